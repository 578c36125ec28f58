"""`client.http.Client` (what `vsrq bulk` and `vsrq demo` send through) over the links users have: an uplink slower
than a request's timeouts, and a connection cut mid-upload or mid-download, through a relay in front of the live API."""

from __future__ import annotations

import io
from collections.abc import Iterator
from urllib.parse import urlsplit

import pytest
import requests

from client.http import Client
from storage.blobs import attempt_output_key
from storage.jobs import InputInfo, OutputInfo
from worker.media.synthetic import write_clip

from .conftest import KEYS, auth, padded
from .link import Link

MiB = 1024 * 1024


@pytest.fixture
def video(tmp_path) -> bytes:
    """A real MP4 grown to 3 MiB."""
    return padded(write_clip(tmp_path / "clip.mp4", 9, (32, 48), audio_codec="aac").read_bytes(), 3 * MiB)


@pytest.fixture
def link(api) -> Iterator[callable]:
    links = []

    def make(**shape) -> Link:
        links.append(Link(urlsplit(api).port, **shape))
        return links[-1]

    yield make
    for made in links:
        made.close()


def test_parts_cross_an_uplink_slower_than_the_connect_timeout(link, tmp_path):
    """Parts of 8 MiB over a 1 MiB/s uplink with a 2 s connect timeout (10 s and 64 MiB parts: any uplink under
    ~50 Mbit/s). Sent as one `bytes`, a part had to cross within the connect timeout (less the 4 MiB the socket
    buffers took): every try failed, with no fault at all (the network trial of session 53). Streamed, each part goes
    at the link's pace."""
    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48), audio_codec="aac").read_bytes()
    path = tmp_path / "big.mp4"
    path.write_bytes(padded(clip, 9 * MiB))
    client = Client(link(rate=MiB).url, KEYS["bulk"], timeout_s=(2, 30), retry_for_s=5)
    upload_id = client.upload_in_parts(path, 8 * MiB)
    upload = requests.get(f"{client.base_url}/v1/uploads/{upload_id}", headers=auth("bulk"), timeout=10).json()
    assert (upload["status"], upload["bytes"], len(upload["part_ids"])) == ("completed", 9 * MiB, 2)


def test_a_transfer_cut_after_its_retry_window_is_sent_again(link, video, tmp_path):
    """A create of 3 MiB over a 512 KiB/s uplink, cut 2 MiB in (4 s), with 3 s of retries: the window counted from
    the first try's start was spent before the cut, so the create was never sent again (a 58 MB upload cut 320 s in,
    in the trial). A try that got further than any before starts the window again: the create is sent again."""
    path = tmp_path / "clip.mp4"
    path.write_bytes(video)
    cut = link(rate=MiB / 2, cut_after=2 * MiB)
    client = Client(cut.url, KEYS["bulk"], timeout_s=(1, 30), retry_for_s=3)
    job = client.create_from_file(path, {"model": "lanczos", "sr_resolution_scale": "2"})
    assert cut.cuts == 1 and job["status"] in ("queued", "in_progress", "completed"), job


def test_a_download_cut_short_goes_on_from_where_it_stopped(link, jobs, s3, tmp_path):
    """A completed job's 3 MiB output, the connection reset 2 MiB into the download: the next try asked for the whole
    again (a user on 256 kbit/s paid every cut in full). Now it asks for the rest (`Range` under `If-Range`), and the
    file is whole and checked against the job's SHA-256."""
    body = padded(write_clip(tmp_path / "out.mp4", 9, (32, 48), audio_codec="aac").read_bytes(), 3 * MiB)
    job = jobs.create(owner="bulk", model="lanczos", queue="vsrq.links-test", params={}, input=InputInfo(key="x"))
    lease = jobs.lease(job.id, "links-test", lease_s=60)
    stored = s3.put(attempt_output_key(job.id, lease.attempt, lease.token), io.BytesIO(body), content_type="video/mp4")
    lease.complete(OutputInfo(key=stored.key, bytes=stored.size, sha256=stored.sha256))
    cut = link(cut_down_after=2 * MiB)
    client = Client(cut.url, KEYS["bulk"], timeout_s=(1, 30), retry_for_s=10)
    asked: list[str | None] = []
    client.session.hooks["response"].append(lambda response, **_: asked.append(response.request.headers.get("Range")))
    path = client.download(job.id, tmp_path / "got.mp4", sha256=stored.sha256)
    assert cut.cuts == 1 and path.read_bytes() == body and not list(tmp_path.glob(".got.mp4.*"))
    assert asked[0] is None and asked[-1].startswith("bytes=") and int(asked[-1][6:-1]) >= MiB, asked
