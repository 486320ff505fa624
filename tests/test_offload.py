"""Offload of the optimizer side (and stage-3 parameters) to CPU memory and to NVMe files."""

from __future__ import annotations

import os

import pytest
import torch
from dist_utils import run_ranks
from offload_cases import (
    edit_before_forward_case,
    edit_case,
    planner_case,
    rss_case,
    run_checkpoints,
    run_parity,
    slow_publish_case,
)
from parity import assert_parity, global_l2_err, rel_err, state_err
from test_checkpoint import assert_resumed_like

from lightning_zero import ZeroConfig, ZeroConfigError
from lightning_zero.engine.swap import NvmePathError, resolve_nvme_dir
from lightning_zero.partition import chunk_units, plan_offload


@pytest.fixture(scope="module")
def nvme_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("nvme"))


@pytest.fixture(scope="module")
def world2(nvme_dir):
    out = run_ranks(run_parity, 2, nvme_dir, lightning=True)
    assert os.listdir(nvme_dir) == [], "NVMe offload files outlived the engine"
    return out


PARTIAL = {"zero2_half", "zero3_opt_third", "zero2_host_acc", "zero3_half_params_cpu_host_acc"}  # offload_fraction < 1


@pytest.mark.slow
@pytest.mark.parametrize("run", ["auto", "zero1_cpu", "zero2_cpu", "zero2_half", "zero3_cpu", "zero3_opt_third",
                                 "zero2_nvme", "zero3_nvme", "zero3_nvme_cpu",
                                 "zero2_host_acc", "zero3_host_acc", "zero2_nvme_host_acc",
                                 "zero3_half_params_cpu_host_acc"])
def test_fp32_offload_matches_ddp(world2, run):
    # accumulation 2, global-norm clipping 0.5: every offload placement trains like DDP
    for results in world2:
        assert_parity(results[run], results["ddp"])
        assert results[run]["global_step"] == results["ddp"]["global_step"] > 0
        # a partial placement offloads some units and keeps others (whole units move)
        if run in PARTIAL:
            assert 0 < results[run]["offloaded_units"] < results[run]["units"], results[run]["units"]
        elif run != "auto":
            assert results[run]["offloaded_units"] == results[run]["units"] > 0
        # host accumulation: every window's earlier micro-batch was added on the host, none otherwise
        assert (results[run]["host_adds"] > 0) == run.endswith("host_acc")
        # small chunks: the worker really stepped while backward ran (the path a GPU run takes)
        assert (results[run]["batches_in_backward"] > 0) == run.endswith("small_chunks")


@pytest.mark.slow
@pytest.mark.parametrize("run", ["zero2_overlap", "zero2_overlap_half", "zero3_overlap", "zero2_no_overlap",
                                 "zero2_overlap_host_acc", "zero2_overlap_small_chunks", "zero3_overlap_small_chunks"])
def test_host_step_during_backward_matches_ddp(world2, run):
    # no clipping and no hook before the step: offloaded units step on the worker while backward runs
    for results in world2:
        assert_parity(results[run], results["ddp_noclip"])
        overlapped = results[run]["stepped_in_backward"]
        assert (overlapped == 0) if run == "zero2_no_overlap" else (overlapped > 0)
        assert (results[run]["host_adds"] > 0) == run.endswith("host_acc")
        # the worker really stepped while backward ran (the path a GPU run takes): an idle worker takes a unit
        # at once, a busy one gets the units that landed meanwhile once they fill a chunk
        assert (results[run]["batches_in_backward"] > 0) == (overlapped > 0)
    for results in world2:  # a callback's on_after_backward (the LM cases' memory probe) or NVMe files: after
        assert results["zero2_cpu"]["stepped_in_backward"] == 0
        assert results["zero2_nvme"]["stepped_in_backward"] == 0


@pytest.mark.slow
def test_a_release_during_the_workers_publish_waits_for_it():
    # stage 3 frees a unit's full buffer after its backward while the host step's worker may be writing the unit's
    # new values into it: the release must wait (else "data is not allocated yet", or a write into freed memory)
    ranks = run_ranks(slow_publish_case, 2, lightning=True)
    # the race is timing: on a loaded 2-core machine one rank's worker may finish first; one rank racing suffices
    assert sum(rank["crossed"] for rank in ranks) > 0, "no release came while a publish was under way: no race"
    for rank in ranks:
        assert rank["slowed"]["losses"] == rank["reference"]["losses"]
        if "weights" in rank["reference"]:  # rank 0 reads the full state
            assert state_err(rank["slowed"]["weights"], rank["reference"]["weights"]) == 0


