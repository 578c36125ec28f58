"""Errors of the engine itself (the shared bases, InvalidRequest and Cancelled are worker/errors.py's)."""

from __future__ import annotations

from worker.errors import PermanentError


class CheckpointNotFound(PermanentError):
    code = "model_not_found"
