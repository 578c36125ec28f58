"""Kandinsky 6 SR checkpoints in the diffusers format: load them onto a device group, or write a tiny random one.

Layout: `transformer/`, `vae/`, `scheduler/` and optionally `latent_upscaler/`, as `Kandinsky6SRPipeline.
save_pretrained` writes it. The transformer, VAE and scheduler load with diffusers' own `from_pretrained`; the latent
upscaler bank is built empty and filled from its safetensors with only the weights its `forward` uses, since the x2
entry carries a 1.45 B-parameter backbone (2.9 GB in bf16) that is never run.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch import nn

from worker.sr.errors import CheckpointNotFound

logger = logging.getLogger(__name__)

HUB_ID = "kandinskylab/Kandinsky-6.0-VSR-distilled2steps-5s-Diffusers"
CONFIG_FILES = {"transformer": "config.json", "vae": "config.json", "scheduler": "scheduler_config.json"}
SCHEDULERS = ("PiflowScheduler", "FlowMatchEulerDiscreteScheduler")
# Submodules of each `Kandinsky6SRLatentUpscaler` that its `forward` never calls (diffusers 0.42.1, U:176-182 and
# 236-237): the x2 entry only runs `mid_input_proj` + `x2_branch`; no entry runs the deep-supervision head.
UNUSED_UPSCALER_MODULES = {
    2: ("input_proj", "pre_blocks", "upsample_1", "mid_blocks", "mid_output_head", "upsample_2", "post_blocks", "output_proj"),
    4: ("mid_output_head",),
}
HOW_TO_GET = (
    f"Download the real weights with `hf download {HUB_ID} --local-dir DIR` and pass that DIR, "
    "or write a tiny random checkpoint for tests and demos with `vsrq checkpoint tiny DIR`."
)


@dataclass
class Components:
    """One replica of the model on one device."""

    device: torch.device
    transformer: nn.Module
    vae: nn.Module
    scheduler: object
    latent_upscaler: nn.Module | None
    placement: Any = None  # `offload.Placement` while its weights are offloaded; None: resident on `device`
    identity: str = ""  # the checkpoint's files (`identity`): other weights under the same path give other bits

    @property
    def dtype(self) -> torch.dtype:
        return self.transformer.dtype

    def modules(self) -> dict[str, nn.Module]:
        named = {"transformer": self.transformer, "vae": self.vae, "latent_upscaler": self.latent_upscaler}
        return {name: module for name, module in named.items() if module is not None}


@dataclass
class LoadReport:
    source: str
    rows: list[tuple[str, str, int]] = field(default_factory=list)  # (component, device, bytes)
    skipped_bytes: int = 0  # weights in the checkpoint that were never read

    def __str__(self) -> str:
        lines = [f"loaded {self.source}"]
        lines += [f"  {name:<16} {device:<8} {size / 2**20:12.3f} MiB" for name, device, size in self.rows]
        lines.append(f"  not loaded (never used by forward): {self.skipped_bytes / 2**20:.3f} MiB")
        return "\n".join(lines)


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if device.type == "cuda" else torch.float32


def module_bytes(module: nn.Module) -> int:
    return sum(t.numel() * t.element_size() for t in [*module.parameters(), *module.buffers()])


def resolve(source: str) -> Path:
    """A local directory holding the checkpoint; hub ids are fetched (or found in the local cache)."""
    path = Path(source).expanduser()
    if path.exists() or source.startswith((".", "/", "~")) or source.count("/") != 1:
        missing = [f"{name}/" for name, config in CONFIG_FILES.items() if not (path / name / config).exists()]
        if missing:
            raise CheckpointNotFound(f"No Kandinsky 6 SR checkpoint at '{path}': missing {', '.join(missing)}. {HOW_TO_GET}")
        return path
    from huggingface_hub import snapshot_download

    try:
        return Path(
            snapshot_download(source, allow_patterns=[f"{name}/*" for name in (*CONFIG_FILES, "latent_upscaler")] + ["model_index.json"])
        )
    except Exception as exc:  # offline, unknown repo, auth: all mean "not here" to the user
        raise CheckpointNotFound(
            f"Could not get checkpoint '{source}' from the Hugging Face hub ({type(exc).__name__}). {HOW_TO_GET}"
        ) from None


def identity(path: Path, sample: int = 64 * 1024) -> str:
    """A digest of the checkpoint's files that changes when its weights do, read in milliseconds: each file's path and
    size, a small file whole and a large one's head, middle and tail (a safetensors header names every tensor's
    offsets; new weights change bytes throughout). No mtimes: the same files copied to another worker agree."""
    digest = hashlib.sha256()
    for file in sorted(p for p in path.rglob("*") if p.is_file() and not p.relative_to(path).parts[0].startswith(".")):
        size = file.stat().st_size
        digest.update(f"{file.relative_to(path).as_posix()}\0{size}\0".encode())
        with file.open("rb") as stream:
            for offset in [0] if size <= 3 * sample else [0, (size - sample) // 2, size - sample]:
                stream.seek(offset)
                digest.update(stream.read(sample))
    return digest.hexdigest()


def load(
    source: str, devices: list[torch.device], dtype: torch.dtype | None = None, on_host: bool = False
) -> tuple[list[Components], LoadReport]:
    """Load one replica per distinct device (CPU 'devices' share one), in eval mode with the dense SDPA processor.
    `on_host`: the weights stay in host memory (for an engine that offloads them, or places them once it has chosen
    its mode), in the device's dtype."""
    # Imported here, not with this module, which worker.sr.readahead imports before diffusers is: attention brings
    # diffusers' K6 modules alone (worker.sr.k6_models), before `diffusers.Kandinsky6SR...` would bring the rest
    from worker.sr.attention import PROCESSORS  # isort: skip
    import diffusers

    path = resolve(source)
    report, weights = LoadReport(source=str(path)), identity(path)
    replicas: dict[torch.device, Components] = {}
    for device in devices:
        if device in replicas:
            continue
        model_dtype = dtype or default_dtype(device)
        transformer = diffusers.Kandinsky6SRTransformer3DModel.from_pretrained(path, subfolder="transformer", dtype=model_dtype)
        transformer.set_attn_processor(PROCESSORS["sdpa"]())
        vae = diffusers.Kandinsky6SRVAE.from_pretrained(path, subfolder="vae", dtype=model_dtype)
        upscaler, skipped = _load_upscaler(path / "latent_upscaler", model_dtype)
        report.skipped_bytes = skipped
        replica = Components(
            device=device,
            transformer=transformer,
            vae=vae,
            scheduler=_load_scheduler(path),
            latent_upscaler=upscaler,
            identity=weights,
        )
        for name, module in replica.modules().items():
            module.requires_grad_(False).eval().to("cpu" if on_host else device)
            report.rows.append((name, str(device), module_bytes(module)))
        replicas[device] = replica
    logger.info("%s", report)
    return [replicas[device] for device in devices], report


