"""Blob storage: videos in and out. One interface, two backends: any S3 endpoint (SeaweedFS, AWS, R2...) through boto3,
and a local directory for the embedded mode.

Keys are chosen by the server (never by callers), from the layout functions below. Writes are streamed: a source is
read in parts (S3 multipart above `part_bytes`), never whole, while its size is capped and its SHA-256 computed.
"""

from __future__ import annotations

import errno
import functools
import hashlib
import io
import itertools
import logging
import math
import os
import re
import secrets
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from stat import S_ISREG
from typing import Any, BinaryIO, Protocol

import boto3
import botocore.exceptions
from boto3.exceptions import RetriesExceededError, S3UploadFailedError
from boto3.s3.transfer import TransferConfig
from botocore.awsrequest import AWSResponse
from botocore.config import Config
from botocore.exceptions import ClientError
from botocore.retries.standard import (
    OrRetryChecker,
    RetryContext,
    ThrottledRetryableChecker,
    ThrottlingStatusCodeChecker,
    TransientRetryableChecker,
)

from storage.config import Settings

log = logging.getLogger("vsrq.blobs")

# -- Key layout ----------------------------------------------------------------------------------------------------
# uploads/{owner}/{upload_id}            an input video (POST /v1/uploads, or the file of a multipart create)
# outputs/{job_id}/attempt-{n}-{token}.mp4
#                                        what attempt n (under lease token `token`) wrote. It is promoted to the
#                                        job's result by the fenced `complete` that records its key: a stale attempt
#                                        can upload, but never become (or overwrite) the result, even one whose
#                                        attempt number was given again. Other attempts' files are then deleted.
# work/{job_id}/                         what an attempt keeps for the next attempt of the same job (finished
#                                        windows): attempt-independent, deleted when the job ends


def new_upload_id() -> str:
    return "upload_" + secrets.token_hex(12)


def upload_key(owner: str, upload_id: str) -> str:
    return f"uploads/{owner}/{upload_id}"


def output_prefix(job_id: str) -> str:
    return f"outputs/{job_id}/"


def attempt_output_key(job_id: str, attempt: int, token: str) -> str:
    return f"{output_prefix(job_id)}attempt-{attempt}-{token}.mp4"


PREVIEWS = ("thumbnail", "spritesheet")  # what the worker makes of an output (worker.media.previews)


def preview_key(output_key: str, variant: str) -> str:
    """A JPEG made from an output (its thumbnail, its sprite sheet), beside it: deleted with the job's outputs."""
    return f"{output_key.removesuffix('.mp4')}.{variant}.jpg"


def work_prefix(job_id: str) -> str:
    return f"work/{job_id}/"


# -- Interface -----------------------------------------------------------------------------------------------------


class BlobError(Exception):
    code = "storage_error"


class BlobNotFound(BlobError):
    code = "blob_not_found"


class InvalidKey(BlobError):
    code = "invalid_key"


class TooLarge(BlobError):
    code = "too_large"

    def __init__(self, limit: int) -> None:
        super().__init__(f"more than {limit} bytes")
        self.limit = limit


@dataclass(frozen=True)
class BlobInfo:
    key: str
    size: int
    sha256: str | None = None  # known where we wrote the blob (put): the caller records it
    modified: float | None = None  # epoch seconds, in listings (`entries`): what the lifecycle sweep ages by
    # which version of the key this is (`head`): a blob written again gets another one (a copy kept by a worker,
    # worker.prefetch, is used only while the key's still matches)
    etag: str | None = None


# Bytes moved since the last call, from the thread doing the transfer: long transfers drive a lease's heartbeats.
Progress = Callable[[int], None]


