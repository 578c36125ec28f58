"""Receiving videos: a multipart body's file streamed into the blob store under a server-chosen key, its size capped
while it streams, its SHA-256 computed on the way. `POST /v1/uploads` stores a file for later jobs (JSON create names
it by `upload_id`); a multipart `POST /v1/videos` stores its file the same way.

A file too large to send in one go comes in parts, as OpenAI's Uploads API takes one (its SDK's
`uploads.upload_file_chunked`): `POST /v1/uploads` as JSON declares it, `/parts` takes each part (a dropped
connection costs that part only), `/complete` joins them in the order named, `/cancel` drops them
(storage.uploads holds the upload's state).
"""

from __future__ import annotations

import hashlib
import logging
import time
from dataclasses import dataclass, replace
from typing import TypeVar

from flask import Blueprint, Response, g, jsonify, request
from pydantic import BaseModel, ValidationError
from redis.exceptions import RedisError

from api.auth import admit_caller, owner
from api.body import Capped, check_coding, hold_body_slot, json_object
from api.errors import ApiError, field_errors
from api.multipart import FormField, FormFile, FormReader, boundary_of
from api.ratelimit import limits_of
from api.schemas import CompleteUpload, DeclareUpload
from api.sniff import PEEK_BYTES, without_video, not_a_video
from api.services import services
from storage.blobs import BlobInfo, BlobNotFound, TooLarge, new_upload_id, read_at, upload_key
from storage.uploads import (
    PART_MAX_BYTES, NotPending, PartRefused, UploadNotFound, UploadRecord, UploadStatus, new_part_id,
    part_key,
)  # fmt: skip

log = logging.getLogger("vsrq.api.uploads")

blueprint = Blueprint("uploads", __name__)


blueprint.before_request(admit_caller)
blueprint.before_request(check_coding)
blueprint.before_request(hold_body_slot)


# Form overhead on top of the file: boundaries, part headers, the non-file fields.
_FORM_SLACK = 1024 * 1024
# How long a completion sent again waits for the one still joining the upload's parts (a dead one's hold lapses first)
WAIT_FOR_COMPLETION_S = 60


@dataclass
class StoredFile:
    field: str
    filename: str
    content_type: str
    id: str  # the upload's, or the part's
    blob: BlobInfo


@dataclass
class ReceivedForm:
    fields: dict[str, str | None]  # None: the text `null` (`_take`)
    file: StoredFile | None


def _upload_limit() -> int:
    """The caller's upload size limit; a body declared larger than it is refused before a byte is read."""
    limit = limits_of(g.api_key, services().settings).upload_bytes
    _check_declared(limit, _too_large(limit))
    return limit


def _too_large(limit: int) -> str:
    return f"Uploads are limited to {limit} bytes."


def _check_declared(limit: int, message: str) -> None:
    if request.content_length is not None and request.content_length > limit + _FORM_SLACK:
        raise ApiError(413, "upload_too_large", message)


def _form(limit: int, file_fields: frozenset[str], message: str | None = None) -> FormReader:
    """The request's form, its bytes counted as they stream (a chunked body declares no length to check first)."""
    body = Capped(request.stream, limit + _FORM_SLACK, message or _too_large(limit))
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


def receive_form(file_fields: frozenset[str], *, part_of: str | None = None) -> ReceivedForm:
    """Reads the request's form, streaming its one file (in one of `file_fields`) to uploads/{owner}/{upload_id}, or
    as a part of the upload `part_of` (its id then the part's).

    Whatever goes wrong after the file was stored (a second file, a bad field) deletes it again."""
    if part_of is None:
        limit, too_large = _upload_limit(), None
    else:
        limit, too_large = PART_MAX_BYTES, f"A part is limited to {PART_MAX_BYTES} bytes (64 MiB)."
        _check_declared(limit, too_large)
    blobs = services().blobs
    reader = _form(limit, file_fields, too_large)
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
                head = part.stream.peek(PEEK_BYTES) if part_of is None else b""
                name = f"`{part.filename}`" if part.filename else f"The file in `{part.name}`"
                if kind := not_a_video(head):  # said now, not after the queue's wait
                    raise ApiError(422, "input_no_video", f"{name} is {kind}, not a video.")
                stored_id = new_upload_id() if part_of is None else new_part_id()
                key = upload_key(owner(), stored_id) if part_of is None else part_key(owner(), part_of, stored_id)
                try:
                    blob = blobs.put(key, part.stream, content_type=part.content_type, max_bytes=limit)
                except TooLarge:
                    raise ApiError(413, "upload_too_large", too_large or _too_large(limit)) from None
                stored = StoredFile(part.name, part.filename, part.content_type, stored_id, blob)
                if blob.size == 0:  # said now: a job would fail on it only after the queue's wait
                    raise ApiError(422, "input_empty", f"The file in `{part.name}` is empty (0 bytes).")
                if part_of is None:
                    _refuse_without_video(blob, head, name)
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
                    raise ApiError(413, "upload_too_large", _too_large(limit))
                hasher.update(chunk)
            digest = hasher.hexdigest()
    return fields, digest


