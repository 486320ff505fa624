"""Stage 3: every rank must gather the same groups in the same order; a step in which they did not is an error.

[Note: conditional groups at run time]
A group's all-gather is a collective. When ranks run different group modules (a mixture of experts whose
experts are groups of their own, any data-dependent branch around a group), their gathers pair up wrongly:
with equal sizes each rank receives pieces of another rank's group and trains on them without a word; with
different sizes they wait for each other. The size policy keeps the known case out (containers of experts,
:mod:`lightning_zero.engine.groups`); this check catches the rest. Each rank records the units it gathers;
at the start of every step the record of the step before goes to every rank in one small all-gather on the
engine's own group (not the gather group, whose collectives may be the ones out of step). The result is read
one step later, when the transfer has long finished, so no step waits for it; a mismatch fails every rank at
once with the modules each gathered and the fix, before a second wrong step.
"""

from __future__ import annotations

from typing import Any, Optional

import torch

from ..collectives import Comm

__all__ = ["GatherScheduleCheck", "GatherScheduleError", "out_of_step"]

_MASK = (1 << 62) - 1


class GatherScheduleError(RuntimeError):
    pass


def out_of_step(collective: str, names: list[str]) -> GatherScheduleError:
    """A parameter collective that timed out (``collective_timeout_s``). With prefetch the ranks' gathers can fall
    out of step inside the step in which their forwards first differ (a rank gathers a group its prediction did
    not name, beside the one it prefetched), before the check above compares them: each rank then waits in some
    collective of its own, and this names the cause wherever it waits (a gather or a gradient reduction)."""
    return GatherScheduleError(
        f"lightning_zero: the {collective} of parameters {names[:3]}... did not complete on every rank within "
        f"collective_timeout_s: the ranks' collectives are out of step. Under stage 3 the usual cause is ranks "
        f"running different group modules (uneven evaluation batches, or data-dependent control flow that runs a "
        f"group module on some ranks only, such as experts that are groups of their own): every rank must run the "
        f"same group modules in the same order. Give each rank the same number of batches (Lightning's "
        f"DistributedSampler does), wrap the module that always runs (wrap_modules=[the MoE layer's class], not "
        f"each expert), or use stage 1/2. Otherwise another rank failed or stopped: see its log.")


class GatherScheduleCheck:
    """Records the units gathered between two checkpoints and compares the records across ranks.

    Args:
        comm: the engine's group (every rank reaches each checkpoint: one per Lightning step).
        device: where that group's collectives run.
        names: a parameter name of each unit, by unit index (for the error).
    """

    def __init__(self, comm: Comm, device: torch.device, names: list[str]) -> None:
        self.comm, self.device, self.names = comm, device, names
        self.trace: list[int] = []
        self.checks = 0  # comparisons made (tests)
        self._pending: Optional[tuple[Any, torch.Tensor, Any, list[int]]] = None  # (handle, values, event, trace)

    def note(self, unit_index: int) -> None:
        self.trace.append(unit_index)

    def checkpoint(self, wait: bool = False) -> None:
        """Compare the record sent at the previous checkpoint, then send the one since; ``wait``: compare it too
        (the end of a loop, where no later step will)."""
        self._compare_pending()
        if self.comm.world_size == 1:
            self.trace = []
            return
        trace, self.trace = self.trace, []
        mine = torch.tensor([hash(tuple(trace)) & _MASK, len(trace)], dtype=torch.int64, device=self.device)
        values = torch.empty(2 * self.comm.world_size, dtype=torch.int64, device=self.device)
        handle = self.comm.all_gather_check(values, mine)
        event = None
        if self.device.type == "cuda":  # to the host behind an event: reading it later waits for nothing else
            handle.wait()
            values = values.to("cpu", non_blocking=True)
            event = torch.cuda.Event()
            event.record()
            handle = None
        self._pending = (handle, values, event, trace)
        if wait:
            self._compare_pending()

    def _compare_pending(self) -> None:
        if self._pending is None:
            return
        handle, values, event, trace = self._pending
        self._pending = None
        if handle is not None:
            handle.wait()
        if event is not None:
            event.synchronize()
        pairs = values.view(-1, 2).tolist()
        self.checks += 1
        if all(pair == pairs[0] for pair in pairs):
            return
        traces = self.comm.all_gather_object(trace)  # every rank saw the mismatch in the same collective
        raise GatherScheduleError(self._message(traces))

    def _message(self, traces: list[list[int]]) -> str:
        first = next((i for i in range(max(map(len, traces))) if len({tuple(t[i:i + 1]) for t in traces}) > 1), 0)
        seen = "; ".join(f"rank {r}: {len(t)} gathers, at #{first} {repr(self.names[t[first]]) if first < len(t) else 'none'}"
                         for r, t in enumerate(traces))
        return (f"lightning_zero stage 3: the ranks gathered different parameter groups in the same step ({seen}). "
                f"Some group module ran on some ranks only (a mixture of experts whose experts are groups of their "
                f"own, a branch that depends on the data), so the ranks' all-gathers paired up wrongly and the last "
                f"step used other ranks' parameters. Make the module that every rank runs the group: "
                f"wrap_modules=[its class name] (e.g. the MoE layer, not each expert), or raise min_group_params so "
                f"that the conditional module joins its parent's group, or use stage 1/2.")
