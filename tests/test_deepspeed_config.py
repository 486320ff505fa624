"""The DeepSpeed JSON importer: every key, the real user's config, and the errors."""

from __future__ import annotations

import json
import math

import pytest
import torch
from deepspeed_cases import fit_from_json
from dist_utils import run_ranks

from lightning_zero import ZeroStrategy
from lightning_zero.config import ZeroConfigError
from lightning_zero.ds_config import DeepSpeedConfigError, build_optimizer, check_batch, import_deepspeed_config
from lightning_zero.ds_schedules import UnsupportedScheduleError, build_scheduler

REAL = "/work/shared/examples/ds_config.json"


def _real() -> dict:
    import os

    if os.path.exists(REAL):
        return json.loads(open(REAL).read())
    # the same content, for a clone without ../shared
    return {"train_batch_size": 128, "gradient_accumulation_steps": 2,
            "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 16},
            "zero_optimization": {"stage": 2, "cpu_offload": True, "offload_params": {"device": "cpu", "pin_memory": True}},
            "zero_allow_untested_optimizer": True,
            "optimizer": {"type": "AdamW", "params": {"lr": 2e-5, "betas": [0.9, 0.999], "eps": 1e-8}},
            "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": 0, "warmup_max_lr": 2e-5, "warmup_num_steps": 1000}}}


def test_every_mapped_key():
    ds = {"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "nvme", "nvme_path": "/nvme", "pin_memory": False,
                                                                  "ratio": 0.4},
                                "offload_param": {"device": "cpu"}, "overlap_comm": False, "reduce_bucket_size": 1000,
                                "stage3_param_persistence_threshold": 77, "stage3_prefetch_bucket_size": 0,
                                "contiguous_gradients": True, "sub_group_size": 1e9, "allgather_bucket_size": 5e8,
                                "stage3_max_live_parameters": 1e9},
          "fp16": {"enabled": True, "loss_scale": 0, "initial_scale_power": 12, "loss_scale_window": 500,
                   "hysteresis": 3, "min_loss_scale": 2},
          "gradient_clipping": 1.5, "train_batch_size": 64, "train_micro_batch_size_per_gpu": 8,
          "gradient_accumulation_steps": 4, "zero_allow_untested_optimizer": True, "steps_per_print": 10,
          "optimizer": {"type": "adam", "params": {"lr": 1e-3}},
          "scheduler": {"type": "WarmupDecayLR", "params": {"total_num_steps": 100, "warmup_num_steps": 10}}}
    r = import_deepspeed_config(ds)
    z = r.zero
    assert (z.stage, z.offload_optimizer, z.nvme_path, z.pin_memory, z.offload_fraction, z.offload_params) == \
        (3, "nvme", "/nvme", False, 0.4, "cpu")
    assert (z.overlap_comm, z.reduce_bucket_size, z.param_persistence_threshold, z.prefetch) == (False, 1000, 77, 0)
    assert (z.loss_scale, z.initial_scale_power, z.loss_scale_window, z.hysteresis, z.min_loss_scale) == (0.0, 12, 500, 3, 2.0)
    assert z.allow_untested_optimizer and r.precision == "16-mixed" and r.gradient_clip_val == 1.5
    assert (r.train_batch_size, r.micro_batch_per_gpu, r.accumulate) == (64, 8, 4)
    assert r.optimizer == {"type": "Adam", "params": {"lr": 1e-3}}
    unmapped = [w for w in r.warnings if w.startswith("mapped to nothing")]
    assert len(unmapped) == 1 and all(k in unmapped[0] for k in ("contiguous_gradients", "sub_group_size",
                                                                  "allgather_bucket_size", "steps_per_print"))
    assert import_deepspeed_config({"zero_optimization": {"stage": 1}, "bf16": {"enabled": True}}).precision == "bf16-mixed"


def test_legacy_keys():
    r = import_deepspeed_config({"zero_optimization": {"stage": 3, "cpu_offload": True, "cpu_offload_params": True,
                                                       "cpu_offload_use_pin_memory": True}})
    assert (r.zero.offload_optimizer, r.zero.offload_params, r.zero.pin_memory) == ("cpu", "cpu", True)
    assert sum("legacy" in w for w in r.warnings) == 2


