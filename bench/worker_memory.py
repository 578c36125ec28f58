"""A real worker's host memory over repeated jobs, on the CPU (the lanczos model: its tail is the GPU worker's):
Redis, local blobs, the API under gunicorn and one solo Celery worker, as bench/service.py starts them.

    python bench/worker_memory.py --groups '1920x1080x9|1920x1080x9,384x256x33,1920x1080x9|...' --out r.jsonl

`--groups`: clips as WIDTHxHEIGHTxFRAMES (each upscaled x2), ',' between the jobs of a group (submitted at once, so
each job's tail overlaps the next job's head and engine), '|' between groups (each submitted once the one before has
ended). After each group, once its last tail has ended (the worker idle): the worker's resident memory read from
/proc; after each job: its /metrics gauge (`vsrq_worker_resident_bytes`, set in the job's tail, the next job running);
over all the jobs: the worker's CPU seconds and minor page faults.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench.service import Jobs, Service  # noqa: E402


def resident_gib(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return next(int(line.split()[1]) for line in status.splitlines() if line.startswith("VmRSS:")) / 2**20


def cpu_and_faults(pid: int) -> dict[str, float]:
    """The worker's CPU seconds (user, system) and minor page faults so far (/proc/PID/stat): what a block mapped
    afresh costs (its pages faulted in and zeroed)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    tick = os.sysconf("SC_CLK_TCK")
    return {"user_s": int(fields[11]) / tick, "system_s": int(fields[12]) / tick, "minor_faults": int(fields[7])}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--groups", required=True)
    parser.add_argument("--dir", type=Path, help="where the stack, logs and clips go (default var/worker-memory-PID)")
    parser.add_argument("--out", type=Path, default=Path("worker-memory.jsonl"))
    parser.add_argument("--job-timeout-s", type=float, default=900)
    args = parser.parse_args(argv)
    from worker.media.synthetic import write_clip

    groups = [group.split(",") for group in args.groups.split("|")]
    root = Path(args.dir or ROOT / "var" / f"worker-memory-{os.getpid()}").resolve()
    service = Service(root, Path("lanczos"), "cpu", "local", tiny=False, lease_s=120)
    service.start()
    try:
        service.start_worker(300)
        (root / "clips").mkdir(parents=True, exist_ok=True)
        clips = {}
        for name in dict.fromkeys(name for group in groups for name in group):
            width, height, frames = map(int, name.split("x"))
            clips[name] = write_clip(root / "clips" / f"{name}.mp4", frames, (height, width), audio_codec="aac")
        jobs = Jobs(service, clips, tiny=False)
        pid = service.worker.pid

        def ended() -> float:  # attempts the worker has counted: a tail counts its own last
            return sum(v for k, v in service.metrics().items() if k.startswith("vsrq_worker_attempts_total"))

        done, idle, gauge, started = 0, [], [], time.monotonic()
        ready, cpu_ready = resident_gib(pid), cpu_and_faults(pid)
        for group in groups:
            submitted = [(name, jobs.submit(name)[0]) for name in group]
            for name, job_id in submitted:
                job, _ = jobs.wait(job_id, args.job_timeout_s)
                if job["status"] != "completed":
                    raise RuntimeError(f"{name}: {job['status']} {job.get('error')}")
                gauge.append(round(service.metrics().get("vsrq_worker_resident_bytes", 0) / 2**30, 3))
            done += len(group)
            while ended() < done:
                time.sleep(0.05)
            idle.append(round(resident_gib(pid), 3))
        cpu = {key: round(value - cpu_ready[key], 2) for key, value in cpu_and_faults(pid).items()}
        commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True)
        record = {
            "phase": "worker_memory",
            "commit": commit.stdout.strip(),
            "groups": args.groups,
            "malloc_mmap_threshold_env": os.environ.get("MALLOC_MMAP_THRESHOLD_"),  # glibc's, set by hand
            "rss_ready_gib": round(ready, 3),
            "rss_idle_after_each_group_gib": idle,
            "idle_last_over_first": round(idle[-1] / idle[0], 4),
            "rss_gauge_after_each_job_gib": gauge,
            "seconds": round(time.monotonic() - started, 1),
            "worker_cpu_over_the_jobs": cpu,  # from ready to the last tail's end
            "date": time.strftime("%Y-%m-%d %H:%M"),
        }
        line = json.dumps(record)
        print(line, flush=True)
        with args.out.open("a") as file:
            file.write(line + "\n")
    finally:
        service.stop()


if __name__ == "__main__":
    main()
