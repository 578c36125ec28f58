"""The blob store, on SeaweedFS's S3 and on a local directory: the same interface, the same behaviour."""

from __future__ import annotations

import hashlib
import io
import secrets
import time

import pytest
import requests
from pydantic import SecretStr

from storage.blobs import BlobNotFound, BlobStore, InvalidKey, LocalBlobStore, S3BlobStore, TooLarge

from .conftest import PART, READ_ONLY


class Trickle(io.RawIOBase):
    """A non-seekable source handing out at most 64 KiB per read, like a request body: nothing can be read whole."""

    def __init__(self, data: bytes) -> None:
        self._data, self._at = data, 0

    def readable(self) -> bool:
        return True

    def read(self, size: int = -1) -> bytes:
        size = 64 * 1024 if size < 0 else min(size, 64 * 1024)
        chunk = self._data[self._at : self._at + size]
        self._at += len(chunk)
        return chunk


@pytest.fixture(params=["s3", "local"])
def store(request, s3, tmp_path) -> BlobStore:
    return s3 if request.param == "s3" else LocalBlobStore(tmp_path / "blobs")


def test_round_trip_streams_parts_and_records_sha256(store: BlobStore, s3, tmp_path):
    data = secrets.token_bytes(PART + PART // 2 + 7)  # > 5 MiB: two parts on S3
    key = f"tests/{secrets.token_hex(6)}/blob.bin"
    info = store.put(key, Trickle(data), content_type="video/mp4")
    assert (info.key, info.size, info.sha256) == (key, len(data), hashlib.sha256(data).hexdigest())
    assert store.exists(key) and store.head(key).size == len(data)
    with store.open(key) as stream:
        assert stream.read() == data
    store.download(key, tmp_path / "copy.bin")
    assert (tmp_path / "copy.bin").read_bytes() == data
    if store is s3:  # a multipart object's ETag ends in -<parts>
        assert s3.client.head_object(Bucket=s3.bucket, Key=key)["ETag"].strip('"').endswith("-2")

    # a key written again, even with as many bytes, is another version: a worker's prefetched copy is not used
    version = store.head(key).etag
    assert version and store.head(key).etag == version
    store.put(key, io.BytesIO(bytes(reversed(data))))
    assert store.head(key).etag not in (None, version)
    store.put(key, io.BytesIO(data))

    store.put(key + ".second", io.BytesIO(b"x"))
    assert sorted(store.keys(key.rsplit("/", 1)[0] + "/")) == [key, key + ".second"]
    assert store.delete_prefix(key.rsplit("/", 1)[0] + "/") == 2
    assert not store.exists(key) and store.head(key) is None
    store.delete(key)  # deleting what is gone is fine
    with pytest.raises(BlobNotFound):
        store.open(key)


def test_too_large_leaves_nothing_behind(store: BlobStore, s3):
    prefix = f"tests/{secrets.token_hex(6)}/"
    with pytest.raises(TooLarge):
        store.put(prefix + "big", Trickle(secrets.token_bytes(2 * PART + 1)), max_bytes=2 * PART - 10)
    assert list(store.keys(prefix)) == []
    if store is s3:  # the parts already sent were aborted, not left as an incomplete upload
        uploads = s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix).get("Uploads", [])
        assert uploads == []


def test_join_writes_its_sources_in_order_as_one_blob_and_nothing_when_one_is_missing(store: BlobStore, s3):
    """S3-sized sources are copied inside storage; a small one but the last makes the join read them through."""
    prefix = f"tests/{secrets.token_hex(6)}/"
    pieces = [secrets.token_bytes(PART), secrets.token_bytes(PART + 3), secrets.token_bytes(11)]
    for index, piece in enumerate(pieces):
        store.put(f"{prefix}{index}", io.BytesIO(piece))
    for order, read_through in (([2, 0, 1], True), ([1, 0, 2], False)):
        if store is s3:  # a join of the key killed midway: its write begun and never finished
            begun = s3.client.create_multipart_upload(Bucket=s3.bucket, Key=f"{prefix}joined")["UploadId"]
            s3.client.upload_part(Bucket=s3.bucket, Key=f"{prefix}joined", UploadId=begun, PartNumber=1, Body=b"x")
        joined = store.join(f"{prefix}joined", [f"{prefix}{index}" for index in order], content_type="video/mp4")
        data = b"".join(pieces[index] for index in order)
        with store.open(joined.key) as stream:
            assert stream.read() == data
        assert joined.size == len(data) and store.head(joined.key).size == len(data)
        # read through, a join knows the bytes' SHA-256; copied inside S3 it does not
        assert joined.sha256 == (hashlib.sha256(data).hexdigest() if read_through or store is not s3 else None)
        if store is s3:  # the killed join's parts were dropped
            assert s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix).get("Uploads", []) == []
    store.delete(f"{prefix}joined")
    with pytest.raises(BlobNotFound):
        store.join(f"{prefix}joined", [f"{prefix}0", f"{prefix}gone"])
    assert not store.exists(f"{prefix}joined")
    if store is s3:
        assert s3.client.list_multipart_uploads(Bucket=s3.bucket, Prefix=prefix).get("Uploads", []) == []
    store.delete_prefix(prefix)


