"""Every collective, gather, offload copy and host step runs under a readable record_function label."""

from __future__ import annotations

import pytest
import torch
from dist_utils import run_ranks
from torch import nn


def _labels(rank: int, world: int, stage: int, offload: str) -> list[str]:
    import lightning_zero
    from lightning_zero.collectives import Comm

    torch.manual_seed(0)
    model = nn.Sequential(*[nn.Linear(32, 32) for _ in range(4)])
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    extra = dict(offload_optimizer=offload, offload_params="cpu" if stage == 3 and offload == "cpu" else "none")
    config = lightning_zero.ZeroConfig(stage=stage, reduce_bucket_size=1000, min_group_params=1000,
                                       param_persistence_threshold=0, **(extra if offload != "none" else {}))
    engine = lightning_zero.ZeroEngine(model, [opt], config, Comm.from_group(None), torch.device("cpu"))
    if stage == 3:
        engine.overlap_step(opt)  # what the strategy does when nothing can change gradients before the step
    try:  # the overlapped host step runs on a worker thread: only profiled with profile_all_threads
        threads = torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:  # older torch: main-thread labels only
        threads = None
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], experimental_config=threads) as prof:
        for _ in range(2):
            engine.backward(model(torch.randn(8, 32)).pow(2).mean())
            opt.step()
            opt.zero_grad()
    return sorted({e.name.split("[")[0] for e in prof.events() if e.name.startswith("zero/")})


@pytest.mark.parametrize("stage,offload,expected", [
    (2, "none", {"zero/reduce_scatter", "zero/reduce_wait", "zero/republish"}),
    (2, "cpu", {"zero/reduce_scatter", "zero/host_step", "zero/device_step", "zero/publish"}),
    (3, "cpu", {"zero/all_gather", "zero/gather_wait", "zero/reduce_scatter", "zero/host_step_in_backward"}),
])
def test_trace_names_every_zero_operation(stage, offload, expected):
    labels = run_ranks(_labels, 2, stage, offload)[0]
    try:
        torch._C._profiler._ExperimentalConfig(profile_all_threads=True)
    except TypeError:
        expected = expected - {"zero/host_step_in_backward"}
    assert expected <= set(labels), labels
