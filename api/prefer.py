"""`Prefer: wait` (RFC 7240's preference, as Replicate's API takes it): a create that waits, up to a minute, for its
job to end and answers with the job as it then is, so a short clip's upscale comes back in the request that sent it;
a poll (GET /v1/videos/{id}) that waits so too.

    Prefer: wait        up to 60 s
    Prefer: wait=10     up to 10 s (1 to 60)

The answer says `Preference-Applied: wait=N` where it waited; the job may still be queued or running when the time is
up, and the client polls as it would have. A waiting request holds one of its process's threads, so at most half of
them wait at once, whoever asks (none where a process runs one thread): a request beyond that is answered at once,
without `Preference-Applied`; one whose client hangs up stops waiting. An unknown preference or a wait that is no
number is ignored, as RFC 7240 asks.
"""

from __future__ import annotations

import math
import socket
import threading
from time import monotonic, sleep

from werkzeug.datastructures import Headers

from api.services import services
from storage.jobs import TERMINAL, JobNotFound, JobRecord

MAX_WAIT_S = 60
POLL_S = 0.2  # a job's record is read this often while a request waits on it

_slots: threading.BoundedSemaphore | None = None
_slots_made = threading.Lock()


def asked_wait(headers: Headers) -> int | None:
    """The seconds a `Prefer: wait[=N]` header asks to wait, at most `MAX_WAIT_S`; None where it asks none."""
    for header in headers.getlist("Prefer"):
        for preference in header.split(","):
            name, _, value = preference.split(";")[0].partition("=")
            if name.strip().lower() != "wait":
                continue
            value = value.strip().strip('"')
            if not value:
                return MAX_WAIT_S
            try:
                seconds = float(value)
            except ValueError:
                return None
            return min(MAX_WAIT_S, math.ceil(seconds)) if seconds > 0 and math.isfinite(seconds) else None
    return None


def wait_to_end(job_id: str, seconds: int, client: socket.socket | None = None) -> JobRecord | None:
    """The job once it has ended, or as it is after `seconds`; None where no thread may wait now, or the `client`
    (the request's connection) has gone, whose slot then goes to another. `JobNotFound` where the job was deleted
    meanwhile."""
    slots = _waiting_slots()
    if not slots.acquire(blocking=False):
        return None
    try:
        deadline = monotonic() + seconds
        while (job := services().jobs.get(job_id)) is not None:
            if job.status in TERMINAL or (left := deadline - monotonic()) <= 0:
                return job
            if client is not None and _hung_up(client):
                return None
            sleep(min(POLL_S, left))
        raise JobNotFound(job_id)
    finally:
        slots.release()


def _hung_up(client: socket.socket) -> bool:
    """Whether the client closed its connection: it reads as ended (a request sent after this one, on a connection
    kept alive, is still unread: not an end). `client` may be gunicorn's paced wrapper (api.gunicorn_worker)."""
    try:
        return getattr(client, "raw", client).recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT) == b""
    except BlockingIOError:
        return False
    except OSError:  # reset
        return True


def _waiting_slots() -> threading.BoundedSemaphore:
    """Half of the process's request threads (gunicorn's `threads`, rounded down), made at the first wait."""
    global _slots
    with _slots_made:
        if _slots is None:
            _slots = threading.BoundedSemaphore(services().settings.web_threads // 2)
        return _slots
