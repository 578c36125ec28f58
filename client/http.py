"""A small client of the vsrq job API, for programs that talk to it as a user does (`vsrq bulk`, `vsrq demo`).

It speaks HTTP only (requests; never imports torch or the server's modules). Every call is retried with tenacity on
what a later try can fix: connection errors, timeouts, 5xx, 429 and 503 (waiting what `Retry-After` says), and 409
`idempotency_in_flight` or `upload_completing`. A create always carries an `Idempotency-Key` (a random one unless the
caller derives its own, as `vsrq bulk` does to survive reruns), so that its retries never make a second job.
"""

from __future__ import annotations

import hashlib
import logging
import mimetypes
import os
import secrets
import threading
import time
from collections.abc import Callable, Iterator
from email.utils import parsedate_to_datetime
from pathlib import Path
from typing import Any, BinaryIO

import requests
from requests_toolbelt import MultipartEncoder
from tenacity import (
    RetryCallState,
    Retrying,
    before_sleep_log,
    retry_if_exception,
    retry_if_exception_type,
    stop_after_delay,
    wait_exponential_jitter,
)

TERMINAL = frozenset({"completed", "failed", "cancelled"})
# A local file larger than this goes up in parts of this size (OpenAI's part size; under the 100 MB a body may have
# through some proxies), not in one request
PART_BYTES = 64 * 1024 * 1024
_TRANSIENT_STATUS = frozenset({429, 500, 502, 503, 504})
# A create still running under its idempotency key; an upload's parts still being joined by an earlier completion
_RETRY_409 = frozenset({"idempotency_in_flight", "idempotency_taken_over", "upload_completing"})
log = logging.getLogger("vsrq.client")


class ApiProblem(Exception):
    """An error answer: its HTTP status, the API's stable `code` and the human `message` (problem+json `detail`)."""

    def __init__(self, status: int, code: str, message: str, *, retry_after: float | None = None) -> None:
        super().__init__(f"{code}: {message}")
        self.status, self.code, self.message, self.retry_after = status, code, message, retry_after

    @property
    def transient(self) -> bool:
        return self.status in _TRANSIENT_STATUS or (self.status == 409 and self.code in _RETRY_409)


class DownloadMismatch(Exception):
    """The bytes received are not the output the job recorded (a cut connection, a proxy's error page)."""

    code = "download_mismatch"


