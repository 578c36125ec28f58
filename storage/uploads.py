"""Uploads in parts (OpenAI's Uploads API): an upload declared with its size, its parts sent one request each, then
completed in the order the caller names, or cancelled. A dropped connection costs its part, not the whole file.

    pending ──complete──▶ completing ──joined──▶ completed
       │  ▲                    │
       │  └────refused─────────┘   (a part missing, an md5 not the file's, not a video)
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


def part_key(owner: str, upload_id: str, part_id: str) -> str:
    # Beside the owner's uploads, never one of them: an upload's id starts "upload_"
    return f"uploads/{owner}/parts/{upload_id}/{part_id}"


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


# KEYS: record, parts. ARGV: part id, its size, the most parts. Records the part if the upload still takes it: no part
# larger than the upload, and no more than twice its bytes in all (a part whose answer was lost lands again when sent
# again, and only the parts named at completion count)
_ADD_PART = """
local now = tonumber(redis.call('TIME')[1])
local r = redis.call('HMGET', KEYS[1], 'status', 'bytes', 'received', 'expires_at')
if not r[1] then return {'missing'} end
if r[1] ~= 'pending' then return {r[1]} end
if tonumber(r[4]) <= now then return {'expired'} end
local size, declared = tonumber(ARGV[2]), tonumber(r[2])
if size > declared or tonumber(r[3]) + size > 2 * declared then return {'over'} end
if redis.call('HLEN', KEYS[2]) >= tonumber(ARGV[3]) then return {'too_many'} end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2])
redis.call('HINCRBY', KEYS[1], 'received', ARGV[2])
redis.call('PEXPIRE', KEYS[2], redis.call('PTTL', KEYS[1]))
return {'ok'}
"""

# KEYS: record. ARGV: the hold. pending (or a completing whose hold ran out) → completing; answers the status found.
_BEGIN_COMPLETE = """
local time = redis.call('TIME')
local now = tonumber(time[1]) + tonumber(time[2]) / 1e6
local r = redis.call('HMGET', KEYS[1], 'status', 'expires_at', 'completing_until')
if not r[1] then return 'missing' end
if r[1] == 'pending' and tonumber(r[2]) <= now then return 'expired' end
if r[1] == 'pending' or (r[1] == 'completing' and tonumber(r[3]) <= now) then
  redis.call('HSET', KEYS[1], 'status', 'completing', 'completing_until', now + tonumber(ARGV[1]))
  return 'ok'
end
return r[1]
"""

# KEYS: record, parts. ARGV: the status to go to from `from`, ARGV[3..]: field, value pairs to set.
_MOVE = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return 'missing' end
if status ~= ARGV[2] then return status end
redis.call('HSET', KEYS[1], 'status', ARGV[1], unpack(ARGV, 3))
if ARGV[1] ~= 'pending' then redis.call('DEL', KEYS[2]) end
return 'ok'
"""


# KEYS: record. ARGV: the hold. A completion still running renews its hold.
_RENEW = """
if redis.call('HGET', KEYS[1], 'status') == 'completing' then
  local time = redis.call('TIME')
  redis.call('HSET', KEYS[1], 'completing_until', tonumber(time[1]) + tonumber(time[2]) / 1e6 + tonumber(ARGV[1]))
end
"""


