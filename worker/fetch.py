"""Fetching a job's input from the `https` URL its owner named, at task time. Only the worker fetches (the API only
checks the URL when the job is created), so this lives with the worker.

Every hop is checked with storage.ssrf right before it connects, and the connection goes to an address that was
checked (DNS may answer differently a second time) while TLS is still verified against the URL's host name.
Redirects are followed here, each hop checked the same way, at most MAX_REDIRECTS. The body streams to disk under the
upload limit, enforced while reading: a declared Content-Length over it is refused before the body, a body that runs
past it is cut off there.

Failures say whether another attempt could succeed: `FetchFailed` (the origin's 4xx, a refused URL or redirect, too
large, an untrusted certificate) ends the job; `FetchUnavailable` (5xx, 429, a reset, a timeout) is retried;
`WorkerDiskFull` (no room for the body in this worker's scratch directory) is retried too, and is not the origin's.
"""

from __future__ import annotations

import errno
import hashlib
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from http import HTTPStatus
from pathlib import Path
from urllib.parse import urljoin, urlsplit

import urllib3
from urllib3.exceptions import ConnectTimeoutError, NewConnectionError, SSLError

from storage.config import Settings
from storage.ssrf import LookupUnavailable, UnsafeUrl, pinned_pool, public_addresses, request_target
from worker.backoff import retry_after_s
from worker.errors import Cancelled, CodedError, PermanentError

MAX_REDIRECTS = 5
# Small reads (read1 returns what has arrived): the lease's heartbeat runs between them, however slow the origin.
CHUNK = 256 * 1024
_REDIRECTS = frozenset({301, 302, 303, 307, 308})
# Writing the body found no room: a full disk, a quota, or a file-size limit (RLIMIT_FSIZE) on this worker
NO_ROOM = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG})


class FetchFailed(PermanentError):
    """The URL does not give us a video, and asking again will not change that: the job fails."""

    code = "input_fetch_failed"


class FetchUnavailable(CodedError):
    """The origin is down, overloaded or slow right now: another attempt may succeed (so not a PermanentError), after
    the time the origin asked for (`retry_after`, seconds, from its Retry-After) or a backoff (worker.attempt)."""

    code = "input_fetch_unavailable"

    def __init__(self, message: str, retry_after: float | None = None) -> None:
        super().__init__(message)
        self.retry_after = retry_after


class WorkerDiskFull(CodedError):
    """This worker has no room for the input: another attempt (maybe on another worker) may have it."""

    code = "worker_disk_full"


@dataclass(frozen=True)
class Fetched:
    url: str  # where the body came from, after redirects
    bytes: int
    sha256: str


def fetch(
    url: str, path: Path, settings: Settings, cancelled: Callable[[], bool], max_bytes: int | None = None
) -> Fetched:
    """Downloads `url` to `path`, at most `max_bytes` (default: the service's upload limit). `cancelled` is asked
    between reads (it is the lease's heartbeat): True stops."""
    for _ in range(MAX_REDIRECTS + 1):
        with _get(url, settings) as response:
            if response.status in _REDIRECTS:
                location = response.headers.get("Location")
                if not location:
                    raise FetchFailed(f"{_host(url)} answered {response.status} without a Location to follow.")
                url = urljoin(url, location)
                continue
            if response.status >= 500 or response.status == HTTPStatus.TOO_MANY_REQUESTS:
                said = f"{_host(url)} answered {response.status} {_reason(response.status)}."
                raise FetchUnavailable(said, retry_after_s(response.headers.get("Retry-After")))
            if response.status != HTTPStatus.OK:
                raise FetchFailed(
                    f"The input URL answered {response.status} {_reason(response.status)}: check that it is "
                    "reachable without credentials and has not expired."
                )
            return _save(response, url, path, max_bytes or settings.max_upload_bytes, cancelled)
    raise FetchFailed(f"The input URL redirected more than {MAX_REDIRECTS} times.")


@contextmanager
def _get(url: str, settings: Settings) -> Iterator[urllib3.BaseHTTPResponse]:
    """GET `url` from the first of its checked addresses that accepts a connection; urllib3's errors as ours."""
    parts = urlsplit(url)
    if parts.scheme != "https":
        raise FetchFailed(f"The input URL must use https (a redirect led to {parts.scheme}://{parts.hostname}).")
    try:
        addresses = public_addresses(
            url, allow_loopback=settings.fetch_allow_loopback, timeout_s=settings.fetch_connect_timeout_s
        )
    except UnsafeUrl as error:
        raise FetchFailed(f"The input URL is refused: {error}.") from None
    except LookupUnavailable as error:
        raise FetchUnavailable(f"The input URL's host could not be resolved now: {error}.") from None
    target = request_target(parts)
    headers = {"Host": parts.netloc, "Accept-Encoding": "identity", "User-Agent": "vsrq"}
    timeout = urllib3.Timeout(connect=settings.fetch_connect_timeout_s, read=settings.fetch_read_timeout_s)
    unreachable: Exception | None = None
    for address in addresses:
        pool = pinned_pool(parts, address, settings.fetch_ca_bundle, timeout)
        try:
            with _translated(parts.hostname):
                try:
                    response = pool.urlopen(
                        "GET", target, headers=headers, redirect=False, retries=False, preload_content=False
                    )
                except (NewConnectionError, ConnectTimeoutError) as error:  # this address is down: try the next
                    unreachable = error
                    continue
                try:
                    yield response
                finally:
                    response.release_conn()
                return
        finally:
            pool.close()
    raise FetchUnavailable(f"{parts.hostname} could not be reached ({type(unreachable).__name__}).")


@contextmanager
def _translated(host: str | None) -> Iterator[None]:
    try:
        yield
    except SSLError as error:  # an untrusted or mismatched certificate is not fixed by asking again
        raise FetchFailed(f"TLS with {host} failed: {error.__context__ or error}.") from None
    except urllib3.exceptions.TimeoutError:
        raise FetchUnavailable(f"{host} did not answer in time.") from None
    except (urllib3.exceptions.HTTPError, OSError) as error:  # resets, a body cut short of its Content-Length
        raise FetchUnavailable(f"The connection to {host} failed ({type(error).__name__}).") from None


def _save(
    response: urllib3.BaseHTTPResponse, url: str, path: Path, limit: int, cancelled: Callable[[], bool]
) -> Fetched:
    declared = response.headers.get("Content-Length", "")
    if declared.isdigit() and int(declared) > limit:
        raise _too_large(limit)
    digest, size = hashlib.sha256(), 0
    try:
        with open(path, "wb") as sink:
            while chunk := response.read1(CHUNK):
                size += len(chunk)
                if size > limit:
                    raise _too_large(limit)
                digest.update(chunk)
                sink.write(chunk)
                if cancelled():
                    raise Cancelled("the job was cancelled")
    except OSError as error:  # these come from the file, never the socket; others are network failures (_translated)
        if error.errno in NO_ROOM:
            raise WorkerDiskFull(
                f"The worker ran out of disk space after {size} bytes of the input ({error.strerror}); "
                "another attempt (maybe on another worker) will try again."
            ) from None
        raise
    return Fetched(url, size, digest.hexdigest())


def _too_large(limit: int) -> FetchFailed:
    return FetchFailed(f"The video at the input URL is larger than the limit of {limit} bytes.")


def _host(url: str) -> str:
    return urlsplit(url).hostname or "the origin"


def _reason(status: int) -> str:
    try:
        return HTTPStatus(status).phrase
    except ValueError:
        return ""