def retry_after(value: str | None) -> float | None:
    """Seconds a `Retry-After` header asks for (delta-seconds or an HTTP date); None if absent or unreadable."""
    if not value:
        return None
    if value.strip().isdigit():
        return float(value)
    try:
        return max(0.0, parsedate_to_datetime(value).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def _transient(error: BaseException) -> bool:
    if isinstance(error, ApiProblem):
        return error.transient
    # a download cut short raises ChunkedEncodingError (urllib3 checks Content-Length); it is fetched again
    return isinstance(error, (requests.ConnectionError, requests.Timeout, requests.exceptions.ChunkedEncodingError,
                              DownloadMismatch))  # fmt: skip


class Client:
    def __init__(
        self,
        base_url: str,
        token: str | None,
        *,
        timeout_s: tuple[float, float] = (10, 300),
        retry_for_s: float = 300,
        follow: Callable[[], tuple[str, str | None] | None] | None = None,
    ) -> None:
        """`follow`: where the API is now (its URL and key), asked again whenever it stops answering: a `vsrq dev`
        stack started again on another port (client.config.dev_api)."""
        self.base_url, self.timeout_s, self.follow = base_url.rstrip("/"), timeout_s, follow
        self._moving = threading.Lock()
        self.session = requests.Session()
        self._use(token)
        backoff = wait_exponential_jitter(initial=0.5, max=30)

        def wait(state: RetryCallState) -> float:
            error = state.outcome.exception() if state.outcome else None
            if isinstance(error, requests.ConnectionError):
                self._look_again()
            asked = getattr(error, "retry_after", None)
            return asked if asked is not None else backoff(state)

        self.retry_for_s = retry_for_s
        self._retrying = Retrying(
            retry=retry_if_exception(_transient),
            wait=wait,
            stop=stop_after_delay(retry_for_s),
            before_sleep=before_sleep_log(log, logging.INFO),  # `vsrq -v` shows each retry and why
            reraise=True,
        )

    # -- create ------------------------------------------------------------------------------------------------

    def create_from_file(
        self, path: str | Path, fields: dict[str, str], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """A job on a local file, uploaded in SGLang's multipart form (`video_reference`), streamed from disk."""
        path = Path(path)
        name = path.name
        content_type = mimetypes.guess_type(name)[0] or "application/octet-stream"
        key = idempotency_key or secrets.token_hex(16)  # one key for every try

        progress = _Progress()

        def send() -> requests.Response:
            with open(path, "rb") as video:  # opened per try: a retry sends the file from its start
                body = _Body(video, path.stat().st_size, progress)
                form = MultipartEncoder({**fields, "video_reference": (name, body, content_type)})
                return self._request("POST", "/v1/videos", data=form, headers=_headers(key, form.content_type))

        return self._retry(send, progress).json()

    def upload_in_parts(self, path: str | Path, part_bytes: int = PART_BYTES) -> str:
        """A local file as an upload in parts (OpenAI's Uploads API): each part retried alone, so a connection that
        drops costs that part, not the file. The completed upload's id, which a job names as `upload_id`."""
        path = Path(path)
        size, name = path.stat().st_size, path.name
        declared = {"bytes": size, "filename": name, "mime_type": mimetypes.guess_type(name)[0] or "video/mp4"}
        upload = self._retry(lambda: self._request("POST", "/v1/uploads", json=declared)).json()
        part_ids, parts_url = [], f"/v1/uploads/{upload['id']}/parts"

        def send(offset: int, progress: _Progress) -> requests.Response:
            # streamed from the file, as a create's is: sent as one `bytes`, a part had to cross the link within the
            # connect timeout (10 s: urllib3 sends a body under it, and `sendall` bounds the whole call)
            with open(path, "rb") as video:
                video.seek(offset)
                body = _Body(video, min(part_bytes, size - offset), progress)
                form = MultipartEncoder({"data": (name, body, "application/octet-stream")})
                return self._request("POST", parts_url, data=form, headers={"Content-Type": form.content_type})

        for offset in range(0, size, part_bytes):
            progress = _Progress()
            part = self._retry(lambda offset=offset, progress=progress: send(offset, progress), progress).json()
            part_ids.append(part["id"])
        body = {"part_ids": part_ids}  # completing again with the same parts answers the same upload
        self._retry(lambda: self._request("POST", f"/v1/uploads/{upload['id']}/complete", json=body))
        return upload["id"]

    def upload(self, upload_id: str) -> dict[str, Any]:
        return self._retry(lambda: self._request("GET", f"/v1/uploads/{upload_id}")).json()

    def create_from_upload(
        self, upload_id: str, fields: dict[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """A job on an earlier upload of the caller's (`upload_id`)."""
        return self._create_json({**fields, "upload_id": upload_id}, idempotency_key)

    def create_from_key(
        self, key: str, fields: dict[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """A job on a blob already in the service's storage, under the caller's uploads (`input_key`)."""
        return self._create_json({**fields, "input_key": key}, idempotency_key)

    def create_from_url(
        self, url: str, fields: dict[str, Any], *, idempotency_key: str | None = None
    ) -> dict[str, Any]:
        """A job on an https URL, which the service fetches itself (`video_url`)."""
        return self._create_json({**fields, "video_url": url}, idempotency_key)

    def _create_json(self, body: dict[str, Any], idempotency_key: str | None) -> dict[str, Any]:
        headers = _headers(idempotency_key or secrets.token_hex(16), "application/json")  # one key for every try
        return self._retry(lambda: self._request("POST", "/v1/videos", json=body, headers=headers)).json()

    # -- read --------------------------------------------------------------------------------------------------

    def get(self, job_id: str) -> dict[str, Any]:
        return self._retry(lambda: self._request("GET", f"/v1/videos/{job_id}")).json()

    def pages(self, status: str, limit: int = 100) -> Iterator[list[dict[str, Any]]]:
        """The key's jobs in `status`, newest first: a page of `limit` a request (the API's default most: 100)."""
        after = None
        while True:
            query = {"status": status, "limit": limit, **({"after": after} if after else {})}
            listed = self._retry(lambda query=query: self._request("GET", "/v1/videos", params=query)).json()
            yield listed["data"]
            if not listed["has_more"] or not listed["data"]:
                return
            after = listed["last_id"]

    def wait(
        self,
        job_id: str,
        *,
        poll_s: float = 1.0,
        timeout_s: float | None = None,
        on_update: Callable[[dict[str, Any]], None] | None = None,
    ) -> dict[str, Any]:
        """Polls until the job ends (completed, failed or cancelled); `on_update` sees every answer."""
        deadline = None if timeout_s is None else time.monotonic() + timeout_s
        while True:
            job = self.get(job_id)
            if on_update is not None:
                on_update(job)
            if job["status"] in TERMINAL:
                return job
            if deadline is not None and time.monotonic() > deadline:
                raise TimeoutError(f"{job_id} is still {job['status']} after {timeout_s} s")
            time.sleep(poll_s)

    def download(self, job_id: str, path: str | Path, *, sha256: str | None = None) -> Path:
        """The job's MP4 into `path`: written beside it, checked against `sha256` when given, then renamed into
        place, so `path` is either absent or whole. A try cut short is followed by one for the rest (`Range`, under
        `If-Range`: the same output or the whole again), not for all of it again."""
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{secrets.token_hex(4)}.partial")
        progress, got = _Progress(), {"digest": hashlib.sha256(), "tag": None}

        def fetch() -> Path:
            have = partial.stat().st_size if partial.exists() else 0
            # the bytes as stored (a compressing proxy's would not count as the range does)
            headers = {"Accept-Encoding": "identity"}
            if have and got["tag"]:
                headers |= {"Range": f"bytes={have}-", "If-Range": got["tag"]}
            try:
                response = self._request("GET", f"/v1/videos/{job_id}/content", stream=True, headers=headers)
            except ApiProblem as problem:
                if problem.status != 416:  # a range from the end: the try before got every byte (then failed)
                    raise
                response = None
            if response is not None:
                if response.status_code != 206 or not response.headers.get("Content-Range", "").startswith(
                    f"bytes {have}-"
                ):  # the whole, from its start (a first try, another output, or a range not the one asked)
                    partial.unlink(missing_ok=True)
                    have, got["digest"] = 0, hashlib.sha256()
                with response, open(partial, "ab") as sink:
                    got["tag"] = response.headers.get("ETag")
                    for chunk in response.iter_content(1 << 20):
                        sink.write(chunk)
                        got["digest"].update(chunk)
                        have += len(chunk)
                        progress.best = max(progress.best, have)
            if sha256 is not None and (digest := got["digest"].hexdigest()) != sha256:
                partial.unlink(missing_ok=True)
                raise DownloadMismatch(f"{job_id}: got sha256 {digest}, the job recorded {sha256}")
            os.replace(partial, path)
            return path

        try:
            return self._retry(fetch, progress)
        finally:
            partial.unlink(missing_ok=True)

    def reach(self, within_s: float = 10) -> None:
        """Returns once the API answers at all (`/healthz`, whatever its status); raises the connection's error when
        it has not within `within_s`: an API that is not there is said in seconds, not after a call's retries."""
        Retrying(
            retry=retry_if_exception_type((requests.ConnectionError, requests.Timeout)),
            wait=wait_exponential_jitter(initial=0.5, max=2),
            stop=stop_after_delay(within_s),
            reraise=True,
        )(lambda: self.session.get(self.base_url + "/healthz", timeout=(min(within_s, self.timeout_s[0]), 10)))

    # -- plumbing ----------------------------------------------------------------------------------------------

    def _use(self, token: str | None) -> None:
        # a new dict, set in one step: other threads' requests read the session's headers meanwhile
        headers = self.session.headers.copy()
        if token:  # none: an API with auth off (`vsrq dev` on loopback) takes the request as it is
            headers["Authorization"] = f"Bearer {token}"
        else:
            headers.pop("Authorization", None)
        self.session.headers = headers

    def _look_again(self) -> None:
        """Moves to where `follow` says the API is now, if that is elsewhere: the next try goes there."""
        where = self.follow() if self.follow is not None else None
        with self._moving:  # several threads' retries may ask at once: one moves, the others see it moved
            if where is not None and where[0].rstrip("/") != self.base_url:
                log.warning("the API moved from %s to %s: carrying on there", self.base_url, where[0])
                self._use(where[1])
                self.base_url = where[0].rstrip("/")

    def _retry(self, call: Callable[[], Any], progress: _Progress | None = None) -> Any:
        """`call`, retried on what a later try can fix for `retry_for_s`, counted from the first try, or from the end
        of the last try that got further through its transfer than any before it (`progress`): a 58 MB upload cut
        320 s in over a slow link was not sent again at all, its window spent before the cut."""
        if progress is None:
            return self._retrying.copy()(call)

        def stop(state: RetryCallState) -> bool:
            ended = state.outcome_timestamp or time.monotonic()
            if progress.gained():
                progress.since = ended
            return ended - (progress.since or state.start_time) >= self.retry_for_s

        return self._retrying.copy(stop=stop)(call)

    def _request(self, method: str, path: str, **kwargs: Any) -> requests.Response:
        response = self.session.request(method, self.base_url + path, timeout=self.timeout_s, **kwargs)
        if response.status_code >= 400:
            raise _problem(response)
        return response


class _Progress:
    """How far the tries of one transfer got: the most bytes one of them sent."""

    def __init__(self) -> None:
        self.best = self._told = 0
        self.since: float | None = None  # when a try last got further than any before it

    def gained(self) -> bool:
        """Whether a try got further since this was last asked."""
        gained, self._told = self.best > self._told, self.best
        return gained


class _Body:
    """`size` bytes of an open file from where it stands, read as a request body streams them (`MultipartEncoder`
    sizes it by `len`: what is left), counted into the transfer's `progress`."""

    def __init__(self, file: BinaryIO, size: int, progress: _Progress) -> None:
        self._file, self._left, self._sent, self._progress = file, size, 0, progress

    def __len__(self) -> int:
        return self._left

    def read(self, size: int = -1) -> bytes:
        data = self._file.read(self._left if size is None or size < 0 else min(size, self._left))
        if self._left and not data:  # the file shrank as it was sent: the body declared would never end
            raise OSError(f"{getattr(self._file, 'name', 'the file')} shrank while it was sent")
        self._left -= len(data)
        self._sent += len(data)
        self._progress.best = max(self._progress.best, self._sent)
        return data


def _headers(idempotency_key: str, content_type: str) -> dict[str, str]:
    return {"Content-Type": content_type, "Idempotency-Key": idempotency_key}


def _problem(response: requests.Response) -> ApiProblem:
    """The API's problem+json as an exception; anything else in front of it (a proxy's page) by its status."""
    try:
        body = response.json()
    except ValueError:
        body = None
    if not isinstance(body, dict):
        body = {}
    response.close()
    # the OpenAI-style `error.message` is the detail with each field's problem, where `detail` says "see `errors`"
    error = body.get("error") if isinstance(body.get("error"), dict) else {}
    return ApiProblem(
        response.status_code,
        str(body.get("code") or f"http_{response.status_code}"),
        str(error.get("message") or body.get("detail") or response.reason or "no detail"),
        retry_after=retry_after(response.headers.get("Retry-After")),
    )
