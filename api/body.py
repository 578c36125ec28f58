"""Request bodies, bounded: in time (the worker paces every read: api/gunicorn_worker.py), in how many one key sends
at once (a slot per body, taken before a byte of it is read), in size as they stream (`capped`), after decompression
(`read_json`) and in JSON depth (`parse_json`, before parsing).

A client too slow or stalled mid-body gets 408 `request_timeout`; a key with all its body slots taken gets 429
`too_many_uploads`; a JSON document nested deeper than `MAX_JSON_DEPTH` gets 400 `json_too_deep`. A JSON body may
come gzip- or deflate-compressed (RFC 9110's Content-Encoding: clients and proxies that compress what they send); an
upload comes as it is (video is compressed already): any other coding gets 415 `unsupported_content_encoding`.
"""

from __future__ import annotations

import json
import re
import zlib
from typing import Any, BinaryIO

from flask import Flask, g, request

from api.errors import ApiError
from api.services import services

# Nothing this API accepts nests deeper than 3 (a create's `extra_body` holding `metadata`); Python's parser recurses
# once per level, and a document 100k levels deep would exhaust its stack.
MAX_JSON_DEPTH = 32
_TOKEN = re.compile(rb'[\[\]{}"\\]')
_QUOTE, _BACKSLASH, _OPEN = ord('"'), ord("\\"), (ord("["), ord("{"))


def too_deep(raw: bytes | str, limit: int = MAX_JSON_DEPTH) -> bool:
    """Whether `raw` nests arrays and objects more than `limit` deep (brackets inside strings do not count); invalid
    JSON gives some answer, and the parser then refuses it. Linear, and stops at the first level too deep."""
    data = raw.encode() if isinstance(raw, str) else raw
    if data.count(b"[") + data.count(b"{") <= limit:
        return False
    depth, in_string, skip = 0, False, -1
    for match in _TOKEN.finditer(data):
        at = match.start()
        char = data[at]
        if at == skip:
            continue
        if in_string:
            if char == _BACKSLASH:
                skip = at + 1  # the escaped character, whatever it is
            elif char == _QUOTE:
                in_string = False
        elif char == _QUOTE:
            in_string = True
        elif char in _OPEN:
            depth += 1
            if depth > limit:
                return True
        elif char != _BACKSLASH:
            depth -= 1
    return False


def parse_json(raw: bytes | str, what: str = "The body") -> Any:
    """`json.loads` once the depth is known to be sane; raises ValueError when `raw` is not JSON."""
    if too_deep(raw):
        raise ApiError(400, "json_too_deep", f"{what} nests more than {MAX_JSON_DEPTH} levels deep.")
    return json.loads(raw)


# zlib's window bits that take a gzip or a zlib header alike: "deflate" in HTTP is zlib's format (RFC 9110 8.4.1.2)
_GZIP_OR_ZLIB = 32 + zlib.MAX_WBITS
JSON_CODINGS = frozenset({"gzip", "x-gzip", "deflate"})


def _has_body() -> bool:
    return bool(request.content_length) or request.headers.get("Transfer-Encoding", "").lower() == "chunked"


def _coding() -> str:
    return request.headers.get("Content-Encoding", "").strip().lower()


def check_coding() -> None:
    """A blueprint's `before_request`, after authentication: a body in a coding this API does not read is refused
    before a byte of it is."""
    coding = _coding()
    if coding in ("", "identity") or not _has_body():
        return
    if request.mimetype != "application/json":
        raise ApiError(
            415,
            "unsupported_content_encoding",
            f"Send the upload as it is, without a Content-Encoding (`{coding}`): video is compressed already.",
        )
    if coding not in JSON_CODINGS:
        raise ApiError(
            415, "unsupported_content_encoding", f"A JSON body may come gzip- or deflate-compressed, not `{coding}`."
        )


