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


class WorkerOutdated(CodedError):
    """The job asks for a parameter this worker does not know: an API newer than this worker made it (a rolling
    deploy). It goes back to the queue, uncounted, for a worker that knows it (worker.attempt.classify)."""

    code = "worker_outdated"


class NoWorkerKnows(PermanentError):
    """The job was given back as `WorkerOutdated` for `OUTDATED_TRIES` in a row: no newer worker came."""

    code = "worker_outdated"


class TailStuck(CodedError):
    """The previous job's tail is stuck on this worker: the job that waited for it goes back to the queue, for another
    worker (worker.attempt.classify retries it)."""

    code = "worker_tail_stuck"
