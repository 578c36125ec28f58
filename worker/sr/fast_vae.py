"""Faster K-VAE decoding, same maths.

The decoder's spatial norms normalise each feature map in fp32 copies, nearest-upsample the latent `zq` (64
channels) to it, run two 1x1x1 convolutions at full resolution, then multiply-add: memory-bound passes that cost
more than the decoder's 3x3x3 convolutions. A 1x1x1 convolution commutes with nearest upsampling, and nearest
upsampling by integer factors is a broadcast, so we convolve at latent resolution and broadcast the result into
one fused multiply-add (`addcmul`): no full-resolution copy of `zq` or of its projections is ever made.

The causal convolutions pad every input spatially (a full copy), convolve the frames next to the carried padding
apart from the rest, and copy both results into a preallocated output (another full copy). `ImplicitPadCausalConv3d`
concatenates the carried frames once and lets the convolution zero-pad spatially itself: one pass instead of three,
one kernel launch instead of two. It carries the unpadded frames in its cache, updated in place: a cache is
allocated once, at its tile's first segment, instead of anew at every segment between that segment's activations.

Each spatial upsampling nearest-doubles the features, adds a 3x3 convolution of the doubled grid and applies a 1x1
convolution, all at the doubled resolution (20 % of the decoder's arithmetic). Each of the four output phases
(even/odd row, even/odd column) of a 3x3 convolution over a nearest-doubled grid sees only a 2x2 neighbourhood of
the original grid, and the 1x1 convolution distributes over the sum. `SubPixelUpsample` therefore runs one 2x2
convolution with the 1x1 folded in (four phases as output channels) and a 1x1 at the original resolution, then
interleaves: 2.35x less arithmetic, and no doubled-resolution intermediates.

`speed_up_decoder` swaps the class of the decoder's modules in place (weights untouched), before the first decode,
so it works on any loaded `Kandinsky6SRVAE`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

import torch
import torch.nn.functional as F
from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import (
    CONV_CHUNK_ELEMENTS,
    Kandinsky6SRCausalConv3d,
    Kandinsky6SRResnetBlock3D,
    Kandinsky6SRSpatialNorm3D,
    Kandinsky6SRUpsample,
)

from worker.sr import precompiled
from worker.sr.compilation import allow_many_graphs
from worker.sr.decoder_caches import cache_bytes


def _modulate(normed: torch.Tensor, scale: torch.Tensor, shift: torch.Tensor) -> torch.Tensor:
    """`normed * up(scale) + up(shift)`, `up` being nearest upsampling to `normed`'s (frames, height, width)."""
    batch, channels, *size = normed.shape
    low = scale.shape[2:]
    if any(full % small for full, small in zip(size, low)):  # never in this decoder; stay exact if it ever is
        size = normed.shape[2:]
        return normed * F.interpolate(scale, size=size, mode="nearest") + F.interpolate(shift, size=size, mode="nearest")
    t, h, w = low
    grouped = normed.reshape(batch, channels, t, size[0] // t, h, size[1] // h, w, size[2] // w)

    def spread(low_res: torch.Tensor) -> torch.Tensor:
        return low_res.reshape(batch, channels, t, 1, h, 1, w, 1)

    return torch.addcmul(spread(shift), grouped, spread(scale)).reshape(normed.shape)


class BroadcastSpatialNorm3D(Kandinsky6SRSpatialNorm3D):
    """`Kandinsky6SRSpatialNorm3D` in three passes over the feature map instead of about a dozen: one reduction for
    the channel norm, one multiply by its inverse, one broadcast multiply-add with the latent-resolution projections
    (the norm's `gamma` folded into them)."""

    def forward(self, hidden_states: torch.Tensor, zq: torch.Tensor, cache: dict) -> torch.Tensor:
        norm_layer = self.norm_layer
        # F.normalize(x, dim=1) * sqrt(C), with the norm accumulated in fp32 as the stock layer does.
        inverse = torch.linalg.vector_norm(hidden_states, dim=1, keepdim=True, dtype=torch.float32)
        unit = hidden_states * (norm_layer.scale / inverse.clamp_min(1e-12)).to(hidden_states.dtype)
        scale = self.conv_y(zq) * norm_layer.gamma
        shift = self.conv_b(zq)
        if cache["is_first_segment"]:
            # The first pixel frame comes from the first latent frame alone (T + 1 latent frames -> 2T + 1 frames).
            parts = [_modulate(unit[:, :, :1], scale[:, :, :1], shift[:, :, :1])]
            if zq.size(2) > 1:
                parts.append(_modulate(unit[:, :, 1:], scale[:, :, 1:], shift[:, :, 1:]))
            output = torch.cat(parts, dim=2) if len(parts) > 1 else parts[0]
        else:
            output = _modulate(unit, scale, shift)
        cache["is_first_segment"] = False
        return output


class ImplicitPadCausalConv3d(Kandinsky6SRCausalConv3d):
    """`Kandinsky6SRCausalConv3d` (stride 1) as one convolution over [carried frames, segment], zero-padded
    spatially by the convolution itself."""

    def forward(self, hidden_states: torch.Tensor, cache: dict) -> torch.Tensor:
        padding = cache["padding"]
        if padding is None:  # the first segment repeats its first frame
            padding = hidden_states[:, :, :1].expand(-1, -1, self.time_pad, -1, -1)
        frames = torch.cat([padding, hidden_states], dim=2) if self.time_pad else hidden_states
        carried = frames[:, :, frames.size(2) - self.time_pad :]
        if cache["padding"] is None:
            cache["padding"] = carried.clone()
        else:  # in place: a tile's cache keeps its memory for all its segments (no churn among the activations)
            cache["padding"].copy_(carried)
        if frames.numel() <= CONV_CHUNK_ELEMENTS:
            conv = self.conv
            return F.conv3d(frames, conv.weight, conv.bias, padding=(0, self.height_pad, self.width_pad))
        # Beyond cuDNN's comfort: the stock chunked convolution on explicitly padded frames.
        return self.conv(F.pad(frames, (self.width_pad, self.width_pad, self.height_pad, self.height_pad)))


# Which of a 3x3 kernel's rows (or columns) act on each of the two original rows an output phase reads: phase 0 (even
# rows) reads rows (i - 1, i), the kernel's row 0 on the first and rows 1 and 2 on the second; phase 1 reads (i, i + 1).
_PHASE_TAPS = torch.tensor([[[1, 0, 0], [0, 1, 1]], [[1, 1, 0], [0, 0, 1]]], dtype=torch.float64)


class SubPixelUpsample(Kandinsky6SRUpsample):
    """`Kandinsky6SRUpsample`'s `linear(up + spatial_conv(up))`, `up` the nearest-doubled features, computed as
    `up(linear(x)) + interleave(phases(x))` on the original grid: `phases` is one 2x2 convolution whose 4C output
    channels are the four phases of `linear . spatial_conv`, derived from the loaded weights (`fold`; again after a
    `load_state_dict`). Eager inference only: the phases are summed into a strided view of the output in place,
    which autograd refuses and Dynamo cannot trace, so a compiled caller runs it eagerly."""

    phase_weight: torch.Tensor
    phase_bias: torch.Tensor

    @classmethod
    def fold(cls, module: Kandinsky6SRUpsample) -> SubPixelUpsample:
        """Swaps `module`'s class in place and derives the phase convolution from its weights."""
        module.__class__ = cls
        module._derive_phases()
        module.register_load_state_dict_post_hook(lambda loaded, _keys: loaded._derive_phases())
        return module

    def _derive_phases(self) -> None:
        """In float64, then rounded once to the weights' dtype."""
        spatial, linear = self.spatial_conv, self.linear
        kernel = spatial.weight[:, :, 0].detach().to(torch.float64)  # (C, C, 3, 3)
        mix = linear.weight[:, :, 0, 0, 0].detach().to(torch.float64)  # (C, C)
        taps = _PHASE_TAPS.to(kernel.device)
        # Collapse the taps first, then mix channels: (2, 2, C, C, 2, 2), never an (out, in, taps...) blow-up.
        collapsed = torch.einsum("ayk,bxl,mikl->abmiyx", taps, taps, kernel)
        phases = torch.einsum("om,abmiyx->aboiyx", mix, collapsed)
        channels = kernel.size(0)
        weight = phases.reshape(4 * channels, channels, 1, 2, 2)
        bias = (mix @ spatial.bias.detach().to(torch.float64)).repeat(4)
        self.register_buffer("phase_weight", weight.to(spatial.weight.dtype), persistent=False)
        self.register_buffer("phase_bias", bias.to(spatial.bias.dtype), persistent=False)

    @torch.compiler.disable
    def forward(self, hidden_states: torch.Tensor, cache: dict) -> torch.Tensor:
        frames = hidden_states.size(2)
        if self.compress_time:  # T frames become 2T, and 2T - 1 in the first segment
            frames = 2 * frames - (cache["temporal_conv"]["padding"] is None)
        if 4 * hidden_states[:, :, :1].numel() * frames > CONV_CHUNK_ELEMENTS:
            return super().forward(hidden_states, cache)  # beyond cuDNN's comfort: the stock chunked convolutions
        if self.compress_time:  # the stock temporal doubling, unchanged
            repeated = hidden_states.repeat_interleave(2, dim=2)
            if cache["temporal_conv"]["padding"] is None:
                repeated = repeated[:, :, 1:]
            hidden_states = self.temporal_conv(repeated, cache["temporal_conv"]) + repeated
        batch, channels, frames, height, width = hidden_states.shape
        # Phase (a, b) of output pixel (i, j) is the 2x2 window at padded (i + a, j + b): (B, 2, 2, C, T, H+1, W+1).
        phases = F.conv3d(hidden_states, self.phase_weight, self.phase_bias, padding=(0, 1, 1))
        phases = phases.unflatten(1, (2, 2, channels))
        # Reading phase (a, b) at row i + a, column j + b is one strided view (B, C, T, H, 2, W, 2) of all four: a
        # step of `a` moves a phase block and a row. So the interleave and the low-resolution 1x1 are one
        # elementwise pass writing the doubled grid in order (compiled, it measured 4-6 % faster decodes for 12
        # more graphs per device: bench/RESULTS.md).
        s_batch, s_a, s_b, s_channel, s_frame, s_row, s_column = phases.stride()
        interleaved = phases.as_strided(
            (batch, channels, frames, height, 2, width, 2),
            (s_batch, s_channel, s_frame, s_row, s_a + s_row, s_column, s_b + s_column),
            phases.storage_offset(),
        )
        low = self.linear(hidden_states)[:, :, :, :, None, :, None]
        output = torch.empty((batch, channels, frames, 2 * height, 2 * width), dtype=hidden_states.dtype,
                             device=hidden_states.device, memory_format=_layout(hidden_states))
        torch.add(low, interleaved, out=output.view(batch, channels, frames, height, 2, width, 2))
        return output


def _layout(tensor: torch.Tensor) -> torch.memory_format:
    """NDHWC where `tensor` keeps its channels innermost (cuDNN's 3D convolutions read it so without converting; a
    segment of frames sliced out of an NDHWC tensor is no longer dense, but still NDHWC), else NCDHW."""
    if tensor.size(1) > 1 and tensor.stride(1) == 1 and not tensor.is_contiguous():
        return torch.channels_last_3d
    return torch.contiguous_format


def tile_cache_bytes(vae: torch.nn.Module, latent_height: int, latent_width: int, fast: bool = True) -> int:
    """Bytes one tile's causal decoder cache holds once it is full, from two segments decoded by a copy of `vae`'s
    architecture on the meta device (shapes only: no memory, no arithmetic). `fast`: with this module's layers,
    which carry unpadded frames."""
    with torch.device("meta"):
        dry = type(vae).from_config(vae.config)
    torch.nn.Module.to(dry, vae.dtype)  # diffusers' `to` warns about keeping fp32 modules: shapes do not care
    if fast:
        speed_up_decoder(dry)
    cache = dry.decoder.make_cache()
    latents = torch.empty((1, vae.config.latent_channels, 2, latent_height, latent_width), device="meta", dtype=vae.dtype)
    with torch.no_grad():
        dry.decoder(latents[:, :, :1], cache)  # the first segment repeats its frame instead of reading the cache
        dry.decoder(latents[:, :, 1:], cache)
    return cache_bytes(cache)


def _broadcast_norm(module: torch.nn.Module) -> None:
    if type(module) is Kandinsky6SRSpatialNorm3D:
        module.__class__ = BroadcastSpatialNorm3D


def _implicit_pad(module: torch.nn.Module) -> None:
    if type(module) is Kandinsky6SRCausalConv3d and module.time_stride == 1:
        module.__class__ = ImplicitPadCausalConv3d


def _sub_pixel_upsample(module: torch.nn.Module) -> None:
    if type(module) is Kandinsky6SRUpsample:
        SubPixelUpsample.fold(module)


# Each swap changes the decoder modules it applies to; bench/levers.py measures them one at a time.
DECODER_SWAPS: dict[str, Callable[[torch.nn.Module], None]] = {
    "broadcast_norm": _broadcast_norm,
    "implicit_pad": _implicit_pad,
    "sub_pixel_upsample": _sub_pixel_upsample,
}


def speed_up_decoder(vae: torch.nn.Module, swaps: Iterable[str] = tuple(DECODER_SWAPS)) -> torch.nn.Module:
    """Swaps the decoder's norms, causal convolutions and upsamplings for this module's (or only `swaps`); after the
    weights are loaded (the sub-pixel upsampling derives its kernels from them)."""
    changes = [DECODER_SWAPS[name] for name in swaps]
    for module in vae.decoder.modules():
        for change in changes:
            change(module)
    return vae


def compile_decoder(vae: torch.nn.Module) -> torch.nn.Module:
    """Compiles each decoder resnet block for static shapes, so Inductor fuses its norms, SiLUs and padding copies.

    Blocks share one code object: every (level, segment length 1-4, first segment or not, tile size, device) is its
    own graph, a few dozen per device and tile size (`compilation.allow_many_graphs`)."""
    allow_many_graphs()  # for the calling thread; an engine's device threads raise the limits themselves
    for module in vae.decoder.modules():
        if isinstance(module, Kandinsky6SRResnetBlock3D) and getattr(module, "_compiled_call_impl", None) is None:
            precompiled.compile_block(module)
    return vae
