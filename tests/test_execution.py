"""Default (per-tile) noise: output independent of tile batching, device count and decode segmenting; frames
stream out segment by segment; progress and cancellation work between tiles."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import CLIP_SIZE, clip, run
from worker.errors import Cancelled, InvalidRequest
from worker.sr.engine import SREngine
from worker.sr.request import SRRequest


@pytest.fixture(scope="module")
def baseline(engine):
    return run(engine, clip(2), SRRequest(scale=2, seed=3))


@pytest.fixture(scope="module")
def baseline_of(engine):
    """The default engine's output for clip(2) of a frame count, computed once for the tests that compare with it."""
    done: dict[int, torch.Tensor] = {}

    def of(frames: int) -> torch.Tensor:
        if frames not in done:
            done[frames] = run(engine, clip(2, frames=frames), SRRequest(scale=2, seed=3))
        return done[frames]

    return of


@pytest.mark.parametrize("tiles_batch_size", [2, 4])
def test_tile_batch_size_does_not_change_output(engine, baseline, tiles_batch_size):
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3, tiles_batch_size=tiles_batch_size)), baseline)


@pytest.mark.parametrize("devices", [2, 3])
def test_more_devices_give_the_same_bits(tiny_piflow, baseline, devices):
    """4 tiles on 3 devices: denoised 2 + 1 + 1, decoded 1 + 1 + 2 (tile 0 is handed from the first to the last)."""
    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu"] * devices)
    assert len(engine.replicas) == devices
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3, tiles_batch_size=2)), baseline)
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3)), baseline)


@pytest.mark.parametrize("decode_order", ["lockstep", "tile_major"])
def test_more_devices_than_tiles_and_a_slow_sink_still_give_the_same_bits(baseline_of, tiny_piflow, decode_order):
    """5 devices for 4 tiles (one denoises nothing and decodes a tile it is handed), and a sink slower than the
    devices, so the bounded queue of 65 frames' 20 tile segments fills: the call neither hangs nor reorders, and it
    reports the time its sink and its own blending took apart from the rest."""
    import time

    request, video = SRRequest(scale=2, seed=3), clip(2, frames=65)
    expected = baseline_of(65)
    many = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu"] * 5, decode_order=decode_order)
    chunks: list[torch.Tensor] = []

    def slow_sink(frames: torch.Tensor) -> None:
        time.sleep(0.1)
        chunks.append(frames)

    info = many.upscale(video, request, slow_sink)
    assert torch.equal(torch.cat(chunks), expected)
    seconds = info.stage_seconds
    assert seconds["sink"] >= 0.1 * len(chunks)
    assert 0 < seconds["blend"] < seconds["denoise_decode"] - seconds["sink"]


@pytest.mark.parametrize(("tiles", "slots"), [(9, 2), (25, 2), (10, 3), (4, 3), (1, 2), (9, 1), (8, 8)])
def test_schedule_balances_denoising_and_decoding(tiles, slots):
    from worker.sr.devices import Schedule
    from worker.sr.tiling import Tile

    schedule = Schedule.balanced([Tile(i, 0, 0) for i in range(tiles)], slots)
    for share in (schedule.denoise, schedule.decode):
        assert sorted(t.index for tiles_ in share.values() for t in tiles_) == list(range(tiles))  # each tile once
    work = [len(schedule.denoise[s]) + len(schedule.decode[s]) for s in range(slots)]
    assert max(work) - min(work) <= 1  # whole tiles: at most one unit apart
    moved = [t.index for s in range(slots) for t in schedule.decode[s] if t not in schedule.denoise[s]]
    assert all(index < slots for index in moved)  # only first-round tiles change device: they are ready first
    if (tiles, slots) == (9, 2):
        assert [len(schedule.denoise[s]) for s in range(2)] == [5, 4] and [len(schedule.decode[s]) for s in range(2)] == [4, 5]


