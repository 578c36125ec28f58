"""Temporal windows: the plan, the crossfade, bounded memory, per-window noise, and resuming from kept windows."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np
import pytest
import torch

from worker.errors import Cancelled, InvalidRequest
from worker.frames import quantise, unit
from worker.sr.request import RunInfo, SRRequest
from worker.sr.windows import DirectoryWindowStore, plan_windows, upscale_windows


def test_a_300_frame_clip_is_three_balanced_windows_of_1_plus_4k():
    plan = plan_windows(300, window=121, overlap=16)
    assert [(w.start, w.stop) for w in plan.windows] == [(0, 113), (97, 210), (194, 300)]
    assert plan.length == 113 and (plan.length - 1) % 4 == 0
    assert all(a.stop - b.start == 16 for a, b in zip(plan.windows, plan.windows[1:]))


@pytest.mark.parametrize("frames", [1, 2, 121, 122, 137, 1000])
def test_windows_cover_every_frame_with_the_overlap(frames):
    plan = plan_windows(frames, window=121, overlap=16)
    assert plan.windows[0].start == 0 and plan.windows[-1].stop == frames
    assert all(w.frames <= 121 for w in plan.windows)
    assert all(a.stop - b.start == 16 for a, b in zip(plan.windows, plan.windows[1:]))
    assert len(plan.windows) == (1 if frames <= 121 else -(-(frames - 16) // 105))


@pytest.mark.parametrize(("window", "overlap"), [(120, 16), (3, 0), (33, 17), (33, -4)])
def test_bad_window_settings_are_refused(window, overlap):
    with pytest.raises(InvalidRequest):
        plan_windows(300, window, overlap)


def test_a_short_window_alone_takes_the_overlap_it_can_hold():
    """`--window 9` alone was refused: "the window overlap must be in [0, 4] frames, got 16", a 16 nobody gave."""
    plan = plan_windows(11, 9)
    assert (plan.overlap, [(w.start, w.stop) for w in plan.windows]) == (4, [(0, 9), (5, 11)])
    assert plan_windows(300).overlap == 16  # the default where the window holds it
    with pytest.raises(InvalidRequest, match="got 16"):  # an overlap asked for is still checked
        plan_windows(11, 9, 16)


@dataclass
class Offset:
    """A x1 'upscaler' adding a different constant per window, emitting in chunks of 3 like a streaming decode."""

    calls: list[tuple[int, ...]] = field(default_factory=list)
    devices: tuple = (torch.device("cpu"),)

    def output_size(self, height, width, scale):
        return height, width

    def upscale(self, video, request, sink, progress=None, cancelled=None):
        self.calls.append(request.noise_key)
        out = unit(video) + 0.1 * request.noise_key[-1]
        for start in range(0, len(out), 3):
            sink(out[start : start + 3])
        return RunInfo((8, 8), (8, 8), len(video), (len(video), 8, 8), 1, ["cpu"])


def frames(count: int, value: float = 0.25) -> list[np.ndarray]:
    return [np.full((8, 8, 3), round(value * 255), np.uint8) for _ in range(count)]


def collect(upscaler, source, plan, **kwargs) -> torch.Tensor:
    chunks = []
    upscale_windows(upscaler, source, plan, SRRequest(scale=2), chunks.append, **kwargs)
    return torch.cat(chunks)


def test_overlaps_crossfade_smoothly_from_one_window_into_the_next():
    plan = plan_windows(40, window=21, overlap=8)  # windows [0, 21) [13, 34) [26, 40)
    upscaler = Offset()
    out = collect(upscaler, frames(40), plan)[:, 0, 0, 0]
    assert upscaler.calls == [(0,), (1,), (2,)]  # every window draws its own noise
    assert len(out) == 40
    base = 64 / 255
    assert torch.allclose(out[:13], torch.full((13,), base))  # window 0 alone
    fade = out[13:21] - base  # 0 -> 0.1, strictly rising, never a jump
    assert torch.all(fade[1:] > fade[:-1]) and 0 < fade[0] < 0.02 and 0.08 < fade[-1] < 0.1
    assert torch.allclose(fade, 0.1 * plan.ramp()[:, 0, 0, 0])
    assert torch.allclose(out[21:26], torch.full((5,), base + 0.1))  # window 1 alone


def test_memory_holds_one_window_of_input_not_the_clip():
    plan = plan_windows(200, window=21, overlap=4)
    pulled, emitted, most = [0], [0], [0]

    def source():
        for frame in frames(200):
            pulled[0] += 1
            most[0] = max(most[0], pulled[0] - emitted[0])
            yield frame

    def sink(chunk):
        emitted[0] += len(chunk)

    upscale_windows(Offset(), source(), plan, SRRequest(scale=2), sink)
    assert emitted[0] == 200
    assert most[0] <= plan.length + plan.overlap


class Recording:
    """Wraps an upscaler; records which windows it computed."""

    def __init__(self, upscaler):
        self.upscaler, self.windows = upscaler, []
        self.devices = upscaler.devices

    def output_size(self, *args):
        return self.upscaler.output_size(*args)

    def upscale(self, video, request, sink, progress=None, cancelled=None):
        self.windows.append(request.noise_key[-1])
        return self.upscaler.upscale(video, request, sink, progress, cancelled)


def test_a_cancelled_job_resumes_from_kept_windows_and_matches_an_uninterrupted_run(engine, tmp_path):
    # one tile of the tiny model per frame; 4 windows of 9 frames, the shortest with a 4-frame overlap
    video = [np.random.default_rng(0).integers(0, 256, (16, 32, 3), dtype=np.uint8) for _ in range(24)]
    plan = plan_windows(24, window=9, overlap=4)
    assert len(plan.windows) == 4

    def run(store=None, cancelled=None):
        upscaler, out = Recording(engine), []
        try:
            upscale_windows(upscaler, iter(video), plan, SRRequest(scale=2, seed=5), lambda f: out.append(quantise(f)), cancelled=cancelled, store=store)
        except Cancelled:
            pass
        return upscaler.windows, torch.cat(out)

    computed, uninterrupted = run()
    assert computed == [0, 1, 2, 3] and len(uninterrupted) == 24

    key = "job-1"
    store = DirectoryWindowStore(tmp_path / "windows", key)
    kept = lambda: sorted(p.name for p in (tmp_path / "windows").glob("*.json") if p.name != "job.json")
    computed, partial = run(store, cancelled=lambda: len(kept()) == 2)  # dies as the third window starts
    assert computed == [0, 1] and len(partial) < 24

    # a window's float tail (the next window fades from it) goes once the next window is kept: a replay needs none
    tails = lambda: sorted(p.name for p in (tmp_path / "windows").glob("*.tail.npy"))
    assert kept() == ["window-00000.json", "window-00001.json"] and tails() == ["window-00001.tail.npy"]

    computed, resumed = run(DirectoryWindowStore(tmp_path / "windows", key))
    assert computed == [2, 3]  # only the missing windows
    assert torch.equal(resumed, uninterrupted)
    assert tails() == []  # the last window has none

    # window 1 kept, then not replayed (its pixels lost): window 0's tail, dropped, is computed again for it
    (tmp_path / "windows" / "window-00001.u8").unlink()
    computed, resumed = run(DirectoryWindowStore(tmp_path / "windows", key))
    assert computed == [0, 1]  # window 0's frames replayed, its tail computed; 2 and 3 replayed
    assert torch.equal(resumed, uninterrupted)

    computed, _ = run(DirectoryWindowStore(tmp_path / "windows", "another job"))
    assert computed == [0, 1, 2, 3]  # a store kept for other settings is never replayed


def test_a_window_folder_left_by_a_crash_is_taken_back_and_emptied(tmp_path):
    """A crash while the marker was written (rewritten in place, half of it) had every rerun refuse the folder as
    another's; window 100,000 and on (six digits) were refused too, and never deleted."""
    folder = tmp_path / "windows"
    folder.mkdir()
    (folder / "job.json.partial").write_text('{"ke')
    (folder / "window-100000.json").write_text("{}")
    (folder / "window-00001.u8.partial").write_bytes(b"x")
    store = DirectoryWindowStore(folder, "job-1")
    kept = sorted(path.name for path in folder.iterdir())
    assert kept == ["job.json", "window-00001.u8.partial", "window-100000.json"]
    store.clear()
    assert not folder.exists()


