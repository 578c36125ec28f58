"""H.264 coded as field pictures (PAFF), as AVCHD camcorders and many 1080i broadcasts code it. No encoder here makes
it (x264 codes interlaced video as MBAFF: frame pictures), so this writes the bitstream itself, to the H.264 syntax:
Main profile, an SPS that allows field pictures (frame_mbs_only_flag 0, no MBAFF), and every field a picture of its
own whose macroblocks are all I_PCM (the samples as they are: nothing to predict or transform). FFmpeg's decoder
reads it as it reads a camcorder's."""

from __future__ import annotations

from fractions import Fraction

import av
import numpy as np


class _Bits:
    def __init__(self) -> None:
        self.out, self.value, self.count = bytearray(), 0, 0  # whole bytes, and the bits of the next one

    def u(self, count: int, value: int) -> None:
        for shift in range(count - 1, -1, -1):
            self.value, self.count = self.value << 1 | (value >> shift) & 1, self.count + 1
            if self.count == 8:
                self.out.append(self.value)
                self.value = self.count = 0

    def ue(self, value: int) -> None:
        value += 1
        self.u(value.bit_length() - 1, 0)
        self.u(value.bit_length(), value)

    def se(self, value: int) -> None:
        self.ue(2 * value - 1 if value > 0 else -2 * value)

    def align(self) -> None:
        if self.count:
            self.u(8 - self.count, 0)

    def raw(self, data: bytes) -> None:
        assert not self.count
        self.out += data

    def rbsp(self) -> bytes:
        self.u(1, 1)  # rbsp_stop_one_bit
        self.align()
        return bytes(self.out)


def _nal(reference: int, kind: int, rbsp: bytes) -> bytes:
    escaped, zeros = bytearray(), 0
    for byte in rbsp:  # emulation prevention: no start code inside a unit
        if zeros >= 2 and byte <= 3:
            escaped.append(3)
            zeros = 0
        escaped.append(byte)
        zeros = zeros + 1 if byte == 0 else 0
    return b"\x00\x00\x00\x01" + bytes([reference << 5 | kind]) + bytes(escaped)


def _sps(width: int, height: int) -> bytes:
    bits = _Bits()
    bits.u(8, 77), bits.u(8, 0), bits.u(8, 40), bits.ue(0)  # Main profile, level 4.0, sps 0
    bits.ue(0), bits.ue(0), bits.ue(2)  # frame_num 4 bits, POC type 0 with 6-bit lsb
    bits.ue(1), bits.u(1, 0)  # one reference frame, no gaps
    bits.ue(width // 16 - 1), bits.ue(height // 32 - 1)  # in macroblock pairs: fields are half the height
    bits.u(1, 0), bits.u(1, 0), bits.u(1, 1), bits.u(1, 0)  # field pictures, no MBAFF, direct 8x8, no cropping
    bits.u(1, 0)  # no VUI: the container times the pictures
    return _nal(3, 7, bits.rbsp())


def _pps() -> bytes:
    bits = _Bits()
    bits.ue(0), bits.ue(0), bits.u(1, 0), bits.u(1, 0), bits.ue(0), bits.ue(0), bits.ue(0)  # CAVLC, one slice group
    bits.u(1, 0), bits.u(2, 0), bits.se(0), bits.se(0), bits.se(0)  # no weighted prediction, QP 26
    bits.u(1, 1), bits.u(1, 0), bits.u(1, 0)  # deblocking control present
    return _nal(3, 8, bits.rbsp())


def _field(planes: list[np.ndarray], frame_num: int, bottom: int, idr: bool, order_lsb: int) -> bytes:
    bits = _Bits()
    bits.ue(0), bits.ue(7), bits.ue(0), bits.u(4, frame_num % 16)  # first MB, I slice, pps 0, frame_num
    bits.u(1, 1), bits.u(1, bottom)  # field_pic_flag, bottom_field_flag
    if idr:
        bits.ue(0)  # idr_pic_id
    bits.u(6, order_lsb % 64)
    bits.u(2, 0) if idr else bits.u(1, 0)  # reference marking: no_output_of_prior_pics, long_term; or sliding window
    bits.se(0), bits.ue(1)  # slice_qp_delta, deblocking off
    luma, cb, cr = planes
    for row in range(luma.shape[0] // 16):
        for column in range(luma.shape[1] // 16):
            bits.ue(25)  # mb_type I_PCM
            bits.align()
            for plane, size in ((luma, 16), (cb, 8), (cr, 8)):
                block = plane[row * size : (row + 1) * size, column * size : (column + 1) * size]
                bits.raw(np.clip(block, 1, 255).astype(np.uint8).tobytes())
    return _nal(2, 5 if idr else 1, bits.rbsp())


def paff(path, frames: list[np.ndarray], order: str, rate: Fraction, container: str = "mpegts") -> None:
    """`frames` (RGB, sizes a multiple of 32 high and 16 wide) as field pictures in `order` ("tff": the top field of
    each frame coded and shown first), each field a packet timed at its own instant, as a camcorder's TS carries it."""
    height, width = frames[0].shape[:2]
    stream = bytearray(_sps(width, height) + _pps())
    first_bottom = int(order == "bff")
    for number, rgb in enumerate(frames):
        yuv = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
        planes = [np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:, : width >> bool(i)]
                  for i, plane in enumerate(yuv.planes)]  # fmt: skip
        for second, bottom in enumerate((first_bottom, 1 - first_bottom)):
            stream += b"\x00\x00\x00\x01\x09\xf0"  # access unit delimiter
            field = [plane[bottom::2] for plane in planes]
            stream += _field(field, number, bottom, number == 0 and second == 0, 4 * number + 2 * second)
    elementary = path.with_suffix(".264")
    elementary.write_bytes(bytes(stream))
    tick = Fraction(1, 90000)
    with av.open(str(elementary), format="h264") as source, av.open(str(path), "w", format=container) as output:
        video = output.add_stream_from_template(source.streams.video[0])
        for index, packet in enumerate(p for p in source.demux(video=0) if p.size):
            packet.stream, packet.time_base = video, tick
            packet.pts = packet.dts = round((index / (2 * rate)) / tick)
            packet.duration = round(1 / (2 * rate) / tick)
            output.mux(packet)