def test_presigned_url_works_then_expires(s3):
    key = f"tests/{secrets.token_hex(6)}/signed"
    s3.put(key, io.BytesIO(b"signed content"))
    url = s3.presigned_url(key, ttl_s=2)
    assert requests.get(url, timeout=10).content == b"signed content"
    assert requests.get(url.replace("Signature=", "Signature=0"), timeout=10).status_code == 403  # tampered
    time.sleep(3)
    assert requests.get(url, timeout=10).status_code == 403


def test_local_store_refuses_paths_out_of_its_directory(tmp_path):
    store = LocalBlobStore(tmp_path / "blobs")
    (tmp_path / "secret").write_bytes(b"x")
    for key in ("../secret", "a/../../secret", "/etc/passwd", "a//b", ".hidden", "a/./b", "a\\..\\b", ""):
        with pytest.raises(InvalidKey):
            store.open(key)
        with pytest.raises(InvalidKey):
            store.put(key, io.BytesIO(b"y"))
    assert store.presigned_url("a", 60) is None  # no server to sign for: callers stream


def test_the_stack_s_seaweedfs_logs_no_refused_dial_of_its_own(stack, redis_client):
    """weed 4.48's plugin worker dials the admin server's gRPC at its HTTP port + 10000, whatever `-admin.port.grpc`
    says: with the stack's random ports it logged a refused dial every 5 s (60 lines in a 3-minute run)."""
    up_s = redis_client.info("server")["uptime_in_seconds"]  # started with weed
    time.sleep(max(0, 11 - up_s))  # two of its dials at least
    lines = (stack.root / "weed.log").read_text().splitlines()
    refused = [line for line in lines if "Plugin worker" in line and "connection refused" in line]
    assert refused == [], refused[:3]


def test_a_delete_storage_refuses_is_said_not_counted_as_done(s3, settings, caplog):
    """S3's DeleteObjects answers 200 with a refusal per key (a key without Write, an object lock): the deletes the
    storage sweep and a job's cleanup make in batches must not take that for done (they did, silently)."""
    read_only = S3BlobStore.from_settings(
        settings.model_copy(
            update={
                "s3_access_key": READ_ONLY["VSRQ_S3_ACCESS_KEY"],
                "s3_secret_key": SecretStr(READ_ONLY["VSRQ_S3_SECRET_KEY"]),
            }
        )
    )
    prefix = f"work/video_{secrets.token_hex(12)}/"
    kept = {prefix + "windows/a", prefix + "windows/b"}
    for key in kept:
        s3.put(key, io.BytesIO(b"w"))

    assert read_only.delete_many(sorted(kept)) == dict.fromkeys(sorted(kept), "AccessDenied")
    assert read_only.delete_prefix(prefix) == 0  # none deleted, and said so
    assert "did not delete 2 blob(s) under" in caplog.text and "AccessDenied" in caplog.text
    assert set(s3.keys(prefix)) == kept
    assert s3.delete_many([*kept, prefix + "never-written"]) == {}
    assert list(s3.keys(prefix)) == []


def test_the_write_probe_leaves_nothing_in_a_versioned_bucket(s3):
    """`/v1/health`, `vsrq status` and each worker's start write and delete an object; in a versioned bucket each
    probe left a version and a delete marker behind, for good."""
    bucket = f"versioned-{secrets.token_hex(4)}"
    s3.client.create_bucket(Bucket=bucket)
    s3.client.put_bucket_versioning(Bucket=bucket, VersioningConfiguration={"Status": "Enabled"})
    store = S3BlobStore(s3.client, bucket, part_bytes=PART)
    for _ in range(3):
        store.check(write=True)
    left = s3.client.list_object_versions(Bucket=bucket)
    assert not left.get("Versions") and not left.get("DeleteMarkers"), left
    s3.client.delete_bucket(Bucket=bucket)
