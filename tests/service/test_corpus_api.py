"""A sample of the real-world corpus (tests/corpus/) end to end through the API: uploaded, upscaled by a real
lanczos Celery worker, downloaded, and checked as tests/test_corpus.py checks the CLI's outputs."""

from __future__ import annotations

import pytest
import requests

from tests.corpus.check import compare, declared
from tests.corpus.fetch import load_manifest

from .conftest import auth
from .test_worker import get, wait_for, worker  # noqa: F401 (the lanczos worker fixture)

FILES = {entry["name"]: entry for entry in load_manifest()["file"]}
# Non-square DVD pixels with MP2 sound re-encoded, Theora in Ogg, cover art without a video (refused as it arrives),
# and an animated WebP (a web download: FFmpeg cannot decode it)
AT_UPLOAD = {"mutagen-covr-with-name.m4a"}  # its one track is sound (the cover is no track): api/sniff.py says so
SAMPLE = ["devede-base_ntsc_wide.mpg", "mecavideo-Effet_force_magnetique.ogv", "mutagen-covr-with-name.m4a",
          "pillow-iss634.webp"]


@pytest.mark.parametrize("name", SAMPLE)
def test_corpus_files_through_the_api(api, worker, corpus_cache, name, tmp_path):  # noqa: F811
    source = corpus_cache / name
    data = {"model": "lanczos", "sr_resolution_scale": "2"}
    files = {"video_reference": (name, source.read_bytes(), "application/octet-stream")}
    response = requests.post(f"{api}/v1/videos", data=data, files=files, headers=auth("dave"), timeout=30)
    expected = FILES[name].get("refuse")
    if name in AT_UPLOAD:  # refused as it arrived, for what the worker's probe would have said
        assert (response.status_code, response.json()["code"]) == (422, expected), response.text
        return
    assert response.status_code == 200, response.text
    job = wait_for(api, response.json()["id"], worker, limit_s=120)
    if expected:
        assert (job["status"], job["error"]["code"]) == ("failed", expected), job
        assert job.get("output") is None
        return
    assert job["status"] == "completed", job
    content = requests.get(f"{api}/v1/videos/{job['id']}/content", headers=auth("dave"), timeout=60)
    assert content.status_code == 200
    (tmp_path / "out.mp4").write_bytes(content.content)
    assert compare(declared(source), declared(tmp_path / "out.mp4")) == []
    assert get(api, job["id"])["output"]["media"]["width"] == 2 * declared(source).width
