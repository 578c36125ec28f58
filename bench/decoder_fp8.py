"""The decoder's convolutions in FP8: what cuDNN's FP8 conv fprop would save against the bf16 convolutions the
decoder runs, shape by shape (issue 25's "reduced-precision decoder paths"; GPU only, Hopper or later).

    python3 bench/decoder_fp8.py --out decoder-fp8.jsonl [--latent 32x48] [--every-plan 6]

The full-size K-VAE decoder (random bf16 weights, `fast_vae.speed_up_decoder` as the engine runs it) decodes one
tile's leading latent frame, then one steady 4-frame segment while every `F.conv3d` call is recorded (input, weight,
how often). Per distinct call, one line: bf16 as the decoder calls it (NCDHW) and channels-last, and cuDNN's FP8
graph (input and weight quantised per tensor onto e4m3's 448, fp32 accumulation, descaled to a bf16 or an FP8
output, bias added) on the plan cuDNN's heuristics pick; the quantisation's own cost; the relative L2 error against
bf16. A `totals` line sums them over the segment. `--every-plan N` instead times every plan cuDNN offers for the N
largest calls, FP8 and bf16 (its frontend), and stops there: the heuristics' pick is not always the fastest.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from worker.sr.fast_vae import speed_up_decoder  # noqa: E402
from worker.sr.fp8 import FP8, FP8_MAX  # noqa: E402

CONV3D = F.conv3d


class Recorder:
    """`F.conv3d` while `on`: each distinct call once (its input kept) and how often it ran."""

    def __init__(self) -> None:
        self.on, self.calls = False, {}

    def __call__(self, x, weight, bias=None, stride=1, padding=0, dilation=1, groups=1):
        if self.on:
            key = (tuple(x.shape), tuple(weight.shape), bias is not None, str(stride), str(padding), str(dilation))
            call = self.calls.setdefault(key, dict(x=x.detach().clone(), w=weight.detach(), b=None if bias is None else bias.detach(),
                                                   args=(stride, padding, dilation), count=0))  # fmt: skip
            call["count"] += 1
        return CONV3D(x, weight, bias, stride, padding, dilation, groups)


def timed(fn, reps: int = 5) -> float:
    """Seconds per call, CUDA events, after one untimed call."""
    fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps / 1000


def triple(value) -> list[int]:
    return list(value) if isinstance(value, (tuple, list)) else [value] * 3


class CudnnConv:
    """One cuDNN conv fprop graph on channels-last tensors: FP8 (per-tensor scales) or bf16 inputs."""

    def __init__(self, handle, call: dict, out_dtype: torch.dtype, in_dtype: torch.dtype, every_plan: bool) -> None:
        import cudnn

        x, w, b = call["x"], call["w"], call["b"]
        stride, padding, dilation = call["args"]
        ones = torch.ones((), device=x.device)
        x_scale = FP8_MAX / x.abs().amax().float().clamp_min(1e-12) if in_dtype == FP8 else ones
        w_scale = FP8_MAX / w.abs().amax().float().clamp_min(1e-12) if in_dtype == FP8 else ones
        self.quantise = lambda: (x * x_scale).to(in_dtype).contiguous(memory_format=torch.channels_last_3d)  # noqa: E731
        xq, wq = self.quantise(), (w * w_scale).to(in_dtype).contiguous(memory_format=torch.channels_last_3d)
        kind = {FP8: cudnn.data_type.FP8_E4M3, torch.bfloat16: cudnn.data_type.BFLOAT16}
        f32 = cudnn.data_type.FLOAT
        g = cudnn.pygraph(io_data_type=kind[in_dtype], intermediate_data_type=f32, compute_data_type=f32, handle=handle)
        X = g.tensor(name="X", dim=list(xq.shape), stride=list(xq.stride()), data_type=kind[in_dtype])
        W = g.tensor(name="W", dim=list(wq.shape), stride=list(wq.stride()), data_type=kind[in_dtype])
        D = g.tensor(name="D", dim=[1] * 5, stride=[1] * 5, data_type=f32)
        y = g.scale(input=g.conv_fprop(image=X, weight=W, padding=triple(padding), stride=triple(stride), dilation=triple(dilation)), scale=D)
        self.reference = CONV3D(x, w, b, stride, padding, dilation)
        self.out = torch.empty_like(self.reference, memory_format=torch.channels_last_3d).to(out_dtype)
        self.pack = {X: xq, W: wq, D: (1 / (x_scale * w_scale)).reshape([1] * 5).contiguous()}
        if b is not None:
            bias = b.reshape(1, -1, 1, 1, 1).contiguous(memory_format=torch.channels_last_3d)
            B = g.tensor(name="B", dim=list(bias.shape), stride=list(bias.stride()), data_type=cudnn.data_type.BFLOAT16)
            y, self.pack[B] = g.bias(input=y, bias=B), bias
        self.pack[y] = self.out
        y.set_output(True).set_dim(list(self.out.shape)).set_stride(list(self.out.stride())).set_data_type(kind[out_dtype])
        g.validate()
        g.build_operation_graph()
        modes = [cudnn.heur_mode.A, cudnn.heur_mode.B, cudnn.heur_mode.FALLBACK] if every_plan else [cudnn.heur_mode.A, cudnn.heur_mode.FALLBACK]
        g.create_execution_plans(modes)
        g.check_support()
        g.build_plans(cudnn.build_plan_policy.ALL) if every_plan else g.build_plans()
        self.graph, self.handle = g, handle
        self.workspace = torch.empty(max(g.get_workspace_size(), 1), device=x.device, dtype=torch.uint8)

    def seconds(self) -> float:
        return timed(lambda: self.graph.execute(self.pack, self.workspace, handle=self.handle))

    def plans(self) -> list[tuple[float, int]]:
        """(seconds, plan index) of every plan that runs, fastest first."""
        ranked = []
        for index in range(self.graph.get_execution_plan_count()):
            try:
                run = lambda: self.graph.execute_plan_at_index(self.pack, self.workspace, index, handle=self.handle)  # noqa: E731
                ranked.append((timed(run, reps=3), index))
            except Exception:  # noqa: BLE001  (a plan that will not run here is not a candidate)
                continue
        return sorted(ranked)

    def error(self) -> float:
        """Relative L2 of the last output against bf16's."""
        ref = self.reference.float()
        return ((self.out.float() - ref).norm() / ref.norm().clamp_min(1e-12)).item()


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--latent", default="32x48", help="the tile's latent HxW (W1's landscape tile: 32x48)")
    parser.add_argument("--every-plan", type=int, default=0, help="time every cuDNN plan for the N largest calls")
    args = parser.parse_args(argv)
    import cudnn
    from diffusers.models.autoencoders.autoencoder_kandinsky6_sr import Kandinsky6SRVAE

    lines = args.out.open("a")

    def emit(**record) -> None:
        print(json.dumps(record), flush=True)
        lines.write(json.dumps(record) + "\n")
        lines.flush()

    height, width = (int(v) for v in args.latent.split("x"))
    device = torch.device("cuda")
    torch.manual_seed(0)
    decoder = speed_up_decoder(Kandinsky6SRVAE().to(device, torch.bfloat16).eval()).decoder
    latent = torch.randn(1, 64, 5, height, width, device=device, dtype=torch.bfloat16)
    recorder = Recorder()
    F.conv3d = recorder  # the stock modules and fast_vae call F.conv3d by attribute
    with torch.no_grad():
        cache = decoder.make_cache()
        decoder(latent[:, :, :1], cache)
        recorder.on = True
        decoder(latent[:, :, 1:5], cache)
        recorder.on = False
        segment_s = timed(lambda: decoder(latent[:, :, 1:5], cache), reps=1)
    F.conv3d = CONV3D
    emit(phase="segment", latent=[height, width], seconds=segment_s, distinct_calls=len(recorder.calls),
         cudnn=torch.backends.cudnn.version(), cudnn_frontend=cudnn.__version__, torch=torch.__version__)  # fmt: skip
    handle = cudnn.create_handle()
    cudnn.set_stream(handle, torch.cuda.current_stream().cuda_stream)
    calls = list(recorder.calls.values())
    if args.every_plan:
        for call in sorted(calls, key=lambda c: -c["x"].numel() * c["w"].numel())[: args.every_plan]:
            x, w, b, conv_args = call["x"], call["w"], call["b"], call["args"]
            xcl, wcl = x.contiguous(memory_format=torch.channels_last_3d), w.contiguous(memory_format=torch.channels_last_3d)
            record = dict(phase="every_plan", x=list(x.shape), w=list(w.shape),
                          bf16_ms=timed(lambda: CONV3D(x, w, b, *conv_args)) * 1e3,
                          bf16_channels_last_ms=timed(lambda: CONV3D(xcl, wcl, b, *conv_args)) * 1e3)  # fmt: skip
            for name, kind in (("fp8", FP8), ("bf16_cudnn_frontend", torch.bfloat16)):
                ranked = CudnnConv(handle, call, torch.bfloat16, kind, every_plan=True).plans()
                record |= {f"{name}_plans": len(ranked), f"{name}_fastest_ms": [round(s * 1e3, 3) for s, _ in ranked[:3]]}
            emit(**record)
        return
    totals = dict(bf16_s=0.0, bf16_channels_last_s=0.0, fp8_s=0.0, fp8_quantise_s=0.0)
    for call in calls:
        x, w, b, conv_args, count = call["x"], call["w"], call["b"], call["args"], call["count"]
        xcl, wcl = x.contiguous(memory_format=torch.channels_last_3d), w.contiguous(memory_format=torch.channels_last_3d)
        bf16 = timed(lambda: CONV3D(x, w, b, *conv_args))
        record = dict(phase="conv", x=list(x.shape), w=list(w.shape), padding=str(conv_args[1]), count=count,
                      bf16_ms=bf16 * 1e3, bf16_channels_last_ms=timed(lambda: CONV3D(xcl, wcl, b, *conv_args)) * 1e3)  # fmt: skip
        fp8 = bf16  # a call FP8 cannot run stays bf16 in the totals
        for name, out_dtype in (("fp8_bf16_out", torch.bfloat16), ("fp8_fp8_out", FP8)):
            try:
                conv = CudnnConv(handle, call, out_dtype, FP8, every_plan=False)
                seconds = conv.seconds()
                record |= {f"{name}_ms": seconds * 1e3, f"{name}_relative_l2": conv.error()}
                if out_dtype == torch.bfloat16:
                    fp8, record["quantise_ms"] = seconds, timed(conv.quantise) * 1e3
                    totals["fp8_quantise_s"] += record["quantise_ms"] / 1e3 * count
            except Exception as error:  # noqa: BLE001  (recorded: a shape cuDNN will not build in FP8)
                record[f"{name}_error"] = f"{type(error).__name__}: {error}"[:300]
        totals["bf16_s"] += bf16 * count
        totals["bf16_channels_last_s"] += record["bf16_channels_last_ms"] / 1e3 * count
        totals["fp8_s"] += fp8 * count
        emit(**record)
        del call["x"]
    emit(phase="totals", segment_s=segment_s, **totals)


if __name__ == "__main__":
    main()
