"""FP8 attention for the `high` quality tier: cuDNN's FP8 fused attention through `nvidia-cudnn-frontend` on GPUs
(Hopper or later), its numerics emulated where that cannot run.

q, k and v are quantised to float8_e4m3fn with one scale per tensor (their largest magnitude onto 448); cuDNN
computes the scores, an FP8 softmax-probability matrix and the output, which on Hopper it can only write in FP8
(a bf16 output is Blackwell-only): an FP8 out projection (`fp8_linear`) takes it as it is, else it is dequantised.
The output is a convex combination of the rows of v, so |o| <= max |v| bounds it before it is computed: its scale
needs no second pass. The quantisation around the kernel is plain tensor code, which a compiled block fuses into its
neighbours.

Where the package, a GPU or the cuDNN graph is missing (the CPU, CI, an older GPU), the same quantisation of q, k, v
and the output runs around a plain SDPA: the same error from the inputs and the output, less the kernel's own FP8
probability matrix. `backend_used()` says which of the two a call ran, for the job to report; a job never fails
for want of the optional package.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from typing import Any

import torch
import torch.nn.functional as F

from worker.sr.attention import qkv
from worker.sr.fp8 import FP8, FP8_MAX, Fp8Linear

log = logging.getLogger("vsrq.fp8_attention")

CUDNN = "cudnn_fp8"
EMULATED = "fp8_emulated"
# The softmax probabilities' FP8 scale. They are <= 1 (cuDNN compensates its lazy rescaling of the running maximum
# inside the kernel), so 256 keeps the largest in range with room to spare, and small ones (a 47,616-token row
# averages 2e-5) above e4m3's smallest subnormal more often than the 64 of cuDNN's own tests would.
# bench/quality.py's `attention` phase measures the error at 64, 256 and 448.
SOFTMAX_SCALE = 256.0
_UIDS = dict(q=1, k=2, v=3, o=4, descale_q=5, descale_k=6, descale_v=7, descale_s=8, scale_s=9, scale_o=10, amax_s=11, amax_o=12)


def fp8_attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor) -> torch.Tensor:
    """Dense attention of (B, H, S, D) q, k, v -> (B, S, H, D) output in q's dtype, through FP8."""
    out, out_scale = quantised_attention(query, key, value)
    return dequantised(out, out_scale, query.dtype).transpose(1, 2)