@pytest.mark.slow
@pytest.mark.parametrize("run", ["gan_zero2_cpu", "gan_zero2_nvme"])
def test_two_optimizers_offloaded(world2, run):
    for results in world2:
        assert_parity(results[run], results["gan_ddp"])


@pytest.mark.slow
def test_bf16_offload_same_math_as_device(world2):
    # the host steps the same fp32 master from the same bf16 gradients as the device would
    for results in world2:
        assert global_l2_err(results["zero2_bf16_cpu"]["state"], results["zero2_bf16"]["state"]) < 1e-6
        assert global_l2_err(results["zero3_bf16_nvme"]["state"], results["zero3_bf16"]["state"]) < 1e-6


@pytest.mark.slow
def test_fp16_overflow_vote_sees_offloaded_gradients(world2):
    # inf injected on rank 1 at steps 2 and 3; half the units' gradients are on the host
    for results in world2:
        run, ref = results["fp16_cpu"], results["fp16"]
        assert run["scale"] == ref["scale"] < 2.0**8
        assert rel_err(run["trace"][2], run["trace"][1]) == 0.0  # the step was skipped everywhere
        assert state_err(run["state"], ref["state"]) <= 1e-5


@pytest.fixture(scope="module")
def checkpoints(tmp_path_factory, nvme_dir):
    d = str(tmp_path_factory.mktemp("ckpt"))
    return run_ranks(run_checkpoints, 2, d, nvme_dir, lightning=True)


@pytest.mark.slow
@pytest.mark.parametrize("run", ["plain_from_cpu", "nvme_from_nvme", "cpu_from_nvme", "nvme_from_plain"])
def test_offloaded_state_checkpoints_resume_exactly(checkpoints, run):
    for r in checkpoints:
        assert_resumed_like(r[run], r["ref"])


@pytest.mark.slow
def test_nvme_host_memory_stays_within_the_staging_budget():
    # Same model (16 layers of 512^2 fp32 parameters, AdamW) on one rank: CPU offload holds master and
    # moments in host memory (12 bytes a parameter), NVMe offload only its staging budget.
    budget = 12 << 20  # three slots of one layer's master and two moments
    cpu = run_ranks(rss_case, 1, 16, dict(offload_optimizer="cpu"), lightning=True)[0]
    nvme = run_ranks(rss_case, 1, 16, dict(offload_optimizer="nvme", nvme_path=_tmp(), nvme_buffer_bytes=budget),
                     lightning=True)[0]
    big = run_ranks(rss_case, 1, 64, dict(offload_optimizer="nvme", nvme_path=_tmp(), nvme_buffer_bytes=budget),
                    lightning=True)[0]
    state = 12 * cpu["numel"]
    print(f"peak RSS growth: cpu offload {cpu['growth'] / 2**20:.1f} MiB, nvme {nvme['growth'] / 2**20:.1f} MiB "
          f"(4x the parameters: {big['growth'] / 2**20:.1f} MiB); optimizer side {state / 2**20:.1f} MiB")
    # the staging slots (12 MiB) and first-step moments waiting to be written stand in for 48 MiB
    assert cpu["growth"] - nvme["growth"] >= 0.6 * state
    # 4x the parameters: the growth follows the gradients and parameters (8 bytes a parameter), not 20
    assert big["growth"] - nvme["growth"] <= 8 * (big["numel"] - nvme["numel"]) + 2 * budget


def _tmp() -> str:
    import tempfile

    return tempfile.mkdtemp(prefix="lz-nvme-")


def test_placement_by_bytes():
    assert plan_offload([10, 10, 10, 10], 0.5) == [0, 1]
    assert plan_offload([100], 0.4) == [] and plan_offload([100], 0.6) == [0]
    assert plan_offload([5, 100, 5], 0.1) == [0, 2]  # skips the unit that would overshoot
    assert plan_offload([1, 2, 3], 1.0) == [0, 1, 2] and plan_offload([1, 2, 3], 0.0) == []
    sizes = [7, 3, 9, 1, 12, 5, 8]
    for f in (0.1, 0.25, 0.5, 0.75, 0.9):
        chosen = plan_offload(sizes, f)
        assert abs(sum(sizes[i] for i in chosen) / sum(sizes) - f) <= max(sizes) / sum(sizes) / 2 + 1e-9
    assert chunk_units([5, 5, 5, 20, 1], 10) == [[0, 1], [2], [3], [4]]


