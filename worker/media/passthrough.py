"""The source's audio and subtitle streams, carried into the output MP4 next to the new video.

Audio MP4 holds (AAC, MP3, AC-3, E-AC-3, ALAC, FLAC, Opus) is copied packet for packet; anything else is decoded
and re-encoded to AAC at its own sample rate and channel layout. Text subtitles become mov_text (the one subtitle
format MP4 players read); bitmap subtitles cannot live in MP4 and are left out, which the plan says. Cover art in a
format MP4's `covr` holds (JPEG, PNG, BMP) is copied; a timecode track is written again by the muxer from the
video's timecode (the writer's `timecode`); other data tracks (a camera's telemetry) are left out, which the plan says.

Timing: the output's clock starts at the earliest of the video and the carried audio, so every stream keeps its
offset from the others, and nothing is cut: audio that starts before the first frame or runs past the last one is
carried whole (a phone clip's sound outlasts its last frame by up to an audio frame or more). Re-encoded audio
keeps every decoded sample, placed as players play it (see `_ToAac`); a track that starts after the clock's start
gets an edit list that skips the encoder's priming (worker/media/edit_list.py).
The streams are read from a second demuxer over the source and muxed as the video advances (`mux_until`), so the
output is interleaved and nothing is buffered beyond the muxer's own queue.
"""

from __future__ import annotations

import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from fractions import Fraction

import av
import numpy as np
from av.subtitles.subtitle import AssSubtitle, SubtitleSet

from worker.media.errors import InputCorrupt
from worker.media.probe import AudioInfo, AVError, MediaInfo, cut_off
from worker.media.source import demux, open_input
from worker.media.timecode import output_count, recount

COPY_AUDIO = frozenset({"aac", "mp3", "ac3", "eac3", "alac", "flac", "opus"})
# MP3 below 16 kHz (MPEG-2.5: 8, 11.025, 12 kHz) is no MP4 codec: FFmpeg's muxer refuses its packets.
MP3_MIN_RATE = 16000
TEXT_SUBTITLES = frozenset({"subrip", "srt", "ass", "ssa", "webvtt", "mov_text", "text"})
CAPTIONS = frozenset({"eia_608"})  # a QuickTime closed-caption track (`c608`)
BITMAP_SUBTITLES = frozenset({"dvd_subtitle", "dvb_subtitle", "hdmv_pgs_subtitle", "xsub"})
COVER_ART = frozenset({"mjpeg", "png", "bmp"})  # what FFmpeg's MP4 muxer writes as `covr`
AAC_BITRATE_PER_CHANNEL = 96_000
# Source metadata that describes the old file rather than its content.
_TECHNICAL_METADATA = frozenset({"major_brand", "minor_version", "compatible_brands", "encoder", "duration"})
_DEFAULT_LAYOUTS = {1: "mono", 2: "stereo", 3: "2.1", 4: "quad", 5: "5.0", 6: "5.1", 7: "6.1", 8: "7.1"}
# The layouts AAC declares which channel is which (its channel configurations), fewest channels first
_AAC_LAYOUTS = ("mono", "stereo", "2.1", "3.0", "quad", "4.0", "5.0", "5.1", "7.1")


@dataclass(frozen=True)
class Carried:
    """What happens to one source stream."""

    index: int
    kind: str  # "audio", "subtitle", "cover art" or "data"
    action: str  # "copy", "aac", "mov_text", "timecode" (written again from the video's) or "drop"
    detail: str  # for people: the codec, or why it is dropped

    def describe(self) -> str:
        verb = {"copy": "copied", "aac": "re-encoded to AAC", "mov_text": "converted to mov_text", "drop": "left out",
                "timecode": "kept as the output's timecode"}  # fmt: skip
        return f"{self.kind} #{self.index} ({self.detail}): {verb[self.action]}"


