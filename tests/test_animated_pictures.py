"""Animated pictures from the web as users bring them: GIF, animated PNG and animated WebP (real files from Pillow's
test images, tests/corpus/manifest.toml; tests/test_corpus.py runs each through the upscale and checks it against
its decoder's reading). FFmpeg decodes GIF and APNG; animated WebP, which it cannot, is read through libwebp."""

from __future__ import annotations

import struct
import zlib
from dataclasses import replace
from pathlib import Path

import av
import numpy as np
import pytest
from PIL import Image, ImageSequence

from worker.media.errors import InputNoVideo, InputTooLarge, OutputTooLarge
from worker.media.limits import Limits
from worker.media.probe import probe
from worker.sr.lanczos import LanczosUpscaler
from worker.sr.request import SRRequest
from worker.upscale import UpscaleOptions, upscale_file

FAST = UpscaleOptions(request=SRRequest(scale=2), preset="ultrafast", crf=0)
WEBP, GIF = "pillow-iss634.webp", "pillow-iss634.gif"  # one animation: the WebP is the GIF made lossless
APNG = "pillow-apng-delay.png"
TRANSPARENT = "the source has transparent pixels ({}): MP4 has no alpha, so they were shown over {}"  # the note
BLACK = "black (background=#RRGGBB names another colour)"


def frames_and_times(path: Path) -> tuple[list[np.ndarray], list[float]]:
    with av.open(str(path)) as container:
        decoded = [(float(f.time), f.to_ndarray(format="rgb24").astype(np.int16)) for f in container.decode(video=0)]
    return [pixels for _, pixels in decoded], [time - decoded[0][0] for time, _ in decoded]


def at_source_size(upscaled: np.ndarray, height: int, width: int) -> np.ndarray:
    """An x2 output frame averaged back over each source pixel's 2x2 block."""
    return upscaled[: 2 * height, : 2 * width].reshape(height, 2, width, 2, 3).mean(axis=(1, 3))


def test_an_animated_webp_comes_back_as_its_gif_twin(corpus_cache, tmp_path):
    """FFmpeg refused the animated WebP as "a still image" (input_no_video). Read by libwebp, it comes back as its GIF
    twin does through FFmpeg: 42 frames at the same times (the first, timed 0 ms, shown 100 ms as browsers and FFmpeg's
    GIF reader show it), the same pictures."""
    info = probe(corpus_cache / WEBP)
    assert (info.format, info.video.codec, info.video.frames, info.audio) == ("webp", "webp", 42, ())
    assert (info.video.width, info.video.height, info.video.cfr) == (245, 245, False)
    assert info.video.duration == pytest.approx(probe(corpus_cache / GIF).video.duration, abs=1e-3)

    results = {name: upscale_file(corpus_cache / name, tmp_path / f"{name}.mp4", LanczosUpscaler(), FAST)
               for name in (WEBP, GIF)}  # fmt: skip
    (webp, webp_times), (gif, gif_times) = (frames_and_times(results[name].output) for name in (WEBP, GIF))
    # a GIF's palette is full-resolution colour, and its output's note says 4:2:0 halves it; Pillow reads any
    # animated WebP as RGBA, its lossy frames' 4:2:0 too: nothing is said of one
    halved = {name: any("the output's is 4:2:0" in note for note in result.notes) for name, result in results.items()}
    assert halved == {GIF: True, WEBP: False}, halved
    assert len(webp) == len(gif) == 42
    assert webp_times == pytest.approx(gif_times, abs=1e-3) and webp_times[1] == pytest.approx(0.1, abs=1e-3)
    assert webp[0].shape == (490, 490, 3)
    assert max(float(np.abs(a - b).mean()) for a, b in zip(webp, gif)) < 1


def test_an_animated_webp_over_a_limit_is_refused_before_it_is_decoded(corpus_cache):
    with pytest.raises(InputTooLarge, match="more than 10 frames"):
        probe(corpus_cache / WEBP, Limits(max_frames=10))
    with pytest.raises(InputTooLarge, match="245x245"):
        probe(corpus_cache / WEBP, Limits(max_pixels=200 * 200))


def test_an_animated_webp_declaring_a_huge_canvas_is_too_large_not_an_internal_error(corpus_cache, tmp_path):
    """The real animation with its canvas declared 16000x16000 (1.5 KB): Pillow refused it as a decompression bomb,
    an error of its own, and the job failed `internal_error`."""
    data = bytearray((corpus_cache / WEBP).read_bytes())
    data[24:30] = (16000 - 1).to_bytes(3, "little") * 2  # VP8X: canvas width - 1, height - 1
    huge = tmp_path / "huge.webp"
    huge.write_bytes(data)
    with pytest.raises(InputTooLarge, match="16000x16000; the limit is 8.3 Mpx"):
        probe(huge)
    with pytest.raises(InputTooLarge, match="canvas is too large to decode"):
        probe(huge, Limits(max_pixels=None))


