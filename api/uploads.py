"""Receiving videos: a multipart body's file streamed into the blob store under a server-chosen key, its size capped
while it streams, its SHA-256 computed on the way. `POST /v1/uploads` stores a file for later jobs (JSON create names
it by `upload_id`); a multipart `POST /v1/videos` stores its file the same way.
"""

from __future__ import annotations

import hashlib
import logging
from dataclasses import dataclass

from flask import Blueprint, Response, g, jsonify, request
from redis.exceptions import RedisError

from api.auth import admit_caller, owner
from api.body import Capped, check_coding, hold_body_slot
from api.errors import ApiError
from api.multipart import FormField, FormFile, FormReader, boundary_of
from api.ratelimit import limits_of
from api.sniff import PEEK_BYTES, not_a_video
from api.services import services
from storage.blobs import BlobInfo, TooLarge, new_upload_id, upload_key

log = logging.getLogger("vsrq.api.uploads")

blueprint = Blueprint("uploads", __name__)


blueprint.before_request(admit_caller)
blueprint.before_request(check_coding)
blueprint.before_request(hold_body_slot)


# Form overhead on top of the file: boundaries, part headers, the non-file fields.
_FORM_SLACK = 1024 * 1024


@dataclass
class StoredFile:
    field: str
    filename: str
    content_type: str
    upload_id: str
    blob: BlobInfo


@dataclass
class ReceivedForm:
    fields: dict[str, str | None]  # None: the text `null` (`_take`)
    file: StoredFile | None


def _upload_limit() -> int:
    """The caller's upload size limit; a body declared larger than it is refused before a byte is read."""
    limit = limits_of(g.api_key, services().settings).upload_bytes
    if request.content_length is not None and request.content_length > limit + _FORM_SLACK:
        raise ApiError(413, "upload_too_large", f"Uploads are limited to {limit} bytes.")
    return limit


def _form(limit: int, file_fields: frozenset[str]) -> FormReader:
    """The request's form, its bytes counted as they stream (a chunked body declares no length to check first)."""
    body = Capped(request.stream, limit + _FORM_SLACK, f"Uploads are limited to {limit} bytes.")
    settings = services().settings
    return FormReader(body, boundary_of(request.content_type), settings.max_form_field_bytes, file_fields)


def _take(fields: dict[str, str | None], part: FormField) -> None:
    """A form cannot say null: the text `null` stands for it, as JavaScript's FormData writes a null and Swagger UI's
    "Try it out" sends every field whose default is null (null, like empty text, is a field not given). Every field
    takes one value: one sent twice is refused, not half read (`name[]`, a list as OpenAI's SDK sends one, is refused
    as a list when it is read)."""
    if part.name in fields and not part.name.endswith("[]"):
        message = "sent more than once: each field takes one value"
        raise ApiError(
            422,
            "invalid_request",
            f"The form sends `{part.name}` more than once.",
            errors=[{"field": part.name, "code": "duplicate_field", "message": message}],
        )
    fields[part.name] = None if part.value == "null" else part.value


def receive_form(file_fields: frozenset[str]) -> ReceivedForm:
    """Reads the request's form, streaming its one file (in one of `file_fields`) to uploads/{owner}/{upload_id}.

    Whatever goes wrong after the file was stored (a second file, a bad field) deletes it again."""
    limit = _upload_limit()
    blobs = services().blobs
    reader = _form(limit, file_fields)
    fields: dict[str, str | None] = {}
    stored: StoredFile | None = None
    try:
        for part in reader.parts():
            if not isinstance(part, FormFile):
                _take(fields, part)
            elif part.name not in file_fields or stored is not None:
                raise ApiError(
                    422,
                    "unexpected_file",
                    f"Only one file is accepted, in `{'` or `'.join(sorted(file_fields))}`; got `{part.name}`.",
                )
            else:
                if kind := not_a_video(part.stream.peek(PEEK_BYTES)):  # said now, not after the queue's wait
                    name = f"`{part.filename}`" if part.filename else f"The file in `{part.name}`"
                    raise ApiError(422, "input_no_video", f"{name} is {kind}, not a video.")
                upload_id = new_upload_id()
                try:
                    blob = blobs.put(
                        upload_key(owner(), upload_id), part.stream, content_type=part.content_type, max_bytes=limit
                    )
                except TooLarge:
                    raise ApiError(413, "upload_too_large", f"Uploads are limited to {limit} bytes.") from None
                stored = StoredFile(part.name, part.filename, part.content_type, upload_id, blob)
                if blob.size == 0:  # said now: a job would fail on it only after the queue's wait
                    raise ApiError(422, "input_empty", f"The file in `{part.name}` is empty (0 bytes).")
    except BaseException:
        if stored is not None:
            blobs.delete(stored.blob.key)
        raise
    return ReceivedForm(fields, stored)


def hash_form(file_fields: frozenset[str]) -> tuple[dict[str, str | None], str | None]:
    """The form's fields and its file's SHA-256, stored nowhere: enough to fingerprint a repeated request."""
    limit = _upload_limit()
    reader = _form(limit, file_fields)
    fields: dict[str, str | None] = {}
    digest: str | None = None
    for part in reader.parts():
        if not isinstance(part, FormFile):
            _take(fields, part)
        elif part.name in file_fields and digest is None:
            hasher, size = hashlib.sha256(), 0
            while chunk := part.stream.read(1024 * 1024):
                size += len(chunk)
                if size > limit:
                    raise ApiError(413, "upload_too_large", f"Uploads are limited to {limit} bytes.")
                hasher.update(chunk)
            digest = hasher.hexdigest()
    return fields, digest


@blueprint.post("/v1/uploads")
def create_upload() -> tuple[Response, int]:
    """A video stored for later jobs: multipart with the file in `file`."""
    if request.mimetype != "multipart/form-data":  # unlike a create, no JSON body: it would name no file
        raise ApiError(415, "unsupported_media_type", "Send multipart/form-data with the video in the field `file`.")
    form = receive_form(frozenset({"file"}))
    if form.file is None:
        raise ApiError(422, "missing_file", "Send the video in the multipart field `file`.")
    if form.file.filename:  # its jobs' name for it, nothing more: an upload is not failed for it
        svc = services()
        try:
            svc.redis.set(_name_key(form.file.blob.key), form.file.filename, ex=svc.settings.upload_ttl_s)
        except RedisError:
            log.warning("%s: its file name was not kept", form.file.upload_id, exc_info=True)
    return jsonify(upload_object(form.file)), 201


def upload_name(key: str) -> str | None:
    """The file name an upload came with, for a job made from its id (as one made from the file itself shows it);
    kept as long as an upload no job names is (`upload_ttl_s`), so a reused upload's later jobs may go without."""
    name = services().redis.get(_name_key(key))
    return None if name is None else name.decode()


def _name_key(key: str) -> str:
    return f"vsrq:upload-name:{key}"


def upload_object(file: StoredFile) -> dict:
    return {
        "id": file.upload_id,
        "object": "upload",
        "key": file.blob.key,
        "bytes": file.blob.size,
        "sha256": file.blob.sha256,
        "filename": file.filename,
        "content_type": file.content_type,
    }
