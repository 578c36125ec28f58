"""A decoded frame's side data as PyAV maps it, where PyAV can. Its map names each entry by a member of its `Type`,
and FFmpeg 8 attaches types PyAV 18 has none for (the view id on every frame of an MV-HEVC clip: an iPhone's or a
Vision Pro's spatial video): building the map then raises ValueError, for the whole frame."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import av
from av.sidedata.sidedata import Type as SideData

__all__ = ["SideData", "side_data"]


def side_data(frame: av.VideoFrame) -> Mapping[SideData, Any] | None:
    """`frame.side_data`, or None where it holds a type PyAV cannot name."""
    try:
        return frame.side_data
    except ValueError:
        return None
