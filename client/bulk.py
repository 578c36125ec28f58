"""`vsrq bulk SRC`: many videos through the job API, sent as a user sends them, resumable, never duplicated.

SRC is a folder (every video in it, recursively), a manifest (CSV or JSONL; per row a `source`, which is a path
relative to the manifest, an `s3://bucket/key` or an https URL, an optional `output` name, and any create field such as
`scale`, `seed` or `sr_target_resolution`), or an `s3://bucket/prefix` (every video object under it).

How each input reaches the service:
- a local file goes up in the multipart create, streamed from disk;
- an S3 object in the service's own bucket under the caller's uploads is referenced by key (`input_key`: no byte
  moves; the API decides what is the caller's); any other object is copied through this machine into an upload. Not
  a presigned URL: it would expire while the job waits in the queue, and would point at a private endpoint that the
  service's SSRF guard refuses;
- an https URL is named by URL; the service fetches it behind its SSRF guard.

A rerun never makes a second job: each create carries an `Idempotency-Key` derived from the source (its name, and its
content: a file's SHA-256, an object's ETag and size) and its fields, and the run keeps a journal beside the report
(SQLite: every change is one committed transaction, so a run stopped anywhere leaves it consistent) of the job each
source became. Rerunning skips what the journal says was created, follows those jobs, and submits the rest; a create
whose answer was lost to Ctrl-C is replayed by the API under its key.
"""

from __future__ import annotations

import argparse
import contextlib
import csv
import hashlib
import io
import json
import math
import os
import re
import sqlite3
import sys
import tempfile
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait
from dataclasses import asdict, dataclass, field, replace
from functools import partial
from pathlib import Path, PurePosixPath, PureWindowsPath
from typing import Any

import requests
from tqdm import tqdm

from client import config
from client.http import PART_BYTES, TERMINAL, ApiProblem, Client, DownloadMismatch

# What a folder's videos are named: what the service reads, with their common spellings, animated pictures included
# (.png and .avif are mostly stills: a manifest sends those). Other files are left out, and counted on the way.
VIDEO_SUFFIXES = frozenset(
    {".mp4", ".m4v", ".mov", ".mkv", ".webm", ".avi", ".ts", ".mts", ".m2ts", ".mpg", ".mpeg", ".mpv", ".m2v", ".vob",
     ".flv", ".f4v", ".wmv", ".asf", ".3gp", ".3g2", ".mxf", ".ogv", ".ogg", ".dv", ".y4m", ".nut", ".flc", ".fli",
     ".gif", ".webp", ".apng", ".avifs"}
)  # fmt: skip
ALIASES = {"scale": "sr_resolution_scale"}
MIB = 1024 * 1024
# A default output's name (`_default_output`): what it is named after, then its scale
_OUTPUT_NAME = re.compile(r"(.+)-x(?:2|2\.25|4)\.mp4")
# The API's `sr_resolution_scale` where a create names none (SGLang's; api/schemas.py `UpscaleParams`, which the
# client does not import): what an output's default name says then
DEFAULT_SCALE = "2.25"
OPEN = ("queued", "in_progress")  # the statuses a followed job is listed under until it ends
PAGE = 100  # jobs a listing request returns (the API's most)
PROGRESS_EVERY_S = 10.0  # a progress line this often where stderr is no terminal
OUTPUT_EXISTS = "output_exists"  # a completed job whose output was not downloaded: another file is at its path
REPORT_COLUMNS = (
    "source", "job_id", "status", "error_code", "error_message", "output", "queued_s", "running_s", "sha256"
)  # fmt: skip


