"""Read the checkpoint directories DeepSpeed writes (its engine, or Lightning's ``DeepSpeedStrategy``), without
DeepSpeed installed: weights always, Adam-style optimizer state, the LR schedule and the counters.

[Note: DeepSpeed's layouts]
A tag directory holds one ``*model_states.pt`` (stage 3: one per rank) and one ``*_optim_states.pt`` per rank.
The model file names every trainable parameter in ``param_shapes`` (one ordered dict per flat group; stage 3:
per sub-group), frozen ones in ``frozen_param_shapes``, tied ones in ``shared_params``, buffers in ``module``.
The fp32 master values live in the optimizer files:

- stages 1/2: per param group, each rank's slice of one flat vector (``single_partition_of_fp32_groups``,
  saved without the end padding); the group's parameters lie back to back in the ranks' slices concatenated.
  The moments (``base_optimizer_state``) are the same slices, still padded by ``group_paddings``.
- stage 3: every parameter is split on its own: each rank holds ``ceil(numel / world)`` elements of it at a
  running offset in its ``fp32_flat_groups`` (sub-groups concatenated); the moments are laid out alike.

The pickles name DeepSpeed classes (its stage enum, its loss scaler): :class:`_Unpickler` stands them up as
plain records, so nothing of DeepSpeed is imported. Tensor/pipeline-parallel checkpoints (``mp_world_size`` > 1)
are refused with the way out (DeepSpeed's universal checkpoint or ``zero_to_fp32`` first).
"""

from __future__ import annotations

import math
import pickle
import re
import types
import warnings
from collections.abc import Iterable
from functools import cached_property
from pathlib import Path
from typing import Any, Optional

import torch

from ..engine.state import FORMAT as FULL_FORMAT
from .files import CheckpointPathError

__all__ = ["DeepSpeedCheckpoint", "find_tag_dir", "is_deepspeed_checkpoint", "lightning_checkpoint", "load_scheduler",
           "align_names"]

_LIGHTNING_PREFIX = "_forward_module."  # Lightning's DeepSpeedStrategy wraps the LightningModule under this name
_ENGINE_KEYS = {"module", "buffer_names", "optimizer", "param_shapes", "frozen_param_shapes", "shared_params",
                "frozen_param_fragments", "lr_scheduler", "data_sampler", "random_ltd", "sparse_tensor_module_names",
                "skipped_steps", "global_steps", "global_samples", "dp_world_size", "mp_world_size",
                "checkpoint_parallel_dimensions", "ds_config", "ds_version"}


# ---- finding and unpickling -------------------------------------------------------------------------
def _natural(path: Path) -> list:
    return [int(t) if t.isdigit() else t for t in re.split(r"(\d+)", path.name)]


def _files(tag_dir: Path, pattern: str) -> list[Path]:
    return sorted(tag_dir.glob(pattern), key=_natural)


def find_tag_dir(path: Any) -> Optional[Path]:
    """The directory holding DeepSpeed's ``*model_states.pt``: ``path`` itself, the tag its ``latest`` file names,
    or Lightning's ``checkpoint`` tag inside a ``DeepSpeedStrategy`` checkpoint; None when it is none of these."""
    path = Path(path)
    if not path.is_dir():
        return None
    if _files(path, "*model_states.pt"):
        return path
    latest = path / "latest"
    candidates = [path / latest.read_text().strip()] if latest.is_file() else []
    candidates.append(path / "checkpoint")
    return next((c for c in candidates if c.is_dir() and _files(c, "*model_states.pt")), None)


def is_deepspeed_checkpoint(path: Any) -> bool:
    return find_tag_dir(path) is not None