@pytest.mark.parametrize("name", [GIF, APNG])
def test_an_animation_declaring_a_huge_canvas_is_too_large_before_it_is_decoded(corpus_cache, tmp_path, name):
    """The real animation with its canvas declared 65535x65535: FFmpeg's decoder refused the GIF's as bad data
    (input_corrupt: "cannot be read to the end (Invalid argument)"), its demuxer took the APNG for a still PNG
    (input_no_video). Neither told the user the file is too large, nor what the limit is."""
    data = bytearray((corpus_cache / name).read_bytes())
    if name == GIF:
        data[6:10] = struct.pack("<HH", 65535, 65535)  # the logical screen
    else:
        data[16:24] = struct.pack(">II", 65535, 65535)  # IHDR's size, then its CRC
        data[29:33] = struct.pack(">I", zlib.crc32(data[12:29]))
    huge = tmp_path / f"huge-{name}"
    huge.write_bytes(data)
    with pytest.raises(InputTooLarge, match=f"65535x65535; the limit is {Limits().max_pixels / 1e6:.1f} Mpx"):
        probe(huge)


@pytest.mark.parametrize("name", [GIF, APNG, WEBP])
def test_an_animation_over_a_limit_is_refused_before_its_frames_are_read(corpus_cache, tmp_path, name):
    """Every frame was read before the output's limits refused the job (each WebP frame decoded on its canvas: minutes
    for a few thousand on a 4K one, in a file of 200 KB), or before the count passed max_frames (each APNG keyframe
    decoded on the way). What the file declares refuses it first: the job's heartbeat, called for each frame read,
    is never called."""
    source = corpus_cache / name
    video = probe(source).video
    heard = []

    def alive() -> bool:
        heard.append(True)
        return False

    size = LanczosUpscaler().output_size(video.height, video.width, FAST.request.scale)
    cost = Limits.none().check_output(*size, video.frames)
    over = replace(FAST, limits=Limits(max_output_megapixel_frames=cost * 0.99))
    with pytest.raises(OutputTooLarge, match=f"{video.frames} frames of {size[1]}x{size[0]}"):
        upscale_file(source, tmp_path / "refused.mp4", LanczosUpscaler(), over, cancelled=alive)
    assert not heard
    with pytest.raises(InputTooLarge, match=f"more than {video.frames - 1} frames"):
        probe(source, Limits(max_frames=video.frames - 1), alive)
    assert not heard


def test_a_still_webp_is_still_refused_as_a_picture(corpus_cache, tmp_path):
    still = tmp_path / "still.webp"
    with Image.open(corpus_cache / GIF) as gif:
        gif.convert("RGB").save(still, "WEBP")
    with pytest.raises(InputNoVideo, match="still image"):
        probe(still)


def test_transparent_pixels_come_out_black_and_the_notes_say_so(corpus_cache, tmp_path):
    """MP4 has no alpha. Dropped, a GIF's transparent pixels showed the colour of its transparent palette entry (this
    file's: white, 253 levels measured in the output) and an animated PNG's whatever its encoder left under them;
    shown over black, they are black, every other pixel as Pillow composites the frame over black, and the notes say
    how many frames had any. FFmpeg decodes every GIF with an alpha channel: an opaque one gets no note; nor does a
    frame transparent everywhere (taken as an alpha channel left unused: test_reader)."""
    for name, frames in (
        ("pillow-dispose_bgnd_transparency.gif", "every frame"),
        ("pillow-apng-dispose_op_background_region.png", "1 of its 3 frames"),
    ):
        output = tmp_path / f"{name}.mp4"
        result = upscale_file(corpus_cache / name, output, LanczosUpscaler(), FAST)
        assert TRANSPARENT.format(frames, BLACK) in result.notes, result.notes
        with Image.open(corpus_cache / name) as image:
            pictures = [np.asarray(frame.convert("RGBA")).astype(np.float64) for frame in ImageSequence.Iterator(image)]
        pictures = pictures[-len(frames_and_times(output)[0]):]  # Pillow counts an APNG's default image as a frame
        for picture, upscaled in zip(pictures, frames_and_times(output)[0], strict=True):
            height, width = picture.shape[:2]
            shown = at_source_size(upscaled, height, width)
            over_black, transparent = picture[..., :3] * picture[..., 3:] / 255, picture[..., 3] == 0
            assert np.abs(shown - over_black).mean() < 12  # 4:2:0 chroma at the edges of a 38x32 picture
            assert not transparent.any() or shown[transparent].mean() < 16
    result = upscale_file(corpus_cache / "pillow-chi.gif", tmp_path / "opaque.mp4", LanczosUpscaler(), FAST)
    assert not any("transparent" in note for note in result.notes), result.notes


