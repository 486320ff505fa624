"""Speculative host steps (``tests/test_speculative_step.py``): each case fitted twice, speculating and not."""

from __future__ import annotations

from lightning_cases import fit_case

CPU = dict(offload_optimizer="cpu", speculative_step=True)
AUTO = dict(offload_optimizer="cpu", speculative_step="auto", min_group_params=10, param_persistence_threshold=0)
SMALL_UNITS = dict(min_group_params=10, param_persistence_threshold=0)
Z3 = dict(CPU, offload_params="cpu", **SMALL_UNITS)

# name: (strategy, fit_case keywords); every case but the rank-expert one without clipping clips or scales the
# loss, so the host step speculates; each is compared with the same fit stepping after backward
CASES = {
    "zero2_clips": ("zero2", dict(accumulate=2, clip_val=0.5, options=dict(CPU, **SMALL_UNITS))),
    "zero2_never_clips": ("zero2", dict(accumulate=2, clip_val=1e6, options=dict(CPU, **SMALL_UNITS))),
    "zero2_fp16_overflow": ("zero2", dict(plugin="16-mixed", inject=(2, 3), clip_val=1e6,
                                          options=dict(CPU, offload_fraction=0.5, initial_scale_power=8,
                                                       **SMALL_UNITS))),
    "zero3_clips": ("zero3", dict(accumulate=2, clip_val=0.5, options=Z3)),
    "zero3_clips_by_value": ("zero3", dict(clip_val=0.02, clip_algo="value", options=Z3)),
    "zero3_host_acc_clips": ("zero3", dict(accumulate=2, clip_val=0.5,
                                           options=dict(Z3, offload_accumulation="host"))),
    # rank 1 never uses one expert: the ranks step different units during backward
    "zero2_rank_expert_clips": ("zero2", dict(module="rank_expert", clip_val=0.5, options=dict(CPU, **SMALL_UNITS))),
    "zero2_rank_expert": ("zero2", dict(module="rank_expert", options=dict(CPU, **SMALL_UNITS))),
    # value clipping: rank 1's expert unit holds no gradient at all (its shard released) when the clamp looks
    "zero2_rank_expert_clips_by_value": ("zero2", dict(module="rank_expert", clip_val=0.02, clip_algo="value",
                                                       options=dict(CPU, **SMALL_UNITS))),
    # speculative_step='auto' on a host whose copies are fast / slow on every rank / slow on rank 1 only
    "zero2_auto_fast_host": ("zero2", dict(accumulate=2, clip_val=0.5, options=AUTO, copy_cost=(0.0, 0.0))),
    "zero2_auto_slow_host": ("zero2", dict(accumulate=2, clip_val=0.5, options=AUTO, copy_cost=(1.0, 1.0))),
    "zero2_auto_one_slow_rank": ("zero2", dict(accumulate=2, clip_val=0.5, options=AUTO, copy_cost=(0.0, 1.0))),
}
AUTO_CASES = ("zero2_auto_fast_host", "zero2_auto_slow_host", "zero2_auto_one_slow_rank")


def run_speculation(rank: int, world: int) -> dict:
    # units far below HOST_STEP_CHUNK would all wait for the drain at the step: small chunks make the worker
    # step while backward runs, the path a large model on a GPU takes
    from lightning_zero.engine import host_schedule, overlap

    chunk, overlap.HOST_STEP_CHUNK = overlap.HOST_STEP_CHUNK, 64
    measured = host_schedule.host_copy_seconds_per_byte
    out = {}
    try:
        for name, (strategy, kwargs) in CASES.items():
            kwargs = dict(kwargs)
            options, module = kwargs.pop("options"), kwargs.pop("module", "lm")
            cost = kwargs.pop("copy_cost", None)  # seconds a byte: a simulated host, this rank's figure
            host_schedule.host_copy_seconds_per_byte = measured if cost is None else (lambda c=cost[rank]: c)
            out[name] = fit_case(rank, world, module, strategy, probe=False, options=options, **kwargs)
            host_schedule.host_copy_seconds_per_byte = measured
            out[name + "_after"] = fit_case(rank, world, module, strategy, probe=False,
                                            options=dict(options, overlap_step=False), **kwargs)
    finally:
        overlap.HOST_STEP_CHUNK = chunk
        host_schedule.host_copy_seconds_per_byte = measured
    return out
