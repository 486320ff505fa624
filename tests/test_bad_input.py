"""Bad input, as a new user types it: every case either runs or ends in one line naming the problem (exit 2),
never a traceback and never a silent change of meaning; the app resumes with ckpt_path=PATH|last."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
from dist_utils import job_env

REPO_ROOT = Path(__file__).resolve().parents[1]
QUICK = ("trainer.max_steps=2", "sample_chars=0", "trainer.enable_progress_bar=false", "trainer.logger=false")


def _env(**env: str) -> dict:
    return job_env(PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]),
                   PYTHONWARNINGS="ignore", **env)


def _run(module: str, *args: str, cwd: Path, timeout: float = 300, **env: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", module, *args], cwd=cwd, env=_env(**env), capture_output=True,
                          text=True, timeout=timeout)


def _run_all(module: str, cases: list[tuple[str, ...]], root: Path, timeout: float = 300,
             envs: list[dict] | None = None) -> list:
    """``_run`` for every case at once, each in its own directory (``envs``: extra environment per case): the
    processes spend most of their time importing torch and Lightning, which runs side by side."""
    procs = []
    for i, args in enumerate(cases):
        cwd = root / f"case{i}"
        cwd.mkdir()
        procs.append(subprocess.Popen([sys.executable, "-m", module, *args], cwd=cwd, env=_env(**(envs or [{}] * len(cases))[i]),
                                      stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True))
    out = []
    for proc in procs:
        stdout, stderr = proc.communicate(timeout=timeout)
        out.append(subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr))
    return out


def _one_line_error(out: subprocess.CompletedProcess, needle: str) -> None:
    assert out.returncode == 2, (out.returncode, out.stdout[-2000:], out.stderr[-3000:])
    errors = [line for line in out.stderr.splitlines() if "error:" in line]
    assert len(errors) == 1, out.stderr[-3000:]  # one line, from rank 0 only
    assert needle in errors[0], errors[0]
    assert "Traceback" not in out.stderr, out.stderr[-3000:]


@pytest.fixture(scope="module")
def jsons(tmp_path_factory):
    d = tmp_path_factory.mktemp("json")
    files = {"syntax.json": "{ stage: 2 }", "stage5.json": {"zero_optimization": {"stage": 5}},
             "both.json": {"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}, "bf16": {"enabled": True}},
             "misspelt.json": {"zero_optimisation": {"stage": 3}},
             "clip.json": {"zero_optimization": {"stage": 2}, "gradient_clipping": 0.5}}
    for name, body in files.items():
        (d / name).write_text(body if isinstance(body, str) else json.dumps(body))
    return d


APP_ERRORS = [
    (("strategy=deepspeed",), "strategy.deepspeed_config=PATH"),
    (("strategy=deepspeed", "strategy.deepspeed_config=nope.json"), "'nope.json' does not exist"),
    (("strategy=deepspeed", "strategy.deepspeed_config={d}/misspelt.json"), "did you mean 'zero_optimization'"),
    (("strategy=zero3_offload_nvme",), "strategy.nvme_path"),
    (("strategy=deepspeed", f"strategy.deepspeed_config={REPO_ROOT}/examples/ds_config_tiny.json",
      "data.batch_size=8"), "data.batch_size"),
    (("strategy=deepspeed", "strategy.deepspeed_config={d}/clip.json", "trainer.gradient_clip_val=2.0"),
     "keep one of them"),
    (("ckpt_path=/no/such/ckpt",), "no such file or directory"),
    (("ckpt_path=last",), "no checkpoint under"),
]


@pytest.fixture(scope="module")
def app_errors(tmp_path_factory, jsons):
    """Every bad invocation, then (last two) the traceback on request and the JSON's clipping, side by side."""
    cases = [(*(a.format(d=jsons) for a in args), *QUICK) for args, _ in APP_ERRORS]
    cases += [("strategy=deepspeed", *QUICK), ("strategy=deepspeed", f"strategy.deepspeed_config={jsons}/clip.json",
                                               *QUICK)]
    envs = [{}] * len(APP_ERRORS) + [{"HYDRA_FULL_ERROR": "1"}, {}]
    return _run_all("lightning_zero.train", cases, tmp_path_factory.mktemp("app_errors"), envs=envs)


@pytest.mark.slow
@pytest.mark.parametrize("case", range(len(APP_ERRORS)), ids=[needle for _, needle in APP_ERRORS])
def test_app_errors_are_one_line(app_errors, case):
    _one_line_error(app_errors[case], APP_ERRORS[case][1])


@pytest.mark.slow
def test_app_traceback_on_request(app_errors):
    out = app_errors[len(APP_ERRORS)]  # HYDRA_FULL_ERROR=1
    assert out.returncode != 0 and "Traceback" in out.stderr and "deepspeed_config" in out.stderr


