"""GPU checks (NCCL, CUDA streams, inference_mode evaluation): skipped without CUDA.

Run on the GPU machine: ``python -m pytest tests/test_gpu.py``. Deterministic kernels are
switched on so that the reference and the ZeRO run differ only by what ZeRO changes.
"""

from __future__ import annotations

import math
import os

os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")

import pytest  # noqa: E402
import torch  # noqa: E402
from lightning_cases import fit_case  # noqa: E402
from parity import assert_16bit_close, assert_parity  # noqa: E402

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

LM = dict(accumulate=2, clip_val=0.5, accelerator="gpu")
BLOCK = dict(wrap_modules=("Block",))


@pytest.fixture(autouse=True)
def deterministic():
    torch.use_deterministic_algorithms(True)
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    yield
    torch.use_deterministic_algorithms(False)


@pytest.mark.parametrize("strategy,model,options", [("zero1", "lm", {}), ("zero2", "lm", {}),
                                                    ("zero3", "blocks", BLOCK)])
def test_nccl_fp32_matches_single_device(strategy, model, options):
    # the reference is DDP on one GPU: like ZeRO it is "distributed" to Lightning (same sampler, same order)
    reference = fit_case(0, 1, model, "ddp", **LM)
    run = fit_case(0, 1, model, strategy, options=options, **LM)
    assert_parity(run, reference, tol=1e-5)
    # validate/predict after fit ran under Lightning's inference_mode on NCCL
    assert abs(run["val"]["val_loss"] - reference["val"]["val_loss"]) < 1e-5
    assert run["dtype"] == "torch.float32"


@pytest.mark.parametrize("strategy,options", [("zero2", {}), ("zero3", BLOCK)])
def test_nccl_bf16_close_to_autocast(strategy, options):
    ref32 = fit_case(0, 1, "blocks", "ddp", **LM)
    ref = fit_case(0, 1, "blocks", "ddp", precision="bf16-mixed", **LM)
    run = fit_case(0, 1, "blocks", strategy, precision="bf16-mixed", options=options, **LM)
    assert_16bit_close(run, ref, ref32)  # see parity.SIXTEEN_BIT_FACTOR


def test_fp16_loss_scaling_on_gpu_close_to_ddp():
    # Lightning's fp16 (autocast + GradScaler) on DDP as the reference: values, not only finiteness
    ref = fit_case(0, 1, "blocks", "ddp", precision="16-mixed", **LM)
    # GradScaler halves the scale at every overflow; our default (DeepSpeed's) hysteresis of 2 absorbs the
    # first one, which skips one more step than DDP at the start: match GradScaler here
    run = fit_case(0, 1, "blocks", "zero3", precision="16-mixed", options=dict(BLOCK, hysteresis=1), **LM)
    assert run["global_step"] == ref["global_step"] > 0
    assert_16bit_close(run, ref, fit_case(0, 1, "blocks", "ddp", **LM))


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_sharded_checkpoint_resumes_fused_adamw_on_gpu(tmp_path, strategy):
    # pieces on the GPU are written and read through DCP; fused AdamW needs its step counters on the device
    from checkpoint_cases import fit_steps
    from parity import state_err

    gpu = dict(accelerator="gpu", fused=True)
    ref = fit_steps(1, strategy, 6, **gpu)
    fit_steps(1, strategy, 3, save_to=str(tmp_path / "a.ckpt"), **gpu)
    resumed = fit_steps(1, strategy, 6, ckpt_in=str(tmp_path / "a.ckpt"), **gpu)
    assert resumed["seen_steps"] == [3, 4, 5]
    assert state_err(resumed["final"], ref["final"]) <= 1e-5


