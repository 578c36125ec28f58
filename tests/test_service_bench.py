"""bench/service.py on the CPU: the real stack (Redis, SeaweedFS, the API under gunicorn, a Celery worker on the tiny
checkpoint, started twice with a kill -9 between, then once with each job's tail inline and once overlapped), jobs
through the API, the diffusers reference; every figure the GPU run reports comes out, with values that make sense
(not the targets: a CPU measures nothing)."""

from __future__ import annotations

import json

from bench.service import main


def test_the_service_bench_reports_every_figure(tmp_path):
    out = tmp_path / "service.jsonl"
    phases = "start,solo,overlap,reference"
    bench = ["--tiny", "--blobs", "s3", "--jobs", "3", "--phases", phases, "--dir", str(tmp_path / "bench")]
    bench.append("--importtime")
    main([*bench, "--out", str(out)])
    records = [json.loads(line) for line in out.read_text().splitlines()]
    by_phase: dict[str, list[dict]] = {}
    for record in records:
        by_phase.setdefault(record["phase"], []).append(record)

    cold, warm = by_phase["worker_start"][:2]  # then the overlap phase's two
    assert (cold["cache"], warm["cache"]) == ("cold", "warm (after kill -9)")
    assert 0 < cold["ready_s"] < 300 and 0 < warm["ready_s"] < 300 and warm["cold_ready_s"] == cold["ready_s"]
    for start in (cold, warm):  # the worker logs each step of its start, in seconds after its process started
        timeline = start["timeline_s"]
        steps = ("first_line", "code_imported", "weights_loaded", "engine_built", "model_ready", "ready")
        assert 0 < timeline["first_line"] and [timeline[step] for step in steps] == sorted(timeline.values()), start
        assert timeline["ready"] <= start["ready_s"] + 0.1, start  # the log's tenths round up by 0.05 at most
        imports = start["imports_s"]  # the worker's imports by package (`-X importtime`), dearest first
        assert {"torch", "celery", "all"} <= imports.keys() and 0 < imports["torch"] < imports["all"], start

    solo = by_phase["solo"]
    assert [job["job"] for job in solo] == ["W2", "W2", "W1"]
    # the same clip and seed twice: the same bytes (what lets two trees' outputs be compared on the GPU)
    assert solo[0]["output_sha256"] == solo[1]["output_sha256"] != solo[2]["output_sha256"], solo
    for job in solo + by_phase["queue_job"]:
        assert job["output_ok"], job  # downloaded, read back: twice the size, every frame
        assert 0 < job["engine_s"] < job["leased_to_completed_s"] <= job["post_to_completed_s"], job
        assert job["overhead_s"] == round(job["post_to_completed_s"] - job["engine_s"], 3)
        assert set(job["split_s"]) == {"lease", "download", "upscale_not_engine", "tail_turn", "upload_complete"}
        assert set(job["head_s"]) == {"fetched", "windows_kept", "probed", "writer_open", "first_window_decoded", "engine"}
        assert all(value >= 0 for value in job["split_s"].values()), job
        assert sum(job["split_s"].values()) <= job["attempt_overhead_s"] + 0.01, job
        assert job["graphs_built"] == 0  # nothing compiles on a CPU
        # the engine's span less its seconds, split: input frames made tensors, each window committed to the store
        engine_span = job["head_s"]["engine"][1] - job["head_s"]["engine"][0]
        assert set(job["windows_s"]) == {"frames_in", "kept"} and job["windows_s"]["kept"] >= 0, job  # a wait, ~0 now
        assert sum(job["windows_s"].values()) <= engine_span - job["engine_s"] + 0.01, job
        assert job["windows"] == 1 and job["kept_upload_s"] >= 0 and job["tail_s"]["kept_join"] >= 0, job
    # one window each: the last window is not kept where no other job's tail is held as the job's engine ends (alone,
    # tails inline, the first of a queue), so nothing is uploaded nor waited for; behind a tail still held then it is
    inline_queue, overlapped_queue = by_phase["queue_job"][:3], by_phase["queue_job"][3:]
    assert all(job["kept_upload_s"] == 0 for job in solo + inline_queue + overlapped_queue[:1])
    assert solo[2]["tiles"] > solo[0]["tiles"]  # W1 tiles, W2 fits one

    [new_size] = by_phase["first_job_of_a_new_size"]
    assert new_size["job"] == "W2" and new_size["ratio"] == round(new_size["first_s"] / new_size["hot_s"], 3)

    inline, overlapped = by_phase["queue"]
    assert (inline["overlap_tail"], overlapped["overlap_tail"]) == (False, True)
    assert (inline["tails"], overlapped["tails"]) == ({"inline": 3}, {"overlapped": 3})  # the setting took
    for queue in (inline, overlapped):
        assert queue["jobs"] == {"W2": 1, "portrait": 1, "square": 1}
        assert 0 < queue["engine_busy_fraction"] <= 1 and queue["engine_s"] < queue["wall_s"] <= queue["client_wall_s"]
        assert abs(queue["gpu_idle_per_job_s"] - (queue["wall_s"] - queue["engine_s"]) / 3) < 0.01
        assert len(queue["engine_gaps_s"]) == 2 and all(gap > 0 for gap in queue["engine_gaps_s"])  # one at a time
        assert queue["gpu_sampled"] is None  # no nvidia-smi here
        causes = {"lease", "download", "upscale_not_engine", "tail_turn", "upload_complete", "between_jobs"}
        assert set(queue["idle_s_by_cause"]) == causes
        assert queue["megapixel_frames_per_gpu_hour"] > 0
        stability = queue["stability"]
        assert stability["graphs_rebuilt_for_a_seen_shape"] == [] and stability["jobs"] == 3
        assert 0.5 < stability["last_over_first_peak"]["rss_gib"] < 2
        # threads: the idle worker's before the queue, and after it once settled, can be no more than those alive
        # while the first job ended (the next one's at work too): threads the jobs left behind would show as more
        first, last = stability["threads_first_last"]
        assert 0 < stability["threads_idle_before"] <= last <= first, stability
    assert inline["idle_s_by_cause"]["between_jobs"] > 0  # inline: the next job is leased once this one completed
    assert overlapped["idle_s_by_cause"]["between_jobs"] < 0  # overlapped: leased while this one's tail ran
    [overlap] = by_phase["overlap"]
    assert overlap["inline"]["wall_s"] == inline["wall_s"] and overlap["overlapped"]["wall_s"] == overlapped["wall_s"]
    assert overlap["throughput_ratio"] == round(
        overlapped["megapixel_frames_per_gpu_hour"] / inline["megapixel_frames_per_gpu_hour"], 3
    )

    reference = by_phase["reference"][0]
    assert [clip["job"] for clip in by_phase["reference_clip"]] == ["W2", "portrait", "square"]  # cheapest first
    assert reference["skipped_for_time"] == [] and reference["reference_s"] > 0 and reference["vsrq_over_reference"] > 0
    assert reference["vsrq_over_reference_on_clips_it_ran"] > 0


