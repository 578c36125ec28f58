"""Inputs named by an `https` URL: checked by the API at submit, fetched by a real Celery worker at task time from an
HTTPS origin the tests run on 127.0.0.1, with a certificate from a test CA (trustme) issued for "localhost" only.

The worker trusts the test CA through `VSRQ_FETCH_CA_BUNDLE`, not `REQUESTS_CA_BUNDLE`: the setting reaches exactly
the input fetch, where the environment variable would replace the CAs of every `requests` call in the process
(hub downloads included). Loopback origins are allowed by `VSRQ_FETCH_ALLOW_LOOPBACK` (conftest's service_env).
"""

from __future__ import annotations

import hashlib
import ssl
import threading
import time
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
import requests
import trustme

from worker.attempt import classify
from worker.errors import Cancelled
from worker.fetch import MAX_REDIRECTS, FetchFailed, FetchUnavailable, fetch
from worker.media.synthetic import write_clip

from .conftest import UPLOAD_LIMIT, auth
from .test_webhooks import running
from .test_worker import celery_worker, wait_for

MiB = 1024 * 1024
HUGE = 64 * MiB  # what /huge would send: far past the upload limit


class Origin(ThreadingHTTPServer):
    """The HTTPS server input URLs point at. It counts what /huge managed to send before the client hung up."""

    daemon_threads = True

    def __init__(self, clip: bytes, context: ssl.SSLContext) -> None:
        super().__init__(("127.0.0.1", 0), OriginHandler)
        self.socket = context.wrap_socket(self.socket, server_side=True)
        self.clip = clip
        self.huge_sent: int | None = None
        self.huge_done = threading.Event()
        self.flaky_left, self.flaky_gets = 0, []

    @property
    def base(self) -> str:
        return f"https://localhost:{self.server_address[1]}"


class OriginHandler(BaseHTTPRequestHandler):
    server: Origin

    def do_GET(self) -> None:  # noqa: N802 (http.server's name)
        path = self.path
        if path == "/clip.mp4":
            self._send(200, self.server.clip)
        elif path.startswith("/hop/"):  # relative redirects, n of them, then the clip
            hops = int(path.removeprefix("/hop/"))
            self._redirect(f"/hop/{hops - 1}" if hops > 1 else "/clip.mp4")
        elif path == "/loop":
            self._redirect("/loop")
        elif path == "/private":
            self._redirect("https://10.20.30.40/clip.mp4")
        elif path == "/unavailable":
            self._send(503, b"try later")
        elif path == "/flaky":  # down (503, come back in 2 s) for its first `flaky_left` requests, then the clip
            self.server.flaky_gets.append(time.monotonic())
            if self.server.flaky_left > 0:
                self.server.flaky_left -= 1
                self.send_response(503)
                self.send_header("Retry-After", "2")
                self.send_header("Content-Length", "0")
                self.end_headers()
            else:
                self._send(200, self.server.clip)
        elif path == "/cut-short":  # promises more than it sends
            self.send_response(200)
            self.send_header("Content-Length", str(len(self.server.clip)))
            self.end_headers()
            self.wfile.write(self.server.clip[:1000])
        elif path == "/stall":
            self.send_response(200)
            self.send_header("Content-Length", "10")
            self.end_headers()
            self.wfile.write(b"12345")
            self.wfile.flush()
            time.sleep(3)
        elif path == "/declared-huge":
            self.send_response(200)
            self.send_header("Content-Length", str(HUGE))
            self.end_headers()
        elif path == "/huge":  # no Content-Length: only counting while reading can stop it
            self._stream_huge()
        else:
            self._send(404, b"no such video")

    def _stream_huge(self) -> None:
        self.send_response(200)
        self.end_headers()
        sent, chunk = 0, b"\0" * MiB
        try:
            while sent < HUGE:
                self.wfile.write(chunk)
                sent += len(chunk)
        except OSError:  # the client stopped reading and closed
            pass
        finally:
            self.server.huge_sent = sent
            self.server.huge_done.set()
            self.close_connection = True

    def _send(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _redirect(self, location: str) -> None:
        self.send_response(302)
        self.send_header("Location", location)
        self.send_header("Content-Length", "0")
        self.end_headers()

    def log_message(self, *_) -> None:
        pass


@pytest.fixture(scope="module")
def ca_bundle(tmp_path_factory) -> tuple[trustme.CA, Path]:
    ca = trustme.CA()
    path = tmp_path_factory.mktemp("ca") / "ca.pem"
    ca.cert_pem.write_to_path(str(path))
    return ca, path


@pytest.fixture(scope="module")
def url_clip(tmp_path_factory) -> bytes:
    """17 frames of 64x48 H.264 with AAC."""
    return write_clip(tmp_path_factory.mktemp("url") / "clip.mp4", 17, (48, 64), audio_codec="aac").read_bytes()


@pytest.fixture(scope="module")
def origin(ca_bundle, url_clip) -> Iterator[Origin]:
    ca, _ = ca_bundle
    context = ssl.create_default_context(ssl.Purpose.CLIENT_AUTH)
    ca.issue_cert("localhost").configure_cert(context)  # "localhost" only: https://127.0.0.1 does not match
    server = Origin(url_clip, context)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture(scope="module")
def url_worker(service_env, redis_client, ca_bundle, tmp_path_factory) -> Iterator[Path]:
    """The lanczos worker (queue vsrq.cpu), trusting the test CA: its log file."""
    redis_client.delete("vsrq.cpu")
    # an origin that is down gets 0.5 to 1 s before the next attempt, or what its Retry-After asks
    env = {**service_env, "VSRQ_FETCH_CA_BUNDLE": str(ca_bundle[1]), "VSRQ_FETCH_RETRY_BASE_S": "1"}
    with celery_worker(env, "lanczos", "vsrq.cpu", tmp_path_factory.mktemp("url-worker") / "cpu.log") as log:
        yield log


def submit(api: str, **body) -> requests.Response:
    body = {"model": "lanczos", "sr_resolution_scale": 2, **body}
    return requests.post(f"{api}/v1/videos", json=body, headers=auth("dave"), timeout=30)


def run(api: str, worker: Path, **body) -> dict:
    response = submit(api, **body)
    assert response.status_code == 200, response.text
    assert response.json()["input"]["bytes"] is None  # known once fetched
    return wait_for(api, response.json()["id"], worker)


# -- through the API and a real worker -----------------------------------------------------------------------------


def test_a_url_input_runs_end_to_end(api, origin, url_worker, url_clip):
    # OpenAI-style {"url": ...}, through two redirects
    job = run(api, url_worker, video_url={"url": f"{origin.base}/hop/2"})
    assert (job["status"], job["size"], job["error"]) == ("completed", "128x96", None), job
    assert job["output"]["media"]["frames"] == 17 and job["output"]["media"]["audio"]
    # the served bytes' size and digest, on the record as an upload's are
    assert job["input"]["bytes"] == len(url_clip) and job["input"]["sha256"] == hashlib.sha256(url_clip).hexdigest()
    # a player seeking in the worker's output gets the slice it asked for
    whole = requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("dave"), timeout=30).content
    tail = requests.get(
        f"{api}/v1/videos/{job['id']}/content", headers={**auth("dave"), "Range": "bytes=-1000"}, timeout=30
    )
    assert tail.status_code == 206 and tail.content == whole[-1000:] and len(whole) == job["output"]["bytes"]


