"""`vsrq`: upscale a video, probe one, write a tiny checkpoint, run the demo or the dev stack, send many videos to the
API, see the service now or a job's history.

Every subcommand's arguments are defined here, so `vsrq --help` and `vsrq bulk` need the client's packages only;
the commands that run the engine or the stack are imported when they run (COMMANDS), and where their part is not
installed the command says which extra to install.

Exit codes: 0 done, 2 bad input or arguments (or a part not installed), 3 model not found, 130 cancelled, 1 internal
error.
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import re
import signal
import sys
from pathlib import Path

from client import config

# subcommand: (the module:function that runs it, the extra that installs what it imports)
COMMANDS = {
    "upscale": ("worker.cli:upscale", "worker"),
    "probe": ("worker.cli:probe", "worker"),
    "checkpoint": ("worker.cli:checkpoint_tiny", "worker"),
    "demo": ("infra.cli:demo", "dev"),
    "dev": ("infra.cli:dev", "dev"),
    "status": ("infra.cli:status", "api"),
    "events": ("infra.cli:events", "api"),
    "bulk": ("client.bulk:run", "client"),
}
OUR_PACKAGES = ("api", "client", "infra", "storage", "worker")
log = logging.getLogger("vsrq")


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.command == "dev" and args.port is None:  # not argparse's default: its error named `--port`, not given
        try:
            args.port = _port(os.environ.get("VSRQ_DEV_PORT", "8000"))
        except argparse.ArgumentTypeError as error:
            print(f"vsrq dev: VSRQ_DEV_PORT: {error}", file=sys.stderr)
            return 2
    # `kill`, `timeout`, `docker stop`, a supervisor, a CI job cancelled: unwound as Ctrl-C is, from the first moment
    # (loading torch takes seconds): no hidden .partial left, bulk's report written, the dev stack stopped
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    logging.basicConfig(level=logging.INFO if args.verbose else logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    target, extra = COMMANDS[args.command]
    module, _, function = target.partition(":")
    try:
        status = getattr(importlib.import_module(module), function)(args)
        sys.stdout.flush()  # here, not at the interpreter's exit: a reader gone (`| head`) is met inside the try
        return status
    except KeyboardInterrupt:
        print("vsrq: cancelled", file=sys.stderr)
        return 130
    except BrokenPipeError:  # `vsrq probe IN | head -3`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # Python's own flush at exit would raise again
        return 141  # 128 + SIGPIPE, as a shell's own commands end
    except Exception as error:
        if isinstance(error, ModuleNotFoundError) and (error.name or "").split(".")[0] not in OUR_PACKAGES:
            print(f"vsrq {args.command} needs the {extra} extra: pip install 'vsrq[{extra}]' (no module {error.name!r})",
                  file=sys.stderr)  # fmt: skip
            return 2
        log.info("internal error", exc_info=True)  # a bug: say so in one line; -v shows where
        print(f"vsrq: internal_error: {type(error).__name__}: {error} (vsrq -v {args.command} … shows where)",
              file=sys.stderr)  # fmt: skip
        return 1


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vsrq", description="Video super-resolution with Kandinsky 6 VSR.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what loads where; show internal errors in full")
    commands = parser.add_subparsers(required=True, metavar="COMMAND", dest="command")

    upscale = commands.add_parser("upscale", help="upscale a video file to an MP4 (every frame, the audio, the subtitles)")
    upscale.add_argument("input", type=Path)
    upscale.add_argument("-o", "--output", type=Path, required=True,
                         help="an .mp4 file, or a folder: IN's name and the scale in it (clip-x2.mp4)")  # fmt: skip
    upscale.add_argument("--overwrite", action="store_true", help="replace a file already at the output path")
    upscale.add_argument("--scale", type=float, choices=(2, 2.25, 4), default=2,
                         help="2 (the default here), 2.25 (the API's default, as SGLang's) or 4")  # fmt: skip
    upscale.add_argument("--model", required=True, help="checkpoint directory, hub id, or 'lanczos'")
    upscale.add_argument("--devices", default="cpu", help="comma-separated, e.g. cuda:0,cuda:1")
    upscale.add_argument("--seed", type=_seed, default=42, help="the noise's seed; -1 draws one (as the API does)")
    upscale.add_argument("--steps", type=int, default=2, help="denoising steps (2 for the distilled checkpoint)")
    upscale.add_argument("--tiles-batch-size", type=int, default=1)
    upscale.add_argument("--min-overlap", type=float, default=0.2, help="least share of a tile its neighbours overlap")
    upscale.add_argument("--target-resolution", help="then downscale to hd, fullhd, 2k or WxH (never upscales)")
    upscale.add_argument("--resize-mode", choices=("fit", "exact"), default="fit", help="fit keeps the aspect ratio")
    upscale.add_argument("--codec", choices=("h264", "hevc", "av1"), default="h264")
    upscale.add_argument("--crf", type=int, default=18, help="quality: lower is better and bigger (the codec's scale)")
    upscale.add_argument("--quality", choices=("lossless", "high"), default="lossless",
                         help="lossless: the exact engine; high: faster FP8 arithmetic in the diffusion transformer, "
                         "not bit-exact (README: what it changes)")  # fmt: skip
    upscale.add_argument("--deinterlace", choices=("frame", "field", "film"), default="frame",
                         help="an interlaced source's output: a frame for each source frame, for each field "
                         "(50i gives 50p), or telecined film's own frames (film: 29.97i gives 23.976p)")  # fmt: skip
    upscale.add_argument("--background", type=_colour, default="#000000", metavar="#RRGGBB",
                         help="what a source's transparent pixels are shown over (MP4 has no alpha): black unless "
                         "named, e.g. '#FFFFFF' for dark line art")  # fmt: skip
    upscale.add_argument("--preset", default="medium", help="encoder speed preset (x264 names; AV1 maps them)")
    upscale.add_argument("--window", type=int, default=121, help="frames per temporal window (1 + 4k)")
    upscale.add_argument("--window-overlap", type=int, default=None,
                         help="frames neighbouring windows crossfade over (default: 16, at most half the window)")
    upscale.add_argument("--keep-windows", type=Path, metavar="DIR", help="keep finished windows in DIR: rerunning resumes")
    _limit_arguments(upscale)

    probe = commands.add_parser("probe", help="what vsrq sees in a file, and what upscaling it would do")
    probe.add_argument("input", type=Path)
    probe.add_argument("--scale", type=float, choices=(2, 2.25, 4), default=2)
    probe.add_argument("--min-overlap", type=float, default=0.2, help="least share of a tile its neighbours overlap")
    probe.add_argument("--target-resolution", help="then downscale to hd, fullhd, 2k or WxH (never upscales)")
    probe.add_argument("--resize-mode", choices=("fit", "exact"), default="fit", help="fit keeps the aspect ratio")
    probe.add_argument("--deinterlace", choices=("frame", "field", "film"), default="frame",
                       help="the frames an interlaced source is read as (see upscale)")  # fmt: skip
    probe.add_argument("--window", type=int, default=121)
    probe.add_argument("--window-overlap", type=int, default=None)
    probe.add_argument("--json", action="store_true", help="machine-readable")
    _limit_arguments(probe)

    checkpoint = commands.add_parser("checkpoint", help="checkpoint tools")
    checkpoint_commands = checkpoint.add_subparsers(required=True, metavar="KIND")
    tiny = checkpoint_commands.add_parser("tiny", help="write a tiny random checkpoint (tests, demos)")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--variant", choices=("piflow", "flowmatch"), default="piflow")
    tiny.add_argument("--no-latent-upscaler", dest="latent_upscaler", action="store_false")
    tiny.add_argument("--seed", type=int, default=0)

    demo = commands.add_parser("demo", help="run the main job end to end on the embedded stack (CPU, tiny checkpoint)")
    demo.add_argument("--dir", type=Path, default=Path("demo"))

    dev = commands.add_parser("dev", help="run the embedded stack until Ctrl-C: Redis, SeaweedFS, API, worker, reaper")
    dev.add_argument("--dir", type=Path, default=Path("var/dev"))
    dev.add_argument("--model", default="lanczos", help="the worker's checkpoint directory, hub id, or 'lanczos'")
    dev.add_argument("--devices", default="cpu")
    dev.add_argument("--port", type=_port, default=None,
                     help="the API's port on 127.0.0.1 (default: $VSRQ_DEV_PORT, else 8000)")  # fmt: skip

    status = commands.add_parser("status", help="the service now: queue depths, workers and their jobs, jobs by status")
    status.add_argument("--json", action="store_true", help="machine-readable")

    events = commands.add_parser("events", help="a job's history from Redis, as an operator sees it (workers, timings)")
    events.add_argument("job_id")
    events.add_argument("--json", action="store_true", help="machine-readable: the events as stored")

    bulk = commands.add_parser("bulk", help="send a folder, a CSV/JSONL manifest or an s3:// prefix to the API")
    bulk.add_argument("source", help="a folder (recursively), a .csv or .jsonl manifest, or s3://bucket/prefix")
    bulk.add_argument("--api-url", help=f"the API's base URL (default: $VSRQ_API_URL, else {config.DEFAULT_API_URL})")
    bulk.add_argument("--token", help="API key (default: $VSRQ_TOKEN)")
    bulk.add_argument("--scale", choices=("2", "2.25", "4"), help="for every video (a manifest row may say otherwise)")
    bulk.add_argument("--seed")
    bulk.add_argument("--model", help="a model the API serves (default: its first)")
    bulk.add_argument("--quality", choices=("lossless", "high"), help="for every video: the tier (default lossless)")
    bulk.add_argument("--set", action="append", default=[], metavar="FIELD=VALUE", help="any other create field")
    bulk.add_argument("--concurrency", type=int, default=4, help="requests in flight: uploads, polls, downloads")
    bulk.add_argument("--part-size", type=int, default=64, metavar="MIB",
                      help="a file larger than this goes up in parts of this size, each sent again alone when its "
                           "connection drops (default 64: OpenAI's part size, under the 100 MB some proxies allow)")
    bulk.add_argument("--wait", action="store_true", help="poll until every job has ended")
    bulk.add_argument("--poll", type=float, default=2.0, metavar="SECONDS", help="between polls of one job")
    bulk.add_argument("--download", type=Path, metavar="DIR", help="fetch outputs into DIR (existing files are kept)")
    bulk.add_argument("--report", type=Path, default=Path("bulk-report.csv"), help=".csv or .jsonl (journal beside)")
    bulk.add_argument("--s3-endpoint-url", help="for s3:// sources (default: $AWS_ENDPOINT_URL, else AWS)")
    bulk.add_argument("--service-bucket", help="its uploads are referenced (default: $VSRQ_S3_BUCKET, vsrq)")
    return parser


def _limit_arguments(parser: argparse.ArgumentParser) -> None:
    # A dataclass of numbers, no third-party import (tests/test_layers.py allows it): the defaults stay the service's.
    from worker.media.limits import Limits

    default = Limits()
    limits = parser.add_argument_group("input limits (refused before any work)")
    limits.add_argument("--max-pixels", type=int, default=default.max_pixels, help="per frame (default: %(default)s)")
    limits.add_argument("--max-frames", type=int, default=default.max_frames, help="(default: %(default)s)")
    limits.add_argument("--max-seconds", type=float, default=default.max_seconds, help="(default: %(default)s)")
    limits.add_argument("--max-bytes", type=int, default=default.max_bytes, help="file size (default: %(default)s)")
    limits.add_argument("--min-frames", type=int, default=default.min_frames, help="(default: %(default)s)")
    output = parser.add_argument_group("output limits (what the model computes, before any target; refused before "
                                       "a model loads)")  # fmt: skip
    output.add_argument("--max-output-pixels", type=int, default=default.max_output_pixels,
                        help="per frame (default: %(default)s)")  # fmt: skip
    output.add_argument("--max-output-megapixel-frames", type=float, default=default.max_output_megapixel_frames,
                        help="per job: a service key's budget (default: %(default)s)")  # fmt: skip


def _port(text: str) -> int:
    if not text.isdigit() or not 1 <= int(text) <= 65535:
        raise argparse.ArgumentTypeError(f"{text!r} is not a port (1-65535)")
    return int(text)


def _colour(text: str) -> str:
    """#RRGGBB, as the API takes `background`."""
    if not re.fullmatch(r"#[0-9A-Fa-f]{6}", text):
        raise argparse.ArgumentTypeError(f"{text!r} is not a colour: #RRGGBB, e.g. #FFFFFF for white")
    return text.lower()


def _seed(text: str) -> int:
    """The API's range: 0 to 2**63 - 1, or -1 to draw one."""
    if not text.lstrip("-").isdigit() or not -1 <= int(text) < 2**63:
        raise argparse.ArgumentTypeError(f"{text!r} is not a seed: 0 to 2**63 - 1, or -1 to draw one")
    return int(text)


if __name__ == "__main__":
    sys.exit(main())
