"""Cases for tests/test_dtensor_checkpoints.py: the sharded state as DTensors, and checkpoints that move
between ZeroStrategy and Lightning's ModelParallelStrategy (FSDP2's ``fully_shard``).

Every run trains checkpoint_cases.StepLM, whose batch is a function of the global step alone (see
[Note: why the batch is a function of the global step]): one uninterrupted ZeRO run is the reference
for every resume, whichever strategy and world size wrote or read the checkpoint.
"""

from __future__ import annotations

import warnings

import lightning.pytorch as pl
from checkpoint_cases import FIRST, TOTAL, StepLM, dummy_loader, fit_steps
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.strategies import ModelParallelStrategy

import lightning_zero
from lightning_zero import ZeroStrategy


class FSDPStepLM(StepLM):
    """StepLM under FSDP2: the whole module one ``fully_shard`` group (its tied embedding/head stay one)."""

    def configure_model(self):
        from torch.distributed.fsdp import fully_shard

        fully_shard(self, mesh=self.device_mesh["data_parallel"])

    def on_train_batch_end(self, outputs, batch, batch_idx):
        pass  # StepLM's trace reads ZeroStrategy's gathered state


class _FullStateAtEnd(Callback):
    def __init__(self, save_to: str | None) -> None:
        self.save_to = save_to

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_model_state_dict

        state = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True, cpu_offload=True))
        self.state = {k: v.detach().float().clone() for k, v in state.items()}
        if self.save_to is not None:
            trainer.save_checkpoint(self.save_to)