@pytest.mark.parametrize("kwargs,needle", [
    (dict(stage=2, offload_params="cpu"), "stage 3"),
    (dict(stage=3, offload_params="cpu"), "offload_optimizer"),
    (dict(offload_fraction=0.5), "partial placement"),
    (dict(offload_optimizer="cpu", offload_fraction=1.5), "between 0.0"),
    (dict(offload_optimizer="gpu"), "'none', 'cpu' or 'nvme'"),
    (dict(offload_optimizer="nvme", nvme_buffer_bytes=10), "nvme_buffer_bytes"),
])
def test_impossible_offload_configs_are_one_line_errors(kwargs, needle):
    with pytest.raises(ZeroConfigError) as err:
        ZeroConfig(**kwargs)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_bad_nvme_paths_are_one_line_errors(tmp_path, monkeypatch):
    monkeypatch.delenv("LIGHTNING_ZERO_NVME_PATH", raising=False)
    cases = [(None, 1, "LIGHTNING_ZERO_NVME_PATH"), (str(tmp_path / "nope"), 1, "does not exist"),
             ("/proc/1", 1, "not writable"), (str(tmp_path), 1 << 62, "GiB free")]
    for path, need, needle in cases:
        with pytest.raises(NvmePathError) as err:
            resolve_nvme_dir(path, need)
        assert needle in str(err.value) and "\n" not in str(err.value)
    monkeypatch.setenv("LIGHTNING_ZERO_NVME_PATH", str(tmp_path))
    assert resolve_nvme_dir(None, 1) == tmp_path


def test_staging_budget_smaller_than_a_unit_is_a_clear_error(tmp_path):
    from torch import nn

    from lightning_zero import ZeroEngine
    from lightning_zero.collectives import Comm

    model = nn.Linear(64, 64)
    config = ZeroConfig(stage=2, offload_optimizer="nvme", nvme_path=str(tmp_path), nvme_buffer_bytes=4096)
    with pytest.raises(NvmePathError, match="nvme_buffer_bytes=4096 is too small"):
        ZeroEngine(model, [torch.optim.AdamW(model.parameters())], config, Comm(), torch.device("cpu"))


PLANS = {
    "zero1": dict(stage=1), "zero2": dict(stage=2), "zero3": dict(stage=3),
    "zero2_cpu": dict(stage=2, offload_optimizer="cpu"),
    "zero2_cpu_40": dict(stage=2, offload_optimizer="cpu", offload_fraction=0.4, reduce_bucket_size=512 * 512),
    "zero3_cpu": dict(stage=3, offload_optimizer="cpu", offload_params="cpu"),
    "zero3_cpu_opt": dict(stage=3, offload_optimizer="cpu"),
}


@pytest.mark.slow
def test_planner_matches_measured_model_state(tmp_path):
    # 4.2M parameters, bf16, AdamW, 2 ranks: what lightning_zero.estimate plans per rank against the storages
    # really alive at a step (found by gc): the offloaded units' host side (gradient arena, master arena or
    # NVMe staging, their pieces' optimizer state), tensors mapped from NVMe files, and everything else (the
    # device side), each within 10% (the device side also holds a batch and activations: +64 KiB)
    runs = dict(PLANS, zero3_nvme=dict(stage=3, offload_optimizer="nvme", offload_params="nvme",
                                       nvme_path=str(tmp_path), nvme_buffer_bytes=80 << 20))
    from lightning_zero.engine.swap import NvmeBackend

    for rank in run_ranks(planner_case, 2, runs, lightning=True):
        for name, r in rank.items():
            assert abs(r["device"] - r["planned_device"]) <= 0.1 * r["planned_device"] + (64 << 10), (name, r)
            # measured after the first step: the plan's peak also holds the moments that step creates for one
            # NVMe chunk before they are written to their files
            steady = r["planned_host"] - (NvmeBackend.first_step_bytes(80 << 20) if name == "zero3_nvme" else 0)
            assert abs(r["host"] - steady) <= 0.1 * steady + 4096, (name, r)
            assert abs(r["files"] - r["planned_nvme"]) <= 0.1 * r["planned_nvme"] + 4096, (name, r)


