"""ZeRO checkpoints: resume on the same, fewer and more ranks, under another stage, and under DDP.

The batch of each step is a function of ``global_step`` and is the same on every rank (see the
note in ``checkpoint_cases.py``), so the math of a step does not depend on the world size and an
uninterrupted run on any number of ranks is a valid reference for a resume on any other number.
Checkpoints are written at the end of training from ``on_train_end`` on every rank (see
``test_save_checkpoint_after_fit_returns`` for what happens once ``fit`` has returned).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from checkpoint_cases import FIRST, TOTAL, fit_steps, world2_cases, world4_cases
from dist_utils import run_ranks
from parity import state_err

TOL = 1e-5


@pytest.fixture(scope="module")
def ckpt_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("ckpt"))


@pytest.fixture(scope="module")
def world2(ckpt_dir):
    return run_ranks(world2_cases, 2, ckpt_dir, lightning=True)


@pytest.fixture(scope="module")
def world4(world2, ckpt_dir):
    return run_ranks(world4_cases, 4, ckpt_dir, lightning=True)


@pytest.fixture(scope="module")
def world1(world2, world4, ckpt_dir):
    # devices=1 runs in this process (the strategy starts a one-rank gloo group here).
    return {"ref": fit_steps(1, "zero1", TOTAL),
            "from2": fit_steps(1, "zero1", TOTAL, ckpt_in=f"{ckpt_dir}/a.ckpt"),
            "from4": fit_steps(1, "zero1", TOTAL, ckpt_in=f"{ckpt_dir}/a4.ckpt"),
            "zero2_from2": fit_steps(1, "zero2", TOTAL, ckpt_in=f"{ckpt_dir}/a.ckpt")}


def assert_resumed_like(run: dict, ref: dict) -> None:
    """Resumed run == uninterrupted run: parameters, steps, scheduler, learning rates, data order."""
    if run["state"] and ref["state"]:  # stage 3 gives the gathered state dict to rank 0 only
        err = state_err(run["state"], ref["state"])
        assert err <= TOL, f"resumed parameters differ from the uninterrupted run by {err:.2e}"
    if run["final"]:  # stages 1/2: the module handed back after teardown; stage 3: full_state_dict() on rank 0
        assert state_err(run["final"], ref["final"]) <= TOL
    assert run["global_step"] == ref["global_step"] == TOTAL
    assert run["sched"] == ref["sched"]
    assert run["sched"]["last_epoch"] == TOTAL  # the scheduler really stepped per step (not left at 0)
    assert run["lrs"] == ref["lrs"]
    assert run["seen_steps"] == list(range(FIRST, TOTAL))
    assert len(run["losses"]) == TOTAL - FIRST
    assert max(abs(a - b) / abs(b) for a, b in zip(run["losses"], ref["losses"][FIRST:])) <= TOL


def test_sharded_directory_holds_one_part_per_rank(world2, ckpt_dir):
    d = Path(ckpt_dir) / "a.ckpt"
    files = sorted(p.name for p in d.iterdir())
    assert {".metadata", "meta.pt", "checksums.json"} <= set(files)
    assert all(f.startswith(("__0_", "__1_")) and f.endswith(".distcp") for f in files
               if f not in (".metadata", "meta.pt", "checksums.json"))
    listed = json.loads((d / "checksums.json").read_text())
    assert set(listed) == set(files) - {"checksums.json"}  # every file the save wrote, with its size
    assert all(listed[f]["bytes"] == (d / f).stat().st_size for f in listed)
    assert not any(p.name.endswith((".partial", ".old")) for p in Path(ckpt_dir).iterdir())
    parts = [sum(p.stat().st_size for p in d.glob(f"__{r}_*.distcp")) for r in (0, 1)]
    # each rank wrote about half of the weights + AdamW moments (12 bytes a parameter in fp32); the small
    # replicated values (param groups, step counters: a file each, mostly header) are not counted
    md = dcp.FileSystemReader(str(d)).read_metadata()
    payload = [0, 0]
    for index, where in md.storage_data.items():
        entry = md.state_dict_metadata[index.fqn]
        if getattr(entry, "size", torch.Size([])).numel() > 1 and not index.fqn.startswith("state_dict.frozen"):
            payload[int(where.relative_path.split("_")[2])] += where.length
    numel = sum(v.numel() for k, v in world2[0]["a"]["state"].items() if k != "head.weight")  # head tied to emb
    assert 0.4 < payload[0] / sum(payload) < 0.6, payload
    assert 12 * numel <= sum(parts)  # (plus per-tensor headers, large at this size)
    meta = torch.load(d / "meta.pt", weights_only=False)
    assert meta["global_step"] == FIRST and "state_dict" not in meta
    assert meta["lightning_zero"]["aliases"] == {"head.weight": "emb.weight"}
    assert (d / "meta.pt").stat().st_size < 0.25 * sum(parts)  # the tensors are in the parts


def test_checkpoint_file_holds_full_fp32_state(world2, ckpt_dir):
    ckpt = torch.load(f"{ckpt_dir}/full.ckpt", weights_only=False)
    ref = world2[0]["full_a"]["state"]
    sd = ckpt["state_dict"]
    assert sd.keys() == ref.keys() and {"emb.weight", "head.weight"} <= sd.keys()  # tied: both keys
    assert all(sd[k].shape == ref[k].shape and sd[k].dtype == torch.float32 for k in sd)
    assert torch.equal(sd["emb.weight"], sd["head.weight"])
    assert state_err(sd, ref) == 0.0
    assert ckpt["global_step"] == FIRST
    (opt,) = ckpt["optimizer_states"]
    assert [g["weight_decay"] for g in opt["param_groups"]] == [0.1, 0.0]
    # torch's own optimizer format (what a plain optimizer saves), parameter names beside it
    names = opt["lightning_zero"]["param_names"]
    assert sorted(i for g in opt["param_groups"] for i in g["params"]) == list(range(len(names)))
    assert opt["state"][names.index("fc1.weight")]["exp_avg"].shape == (48, 24)  # full shape, not a shard


def test_resume_same_world_size(world2):
    for r in world2:
        assert_resumed_like(r["resumed"], r["ref"])
        assert_resumed_like(r["z3_resumed"], r["ref"])
    assert state_err(world2[0]["resumed"]["state"], world2[1]["resumed"]["state"]) == 0.0


def test_resume_under_zero1_same_world_size(world2):
    for r in world2:
        assert_resumed_like(r["zero1_resumed"], r["ref"])


def test_world_size_does_not_change_the_math(world1, world2, world4):
    # The premise of the cross-world comparisons: uninterrupted runs on 1, 2 and 4 ranks agree.
    assert state_err(world1["ref"]["state"], world2[0]["ref"]["state"]) <= TOL
    assert state_err(world4[0]["ref"]["state"], world2[0]["ref"]["state"]) <= TOL


def test_resume_on_one_rank_zero1(world1):
    assert_resumed_like(world1["from2"], world1["ref"])  # written by 2 ranks (zero2), read by 1 (zero1)
    assert_resumed_like(world1["from4"], world1["ref"])  # written by 4 ranks
    assert_resumed_like(world1["zero2_from2"], world1["ref"])


def test_stage3_checkpoints_move_between_stages_and_world_sizes(world2, world4):
    for r in world2:
        assert_resumed_like(r["z3_from_z2"], r["ref"])  # zero2 file -> zero3
        assert_resumed_like(r["z2_from_z3"], r["ref"])  # zero3 file -> zero2
        assert_resumed_like(r["z3_from_z1"], r["ref"])  # zero1 dir -> zero3
    for r in world4:
        assert_resumed_like(r["z3_from2"], r["ref"])  # zero3 on 2 ranks -> zero3 on 4


def test_one_file_checkpoints_still_load_into_every_stage(world2):
    for r in world2:
        assert state_err(r["full_a"]["state"], r["a"]["state"]) == 0.0
        assert_resumed_like(r["full_resumed"], r["ref"])
        assert_resumed_like(r["z3_from_full"], r["ref"])


def test_resume_on_four_ranks(world4):
    for r in world4:
        assert_resumed_like(r["resumed"], r["ref"])  # written by 2 ranks, read by 4


def test_modelcheckpoint_last(world2):
    for r in world2:
        case = r["last"]
        assert "last.ckpt" in case["files"] and case["last_global_step"] == 4
        assert case["first"]["global_step"] == 4
        resumed = case["resumed"]
        assert resumed["seen_steps"] == list(range(4, TOTAL))
        assert state_err(resumed["state"], r["ref"]["state"]) <= TOL
        assert resumed["global_step"] == TOTAL and resumed["sched"] == r["ref"]["sched"]


def test_fp16_loss_scaler_restored(world2):
    for r in world2:
        saved = r["fp16_a"]["scaler"]
        # step 1 overflowed on rank 1: 2**8 halved once (hysteresis 1), so the scale is not the initial one
        assert saved["scale"] == 128.0 and saved["overflows"] == 1
        resumed = r["fp16_resumed"]
        assert resumed["seen_scales"][0] == saved["scale"]  # the first step after resume uses the saved scale
        assert resumed["scaler"] == r["fp16_ref"]["scaler"]
        assert resumed["scaler"]["step_count"] == 7
        assert state_err(resumed["state"], r["fp16_ref"]["state"]) <= TOL


def test_missing_key_strict_is_a_clear_error(world2):
    # loaded into the module before setup, as under DDP: torch's own message names the key
    for r in world2:
        case = r["missing_key"]
        assert "KeyError" in case.get("types", [case.get("error")]) or case.get("error") == "RuntimeError", case
        assert "fc1.bias" in case["message"] and "issing" in case["message"]


def test_ddp_checkpoint_resumes_under_zero(world2):
    # the optimizer state is in torch's own format: a DDP checkpoint resumes exactly under ZeRO
    for r in world2:
        case = r["ddp_to_zero"]
        assert "ok" in case, case
        assert_resumed_like(case["ok"], r["ref"])


def test_zero_checkpoint_resumes_under_ddp(world2):
    for r in world2:
        case = r["zero_to_ddp"]
        assert "ok" in case, case
        assert_resumed_like(case["ok"], r["ref"])


@pytest.mark.parametrize("strategy", ["zero2", "zero3"])
def test_save_checkpoint_after_fit_returns(tmp_path, strategy):
    run = fit_steps(1, strategy, 2, save_after_fit=str(tmp_path / "after.ckpt"))
    assert torch.load(tmp_path / "after.ckpt" / "meta.pt", weights_only=False)["global_step"] == 2
    full = fit_steps(1, strategy, 2, save_after_fit=str(tmp_path / "full.ckpt"), options={"checkpoint_format": "full"})
    ckpt = torch.load(tmp_path / "full.ckpt", weights_only=False)
    assert ckpt["global_step"] == 2 and state_err(ckpt["state_dict"], full["state"]) == 0.0
    assert state_err(run["state"], full["state"]) == 0.0


# ---- consolidation: a sharded directory -> one ordinary file ---------------------------------------------
def test_consolidate_equals_full_checkpoint(world2, ckpt_dir, tmp_path):
    from lightning_zero.checkpoint.export import write_checkpoint

    write_checkpoint(f"{ckpt_dir}/a.ckpt", tmp_path / "out.ckpt")
    out = torch.load(tmp_path / "out.ckpt", weights_only=False, mmap=True)
    full = torch.load(f"{ckpt_dir}/full.ckpt", weights_only=False)  # checkpoint_format="full", same training
    assert out["state_dict"].keys() == full["state_dict"].keys()
    assert state_err(out["state_dict"], full["state_dict"]) == 0.0
    assert out["global_step"] == full["global_step"] == FIRST
    assert out["lr_schedulers"] == full["lr_schedulers"] and out["loops"] == full["loops"]
    (o,), (f,) = out["optimizer_states"], full["optimizer_states"]
    assert o["param_groups"] == f["param_groups"]
    assert o["lightning_zero"] == f["lightning_zero"]
    assert o["state"].keys() == f["state"].keys()
    for index, entry in f["state"].items():
        assert o["state"][index].keys() == entry.keys()
        for key, value in entry.items():
            assert torch.equal(o["state"][index][key], value), (index, key)


def test_consolidated_file_resumes_under_ddp(world2):
    for r in world2:
        case = r["consolidated_to_ddp"]
        assert "ok" in case, case
        assert_resumed_like(case["ok"], r["ref"])


def test_consolidate_weights_only_loads_without_lightning_zero(ckpt_dir, tmp_path):
    import subprocess
    import sys

    cli = [sys.executable, "-m", "lightning_zero.consolidate", f"{ckpt_dir}/a.ckpt", "--weights-only",
           str(tmp_path / "w.pt")]
    done = subprocess.run(cli, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert "wrote" in done.stdout
    # a fresh interpreter that never imports lightning_zero: torch + the plain module class
    script = ("import sys, torch\nfrom torch import nn\n"
              "class M(nn.Module):  # TinyLM's layers, as plain torch\n"
              "    def __init__(s):\n"
              "        super().__init__(); s.emb = nn.Embedding(37, 24); s.fc1 = nn.Linear(24, 48)\n"
              "        s.fc2 = nn.Linear(48, 24); s.shared = nn.Linear(24, 24); s.frozen = nn.Linear(24, 24)\n"
              "        s.norm = nn.LayerNorm(24); s.head = nn.Linear(24, 37, bias=False); s.head.weight = s.emb.weight\n"
              f"sd = torch.load({str(tmp_path / 'w.pt')!r}, weights_only=True)\n"
              "print(M().load_state_dict(sd)); assert 'lightning_zero' not in sys.modules")
    plain = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).parent.parent)
    assert plain.returncode == 0 and "All keys matched" in plain.stdout, plain.stderr[-2000:]


@pytest.fixture(scope="module")
def consolidate_errors(world2, ckpt_dir, tmp_path_factory):  # world2 writes the checkpoints
    """The consolidate CLI on each bad input, all at once (each is mostly importing torch)."""
    import subprocess
    import sys

    tmp_path = tmp_path_factory.mktemp("consolidate_errors")
    cases = {"file_as_dir": [f"{ckpt_dir}/full.ckpt", str(tmp_path / "o.ckpt")],
             "missing": [str(tmp_path / "nope.ckpt"), str(tmp_path / "o.ckpt")],
             "out_is_dir": [f"{ckpt_dir}/a.ckpt", str(tmp_path)],
             "no_output": [f"{ckpt_dir}/a.ckpt"]}
    procs = {case: subprocess.Popen([sys.executable, "-m", "lightning_zero.consolidate", *args],
                                    stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for case, args in cases.items()}
    out = {}
    for case, proc in procs.items():
        stdout, stderr = proc.communicate(timeout=180)
        out[case] = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    return out


@pytest.mark.parametrize("case", ["file_as_dir", "missing", "out_is_dir", "no_output"])
def test_consolidate_bad_input_is_one_line(consolidate_errors, case):
    done = consolidate_errors[case]
    assert done.returncode == 2
    assert "Traceback" not in done.stderr
    last = done.stderr.strip().splitlines()[-1]
    expected = {"file_as_dir": "is a file", "missing": "does not exist", "out_is_dir": "is a directory",
                "no_output": "give OUT.ckpt"}[case]
    assert expected in last, done.stderr
