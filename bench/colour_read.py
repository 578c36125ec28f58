"""How far swscale's 8-bit Y'CbCr -> RGB conversions land from the exact colours, and what each costs a frame.

75 % colour bars in limited-range 8-bit 4:2:0 (BT.601 at 640x480, BT.709 at 1920x1080), converted by PyAV's
reformatter with swscale's default flags (the reader before session 45) and with the exact path the reader takes now
(`worker.media.reader.EXACT_8_BIT`); the worst bar's error in levels of 255 against the float conversion of the stored
values, and milliseconds a frame (median of 20, after one).

    python bench/colour_read.py
"""

from __future__ import annotations

import json
import statistics
from time import perf_counter

import av
import numpy as np
from av.video.reformatter import ColorRange, Colorspace, VideoReformatter

from worker.media.reader import EXACT_8_BIT

# the matrix, its luma weights (Kr, Kb), the size of a source tagged with it
WEIGHTS = {
    "bt601": (Colorspace.ITU601, 0.299, 0.114, (480, 640)),
    "bt709": (Colorspace.ITU709, 0.2126, 0.0722, (1080, 1920)),
}
BARS = np.array([[1, 1, 1], [1, 1, 0], [0, 1, 1], [0, 1, 0], [1, 0, 1], [1, 0, 0], [0, 0, 1], [0, 0, 0]]) * 0.75


def bars_frame(kr: float, kb: float, height: int, width: int) -> tuple[av.VideoFrame, np.ndarray]:
    """The bars stored as 8-bit Y'CbCr 4:2:0, and the RGB their stored values convert to exactly (0-255)."""
    luma = BARS @ [kr, 1 - kr - kb, kb]
    stored = np.round([16 + 219 * luma, 128 + 112 * (BARS[:, 2] - luma) / (1 - kb),
                       128 + 112 * (BARS[:, 0] - luma) / (1 - kr)])  # fmt: skip
    y, cb, cr = (stored[0] - 16) / 219, (stored[1] - 128) / 224, (stored[2] - 128) / 224
    red, blue = y + 2 * (1 - kr) * cr, y + 2 * (1 - kb) * cb
    exact = 255 * np.stack([red, (y - kr * red - kb * blue) / (1 - kr - kb), blue], axis=1)
    frame = av.VideoFrame(width, height, "yuv420p")
    columns = np.repeat(np.arange(8), width // 8)
    for plane, values in zip(frame.planes, stored, strict=True):
        rows = np.zeros((plane.height, plane.line_size), np.uint8)
        rows[:, : plane.width] = values[columns[:: width // plane.width]].astype(np.uint8)
        plane.update(rows)
    return frame, np.clip(exact, 0, 255)


def main() -> None:
    for name, (space, kr, kb, (height, width)) in WEIGHTS.items():
        frame, exact = bars_frame(kr, kb, height, width)
        for flags_name, flags in (("default", None), ("exact", EXACT_8_BIT)):
            reformatter = VideoReformatter()
            convert = lambda: reformatter.reformat(  # noqa: E731
                frame, format="rgb24", src_colorspace=space, src_color_range=ColorRange.MPEG, interpolation=flags
            ).to_ndarray()
            convert()
            times = []
            for _ in range(20):
                started = perf_counter()
                rgb = convert()
                times.append(perf_counter() - started)
            means = [rgb[:, b * width // 8 + 16 : (b + 1) * width // 8 - 16].reshape(-1, 3).mean(0) for b in range(8)]
            error = float(np.abs(np.array(means) - exact).max())
            print(json.dumps({
                "matrix": name, "size": f"{width}x{height}", "flags": flags_name,
                "worst_bar_error": round(error, 2), "ms_a_frame": round(1000 * statistics.median(times), 2),
            }))  # fmt: skip


if __name__ == "__main__":
    main()
