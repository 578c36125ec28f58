"""Interlaced video coded as field pictures, each field a picture of its own: H.264 as AVCHD camcorders and many 1080i
broadcasts code it (PAFF), MPEG-2 as broadcast encoders may. No encoder here makes either (x264 codes interlaced video
as MBAFF, FFmpeg's MPEG-2 encoder frame pictures), so this writes the bitstreams to their syntax. H.264: Main profile,
an SPS that allows field pictures (frame_mbs_only_flag 0, no MBAFF), every macroblock I_PCM (the samples as they
are). MPEG-2: Main@Main, an interlaced sequence, I field pictures whose blocks carry their DC alone (each 8x8 block
its mean). FFmpeg's decoders read them as they read a camcorder's or a broadcast's."""

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


# -- MPEG-2 (H.262): field pictures, every block its DC alone ----------------------------------------------------------

_DC_SIZE = {  # dct_dc_size VLCs, tables B.12 (luminance) and B.13 (chrominance)
    "luma": ["100", "00", "01", "101", "110", "1110", "11110", "111110", "1111110", "11111110", "111111110",
             "111111111"],
    "chroma": ["00", "01", "10", "110", "1110", "11110", "111110", "1111110", "11111110", "111111110", "1111111110",
               "1111111111"],
}  # fmt: skip


def _vlc(bits: _Bits, code: str) -> None:
    bits.u(len(code), int(code, 2))


def _dc(bits: _Bits, table: str, difference: int) -> None:
    size = abs(difference).bit_length()
    _vlc(bits, _DC_SIZE[table][size])
    if size:
        bits.u(size, difference if difference > 0 else difference + (1 << size) - 1)
    _vlc(bits, "10")  # end of block (table B.14): no AC coefficient


def _mpeg2_headers(width: int, height: int, rate_code: int) -> bytes:
    bits = _Bits()
    bits.raw(b"\x00\x00\x01\xb3")
    bits.u(12, width), bits.u(12, height), bits.u(4, 2), bits.u(4, rate_code)  # 4:3 display, frame rate
    bits.u(18, 0x3FFFF), bits.u(1, 1), bits.u(10, 112), bits.u(1, 0), bits.u(1, 0), bits.u(1, 0)  # no matrices
    bits.raw(b"\x00\x00\x01\xb5")
    bits.u(4, 1), bits.u(8, 0x48), bits.u(1, 0), bits.u(2, 1)  # Main@Main, interlaced sequence, 4:2:0
    bits.u(2, 0), bits.u(2, 0), bits.u(12, 0), bits.u(1, 1), bits.u(8, 0), bits.u(1, 1), bits.u(2, 0), bits.u(5, 0)
    bits.align()
    return bytes(bits.out)


def _mpeg2_field(planes: list[np.ndarray], temporal_reference: int, bottom: int, top_first: int) -> bytes:
    bits = _Bits()
    bits.raw(b"\x00\x00\x01\x00")
    bits.u(10, temporal_reference), bits.u(3, 1), bits.u(16, 0xFFFF), bits.u(1, 0)  # an I picture
    bits.align()
    bits.raw(b"\x00\x00\x01\xb5")
    bits.u(4, 8), bits.u(16, 0xFFFF), bits.u(2, 0), bits.u(2, 2 if bottom else 1)  # picture coding extension: a field
    bits.u(1, top_first), bits.u(1, 0), bits.u(1, 0), bits.u(1, 0), bits.u(1, 0), bits.u(1, 0)
    bits.u(1, 0), bits.u(1, 0), bits.u(1, 0), bits.u(1, 0)  # no repeat, 4:2:0 type, interlaced frame, no composite
    bits.align()
    luma, cb, cr = (plane.astype(np.int64) for plane in planes)
    for row in range(luma.shape[0] // 16):
        bits.raw(b"\x00\x00\x01" + bytes([row + 1]))
        bits.u(5, 8), bits.u(1, 0)  # quantiser_scale_code, no extra information
        predictors = {"luma": 128, "cb": 128, "cr": 128}  # 8-bit DC precision: reset at each slice
        for column in range(luma.shape[1] // 16):
            bits.u(1, 1), bits.u(1, 1)  # macroblock_address_increment 1, macroblock_type intra
            blocks = [("luma", luma[row * 16 + y : row * 16 + y + 8, column * 16 + x : column * 16 + x + 8])
                      for y in (0, 8) for x in (0, 8)]  # fmt: skip
            blocks += [("cb", cb[row * 8 : row * 8 + 8, column * 8 : column * 8 + 8]),
                       ("cr", cr[row * 8 : row * 8 + 8, column * 8 : column * 8 + 8])]  # fmt: skip
            for kind, block in blocks:
                value = int(round(block.mean() / 8))  # the DC coefficient at 8-bit precision: the block's mean / 8
                _dc(bits, "luma" if kind == "luma" else "chroma", value - predictors[kind])
                predictors[kind] = value
        bits.align()
    return bytes(bits.out)


def mpeg2_fields(path, frames: list[np.ndarray], order: str, container: str = "mpegts") -> None:
    """`frames` (RGB, 25 frames/s, sizes a multiple of 32 high and 16 wide) as MPEG-2 field pictures, as broadcast
    encoders code interlaced video: each field a picture of its own (every 8x8 block its mean: DC coefficients only)."""
    height, width = frames[0].shape[:2]
    stream = bytearray(_mpeg2_headers(width, height, 3))  # frame_rate_code 3: 25
    first_bottom = int(order == "bff")
    for number, rgb in enumerate(frames):
        yuv = av.VideoFrame.from_ndarray(rgb, format="rgb24").reformat(format="yuv420p")
        planes = [np.frombuffer(plane, np.uint8).reshape(-1, plane.line_size)[:, : width >> bool(i)]
                  for i, plane in enumerate(yuv.planes)]  # fmt: skip
        for bottom in (first_bottom, 1 - first_bottom):
            stream += _mpeg2_field([plane[bottom::2] for plane in planes], number, bottom, int(order == "tff"))
    stream += b"\x00\x00\x01\xb7"  # sequence end
    elementary = path.with_suffix(".m2v")
    elementary.write_bytes(bytes(stream))
    with av.open(str(elementary), format="mpegvideo") as source, av.open(str(path), "w", format=container) as output:
        video = output.add_stream_from_template(source.streams.video[0])
        for packet in (p for p in source.demux(video=0) if p.size):
            packet.stream = video
            output.mux(packet)