@pytest.mark.parametrize(("decode_order", "devices", "segment"), [
    ("tile_major", ["cpu"], 4), ("tile_major", ["cpu", "cpu"], 4), ("parked", ["cpu"], 4), ("parked", ["cpu"], 1),
])
def test_other_decode_orders_give_the_same_bits(baseline_of, tiny_piflow, monkeypatch, decode_order, devices, segment):
    """Parked caches go to host memory and back between segments, one segment of every tile after another: a cache
    restored to the wrong tile or a stale copy would change the frames. Only parked moves caches."""
    from worker.sr.decoder_caches import DecoderCaches

    parked = []
    give_back = DecoderCaches.give_back
    monkeypatch.setattr(DecoderCaches, "give_back", lambda self, index, cache, last: (parked.append(self._park and not last), give_back(self, index, cache, last)))
    request, video = SRRequest(scale=2, seed=3), clip(2, frames=25)
    expected = baseline_of(25)
    other = SREngine.from_pretrained(str(tiny_piflow), devices=devices, decode_order=decode_order, decode_segment=segment)
    parked.clear()
    assert torch.equal(run(other, video, request), expected)
    # 4 tiles; 25 frames are 7 latent frames: segments [0:1], [1:5], [5:6], [6:7] (a remainder goes one frame at a
    # time) or seven (segment 1)
    assert sum(parked) == (4 * (6 if segment == 1 else 3) if decode_order == "parked" else 0)


@pytest.mark.parametrize("decode_segment", [1, 2, 64])
def test_decode_segment_does_not_change_output(tiny_piflow, baseline, decode_segment):
    engine = SREngine.from_pretrained(str(tiny_piflow), decode_segment=decode_segment)
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3)), baseline)


def test_seed_changes_output(engine, baseline):
    other = run(engine, clip(2), SRRequest(scale=2, seed=4))
    assert (other - baseline).abs().max() > 1e-3


def test_frames_stream_out_in_bounded_segments(engine):
    """Each sink call holds at most one decode segment, whatever the clip length, and arrives before decoding ends
    (the device runs at most a few segments ahead of the sink)."""
    for frames in (9, 65):
        events, chunks = [], []
        engine.upscale(
            clip(2, frames=frames),
            SRRequest(scale=2),
            lambda chunk: chunks.append((len(chunk), events[-1].done if events else 0)),
            progress=events.append,
        )
        total = events[-1].total
        assert sum(n for n, _ in chunks) == frames
        assert max(n for n, _ in chunks) <= 4 * engine.decode_segment
        if frames > 9:
            assert chunks[0][1] < total  # the first frames left before the last tile was decoded


def test_any_frame_count_and_size_round_trip(engine):
    """Sizes and frame counts the model cannot take directly are padded inside and cropped back."""
    video = torch.rand(6, 3, 21, 43)
    out = run(engine, video, SRRequest(scale=2))
    assert out.shape == (6, 3, 42, 86)
    assert engine.output_size(21, 43, 2) == (42, 86)


def test_progress_counts_every_tile_step_and_segment(engine):
    events = []
    run(engine, clip(2), SRRequest(scale=2, num_inference_steps=3), progress=events.append)
    # 4 tiles x (3 steps + 3 decode segments of 3 latent frames: the leading frame, then one at a time).
    assert events[-1].done == events[-1].total == 4 * (3 + 3)
    assert [e.done for e in events] == sorted(e.done for e in events)
    assert {e.stage for e in events} == {"denoise", "decode"}


def test_cancellation_stops_between_steps(engine):
    events, chunks = [], []
    with pytest.raises(Cancelled):
        engine.upscale(clip(2), SRRequest(scale=2), chunks.append, progress=events.append, cancelled=lambda: len(events) >= 3)
    assert len(events) == 3
    assert chunks == []


@pytest.mark.parametrize("field", [{"scale": 3}, {"num_inference_steps": 0}, {"min_overlap": 1.0}, {"lq_noise_scale": 0}])
def test_invalid_requests_are_refused(engine, field):
    with pytest.raises(InvalidRequest):
        run(engine, clip(2), SRRequest(**field))


