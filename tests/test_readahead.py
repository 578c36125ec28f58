"""The worker's read-ahead of its checkpoint (worker.sr.readahead): the bytes its loader reads, in the page cache
before the load asks for them; nothing else, and no error of its own."""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import threading
from pathlib import Path

import pytest
import torch

from worker.sr import readahead
from worker.sr.backends import open_upscaler
from worker.sr.checkpoint import load, write_tiny
from worker.sr.errors import CheckpointNotFound

_libc = ctypes.CDLL(ctypes.util.find_library("c"), use_errno=True)


def resident_fraction(file: Path) -> float:
    """The share of the file's pages in the page cache: mincore(2) over a read-only shared mapping of it."""
    size = file.stat().st_size
    pages = (size + mmap.PAGESIZE - 1) // mmap.PAGESIZE
    _libc.mmap.restype = ctypes.c_void_p
    _libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    descriptor = os.open(file, os.O_RDONLY)
    try:
        address = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, descriptor, 0)
        if address in (None, ctypes.c_void_p(-1).value):
            raise OSError(ctypes.get_errno(), "mmap")
        try:
            vector = (ctypes.c_ubyte * pages)()
            if _libc.mincore(ctypes.c_void_p(address), ctypes.c_size_t(size), vector) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
        finally:
            _libc.munmap(ctypes.c_void_p(address), ctypes.c_size_t(size))
    finally:
        os.close(descriptor)
    return sum(byte & 1 for byte in vector) / pages


def evict(path: Path) -> None:
    for file in path.rglob("*.safetensors"):
        descriptor = os.open(file, os.O_RDONLY)
        try:
            os.fsync(descriptor)  # written just now: dirty pages are not dropped
            os.posix_fadvise(descriptor, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(descriptor)


def test_the_weights_are_read_into_the_page_cache(tmp_path):
    checkpoint = write_tiny(tmp_path / "tiny", seed=1)
    files = sorted(checkpoint.rglob("*.safetensors"))
    evict(checkpoint)
    if any(resident_fraction(file) > 0 for file in files):
        pytest.skip("this file system keeps its pages (tmpfs): nothing to read ahead")
    thread = readahead.start(str(checkpoint))
    assert thread is not None
    thread.join(30)
    # The kernel's reads were asked for; they land within moments
    for _ in range(100):
        if all(resident_fraction(file) == 1 for file in files):
            break
        threading.Event().wait(0.05)
    assert {file.parent.name: resident_fraction(file) for file in files} == {
        "transformer": 1,
        "vae": 1,
        "latent_upscaler": 1,
    }


def test_it_reads_what_the_loader_loads_and_not_the_pruned_upscaler(tiny_piflow):
    import json

    scales = json.loads((tiny_piflow / "latent_upscaler" / "config.json").read_text())["scales"]
    [file] = (tiny_piflow / "latent_upscaler").glob("*.safetensors")
    keys = readahead.tensor_ranges(file)
    read = {key for key in keys if readahead.upscaler_key_loaded(key, scales)}
    replicas, report = load(str(tiny_piflow), [torch.device("cpu")])
    assert read == set(replicas[0].latent_upscaler.state_dict())
    assert report.skipped_bytes > 0 and read < set(keys)
    # Every tensor of the transformer and the VAE lies in a range it reads
    spans = readahead.ranges(tiny_piflow)
    for component in ("transformer", "vae"):
        [weights] = (tiny_piflow / component).glob("*.safetensors")
        ranges = [(offset, offset + length) for path, offset, length in spans if path == weights]
        for offset, length in readahead.tensor_ranges(weights).values():
            assert any(start <= offset and offset + length <= end for start, end in ranges)


def test_a_missing_or_corrupt_checkpoint_fails_as_before(tmp_path):
    errors: list[BaseException] = []
    previous = threading.excepthook
    threading.excepthook = lambda args: errors.append(args.exc_value)  # an exception on the read-ahead's thread
    try:
        with pytest.raises(CheckpointNotFound) as missing:
            open_upscaler(str(tmp_path / "nowhere"), warmup_frames=None)
        assert missing.value.code == "model_not_found" and str(tmp_path / "nowhere") in missing.value.message

        corrupt = write_tiny(tmp_path / "corrupt", seed=1)
        [weights] = (corrupt / "transformer").glob("*.safetensors")
        weights.write_bytes(weights.read_bytes()[:5])  # cut inside the header's length
        with pytest.raises(Exception) as through_the_worker:
            open_upscaler(str(corrupt), warmup_frames=None)
        with pytest.raises(Exception) as loaded_alone:
            load(str(corrupt), [torch.device("cpu")])
        assert type(through_the_worker.value) is type(loaded_alone.value)
        assert str(through_the_worker.value) == str(loaded_alone.value)
        for thread in threading.enumerate():
            if thread.name == "vsrq-readahead":
                thread.join(30)
    finally:
        threading.excepthook = previous
    assert errors == []