@pytest.mark.parametrize("stage", [2, 3])
def test_teardown_never_holds_the_fp32_model_on_the_gpu(stage):
    # bf16-mixed: stage 2 gathers the fp32 masters unit by unit into host memory, stage 3 gathers nothing
    import lightning.pytorch as pl
    from lightning.pytorch.callbacks import Callback
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    from lightning_zero import ZeroStrategy

    class Net(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layers = nn.Sequential(*[nn.Linear(512, 512) for _ in range(8)])

        def training_step(self, batch, batch_idx):
            return self.layers(batch[0]).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-3)

    class AtEnd(Callback):
        def on_train_end(self, trainer, pl_module):
            torch.cuda.synchronize()
            self.allocated = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()

    probe, module = AtEnd(), Net()
    fp32_model = 4 * sum(p.numel() for p in module.parameters())
    trainer = pl.Trainer(accelerator="gpu", devices=1, precision="bf16-mixed", max_steps=2, logger=False,
                         strategy=ZeroStrategy(stage=stage, reduce_bucket_size=300_000, min_group_params=300_000),
                         enable_checkpointing=False, enable_progress_bar=False, callbacks=[probe])
    trainer.fit(module, DataLoader(TensorDataset(torch.randn(8, 512)), batch_size=2))
    torch.cuda.synchronize()
    teardown_growth = torch.cuda.max_memory_allocated() - probe.allocated
    assert teardown_growth < 0.5 * fp32_model, (teardown_growth, fp32_model)
    if stage == 2:
        assert all(p.device.type == "cpu" and p.dtype == torch.float32 for p in module.parameters())


