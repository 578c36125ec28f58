"""H.264 coded as field pictures (PAFF: AVCHD camcorders' 1080i, many 1080i broadcasts): each field is a picture of
its own, so FFmpeg's parser hands over two packets for every frame its decoder shows. Counted one frame a packet, such
a source was probed at twice its frames and rate, and refused as input_corrupt once all of it had been upscaled
("decoded 10 frames, the container holds 20"). Which packet is a frame's second field is read from the slice header,
as the decoder pairs them: a field following a field of the other parity completes its frame."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass

import av

# profile_idc values whose SPS carries chroma format, bit depths and scaling lists (H.264 7.3.2.1.1)
_HIGH_PROFILES = frozenset({100, 110, 122, 244, 44, 83, 86, 118, 128, 138, 139, 134, 135})
_SLICE, _IDR_SLICE, _SPS, _PPS = 1, 5, 7, 8
# An access unit's parameter sets and first slice header come first: a packet's head is read, not its slice data
_HEAD = 1 << 16


class _Bits:
    """Exp-Golomb and fixed-width reads over an RBSP (emulation prevention bytes removed)."""

    def __init__(self, data: bytes) -> None:
        self.data, self.position = data, 0

    def u(self, count: int) -> int:
        value = 0
        for _ in range(count):
            byte = self.data[self.position >> 3]  # IndexError past the end: a truncated unit
            value = (value << 1) | ((byte >> (7 - (self.position & 7))) & 1)
            self.position += 1
        return value

    def ue(self) -> int:
        zeros = 0
        while self.u(1) == 0:
            zeros += 1
            if zeros > 31:
                raise ValueError("not an Exp-Golomb code")
        return (1 << zeros) - 1 + self.u(zeros)

    def se(self) -> int:
        value = self.ue()
        return (value + 1) // 2 if value & 1 else -(value // 2)


@dataclass(frozen=True)
class _Sps:
    frame_num_bits: int
    frame_mbs_only: bool
    separate_colour_planes: bool


def _rbsp(unit: bytes) -> bytes:
    return unit.replace(b"\x00\x00\x03", b"\x00\x00")  # a slice header and an SPS are read from their first bytes


def _sps(payload: bytes) -> tuple[int, _Sps]:
    bits = _Bits(_rbsp(payload))
    profile = bits.u(8)
    bits.u(16)  # constraint flags, level
    sps_id, separate = bits.ue(), False
    if profile in _HIGH_PROFILES:
        chroma_format = bits.ue()
        if chroma_format == 3:
            separate = bool(bits.u(1))
        bits.ue(), bits.ue(), bits.u(1)  # bit depths, qpprime_y_zero_transform_bypass
        if bits.u(1):  # seq_scaling_matrix_present_flag
            for index in range(8 if chroma_format != 3 else 12):
                if bits.u(1):
                    last = following = 8
                    for _ in range(16 if index < 6 else 64):
                        if following:
                            following = (last + bits.se() + 256) % 256
                        last = following or last
    frame_num_bits = bits.ue() + 4
    order_type = bits.ue()
    if order_type == 0:
        bits.ue()
    elif order_type == 1:
        bits.u(1), bits.se(), bits.se()
        for _ in range(bits.ue()):
            bits.se()
    bits.ue(), bits.u(1), bits.ue(), bits.ue()  # reference frames, gaps allowed, width and height in units
    return sps_id, _Sps(frame_num_bits, bool(bits.u(1)), separate)


def _units(data: bytes, length_size: int) -> Iterator[bytes]:
    """The NAL units of a packet: length-prefixed (MP4, Matroska: `length_size` bytes) or Annex B (0: start codes)."""
    if length_size:
        position = 0
        while position + length_size <= len(data):
            size = int.from_bytes(data[position : position + length_size], "big")
            position += length_size
            yield data[position : position + size]
            position += size
        return
    for unit in data.split(b"\x00\x00\x01"):
        if unit.rstrip(b"\x00"):
            yield unit.rstrip(b"\x00")  # the zero before a four-byte start code belongs to neither unit


def second_fields(stream: av.VideoStream) -> Callable[[av.Packet], bool]:
    """Whether each packet of `stream` (in decode order) is the second field of an H.264 frame, which adds no frame to
    what the decoder shows; never for other codecs. A packet the parser cannot read counts as a frame."""
    if stream.codec_context.name != "h264":
        return lambda packet: False
    extradata = bytes(stream.codec_context.extradata or b"")
    length_size = (extradata[4] & 3) + 1 if extradata[:1] == b"\x01" and len(extradata) > 6 else 0
    sets: dict[int, _Sps] = {}
    pictures: dict[int, int] = {}  # pps id -> sps id
    pending: tuple[int, int] | None = None  # a first field waiting for its pair: (bottom?, frame_num)

    def learn(unit: bytes) -> None:
        kind = unit[0] & 0x1F
        if kind == _SPS:
            sps_id, sps = _sps(unit[1:])
            sets[sps_id] = sps
        elif kind == _PPS:
            bits = _Bits(_rbsp(unit[1:]))
            pps_id = bits.ue()
            pictures[pps_id] = bits.ue()

    if length_size:  # avcC: its parameter sets
        try:
            position, count = 6, extradata[5] & 0x1F
            for group in range(2):
                for _ in range(count):
                    size = int.from_bytes(extradata[position : position + 2], "big")
                    learn(extradata[position + 2 : position + 2 + size])
                    position += 2 + size
                if group == 0:
                    count, position = extradata[position], position + 1
        except (IndexError, ValueError):
            pass
    else:
        for unit in _units(extradata, 0):
            try:
                learn(unit)
            except (IndexError, ValueError):
                pass

    def second(packet: av.Packet) -> bool:
        nonlocal pending
        try:
            for unit in _units(bytes(memoryview(packet)[:_HEAD]), length_size):
                kind = unit[0] & 0x1F
                if kind in (_SPS, _PPS):
                    learn(unit)
                elif kind in (_SLICE, _IDR_SLICE):
                    bits = _Bits(_rbsp(unit[1:24]))
                    bits.ue(), bits.ue()  # first_mb_in_slice, slice_type
                    sps = sets[pictures[bits.ue()]]
                    if sps.separate_colour_planes:
                        bits.u(2)
                    frame_num = bits.u(sps.frame_num_bits)
                    field = None
                    if not sps.frame_mbs_only and bits.u(1):  # field_pic_flag
                        field = (bits.u(1), frame_num)  # bottom_field_flag
                    # the other parity of the same frame_num completes the pending field's frame
                    completes = field is not None and pending == (1 - field[0], frame_num)
                    pending = None if completes else field
                    return completes
        except (IndexError, KeyError, ValueError):
            pending = None
        return False

    return second