class BulkError(Exception):
    """Something the user fixes before a run can start (a missing source, a manifest without `source`...)."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(f"{code}: {message}")
        self.code, self.message = code, message


@dataclass(frozen=True)
class Item:
    source: str  # as the report names it: a path relative to the folder, a manifest's cell, an s3:// URL
    location: str  # where it is read: an absolute path, s3://bucket/key or an http(s) URL
    fields: dict[str, str]  # the create's fields: the command's defaults, then the row's own
    output: str  # the file name under --download
    stamp: str  # the source as it is now: a file's size and mtime, an object's ETag and size ("" for a URL)
    # what `output` is named after (`_default_output`): the path in the folder or under the prefix, a manifest's
    # source; None where the manifest names the output
    named_after: str | None = None

    @property
    def id(self) -> str:
        return _digest("item", self.source, self.fields)

    def idempotency_key(self, content: str) -> str:
        return "vsrq-bulk-" + _digest("job", self.source, self.fields, content)


@dataclass(frozen=True)
class Entry:
    """What the journal knows of one item."""

    source: str
    stamp: str
    job_id: str | None = None
    status: str = "pending"  # then the job's status; or failed when the create was refused
    error_code: str | None = None
    error_message: str | None = None
    output: str | None = None  # the downloaded file
    sha256: str | None = None  # of the output, as the job recorded it
    queued_s: int | None = None
    running_s: int | None = None
    upload_id: str | None = None  # a file sent in parts, once all of them are up


def _digest(*parts: Any) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


# -- planning: which videos, with which fields ---------------------------------------------------------------------


def plan(
    source: str, defaults: dict[str, str], s3: Callable[[], Any], download: Path | None = None
) -> tuple[list[Item], Counter]:
    """The videos `source` names, and the files of a folder or prefix left out, counted by why (`_left_out`; "earlier
    outputs": `_outputs_among`; "in the download folder", where `download` is a folder inside the source's)."""
    left_out: Counter = Counter()
    if source.startswith("s3://"):
        items = list(_s3_prefix(source, defaults, s3(), left_out))
    else:
        path = Path(source)
        if path.is_dir():
            items = []
            names = [file.relative_to(path).as_posix() for file in filter(Path.is_file, sorted(path.rglob("*")))]
            outputs, downloads = _outputs_among(names), _below(download, path)
            for relative in names:
                if downloads and relative.startswith(downloads):
                    left_out["in the download folder"] += 1
                elif why := _left_out(relative, outputs):
                    left_out[why] += 1
                else:
                    items.append(_item(relative, str((path / relative).resolve()), defaults, {}, None, s3))
        elif path.suffix.lower() in (".csv", ".jsonl", ".ndjson") and path.is_file():
            items = [_row(row, path.parent, defaults, s3, number) for number, row in _rows(path)]
        else:
            raise BulkError("bad_source", f"{source} is not a folder, a .csv or .jsonl manifest, or an s3:// prefix")
    return _apart(items), left_out


def _below(download: Path | None, folder: Path) -> str | None:
    """Where `download` is in `folder` ("out/"), if it is a folder below it: what is there is outputs, not videos."""
    if download is None:
        return None
    download, folder = download.resolve(), folder.resolve()
    below = download != folder and download.is_relative_to(folder)
    return f"{download.relative_to(folder).as_posix()}/" if below else None


def _apart(items: list[Item]) -> list[Item]:
    """`items` with no two outputs at one path: sources whose default names clash (`clip.mov`, `clip.mp4`) keep their
    suffixes in them; a name still shared (a manifest's `output` column) refuses the run, naming its sources."""
    shared = {name for name, count in Counter(item.output for item in items).items() if count > 1}
    items = [
        replace(item, output=_default_output(item.named_after, item.fields, suffixed=True))
        if item.output in shared and item.named_after is not None
        else item
        for item in items
    ]
    sources: dict[str, list[str]] = {}
    for item in items:
        sources.setdefault(item.output, []).append(item.source)
    clashes = sorted((name, named) for name, named in sources.items() if len(named) > 1)
    if clashes:
        name, named = clashes[0]
        more = f" ({len(clashes) - 1} more outputs are shared)" if len(clashes) > 1 else ""
        raise BulkError(
            "output_clash",
            f"{', '.join(named)} would all be written to {name}{more}: name them in a manifest's `output` column",
        )
    return items


def _rows(path: Path) -> Iterator[tuple[int, dict[str, Any]]]:
    with open(path, newline="", encoding="utf-8") as file:
        if path.suffix.lower() == ".csv":
            yield from enumerate(csv.DictReader(file), start=2)  # line 1 is the header
            return
        for number, line in enumerate(file, start=1):
            if line.strip():
                try:
                    row = json.loads(line)
                except ValueError:
                    raise BulkError("bad_manifest", f"{path}:{number} is not JSON") from None
                if not isinstance(row, dict):
                    raise BulkError("bad_manifest", f"{path}:{number} is not a JSON object")
                yield number, row


def _row(row: dict[str, Any], base: Path, defaults: dict[str, str], s3: Callable[[], Any], number: int) -> Item:
    values = {str(name).strip(): "" if value is None else str(value).strip() for name, value in row.items() if name}
    source = values.pop("source", "")
    if not source:
        raise BulkError("bad_manifest", f"row {number} names no `source`")
    output = values.pop("output", "") or None
    fields = {ALIASES.get(name, name): value for name, value in values.items() if value}
    if source.startswith(("s3://", "https://", "http://")):
        return _item(source, source, defaults, fields, output, s3)
    return _item(source, str((base / source).resolve()), defaults, fields, output, s3)


def _item(source: str, location: str, defaults: dict[str, str], fields: dict[str, str], output: str | None, s3) -> Item:
    if location.startswith(("https://", "http://")):
        stamp = ""
    elif location.startswith("s3://"):
        bucket, key = _split_s3(location)
        import botocore.exceptions  # boto3 only for s3:// sources: the client installs without it

        try:
            head = s3().head_object(Bucket=bucket, Key=key)
        except botocore.exceptions.ClientError as error:
            raise BulkError("source_not_found", f"{location}: {error}") from None
        stamp = f"{head['ETag']}:{head['ContentLength']}"
    else:
        try:
            stat = os.stat(location)
        except OSError as error:
            raise BulkError("source_not_found", f"{source}: {error.strerror}") from None
        stamp = f"{stat.st_size}:{stat.st_mtime_ns}"
    name = output or _default_output(source, {**defaults, **fields})
    # as either system reads it: on Windows `C:\x.mp4` or `a\..\..\x.mp4` would leave the download folder
    paths = (PurePosixPath(name), PureWindowsPath(name))
    if any(path.is_absolute() or path.drive or ".." in path.parts for path in paths):
        raise BulkError("bad_output", f"output {name!r} must be a relative name inside the download folder")
    return Item(source, location, {**defaults, **fields}, name, stamp, None if output else source)


def _default_output(source: str, fields: dict[str, str], suffixed: bool = False) -> str:
    """The source's name and its scale, as an MP4 (`in/clip.mov` at ×2: `in/clip-x2.mp4`, the web app's name for a
    download), keeping its folders when it is relative: never a source's own name, so outputs may be downloaded beside
    their sources. `suffixed` keeps the source's suffix too (`in/clip-mov-x2.mp4`), for names that would clash."""
    if source.startswith(("s3://", "https://", "http://")):
        path = PurePosixPath(PurePosixPath(source.split("?", 1)[0].rstrip("/")).name or "video")
    else:
        path = PurePosixPath(source)
        path = PurePosixPath(path.name) if path.is_absolute() or ".." in path.parts else path
    scale = fields.get("sr_resolution_scale", DEFAULT_SCALE)
    with contextlib.suppress(ValueError):  # a bad scale names the output as it is; the API refuses the row
        scale = f"{float(scale):g}"
    kept = f"-{path.suffix[1:]}" if suffixed and path.suffix else ""
    return str(path.with_name(f"{path.stem}{kept}-x{scale}.mp4"))


def _left_out(name: str, outputs: set[str] = frozenset()) -> str | None:
    """Why a folder's or a prefix's file `name` (relative) is no video to send: "hidden" (a dot file, such as macOS's
    `._clip.mp4` resource fork), its suffix, or "earlier outputs" (one of `outputs`: `_outputs_among`); None for a
    video's name."""
    path = PurePosixPath(name)
    if any(part.startswith(".") for part in path.parts):
        return "hidden"
    suffix = path.suffix.lower()
    if suffix not in VIDEO_SUFFIXES:
        return suffix or "no suffix"
    return "earlier outputs" if name in outputs else None


def _s3_prefix(url: str, defaults: dict[str, str], s3, left_out: Counter) -> Iterator[Item]:
    bucket, prefix = _split_s3(url)
    objects = {
        obj["Key"][len(prefix) :].lstrip("/") or PurePosixPath(obj["Key"]).name: obj
        for page in s3.get_paginator("list_objects_v2").paginate(Bucket=bucket, Prefix=prefix)
        for obj in page.get("Contents", [])
    }
    outputs = _outputs_among(list(objects))
    for relative, obj in objects.items():
        if why := _left_out(relative, outputs):
            left_out[why] += 1
        else:
            source = f"s3://{bucket}/{obj['Key']}"
            output = _default_output(relative, defaults)
            yield Item(source, source, dict(defaults), output, f"{obj['ETag']}:{obj['Size']}", relative)


def _outputs_among(names: list[str]) -> set[str]:
    """Those of a folder's `names` (relative paths) that are outputs named after a video beside them (`clip-x2.mp4`,
    `clip-mov-x4.mp4` beside `clip.mov`: `_default_output`), downloaded there by an earlier run: never sent again."""
    bases = set()
    for name in filter(lambda name: _left_out(name) is None, names):  # named after videos only
        path = PurePosixPath(name)
        bases |= {str(path.with_suffix("")), f"{path.with_suffix('')}-{path.suffix[1:]}"}
    return {name for name in names if (named := _OUTPUT_NAME.fullmatch(name)) and named.group(1) in bases}


def _split_s3(url: str) -> tuple[str, str]:
    bucket, _, key = url.removeprefix("s3://").partition("/")
    if not bucket:
        raise BulkError("bad_source", f"{url} names no bucket")
    return bucket, key


def s3_client(endpoint_url: str | None):
    """boto3 with its usual credentials (environment, ~/.aws); path-style addressing for a custom endpoint, since a
    local S3 (SeaweedFS, MinIO) has no DNS name per bucket."""
    try:
        import boto3
        from botocore.config import Config
    except ImportError:
        raise BulkError("s3_unavailable", "s3:// sources need boto3: pip install 'vsrq[s3]'") from None
    endpoint_url = endpoint_url or os.environ.get("AWS_ENDPOINT_URL_S3") or os.environ.get("AWS_ENDPOINT_URL")
    config = Config(s3={"addressing_style": "path"}) if endpoint_url else None
    return boto3.client("s3", endpoint_url=endpoint_url, config=config)


# -- the journal ---------------------------------------------------------------------------------------------------


class Journal:
    """Entries by item id in SQLite: each save is one transaction, whole or absent, whatever stops the run."""

    def __init__(self, path: Path) -> None:
        self._lock = threading.Lock()
        self._db = sqlite3.connect(path, check_same_thread=False)
        with self._lock, self._db:
            self._db.execute("CREATE TABLE IF NOT EXISTS entries (item TEXT PRIMARY KEY, entry TEXT NOT NULL)")

    def load(self) -> dict[str, Entry]:
        with self._lock:
            rows = self._db.execute("SELECT item, entry FROM entries").fetchall()
        return {item: Entry(**json.loads(entry)) for item, entry in rows}

    def save(self, item_id: str, entry: Entry) -> None:
        with self._lock, self._db:
            self._db.execute("INSERT OR REPLACE INTO entries VALUES (?, ?)", (item_id, json.dumps(asdict(entry))))

    def close(self) -> None:
        self._db.close()


# -- the run -------------------------------------------------------------------------------------------------------


@dataclass
class Bulk:
    client: Client
    items: list[Item]
    journal: Journal
    s3: Callable[[], Any]
    service_bucket: str
    concurrency: int = 4
    wait: bool = False
    poll_s: float = 2.0
    download: Path | None = None
    part_bytes: int = PART_BYTES  # a file larger than this goes in parts
    entries: dict[str, Entry] = field(default_factory=dict)
    in_the_way: set[str] = field(default_factory=set)  # items whose output path holds another file, this run
    resumed: int = 0  # items an earlier run had submitted already
    list_cost: float = len(OPEN)  # requests listing the key's open jobs took last (one a status, at the least)
    _created_at: dict[str, float] = field(default_factory=dict)  # of this run's jobs, as the API said them
    _said: str = ""  # the progress line printed last, without a terminal
    _said_at: float = -math.inf

    def __post_init__(self) -> None:
        known = self.journal.load()
        for item in self.items:
            entry = known.get(item.id)
            # a source changed since its job was made (rewritten file, new object version) is a new video
            fresh = entry is None or entry.stamp != item.stamp
            self.entries[item.id] = Entry(source=item.source, stamp=item.stamp) if fresh else entry
        self.resumed = sum(entry.job_id is not None for entry in self.entries.values())

    def run(self) -> None:
        if any(entry.job_id is None or self._open(entry) for entry in self.entries.values()):
            self.client.reach()  # each call below retries a dead API for minutes, silently
        pool = ThreadPoolExecutor(self.concurrency, thread_name_prefix="bulk")
        bar = tqdm(total=len(self.items), unit="video", desc="bulk", dynamic_ncols=True, disable=None)
        try:
            self._count(bar)
            # a create the API refused is tried again; a job that failed on the service stays failed
            unsent = [item for item in self.items if self.entries[item.id].job_id is None]
            self._each(pool, bar, self._submit, unsent)
            while True:
                following = [
                    item for item in self.items if item.id not in self.in_the_way and self._open(self.entries[item.id])
                ]
                if not following:
                    break
                started = time.monotonic()
                self._each(pool, bar, self._follow, self._still_open(following))
                if not self.wait:
                    break
                time.sleep(max(0.0, self.poll_s - (time.monotonic() - started)))
        finally:
            # Ctrl-C: what is in flight finishes and is journalled (at most `concurrency` requests); nothing new starts
            pool.shutdown(wait=True, cancel_futures=True)
            self._count(bar)
            bar.close()

    def _still_open(self, following: list[Item]) -> list[Item]:
        """Of `following`, those to ask about one by one: where that takes more requests than listing the key's queued
        and running jobs (a page a request), they are listed and those still among them recorded as listed. Asking
        each job every `poll_s` spent the key's rate limit on 400 jobs: every other client of the key got 429."""
        if len(following) <= self.list_cost:
            return following
        # the key's other open jobs lengthen the listing: once it takes as many requests as asking each, it stops;
        # and newest first, it stops past the oldest job followed (a key with 24,000 older jobs queued: 240 pages a
        # poll, 40 requests a second)
        ids = {self.entries[item.id].job_id for item in following}
        created = [self._created_at.get(job_id or "") for job_id in ids]
        oldest = None if None in created else min(created, default=None)
        listed: dict[str, dict[str, Any]] = {}
        self.list_cost = 0
        try:
            for status in OPEN:
                for page in self.client.pages(status, PAGE):
                    self.list_cost += 1
                    if self.list_cost > len(following):
                        return following
                    listed |= {job["id"]: job for job in page}
                    self._created_at |= {job["id"]: job["created_at"] for job in page if job["id"] in ids}
                    if oldest is not None and page and page[-1]["created_at"] < oldest:
                        break  # the rest are older than every job followed
        except ApiProblem as problem:
            if problem.status != 422:  # a deployment whose pages are shorter than PAGE: each job is asked
                raise
            self.list_cost = math.inf
            return following
        for item in following:
            entry = self.entries[item.id]
            if entry.job_id in listed and (seen := _observed(entry, listed[entry.job_id])) != entry:
                self._save(item, seen)
        return [item for item in following if self.entries[item.id].job_id not in listed]

    def _each(self, pool: ThreadPoolExecutor, bar: tqdm, work: Callable[[Item], None], items: Iterable[Item]) -> None:
        pending = {pool.submit(work, item) for item in items}
        while pending:
            done, pending = wait(pending, timeout=0.5, return_when=FIRST_EXCEPTION)
            for future in done:
                future.result()  # an API that stays unreachable, or refuses the key, ends the run
            self._count(bar)

    def _open(self, entry: Entry) -> bool:
        """Whether the job still needs following: not ended, or completed and not downloaded yet."""
        if entry.job_id is None:
            return False
        return entry.status not in TERMINAL or (
            self.download is not None and entry.status == "completed" and entry.output is None
        )

    def _count(self, bar: tqdm) -> None:
        counts = self.counts()
        bar.n = counts["completed"] + counts["failed"] + (0 if self.wait else counts["submitted"])
        said = f"submitted {counts['submitted']}, done {counts['completed']}, failed {counts['failed']}"
        bar.set_postfix_str(said, refresh=False)
        bar.refresh()
        # no terminal (a CI log, nohup): no bar either, so a line now and then (the run's end says its summary)
        if bar.disable and time.monotonic() - self._said_at >= PROGRESS_EVERY_S and said != self._said:
            print(f"vsrq bulk: {bar.n}/{len(self.items)} videos: {said}", file=sys.stderr, flush=True)
            self._said, self._said_at = said, time.monotonic()

    def counts(self) -> Counter:
        counts: Counter = Counter()
        for entry in self.entries.values():
            counts["submitted"] += entry.job_id is not None
            counts["completed"] += entry.status == "completed"
            counts["failed"] += entry.status in ("failed", "cancelled")
            counts["in_progress"] += entry.job_id is not None and entry.status not in TERMINAL
            counts["in_the_way"] += entry.error_code == OUTPUT_EXISTS and entry.status == "completed"
        return counts

    def _save(self, item: Item, entry: Entry) -> None:
        self.journal.save(item.id, entry)
        self.entries[item.id] = entry

    def _submit(self, item: Item) -> None:
        try:
            job = self._create(item)
        except requests.RequestException:
            raise  # the API is unreachable (after the client's retries): the run stops, the journal stays
        except ApiProblem as problem:
            if problem.transient or problem.status == 401:
                raise
            entry = replace(self.entries[item.id], status="failed", error_code=problem.code,
                            error_message=problem.message)  # fmt: skip
        except _source_errors() as error:
            entry = replace(self.entries[item.id], status="failed", error_code="source_unreadable",
                            error_message=str(error))  # fmt: skip
        else:  # the entry as `_create` left it: an upload in parts is journalled before its job is made
            entry = _observed(replace(self.entries[item.id], job_id=job["id"]), job)
            self._created_at[job["id"]] = job["created_at"]
        self._save(item, entry)

    def _create(self, item: Item) -> dict[str, Any]:
        label = {"bulk_source": item.source[-512:]}  # the job says where it came from (metadata values: 512 chars)
        if item.location.startswith(("https://", "http://")):
            return self.client.create_from_url(
                item.location, {**item.fields, "metadata": label}, idempotency_key=item.idempotency_key(item.stamp)
            )
        if not item.location.startswith("s3://"):
            key = item.idempotency_key(_file_sha256(Path(item.location)))
            return self._from_file(item, Path(item.location), key, label)
        bucket, name = _split_s3(item.location)
        key = item.idempotency_key(item.stamp)
        if bucket == self.service_bucket:
            try:
                return self.client.create_from_key(name, {**item.fields, "metadata": label}, idempotency_key=key)
            except ApiProblem as problem:
                if problem.code != "upload_not_found":  # not the caller's upload: copied below
                    raise
        with tempfile.TemporaryDirectory(prefix="vsrq-bulk-") as scratch:
            local = Path(scratch) / PurePosixPath(name).name
            self.s3().download_file(bucket, name, str(local))
            return self._from_file(item, local, key, label)

    def _from_file(self, item: Item, path: Path, key: str, label: dict[str, str]) -> dict[str, Any]:
        """A local file: sent with its create where it fits in one part; else uploaded in parts first, the upload
        journalled, so that a rerun names the same upload (and the API replays a create whose answer was lost)."""
        if path.stat().st_size <= self.part_bytes:
            form = {**item.fields, "metadata": json.dumps(label)}
            return self.client.create_from_file(path, form, idempotency_key=key)
        upload_id = self.entries[item.id].upload_id
        if upload_id is None or self._upload_gone(upload_id):
            upload_id = self.client.upload_in_parts(path, self.part_bytes)
            self._save(item, replace(self.entries[item.id], upload_id=upload_id))
        fields = {**item.fields, "metadata": label}
        return self.client.create_from_upload(upload_id, fields, idempotency_key=key)

    def _upload_gone(self, upload_id: str) -> bool:
        try:
            return self.client.upload(upload_id)["status"] != "completed"
        except ApiProblem as problem:
            if problem.status == 404:  # expired and swept, or the service's storage was reset
                return True
            raise

    def _follow(self, item: Item) -> None:
        entry = self.entries[item.id]
        try:
            job = self.client.get(entry.job_id)
        except ApiProblem as problem:
            if problem.code != "job_not_found":  # deleted, or expired with its results
                raise
            self._save(item, replace(entry, status="failed", error_code=problem.code, error_message=problem.message))
            return
        entry = _observed(entry, job)
        self._created_at[job["id"]] = job["created_at"]
        if self.download is not None and entry.status == "completed" and entry.output is None:
            path = self.download / item.output
            try:
                if not path.exists():
                    self.client.download(entry.job_id, path, sha256=entry.sha256)
                elif entry.sha256 is not None and _file_sha256(path) != entry.sha256:
                    # another job's output (a rerun with other fields) or the user's file: neither overwritten nor
                    # reported as this job's; followed again by the next run, which downloads it once it is moved
                    self.in_the_way.add(item.id)
                    message = f"{path} is there already and is another file: move it and rerun to download this job's"
                    self._save(item, replace(entry, error_code=OUTPUT_EXISTS, error_message=message))
                    return
                entry = replace(entry, output=str(path), error_code=None, error_message=None)  # an earlier run's: kept
            except DownloadMismatch as error:
                entry = replace(entry, status="failed", error_code=error.code, error_message=str(error))
        self._save(item, entry)


def _observed(entry: Entry, job: dict[str, Any]) -> Entry:
    error = job.get("error") or {}
    created, started, ended = job.get("created_at"), job.get("started_at"), job.get("completed_at")
    return replace(
        entry,
        status=job["status"],
        error_code=error.get("code"),
        error_message=error.get("message"),
        sha256=(job.get("output") or {}).get("sha256"),
        queued_s=started - created if started is not None and created is not None else None,
        running_s=ended - started if ended is not None and started is not None else None,
    )


def _source_errors() -> tuple[type[BaseException], ...]:
    """What reading a source raises: OSError, and boto's errors once an s3:// source has imported it."""
    boto = sys.modules.get("botocore.exceptions")
    return (OSError,) if boto is None else (OSError, boto.BotoCoreError, boto.ClientError)


def _file_sha256(path: Path) -> str:
    with open(path, "rb") as file:
        return hashlib.file_digest(file, "sha256").hexdigest()


# -- the report and the command ------------------------------------------------------------------------------------


def write_report(path: Path, items: list[Item], entries: dict[str, Entry]) -> None:
    """One row per item, CSV or JSONL by the name's suffix, written beside and renamed into place."""
    rows = [{"source": item.source} | asdict(entries[item.id]) for item in items]
    rows = [{column: row.get(column) for column in REPORT_COLUMNS} for row in rows]
    text = io.StringIO()
    if path.suffix.lower() in (".jsonl", ".ndjson"):
        text.writelines(json.dumps(row) + "\n" for row in rows)
    else:
        writer = csv.DictWriter(text, REPORT_COLUMNS)
        writer.writeheader()
        writer.writerows(rows)
    partial = path.with_name(f".{path.name}.partial")
    partial.write_text(text.getvalue(), encoding="utf-8")
    os.replace(partial, path)


def journal_path(report: Path) -> Path:
    return report.with_name(report.name + ".state.sqlite")


def run(args: argparse.Namespace) -> int:
    """`vsrq bulk`: 0 when every video was submitted (and, with --wait, completed), 1 when any failed or the API
    stayed unreachable, 2 for a bad source or arguments."""
    token = args.token or config.token()  # none: the API may not ask for one (`vsrq dev`, from this machine)
    defaults = {name: value for name, value in (("sr_resolution_scale", args.scale), ("seed", args.seed),
                                                ("model", args.model), ("quality", args.quality))
                if value is not None}  # fmt: skip
    for assignment in args.set:
        name, equals, value = assignment.partition("=")
        if not equals or not name:
            print(f"vsrq: bulk: bad_field: --set {assignment!r} is not FIELD=VALUE", file=sys.stderr)
            return 2
        defaults[ALIASES.get(name, name)] = value
    if not 1 <= args.part_size * MIB <= PART_BYTES:  # the client's part size is the service's most
        print(f"vsrq: bulk: bad_part_size: --part-size is 1 to {PART_BYTES // MIB} (MiB): the service takes parts of "
              f"at most {PART_BYTES // MIB} MiB", file=sys.stderr)  # fmt: skip
        return 2
    s3 = _lazy(lambda: s3_client(args.s3_endpoint_url))
    try:
        items, left_out = plan(args.source, defaults, s3, args.download)
    except BulkError as error:
        print(f"vsrq: bulk: {error.code}: {error.message}", file=sys.stderr)
        return 2
    if left_out:
        names = ", ".join(f"{count} {why}" for why, count in sorted(left_out.items()))
        print(f"vsrq bulk: left out by their names: {names} (a manifest sends any file)", file=sys.stderr)
    url = args.api_url or config.api_url()
    report = args.report
    report.parent.mkdir(parents=True, exist_ok=True)
    journal = Journal(journal_path(report))
    # a URL found in dev.json is looked for there again when it stops answering (its stack restarted elsewhere)
    directory = config.dev_stack_directory() if args.api_url is None else None
    follow = partial(config.dev_api, directory, args.token) if directory is not None else None
    client = Client(url, token, follow=follow)
    bulk = Bulk(client, items, journal, s3, args.service_bucket or config.service_bucket(),
                max(1, args.concurrency), args.wait, args.poll, args.download, args.part_size * MIB)  # fmt: skip
    try:
        bulk.run()
    except KeyboardInterrupt:  # what was in flight ended and is journalled (`Bulk.run`); the report is written below
        print(f"vsrq bulk: interrupted: {_tally(items, bulk)}; rerun the same command to carry on (report {report})",
              file=sys.stderr)  # fmt: skip
        return 130
    except ApiProblem as problem:  # the key is refused, or the API kept answering 5xx / 429
        if problem.status == 401:
            hint = "the API asks for a key: pass --token or set VSRQ_TOKEN" if not token else "is it this API's key?"
            print(f"vsrq: bulk: {problem.code}: {problem.message} ({hint})", file=sys.stderr)
            return 2
        print(f"vsrq: bulk: {problem.code}: {problem.message} (rerun to carry on)", file=sys.stderr)
        return 1
    except requests.RequestException as error:
        print(f"vsrq: bulk: api_unreachable: {client.base_url} does not answer ({_why(error)}): is the API up? "
              "`vsrq dev` starts one here; --api-url or VSRQ_API_URL names another (rerun to carry on)",
              file=sys.stderr)  # fmt: skip
        return 1
    finally:
        write_report(report, items, bulk.entries)
        journal.close()
    print(f"vsrq bulk: {_tally(items, bulk)}; report {report}")
    counts = bulk.counts()
    return 1 if counts["failed"] or counts["in_the_way"] else 0


def _tally(items: list[Item], bulk: Bulk) -> str:
    """Where the run's videos stand: "10 videos: 10 submitted (3 by an earlier run), 9 completed, 1 failed, …"."""
    counts = bulk.counts()
    in_the_way = (
        f", {counts['in_the_way']} not downloaded (another file is where it would go: error_code output_exists)"
        if counts["in_the_way"]
        else ""
    )
    earlier = f" ({bulk.resumed} by an earlier run)" if bulk.resumed else ""
    return (
        f"{len(items)} videos: {counts['submitted']} submitted{earlier}, {counts['completed']} completed{in_the_way}, "
        f"{counts['failed']} failed, {counts['in_progress']} still running"
    )


def _why(error: requests.RequestException) -> str:
    """The system's words for a failed connection ("Connection refused"), not urllib3's wrapping of them."""
    said = re.search(r"\[Errno -?\d+\] ([^'\")]+)", str(error))
    return said.group(1) if said else type(error).__name__


def _lazy(make: Callable[[], Any]) -> Callable[[], Any]:
    """`make()` once, on first use: a run without S3 sources never builds (or needs credentials for) a client."""
    made: list[Any] = []
    lock = threading.Lock()

    def get() -> Any:
        with lock:
            if not made:
                made.append(make())
            return made[0]

    return get
