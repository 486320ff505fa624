"""The Hydra app: composition with overrides, the strategy node == ZeroConfig, clear errors, one real run."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import job_env
from hydra import compose, initialize_config_dir
from hydra.errors import ConfigCompositionException
from omegaconf import OmegaConf

from lightning_zero.config import ZeroConfig, ZeroConfigError, field_names

REPO_ROOT = Path(__file__).resolve().parents[1]
CONF = REPO_ROOT / "conf"
train = pytest.importorskip("lightning_zero.train")  # registers the strategy schema in the ConfigStore


def _compose(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("config", overrides=list(overrides))


def _start_app(*args: str, cwd: Path, **env: str) -> subprocess.Popen:
    # PYTHONPATH: the package is run from a checkout (it need not be installed).
    environ = job_env(PYTHONPATH=os.pathsep.join([str(REPO_ROOT), os.environ.get("PYTHONPATH", "")]), **env)
    return subprocess.Popen([sys.executable, "-m", "lightning_zero.train", *args], cwd=cwd, env=environ,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def _finish(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def _app(*args: str, cwd: Path, timeout: float) -> subprocess.CompletedProcess:
    return _finish(_start_app(*args, cwd=cwd), timeout)


# ---- composition -----------------------------------------------------------------------------------
def test_default_job() -> None:
    cfg = _compose()
    assert train.strategy_options(cfg.strategy) == (ZeroConfig(stage=2), None)
    assert cfg.trainer.accelerator == "auto" and cfg.trainer.devices == "auto"
    assert cfg.trainer.precision == "32-true"
    assert cfg.model.seq_len == cfg.data.seq_len  # one number, interpolated
    assert OmegaConf.load(CONF / "config.yaml").hydra.job.chdir is False  # `examples` resolves from the launch dir


def test_overrides_compose() -> None:
    cfg = _compose("strategy=zero1", "trainer.devices=2", "trainer.precision=bf16-mixed",
                   "strategy.reduce_bucket_size=1000000", "trainer.max_steps=20")
    assert cfg.trainer.devices == 2 and cfg.trainer.precision == "bf16-mixed" and cfg.trainer.max_steps == 20
    assert train.strategy_options(cfg.strategy)[0] == ZeroConfig(stage=1, reduce_bucket_size=1_000_000)


def test_tuple_fields_from_the_command_line() -> None:
    cfg = _compose("strategy=zero3", "strategy.wrap_modules=[Block]", "strategy.reduce_dtype=bf16")
    config, _ = train.strategy_options(cfg.strategy)
    assert config.wrap_modules == ("Block",) and config.reduce_dtype == "bf16" and config.shard_params


@pytest.mark.parametrize("option", ["32-true", "bf16-mixed", "16-mixed", "bf16-true"])
def test_precision_group(option: str) -> None:
    assert _compose(f"precision={option}").trainer.precision == option


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_strategy_option_builds_the_strategy(stage: int) -> None:
    from lightning_zero import ZeroStrategy

    strategy = train.build_strategy(_compose(f"strategy=zero{stage}").strategy)
    assert isinstance(strategy, ZeroStrategy) and strategy.config == ZeroConfig(stage=stage)


def test_model_and_data_instantiate() -> None:
    from hydra.utils import instantiate

    cfg = _compose("model.n_layer=1", "model.d_model=32", "model.n_head=2", "data.train_windows=8", "data.batch_size=4")
    dm = instantiate(cfg.data)
    model = instantiate(cfg.model, vocab_size=dm.vocab_size)
    dm.setup("fit")
    x, _ = next(iter(dm.train_dataloader()))
    assert model(x).shape == (*x.shape, dm.vocab_size)


# ---- the strategy YAMLs are ZeroConfig ------------------------------------------------------------
@pytest.mark.parametrize("stage", [1, 2, 3])
def test_strategy_yaml_fields_are_zeroconfig_fields(stage: int) -> None:
    path = CONF / "strategy" / f"zero{stage}.yaml"
    node = OmegaConf.load(path)
    assert [k for k in node if k != "defaults"] == field_names()
    assert path.read_text() == train.strategy_yaml(stage), "regenerate: lightning_zero.train.write_strategy_yamls()"


def test_schema_mirrors_zeroconfig() -> None:
    schema = OmegaConf.to_container(OmegaConf.structured(train.zero_schema()))
    assert schema.pop("deepspeed_config") is None  # the one extra key: a ds_config.json path
    assert schema == OmegaConf.to_container(OmegaConf.create(ZeroConfig().to_dict()))


# ---- errors ----------------------------------------------------------------------------------------
def test_bad_key_is_named_with_the_valid_options() -> None:
    with pytest.raises(ZeroConfigError, match=r"'stagee'.*Did you mean 'stage'.*Valid options: stage, "):
        train.check_overrides(["strategy=zero1", "strategy.stagee=2"])
    train.check_overrides(["strategy.stage=3", "+trainer.detect_anomaly=true", "hydra.run.dir=x", "seed=7", "--cfg",
                           "job"])  # no complaint
    with pytest.raises(ConfigCompositionException):  # composed directly, the schema rejects it
        _compose("strategy.stagee=2")
    with pytest.raises(ZeroConfigError, match="'stagee'"):  # `+` forces it past the schema: ZeroConfig stops it
        train.build_strategy(_compose("+strategy.stagee=2").strategy)


@pytest.mark.parametrize("arg,needle", [("+zero.stage=3", "'zero.stage' is not a setting of this app. Top-level"),
                                        ("+strategyy.stage=3", "did you mean 'strategy'?"),
                                        ("+trainer.max_step=5", "did you mean 'trainer.max_steps'?"),
                                        ("trainer.max_step=5", "is not an argument of Lightning's Trainer"),
                                        ("seed=abc", "seed=abc is not a whole number")])
def test_a_key_nothing_reads_or_a_number_that_is_not_one_is_named(arg: str, needle: str) -> None:
    with pytest.raises(ZeroConfigError) as err:  # Hydra would add the first two silently; the rest fail deep in the job
        train.check_overrides([arg])
    assert needle in str(err.value)


@pytest.mark.parametrize("arg,needle", [("strategy=zero9", "strategy=zero9 is not an option of 'strategy' — did you "
                                                         "mean 'zero3'? Options: deepspeed, zero1,"),
                                        ("strategy=_zero_schema", "not an option"),  # the schema is internal
                                        ("strategy=zero1,zero5", "strategy=zero5 is not an option"),
                                        ("model=gpt_tny", "did you mean 'gpt_tiny'")])
def test_a_wrong_group_option_is_named_with_the_options(arg: str, needle: str) -> None:
    with pytest.raises(ZeroConfigError) as err:
        train.check_overrides([arg])
    assert needle in str(err.value) and "_zero_schema," not in str(err.value)
    train.check_overrides(["strategy=zero1,zero3", "model=gpt_small", "precision=bf16-mixed"])  # no complaint


def test_bad_value_is_a_zeroconfig_error() -> None:
    with pytest.raises(ZeroConfigError, match="stage"):
        train.build_strategy(_compose("strategy.stage=5").strategy)


def test_bad_key_on_the_command_line_is_one_line(tmp_path: Path) -> None:
    out = _app("strategy.stagee=2", cwd=tmp_path, timeout=120)
    assert out.returncode == 2
    lines = out.stderr.strip().splitlines()
    assert len(lines) == 1 and "stagee" in lines[0] and "Valid options" in lines[0], out.stderr
    assert "Traceback" not in out.stderr


@pytest.mark.parametrize("override,needle", [("data.batch_size=0", "data.batch_size=0 is invalid"),
                                             ("data.seq_len=-3", "data.seq_len=-3 is invalid"),
                                             ("model.d_model=65", "model.d_model=65 is invalid: it must be a whole "
                                                                  "number that model.n_head=4 divides"),
                                             ("strategy=zero3 strategy.wrap_modules=[Blok]", "wrap_modules names ['Blok'], which "
                                                                              "match no module of the model"),
                                             ("trainer.precision=64-true", "ZeroStrategy cannot run with the "
                                                                           "precision plugin")])
def test_a_bad_model_or_data_value_is_one_line(tmp_path: Path, override: str, needle: str) -> None:
    out = _app(*override.split(), cwd=tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr[-2000:]
    lines = out.stderr.strip().splitlines()
    assert lines[-1].startswith("error: ") and needle in lines[-1], out.stderr[-2000:]
    assert "Traceback" not in out.stderr


# ---- devices ---------------------------------------------------------------------------------------
def test_resolve_devices(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert train.resolve_devices("auto", "auto", 2) == ("cpu", 2)
    assert train.resolve_devices("cpu", 3, 2) == ("cpu", 3)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 4)
    assert train.resolve_devices("auto", "auto", 2) == ("gpu", 4)
    assert train.resolve_devices("auto", [0, 1], 2) == ("gpu", [0, 1])


# ---- end to end ------------------------------------------------------------------------------------
SMOKE = ("trainer.devices=2", "trainer.max_steps=4", "trainer.val_check_interval=2", "trainer.limit_val_batches=1",
         "model.n_layer=1", "model.d_model=64", "model.n_head=2", "progress_every=2", "throughput_window=2",
         "trainer.log_every_n_steps=2",
         "sample_chars=20")


@pytest.mark.parametrize("name,field,value", [("zero2_offload", "offload_optimizer", "cpu"),
                                              ("zero3_offload", "offload_params", "cpu"),
                                              ("zero3_offload_nvme", "offload_params", "nvme"),
                                              ("zero_auto", "auto_placement", True)])
def test_offload_presets_compose(name: str, field: str, value: object) -> None:
    strategy = train.build_strategy(_compose(f"strategy={name}").strategy)
    assert getattr(strategy.config, field) == value


def test_deepspeed_entry_reads_the_json() -> None:
    path = Path(__file__).resolve().parents[1] / "examples" / "ds_config_tiny.json"
    strategy = train.build_strategy(_compose("strategy=deepspeed", f"strategy.deepspeed_config={path}").strategy)
    assert strategy.config.offload_optimizer == "cpu" and strategy.deepspeed.gradient_clip_val == 1.0


def test_what_the_user_typed_wins_over_the_deepspeed_json() -> None:
    """The JSON (stage 2, CPU offload) wins over the YAML's defaults, not over strategy.KEY=... typed on the command
    line, nor over the fields of a preset named there."""
    path = Path(__file__).resolve().parents[1] / "examples" / "ds_config_tiny.json"
    typed = ("strategy=deepspeed", f"strategy.deepspeed_config={path}", "strategy.stage=3", "strategy.prefetch=2")
    strategy = train.build_strategy(_compose(*typed).strategy, frozenset({"strategy.stage", "strategy.prefetch"}),
                                    "deepspeed")
    assert (strategy.config.stage, strategy.config.prefetch, strategy.config.offload_optimizer) == (3, 2, "cpu")
    strategy = train.build_strategy(_compose("strategy=zero3", f"+strategy.deepspeed_config={path}").strategy,
                                    frozenset({"strategy"}), "zero3")
    assert (strategy.config.stage, strategy.config.offload_optimizer) == (3, "none")
    assert strategy.deepspeed.gradient_clip_val == 1.0  # the rest still from the JSON


TRAIN_CASES = {"zero2-fp32": (),
               "zero1-bf16": ("strategy=zero1", "trainer.precision=bf16-mixed", "strategy.reduce_bucket_size=1000000"),
               "zero3-sample-after-fit": ("strategy=zero3", "strategy.wrap_modules=[Block]"),
               "deepspeed-json-offload": ("strategy=deepspeed", "strategy.deepspeed_config=" + str(
                   Path(__file__).resolve().parents[1] / "examples" / "ds_config_tiny.json"))}


@pytest.fixture(scope="module")
def app_runs(tmp_path_factory):
    """The four jobs side by side (each mostly starts Python, torch and Lightning twice), each on its own port."""
    from dist_utils import free_port

    dirs = {name: tmp_path_factory.mktemp(name) for name in TRAIN_CASES}
    procs = {name: _start_app(*SMOKE, *extra, f"hydra.run.dir={dirs[name] / 'run'}", "trainer.accelerator=cpu",
                              cwd=dirs[name], MASTER_ADDR="127.0.0.1", MASTER_PORT=str(free_port()))
             for name, extra in TRAIN_CASES.items()}
    return {name: (dirs[name] / "run", _finish(proc, timeout=300)) for name, proc in procs.items()}


@pytest.mark.slow
@pytest.mark.parametrize("name", list(TRAIN_CASES))
def test_app_trains_on_two_cpu_ranks(app_runs, name: str) -> None:
    """The real app, started from another directory: Lightning re-launches it for rank 1 under Hydra."""
    run_dir, out = app_runs[name]
    extra = TRAIN_CASES[name]
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert re.search(r"finished step 4/4 +train/loss [0-9.]+ +val/loss [0-9.]+ +tokens/s [0-9,]+ +MFU n/a", text), \
        text[-4000:]  # ThroughputMonitor's tokens/s; no MFU on a CPU (peak FLOPs unknown)
    assert "4/4" in text and "it/s" in text  # Lightning's progress bar
    assert "lightning_zero memory report — rank 0/2" in text
    assert (run_dir / "train_ddp_process_1.log").is_file()  # rank 1 ran in the same output directory
    assert (run_dir / ".hydra" / "config.yaml").is_file()
    saved = OmegaConf.load(run_dir / ".hydra" / "config.yaml")
    assert saved.strategy.stage == (int(extra[0][-1]) if extra and extra[0][-1].isdigit() else 2)
    assert "sample:" in text  # rank 0 samples from the trained model (stage 3: a plain copy)


@pytest.mark.slow
def test_multirun_over_stages(tmp_path: Path) -> None:
    """``--multirun strategy=zero1,zero2,zero3``: three jobs, the same losses (fp32, same data)."""
    out = _app("--multirun", "strategy=zero1,zero2,zero3", *SMOKE, "sample_chars=0", "trainer.accelerator=cpu",
               f"hydra.sweep.dir={tmp_path / 'sweep'}", cwd=tmp_path, timeout=300)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    finals = re.findall(r"finished step 4/4\s+train/loss ([0-9.]+)", text)
    assert len(finals) == 3 and len(set(finals)) == 1, finals
    assert sorted(p.name for p in (tmp_path / "sweep").iterdir() if p.is_dir()) == ["0", "1", "2"]


@pytest.mark.parametrize("name", ["gpt2_124m", "gpt2_350m", "gpt2_774m", "gpt2_1558m", "gpt_2_7b", "gpt_6_7b",
                                  "gpt_13b"])
def test_model_presets_compose(name: str) -> None:
    cfg = _compose(f"model={name}")
    assert cfg.model.n_layer >= 12 and cfg.model.d_model % cfg.model.n_head == 0


@pytest.mark.slow
def test_profiler_trace_shows_zero_ranges(tmp_path: Path) -> None:
    """``trainer.profiler=pytorch``: the app says where the trace went; it holds the zero/* ranges."""
    run_dir = tmp_path / "run"
    out = _app(*SMOKE, "trainer.max_steps=6", "trainer.profiler=pytorch", "sample_chars=0",
               "trainer.enable_progress_bar=false", f"hydra.run.dir={run_dir}", "trainer.accelerator=cpu",
               cwd=tmp_path, timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    traces = re.search(r"profiler trace: (\S+\.json)", text)
    assert traces, text[-4000:]
    trace = Path(traces.group(1).rstrip(","))
    assert trace.is_file() and trace.parent == run_dir / "profile"
    body = trace.read_text()
    assert "zero/reduce_scatter[" in body and "zero/reduce_wait" in body
    assert "it/s" not in text  # progress bar off


@pytest.mark.slow
def test_app_from_an_installed_wheel(tmp_path: Path) -> None:
    """``pip install <wheel>`` (not editable), then ``lightning-zero-train`` in an empty directory:
    the configs and the example model/data come from the wheel, not from the checkout."""
    repo = Path(__file__).resolve().parents[1]
    build = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w",
                            str(tmp_path / "dist"), str(repo)], capture_output=True, text=True, timeout=300)
    assert build.returncode == 0, build.stderr[-3000:]
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "--no-deps", "-q",
                          *map(str, (tmp_path / "dist").glob("*.whl"))], capture_output=True, text=True, timeout=300)
    assert pip.returncode == 0, pip.stderr[-3000:]
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in job_env().items() if k != "PYTHONPATH"}
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import lightning_zero.train as t, lightning_zero.demo.gpt as g;"
                            "print(t.CONF_DIR); print(g.__file__)"], cwd=work, env=env, capture_output=True,
                           text=True, timeout=120)
    assert where.returncode == 0, where.stderr[-3000:]
    assert all(line.startswith(str(venv)) for line in where.stdout.split()), where.stdout
    out = subprocess.run([str(venv / "bin" / "lightning-zero-train"), *SMOKE, "trainer.accelerator=cpu",
                          f"hydra.run.dir={work / 'run'}"], cwd=work, env=env, capture_output=True, text=True,
                         timeout=240)
    text = out.stdout + out.stderr
    assert out.returncode == 0, text[-4000:]
    assert "finished step 4/4" in text and "sample:" in text