@pytest.mark.slow
def test_json_clipping_wins_over_the_apps_default(app_errors):
    """The app's own default gradient_clip_val (1.0) is not the user's choice: the JSON's 0.5 stands."""
    out = app_errors[len(APP_ERRORS) + 1]
    assert out.returncode == 0, out.stderr[-3000:]


@pytest.mark.slow
def test_app_resumes_from_path_and_last(tmp_path):
    common = ("trainer.val_check_interval=4", "trainer.enable_checkpointing=true", "sample_chars=0",
              "trainer.enable_progress_bar=false")
    first = _run("lightning_zero.train", "trainer.max_steps=8", *common, cwd=tmp_path)
    assert first.returncode == 0, first.stderr[-3000:]
    saved = sorted(tmp_path.glob("outputs/*/*/**/*.ckpt"))
    assert saved, first.stderr[-2000:]
    last = _run("lightning_zero.train", "trainer.max_steps=12", "ckpt_path=last", *common, cwd=tmp_path)
    assert last.returncode == 0, last.stderr[-3000:]
    line = next(x for x in (last.stdout + last.stderr).splitlines() if "finished step" in x)
    assert "finished step 12/12" in line and re.search(r"resumed from \S+step=8\.ckpt at step 8", line), line
    # Hydra's grammar wants a value holding '=' (Lightning's checkpoint names) quoted
    explicit = _run("lightning_zero.train", "trainer.max_steps=10", f"ckpt_path='{saved[0]}'", *common, cwd=tmp_path)
    assert explicit.returncode == 0, explicit.stderr[-3000:]
    line = next(x for x in (explicit.stdout + explicit.stderr).splitlines() if "finished step" in x)
    assert "finished step 10/10" in line and f"resumed from {saved[0]}" in line, line


ESTIMATOR_ERRORS = [
    (("--params", "-5"), "--params -5"), (("--params", "7e9", "--gpu-mem", "-10"), "--gpu-mem -10"),
    (("--params", "7e9", "--activations", "-3"), "--activations -3"),
    (("--params", "7e9", "--gpus-per-node", "0"), "--gpus-per-node 0"), (("--params", "nan"), "--params nan"),
    (("--params", "7e9", "--precision", "int8"), "--precision 'int8'"), (("--params", "abc"), "invalid float"),
    (("model=nonexistent",), "model=nonexistent"),
]


@pytest.fixture(scope="module")
def estimator_errors(tmp_path_factory):
    return _run_all("lightning_zero.estimate", [args for args, _ in ESTIMATOR_ERRORS],
                    tmp_path_factory.mktemp("estimator_errors"))


@pytest.mark.parametrize("case", range(len(ESTIMATOR_ERRORS)), ids=[needle for _, needle in ESTIMATOR_ERRORS])
def test_estimator_refuses_impossible_input(estimator_errors, case):
    _one_line_error(estimator_errors[case], ESTIMATOR_ERRORS[case][1])


def test_estimator_fp32_is_32_true(capsys):
    from lightning_zero.estimate import main

    outs = []
    for p in ("fp32", "32-true", "bf16-mixed"):
        assert main(["--params", "7e9", "--gpus-per-node", "8", "--gpu-mem", "80", "--precision", p]) == 0
        outs.append(capsys.readouterr().out)
    body = [o.split("\n", 1)[1] for o in outs]
    assert body[0] == body[1] and body[0] != body[2]  # fp32's figures, not bf16's
    assert "32-true" in outs[0].splitlines()[0]


def test_strategy_takes_a_preset_name_or_refuses_at_once():
    from lightning_zero import ZeroStrategy
    from lightning_zero.config import ZeroConfigError

    assert ZeroStrategy("zero3").config.stage == 3
    assert ZeroStrategy("zero2_offload", prefetch=2).config.offload_optimizer == "cpu"
    assert ZeroStrategy({"stage": 1}).config.stage == 1
    for bad, needle in (("zero4", "did you mean 'zero3'"), (3, "got int"), ({"stag": 3}, "Did you mean 'stage'")):
        with pytest.raises(ZeroConfigError, match=needle) as err:
            ZeroStrategy(bad)
        assert "\n" not in str(err.value)