def plan_streams(info: MediaInfo) -> tuple[Carried, ...]:
    carried = []
    for audio in info.audio:
        if audio.codec == "unknown" or audio.channels == 0:
            carried.append(Carried(audio.index, "audio", "drop", "no decoder for its codec"))
        elif audio.duration <= 0:
            carried.append(Carried(audio.index, "audio", "drop", f"{audio.codec}, holds no samples"))
        else:
            copy = audio.codec in COPY_AUDIO and not (audio.codec == "mp3" and audio.sample_rate < MP3_MIN_RATE)
            layout = None if copy else aac_format(audio.sample_rate, audio.layout, audio.channels)[1]
            moved = f", {audio.layout} as {layout}" if layout and layout != audio.layout else ""  # 6.1 as 7.1
            carried.append(Carried(audio.index, "audio", "copy" if copy else "aac", audio.codec + moved))
    for subtitle in info.subtitles:
        if subtitle.codec in TEXT_SUBTITLES:
            carried.append(Carried(subtitle.index, "subtitle", "mov_text", subtitle.codec))
            continue
        # closed captions (EIA-608 byte pairs) are text, but no MP4 subtitle track of FFmpeg's takes them
        why = (
            "closed captions, which MP4's muxer cannot carry" if subtitle.codec in CAPTIONS
            else "a bitmap format MP4 cannot hold" if subtitle.codec in BITMAP_SUBTITLES
            else "a subtitle format MP4's muxer cannot carry"
        )  # fmt: skip
        carried.append(Carried(subtitle.index, "subtitle", "drop", f"{subtitle.codec}, {why}"))
    for cover in info.covers:
        art = cover.codec in COVER_ART
        carried.append(Carried(cover.index, "cover art", "copy" if art else "drop", cover.codec + ("" if art else ", a format MP4 cover art cannot hold")))
    for data in info.data:
        if data.timecode and info.video.timecode:
            text, fps = info.video.timecode, info.video.fps
            written = recount(text, data.count, fps) if data.count else text
            rate = f"the output's rate ({float(fps):.4g} fps)"
            # FFmpeg writes a reel name in QuickTime's timecode track only: an MP4's has no place for it
            reel = f"; reel {data.reel} not kept: MP4's timecode track has no reel name" if data.reel else ""
            if written is None:
                why = f"drop-frame at {data.count.frames} a second, which {rate} does not count"
                carried.append(Carried(data.index, "data", "drop", f"timecode {text}, {why}"))
            elif written != text:
                how = f"counted at {output_count(fps)} a second as {rate} is, not {data.count.frames}"
                carried.append(Carried(data.index, "data", "timecode", f"timecode {text} as {written}, {how}{reel}"))
            else:
                carried.append(Carried(data.index, "data", "timecode", f"timecode {text}{reel}"))
        else:
            what = data.handler or "unknown"
            carried.append(Carried(data.index, "data", "drop", f"{what}, a data track only its maker's software reads"))
    return tuple(carried)


def output_timecode(info: MediaInfo, carried: tuple[Carried, ...]) -> str | None:
    """The timecode the output's first frame is given: the source's, counted at the output's rate (`recount`), where
    it is carried."""
    if not any(c.action == "timecode" for c in carried):
        return None
    count = next((d.count for d in info.data if d.timecode and d.count), None)
    return recount(info.video.timecode, count, info.video.fps) if count else info.video.timecode


def output_clock(info: MediaInfo, carried: tuple[Carried, ...]) -> float:
    """Where the output's clock starts, in seconds of the source: its first frame, or a carried audio stream that
    starts over one of its packets earlier. A lead within one packet is a codec's start-up (AAC priming, Opus
    pre-skip: samples never presented) or within what a copy keeps anyway: the packet that straddles the start."""
    kept = {c.index for c in carried if c.kind == "audio" and c.action != "drop"}
    video = info.video.start
    return min([video, *(a.start for a in info.audio if a.index in kept and a.start < video - a.packet_seconds)])


def output_metadata(info: MediaInfo) -> dict[str, str]:
    """Container metadata worth keeping (title, dates, ...), not what described the old file's muxing."""
    return {key: value for key, value in info.metadata.items() if key.lower() not in _TECHNICAL_METADATA}