def test_the_real_users_config_loads_with_the_messages_they_need():
    r = import_deepspeed_config(_real())
    assert (r.zero.stage, r.zero.offload_optimizer, r.zero.offload_params, r.precision) == (2, "cpu", "none", "16-mixed")
    text = " | ".join(r.warnings)
    assert "'zero_optimization.offload_params' is not a DeepSpeed key" in text and "did you mean 'offload_param'" in text
    assert "only applies to stage 3" in text and "legacy" in text


@pytest.mark.parametrize("ds,needle", [
    ({"zero_optimization": {"stage": 5}}, "use 1, 2 or 3"),
    ({"zero_optimization": {"stage": 2}, "lightning_zero": {"prefetchh": 2}}, "did you mean 'prefetch'"),
    ({"zero_optimization": {"stage": 2}, "lightning_zero": {"scheduler_on_skip": "later"}}, "scheduler_on_skip"),
    ({"zero_optimization": {"stage": 2}, "fp16": {"enabled": True}, "bf16": {"enabled": True}}, "choose one"),
    ({"zero_optimization": {"stage": 3, "offload_param": {"device": "cpu"}}}, "without offload_optimizer"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"device": "gpu"}}}, "'cpu', 'nvme' or 'none'"),
    ({"zero_optimization": {"stage": 2}, "optimizer": {"type": "Lamb"}}, "not supported"),
    ({"zero_optimization": {"stage": 2, "cpu_offload": True, "offload_optimizer": {"device": "none"}}}, "disagree"),
    # a misspelt switch would silently mean the opposite of what the section says
    ({"bf16": {"enabeld": True}}, "did you mean 'bf16.enabled'"),
    ({"fp16": {"enable": True, "loss_scale": 0}}, "did you mean 'fp16.enabled'"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": {"devise": "cpu"}}},
     "did you mean 'zero_optimization.offload_optimizer.device'"),
    ({"zero_optimization": {"stage": 3, "offload_optimizer": {"device": "cpu"}, "offload_param": {"devcie": "cpu"}}},
     "did you mean 'zero_optimization.offload_param.device'"),
])
def test_contradictions_are_one_line_errors(ds, needle):
    with pytest.raises((DeepSpeedConfigError, ZeroConfigError)) as err:
        import_deepspeed_config(ds)
    assert needle in str(err.value) and "\n" not in str(err.value)


def test_null_sections_read_as_absent_and_other_bf16_keys_are_named():
    assert import_deepspeed_config({"zero_optimization": None, "optimizer": {"type": "AdamW", "params": None}}).zero.stage == 1
    out = import_deepspeed_config({"bf16": {"enabled": True, "immediate_grad_updte": True}})
    assert out.precision == "bf16-mixed" and any("did you mean 'immediate_grad_update'" in w for w in out.warnings)


def test_a_config_that_is_not_an_object_is_named(tmp_path):
    listed = tmp_path / "list.json"
    listed.write_text("[1, 2]")
    with pytest.raises(DeepSpeedConfigError, match="holds a JSON list: it must be one object"):
        import_deepspeed_config(listed)
    with pytest.raises(DeepSpeedConfigError, match="path of a ds_config.json or a dict, not list"):
        import_deepspeed_config([1, 2])


def test_the_legacy_bfloat16_section_trains_in_bf16():
    r = import_deepspeed_config({"bfloat16": {"enabled": True}})
    assert r.precision == "bf16-mixed" and any("old name of 'bf16'" in w for w in r.warnings)
    assert not any("is not a DeepSpeed key" in w for w in r.warnings)
    both = import_deepspeed_config({"bfloat16": {"enabled": True}, "bf16": {"enabled": False}})
    assert both.precision is None and any("wins" in w for w in both.warnings)  # DeepSpeed reads bf16 first


@pytest.mark.parametrize("kind,params,needle", [
    ("WarmupLR", {"warmup_num_step": 10}, "warmup_num_step is not a parameter of DeepSpeed's WarmupLR — did you mean "
                                          "'warmup_num_steps'?"),
    ("WarmupDecayLR", {"total_num_steps": 9, "warmup_max_lr": 1e-3, "warmup_min": 0}, "did you mean 'warmup_min_lr'"),
    ("WarmupCosineLR", {"total_num_steps": 9, "warmup_max_lr": 1e-3}, "not a parameter of DeepSpeed's WarmupCosineLR"),
    ("OneCycle", {"cycle_min_lr": 0, "cycle_max_lr": 1, "cycle_min_mon": 0.8}, "did you mean 'cycle_min_mom'"),
])
def test_a_misspelt_schedule_parameter_is_refused(kind, params, needle):
    """DeepSpeed refuses an unknown schedule argument; reading around it would leave the default (1000 warm-up
    steps) in force."""
    with pytest.raises(UnsupportedScheduleError) as err:
        import_deepspeed_config({"scheduler": {"type": kind, "params": params}})
    assert needle in str(err.value) and "\n" not in str(err.value)
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UnsupportedScheduleError, match="not a parameter"):
        build_scheduler(opt, {"type": kind, "params": params})