def test_nabla_attention_option_runs_the_sparse_processor(tiny_piflow, baseline):
    """On the CPU eager flex attention is dense, so the NABLA option must give the dense output here (the sparse
    kernel and its distance from dense are GPU figures: bench/levers.py)."""
    engine = SREngine.from_pretrained(str(tiny_piflow), attention="nabla")
    processors = {type(p).__name__ for p in engine.replicas[0].transformer.attn_processors.values()}
    assert processors == {"NablaFlexProcessor"}
    assert (run(engine, clip(2), SRRequest(scale=2, seed=3)) - baseline).abs().max() <= 1e-5
    with pytest.raises(ValueError, match="attention must be one of"):
        SREngine.from_pretrained(str(tiny_piflow), attention="flash")


def test_warmup_gives_every_device_a_tile_of_every_size_and_no_more_than_it_needs(tiny_piflow):
    """Three devices: landscape and portrait clips grow along their long side to three tiles; a square one would
    turn landscape that way, so it grows in both directions and keeps square tiles."""
    from worker.sr import tiling

    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu", "cpu"])
    assert not engine.compiles  # nothing is compiled on the CPU: the worker skips the warmup there
    sizes: list[tuple[int, int]] = []
    upscale = engine.upscale
    engine.upscale = lambda video, *args, **kwargs: (sizes.append(tuple(video.shape[2:])), upscale(video, *args, **kwargs))[1]
    info = engine.warmup(frames=5, every_tile_size=True)
    assert info.frames == 5
    tiles = {
        tiling.choose_base_tile(*size, engine.tile_sizes): len(tiling.plan_tiles(*size, 2, engine.tile_sizes, engine.snap).tiles)
        for size in sizes
    }
    landscape, portrait, square = (32, 64), (64, 32), (32, 32)
    assert tiles.keys() == {landscape, portrait, square} == set(engine.tile_sizes)
    assert tiles[landscape] == tiles[portrait] == 3 and tiles[square] >= 3


@pytest.mark.parametrize("mode", ["speed", "balanced", "memory"])
def test_performance_modes_give_the_same_bits(tiny_piflow, baseline, mode):
    from worker.sr.backends import PERFORMANCE_MODES, open_upscaler

    engine = open_upscaler(str(tiny_piflow), ["cpu"], mode)
    settings = PERFORMANCE_MODES[mode]
    assert (engine.decode_order, engine.decode_segment, engine.offload) == (settings["decode_order"], settings["decode_segment"], None)
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3)), baseline)


def test_a_new_clip_shape_runs_model_calls_one_at_a_time_then_in_parallel(tiny_piflow, baseline):
    """On GPUs the first call of a new clip shape compiles, and Dynamo tracing in one thread breaks module calls in
    the others: its model calls never overlap; the next call of that shape runs them side by side, every thread
    without gradients, and a new shape is gated again."""
    import threading

    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu"])
    engine.compiles = True  # what compiled blocks set on GPUs (compiling is off by default on the CPU)
    lock, events = threading.Lock(), []  # (enter or leave, call number, thread, grad)

    def enter(*_) -> None:
        with lock:
            events.append(("enter", len(events), threading.current_thread().name, torch.is_grad_enabled()))
            threading.current_thread().vsrq_call = events[-1][1]

    def leave(*_) -> None:
        with lock:
            events.append(("leave", threading.current_thread().vsrq_call, None, None))

    models = (engine.replicas[0].transformer, engine.replicas[0].vae.decoder)
    hooks = [hook for m in models for hook in (m.register_forward_pre_hook(enter), m.register_forward_hook(leave))]
    traces, outputs = [], []
    try:
        for video in (clip(2), clip(2), clip(2), clip(2, frames=13)):
            events.clear()
            outputs.append(run(engine, video, SRRequest(scale=2, seed=3)))
            traces.append(list(events))
    finally:
        for hook in hooks:
            hook.remove()

    def overlapping(trace: list) -> bool:
        """Whether a model call started while another was inside."""
        inside = set()
        for event, call, *_ in trace:
            if event == "enter" and inside:
                return True
            (inside.add if event == "enter" else inside.discard)(call)
        return False

    first, *seen, new_shape = traces
    assert not overlapping(first) and any(map(overlapping, seen)) and not overlapping(new_shape)
    assert {thread for event, _, thread, _ in first + seen[0] if event == "enter"} == {"vsrq-device_0", "vsrq-device_1"}
    assert not any(grad for trace in traces for event, *_, grad in trace if event == "enter")
    assert torch.equal(outputs[0], baseline) and torch.equal(outputs[1], baseline)