@blueprint.post("/v1/uploads")
def create_upload() -> tuple[Response, int]:
    """A video stored for later jobs: multipart with the file in `file`; or, as JSON, an upload declared to come in
    parts (OpenAI's `uploads.create`)."""
    if request.mimetype == "application/json":
        return _declare_upload()
    if request.mimetype != "multipart/form-data":
        raise ApiError(
            415,
            "unsupported_media_type",
            "Send multipart/form-data with the video in the field `file`, or JSON declaring an upload in parts.",
        )
    form = receive_form(frozenset({"file"}))
    if form.file is None:
        raise ApiError(422, "missing_file", "Send the video in the multipart field `file`.")
    svc, file = services(), form.file
    try:
        if file.filename:  # its jobs' name for it, nothing more: an upload is not failed for it
            svc.redis.set(_name_key(file.blob.key), file.filename, ex=svc.settings.upload_ttl_s)
        record = svc.uploads.record_whole(
            file.id, owner(), filename=file.filename, size=file.blob.size, mime_type=file.content_type,
            sha256=file.blob.sha256,
        )  # fmt: skip
    except RedisError:  # the file is stored: a job may name it, only its name and GET /v1/uploads/{id} are lost
        log.warning("%s: its record was not kept", file.id, exc_info=True)
        record = svc.uploads.unrecorded(file.id, owner(), file.filename, file.blob, file.content_type)
    return jsonify(upload_view(record)), 201


def upload_name(key: str) -> str | None:
    """The file name an upload came with, for a job made from its id (as one made from the file itself shows it);
    kept as long as an upload no job names is (`upload_ttl_s`), so a reused upload's later jobs may go without."""
    name = services().redis.get(_name_key(key))
    return None if name is None else name.decode()


def _name_key(key: str) -> str:
    return f"vsrq:upload-name:{key}"


def upload_view(record: UploadRecord) -> dict:
    """OpenAI's Upload object, with ours: where it is stored (`key`), its `sha256`, the bytes received so far."""
    completed = record.status is UploadStatus.COMPLETED
    file = {
        "id": record.id,  # what `upload_id` or `input_reference.file_id` names
        "object": "file",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "filename": record.filename,
        "purpose": record.purpose or "user_data",
        "status": "processed",
    }
    return {
        "id": record.id,
        "object": "upload",
        "bytes": record.bytes,
        "created_at": record.created_at,
        "expires_at": record.expires_at,
        "filename": record.filename,
        "purpose": record.purpose or "user_data",
        # OpenAI's statuses have no step between pending and completed: one being joined is still pending
        "status": UploadStatus.PENDING if record.status is UploadStatus.COMPLETING else record.status,
        "file": file if completed else None,
        "key": upload_key(record.owner, record.id) if completed else None,
        "sha256": record.sha256,
        "content_type": record.mime_type,
        "received_bytes": record.bytes if completed else record.received,
        "part_ids": (record.part_ids or []) if completed else sorted(record.parts),
    }


Asked = TypeVar("Asked", bound=BaseModel)


def _validated(model: type[Asked]) -> Asked:
    try:
        return model.model_validate(json_object())
    except ValidationError as error:
        raise ApiError(422, "invalid_request", "The request has invalid fields: see `errors`.",
                       errors=field_errors(error)) from None  # fmt: skip


def _declare_upload() -> tuple[Response, int]:
    declared = _validated(DeclareUpload)
    limit = limits_of(g.api_key, services().settings).upload_bytes
    if declared.bytes > limit:
        raise ApiError(413, "upload_too_large", _too_large(limit))
    record = services().uploads.create(
        new_upload_id(), owner(), filename=declared.filename, size=declared.bytes, mime_type=declared.mime_type,
        purpose=declared.purpose,
    )  # fmt: skip
    return jsonify(upload_view(record)), 201


def _pending(upload_id: str) -> UploadRecord:
    """The caller's upload, which must still take parts (refused before its part's body is read)."""
    record = _record(upload_id)
    if record.status is not UploadStatus.PENDING:
        raise _not_pending(upload_id, record.status)
    return record


def _record(upload_id: str) -> UploadRecord:
    try:
        return services().uploads.get(upload_id, owner())
    except UploadNotFound:
        raise no_such_upload() from None


def no_such_upload() -> ApiError:
    """Missing, or another key's: the same answer."""
    return ApiError(404, "upload_not_found", "No such upload.")


