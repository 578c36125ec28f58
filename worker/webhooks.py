"""Webhook delivery: `vsrq.deliver_webhook`, which makes one signed POST of one outbox event (storage.webhooks, whose
relay hands due events to Celery) and records it in the job's events.

    celery -A worker.webhooks worker --pool threads --concurrency 8 -Q vsrq.webhooks

Threads, since an attempt is network I/O. The relay runs where a job ends (its worker, the API cancelling) and in the
reaper's loop (worker.reaper) for what they could not send and for retries: periodic work over Redis like reaping, the
reaper already runs wherever the service does, and more than one is safe (taking an event is one atomic script). Retries
are due times in the outbox, not Celery countdowns: a countdown message waits in one worker's memory, and goes with that
worker (or comes back after the visibility timeout, hours later).

An attempt checks the URL with storage.ssrf right before connecting and connects to an address that was checked (TLS
is still verified against the URL's host name); it never follows a redirect. A 2xx delivers. 410 Gone, a URL refused
at send time (`unsafe_url`) or a job deleted before its first attempt end the event at once. Anything else (a network
error, a timeout, a 3xx, 4xx or 5xx, and a key this process's settings lack or give no secret, which the API had: a
configuration rolled out to the API first, or a key removed since) is retried after an exponential backoff with
jitter, never sooner than the receiver's Retry-After, until `webhook_max_attempts`.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import logging
import socket
import ssl
import threading
import time
from dataclasses import dataclass
from datetime import UTC, datetime
from http import HTTPStatus
from typing import Any, Literal
from urllib.parse import urlsplit

import urllib3
from celery import Task
from celery.signals import worker_init
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError, SSLError
from urllib3.util.ssl_match_hostname import CertificateError

from storage.config import Settings, say_unknown_variables
from storage.jobs import JobNotFound, JobStore, VideoWebhook
from storage.logs import job_context
from storage.signatures import signed_headers
from storage.ssrf import LookupUnavailable, UnsafeUrl, pinned_connection, public_addresses, request_target
from storage.webhooks import DELIVER_TASK, Outbox, Started
from storage.workers import this_process
from worker import metrics, service
from worker import signals as _signals  # noqa: F401  (this worker's logging and registry entry)
from worker.backoff import backoff_s, retry_after_s
from worker.celery_app import app

log = logging.getLogger("vsrq.webhooks")


@worker_init.connect
def _say_unknown_variables(**_: Any) -> None:
    """A misspelt VSRQ_* name is said at start, as the API, the GPU worker and the reaper say it."""
    say_unknown_variables(log)


@dataclass(frozen=True)
class Attempt:
    """How one attempt went. `failed` is for good: no attempt after it would do better."""

    outcome: Literal["delivered", "retry", "failed"]
    code: str | None = None
    message: str | None = None
    status_code: int | None = None
    retry_after_s: float | None = None


@app.task(name=DELIVER_TASK, bind=True)
def deliver_webhook(task: Task, event_id: str, claim: int) -> None:
    settings, box, jobs = service.settings(), service.outbox(), service.jobs()
    # the attempt's whole time, the payload and DNS too, counts from before `start` records when it began: the reaper
    # sends it again only a POST's limit after that (worker.gone), so this one is over by then
    deadline = time.monotonic() + settings.webhook_timeout_s
    # held in the worker registry's terms, so that the reaper can tell this worker gone (worker.gone)
    started = box.start(event_id, claim, settings.webhook_claim_s, this_process(task.request.hostname))
    if started is None:  # a later claim took the event over (this message waited longer than a claim lasts), or
        # this message is one given again after its attempt started
        log.info("dropped a message for %s (claim %d): a later claim, or its attempt, has it", event_id, claim)
        return
    with job_context(started.event.job):
        _end(started, _attempt(started, settings, box, jobs, deadline), settings, box, jobs)


def _attempt(started: Started, settings: Settings, box: Outbox, jobs: JobStore, deadline: float) -> Attempt:
    event = started.event
    if started.attempt > settings.webhook_max_attempts:  # its delivery workers kept dying mid-attempt
        return Attempt("failed", "too_many_attempts", f"gave up after {started.attempt - 1} attempts")
    key = next((key for key in settings.api_keys if key.id == event.owner), None)
    if key is None or key.webhook_secret is None:  # the API had it: a rollout under way, or a key removed since
        known = "has no webhook_secret" if key is not None else "is not in VSRQ_API_KEYS"
        message = f"API key {event.owner!r} {known} in this delivery worker's configuration"
        return Attempt("retry", "webhook_secret_missing", message)
    payload = started.payload or _payload(started, box, jobs)
    if payload is None:
        return Attempt("failed", "job_deleted", "the job was deleted before its webhook was first sent")
    headers = signed_headers([key.webhook_secret.get_secret_value()], started.event_id, int(time.time()), payload)
    return post(event.url, payload, {**headers, "Content-Type": "application/json"}, settings, deadline)


def _payload(started: Started, box: Outbox, jobs: JobStore) -> bytes | None:
    """The body every attempt sends: the event, and the job as GET /v1/videos/{id} shows it (ended, so final)."""
    job = jobs.get(started.event.job)
    if job is None:
        return None
    # the model the document's `webhooks` are made from, so what is sent is what it says
    body = VideoWebhook(
        id=started.event_id,
        object="event",
        type=started.event.type,
        created_at=int(started.event.at),
        timestamp=datetime.fromtimestamp(started.event.at, UTC).isoformat().replace("+00:00", "Z"),
        data=jobs.view(job),
    ).model_dump(mode="json")
    return box.keep_payload(started.event_id, json.dumps(body, separators=(",", ":")).encode())


def post(url: str, body: bytes, headers: dict[str, str], settings: Settings, deadline: float) -> Attempt:
    """One POST to the first checked address of `url`'s host that accepts a connection, over by `deadline`
    (`time.monotonic()`): the host's lookup, the connection and the answer."""
    parts = urlsplit(url)
    try:
        if parts.scheme != "https":
            raise UnsafeUrl("must be an https URL")
        remaining = deadline - time.monotonic()
        addresses = public_addresses(url, allow_loopback=settings.webhook_allow_loopback, timeout_s=remaining)
    except UnsafeUrl as error:
        return Attempt("failed", UnsafeUrl.code, f"the webhook URL is refused: {error}")
    except LookupUnavailable as error:
        return Attempt("retry", "lookup_unavailable", f"the webhook URL's host could not be resolved: {error}")
    target = request_target(parts)
    headers = {**headers, "Host": parts.netloc, "User-Agent": "vsrq-webhooks"}
    late = Attempt("retry", "timeout", f"no answer within {settings.webhook_timeout_s:g} s")
    for address in addresses:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            break
        connection = pinned_connection(parts, address, settings.webhook_ca_bundle, remaining)
        # urllib3's timeouts bound each read of the socket, not the answer: a receiver that sent a byte every few
        # seconds held an attempt (and a delivery thread) for as long as it liked. Cut at the deadline instead.
        cut = threading.Event()
        watchdog = threading.Timer(remaining, _cut, (connection, cut))
        watchdog.daemon = True
        watchdog.start()
        try:
            connection.request("POST", target, body=body, headers=headers, preload_content=False)
            response = connection.getresponse()  # the answer's body is never read: its size costs nothing
            response.close()
        except (NewConnectionError, ConnectTimeoutError):  # this address is down: try the next
            continue
        # the certificate (another name's: urllib3's CertificateError, a ValueError; an untrusted chain: ssl's), as
        # urllib3 raises it through a pool or the ssl module through a connection
        except (SSLError, ssl.SSLError, CertificateError) as error:
            return Attempt("retry", "tls_failed", f"TLS with {parts.hostname} failed: {error.__context__ or error}")
        except (urllib3.exceptions.TimeoutError, TimeoutError):
            return late
        except (urllib3.exceptions.HTTPError, http.client.HTTPException, OSError) as error:
            if cut.is_set():
                return late
            return Attempt("retry", "connection_failed", f"the connection failed ({type(error).__name__})")
        finally:
            watchdog.cancel()
            connection.close()
        if cut.is_set():  # http.client takes the end of the connection for the end of the headers
            return late
        return _judged(response.status, response.headers.get("Retry-After"))
    return Attempt("retry", "connection_failed", f"{parts.hostname} could not be reached")