@pytest.mark.parametrize("compiles", [False, True])
def test_a_failing_sink_or_device_stops_every_device(tiny_piflow, baseline, compiles):
    """An error on either side ends the call with that error, no device works on after it, and the engine keeps
    working; also in a first call where blocks compile (model calls one at a time), where a device waiting for its
    turn must not start once the call failed."""
    import time

    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu"])
    engine.compiles = compiles
    events: list = []

    def broken_sink(_frames: torch.Tensor) -> None:
        raise OSError("disk full")

    def settled() -> bool:
        seen = len(events)
        time.sleep(0.5)
        return len(events) == seen

    with pytest.raises(OSError, match="disk full"):
        engine.upscale(clip(2, frames=65), SRRequest(scale=2, seed=3), broken_sink, progress=events.append)
    assert settled() and events[-1].done < events[-1].total
    events.clear()
    with pytest.raises(Cancelled):
        engine.upscale(
            clip(2, frames=65),
            SRRequest(scale=2, seed=3),
            lambda _: None,
            progress=events.append,
            cancelled=lambda: any(event.stage == "decode" for event in events),
        )
    assert settled() and events[-1].done < events[-1].total
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3)), baseline)


@pytest.fixture
def built_graphs(monkeypatch) -> list[tuple[str, bool]]:
    """(thread, the mode Inductor builds the graph in) of every graph Dynamo hands to Inductor from now on, Dynamo's
    caches emptied first (graphs are shared by every module of a class: another test's would be reused)."""
    import threading

    import torch._inductor.compile_fx as compile_fx
    import torch._inductor.config as inductor

    built: list[tuple[str, bool]] = []
    build = compile_fx.compile_fx

    def recording(graph, inputs, *args, config_patches=None, **kwargs):
        if config_patches is not None:  # Dynamo's call, not compile_fx calling itself with the patches applied
            built.append((threading.current_thread().name, config_patches.get("deterministic", inductor.deterministic)))
        return build(graph, inputs, *args, config_patches=config_patches, **kwargs)

    torch._dynamo.reset()
    monkeypatch.setattr(compile_fx, "compile_fx", recording)
    return built


def test_every_compiled_graph_is_built_deterministic_on_the_device_threads(tiny_piflow, built_graphs):
    """Every graph Inductor builds for an engine is built in its deterministic mode (no timed choice of reduction
    kernels, whose near-ties differ between GPUs), on the device threads that run the model calls, and past Dynamo's
    default of 8 graphs per code object (the decoder's resnet blocks: 8 graphs for a 9-frame clip, 4 more for 17
    frames). PyTorch resets the mode after tracing and keeps settings per thread: on two H200s the second GPU's graphs
    were built without it, and on torch 2.13 a device thread failed at the ninth graph."""
    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu"], compile_transformer=True, compile_decoder=True)
    for frames in (9, 17):
        assert run(engine, clip(2, frames=frames), SRRequest(scale=2, seed=3)).shape[0] == frames
    # CPU "devices" share one replica, so whichever device thread meets a shape first builds its graph for both.
    assert len(built_graphs) >= 12 and {mode for _, mode in built_graphs} == {True}
    assert {thread for thread, _ in built_graphs} <= {"vsrq-device_0", "vsrq-device_1"}


