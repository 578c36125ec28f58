"""`vsrq bulk` as a user runs it: a subprocess against the live API (gunicorn), a real lanczos Celery worker and
SeaweedFS, on real MP4s with audio. Jobs are counted through the API under a key only this module uses ("bulk")."""

from __future__ import annotations

import csv
import hashlib
import json
import os
import re
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Iterator
from email.utils import formatdate
from pathlib import Path

import av
import psutil
import pytest
import requests

from client import bulk as bulk_module
from client.bulk import Bulk, BulkError, Journal, journal_path, plan
from client.http import ApiProblem, Client, retry_after
from worker.media.synthetic import write_clip

from .conftest import KEYS, ROOT, UNREADABLE, as_a_shell_starts_it, auth, padded
from .test_worker import celery_worker

@pytest.fixture(scope="module")
def worker(service_env, redis_client, tmp_path_factory) -> Iterator[Path]:
    redis_client.delete("vsrq.cpu")  # messages other tests left for jobs they only inspected
    with celery_worker(service_env, "lanczos", "vsrq.cpu", tmp_path_factory.mktemp("worker") / "cpu.log") as log:
        yield log


def job_count(api: str) -> int:
    """Jobs the "bulk" key owns, every page."""
    count, after = 0, None
    while True:
        params = {"limit": 100, **({"after": after} if after else {})}
        page = requests.get(f"{api}/v1/videos", params=params, headers=auth("bulk"), timeout=10).json()
        count += len(page["data"])
        if not page["has_more"]:
            return count
        after = page["last_id"]


def bulk_command(api: str, source: str | Path, report: Path, *options: str) -> list[str]:
    return [sys.executable, "-m", "client.cli", "-v", "bulk", str(source), "--api-url", api, "--report", str(report),
            "--model", "lanczos", "--poll", "0.2", *options]  # fmt: skip


def bulk_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "VSRQ_TOKEN": KEYS["bulk"], **extra}