def test_an_origin_that_is_down_gets_the_time_it_asks_for_before_the_next_attempt(
    api, origin, url_worker, jobs, service_env, tmp_path
):
    """It was tried again at once: three attempts in ~60 ms, then the job failed, for an origin restarting. The
    reaper, its passes a minute apart here, wakes for the retry when its wait ends."""
    origin.flaky_left, origin.flaky_gets = 1, []
    with running(["worker.reaper"], {**service_env, "VSRQ_REAP_INTERVAL_S": "60"}, tmp_path / "reaper.log"):
        response = submit(api, video_url=f"{origin.base}/flaky")
        assert response.status_code == 200, response.text
        job = wait_for(api, response.json()["id"], url_worker, limit_s=60)
    assert (job["status"], job["attempt"], job["error"]) == ("completed", 2, None), job
    requeued = [event for event in jobs.event_views(job["id"]).data if event.type == "requeued"]
    assert [(event.reason.code, event.retry_in_s) for event in requeued] == [("input_fetch_unavailable", 2.0)]
    first, second = origin.flaky_gets
    assert 2.0 <= second - first < 6  # its Retry-After (the backoff alone: 0.5 to 1 s), not the reaper's next pass
    # an origin down is expected: the worker's line says why, without a traceback in every retry's log
    [line] = [line for line in url_worker.read_text().splitlines() if f"{job['id']} attempt 1: retry" in line]
    assert "503" in line and "Traceback" not in line, line


def test_the_fetched_inputs_size_and_digest_are_documented(api):
    schemas = requests.get(f"{api}/openapi.json", timeout=30).json()["components"]["schemas"]
    fields = schemas["VideoInput"]["properties"]
    assert all("URL input" in fields[name]["description"] for name in ("bytes", "sha256")), fields


def test_an_origin_404_fails_the_job(api, origin, url_worker):
    # SGLang clients name the URL in input_reference
    job = run(api, url_worker, input_reference=f"{origin.base}/gone.mp4")
    assert (job["status"], job["attempt"]) == ("failed", 1), job
    assert job["error"]["code"] == "input_fetch_failed" and "404 Not Found" in job["error"]["message"]


def test_a_redirect_to_a_private_address_is_refused(api, origin, url_worker):
    job = run(api, url_worker, video_url=f"{origin.base}/private")
    assert (job["status"], job["error"]["code"], job["attempt"]) == ("failed", "input_fetch_failed", 1), job
    assert "'10.20.30.40' resolves to a non-public address" in job["error"]["message"]


