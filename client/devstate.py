"""The running dev stack's address and key, in a file the client side reads: `vsrq status`, `vsrq bulk` (and anyone
exporting its lines for OpenAI's SDK) find `vsrq dev` without copying a token. Standard library only: the client
reads it, infra/dev.py writes it.

`vsrq dev` writes `dev.json` in its own directory and, for commands run from anywhere, in the user's config
directory ($XDG_CONFIG_HOME/vsrq, else ~/.config/vsrq; not over another running stack's); it removes both when it
stops. Readonly for its owner: it holds the stack's API key and its local S3 credentials. A file whose process is
gone (a `kill -9`) is ignored.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

FILENAME = "dev.json"


def user_path() -> Path:
    base = os.environ.get("XDG_CONFIG_HOME") or Path.home() / ".config"
    return Path(base) / "vsrq" / FILENAME


def write(directory: Path, state: dict[str, Any]) -> list[Path]:
    """Writes `state` into `directory` and the user's config directory, unless another running stack's is there
    (the one commands run from anywhere keep finding, until it stops); returns where it went."""
    written = []
    other = read()
    anywhere = [user_path()] if other is None or other.get("pid") == state.get("pid") else []
    for path in (directory / FILENAME, *anywhere):
        try:
            path.parent.mkdir(parents=True, exist_ok=True)
            partial = path.with_suffix(".partial")
            partial.touch(mode=0o600)
            partial.write_text(json.dumps(state, indent=2))
            os.replace(partial, path)
            written.append(path)
        except OSError:  # a read-only home: the copy in the dev directory is still there
            continue
    return written


def remove(paths: list[Path], pid: int) -> None:
    """Removes the files this process wrote, unless a later `vsrq dev` has written its own over them."""
    for path in paths:
        try:
            if json.loads(path.read_text()).get("pid") == pid:
                path.unlink()
        except (OSError, ValueError):
            continue


def read(directory: Path | None = None) -> dict[str, Any] | None:
    """The running stack's state (from `directory`, else the user's config directory), or None if none runs."""
    path = directory / FILENAME if directory is not None else user_path()
    try:
        state = json.loads(path.read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(state, dict) or not _alive(state.get("pid")):
        return None
    return state


def _alive(pid: Any) -> bool:
    if not isinstance(pid, int) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)  # no signal sent: only whether the process exists
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's: it exists
        return True
    return True