def run_bulk(command: list[str], env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    return subprocess.run(command, env=env or bulk_env(), cwd=ROOT, capture_output=True, text=True, timeout=300)


def report_rows(path: Path) -> list[dict]:
    with open(path, newline="") as file:
        return list(csv.DictReader(file)) if path.suffix == ".csv" else [json.loads(line) for line in file]


def by_source(path: Path) -> dict[str, dict]:
    return {row["source"]: row for row in report_rows(path)}


def media(path: Path) -> tuple[int, int, int, bool]:
    """(width, height, frames, has audio) of an MP4, read back with PyAV."""
    with av.open(str(path)) as container:
        video = container.streams.video[0]
        frames = sum(1 for _ in container.decode(video))
        return video.width, video.height, frames, bool(container.streams.audio)


def writes_to(process: psutil.Process, log: Path) -> bool:
    try:
        return any(file.path == str(log) for file in process.open_files())
    except psutil.Error:  # ended meanwhile
        return False


def test_a_folder_interrupted_then_rerun_makes_each_job_exactly_once(api, worker, tmp_path):
    folder, out, report = tmp_path / "in", tmp_path / "out", tmp_path / "report.csv"
    frames = {}
    for index in range(10):  # distinct clips (frame counts), some in a subfolder
        name = f"{'nested/' if index % 3 == 0 else ''}clip{index}.mp4"
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        write_clip(folder / name, 5 + index, (32, 48), audio_codec="aac")
        frames[name] = 5 + index
    (folder / "notes.txt").write_text("not a video: skipped by its suffix")
    command = bulk_command(api, folder, report, "--scale", "2", "--concurrency", "1", "--wait", "--download", str(out))
    before = job_count(api)

    # The worker is paused (idle, no job in hand) while the first run submits: it cannot finish all ten before the
    # interrupt, however fast the jobs and slow this test's polling are on a loaded machine
    # This module's worker: the one writing its log (another module's worker on the same queue may still be ending)
    [paused] = [p for p in psutil.Process().children(recursive=True) if writes_to(p, worker)]
    paused.suspend()
    try:
        first = subprocess.Popen(command, env=bulk_env(), cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                                 text=True, preexec_fn=as_a_shell_starts_it)  # fmt: skip
        deadline = time.monotonic() + 120
        while job_count(api) - before < 3:
            assert first.poll() is None, first.communicate()
            assert time.monotonic() < deadline, "no submissions"
            time.sleep(0.05)
        first.send_signal(signal.SIGINT)
        stdout, stderr = first.communicate(timeout=120)
    finally:
        paused.resume()
    assert first.returncode == 130, stdout + stderr
    assert "vsrq bulk: interrupted: 10 videos: " in stderr and "rerun the same command to carry on" in stderr
    # the journal is consistent: it holds exactly the jobs the API made, no more, no fewer
    with sqlite3.connect(journal_path(report)) as db:
        journalled = {json.loads(entry)["job_id"] for (entry,) in db.execute("SELECT entry FROM entries")} - {None}
    assert 3 <= len(journalled) == job_count(api) - before, stderr
    print(f"FIGURE bulk interrupted after {len(journalled)}/10 submissions")
    assert len(report_rows(report)) == 10  # the interrupted run reports too (pending rows included)

    second = run_bulk(command)
    assert second.returncode == 0, second.stdout + second.stderr
    assert job_count(api) - before == 10  # no duplicates
    # no terminal here, so no bar: a progress line as it starts (then every 10 s), where nothing at all was said
    progress = r"^vsrq bulk: \d+/10 videos: submitted \d+, done \d+, failed 0$"
    assert re.search(progress, second.stderr, re.M), second.stderr
    assert f"10 videos: 10 submitted ({len(journalled)} by an earlier run), 10 completed" in second.stdout
    rows = by_source(report)
    assert sorted(rows) == sorted(frames) and len({row["job_id"] for row in rows.values()}) == 10
    assert journalled <= {row["job_id"] for row in rows.values()}  # the first run's jobs were followed, not remade
    for name, row in rows.items():
        assert (row["status"], row["error_code"]) == ("completed", ""), row
        output = Path(row["output"])
        assert output == out / Path(name).with_name(f"{Path(name).stem}-x2.mp4")  # the source's name and folders
        assert hashlib.sha256(output.read_bytes()).hexdigest() == row["sha256"]
        assert media(output) == (96, 64, frames[name], True)
        assert int(row["queued_s"]) >= 0 and int(row["running_s"]) >= 0
    assert not list(out.rglob("*.partial"))

    # a third run: nothing to submit, nothing to download again
    stamps = {path: path.stat().st_mtime_ns for path in out.rglob("*.mp4")}
    third = run_bulk(command)
    assert third.returncode == 0, third.stdout + third.stderr
    assert "10 videos: 10 submitted (10 by an earlier run), 10 completed" in third.stdout
    assert job_count(api) - before == 10
    assert {path: path.stat().st_mtime_ns for path in out.rglob("*.mp4")} == stamps


def test_a_file_larger_than_a_part_goes_in_parts_and_a_rerun_names_the_same_upload(api, worker, tmp_path):
    """`--part-size 1`: a 2.5 MiB MP4 goes up in three parts (each retried alone), its job names the upload. A rerun
    whose journal lost the job (its create's answer lost to a kill) names the same upload: the API replays the job."""
    folder, report = tmp_path / "in", tmp_path / "report.csv"
    folder.mkdir()
    clip = write_clip(tmp_path / "clip.mp4", 9, (32, 48), audio_codec="aac").read_bytes()
    (folder / "long.mp4").write_bytes(padded(clip, 5 * 1024 * 1024 // 2))
    command = bulk_command(api, folder, report, "--part-size", "1", "--scale", "2")
    before = job_count(api)
    first = run_bulk(command)
    assert first.returncode == 0, first.stdout + first.stderr
    row = by_source(report)["long.mp4"]
    job = requests.get(f"{api}/v1/videos/{row['job_id']}", headers=auth("bulk"), timeout=10).json()
    upload = requests.get(f"{api}/v1/uploads/{job['input']['upload_id']}", headers=auth("bulk"), timeout=10).json()
    assert (upload["status"], upload["bytes"], len(upload["part_ids"])) == ("completed", 5 * 1024 * 1024 // 2, 3)
    assert job["input"]["filename"] == "long.mp4" and job["metadata"] == {"bulk_source": "long.mp4"}

    with sqlite3.connect(journal_path(report)) as db:  # the create's answer never came back
        (entry,) = [json.loads(entry) for (entry,) in db.execute("SELECT entry FROM entries")]
        assert entry["upload_id"] == upload["id"]
        db.execute("UPDATE entries SET entry = ?", (json.dumps({**entry, "job_id": None, "status": "pending"}),))
    second = run_bulk(command)
    assert second.returncode == 0, second.stdout + second.stderr
    assert by_source(report)["long.mp4"]["job_id"] == row["job_id"] and job_count(api) - before == 1
    assert run_bulk([*command[:-4], "--part-size", "65"]).returncode == 2  # the service takes parts of 64 MiB


def test_many_jobs_are_followed_by_listing_not_one_request_each_per_poll(api, worker, tmp_path):
    """`--wait` asked the API about every open job every poll: 400 jobs spent the key's rate limit (1,200 a minute),
    and every other client of the key got 429. Now a run following many lists the key's open jobs, a page a request,
    and asks about each job only once it has left them."""
    folder = tmp_path / "in"
    folder.mkdir()
    for index in range(30):
        write_clip(folder / f"clip{index}.mp4", 3 + index % 3, (16, 24))
    items, _ = plan(str(folder), {"sr_resolution_scale": "2", "model": "lanczos"}, lambda: None)
    client = Client(api, KEYS["bulk"])
    sent: list[str] = []
    client.session.hooks["response"].append(lambda response, **_: sent.append(response.request.path_url))
    bulk = Bulk(client, items, Journal(tmp_path / "journal.sqlite"), lambda: None, "vsrq", wait=True, poll_s=0.2)
    bulk.run()
    assert bulk.counts()["completed"] == len(items), bulk.entries
    asked_each = [path for path in sent if path.startswith("/v1/videos/video_")]
    rounds = sum(path.startswith("/v1/videos?status=queued") for path in sent)
    print(f"FIGURE bulk following {len(items)} jobs: {rounds} polls, {len(asked_each)} requests about one job")
    assert rounds > 1 and len(asked_each) <= 2 * len(items), (rounds, len(asked_each))


def test_following_a_run_lists_its_own_jobs_not_the_key_s_older_open_ones(api, worker, tmp_path, monkeypatch):
    """`--wait` listed every open job of the key each poll: with 24,000 older jobs queued, 240 pages a poll, 40
    requests a second without end (a trial), past the key's rate limit. Newest first, a listing stops past the oldest
    job the run follows."""
    monkeypatch.setattr(bulk_module, "PAGE", 5)
    client = Client(api, KEYS["bulk"])
    older = [client.create_from_file(write_clip(tmp_path / f"old{index}.mp4", 3, (16, 24)), {"model": "k6-vsr"})["id"]
             for index in range(25)]  # fmt: skip  (no worker serves it here: queued throughout)
    time.sleep(1.1)  # a job's `created_at` is in whole seconds (OpenAI's): the run's are newer
    folder = tmp_path / "in"
    folder.mkdir()
    for index in range(12):  # clips no other test sends: an Idempotency-Key would replay that test's jobs
        write_clip(folder / f"clip{index}.mp4", 5 + index % 3, (24, 16))
    items, _ = plan(str(folder), {"sr_resolution_scale": "2", "model": "lanczos"}, lambda: None)
    sent: list[str] = []
    client.session.hooks["response"].append(lambda response, **_: sent.append(response.request.path_url))
    try:
        bulk = Bulk(client, items, Journal(tmp_path / "journal.sqlite"), lambda: None, "vsrq", wait=True, poll_s=0.2)
        bulk.run()
        assert bulk.counts()["completed"] == len(items), bulk.entries
    finally:
        for job_id in older:  # out of the way of the tests after this one
            requests.post(f"{api}/v1/videos/{job_id}/cancel", headers=auth("bulk"), timeout=30)
    listings = [path for path in sent if path.startswith("/v1/videos?status=queued")]
    rounds = sum("after=" not in path for path in listings)
    assert rounds >= 1 and len(listings) <= 3 * rounds, listings  # the run's 12 at most: 3 pages of 5, not 8


def test_a_deployment_with_shorter_pages_has_each_job_asked_about(api, worker, tmp_path, monkeypatch):
    """A page longer than the deployment's `VSRQ_LIST_LIMIT_MAX` is refused (422): the run went on asking each job."""
    monkeypatch.setattr(bulk_module, "PAGE", 101)  # one more than this API's most
    folder = tmp_path / "in"
    folder.mkdir()
    for index in range(4):
        write_clip(folder / f"clip{index}.mp4", 3 + index, (16, 24))
    items, _ = plan(str(folder), {"sr_resolution_scale": "2", "model": "lanczos"}, lambda: None)
    bulk = Bulk(Client(api, KEYS["bulk"]), items, Journal(tmp_path / "j.sqlite"), lambda: None, "vsrq", wait=True,
                poll_s=0.2)  # fmt: skip
    bulk.run()
    assert bulk.counts()["completed"] == len(items) and bulk.list_cost == float("inf"), bulk.entries


@pytest.mark.parametrize("kind", ["csv", "jsonl"])
def test_a_manifest_carries_per_row_parameters_and_reports_a_bad_file(api, worker, tmp_path, kind):
    write_clip(tmp_path / "a.mp4", 9, (32, 48), audio_codec="aac")
    (tmp_path / "bad.mp4").write_bytes(UNREADABLE)
    seed = {"csv": 11, "jsonl": 12}[kind]  # the two formats make their own jobs
    rows = [
        {"source": "a.mp4", "scale": 2, "seed": seed, "output": "x2/a.mp4"},
        {"source": "a.mp4", "scale": 4, "seed": seed, "output": "x4/a.mp4"},
        {"source": "bad.mp4", "seed": seed},  # same name and bytes in both runs: the seed makes it another job
        {"source": "https://10.0.0.1/clip.mp4"},  # named by URL: the service's SSRF guard refuses a private address
    ]
    manifest = tmp_path / f"manifest.{kind}"
    if kind == "csv":
        with open(manifest, "w", newline="") as file:
            writer = csv.DictWriter(file, ["source", "scale", "seed", "output"])
            writer.writeheader()
            writer.writerows(rows)
    else:
        manifest.write_text("".join(json.dumps(row) + "\n" for row in rows))
    report = tmp_path / f"report.{kind}"
    before = job_count(api)

    result = run_bulk(bulk_command(api, manifest, report, "--wait", "--download", str(tmp_path / "out")))
    assert result.returncode == 1, result.stdout + result.stderr  # some failed
    assert "2 completed, 2 failed" in result.stdout
    assert job_count(api) - before == 3  # the URL is refused at create: no job
    report_list = report_rows(report)
    assert [row["source"] for row in report_list] == [row["source"] for row in rows]  # the manifest's order
    x2, x4, bad, url = report_list
    assert media(Path(x2["output"])) == (96, 64, 9, True) and media(Path(x4["output"])) == (192, 128, 9, True)
    assert Path(x4["output"]) == tmp_path / "out" / "x4" / "a.mp4"
    job = requests.get(f"{api}/v1/videos/{x4['job_id']}", headers=auth("bulk"), timeout=10).json()
    assert (job["params"]["sr_resolution_scale"], job["params"]["seed"]) == (4.0, seed)
    assert job["metadata"] == {"bulk_source": "a.mp4"}
    assert (bad["status"], bad["error_code"]) == ("failed", "input_unreadable"), bad
    assert bad["job_id"] and bad["output"] in ("", None)
    assert (url["status"], url["error_code"]) == ("failed", "unsafe_url"), url
    assert url["job_id"] in ("", None)


def test_a_folder_sends_its_animated_pictures_and_never_reports_another_file_as_an_output(api, worker, tmp_path):
    """A folder of a GIF and a .3g2 (both were left out, unsaid); a rerun with another encoder quality into the same
    download folder kept the first outputs and reported them with the new jobs' sha256."""
    folder, out, report = tmp_path / "in", tmp_path / "out", tmp_path / "report.csv"
    folder.mkdir()
    write_clip(folder / "anim.gif", 13, (32, 48), video_codec="gif", pix_fmt="rgb8")
    write_clip(folder / "phone.3g2", 11, (32, 48))
    (folder / "notes.txt").write_text("not a video")
    (folder / "._phone.3g2").write_bytes(UNREADABLE)  # a macOS resource fork: a video's name, not a video
    command = bulk_command(api, folder, report, "--scale", "2", "--seed", "21", "--wait", "--download", str(out))

    first = run_bulk(command)
    assert first.returncode == 0, first.stdout + first.stderr
    assert "vsrq bulk: left out by their names: 1 .txt, 1 hidden (a manifest sends any file)" in first.stderr
    rows = by_source(report)
    assert sorted(rows) == ["anim.gif", "phone.3g2"]
    kept = {}
    for name, row in rows.items():
        assert (row["status"], row["output"]) == ("completed", str(out / f"{Path(name).stem}-x2.mp4")), row
        kept[name] = hashlib.sha256(Path(row["output"]).read_bytes()).hexdigest()
        assert kept[name] == row["sha256"]
        assert media(Path(row["output"]))[:3] == (96, 64, {"anim.gif": 13, "phone.3g2": 11}[name])

    second = run_bulk([*command, "--set", "output_crf=30"])
    assert second.returncode == 1, second.stdout + second.stderr
    assert "2 completed, 2 not downloaded (another file is where it would go" in second.stdout
    for name, row in by_source(report).items():
        assert (row["status"], row["error_code"], row["output"]) == ("completed", "output_exists", ""), row
        assert row["sha256"] != kept[name]  # the CRF 30 job's
        assert hashlib.sha256((out / f"{Path(name).stem}-x2.mp4").read_bytes()).hexdigest() == kept[name]

    out.rename(tmp_path / "crf18")  # moved away: the next run downloads the CRF 30 outputs, submitting nothing
    third = run_bulk([*command, "--set", "output_crf=30"])
    assert third.returncode == 0, third.stdout + third.stderr
    for name, row in by_source(report).items():
        assert (row["status"], row["error_code"]) == ("completed", ""), row
        assert hashlib.sha256(Path(row["output"]).read_bytes()).hexdigest() == row["sha256"] != kept[name]
        assert media(Path(row["output"]))[:2] == (96, 64)


def test_outputs_downloaded_beside_their_sources_never_clash_and_are_not_sent_again(api, worker, tmp_path):
    """Two videos of one name but their suffixes, downloaded into their own folder: each output is named apart
    (the source's suffix kept), no source is in the way, and a rerun, at any scale, does not take the outputs for new
    videos."""
    folder, report = tmp_path / "shoot", tmp_path / "report.csv"
    folder.mkdir()
    write_clip(folder / "take.mp4", 7, (32, 48))
    write_clip(folder / "take.mkv", 9, (32, 48))
    sources = {path.name: path.read_bytes() for path in folder.iterdir()}
    command = bulk_command(api, folder, report, "--scale", "2", "--wait", "--download", str(folder))
    before = job_count(api)

    first = run_bulk(command)
    assert first.returncode == 0, first.stdout + first.stderr
    rows = by_source(report)
    assert {name: Path(row["output"]).name for name, row in rows.items()} == {
        "take.mp4": "take-mp4-x2.mp4", "take.mkv": "take-mkv-x2.mp4"
    }  # fmt: skip
    assert media(folder / "take-mp4-x2.mp4")[:3] == (96, 64, 7) and media(folder / "take-mkv-x2.mp4")[:3] == (96, 64, 9)
    assert {name: (folder / name).read_bytes() for name in sources} == sources

    second = run_bulk(command)
    assert second.returncode == 0, second.stdout + second.stderr
    assert "left out by their names: 2 earlier outputs" in second.stderr
    assert "2 videos: 2 submitted (2 by an earlier run), 2 completed" in second.stdout
    assert job_count(api) - before == 2

    third = run_bulk([*command, "--scale", "4"])
    assert third.returncode == 0, third.stdout + third.stderr
    assert "left out by their names: 2 earlier outputs" in third.stderr and job_count(api) - before == 4
    assert sorted(path.name for path in folder.iterdir()) == [
        "take-mkv-x2.mp4", "take-mkv-x4.mp4", "take-mp4-x2.mp4", "take-mp4-x4.mp4", "take.mkv", "take.mp4"
    ]  # fmt: skip


def test_a_refused_field_is_named_in_the_report_and_no_key_is_asked_for_until_the_api_does(api, worker, tmp_path):
    (tmp_path / "in").mkdir()
    write_clip(tmp_path / "in" / "a.mp4", 7, (32, 48))
    report = tmp_path / "report.csv"
    command = bulk_command(api, tmp_path / "in", report, "--set", "output_crf=60")
    refused = run_bulk(command)
    assert refused.returncode == 1, refused.stdout + refused.stderr
    [row] = report_rows(report)
    assert (row["status"], row["error_code"]) == ("failed", "invalid_request")
    # x264 would have capped it at 51 without a word; the field and its range are in the report, not "see `errors`"
    assert "output_crf: must be 0 to 51 for h264 (lower is better), got 60" in row["error_message"], row

    anonymous = {name: value for name, value in bulk_env().items() if name != "VSRQ_TOKEN"}
    asked = run_bulk(command, env=anonymous | {"XDG_CONFIG_HOME": str(tmp_path)})  # no dev.json either
    assert asked.returncode == 2
    assert "unauthorized" in asked.stderr and "pass --token or set VSRQ_TOKEN" in asked.stderr, asked.stderr


def test_s3_sources_are_referenced_in_our_bucket_and_copied_from_others(api, worker, stack, s3, tmp_path):
    batch = os.urandom(4).hex()
    clips = {name: write_clip(tmp_path / name, frames, (32, 48), audio_codec="aac").read_bytes()
             for name, frames in (("r0.mp4", 7), ("r1.mp4", 8), ("c0.mp4", 9), ("c1.mp4", 10))}  # fmt: skip
    client = stack.s3_client()
    other = f"elsewhere-{batch}"
    client.create_bucket(Bucket=other)
    ours = f"uploads/bulk/{batch}/"
    for name in ("r0.mp4", "r1.mp4"):
        client.put_object(Bucket=stack.bucket, Key=ours + name, Body=clips[name])
    client.put_object(Bucket=stack.bucket, Key=ours + "readme.txt", Body=b"skipped")
    client.put_object(Bucket=stack.bucket, Key=ours + "r1-x2.mp4", Body=clips["r1.mp4"])  # as if an earlier output
    client.put_object(Bucket=other, Key="in/c0.mp4", Body=clips["c0.mp4"])
    client.put_object(Bucket=stack.bucket, Key=f"incoming/{batch}/c1.mp4", Body=clips["c1.mp4"])  # not an upload
    env = bulk_env(
        AWS_ENDPOINT_URL=stack.s3_endpoint, AWS_ACCESS_KEY_ID=stack.access_key,
        AWS_SECRET_ACCESS_KEY=stack.secret_key, AWS_DEFAULT_REGION="us-east-1",
    )  # fmt: skip
    before = job_count(api)

    prefix = run_bulk(bulk_command(api, f"s3://{stack.bucket}/{ours}", tmp_path / "prefix.csv", "--scale", "2",
                                   "--wait", "--download", str(tmp_path / "out")), env)  # fmt: skip
    assert prefix.returncode == 0, prefix.stdout + prefix.stderr
    assert "left out by their names: 1 .txt, 1 earlier outputs" in prefix.stderr
    rows = by_source(tmp_path / "prefix.csv")
    assert sorted(rows) == [f"s3://{stack.bucket}/{ours}r0.mp4", f"s3://{stack.bucket}/{ours}r1.mp4"]
    for source, row in rows.items():
        job = requests.get(f"{api}/v1/videos/{row['job_id']}", headers=auth("bulk"), timeout=10).json()
        # referenced: the API read no byte of it; the worker hashed what it downloaded
        digest = hashlib.sha256(clips[source.rsplit("/", 1)[1]]).hexdigest()
        assert job["status"] == "completed" and job["input"]["sha256"] == digest, job
        assert media(Path(row["output"]))[:2] == (96, 64)
        assert Path(row["output"]).name == source.rsplit("/", 1)[1].replace(".mp4", "-x2.mp4")
    assert s3.exists(ours + "r0.mp4")  # a referenced upload is the caller's: no job deletes it

    manifest = tmp_path / "copies.csv"
    manifest.write_text(f"source\ns3://{other}/in/c0.mp4\ns3://{stack.bucket}/incoming/{batch}/c1.mp4\n")
    copies = run_bulk(bulk_command(api, manifest, tmp_path / "copies-report.csv", "--scale", "2", "--wait"), env)
    assert copies.returncode == 0, copies.stdout + copies.stderr
    for source, row in by_source(tmp_path / "copies-report.csv").items():
        job = requests.get(f"{api}/v1/videos/{row['job_id']}", headers=auth("bulk"), timeout=10).json()
        name = source.rsplit("/", 1)[1]
        assert job["status"] == "completed" and job["input"]["filename"] == name, job
        assert job["input"]["sha256"] == hashlib.sha256(clips[name]).hexdigest()  # copied through an upload
    assert job_count(api) - before == 4


def test_the_client_maps_problems_and_replays_under_an_idempotency_key(api, clip, tmp_path):
    path = tmp_path / "clip.mp4"
    path.write_bytes(clip)
    client = Client(api, KEYS["bulk"], retry_for_s=5)
    fields = {"model": "lanczos", "sr_resolution_scale": "2"}
    key = f"test-{os.urandom(6).hex()}"
    first = client.create_from_file(path, fields, idempotency_key=key)
    assert client.create_from_file(path, fields, idempotency_key=key)["id"] == first["id"]
    assert client.get(first["id"])["id"] == first["id"]
    with pytest.raises(ApiProblem) as refused:  # a 4xx is the caller's to fix: raised at once, never retried
        client.create_from_file(path, {**fields, "sr_resolution_scale": "3"})
    assert (refused.value.status, refused.value.code, refused.value.transient) == (422, "invalid_request", False)
    with pytest.raises(ApiProblem) as missing:
        client.get("video_does_not_exist")
    assert (missing.value.status, missing.value.code) == (404, "job_not_found")


def test_an_api_that_is_not_there_is_said_in_seconds(tmp_path):
    """It was retried for 5 minutes a request, silently (a `vsrq dev` killed hard leaves no API behind)."""
    (tmp_path / "in").mkdir()
    write_clip(tmp_path / "in" / "a.mp4", 5, (32, 48))
    with socket.socket() as probe:  # a port nothing listens on once closed
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    started = time.monotonic()
    result = run_bulk(bulk_command(url, tmp_path / "in", tmp_path / "report.csv"))
    assert result.returncode == 1 and time.monotonic() - started < 60, result.stderr
    assert f"vsrq: bulk: api_unreachable: {url} does not answer (Connection refused): is the API up?" in result.stderr
    assert by_source(tmp_path / "report.csv")["a.mp4"]["status"] == "pending"  # a rerun carries on


def test_retry_after_reads_seconds_and_dates():
    assert retry_after("7") == 7.0
    assert 25 <= retry_after(formatdate(time.time() + 30, usegmt=True)) <= 30
    assert retry_after(formatdate(time.time() - 30, usegmt=True)) == 0.0
    assert retry_after(None) is None and retry_after("soon") is None


def test_a_manifest_output_outside_the_download_folder_is_refused_on_any_system(tmp_path):
    write_clip(tmp_path / "a.mp4", 3, (32, 48))
    for output in ("/etc/a.mp4", "../a.mp4", "C:\\a.mp4", "C:a.mp4", "x\\..\\..\\a.mp4", "\\\\host\\share\\a.mp4"):
        manifest = tmp_path / "m.jsonl"
        manifest.write_text(json.dumps({"source": "a.mp4", "output": output}) + "\n")
        with pytest.raises(BulkError) as refused:
            plan(str(manifest), {}, s3=lambda: None)
        assert refused.value.code == "bad_output", output
    manifest.write_text(json.dumps({"source": "a.mp4", "output": "x2/a b.mp4"}) + "\n")
    assert [item.output for item in plan(str(manifest), {}, s3=lambda: None)[0]] == ["x2/a b.mp4"]


def test_a_folder_s_downloads_and_look_alike_names_are_told_apart(tmp_path):
    """Outputs downloaded into a folder below the sources are never sent again, at any scale; a video whose name only
    looks like an output (`movie-x264.mp4` beside `movie.mkv`, `talk-x2.mp4` beside `talk.srt`) is sent."""
    folder = tmp_path / "in"
    for name in ("clip.mov", "out/clip-x2.mp4", "out/clip-x4.mp4", "movie.mkv", "movie-x264.mp4", "talk-x2.mp4"):
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        write_clip(folder / name, 3, (32, 48))
    (folder / "talk.srt").write_text("1\n00:00:00,000 --> 00:00:01,000\nhi\n")
    items, left_out = plan(str(folder), {"sr_resolution_scale": "4"}, s3=lambda: None, download=folder / "out")
    assert sorted(item.source for item in items) == ["clip.mov", "movie-x264.mp4", "movie.mkv", "talk-x2.mp4"]
    assert left_out == {"in the download folder": 2, ".srt": 1}


def test_a_run_that_found_its_api_in_dev_json_follows_its_stack_to_another_port(api, worker, tmp_path, monkeypatch):
    """`vsrq dev` stopped and started again on another port mid-run (a chaos trial): `vsrq bulk --wait`, which had
    found its API in dev.json, asked the old port for its 5 minutes of retries and gave up (`api_unreachable`) while
    dev.json named the running stack. It looks in dev.json again when its API stops answering, and carries on."""
    from client import devstate
    from tests.reliability.processes import Partition

    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    (tmp_path / "in").mkdir()
    for name in ("a.mp4", "b.mp4"):
        write_clip(tmp_path / "in" / name, 5, (32, 48))
    plain = requests.utils.urlparse(api)
    old = Partition((plain.hostname, plain.port))  # the stack's first port, in front of the API
    old.refuse(b"POST /v1/videos")  # it goes down as the run's first create arrives
    state = {"pid": os.getpid(), "url": f"http://127.0.0.1:{old.port}", "token": KEYS["bulk"], "dir": "/stack/a"}
    devstate.write(tmp_path / "dev", state)
    command = [sys.executable, "-m", "client.cli", "-v", "bulk", str(tmp_path / "in"), "--report",
               str(tmp_path / "report.csv"), "--model", "lanczos", "--poll", "0.2", "--wait"]  # fmt: skip
    env = {key: value for key, value in bulk_env(XDG_CONFIG_HOME=str(tmp_path / "config")).items()
           if key not in ("VSRQ_API_URL", "VSRQ_TOKEN")}  # fmt: skip
    with open(tmp_path / "bulk.log", "w") as log:
        run = subprocess.Popen(command, env=env, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, text=True)
    try:
        deadline = time.monotonic() + 30
        while old.refused == 0:
            assert time.monotonic() < deadline and run.poll() is None
            time.sleep(0.05)
        old.close()  # the first port answers nothing any more
        devstate.write(tmp_path / "dev", {**state, "url": api, "dir": "/stack/b"})  # another stack: not followed
        time.sleep(3)
        assert run.poll() is None and "moved" not in (tmp_path / "bulk.log").read_text()
        devstate.write(tmp_path / "dev", {**state, "url": api})  # its own, started again on another port
        run.wait(timeout=90)
    finally:
        run.kill()
        old.close()
    output = (tmp_path / "bulk.log").read_text()
    assert run.returncode == 0, output
    assert f"the API moved from http://127.0.0.1:{old.port} to {api}" in output
    assert [row["status"] for row in report_rows(tmp_path / "report.csv")] == ["completed", "completed"]
