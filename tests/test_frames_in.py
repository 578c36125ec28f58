"""Frames reach an upscaler as integers (uint8, uint16) and become float where it computes: the same bits as the
float frames the host made of them before (x / full scale on the CPU), through the engine, the window runner and
Lanczos."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tests.conftest import CLIP_SIZE, FRAMES, run
from worker.frames import FULL_SCALE, unit
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.sr.windows import plan_windows, upscale_windows

NUMPY = {torch.uint8: np.uint8, torch.uint16: np.uint16}
DEVICES = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]


def decoded(dtype: torch.dtype, size=CLIP_SIZE[2], frames: int = FRAMES) -> list[np.ndarray]:
    """Frames as the reader yields them: (H, W, 3) RGB, random over the whole range of `dtype`."""
    rng = np.random.default_rng(7)
    top = int(FULL_SCALE[dtype])
    return [rng.integers(0, top + 1, (*size, 3), dtype=NUMPY[dtype]) for _ in range(frames)]


def as_float(frames: list[np.ndarray]) -> torch.Tensor:
    """The float window the host made before (`upscale_windows`' `_video` up to this change)."""
    pixels = torch.from_numpy(np.stack(frames))
    video = torch.empty(pixels.shape[0], 3, *pixels.shape[1:3])
    video.copy_(pixels.permute(0, 3, 1, 2))
    return video.div_(255.0 if pixels.dtype == torch.uint8 else 65535.0)


def stacked(frames: list[np.ndarray]) -> torch.Tensor:
    """(F, 3, H, W) integers, a view of the frames stacked, as the window runner hands them over."""
    return torch.from_numpy(np.stack(frames)).permute(0, 3, 1, 2)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16])
def test_every_integer_value_becomes_the_float_the_cpu_divides_it_into(device, dtype):
    """Every value of the type, on every device here: CUDA would round 126 of the 256 8-bit values otherwise if it
    divided by a scalar (through its reciprocal)."""
    values = torch.arange(int(FULL_SCALE[dtype]) + 1, dtype=torch.int32).to(dtype)
    expected = values.float() / FULL_SCALE[dtype]
    got = unit(values.view(-1, 1, 1, 1).expand(-1, 3, 1, 1), device)
    assert got.dtype == torch.float32 and got.is_contiguous() and got.device.type == device
    assert torch.equal(got.cpu(), expected.view(-1, 1, 1, 1).expand(-1, 3, 1, 1))


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16])
def test_the_engine_given_integer_frames_gives_the_bits_of_their_floats(engine, dtype):
    frames, request = decoded(dtype), SRRequest(scale=2, seed=3)
    assert torch.equal(run(engine, stacked(frames), request), run(engine, as_float(frames), request))


class Receiving:
    """The engine as the window runner's upscaler, noting what each call was handed."""

    def __init__(self, upscaler) -> None:
        self.upscaler, self.devices, self.received = upscaler, upscaler.devices, []

    def output_size(self, *args):
        return self.upscaler.output_size(*args)

    def upscale(self, video, request, sink, progress=None, cancelled=None):
        self.received.append((video.dtype, tuple(video.shape)))
        return self.upscaler.upscale(video, request, sink, progress, cancelled)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16])
def test_the_window_runner_hands_the_engine_integer_frames_and_the_output_keeps_its_bits(engine, dtype):
    """The host makes no float window: the engine gets the reader's integers, and gives what it gave for the float
    window the host made before."""
    frames, request = decoded(dtype), SRRequest(scale=2, seed=3)
    receiving, chunks = Receiving(engine), []
    upscale_windows(receiving, iter(frames), plan_windows(FRAMES), request, chunks.append)
    assert receiving.received == [(dtype, (FRAMES, 3, *CLIP_SIZE[2]))]
    before = run(engine, as_float(frames), SRRequest(scale=2, seed=3, noise_key=(0,)))  # the window's own noise
    assert torch.equal(torch.cat(chunks), before)


@pytest.mark.parametrize("dtype", [torch.uint8, torch.uint16])
def test_lanczos_given_integer_frames_gives_the_bytes_of_their_floats(dtype):
    frames, request = decoded(dtype, size=(10, 14), frames=3), SRRequest(scale=2.25)
    lanczos = LanczosUpscaler()
    assert torch.equal(run(lanczos, stacked(frames), request), run(lanczos, as_float(frames), request))


def test_frames_of_another_integer_type_are_a_bug_not_a_request():
    """Only code makes frames (the reader gives uint8 or uint16): another type is a `TypeError`, never an
    `InvalidRequest` a job would fail with as if its input were at fault."""
    with pytest.raises(TypeError, match="uint8 or uint16, got torch.int32"):
        unit(torch.zeros(1, 3, 2, 2, dtype=torch.int32))
