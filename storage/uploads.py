"""Uploads in parts (OpenAI's Uploads API): an upload declared with its size, its parts sent one request each, then
completed in the order the caller names, or cancelled. A dropped connection costs its part, not the whole file.

    pending ──complete──▶ completing ──joined──▶ completed
       │  ▲                    │
       │  └────refused─────────┘   (a part missing, an md5 not the file's, not a video; or its hold lapsed: the
       │                            completing request's process died)
       ├──cancel──▶ cancelled
       └──(its expires_at passes)──▶ expired

A whole file sent in one request (`POST /v1/uploads` as multipart) is recorded `completed` at once, so that
`GET /v1/uploads/{id}` answers for both. Keys:

    vsrq:upload:{id}           hash: the record
    vsrq:upload:{id}:parts     hash: part id → its size, for each part stored so far

Each part is a blob of its own (`part_key`), recorded only once all its bytes are stored; `complete` joins them into
the upload's one blob (uploads/{owner}/{id}, what a job names) and deletes them. A pending upload's parts go with its
TTL: the storage sweep deletes blobs under uploads/ that no job names (storage.lifecycle).
"""

from __future__ import annotations

import json
import logging
import secrets
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from enum import StrEnum

from redis import Redis
from redis.exceptions import RedisError

from storage.blobs import BlobInfo

log = logging.getLogger("vsrq.uploads")

# OpenAI's part size limit, and the SDK's `upload_file_chunked` part size
PART_MAX_BYTES = 64 * 1024 * 1024
MAX_PARTS = 10_000  # S3's multipart limit; 64 MiB parts are 640 GB
KEPT_AFTER_S = 24 * 3600  # a record is kept this long past its expiry, so that it answers `expired`, not not found
# A completion holds its upload this long at a time, renewed while it joins the parts: one whose API process was
# killed lets another take over this soon after
COMPLETING_HOLD_S = 30


class UploadStatus(StrEnum):
    PENDING = "pending"
    COMPLETING = "completing"  # shown as pending: OpenAI's statuses have no such step
    COMPLETED = "completed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"


class UploadNotFound(Exception):
    pass


class NotPending(Exception):
    """The upload takes no part, no completion or no cancel in its status."""

    def __init__(self, status: UploadStatus) -> None:
        super().__init__(status)
        self.status = status