def _cut(connection: urllib3.connection.HTTPSConnection, cut: threading.Event) -> None:
    """Ends an exchange past its deadline: the thread blocked reading the socket wakes to a closed connection."""
    cut.set()
    if (sock := connection.sock) is not None:  # read once: the attempt's thread may close it meanwhile
        with contextlib.suppress(OSError):
            sock.shutdown(socket.SHUT_RDWR)


def _judged(status: int, retry_after: str | None) -> Attempt:
    if 200 <= status < 300:
        return Attempt("delivered", status_code=status)
    if status == HTTPStatus.GONE:  # the receiver asks us to stop
        return Attempt("failed", "receiver_gone", "the receiver answered 410 Gone", status)
    if 300 <= status < 400:
        message = f"the receiver answered {status}: redirects are not followed, give the final URL"
        return Attempt("retry", "redirect_refused", message, status)
    return Attempt("retry", "http_error", f"the receiver answered {status}", status, retry_after_s(retry_after))


def backoff(attempt: int, settings: Settings, retry_after: float | None = None) -> float:
    """Seconds until the delivery attempt after `attempt` (worker.backoff: base x 2^(attempt-1) with jitter)."""
    return backoff_s(attempt, settings.webhook_retry_base_s, settings.webhook_retry_max_s, retry_after)


def _end(started: Started, attempt: Attempt, settings: Settings, box: Outbox, jobs: JobStore) -> None:
    """Records the attempt in the job's events, then schedules the next one or removes the event."""
    detail: dict[str, Any] = {
        "webhook_id": started.event_id,
        "event": started.event.type,
        "attempt": started.attempt,
        "outcome": attempt.outcome,
        "code": attempt.code,
        "status_code": attempt.status_code,
        "message": attempt.message,
    }
    retry_in = None
    if attempt.outcome == "retry":
        if started.attempt < settings.webhook_max_attempts:
            retry_in = backoff(started.attempt, settings, attempt.retry_after_s)
            detail.update(outcome="retrying", retry_in_s=round(retry_in, 3))
        else:
            detail.update(outcome="failed", message=f"{attempt.message}; gave up after {started.attempt} attempts")
    try:
        jobs.note(started.event.job, "webhook", {name: value for name, value in detail.items() if value is not None})
    except JobNotFound:  # deleted since: the delivery goes on, with nowhere to record it
        pass
    metrics.WEBHOOK_DELIVERIES.inc()
    if attempt.outcome != "delivered":
        metrics.WEBHOOK_FAILURES.inc()
    if retry_in is not None:
        current = box.retry(started.event_id, started.claim, retry_in)
    else:
        current = box.done(started.event_id, started.claim)
    if not current:  # it outlasted its claim, and the event was taken again: that claim decides now
        log.warning("%s attempt %d ended after its claim was taken over", started.event_id, started.attempt)
    log.info(
        "%s %s attempt %d: %s%s",
        started.event_id,
        started.event.type,
        started.attempt,
        detail["outcome"],
        f" ({attempt.code}: {attempt.message})" if attempt.code else "",
    )
