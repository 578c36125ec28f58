"""Every cuDNN execution plan for `high`'s FP8 attention at one W1 tile's shape (1 x 28 heads x 47,616 tokens x 64),
timed: whether a plan other than the one cuDNN's heuristics pick (`worker.sr.fp8_attention._graph`: mode A, then
the fallback list, the first that builds) is faster, in the worker's (B, S, H, D) layout and heads-major.

    python3 bench/fp8_attention_plans.py --out plans.jsonl [--repeat 10]

One line per plan: the heuristics mode that listed it, its index and engine name, milliseconds per call (after two
untimed calls) and the relative L2 error of its output against bf16 SDPA's. First, two lines for `lossless`'s own
kernel (bf16 SDPA, which PyTorch sends to cuDNN's flash kernel) in the same two layouts, and whether the heads-major
one gives the same bits: if it does and is faster, `lossless` could write its q, k, v heads-major too. Needs a
Hopper GPU and nvidia-cudnn-frontend (bench/quality_wheels.sh).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench.quality import W1_TILE_LATENT
from worker.sr import fp8_attention as fa
from worker.sr.fp8 import FP8

HEADS, DIM = 28, 64


def main(argv: list[str] | None = None) -> None:
    import cudnn

    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True, help="JSON lines, appended")
    parser.add_argument("--repeat", type=int, default=10)
    args = parser.parse_args(argv)
    device = torch.device("cuda:0")
    tokens = W1_TILE_LATENT[0] * W1_TILE_LATENT[1] * W1_TILE_LATENT[2]
    generator = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, tokens, HEADS, DIM, generator=generator).to(device, torch.bfloat16) for _ in range(3))
    exact = F.scaled_dot_product_attention(*(t.transpose(1, 2) for t in (q, k, v))).transpose(1, 2).float()

    def timed(call) -> tuple[float, torch.Tensor]:
        for _ in range(2):
            out = call()
        torch.cuda.synchronize(device)
        started = time.perf_counter()
        for _ in range(args.repeat):
            out = call()
        torch.cuda.synchronize(device)
        return round((time.perf_counter() - started) / args.repeat * 1e3, 3), out

    # bf16 SDPA as `lossless` calls it ((B, H, S, D) views of the projections' (B, S, H, D) memory), then heads-major
    views = [t.transpose(1, 2) for t in (q, k, v)]
    contiguous = [t.contiguous() for t in views]
    ms_views, out_views = timed(lambda: F.scaled_dot_product_attention(*views))
    ms_heads, out_heads = timed(lambda: F.scaled_dot_product_attention(*contiguous))
    scales = [fa._scale_of(t) for t in (q, k, v)]
    quantised = [(t * s.to(t.dtype)).to(FP8) for t, s in zip((q, k, v), scales)]  # (B, S, H, D)
    handle = fa._handle(device)

    def emit(record: dict) -> None:
        line = json.dumps(record)
        print(line, flush=True)
        with open(args.out, "a") as out:
            out.write(line + "\n")

    emit({"kernel": "bf16_sdpa", "layout": "bshd", "ms": ms_views})
    same = bool(torch.equal(out_views, out_heads))
    emit({"kernel": "bf16_sdpa", "layout": "bhsd", "ms": ms_heads, "same_bits_as_bshd": same})
    for heads_major in (False, True):
        layout = "bhsd" if heads_major else "bshd"
        operands = [t.transpose(1, 2).contiguous() if heads_major else t for t in quantised]
        out = torch.empty_like(operands[0])
        amax = torch.empty((2, 1, 1, 1, 1), dtype=torch.float32, device=device)
        pack = {
            fa._UIDS["q"]: operands[0], fa._UIDS["k"]: operands[1], fa._UIDS["v"]: operands[2], fa._UIDS["o"]: out,
            **{fa._UIDS[f"descale_{n}"]: s.reciprocal().reshape(1, 1, 1, 1).contiguous()
               for n, s in zip("qkv", scales)},
            **fa._softmax_scales(device), fa._UIDS["scale_o"]: scales[2].reshape(1, 1, 1, 1).contiguous(),
            fa._UIDS["amax_s"]: amax[0], fa._UIDS["amax_o"]: amax[1],
        }  # fmt: skip
        for mode in ("A", "B", "FALLBACK"):
            graph = fa.operation_graph(handle, 1, HEADS, tokens, tokens, DIM, heads_major=heads_major)
            try:
                graph.create_execution_plans([getattr(cudnn.heur_mode, mode)])
                count = graph.get_execution_plan_count()
            except Exception as error:
                emit({"layout": layout, "mode": mode, "error": f"{type(error).__name__}: {error}"[:300]})
                continue
            for index in range(count):
                record = {"kernel": "cudnn_fp8", "layout": layout, "mode": mode, "index": index}
                try:
                    record["name"] = graph.get_plan_name_at_index(index)
                    graph.build_plan_at_index(index)
                    size = max(graph.get_workspace_size_plan_at_index(index), 1)
                    workspace = torch.empty(size, dtype=torch.uint8, device=device)
                    record["ms"], _ = timed(lambda: graph.execute_plan_at_index(pack, workspace, index, handle=handle))
                    result = out.transpose(1, 2) if heads_major else out
                    result = result.float() / scales[2]
                    record["relative_l2_vs_bf16"] = round(((result - exact).norm() / exact.norm()).item(), 5)
                except Exception as error:  # a plan that does not build or run here: said, and the next one
                    record["error"] = f"{type(error).__name__}: {error}"[:300]
                emit(record)


if __name__ == "__main__":
    main()
