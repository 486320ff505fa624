"""DeepSpeed users' own scripts, with only the import line changed, under torchrun on 2 CPU ranks:
a DeepSpeedExamples-style CNN client (tests/ds_cnn_client.py) in every stage and with CPU offload, and the
GPT-2 script of the README's DeepSpeed chapter (examples/deepspeed_gpt2_script.py): train, save, resume."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from dist_utils import free_port, job_env

ROOT = Path(__file__).resolve().parent.parent
CLIENT = ROOT / "tests" / "ds_cnn_client.py"
GPT2 = ROOT / "examples" / "deepspeed_gpt2_script.py"


def start_torchrun(script: Path, *args: str, cwd: Path) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", str(free_port()),
           str(script), *args]
    return subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=cwd,
                            env=job_env(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore"))


def finish(proc: subprocess.Popen, timeout: float = 300) -> subprocess.CompletedProcess:
    stdout, stderr = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, stdout[-3000:] + stderr[-5000:]
    return subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)


def torchrun(script: Path, *args: str, cwd: Path, timeout: float = 300) -> subprocess.CompletedProcess:
    return finish(start_torchrun(script, *args, cwd=cwd), timeout)


# stage 0 runs as stage 1 (tests/test_deepspeed_config.py)
CASES = {"stage1": ["--stage", "1"], "stage2": ["--stage", "2"], "stage3": ["--stage", "3"],
         "stage2_offload": ["--stage", "2", "--offload"]}


@pytest.fixture(scope="module")
def cnn_runs(tmp_path_factory):
    """Every stage's job at once (start-up and checkpoint files dominate; they run side by side)."""
    dirs = {name: tmp_path_factory.mktemp(name) for name in CASES}
    procs = {name: start_torchrun(CLIENT, *args, "--out", str(dirs[name]), cwd=dirs[name]) for name, args in CASES.items()}
    runs = {}
    for name, proc in procs.items():
        finish(proc, timeout=600)
        runs[name] = [json.loads((dirs[name] / f"result_{r}.json").read_text()) for r in (0, 1)]
    return runs


@pytest.mark.slow
@pytest.mark.parametrize("case", list(CASES))
def test_cnn_client_trains_saves_and_resumes(cnn_runs, case):
    for r in cnn_runs[case]:
        assert r["world"] == 2 and r["stage"] == max(1, int(CASES[case][1]))  # DeepSpeed's stage 0 runs as 1
        assert r["optimizer"] == "AdamW" and r["weight_decay"] == pytest.approx(3e-7)  # DeepSpeed's "Adam"
        assert r["micro_batch"] == 8  # train_batch_size 16 over 2 ranks
        assert sum(r["losses"][-10:]) < sum(r["losses"][:10]) - 0.5 and r["eval"] < r["first_eval"] - 0.1
        assert r["load_path"].endswith("global_step40")
        assert r["client_state"] == {"epoch": 2, "eval_loss": cnn_runs[case][0]["eval"]}  # rank 0's, as DeepSpeed
        assert r["global_steps"] == [43, 43] and r["lr"][0] == r["lr"][1]
        assert r["grad_norm"] > 0
        # the checkpoint is the whole state: a fresh engine evaluates and then trains exactly as the saver
        assert r["fresh_eval"] == pytest.approx(cnn_runs[case][0]["eval"], abs=1e-6)  # rank 0's BatchNorm stats
        assert r["resumed"] == pytest.approx(r["continued"], abs=1e-6)
    assert cnn_runs[case][0]["fp32_eval"] == pytest.approx(cnn_runs[case][0]["eval"], abs=1e-6)


@pytest.mark.slow
def test_cnn_client_trains_the_same_model_in_every_stage(cnn_runs):
    reference = cnn_runs["stage1"][0]["losses"]
    for case in CASES:
        assert cnn_runs[case][0]["losses"] == pytest.approx(reference, abs=1e-5), case