@pytest.mark.parametrize(("window", "every_tile_size"), [(21, True), (17, False)])
def test_after_the_warmup_no_clip_builds_a_decoder_graph(tiny_piflow, built_graphs, window, every_tile_size):
    """The compiled decoder builds a graph per segment shape and tile size, and the warmup builds every shape a clip
    can need: for landscape tiles, and portrait and square ones with `every_tile_size`; also where the window leaves
    no remainder (17 frames: 1 + 4 latent frames). Before, a remainder of 1 to 3 latent frames decoded whole was a
    shape of its own (after a 121-frame warmup, half of all clip lengths compiled the decoder again in their first
    job), and only landscape was warmed up."""
    engine = SREngine.from_pretrained(str(tiny_piflow), compile_transformer=False, compile_decoder=True)
    engine.warmup(window, every_tile_size=every_tile_size)
    assert built_graphs  # the warmup compiled
    built_graphs.clear()
    # Landscape as a 2x2-tile clip (the lockstep decode users run, tile caches swapped between calls); portrait and
    # square as one tile each, which is all their graphs need once many tiles are shown to reuse the warmup's
    sizes = [CLIP_SIZE[2], (32, 16), (16, 16)] if every_tile_size else [CLIP_SIZE[2]]
    for size in sizes:
        for frames in (1, 5, 9, 13, 17, 20, 25, 29, 33):
            video = torch.rand(frames, 3, *size, generator=torch.Generator().manual_seed(frames))
            assert run(engine, video, SRRequest(scale=2, seed=3)).shape == (frames, 3, 2 * size[0], 2 * size[1])
    assert built_graphs == []


def test_the_warmup_decodes_each_segment_signature_once_and_jobs_of_its_window_build_nothing(tiny_piflow, built_graphs):
    """A window's middle segments all decode through the same compiled functions: the warmup decodes one of them
    (a 33-frame window: 9 latent frames, 1 + 4 + 4, then the 2-latent-frame call for the single-frame shape), and
    a job of the whole window, with every segment, on one tile or 2x2 tiles, builds no graph. Before, the warmup
    decoded all of them (bench/RESULTS.md, issue 22)."""
    window = 33
    engine = SREngine.from_pretrained(str(tiny_piflow), compile_transformer=False, compile_decoder=True)
    segments = len(engine._segments(engine._latent_frames(window)))
    calls = []
    hook = engine.replicas[0].vae.decoder.register_forward_pre_hook(lambda _, args: calls.append(args[0].shape[2]))
    try:
        engine.warmup(window)
        assert built_graphs  # the warmup compiled
        assert calls == [1, engine.decode_segment, 1, 1] and segments == 3  # not [1, 4, 4, 1, 1]
        built_graphs.clear()
        calls.clear()
        for size, tiles in (((16, 32), 1), (CLIP_SIZE[2], 4)):  # one landscape tile, 2x2 of them
            video = torch.rand(window, 3, *size, generator=torch.Generator().manual_seed(window))
            info = engine.upscale(video, SRRequest(scale=2, seed=3), lambda _: None)
            assert (info.frames, info.tiles) == (window, tiles)
    finally:
        hook.remove()
    assert len(calls) == segments * (1 + 4)  # every segment of every tile decoded
    assert built_graphs == []