class Passthrough:
    """Carries the planned streams of `info`'s file into an output container, shifted by `offset` seconds (where the
    output's clock starts in the source) and, where `end` is given, cut at `end` seconds of output time."""

    def __init__(self, info: MediaInfo, carried: tuple[Carried, ...], offset: float, end: float | None = None) -> None:
        self.path, self.format, self.size = info.path, info.format, info.size_bytes
        self.offset, self.end = offset, end
        self.container = open_input(info.path, metadata_errors="replace")
        wanted = {c.index: c.action if c.kind != "cover art" else "cover" for c in carried if c.action not in ("drop", "timecode")}
        self.streams = [self.container.streams[index] for index in wanted]
        self.handlers: dict[int, _Handler] = {}
        self._actions = wanted
        self._packets = demux(self.container, *self.streams) if self.streams else iter(())
        self._pending: av.Packet | None = None

    def add_streams(self, output: av.container.OutputContainer) -> None:
        """Create the output streams: before the output's header is written."""
        kinds = {"copy": _Copy, "aac": _ToAac, "mov_text": _ToMovText, "cover": _Cover}
        marked = set()  # kinds whose default track is chosen
        for stream in self.streams:
            handler = kinds[self._actions[stream.index]](stream, output, self)
            for key in ("language", "title"):
                if stream.metadata.get(key):
                    handler.output.metadata[key] = stream.metadata[key]
            # The track players pick of several (a film's original language marked default after its dub): the MP4
            # muxer enables the default tracks of each kind, else the first one; unmarked, it was always the first.
            # One per kind: Matroska marks every track default unless told, and MP4 players play every enabled one.
            if stream.disposition & av.stream.Disposition.default and stream.type not in marked and not isinstance(handler, _Cover):
                handler.output.disposition = av.stream.Disposition.default
                marked.add(stream.type)
            self.handlers[stream.index] = handler

    def mux_until(self, seconds: float | None, alive: Callable[[], object] | None = None) -> None:
        """Mux every carried packet that starts before `seconds` of output time (None: all that remain). `alive` is
        called for each: after the last frame, an hour of sound to re-encode takes minutes, and the job's lease and
        its worker's watch for a stuck tail must see it go on."""
        while True:
            if alive is not None:
                alive()
            packet, self._pending = self._pending, None
            if packet is None:
                with self.reading():
                    packet = next(self._packets, None)
            if packet is None:
                break
            if cut_off(packet, self.size):  # the probe left it out of the streams' extents too
                continue
            if seconds is not None and packet.pts is not None and self.output_time(packet) >= seconds:
                self._pending = packet
                return
            self.handlers[packet.stream.index].take(packet)
        if seconds is None:
            for handler in self.handlers.values():
                handler.finish()

    def edits(self) -> list[tuple[int, int]]:
        """(track, samples): the re-encoded tracks whose encoder priming the MP4's edit list must skip."""
        return [edit for handler in self.handlers.values() if isinstance(handler, _ToAac) and (edit := handler.edit())]

    def placed(self) -> dict[int, tuple[float, float]]:
        """Source stream -> (start, seconds) of output time its re-encoded audio covers, as decoded."""
        return {index: placed for index, handler in self.handlers.items() if isinstance(handler, _ToAac) and (placed := handler.placed())}

    @contextmanager
    def reading(self) -> Iterator[None]:
        """Demuxing and decoding the source: its failures are the input's (muxing failures are ours)."""
        try:
            yield
        except AVError as error:
            raise InputCorrupt(f"{self.path.name}: a carried stream cannot be read ({error})") from None

    def output_time(self, packet: av.Packet) -> float:
        return float(packet.pts * packet.time_base) - self.offset

    def close(self) -> None:
        self.container.close()


class _Handler:
    def __init__(self, stream: av.stream.Stream, output: av.container.OutputContainer, passthrough: Passthrough) -> None:
        # held weakly: the passthrough holds its handlers, and a cycle would keep them (their decoders and encoders,
        # whose FFmpeg threads run on: 256 for 64 sound tracks) until Python's cyclic collector runs, jobs later
        self.source, self._passthrough = stream, weakref.ref(passthrough)
        self.output = self._add(output)

    @property
    def passthrough(self) -> Passthrough:
        passthrough = self._passthrough()
        assert passthrough is not None, "a handler outlived its passthrough"
        return passthrough

    def _add(self, output: av.container.OutputContainer) -> av.stream.Stream:
        raise NotImplementedError

    def take(self, packet: av.Packet) -> None:
        raise NotImplementedError

    def finish(self) -> None:
        pass


