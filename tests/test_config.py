"""ZeroConfig: defaults, derived flags, validation messages, from_dict, normalisation, immutability."""

from __future__ import annotations

import dataclasses

import pytest

from lightning_zero.config import ZeroConfig, ZeroConfigError

FIELDS = [f.name for f in dataclasses.fields(ZeroConfig)]


def test_defaults_valid() -> None:
    cfg = ZeroConfig()
    assert cfg.stage == 2
    assert cfg.loss_scale == 0  # dynamic
    assert cfg.initial_scale_power == 16
    assert cfg.loss_scale_window == 1000
    assert cfg.hysteresis == 2
    assert cfg.min_loss_scale == 1.0
    assert cfg.wrap_modules == () and cfg.activation_checkpointing == ()
    assert issubclass(ZeroConfigError, ValueError)


@pytest.mark.parametrize(
    "stage, shard_grads, shard_params", [(1, False, False), (2, True, False), (3, True, True)]
)
def test_derived_flags(stage: int, shard_grads: bool, shard_params: bool) -> None:
    cfg = ZeroConfig(stage=stage)
    assert cfg.shard_optimizer is True
    assert cfg.shard_grads is shard_grads
    assert cfg.shard_params is shard_params


INVALID = [
    ("stage", 0),
    ("stage", 4),
    ("stage", -1),
    ("stage", "2"),
    ("reduce_bucket_size", 0),
    ("reduce_bucket_size", -1),
    ("reduce_bucket_size", 1.5),
    ("min_group_params", 0),
    ("min_group_params", -10),
    ("prefetch", -1),
    ("prefetch", 1.0),
    ("param_persistence_threshold", -1),
    ("initial_scale_power", -1),
    ("reduce_dtype", "int8"),
    ("reduce_dtype", "float64"),
    ("reduce_dtype", ""),
    ("loss_scale", -1.0),
    ("loss_scale", -0.5),
    ("loss_scale_window", 0),
    ("loss_scale_window", -5),
    ("loss_scale_window", 2.5),
    ("hysteresis", 0),
    ("hysteresis", -1),
    ("hysteresis", 1.5),
    ("min_loss_scale", 0.0),
    ("min_loss_scale", -1.0),
    ("collective_timeout_s", 0),
    ("collective_timeout_s", -1.0),
]


@pytest.mark.parametrize("name, value", INVALID, ids=[f"{n}={v!r}" for n, v in INVALID])
def test_invalid_value_names_the_field(name: str, value) -> None:
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig(**{name: value})
    assert name in str(info.value)
    # from_dict and replace go through the same validation
    with pytest.raises(ZeroConfigError, match=name):
        ZeroConfig.from_dict({name: value})
    with pytest.raises(ZeroConfigError, match=name):
        ZeroConfig().replace(**{name: value})


# Wrongly typed values (e.g. a YAML ``1e4`` read as the string "1e4") should get the same
# field-naming ZeroConfigError; today they escape as TypeError/OverflowError or are accepted.
WRONG_TYPE = [
    ("loss_scale", "1e4"),
    ("loss_scale", None),
    ("min_loss_scale", None),
    ("collective_timeout_s", "30"),
    ("reduce_dtype", ["bf16"]),
    ("initial_scale_power", 5000),
    ("reduce_bucket_size", True),
]


@pytest.mark.parametrize("name, value", WRONG_TYPE, ids=[f"{n}={v!r}" for n, v in WRONG_TYPE])
def test_wrongly_typed_value_names_the_field(name: str, value) -> None:
    with pytest.raises(ZeroConfigError, match=name):
        ZeroConfig(**{name: value})


def test_min_loss_scale_above_initial_scale() -> None:
    with pytest.raises(ZeroConfigError, match="min_loss_scale"):
        ZeroConfig(initial_scale_power=2, min_loss_scale=8.0)
    ZeroConfig(initial_scale_power=3, min_loss_scale=8.0)  # equal is fine
    ZeroConfig(initial_scale_power=2, min_loss_scale=8.0, loss_scale=128.0)  # static scale: irrelevant


@pytest.mark.parametrize("value", [None, "fp32", "float32", "bf16", "bfloat16", "fp16", "float16", "half"])
def test_valid_reduce_dtypes(value) -> None:
    assert ZeroConfig(reduce_dtype=value).reduce_dtype == value


def test_valid_edge_values() -> None:
    ZeroConfig(stage=1, reduce_bucket_size=1, min_group_params=1, prefetch=0, param_persistence_threshold=0,
               initial_scale_power=0, loss_scale=0.0, loss_scale_window=1, hysteresis=1, min_loss_scale=1.0)
    ZeroConfig(loss_scale=1024.0)