class BlobStore(Protocol):
    def put(
        self,
        key: str,
        source: BinaryIO,
        *,
        content_type: str = "application/octet-stream",
        max_bytes: int | None = None,
        progress: Progress | None = None,
    ) -> BlobInfo:
        """Stream `source` to `key`; raises `TooLarge` past `max_bytes`, leaving nothing behind."""

    def open(self, key: str, byte_range: tuple[int, int] | None = None) -> BinaryIO:
        """A stream of the blob (close it), or of its bytes first..last (inclusive, as HTTP counts them: the range
        must lie within the blob); raises `BlobNotFound`."""

    def download(self, key: str, path: Path, progress: Progress | None = None) -> None: ...

    def head(self, key: str) -> BlobInfo | None: ...

    def join(self, key: str, sources: list[str], *, content_type: str = "application/octet-stream") -> BlobInfo:
        """The blobs `sources`, in order, written as one at `key` (its sha256 where it was read to join it); raises
        `BlobNotFound` for a missing source, leaving nothing at `key`. One join of a key at a time: a write of it
        begun before and left unfinished (its process killed) is dropped."""

    def exists(self, key: str) -> bool: ...

    def delete(self, key: str) -> None:
        """Idempotent: deleting a missing key is not an error."""

    def keys(self, prefix: str) -> Iterator[str]: ...

    def entries(self, prefix: str) -> Iterator[BlobInfo]:
        """The blobs under `prefix`, with size and `modified`."""

    def delete_many(self, keys: Iterable[str]) -> dict[str, str]:
        """Deletes `keys` in as few requests as storage allows (a sweep expiring thousands of jobs); returns those it
        did not delete, each with storage's code (a bucket policy, an object lock; one still failing after tries).
        A missing key is deleted."""

    def delete_prefix(self, prefix: str) -> int:
        """Deletes the blobs under `prefix` and drops writes under it never finished (a writer killed mid-upload:
        their parts are in no listing of blobs, and stayed until `abort_incomplete`, a day); returns the blobs
        deleted. What storage would not delete is logged and left to the storage sweep."""

    def abort_incomplete(self, before: float) -> int:
        """Drops writes begun before `before` (epoch seconds) and never finished; returns how many."""

    def presigned_url(
        self, key: str, ttl_s: int, filename: str | None = None, content_type: str | None = None
    ) -> str | None:
        """A URL that GETs the blob for `ttl_s` seconds (answered as an attachment named `filename`, of `content_type`,
        where given), or None where the backend has no server to sign for."""

    def check(self, write: bool = False) -> None:
        """Raises unless the store is reachable and usable (health checks); `write`: writes too, an object written
        and deleted (a worker's start, `vsrq status`: a key that may only read passed, and failed every job)."""


def open_blob_store(settings: Settings) -> BlobStore:
    if settings.blob_backend == "s3":
        return S3BlobStore.from_settings(settings)
    return LocalBlobStore(settings.local_blob_dir)


class _Joined:
    """Blobs read one after another as one stream (what `put` takes), each opened as its turn comes."""

    def __init__(self, store: BlobStore, keys: list[str]) -> None:
        self._store, self._keys = store, iter(keys)
        self._current: BinaryIO | None = None

    def read(self, size: int = -1) -> bytes:
        if size < 0:
            return b"".join(iter(lambda: self.read(8 * 1024 * 1024), b""))
        while True:
            if self._current is None:
                key = next(self._keys, None)
                if key is None:
                    return b""
                self._current = self._store.open(key)
            if chunk := self._current.read(size):
                return chunk
            self._current.close()
            self._current = None

    def close(self) -> None:
        if self._current is not None:
            self._current.close()


_BLOCK = 64 * 1024  # what `read_at` reads of a blob at a time


def read_at(store: BlobStore, blob: BlobInfo, head: bytes, most_blocks: int = 64) -> Callable[[int, int], bytes]:
    """Reads of a stored blob at any offset (`read(offset, length)`), for parsers that seek: its first bytes from
    `head`, the rest by ranged reads of 64 KiB blocks, each read once; past `most_blocks` of them (4 MiB), empty."""
    blocks: dict[int, bytes] = {}

    def read(offset: int, length: int) -> bytes:
        if offset + length <= len(head) or offset >= blob.size:
            return head[offset : offset + length]
        first, last = offset // _BLOCK, (min(offset + length, blob.size) - 1) // _BLOCK
        for block in range(first, last + 1):
            if block not in blocks:
                if len(blocks) == most_blocks:
                    return b""
                with store.open(blob.key, (block * _BLOCK, min((block + 1) * _BLOCK, blob.size) - 1)) as stream:
                    blocks[block] = stream.read()
        data = b"".join(blocks[block] for block in range(first, last + 1))
        return data[offset - first * _BLOCK :][:length]

    return read


