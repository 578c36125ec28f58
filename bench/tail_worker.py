"""A job's tail through the worker's own task code, on the CPU: this process leases a job and runs its head and its
tail inline (`worker.tasks._head`, then `_finish`: the flush, the check, the previews, the uploads, `complete`)
against Redis started here and SeaweedFS (`--blobs s3`) or a local blob store, lanczos 2x on bench/tail.py's noisy
clip. One JSON line per job: the tail's wall seconds (`_finish`, to `complete` and the cleanup after it), what of it
came after the encoder's flush, and the `run` event's `tail_s` (with `tail_at_s` where the code reports it) and
`kept_upload_s`.

    python bench/tail_worker.py --size 384x256 --frames 33 --runs 6                 # W2's output, one window
    python bench/tail_worker.py --size 384x256 --frames 33 --window 17 --runs 6     # two windows (and their overlap)
    python bench/tail_worker.py --size 384x256 --frames 33 --runs 6 --blobs local
"""

from __future__ import annotations

import argparse
import io
import os
import sys
import tempfile
from pathlib import Path
from time import monotonic

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: `bench` the package, not bench.py

from bench.lines import emit  # noqa: E402
from bench.tail import noisy_clip  # noqa: E402
from infra.stack import Stack  # noqa: E402


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--size", default="384x256", help="the input, WIDTHxHEIGHT (the output is twice)")
    parser.add_argument("--frames", type=int, default=33)
    parser.add_argument("--window", type=int, help="frames per window (1 + 4k): unset, the worker's (121)")
    parser.add_argument("--overlap", type=int, default=4, help="frames two windows share, with --window")
    parser.add_argument("--runs", type=int, default=4)
    parser.add_argument("--blobs", choices=("s3", "local"), default="s3")
    parser.add_argument("--label", default="")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args(argv)
    width, height = map(int, args.size.split("x"))
    with tempfile.TemporaryDirectory(prefix="vsrq-tail-worker-") as directory:
        root = Path(directory)
        with Stack(root / "stack", s3=args.blobs == "s3") as stack:
            env = {**stack.env(), "VSRQ_WORKER_MODEL": "lanczos", "VSRQ_WORKER_DEVICES": "cpu"}
            env |= {"VSRQ_WORKER_PREFETCH_INPUT": "false", "VSRQ_LOCAL_BLOB_DIR": str(root / "blobs")}
            if args.window:
                env |= {"VSRQ_WORKER_WINDOW": str(args.window), "VSRQ_WORKER_WINDOW_OVERLAP": str(args.overlap)}
            os.environ.update(env)  # read once, by `worker.service`, on first use
            run_jobs(args, noisy_clip(root / "input.mp4", width, height, args.frames))


def run_jobs(args: argparse.Namespace, source: Path) -> None:
    from api.schemas import UpscaleParams
    from storage.blobs import attempt_output_key, new_upload_id, upload_key
    from storage.jobs import InputInfo
    from worker import service, tasks
    from worker.kept_windows import KeptPrefix

    jobs, blobs = service.jobs(), service.blobs()
    for number in range(args.runs):
        key = upload_key("bench", new_upload_id())
        stored = blobs.put(key, io.BytesIO(source.read_bytes()))
        upload = InputInfo(key=key, bytes=stored.size, sha256=stored.sha256, upload_id=key.rsplit("/", 1)[1],
                           owned_by_job=True)  # fmt: skip
        params = UpscaleParams(sr_resolution_scale=2, seed=7).model_dump()
        job = jobs.create(owner="bench", model="lanczos", queue="vsrq.bench", params=params, input=upload)
        lease = jobs.lease(job.id, "bench/1", lease_s=600)
        job, output_key = lease.job(), attempt_output_key(job.id, lease.attempt, lease.token)
        prefix = KeptPrefix(lease.attempt)
        with tasks._attempt(job, lease, output_key, prefix):
            tail = tasks._head(job, lease, output_key, prefix)
        began = monotonic()
        tasks._finish(tail)
        wall = monotonic() - began
        done = jobs.require(job.id)
        assert done.status == "completed", done
        [run] = [event.detail for event in jobs.events(job.id) if event.type == "run"]
        steps = run["tail_s"]
        line = {
            "label": args.label, "run": number, "blobs": args.blobs, "windows": run["windows"],
            "output": f"{done.output.media.width}x{done.output.media.height}x{done.output.media.frames}",
            "bytes": done.output.bytes, "tail_wall_s": round(wall, 3),
            "after_flush_s": round(wall - steps["flush"], 3), "tail_s": steps,
            "kept_upload_s": run["kept_upload_s"],
        } | ({"tail_at_s": run["tail_at_s"]} if "tail_at_s" in run else {})  # fmt: skip
        emit(line, args.out)


if __name__ == "__main__":
    main()
