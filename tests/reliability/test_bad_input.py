"""Bad input through the live API and a real worker: a corpus of requests and files, made here, that a client or an
attacker might send. Every one ends as a 4xx problem+json or a `failed` job with a stable code, never a 5xx; the odd but
valid videos complete; and the API and the worker still serve the next job."""

from __future__ import annotations

import io
import json
import random
import secrets
import struct
import zipfile
from collections.abc import Callable
from fractions import Fraction
from pathlib import Path

import av
import pytest
import requests
from PIL import Image

from tests.service.test_api import assert_problem
from worker.media.errors import BAD_INPUT_CODES
from worker.media.synthetic import write_clip

from .conftest import UPLOAD_LIMIT, MiB, auth, create, status_counts, wait_all

KEY = "carol"
BOUNDARY = "vsrq-bad-input"


# -- the corpus of files -------------------------------------------------------------------------------------------


def remux(
    source: Path, target: Path, kinds: tuple[str, ...] = ("video", "audio"), container: str = "mp4", **options: str
) -> bytes:
    """`source`'s streams of `kinds`, copied packet for packet into an MP4 (or `container`; muxer `options`, e.g.
    faststart)."""
    with av.open(str(source)) as given, av.open(str(target), "w", format=container, options=options) as written:
        streams = {s.index: written.add_stream_from_template(s) for s in given.streams if s.type in kinds}
        for packet in given.demux(*[s for s in given.streams if s.index in streams]):
            if packet.dts is not None:
                packet.stream = streams[packet.stream.index]
                written.mux(packet)
    return target.read_bytes()


def patched(data: bytes, box: bytes, offset: int, value: int) -> bytes:
    """`data` with the 32-bit big-endian field `offset` bytes after the first `box` tag replaced."""
    at = data.index(box) + offset
    return data[:at] + struct.pack(">I", value) + data[at + 4 :]


def test_the_upload_sniff_names_no_video_of_the_corpus(corpus_cache):
    """What api/sniff.py refuses as it arrives, over every real file of the corpus: the songs, never a video (an Ogg
    with Theora, an MPEG-TS whose packets could start like an MP3 frame, an animated PNG)."""
    from api.sniff import PEEK_BYTES, not_a_video

    heads = {path.name: path.read_bytes()[:PEEK_BYTES] for path in sorted(corpus_cache.iterdir())}
    named = {name: kind for name, head in heads.items() if (kind := not_a_video(head))}
    assert set(named) == {*NOT_VIDEOS.values(), "pymediainfo-sample_with_cover.mp3"}, named


def test_files_without_a_video_track_are_named_and_no_other_file_of_the_corpus(corpus_cache):
    """What api/sniff.py refuses once an MP4 or a Matroska file is stored, read from its boxes or elements: songs and
    captions saved so (their tracks all sound, or text), never a video, nor a file whose structure does not say."""
    from api.sniff import without_video

    named = {}
    for path in sorted(corpus_cache.iterdir()):
        data = path.read_bytes()
        if kind := without_video(lambda offset, length, data=data: data[offset : offset + length], len(data)):
            named[path.name] = kind
    assert named == {
        "mutagen-alac.m4a": "an MP4 with sound only", "mutagen-covr-with-name.m4a": "an MP4 with sound only",
        "mutagen-no-tags.3g2": "an MP4 with sound only", "pymediainfo-mp4-with-audio.mp4": "an MP4 with sound only",
        "pymediainfo-vbr_requires_parsespeed_1.mp4": "an MP4 with sound only",
        "muxjs-test-webvtt-init.mp4": "an MP4 without a video track",
        "pymediainfo-sample.mkv": "a Matroska file without a video track",  # its one track subtitles
    }  # fmt: skip