_WHAT_NOW = {
    UploadStatus.COMPLETED: "name it in a job as `upload_id`",
    UploadStatus.CANCELLED: "declare a new upload to send the file again",
    UploadStatus.EXPIRED: "declare a new upload to send the file again",
}


def _not_pending(upload_id: str, status: UploadStatus) -> ApiError:
    if status is UploadStatus.COMPLETING:  # a retry may succeed: OpenAI's SDK retries it after Retry-After
        return ApiError(409, "upload_completing", f"Upload `{upload_id}` is being completed: its parts are joined.",
                        headers={"Retry-After": "5"})  # fmt: skip
    return ApiError(409, f"upload_{status}", f"Upload `{upload_id}` is {status}: {_WHAT_NOW[status]}.")


@blueprint.get("/v1/uploads/<upload_id>")
def get_upload(upload_id: str) -> Response:
    record = _record(upload_id)
    if record.status is UploadStatus.COMPLETED and not services().blobs.exists(upload_key(record.owner, record.id)):
        record = replace(record, status=UploadStatus.EXPIRED)  # its file deleted: no job named it within its TTL
    return jsonify(upload_view(record))


@blueprint.post("/v1/uploads/<upload_id>/parts")
def add_part(upload_id: str) -> tuple[Response, int]:
    """One part of an upload in parts, multipart in `data` (OpenAI's `uploads.parts.create`), at most 64 MiB."""
    _pending(upload_id)
    if request.mimetype != "multipart/form-data":
        raise ApiError(415, "unsupported_media_type", "Send multipart/form-data with the part in the field `data`.")
    form = receive_form(frozenset({"data"}), part_of=upload_id)
    if form.file is None:
        raise ApiError(422, "missing_file", "Send the part in the multipart field `data`.")
    part = form.file
    try:
        created = services().uploads.add_part(upload_id, part.id, part.blob.size)
    except BaseException as error:
        services().blobs.delete(part.blob.key)
        if isinstance(error, PartRefused):
            raise ApiError(413 if error.code == "upload_too_large" else 422, error.code, error.message) from None
        if isinstance(error, NotPending):
            raise _not_pending(upload_id, error.status) from None
        if isinstance(error, UploadNotFound):
            raise no_such_upload() from None
        raise
    view = {"id": part.id, "object": "upload.part", "created_at": created, "upload_id": upload_id,
            "bytes": part.blob.size, "sha256": part.blob.sha256}  # fmt: skip
    return jsonify(view), 201


@blueprint.post("/v1/uploads/<upload_id>/complete")
def complete_upload(upload_id: str) -> Response:
    """Joins the parts in the order `part_ids` names them into the upload's one file (OpenAI's `uploads.complete`).
    Completing it again with the same parts answers it again (a retry whose first answer was lost)."""
    asked, store = _validated(CompleteUpload), services().uploads
    record = _completing_elsewhere(upload_id)
    if record.status is UploadStatus.COMPLETED and record.part_ids == asked.part_ids:
        if asked.md5 is not None:
            _check_md5(record, asked.md5)
        return jsonify(upload_view(record))
    try:
        token = store.begin_complete(upload_id)
    except NotPending as error:
        raise _not_pending(upload_id, error.status) from None
    try:
        with store.holding(upload_id, token):  # no other completion while this one lives, however long it joins
            record = store.get(upload_id, owner())  # its parts, which no request adds to meanwhile
            sha256 = _join(record, asked)
    except BaseException:
        store.reopen(upload_id, token)
        raise
    if not store.completed(upload_id, token, asked.part_ids, sha256):  # its hold lapsed: another completion runs
        raise _not_pending(upload_id, UploadStatus.COMPLETING)
    svc = services()
    try:
        svc.redis.set(_name_key(upload_key(owner(), upload_id)), record.filename, ex=svc.settings.upload_ttl_s)
    except RedisError:
        log.warning("%s: its file name was not kept", upload_id, exc_info=True)
    _drop_parts(upload_id)
    return jsonify(upload_view(store.get(upload_id, owner())))


def _completing_elsewhere(upload_id: str) -> UploadRecord:
    """The upload, once no other request is joining its parts: a completion retried while the first still runs
    (OpenAI's SDK gives up on its answer after its timeout) waits for it, then answers what it did. One whose process
    died reads pending once its hold lapses."""
    deadline = time.monotonic() + WAIT_FOR_COMPLETION_S
    while (record := _record(upload_id)).status is UploadStatus.COMPLETING and time.monotonic() < deadline:
        time.sleep(0.2)
    return record


def _check_md5(record: UploadRecord, md5: str) -> None:
    """Refuses an `md5` that is not the completed upload's file's."""
    found, _ = _digests(upload_key(record.owner, record.id))
    if found != md5.lower():
        raise _md5_refused(found, md5)