class PartRefused(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


def new_part_id() -> str:
    return "part_" + secrets.token_hex(12)


def parts_prefix(owner: str) -> str:
    # Beside the owner's uploads, never one of them: an upload's id starts "upload_"
    return f"uploads/{owner}/parts/"


def part_key(owner: str, upload_id: str, part_id: str) -> str:
    return f"{parts_prefix(owner)}{upload_id}/{part_id}"


@dataclass(frozen=True)
class UploadRecord:
    id: str
    owner: str
    filename: str
    bytes: int
    mime_type: str
    purpose: str | None
    created_at: int
    expires_at: int
    status: UploadStatus
    received: int  # the bytes of the parts stored so far
    parts: dict[str, int]  # part id → size; empty once completed
    part_ids: list[str] | None  # the order it was completed in
    sha256: str | None


# Every script's first lines: Redis's time, and the upload's status as it stands now. A completion whose hold lapsed
# (its API process died mid-join) leaves the upload pending again; a pending one past its expiry is expired.
_NOW = """
local clock = redis.call('TIME')
local now = tonumber(clock[1]) + tonumber(clock[2]) / 1e6
local function current(key)
  local r = redis.call('HMGET', key, 'status', 'expires_at', 'completing_until')
  if not r[1] then return 'missing' end
  if r[1] == 'completing' and tonumber(r[3]) <= now then
    redis.call('HSET', key, 'status', 'pending', 'completing_token', '')
    r[1] = 'pending'
  end
  if r[1] == 'pending' and tonumber(r[2]) <= now then return 'expired' end
  return r[1]
end
"""

# KEYS: record, parts. ARGV: part id, its size, the most parts. Records the part if the upload still takes it: no part
# larger than the upload, and no more than twice its bytes in all (a part whose answer was lost lands again when sent
# again, and only the parts named at completion count). Answers when it was recorded.
_ADD_PART = _NOW + """
local status = current(KEYS[1])
if status ~= 'pending' then return {status} end
local r = redis.call('HMGET', KEYS[1], 'bytes', 'received')
local size, declared = tonumber(ARGV[2]), tonumber(r[1])
if size > declared or tonumber(r[2]) + size > 2 * declared then return {'over'} end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[3]) then return {'too_many'} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'received', ARGV[2])
redis.call('PEXPIRE', KEYS[2], redis.call('PTTL', KEYS[1]))
return {'ok', math.floor(now)}
"""

# KEYS: record. ARGV: the hold, the completion's token. pending → completing, held by that token; answers the status.
_BEGIN_COMPLETE = _NOW + """
local status = current(KEYS[1])
if status ~= 'pending' then return status end
redis.call('HSET', KEYS[1], 'status', 'completing', 'completing_until', now + tonumber(ARGV[1]),
           'completing_token', ARGV[2])
return 'ok'
"""

# KEYS: record. ARGV: the hold, the token. The completion holding the upload renews its hold; 0 if it lost it.
_RENEW = _NOW + """
local r = redis.call('HMGET', KEYS[1], 'status', 'completing_token')
if r[1] ~= 'completing' or r[2] ~= ARGV[2] then return 0 end
redis.call('HSET', KEYS[1], 'completing_until', now + tonumber(ARGV[1]))
return 1
"""

# KEYS: record, parts. ARGV: the token, the status to end in, then field, value pairs. The completion holding the
# upload ends: completed (its parts' record goes) or pending again; answers the status found where it holds it no more.
_END_COMPLETE = """
local r = redis.call('HMGET', KEYS[1], 'status', 'completing_token')
if r[1] ~= 'completing' or r[2] ~= ARGV[1] then return r[1] or 'missing' end
redis.call('HSET', KEYS[1], 'status', ARGV[2], 'completing_token', '', unpack(ARGV, 3))
if ARGV[2] ~= 'pending' then redis.call('DEL', KEYS[2]) end
return 'ok'
"""

# KEYS: record, parts. A pending upload cancelled (its parts' record goes); answers the status found.
_CANCEL = _NOW + """
local status = current(KEYS[1])
if status ~= 'pending' then return status end
redis.call('HSET', KEYS[1], 'status', 'cancelled')
redis.call('DEL', KEYS[2])
return 'ok'
"""


class UploadStore:
    def __init__(self, redis: Redis, *, ttl_s: int, prefix: str = "vsrq", hold_s: float = COMPLETING_HOLD_S) -> None:
        self.redis, self.ttl_s, self.prefix, self.hold_s = redis, ttl_s, prefix, hold_s
        self._add_part = redis.register_script(_ADD_PART)
        self._begin_complete = redis.register_script(_BEGIN_COMPLETE)
        self._renew = redis.register_script(_RENEW)
        self._end_complete = redis.register_script(_END_COMPLETE)
        self._cancel = redis.register_script(_CANCEL)

    def _keys(self, upload_id: str) -> list[str]:
        record = f"{self.prefix}:upload:{upload_id}"
        return [record, f"{record}:parts"]

    def _now(self) -> int:
        return int(self.redis.time()[0])

    def create(
        self, upload_id: str, owner: str, *, filename: str, size: int, mime_type: str, purpose: str | None
    ) -> UploadRecord:
        """A pending upload of `size` bytes, taking parts until it expires (the upload TTL from now)."""
        return self._write(self._new(upload_id, owner, filename, size, mime_type, purpose, None, self._now()))

    def record_whole(
        self, upload_id: str, owner: str, *, filename: str, size: int, mime_type: str, sha256: str
    ) -> UploadRecord:
        """A file sent whole: completed as it is recorded."""
        return self._write(self._new(upload_id, owner, filename, size, mime_type, None, sha256, self._now()))

    def unrecorded(self, upload_id: str, owner: str, filename: str, blob: BlobInfo, mime_type: str) -> UploadRecord:
        """A file sent whole whose record could not be written, as it would read."""
        return self._new(upload_id, owner, filename, blob.size, mime_type, None, blob.sha256,
                         int(blob.modified or time.time()))  # fmt: skip

    def _new(self, upload_id, owner, filename, size, mime_type, purpose, sha256, now) -> UploadRecord:
        """A new upload's record: completed where its file came whole (`sha256` known), else pending."""
        status, received = (UploadStatus.COMPLETED, size) if sha256 else (UploadStatus.PENDING, 0)
        return UploadRecord(upload_id, owner, filename, size, mime_type, purpose, now, now + self.ttl_s, status,
                            received, {}, None, sha256)  # fmt: skip

    def _write(self, record: UploadRecord) -> UploadRecord:
        fields = {
            "owner": record.owner, "filename": record.filename, "bytes": record.bytes, "mime_type": record.mime_type,
            "purpose": record.purpose or "", "created_at": record.created_at, "expires_at": record.expires_at,
            "status": record.status, "received": record.received, "sha256": record.sha256 or "",
        }  # fmt: skip
        key = self._keys(record.id)[0]
        self.redis.pipeline().hset(key, mapping=fields).expire(key, self.ttl_s + KEPT_AFTER_S).execute()
        return record

    def get(self, upload_id: str, owner: str) -> UploadRecord:
        """The caller's upload; another caller's answers as a missing one."""
        record, parts = self._keys(upload_id)
        with self.redis.pipeline(transaction=True) as pipe:
            fields, sizes, now = pipe.hgetall(record).hgetall(parts).time().execute()
        if not fields or fields[b"owner"].decode() != owner:
            raise UploadNotFound(upload_id)
        text = {name.decode(): value.decode() for name, value in fields.items()}
        part_ids, status, now_s = text.get("part_ids"), UploadStatus(text["status"]), now[0] + now[1] / 1e6
        if status is UploadStatus.COMPLETING and float(text["completing_until"]) <= now_s:
            status = UploadStatus.PENDING  # its completion died: the next script to run says so (`_NOW`)
        if status is UploadStatus.PENDING and int(text["expires_at"]) <= now_s:
            status = UploadStatus.EXPIRED
        return UploadRecord(
            id=upload_id,
            owner=owner,
            filename=text["filename"],
            bytes=int(text["bytes"]),
            mime_type=text["mime_type"],
            purpose=text["purpose"] or None,
            created_at=int(text["created_at"]),
            expires_at=int(text["expires_at"]),
            status=status,
            received=int(text["received"]),
            parts={part.decode(): int(size) for part, size in sizes.items()},
            part_ids=json.loads(part_ids) if part_ids else None,
            sha256=text["sha256"] or None,
        )

    def add_part(self, upload_id: str, part_id: str, size: int) -> int:
        """Records a stored part, and when; raises NotPending, PartRefused or UploadNotFound when the upload takes it
        no more."""
        answer = self._add_part(keys=self._keys(upload_id), args=[part_id, size, MAX_PARTS])
        answer[0] = answer[0].decode()
        if answer[0] == "ok":
            return int(answer[1])
        if answer[0] == "missing":
            raise UploadNotFound(upload_id)
        if answer[0] == "over":
            message = "This part is larger than the upload, or takes its parts past twice its bytes."
            raise PartRefused("upload_too_large", message)
        if answer[0] == "too_many":
            raise PartRefused("too_many_parts", f"An upload takes at most {MAX_PARTS} parts.")
        raise NotPending(UploadStatus(answer[0]))

    def begin_complete(self, upload_id: str) -> str:
        """Holds the upload for its completion: no part is added meanwhile, and no other completion runs. The hold's
        token, which renews and ends it."""
        token = secrets.token_hex(8)
        status = self._begin_complete(keys=self._keys(upload_id)[:1], args=[self.hold_s, token]).decode()
        if status == "missing":
            raise UploadNotFound(upload_id)
        if status != "ok":
            raise NotPending(UploadStatus(status))
        return token

    @contextmanager
    def holding(self, upload_id: str, token: str) -> Iterator[None]:
        """Renews the completion's hold while the block runs (a thread of its own: joining parts blocks for long)."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.hold_s / 3):
                try:
                    self._renew(keys=self._keys(upload_id)[:1], args=[self.hold_s, token])
                except RedisError:  # the next beat tries again; the hold outlives a few
                    log.warning("%s: its completion's hold was not renewed", upload_id, exc_info=True)

        renewer = threading.Thread(target=renew, name=f"hold-{upload_id}", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()

    def reopen(self, upload_id: str, token: str) -> None:
        """A completion that failed (refused, or an error): the upload takes parts again, unless another completion
        holds it now."""
        self._end_complete(keys=self._keys(upload_id), args=[token, UploadStatus.PENDING])

    def completed(self, upload_id: str, token: str, part_ids: list[str], sha256: str | None) -> bool:
        """The parts are joined: the upload is a file any job may name, kept as long as a whole upload. False where
        this completion held it no more (its hold lapsed and another took it over)."""
        now = self._now()
        fields = ["part_ids", json.dumps(part_ids), "sha256", sha256 or "", "expires_at", now + self.ttl_s]
        ended = self._end_complete(keys=self._keys(upload_id), args=[token, UploadStatus.COMPLETED, *fields])
        self.redis.expire(self._keys(upload_id)[0], self.ttl_s + KEPT_AFTER_S)
        return ended.decode() == "ok"

    def cancel(self, upload_id: str) -> None:
        status = self._cancel(keys=self._keys(upload_id)).decode()
        if status == "missing":
            raise UploadNotFound(upload_id)
        if status not in ("ok", UploadStatus.CANCELLED):
            raise NotPending(UploadStatus(status))
