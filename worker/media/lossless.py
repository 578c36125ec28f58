"""Frames kept losslessly: a kept window's raw RGB frames as FFV1 (FFmpeg's lossless intra-frame codec) in Matroska,
and back to the very same bytes. Upscaled video is smooth enough that this is several times smaller than the raw
frames (bench/RESULTS.md "Kept windows in blob storage"), and PyAV already carries the codec: no zstd or PNG
dependency, and a codec that models neighbouring pixels beats a general-purpose compressor on pictures."""

from __future__ import annotations

import os
from pathlib import Path

import av
import numpy as np

# The arrays' layout -> (the frame format PyAV builds from it, the one FFV1 codes). FFV1 takes no packed 8-bit RGB:
# BGR0 is a lossless shuffle of it.
_FORMATS = {np.dtype(np.uint8): ("rgb24", "bgr0"), np.dtype(np.uint16): ("rgb48le", "rgb48le")}
# FFV1's slices are coded in parallel, one per thread; its version 3 takes these counts
_SLICES = (4, 6, 9, 12, 16, 24)


def compress(raw: Path, shape: tuple[int, ...], dtype: str, into: Path) -> None:
    """Writes the (n, H, W, 3) frames of the raw file `raw` (`dtype`: uint8 or uint16) into `into`, losslessly."""
    layout, coded = _FORMATS[np.dtype(dtype)]
    frames = np.memmap(raw, dtype=dtype, mode="r", shape=shape)
    slices = max(count for count in _SLICES if count <= max(4, os.cpu_count() or 1))
    with av.open(str(into), mode="w", format="matroska") as container:
        stream = container.add_stream("ffv1", rate=1, options={"level": "3", "slices": str(slices)})
        stream.width, stream.height, stream.pix_fmt = shape[2], shape[1], coded
        stream.codec_context.thread_type = "SLICE"
        for index, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(np.ascontiguousarray(pixels), format=layout)
            frame = frame.reformat(format=coded) if coded != layout else frame
            frame.pts = index
            container.mux(stream.encode(frame))
        container.mux(stream.encode())


def expand(packed: Path, shape: tuple[int, ...], dtype: str, into: Path) -> None:
    """Writes the frames `compress` packed into `packed` back into the raw file `into`, byte for byte; raises
    ValueError where they are not `shape` (a file cut short, or another window's)."""
    layout, _ = _FORMATS[np.dtype(dtype)]
    count = 0
    with av.open(str(packed)) as container, into.open("wb") as file:
        container.streams.video[0].thread_type = "SLICE"  # its slices decode in parallel as they were coded
        for frame in container.decode(video=0):
            pixels = frame.to_ndarray(format=layout)
            if pixels.shape != tuple(shape[1:]) or count == shape[0]:
                raise ValueError(f"{packed.name} holds frames other than {shape} ones")
            file.write(pixels.tobytes())
            count += 1
    if count != shape[0]:
        raise ValueError(f"{packed.name} holds {count} of {shape[0]} frames")
