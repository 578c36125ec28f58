"""Schemathesis hooks for tests/service/test_openapi.py.

The document's own examples carry a real video in their file field, as a person's request does: the example's file is
a placeholder text, which the API refuses as it arrives (a text file is no video: api/sniff.py), so without them no
generated create would reach the job it describes. Generated cases keep their bytes: a negative one must still be
refused for what makes it one. A create that prefers to wait for its job waits a second: no worker runs it here."""

from __future__ import annotations

import os
from pathlib import Path

import schemathesis

VIDEO = Path(os.environ["VSRQ_FUZZ_VIDEO"]).read_bytes()
FILE_FIELDS = ("video_reference", "file")  # a create's file, and a whole upload's (POST /v1/uploads)


@schemathesis.hook
def before_call(context, case, **kwargs) -> None:
    if isinstance(case.body, dict) and case.meta is not None and case.meta.phase.name == "examples":
        for name in FILE_FIELDS:
            if isinstance(case.body.get(name), str | bytes):
                case.body[name] = VIDEO
    if case.headers and "wait" in str(case.headers.get("Prefer", "")).lower():
        case.headers["Prefer"] = "wait=1"
