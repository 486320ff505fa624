"""Property-based fuzzing of what people type: ZeroConfig fields (the Hydra ``strategy.*`` overrides and the
strategy's keyword arguments), DeepSpeed JSON values and the estimator's flags. Every input either works or
ends in one error of ours whose message is one line naming the key; nothing else escapes."""

from __future__ import annotations

import contextlib
import io
import math

import pytest

hypothesis = pytest.importorskip("hypothesis")
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

from lightning_zero.config import ZeroConfig, field_names  # noqa: E402
from lightning_zero.ds_config import import_deepspeed_config  # noqa: E402
from lightning_zero.errors import user_errors  # noqa: E402

SETTINGS = settings(max_examples=400, deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])

scalars = st.one_of(st.none(), st.booleans(), st.integers(-10**12, 10**12), st.floats(allow_nan=True),
                    st.sampled_from(["auto", "true", "false", "True", "0", "1", "cpu", "nvme", "none", "fp32", "bf16",
                                     "", "3", "1e6", "sharded", "hold", "advance", "device", "host"]),
                    st.text(max_size=8))
values = st.one_of(scalars, st.lists(scalars, max_size=3))


def _one_line_of_ours(err: BaseException) -> None:
    assert isinstance(err, user_errors()), f"{type(err).__name__}: {err}"
    message = str(err)
    assert message and "\n" not in message, message


@SETTINGS
@given(st.dictionaries(st.sampled_from(field_names()), values, max_size=4))
def test_zero_config_fields(fields):
    try:
        config = ZeroConfig.from_dict(fields)
    except Exception as err:  # noqa: BLE001 - the property: only our one-line errors
        _one_line_of_ours(err)
        return
    for key, value in fields.items():  # accepted: the value means what was typed (no silent coercion)
        got = getattr(config, key)
        if isinstance(value, float) and math.isnan(value):
            pytest.fail(f"{key}=nan accepted")
        if isinstance(got, tuple):  # a list of class names; one name alone is a list of one
            value = (value,) if isinstance(value, str) else tuple(value)
        assert got == value, (key, value, got)


KNOWN = {
    "zero_optimization": ["stage", "overlap_comm", "reduce_bucket_size", "stage3_param_persistence_threshold",
                          "stage3_prefetch_bucket_size", "cpu_offload", "offload_optimizer", "offload_param",
                          "contiguous_gradients", "sub_group_size"],
    "fp16": ["enabled", "loss_scale", "initial_scale_power", "loss_scale_window", "hysteresis", "min_loss_scale"],
    "bf16": ["enabled"],
    "optimizer": ["type", "params"],
    "scheduler": ["type", "params"],
}
TOP = ["train_batch_size", "train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping",
       "zero_allow_untested_optimizer", "steps_per_print"]


@st.composite
def deepspeed_configs(draw):
    config = {}
    for key in draw(st.lists(st.sampled_from(TOP), max_size=3, unique=True)):
        config[key] = draw(scalars)
    for section in draw(st.lists(st.sampled_from(list(KNOWN)), max_size=3, unique=True)):
        body = {}
        for key in draw(st.lists(st.sampled_from(KNOWN[section]), max_size=3, unique=True)):
            if key in ("offload_optimizer", "offload_param"):
                body[key] = {"device": draw(st.sampled_from(["cpu", "nvme", "none", "gpu", "auto"])),
                             "pin_memory": draw(scalars)}
            elif key == "params":
                body[key] = {"lr": draw(scalars), "weight_decay": draw(scalars)}
            elif key == "type":
                body[key] = draw(st.sampled_from(["Adam", "AdamW", "SGD", "Lamb", "WarmupLR", "OneCycle", "x"]))
            else:
                body[key] = draw(scalars)
        config[section] = body
    return config


@SETTINGS
@given(deepspeed_configs())
def test_deepspeed_json_values(config):
    try:
        imported = import_deepspeed_config(config)
    except Exception as err:  # noqa: BLE001
        _one_line_of_ours(err)
        return
    fp16 = config.get("fp16", {}).get("enabled")
    if fp16 in (False, "false", 0, "0") or fp16 is None:
        assert imported.precision != "16-mixed"  # a false-looking flag never turns fp16 on
    if imported.precision == "16-mixed":
        assert fp16 in (True, "true", "True", 1, "1")


estimator_numbers = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.integers(-5, 10**13),
                              st.sampled_from(["abc", "", "1e9", "-0"]))


@SETTINGS
@given(st.fixed_dictionaries({}, optional={"--params": estimator_numbers, "--gpu-mem": estimator_numbers,
                                           "--host-mem": estimator_numbers, "--nvme": estimator_numbers,
                                           "--gpus-per-node": estimator_numbers, "--nodes": estimator_numbers,
                                           "--activations": estimator_numbers, "--batch": estimator_numbers,
                                           "--accumulate": estimator_numbers,
                                           "--precision": st.sampled_from(["fp32", "32-true", "bf16", "int8", "x"])}))
def test_estimator_flags(flags):
    from lightning_zero.estimate import main

    argv = [str(x) for kv in flags.items() for x in kv]
    err, out = io.StringIO(), io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(out):
        try:
            code = main(argv)
        except SystemExit as exit_:
            code = exit_.code
    message = err.getvalue().strip()
    if code == 0:
        assert "fits" in out.getvalue() and not message
    else:
        assert code == 2 and message.count("\n") == 0 and "error:" in message, message


tokens = st.one_of(st.sampled_from(["abc", "1.5", "-1", "0", "3", "true", "false", "null", "[]", "[Block]", "[1,2]",
                                    "cpu", "nvme", "auto", "1e9", "'x y'", "hold", "sharded", "fp32"]),
                   st.integers(-3, 10**9).map(str))


@settings(SETTINGS, max_examples=60)  # each composes a Hydra config
@given(st.lists(st.tuples(st.sampled_from(field_names()), tokens), min_size=1, max_size=3))
def test_hydra_strategy_overrides(pairs):
    """``strategy.FIELD=VALUE`` as typed on the command line: the app's pre-check or ZeroConfig names it in one
    line, or the composed config builds the strategy (never Hydra's multi-line composition error)."""
    from hydra import compose, initialize_config_dir

    from lightning_zero import train
    from lightning_zero.config import ZeroConfigError

    overrides = [f"strategy.{k}={v}" for k, v in dict(pairs).items()]
    try:
        train.check_overrides(overrides)
    except ZeroConfigError as err:
        _one_line_of_ours(err)
        return
    with initialize_config_dir(config_dir=str(train.CONF_DIR), version_base="1.3"):
        cfg = compose("config", overrides=overrides)  # the pre-check let it through: Hydra accepts it too
    try:
        train.strategy_options(cfg.strategy)
    except Exception as err:  # noqa: BLE001
        _one_line_of_ours(err)