def test_from_dict_rejects_unknown_key_with_suggestion() -> None:
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_dict({"stagee": 3})
    msg = str(info.value)
    assert "stagee" in msg
    assert "'stage'" in msg
    with pytest.raises(ZeroConfigError) as info:
        ZeroConfig.from_dict({"reduce_bucket_sise": 10})
    assert "'reduce_bucket_size'" in str(info.value)
    # nothing close: still an error naming the key
    with pytest.raises(ZeroConfigError, match="zzzqqq"):
        ZeroConfig.from_dict({"zzzqqq": 1})


def test_from_dict_builds_and_ignores_hydra_target() -> None:
    values = {"_target_": "lightning_zero.ZeroConfig", "stage": 3, "prefetch": 2, "wrap_modules": ["Block"]}
    cfg = ZeroConfig.from_dict(values)
    assert cfg.stage == 3 and cfg.prefetch == 2 and cfg.wrap_modules == ("Block",)
    assert "_target_" in values  # the caller's mapping is not mutated


def test_to_dict_round_trip() -> None:
    cfg = ZeroConfig(stage=3, wrap_modules=("A", "B"), reduce_dtype="bf16", loss_scale=64.0)
    d = cfg.to_dict()
    assert sorted(d) == sorted(FIELDS)
    assert ZeroConfig.from_dict(d) == cfg


@pytest.mark.parametrize("name", ["wrap_modules", "activation_checkpointing"])
def test_tuple_fields_normalised(name: str) -> None:
    assert getattr(ZeroConfig(**{name: ["Block", "MLP"]}), name) == ("Block", "MLP")
    assert getattr(ZeroConfig(**{name: "Block"}), name) == ("Block",)  # a single name, not its characters
    assert getattr(ZeroConfig.from_dict({name: ["Layer"]}), name) == ("Layer",)
    assert isinstance(getattr(ZeroConfig(**{name: ["Block"]}), name), tuple)


def test_classes_become_names() -> None:
    class Block:
        pass

    class Attention:
        pass

    cfg = ZeroConfig(stage=3, wrap_modules=[Block, "MLP"], activation_checkpointing=(Attention,))
    assert cfg.wrap_modules == ("Block", "MLP")
    assert cfg.activation_checkpointing == ("Attention",)
    hash(cfg)  # all-immutable fields: usable as a key


def test_frozen() -> None:
    cfg = ZeroConfig()
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.stage = 3  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        cfg.hysteresis = 0  # type: ignore[misc]
    assert cfg.stage == 2


def test_replace_validates_and_copies() -> None:
    cfg = ZeroConfig(stage=1, prefetch=3)
    new = cfg.replace(stage=3, wrap_modules=["Block"])
    assert new.stage == 3 and new.prefetch == 3 and new.wrap_modules == ("Block",)
    assert cfg.stage == 1  # the original is unchanged
    with pytest.raises(ZeroConfigError, match="stage"):
        cfg.replace(stage=4)
    with pytest.raises(ZeroConfigError, match="hysteresis"):
        cfg.replace(hysteresis=0)
    with pytest.raises(ZeroConfigError) as info:
        cfg.replace(stagee=3)
    assert "'stage'" in str(info.value)


def test_settings_this_configuration_never_reads_are_named():
    import warnings

    from lightning_zero import ZeroStrategy

    assert ZeroConfig(stage=3, wrap_modules=["Block"], prefetch=2).inert_settings() == []
    assert ZeroConfig(stage=2, auto_placement=True, wrap_modules=["Block"]).inert_settings() == []  # it may pick 3
    inert = ZeroConfig(stage=1, wrap_modules=["Block"], prefetch=0, delayed_step_warmup=2,
                       offload_accumulation="host").inert_settings()
    assert [s.split(" ")[0] for s in inert] == ["wrap_modules", "prefetch", "delayed_step_warmup", "offload_accumulation"]
    with warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        ZeroStrategy(stage=2, wrap_modules=["Block"])
    assert any("wrap_modules applies to stage 3 only" in str(w.message) for w in seen)


def test_a_misspelt_keyword_names_the_close_option():
    with pytest.raises(ZeroConfigError, match="Unknown ZeroConfig option 'stgae'. Did you mean 'stage'"):
        ZeroConfig(stgae=3)
    assert ZeroConfig(stage=3).stage == 3 and dataclasses.replace(ZeroConfig(), stage=1).stage == 1
