"""Run the whole corpus as tests/test_corpus.py does and write tests/corpus/RESULTS.md (the table and pass count).

    PYTHONPATH=. .venv/bin/python tests/corpus/results.py              # after `make corpus`
    PYTHONPATH=. .venv/bin/python tests/corpus/results.py NAME ...     # run these again, keep the other rows
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

from tests.corpus.check import Outcome, corpus, run

HERE = Path(__file__).resolve().parent
# What the packages reachable from here gave, against issue 20's list (by reading the files with ffprobe).
COVERAGE = """
## What the corpus covers, and what the sources did not give

- Video codecs found: H.264 (MP4, AVI, Matroska, MPEG-TS, a phone's VFR clip), HEVC 8-bit and Main 10 (10-bit,
  puremagic's Matroska file), VP8, VP9 (in AVI and WebM), AV1 (an AVIF image sequence in ISO BMFF, with its alpha
  plane as a second AV1 track), Theora, MPEG-1/2 (program and transport streams, DVD, a bare MPEG-1 elementary
  stream), MPEG-4 Part 2, H.263, Sorenson H.263 (FLV), VP6, WMV1, WMV3, Microsoft RLE (palette), QuickTime Animation
  (RGB), Autodesk FLIC (palette).
  Interlaced: one file, hachoir-sample.ts (a DVB broadcast's MPEG-2, 2 frames, top field first; the one AVCHD file
  is cut to 8 KiB before a decodable frame; tests/field_pictures.py writes the field-coded H.264 (PAFF) that AVCHD
  camcorders record, which no encoder here makes). **Not found**: H.264 4:4:4, 10-bit or interlaced, MJPEG (the
  camera MOV is cut before its frames), ProRes, DNxHD, FFV1.
  The reported Theora 214x160 file was not located; its class (a picture cropped off the left of the coded frame)
  is covered by tests/test_media.py with an H.264 stream that crops 6 columns.
- Containers found: MP4, MOV, ISO BMFF (AVIF sequence), Matroska, WebM, Ogg, AVI, MPEG-TS, MPEG-PS (.mpg), MPEG-1
  elementary stream, FLV, FLIC, 3GPP2, ASF/WMV, RealMedia (audio only). **Not found** playable: M2TS, 3GP, MXF.
- Animated pictures (Pillow's test images): GIF (one with a transparent colour and background disposal), animated
  PNG (frames that blend over the one before, a first frame its demuxer does not flag key), animated WebP (read
  through libwebp: FFmpeg decodes WebP stills only). Soft-telecined film (MPEG-2 pulldown flags) was not found in
  a package: tests/test_deinterlace.py flags a real clip's MPEG-2 as DVD authoring tools do.
- Audio found with video: AAC (incl. a stream running past the last frame, and HLS segments whose audio starts
  apart from the video), MP3, Vorbis (Ogg, whose per-packet times FFmpeg estimates seconds off), Opus, MP2
  (starting 91 ms after the video), WMA2 (ASF packets that overlap, and a first packet that decodes without
  times), PCM; with no video (refused): Opus, FLAC, ALAC, AAC, MP3, Cook. AC-3 only in the cut AVCHD file.
  **Not found**: several audio tracks with languages, E-AC-3.
- Picture: non-square pixels (DVD 8:9, 16:15, 32:27, 64:45; 10:11, 12:11, 80:81, 237:235), odd and unaligned
  sizes (720x405, 320x214, 190x240, 400x170, 388x300, 159x159), variable rate (a phone clip; an AVI with dropped
  frames; Ogg with repeated Theora frames), 187 fps, 1 fps, an attached cover picture next to the video
  (Matroska), several video streams (a cut ASF with three; an AVIF sequence's alpha track), CEA-608 captions
  inside H.264 (not carried: they are not a stream), B-frame MP4s whose edit lists start the media late (puremagic
  test.mp4: 800 of its video's time units, 1024 AAC priming samples).
  Chapters: hachoir-flashmob.mkv's two (one title accented), carried as a QuickTime chapter track and checked
  (mkv-chapter-helper's AV1 samples with four chapters were left out: 284 s and 5,680 frames each).
  **Not found**: rotation side data, empty edits (a track that starts late) in an MP4 source, open GOPs known as
  such, subtitle streams, HDR. tests/test_media.py covers rotation, subtitles, chapters and late starts (early
  and late sound, copied and re-encoded) on generated files.
"""


def kept_rows() -> dict[str, Outcome]:
    """The outcomes RESULTS.md already holds, by file name."""
    if not (HERE / "RESULTS.md").exists():
        return {}
    kept = {}
    for line in (HERE / "RESULTS.md").read_text().splitlines():
        cells = [cell.strip() for cell in line.strip("|").split(" | ")]
        if len(cells) == 5 and cells[0] not in ("file", "---"):
            status, _, detail = cells[3].partition(": ")
            kept[cells[0]] = Outcome(cells[0], status, detail.replace("\\|", "|"), float(cells[4]))
    return kept


def main(only: list[str]) -> int:
    cache, files = corpus()
    files_by_name = {entry["name"]: entry for entry in files}
    kept = kept_rows() if only else {}
    rows = []
    for entry in files:
        if only and entry["name"] not in only and entry["name"] in kept:
            rows.append((entry, kept[entry["name"]]))
            continue
        with tempfile.TemporaryDirectory() as out:
            outcome = run(entry, cache, Path(out))
        print(f"{outcome.status:8} {outcome.seconds:6.1f} s {entry['name']}: {outcome.detail}", flush=True)
        rows.append((entry, outcome))
    passed = sum(o.status == "pass" for _, o in rows)
    refused = sum(o.status == "refused" for _, o in rows)
    failed = [e["name"] for e, o in rows if o.status == "FAIL"]
    known = [name for name in failed if files_by_name[name].get("known_failure")]
    lines = [
        "# The real-world corpus: results",
        "",
        "Generated by `tests/corpus/results.py` (after `make corpus`); `tests/test_corpus.py` checks the same in CI.",
        "Each file goes through the CLI's upscale path (`--model lanczos --scale 2`, x264 `superfast`) and is checked",
        "against what PyAV (FFmpeg's libraries, as ffprobe reads them) says the input declares: every frame at its time,",
        "declared size x 2, display aspect, average rate, every audio stream whole and in sync, subtitles, title, chapters.",
        "",
        f"**{passed} pass, {refused} refused on purpose with their typed code, {len(failed)} fail** of {len(rows)} files"
        + (f" (failing: {', '.join(failed)}; {len(known)} of them known, marked in the manifest)" if failed else "") + ".",
        "",
        "| file | source | what it is | result | seconds |",
        "| --- | --- | --- | --- | --- |",
    ]
    for entry, outcome in rows:
        result = outcome.status if outcome.status == "pass" else f"{outcome.status}: {outcome.detail}"
        result = result.replace("|", "\\|").replace("\n", " ")[:300]
        lines.append(f"| {entry['name']} | {entry['source']} | {entry['about']} | {result} | {outcome.seconds:.1f} |")
    (HERE / "RESULTS.md").write_text("\n".join(lines) + "\n" + COVERAGE)
    print(f"{passed} passed, {refused} refused, {len(failed)} failed")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