def test_transparent_pixels_come_out_over_the_background_the_job_names(corpus_cache, tmp_path):
    """Over black, dark line art on a transparent page (gdk-pixbuf's aero.gif: a paper plane's dark outline) all but
    vanished; `background` names what is behind it instead, every pixel as Pillow composites the frame over it."""
    name = "pillow-dispose_bgnd_transparency.gif"
    white = UpscaleOptions(request=SRRequest(scale=2), preset="ultrafast", crf=0, background="#ffffff")
    result = upscale_file(corpus_cache / name, tmp_path / "white.mp4", LanczosUpscaler(), white)
    assert TRANSPARENT.format("every frame", "#ffffff") in result.notes, result.notes
    with Image.open(corpus_cache / name) as image:
        pictures = [np.asarray(frame.convert("RGBA")).astype(np.float64) for frame in ImageSequence.Iterator(image)]
    for picture, upscaled in zip(pictures, frames_and_times(result.output)[0], strict=True):
        shown = at_source_size(upscaled, *picture.shape[:2])
        alpha = picture[..., 3:] / 255
        over_white, transparent = picture[..., :3] * alpha + 255 * (1 - alpha), picture[..., 3] == 0
        assert np.abs(shown - over_white).mean() < 12  # 4:2:0 chroma at the edges of a 38x32 picture
        assert transparent.any() and shown[transparent].mean() > 239


def test_an_animation_that_starts_blank_starts_black(corpus_cache, tmp_path):
    """A sticker that fades in starts with a frame transparent everywhere. Taken for an alpha channel left unused
    (as in 32-bit AVI), it showed the colour stored under it, this GIF's transparent palette entry: a white flash
    before frames shown over black. In the codecs made for the web it is a blank frame: black, like the
    transparent pixels after it; an animated PNG's last frame, emptied by its disposal, likewise."""
    with Image.open(corpus_cache / "pillow-dispose_bgnd_transparency.gif") as image:
        frames = [frame.convert("RGBA") for frame in ImageSequence.Iterator(image)]
    blank = tmp_path / "fades-in.gif"
    Image.new("RGBA", frames[0].size).save(blank, save_all=True, append_images=frames, duration=100, disposal=2)
    with av.open(str(blank)) as container:  # stored under it: the palette's transparent entry, white
        first = next(container.decode(video=0)).to_ndarray(format="rgba")
    assert first[..., 3].max() == 0 and first[..., :3].min() == 255

    result = upscale_file(blank, tmp_path / "fades-in.mp4", LanczosUpscaler(), FAST)
    assert TRANSPARENT.format("every frame", BLACK) in result.notes, result.notes
    assert frames_and_times(result.output)[0][0].max() <= 16  # x264 at CRF 0 from 4:2:0: black, not white

    emptied = "pillow-apng-dispose_op_background.png"  # two opaque frames, the last one transparent everywhere
    result = upscale_file(corpus_cache / emptied, tmp_path / "emptied.mp4", LanczosUpscaler(), FAST)
    assert TRANSPARENT.format("1 of its 3 frames", BLACK) in result.notes, result.notes