def test_estimate_prints_every_configuration(capsys):
    from lightning_zero.estimate import main

    assert main(["--params", "13e9", "--nvme", "60", "--activations", "4"]) == 0
    out = capsys.readouterr().out
    for name in ("ddp", "zero1", "zero2", "zero3", "zero2 offload cpu", "zero3 offload cpu+params cpu",
                 "zero3 offload nvme+params nvme", "(recommended partial)"):
        assert name in out
    assert "bottleneck" in out and "CPU step" in out


def test_estimate_counts_a_hydra_model(capsys):
    pytest.importorskip("hydra")
    from lightning_zero.estimate import main

    assert main(["model=gpt_small", "--gpus-per-node", "2"]) == 0
    out = capsys.readouterr().out
    assert "parameters" in out.splitlines()[0] and int(out.split()[0].replace(",", "")) > 10_000_000


def test_auto_placement_picks_in_order_of_traffic_and_explains():
    from lightning_zero.planner import GiB, Hardware, choose

    base = ZeroConfig(auto_placement=True, prefetch=2)
    small = choose(1_300_000_000, Hardware(gpu_bytes=int(80 * GiB)), base, activations=int(20 * GiB))
    assert small.config.stage == 2 and not small.config.offloads and small.config.prefetch == 2
    big = choose(13_000_000_000, Hardware(gpu_bytes=int(139 * GiB), host_bytes=int(125 * GiB)), base,
                 activations=int(4 * GiB))
    assert big.config.offload_optimizer == "cpu" and 0 < big.config.offload_fraction < 1
    assert "fits" in big.why
    with pytest.raises(ValueError) as err:
        choose(70_000_000_000, Hardware(gpu_bytes=int(24 * GiB), host_bytes=int(64 * GiB)), base)
    assert "No placement fits" in str(err.value) and "\n" not in str(err.value)


def test_accumulation_places_the_offloaded_gradients_where_they_fit():
    from lightning_zero.planner import GiB, Hardware, choose, estimate

    hw, n = Hardware(gpu_bytes=int(139 * GiB), host_bytes=int(125 * GiB)), 13_000_000_000
    half = ZeroConfig(stage=3, offload_optimizer="cpu", offload_fraction=0.5)
    host = half.replace(offload_accumulation="host")
    one, dev, on_host = (estimate(n, c, hw, accumulate=a, largest_unit=300_000_000)
                         for c, a in ((half, 1), (half, 8), (host, 8)))
    # the device accumulator holds the offloaded half of the gradients in fp32; host accumulation moves it
    # to the host side as two staging slots of the largest unit, and crosses PCIe once per micro-batch
    assert dev.gpu_state - one.gpu_state == 4 * n // 2
    assert on_host.gpu_state == one.gpu_state and on_host.host - one.host == 2 * 4 * 300_000_000
    assert on_host.seconds["PCIe"] > dev.seconds["PCIe"]
    # 13B on one H200 with accumulation fits only without the device accumulator: zero_auto says so
    chosen = choose(n, hw, ZeroConfig(auto_placement=True), activations=int(12 * GiB), accumulate=8)
    assert chosen.config.offload_accumulation == "host" and "host acc." in chosen.why
    without = choose(n, hw, ZeroConfig(auto_placement=True), activations=int(12 * GiB), accumulate=1)
    assert without.config.offload_accumulation == "device"
    with pytest.raises(ZeroConfigError, match="offload_accumulation"):
        ZeroConfig(offload_accumulation="gpu")


def test_activation_probe_without_a_gpu_is_a_clear_error():
    from lightning_zero.probe import probe_activations

    with pytest.raises(ValueError, match="needs a GPU.*--activations"):
        probe_activations(lambda depth: torch.nn.Linear(4, 4), 2, lambda m: m(torch.ones(1, 4)).sum(),
                          torch.device("cpu"))


