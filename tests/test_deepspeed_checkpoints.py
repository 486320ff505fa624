"""DeepSpeed's own checkpoints load into lightning_zero without DeepSpeed installed: ZeRO 1/2/3 written at world
sizes 1, 2 and 4 (fp32, bf16, frozen parameters) by DeepSpeed's engine, and by Lightning's DeepSpeedStrategy
(tests/fixtures/deepspeed.tar.gz; tests/fixtures/make_deepspeed_fixtures.py wrote them). Through
``engine.load_checkpoint`` on 1 and 2 ranks at every stage, ``Trainer.fit(ckpt_path=...)`` and ``zero_to_fp32``;
DeepSpeed's LR schedules against DeepSpeed's own recorded values."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch
from deepspeed_checkpoint_cases import (
    FixtureModule,
    engine_dirs,
    expected,
    extract,
    fm,
    load_case,
    max_diff,
    reference_lightning_next_step,
    reference_next_step,
    trainer_resume_case,
)
from dist_utils import run_ranks

from lightning_zero.checkpoint.deepspeed_format import DeepSpeedCheckpoint
from lightning_zero.checkpoint.files import CheckpointPathError
from lightning_zero.ds_schedules import build_scheduler
from lightning_zero.utils.zero_to_fp32 import (
    convert_zero_checkpoint_to_fp32_state_dict,
    get_fp32_state_dict_from_zero_checkpoint,
    load_state_dict_from_zero_checkpoint,
)


@pytest.fixture(scope="module")
def fixtures(tmp_path_factory):
    root = extract(tmp_path_factory.mktemp("deepspeed"))
    names = sorted(p.name for p in root.iterdir())
    assert {"ds_stage1_world1", "ds_stage2_world4", "ds_stage3_world4", "ds_stage3_world2_bf16",
            "ds_stage3_world2_frozen", "lightning_stage2", "lightning_stage3", "schedules.pt"} <= set(names), names
    return root


def _full(exp: dict) -> dict:
    """The state dict DeepSpeed's values make (the head tied to the embedding)."""
    emb = next(k for k in exp["params"] if k.endswith("emb.weight"))
    return {**exp["params"], **exp["buffers"], emb.replace("emb.weight", "head.weight"): exp["params"][emb]}


def test_reader_gives_deepspeeds_values_exactly(fixtures):
    for path in engine_dirs(fixtures):
        exp = expected(path)
        ckpt = DeepSpeedCheckpoint(path)  # through its 'latest' file
        assert ckpt.path.name == f"global_step{fm.STEPS}" and ckpt.global_steps == fm.STEPS
        assert ckpt.client_state == {"note": "fixture"} and ckpt.lr_scheduler == {"last_batch_iteration": fm.STEPS - 1}
        weights = ckpt.weights()
        assert sorted(weights) == sorted(_full(exp)), path.name
        for k, v in _full(exp).items():
            assert torch.equal(weights[k], v), (path.name, k)
        state = ckpt.optimizer_state()
        names = state["lightning_zero"]["param_names"]
        assert sorted(names) == sorted(exp["exp_avg"]), path.name  # trainable only (frozen ones have no state)
        for i, name in enumerate(names):
            for key in ("exp_avg", "exp_avg_sq"):
                assert torch.equal(state["state"][i][key], exp[key][name]), (path.name, name, key)
            assert float(state["state"][i]["step"]) == fm.STEPS
        assert state["param_groups"][0]["lr"] == pytest.approx(exp["lr"])


def test_zero_to_fp32_on_deepspeed_directories(fixtures, tmp_path):
    for path in engine_dirs(fixtures) + [fixtures / "lightning_stage3" / "model.ckpt"]:
        exp = expected(path if path.name != "model.ckpt" else path.parent)
        want = _full(exp)  # Lightning's fixture: the LightningModule's names (net.*)
        got = get_fp32_state_dict_from_zero_checkpoint(path)
        assert max_diff(got, want) == 0.0, path
        out = convert_zero_checkpoint_to_fp32_state_dict(path, tmp_path / f"{path.parent.name}_{path.name}.bin")
        assert max_diff(torch.load(out), want) == 0.0
    # the console script, and the exclude_frozen_parameters switch
    frozen = fixtures / "ds_stage3_world2_frozen"
    out = tmp_path / "cli.bin"
    run = subprocess.run([sys.executable, "-m", "lightning_zero.utils.zero_to_fp32", str(frozen), str(out)],
                         capture_output=True, text=True)
    assert run.returncode == 0, run.stderr
    assert max_diff(torch.load(out), _full(expected(frozen))) == 0.0
    lean = get_fp32_state_dict_from_zero_checkpoint(frozen, exclude_frozen_parameters=True)
    assert "fc.weight" not in lean and "out.weight" in lean
    # into a plain model, with a prefix: DeepSpeed's names under a LightningModule's attribute
    plain = FixtureModule()
    load_state_dict_from_zero_checkpoint(plain, fixtures / "ds_stage2_world2")
    assert max_diff({f"net.{k}": v for k, v in _full(expected(fixtures / "ds_stage2_world2")).items()},
                    dict(plain.state_dict())) == 0.0