def test_quantise_rounds_clamps_and_hands_the_encoder_contiguous_rgb():
    """Out-of-range values clamp, halves round to even, and the (n, H, W, 3) result is contiguous (the encoder's
    RGB-to-YUV conversion reads strided frames at a third of the speed); dequantise inverts it exactly."""
    from worker.frames import dequantise

    frames = torch.tensor([-0.5, 0.0, 0.5 / 255, 1.5 / 255, 0.5, 1.0, 7.0]).reshape(1, 1, 1, 7).expand(2, 3, 1, 7)
    pixels = quantise(frames)
    assert pixels.shape == (2, 1, 7, 3) and pixels.is_contiguous() and pixels.dtype == torch.uint8
    assert pixels[0, 0, :, 0].tolist() == [0, 0, 0, 2, 128, 255, 255]
    assert torch.equal(quantise(dequantise(pixels)), pixels)


def test_windows_kept_by_another_version_replay_when_readable_and_are_computed_again_when_not(tmp_path):
    """A rolling deploy: a newer worker kept windows whose record has a field this version does not know (replayed),
    or one it cannot read (computed again, never a failed job); the frames are the uninterrupted run's."""
    video, plan = frames(30), plan_windows(30, window=13, overlap=4)  # 3 windows
    uninterrupted = collect(Offset(), iter(video), plan)
    stored = DirectoryWindowStore(tmp_path / "windows", "job")
    two_kept = lambda: len(list(stored.directory.glob("window-*.json"))) == 2
    with pytest.raises(Cancelled):
        collect(Offset(), iter(video), plan, store=stored, cancelled=two_kept)
    for index, change in ((0, {"made_on": "a newer worker"}), (1, {"levers": "not a mapping"})):
        meta = stored._path(index, "json")
        kept = json.loads(meta.read_text())
        meta.write_text(json.dumps({**kept, "made": {**kept["made"], **change}}))
    resumed = Offset()
    replayed = collect(resumed, iter(video), plan, store=DirectoryWindowStore(tmp_path / "windows", "job"))
    assert torch.equal(replayed, uninterrupted)
    assert [key[-1] for key in resumed.calls] == [0, 1, 2]  # window 0 replayed, then run again for its tail