def read_json(limit: int) -> bytes:
    """Up to `limit` + 1 bytes of the request's JSON body, decompressed where its Content-Encoding says so: a small
    compressed body that inflates past the limit stops there, and one whose compressed bytes pass it is refused as a
    plain one is (bytes after the compressed stream would otherwise be read, and kept, to the body's end)."""
    if _coding() not in JSON_CODINGS:
        return request.stream.read(limit + 1)
    detail = f"The body is not the {_coding()} data its Content-Encoding says."
    too_large = f"A JSON body is limited to {limit} bytes, compressed or not."
    stream = Capped(request.stream, limit, too_large, "body_too_large")
    inflater, out = zlib.decompressobj(_GZIP_OR_ZLIB), bytearray()
    try:
        while len(out) <= limit and not inflater.eof and (chunk := stream.read(64 * 1024)):
            out += inflater.decompress(chunk, limit + 1 - len(out))
    except zlib.error:
        raise ApiError(400, "malformed_json", detail) from None
    if len(out) <= limit and (not inflater.eof or inflater.unused_data or stream.read(1)):  # cut short, or more after
        raise ApiError(400, "malformed_json", detail)
    return bytes(out)


MAX_JSON_BYTES = 1024 * 1024


def json_object() -> dict[str, Any]:
    """The request's body as a JSON object, at most `MAX_JSON_BYTES`."""
    raw = read_json(MAX_JSON_BYTES)
    if len(raw) > MAX_JSON_BYTES:
        raise ApiError(
            413, "body_too_large", f"A JSON body is limited to {MAX_JSON_BYTES} bytes; send videos as multipart."
        )
    try:
        body = parse_json(raw)
    except ValueError:
        raise ApiError(400, "malformed_json", "The body is not valid JSON.") from None
    if not isinstance(body, dict):
        raise ApiError(400, "malformed_json", "The body must be a JSON object.")
    return body


CLIENT_CLOSED = 499  # nginx's status for a request its client closed: logged and counted, never sent


class TimedInput:
    """`wsgi.input` whose reads that time out (the worker's pacing) answer 408 rather than look like a disconnect,
    and whose connection the client closed answer 499 rather than look like our failure."""

    def __init__(self, stream: BinaryIO) -> None:
        self._stream = stream

    def _call(self, method: str, *args: Any) -> Any:
        try:
            return getattr(self._stream, method)(*args)
        except TimeoutError as error:
            raise ApiError(
                408,
                "request_timeout",
                f"The request body arrived too slowly ({error.strerror or error}); send it again, at a steady pace.",
            ) from None
        except (ConnectionResetError, ConnectionAbortedError, BrokenPipeError):
            # a client that lost its network mid-upload: its own doing, not a 500 with a traceback (nginx's 499)
            raise ApiError(
                CLIENT_CLOSED, "client_disconnected", "The client closed the connection before its body arrived."
            ) from None

    def read(self, *args: Any) -> bytes:
        return self._call("read", *args)

    def readline(self, *args: Any) -> bytes:
        return self._call("readline", *args)

    def readlines(self, *args: Any) -> list[bytes]:
        return self._call("readlines", *args)

    def __iter__(self):
        return iter(self.readline, b"")


class Capped:
    """A body stream that answers 413 once more than `limit` bytes came through it: a chunked body declares no
    length to refuse up front, so its bytes count as they arrive."""

    def __init__(self, stream: BinaryIO, limit: int, detail: str, code: str = "upload_too_large") -> None:
        self._stream, self._left, self._detail, self._code = stream, limit, detail, code

    def read(self, size: int = -1) -> bytes:
        data = self._stream.read(size)
        self._left -= len(data)
        if self._left < 0:
            raise ApiError(413, self._code, self._detail)
        return data


def hold_body_slot() -> None:
    """A blueprint's `before_request`, after authentication: a request with a body takes one of the key's body
    slots until it ends (`register` releases it)."""
    if _has_body():
        svc = services()
        g.body_slot = svc.limiter.body_slot(g.api_key, svc.settings)


def release_body_slot(_: BaseException | None = None) -> None:
    """The request's body slot goes: at its end, or once its body is read where it goes on (a create that waits for
    its job, api.prefer)."""
    if (token := g.pop("body_slot", None)) is not None:
        services().limiter.release_body(g.api_key, token)


def register(app: Flask) -> None:
    inner = app.wsgi_app

    def timed(environ: dict, start_response: Any) -> Any:
        environ["wsgi.input"] = TimedInput(environ["wsgi.input"])
        return inner(environ, start_response)

    app.wsgi_app = timed
    app.teardown_request(release_body_slot)