def test_a_sharded_optimizers_state_dict_names_the_consolidated_way():
    """optimizer.state_dict() of an engine-wrapped optimizer is an error that names the call that does work
    (full_optimizer_state_dict, a collective), and that call then gives the state."""
    import lightning.pytorch as pl
    import torch
    from lightning.pytorch.demos.boring_classes import BoringModel

    import lightning_zero

    seen = {}

    class Read(pl.Callback):
        def on_train_end(self, trainer, pl_module):
            optimizer = trainer.optimizers[0]
            with pytest.raises(RuntimeError) as caught:
                optimizer.state_dict()
            seen["message"] = str(caught.value)
            seen["full"] = trainer.strategy.full_optimizer_state_dict(optimizer)

    trainer = pl.Trainer(accelerator="cpu", devices=1, strategy=lightning_zero.ZeroStrategy(stage=2), max_steps=2,
                         logger=False, enable_checkpointing=False, enable_progress_bar=False,
                         enable_model_summary=False, callbacks=[Read()])
    class WithAdam(BoringModel):
        def configure_optimizers(self):
            return torch.optim.AdamW(self.parameters(), lr=0.1)

    trainer.fit(WithAdam())
    assert "trainer.strategy.full_optimizer_state_dict(optimizer)" in seen["message"]
    entries = list(seen["full"]["state"].values())
    assert entries and all(torch.is_tensor(e["exp_avg"]) and float(e["step"]) == 2 for e in entries)


def test_initialize_calls_an_optimizer_class_and_names_a_scheduler_class_that_needs_more():
    """DeepSpeed's rule: optimizer=/lr_scheduler= callables (classes included) are called with the parameters /
    the optimizer; one that needs more arguments is a one-line error naming partial, not an AttributeError."""
    import functools

    import torch

    import lightning_zero

    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    model = torch.nn.Linear(8, 2)
    engine, optimizer, _, _ = lightning_zero.initialize(model=model, model_parameters=model.parameters(),
                                                        optimizer=torch.optim.AdamW, config=config)
    assert isinstance(optimizer, torch.optim.AdamW)
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    engine.step()
    model = torch.nn.Linear(8, 2)
    with pytest.raises(ValueError, match=r"lr_scheduler='StepLR' is called with the optimizer .*step_size.*partial"):
        lightning_zero.initialize(model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1),
                                  lr_scheduler=torch.optim.lr_scheduler.StepLR, config=config)
    model = torch.nn.Linear(8, 2)
    _, _, _, scheduler = lightning_zero.initialize(
        model=model, optimizer=torch.optim.SGD(model.parameters(), lr=0.1), config=config,
        lr_scheduler=functools.partial(torch.optim.lr_scheduler.StepLR, step_size=1))
    assert isinstance(scheduler, torch.optim.lr_scheduler.StepLR)


@pytest.mark.parametrize("config", ["ds_config.json", {"zero_optimization": {"stage": 3}}])
def test_a_deepspeed_config_given_as_config_names_deepspeed_config(config):
    # Lightning's DeepSpeedStrategy(config=...) takes the JSON; here it is deepspeed_config=
    import lightning_zero

    with pytest.raises(lightning_zero.ZeroConfigError, match=r"pass it as ZeroStrategy\(deepspeed_config=\.\.\.\)"):
        lightning_zero.ZeroStrategy(config=config)


def test_engine_load_checkpoint_given_the_tag_directory_names_the_parent_and_tag(tmp_path):
    """load_checkpoint(save_dir/tag) without a tag would find no 'latest' and train from scratch behind a warning
    (DeepSpeed's rule for a first start); a directory that is itself a checkpoint is an error naming the call."""
    import warnings

    import torch

    import lightning_zero

    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = lightning_zero.initialize(model=torch.nn.Linear(8, 2), config=config)
    engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
    engine.step()
    engine.save_checkpoint(str(tmp_path), tag="step1")
    with pytest.raises(FileNotFoundError, match=r"that is a checkpoint itself.*tag='step1'"):
        engine.load_checkpoint(str(tmp_path / "step1"))
    assert engine.load_checkpoint(str(tmp_path))[0] == str(tmp_path / "step1")  # the save_dir: 'latest' names it
    with warnings.catch_warnings(record=True) as caught:  # a first start: nothing there yet
        warnings.simplefilter("always")
        assert engine.load_checkpoint(str(tmp_path / "fresh")) == (None, None)
    assert any("Unable to find a 'latest' file" in str(w.message) for w in caught)


def test_engine_save_inside_an_accumulation_window_warns_that_its_gradients_are_not_saved(tmp_path):
    import warnings

    import torch

    import lightning_zero

    config = {"train_micro_batch_size_per_gpu": 4, "gradient_accumulation_steps": 2, "zero_optimization": {"stage": 2},
              "optimizer": {"type": "SGD", "params": {"lr": 0.1}}}
    engine, *_ = lightning_zero.initialize(model=torch.nn.Linear(8, 2), config=config)
    seen = []
    for micro in range(2):
        engine.backward(engine(torch.randn(4, 8)).pow(2).mean())
        engine.step()
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            engine.save_checkpoint(str(tmp_path), tag=f"m{micro}")
        seen.append(any("accumulation window" in str(w.message) for w in caught))
    assert seen == [True, False]  # after 1 of 2 micro-batches it warns; at the boundary it does not