def test_the_world_phase_upscales_real_files_and_recovers_a_killed_job(tmp_path):
    """bench/service.py's world phase on the CPU, its worker on the lanczos model (the diffusion model's tiles are too
    many on a CPU for files this size): a real file (portrait MPEG-4 Part 2 and AAC in MP4, two windows;
    the smallest corpus file of more than one window, for CI's time) through the real stack twice, then once more
    with its worker killed once it kept a window."""
    out = tmp_path / "world.jsonl"
    name = "hachoir-quicktime.mp4"
    main(["--checkpoint", "lanczos", "--devices", "cpu", "--phases", "world", "--world", name, "--world-kill",
          name, "--lease-s", "6", "--dir", str(tmp_path / "bench"), "--out", str(out)])  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    jobs = [record for record in records if record["phase"] == "world_job"]
    assert [(job["round"], job["job"]) for job in jobs] == [("first", name), ("hot", name)]
    for job in jobs:  # read back by PyAV: twice the stored size, every frame, the sound kept
        assert job["status"] == "completed" and job["output_ok"], job
    assert jobs[0]["input"] == {"size": [190, 240], "frames": 149, "sound": True} and jobs[0]["windows"] == 2
    [world] = [record for record in records if record["phase"] == "world"]
    assert (world["completed_both"], world["outputs_ok"], world["same_bytes_twice"]) == (1, 1, 1), world
    assert set(world["first_over_hot_s"]) == {name} and world["failed"] == {}
    [kill] = [record for record in records if record["phase"] == "world_kill"]
    # the second attempt restored what the first kept, and made the uninterrupted run's bytes
    assert (kill["status"], kill["attempt"], kill["output_ok"]) == ("completed", 2, True), kill
    assert kill["restored"] >= kill["windows_kept_at_kill"] >= 1, kill  # a window's marker is written last
    assert kill["same_bytes_as_uninterrupted"], kill


def test_a_mixed_queue_alternates_the_tiers_and_lossless_keeps_its_bytes(tmp_path):
    """`--quality mixed`: each clip's jobs in turn lossless, high, lossless; the worker swaps the levers in and out
    job by job, so the W2 job after a `high` one gives the first W2's bytes, and `high` other ones."""
    out = tmp_path / "mixed.jsonl"
    main(["--tiny", "--jobs", "9", "--phases", "queue", "--quality", "mixed", "--dir", str(tmp_path / "bench"),
          "--out", str(out)])  # fmt: skip
    records = [json.loads(line) for line in out.read_text().splitlines()]
    jobs = [record for record in records if record["phase"] == "queue_job"]
    [queue] = [record for record in records if record["phase"] == "queue"]
    assert [(job["job"], job["quality"]) for job in jobs if job["job"] == "W2"] == [
        ("W2", "lossless"), ("W2", "high"), ("W2", "lossless")
    ]
    assert all(job["output_ok"] for job in jobs) and queue["tiers"] == {"lossless": 7, "high": 2}
    # each job says how its levers ran: none at lossless; on the CPU, FP8 attention emulated
    assert {job["levers"].get("fp8_attention") for job in jobs} == {None, "fp8_emulated"}
    w2 = [job["output_sha256"] for job in jobs if job["job"] == "W2"]
    assert w2[0] == w2[2] != w2[1] and queue["lossless_same_bytes"] is True
    starts = [record for record in records if record["phase"] == "worker_start"]
    assert queue["quality"] == "mixed" and {start["quality"] for start in starts} == {"lossless"}