class _Copy(_Handler):
    def _add(self, output: av.container.OutputContainer) -> av.stream.Stream:
        self.muxed = False
        self.latest: int | None = None  # the latest packet's time
        return output.add_stream_from_template(self.source)

    def take(self, packet: av.Packet) -> None:
        if packet.size == 0 or packet.pts is None:
            return
        if not packet.duration and self.latest is not None and packet.pts > self.latest:
            # ALAC in Matroska: packets without durations. The MP4's last sample would last nothing and cut the
            # sound short by a packet: each lasts as long as the one before it (as probe reads such a stream).
            packet.duration = packet.pts - self.latest
        self.latest = packet.pts
        if packet.is_discard and self.muxed:
            # An MP4 edit list of several edits (a clip cut in QuickTime without re-encoding): each later edit's
            # lead-in comes marked to discard, timed back before sound already muxed. Its sound is cut by the edit;
            # copied, its times ran back and the muxer refused them (EINVAL: an internal error).
            return
        start = self.passthrough.output_time(packet)
        duration = float((packet.duration or 0) * packet.time_base)
        # Keep one packet before the start: codecs like AAC need it to decode the first samples (the MP4 edit list
        # hides it). At the end a copy can only be cut between packets: keep those that are mostly before it.
        end = self.passthrough.end
        if (start < 0 and start + duration <= -duration) or (end is not None and start + duration / 2 >= end):
            return
        shift = round(self.passthrough.offset / packet.time_base)
        packet.pts -= shift
        if packet.dts is not None:
            packet.dts -= shift
        packet.stream = self.output
        self.output.container.mux(packet)
        self.muxed = True


class _Cover(_Handler):
    """Cover art: its one picture, which the MP4 muxer writes as `covr` (players and file browsers show it)."""

    def _add(self, output: av.container.OutputContainer) -> av.stream.Stream:
        stream = output.add_stream_from_template(self.source)
        stream.disposition = av.stream.Disposition.attached_pic
        self.muxed = False
        return stream

    def take(self, packet: av.Packet) -> None:
        if self.muxed or not packet.size:
            return
        packet.stream, packet.pts, packet.dts = self.output, 0, 0
        self.output.container.mux(packet)
        self.muxed = True