@pytest.mark.slow
def test_gpt2_script_runs_resumes_and_exports(tmp_path):
    pytest.importorskip("transformers")
    config = ROOT / "examples" / "ds_config_gpt2.json"
    common = ["--deepspeed", "--deepspeed_config", str(config), "--tiny", "--save_dir", str(tmp_path / "ckpt")]
    first = torchrun(GPT2, *common, "--epochs", "1", cwd=tmp_path)
    assert "epoch 0 eval loss" in first.stdout and "resumed" not in first.stdout
    second = torchrun(GPT2, *common, "--epochs", "2", "--export_dir", str(tmp_path / "export"), cwd=tmp_path)
    assert "resumed from" in second.stdout and "at epoch 1 (global step 16)" in second.stdout
    assert "epoch 1 eval loss" in second.stdout and "epoch 0" not in second.stdout
    assert (tmp_path / "ckpt" / "latest").read_text() == "global_step32"
    exported = torch.load(tmp_path / "export" / "pytorch_model.bin")
    converted = tmp_path / "fp32.bin"
    subprocess.run([sys.executable, "-m", "lightning_zero.utils.zero_to_fp32", str(tmp_path / "ckpt"), str(converted)],
                   check=True, capture_output=True)
    fp32 = torch.load(converted)
    assert set(exported) <= set(fp32) and all(torch.equal(exported[k], fp32[k]) for k in exported)  # fp32 config
    # the zero_to_fp32.py written beside the checkpoints, as DeepSpeed writes its own
    again = tmp_path / "again.bin"
    subprocess.run([sys.executable, str(tmp_path / "ckpt" / "zero_to_fp32.py"), str(tmp_path / "ckpt"), str(again)],
                   check=True, capture_output=True)
    assert torch.equal(torch.load(again)["transformer.wte.weight"], fp32["transformer.wte.weight"])


@pytest.mark.slow
def test_gpt2_script_under_zero_init(tmp_path):
    pytest.importorskip("transformers")
    config = json.loads((ROOT / "examples" / "ds_config_gpt2.json").read_text())
    (tmp_path / "ds.json").write_text(json.dumps(config))
    out = torchrun(GPT2, "--deepspeed_config", str(tmp_path / "ds.json"), "--tiny", "--zero_init", "--epochs", "1",
                   "--save_dir", str(tmp_path / "ckpt"), cwd=tmp_path)
    loss = float(out.stdout.split("epoch 0 step 0 loss ")[1].split()[0])
    assert abs(loss - torch.log(torch.tensor(256.0)).item()) < 0.1  # HF's own initialization: near-uniform output
    assert "epoch 0 eval loss" in out.stdout


@pytest.mark.parametrize("name,kwargs,plain", [
    ("FusedAdam", dict(lr=1e-2, weight_decay=0.1), lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1)),
    ("FusedAdam", dict(lr=1e-2, weight_decay=0.1, adam_w_mode=False), lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
    ("DeepSpeedCPUAdam", dict(lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9)),
     lambda p: torch.optim.AdamW(p, lr=1e-2, weight_decay=0.1, betas=(0.8, 0.9))),
    ("DeepSpeedCPUAdam", dict(lr=1e-2, weight_decay=0.1, adamw_mode=False), lambda p: torch.optim.Adam(p, lr=1e-2, weight_decay=0.1)),
])
@pytest.mark.parametrize("offload", [False, True], ids=["gpu_side", "cpu_offload"])
def test_deepspeed_adam_names_step_as_torchs(name, kwargs, plain, offload):
    """``deepspeed.ops.adam.FusedAdam`` / ``DeepSpeedCPUAdam`` in a script: the engine steps them as torch's Adam(W)
    with the same arguments (AdamW by default, Adam with L2 decay when the script turns the W off)."""
    import lightning_zero as deepspeed

    def model():
        torch.manual_seed(0)
        return torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.Tanh(), torch.nn.Linear(16, 1))

    reference = model()
    ref_opt = plain(reference.parameters())
    ours = model()
    optimizer = getattr(deepspeed.ops.adam, name)(ours.parameters(), **kwargs)
    config = {"train_micro_batch_size_per_gpu": 4, "zero_optimization": {"stage": 2}}
    if offload:
        config["zero_optimization"]["offload_optimizer"] = {"device": "cpu"}
    engine, _, _, _ = deepspeed.initialize(model=ours, optimizer=optimizer, config=config)
    assert isinstance(engine, deepspeed.DeepSpeedEngine)
    data = torch.randn(5, 4, 8, generator=torch.Generator().manual_seed(1))
    for x in data:
        loss = reference(x).pow(2).mean()
        ref_opt.zero_grad()
        loss.backward()
        ref_opt.step()
        engine.backward(engine(x).pow(2).mean())
        engine.step()
    for (n, p), q in zip(engine.module.named_parameters(), reference.parameters()):
        torch.testing.assert_close(p.detach(), q.detach(), rtol=1e-5, atol=1e-6, msg=n)


def test_deepspeed_adam_without_bias_correction_is_refused():
    import lightning_zero as deepspeed
    from lightning_zero import UnsupportedOptimizerError

    with pytest.raises(UnsupportedOptimizerError, match="bias_correction=False"):
        deepspeed.ops.adam.FusedAdam(torch.nn.Linear(2, 2).parameters(), bias_correction=False)
    assert deepspeed.utils.logger.name == "lightning_zero"