def test_when_every_fitting_placement_offloads_one_gpu_takes_the_fastest_predicted():
    from lightning_zero.planner import GiB, Hardware, choose, estimate

    n, base = 12_920_000_000, ZeroConfig(auto_placement=True)
    one = Hardware(gpu_bytes=int(139 * GiB), host_bytes=int(120 * GiB))
    chosen = choose(n, one, base, accumulate=6, activations=int(10 * GiB), largest_unit=315_000_000)
    runner = chosen.runner_up
    assert chosen.config.offloads and runner is not None and runner.config.offloads
    # the choice is predicted faster than its runner-up, whatever their order of traffic
    seconds = [max(estimate(n, row.config, one, accumulate=6, activations=int(10 * GiB),
                            largest_unit=315_000_000).seconds.values()) for row in (chosen, runner)]
    assert seconds[0] <= seconds[1] and "least predicted step time" in chosen.why
    # on several GPUs stage 3's gathers cross the network: the order of traffic alone decides
    four = Hardware(gpus_per_node=4, gpu_bytes=int(24 * GiB), host_bytes=int(120 * GiB))
    several = choose(4 * n // 10, four, base, activations=int(4 * GiB))
    assert "least predicted step time" not in several.why


def test_the_largest_models_gather_their_offloaded_units_from_the_host():
    # Past the size where zero3 with a partial share offloaded fits, the offloaded units need not keep their
    # 16-bit copy on the GPU: gathered from the fp32 host master, they leave it room for more parameters.
    from lightning_zero.planner import GiB, Hardware, choose, estimate, recommend_partial

    hw, kwargs = Hardware(gpu_bytes=int(139 * GiB), host_bytes=int(118 * GiB)), dict(accumulate=6,
                                                                                    activations=int(10 * GiB))
    n = 14_200_000_000
    assert recommend_partial(n, hw, stage=2, **kwargs) is None and recommend_partial(n, hw, stage=3, **kwargs) is None
    chosen = choose(n, hw, ZeroConfig(auto_placement=True), **kwargs)
    config = chosen.config
    assert config.stage == 3 and config.offload_params == "cpu" and 0 < config.offload_fraction < 1, chosen.why
    row = estimate(n, config, hw, **kwargs)
    assert row.fits and row.seconds["PCIe"] > estimate(n, config.replace(offload_params="none"), hw, **kwargs).seconds["PCIe"]
    # below that size the copy stays on the GPU (fewer bytes cross PCIe): the plain partial placement is chosen
    smaller = choose(12_000_000_000, hw, ZeroConfig(auto_placement=True), **kwargs)
    assert smaller.config.offload_params == "none"


def test_an_edit_of_one_element_by_one_ulp_reaches_the_offloaded_master():
    # the offloaded masters are checked through fingerprints of what was published: one element one ulp off, and a
    # row negated, both reach the fp32 master (lr 0: nothing else moves it)
    for rank in run_ranks(edit_case, 2, lightning=True):
        assert torch.equal(rank["final"], rank["expected"])


@pytest.mark.parametrize("where", ["training_step", "on_before_zero_grad"])
def test_an_edit_made_before_backward_reaches_the_master_the_host_steps(where):
    # the host steps offloaded units during backward: an edit made in training_step or on_before_zero_grad (after the
    # forward began) must be in the master by then, as under DDP where the parameters are the master
    reference = run_ranks(edit_before_forward_case, 2, "ddp", where, lightning=True)
    mine = run_ranks(edit_before_forward_case, 2, "zero2_offload", where, lightning=True)
    for ref, got in zip(reference, mine):
        assert got["stepped_in_backward"] > 0  # the host did step during backward
        assert_parity(got, ref)


def _inout(rank: int, world: int) -> dict:
    from lightning_cases import fit_case

    sharded = dict(min_group_params=100, param_persistence_threshold=0)
    plain = dict(accumulate=2, probe=False)  # no hook before the step: the host steps during backward
    return {"ddp": fit_case(rank, world, "blocks_inout_plain", "ddp_find_unused_parameters_true", **plain),
            "zero3_offload": fit_case(rank, world, "blocks_inout", "zero3", **plain,
                                      options=dict(offload_optimizer="cpu", **sharded)),
            "zero3_offload_params": fit_case(rank, world, "blocks_inout", "zero3", **plain,
                                             options=dict(offload_optimizer="cpu", offload_params="cpu", **sharded))}


def test_a_unit_whose_gradient_comes_late_is_left_to_the_regular_step():
    # a block used outside and inside a reentrant checkpoint: its units look complete after the nested backward, and
    # the rest of their gradient comes later; the host must not step them early with half of it
    for results in run_ranks(_inout, 2, lightning=True):
        for run in ("zero3_offload", "zero3_offload_params"):
            assert results[run]["stepped_in_backward"] > 0, run  # the other units still step during backward
            assert_parity(results[run], results["ddp"])
