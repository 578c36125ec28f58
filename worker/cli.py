"""`vsrq`: upscale a video, probe one, write a tiny checkpoint, run the demo.

Exit codes: 0 done, 2 bad input or arguments, 3 model not found, 130 cancelled, 1 internal error.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import logging
import sys
from pathlib import Path

from tqdm import tqdm

from worker.media.errors import BAD_INPUT_CODES

EXIT_CODES = {"invalid_request": 2, "model_not_found": 3, "cancelled": 130} | dict.fromkeys(BAD_INPUT_CODES, 2)
log = logging.getLogger("vsrq")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    from worker.sr.errors import SRError

    try:
        return args.run(args)
    except SRError as error:
        print(f"vsrq: {error.code}: {error.message}", file=sys.stderr)
        return EXIT_CODES.get(error.code, 1)
    except KeyboardInterrupt:
        print("vsrq: cancelled", file=sys.stderr)
        return EXIT_CODES["cancelled"]
    except Exception as error:  # a bug: say so in one line; -v shows where
        log.info("internal error", exc_info=True)
        print(f"vsrq: internal_error: {type(error).__name__}: {error} (run with -v for details)", file=sys.stderr)
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vsrq", description="Video super-resolution with Kandinsky 6 VSR.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what loads where; show internal errors in full")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    upscale = commands.add_parser("upscale", help="upscale a video file to an MP4 (every frame, the audio, the subtitles)")
    upscale.add_argument("input", type=Path)
    upscale.add_argument("-o", "--output", type=Path, required=True)
    upscale.add_argument("--scale", type=float, choices=(2, 2.25, 4), default=2)
    upscale.add_argument("--model", required=True, help="checkpoint directory, hub id, or 'lanczos'")
    upscale.add_argument("--devices", default="cpu", help="comma-separated, e.g. cuda:0,cuda:1")
    upscale.add_argument("--seed", type=int, default=42)
    upscale.add_argument("--steps", type=int, default=2, help="denoising steps (2 for the distilled checkpoint)")
    upscale.add_argument("--tiles-batch-size", type=int, default=1)
    upscale.add_argument("--min-overlap", type=float, default=0.2, help="least share of a tile its neighbours overlap")
    upscale.add_argument("--target-resolution", help="then downscale to hd, fullhd, 2k or WxH (never upscales)")
    upscale.add_argument("--resize-mode", choices=("fit", "exact"), default="fit", help="fit keeps the aspect ratio")
    upscale.add_argument("--codec", choices=("h264", "hevc", "av1"), default="h264")
    upscale.add_argument("--crf", type=int, default=18, help="quality: lower is better and bigger (the codec's scale)")
    upscale.add_argument("--preset", default="medium", help="encoder speed preset (x264 names; AV1 maps them)")
    upscale.add_argument("--window", type=int, default=121, help="frames per temporal window (1 + 4k)")
    upscale.add_argument("--window-overlap", type=int, default=16, help="frames neighbouring windows crossfade over")
    upscale.add_argument("--keep-windows", type=Path, metavar="DIR", help="keep finished windows in DIR: rerunning resumes")
    _limit_arguments(upscale)
    upscale.set_defaults(run=_upscale)

    probe = commands.add_parser("probe", help="what vsrq sees in a file, and what upscaling it would do")
    probe.add_argument("input", type=Path)
    probe.add_argument("--scale", type=float, choices=(2, 2.25, 4), default=2)
    probe.add_argument("--window", type=int, default=121)
    probe.add_argument("--window-overlap", type=int, default=16)
    probe.add_argument("--json", action="store_true", help="machine-readable")
    _limit_arguments(probe)
    probe.set_defaults(run=_probe)

    checkpoint = commands.add_parser("checkpoint", help="checkpoint tools")
    checkpoint_commands = checkpoint.add_subparsers(required=True, metavar="KIND")
    tiny = checkpoint_commands.add_parser("tiny", help="write a tiny random checkpoint (tests, demos)")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--variant", choices=("piflow", "flowmatch"), default="piflow")
    tiny.add_argument("--no-latent-upscaler", dest="latent_upscaler", action="store_false")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_tiny)

    demo = commands.add_parser("demo", help="run the main job end to end on the embedded stack (CPU, tiny checkpoint)")
    demo.add_argument("--dir", type=Path, default=Path("demo"))
    demo.set_defaults(run=_demo)

    dev = commands.add_parser("dev", help="run the embedded stack until Ctrl-C: Redis, SeaweedFS, API, worker, reaper")
    dev.add_argument("--dir", type=Path, default=Path("var/dev"))
    dev.add_argument("--model", default="lanczos", help="the worker's checkpoint directory, hub id, or 'lanczos'")
    dev.add_argument("--devices", default="cpu")
    dev.add_argument("--port", type=int, default=8000)
    dev.set_defaults(run=_dev)

    status = commands.add_parser("status", help="the service now: queue depths, workers and their jobs, jobs by status")
    status.add_argument("--json", action="store_true", help="machine-readable")
    status.set_defaults(run=_status)

    bulk = commands.add_parser("bulk", help="send a folder, a CSV/JSONL manifest or an s3:// prefix to the API")
    bulk.add_argument("source", help="a folder (recursively), a .csv or .jsonl manifest, or s3://bucket/prefix")
    bulk.add_argument("--api-url", help="the API's base URL (default: $VSRQ_API_URL, else http://127.0.0.1:8000)")
    bulk.add_argument("--token", help="API key (default: $VSRQ_TOKEN)")
    bulk.add_argument("--scale", choices=("2", "2.25", "4"), help="for every video (a manifest row may say otherwise)")
    bulk.add_argument("--seed")
    bulk.add_argument("--model", help="a model the API serves (default: its first)")
    bulk.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any other create field")
    bulk.add_argument("--concurrency", type=int, default=4, help="requests in flight: uploads, polls, downloads")
    bulk.add_argument("--wait", action="store_true", help="poll until every job has ended")
    bulk.add_argument("--poll", type=float, default=2.0, metavar="SECONDS", help="between polls of one job")
    bulk.add_argument("--download", type=Path, metavar="DIR", help="fetch outputs into DIR (existing files are kept)")
    bulk.add_argument("--report", type=Path, default=Path("bulk-report.csv"), help=".csv or .jsonl (journal beside)")
    bulk.add_argument("--s3-endpoint-url", help="for s3:// sources (default: $AWS_ENDPOINT_URL, else AWS)")
    bulk.add_argument("--service-bucket", help="its uploads are referenced (default: $VSRQ_S3_BUCKET, vsrq)")
    bulk.set_defaults(run=_bulk)
    return parser


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    from worker.media.limits import Limits

    default = Limits()
    limits = parser.add_argument_group("input limits (refused before any work)")
    limits.add_argument("--max-pixels", type=int, default=default.max_pixels, help="per frame (default: %(default)s)")
    limits.add_argument("--max-frames", type=int, default=default.max_frames, help="(default: %(default)s)")
    limits.add_argument("--max-seconds", type=float, default=default.max_seconds, help="(default: %(default)s)")
    limits.add_argument("--max-bytes", type=int, default=default.max_bytes, help="file size (default: %(default)s)")
    limits.add_argument("--min-frames", type=int, default=default.min_frames, help="(default: %(default)s)")


def _limits(args: argparse.Namespace):
    from worker.media.limits import Limits

    return Limits(args.max_pixels, args.max_frames, args.max_seconds, args.max_bytes, args.min_frames)


def _upscale(args: argparse.Namespace) -> int:
    from worker.media.resize import Target
    from worker.sr.backends import open_upscaler
    from worker.sr.engine import SRRequest
    from worker.sr.windows import DirectoryWindowStore
    from worker.upscale import UpscaleOptions, upscale_file

    options = UpscaleOptions(
        request=SRRequest(
            scale=args.scale,
            num_inference_steps=args.steps,
            seed=args.seed,
            min_overlap=args.min_overlap,
            tiles_batch_size=args.tiles_batch_size,
        ),
        target=Target.parse(args.target_resolution, args.resize_mode) if args.target_resolution else None,
        window=args.window,
        window_overlap=args.window_overlap,
        codec=args.codec,
        crf=args.crf,
        preset=args.preset,
        limits=_limits(args),
    )
    upscaler = open_upscaler(args.model, args.devices.split(","), warmup_frames=None)  # one job compiles what it needs
    store = DirectoryWindowStore(args.keep_windows, _job_key(args)) if args.keep_windows else None
    bar = tqdm(total=1, unit="window", dynamic_ncols=True, disable=None, bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")

    def progress(event) -> None:
        bar.total = event.windows
        bar.set_description(f"window {event.window + 1}/{event.windows} {event.stage}", refresh=False)
        bar.set_postfix_str(f"{event.done}/{event.total}" + (f", {event.tiles} tiles" if event.tiles else ""), refresh=False)
        bar.update(event.fraction * event.windows - bar.n)

    try:
        result = upscale_file(args.input, args.output, upscaler, options, progress, store=store)
    finally:
        bar.close()
    if store is not None:
        store.clear()
    source, written = result.source.video, result.written.video
    audio = ", ".join(c.describe() for c in result.carried if c.action != "drop") or "no audio"
    print(
        f"{result.output}: {written.frames} frames {source.width}x{source.height} -> {written.width}x{written.height} "
        f"at {float(written.fps):g} fps, {result.windows} window(s) ({result.restored} restored), {result.tiles} tiles "
        f"on {','.join(result.devices) or '-'}; {audio}; {result.seconds:.1f} s, {result.output.stat().st_size / 1e6:.2f} MB"
    )
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _job_key(args: argparse.Namespace) -> str:
    """Names the job a kept window belongs to: the input file as it is now, the model and every option that
    changes the frames (not the encoder's, which only sees them afterwards)."""
    stat = args.input.stat()
    fields = [str(args.input.resolve()), stat.st_size, stat.st_mtime_ns, args.model, args.devices, args.scale, args.seed,
              args.steps, args.min_overlap, args.window, args.window_overlap, args.target_resolution, args.resize_mode]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


def _probe(args: argparse.Namespace) -> int:
    from worker.media.passthrough import plan_streams
    from worker.media.probe import probe
    from worker.sr import tiling
    from worker.sr.windows import plan_windows

    info = probe(args.input, _limits(args))
    video = info.video
    height, width = tiling.output_size(video.height, video.width, args.scale)
    plan = plan_windows(video.frames, args.window, args.window_overlap)
    carried = plan_streams(info)
    if args.json:
        print(json.dumps(info.to_dict() | {"plan": {
            "output_size": [width, height],
            "windows": [[w.start, w.stop] for w in plan.windows],
            "streams": [{"index": c.index, "kind": c.kind, "action": c.action, "detail": c.detail} for c in carried],
        }}, indent=2))
        return 0
    print("\n".join(info.describe()))
    print(f"upscale x{args.scale:g}: {width}x{height}, {video.frames} frames in {len(plan.windows)} window(s) of up to {plan.length}")
    for c in carried:
        print(f"  {c.describe()}")
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from worker.sr.checkpoint import write_tiny

    write_tiny(args.directory, args.variant, args.latent_upscaler, args.seed)
    print(f"wrote a tiny random {args.variant} checkpoint to {args.directory}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    """The main job end to end on the embedded stack: a generated clip with audio goes in over the API, a job runs
    on a CPU worker with a tiny random checkpoint, the MP4 comes back."""
    from api.client import Client
    from infra.dev import DevStack
    from worker.media.synthetic import write_clip

    args.dir.mkdir(parents=True, exist_ok=True)
    model = args.dir / "tiny-checkpoint"
    if not (model / "model_index.json").exists():
        main(["checkpoint", "tiny", str(model)])
    source = write_clip(args.dir / "input.mp4", num_frames=33, size=(64, 96), audio_codec="aac")
    print(f"generated {source} (96x64, 33 frames, stereo tone)")
    with DevStack(args.dir / "stack", str(model)) as stack:
        print(f"stack up: Redis, SeaweedFS, API {stack.url}, a CPU worker, the reaper (logs in {stack.root})")
        api = Client(stack.url, stack.token)
        job = api.create_from_file(source, {"sr_resolution_scale": "2"})  # SGLang's request form, unchanged
        print(f"POST /v1/videos -> {job['id']} {job['status']}")
        job = api.wait(job["id"], poll_s=0.5, on_update=lambda job: print(
            f"  {job['status']:<11} {job.get('stage') or '':<10} {job['progress']:3d} %"))  # fmt: skip
        if job["status"] != "completed":
            print(f"vsrq: the job ended {job['status']}: {job.get('error')}", file=sys.stderr)
            return 1
        output = api.download(job["id"], args.dir / "output-x2.mp4", sha256=job["output"]["sha256"])
    print(f"{output}: {json.dumps(job['output'])}")
    return 0


def _status(args: argparse.Namespace) -> int:
    """Read from the Redis that VSRQ_REDIS_URL names, as the API reads it (storage.overview)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from storage.config import Settings
    from storage.jobs import JobStore, open_redis
    from storage.overview import overview
    from storage.workers import WorkerRegistry

    settings = Settings()
    redis = open_redis(settings)
    jobs = JobStore(redis, result_ttl_s=settings.result_ttl_s, max_attempts=settings.max_attempts)
    try:
        now = overview(jobs, WorkerRegistry(redis, ttl_s=settings.worker_ttl_s), list(settings.models.values()))
    except (RedisConnectionError, RedisTimeoutError) as error:
        print(f"vsrq: redis_unavailable: {error} (VSRQ_REDIS_URL)", file=sys.stderr)
        return 1
    if args.json:
        print(now.model_dump_json(indent=2))
        return 0
    seconds = WorkerRegistry(redis).now()
    print("queues   " + "  ".join(f"{queue} {depth}" for queue, depth in now.queues.items()))
    print("jobs     " + "  ".join(f"{status} {count}" for status, count in now.jobs.items()))
    print(f"workers  {len(now.workers)}")
    for worker in now.workers:
        runs = f"{worker.model} on {','.join(worker.devices)}" if worker.model else "no model"
        gpus = f" ({', '.join(worker.gpus)})" if worker.gpus else ""
        print(f"  {worker.name}  {','.join(worker.queues)}  {runs}{gpus}  job {worker.job or '-'}  "
              f"beat {seconds - worker.heartbeat_at:.0f}s ago")  # fmt: skip
    return 0


def _bulk(args: argparse.Namespace) -> int:
    from api.bulk import run

    return run(args)


def _dev(args: argparse.Namespace) -> int:
    import signal

    from infra.dev import DevStack

    # SIGTERM (a supervisor stopping us) ends the stack as cleanly as Ctrl-C does.
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    with DevStack(args.dir, args.model, args.devices, args.port) as stack:
        print(
            f"vsrq dev: API {stack.url}, worker model {args.model} on {args.devices}, logs in {stack.root}\n"
            f"  export VSRQ_TOKEN={stack.token}\n"
            f'  curl -H "Authorization: Bearer $VSRQ_TOKEN" -F video_reference=@IN.mp4 -F sr_resolution_scale=2 '
            f"{stack.url}/v1/videos\n"
            "Ctrl-C stops everything.",
            flush=True,
        )
        try:
            signal.pause()
        except KeyboardInterrupt:
            print("vsrq dev: stopping", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