def _join_by_reading(store: BlobStore, key: str, sources: list[str], content_type: str) -> BlobInfo:
    joined = _Joined(store, sources)
    try:
        return store.put(key, joined, content_type=content_type)
    finally:
        joined.close()


class _Metered:
    """Reads through a source, counting and hashing, and stops the write once it passes `limit` bytes.

    It has no `seek`, on purpose: boto3 then reads it strictly in order, in parts, which keeps the hash right and the
    memory bounded."""

    def __init__(self, source: BinaryIO, limit: int | None) -> None:
        self._source, self._limit = source, limit
        self.size = 0
        self._hash = hashlib.sha256()

    def read(self, size: int = -1) -> bytes:
        # Fill the request: boto3 takes a short read for the end of the stream (sockets, request bodies read short).
        chunks = [self._source.read(size)]
        got = len(chunks[0])
        while size > 0 and 0 < got < size:
            chunks.append(self._source.read(size - got))
            if not chunks[-1]:
                break
            got += len(chunks[-1])
        data = b"".join(chunks)
        self.size += len(data)
        if self._limit is not None and self.size > self._limit:
            raise TooLarge(self._limit)
        self._hash.update(data)
        return data

    @property
    def sha256(self) -> str:
        return self._hash.hexdigest()


MIN_PART_BYTES = 5 * 1024 * 1024  # S3's least part of a multipart upload, the last one apart

# -- S3 ------------------------------------------------------------------------------------------------------------


def _client(settings: Settings, endpoint_url: str | None):
    return boto3.client(
        "s3",
        endpoint_url=endpoint_url,
        region_name=settings.s3_region,
        aws_access_key_id=settings.s3_access_key,
        aws_secret_access_key=settings.s3_secret_key.get_secret_value() if settings.s3_secret_key else None,
        # Path-style addressing works with every S3 implementation; virtual hosts need DNS per bucket.
        config=Config(
            signature_version="s3v4",
            s3={"addressing_style": "path"},
            retries={"mode": "standard"},
            connect_timeout=settings.s3_timeout_s,
            read_timeout=settings.s3_timeout_s,
        ),
    )


