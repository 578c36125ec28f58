"""A bench's figures as JSON lines: printed as each is measured, and appended to its `--out` file, so a run cut short
by its device call's limit still leaves what it measured."""

from __future__ import annotations

import json
from typing import Any


def emit(line: dict[str, Any], out: str | None) -> None:
    print(json.dumps(line), flush=True)
    if out:
        with open(out, "a") as file:
            file.write(json.dumps(line) + "\n")