@pytest.mark.parametrize("codec", ["libvpx-vp9", "libvpx"])
def test_a_transparent_webm_sticker_keeps_its_alpha(corpus_cache, tmp_path, codec):
    """Transparent web videos and Telegram's video stickers are WebM with an alpha channel beside each VP9 (or VP8)
    picture, made with `-pix_fmt yuva420p` as here from a real transparent GIF. FFmpeg's own decoders drop it: the
    transparent pixels showed the colour stored under them (this GIF's: white). Read with libvpx they are black, as
    the GIF's own are, and the notes say so."""
    name = "pillow-dispose_bgnd_transparency.gif"
    with Image.open(corpus_cache / name) as image:
        pictures = [np.asarray(frame.convert("RGBA")) for frame in ImageSequence.Iterator(image)]
    sticker = tmp_path / f"{codec}.webm"
    with av.open(str(sticker), "w") as container:
        stream = container.add_stream(codec, rate=10)
        stream.height, stream.width = pictures[0].shape[:2]
        stream.pix_fmt = "yuva420p"
        stream.options = {"auto-alt-ref": "0"}  # libvpx's VP8 encodes no alpha with alternate reference frames
        for picture in pictures:
            container.mux(stream.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(picture), format="rgba")))
        container.mux(stream.encode())
    info = probe(sticker)
    assert info.video.pix_fmt == "yuv420p"  # as ffprobe reads it: the alpha is not in the codec's picture
    assert info.video.alpha_beside and "its alpha beside each picture" in info.describe()[1]

    result = upscale_file(sticker, tmp_path / f"{codec}.mp4", LanczosUpscaler(), FAST)
    assert TRANSPARENT.format("every frame", BLACK) in result.notes, result.notes
    for picture, upscaled in zip(pictures, frames_and_times(result.output)[0], strict=True):
        height, width = picture.shape[:2]
        shown = at_source_size(upscaled, height, width)
        transparent = picture[..., 3] == 0
        assert transparent.any() and shown[transparent].mean() < 16, shown[transparent].mean()
        over_black = picture[..., :3] * (picture[..., 3:] / 255)
        assert np.abs(shown - over_black).mean() < 16  # two lossy codecs and 4:2:0 chroma on a 38x32 picture


def test_an_animated_avif_takes_its_alpha_from_its_alpha_track(corpus_cache, tmp_path):
    """An animated AVIF keeps its transparency in a track of its own (libavif, which Pillow writes with here from a
    real transparent GIF, and GPAC make it so). FFmpeg reads that track as one more video stream: the transparent
    pixels showed the colour stored under them (this GIF's: white), and the notes called the alpha a video stream
    left out. Its alpha now comes from that track: the transparent pixels are black, as the GIF's own are."""
    name = "pillow-dispose_bgnd_transparency.gif"
    with Image.open(corpus_cache / name) as image:
        pictures = [np.array(frame.convert("RGBA")) for frame in ImageSequence.Iterator(image)]
    for picture in pictures:  # stored under the transparent pixels: white, as FFmpeg reads this GIF's
        picture[picture[..., 3] == 0, :3] = 255
    animation = tmp_path / "sticker.avif"
    first, *rest = (Image.fromarray(picture) for picture in pictures)
    first.save(animation, save_all=True, append_images=rest, duration=100, quality=90)
    pictures = [picture.astype(np.float64) for picture in pictures]
    info = probe(animation)
    with av.open(str(animation)) as container:  # the colour track alone: white under the transparent pixels
        colour = next(container.decode(container.streams[info.video.index])).to_ndarray(format="rgb24")
    assert colour[pictures[0][..., 3] == 0].mean() > 240
    assert info.video.frames == len(pictures) and info.video.alpha_index is not None
    assert info.video.alpha_index not in [other.index for other in info.other_video]
    assert f"its alpha in video #{info.video.alpha_index}" in info.describe()[1]

    result = upscale_file(animation, tmp_path / "sticker.mp4", LanczosUpscaler(), FAST)
    assert TRANSPARENT.format("every frame", BLACK) in result.notes, result.notes
    assert not any(f"#{info.video.alpha_index}" in note for note in result.notes), result.notes
    for picture, upscaled in zip(pictures, frames_and_times(result.output)[0], strict=True):
        shown = at_source_size(upscaled, *picture.shape[:2])
        transparent = picture[..., 3] == 0
        assert transparent.any() and shown[transparent].mean() < 16, shown[transparent].mean()
        assert np.abs(shown - picture[..., :3] * (picture[..., 3:] / 255)).mean() < 16


def test_a_long_walk_over_an_animation_s_blocks_beats_the_job_s_heart(tmp_path):
    """What an animation declares is counted by walking its blocks in Python: a hostile GIF of millions of 1-byte
    blocks (9 MiB here; 16 GiB are allowed) kept the probe walking with no heartbeat, so the job's lease could run
    out and another worker walk it again. The walk calls the job's `alive` as it goes, and a cancel stops it."""
    from worker.errors import Cancelled
    from worker.media import animation

    image = b"\x2c" + struct.pack("<HHHHB", 0, 0, 8, 8, 0) + b"\x02" + b"\x01\x00" * (9 << 19) + b"\x00"
    path = tmp_path / "blocks.gif"
    path.write_bytes(b"GIF89a" + struct.pack("<HHBBB", 8, 8, 0, 0, 0) + image + b"\x3b")
    heard = []
    assert animation.declared(path, lambda: heard.append(True) or False) == (8, 8, 1) and heard
    with pytest.raises(Cancelled):
        animation.declared(path, lambda: True)
