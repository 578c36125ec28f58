"""A tile's denoising split over several CPU "devices" (sequence parallel, Ulysses over heads): the same output as one
device within float tolerance, the same bytes from the same group every time, whole tiles untouched, and a failure
or a cancellation in one device thread stops the whole group instead of leaving it at a barrier.

The tiny transformer has 2 heads: 3 devices split them unevenly (1, 1, 0) and 4 leave two devices without heads."""

from __future__ import annotations

import threading

import pytest
import torch

from tests.conftest import clip, run
from worker.errors import Cancelled
from worker.sr import split
from worker.sr.devices import Schedule
from worker.sr.engine import SREngine
from worker.sr.request import SRRequest
from worker.sr.tiling import Tile

REQUEST = SRRequest(scale=2, seed=3)


def one_tile(seed: int = 0) -> torch.Tensor:
    """A clip the tiny model's (32, 64) landscape tile covers whole at x2 (W2 at full size: one tile)."""
    return torch.rand(9, 3, 16, 32, generator=torch.Generator().manual_seed(seed))


def upscale(engine: SREngine, video: torch.Tensor, request: SRRequest = REQUEST) -> tuple[torch.Tensor, int]:
    chunks: list[torch.Tensor] = []
    info = engine.upscale(video, request, chunks.append)
    return torch.cat(chunks), info.split


def psnr(a: torch.Tensor, b: torch.Tensor) -> float:
    mse = torch.mean((a.double() - b.double()) ** 2).item()
    return float("inf") if mse == 0 else 10 * torch.log10(torch.tensor(1 / mse)).item()


@pytest.fixture(scope="module")
def engines(tiny_piflow) -> dict[tuple[int, str], SREngine]:
    cache: dict[tuple[int, str], SREngine] = {}

    def get(devices: int, mode: str = "auto") -> SREngine:
        if (devices, mode) not in cache:
            cache[devices, mode] = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu"] * devices, split=mode)
        return cache[devices, mode]

    return get


@pytest.mark.parametrize("devices", [2, 3, 4])
@pytest.mark.parametrize(("video", "mode"), [(one_tile(), "auto"), (clip(2), "on")], ids=["one-tile", "four-tiles-forced"])
def test_a_split_tile_gives_the_output_of_one_device(engine, engines, devices, video, mode):
    """One tile on a group (auto splits it) and four tiles forced split: within float tolerance of one device."""
    expected, _ = upscale(engine, video)
    output, degree = upscale(engines(devices, mode), video)
    difference = (output - expected).abs().max().item()
    print(f"FIGURE split {devices} devices, {mode}: max |delta| {difference:.3g}, PSNR {psnr(output, expected):.1f} dB")
    assert degree == devices
    assert output.shape == expected.shape
    assert difference <= 1e-5 and psnr(output, expected) >= 50


def test_two_groups_split_their_tiles_side_by_side(engine, engines):
    """Four devices in two groups of two (forced), each denoising two of the four tiles, also two at a time."""
    expected, _ = upscale(engine, clip(2))
    for request in (REQUEST, SRRequest(scale=2, seed=3, tiles_batch_size=2)):
        output, degree = upscale(engines(4, 2), clip(2), request)
        assert degree == 2
        assert (output - expected).abs().max().item() <= 1e-5 and psnr(output, expected) >= 50


def test_a_flow_matching_checkpoint_without_latent_upscaler_splits_alike(tiny_checkpoints):
    """The other scheduler, and low-resolution latents encoded per tile (by the group's first device only)."""
    source = str(tiny_checkpoints[("flowmatch", False)])
    expected, _ = upscale(SREngine.from_pretrained(source), one_tile())
    output, degree = upscale(SREngine.from_pretrained(source, devices=["cpu"] * 3), one_tile())
    assert degree == 3
    assert (output - expected).abs().max().item() <= 1e-5 and psnr(output, expected) >= 50


def test_a_group_gives_the_same_bytes_every_time_and_counts_each_step_once(engines):
    first, _ = upscale(engines(3), one_tile(1))
    events: list = []
    chunks: list[torch.Tensor] = []
    engines(3).upscale(one_tile(1), REQUEST, chunks.append, progress=events.append)
    assert torch.equal(first, torch.cat(chunks))
    assert [event.done for event in events] == list(range(1, events[-1].total + 1))


def test_whole_tiles_stay_bit_identical_to_one_device(engine, engines):
    """Four tiles on two devices: auto splits nothing, and the output is one device's to the bit."""
    expected, _ = upscale(engine, clip(2))
    output, degree = upscale(engines(2), clip(2))
    assert degree == 1 and torch.equal(output, expected)


