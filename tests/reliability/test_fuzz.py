"""Property tests (hypothesis, derandomized so CI sees the same examples every run) over what parses untrusted input:
the create request's fields (api/schemas.py), the list query, the multipart reader (api/multipart.py) and the media
probe on mutated real MP4s. Each may only succeed or raise its typed error: an `ApiError` with a 4xx status, a pydantic
`ValidationError`, or a media error with a bad-input code; never another exception, never a hang."""

from __future__ import annotations

import io
import time

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import ValidationError

from api.errors import ApiError
from api.multipart import FormFile, FormReader, boundary_of
from api.schemas import (
    GENERATION_ONLY,
    SGLANG_IGNORED,
    URL_FIELDS,
    CreateRequest,
    JobOptions,
    ListQuery,
    UpscaleParams,
    create_request,
)
from worker.errors import PermanentError
from worker.media.errors import BAD_INPUT_CODES
from worker.media.probe import probe
from worker.media.synthetic import write_clip

FUZZ = settings(derandomize=True, database=None, deadline=None, suppress_health_check=list(HealthCheck))
TALLY: dict[str, dict[str, int]] = {}  # test -> outcome -> examples, printed as the figure


def tally(test: str, outcome: str) -> None:
    counts = TALLY.setdefault(test, {})
    counts[outcome] = counts.get(outcome, 0) + 1


def figure(test: str, started: float) -> None:
    counts = TALLY.pop(test, {})
    print(
        f"FIGURE fuzz {test}: {sum(counts.values())} examples in {time.monotonic() - started:.1f} s, "
        f"0 untyped exceptions; outcomes {dict(sorted(counts.items()))}"
    )


# -- request fields ------------------------------------------------------------------------------------------------

NAMES = sorted(
    {*UpscaleParams.model_fields, *JobOptions.model_fields, *SGLANG_IGNORED, *GENERATION_ONLY, *URL_FIELDS}
    | {"upload_id", "input_key", "extra_body", "extra_json", "extra_params", "upscaling_scale", "metadata[a]"}
)
scalars = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(min_value=-(2**70), max_value=2**70),
    st.floats(allow_nan=True, allow_infinity=True),
    st.text(max_size=40),
    st.sampled_from(["2", "2.25", "4", "hd", "1280x720", "0x0", "nan", "1e400", "https://example.com/v.mp4", "{}"]),
)
values = st.recursive(
    scalars,
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=8), inner, max_size=4),
    max_leaves=8,
)
# what a form sends: text, and text that looks like the numbers and sizes the validators parse
NUMBERS = r"-?[0-9]{0,4}(\.[0-9]{0,3})?(e[0-9]+)?|[0-9]+x[0-9]+"
form_values = st.text(max_size=20) | st.from_regex(NUMBERS, fullmatch=True)
# Mostly the fields we know, so that the examples reach their validators (unknown names are refused first).
fields = st.dictionaries(st.sampled_from(NAMES), values | form_values, max_size=8) | st.dictionaries(
    st.text(max_size=12), values, max_size=3
)


@pytest.mark.timeout(120)
def test_create_request_parsing_raises_only_typed_4xx():
    started = time.monotonic()

    @FUZZ
    @given(fields, st.booleans())
    def check(body: dict, references: bool) -> None:
        try:
            assert isinstance(create_request(body, references=references), CreateRequest)
            tally("create_request", "accepted")
        except ApiError as error:
            assert 400 <= error.status < 500 and error.code and error.detail, error
            tally("create_request", f"{error.status} {error.code}")

    check()
    figure("create_request", started)


@pytest.mark.timeout(60)
def test_list_query_parsing_raises_only_validation_errors():
    started = time.monotonic()

    @FUZZ
    @given(st.dictionaries(st.sampled_from(["after", "limit", "order", "status", "x"]), st.text(max_size=20)))
    def check(query: dict[str, str]) -> None:
        try:
            ListQuery.model_validate(query)
            tally("list_query", "accepted")
        except ValidationError:
            tally("list_query", "invalid")

    check()
    figure("list_query", started)


# -- the multipart reader ------------------------------------------------------------------------------------------

BOUNDARY = b"fuzz-boundary"
FILE_FIELDS = frozenset({"video_reference", "input_reference"})  # a create's (api.videos)


def form(parts: list[tuple[str, str | None, str | None, bytes]]) -> bytes:
    body = b""
    for name, filename, kind, content in parts:
        disposition = f'form-data; name="{name}"' + (f'; filename="{filename}"' if filename is not None else "")
        headers = f"Content-Disposition: {disposition}" + (f"\r\nContent-Type: {kind}" if kind else "")
        body += b"--" + BOUNDARY + f"\r\n{headers}\r\n\r\n".encode() + content + b"\r\n"
    return body + b"--" + BOUNDARY + b"--\r\n"