def test_engine_api_under_torchrun_on_the_gpu(tmp_path):
    # lightning_zero.initialize on NCCL (torchrun, one GPU): every stage and the pinned offloads match DDP
    import subprocess
    import sys
    from pathlib import Path

    from dist_utils import job_env
    from test_engine_api import STAGES

    tests = Path(__file__).parent
    out = tmp_path / "engine.pt"
    run = subprocess.run([sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "1",
                          str(tests / "engine_gpu_job.py"), str(out)], env=job_env(PYTHONPATH=os.pathsep.join(
                             [str(tests), str(tests.parent), os.environ.get("PYTHONPATH", "")])),
                         capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, (run.stdout + run.stderr)[-4000:]
    results = torch.load(out, weights_only=False)
    for name in STAGES:
        assert results[name]["steps"] == 8
        assert_parity(results[name], results["ddp"], tol=1e-5)


@pytest.mark.parametrize("checkpointing", [(), ("Block",)])
def test_activation_probe_predicts_the_peak_of_the_full_depth(checkpointing):
    # depth 2 and 3 measured, depth 8 extrapolated: within 10% of depth 8's real forward/backward peak
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from lightning_zero.demo.gpt import GPT
    from lightning_zero.probe import _peak, next_token_step, probe_activations

    torch.use_deterministic_algorithms(False)  # fused attention's backward
    device = torch.device("cuda")
    step = next_token_step(torch.randint(0, 8192, (8, 1025), device=device))

    def build(depth):
        torch.manual_seed(0)
        return GPT(8192, 1024, depth, 8, 512)

    probe = probe_activations(build, 8, step, device, torch.bfloat16, checkpointing)
    measured, _ = _peak(build(8), step, device, torch.bfloat16, checkpointing)
    assert abs(probe.total - measured) <= 0.1 * measured, (probe, measured)


def _wide():
    """An MLP LightningModule with 18.9M parameters (the zero_auto checks below)."""
    import lightning.pytorch as pl
    from torch import nn

    class Wide(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.net = nn.Sequential(nn.Linear(512, 4096), nn.GELU(), nn.Linear(4096, 4096), nn.GELU(),
                                     nn.Linear(4096, 1))

        def training_step(self, batch, batch_idx):
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-4)

    return Wide()


def test_zero_auto_measures_the_activations_of_its_first_step():
    """The allocator peak of the first step under zero_auto is this module's activation memory: close to
    the peak of the same forward and backward in plain PyTorch above its parameters and gradients."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero

    data = torch.randn(8 * 1024, 512)
    torch.manual_seed(0)
    plain = _wide().cuda()
    x = data[:1024].cuda()
    plain.net(x).pow(2).mean().backward()  # gradients exist, as they do at the engine's step start
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    plain.net(x).pow(2).mean().backward()
    torch.cuda.synchronize()
    reference = torch.cuda.max_memory_allocated() - base
    del plain, x
    torch.cuda.empty_cache()
    assert lightning_zero
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="zero_auto", max_steps=2, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(_wide(), DataLoader(TensorDataset(data), batch_size=1024))
    measured = trainer.strategy._auto.replanner.measured
    assert measured is not None and 0.5 * reference <= measured <= 2 * reference, (measured, reference)


def test_zero_auto_gives_the_gpu_memory_of_its_first_placement_back_before_the_next(monkeypatch):
    """A move of zero_auto builds the new placement while Lightning still holds the first batch's loss and
    optimizer: the first placement's masters and gradients must be gone from the GPU by then (a 2.7B model
    under a 24 GiB cap ran out of memory beside them). Measured with the allocator, the cycle collector off."""
    import gc

    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    import lightning_zero
    from lightning_zero import planner

    def first_on_the_gpu_then_offload(*args, measured=None, **kwargs):
        offload = {} if measured is None else {"offload_optimizer": "cpu"}
        return [lightning_zero.ZeroConfig(stage=2, **offload).to_dict(), "test"]

    monkeypatch.setattr(planner, "plan_for_run", first_on_the_gpu_then_offload)
    monkeypatch.setattr(planner, "fits_measured", lambda *args, **kwargs: False)
    seen = {}

    class Watch(pl.Callback):
        def on_train_start(self, trainer, pl_module):
            seen["start"] = torch.cuda.memory_allocated()

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            seen.setdefault("losses", []).append(float(outputs["loss"]))

    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy="zero_auto", max_steps=3, logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                         callbacks=[Watch()])
    strategy = trainer.strategy
    rebuild = strategy.model_to_device

    def measured_rebuild():  # also called at setup, before the first engine exists: the last call counts
        torch.cuda.synchronize()
        # the first forward and backward made cuBLAS allocate its workspaces (32 MiB each per handle and stream
        # under CUBLAS_WORKSPACE_CONFIG=:4096:8) in the caching allocator: they are not the placement's
        torch._C._cuda_clearCublasWorkspaces()
        seen["rebuild"] = torch.cuda.memory_allocated()
        rebuild()

    strategy.model_to_device = measured_rebuild
    gc.disable()
    try:
        with pytest.warns(UserWarning, match="moved from zero2 to zero2 offload"):
            trainer.fit(_wide(), DataLoader(TensorDataset(torch.randn(1024, 512)), batch_size=256))
    finally:
        gc.enable()
    params = sum(p.numel() for p in _wide().parameters())
    assert seen["start"] >= 4 * params  # at least the fp32 parameters (the masters) of the first placement
    assert seen["rebuild"] < 0.1 * seen["start"], seen  # what is left: the batch and the loss
    assert len(seen["losses"]) == 3 and all(math.isfinite(v) for v in seen["losses"])


@pytest.mark.parametrize("stage,offload", [(2, "none"), (3, "none"), (2, "cpu")])
def test_weight_clipping_reaches_the_masters_on_the_gpu(stage, offload):
    """bf16-mixed on CUDA: the clamp of the published 16-bit values is taken into the fp32 masters (on the device;
    an offloaded master at the end of fit); the trained weights stay within the bound."""
    import lightning.pytorch as pl
    from torch import nn
    from torch.utils.data import DataLoader

    import lightning_zero

    class Critic(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.a, self.b = nn.Linear(8, 64), nn.Linear(64, 1)

        def training_step(self, batch, batch_idx):
            return self.b(torch.tanh(self.a(batch[0]))).pow(2).mean()

        def on_train_batch_end(self, outputs, batch, batch_idx):
            for p in self.parameters():
                p.data.clamp_(-0.05, 0.05)

        def configure_optimizers(self):
            return torch.optim.Adam(self.parameters(), lr=0.1)

    torch.manual_seed(0)
    strategy = lightning_zero.ZeroStrategy(stage=stage, offload_optimizer=offload)
    trainer = pl.Trainer(accelerator="gpu", devices=1, strategy=strategy, precision="bf16-mixed", max_steps=4,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    trainer.fit(Critic(), DataLoader([(torch.randn(8),) for _ in range(16)], batch_size=4))
    bound = torch.tensor(0.05, dtype=torch.bfloat16).item()  # the 16-bit value the clamp writes
    assert max(v.abs().max().item() for v in trainer.strategy.full_state_dict().values()) <= bound


def _fit_three_steps(module, width: int, **trainer_options):
    """Three steps of batch 8 on the GPU over fixed random inputs of ``width`` features; returns the trainer."""
    import lightning.pytorch as pl
    from torch.utils.data import DataLoader, TensorDataset

    trainer = pl.Trainer(accelerator="gpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, **trainer_options)
    inputs = torch.randn(24, width, generator=torch.Generator().manual_seed(1))
    trainer.fit(module, DataLoader(TensorDataset(inputs), batch_size=8))
    return trainer


@pytest.mark.parametrize("stage", [2, 3])
def test_sync_batchnorm_converts_the_layers_and_trains_as_ddp(stage):
    """Trainer(sync_batchnorm=True) converts BatchNorm to SyncBatchNorm, as DDPStrategy's setup (it was ignored)."""
    import lightning.pytorch as pl
    from torch import nn

    from lightning_zero import ZeroStrategy

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.net = nn.Sequential(nn.Linear(4, 8), nn.BatchNorm1d(8), nn.Linear(8, 1))
            self.types: set = set()

        def training_step(self, batch, batch_idx):
            self.types = {type(m).__name__ for m in self.net.modules()}
            return self.net(batch[0]).pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    out = {}
    for name, strategy in (("ddp", "ddp"), ("zero", ZeroStrategy(stage=stage))):
        pl.seed_everything(0, verbose=False)
        module = Net()
        trainer = _fit_three_steps(module, 4, strategy=strategy, sync_batchnorm=True)
        state = trainer.strategy.full_state_dict() if name == "zero" else module.state_dict()
        out[name] = (module.types, {k: v.detach().float().cpu() for k, v in state.items()})
    assert "SyncBatchNorm" in out["zero"][0] and "BatchNorm1d" not in out["zero"][0]
    for key, value in out["ddp"][1].items():
        torch.testing.assert_close(out["zero"][1][key], value, rtol=1e-5, atol=1e-6, msg=key)


