"""Decode a video as a stream of RGB frames, as they are meant to be seen: rotation and mirror applied, colour
converted with the stream's own matrix and range. Memory stays at one frame (plus whatever a consumer buffers)."""

from __future__ import annotations

import queue
import threading
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import TypeVar

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from worker.media.errors import InputCorrupt
from worker.media.probe import AVError, VideoInfo, decode_declared_picture

T = TypeVar("T")
_UNSPECIFIED = 2  # AVCOL_SPC_UNSPECIFIED


def read_frames(path: str | Path, video: VideoInfo) -> Iterator[np.ndarray]:
    """Every frame of the probed `video` stream in presentation order, (H, W, 3) RGB: uint8, or uint16 (full 16-bit
    scale) for sources deeper than 8 bits. Raises `InputCorrupt` if decoding fails or yields another frame count."""
    pixel_format = "rgb24" if video.bit_depth <= 8 else "rgb48le"
    turns = video.rotation // 90
    # Stored frames are the displayed ones before rotation; a stream that changes size mid-way is scaled back.
    width, height = (video.height, video.width) if turns % 2 else (video.width, video.height)
    count = 0
    # One swscale context for the stream: `frame.to_ndarray(format=...)` makes one per frame, and with it swscale's
    # slice threads (one per core), started and joined for every frame. The conversion is the same either way.
    reformatter = VideoReformatter()
    try:
        with av.open(str(path)) as container:
            stream = container.streams[video.index]
            stream.thread_type = "AUTO"
            decode_declared_picture(stream)
            for frame in _decode(container, stream):
                colour = _source_colour(frame)
                pixels = reformatter.reformat(frame, width, height, pixel_format, **colour).to_ndarray()
                count += 1
                if count > video.frames:
                    break
                upright = np.rot90(pixels, turns) if turns else pixels
                upright = np.fliplr(upright) if video.mirrored else upright
                yield np.ascontiguousarray(upright)  # `pixels` itself where nothing turned or flipped it
    except AVError as error:
        raise InputCorrupt(f"{Path(path).name}: decoding failed after {count} frames ({error})") from None
    if count != video.frames:
        raise InputCorrupt(f"{Path(path).name}: decoded {count} frames, the container holds {video.frames}")


def _decode(container: av.container.InputContainer, stream: av.VideoStream) -> Iterator[av.VideoFrame]:
    """Every frame of `stream`. Empty packets are skipped, not sent: Ogg stores a Theora frame that repeats the one
    before as a 0-byte packet, which the decoder takes for the end of the stream (every later packet: EINVAL).
    The probe counts frames the same way, as ffprobe does."""
    for packet in container.demux(stream):
        if packet.size:
            yield from packet.decode()
    yield from stream.decode(None)


def _source_colour(frame: av.VideoFrame) -> dict:
    """How to read YUV as RGB. The stream's tags when it has them; untagged streams get what players assume:
    BT.709 for HD sizes, BT.601 below, and limited range (full range arrives tagged, or as a yuvj format)."""
    if frame.format.is_rgb:
        return {}
    hd = frame.width >= 1280 or frame.height > 576
    colour = {}
    if frame.colorspace == _UNSPECIFIED:
        colour["src_colorspace"] = Colorspace.ITU709 if hd else Colorspace.ITU601
    if frame.color_range == ColorRange.UNSPECIFIED:
        colour["src_color_range"] = ColorRange.MPEG
    return colour


_END = object()


def prefetch(items: Iterable[T], depth: int) -> Iterator[T]:
    """Iterate `items` on a thread of its own, at most `depth` items ahead, so decoding overlaps the consumer's work.
    Errors surface where the consumer would have met them; closing the iterator stops the thread."""
    buffer: queue.Queue = queue.Queue(maxsize=max(1, depth))
    stop = threading.Event()

    def put(entry: tuple) -> bool:
        while not stop.is_set():
            try:
                buffer.put(entry, timeout=0.1)
                return True
            except queue.Full:
                pass
        return False

    def produce() -> None:
        iterator = iter(items)
        try:
            for item in iterator:
                if not put((item, None)):
                    return
            put((_END, None))
        except BaseException as error:  # handed to the consumer
            put((_END, error))
        finally:
            getattr(iterator, "close", lambda: None)()

    thread = threading.Thread(target=produce, name="vsrq-decoder", daemon=True)
    thread.start()
    try:
        while True:
            item, error = buffer.get()
            if item is _END:
                if error is not None:
                    raise error
                return
            yield item
    finally:
        stop.set()
        thread.join()