def _digests(key: str) -> tuple[str, str]:
    """A stored file's MD5 and SHA-256, read once."""
    md5, sha256 = hashlib.md5(usedforsecurity=False), hashlib.sha256()
    with services().blobs.open(key) as stored:
        while chunk := stored.read(8 * 1024 * 1024):
            md5.update(chunk)
            sha256.update(chunk)
    return md5.hexdigest(), sha256.hexdigest()


def _md5_refused(found: str, asked: str) -> ApiError:
    message = f"The parts joined have MD5 {found}, not {asked}."
    return ApiError(422, "md5_mismatch", message, errors=_about("md5", "md5_mismatch", message))


def _join(record: UploadRecord, asked: CompleteUpload) -> str | None:
    """Writes the named parts, in order, as the upload's file; its SHA-256 where it was read. Refuses parts that do
    not make the declared file, a file that is no video, an `md5` that is not its own: the file is then not kept."""
    unknown = [part for part in asked.part_ids if part not in record.parts]
    repeated = len(set(asked.part_ids)) != len(asked.part_ids)
    if unknown or repeated:
        message = f"Upload `{record.id}` has no part {', '.join(unknown)}." if unknown else "A part is named twice."
        raise ApiError(422, "invalid_parts", message, errors=_about("part_ids", "invalid_parts", message))
    total = sum(record.parts[part] for part in asked.part_ids)
    if total != record.bytes:
        message = f"The parts named hold {total} bytes; the upload declared {record.bytes}."
        raise ApiError(422, "upload_incomplete", message, errors=_about("part_ids", "upload_incomplete", message))
    blobs = services().blobs
    sources = [part_key(record.owner, record.id, part) for part in asked.part_ids]
    head = _first_bytes(sources, [record.parts[part] for part in asked.part_ids], PEEK_BYTES)
    if kind := not_a_video(head):
        raise ApiError(422, "input_no_video", f"`{record.filename}` is {kind}, not a video.")
    try:
        blob = blobs.join(upload_key(record.owner, record.id), sources, content_type=record.mime_type)
    except BlobNotFound as gone:  # swept as the upload neared its expiry
        message = f"A part of upload `{record.id}` is no longer stored ({gone}): send it again."
        raise ApiError(422, "invalid_parts", message, errors=_about("part_ids", "invalid_parts", message)) from None
    try:  # the file is there for a job to name only once the upload is completed
        _refuse_without_video(blob, head, f"`{record.filename}`")
        if asked.md5 is None:
            return blob.sha256  # None where storage joined the parts itself: the worker hashes what it downloads
        md5, sha256 = _digests(blob.key)
        if md5 != asked.md5.lower():
            raise _md5_refused(md5, asked.md5)
        return sha256
    except BaseException:
        blobs.delete(blob.key)
        raise


def _refuse_without_video(blob: BlobInfo, head: bytes, name: str) -> None:
    """Refuses a stored MP4, WebM or Matroska file whose tracks are all sound (or text): its movie box may come after
    its media data, so it is read from storage where `head` (the file's first bytes) ends before it."""
    if kind := without_video(read_at(services().blobs, blob, head), blob.size):
        raise ApiError(422, "input_no_video", f"{name} is {kind}, not a video.")


def _first_bytes(keys: list[str], sizes: list[int], count: int) -> bytes:
    """The first `count` bytes of the blobs `keys` (of `sizes`) joined."""
    data = b""
    for key, size in zip(keys, sizes, strict=True):
        if (wanted := min(size, count - len(data))) <= 0:
            break
        with services().blobs.open(key, byte_range=(0, wanted - 1)) as stream:
            data += stream.read()
    return data


def _about(field: str, code: str, message: str) -> list[dict[str, str]]:
    return [{"field": field, "code": code, "message": message}]


@blueprint.post("/v1/uploads/<upload_id>/cancel")
def cancel_upload(upload_id: str) -> Response:
    """Drops a pending upload and its parts (OpenAI's `uploads.cancel`); cancelling it again answers it again."""
    _record(upload_id)  # another key's answers as a missing one
    try:
        services().uploads.cancel(upload_id)
    except UploadNotFound:
        raise no_such_upload() from None
    except NotPending as error:
        raise _not_pending(upload_id, error.status) from None
    _drop_parts(upload_id)
    return jsonify(upload_view(_record(upload_id)))


def _drop_parts(upload_id: str) -> None:
    """Its parts' blobs, once they are no use (what is left goes with the TTL: storage.lifecycle)."""
    try:
        services().blobs.delete_prefix(part_key(owner(), upload_id, ""))
    except Exception:
        log.warning("%s: its parts were not deleted (the storage sweep will)", upload_id, exc_info=True)
