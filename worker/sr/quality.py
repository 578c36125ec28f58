"""The quality tiers a job may ask for, and the levers `high` pulls in the DiT.

`lossless` (the default) is the exact engine: not one bit differs from what it computed before the tiers existed.
`high` trades exactness for speed with arithmetic that is not bit-exact; each lever is a named switch, so a
benchmark can time and measure it alone (bench/quality.py):

- `fp8_linear`: the transformer blocks' attention projections (q, k, v, out) and feed-forward linears as row-wise
  scaled FP8 GEMMs (`worker.sr.fp8`);
- `fp8_attention`: dense attention through FP8, cuDNN's fused kernel on Hopper and later
  (`worker.sr.fp8_attention`; emulated elsewhere, and the job says which ran).

The levers are swapped into a transformer for the length of a call (`applied`) and out again after it: the
modules, parameters and state dict of the model are what they were, and a `lossless` call after a `high` one runs
the same code as before it.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import torch
from torch import nn

from worker.sr import fp8_attention
from worker.sr import split as _split
from worker.sr.attention import DenseSDPAProcessor
from worker.sr.fp8 import Fp8Linear, forget
from worker.sr.request import HIGH, LOSSLESS, QUALITIES

FP8_LINEAR, FP8_ATTENTION = "fp8_linear", "fp8_attention"
LEVERS = (FP8_LINEAR, FP8_ATTENTION)
# What `high` runs unless an engine is told otherwise: a lever that misses the quality gate in bench/RESULTS.md
# (worst-frame PSNR >= 40 dB against lossless) comes out of this list.
HIGH_LEVERS: tuple[str, ...] = (FP8_LINEAR, FP8_ATTENTION)
# What `high` computes, by revision: raised whenever the levers' arithmetic changes, so that windows a worker of
# another revision kept are never replayed into this one's output (the engine's signature carries it). 2: FP8
# attention's quantisation in the compiled block, its FP8 output straight into the FP8 out projection.
REVISION = 2
# One instance each, bare and as a split group runs it: compiled blocks guard on the processor object.
_FP8_ATTENTION_PROCESSOR = fp8_attention.Fp8AttentionProcessor()
_FP8_ATTENTION_SPLIT = _split.UlyssesProcessor(_FP8_ATTENTION_PROCESSOR)


def check_levers(levers: Sequence[str]) -> tuple[str, ...]:
    unknown = sorted(set(levers) - set(LEVERS))
    if unknown:
        raise ValueError(f"unknown quality lever(s) {unknown}: the levers are {LEVERS}")
    return tuple(lever for lever in LEVERS if lever in levers)


def block_linears(transformer: nn.Module) -> list[tuple[nn.Module, str]]:
    """(parent, attribute) of every linear `fp8_linear` swaps: per block, q, k, v, out and the two feed-forward ones."""
    found = []
    # the blocks themselves, not an iteration of the list: offloaded, that streams every block to the device
    for block in transformer.visual_transformer_blocks._modules.values():
        attention = block.self_attention
        found += [(attention, name) for name in ("to_query", "to_key", "to_value", "out_layer")]
        found += [(block.feed_forward.net[0], "proj"), (block.feed_forward.net, "2")]  # GELU's projection, the output
    return found


class Applied:
    """What a call ran: the levers in force and, once it is over, how attention was computed."""

    def __init__(self, levers: tuple[str, ...], notes: dict[str, str]) -> None:
        self.levers = levers
        self.notes = notes

    def report(self) -> dict[str, str]:
        """lever -> how it ran, e.g. {"fp8_linear": "scaled_mm_rowwise", "fp8_attention": "cudnn_fp8"}."""
        ran = dict(self.notes)
        if FP8_ATTENTION in ran and ran[FP8_ATTENTION] == "pending":
            ran[FP8_ATTENTION] = fp8_attention.backend_used() or "not_called"
        return ran


@contextmanager
def applied(transformer: nn.Module, levers: Sequence[str], keep_weights: bool = True) -> Iterator[Applied]:
    """`levers` in force in `transformer` inside the block. Device threads sharing one (CPU) replica may nest: the
    first one in swaps, the last one out restores. `keep_weights` False drops the FP8 weights afterwards (an
    offloaded model keeps nothing on the GPU between calls)."""
    levers = check_levers(levers)
    if not levers:
        yield Applied((), {})
        return
    with _LOCK:
        state = _STATE.get(id(transformer))
        if state is None:
            state = _STATE[id(transformer)] = _swap_in(transformer, levers)
        elif state.levers != levers:
            raise RuntimeError(f"levers {state.levers} are already in force in this transformer, not {levers}")
        state.users += 1
    try:
        yield Applied(levers, dict(state.notes))
    finally:
        with _LOCK:
            state.users -= 1
            if state.users == 0:
                del _STATE[id(transformer)]
                state.restore(keep_weights)


class _Swapped:
    def __init__(self, levers: tuple[str, ...]) -> None:
        self.levers = levers
        self.users = 0
        self.linears: list[tuple[nn.Module, str, nn.Module]] = []
        self.processors: dict[str, object] | None = None
        self.notes: dict[str, str] = {}
        self.transformer: nn.Module | None = None

    def restore(self, keep_weights: bool) -> None:
        for parent, name, linear in self.linears:
            setattr(parent, name, linear)
            if not keep_weights:
                forget(linear)
        if self.processors is not None:
            self.transformer.set_attn_processor(self.processors)


def _swap_in(transformer: nn.Module, levers: tuple[str, ...]) -> _Swapped:
    state = _Swapped(levers)
    try:
        return _swap_levers_in(transformer, levers, state)
    except BaseException:
        state.restore(keep_weights=False)  # what was swapped goes back: later lossless calls stay exact
        raise


def _swap_levers_in(transformer: nn.Module, levers: tuple[str, ...], state: _Swapped) -> _Swapped:
    state.transformer = transformer
    device = next(transformer.parameters()).device
    if FP8_LINEAR in levers and not fp8_supported(device):
        state.notes[FP8_LINEAR] = "not_applied_no_fp8_gemm_on_device"
    elif FP8_LINEAR in levers:
        # Every twin made before any is put in: a failure part-way (a GPU out of memory) leaves lossless intact
        twins = [(parent, name, getattr(parent, name)) for parent, name in block_linears(transformer)]
        made = [Fp8Linear.of(linear) for _, _, linear in twins]
        for (parent, name, linear), twin in zip(twins, made):
            setattr(parent, name, twin)
            state.linears.append((parent, name, linear))
        state.notes[FP8_LINEAR] = "scaled_mm_rowwise"
    if FP8_ATTENTION in levers:
        processors = transformer.attn_processors
        if all(isinstance(_split.unwrapped(p), DenseSDPAProcessor) for p in processors.values()):
            state.processors = processors
            transformer.set_attn_processor({
                name: _FP8_ATTENTION_SPLIT if isinstance(p, _split.UlyssesProcessor) else _FP8_ATTENTION_PROCESSOR
                for name, p in processors.items()
            })  # fmt: skip
            state.notes[FP8_ATTENTION] = "pending"  # cuDNN, or emulated: known once it ran
        else:  # NABLA's sparse pattern is not dense attention: FP8 would change what is attended to
            state.notes[FP8_ATTENTION] = "not_applied_sparse_attention"
    return state


_LOCK = threading.Lock()
_STATE: dict[int, _Swapped] = {}


def reset() -> None:
    """Before a call: forget how earlier calls computed FP8 attention (`Applied.report` reads what this one ran)."""
    fp8_attention.reset_backend_used()


def request_levers(quality: str, high_levers: Sequence[str]) -> tuple[str, ...]:
    """The levers a request of `quality` runs with on an engine whose `high` means `high_levers`."""
    if quality not in QUALITIES:
        raise ValueError(f"quality must be one of {QUALITIES}, got {quality!r}")
    return check_levers(high_levers) if quality == HIGH else ()


def fp8_supported(device: torch.device) -> bool:
    """Whether row-wise FP8 GEMMs run on `device`: any CPU (torch >= 2.13), GPUs of compute capability 8.9 or later."""
    return device.type != "cuda" or torch.cuda.get_device_capability(device) >= (8, 9)