class _Record:
    """Stands in for a DeepSpeed class in a pickle: keeps its constructor arguments and its state."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        self._args = args
        self.__dict__.update(kwargs)

    def __setstate__(self, state: Any) -> None:
        if isinstance(state, dict):
            self.__dict__.update(state)
        else:
            self._state = state

    def __int__(self) -> int:  # ZeroStageEnum(2)
        return int(self._args[0]) if self._args else 0

    def __index__(self) -> int:
        return int(self)


class _Unpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module.split(".")[0] != "deepspeed":
            try:
                return super().find_class(module, name)
            except (ImportError, AttributeError):
                pass
        return type(name, (_Record,), {"__module__": module})


_PICKLE = types.SimpleNamespace(Unpickler=_Unpickler, load=lambda f, **kw: _Unpickler(f, **kw).load(),
                                __name__="lightning_zero_deepspeed_pickle")


def _load(path: Path) -> dict[str, Any]:
    try:
        return torch.load(path, map_location="cpu", pickle_module=_PICKLE, weights_only=False, mmap=True)
    except Exception as e:  # noqa: BLE001 - one line naming the damaged file
        raise CheckpointPathError(f"Cannot read DeepSpeed checkpoint file {path}: {type(e).__name__}: {e}. The file "
                                  f"is damaged or incomplete; use another checkpoint.") from None


# ---- names -----------------------------------------------------------------------------------------
def align_names(names: Iterable[str], keys: Optional[Iterable[str]]) -> dict[str, str]:
    """DeepSpeed name -> the model's key: Lightning's wrapper prefix dropped, then one common prefix added or
    dropped when that makes every name a key (weights saved from ``model`` loaded into ``self.model`` of a
    LightningModule, or the reverse). Names that match nothing keep their name (strict loading reports them)."""
    names = list(names)
    plain = {n: n[len(_LIGHTNING_PREFIX):] if n.startswith(_LIGHTNING_PREFIX) else n for n in names}
    if keys is None or not names:
        return plain
    keys = set(keys)
    values = list(plain.values())
    if all(v in keys for v in values):
        return plain
    first = values[0]
    for key in sorted(keys):
        if key.endswith("." + first):  # add a prefix
            prefix = key[:-len(first)]
            if all(prefix + v in keys for v in values):
                return {n: prefix + v for n, v in plain.items()}
    head = first.split(".")
    for i in range(1, len(head)):  # drop a prefix
        prefix = ".".join(head[:i]) + "."
        if all(v.startswith(prefix) and v[len(prefix):] in keys for v in values):
            return {n: v[len(prefix):] for n, v in plain.items()}
    return plain


# ---- the checkpoint ----------------------------------------------------------------------------------
class DeepSpeedCheckpoint:
    """One tag directory of a DeepSpeed checkpoint (see [Note: DeepSpeed's layouts])."""

    def __init__(self, path: Any) -> None:
        tag_dir = find_tag_dir(path)
        if tag_dir is None:
            raise CheckpointPathError(f"{path} is not a DeepSpeed checkpoint: no *model_states.pt in it, in the tag "
                                      f"its 'latest' file names, or in its 'checkpoint' directory.")
        self.path = tag_dir
        self._model_files = _files(tag_dir, "*model_states.pt")
        self._optim_files = _files(tag_dir, "*_optim_states.pt")
        self.model = _load(self._model_files[0])
        mp = int(self.model.get("mp_world_size", 1) or 1)
        if mp > 1:
            raise CheckpointPathError(f"{tag_dir} was written with tensor/pipeline parallelism (mp_world_size={mp}); "
                                      f"lightning_zero reads data-parallel ZeRO checkpoints only. Convert it with "
                                      f"DeepSpeed's zero_to_fp32.py (or its universal checkpoint) first.")
        self.optim = [_load(f)["optimizer_state_dict"] for f in self._optim_files]
        self.stage = int(self.optim[0].get("zero_stage", 0)) if self.optim else 0
        counts = self.optim[0].get("partition_count", 1) if self.optim else 1
        self.world_size = max(counts) if isinstance(counts, (list, tuple)) else int(counts)
        if self.optim and len(self.optim) != self.world_size:
            raise CheckpointPathError(f"{tag_dir} was written by {self.world_size} ranks but holds "
                                      f"{len(self.optim)} optimizer files: the checkpoint is incomplete.")
        if self.stage == 3 and len(self._model_files) != self.world_size:
            raise CheckpointPathError(f"{tag_dir} (ZeRO stage 3, {self.world_size} ranks) holds "
                                      f"{len(self._model_files)} model files: the checkpoint is incomplete.")
        self.groups = [dict(g) for g in self.model.get("param_shapes") or []]
        self.frozen = dict(self.model.get("frozen_param_shapes") or {})
        self.shared = dict(self.model.get("shared_params") or {})
        self.lr_scheduler = self.model.get("lr_scheduler")
        self.global_steps = int(self.model.get("global_steps", 0) or 0)
        self.global_samples = self.model.get("global_samples")
        self.skipped_steps = int(self.model.get("skipped_steps", 0) or 0)
        self.client_state = {k: v for k, v in self.model.items() if k not in _ENGINE_KEYS}

    # ---- where each parameter's elements are -----------------------------------------------------
    @cached_property
    def _sizes(self) -> dict[str, int]:
        return {n: math.prod(s) for g in self.groups for n, s in g.items()}

    @cached_property
    def _stage3_offsets(self) -> dict[str, int]:
        offsets, at = {}, 0
        for g in self.groups:
            for name, size in ((n, math.prod(s)) for n, s in g.items()):
                offsets[name] = at
                at += math.ceil(size / self.world_size)
        return offsets

    def _per_rank_flats(self, key: Optional[str]) -> list[list[torch.Tensor]]:
        """[rank][group] the flat vectors of the fp32 values (key None) or of one optimizer state key."""
        out = []
        for sd in self.optim:
            if self.stage == 3:
                if key is None:
                    out.append(list(sd["fp32_flat_groups"]))
                else:
                    inner = sd["optimizer_state_dict"]["state"]
                    out.append([inner[i][key] for i in sorted(inner)])
            elif key is None:
                out.append(list(sd["single_partition_of_fp32_groups"]))
            else:
                base = sd["base_optimizer_state"]
                paddings = sd.get("group_paddings") or [0] * len(self.groups)
                if isinstance(base, dict):  # rigid: torch's state dict of the padded flat partitions
                    states = [base["state"][i] for i in sorted(base["state"])]
                    out.append([s[key][:s[key].numel() - pad] for s, pad in zip(states, paddings)])
                else:  # elastic: already without padding
                    out.append([s[key] for s in base])
        return out

    def _assemble(self, key: Optional[str]) -> dict[str, torch.Tensor]:
        """name -> full fp32 tensor of every trainable parameter (key None) or of its ``key`` state."""
        flats = self._per_rank_flats(key)
        shapes = {n: s for g in self.groups for n, s in g.items()}
        out: dict[str, torch.Tensor] = {}
        if self.stage == 3:
            per_rank = [torch.cat([t.reshape(-1) for t in groups]) if groups else torch.zeros(0) for groups in flats]
            offsets = self._stage3_offsets
            for name, shape in shapes.items():
                size = math.prod(shape)
                part = math.ceil(size / self.world_size)
                at = offsets[name]
                pieces = [r[at:at + part] for r in per_rank]
                out[name] = torch.cat(pieces)[:size].view(shape).float().clone()
            return out
        for g, group in enumerate(self.groups):
            flat = torch.cat([ranks[g].reshape(-1) for ranks in flats])
            at = 0
            for name, shape in group.items():
                size = math.prod(shape)
                if at + size > flat.numel():
                    raise CheckpointPathError(f"{self.path}: parameter {name} runs past its group's saved values; "
                                              f"the checkpoint is damaged or of an unknown layout.")
                out[name] = flat[at:at + size].view(shape).float().clone()
                at += size
        return out

    def _frozen_values(self) -> dict[str, torch.Tensor]:
        out = {}
        fragments = [dict(self.model.get("frozen_param_fragments") or {})]
        if self.stage == 3:
            fragments = [dict(_load(f).get("frozen_param_fragments") or {}) for f in self._model_files]
        module = self.model.get("module") or {}
        for name, shape in self.frozen.items():
            size = math.prod(shape)
            if all(name in f for f in fragments):
                value = torch.cat([f[name].reshape(-1) for f in fragments])[:size]
            elif name in module and module[name].numel() == size:
                value = module[name].reshape(-1)
            else:
                raise CheckpointPathError(f"{self.path}: no saved value for frozen parameter {name}.")
            out[name] = value.view(shape).float().clone()
        return out

    # ---- what the readers want ------------------------------------------------------------------
    def weights(self, keys: Optional[Iterable[str]] = None, exclude_frozen: bool = False) -> dict[str, torch.Tensor]:
        """The model's state dict in fp32 (buffers in their own dtype), named as ``keys`` when given."""
        module = self.model.get("module") or {}
        if self.optim:
            state = self._assemble(None)
        else:  # no ZeRO: the module holds the parameters
            state = {k: v.float().clone() for k, v in module.items() if k not in set(self.model.get("buffer_names") or [])}
        if not exclude_frozen:
            state.update(self._frozen_values())
            if self.stage < 3:  # stage 1 records no frozen_param_shapes: its module holds them whole
                buffers, shared = set(self.model.get("buffer_names") or []), set(self.shared)
                state.update({k: v.float().clone() for k, v in module.items() if k not in state
                              and k not in buffers and k not in shared and isinstance(v, torch.Tensor)})
        for name in self.model.get("buffer_names") or []:
            if name in module:
                state[name] = module[name].clone()
        for alias, name in self.shared.items():
            if name in state:
                state[alias] = state[name]
        rename = align_names(state, keys)
        return {rename[k]: v for k, v in state.items()}

    def optimizer_state(self, optimizer: Optional[torch.optim.Optimizer] = None,
                        keys: Optional[Iterable[str]] = None) -> dict[str, Any]:
        """The optimizer state in lightning_zero's full format (torch's, with parameter names), for
        ``engine.state.load_optimizer_state``. Group hyper-parameters are kept where ``optimizer`` has them."""
        if not self.optim:
            saved = self.model.get("optimizer")
            if not saved:
                raise CheckpointPathError(f"{self.path} holds no optimizer state; load it with "
                                          f"load_optimizer_states=False (weights only).")
            return saved
        first = self.optim[0]
        torch_state = first["optimizer_state_dict"] if self.stage == 3 else first["base_optimizer_state"]
        groups_saved = torch_state["param_groups"] if isinstance(torch_state, dict) else [{} for _ in self.groups]
        if self.stage == 3:  # a param group's parameters: those of its sub-groups
            members = [[n for i in g["params"] for n in self.groups[i]] for g in groups_saved]
            inner = torch_state["state"]
            sample = inner[sorted(inner)[0]] if inner else {}
        else:
            members = [list(g) for g in self.groups]
            base = first["base_optimizer_state"]
            sample = (base["state"][sorted(base["state"])[0]] if isinstance(base, dict) and base["state"]
                      else base[0] if isinstance(base, list) and base else {})
        elementwise = [k for k, v in sample.items() if isinstance(v, torch.Tensor) and v.dim() > 0]
        moments = {k: self._assemble(k) for k in elementwise}
        scalars = {k: v for k, v in sample.items() if k not in elementwise}
        if "step" not in scalars:  # FusedAdam keeps the step in the group; elastic checkpoints beside the state
            step = first.get("base_optimizer_state_step", groups_saved[0].get("step") if groups_saved else None)
            if step is not None:
                scalars["step"] = torch.tensor(float(step))
        names = [n for m in members for n in m]
        rename = align_names(names, keys)
        state = {i: {**{k: moments[k][n] for k in elementwise},
                     **{k: v.clone() if isinstance(v, torch.Tensor) else v for k, v in scalars.items()}}
                 for i, n in enumerate(names)}
        target = optimizer.param_groups if optimizer is not None else None
        groups, at = [], 0
        for g, saved in enumerate(groups_saved):
            keep = (set(target[g]) - {"params"}) if target is not None and g < len(target) else set(saved) - {"params"}
            groups.append({**{k: v for k, v in saved.items() if k in keep}, "params": list(range(at, at + len(members[g])))})
            at += len(members[g])
        return {"state": state, "param_groups": groups,
                "lightning_zero": {"format": FULL_FORMAT, "param_names": [rename[n] for n in names],
                                   "elementwise": elementwise}}


_LIGHTNING_KEYS = ("epoch", "global_step", "loops")


def lightning_checkpoint(path: Any, module: torch.nn.Module) -> dict[str, Any]:
    """A Lightning checkpoint dict from a DeepSpeed directory, for ``Trainer.fit(ckpt_path=...)``.

    Lightning's ``DeepSpeedStrategy`` keeps the trainer's state (loops, epoch, callbacks, schedulers) in the
    client state, so its checkpoints resume where they stopped. A checkpoint of DeepSpeed's own engine has
    none of that: weights and optimizer state are restored and the loop starts from the beginning (a warning
    says so); the LR scheduler is the LightningModule's, built anew."""
    from ..engine.guard import allow_state_dict

    ckpt = DeepSpeedCheckpoint(path)
    with allow_state_dict():
        keys = list(module.state_dict(keep_vars=True).keys())
    checkpoint = dict(ckpt.client_state)
    checkpoint["state_dict"] = ckpt.weights(keys)
    checkpoint["optimizer_states"] = [ckpt.optimizer_state(None, keys)] if ckpt.optim or ckpt.model.get("optimizer") else []
    if not all(k in checkpoint for k in _LIGHTNING_KEYS):
        warnings.warn(f"{ckpt.path} was written by DeepSpeed's engine, not by Lightning: the weights and the optimizer "
                      f"state are restored, the training loop starts at step 0 and the LR scheduler from its start "
                      f"(the checkpoint was at global step {ckpt.global_steps}).", stacklevel=2)
        import lightning

        checkpoint.setdefault("lr_schedulers", [])
        checkpoint.setdefault("pytorch-lightning_version", lightning.__version__)
        checkpoint.setdefault("epoch", 0)
        checkpoint.setdefault("global_step", 0)
    return checkpoint


def load_scheduler(scheduler: Any, saved: Any) -> None:
    """DeepSpeed's schedule state (``{"last_batch_iteration": n}``) into our DeepSpeed schedules, or a saved
    torch scheduler's state into a torch scheduler."""
    if not saved:
        return
    try:
        scheduler.load_state_dict(saved)
    except (KeyError, TypeError, ValueError) as e:
        raise CheckpointPathError(f"The checkpoint's LR scheduler state {sorted(saved)} does not fit "
                                  f"{type(scheduler).__name__} ({e}); configure the same scheduler, or load with "
                                  f"load_lr_scheduler_states=False.") from None