def test_too_large_is_refused_while_streaming(api, origin, url_worker):
    origin.huge_done.clear()
    job = run(api, url_worker, video_url=f"{origin.base}/huge")
    assert (job["status"], job["error"]["code"]) == ("failed", "input_fetch_failed"), job
    assert f"limit of {UPLOAD_LIMIT} bytes" in job["error"]["message"]
    # the worker hung up soon after the limit: what the origin got out is the limit plus what the sockets buffer
    assert origin.huge_done.wait(30)
    assert UPLOAD_LIMIT < origin.huge_sent < UPLOAD_LIMIT + 16 * MiB < HUGE


# -- at submit -----------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "body, field, code",
    [
        ({"video_url": "https://10.0.0.7/a.mp4"}, "video_url", "unsafe_url"),
        ({"input_reference": "https://169.254.169.254/latest/meta-data"}, "input_reference", "unsafe_url"),
        ({"video_url": "https://user:pw@localhost/a.mp4"}, "video_url", "unsafe_url"),
        ({"video_url": "http://localhost/a.mp4"}, "video_url", "invalid_request"),
        ({"input_reference": "ftp://localhost/a.mp4"}, "input_reference", "invalid_request"),
    ],
)
def test_a_refused_url_is_422_at_submit(api, body, field, code):
    response = submit(api, **body)
    assert response.status_code == 422 and response.headers["Content-Type"] == "application/problem+json"
    problem = response.json()
    assert problem["code"] == code and [error["field"] for error in problem["errors"]] == [field], problem


def test_exactly_one_input_is_named(api):
    for body in (
        {"video_url": "https://localhost/a.mp4", "upload_id": "upload_" + "0" * 24},
        {"video_url": "https://localhost/a.mp4", "input_reference": "https://localhost/b.mp4"},
        {},
    ):
        response = submit(api, **body)
        assert (response.status_code, response.json()["code"]) == (422, "missing_video"), body


# -- the fetch itself, in this process -----------------------------------------------------------------------------


def never() -> bool:
    return False


@pytest.fixture
def fetch_settings(settings, ca_bundle):
    # a generous read timeout: on a loaded 2-core box a TLS handshake alone can take over a second
    return settings.model_copy(update={"fetch_ca_bundle": ca_bundle[1], "fetch_read_timeout_s": 15.0})


def test_fetch_outcomes(origin, fetch_settings, url_clip, tmp_path):
    target = tmp_path / "input"
    fetched = fetch(f"{origin.base}/hop/{MAX_REDIRECTS}", target, fetch_settings, never)
    assert (fetched.bytes, fetched.url, target.read_bytes()) == (len(url_clip), f"{origin.base}/clip.mp4", url_clip)

    failed = {
        "/loop": "redirected more than",
        "/declared-huge": "larger than the limit",  # refused on its Content-Length, before the body
        "/missing": "404 Not Found",
    }
    for path, message in failed.items():
        with pytest.raises(FetchFailed, match=message) as error:
            fetch(f"{origin.base}{path}", target, fetch_settings, never)
        assert classify(error.value)[:2] == ("failed", "input_fetch_failed")
    # TLS is verified against the URL's host name: the certificate is for "localhost", not for 127.0.0.1
    port = origin.server_address[1]
    with pytest.raises(FetchFailed, match="TLS with 127.0.0.1 failed"):
        fetch(f"https://127.0.0.1:{port}/clip.mp4", target, fetch_settings, never)
    # ...and against the configured CAs only
    with pytest.raises(FetchFailed, match="TLS with localhost failed"):
        fetch(f"{origin.base}/clip.mp4", target, fetch_settings.model_copy(update={"fetch_ca_bundle": None}), never)

    impatient = fetch_settings.model_copy(update={"fetch_read_timeout_s": 1.0})  # so that /stall ends the read soon
    for path in ("/unavailable", "/cut-short", "/stall"):
        with pytest.raises(FetchUnavailable) as error:
            fetch(f"{origin.base}{path}", target, impatient, never)
        assert classify(error.value)[:2] == ("retry", "input_fetch_unavailable"), path

    # a key's own, smaller upload limit holds for what is fetched for it (recorded on the job at create)
    with pytest.raises(FetchFailed, match="larger than the limit"):
        fetch(f"{origin.base}/clip.mp4", target, fetch_settings, never, max_bytes=len(url_clip) - 1)

    strict = fetch_settings.model_copy(update={"fetch_allow_loopback": False})
    with pytest.raises(FetchFailed, match="non-public"):  # loopback only where the development flag allows it
        fetch(f"{origin.base}/clip.mp4", target, strict, never)


def test_a_cancel_stops_the_download(origin, fetch_settings, tmp_path):
    with pytest.raises(Cancelled):
        fetch(f"{origin.base}/huge", tmp_path / "input", fetch_settings, lambda: True)
