"""What a worker process holds for its whole life: its settings, the job store, the blob store and the upscaler.

Each is made once per process, on first use: the upscaler is the expensive one (a checkpoint on the GPUs), so the
worker loads it at start (`worker_init`, see worker.tasks) rather than inside its first job.
"""

from __future__ import annotations

import sys
from functools import cache
from pathlib import Path
from typing import Annotated, Literal

from pydantic import Field, field_validator
from pydantic_settings import BaseSettings, NoDecode, SettingsConfigDict

from storage.blobs import BlobStore, open_blob_store
from storage.config import Settings, served_name
from storage.jobs import JobStore
from storage.webhooks import Outbox


class WorkerSettings(BaseSettings):
    """`VSRQ_WORKER_*`: what this worker runs. One model per worker: run it on the queue its model is served on."""

    model_config = SettingsConfigDict(env_prefix="VSRQ_WORKER_", env_file=".env", extra="ignore")

    model: str = "lanczos"  # a checkpoint directory, a hub id, or "lanczos"
    # The name its jobs report having run (`output.model`): the name VSRQ_MODELS serves it under, where `model` is a
    # directory named otherwise (/models/k6-vsr for the hub's kandinskylab/...). Unset: `model`, a directory by its name
    served_as: str | None = None
    devices: str = "cpu"  # comma-separated, e.g. "cuda:0,cuda:1"
    heartbeat_s: float = 0.5  # progress heartbeats at most this often (and at the end of every window)
    # "speed": every tile's decoder cache resident; "balanced": parked in host memory between segments; "memory":
    # one tile at a time per GPU. The same output, up to 2/255 on GPUs (segment 2 against speed's 4); W1 on one
    # H200: 40.7 / 27.5 / 22.0 GiB peak for 1 / 1.12 / ~1.2x the time (bench/RESULTS.md). "offload": memory's
    # decoding with the weights in pinned host memory, each component on the GPU while it runs (16 GB cards);
    # "offload_layers": the transformer's blocks streamed too (12 GB). "auto": the fastest that fits the free memory
    performance_mode: Literal["auto", "speed", "balanced", "memory", "offload", "offload_layers"] = "auto"
    offload_prefetch: int | None = None  # transformer blocks in flight in offload_layers (unset: the mode's 2)
    # Devices sharing a tile's denoising where there are fewer tiles than devices ("auto"), never ("off"), or always
    # ("on"). Off until measured on GPUs: a split group runs its blocks uncompiled (bench/RESULTS.md, issue 24)
    split: Literal["auto", "on", "off"] = "off"
    warmup: bool = True  # compile for one window at start (GPUs), so the first job is not the cold one
    # "all": portrait and square tiles too (a short clip each), so their first job does not compile the decoder
    # either; "landscape": a faster start (a tile size's graphs took 77 s of a one-tile first call on an H200)
    warmup_tiles: Literal["all", "landscape"] = "all"
    # The quality tiers warmed up, comma-separated (lossless always is): "lossless,high" also builds `high`'s graphs
    # for landscape windows (its levers make blocks of their own), so that tier's first long landscape job does not
    # compile them; the start takes longer
    warmup_qualities: Annotated[tuple[Literal["lossless", "high"], ...], NoDecode] = ("lossless",)
    # Compiled graphs persist here between worker processes (a volume in compose/k8s): a restart loads the warmup's
    # graphs instead of compiling them (worker.sr.compile_cache). Unset: TORCHINDUCTOR_CACHE_DIR (the worker image's
    # /cache volume), else Inductor's /tmp/torchinductor_<user>, which a container loses with its restart.
    compile_cache_dir: Path | None = None
    # With compile_cache_dir: each compiled block's call through a function compiled ahead of time and kept there, so
    # a restart loads them instead of tracing every block with Dynamo (worker.sr.precompiled); off: traced each start
    precompiled: bool = True
    # The model's blocks compiled with torch.compile: on GPUs ("auto"), also on CPUs ("on": slower there, but a CPU
    # start then builds and caches the graphs a GPU's does) or never ("off": a start without warmup, slower jobs)
    compile: Literal["auto", "on", "off"] = "auto"
    # A job's tail (the encoder's flush, the check, previews, upload, `complete`) on a thread of its own while the next
    # job's head and engine run (worker.finisher); off: the task runs it before it takes the next message
    overlap_tail: bool = True
    # Overlapped, tails held at once (one running, the others waiting their turn, each with its encoder open and its
    # scratch directory, the output among it, on disk): more lets more small jobs run behind a big job's long tail
    tails_held: int = Field(default=3, ge=1)
    # While a job's engine runs, the input of the job this worker most likely runs next (the next message on its
    # queues, read, not taken) is downloaded into a one-entry cache, used only if the blob is still the same
    # (worker.prefetch); off: each job downloads its input once leased
    prefetch_input: bool = True
    prefetch_max_bytes: int = 4 * 2**30  # a larger input is not prefetched (disk: the cache holds one input)
    # Where the cache's directory is made: on the disk of the jobs' scratch directories (TMPDIR), so that handing a
    # job its input is a rename. Unset: the system's temporary directory, where those go
    prefetch_dir: Path | None = None
    storage_retry_s: float = 120  # a blob storage outage this long is waited out inside the attempt
    # A tail that has delivered no heartbeat this long is stuck (unset: the lease's length, past which its job is the
    # reaper's anyway): the job waiting for it goes back to the queue and the worker exits (worker.tasks)
    tail_stall_s: float | None = None
    # Temporal windows (frames, 1 + 4k; and their crossfade): unset, the engine's (121 and 16)
    window: int | None = None
    window_overlap: int | None = None

    @field_validator("warmup_qualities", mode="before")
    @classmethod
    def _comma_separated(cls, value: object) -> object:
        return tuple(part.strip() for part in value.split(",") if part.strip()) if isinstance(value, str) else value

    @property
    def window_options(self) -> dict[str, int]:
        """The window settings that are set, as `UpscaleOptions` fields."""
        return {name: value for name in ("window", "window_overlap") if (value := getattr(self, name)) is not None}

    @property
    def served(self) -> str:
        return self.served_as or served_name(self.model)

    @property
    def device_list(self) -> list[str]:
        return [device.strip() for device in self.devices.split(",") if device.strip()]