# a file's part under a name that takes none is a field when it is JSON or text (a browser's Blob): both kinds drawn
names = st.sampled_from(sorted(FILE_FIELDS)) | st.text(max_size=10)
kinds = st.sampled_from([None, "application/json", "text/plain; charset=utf-8", "video/mp4"])
parts = st.lists(st.tuples(names, st.none() | st.text(max_size=10), kinds, st.binary(max_size=300)), max_size=5)


@st.composite
def bodies(draw) -> bytes:
    """A well-formed form, then mutated: bytes flipped, cut, spliced, or replaced by noise."""
    body = bytearray(form(draw(parts)))
    for _ in range(draw(st.integers(0, 4))):
        kind = draw(st.sampled_from(["flip", "cut", "splice", "noise"]))
        at = draw(st.integers(0, max(0, len(body) - 1)))
        if kind == "flip" and body:
            body[at] ^= draw(st.integers(1, 255))
        elif kind == "cut":
            del body[at:]
        elif kind == "splice":
            body[at:at] = draw(st.sampled_from([b"\r\n", b"--", b"--" + BOUNDARY, b"\r\n\r\n", b'"', b"\x00"]))
        else:
            body[at:at] = draw(st.binary(max_size=64))
    return bytes(body)


@pytest.mark.timeout(120)
def test_multipart_reader_raises_only_typed_4xx():
    started = time.monotonic()

    @FUZZ
    @given(bodies(), st.integers(1024, 4096))
    def check(body: bytes, max_field_bytes: int) -> None:
        try:
            for part in FormReader(io.BytesIO(body), BOUNDARY, max_field_bytes, FILE_FIELDS).parts():
                if isinstance(part, FormFile):
                    while part.stream.read(97):  # an odd size, so that reads straddle the decoder's events
                        pass
            tally("multipart", "parsed")
        except ApiError as error:
            assert 400 <= error.status < 500 and error.code, error
            tally("multipart", f"{error.status} {error.code}")

    check()

    @FUZZ
    @given(st.text(max_size=80))
    def content_types(content_type: str) -> None:
        try:
            assert boundary_of(content_type)
        except ApiError as error:
            assert (error.status, error.code) == (415, "unsupported_media_type")

    content_types()
    figure("multipart", started)


# -- the media probe -----------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def real_mp4(tmp_path_factory) -> bytes:
    """9 frames of 48x32 H.264 with AAC: every box a real muxer writes (ftyp, mdat, moov with two traks)."""
    return write_clip(tmp_path_factory.mktemp("fuzz") / "clip.mp4", 9, (32, 48), audio_codec="aac").read_bytes()


@st.composite
def mutations(draw, source: bytes) -> bytes:
    data = bytearray(source)
    for _ in range(draw(st.integers(1, 6))):
        kind = draw(st.sampled_from(["flip", "byte", "word", "cut", "duplicate", "zero", "box"]))
        at = draw(st.integers(0, len(data) - 1)) if data else 0
        if not data:
            break
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "byte":
            data[at] = draw(st.integers(0, 255))
        elif kind == "word":  # sizes, counts and offsets in MP4 boxes are big-endian 32-bit words
            data[at : at + 4] = draw(st.sampled_from([0, 1, 0x7FFFFFFF, 0xFFFFFFFF, 8])).to_bytes(4, "big")
        elif kind == "cut":
            del data[at:]
        elif kind == "duplicate":
            end = min(len(data), at + draw(st.integers(1, 2048)))
            data[at:at] = data[at:end]
        elif kind == "zero":
            end = min(len(data), at + draw(st.integers(1, 512)))
            data[at:end] = bytes(end - at)
        else:  # a box's size field: the 4 bytes before one of the box types the demuxer trusts
            tag = draw(st.sampled_from([b"moov", b"trak", b"stbl", b"stsz", b"stco", b"stts", b"avcC", b"mdat"]))
            found = bytes(data).find(tag)
            if found >= 4:
                data[found - 4 : found] = draw(st.integers(0, 2**32 - 1)).to_bytes(4, "big")
    return bytes(data)


@pytest.mark.timeout(180)  # a hang fails here instead of stalling CI
def test_probe_of_mutated_mp4s_raises_only_media_errors(real_mp4, tmp_path):
    started = time.monotonic()
    path = tmp_path / "mutated.mp4"

    @settings(FUZZ, max_examples=150)
    @given(mutations(real_mp4))
    def check(data: bytes) -> None:
        path.write_bytes(data)
        began = time.monotonic()
        try:
            probe(path)
            tally("probe", "probed")
        except PermanentError as error:
            assert error.code in BAD_INPUT_CODES, error
            tally("probe", error.code)
        assert time.monotonic() - began < 10, "the probe took more than 10 s on a 10 kB file"

    check()
    figure("probe", started)
