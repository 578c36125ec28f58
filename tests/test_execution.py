"""Default (per-tile) noise: output independent of tile batching, device count and decode segmenting; frames
stream out segment by segment; progress and cancellation work between tiles."""

from __future__ import annotations

import pytest
import torch

from tests.conftest import clip, run
from worker.sr.engine import SREngine, SRRequest
from worker.sr.errors import Cancelled, InvalidRequest


@pytest.fixture(scope="module")
def baseline(engine):
    return run(engine, clip(2), SRRequest(scale=2, seed=3))


@pytest.mark.parametrize("tiles_batch_size", [2, 4])
def test_tile_batch_size_does_not_change_output(engine, baseline, tiles_batch_size):
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3, tiles_batch_size=tiles_batch_size)), baseline)


def test_two_devices_give_the_same_bits(tiny_piflow, baseline):
    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu"])
    assert len(engine.replicas) == 2
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3, tiles_batch_size=2)), baseline)


@pytest.mark.parametrize("devices", [["cpu"], ["cpu", "cpu"]])
def test_tile_major_decode_gives_the_same_bits(tiny_piflow, baseline, devices):
    engine = SREngine.from_pretrained(str(tiny_piflow), devices=devices, decode_order="tile_major")
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3)), baseline)


@pytest.mark.parametrize("decode_segment", [1, 2, 64])
def test_decode_segment_does_not_change_output(tiny_piflow, baseline, decode_segment):
    engine = SREngine.from_pretrained(str(tiny_piflow), decode_segment=decode_segment)
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3)), baseline)


def test_seed_changes_output(engine, baseline):
    other = run(engine, clip(2), SRRequest(scale=2, seed=4))
    assert (other - baseline).abs().max() > 1e-3


def test_frames_stream_out_in_bounded_segments(engine):
    """Each sink call holds at most one decode segment, whatever the clip length, and arrives before decoding ends."""
    for frames in (9, 33):
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
    # 4 tiles x (3 steps + 2 decode segments of 3 latent frames).
    assert events[-1].done == events[-1].total == 4 * (3 + 2)
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


def test_warmup_gives_every_device_a_tile(tiny_piflow):
    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu", "cpu"])
    assert not engine.compiles  # nothing is compiled on the CPU: the worker skips the warmup there
    info = engine.warmup(frames=5)
    assert info.tiles >= 3 and info.frames == 5


@pytest.mark.parametrize("mode", ["speed", "memory"])
def test_performance_modes_give_the_same_bits(tiny_piflow, baseline, mode):
    from worker.sr.backends import PERFORMANCE_MODES, open_upscaler

    engine = open_upscaler(str(tiny_piflow), ["cpu"], mode)
    assert (engine.decode_order, engine.decode_segment) == tuple(PERFORMANCE_MODES[mode].values())
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2, seed=3)), baseline)


def test_new_compiled_shapes_run_device_by_device_then_in_parallel(tiny_piflow, baseline):
    """On GPUs the first call on new shapes compiles, and Dynamo tracing in one thread breaks module calls in the
    others: such a call runs the devices in turn; later calls run them at once, every thread without gradients."""
    import threading

    engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu"])
    engine.compiles = True  # what compiled blocks set on GPUs (compiling itself is GPU-only)
    calls: list[tuple[str, bool]] = []
    transformer = engine.replicas[0].transformer
    hook = transformer.register_forward_pre_hook(
        lambda *_: calls.append((threading.current_thread().name, torch.is_grad_enabled()))
    )
    try:
        first = run(engine, clip(2), SRRequest(scale=2, seed=3))
        in_turn = list(calls)
        calls.clear()
        second = run(engine, clip(2), SRRequest(scale=2, seed=3))
    finally:
        hook.remove()
    assert {thread for thread, _ in in_turn} == {"MainThread"}
    assert all(thread.startswith("vsrq-device") for thread, _ in calls)
    assert not any(grad for _, grad in in_turn + calls)
    assert torch.equal(first, baseline) and torch.equal(second, baseline)