@cache
def settings() -> Settings:
    return Settings()


@cache
def worker_settings() -> WorkerSettings:
    return WorkerSettings()


@cache
def jobs() -> JobStore:
    return JobStore.from_settings(settings())


@cache
def blobs() -> BlobStore:
    return open_blob_store(settings())


@cache
def outbox() -> Outbox:
    """The webhook outbox, the one the job store's scripts write (storage.webhooks)."""
    store = jobs()
    return Outbox(store.redis, store.prefix)


@cache
def upscaler():
    # torch and the engine: only in processes that run jobs. None runs a diffusers pipeline: Hugging Face
    # `transformers`, which diffusers imports wherever it is installed (~1 s of a start), is hidden from a process that
    # has not imported diffusers yet (`None` in `sys.modules`, as worker.sr.k6_models hides PEFT)
    if "diffusers" not in sys.modules:
        sys.modules.setdefault("transformers", None)
    from worker.sr.backends import open_upscaler
    from worker.sr.windows import DEFAULT_WINDOW

    config = worker_settings()
    window = config.window or DEFAULT_WINDOW
    return open_upscaler(
        config.model,
        config.device_list,
        config.performance_mode,
        window if config.warmup else None,
        warmup_every_tile_size=config.warmup_tiles == "all",
        warmup_qualities=config.warmup_qualities,
        compile_cache_dir=config.compile_cache_dir,
        offload_prefetch=config.offload_prefetch,
        split=config.split,
        compile=config.compile,
        precompile=config.precompiled,
    )