def quantised_attention(
    query: torch.Tensor, key: torch.Tensor, value: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Dense attention of (B, H, S, D) q, k, v -> the (B, H, S, D) float8 output and its 0-d float32 scale
    (out ~= out8 / scale). Plain tensor code around one opaque kernel: compiled, the quantisation fuses into the
    kernels that made q, k and v (and writes them heads-major, the layout cuDNN's kernel reads fastest), and the
    output can go on in FP8 (`Fp8Linear.forward_fp8`)."""
    scales = [_scale_of(t) for t in (query, key, value)]
    q, k, v = (_quantised(t, s) for t, s in zip((query, key, value), scales))
    descales = torch.stack([s.reciprocal() for s in scales])
    out_scale = scales[2]  # |o| <= max |v|
    return fp8_sdpa(q, k, v, descales, out_scale, query.dtype), out_scale


def dequantised(out: torch.Tensor, out_scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    return out.to(dtype) / out_scale.to(dtype)


@torch.library.custom_op("vsrq::fp8_sdpa", mutates_args=())
def fp8_sdpa(
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    descales: torch.Tensor,
    out_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    """Attention of contiguous float8 (B, H, S, D) q, k, v (dequantised by `descales`, three float32 values) -> the
    float8 (B, H, S, D) output quantised by `out_scale`; `dtype` is what the emulation computes in. An opaque
    operator to `torch.compile` (the compiled blocks are whole graphs: a call into cuDNN's Python API would break
    them)."""
    if query.is_cuda and _cudnn_usable(query.device):
        try:
            out = _cudnn_attention(query, key, value, descales, out_scale)
            _note(CUDNN)
            return out
        except Exception as error:  # a graph cuDNN will not build here: emulate from now on, and say why once
            _disable(query.device, error)
    _note(EMULATED)
    return _emulated_attention(query, key, value, descales, out_scale, dtype)


@fp8_sdpa.register_fake
def _(query, key, value, descales, out_scale, dtype) -> torch.Tensor:
    return query.new_empty(query.shape)


class Fp8AttentionProcessor:
    """Dense self-attention on the stock q/k/v (`attention.qkv`), computed through FP8; an FP8 out projection
    (`fp8_linear`) takes the kernel's FP8 output as it is."""

    def __call__(self, attn: Any, hidden_states: torch.Tensor, rotary_emb: torch.Tensor, sparse_params: Any) -> torch.Tensor:
        query, key, value = qkv(attn, hidden_states, rotary_emb)
        out, out_scale = quantised_attention(query, key, value)
        if isinstance(attn.out_layer, Fp8Linear):
            return attn.out_layer.forward_fp8(out.transpose(1, 2).flatten(2, 3), out_scale.reciprocal(), query.dtype)
        return attn.out_layer(dequantised(out, out_scale, query.dtype).transpose(1, 2).flatten(2, 3))


def backend_used() -> str | None:
    """What the latest FP8 attention calls ran: `cudnn_fp8`, `fp8_emulated`, or both joined by `+` (None: none ran
    since `reset_backend_used`)."""
    with _LOCK:
        return "+".join(sorted(_RAN)) or None


def expected_backend(devices: Sequence[torch.device]) -> str:
    """What FP8 attention will run on `devices`, as far as can be told before a call: cuDNN where it is usable,
    emulated elsewhere. A cuDNN graph that fails to build is emulated from its first call on: the windows it makes
    say so (`backend_used`), and the next call's expectation too."""
    return "+".join(sorted({CUDNN if d.type == "cuda" and _cudnn_usable(d) else EMULATED for d in devices}))


def reset_backend_used() -> None:
    with _LOCK:
        _RAN.clear()


# --- the quantisation both paths share -------------------------------------------------------------------------


def _scale_of(x: torch.Tensor) -> torch.Tensor:
    """0-d float32 multiplier that maps the largest magnitude of `x` onto the FP8 maximum (no host sync), rounded to
    x's dtype first: quantising multiplies by exactly the value whose reciprocal dequantises (a max rounded up one
    step still casts to 448)."""
    return (FP8_MAX / x.detach().abs().amax().float().clamp_min(1e-12)).to(x.dtype).float()


def _quantised(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """(B, H, S, D) -> the same, contiguous float8: cuDNN's FP8 kernel reads heads-major operands ~9 % faster than
    the projections' (B, S, H, D) layout (bench/fp8_attention_plans.py), and the cast writes them anew anyway."""
    return (x * scale.to(x.dtype)).to(FP8).contiguous()


def _emulated_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    descales: torch.Tensor,
    out_scale: torch.Tensor,
    dtype: torch.dtype,
) -> torch.Tensor:
    q, k, v = ((t.float() * d).to(dtype) for t, d in zip((q, k, v), descales))
    out = F.scaled_dot_product_attention(q, k, v)
    return (out * out_scale.to(dtype)).to(FP8).contiguous()


# --- cuDNN --------------------------------------------------------------------------------------------------------


def _cudnn_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, descales: torch.Tensor, out_scale: torch.Tensor
) -> torch.Tensor:
    import cudnn

    device = q.device
    batch, heads, tokens, dim = q.shape
    kv_tokens = k.shape[2]
    graph, workspace_bytes = _graph(device, batch, heads, tokens, kv_tokens, dim)
    handle = _handle(device)
    cudnn.set_stream(handle, torch.cuda.current_stream(device).cuda_stream)

    def scalar(value: torch.Tensor) -> torch.Tensor:
        return value.reshape(1, 1, 1, 1).float().contiguous()

    out = torch.empty((batch, heads, tokens, dim), dtype=FP8, device=device)
    amax = torch.empty((2, 1, 1, 1, 1), dtype=torch.float32, device=device)
    pack = {
        _UIDS["q"]: q,
        _UIDS["k"]: k,
        _UIDS["v"]: v,
        _UIDS["o"]: out,
        _UIDS["descale_q"]: scalar(descales[0]),
        _UIDS["descale_k"]: scalar(descales[1]),
        _UIDS["descale_v"]: scalar(descales[2]),
        **_softmax_scales(device),
        _UIDS["scale_o"]: scalar(out_scale),
        _UIDS["amax_s"]: amax[0],
        _UIDS["amax_o"]: amax[1],
    }
    workspace = torch.empty(max(workspace_bytes, 1), dtype=torch.uint8, device=device)
    graph.execute(pack, workspace, handle=handle)
    return out


def _softmax_scales(device: torch.device) -> dict[int, torch.Tensor]:
    """The probabilities' scale and descale on `device` (made once per value, not copied in per call)."""
    cache = _thread_state("softmax_scales")
    key = (device.index, SOFTMAX_SCALE)
    if key not in cache:
        values = torch.tensor([SOFTMAX_SCALE, 1.0 / SOFTMAX_SCALE], dtype=torch.float32, device=device)
        cache[key] = {_UIDS["scale_s"]: values[0].reshape(1, 1, 1, 1), _UIDS["descale_s"]: values[1].reshape(1, 1, 1, 1)}
    return cache[key]


def _graph(device: torch.device, batch: int, heads: int, tokens: int, kv_tokens: int, dim: int) -> tuple[Any, int]:
    """The built cuDNN graph for this shape (once per shape, GPU and thread: a graph is bound to its thread's handle)
    and its workspace size."""
    key = (device.index, batch, heads, tokens, kv_tokens, dim)
    graphs = _thread_state("graphs")
    built = graphs.get(key)
    if built is not None:
        return built
    import cudnn

    graph = operation_graph(_handle(device), batch, heads, tokens, kv_tokens, dim, heads_major=True)
    graph.create_execution_plans([cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK])
    graph.check_support()
    graph.build_plans()
    built = graphs[key] = (graph, graph.get_workspace_size())
    log.info("cuDNN FP8 attention graph built for %s on %s (its plans, cuDNN's preferred first: %s)", key[1:], device,
             _plans(graph))
    return built


def _plans(graph: Any) -> str:
    """The names of the graph's execution plans in its heuristics' order, the preferred one (the one that runs where
    it builds) first; for the log: one clip's `high` bytes differed between worker processes (bench/RESULTS.md)."""
    try:
        return ", ".join(graph.get_plan_name_at_index(index) for index in range(graph.get_execution_plan_count()))
    except Exception as error:  # a name is only for the log
        return f"not named ({type(error).__name__})"


def operation_graph(
    handle: Any, batch: int, heads: int, tokens: int, kv_tokens: int, dim: int, heads_major: bool = False
) -> Any:
    """cuDNN's FP8 attention as an operation graph, before any plan: q, k, v and the output (B, H, S, D), over
    (B, H, S, D) memory (`heads_major`) or (B, S, H, D) memory, as the projections make them."""
    import cudnn

    fp8, f32 = cudnn.data_type.FP8_E4M3, cudnn.data_type.FLOAT
    graph = cudnn.pygraph(io_data_type=fp8, intermediate_data_type=f32, compute_data_type=f32, handle=handle)

    def strides(length: int) -> tuple[int, ...]:
        if heads_major:
            return (heads * length * dim, length * dim, dim, 1)
        return (length * heads * dim, dim, heads * dim, 1)

    def operand(uid: int, length: int):
        return graph.tensor(uid=uid, dim=(batch, heads, length, dim), stride=strides(length), data_type=fp8)

    def scalar(name: str):
        return graph.tensor(uid=_UIDS[name], dim=(1, 1, 1, 1), stride=(1, 1, 1, 1), data_type=f32)

    out, _, amax_s, amax_o = graph.sdpa_fp8(
        q=operand(_UIDS["q"], tokens),
        k=operand(_UIDS["k"], kv_tokens),
        v=operand(_UIDS["v"], kv_tokens),
        descale_q=scalar("descale_q"),
        descale_k=scalar("descale_k"),
        descale_v=scalar("descale_v"),
        descale_s=scalar("descale_s"),
        scale_s=scalar("scale_s"),
        scale_o=scalar("scale_o"),
        generate_stats=False,
        attn_scale=dim**-0.5,
        use_causal_mask=False,
    )
    out.set_uid(_UIDS["o"]).set_output(True).set_dim((batch, heads, tokens, dim)).set_stride(strides(tokens))
    out.set_data_type(fp8)
    for name, tensor in (("amax_s", amax_s), ("amax_o", amax_o)):
        tensor.set_uid(_UIDS[name]).set_output(True).set_dim((1, 1, 1, 1)).set_stride((1, 1, 1, 1)).set_data_type(f32)
    graph.validate()
    graph.build_operation_graph()
    return graph


def _handle(device: torch.device) -> Any:
    """This thread's cuDNN handle on `device` (cuDNN handles are not to be shared between threads)."""
    handles = _thread_state("handles")
    if device.index not in handles:
        import cudnn

        with torch.cuda.device(device):
            handles[device.index] = cudnn.create_handle()
    return handles[device.index]


def _thread_state(name: str) -> dict:
    if not hasattr(_THREAD, name):
        setattr(_THREAD, name, {})
    return getattr(_THREAD, name)


def _cudnn_usable(device: torch.device) -> bool:
    """Whether to try cuDNN on this GPU: the package imports, the GPU is Hopper or later, no graph failed on it."""
    with _LOCK:
        if device.index in _DISABLED:
            return False
    if torch.cuda.get_device_capability(device)[0] < 9:
        _disable(device, "FP8 attention needs a Hopper or later GPU")
        return False
    try:
        import cudnn  # noqa: F401  (the optional `fp8` extra: nvidia-cudnn-frontend)
    except Exception as error:  # absent, or present without a loadable cuDNN
        _disable(device, f"nvidia-cudnn-frontend not usable ({error})")
        return False
    return True


def why_emulated() -> dict[str, str]:
    """GPU -> why FP8 attention is emulated there (benchmarks record it beside their figures)."""
    with _LOCK:
        return dict(_WHY)


def _disable(device: torch.device, why: Any) -> None:
    with _LOCK:
        first = device.index not in _DISABLED
        _DISABLED.add(device.index)
        _WHY.setdefault(str(device), f"{type(why).__name__}: {why}" if isinstance(why, BaseException) else str(why))
    if first:
        log.warning("FP8 attention on %s is emulated (FP8 quantisation around bf16 SDPA): %s", device, why)


def _note(backend: str) -> None:
    with _LOCK:
        _RAN.add(backend)


_LOCK = threading.Lock()
_THREAD = threading.local()  # "handles": device index -> cuDNN handle; "graphs": shape key -> (graph, workspace bytes)
_DISABLED: set[int | None] = set()
_WHY: dict[str, str] = {}
_RAN: set[str] = set()
