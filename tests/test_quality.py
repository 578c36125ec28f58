"""The quality tiers on the tiny checkpoint (CPU): `lossless` is the exact engine, `high` close to it, each lever a
switch of its own, and the levers leave the model as they found it."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.conftest import clip, run
from worker.errors import InvalidRequest
from worker.sr import fp8_attention, quality, split
from worker.sr.attention import DenseSDPAProcessor
from worker.sr.engine import SREngine
from worker.sr.fp8 import Fp8Linear, quantise_rows
from worker.sr.request import SRRequest

# Per-frame PSNR of `high` against `lossless` on the tiny random checkpoint (both levers, 9 frames at x2, x2.25 and
# x4, two seeds): 58.6 to 61.5 dB measured; the floor leaves room for other CPUs' rounding. It says the levers are
# wired and sane, not what the full-size model loses (bench/quality.py measures that on a GPU).
TINY_PSNR_FLOOR_DB = 50.0


def psnr_per_frame(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    return 10 * torch.log10(1 / (a - b).pow(2).flatten(1).mean(1).clamp_min(1e-20))


@pytest.fixture(scope="module")
def lossless(engine) -> dict[float, torch.Tensor]:
    return {scale: run(engine, clip(scale), SRRequest(scale=scale)) for scale in (2, 4)}


def test_lossless_is_the_exact_engine_before_and_after_a_high_call(engine, lossless):
    modules = dict(engine.replicas[0].transformer.named_modules())
    run(engine, clip(2), SRRequest(scale=2, quality="high"))
    # the levers are gone again: the same module objects, processors and state dict as before the call
    assert dict(engine.replicas[0].transformer.named_modules()) == modules
    processors = engine.replicas[0].transformer.attn_processors.values()
    assert all(isinstance(split.unwrapped(p), DenseSDPAProcessor) for p in processors)
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2)), lossless[2])
    # an engine whose `high` has no levers runs the exact engine for it, and says so
    exact = SREngine(engine.replicas, high_levers=())
    chunks: list[torch.Tensor] = []
    info = exact.upscale(clip(2), SRRequest(scale=2, quality="high"), chunks.append)
    assert torch.equal(torch.cat(chunks), lossless[2]) and (info.quality, info.levers) == ("lossless", {})


def test_a_high_call_that_fails_while_its_levers_go_in_leaves_lossless_exact(engine, lossless, monkeypatch):
    """The FP8 twins are made one linear at a time (a full GPU can run out of memory part-way): none may stay behind."""
    made = 0

    def of(linear: nn.Linear) -> Fp8Linear:
        nonlocal made
        made += 1
        if made == 3:
            raise torch.OutOfMemoryError("injected: no room for the third FP8 weight")
        return original(linear)

    original = Fp8Linear.of
    monkeypatch.setattr(Fp8Linear, "of", staticmethod(of))  # the fault injected where a real OOM would rise
    modules = dict(engine.replicas[0].transformer.named_modules())
    with pytest.raises(torch.OutOfMemoryError):
        run(engine, clip(2), SRRequest(scale=2, quality="high"))
    monkeypatch.undo()
    assert dict(engine.replicas[0].transformer.named_modules()) == modules
    assert torch.equal(run(engine, clip(2), SRRequest(scale=2)), lossless[2])
    assert not torch.equal(run(engine, clip(2), SRRequest(scale=2, quality="high")), lossless[2])  # and high works


@pytest.mark.parametrize("scale", [2, 4])
def test_high_differs_from_lossless_but_stays_close(engine, lossless, scale):
    chunks: list[torch.Tensor] = []
    info = engine.upscale(clip(scale), SRRequest(scale=scale, quality="high"), chunks.append)
    high = torch.cat(chunks)
    assert high.shape == lossless[scale].shape and not torch.equal(high, lossless[scale])
    psnr = psnr_per_frame(high, lossless[scale])
    assert psnr.min() > TINY_PSNR_FLOOR_DB, psnr
    # what ran, for the job to report: on a CPU the FP8 attention is emulated
    assert info.quality == "high"
    assert info.levers == {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "fp8_emulated"}


def test_each_lever_is_a_switch_of_its_own(engine, lossless):
    outputs, reports = {}, {}
    for levers in [("fp8_linear",), ("fp8_attention",), ("fp8_linear", "fp8_attention")]:
        chunks: list[torch.Tensor] = []
        info = SREngine(engine.replicas, high_levers=levers).upscale(clip(2), SRRequest(scale=2, quality="high"), chunks.append)
        outputs[levers], reports[levers] = torch.cat(chunks), info.levers
    assert {levers: tuple(report) for levers, report in reports.items()} == {levers: levers for levers in reports}
    # every lever changes the output, and each one differently
    distinct = [lossless[2], *outputs.values()]
    assert all(not torch.equal(a, b) for i, a in enumerate(distinct) for b in distinct[i + 1 :])
    with pytest.raises(ValueError, match="unknown quality lever"):
        SREngine(engine.replicas, high_levers=("fp4_everything",))


def test_an_unknown_quality_is_refused(engine):
    with pytest.raises(InvalidRequest, match="quality must be one of lossless, high"):
        run(engine, clip(2), SRRequest(scale=2, quality="extra-high"))


def test_fp8_linear_is_close_to_the_float_linear_and_quantises_its_weight_once():
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    x = torch.randn(3, 5, 64)
    twin = Fp8Linear.of(linear)
    out, exact = twin(x), linear(x)
    assert out.shape == exact.shape and out.dtype == exact.dtype
    relative = ((out - exact).norm() / exact.norm()).item()
    assert 0 < relative < 0.06, relative  # e4m3 keeps 3 mantissa bits: a few percent
    assert Fp8Linear.of(linear) is twin  # kept
    with torch.no_grad():
        linear.weight.mul_(2)  # a new weight (in place: its version moves) is quantised again
    assert Fp8Linear.of(linear) is not twin
    # row-wise scales: a row of large values does not crush a row of small ones
    rows = torch.tensor([[1e-3, -2e-3, 3e-3, 0.0], [100.0, -50.0, 25.0, 1.0]])
    quantised, scale = quantise_rows(rows)
    assert torch.allclose(quantised.float() * scale, rows, rtol=0.07, atol=0)


def test_the_fp8_out_projection_takes_fp8_attention_output_with_its_one_scale():
    """FP8 attention's output (float8, one scale for the whole tensor) goes into the FP8 out projection as written:
    the layer computes on what the float8 values stand for, with every row scaled by that one scale."""
    torch.manual_seed(0)
    linear = nn.Linear(64, 48)
    q, k, v = (torch.randn(1, 4, 40, 16) for _ in range(3))
    out8, out_scale = fp8_attention.quantised_attention(q, k, v)
    assert out8.dtype == torch.float8_e4m3fn and out8.shape == (1, 4, 40, 16)  # heads-major, as cuDNN writes it
    rows8 = out8.transpose(1, 2).flatten(2, 3)  # (B, S, H * D), as the processor hands it on
    represented = rows8.float() / out_scale
    out = Fp8Linear.of(linear).forward_fp8(rows8, out_scale.reciprocal(), torch.float32)
    exact = linear(represented)
    relative = ((out - exact).norm() / exact.norm()).item()
    assert out.shape == (1, 40, 48) and 0 < relative < 0.06, relative  # the weight's e4m3 rounding, no more
    attention = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2).flatten(2, 3)
    assert ((represented - attention).norm() / attention.norm()).item() < 0.1  # and it stands for the attention


def test_fp8_attention_without_cudnn_emulates_the_quantisation():
    torch.manual_seed(0)
    q, k, v = (torch.randn(1, 2, 40, 16) for _ in range(3))
    fp8_attention.reset_backend_used()
    out = fp8_attention.fp8_attention(q, k, v)
    exact = torch.nn.functional.scaled_dot_product_attention(q, k, v).transpose(1, 2)
    assert out.shape == exact.shape == (1, 40, 2, 16)
    relative = ((out - exact).norm() / exact.norm()).item()
    assert 0 < relative < 0.1, relative
    assert fp8_attention.backend_used() == "fp8_emulated"


def test_compiled_blocks_recompile_for_the_levers_and_back(engine):
    """The engine compiles its blocks as whole graphs on GPUs: the levers must trace into them (no graph break) and
    a lossless call after a high one must not run the high graph."""
    transformer = engine.replicas[0].transformer
    block = transformer.visual_transformer_blocks[0]
    captured = []
    hook = block.register_forward_pre_hook(lambda module, args: captured.append(args))
    try:  # the block's real inputs: one model call on a tile's latent grid
        config = transformer.config
        latents = torch.randn(1, 2, 8, 8, 2 * config.in_visual_dim + 1, generator=torch.Generator().manual_seed(0))
        with torch.no_grad():
            transformer(hidden_states=latents, timestep=torch.tensor([500.0]), return_dict=False)
    finally:
        hook.remove()
    hidden, temb, rope, sparse = captured[0]
    torch.set_grad_enabled(False)  # pytest runs each test in a fresh grad mode
    eager_lossless = block(hidden, temb, rope, sparse)
    with quality.applied(transformer, quality.LEVERS):
        eager_high = block(hidden, temb, rope, sparse)
    compiled = torch.compile(block, backend="eager", fullgraph=True)
    torch._dynamo.reset()
    assert torch.equal(compiled(hidden, temb, rope, sparse), eager_lossless)
    with quality.applied(transformer, quality.LEVERS):
        assert torch.equal(compiled(hidden, temb, rope, sparse), eager_high)
    assert torch.equal(compiled(hidden, temb, rope, sparse), eager_lossless)
    assert not torch.equal(eager_high, eager_lossless)


def test_high_gives_the_same_bits_offloaded_and_on_two_devices_and_keeps_no_fp8_weights(engine, tiny_piflow):
    """Blocks streamed one by one through device slots, and two device threads sharing one replica (the levers are
    swapped in once and out after the last): the resident engine's `high` bits; an offloaded engine keeps no FP8
    copy of its weights after the call."""
    from worker.sr import fp8
    from worker.sr.offload import Offload

    request = SRRequest(scale=2, quality="high")
    resident = run(engine, clip(2), request)
    offloaded = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu"], offload=Offload(layers=True, resident_blocks=0, prefetch=1))
    assert torch.equal(run(offloaded, clip(2), request), resident)
    linears = [getattr(parent, name) for parent, name in quality.block_linears(offloaded.replicas[0].transformer)]
    assert all(isinstance(linear, nn.Linear) and linear not in fp8._TWINS for linear in linears)


def test_high_runs_its_levers_in_a_split_group_too(engine, tiny_piflow):
    """A tile split over two devices (Ulysses over heads) runs the FP8 attention inside its wrapper: the levers
    report as on one device and the output stays as close to lossless."""
    request = SRRequest(scale=2, quality="high")
    split_engine = SREngine.from_pretrained(str(tiny_piflow), devices=["cpu", "cpu"], split="on")
    chunks: list[torch.Tensor] = []
    info = split_engine.upscale(clip(2), request, chunks.append)
    assert info.levers == {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "fp8_emulated"}
    psnr = psnr_per_frame(torch.cat(chunks), run(engine, clip(2), SRRequest(scale=2)))
    assert psnr.min() > TINY_PSNR_FLOOR_DB, psnr


def test_a_worker_is_told_which_tiers_to_warm_up_as_a_comma_separated_list(monkeypatch):
    """`VSRQ_WORKER_WARMUP_QUALITIES=lossless,high`, as an operator writes it in an env file; a tier the engine has
    not got is refused when the worker starts, not met by its first job."""
    from pydantic import ValidationError

    from worker.service import WorkerSettings

    monkeypatch.delenv("VSRQ_WORKER_WARMUP_QUALITIES", raising=False)
    assert WorkerSettings(_env_file=None).warmup_qualities == ("lossless",)
    monkeypatch.setenv("VSRQ_WORKER_WARMUP_QUALITIES", "lossless, high")
    assert WorkerSettings(_env_file=None).warmup_qualities == ("lossless", "high")
    monkeypatch.setenv("VSRQ_WORKER_WARMUP_QUALITIES", "lossless,fast")
    with pytest.raises(ValidationError, match="warmup_qualities"):
        WorkerSettings(_env_file=None)