class UploadStore:
    def __init__(self, redis: Redis, *, ttl_s: int, prefix: str = "vsrq", hold_s: float = COMPLETING_HOLD_S) -> None:
        self.redis, self.ttl_s, self.prefix, self.hold_s = redis, ttl_s, prefix, hold_s
        self._add_part = redis.register_script(_ADD_PART)
        self._begin_complete = redis.register_script(_BEGIN_COMPLETE)
        self._move = redis.register_script(_MOVE)
        self._renew = redis.register_script(_RENEW)

    def _keys(self, upload_id: str) -> list[str]:
        record = f"{self.prefix}:upload:{upload_id}"
        return [record, f"{record}:parts"]

    def _now(self) -> int:
        return int(self.redis.time()[0])

    def create(
        self, upload_id: str, owner: str, *, filename: str, size: int, mime_type: str, purpose: str | None
    ) -> UploadRecord:
        """A pending upload of `size` bytes, taking parts until it expires (the upload TTL from now)."""
        return self._write(upload_id, owner, filename, size, mime_type, purpose, UploadStatus.PENDING, None)

    def record_whole(
        self, upload_id: str, owner: str, *, filename: str, size: int, mime_type: str, sha256: str
    ) -> UploadRecord:
        """A file sent whole: completed as it is recorded."""
        return self._write(upload_id, owner, filename, size, mime_type, None, UploadStatus.COMPLETED, sha256)

    def unrecorded(self, upload_id: str, owner: str, filename: str, blob: BlobInfo, mime_type: str) -> UploadRecord:
        """A file sent whole whose record could not be written, as it would read."""
        now = int(blob.modified or time.time())
        return UploadRecord(upload_id, owner, filename, blob.size, mime_type, None, now, now + self.ttl_s,
                            UploadStatus.COMPLETED, blob.size, {}, None, blob.sha256)  # fmt: skip

    def _write(self, upload_id, owner, filename, size, mime_type, purpose, status, sha256) -> UploadRecord:
        now = self._now()
        fields = {
            "owner": owner, "filename": filename, "bytes": size, "mime_type": mime_type, "purpose": purpose or "",
            "created_at": now, "expires_at": now + self.ttl_s, "status": status, "received": 0, "sha256": sha256 or "",
        }  # fmt: skip
        record = self._keys(upload_id)[0]
        # Kept a day past its expiry, so that it answers `expired` rather than not found
        self.redis.pipeline().hset(record, mapping=fields).expire(record, self.ttl_s + 24 * 3600).execute()
        return self.get(upload_id, owner)

    def get(self, upload_id: str, owner: str) -> UploadRecord:
        """The caller's upload; another caller's answers as a missing one."""
        record, parts = self._keys(upload_id)
        with self.redis.pipeline(transaction=True) as pipe:
            fields, sizes, now = pipe.hgetall(record).hgetall(parts).time().execute()
        if not fields or fields[b"owner"].decode() != owner:
            raise UploadNotFound(upload_id)
        text = {name.decode(): value.decode() for name, value in fields.items()}
        part_ids, status = text.get("part_ids"), UploadStatus(text["status"])
        if status is UploadStatus.PENDING and int(text["expires_at"]) <= now[0]:
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

    def add_part(self, upload_id: str, part_id: str, size: int) -> None:
        """Records a stored part; raises NotPending, PartRefused or UploadNotFound when the upload takes it no more."""
        answer = [item.decode() for item in self._add_part(keys=self._keys(upload_id), args=[part_id, size, MAX_PARTS])]
        if answer[0] == "ok":
            return
        if answer[0] == "missing":
            raise UploadNotFound(upload_id)
        if answer[0] == "over":
            message = "This part is larger than the upload, or takes its parts past twice its bytes."
            raise PartRefused("upload_too_large", message)
        if answer[0] == "too_many":
            raise PartRefused("too_many_parts", f"An upload takes at most {MAX_PARTS} parts.")
        raise NotPending(UploadStatus(answer[0]))

    def begin_complete(self, upload_id: str) -> None:
        """Holds the upload for its completion: no part is added meanwhile, and no other completion runs."""
        status = self._begin_complete(keys=self._keys(upload_id)[:1], args=[self.hold_s]).decode()
        if status == "missing":
            raise UploadNotFound(upload_id)
        if status != "ok":
            raise NotPending(UploadStatus(status))

    @contextmanager
    def holding(self, upload_id: str) -> Iterator[None]:
        """Renews the completion's hold while the block runs (a thread of its own: joining parts blocks for long)."""
        stop = threading.Event()

        def renew() -> None:
            while not stop.wait(self.hold_s / 3):
                try:
                    self._renew(keys=self._keys(upload_id)[:1], args=[self.hold_s])
                except RedisError:  # the next beat tries again; the hold outlives a few
                    log.warning("%s: its completion's hold was not renewed", upload_id, exc_info=True)

        renewer = threading.Thread(target=renew, name=f"hold-{upload_id}", daemon=True)
        renewer.start()
        try:
            yield
        finally:
            stop.set()
            renewer.join()

    def reopen(self, upload_id: str) -> None:
        """A completion refused: the upload takes parts again (what the caller can fix: a part missing, or over)."""
        self._move(keys=self._keys(upload_id), args=[UploadStatus.PENDING, UploadStatus.COMPLETING])

    def completed(self, upload_id: str, part_ids: list[str], sha256: str | None) -> None:
        """The parts are joined: the upload is a file any job may name, kept as long as a whole upload."""
        now = self._now()
        fields = ["part_ids", json.dumps(part_ids), "sha256", sha256 or "", "expires_at", now + self.ttl_s]
        self._move(keys=self._keys(upload_id), args=[UploadStatus.COMPLETED, UploadStatus.COMPLETING, *fields])
        self.redis.expire(self._keys(upload_id)[0], self.ttl_s + 24 * 3600)

    def cancel(self, upload_id: str) -> None:
        status = self._move(keys=self._keys(upload_id), args=[UploadStatus.CANCELLED, UploadStatus.PENDING]).decode()
        if status == "missing":
            raise UploadNotFound(upload_id)
        if status not in ("ok", UploadStatus.CANCELLED):
            raise NotPending(UploadStatus(status))
