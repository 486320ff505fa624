"""Speculative host steps (``tests/test_speculative_step.py``): each case fitted twice, speculating and not."""

from __future__ import annotations

from lightning_cases import fit_case

CPU = dict(offload_optimizer="cpu")
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
}


def run_speculation(rank: int, world: int) -> dict:
    # units far below HOST_STEP_CHUNK would all wait for the drain at the step: small chunks make the worker
    # step while backward runs, the path a large model on a GPU takes
    from lightning_zero.engine import overlap

    chunk, overlap.HOST_STEP_CHUNK = overlap.HOST_STEP_CHUNK, 64
    out = {}
    try:
        for name, (strategy, kwargs) in CASES.items():
            kwargs = dict(kwargs)
            options, module = kwargs.pop("options"), kwargs.pop("module", "lm")
            out[name] = fit_case(rank, world, module, strategy, probe=False, options=options, **kwargs)
            out[name + "_after"] = fit_case(rank, world, module, strategy, probe=False,
                                            options=dict(options, overlap_step=False), **kwargs)
    finally:
        overlap.HOST_STEP_CHUNK = chunk
    return out