class _ToAac(_Handler):
    """Decode, place the samples on the output clock and encode AAC in 1024-sample frames at the source's rate and
    layout. Every decoded sample is kept, one after another, as players play them: a frame's timestamp moves it
    only across a real gap (more than two frames: silence fills it), never back over sound already placed, since
    containers time audio coarsely (ASF to the millisecond, over packets that overlap; Ogg only per page, FFmpeg's
    per-packet times there run seconds off). The track starts at its first frame's time, or where the stream says
    it starts where that frame has none (or, in Ogg, an estimated one); nothing before the clock's start, nothing
    after `end` where one is set."""

    FRAME = 1024
    SLACK_SECONDS = 0.02  # the least gap that is one: below, timestamps only jitter (Matroska rounds to ms)

    def _add(self, output: av.container.OutputContainer) -> av.stream.Stream:
        context = self.source.codec_context
        self.rate, self.layout = aac_format(context.sample_rate, context.layout.name, context.channels)
        channels = av.AudioLayout(self.layout).nb_channels
        stream = output.add_stream("aac", rate=self.rate, layout=self.layout)
        stream.codec_context.bit_rate = AAC_BITRATE_PER_CHANNEL * channels
        # Samples go through numpy interleaved ("flt"), not planar: PyAV (18.1) counts 9 planes in an 8-channel
        # planar frame, so a 7.1 track (a Blu-ray rip's TrueHD or DTS, a camera's 8 PCM channels) crashed the worker
        # (SIGSEGV reading the ninth) and could not be encoded (IndexError making the frame). The encoder converts.
        self.resampler = av.AudioResampler(format="flt", layout=self.layout, rate=self.rate)
        self.channels = channels
        self.buffer = np.zeros((channels, 0), np.float32)
        self.timed = self.passthrough.format != "ogg"
        source = self.source
        self.declared_start = float(source.start_time * source.time_base) if source.start_time is not None else None
        self.first: int | None = None  # output sample of the track's first sample
        self.position: int | None = None  # output sample the next decoded sample lands on
        self.skip = 0  # samples still to drop: those before the output clock's start
        self.longest = 0  # the longest decoded frame so far, in output samples
        self.encoded = 0
        self.priming: int | None = None  # samples the encoder puts before the first (its first packet's lead)
        self.limit = None if self.passthrough.end is None else round(self.passthrough.end * self.rate)
        return stream

    def take(self, packet: av.Packet) -> None:
        if not packet.size:
            return  # sent, it would end the decoder's stream (Ogg files hold thousands); finish() flushes it
        with self.passthrough.reading():
            self._decoded(packet.decode())

    def _decoded(self, frames: list[av.AudioFrame]) -> None:
        for frame in frames:
            time = float(frame.pts * frame.time_base) if frame.pts is not None and self.timed else None
            if time is not None and self.declared_start is not None and time < self.declared_start - self.SLACK_SECONDS:
                time = None  # before where the stream starts: a time made up counting back from a page's end
            if self.position is None:
                time = time if time is not None else self.declared_start
            at = None if time is None else round((time - self.passthrough.offset) * self.rate)
            self._place(self.resampler.resample(frame), at)

    def _place(self, frames: list[av.AudioFrame], at: int | None) -> None:
        """Append decoded samples due at output sample `at` (None: right after the previous ones)."""
        planes = (frame.to_ndarray().reshape(-1, self.channels).T for frame in frames)  # (channels, samples)
        samples = np.concatenate([self.buffer[:, :0], *planes], axis=1)
        if not samples.shape[1]:
            return
        self.longest = max(self.longest, samples.shape[1])
        if self.position is None:  # the first samples: the track starts where they are due
            self.position = at or 0
            self.skip = max(0, -self.position)
            self.position += self.skip
        elif at is not None and at - self.position > max(self.SLACK_SECONDS * self.rate, 2 * self.longest):
            silence = np.zeros((len(samples), at - self.position), np.float32)
            samples = np.concatenate([silence, samples], axis=1)  # a real gap: silence until they are due
        dropped = min(self.skip, samples.shape[1])
        samples, self.skip = samples[:, dropped:], self.skip - dropped
        if not samples.shape[1]:
            return
        if self.first is None:
            self.first = self.encoded = self.position
        self.position += samples.shape[1]
        if self.limit is not None:
            samples = samples[:, : max(0, self.limit - (self.encoded + self.buffer.shape[1]))]
        self.buffer = np.concatenate([self.buffer, samples], axis=1)
        while self.buffer.shape[1] >= self.FRAME:
            self._encode(self.FRAME)

    def _encode(self, count: int) -> None:
        interleaved = np.ascontiguousarray(self.buffer[:, :count].T).reshape(1, -1)
        frame = av.AudioFrame.from_ndarray(interleaved, format="flt", layout=self.layout)
        frame.sample_rate, frame.pts, frame.time_base = self.rate, self.encoded, Fraction(1, self.rate)
        self.buffer = self.buffer[:, count:]
        self.encoded += count
        self._mux(self.output.encode(frame))

    def _mux(self, packets: list[av.Packet]) -> None:
        for packet in packets:
            if self.priming is None:
                self.priming = max(0, self.first - packet.pts)
            if self.first:  # a late start: see `edit`
                packet.pts += self.priming
                packet.dts += self.priming
            self.output.container.mux(packet)

    def finish(self) -> None:
        with self.passthrough.reading():
            self._decoded(self.source.codec_context.decode(None))
        self._place(self.resampler.resample(None), None)
        if self.buffer.shape[1]:
            self._encode(self.buffer.shape[1])
        self._mux(self.output.encode(None))

    def edit(self) -> tuple[int, int] | None:
        """(track, samples) where the MP4's edit list must skip the encoder's priming: a track that starts after the
        output's clock. FFmpeg's muxer trims priming only from a track that starts at 0 (its packets then start
        before 0); later, it turns the first packet's time into an empty edit, priming included, which would be
        played as sound (1024 samples of near-silence ahead of the track). The packets were muxed `priming` later,
        so the empty edit ends where the first sample is due, and `edit_list.skip` moves the media's start past it."""
        if not self.first or not self.priming:
            return None
        return self.output.index + 1, self.priming  # FFmpeg's MP4 muxer numbers tracks from 1 in stream order

    def placed(self) -> tuple[float, float] | None:
        """(start, seconds) of output time the track covers: its decoded samples, and the silence of real gaps."""
        if self.first is None:
            return None
        end = self.position if self.limit is None else min(self.position, self.limit)
        return self.first / self.rate, (end - self.first) / self.rate


