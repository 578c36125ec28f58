"""The SSRF guard, on literal addresses and names this machine resolves itself (no network needed), and how long it
waits for a resolver."""

from __future__ import annotations

import io
import ipaddress
import socket
import threading
import time

import pytest

from storage.ssrf import LookupUnavailable, UnsafeUrl, public_addresses
from worker.webhooks import post

from .conftest import auth

REFUSED = [
    "https://127.0.0.1/hook",
    "https://localhost/hook",
    "https://10.1.2.3:8443/",
    "https://172.16.0.1/",
    "https://192.168.1.1/",
    "https://169.254.169.254/latest/meta-data",  # cloud metadata
    "https://100.64.0.1/",  # CGNAT
    "https://224.0.0.1/",  # multicast
    "https://0.0.0.0/",
    "https://[::1]/",
    "https://[fd00::1]/",  # ULA
    "https://[fe80::1]/",  # link-local
    "https://[::ffff:10.0.0.1]/",  # IPv4-mapped
    "https://[64:ff9b::a00:1]/",  # NAT64 of 10.0.0.1
    "https://[2002:a00:1::]/",  # 6to4 of 10.0.0.1
    "https://user:pass@93.184.215.14/",  # credentials in the URL
    "ftp://93.184.215.14/",
    "https://host.invalid/",  # does not resolve
]


@pytest.mark.parametrize("url", REFUSED)
def test_refused(url):
    with pytest.raises(UnsafeUrl):
        public_addresses(url)


def test_public_addresses_pass_and_loopback_only_with_the_development_flag():
    assert public_addresses("https://93.184.215.14/hooks") == [ipaddress.ip_address("93.184.215.14")]
    assert public_addresses("https://[2606:4700::1111]:8443/") == [ipaddress.ip_address("2606:4700::1111")]
    assert public_addresses("https://127.0.0.1:9000/hook", allow_loopback=True) == [ipaddress.ip_address("127.0.0.1")]
    with pytest.raises(UnsafeUrl):
        public_addresses("https://10.0.0.1/", allow_loopback=True)


class Resolver:
    """The system resolver, except that names under `slow.example` get no answer until released (glibc's own limit,
    5 s a try and a few tries, is what a resolver that is down costs), and those under `down.example` the answer a
    resolver whose upstream fails gives at once (EAI_AGAIN)."""

    def __init__(self, real):
        self.real, self.released, self.asked = real, threading.Event(), 0

    def __call__(self, host, *args, **kwargs):
        if str(host).endswith("slow.example"):
            self.asked += 1
            self.released.wait(30)
        if str(host).endswith(("slow.example", "down.example")):
            raise socket.gaierror(socket.EAI_AGAIN, "Temporary failure in name resolution")
        return self.real(host, *args, **kwargs)


@pytest.fixture
def resolver(monkeypatch):
    slow = Resolver(socket.getaddrinfo)
    monkeypatch.setattr(socket, "getaddrinfo", slow)
    yield slow
    slow.released.set()


def test_a_resolver_that_does_not_answer_is_waited_for_no_longer_than_asked(resolver):
    began = time.monotonic()
    with pytest.raises(LookupUnavailable):
        public_addresses("https://hooks.slow.example/in", timeout_s=0.5)
    waited = time.monotonic() - began
    assert 0.5 <= waited < 1.5 and resolver.asked == 1, waited
    with pytest.raises(LookupUnavailable):  # a resolver that says to try again is not a host that does not exist
        public_addresses("https://hooks.down.example/in", timeout_s=5)
    # what answers is unchanged: an answer, or a refusal, not a timeout
    assert public_addresses("https://93.184.215.14/", timeout_s=0.5) == [ipaddress.ip_address("93.184.215.14")]
    with pytest.raises(UnsafeUrl):
        public_addresses("https://host.invalid/", timeout_s=5)
    with pytest.raises(UnsafeUrl):
        public_addresses("https://127.0.0.1/", timeout_s=5)


def test_a_webhook_attempt_is_over_by_its_deadline_however_slow_the_lookup(resolver, settings):
    """The reaper sends an attempt again a POST's limit after it began (worker.gone): the attempt's lookup counts
    within that limit, or a worker cut off from Redis could send it at the same time as its successor."""
    began = time.monotonic()
    deadline = began + 0.8
    attempt = post("https://hooks.slow.example/in", b"{}", {}, settings, deadline)
    assert (attempt.outcome, attempt.code) == ("retry", "lookup_unavailable"), attempt
    assert time.monotonic() - deadline < 0.5, time.monotonic() - began
    # a deadline already past sends nothing and asks nothing; a resolver that is down is retried, not given up
    asked = resolver.asked
    attempt = post("https://hooks.slow.example/in", b"{}", {}, settings, time.monotonic() - 1)
    assert (attempt.outcome, attempt.code, resolver.asked) == ("retry", "lookup_unavailable", asked), attempt
    attempt = post("https://hooks.down.example/in", b"{}", {}, settings, time.monotonic() + 5)
    assert (attempt.outcome, attempt.code) == ("retry", "lookup_unavailable"), attempt


def test_a_submit_whose_url_does_not_resolve_in_time_is_told_to_retry_and_makes_no_job(resolver, settings, clip):
    """The API checks a webhook or input URL at submit: a resolver that does not answer held the request's thread for
    as long as glibc kept trying, then gave 422 for a URL that may be fine."""
    from api.app import create_app

    client = create_app(settings.model_copy(update={"fetch_connect_timeout_s": 0.5})).test_client()
    listed = client.get("/v1/videos?limit=100", headers=auth("alice")).get_json()["data"]
    began = time.monotonic()
    response = client.post(
        "/v1/videos",
        data={"video_reference": (io.BytesIO(clip), "clip.mp4"), "webhook_url": "https://hooks.slow.example/in"},
        headers=auth("alice"),
    )
    waited = time.monotonic() - began
    body = response.get_json()
    assert (response.status_code, body["code"]) == (503, "url_lookup_unavailable"), body
    assert body["errors"][0]["field"] == "webhook_url" and int(response.headers["Retry-After"]) > 0, body
    assert waited < 3, waited
    for host in ("media.slow.example", "media.down.example"):
        response = client.post("/v1/videos", json={"model": "lanczos", "video_url": f"https://{host}/a.mp4"},
                               headers=auth("alice"))  # fmt: skip
        assert (response.status_code, response.get_json()["code"]) == (503, "url_lookup_unavailable"), host
    assert client.get("/v1/videos?limit=100", headers=auth("alice")).get_json()["data"] == listed