class S3BlobStore:
    def __init__(
        self, client, bucket: str, part_bytes: int = 8 * 1024 * 1024, concurrency: int = 4, signer=None
    ) -> None:
        self.client, self.bucket, self._concurrency = client, bucket, concurrency
        self._signer = signer or client  # presigned URLs: a client for the public address (`s3_public_url`)
        self._transfer = TransferConfig(
            multipart_threshold=part_bytes, multipart_chunksize=part_bytes, max_concurrency=concurrency
        )

    @classmethod
    def from_settings(cls, settings: Settings) -> S3BlobStore:
        client = _client(settings, settings.s3_endpoint_url)
        # makes no request: it only signs URLs for where clients reach storage
        signer = _client(settings, settings.s3_public_url) if settings.s3_public_url else None
        return cls(client, settings.s3_bucket, settings.s3_part_bytes, settings.s3_upload_concurrency, signer)

    def put(
        self,
        key: str,
        source: BinaryIO,
        *,
        content_type: str = "application/octet-stream",
        max_bytes: int | None = None,
        progress: Progress | None = None,
    ) -> BlobInfo:
        metered = _Metered(source, max_bytes)
        # A failed multipart upload is aborted by boto3's transfer manager, so a refused upload leaves no parts.
        self.client.upload_fileobj(
            metered,
            self.bucket,
            key,
            ExtraArgs={"ContentType": content_type},
            Config=self._transfer,
            Callback=progress,
        )
        return BlobInfo(key, metered.size, metered.sha256)

    def open(self, key: str, byte_range: tuple[int, int] | None = None) -> BinaryIO:
        ranged = {"Range": f"bytes={byte_range[0]}-{byte_range[1]}"} if byte_range else {}
        try:
            return self.client.get_object(Bucket=self.bucket, Key=key, **ranged)["Body"]
        except ClientError as error:
            if _missing(error):
                raise BlobNotFound(key) from error
            raise

    def download(self, key: str, path: Path, progress: Progress | None = None) -> None:
        try:
            self.client.download_file(self.bucket, key, str(path), Config=self._transfer, Callback=progress)
        except ClientError as error:
            if _missing(error):
                raise BlobNotFound(key) from error
            raise

    def head(self, key: str) -> BlobInfo | None:
        try:
            response = self.client.head_object(Bucket=self.bucket, Key=key)
        except ClientError as error:
            if _missing(error):
                return None
            raise
        return BlobInfo(key, response["ContentLength"], etag=response.get("ETag"))

    def join(self, key: str, sources: list[str], *, content_type: str = "application/octet-stream") -> BlobInfo:
        # Copied inside storage, part by part (UploadPartCopy), not read through this process and written back (4-6 x
        # faster on a local SeaweedFS: bench/RESULTS.md). S3 takes no part under 5 MiB but the last: such are read.
        sizes = [self._size(source) for source in sources]
        # One join of a key runs at a time (its caller holds it): one begun before was killed midway, its parts kept
        for stale in self.client.list_multipart_uploads(Bucket=self.bucket, Prefix=key).get("Uploads", []):
            if stale["Key"] == key:
                self._abort_upload(key, stale["UploadId"])
        if any(size < MIN_PART_BYTES for size in sizes[:-1]):
            return _join_by_reading(self, key, sources, content_type)
        upload_id = self.client.create_multipart_upload(Bucket=self.bucket, Key=key, ContentType=content_type)[
            "UploadId"
        ]

        def copy(number: int, source: str) -> dict[str, Any]:
            copied = self.client.upload_part_copy(
                Bucket=self.bucket, Key=key, UploadId=upload_id, PartNumber=number,
                CopySource={"Bucket": self.bucket, "Key": source},
            )  # fmt: skip
            return {"PartNumber": number, "ETag": copied["CopyPartResult"]["ETag"]}

        try:
            with ThreadPoolExecutor(self._concurrency) as pool:
                parts = list(pool.map(copy, range(1, len(sources) + 1), sources))
            self.client.complete_multipart_upload(
                Bucket=self.bucket, Key=key, UploadId=upload_id, MultipartUpload={"Parts": parts}
            )
        except BaseException:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
            raise
        return BlobInfo(key, sum(sizes))

    def _size(self, key: str) -> int:
        blob = self.head(key)
        if blob is None:
            raise BlobNotFound(key)
        return blob.size

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def delete(self, key: str) -> None:
        self.client.delete_object(Bucket=self.bucket, Key=key)

    def keys(self, prefix: str) -> Iterator[str]:
        return (entry.key for entry in self.entries(prefix))

    def entries(self, prefix: str) -> Iterator[BlobInfo]:
        for page in self.client.get_paginator("list_objects_v2").paginate(Bucket=self.bucket, Prefix=prefix):
            for item in page.get("Contents", []):
                yield BlobInfo(item["Key"], item["Size"], modified=item["LastModified"].timestamp())

    def delete_many(self, keys: Iterable[str]) -> dict[str, str]:
        refused: dict[str, str] = {}
        left = iter(keys)
        while batch := list(itertools.islice(left, 1000)):  # DeleteObjects takes at most 1000 keys
            refused |= self._delete_batch(batch)
        return refused

    def _delete_batch(self, keys: list[str]) -> dict[str, str]:
        """One DeleteObjects, sent again for the keys it failed for a moment: its per-key errors come in a 200, which
        botocore's retries never see."""
        refused: dict[str, str] = {}
        for pause_s in (0.2, 1.0, None):
            objects = {"Objects": [{"Key": key} for key in keys], "Quiet": True}  # quiet: only errors come back
            errors = self.client.delete_objects(Bucket=self.bucket, Delete=objects).get("Errors", [])
            failed = {error["Key"]: error.get("Code", "") for error in errors if error.get("Code") != "NoSuchKey"}
            keys = [key for key, code in failed.items() if code in TRANSIENT_CODES]
            refused |= {key: code for key, code in failed.items() if code not in TRANSIENT_CODES or pause_s is None}
            if not keys or pause_s is None:
                return refused
            time.sleep(pause_s)
        return refused

    def delete_prefix(self, prefix: str) -> int:
        keys = list(self.keys(prefix))
        refused = self.delete_many(keys)
        _log_refused(prefix, refused)
        self._abort_uploads(prefix, before=math.inf)
        return len(keys) - len(refused)

    def abort_incomplete(self, before: float) -> int:
        return self._abort_uploads("", before)

    def _abort_uploads(self, prefix: str, before: float) -> int:
        aborted = 0
        pages = self.client.get_paginator("list_multipart_uploads").paginate(Bucket=self.bucket, Prefix=prefix)
        for page in pages:
            for upload in page.get("Uploads", []):
                if upload["Key"].startswith(prefix) and upload["Initiated"].timestamp() < before:
                    aborted += self._abort_upload(upload["Key"], upload["UploadId"])
        return aborted

    def _abort_upload(self, key: str, upload_id: str) -> bool:
        """False where it ended since it was listed (AWS says NoSuchUpload; SeaweedFS answers 204)."""
        try:
            self.client.abort_multipart_upload(Bucket=self.bucket, Key=key, UploadId=upload_id)
        except ClientError as error:
            if error.response.get("Error", {}).get("Code") != "NoSuchUpload":
                raise
            return False
        return True

    def presigned_url(
        self, key: str, ttl_s: int, filename: str | None = None, content_type: str | None = None
    ) -> str | None:
        params = {"Bucket": self.bucket, "Key": key}
        if filename is not None:  # S3 answers with these headers instead of the object's own
            params["ResponseContentDisposition"] = f'attachment; filename="{filename}"'
        if content_type is not None:
            params["ResponseContentType"] = content_type
        # signed for the address clients reach storage at (SigV4 signs the host), which may not be the service's own
        return self._signer.generate_presigned_url("get_object", Params=params, ExpiresIn=ttl_s)

    def check(self, write: bool = False) -> None:
        self.client.head_bucket(Bucket=self.bucket)
        if write:
            probe = f"{WRITE_PROBES}{secrets.token_hex(8)}"
            # a versioned bucket keeps a version and a delete marker of each probe unless its version is deleted
            version = self.client.put_object(Bucket=self.bucket, Key=probe, Body=b"").get("VersionId")
            try:
                self.client.delete_object(Bucket=self.bucket, Key=probe, **({"VersionId": version} if version else {}))
            except ClientError as error:
                if version is None:
                    raise
                # a key without DeleteObjectVersion, a store without it: a delete marker at least, as before
                self.client.delete_object(Bucket=self.bucket, Key=probe)
                _say_versions_kept(self.bucket, error.response.get("Error", {}).get("Code", "unknown"))


