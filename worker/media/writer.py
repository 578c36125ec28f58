"""Encode frames into an MP4 as they arrive, on a thread of its own, so encoding overlaps the engine's work."""

from __future__ import annotations

import queue
import threading
from fractions import Fraction
from pathlib import Path
from time import perf_counter
from types import TracebackType

import av
import numpy as np
import torch

_DONE = None


class Mp4Writer:
    """H.264 (yuv420p, +faststart) MP4 writer; `write` takes (n, 3, H, W) float frames in [0, 1] on any device.

    `write` only quantises and queues; a background thread encodes and muxes. A failure there surfaces at the next
    `write` or at `close`. Leaving the `with` block through an exception deletes the partial file.
    """

    def __init__(
        self, path: str | Path, fps: Fraction, size: tuple[int, int], crf: int = 18, preset: str = "medium", queue_size: int = 4
    ) -> None:
        height, width = size
        self.path = Path(path)
        self.container = av.open(str(self.path), mode="w", options={"movflags": "+faststart"})
        self.stream = self.container.add_stream("libx264", rate=fps, options={"crf": str(crf), "preset": preset})
        self.stream.width, self.stream.height, self.stream.pix_fmt = width, height, "yuv420p"
        self.frames = 0
        self.encode_seconds = 0.0
        self._queue: queue.Queue[np.ndarray | None] = queue.Queue(maxsize=queue_size)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._encode_loop, name="vsrq-encoder", daemon=True)
        self._thread.start()

    def write(self, frames: torch.Tensor) -> None:
        self._raise_if_failed()
        # Quantise where the frames are (a GPU moves a quarter of the bytes to the host this way).
        pixels = (frames * 255.0).round().clamp(0, 255).to(torch.uint8).permute(0, 2, 3, 1).cpu().numpy()
        self._queue.put(pixels)
        self.frames += len(pixels)

    def close(self) -> None:
        self._queue.put(_DONE)
        self._thread.join()
        self._raise_if_failed()
        self.container.close()

    def _encode_loop(self) -> None:
        try:
            while (pixels := self._queue.get()) is not _DONE:
                started = perf_counter()
                for pixel in pixels:
                    self.container.mux(self.stream.encode(av.VideoFrame.from_ndarray(pixel, format="rgb24")))
                self.encode_seconds += perf_counter() - started
            self.container.mux(self.stream.encode())
        except BaseException as error:  # handed to the producer thread
            self._error = error
            while self._queue.get() is not _DONE:  # unblock a producer waiting on a full queue
                pass

    def _raise_if_failed(self) -> None:
        if self._error is not None:
            raise self._error

    def __enter__(self) -> Mp4Writer:
        return self

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None) -> None:
        if exc_type is None:
            self.close()
            return
        # Never leave a partial output behind.
        if self._thread.is_alive():
            self._queue.put(_DONE)
            self._thread.join()
        self.container.close()
        self.path.unlink(missing_ok=True)