def aac_format(sample_rate: int, layout: str, channels: int) -> tuple[int, str]:
    """(rate, layout) of the AAC a source is re-encoded to: its own wherever FFmpeg's AAC encoder takes them and
    the file says which channel is which, else 48 kHz and the standard layout of as many channels."""
    rate = sample_rate if sample_rate in av.codec.Codec("aac", "w").audio_rates else 48000
    written = _written(rate, layout)
    if written == av.AudioLayout(layout).name:
        return rate, layout
    standard = _DEFAULT_LAYOUTS.get(channels)
    return rate, _holding(rate, layout) or standard or (layout if written is not None else "stereo")


def _holding(rate: int, layout: str) -> str | None:
    """The smallest layout AAC declares that has room for each of `layout`'s channels: as many besides the LFE, and
    an LFE where it has one. The resampler puts each channel where it goes, or between its neighbours (a 6.1's back
    centre on both back channels, as a 7.1 system plays it). AAC declares no 7-channel layout: 6.1 (DTS-ES, 7-channel
    PCM) read back as "7 channels", positions unknown; and the standard layout of as many channels dropped an LFE
    (3.1 as quad) or had none for it."""
    try:
        names = [channel.name for channel in av.AudioLayout(layout).channels]
    except ValueError:
        return None
    if "NONE" in names:  # "7 channels": which is which unknown; the resampler takes them as the standard layout
        return _holding(rate, _DEFAULT_LAYOUTS[len(names)]) if len(names) in _DEFAULT_LAYOUTS else None
    lfe = "LFE" in names
    for candidate in _AAC_LAYOUTS:
        held = [channel.name for channel in av.AudioLayout(candidate).channels]
        if len(held) - ("LFE" in held) >= len(names) - lfe and ("LFE" in held) >= lfe and _written(rate, candidate) == candidate:
            return candidate
    return None


def _written(rate: int, layout: str) -> str | None:
    """The layout AAC of `layout` reads back as (None: the encoder refuses it). Layouts outside AAC's channel
    configurations are written with a program config element, and some come back as "6 channels", positions
    unknown: 5.1(side), what FFmpeg decodes DTS, TrueHD and 6-channel PCM as (a Blu-ray rip, a camera), so players
    guessed where each channel goes. Their standard layout (5.1) is declared; the resampler moves the sides back."""
    encoder = av.codec.CodecContext.create("aac", "w")
    encoder.sample_rate, encoder.format = rate, "fltp"
    try:
        encoder.layout = layout
        encoder.open()
        decoder = av.codec.CodecContext.create("aac", "r")
        decoder.extradata = encoder.extradata
        decoder.open()
    except (*AVError, ValueError):
        return None
    return decoder.layout.name


def audio_output(audio: AudioInfo, action: str) -> tuple[str, int, int]:
    """(codec, sample rate, channels) a carried audio stream has in the output."""
    if action == "copy":
        return audio.codec, audio.sample_rate, audio.channels
    rate, layout = aac_format(audio.sample_rate, audio.layout, audio.channels)
    return "aac", rate, av.AudioLayout(layout).nb_channels


