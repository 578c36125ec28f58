"""Errors the engine raises on purpose: each carries a stable `code` and a message a user can act on."""

from __future__ import annotations


class SRError(Exception):
    code = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class CheckpointNotFound(SRError):
    code = "model_not_found"


class InvalidRequest(SRError):
    code = "invalid_request"


class Cancelled(SRError):
    code = "cancelled"
