"""Errors the worker raises on purpose, whatever layer raises them (the engine, media, the fetcher): each carries a
stable `code` a client can switch on and a `message` a person can act on."""

from __future__ import annotations


class CodedError(Exception):
    """An error raised on purpose: a stable `code` a client can switch on and a `message` a person can act on."""

    code = "internal_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PermanentError(CodedError):
    """Raised where another attempt would end the same way (worker.attempt.classify ends the job with it)."""


class InvalidRequest(PermanentError):
    code = "invalid_request"


class Cancelled(PermanentError):
    code = "cancelled"


class TailStuck(CodedError):
    """The previous job's tail is stuck on this worker: the job that waited for it goes back to the queue, for another
    worker (worker.attempt.classify retries it)."""

    code = "worker_tail_stuck"