def fsdp_fit_steps(world: int, steps: int, ckpt_in: str | None = None, save_to: str | None = None,
                   accelerator: str = "cpu") -> dict:
    """fit_steps' FSDP2 twin: StepLM under ModelParallelStrategy on ``world`` ranks."""
    pl.seed_everything(0, verbose=False)
    module = FSDPStepLM()
    end = _FullStateAtEnd(save_to)
    trainer = pl.Trainer(accelerator=accelerator, devices=world, strategy=ModelParallelStrategy(data_parallel_size=world,
                                                                                         tensor_parallel_size=1),
                         precision="32-true", max_steps=steps, logger=False, enable_checkpointing=False,
                         callbacks=[end], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(module, dummy_loader(), ckpt_path=ckpt_in)
    sched = trainer.lr_scheduler_configs[0].scheduler
    return {"state": end.state, "global_step": trainer.global_step, "sched": sched.state_dict(),
            "lrs": [g["lr"] for g in trainer.optimizers[0].param_groups], "losses": list(module.losses),
            "seen_steps": list(module.seen_steps), "final": {}}


# ---- the returned DTensors -------------------------------------------------------------------------------
class _InspectState(Callback):
    """At on_train_end (every rank): the DTensors both functions return against the gathered full state;
    in on_save_checkpoint, rank 0 alone uses the checkpoint's DTensors (local ops only: must not hang)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.seen: dict = {}

    def on_save_checkpoint(self, trainer, pl_module, checkpoint):
        if trainer.is_global_zero:
            weight = checkpoint["state_dict"]["fc1.weight"]
            moment = checkpoint["optimizer_states"][0]["state"]["fc1.weight"]["exp_avg"]
            self.seen["one_rank"] = {"type": type(weight).__name__, "local_sum": float((weight * 2).to_local().sum()),
                                     "norm": float(weight.norm()), "placements": str(weight.placements),
                                     "moment_type": type(moment).__name__, "moment_shape": tuple(moment.shape)}

    def on_train_end(self, trainer, pl_module):
        from torch.distributed.tensor import DTensor, Replicate, Shard

        from lightning_zero.checkpoint.dtensors import model_state_is_local

        strategy = trainer.strategy
        full = strategy.full_state_dict(rank0_only=False)
        full_opt = strategy.full_optimizer_state_dict(trainer.optimizers[0], rank0_only=False)
        sd = strategy.lightning_module_state_dict()
        opt = strategy.optimizer_state(trainer.optimizers[0])
        out = {"types": {}, "errors": {}, "local": {}}
        for name, value in sd.items():
            out["types"][name] = type(value).__name__
            if isinstance(value, DTensor):
                # every rank holds the values whole (stages 1/2 in fp32, stage-3 units kept gathered): Replicate;
                # else row chunks
                whole = model_state_is_local(strategy.engine)
                out["whole"] = whole
                assert value.placements == ((Replicate(),) if whole else (Shard(0),)), (name, value.placements)
                assert value.shape == full[name].shape, name
                out["errors"][name] = float((value.full_tensor() - full[name]).abs().max())
                out["local"][name] = tuple(value.to_local().shape)
                doubled = (value * 2 + 1).full_tensor()  # elementwise math stays sharded, then gathers
                out["errors"][name + "*2+1"] = float((doubled - (full[name] * 2 + 1)).abs().max())
        out["tied_same_object"] = sd["emb.weight"] is sd["head.weight"]
        out["true_norm"] = float(full["fc1.weight"].norm())
        names = full_opt["lightning_zero"]["param_names"]
        out["opt_errors"] = {}
        for position, entry in full_opt["state"].items():
            for key in ("exp_avg", "exp_avg_sq"):
                got = opt["state"][names[position]][key]
                out["opt_errors"][f"{names[position]}.{key}"] = float((got.full_tensor() - entry[key]).abs().max())
            out["opt_errors"][f"{names[position]}.step"] = float(opt["state"][names[position]]["step"] - entry["step"])
        out["group_params"] = [g["params"] for g in opt["param_groups"]]
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            trainer.save_checkpoint(self.path)
        out["save_warnings"] = [f"{w.category.__name__}: {w.message} ({w.filename})" for w in caught
                                if issubclass(w.category, (FutureWarning, DeprecationWarning))]
        out["one_rank"] = self.seen.get("one_rank")
        self.out = out


def dtensor_case(rank: int, world: int, d: str, stage: str, accelerator: str = "cpu", nodes: int = 1) -> dict:
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    module = StepLM()
    inspect = _InspectState(f"{d}/{stage}_inspect.ckpt")
    trainer = pl.Trainer(accelerator=accelerator, devices=world // nodes, num_nodes=nodes,
                         strategy=ZeroStrategy(stage=int(stage[-1]),
                                               process_group_backend="gloo" if nodes > 1 else None,
                                               param_persistence_threshold=0),  # stage 3: every unit sharded
                         precision="32-true", max_steps=3, logger=False, enable_checkpointing=False,
                         callbacks=[inspect], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(module, dummy_loader())
    inspect.out["sharded_view_warned"] = any("_InspectState.on_save_checkpoint" in str(w.message)
                                             and ".full_tensor()" in str(w.message) for w in caught)
    return inspect.out


# ---- round trips ------------------------------------------------------------------------------------------
def writers(rank: int, world: int, d: str) -> dict:
    """On 2 ranks: ZeRO stages 1-3 and FSDP2 each train FIRST steps and save; the uninterrupted reference."""
    out = {"ref": fit_steps(world, "zero2", TOTAL)}
    for stage in ("zero1", "zero2", "zero3"):
        fit_steps(world, stage, FIRST, save_to=f"{d}/{stage}.ckpt")
    out["fsdp_ref"] = fsdp_fit_steps(world, TOTAL)
    fsdp_fit_steps(world, FIRST, save_to=f"{d}/fsdp.ckpt")
    out["zero2_from_fsdp"] = fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/fsdp.ckpt")
    return out


def readers_one(rank: int, world: int, d: str) -> dict:
    return {"fsdp_from_zero1": fsdp_fit_steps(world, TOTAL, ckpt_in=f"{d}/zero1.ckpt"),
            "fsdp_from_zero2": fsdp_fit_steps(world, TOTAL, ckpt_in=f"{d}/zero2.ckpt"),
            "zero1_from_fsdp": fit_steps(world, "zero1", TOTAL, ckpt_in=f"{d}/fsdp.ckpt"),
            "zero3_from_fsdp": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/fsdp.ckpt")}


def readers_four(rank: int, world: int, d: str) -> dict:
    return {"fsdp_from_zero3": fsdp_fit_steps(world, TOTAL, ckpt_in=f"{d}/zero3.ckpt"),
            "zero2_from_fsdp": fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/fsdp.ckpt"),
            "zero3_from_fsdp": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/fsdp.ckpt")}


def old_format(rank: int, world: int, d: str) -> dict:
    """The committed v1 directories (2 ranks wrote them) resumed under other stages and world sizes."""
    return {"zero1_from_v1_zero2": fit_steps(world, "zero1", TOTAL, ckpt_in=f"{d}/zero2.ckpt"),
            "zero3_from_v1_zero3": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/zero3.ckpt")}


# ---- torch.distributed.checkpoint.state_dict on a module the strategy trains ------------------------------
class _StateDictApi(Callback):
    def on_train_end(self, trainer, pl_module):
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            get_model_state_dict,
            get_optimizer_state_dict,
            set_model_state_dict,
        )

        strategy = trainer.strategy
        full = strategy.full_state_dict(rank0_only=False)
        got = get_model_state_dict(pl_module, options=StateDictOptions(full_state_dict=True))
        out = {"get_dtype": str(got["fc1.weight"].dtype),
               "get_err": max(float((got[k].float() - full[k]).abs().max()) for k in full)}
        shifted = {k: v + 1 for k, v in full.items()}
        set_model_state_dict(pl_module, shifted, options=StateDictOptions(full_state_dict=True))
        after = strategy.full_state_dict(rank0_only=False)
        out["set_err"] = max(float((after[k] - shifted[k]).abs().max()) for k in full)
        sharded = strategy.lightning_module_state_dict()  # DTensors: every rank loads them
        pl_module.load_state_dict({k: v * 0 - 2 for k, v in sharded.items()})
        after = strategy.full_state_dict(rank0_only=False)
        out["dtensor_load_err"] = max(float((after[k] + 2).abs().max()) for k in full)
        try:
            get_optimizer_state_dict(pl_module, trainer.optimizers[0])
            out["optimizer"] = "returned"
        except Exception as err:  # noqa: BLE001 - the test reads the message
            out["optimizer"] = f"{type(err).__name__}: {err}"
        self.out = out


def state_dict_api_case(rank: int, world: int, stage: str, precision: str) -> dict:
    assert lightning_zero
    pl.seed_everything(0, verbose=False)
    probe = _StateDictApi()
    trainer = pl.Trainer(accelerator="cpu", devices=world, strategy=ZeroStrategy(stage=int(stage[-1])),
                         precision=precision, max_steps=2, logger=False, enable_checkpointing=False,
                         callbacks=[probe], enable_progress_bar=False, enable_model_summary=False,
                         num_sanity_val_steps=0, limit_val_batches=0, use_distributed_sampler=False)
    trainer.fit(StepLM(), dummy_loader())
    return probe.out


# ---- the same on the GPU (tests/test_gpu_dtensor.py) -------------------------------------------------------
def gpu_zero_writers(rank: int, world: int, d: str) -> dict:
    """Two ranks on the one GPU (gloo): ZeRO stages 2 and 3 save; the reference; FSDP2's checkpoint resumed."""
    out = {"ref": fit_steps(world, "zero2", TOTAL, accelerator="gpu", nodes=world)}
    for stage in ("zero2", "zero3"):
        fit_steps(world, stage, FIRST, save_to=f"{d}/{stage}.ckpt", accelerator="gpu", nodes=world)
    return out


def gpu_zero_readers(rank: int, world: int, d: str) -> dict:
    return {"zero3_from_fsdp": fit_steps(world, "zero3", TOTAL, ckpt_in=f"{d}/fsdp.ckpt", accelerator="gpu",
                                         nodes=world),
            "zero2_from_fsdp": fit_steps(world, "zero2", TOTAL, ckpt_in=f"{d}/fsdp.ckpt", accelerator="gpu",
                                         nodes=world)}


def gpu_fsdp(rank: int, world: int, d: str) -> dict:
    """One rank, NCCL: FSDP2 resumes ZeRO's checkpoints, then writes its own."""
    out = {"fsdp_from_zero2": fsdp_fit_steps(world, TOTAL, ckpt_in=f"{d}/zero2.ckpt", accelerator="gpu"),
           "fsdp_from_zero3": fsdp_fit_steps(world, TOTAL, ckpt_in=f"{d}/zero3.ckpt", accelerator="gpu")}
    fsdp_fit_steps(world, FIRST, save_to=f"{d}/fsdp.ckpt", accelerator="gpu")
    return out