class _ToMovText(_Handler):
    """Text subtitles as mov_text, in milliseconds of output time. An MP4 text track shows one sample at a time, and
    FFmpeg's muxer moves a cue that starts before the last one ended to after it (each one after a sign or a second
    speaker came late, and later in turn): cues that overlap are cut where any starts or ends, and each piece shows
    every cue on screen then, one line after another."""

    def _add(self, output: av.container.OutputContainer) -> av.stream.Stream:
        # S_TEXT/WEBVTT's stream has no codec (this FFmpeg maps only D_WEBVTT/*): its blocks are WebVTT cues, which
        # FFmpeg's own decoder reads
        self.decoder = self.source.codec_context or av.CodecContext.create("webvtt", "r")
        self.decoder.open()  # its ASS header is the encoder's, and must exist before the output header is written
        header = self.decoder.subtitle_header or b""
        self.styles = _style_names(header)
        if not self.styles:  # the encoder wrote every cue in size 0, transparent: hidden
            header = default_ass_header()
            self.styles = _style_names(header)
        stream = output.add_stream("mov_text")
        stream.codec_context.time_base = Fraction(1, 1000)
        stream.codec_context.subtitle_header = header
        stream.codec_context.open()
        self.shown: list[tuple[int, int, bytes]] = []  # cues on screen: (start, end) in ms, the ASS dialogue
        self.cut = 0  # ms before which every piece has been muxed
        return stream

    def take(self, packet: av.Packet) -> None:
        if packet.size == 0 or packet.pts is None:
            return
        start = self.passthrough.output_time(packet)
        with self.passthrough.reading():
            subtitles = self.decoder.decode2(packet)
        dialogues = [rect.ass for rect in subtitles.rects if isinstance(rect, AssSubtitle)] if subtitles else []
        end = start + float((packet.duration or 0) * packet.time_base)
        if self.passthrough.end is not None:
            end = min(end, self.passthrough.end)
        # a cue from before what is muxed (out of order) shows from there on
        first, last = max(round(start * 1000), 0, self.cut), round(end * 1000)
        if not dialogues or last <= first:
            return
        self._show_until(first)
        self.shown.extend((first, last, dialogue) for dialogue in dialogues)

    def finish(self) -> None:
        self._show_until(None)

    def _show_until(self, until: int | None) -> None:
        """Mux what is on screen before `until` ms (None: all), a piece between each two cue starts or ends."""
        while self.shown:
            begin = max(self.cut, min(start for start, _, _ in self.shown))
            if until is not None and begin >= until:
                return
            boundary = min(t for start, end, _ in self.shown for t in (start, end) if t > begin)
            self._mux_piece(begin, boundary if until is None else min(boundary, until))

    def _mux_piece(self, begin: int, end: int) -> None:
        on = [dialogue for start, stop, dialogue in self.shown if start <= begin and stop >= end]  # never empty
        fields = on[0].split(b",", 8)  # ReadOrder,Layer,Style,Name,MarginL,MarginR,MarginV,Effect,Text
        fields[2] = self._style(fields[2])
        text = b"\\N".join(dialogue.split(b",", 8)[-1] for dialogue in on)
        piece = SubtitleSet.create(b",".join([*fields[:8], text]), 0, end - begin, pts=begin)
        encoded = self.output.codec_context.encode_subtitle(piece)
        encoded.stream, encoded.time_base = self.output, Fraction(1, 1000)
        encoded.pts = encoded.dts = begin
        encoded.duration = end - begin
        self.output.container.mux(encoded)
        self.cut = end
        self.shown = [cue for cue in self.shown if cue[1] > end]

    def _style(self, name: bytes) -> bytes:
        """The header's style a cue names, as libass finds it (spaces and a leading `*` aside), else `Default` or
        the first, as libass falls back: a name the header lacks was encoded in size 0, transparent."""
        name = name.strip().lstrip(b"*")
        if name in self.styles:
            return name
        return b"Default" if b"Default" in self.styles else self.styles[0]


def _style_names(header: bytes) -> list[bytes]:
    """The names of the styles an ASS header defines, in order."""
    lines = (line.strip() for line in header.splitlines())
    return [line.split(b":", 1)[1].split(b",", 1)[0].strip() for line in lines if line.startswith(b"Style:")]


def default_ass_header() -> bytes:
    """FFmpeg's ASS header for cues that come with none (an SRT's): one `Default` style, white on its outline."""
    decoder = av.CodecContext.create("subrip", "r")
    decoder.open()
    return decoder.subtitle_header
