"""lightning_zero/lightning_compat.py against every Lightning minor version pyproject.toml admits."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import lightning
import pytest
from dist_utils import job_env

JOB = Path(__file__).parent / "lightning_compat_job.py"
OTHER_VERSIONS = [v for v in ("2.5.*", "2.6.*") if not lightning.__version__.startswith(v[:4])]


def run(python: str, cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([python, str(JOB)], capture_output=True, text=True, timeout=300, cwd=cwd,
                          env=job_env(PYTHONWARNINGS="ignore"))


def test_compat_with_the_installed_lightning(tmp_path):
    job = run(sys.executable, tmp_path)
    assert job.returncode == 0 and job.stdout.strip().endswith(f"ok {lightning.__version__}"), job.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.parametrize("version", OTHER_VERSIONS)
def test_compat_with_other_supported_lightning(tmp_path, version):
    venv = tmp_path / "venv"  # everything from this interpreter but Lightning
    subprocess.run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)], check=True, timeout=120)
    pip = subprocess.run([str(venv / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                          f"lightning=={version}"], capture_output=True, text=True, timeout=300)
    if pip.returncode != 0:
        pytest.skip(f"lightning=={version} could not be installed here: {pip.stderr.strip().splitlines()[-1:]}")
    job = run(str(venv / "bin" / "python"), tmp_path)
    assert job.returncode == 0 and f"ok {version[:4]}" in job.stdout, job.stderr[-3000:]
