"""Every Lightning private lightning_zero reads (lightning_zero/lightning_compat.py), exercised under the
Lightning installed in this interpreter: ``python tests/lightning_compat_job.py`` prints ``ok <version>``.

tests/test_lightning_compat.py runs it under the installed Lightning and under each other supported
minor version (a virtual environment over this one, with only Lightning replaced)."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning  # noqa: E402
import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
from lightning.pytorch.callbacks import BackboneFinetuning, ModelSummary  # noqa: E402
from lightning.pytorch.plugins.environments import LightningEnvironment  # noqa: E402
from parity_zoo import GAN, point_data  # noqa: E402

import lightning_zero  # noqa: E402
from lightning_zero import ZeroStrategy, lightning_compat  # noqa: E402


class Checks(pl.Callback):
    def on_train_start(self, trainer, pl_module):
        wrappers = lightning_compat.lightning_optimizers(trainer.strategy)
        assert [w.optimizer for w in wrappers] == trainer.optimizers, "wrappers are not self.optimizers()'s"
        assert wrappers == list(pl_module.optimizers()), "self.optimizers() returns other wrappers"
        for w in pl_module.optimizers():  # routed: their zero_grad clears the engine's gradients
            assert w.zero_grad.__func__ is not torch.optim.Optimizer.zero_grad, "a wrapper's zero_grad is torch's"
        self.ran = True


def main() -> None:
    assert lightning_zero
    # the private attributes and functions the compat module names exist and behave
    finetuning = BackboneFinetuning()
    assert lightning_compat.is_restarting(finetuning) is False
    assert lightning_compat.summary_depth(ModelSummary(max_depth=3)) == 3
    assert callable(ModelSummary()._summary)  # what install_summary wraps
    assert lightning_compat.default_backend_for(torch.device("cpu")) == "gloo"
    module = pl.LightningModule()
    lightning_compat.record_module_device(module, torch.device("meta"))
    assert module.device == torch.device("meta")
    strategy = ZeroStrategy(stage=2)
    lightning_compat.set_launcher(strategy, "launcher")
    assert strategy.launcher == "launcher"
    env = LightningEnvironment()
    lightning_compat.init_process_group(env, "gloo")  # one rank: starts a real group
    assert torch.distributed.is_initialized()
    lightning_compat.destroy_process_group()
    assert not torch.distributed.is_initialized()
    # and end to end: manual optimization through the wrappers the compat module finds (their zero_grad
    # must reach the engine: the GAN trains as under DDP only then, see tests/test_parity_matrix.py)
    pl.seed_everything(0, verbose=False)
    checks = Checks()
    module = GAN(accumulate=1, clip=False)
    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=ZeroStrategy(stage=2), max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[checks])
    trainer.fit(module, point_data())
    assert checks.ran and trainer.global_step > 0
    print("ok", lightning.__version__)


if __name__ == "__main__":
    main()
