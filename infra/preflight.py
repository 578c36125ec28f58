"""What `make setup` needs, checked before a minute of installing: a Python it can use, `venv` with `ensurepip`, a
machine the lock file is for, and room on the disk. Standard library only: it runs on the machine's own Python.

    python3 infra/preflight.py [--venv .venv] [--lock-for x86_64 3.11]

Each problem is one line saying what to do; exit code 1 if there is any.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
from pathlib import Path

MIN_PYTHON = (3, 11)
# The test environment: 1.9 GB installed (torch's CPU build is most of it), plus pip's unpacking beside it
NEEDED_BYTES = 3 * 1024**3


def problems(venv: Path, lock_for: tuple[str, str] | None = None) -> list[str]:
    """`lock_for`: the (machine, Python) the lock file pins its packages for (Linux), if it is for one."""
    found = []
    version = ".".join(map(str, sys.version_info[:3]))
    if sys.version_info[:2] < MIN_PYTHON:
        found.append(
            f"Python {version} ({sys.executable}) is too old: vsrq needs {'.'.join(map(str, MIN_PYTHON))} or newer; "
            "run `make setup PYTHON=python3.11` (or the path of a newer one)"
        )
    else:
        # `import venv` alone passes on Debian without python3-venv: creating one fails later, at ensurepip
        probe = subprocess.run([sys.executable, "-c", "import venv, ensurepip"], capture_output=True, text=True)
        if probe.returncode != 0:
            found.append(
                f"Python {version} has no usable venv/ensurepip ({probe.stderr.strip().splitlines()[-1]}): on "
                f"Debian/Ubuntu `apt-get install python{sys.version_info[0]}.{sys.version_info[1]}-venv`"
            )
        here = (platform.system(), platform.machine(), f"{sys.version_info[0]}.{sys.version_info[1]}")
        if lock_for and ("Linux", *lock_for) != here:
            found.append(
                f"the lock file pins its packages for Linux {' '.join(lock_for)} (torch's CPU build), this is "
                f"{' '.join(here)}: make setup PYTHON=python{lock_for[1]} if you have it, or "
                "install from the ranges instead, `python3 -m venv .venv && .venv/bin/pip install -e '.[test]'` "
                "(on Linux that takes torch's CUDA build, several GB, unless pip is pointed at "
                "https://download.pytorch.org/whl/cpu)"
            )
    room = shutil.disk_usage(_existing(venv.resolve())).free
    if room < NEEDED_BYTES:
        found.append(
            f"{room / 1024**3:.1f} GiB free where {venv} goes: the environment needs about "
            f"{NEEDED_BYTES / 1024**3:.0f} GiB; free some, or `make setup VENV=/path/with/room`"
        )
    return found


def _existing(path: Path) -> Path:
    while not path.exists():
        path = path.parent
    return path


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python3 infra/preflight.py", description=__doc__.split("\n\n")[0])
    parser.add_argument("--venv", type=Path, default=Path(".venv"))
    parser.add_argument("--lock-for", nargs=2, metavar=("MACHINE", "PYTHON"), help="e.g. x86_64 3.11")
    args = parser.parse_args(argv)
    found = problems(args.venv, tuple(args.lock_for) if args.lock_for else None)
    for problem in found:
        print(f"make setup: {problem}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
