"""/v1/videos: OpenAI's / SGLang's video jobs API, for super-resolution.

    POST   /v1/videos                 create: multipart with the video in `video_reference`, or JSON naming an upload
                                      or an https `video_url`
    POST   /v1/videos/edits           OpenAI's `videos.edit`: the same, the video in `video`, or `video: {"id": ...}`
                                      naming one of the caller's completed jobs, whose output is upscaled again
    GET    /v1/videos                 list the caller's jobs: after / limit / order, and status
    GET    /v1/videos/{id}            poll
    POST   /v1/videos/{id}/cancel     cancel (a running job stops at its next tile)
    DELETE /v1/videos/{id}            delete the job and its files
    GET    /v1/videos/{id}/content    the MP4: streamed (one `Range` honoured, for players that seek), or a redirect to
                                      a presigned URL; `?variant=thumbnail` a JPEG poster frame, `spritesheet` a JPEG
                                      grid of frames across the video (OpenAI's variants, made by the worker)

A caller sees only its own jobs: another key's job answers 404, exactly as a missing one.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator
from pathlib import PurePosixPath
from typing import Any
from urllib.parse import unquote, urlsplit

import kombu.exceptions
import redis
from flask import Blueprint, Response, g, jsonify, redirect, request
from pydantic import ValidationError

from api import idempotency, prefer
from api.auth import admit_caller, owner
from api.body import check_coding, hold_body_slot, json_object, release_body_slot
from api.errors import UNAVAILABLE_RETRY_AFTER_S, ApiError, field_errors, problem
from api.ratelimit import limits_of
from api.schemas import REFERENCES, CreateRequest, ListQuery, create_request
from api.services import services
from api.uploads import hash_form, no_such_upload, receive_form, upload_name
from storage.blobs import SAFE_KEY, BlobError, BlobNotFound, storage_unavailable, upload_key
from storage.jobs import (
    FenceLost,
    InputInfo,
    InvalidCursor,
    InvalidTransition,
    JobActive,
    JobNotFound,
    JobRecord,
    Status,
)
from storage.lifecycle import delete_job_files, forget_attempts
from storage.queue import send_upscale
from storage.ssrf import LookupUnavailable, UnsafeUrl, public_addresses
from storage.uploads import UploadNotFound, UploadStatus, parts_prefix
from storage.webhooks import Outbox, relay_now

log = logging.getLogger("vsrq.api")

blueprint = Blueprint("videos", __name__)

VIDEO_FILES = frozenset({"video_reference", "input_reference"})  # SGLang takes the video in either
EDIT_FILES = frozenset({"video"})  # OpenAI's SDK sends `videos.edit`'s source as `video`


blueprint.before_request(admit_caller)
blueprint.before_request(check_coding)
blueprint.before_request(hold_body_slot)


@blueprint.errorhandler(JobNotFound)
def _not_found(error: JobNotFound) -> Response:
    return problem(404, "job_not_found", "No such video job.")


# -- create --------------------------------------------------------------------------------------------------------


@blueprint.post("/v1/videos")
def create_video() -> tuple[Response, int]:
    return _created(VIDEO_FILES)


@blueprint.post("/v1/videos/edits")
def edit_video() -> tuple[Response, int]:
    """OpenAI's `client.videos.edit(prompt=..., video=...)`, the SDK's way to hand over a video to change: a job as
    `create` makes it (the prompt means nothing to super-resolution), the video a file, or a completed job's output
    (`video={"id": ...}`: ×2 then ×2 again, or another model on the same output)."""
    return _created(EDIT_FILES)


def _created(files: frozenset[str]) -> tuple[Response, int]:
    """Creates the job, with the input in one of `files` (or named), once per `Idempotency-Key`."""
    key = idempotency.key_from(request.headers)
    if key is None:
        status, body, _ = _create(files, None)
        return _answer(body), status
    store, jobs = services().idempotency, services().jobs
    claim = store.claim(owner(), key, made=lambda job_id: _body(job) if (job := jobs.get(job_id)) else None)
    if not isinstance(claim, idempotency.Claim):
        replay = store.check_replay(claim, lambda: _fingerprint(files))
        response = _answer(replay.body)
        response.headers["Idempotent-Replayed"] = "true"
        return response, replay.status
    try:
        with claim.held():
            status, body, fingerprint = _create(files, claim)
    except BaseException:
        claim.release()  # a failed request is not remembered: the caller may fix it and retry
        raise
    try:
        if not claim.finish(fingerprint, status, body):
            log.warning("%s made under an Idempotency-Key that a repeat took over meanwhile", body["id"])
    except redis.exceptions.RedisError as error:  # the job is made: said here; a repeat finds it once the claim lapses
        log.warning("%s made, its Idempotency-Key's answer not kept (%s)", body["id"], error)
    return _answer(body), status


def _answer(created: dict[str, Any]) -> Response:
    """The created job; with `Prefer: wait`, as it is once it ended or the wait is up. What an `Idempotency-Key`
    remembers is the job as created: a retry waits again."""
    try:
        return _waited(created)
    except JobNotFound:  # deleted by its owner meanwhile: what was created is what this request did
        return _job_response(created)


def _waited(shown: dict[str, Any]) -> Response:
    """`shown` (a job as GET shows it) as the answer; with `Prefer: wait` (api.prefer), the job as it is once it has
    ended or the wait is up. `JobNotFound` where it was deleted meanwhile."""
    if (seconds := prefer.asked_wait(request.headers)) is None:
        return _job_response(shown)
    release_body_slot()  # a create's body is read: waiting must not hold one of the key's uploads back
    if (job := prefer.wait_to_end(shown["id"], seconds, request.environ.get("gunicorn.socket"))) is None:
        return _job_response(shown)
    response = _job_response(_body(job))
    response.headers["Preference-Applied"] = f"wait={seconds}"
    return response


def _job_response(body: dict[str, Any]) -> Response:
    """A job as JSON; while it runs, `openai-poll-after-ms` says when to look again (OpenAI's SDK `poll` obeys it)."""
    response = jsonify(body)
    if body["status"] in (Status.QUEUED, Status.IN_PROGRESS):
        response.headers["openai-poll-after-ms"] = str(services().settings.poll_after_ms)
    return response


def _create(files: frozenset[str], claim: idempotency.Claim | None) -> tuple[int, dict[str, Any], str]:
    """Creates the job from this request (under `claim`, its `Idempotency-Key`'s); returns (status, body, the request's
    fingerprint). The key's job slot is taken before the upload streams, so a key at its limit sends no video for
    nothing."""
    svc = services()
    svc.limiter.check_budget(g.api_key, svc.settings)
    with svc.limiter.job_slot(g.api_key, svc.settings, svc.jobs.active_keys(owner())):
        return _create_from_request(files, claim)


def _create_from_request(files: frozenset[str], claim: idempotency.Claim | None) -> tuple[int, dict[str, Any], str]:
    if request.mimetype == "application/json":
        body = json_object()
        fingerprint = idempotency.fingerprint("json", body)
        return 200, _create_job(*_named_input(body, files), claim, fingerprint), fingerprint

    form = receive_form(files)
    if form.file is None:  # a form may name its input instead, as SGLang's does with `video_url` / `reference_url`
        fingerprint = idempotency.fingerprint("multipart", {"fields": form.fields, "file": None})
        return 200, _create_job(*_named_input(form.fields, files), claim, fingerprint), fingerprint
    try:
        create = create_request(form.fields, references=False)
        stored = form.file
        source = InputInfo(
            key=stored.blob.key,
            bytes=stored.blob.size,
            sha256=stored.blob.sha256,
            filename=stored.filename,
            upload_id=stored.id,
            owned_by_job=True,
        )
        fingerprint = idempotency.fingerprint("multipart", {"fields": form.fields, "file": stored.blob.sha256})
        body = _create_job(create, source, claim, fingerprint)
    except BaseException:
        if form.file is not None:
            services().blobs.delete(form.file.blob.key)
        raise
    return 200, body, fingerprint


def _fingerprint(files: frozenset[str]) -> str:
    """The fingerprint of this request, read without creating anything (to compare a repeat with the first)."""
    if request.mimetype == "application/json":
        return idempotency.fingerprint("json", json_object())
    fields, digest = hash_form(files)
    return idempotency.fingerprint("multipart", {"fields": fields, "file": digest})


def _referenced_input(create: CreateRequest) -> InputInfo:
    """The input a JSON create (or a form without a file) names: one of the caller's uploads, by id or by key, or an
    https URL."""
    if sum(getattr(create, name) is not None for name in REFERENCES) != 1:
        raise ApiError(
            422,
            "missing_video",
            "Send the video as the multipart file `video_reference`, or name it with exactly one of `upload_id`, "
            "`input_key` or `video_url`.",
        )
    if create.video_url is not None:  # checked again by the worker right before each connection
        _check_url(create.video_url_field, create.video_url, services().settings.fetch_allow_loopback)
        # the key's own upload limit holds for what the worker fetches for it, too
        name = PurePosixPath(unquote(urlsplit(create.video_url).path)).name or None  # what a download calls it
        return InputInfo(
            url=create.video_url, filename=name, max_bytes=limits_of(g.api_key, services().settings).upload_bytes
        )
    caller = owner()
    key = upload_key(caller, create.upload_id) if create.upload_id else create.input_key
    # Another caller's upload, or any key outside the caller's uploads, answers exactly as a missing one; so does a key
    # that is not plainly spelled: `uploads/{caller}/../{other}/...` starts like the caller's (and S3 answers it 400),
    # and one part of an upload in parts.
    mine, part = key.startswith(upload_key(caller, "")), key.startswith(parts_prefix(caller))
    ours = SAFE_KEY.fullmatch(key) and mine and not part
    upload_id = key.rsplit("/", 1)[-1]  # a key without a slash ("a") is no upload of the caller's: 404 below
    try:
        blob = services().blobs.head(key) if ours else None
    except BlobError:
        blob = None
    if ours and (refused := _unfinished(upload_id, file_kept=blob is not None)):
        raise refused
    if blob is None:
        raise no_such_upload()
    return InputInfo(key=key, bytes=blob.size, filename=upload_name(key), upload_id=upload_id, owned_by_job=False)


def _unfinished(upload_id: str, file_kept: bool) -> ApiError | None:
    """Why an upload of the caller's is no input (yet, or any more): still taking its parts, cancelled or expired
    (before its completion, or after it: its file deleted, as GET says). None for a completed one whose file is kept,
    and for one no record was kept of (uploaded before records were)."""
    try:
        record = services().uploads.get(upload_id, owner())
    except UploadNotFound:
        return None
    if record.status in (UploadStatus.PENDING, UploadStatus.COMPLETING):
        return ApiError(409, "upload_not_completed",
                        f"Upload `{upload_id}` is pending: complete it (POST /v1/uploads/{upload_id}/complete) first.")
    if record.status is not UploadStatus.COMPLETED:
        return ApiError(409, f"upload_{record.status}",
                        f"Upload `{upload_id}` was {record.status} before it was completed: send the file again.")
    if not file_kept and record.expires_at <= time.time():  # the sweep deleted it (a file gone before: 404)
        return ApiError(409, "upload_expired", f"Upload `{upload_id}` expired: no job named it within its time, and "
                        "its file was deleted; send the file again.")  # fmt: skip
    return None


def _named_input(body: dict[str, Any], files: frozenset[str]) -> tuple[CreateRequest, InputInfo]:
    """The job a request without a file asks for, and the input it names: an edit's completed job, else an upload,
    key or URL (`body` is left as it came, for the request's fingerprint)."""
    fields = dict(body)
    edited = _edited_output(fields) if files == EDIT_FILES else None
    create = create_request(fields, references=edited is None)
    return create, edited or _referenced_input(create)


def _edited_output(fields: dict[str, Any]) -> InputInfo | None:
    """The output of the caller's completed job that an edit names, taken out of `fields`: `video: {"id": ...}` in
    JSON, `video[id]` in a form (the SDK's flattening); None where the edit carries its video as a file or a
    reference `create` reads. Another caller's job answers 404, as a missing one."""
    named = fields.pop("video", None)
    job_id = named.get("id") if isinstance(named, dict) else fields.pop("video[id]", None)
    if named is not None and not isinstance(named, dict):
        raise ApiError(422, "invalid_request", 'An edit names its video as `video: {"id": ...}`, or sends it as a file.')
    if job_id is None:
        return None
    if not isinstance(job_id, str):
        raise ApiError(422, "invalid_request", "`video.id` is a video job's id.")
    job = services().jobs.require(job_id, owner())
    if job.status != Status.COMPLETED or job.output is None:
        raise ApiError(409, "job_not_completed", f"The job is {job.status}; it can be edited once it is completed.")
    output = job.output
    return InputInfo(key=output.key, bytes=output.bytes, sha256=output.sha256, filename=f"{job.id}.mp4")


def _create_job(
    create: CreateRequest, source: InputInfo, claim: idempotency.Claim | None, fingerprint: str
) -> dict[str, Any]:
    """The job `create` asks for, on `source`; made under `claim`'s id where an `Idempotency-Key` holds one."""
    settings, jobs = services().settings, services().jobs
    model = create.options.model or settings.default_model
    if model not in settings.models:
        served = f"served: {', '.join(settings.models)}"
        raise ApiError(
            422,
            "unknown_model",
            f"Model {model!r} is not served here; {served}.",
            errors=[{"field": "model", "code": "unknown_model", "message": served}],
        )
    if create.options.webhook_url is not None:
        if g.api_key.webhook_secret is None:  # vsrq signs every webhook: one this key cannot sign would never be sent
            message = "this API key has no webhook_secret to sign webhooks with: ask the operator for one, or poll"
            raise ApiError(
                422,
                "webhook_secret_missing",
                f"webhook_url is refused: {message}.",
                errors=[{"field": "webhook_url", "code": "webhook_secret_missing", "message": message}],
            )
        # checked again when each delivery connects
        _check_url("webhook_url", create.options.webhook_url, settings.webhook_allow_loopback, "unsafe_webhook_url")
    # the claim says what this request asks for right before the job is made: a repeat after a crash finds one or
    # the other, and a claim taken over meanwhile makes no job here
    job_id, fence = claim.making(fingerprint) if claim is not None else (None, None)
    try:
        job = jobs.create(
            job_id=job_id,
            fence=fence,
            owner=owner(),
            model=model,
            queue=settings.models[model],
            params=create.params.model_dump(),
            asks=sorted(create.params.model_dump(exclude_defaults=True)),
            input=source,
            metadata=create.options.metadata,
            webhook_url=create.options.webhook_url,
            request_id=g.get("request_id"),
        )
    except FenceLost:
        if claim is None:  # a new id's job is never made already
            raise
        raise claim.taken_over() from None
    try:
        send_upscale(services().celery, jobs, job)
    except (kombu.exceptions.OperationalError, redis.exceptions.RedisError, OSError) as error:
        # the broker out of reach or refusing: the job is made, and due a message until one is sent: the reaper sends
        # it (JobStore.unsent)
        log.warning("%s: its message was not sent (%s: %s); the reaper sends it", job.id, type(error).__name__, error)
    return _body(job)


def _check_url(field: str, url: str, allow_loopback: bool, code: str = UnsafeUrl.code) -> None:
    """422 unless `url` reaches only public addresses (storage.ssrf); 503 while its host's name cannot be resolved
    now (a resolver slower than a connection may take, or down: no request thread is held by one)."""
    limit_s = services().settings.fetch_connect_timeout_s
    try:
        public_addresses(url, allow_loopback=allow_loopback, timeout_s=limit_s)
    except LookupUnavailable as error:
        raise ApiError(
            503,
            "url_lookup_unavailable",
            f"{field}'s host could not be resolved now ({error}); retry later.",
            errors=[{"field": field, "code": "url_lookup_unavailable", "message": str(error)}],
            headers={"Retry-After": str(UNAVAILABLE_RETRY_AFTER_S)},
        ) from None
    except UnsafeUrl as error:
        raise ApiError(
            422,
            code,
            f"{field} is refused: {error}.",
            errors=[{"field": field, "code": UnsafeUrl.code, "message": str(error)}],
        ) from None


def _body(job: JobRecord) -> dict[str, Any]:
    return services().jobs.view(job).model_dump(mode="json")


# -- read, cancel, delete ------------------------------------------------------------------------------------------


@blueprint.get("/v1/videos/<job_id>")
def get_video(job_id: str) -> Response:
    """The job; with `Prefer: wait`, once it has ended or the wait is up (a create whose own wait ran out, polled on
    with one request a minute rather than one a second)."""
    # a job deleted while the poll waits is 404 (JobNotFound), as it would be to a poll then
    return _waited(_body(services().jobs.require(job_id, owner())))


@blueprint.get("/v1/videos/<job_id>/events")
def video_events(job_id: str) -> Response:
    jobs = services().jobs
    jobs.require(job_id, owner())
    return jsonify(jobs.event_views(job_id).model_dump(mode="json"))


@blueprint.get("/v1/videos")
def list_videos() -> Response:
    settings, jobs = services().settings, services().jobs
    try:
        query = ListQuery.model_validate(request.args.to_dict())
    except ValidationError as error:
        raise ApiError(
            422, "invalid_request", "Invalid list parameters: see `errors`.", errors=field_errors(error)
        ) from None
    if query.limit > settings.list_limit_max:
        most = f"`limit` is at most {settings.list_limit_max}."
        raise ApiError(
            422, "invalid_request", most, errors=[{"field": "limit", "code": "less_than_equal", "message": most}]
        )
    try:
        page = jobs.page(
            owner(),
            status=Status(query.status) if query.status else None,
            after=query.after,
            limit=query.limit,
            order=query.order,
        )
    except InvalidCursor:
        raise ApiError(400, "invalid_cursor", "`after` must be the id of one of your jobs.") from None
    data = [_body(job) for job in page.jobs]
    return jsonify(
        object="list",
        data=data,
        first_id=data[0]["id"] if data else None,
        last_id=data[-1]["id"] if data else None,
        has_more=page.has_more,
    )


@blueprint.post("/v1/videos/<job_id>/cancel")
def cancel_video(job_id: str) -> Response:
    jobs = services().jobs
    jobs.require(job_id, owner())
    try:
        job = jobs.cancel(job_id)
    except InvalidTransition:
        raise ApiError(409, "not_cancellable", "The job has already ended.") from None
    if job.status == Status.CANCELLED and job.webhook_url:  # a queued job ends at once: its webhook goes out now
        claim_s = services().settings.webhook_claim_s
        relay_now(Outbox(jobs.redis, jobs.prefix), services().celery, claim_s, job.id, Status.CANCELLED)
    if job.status == Status.CANCELLED:  # and what an earlier attempt kept goes
        forget_attempts(services().blobs, job)
    return jsonify(_body(job))


@blueprint.delete("/v1/videos/<job_id>")
def delete_video(job_id: str) -> Response:
    jobs, blobs = services().jobs, services().blobs
    job = jobs.require(job_id, owner())
    try:
        jobs.delete(job_id)
    except JobActive:
        raise ApiError(409, "job_active", "The job is running: cancel it, then delete it.") from None
    services().idempotency.forget_job(job_id)
    # The record goes first: nobody can see a job whose files are half gone. The job is deleted from here on: files
    # that storage (down) or a crash left are the reaper's storage sweep's, and a 503 would send the client to retry
    # into a 404
    try:
        delete_job_files(jobs, blobs, job)
    except Exception as error:  # an outage in a line; anything else with its traceback (a bug, a refusal that stays)
        outage = storage_unavailable(error) or isinstance(error, (redis.ConnectionError, redis.TimeoutError))
        cause = None if outage else error
        log.warning("%s deleted; its files are left to the storage sweep (%s)", job_id, error, exc_info=cause)
    return jsonify(id=job_id, object="video.deleted", deleted=True)


VARIANTS = {"video": "video/mp4", "thumbnail": "image/jpeg", "spritesheet": "image/jpeg"}


@blueprint.get("/v1/videos/<job_id>/content")
def video_content(job_id: str) -> Response:
    settings, blobs = services().settings, services().blobs
    job = services().jobs.require(job_id, owner())
    variant = request.args.get("variant") or "video"
    if variant == "0":  # SGLang numbers a job's outputs: a job here has one, the video
        variant = "video"
    if variant not in VARIANTS:
        raise ApiError(
            422,
            "invalid_request",
            f"`variant` is one of {', '.join(VARIANTS)}.",
            errors=[{"field": "variant", "code": "enum", "message": f"one of {', '.join(VARIANTS)}"}],
        )
    # 409, not SGLang's 404 "still in progress": the job exists, and a client that reads 404 as "gone" would stop
    if job.status != Status.COMPLETED or job.output is None:
        if job.status in (Status.FAILED, Status.CANCELLED):  # it never will be: not "once it is completed"
            raise ApiError(409, "job_not_completed", f"The job is {job.status}: it has no video.")
        raise ApiError(409, "job_not_completed", f"The job is {job.status}; its video exists once it is completed.")
    output = job.output
    if variant == "video":
        key, size, digest, filename = output.key, output.bytes, output.sha256, f"{job_id}.mp4"
    else:
        preview = output.previews.get(variant)
        if preview is None:  # made by a worker of an earlier version, or the output had no frame to show
            raise ApiError(404, "variant_not_found", f"This job's output has no {variant}.")
        key, size, digest, filename = preview.key, preview.bytes, preview.sha256, f"{job_id}.{variant}.jpg"
    mimetype = VARIANTS[variant]
    if settings.content_delivery == "redirect":  # the same name and type as a streamed answer's
        url = blobs.presigned_url(key, settings.presign_ttl_s, filename=filename, content_type=mimetype)
        if url is not None:
            return redirect(url, 302)
    headers = {
        "ETag": f'"{digest}"',  # the content's own hash: the same bytes are the same tag, whatever the job
        "Accept-Ranges": "bytes",
        "Content-Disposition": f'attachment; filename="{filename}"',
    }
    if request.if_none_match.contains_weak(digest):
        return Response(status=304, headers=headers)
    byte_range = _byte_range(size, digest)
    try:
        stream = blobs.open(key, byte_range)  # a ranged GET on S3: a player seeking reads only what it shows
    except BlobNotFound:  # removed from storage under the job (a lifecycle rule, a hand's cleanup): it was a 500
        blobs.check()  # unless the bucket itself is missing (misnamed): not the video's fate, and 503 (api.errors)
        raise ApiError(
            410, "output_gone", f"This job's {variant} is no longer in storage (removed before the job expired)."
        ) from None

    def chunks() -> Iterator[bytes]:
        try:
            while chunk := stream.read(1024 * 1024):
                yield chunk
        finally:
            stream.close()

    if byte_range is None:
        return Response(chunks(), mimetype=mimetype, headers={**headers, "Content-Length": str(size)})
    first, last = byte_range
    headers |= {"Content-Length": str(last - first + 1), "Content-Range": f"bytes {first}-{last}/{size}"}
    return Response(chunks(), status=206, mimetype=mimetype, headers=headers)


def _byte_range(length: int, etag: str) -> tuple[int, int] | None:
    """The one byte range (first, last) the request asks for, or None for the whole video: no Range, several ranges
    (allowed to be answered whole), another unit, an invalid header, or an If-Range naming other content. A range
    that starts past the end answers 416."""
    asked = request.range
    if asked is None or asked.units != "bytes" or len(asked.ranges) != 1:
        return None
    if "If-Range" in request.headers and request.if_range.etag != etag:
        return None
    [(start, stop)] = asked.ranges
    if start < 0:  # the last -start bytes; a suffix longer than the video is all of it (RFC 9110, 14.1.2)
        start, stop = max(length + start, 0), length
    stop = length if stop is None else min(stop, length)
    if start >= length:
        raise ApiError(
            416,
            "range_not_satisfiable",
            f"The video has {length} bytes: the range asked for starts past its end.",
            headers={"Content-Range": f"bytes */{length}"},
        )
    return start, stop - 1