@pytest.mark.parametrize("precision", ["32-true", "bf16-mixed"])
def test_module_after_a_stage3_fit_runs_on_the_cpu_as_ddps(precision):
    """Lightning's teardown moves the module to the CPU: under DDP a forward with CPU inputs then runs there.
    Under stage 3 the module stays sharded on the GPU: its gathers are shown on the CPU (a forward after fit with CPU
    inputs met GPU parameters), a user's `module.cuda()` brings them back, and GatheredParameters follows too."""
    import lightning.pytorch as pl
    from torch import nn

    from lightning_zero import ZeroStrategy
    from lightning_zero.zero import GatheredParameters

    class Net(pl.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.Sequential(*[nn.Sequential(nn.Linear(64, 64), nn.Tanh()) for _ in range(3)])
            self.head = nn.Linear(64, 1)

        def forward(self, x):
            return self.head(self.blocks(x))

        def training_step(self, batch, batch_idx):
            return self(batch[0]).float().pow(2).mean()

        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=1e-2)

    x = torch.randn(5, 64, generator=torch.Generator().manual_seed(3))
    out = {}
    for name, strategy in (("ddp", "ddp"), ("zero3", ZeroStrategy(stage=3, wrap_modules=("Sequential",),
                                                                  param_persistence_threshold=0))):
        pl.seed_everything(0, verbose=False)
        module = Net()
        trainer = _fit_three_steps(module, 64, strategy=strategy, precision=precision)
        assert {p.device.type for p in module.parameters()} == {"cpu"}, name
        with torch.no_grad():
            on_cpu = module(x)
            assert {p.device.type for p in module.parameters()} == {"cpu"}, name  # still there after the forward
            again = module(x)
        module.cuda()
        with torch.no_grad():
            on_gpu = module(x.cuda()).cpu()
        module.cpu()
        with GatheredParameters(list(module.head.parameters())):
            head = [p.detach().clone() for p in module.head.parameters()]
        state = trainer.strategy.full_state_dict() if name == "zero3" else module.state_dict()
        plain = Net()
        plain.load_state_dict({k: v.detach().float().cpu() for k, v in state.items()})
        with torch.no_grad():
            expected = plain(x)
        for got in (on_cpu, again, on_gpu):  # the trained weights' own forward, wherever the module was moved
            assert got.device.type == "cpu"
            torch.testing.assert_close(got.float(), expected, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(head, [p.detach() for p in plain.head.parameters()], rtol=0, atol=0)
        out[name] = on_cpu
    if precision == "32-true":  # the same training as DDP's (bf16-mixed computes differently by design)
        torch.testing.assert_close(out["zero3"], out["ddp"], rtol=1e-5, atol=1e-6)