@pytest.mark.parametrize(
    ("tiles", "devices", "expected"),
    [(1, 2, 2), (1, 8, 8), (2, 8, 4), (3, 8, 8), (4, 8, 2), (9, 8, 1), (9, 2, 1), (1, 7, 7), (1, 1, 1)],
)
def test_the_split_follows_from_the_tile_and_device_counts(tiles, devices, expected):
    assert split.degree(tiles, devices) == expected
    assert split.degree(tiles, devices, "off") == 1
    assert split.degree(tiles, devices, "on") == devices
    assert split.degree(tiles, devices, 1) == 1


def test_a_forced_degree_must_divide_the_group():
    assert split.degree(9, 8, 4) == 4
    with pytest.raises(ValueError, match="divide"):
        split.degree(9, 8, 3)
    with pytest.raises(ValueError, match="split must be"):
        split.degree(9, 8, "sometimes")


def test_a_split_schedule_shares_every_tile_within_its_group_and_decodes_each_once():
    tiles = [Tile(i, 0, 0) for i in range(3)]
    schedule = Schedule.split(tiles, 4, 2)
    assert schedule.groups == ((0, 1), (2, 3))
    assert [t.index for t in schedule.denoise[1]] == [0, 2] and [t.index for t in schedule.denoise[3]] == [1]
    assert sorted(t.index for slot in schedule.decode.values() for t in slot) == [0, 1, 2]
    assert {slot: [t.index for t in tiles] for slot, tiles in schedule.encode.items()} == {0: [0, 2], 1: [], 2: [1], 3: []}
    assert [schedule.hands_over(slot) for slot in range(4)] == [True, False, True, False]


@pytest.fixture
def finishes(monkeypatch):
    """`finishes(call)`: what `call()` raised, once it returned within a minute. A group left at a barrier fails the
    test: its barriers are broken then, so the stuck device threads end too (the interpreter waits for them)."""
    groups: list[split.Group] = []
    join = split.join

    def recording(*args):
        shards = join(*args)
        groups.extend(shard.group for shard in shards.values())
        return shards

    monkeypatch.setattr(split, "join", recording)

    def finished(call) -> BaseException | None:
        return _finishes(call, groups)

    return finished


def _finishes(call, groups: list[split.Group], seconds: float = 60) -> BaseException | None:
    raised: list[BaseException | None] = [None]

    def target() -> None:
        try:
            call()
        except BaseException as error:  # noqa: BLE001 (handed to the test)
            raised[0] = error

    thread = threading.Thread(target=target, daemon=True)
    thread.start()
    thread.join(seconds)
    hung = thread.is_alive()
    for group in groups:
        group.abort()
    assert not hung, "the split group hung"
    return raised[0]


def test_a_device_failing_mid_split_stops_its_group(engines, engine, finishes):
    """The second device fails inside an attention layer, late, while the first waits for it at the exchange: the
    call ends with that error, and the engine works on."""
    group = engines(2, "on")
    attention = group.replicas[0].transformer.visual_transformer_blocks[1].self_attention
    calls = {"vsrq-device_1": 0}

    def fail(*_) -> None:
        name = threading.current_thread().name
        if name in calls:
            calls[name] += 1
            if calls[name] == 3:
                threading.Event().wait(0.2)  # the other device is at the barrier by now
                raise RuntimeError("device lost")

    hook = attention.register_forward_pre_hook(fail)
    try:
        error = finishes(lambda: upscale(group, clip(2)))
    finally:
        hook.remove()
    assert isinstance(error, RuntimeError) and "device lost" in str(error)
    assert calls["vsrq-device_1"] == 3
    expected, _ = upscale(engine, clip(2))
    assert torch.equal(upscale(group, clip(2))[0], expected)


def test_a_cancellation_mid_split_stops_the_group(engines, finishes):
    """Cancelled after the first denoising step of a split tile, as only one device thread sees it (each asks the
    job store itself): the call raises `Cancelled` and no step runs after."""
    events: list = []
    group = engines(3)

    def cancelled() -> bool:
        return len(events) >= 1 and threading.current_thread().name == "vsrq-device_0"

    def cancel() -> None:
        group.upscale(one_tile(), REQUEST, lambda _: None, progress=events.append, cancelled=cancelled)

    error = finishes(cancel)
    assert isinstance(error, Cancelled)
    assert [event.done for event in events] == [1]


def test_a_worker_splits_only_when_its_operator_says_so(tiny_piflow, monkeypatch):
    """The split is unmeasured on GPUs: a worker keeps whole tiles unless `VSRQ_WORKER_SPLIT` asks for it."""
    from worker.service import WorkerSettings
    from worker.sr.backends import open_upscaler

    assert WorkerSettings().split == "off"
    monkeypatch.setenv("VSRQ_WORKER_SPLIT", "auto")
    config = WorkerSettings()
    assert open_upscaler(str(tiny_piflow), ["cpu", "cpu"], split=config.split, warmup_frames=None).split == "auto"
    assert open_upscaler(str(tiny_piflow), ["cpu", "cpu"], split=WorkerSettings(split="off").split).split == "off"
