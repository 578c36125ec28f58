"""One tile's denoising split over several devices: DiT sequence parallelism, Ulysses over heads.

Every device of a split group holds a contiguous shard of the tile's token sequence and runs the transformer blocks
on it; everything in a block but attention works token by token. Attention projects q/k/v on the shard, exchanges
them all-to-all so that each device holds the whole sequence for a share of the heads (uneven where the heads do not
divide the group), runs the engine's attention processor there unchanged, exchanges the result back and projects it
out on the shard. The blocks' output is gathered on every device, which then all project it out and step the
scheduler alike, so every device of a group holds the same latents.

The devices exchange tensors between the engine's device threads (`Group`), not through torch.distributed: the
engine is one process with a replica per device thread, and process groups want one process per rank. On GPUs an
exchange is a peer copy (`Tensor.to`, ordered on both devices' streams by PyTorch); on CPU "devices" it hands the
tensor itself over.

Which tiles are split, and over how many devices, depends on the tile and device counts only (`degree`): a given
group makes the same bytes every time. Split output matches the unsplit one to float rounding, not to the bit
(`tests/test_split.py`, `bench/RESULTS.md`).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator, Sequence
from contextlib import AbstractContextManager, contextmanager
from dataclasses import dataclass
from typing import Any

import torch
from worker.sr.devices import Stopped
from worker.sr.k6_models import transformer as k6_transformer

FRACTAL_BLOCK_SIZE, sliding_tile_mask = k6_transformer.FRACTAL_BLOCK_SIZE, k6_transformer.sliding_tile_mask
_local_patch, _local_merge = k6_transformer._local_patch, k6_transformer._local_merge

SPLITS = ("auto", "off", "on")
# The key under which a block's `sparse_params` carry the device's `Shard` to the attention processor.
SHARD = "vsrq_shard"


def check(split: str | int) -> None:
    if split not in SPLITS and not (isinstance(split, int) and split >= 1):
        raise ValueError(f"split must be one of {SPLITS} or a number of devices per tile, got {split!r}")


def degree(tiles: int, devices: int, split: str | int = "auto") -> int:
    """Devices that share each tile's denoising: a divisor of `devices`, from the two counts alone.

    "off": 1 (whole tiles, as on one device: bit-identical to it). "on": every device on every tile; a number: that
    many (a divisor of `devices`; tests, bench). "auto": whole tiles when there are at least as many tiles as
    devices (the schedule balances those); otherwise the divisor that leaves the least work on the busiest device
    (one tile on 8 devices: 8; two: 4 and 4)."""
    check(split)
    if isinstance(split, int):
        if devices % split:
            raise ValueError(f"split={split} does not divide the {devices} devices")
        return split
    if split == "off" or devices == 1 or (split == "auto" and tiles >= devices):
        return 1
    if split == "on":
        return devices
    divisors = [g for g in range(1, devices + 1) if devices % g == 0]
    return min(divisors, key=lambda g: (math.ceil(tiles * g / devices) / g, g))


class Group:
    """The devices that denoise a tile together, exchanging tensors between their threads.

    Every exchange is one barrier: each device leaves what it sends in this exchange's slots, waits for all, and
    takes what was left for it. Two sets of slots alternate: a device writing the next exchange's has passed the
    barrier every other device reaches only once done reading the previous one. `abort` (the call failed anywhere)
    breaks the barrier: every device waiting there, or arriving later, stops (`Stopped`) instead of hanging."""

    def __init__(self, devices: Sequence[torch.device]) -> None:
        self.devices = list(devices)
        self.size = len(self.devices)
        self._barrier = threading.Barrier(self.size)
        self._slots: list[list[Any]] = [[None] * self.size, [None] * self.size]
        self._round = [0] * self.size

    def abort(self) -> None:
        self._barrier.abort()

    def wait(self) -> None:
        try:
            self._barrier.wait()
        except threading.BrokenBarrierError:
            raise Stopped from None

    def all_to_all(self, rank: int, outgoing: Sequence[Any]) -> list[Any]:
        """`outgoing[j]` (a tensor or a tuple of them) to device j; what every device sent to `rank`, in rank order,
        on `rank`'s device."""
        slots = self._slots[self._round[rank] % 2]
        self._round[rank] += 1
        slots[rank] = outgoing
        self.wait()
        device = self.devices[rank]
        return [_to(slots[source][rank], device) for source in range(self.size)]

    def all_gather(self, rank: int, tensor: torch.Tensor) -> list[torch.Tensor]:
        return self.all_to_all(rank, [tensor] * self.size)