def test_an_mpeg_ts_is_judged_only_by_the_tables_it_reads_whole(corpus_cache, tmp_path):
    """An MPEG-TS is refused at upload only where its program tables (PAT, PMTs, CRCs right) list no stream that may
    hold pictures; a private stream that does not say what it holds (AAC in an M2TS: FFmpeg probes its packets), a
    broken table or a stream cut before its tables is left to the worker's probe."""
    from api.sniff import without_video

    def judged(data: bytes) -> str | None:
        return without_video(lambda offset, length: data[offset : offset + length], len(data))

    sound = remux(corpus_cache / "muxjs-sintel-captions.ts", tmp_path / "sound.ts", ("audio",), "mpegts")
    assert judged(sound) == "an MPEG transport stream with sound only"
    pat = next(at for at in range(0, len(sound), 188) if sound[at + 1] & 0x1F == 0 and sound[at + 2] == 0)
    assert judged(sound[: pat + 188]) is None  # its PMT not reached
    video = remux(corpus_cache / "hachoir-sample.ts", tmp_path / "video.ts", ("video",), "mpegts")
    pmt = next(at for at in range(0, len(video), 188) if video[at + 1] & 0x40 and video[at + 5] == 0x02)
    entry = pmt + 5 + 12 + ((video[pmt + 15] & 0x0F) << 8 | video[pmt + 16])  # its first stream's type
    assert judged(video) is None and video[entry] == 0x02  # MPEG-2 video
    assert judged(video[:entry] + b"\x0f" + video[entry + 1 :]) is None  # a damaged table (it says AAC; its CRC not)
    private = remux(corpus_cache / "muxjs-sintel-captions.ts", tmp_path / "aac.m2ts", ("audio",), "mpegts",
                    mpegts_m2ts_mode="1")  # fmt: skip
    assert judged(private) is None
    # crafted: a radio programme and a TV one whose tables share a PID (the radio's read first), and a PMT too short
    # for its own header (its CRC right: it was an IndexError, a 500)
    pat = _ts_packet(0, _ts_table(0x00, b"\x00\x01\xc1\x00\x00" + b"\x00\x01\xe1\x00" + b"\x00\x02\xe1\x00"))
    radio = _ts_packet(0x100, _ts_table(0x02, b"\x00\x01\xc1\x00\x00\xe1\x01\xf0\x00" + b"\x0f\xe1\x01\xf0\x00"))
    tv = _ts_packet(0x100, _ts_table(0x02, b"\x00\x02\xc1\x00\x00\xe1\x02\xf0\x00" + b"\x1b\xe1\x02\xf0\x00"))
    alone = _ts_packet(0, _ts_table(0x00, b"\x00\x01\xc1\x00\x00" + b"\x00\x01\xe1\x00"))  # the radio's alone
    assert judged(alone + radio + radio) == "an MPEG transport stream with sound only"
    assert judged(pat + radio + radio + tv) is None and judged(pat + radio + radio) is None  # the TV one not read
    assert judged(pat + _ts_packet(0x100, _ts_table(0x02, b"\x00\x01\xc1\x00\x00")) + pat) is None
    # Blu-ray's LPCM (0x80) is sound where the programme is registered as Blu-ray's (HDMV), and no judge's elsewhere
    lpcm = b"\x80\xe1\x01\xf0\x00"
    blu_ray = _ts_packet(0x100, _ts_table(0x02, b"\x00\x01\xc1\x00\x00\xe1\x01\xf0\x06\x05\x04HDMV" + lpcm))
    other = _ts_packet(0x100, _ts_table(0x02, b"\x00\x01\xc1\x00\x00\xe1\x01\xf0\x00" + lpcm))
    assert (judged(alone + blu_ray + blu_ray), judged(alone + other + other)) == (
        "an MPEG transport stream with sound only", None
    )


def _ts_table(table_id: int, body: bytes) -> bytes:
    """A PSI table section: its id, its length, `body` (from the table id extension on), and its CRC."""
    from api.sniff import _crc32_mpeg2

    head = bytes([table_id, 0xB0 | (len(body) + 4) >> 8, (len(body) + 4) & 0xFF]) + body
    return head + _crc32_mpeg2(head).to_bytes(4, "big")