def test_a_schedule_resumes_from_last_batch_iteration():
    """DeepSpeed's own constructor argument: the schedule starts where the iteration says."""
    params = {"warmup_min_lr": 0.0, "warmup_max_lr": 1e-3, "warmup_num_steps": 10, "warmup_type": "linear"}
    fresh = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                            {"type": "WarmupLR", "params": params})
    for _ in range(4):
        fresh.optimizer.step()
        fresh.step()
    resumed = build_scheduler(torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1),
                              {"type": "WarmupLR", "params": {**params, "last_batch_iteration": 3}})
    assert resumed.get_last_lr() == fresh.get_last_lr() and resumed.last_batch_iteration == 3


def test_unknown_scheduler_and_missing_file(tmp_path):
    with pytest.raises(UnsupportedScheduleError, match="WarmupLR"):
        import_deepspeed_config({"zero_optimization": {"stage": 2}, "scheduler": {"type": "Cyclic"}})
    with pytest.raises(DeepSpeedConfigError, match="does not exist"):
        ZeroStrategy(deepspeed_config=str(tmp_path / "nope.json"))
    bad = tmp_path / "bad.json"
    bad.write_text("{ stage: 2 }")
    with pytest.raises(DeepSpeedConfigError, match="not valid JSON"):
        ZeroStrategy(deepspeed_config=str(bad))


def test_batch_arithmetic_error_shows_the_numbers():
    r = import_deepspeed_config({"zero_optimization": {"stage": 2}, "train_batch_size": 128,
                                 "gradient_accumulation_steps": 2})
    check_batch(r, 32, 2, 2)
    with pytest.raises(DeepSpeedConfigError) as err:
        check_batch(r, 16, 2, 2)
    assert "16 x 2 x 2 = 64" in str(err.value) and "would be 32" in str(err.value)


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    path = tmp_path_factory.mktemp("ds") / "ds_config.json"
    path.write_text(json.dumps(_real()))
    return run_ranks(fit_from_json, 2, str(path), 32, lightning=True), run_ranks(fit_from_json, 2, str(path), 16,
                                                                                lightning=True)