def _to(payload: Any, device: torch.device) -> Any:
    if isinstance(payload, tuple):
        return tuple(tensor.to(device) for tensor in payload)
    return payload.to(device)


@dataclass(frozen=True)
class Shard:
    """One device's place in a split group."""

    group: Group
    rank: int

    def part(self, length: int) -> slice:
        """This device's share of `length` (tokens or heads), contiguous, the first shares one longer where uneven."""
        return _parts(length, self.group.size)[self.rank]

    @contextmanager
    def turn(self, turn: Callable[[], AbstractContextManager]) -> Iterator[None]:
        """Around the group's model call: the first device takes the engine's turn (the compile gate runs model calls
        one at a time while graphs are built: each device taking it would leave the others waiting at a barrier
        for the one queued behind them) and the others start with it."""
        if self.rank == 0:
            with turn():
                self.group.wait()
                yield
                self.group.wait()
        else:
            self.group.wait()
            yield
            self.group.wait()


def _parts(length: int, size: int) -> list[slice]:
    bounds = [0]
    for rank in range(size):
        bounds.append(bounds[-1] + length // size + (rank < length % size))
    return [slice(a, b) for a, b in zip(bounds, bounds[1:])]


def transformer(model: torch.nn.Module, hidden_states: torch.Tensor, timestep: torch.Tensor, shard: Shard | None) -> torch.Tensor:
    """`model(hidden_states, timestep)`'s prediction, computed by the group when `shard` is set.

    Steps 1, 2 and 4 are `Kandinsky6SRTransformer3DModel.forward`'s (diffusers 0.42.1), on every device alike; step 3
    runs the blocks on this device's shard of the tokens. The blocks run uncompiled: a compiled graph cannot wait
    for the other device threads."""
    if shard is None:
        return model(hidden_states=hidden_states, timestep=timestep, return_dict=False)[0]
    device = hidden_states.device
    temb = model.time_embeddings(timestep) + model.pooled_bias

    # 1. Patchify, and the rotary embeddings of the whole token grid (attention sees the whole sequence)
    visual_embed = model.visual_embeddings(hidden_states)
    visual_shape = visual_embed.shape[1:4]
    visual_rope = model.visual_rope_embeddings(tuple(torch.arange(size, device=device) for size in visual_shape), model.config.scale_factor)

    # 2. The token sequence in NABLA's block order, and this device's shard of it
    num_frames, height, width = visual_shape
    if height % FRACTAL_BLOCK_SIZE or width % FRACTAL_BLOCK_SIZE:
        raise ValueError(f"NABLA attention needs the token grid {(height, width)} to be divisible by {FRACTAL_BLOCK_SIZE}")
    group_size = (1, FRACTAL_BLOCK_SIZE, FRACTAL_BLOCK_SIZE)
    visual_embed = _local_patch(visual_embed, visual_shape, group_size, dim=1).flatten(1, 2)
    visual_rope = _local_patch(visual_rope, visual_shape, group_size, dim=0).flatten(0, 1)
    sta_mask = sliding_tile_mask(num_frames, height // FRACTAL_BLOCK_SIZE, width // FRACTAL_BLOCK_SIZE, model.config.nabla_window, device)
    sparse_params = {"sta_mask": sta_mask, "threshold": model.config.nabla_threshold, SHARD: shard}
    tokens = visual_embed[:, shard.part(visual_embed.shape[1])]

    # 3. The blocks on the shard (`_call_impl`: the module call without its compiled code, hooks kept)
    for block in model.visual_transformer_blocks:
        tokens = block._call_impl(tokens, temb, visual_rope, sparse_params)

    # 4. The whole sequence on every device, back to the grid and out to the latent space
    visual_embed = torch.cat(shard.group.all_gather(shard.rank, tokens), dim=1)
    visual_embed = _local_merge(visual_embed.reshape(visual_embed.shape[0], -1, FRACTAL_BLOCK_SIZE**2, visual_embed.shape[-1]), visual_shape, group_size, dim=1)
    return model.out_layer(visual_embed, temb)


class UlyssesProcessor:
    """Wraps an attention processor: unchanged without a `Shard` in `sparse_params`; with one, attention over the
    whole sequence for this device's heads.

    The wrapped processor runs as it is, on a view of the attention module whose projections hand it the exchanged
    q/k/v (whole sequence, this device's heads) and whose out projection hands its result back: it applies its norms,
    rotary embeddings and kernel per head, as on one device."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner

    def __call__(self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: dict[str, Any]) -> torch.Tensor:
        shard: Shard | None = sparse_params.get(SHARD)
        if shard is None:
            return self.inner(attn, hidden_states, rotary_emb, sparse_params)
        group, heads = shard.group, attn.num_heads
        head_parts = _parts(heads, group.size)
        # (B, s, H * D) projections of this shard, by the heads of each device
        projected = [attn.to_query(hidden_states), attn.to_key(hidden_states), attn.to_value(hidden_states)]
        projected = [p.unflatten(-1, (heads, -1)) for p in projected]
        received = group.all_to_all(shard.rank, [tuple(p[:, :, part] for p in projected) for part in head_parts])
        # (B, S, h * D): the whole sequence (shards in rank order) for this device's h heads
        query, key, value = (torch.cat([parts[i] for parts in received], dim=1).flatten(2) for i in range(3))
        mine = head_parts[shard.rank]
        if mine.stop > mine.start:
            out = self.inner(_HeadView(attn, query, key, value, mine.stop - mine.start), query, rotary_emb, _without_shard(sparse_params))
        else:  # more devices than heads: this one only relays
            out = query
        # back: this device's tokens, every device's heads in order -> (B, s, H * D)
        token_parts = _parts(out.shape[1], group.size)
        back = group.all_to_all(shard.rank, [out[:, part] for part in token_parts])
        return attn.out_layer(torch.cat(back, dim=-1))


def _without_shard(sparse_params: dict[str, Any]) -> dict[str, Any]:
    return {key: value for key, value in sparse_params.items() if key != SHARD}


class _HeadView:
    """`attn` as the wrapped processor sees it for a share of the heads: projections that return the exchanged q/k/v
    and an out projection that returns its input; everything else (norms, ...) the module's own."""

    def __init__(self, attn: Any, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, heads: int) -> None:
        self._attn = attn
        self.num_heads = heads
        self.to_query, self.to_key, self.to_value = (lambda _, t=t: t for t in (query, key, value))
        self.out_layer = lambda out: out

    def __getattr__(self, name: str) -> Any:
        return getattr(self._attn, name)


def wrap_attention(model: torch.nn.Module) -> None:
    """Wraps every attention processor of `model` in `UlyssesProcessor`, once."""
    processors = model.attn_processors
    if not all(isinstance(p, UlyssesProcessor) for p in processors.values()):
        model.set_attn_processor({name: p if isinstance(p, UlyssesProcessor) else UlyssesProcessor(p) for name, p in processors.items()})


def unwrapped(processor: Any) -> Any:
    return processor.inner if isinstance(processor, UlyssesProcessor) else processor


def join(groups: Sequence[Sequence[int]], devices: Sequence[torch.device]) -> dict[int, Shard]:
    """Slot -> its `Shard`, for the slots of `groups` (the schedule's split groups; new ones for every call)."""
    shards = {}
    for slots in groups:
        group = Group([devices[slot] for slot in slots])
        shards.update({slot: Shard(group, rank) for rank, slot in enumerate(slots)})
    return shards
