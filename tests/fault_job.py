"""A training job that loses a rank, started by torchrun (see test_fault_recovery.py).

    python -m torch.distributed.run --nproc-per-node 2 --max-restarts 1 ... tests/fault_job.py \
        OUT_DIR STRATEGY {none|step|save}

Trains StepLM (its batch is a function of the global step, so a resumed run sees the same data)
to TOTAL steps with ``ModelCheckpoint(save_last=True, every 2 steps)`` and always calls
``fit(ckpt_path="last")``. In the first attempt rank 1 kills itself (SIGKILL, no cleanup):
``step`` between two checkpoints, ``save`` in the middle of writing its part of a checkpoint.
torchrun then restarts both ranks, which resume from the last complete checkpoint. Rank 0
records what the checkpoint directory held when each attempt started and, at the end, the
trained weights.
"""

from __future__ import annotations

import os
import signal
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))

import lightning.pytorch as pl  # noqa: E402
import torch  # noqa: E402
import torch.distributed.checkpoint as dcp  # noqa: E402
from checkpoint_cases import StepLM, dummy_loader, make_strategy  # noqa: E402
from lightning.pytorch.callbacks import Callback, ModelCheckpoint  # noqa: E402

TOTAL, KILL_AT = 9, 5  # checkpoints after steps 2, 4, 6, 8: step 5 lies between two of them; step 6's is cut


def _die() -> None:
    os.kill(os.getpid(), signal.SIGKILL)


class _KillBetweenCheckpoints(Callback):
    def on_train_batch_end(self, trainer, *args):
        if trainer.global_step == KILL_AT and trainer.global_rank == 1:
            _die()


def _kill_inside_save() -> None:
    """Rank 1 dies after writing part of its file for the checkpoint of step KILL_AT + 1."""
    original = dcp.FileSystemWriter.write_data

    def write_data(self, plan, planner):
        if "step=6" in str(self.path):
            Path(self.path, "__1_0.distcp").write_bytes(b"part of a file")
            _die()
        return original(self, plan, planner)

    dcp.FileSystemWriter.write_data = write_data


def main(out_dir: str, strategy: str, kill: str) -> None:
    out = Path(out_dir)
    attempt = int(os.environ.get("TORCHELASTIC_RESTART_COUNT", "0"))
    rank = int(os.environ["RANK"])
    ckpt_dir = out / "checkpoints"
    if rank == 0:
        seen = sorted(p.name for p in ckpt_dir.iterdir()) if ckpt_dir.exists() else []
        torch.save(seen, out / f"attempt{attempt}_saw.pt")
    callbacks: list[Callback] = [ModelCheckpoint(dirpath=ckpt_dir, save_last=True, every_n_train_steps=2,
                                                 save_top_k=-1)]
    if attempt == 0 and kill == "step":
        callbacks.append(_KillBetweenCheckpoints())
    if attempt == 0 and kill == "save" and rank == 1:
        _kill_inside_save()
    pl.seed_everything(0, verbose=False)
    module = StepLM()
    trainer = pl.Trainer(accelerator="cpu", devices=2, strategy=make_strategy(strategy), max_steps=TOTAL,
                         logger=False, callbacks=callbacks, enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False,
                         default_root_dir=out)
    trainer.fit(module, dummy_loader(), ckpt_path="last")
    state = trainer.strategy.full_state_dict() if hasattr(trainer.strategy, "full_state_dict") else module.state_dict()
    if rank == 0:
        torch.save({"state": state, "global_step": trainer.global_step, "attempt": attempt,
                    "seen_steps": module.seen_steps}, out / "final.pt")


if __name__ == "__main__":
    main(*sys.argv[1:4])