@pytest.mark.slow
def test_the_real_config_trains_under_lightning(trained):
    good, _ = trained
    for r in good:
        assert "error" not in r, r
        assert r["precision"] == "16-mixed" and r["accumulate"] == 2 and r["optimizer"] == "AdamW"
        assert r["config"]["offload_optimizer"] == "cpu" and r["config"]["stage"] == 2
        assert r["betas"] == (0.9, 0.999) and r["global_step"] == 6
        # WarmupLR, log warm-up over 1000 steps from 0 to 2e-5 on DeepSpeed's clock (step k runs with the
        # warm-up value of iteration k - 1; recorded from DeepSpeed in tests/fixtures): 2e-5 * log(max(k, 1)) / log(1000)
        steps = [i // 2 for i in range(len(r["lrs"]))]  # two micro-batches a step
        for k, lr in zip(steps, r["lrs"]):
            assert math.isclose(lr, 2e-5 * math.log(max(k, 1)) / math.log(1000), rel_tol=1e-6, abs_tol=1e-12)
        assert all(math.isfinite(x) for x in r["losses"])
    assert any("did you mean 'offload_param'" in w for w in good[0]["warnings"])


@pytest.mark.slow
def test_wrong_micro_batch_is_one_error_with_the_arithmetic(trained):
    _, bad = trained
    assert bad[0]["error"] == "DeepSpeedConfigError" and "16 x 2 x 2 = 64" in bad[0]["message"]


def test_stage_zero_runs_as_stage_one_and_says_so():
    """DeepSpeed's default (no zero_optimization, or stage 0) is plain data parallelism: ZeRO-1 trains the same."""
    for ds in ({}, {"zero_optimization": {"stage": 0}}):
        r = import_deepspeed_config(ds)
        assert r.zero.stage == 1 and any("runs here as ZeRO stage 1" in w for w in r.warnings)
    with pytest.raises(DeepSpeedConfigError, match="did you mean 'zero_optimization'"):  # misspelt: not stage 1
        import_deepspeed_config({"zero_optimisation": {"stage": 3}})


def test_own_section_sets_fields_deepspeed_has_no_key_for():
    r = import_deepspeed_config({"zero_optimization": {"stage": 3, "stage3_prefetch_bucket_size": 0},
                                 "lightning_zero": {"scheduler_on_skip": "advance", "prefetch": 3}})
    assert (r.zero.stage, r.zero.scheduler_on_skip, r.zero.prefetch) == (3, "advance", 3)  # the section wins


def _params():
    return [torch.nn.Parameter(torch.zeros(3))]


@pytest.mark.parametrize("spec,kind,checks", [
    # DeepSpeed's "Adam" is AdamW (adam_w_mode defaults to true); its fused Adam's weight_decay defaults to 0
    ({"type": "Adam", "params": {"lr": 1e-3}}, torch.optim.AdamW, {"weight_decay": 0.0}),
    ({"type": "AdamW", "params": {"lr": 1e-3}}, torch.optim.AdamW, {"weight_decay": 0.0}),
    ({"type": "Adam", "params": {"lr": 1e-3, "adam_w_mode": False}}, torch.optim.Adam, {"weight_decay": 0.0}),
    # torch_adam: torch's own class with torch's defaults, as DeepSpeed builds it
    ({"type": "AdamW", "params": {"lr": 1e-3, "torch_adam": True}}, torch.optim.AdamW, {"weight_decay": 0.01}),
    ({"type": "adamw", "params": {"lr": 1e-3, "betas": [0.8, 0.9], "bias_correction": True}}, torch.optim.AdamW,
     {"betas": (0.8, 0.9)}),
    ({"type": "SGD", "params": {"lr": 0.1, "momentum": 0.9}}, torch.optim.SGD, {"momentum": 0.9}),
    ({"type": "Adagrad", "params": {"lr": 0.1}}, torch.optim.Adagrad, {"lr": 0.1}),
])
def test_optimizers_are_built_with_deepspeeds_semantics(spec, kind, checks):
    from lightning_zero.ds_config import _optimizer

    opt = build_optimizer(_optimizer(spec), _params())
    assert type(opt) is kind
    for key, value in checks.items():
        assert opt.param_groups[0][key] == value, key


@pytest.mark.parametrize("params,needle", [({"bias_correction": False}, "bias_correction"),
                                           ({"max_grad_norm": 1.0}, "gradient_clipping"),
                                           ({"lr": 1e-3, "nesterov_typo": True}, "nesterov_typo")])
def test_optimizer_params_that_cannot_be_honoured(params, needle):
    from lightning_zero.ds_config import _optimizer

    with pytest.raises(DeepSpeedConfigError, match=needle):
        build_optimizer(_optimizer({"type": "AdamW", "params": params}), _params())


@pytest.mark.parametrize("given,world,want", [
    ((32, 4, None), 2, (32, 4, 4)),       # DeepSpeed derives the accumulation from the two sizes
    ((32, None, 2), 2, (32, 8, 2)),       # ... or the micro-batch
    ((32, None, None), 4, (32, 8, 1)),    # only the batch: no accumulation
    ((None, 4, 3), 2, (24, 4, 3)),
    ((None, 4, None), 2, (8, 4, 1)),
    ((16, 4, 2), 2, (16, 4, 2)),
    ((None, None, None), 2, (None, None, None)),
])
def test_batch_sizes_resolve_as_deepspeed(given, world, want):
    from lightning_zero.ds_config import resolve_batch

    assert resolve_batch(*given, world) == want


@pytest.mark.parametrize("given,world,needle", [((16, 4, 1), 2, "4 x 1 x 2 = 8"), ((30, 4, None), 2, "cannot be split"),
                                                ((9, None, None), 2, "cannot be split")])
def test_batch_sizes_that_disagree(given, world, needle):
    from lightning_zero.ds_config import resolve_batch

    with pytest.raises(DeepSpeedConfigError, match=needle):
        resolve_batch(*given, world)


def test_flags_read_as_deepspeed_reads_them():
    r = import_deepspeed_config({"zero_optimization": {"stage": 2}, "fp16": {"enabled": "false"}})
    assert r.precision is None  # the string "false" is false, as DeepSpeed's parser reads it
    r = import_deepspeed_config({"zero_optimization": {"stage": 2}, "bf16": {"enabled": "True"}})
    assert r.precision == "bf16-mixed"


def test_auto_takes_the_runs_values():
    """A config written for Hugging Face's Trainer: every "auto" the run can fill is filled from it."""
    ds = {"train_batch_size": "auto", "train_micro_batch_size_per_gpu": "auto", "gradient_accumulation_steps": "auto",
          "gradient_clipping": "auto", "fp16": {"enabled": "auto", "loss_scale": 0}, "bf16": {"enabled": "auto"},
          "zero_optimization": {"stage": 3, "reduce_bucket_size": "auto", "stage3_prefetch_bucket_size": "auto",
                                "stage3_param_persistence_threshold": "auto", "sub_group_size": 1e9,
                                "stage3_gather_16bit_weights_on_model_save": "auto"},
          "optimizer": {"type": "AdamW", "params": {"lr": "auto", "weight_decay": "auto"}},
          "scheduler": {"type": "WarmupLR", "params": {"warmup_min_lr": "auto", "warmup_max_lr": "auto",
                                                       "warmup_num_steps": 10}}}
    r = import_deepspeed_config(ds)
    assert (r.zero.stage, r.precision, r.train_batch_size, r.micro_batch_per_gpu, r.accumulate,
            r.gradient_clip_val) == (3, None, None, None, None, None)
    assert r.zero.reduce_bucket_size == ZeroStrategy().config.reduce_bucket_size
    # the optimizer's hyper-parameters have no source here: an error naming the key when it is built
    with pytest.raises(DeepSpeedConfigError, match="optimizer.params.lr is 'auto'"):
        build_optimizer(r.optimizer, _params())
    # warmup_max_lr 'auto' is the optimizer's lr (as Hugging Face fills it)
    from lightning_zero.ds_schedules import build_scheduler

    opt = torch.optim.AdamW(_params(), lr=3e-4)
    sched = build_scheduler(opt, r.scheduler)
    for _ in range(20):
        opt.step()
        sched.step()
    assert opt.param_groups[0]["lr"] == pytest.approx(3e-4)


@pytest.mark.parametrize("ds,needle", [
    ({"fp16": {"enabled": "maybe"}}, "fp16.enabled='maybe' is not a boolean"),
    ({"zero_optimization": {"stage": "two"}}, "zero_optimization.stage='two' is not a number"),
    ({"train_batch_size": "32"}, "train_batch_size='32' is not a number"),
    ({"train_micro_batch_size_per_gpu": 0}, "must be 1 or more"),
    ({"zero_optimization": {"stage": 2, "reduce_bucket_size": 2.5}}, "whole number"),
    ({"zero_optimization": {"stage": 2, "overlap_comm": "auto"}}, "overlap_comm is 'auto'"),
    ({"gradient_clipping": -1}, "negative"),
    ({"fp16": {"enabled": True, "initial_scale_power": "16"}}, "fp16.initial_scale_power='16' is not a number"),
    # a bare value where DeepSpeed reads an object: "fp16": true would otherwise train in fp32 without a word
    ({"fp16": True}, "'fp16' must be a JSON object such as \"fp16\": {\"enabled\": true}"),
    ({"bf16": True}, "'bf16' must be a JSON object"),
    ({"zero_optimization": 3}, "'zero_optimization' must be a JSON object such as \"zero_optimization\": {\"stage\": 2}"),
    ({"optimizer": "AdamW"}, "'optimizer' must be a JSON object"),
    ({"optimizer": {"type": "AdamW", "params": [1e-3]}}, "'optimizer.params' must be a JSON object"),
    ({"scheduler": "WarmupLR"}, "'scheduler' must be a JSON object"),
    ({"zero_optimization": {"stage": 2, "offload_optimizer": "cpu"}}, "'zero_optimization.offload_optimizer' must be"),
])
def test_values_of_the_wrong_type_are_named(ds, needle):
    with pytest.raises(DeepSpeedConfigError) as err:
        import_deepspeed_config(ds)
    assert needle in str(err.value) and "\n" not in str(err.value)


@pytest.mark.parametrize("key,meant", [("Fp16", "fp16"), ("FP16", "fp16"), ("fp61", "fp16"), ("BF16", "bf16"),
                                       ("Zero_Optimization", "zero_optimization")])
def test_a_precision_or_zero_section_misspelt_or_in_capitals_is_refused(key, meant):
    # as written DeepSpeed ignores the section: the run would train in fp32 (or without its ZeRO settings)
    with pytest.raises(DeepSpeedConfigError, match=f"'{key}' is not a DeepSpeed key — did you mean '{meant}'"):
        import_deepspeed_config({key: {"enabled": True} if meant != "zero_optimization" else {"stage": 2}})


@pytest.mark.parametrize("params,needle", [({"lr": 1e-3, "betas": [0.9]}, "tuple index out of range"),
                                           ({"lr": -1}, "Invalid learning rate: -1")])
def test_optimizer_values_torch_refuses_name_the_section(params, needle):
    from lightning_zero.ds_config import build_optimizer

    with pytest.raises(DeepSpeedConfigError, match=f"refused by torch.optim.AdamW: {needle}.*optimizer.params"):
        build_optimizer({"type": "AdamW", "params": params}, [torch.nn.Parameter(torch.zeros(2))])


def test_consecutive_hysteresis_is_read_and_restores_the_tolerance_after_each_clean_step():
    from lightning_zero.precision.loss_scaler import DynamicLossScaler

    assert import_deepspeed_config({"fp16": {"enabled": True, "consecutive_hysteresis": True}}).zero.consecutive_hysteresis
    with pytest.raises(DeepSpeedConfigError, match="consecutive_hysteresis must be true or false"):
        import_deepspeed_config({"fp16": {"enabled": True, "consecutive_hysteresis": "yes"}})
    scales = {}
    for consecutive in (False, True):  # overflows at steps 0, 2, 4 with a clean step between each
        scaler = DynamicLossScaler(init_scale=8.0, hysteresis=2, consecutive_hysteresis=consecutive)
        for overflow in (True, False, True, False, True):
            scaler.update(overflow)
        scales[consecutive] = scaler.scale
    assert scales == {False: 2.0, True: 8.0}  # hysteresis 2: the second and third overflows halve; never in a row


@pytest.mark.parametrize("kind", ["WarmupLR", "WarmupDecayLR", "WarmupCosineLR"])
def test_a_warmup_type_deepspeed_does_not_know_is_refused(kind):
    from lightning_zero.ds_schedules import UnsupportedScheduleError, build_scheduler

    params = {"warmup_num_steps": 5, "warmup_type": "cosine", **({} if kind == "WarmupLR" else {"total_num_steps": 20})}
    optimizer = torch.optim.SGD([torch.nn.Parameter(torch.zeros(2))], lr=0.1)
    with pytest.raises(UnsupportedScheduleError, match="warmup_type='cosine'"):
        build_scheduler(optimizer, {"type": kind, "params": params})


@pytest.mark.parametrize("algorithm", [None, "norm", "value"])
def test_the_jsons_norm_clip_is_never_applied_as_value_clipping(algorithm):
    from types import SimpleNamespace

    from lightning_zero.ds_glue import apply_to_trainer

    trainer = SimpleNamespace(gradient_clip_val=None, gradient_clip_algorithm=algorithm, accumulate_grad_batches=1)
    ds = import_deepspeed_config({"gradient_clipping": 0.5, "zero_optimization": {"stage": 2}})
    if algorithm == "value":
        with pytest.raises(DeepSpeedConfigError, match="is a norm clip, but Trainer\\(gradient_clip_algorithm='value'\\)"):
            apply_to_trainer(ds, trainer)
    else:
        apply_to_trainer(ds, trainer)
        assert trainer.gradient_clip_val == 0.5


def test_a_schedule_error_that_names_its_fix_is_not_wrapped_again():
    opt = torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))], lr=0.1)
    with pytest.raises(UnsupportedScheduleError) as err:
        build_scheduler(opt, {"type": "WarmupLR", "params": {"warmup_num_steps": 10, "warmup_type": "cubic"}})
    assert str(err.value).endswith("write the one you mean.") and "give numbers" not in str(err.value)
