"""What `make setup` needs, checked before a minute of installing: a Python it can use, `venv` with `ensurepip`, and
room on the disk; and whether the lock file is for this machine (if not, setup installs from the ranges instead:
infra/install_ranges.py). Standard library only: it runs on the machine's own Python.

    python3 infra/preflight.py [--venv .venv] [--lock-for x86_64 3.11]   # exit code 1 if there is a problem
    python3 infra/preflight.py --lock-for x86_64 3.11 --fits             # exit code 0 if the lock is for this one

Each problem is one line saying what to do.
"""

from __future__ import annotations

import argparse
import platform
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

MIN_PYTHON = (3, 11)
# The test environment: 1.9 GB installed (torch's CPU build is most of it), plus pip's unpacking beside it
NEEDED_BYTES = 3 * 1024**3
# pip unpacks each package in the temporary directory first, torch's CPU build (~200 MB) the largest the lock takes;
# a 60 MB TMPDIR failed setup with "No space left on device", naming nothing
TEMP_BYTES = 400 * 1024**2


def here() -> tuple[str, str, str]:
    return platform.system(), platform.machine(), f"{sys.version_info[0]}.{sys.version_info[1]}"


def lock_fits(lock_for: tuple[str, str]) -> bool:
    """`lock_for`: the (machine, Python) the lock file pins its packages for, on Linux."""
    return ("Linux", *lock_for) == here()


def other_machine(lock_for: tuple[str, str]) -> str:
    """What setup does where the lock is not for this machine: not a problem, said before it starts."""
    return (
        f"the lock pins its packages for Linux {' '.join(lock_for)}, this is {' '.join(here())}: installing "
        f"pyproject.toml's ranges at the lock's versions instead (infra/install_ranges.py; "
        f"`make setup PYTHON=python{lock_for[1]}` for the lock itself, if you have that Python)"
    )


def problems(venv: Path, temp_needed: int = TEMP_BYTES) -> list[str]:
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
    room = shutil.disk_usage(_existing(venv.resolve())).free
    if room < NEEDED_BYTES:
        found.append(
            f"{room / 1024**3:.1f} GiB free where {venv} goes: the environment needs about "
            f"{NEEDED_BYTES / 1024**3:.0f} GiB; free some, or `make setup VENV=/path/with/room`"
        )
    temporary = Path(tempfile.gettempdir())
    if (room := shutil.disk_usage(temporary).free) < temp_needed:
        found.append(
            f"{room / 1024**2:.0f} MB free in {temporary}, the temporary directory, where pip unpacks each package "
            f"(torch's needs about {temp_needed / 1024**2:.0f} MB): free some, or `TMPDIR=/path/with/room make setup`"
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
    parser.add_argument("--fits", action="store_true", help="only say (exit code) whether the lock is for this one")
    args = parser.parse_args(argv)
    lock_for = tuple(args.lock_for) if args.lock_for else None
    if args.fits:
        return 0 if lock_for and lock_fits(lock_for) else 1
    found = problems(args.venv)
    for problem in found:
        print(f"make setup: {problem}", file=sys.stderr)
    if not found and lock_for and not lock_fits(lock_for):
        print(f"make setup: {other_machine(lock_for)}", file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
