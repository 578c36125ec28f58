"""Errors the engine raises on purpose: each carries a stable `code` and a message a user can act on."""

from __future__ import annotations


class CodedError(Exception):
    """An error raised on purpose: a stable `code` a client can switch on and a `message` a person can act on."""

    code = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class SRError(CodedError):
    """Raised where another attempt would end the same way (worker.attempt.classify ends the job with it)."""


class CheckpointNotFound(SRError):
    code = "model_not_found"


class InvalidRequest(SRError):
    code = "invalid_request"


class Cancelled(SRError):
    code = "cancelled"