@pytest.mark.slow
@pytest.mark.parametrize("world", [1, 2])
def test_engine_loads_every_fixture_at_every_stage(fixtures, world):
    results = run_ranks(load_case, world, str(fixtures), [1, 2, 3])
    for path in engine_dirs(fixtures):
        exp = expected(path)
        reference = reference_next_step(path, world)
        for stage in (1, 2, 3):
            for r in results:
                got = r[(path.name, stage)]
                where = (path.name, stage, world)
                assert got["loaded"] == f"global_step{fm.STEPS}" and got["client"] == {"note": "fixture"}, where
                assert got["global_steps"] == fm.STEPS and got["iteration"] == fm.STEPS - 1, where
                assert got["lr"] == pytest.approx(exp["lr"]), where
                assert max_diff(got["state"], _full(exp)) == 0.0, where
                for name, moments in got["moments"].items():
                    for key in ("exp_avg", "exp_avg_sq"):
                        assert torch.equal(moments[key], exp[key][name]), (where, name, key)
                    assert float(moments["step"]) == fm.STEPS
                # the next step continues DeepSpeed's run: step count (bias correction) and lr position restored
                err = max_diff(got["after"], {k: v for k, v in reference.items() if k in got["after"]})
                assert err < 1e-6, (where, err)


@pytest.mark.slow
@pytest.mark.parametrize("stage", [1, 3])
def test_trainer_resumes_lightning_deepspeed_checkpoint(fixtures, stage):
    for ds_stage in (2, 3):
        path = fixtures / f"lightning_stage{ds_stage}"
        (r,) = run_ranks(trainer_resume_case, 1, str(path / "model.ckpt"), stage, lightning=True)
        # resumed after the saved steps: one step more, from the batch Lightning's restored loop picks
        assert r["global_step"] == fm.STEPS + 1 and len(r["seen"]) == 1
        assert max_diff({k: v for k, v in r["state"].items() if k.startswith("net.") and "bn.running" not in k
                         and "num_batches" not in k and k != "net.head.weight"},
                        reference_lightning_next_step(path, r["seen"][0])) < 1e-6


@pytest.mark.slow
def test_trainer_takes_weights_from_a_deepspeed_engine_checkpoint(fixtures):
    """A checkpoint of DeepSpeed's engine has no Lightning state: weights and optimizer load, the loop restarts
    (said in a warning)."""
    (r,) = run_ranks(trainer_resume_case, 1, str(fixtures / "ds_stage2_world1"), 2, lightning=True)
    assert len(r["seen"]) == fm.STEPS + 1 and r["global_step"] == fm.STEPS + 1  # from step 0 (a shuffled sampler)
    assert any("not by Lightning" in w for w in r["warnings"])


def test_schedules_match_deepspeeds_recording(fixtures):
    for record in torch.load(fixtures / "schedules.pt", weights_only=False):
        opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0, betas=(0.9, 0.999))
        sched = build_scheduler(opt, {"type": record["type"], "params": record["params"]})
        lrs, betas = [], []
        for _ in record["lr"]:
            lrs.append(opt.param_groups[0]["lr"])
            betas.append(tuple(opt.param_groups[0]["betas"]))
            opt.step()
            sched.step()
        assert lrs == pytest.approx(record["lr"], abs=1e-12), record["type"]
        assert betas == pytest.approx(record["betas"], abs=1e-12), record["type"]
        assert sched.state_dict()["last_batch_iteration"] == record["state"]["last_batch_iteration"]
        # DeepSpeed's saved state loads into ours: the lr (and betas) of the next step, as the schedule it left
        current = (opt.param_groups[0]["lr"], *opt.param_groups[0]["betas"])
        other = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(2))], lr=1.0, betas=(0.9, 0.999))
        again = build_scheduler(other, {"type": record["type"], "params": record["params"]})
        again.load_state_dict(record["state"])
        assert (other.param_groups[0]["lr"], *other.param_groups[0]["betas"]) == pytest.approx(current, abs=1e-12)


def test_damaged_and_incomplete_deepspeed_checkpoints_are_named(fixtures, tmp_path):
    broken = tmp_path / "broken"
    shutil.copytree(fixtures / "ds_stage3_world2", broken)
    tag = broken / f"global_step{fm.STEPS}"
    (tag / "zero_pp_rank_1_mp_rank_00_optim_states.pt").unlink()
    with pytest.raises(CheckpointPathError, match="incomplete"):
        DeepSpeedCheckpoint(broken)
    damaged = tmp_path / "damaged"
    shutil.copytree(fixtures / "ds_stage2_world2", damaged)
    target = damaged / f"global_step{fm.STEPS}" / "zero_pp_rank_0_mp_rank_00_optim_states.pt"
    target.write_bytes(target.read_bytes()[:200])
    with pytest.raises(CheckpointPathError, match="zero_pp_rank_0_mp_rank_00_optim_states.pt"):
        DeepSpeedCheckpoint(damaged)
    with pytest.raises(CheckpointPathError, match="not a DeepSpeed checkpoint"):
        DeepSpeedCheckpoint(tmp_path)


def test_load_from_checkpoint_reads_a_deepspeed_strategy_directory(fixtures):
    """LightningModule.load_from_checkpoint on the directory Lightning's DeepSpeedStrategy wrote."""
    path = fixtures / "lightning_stage3"
    module = FixtureModule.load_from_checkpoint(path / "model.ckpt")
    assert max_diff(dict(module.state_dict()), _full(expected(path))) == 0.0