def _ts_packet(pid: int, section: bytes) -> bytes:
    """A 188-byte transport packet starting `section` (its pointer field 0), stuffed."""
    payload = b"\x00" + section
    return bytes([0x47, 0x40 | pid >> 8, pid & 0xFF, 0x10]) + payload + b"\xff" * (184 - len(payload))


def picture(kind: str = "PNG") -> bytes:
    """A still picture (or a one-page PDF of it), as Pillow writes one."""
    out = io.BytesIO()
    Image.new("RGB", (48, 32), (200, 40, 40)).save(out, format=kind)
    return out.getvalue()


def zipped(member: bytes) -> bytes:
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w") as archive:
        archive.writestr("clip.mp4", member)
    return out.getvalue()


def y4m(width: int, height: int) -> bytes:
    """A raw YUV4MPEG2 stream whose header declares `width` x `height` (the frame that follows is a few bytes)."""
    return f"YUV4MPEG2 W{width} H{height} F24:1 Ip A1:1 C420jpeg\nFRAME\n".encode() + b"\x80" * 4096


def bad_files(scratch: Path) -> dict[str, tuple[bytes, str]]:
    """name -> (bytes sent as `clip.mp4`, the failed job's code)."""
    plain = write_clip(scratch / "plain.mp4", 9, (32, 48), audio_codec="aac")
    moov_last = plain.read_bytes()  # PyAV writes the index (moov) after the media data (mdat)
    moov_first = remux(plain, scratch / "faststart.mp4", movflags="+faststart")
    mdat = moov_first.index(b"mdat")
    mkv = write_clip(scratch / "clip.mkv", 17, (32, 48), audio_codec="libopus").read_bytes()
    return {
        # seeded: FFmpeg's probe finds audio or subtitles in about 1 of 150 noise files (measured), a job then failed
        # as input_no_video
        "random bytes": (random.Random(0).randbytes(20_000), "input_unreadable"),
        "ftyp only": (moov_first[: moov_first.index(b"moov") - 4], "input_unreadable"),
        "moov missing": (moov_last[: moov_last.index(b"moov") - 4], "input_unreadable"),
        "mdat cut": (moov_first[: (mdat + len(moov_first)) // 2], "input_corrupt"),
        "mdat overwritten": (
            moov_first[: mdat + 200] + bytes(range(256)) * 4 + moov_first[mdat + 1224 :],
            "input_corrupt",
        ),
        "mkv cut": (mkv[: len(mkv) * 6 // 10], "input_corrupt"),
        "one frame": (write_clip(scratch / "one.mp4", 1, (32, 48)).read_bytes(), "input_too_short"),
        "declared 60000x60000": (y4m(60000, 60000), "input_unreadable"),  # FFmpeg refuses the size itself
        "declared 8000x8000": (y4m(8000, 8000), "input_too_large"),  # over our 4K limit, before a packet is read
        # the index (stts) claims 100,000 frames; the file holds 9
        "100k declared frames": (patched(moov_last, b"stts", 12, 100_000), "input_corrupt"),
        "3 hours at 1/1000 fps": (
            write_clip(scratch / "slow.mp4", 9, (32, 48), Fraction(1, 1000)).read_bytes(),
            "input_too_large",
        ),
        "unsupported codec": (moov_last.replace(b"avc1", b"zzzz"), "input_unsupported_codec"),
        # found by this test: the MP4 written back at such a rate lost its frames (output_mismatch, ours)
        "240000 fps": (write_clip(scratch / "fast.mp4", 9, (32, 48), Fraction(240000)).read_bytes(), "input_too_large"),
    }


# -- odd but valid videos: they complete ---------------------------------------------------------------------------

ODD: dict[str, tuple[Callable[[Path], Path], tuple[int, int, int]]] = {
    # name -> (writer, (output width, height, frames) at x2)
    "variable frame rate": (
        lambda p: write_clip(p, 9, (32, 48), timestamps=[0, 1, 3, 4, 8, 9, 15, 16, 20], time_base=Fraction(1, 48)),
        (96, 64, 9),
    ),
    "rotated 90": (lambda p: write_clip(p, 9, (32, 48), rotation=90), (64, 96, 9)),
    "odd size 47x33": (lambda p: write_clip(p, 9, (33, 47), pix_fmt="yuv444p"), (94, 66, 9)),
    "10-bit": (lambda p: write_clip(p, 9, (32, 48), pix_fmt="yuv420p10le"), (96, 64, 9)),
    "1000 fps": (lambda p: write_clip(p, 9, (32, 48), Fraction(1000)), (96, 64, 9)),
}


def damaged_files(corpus_cache: Path) -> tuple[dict[str, tuple[bytes, str]], dict[str, tuple[bytes, str | None, int]]]:
    """Real files damaged as downloads and recordings are: (name -> (bytes, the failed job's code)), and those that
    complete (name -> (bytes, a note the job has, its frames))."""
    ts = (corpus_cache / "muxjs-test-segment.ts").read_bytes()
    flv = (corpus_cache / "hachoir-breakdance.flv").read_bytes()
    first_40 = ts[:62_416]  # its first 40 frames, then 5 % of them lost
    lost = first_40[: len(first_40) // 3] + first_40[len(first_40) // 3 + len(first_40) // 20 :]
    failing = {
        # a sound packet's timestamps wrapped past int64: "its audio runs to 9223372032559810 s" (input_too_large)
        "flv joined to itself": (flv + flv, "input_corrupt"),
        "ts a tenth of its frames lost": (lost, "input_corrupt"),
    }
    completing = {
        # the decoder gives 120 of 128 frames: failed after every window had run, "decoded 120 frames, the container
        # holds 128"
        "ts a block lost": (ts[: len(ts) // 3] + ts[len(ts) // 3 + len(ts) // 20 :], "8 of the source's 128", 128),
        "ts cut at 8 KiB": (ts[:8192], None, 6),  # internal_error: a sound packet's position None
    }
    return failing, completing


def test_bad_files_fail_with_their_code_and_odd_ones_complete(rel_api, cpu_worker, tmp_path, clip, corpus_cache):
    corpus = bad_files(tmp_path)
    damaged, readable = damaged_files(corpus_cache)
    corpus |= damaged
    submitted: dict[str, str] = {}  # case -> job id
    for name, (data, _) in corpus.items():
        response = create(rel_api.url, KEY, data)
        assert response.status_code == 200, (name, response.text)
        submitted[name] = response.json()["id"]
    for name, (write, _) in ODD.items():
        response = create(rel_api.url, KEY, write(tmp_path / "odd.mp4").read_bytes())
        assert response.status_code == 200, (name, response.text)
        submitted[name] = response.json()["id"]
    for name, (data, _, _) in readable.items():
        response = create(rel_api.url, KEY, data)
        assert response.status_code == 200, (name, response.text)
        submitted[name] = response.json()["id"]
    # a header injection and a path traversal in the filename: stored as the caller's label, never as a key or header
    nasty = 'a.mp4"\r\nX-Injected: 1\r\n../../../etc/passwd'
    response = create(rel_api.url, KEY, clip, filename=nasty)
    assert response.status_code == 200, response.text
    submitted["nasty filename"] = response.json()["id"]

    ended = wait_all(rel_api.url, KEY, list(submitted.values()), cpu_worker)
    outcomes = {name: ended[job_id] for name, job_id in submitted.items()}
    wrong = {
        name: (job["status"], job["error"])
        for name, job in outcomes.items()
        if name in corpus and (job["status"], (job["error"] or {}).get("code")) != ("failed", corpus[name][1])
    }
    assert not wrong, wrong
    for name, job in outcomes.items():
        if job["error"]:
            error = job["error"]
            assert error["code"] in BAD_INPUT_CODES and "Traceback" not in error["message"], (name, error)
    for name, (_, (width, height, frames)) in ODD.items():
        job = outcomes[name]
        assert job["status"] == "completed", (name, job)
        assert (job["size"], job["output"]["media"]["frames"]) == (f"{width}x{height}", frames), (name, job)

    for name, (_, note, frames) in readable.items():
        job = outcomes[name]
        assert job["status"] == "completed" and job["output"]["media"]["frames"] == frames, (name, job)
        assert note is None or any(note in line for line in job["output"]["notes"]), (name, job["output"]["notes"])

    nasty_job = outcomes["nasty filename"]
    assert nasty_job["status"] == "completed", nasty_job
    stored = requests.get(f"{rel_api.url}/v1/videos/{nasty_job['id']}", headers=auth(KEY), timeout=30)
    label = stored.json()["input"]["filename"]  # a label only (clients percent-encode CR LF; none may survive)
    assert "\r" not in label and "\n" not in label and nasty_job["input"]["upload_id"].startswith("upload_"), label
    content = requests.get(
        f"{rel_api.url}/v1/videos/{nasty_job['id']}/content", headers=auth(KEY), timeout=30, allow_redirects=False
    )
    assert content.status_code == 302 and "X-Injected" not in content.headers, content.headers
    assert f"/outputs/{nasty_job['id']}/" in content.headers["Location"]

    codes = sorted({job["error"]["code"] for job in outcomes.values() if job["error"]})
    print(
        f"FIGURE bad_input files: {len(corpus)} bad -> {len(corpus)} failed with a stable code ({', '.join(codes)}); "
        f"{len(ODD) + len(readable) + 1}/{len(ODD) + len(readable) + 1} odd-but-valid or damaged-but-readable completed"
    )


# -- bad requests: 4xx problem+json, nothing stored ----------------------------------------------------------------


def multipart(*parts: tuple[str, str | None, bytes], closed: bool = True) -> bytes:
    """A hand-made multipart body: (field name, filename or None, content) parts."""
    body = b""
    for name, filename, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        body += f"--{BOUNDARY}\r\nContent-Disposition: {disposition}\r\n\r\n".encode() + content + b"\r\n"
    return body + (f"--{BOUNDARY}--\r\n".encode() if closed else b"")


def raw_post(url: str, body, content_type: str | None = f"multipart/form-data; boundary={BOUNDARY}", **headers):
    sent = {**auth(KEY), **headers, **({"Content-Type": content_type} if content_type else {})}
    return requests.post(f"{url}/v1/videos", data=body, headers=sent, timeout=60)


def field_cases(clip: bytes) -> dict[str, tuple[dict[str, str], int, str]]:
    """name -> (form fields sent with a valid clip, status, code)."""
    invalid = (422, "invalid_request")
    return {
        "scale 3": ({"sr_resolution_scale": "3"}, *invalid),
        "scale nan": ({"sr_resolution_scale": "nan"}, *invalid),
        "scale inf": ({"sr_resolution_scale": "inf"}, *invalid),
        "scale text": ({"sr_resolution_scale": "two"}, *invalid),
        "negative seed": ({"seed": "-2"}, *invalid),  # -1 is SGLang's "draw one"
        "seed 2**63": ({"seed": str(2**63)}, *invalid),
        "seed 1e400": ({"seed": "1e400"}, *invalid),
        "overlap 1.5": ({"sr_tile_min_overlap": "1.5"}, *invalid),
        "overlap -0.1": ({"sr_tile_min_overlap": "-0.1"}, *invalid),
        "tiles batch 0": ({"sr_tiles_batch_size": "0"}, *invalid),
        "steps 10000": ({"num_inference_steps": "10000"}, *invalid),
        "WxH garbage": ({"sr_target_resolution": "axb"}, *invalid),
        "WxH 0x0": ({"sr_target_resolution": "0x0"}, *invalid),
        "WxH negative": ({"sr_target_resolution": "-1280x720"}, *invalid),
        "WxH with injection": ({"sr_target_resolution": "1280x720\r\nX-Injected: 1"}, *invalid),
        "resize mode": ({"sr_target_resize_mode": "stretch"}, *invalid),
        "codec": ({"output_codec": "mpeg2"}, *invalid),
        "crf 99": ({"output_crf": "99"}, *invalid),
        "metadata not json": ({"metadata": "{oops"}, *invalid),
        "metadata too many": ({"metadata": json.dumps({f"k{i}": "v" for i in range(17)})}, *invalid),
        "metadata not strings": ({"metadata": json.dumps({"a": {"b": 1}})}, *invalid),
        "webhook not https": ({"webhook_url": "file:///etc/passwd"}, *invalid),
        "unknown model": ({"model": "../../etc/passwd"}, 422, "unknown_model"),
        "unknown field": ({"shell": "rm -rf /"}, 422, "unknown_field"),
        "server path": ({"video_path": "/etc/passwd"}, 422, "server_path_refused"),
        "extra_body not json": ({"extra_body": "{"}, 400, "malformed_extra_body"),
        "extra_body a list": ({"extra_body": "[1]"}, 400, "malformed_extra_body"),
    }


# Not videos, refused as the upload arrives (api/sniff.py) rather than failed by a worker after the queue's wait:
# real songs from the corpus, and what a person picks by mistake; once stored, MP4, Matroska and MPEG-TS files whose
# tracks are all sound.
NOT_VIDEOS = {
    "mp3": "hachoir-marc_kravetz.mp3", "flac": "mutagen-silence-44-s.flac", "opus": "mutagen-example.opus",
    "m4a": "mutagen-alac.m4a", "ogg vorbis": "forensics-debian.ogg",
}  # fmt: skip


def test_bad_requests_are_4xx_problems_and_store_nothing(rel_api, clip, s3, corpus_cache, tmp_path):
    url = rel_api.url
    before = sorted(s3.keys(f"uploads/{KEY}/"))
    answered: dict[str, tuple[requests.Response, int, str]] = {}
    for name, (fields, status, code) in field_cases(clip).items():
        answered[name] = (create(url, KEY, clip, **fields), status, code)

    file_part = ("video_reference", "clip.mp4", clip)
    requests_ = {
        "not multipart": (lambda: raw_post(url, b"hello", "text/plain"), 415, "unsupported_media_type"),
        "no boundary": (
            lambda: raw_post(url, multipart(file_part), "multipart/form-data"), 415, "unsupported_media_type"
        ),
        "garbage body": (lambda: raw_post(url, secrets.token_bytes(4096)), 400, "malformed_form"),
        "unterminated part": (lambda: raw_post(url, multipart(file_part, closed=False)[:-2]), 400, "malformed_form"),
        "part without headers": (lambda: raw_post(url, f"--{BOUNDARY}\r\n\r\n\r\n".encode()), 400, "malformed_form"),
        "field not utf-8": (
            lambda: raw_post(url, multipart(("seed", None, b"\xff\xfe"), file_part)), 400, "malformed_form"
        ),
        "field too large": (
            lambda: raw_post(url, multipart(("prompt", None, b"x" * 200_000), file_part)), 413, "field_too_large"
        ),
        "too many parts": (
            lambda: raw_post(url, multipart(*[(f"extra_body[k{n}]", None, b"x") for n in range(80)])),
            413,
            "too_many_parts",
        ),
        "a field twice": (
            lambda: raw_post(url, multipart(("seed", None, b"1"), ("seed", None, b"2"))), 422, "invalid_request"
        ),
        "no video": (lambda: raw_post(url, multipart(("seed", None, b"1"))), 422, "missing_video"),
        "two videos": (lambda: raw_post(url, multipart(file_part, file_part)), 422, "unexpected_file"),
        "empty video": (lambda: raw_post(url, multipart(("video_reference", "clip.mp4", b""))), 422, "input_empty"),
        **{
            f"{name} named .mp4": (
                lambda data=data: raw_post(url, multipart(("video_reference", "clip.mp4", data))), 422, "input_no_video"
            )
            for name, data in {
                **{name: (corpus_cache / file).read_bytes() for name, file in NOT_VIDEOS.items()},
                "png": picture(), "jpeg": picture("JPEG"), "pdf": picture("PDF"), "zip": zipped(clip),
                "text": "Notes for the edit: cut at 0:42, keep the ending.\r\n".encode() * 200,
                "hls playlist": b"#EXTM3U\n#EXT-X-TARGETDURATION:6\n#EXTINF:6.0,\nsegment0.ts\n#EXT-X-ENDLIST\n",
                "srt subtitles": "1\n00:00:01,000 --> 00:00:03,500\nBonjour à tous\n\n".encode(),
                "utf-16 subtitles": "1\r\n00:00:01,000 --> 00:00:03,500\r\nBonjour à tous\r\n".encode("utf-16"),
                "latin-1 subtitles": "1\n00:00:01,000 --> 00:00:03,500\nGrüße aus Köln\n".encode("latin-1"),
                # an HLS audio segment (packed audio): an ID3 tag (its timestamp), then AAC's ADTS frames
                "hls aac segment": b"ID3\x04\x00\x00\x00\x00\x00\x00" + remux(
                    corpus_cache / "muxjs-sintel-captions.ts", tmp_path / "sound.aac", ("audio",), "adts"
                ),
                "mp4 with sound only": (corpus_cache / "pymediainfo-mp4-with-audio.mp4").read_bytes(),
                "webm with sound only": remux(  # as a downloader keeps a video's sound track
                    corpus_cache / "ffprobe-client-input.webm", tmp_path / "opus.webm", ("audio",), container="webm"
                ),
                # its movie box after 75 KB of sound: read from storage, past the bytes peeked as it arrived
                "mp4 with sound only, its boxes last": remux(
                    corpus_cache / "muxjs-sintel-captions.ts", tmp_path / "sintel-sound.mp4", ("audio",)
                ),
                "mpeg-ts with sound only": remux(  # an HLS audio rendition's segment (AAC)
                    corpus_cache / "muxjs-sintel-captions.ts", tmp_path / "sintel-sound.ts", ("audio",), "mpegts"
                ),
                "m2ts with sound only": remux(  # a Blu-ray or AVCHD stream's sound kept alone (AC-3)
                    write_clip(tmp_path / "ac3.mkv", 9, (32, 48), audio_codec="ac3"), tmp_path / "ac3.m2ts",
                    ("audio",), "mpegts", mpegts_m2ts_mode="1",
                ),
            }.items()
        },  # fmt: skip
        "video in another field": (
            lambda: raw_post(url, multipart(("image", "x.png", picture()))), 422, "unexpected_file"
        ),
        "json not json": (lambda: raw_post(url, b"{", "application/json"), 400, "malformed_json"),
        "json a list": (lambda: raw_post(url, b"[]", "application/json"), 400, "malformed_json"),
        "json over 1 MiB": (
            lambda: raw_post(url, b'{"a": "' + b"x" * (MiB + 10) + b'"}', "application/json"), 413, "body_too_large"
        ),
        "json url input not https": (
            lambda: raw_post(url, b'{"video_url": "file:///etc/passwd"}', "application/json"), 422, "invalid_request"
        ),
        "json traversal to another key's upload": (
            lambda: raw_post(url, b'{"input_key": "uploads/carol/../alice/upload_0123456789abcdef01234567"}',
                             "application/json"),
            404,
            "upload_not_found",
        ),  # fmt: skip
        "json outputs key": (
            lambda: raw_post(url, b'{"input_key": "outputs/video_x/1.mp4"}', "application/json"),
            404,
            "upload_not_found",
        ),
        "json key without a slash": (
            lambda: raw_post(url, b'{"input_key": "a"}', "application/json"), 404, "upload_not_found"
        ),
        "json upload id traversal": (
            lambda: raw_post(url, b'{"upload_id": "upload_../../alice"}', "application/json"), 422, "invalid_request"
        ),
        "bad idempotency key": (
            lambda: raw_post(url, multipart(file_part), **{"Idempotency-Key": "a" * 300}),
            400,
            "invalid_idempotency_key",
        ),
        "oversized, declared": (
            lambda: requests.post(
                f"{url}/v1/videos",
                files={"video_reference": ("big.mp4", b"\0" * (UPLOAD_LIMIT + 2 * MiB), "video/mp4")},
                headers=auth(KEY),
                timeout=60,
            ),
            413,
            "upload_too_large",
        ),
        "oversized, streamed": (lambda: raw_post(url, _endless_upload()), 413, "upload_too_large"),
        "job id traversal": (  # the decoded slashes match no route
            lambda: requests.get(f"{url}/v1/videos/..%2F..%2Fjob%3Aanything", headers=auth(KEY), timeout=30),
            404,
            "not_found",
        ),
        "job id of a redis key": (
            lambda: requests.get(f"{url}/v1/videos/x%3A*", headers=auth(KEY), timeout=30), 404, "job_not_found"
        ),
        "list limit text": (
            lambda: requests.get(f"{url}/v1/videos?limit=all", headers=auth(KEY), timeout=30), 422, "invalid_request"
        ),
        "list cursor of nothing": (
            lambda: requests.get(f"{url}/v1/videos?after=video_nope", headers=auth(KEY), timeout=30),
            400,
            "invalid_cursor",
        ),
        "wrong method": (
            lambda: requests.put(f"{url}/v1/videos", headers=auth(KEY), timeout=30), 405, "method_not_allowed"
        ),
        "bad token": (
            lambda: requests.get(f"{url}/v1/videos", headers={"Authorization": "Bearer ' OR 1=1 --"}, timeout=30),
            401,
            "unauthorized",
        ),
    }
    for name, (send, status, code) in requests_.items():
        answered[name] = (send(), status, code)

    for name, (response, status, code) in answered.items():
        assert response.status_code < 500, (name, response.text)
        try:
            assert_problem(response, status, code)
        except AssertionError as error:
            raise AssertionError(f"{name}: {error}") from None
    # Werkzeug's words for a body cut short were "cannot parse beyond State.DATA"
    assert "cut short" in answered["unterminated part"][0].json()["detail"]
    assert answered["mp3 named .mp4"][0].json()["detail"] == "`clip.mp4` is MP3 audio, not a video."
    assert answered["hls playlist named .mp4"][0].json()["detail"] == (
        "`clip.mp4` is an HLS playlist (it only names the video's segments), not a video."
    )
    assert answered["hls aac segment named .mp4"][0].json()["detail"] == "`clip.mp4` is AAC audio, not a video."
    sound_ts = answered["mpeg-ts with sound only named .mp4"][0].json()["detail"]
    assert sound_ts == "`clip.mp4` is an MPEG transport stream with sound only, not a video.", sound_ts
    assert sorted(s3.keys(f"uploads/{KEY}/")) == before  # nothing refused was kept
    print(f"FIGURE bad_input requests: {len(answered)} bad requests -> {len(answered)} x 4xx problem+json, 0 x 5xx")


def _endless_upload():
    """A chunked upload past the limit: no Content-Length, so only counting while it streams can stop it."""
    yield f'--{BOUNDARY}\r\nContent-Disposition: form-data; name="video_reference"; filename="big.mp4"\r\n\r\n'.encode()
    for _ in range(UPLOAD_LIMIT // MiB + 8):
        yield secrets.token_bytes(MiB)
    yield f"\r\n--{BOUNDARY}--\r\n".encode()


@pytest.mark.usefixtures("cpu_worker")
def test_the_service_still_serves_after_the_corpus(rel_api, cpu_worker, clip):
    # runs after the two tests above: the same API processes and the same worker take the next valid job
    job = create(rel_api.url, KEY, clip).json()
    assert wait_all(rel_api.url, KEY, [job["id"]], cpu_worker)[job["id"]]["status"] == "completed"
    counts = status_counts(rel_api.log)
    server_errors = sum(count for status, count in counts.items() if status >= 500)
    assert server_errors == 0, counts
    print(f"FIGURE bad_input 5xx over the API's whole log: {server_errors} of {sum(counts.values())} responses")