def test_the_warmup_denoises_once_and_jobs_of_its_length_build_no_transformer_graph(tiny_piflow, built_graphs, caplog):
    """Every denoising step runs the same compiled graphs (the timestep is a tensor input): the warmup runs one step
    per tile, and a job of its window length at the default two steps builds nothing. The worker's log gives each
    warmed-up tile shape its seconds and graph counts (a start on the GPU is read from it)."""
    import logging

    engine = SREngine.from_pretrained(str(tiny_piflow), compile_transformer=True, compile_decoder=False)
    steps = []
    hook = engine.replicas[0].transformer.register_forward_pre_hook(lambda *_: steps.append(1))
    try:
        with caplog.at_level(logging.INFO, logger="vsrq.engine"):
            engine.warmup(9)
        assert len(steps) == 1  # one tile, one step (9 frames: 3 latent ones, decoded 1 + 1 + 1: no extra call)
        assert built_graphs
        [line] = [record.getMessage() for record in caplog.records if record.getMessage().startswith("warmed up")]
        assert line.startswith("warmed up landscape tiles (64x32, 9 frames, 1 tiles, lossless) in ")
        assert " graphs traced" in line
        built_graphs.clear()
        steps.clear()
        info = engine.upscale(clip(2, frames=9), SRRequest(scale=2, seed=3), lambda _: None)
    finally:
        hook.remove()
    assert info.frames == 9 and len(steps) == SRRequest.num_inference_steps * info.tiles == 2 * info.tiles
    assert built_graphs == []


@pytest.mark.parametrize("qualities", [("lossless", "high"), ("lossless",)])
def test_a_warmup_with_high_builds_its_graphs_so_its_first_job_builds_none(
    tiny_piflow, built_graphs, caplog, qualities
):
    """`high`'s levers swap the transformer blocks' layers and attention processor: its compiled blocks are graphs
    of their own. A worker warmed up for `lossless,high` has them before its first `high` job of the window's
    length; one warmed up for `lossless` alone builds them in that job. Either way a `lossless` job after it
    builds nothing, and a warmup logs one line per tier and tile shape."""
    import logging

    engine = SREngine.from_pretrained(str(tiny_piflow), compile_transformer=True, compile_decoder=True)
    with caplog.at_level(logging.INFO, logger="vsrq.engine"):
        engine.warmup(9, qualities=qualities)
    lines = [record.getMessage() for record in caplog.records if record.getMessage().startswith("warmed up")]
    assert [line.split(") in ")[0] for line in lines] == [
        f"warmed up landscape tiles (64x32, 9 frames, 1 tiles, {tier}" for tier in qualities
    ]
    built_graphs.clear()
    high = run(engine, clip(2, frames=9), SRRequest(scale=2, seed=3, quality="high"))
    assert (built_graphs == []) == ("high" in qualities)
    built_graphs.clear()
    lossless = run(engine, clip(2, frames=9), SRRequest(scale=2, seed=3))
    assert built_graphs == [] and not torch.equal(high, lossless)


@pytest.mark.parametrize(
    ("order", "tiles", "gpu_gib", "host_gib", "expected"),
    [
        ("lockstep", [9], 139, 100, "lockstep"),  # W1 on an H200
        ("lockstep", [25], 139, 100, "lockstep"),  # x4 too (measured at 82 GiB there)
        ("lockstep", [9], 79.6, 100, "lockstep"),
        ("lockstep", [25], 79.6, 100, "parked"),  # x4 on an 80 GB GPU: 46 GiB of caches go to the host
        ("lockstep", [13, 12], 79.6, 100, "lockstep"),  # x4 on two such GPUs: each holds its share
        ("lockstep", [25], 79.6, 80, "tile_major"),  # 25 x 2 GiB pinned would take over half the host
        ("lockstep", [9], 23.6, 100, "parked"),  # W1 on a 24 GB GPU
        ("parked", [9], 139, 100, "parked"),  # asked for (`balanced`)
        ("parked", [2, 2], 139, 100, "lockstep"),  # nothing to save: three caches stay in flight anyway
        ("parked", [9], 139, 30, "tile_major"),
        ("tile_major", [25], 23.6, 1, "tile_major"),
    ],
)
def test_the_decode_order_follows_gpu_and_host_memory(order, tiles, gpu_gib, host_gib, expected):
    """With the full-size decoder's 1.85 GiB caches per W1 tile (2 GiB pinned) and 10 GiB of weights per GPU."""
    from worker.sr.decode_order import decode_order_for

    gpus = [(count, int(gpu_gib * 2**30), 10 * 2**30) for count in tiles]
    assert decode_order_for(order, gpus, 1_988_493_312, int(host_gib * 2**30)) == expected