@functools.cache
def _say_versions_kept(bucket: str, code: str) -> None:
    """Once a process: every health check and start would say it again."""
    log.warning(
        "storage did not delete a write probe's version in the versioned bucket %s (%s): where it refuses, each check "
        "leaves a version and a delete marker under %s; give the key s3:DeleteObjectVersion, or add a lifecycle rule "
        "that expires them",
        bucket, code, WRITE_PROBES,
    )  # fmt: skip


# `check(write=True)`'s objects, each deleted at once: under the jobs' own prefix (a bucket policy may allow no other),
# where the sweep deletes one left behind as a job that does not exist
WRITE_PROBES = "work/write-probe-"


# DeleteObjects' per-key codes worth another try (S3's own list of retryable errors names these)
TRANSIENT_CODES = frozenset({"InternalError", "SlowDown", "ServiceUnavailable", "RequestTimeout", "OperationAborted"})


def _log_refused(prefix: str, refused: dict[str, str]) -> None:
    if refused:
        key, code = next(iter(refused.items()))
        log.warning("storage did not delete %d blob(s) under %r (%s: %s first); left to the storage sweep",
                    len(refused), prefix, code, key)  # fmt: skip


def _missing(error: ClientError) -> bool:
    return error.response.get("Error", {}).get("Code") in ("404", "NoSuchKey", "NotFound")


def refusal(error: ClientError) -> str | None:
    """What storage refused, where it did: "key" (the access key or its secret: 403), "bucket" (none of that name);
    None for any other answer. A HEAD's answer has no code but its status."""
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    code = error.response.get("Error", {}).get("Code")
    if status == 403 or code in ("AccessDenied", "InvalidAccessKeyId", "SignatureDoesNotMatch"):
        return "key"
    if code == "NoSuchBucket" or (status == 404 and error.operation_name == "HeadBucket"):
        return "bucket"
    return None


