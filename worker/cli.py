"""The `vsrq` commands that run the engine on this machine: upscale, probe, checkpoint tiny (client/cli.py defines
their arguments and imports this module when one runs).

Errors raised on purpose end the command with their code in one line: 2 for bad input, 3 for a model not found.
"""

from __future__ import annotations

import argparse
import functools
import hashlib
import json
import secrets
import sys
from collections.abc import Callable
from typing import TYPE_CHECKING

from tqdm import tqdm

from worker.errors import InvalidRequest, PermanentError
from worker.media.errors import BAD_INPUT_CODES, OutputExists

MP4_SUFFIXES = (".mp4", ".m4v", ".mov")  # the names players know the written file's container by
EXIT_CODES = {"invalid_request": 2, "output_exists": 2, "output_unwritable": 2, "model_not_found": 3, "cancelled": 130}
EXIT_CODES |= dict.fromkeys(BAD_INPUT_CODES, 2)

if TYPE_CHECKING:  # imported where a command runs: `vsrq --help` loads no torch
    from worker.upscale import UpscaleOptions


def _reported(command: Callable[[argparse.Namespace], int]) -> Callable[[argparse.Namespace], int]:
    @functools.wraps(command)
    def run(args: argparse.Namespace) -> int:
        try:
            return command(args)
        except PermanentError as error:
            print(f"vsrq: {error.code}: {error.message}", file=sys.stderr)
            return EXIT_CODES.get(error.code, 1)

    return run


def _limits(args: argparse.Namespace):
    from worker.media.limits import Limits

    return Limits(args.max_pixels, args.max_frames, args.max_seconds, args.max_bytes, args.min_frames,
                  max_output_pixels=args.max_output_pixels,
                  max_output_megapixel_frames=args.max_output_megapixel_frames)  # fmt: skip


@_reported
def upscale(args: argparse.Namespace) -> int:
    from worker.media.probe import existing
    from worker.media.resize import Target
    from worker.sr.backends import open_upscaler
    from worker.sr.request import SRRequest
    from worker.sr.windows import DirectoryWindowStore
    from worker.upscale import UpscaleOptions, check_output, upscale_file

    existing(args.input)  # before a model loads (seconds): the job key reads the file too
    if args.output.is_dir():  # the video goes in it, named as `vsrq bulk` and the web app name theirs
        args.output = args.output / f"{args.input.stem}-x{args.scale:g}.mp4"
    elif args.output.suffix.lower() not in MP4_SUFFIXES:  # players pick a demuxer by the name: an MP4 as .mkv fails
        raise InvalidRequest(f"the output is an MP4: name it {args.output.stem}.mp4, not {args.output.name}")
    check_output(args.input, args.output)  # before the next check: --overwrite would not make the input one
    if args.keep_windows:  # a folder of the user's named by mistake: refused before a model loads, never emptied
        DirectoryWindowStore.refuse_foreign(args.keep_windows)
    if args.output.exists() and not args.overwrite:  # an earlier output may have cost an hour of GPU
        raise OutputExists(f"{args.output} is there already: --overwrite replaces it")
    drawn = args.seed == -1
    if drawn:  # as the API draws one (SGLang's range); the job key below then names the drawn seed
        args.seed = secrets.randbelow(2**31)
    options = UpscaleOptions(
        request=SRRequest(
            scale=args.scale,
            num_inference_steps=args.steps,
            seed=args.seed,
            min_overlap=args.min_overlap,
            tiles_batch_size=args.tiles_batch_size,
            quality=args.quality,
        ),
        target=Target.parse(args.target_resolution, args.resize_mode) if args.target_resolution else None,
        window=args.window,
        window_overlap=args.window_overlap,
        codec=args.codec,
        crf=args.crf,
        preset=args.preset,
        deinterlace=args.deinterlace,
        background=args.background,
        limits=_limits(args),
    )
    _refuse_before_loading(args, options)
    upscaler = open_upscaler(args.model, args.devices.split(","), warmup_frames=None)  # one job compiles what it needs
    key = _job_key(args, upscaler.signature(options.request))
    bar = tqdm(total=1, unit="window", dynamic_ncols=True, disable=None, bar_format="{desc} {percentage:3.0f}%|{bar}| {elapsed}<{remaining}{postfix}")

    def progress(event) -> None:
        bar.total = event.windows
        bar.set_description(f"window {event.window + 1}/{event.windows} {event.stage}", refresh=False)
        bar.set_postfix_str(f"{event.done}/{event.total}" + (f", {event.tiles} tiles" if event.tiles else ""), refresh=False)
        bar.update(event.fraction * event.windows - bar.n)

    store = None
    try:  # from the store's making on: a cancel right after it left its directory behind
        store = DirectoryWindowStore(args.keep_windows, key) if args.keep_windows else None
        result = upscale_file(args.input, args.output, upscaler, options, progress, store=store)
    except KeyboardInterrupt:
        if store is None or not store.kept():
            if store is not None:  # cancelled before its first window was done: nothing to resume from
                store.clear()
            raise
        # the windows kept are this seed's: a drawn one must be named again for them to be found
        again = f" with --seed {args.seed}" if drawn else ""
        print(f"vsrq: cancelled; the windows done are kept in {args.keep_windows}: the same command{again} resumes",
              file=sys.stderr)  # fmt: skip
        return 130
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
    if drawn:
        print(f"seed: {args.seed} (drawn: --seed {args.seed} gives this video again)")
    if result.quality != "lossless":
        print(f"quality: {result.quality} ({', '.join(f'{lever}: {how}' for lever, how in result.levers.items())})")
    for note in result.notes:
        print(f"note: {note}")
    return 0


