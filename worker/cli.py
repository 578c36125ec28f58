"""`vsrq`: upscale a video, write a tiny checkpoint, run the demo.

Exit codes: 0 done, 2 bad input or arguments, 3 model not found, 130 cancelled, 1 internal error.
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from pathlib import Path

from tqdm import tqdm

EXIT_CODES = {"invalid_request": 2, "model_not_found": 3, "cancelled": 130}


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


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vsrq", description="Video super-resolution with Kandinsky 6 VSR.")
    parser.add_argument("-v", "--verbose", action="store_true", help="log what loads where")
    commands = parser.add_subparsers(required=True, metavar="COMMAND")

    upscale = commands.add_parser("upscale", help="upscale a video file to an MP4")
    upscale.add_argument("input", type=Path)
    upscale.add_argument("-o", "--output", type=Path, required=True)
    upscale.add_argument("--scale", type=float, choices=(2, 2.25, 4), default=2)
    upscale.add_argument("--model", required=True, help="checkpoint directory, hub id, or 'lanczos'")
    upscale.add_argument("--devices", default="cpu", help="comma-separated, e.g. cuda:0,cuda:1")
    upscale.add_argument("--seed", type=int, default=42)
    upscale.add_argument("--steps", type=int, default=2, help="denoising steps (2 for the distilled checkpoint)")
    upscale.add_argument("--tiles-batch-size", type=int, default=1)
    upscale.add_argument("--min-overlap", type=float, default=0.2)
    upscale.add_argument("--crf", type=int, default=18)
    upscale.set_defaults(run=_upscale)

    checkpoint = commands.add_parser("checkpoint", help="checkpoint tools")
    checkpoint_commands = checkpoint.add_subparsers(required=True, metavar="KIND")
    tiny = checkpoint_commands.add_parser("tiny", help="write a tiny random checkpoint (tests, demos)")
    tiny.add_argument("directory", type=Path)
    tiny.add_argument("--variant", choices=("piflow", "flowmatch"), default="piflow")
    tiny.add_argument("--no-latent-upscaler", dest="latent_upscaler", action="store_false")
    tiny.add_argument("--seed", type=int, default=0)
    tiny.set_defaults(run=_tiny)

    demo = commands.add_parser("demo", help="generate a clip and upscale it with a tiny checkpoint, on the CPU")
    demo.add_argument("--dir", type=Path, default=Path("demo"))
    demo.set_defaults(run=_demo)
    return parser


def _upscale(args: argparse.Namespace) -> int:
    from worker.media.reader import read_clip
    from worker.media.writer import Mp4Writer
    from worker.sr.backends import open_upscaler
    from worker.sr.engine import SRRequest

    started = time.perf_counter()
    upscaler = open_upscaler(args.model, args.devices.split(","))
    clip = read_clip(args.input)
    num_frames, _, height, width = clip.frames.shape
    size = upscaler.output_size(height, width, args.scale)
    request = SRRequest(
        scale=args.scale,
        num_inference_steps=args.steps,
        seed=args.seed,
        min_overlap=args.min_overlap,
        tiles_batch_size=args.tiles_batch_size,
    )
    bar = tqdm(total=1, unit="unit", desc="upscaling", dynamic_ncols=True, disable=None)  # no bar when piped

    def progress(event) -> None:
        bar.total = event.total
        bar.set_description(event.stage)
        bar.update(event.done - bar.n)

    with Mp4Writer(args.output, clip.fps, size, crf=args.crf) as writer:
        info = upscaler.upscale(clip.frames, request, writer.write, progress)
    bar.close()
    print(
        f"{args.output}: {info.frames} frames {width}x{height} -> {info.output_size[1]}x{info.output_size[0]} "
        f"at {float(clip.fps):g} fps, {info.tiles} tiles on {','.join(info.devices)}, "
        f"{time.perf_counter() - started:.1f} s, {args.output.stat().st_size / 1e6:.2f} MB"
    )
    return 0


def _tiny(args: argparse.Namespace) -> int:
    from worker.sr.checkpoint import write_tiny

    write_tiny(args.directory, args.variant, args.latent_upscaler, args.seed)
    print(f"wrote a tiny random {args.variant} checkpoint to {args.directory}")
    return 0


def _demo(args: argparse.Namespace) -> int:
    from worker.media.synthetic import write_clip

    args.dir.mkdir(parents=True, exist_ok=True)
    model = args.dir / "tiny-checkpoint"
    if not (model / "model_index.json").exists():
        main(["checkpoint", "tiny", str(model)])
    source = write_clip(args.dir / "input.mp4", num_frames=33, size=(64, 96))
    print(f"generated {source}")
    return main(["upscale", str(source), "-o", str(args.dir / "output-x2.mp4"), "--model", str(model), "--scale", "2"])


if __name__ == "__main__":
    sys.exit(main())