# botocore's own transient list (standard retry mode, as this module configures it): still transient past its 3 tries
_BOTOCORE_TRANSIENT = OrRetryChecker(
    [TransientRetryableChecker(), ThrottledRetryableChecker(), ThrottlingStatusCodeChecker()]
)
# S3's answers to an upload that reached it damaged (a body cut short or altered on the way: a partition that healed
# mid-request), which botocore does not retry since its own bytes were sound. SeaweedFS answers a body cut short with
# 499 ClientDisconnected, AWS with 400 IncompleteBody or RequestTimeout. Only a request with a body can arrive so: on
# any other (a HEAD against the wrong region answers a bare 400) they are refusals that stay.
_DAMAGED = {"IncompleteBody", "BadDigest", "XAmzContentSHA256Mismatch", "ClientDisconnected", "BadRequest"}
_UPLOADS = {"PutObject", "UploadPart", "CompleteMultipartUpload"}
# S3UploadFailedError, RetriesExceededError: boto3's transfer manager gave up on the parts
UNREACHABLE = (
    botocore.exceptions.ConnectionError,
    botocore.exceptions.HTTPClientError,
    S3UploadFailedError,
    RetriesExceededError,
)


def storage_unavailable(error: BaseException) -> bool:
    """Whether storage could not be reached, or answered that it may on the next try (an outage: waited out, logged
    in a line), as opposed to a refusal that stays or a bug."""
    return isinstance(error, UNREACHABLE) or (isinstance(error, ClientError) and _transient(error))


def _transient(error: ClientError) -> bool:
    """Whether storage's answer may change on the next try. A 400 with no S3 error code to an upload is one the server
    could not parse as a request at all (botocore names it by its status): only bytes lost on the way make those of a
    request botocore built. Refusals that stay (403 AccessDenied, 404 NoSuchBucket, InvalidAccessKeyId...) are
    permanent; a conflict S3 says to try again (OperationAborted) is not."""
    status = error.response.get("ResponseMetadata", {}).get("HTTPStatusCode", 0)
    code = error.response.get("Error", {}).get("Code")
    damaged = code in _DAMAGED or (status == 400 and code in (None, "400"))
    if error.operation_name in _UPLOADS and damaged:
        return True
    if status >= 500 or status in (408, 499) or code in TRANSIENT_CODES:
        return True
    context = RetryContext(1, parsed_response=error.response, http_response=AWSResponse(None, status, {}, None))
    return _BOTOCORE_TRANSIENT.is_retryable(context)


# -- Local directory -----------------------------------------------------------------------------------------------

# Segments of letters, digits, '.', '_' and '-' that do not start with a dot: no '..', no hidden files, no absolute
# paths, no backslashes. Keys are server-chosen, so this only ever refuses bugs and attacks.
SAFE_KEY = re.compile(r"[A-Za-z0-9_-][A-Za-z0-9._-]*(/[A-Za-z0-9_-][A-Za-z0-9._-]*)*")


class _Slice(io.RawIOBase):
    """The next `length` bytes of a file, ending there as an S3 ranged GET does."""

    def __init__(self, file: BinaryIO, length: int) -> None:
        self._file, self._left = file, length

    def readable(self) -> bool:
        return True

    def readinto(self, buffer) -> int:
        got = self._file.readinto(memoryview(buffer)[: self._left])
        self._left -= got
        return got

    def close(self) -> None:
        self._file.close()
        super().close()