def _refuse_before_loading(args: argparse.Namespace, options: UpscaleOptions) -> None:
    """What needs no model refused before one loads (seconds on the CPU, a 13 GB checkpoint on a GPU): the input's
    and the output's limits, the windows, the codec's least size. The job probes again (`begin_upscale`): seconds
    for a long 4K input, against the load."""
    from worker.media.probe import probe
    from worker.media.writer import check_size
    from worker.sr import tiling
    from worker.sr.windows import plan_windows

    video = probe(args.input, options.limits, output_size=lambda h, w: tiling.output_size(h, w, args.scale)).video
    plan_windows(video.frames, options.window, options.window_overlap)
    size = tiling.output_size(video.height, video.width, args.scale)
    options.limits.check_output(*size, video.frames)  # before any target: what the model computes
    if options.target is None:  # a target's output is sized by it, and checked by the job
        check_size(options.codec, size)


def _job_key(args: argparse.Namespace, signature: str) -> str:
    """Names the job a kept window belongs to: the input file as it is now, the model, every option that changes
    the frames (not the encoder's, which only sees them afterwards) and what else does on this machine (`signature`:
    the performance mode `auto` picked, the split, the FP8 attention backend)."""
    from worker.sr.windows import overlap_for

    stat = args.input.stat()
    # the overlap resolved: windows kept under the default's 16 resume though the option is now left unset
    overlap = overlap_for(args.window, args.window_overlap)
    fields = [str(args.input.resolve()), stat.st_size, stat.st_mtime_ns, args.model, args.devices, args.scale, args.seed,
              args.steps, args.min_overlap, args.window, overlap, args.target_resolution, args.resize_mode,
              args.quality, args.deinterlace, args.background, signature]
    return hashlib.sha256(json.dumps(fields).encode()).hexdigest()


