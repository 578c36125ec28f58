"""A multipart/form-data body read part by part as it arrives: a file part is a stream the caller consumes (into the
blob store), never buffered whole, in memory or on disk. Werkzeug's own form parsing (`request.files`) would spool
the whole upload to a temporary file first.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import BinaryIO

from werkzeug.exceptions import RequestEntityTooLarge
from werkzeug.http import parse_options_header
from werkzeug.sansio.multipart import NEED_DATA, Data, Epilogue, Field, File, MultipartDecoder, State

from api.errors import ApiError

CHUNK = 256 * 1024
MAX_PARTS = 64
# What the decoder may hold while it looks for the next boundary or the end of a part's headers (a file's data
# streams through it a chunk at a time): a preamble or a header block past this is refused, not buffered.
MAX_BUFFERED = 1024 * 1024


@dataclass
class FormField:
    name: str
    value: str


@dataclass
class FormFile:
    name: str
    filename: str
    content_type: str
    stream: _PartStream  # valid until the next part is read


def boundary_of(content_type: str | None) -> bytes:
    kind, options = parse_options_header(content_type or "")
    if kind != "multipart/form-data" or not options.get("boundary"):
        raise ApiError(415, "unsupported_media_type", "Send multipart/form-data (with a file) or application/json.")
    return options["boundary"].encode()


class FormReader:
    """The parts of one body. A part with a filename under a name that takes no file (not in `file_fields`) is a field
    if it is JSON or text: a browser's FormData sends a Blob with a filename ("blob"), as Swagger UI sends `metadata`
    when the OpenAPI document gives its `encoding` as application/json."""

    def __init__(self, stream: BinaryIO, boundary: bytes, max_field_bytes: int, file_fields: frozenset[str]) -> None:
        self._stream, self._max_field_bytes, self._file_fields = stream, max_field_bytes, file_fields
        self._decoder = MultipartDecoder(boundary, max_parts=MAX_PARTS)
        self._ended = False  # the body's last byte read: the decoder's complaint is then that it was cut short
        self._events = self._pull()

    def _pull(self) -> Iterator[Field | File | Data]:
        while True:
            try:
                event = self._decoder.next_event()
                if event is NEED_DATA:
                    data = self._stream.read(CHUNK)
                    if len(self._decoder.buffer) + len(data) > MAX_BUFFERED:
                        raise ApiError(
                            413,
                            "form_part_too_large",
                            f"A multipart preamble or part header block is larger than {MAX_BUFFERED} bytes.",
                        )
                    self._ended = not data
                    self._decoder.receive_data(data or None)  # None: the body ended
                    continue
            except RequestEntityTooLarge:
                raise ApiError(413, "too_many_parts", f"A form may have at most {MAX_PARTS} parts.") from None
            except ValueError as error:
                # Werkzeug says "cannot parse beyond State.DATA": its state, not what the sender did
                if self._ended and self._decoder.state in (State.PART, State.DATA, State.DATA_START):
                    detail = "The multipart body ended before its closing boundary: the upload was cut short."
                else:
                    detail = f"The multipart body cannot be parsed: {error}"
                raise ApiError(400, "malformed_form", detail) from None
            if isinstance(event, Epilogue):
                return
            if isinstance(event, (Field, File, Data)):
                yield event

    def parts(self) -> Iterator[FormField | FormFile]:
        for event in self._events:
            if isinstance(event, Field):
                yield FormField(event.name, self._field_value(event.name))
            elif isinstance(event, File) and self._textual(event):
                yield FormField(event.name, self._field_value(event.name))
            elif isinstance(event, File):
                stream = _PartStream(self._events)
                yield FormFile(
                    event.name, event.filename, event.headers.get("content-type", "application/octet-stream"), stream
                )
                stream.skip_rest()

    def _textual(self, part: File) -> bool:
        kind = parse_options_header(part.headers.get("content-type", ""))[0]
        return part.name not in self._file_fields and (kind == "application/json" or kind.startswith("text/"))

    def _field_value(self, name: str) -> str:
        value = bytearray()
        for event in self._events:
            value += event.data
            if len(value) > self._max_field_bytes:
                raise ApiError(
                    413, "field_too_large", f"Form field `{name}` is larger than {self._max_field_bytes} bytes."
                )
            if not event.more_data:
                break
        try:
            return value.decode()
        except UnicodeDecodeError:
            raise ApiError(400, "malformed_form", f"Form field `{name}` is not UTF-8 text.") from None


class _PartStream:
    """The bytes of one file part, read on demand from the body."""

    def __init__(self, events: Iterator[Field | File | Data]) -> None:
        self._events, self._buffer, self._done = events, bytearray(), False

    def read(self, size: int = -1) -> bytes:
        self._fill(size)
        if size < 0 or size >= len(self._buffer):
            data, self._buffer = bytes(self._buffer), bytearray()
        else:
            data = bytes(self._buffer[:size])
            del self._buffer[:size]
        return data

    def peek(self, size: int) -> bytes:
        """The next `size` bytes (fewer at the part's end), left to be read."""
        self._fill(size)
        return bytes(self._buffer[:size])

    def _fill(self, size: int) -> None:
        while not self._done and (size < 0 or len(self._buffer) < size):
            event = next(self._events)
            self._buffer += event.data
            self._done = not event.more_data

    def skip_rest(self) -> None:
        while self.read(CHUNK):
            pass