class LocalBlobStore:
    def __init__(self, root: str | Path) -> None:
        self.root = Path(root).resolve()
        self.root.mkdir(parents=True, exist_ok=True)

    def _path(self, key: str) -> Path:
        if not SAFE_KEY.fullmatch(key) or len(key) > 1024:
            raise InvalidKey(f"invalid blob key {key!r}")
        path = (self.root / key).resolve()
        if not path.is_relative_to(self.root):  # belt and braces: symlinks inside the root
            raise InvalidKey(f"invalid blob key {key!r}")
        return path

    def put(
        self,
        key: str,
        source: BinaryIO,
        *,
        content_type: str = "application/octet-stream",
        max_bytes: int | None = None,
        progress: Progress | None = None,
    ) -> BlobInfo:
        path = self._path(key)
        path.parent.mkdir(parents=True, exist_ok=True)
        metered = _Metered(source, max_bytes)
        # Written beside its final name and renamed: readers never see half a blob, a refused write leaves nothing.
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        try:
            with open(partial, "wb") as sink:
                _copy(metered, sink, progress)
            os.replace(partial, path)
        finally:
            partial.unlink(missing_ok=True)
        return BlobInfo(key, metered.size, metered.sha256)

    def open(self, key: str, byte_range: tuple[int, int] | None = None) -> BinaryIO:
        try:
            file = open(self._path(key), "rb")
        except FileNotFoundError as error:
            raise BlobNotFound(key) from error
        if byte_range is None:
            return file
        file.seek(byte_range[0])
        return io.BufferedReader(_Slice(file, byte_range[1] - byte_range[0] + 1))

    def download(self, key: str, path: Path, progress: Progress | None = None) -> None:
        with self.open(key) as source, open(path, "wb") as sink:
            _copy(source, sink, progress)

    def head(self, key: str) -> BlobInfo | None:
        try:
            stat = self._path(key).stat()
        except (FileNotFoundError, NotADirectoryError):
            return None
        if not S_ISREG(stat.st_mode):
            return None
        # `put` renames a new file over the key: a new inode, whatever the size and the clock say
        return BlobInfo(key, stat.st_size, etag=f"{stat.st_ino:x}-{stat.st_mtime_ns:x}-{stat.st_size:x}")

    def join(self, key: str, sources: list[str], *, content_type: str = "application/octet-stream") -> BlobInfo:
        return _join_by_reading(self, key, sources, content_type)

    def exists(self, key: str) -> bool:
        return self.head(key) is not None

    def delete(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)

    def keys(self, prefix: str) -> Iterator[str]:
        return (entry.key for entry in self.entries(prefix))

    def entries(self, prefix: str) -> Iterator[BlobInfo]:
        for path in sorted(self.root.rglob("*")):
            key = path.relative_to(self.root).as_posix()
            if path.is_file() and key.startswith(prefix) and SAFE_KEY.fullmatch(key):
                stat = path.stat()
                yield BlobInfo(key, stat.st_size, modified=stat.st_mtime)

    def delete_many(self, keys: Iterable[str]) -> dict[str, str]:
        refused: dict[str, str] = {}
        for key in keys:
            try:
                self.delete(key)
            except OSError as error:  # a file this process may not remove (permissions, a read-only mount)
                refused[key] = errno.errorcode.get(error.errno or 0, type(error).__name__)
        return refused

    def delete_prefix(self, prefix: str) -> int:
        keys = list(self.keys(prefix))
        refused = self.delete_many(keys)
        _log_refused(prefix, refused)
        self._abort_writes(prefix, before=math.inf)
        return len(keys) - len(refused)

    def abort_incomplete(self, before: float) -> int:
        return self._abort_writes("", before)

    def _abort_writes(self, prefix: str, before: float) -> int:
        # A put that died midway leaves its hidden `.partial` file (`.{name}.{hex}.partial`) beside where the blob
        # would have been: the local store's incomplete upload.
        def under(path: Path) -> bool:
            return (path.parent / path.name[1:]).relative_to(self.root).as_posix().startswith(prefix)

        stale = [path for path in self.root.rglob(".*.partial")
                 if path.is_file() and under(path) and path.stat().st_mtime < before]  # fmt: skip
        for path in stale:
            path.unlink(missing_ok=True)
        return len(stale)

    def presigned_url(
        self, key: str, ttl_s: int, filename: str | None = None, content_type: str | None = None
    ) -> str | None:
        return None

    def check(self, write: bool = False) -> None:
        if not os.access(self.root, os.W_OK):
            raise BlobError(f"{self.root} is not writable")


def _copy(source: BinaryIO, sink: BinaryIO, progress: Progress | None) -> None:
    while chunk := source.read(1024 * 1024):
        sink.write(chunk)
        if progress is not None:
            progress(len(chunk))