@pytest.mark.parametrize("pixels", ["missing", "short", "empty JSON", "JSON of another shape"])
def test_a_kept_window_whose_files_are_missing_short_or_unreadable_is_computed_again(pixels, tmp_path):
    """A window's JSON without its pixel file, or with one not of its shape (files that came from two attempts), or
    a JSON cut short (a process killed as it wrote one; CI's Ctrl-C once landed there): the window is computed again,
    never a crash, and the frames are the uninterrupted run's."""
    video, plan = frames(30), plan_windows(30, window=13, overlap=4)  # 3 windows
    uninterrupted = collect(Offset(), iter(video), plan, store=DirectoryWindowStore(tmp_path / "windows", "job"))
    u8 = DirectoryWindowStore(tmp_path / "windows", "job")._path(1, "u8")
    if pixels == "missing":
        u8.unlink()
    elif pixels == "empty JSON":
        u8.with_suffix(".json").write_text("")
    elif pixels == "JSON of another shape":
        u8.with_suffix(".json").write_text("[]")
    else:
        u8.write_bytes(u8.read_bytes()[:-1])
    resumed = Offset()
    replayed = collect(resumed, iter(video), plan, store=DirectoryWindowStore(tmp_path / "windows", "job"))
    assert torch.equal(quantise(replayed), quantise(uninterrupted))  # the encoder's frames
    assert [key[-1] for key in resumed.calls] == [0, 1]  # window 0 replayed, then run again for its tail


@pytest.mark.parametrize(("length", "overlap", "stand_alone"), [(25, 11, False), (17, 4, True)])
def test_a_window_computed_after_replays_fades_from_the_uninterrupted_tail(length, overlap, stand_alone, tmp_path):
    """Window 2 lost after windows 0 and 1 were kept: computed again, it fades from window 1's tail. Where windows are
    shorter than twice their overlap (a reviewer's 21 frames over 11), a tail holds frames faded into from the window
    before it: kept then, never dropped and computed again alone, which gave other pixels."""
    video, plan = frames(40), plan_windows(40, window=length, overlap=overlap)  # 3 windows
    assert len(plan.windows) == 3 and plan.tails_stand_alone == stand_alone
    store = DirectoryWindowStore(tmp_path / "windows", "job")
    uninterrupted = collect(Offset(), iter(video), plan, store=store)
    tails = sorted(path.name for path in store.directory.glob("*.tail.npy"))
    assert tails == ([] if stand_alone else ["window-00000.tail.npy", "window-00001.tail.npy"])
    store._path(2, "u8").unlink()
    resumed = Offset()
    replayed = collect(resumed, iter(video), plan, store=DirectoryWindowStore(tmp_path / "windows", "job"))
    assert torch.equal(quantise(replayed), quantise(uninterrupted))
    assert [key[-1] for key in resumed.calls] == ([1, 2] if stand_alone else [2])  # window 1 again for its tail


def test_16_bit_windows_are_kept_whole_and_8_bit_ones_never_replay_into_a_10_bit_output(tmp_path):
    """A 10-bit output's frames are quantised to 16 bits; its kept windows keep them so (8 bits would band the
    resumed part of the output), and windows kept at 8 bits are computed again rather than replayed into it."""
    video = [np.full((8, 8, 3), 1000 * (i + 1), np.uint16) for i in range(30)]
    plan = plan_windows(30, window=13, overlap=4)  # 3 windows
    deep = {"dtype": torch.uint16}
    uninterrupted = quantise(collect(Offset(), iter(video), plan, **deep), torch.uint16)
    stored = DirectoryWindowStore(tmp_path / "deep", "job")
    with pytest.raises(Cancelled):
        collect(Offset(), iter(video), plan, store=stored, cancelled=lambda: len(list(stored.directory.glob("window-*.json"))) == 2, **deep)
    resumed = Offset()
    replayed = collect(resumed, iter(video), plan, store=DirectoryWindowStore(tmp_path / "deep", "job"), **deep)
    assert [key[-1] for key in resumed.calls] == [2]  # two windows replayed
    assert torch.equal(quantise(replayed, torch.uint16), uninterrupted)  # to the last of 16 bits

    shallow = DirectoryWindowStore(tmp_path / "shallow", "job")
    collect(Offset(), iter(video), plan, store=shallow)  # kept at 8 bits
    again = Offset()
    collect(again, iter(video), plan, store=DirectoryWindowStore(tmp_path / "shallow", "job"), **deep)
    assert [key[-1] for key in again.calls] == [0, 1, 2]