@_reported
def probe(args: argparse.Namespace) -> int:
    """What the file is and what a job on it would compute, planned by the engine's own functions with the released
    checkpoint's tile sizes (no model loads): a batch is sized, and a refusal seen, before any GPU time."""
    from worker.media.errors import OutputTooLarge
    from worker.media.limits import Limits
    from worker.media.passthrough import plan_streams
    from worker.media.probe import probe
    from worker.media.reader import at_cadence, telecined
    from worker.media.resize import Target
    from worker.sr import tiling
    from worker.sr.windows import plan_windows

    limits = _limits(args)
    info = probe(args.input, limits)
    video = at_cadence(info.video, args.deinterlace) or info.video  # the frames the job reads, as it counts them
    height, width = tiling.output_size(video.height, video.width, args.scale)
    plan = plan_windows(video.frames, args.window, args.window_overlap)
    tiles = tiling.plan_video(video.height, video.width, args.scale, tiling.RELEASED_TILE_SIZES, tiling.RELEASED_SNAP,
                              args.min_overlap)  # fmt: skip
    target = Target.parse(args.target_resolution, args.resize_mode) if args.target_resolution else None
    written = target.size(height, width, video.sar) if target else None
    cost = Limits.none().check_output(height, width, video.frames)  # the megapixel-frames, said over a limit too
    try:  # the job's own check, on what the model computes (before any downscale to a target)
        limits.check_output(height, width, video.frames)
        refused = None
    except OutputTooLarge as error:
        refused = error
    carried = plan_streams(info)
    film = telecined(args.input, info.video)  # what the job's notes would say after the fact, said before it
    if args.json:
        print(json.dumps(info.to_dict() | {"plan": {
            "output_size": [width, height],
            "target_size": list(written[::-1]) if written else None,
            "windows": [[w.start, w.stop] for w in plan.windows],
            "tiles": {
                "per_window": len(tiles.tiles),
                "total": len(tiles.tiles) * len(plan.windows),
                "input_tile": [tiles.tile_width, tiles.tile_height],
                "output_tile": [tiles.base_width, tiles.base_height],
                "model_input": [tiles.width, tiles.height],
            },
            "megapixel_frames": round(cost, 3),
            "limits": {"max_output_pixels": limits.max_output_pixels,
                       "max_output_megapixel_frames": limits.max_output_megapixel_frames},
            "refused": refused and {"code": refused.code, "message": refused.message},
            "streams": [{"index": c.index, "kind": c.kind, "action": c.action, "detail": c.detail} for c in carried],
            "looks_telecined": film,
        }}, indent=2))  # fmt: skip
    else:
        print("\n".join(info.describe()))
        then = f", then {written[1]}x{written[0]} ({args.target_resolution}, {target.mode})" if written else ""
        print(f"upscale x{args.scale:g}: {width}x{height}, {video.frames} frames in {len(plan.windows)} window(s) "
              f"of up to {plan.length}{then}")
        print(f"  tiles: {len(tiles.tiles)} a window, {len(tiles.tiles) * len(plan.windows)} in all, each "
              f"{tiles.tile_width}x{tiles.tile_height} of the {tiles.width}x{tiles.height} model input to "
              f"{tiles.base_width}x{tiles.base_height} (the released model's tiles)")
        most_pixels = limits.max_output_pixels and limits.max_output_pixels / 1e6
        print(f"  computes {_against(cost, limits.max_output_megapixel_frames, ',.0f', 'megapixel-frames')}, "
              f"{_against(height * width / 1e6, most_pixels, '.1f', 'megapixels a frame')}")
        for c in carried:
            print(f"  {c.describe()}")
        if film:
            print("looks like telecined film (3:2 pulldown repeats a field in two of every five frames): "
                  "--deinterlace film gives the film's own 23.976 frames back")
        elif (video.interlaced or video.turns_interlaced) and args.deinterlace == "frame":
            print("interlaced (each frame two fields of different instants): deinterlaced as it is read, a frame for "
                  f"each frame; --deinterlace field gives a frame for each field ({float(2 * video.fps):.5g} frames/s)")
    if refused is not None:  # as `vsrq upscale` would end, before loading a model: a batch script skips the file
        raise refused
    return 0


def _against(value: float, limit: float | None, spec: str, unit: str) -> str:
    return f"{value:{spec}} {unit} " + (f"(limit {limit:{spec}})" if limit is not None else "(no limit)")


@_reported
def checkpoint_tiny(args: argparse.Namespace) -> int:
    from worker.sr.checkpoint import write_tiny

    write_tiny(args.directory, args.variant, args.latent_upscaler, args.seed)
    print(f"wrote a tiny random {args.variant} checkpoint to {args.directory}")
    return 0
