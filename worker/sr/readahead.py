"""A local checkpoint's weights read into the page cache on a thread, while the worker imports its model code.

A start whose weights are not in the page cache (a fresh machine or pod, a cache evicted since) would read them from
disk only once diffusers and torch's compiler are imported, seconds after it knew the path. Asking the kernel to read
them ahead (`posix_fadvise(WILLNEED)`, which releases the GIL) lets the disk work during those imports; the load
then finds its pages in memory or in flight. Only the bytes the loader reads: every tensor of the transformer and
the VAE, the latent upscaler's without the submodules it prunes (`checkpoint.UNUSED_UPSCALER_MODULES`: 2.9 GB of
the full checkpoint). Pages already cached cost nothing; where `posix_fadvise` does not exist, nothing is read ahead.
"""

from __future__ import annotations

import json
import logging
import os
import struct
import threading
from pathlib import Path
from time import perf_counter

from worker.sr.checkpoint import UNUSED_UPSCALER_MODULES

log = logging.getLogger("vsrq.engine")

COMPONENTS = ("transformer", "vae", "latent_upscaler")
_MERGE_GAP = 1 << 20  # neighbouring tensors closer than this are read as one range
_CHUNK = 4 << 20
_MAX_HEADER = 100_000_000  # safetensors' own limit


def tensor_ranges(file: Path) -> dict[str, tuple[int, int]]:
    """Each tensor's (offset, length) in a safetensors file: an 8-byte little-endian header length, a JSON header
    naming each tensor's `data_offsets` from the end of the header."""
    with file.open("rb") as stream:
        (size,) = struct.unpack("<Q", stream.read(8))
        if size > _MAX_HEADER:  # corrupt: no multi-GB read on the thread (the loader reports the file itself)
            raise ValueError(f"{file.name}: a safetensors header of {size} bytes")
        header = json.loads(stream.read(size))
    start = 8 + size
    return {
        name: (start + entry["data_offsets"][0], entry["data_offsets"][1] - entry["data_offsets"][0])
        for name, entry in header.items()
        if name != "__metadata__"
    }


def upscaler_key_loaded(key: str, scales: list[int]) -> bool:
    """Whether the loader reads this latent upscaler weight (`_models.<index>.<submodule>...`): not if its
    submodule is one its scale's `forward` never calls."""
    parts = key.split(".")
    if len(parts) < 3 or parts[0] != "_models" or not parts[1].isdigit() or int(parts[1]) >= len(scales):
        return True
    return parts[2] not in UNUSED_UPSCALER_MODULES.get(scales[int(parts[1])], ())


def ranges(path: Path) -> list[tuple[Path, int, int]]:
    """(file, offset, length) of what the loader reads from the checkpoint at `path`, neighbours merged."""
    found: list[tuple[Path, int, int]] = []
    for component in COMPONENTS:
        folder = path / component
        scales = None
        if component == "latent_upscaler":
            config = folder / "config.json"
            if not config.exists():
                continue
            scales = list(json.loads(config.read_text()).get("scales", ()))
        for file in sorted(folder.glob("*.safetensors")):
            tensors = tensor_ranges(file)
            spans = sorted(span for key, span in tensors.items() if scales is None or upscaler_key_loaded(key, scales))
            merged: list[list[int]] = []
            for offset, length in spans:
                if merged and offset - (merged[-1][0] + merged[-1][1]) <= _MERGE_GAP:
                    merged[-1][1] = max(merged[-1][1], offset + length - merged[-1][0])
                else:
                    merged.append([offset, length])
            found += [(file, offset, length) for offset, length in merged]
    return found


def start(source: str) -> threading.Thread | None:
    """Starts reading ahead the checkpoint at `source` if it is a local directory (a hub id is resolved, and
    downloaded, by the load itself). A daemon thread: the load never waits for it, and a checkpoint it cannot read is
    the load's error to report."""
    path = Path(source).expanduser()
    if not hasattr(os, "posix_fadvise") or not (path / "transformer").is_dir():
        return None
    thread = threading.Thread(target=_read_ahead, args=(path,), name="vsrq-readahead", daemon=True)
    thread.start()
    return thread


def _read_ahead(path: Path) -> None:
    began = perf_counter()
    try:
        spans = ranges(path)
        for file, offset, length in spans:
            descriptor = os.open(file, os.O_RDONLY)
            try:  # in chunks: the kernel reads ahead at most its readahead window (a few MiB) per call
                for chunk in range(offset, offset + length, _CHUNK):
                    os.posix_fadvise(descriptor, chunk, min(_CHUNK, offset + length - chunk), os.POSIX_FADV_WILLNEED)
            finally:
                os.close(descriptor)
    except Exception as error:  # unreadable, cut short, not safetensors: the load says so, with its own error
        log.debug("no read-ahead of %s: %s", path, error)
        return
    log.info("weights read ahead: %.2f GiB asked of the disk in %.1f s", sum(s[2] for s in spans) / 2**30, perf_counter() - began)