def _load_scheduler(path: Path):
    import diffusers

    config = json.loads((path / "scheduler" / "scheduler_config.json").read_text())
    name = config.get("_class_name")
    if name not in SCHEDULERS:
        raise CheckpointNotFound(f"Unsupported scheduler {name!r} in '{path}/scheduler'; expected one of {SCHEDULERS}.")
    return getattr(diffusers, name).from_pretrained(path, subfolder="scheduler")


def _load_upscaler(path: Path, dtype: torch.dtype) -> tuple[nn.Module | None, int]:
    """The bank without its unused submodules, reading only the weights it keeps. Returns (bank, bytes skipped)."""
    if not (path / "config.json").exists():
        return None, 0
    from accelerate import init_empty_weights
    from diffusers import Kandinsky6SRLatentUpscalerBank
    from safetensors import safe_open

    config = Kandinsky6SRLatentUpscalerBank.load_config(path)
    with init_empty_weights():
        bank = Kandinsky6SRLatentUpscalerBank.from_config(config)
    prune_upscaler(bank)
    wanted = set(bank.state_dict())
    state, skipped = {}, 0
    for file in sorted(path.glob("*.safetensors")):
        with safe_open(str(file), framework="pt") as weights:
            for key in weights.keys():
                if key in wanted:
                    state[key] = weights.get_tensor(key).to(dtype)
                else:
                    sliced = weights.get_slice(key)
                    skipped += math.prod(sliced.get_shape()) * dtype.itemsize
    missing = wanted - state.keys()
    if missing:
        raise CheckpointNotFound(f"Latent upscaler at '{path}' lacks {len(missing)} weights, e.g. {sorted(missing)[:3]}.")
    bank.load_state_dict(state, strict=True, assign=True)
    return bank, skipped


def prune_upscaler(bank: nn.Module) -> nn.Module:
    """Drop the submodules of each upscaler that its `forward` never calls."""
    for scale, model in zip(bank.config.scales, bank._models):
        for name in UNUSED_UPSCALER_MODULES.get(scale, ()):
            delattr(model, name)
    return bank


def tiny_components(variant: str = "piflow", latent_upscaler: bool = True, seed: int = 0) -> dict:
    """Random components in the tiny configuration diffusers' own tests use; fast on a CPU."""
    import diffusers

    if variant not in ("piflow", "flowmatch"):
        raise ValueError(f"variant must be 'piflow' or 'flowmatch', got {variant!r}")
    torch.manual_seed(seed)
    latent_channels, n_grid = 4, 10
    return {
        "transformer": diffusers.Kandinsky6SRTransformer3DModel(
            in_visual_dim=latent_channels,
            out_visual_dim=latent_channels * (n_grid if variant == "piflow" else 1),
            time_dim=16,
            model_dim=24,
            ff_dim=32,
            num_visual_blocks=2,
            axes_dims=(4, 4, 4),
            tile_sizes=((32, 32), (32, 64), (64, 32)),
        ),
        "vae": diffusers.Kandinsky6SRVAE(
            latent_channels=latent_channels,
            encoder_block_out_channels=(4, 8, 8),
            decoder_block_out_channels=(4, 8, 8),
            layers_per_block=1,
            temporal_compression_ratio=4,
            temporal_compression_start_level=0,
        ),
        "latent_upscaler": diffusers.Kandinsky6SRLatentUpscalerBank(
            in_channels=latent_channels,
            stage_channels=(8, 8, 4),
            num_pre_blocks=1,
            num_mid_blocks=1,
            num_post_blocks=1,
            num_x2_adapter_blocks=1,
            scales=(2, 4),
        )
        if latent_upscaler
        else None,
        "scheduler": diffusers.PiflowScheduler(n_grid=n_grid)
        if variant == "piflow"
        else diffusers.FlowMatchEulerDiscreteScheduler(shift=3.5),
    }


def write_tiny(directory: Path, variant: str = "piflow", latent_upscaler: bool = True, seed: int = 0) -> Path:
    """Save `tiny_components` in the real checkpoint format, as `Kandinsky6SRPipeline.save_pretrained` does."""
    # from its module: diffusers' top-level name needs `transformers`, which a worker's process hides (service.upscaler)
    from diffusers.pipelines.kandinsky6.pipeline_kandinsky6_sr import Kandinsky6SRPipeline

    Kandinsky6SRPipeline(**tiny_components(variant, latent_upscaler, seed)).save_pretrained(directory)
    return Path(directory)
