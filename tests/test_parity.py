"""In `reference` noise mode the engine reproduces `diffusers.Kandinsky6SRPipeline` (fp32, CPU)."""

from __future__ import annotations

import diffusers
import pytest
import torch

from tests.conftest import VARIANTS, clip, run
from worker.sr.attention import DenseSDPAProcessor, NablaFlexProcessor, nabla_density, qkv
from worker.sr.checkpoint import Components
from worker.sr.engine import SREngine
from worker.sr.noise import NoiseMode
from worker.sr.offload import align_on_cpu
from worker.sr.request import SRRequest

SEED = 7


def reference(checkpoint, video, scale, tiles_batch_size=1) -> torch.Tensor:
    pipe = diffusers.Kandinsky6SRPipeline.from_pretrained(checkpoint, local_files_only=True)
    pipe.set_progress_bar_config(disable=True)
    # Eager flex attention computes the same dense attention (see test_sdpa_matches_stock_flex_attention).
    pipe.transformer.set_attn_processor(DenseSDPAProcessor())
    # Aligned weights, as the engine computes with (CPU kernels round unaligned operands differently)
    align_on_cpu(Components(torch.device("cpu"), pipe.transformer, pipe.vae, pipe.scheduler, pipe.latent_upscaler))
    return pipe(
        video=video[None],
        resolution_scale=scale,
        num_inference_steps=2,
        tiles_batch_size=tiles_batch_size,
        generator=torch.Generator().manual_seed(SEED),
        output_type="pt",
    ).frames[0]


@pytest.mark.parametrize("scale", [2, 2.25, 4])
@pytest.mark.parametrize(("variant", "latent_upscaler"), VARIANTS)
def test_parity_with_reference_pipeline(tiny_checkpoints, variant, latent_upscaler, scale):
    checkpoint = tiny_checkpoints[(variant, latent_upscaler)]
    video = clip(scale)
    expected = reference(checkpoint, video, scale)
    engine = SREngine.from_pretrained(str(checkpoint))
    ours = run(engine, video, SRRequest(scale=scale, seed=SEED, noise_mode=NoiseMode.REFERENCE))
    assert ours.shape == expected.shape
    delta = (ours - expected).abs().max().item()
    print(f"parity {variant} latent_upscaler={latent_upscaler} x{scale}: max|delta| = {delta:.3g}")
    assert delta <= 1e-5
    # The blend is not a no-op: neighbouring tiles really overlap and differ.
    assert expected.std() > 0.01


def test_parity_with_batched_reference(tiny_piflow):
    video = clip(2)
    expected = reference(tiny_piflow, video, 2, tiles_batch_size=2)
    ours = run(SREngine.from_pretrained(str(tiny_piflow)), video, SRRequest(scale=2, seed=SEED, noise_mode=NoiseMode.REFERENCE, tiles_batch_size=2))
    assert (ours - expected).abs().max() <= 1e-5


def test_streaming_decode_equals_whole_decode(tiny_piflow):
    """The reference decodes each tile whole; we stream it in segments through the causal cache: same bits."""
    video = clip(2)
    expected = reference(tiny_piflow, video, 2)
    engine = SREngine.from_pretrained(str(tiny_piflow), decode_segment=1, fast_decode=False)
    ours = run(engine, video, SRRequest(scale=2, seed=SEED, noise_mode=NoiseMode.REFERENCE))
    assert torch.equal(ours, expected)


def test_sdpa_matches_stock_flex_attention(tiny_piflow):
    transformer = diffusers.Kandinsky6SRTransformer3DModel.from_pretrained(tiny_piflow, subfolder="transformer")
    hidden = torch.randn(1, 3, 16, 16, 9, generator=torch.Generator().manual_seed(0))
    timestep = torch.tensor([500.0])
    with torch.no_grad():
        stock = transformer(hidden, timestep, return_dict=False)[0]
        transformer.set_attn_processor(DenseSDPAProcessor())
        ours = transformer(hidden, timestep, return_dict=False)[0]
    assert (stock - ours).abs().max() <= 1e-5



def test_nabla_processor_is_the_stock_sparse_attention(tiny_piflow):
    """Our flex processor computes the stock processor's attention, and its density figure sees the sparsity a
    narrow window and threshold make. (Eager flex ignores the block lists, so on the CPU both are dense; the sparse
    kernel runs compiled on GPUs, where bench/levers.py measures its speed, density and distance from dense.)"""
    transformer = diffusers.Kandinsky6SRTransformer3DModel.from_pretrained(
        tiny_piflow, subfolder="transformer", nabla_window=(1, 1, 1), nabla_threshold=0.3
    )
    hidden = torch.randn(1, 3, 16, 32, 9, generator=torch.Generator().manual_seed(0))
    timestep = torch.tensor([500.0])
    densities = []
    attention = transformer.visual_transformer_blocks[0].self_attention
    attention.register_forward_pre_hook(
        lambda attn, args: densities.append(nabla_density(*qkv(attn, args[0], args[1])[:2], args[2]).item())
    )
    outputs = {}
    with torch.no_grad():
        for name, processor in (("stock", None), ("nabla", NablaFlexProcessor())):
            if processor is not None:
                transformer.set_attn_processor(processor)
            outputs[name] = transformer(hidden, timestep, return_dict=False)[0]
    assert 0 < densities[0] < 0.9
    assert (outputs["nabla"] - outputs["stock"]).abs().max() <= 1e-5
