"""The OpenAPI 3.1 document at /openapi.json, and Swagger UI at /docs to read and try it.

The schemas are generated from the pydantic models the API validates requests with (api/schemas.py) and answers
with (storage/jobs.py `Video`, api/errors.py `Problem`), so the document cannot drift from what is enforced; the few
response shapes the handlers build by hand are described by the small models below, and the test suite checks every
response of the live API against them (tests/service/test_openapi.py). Served models and the list limit come from the
settings, so the document says what this deployment accepts.

Swagger UI's assets come from the `flask-swagger-ui` package and are served by this API: the page needs nothing from
another host at run time. The page is ours (api/static/docs.html, docs.js): no inline script, so a strict CSP holds,
nothing from the request (its Host header) in the page or in the /docs redirect, and no API key kept in
localStorage.
"""

from __future__ import annotations

from importlib.metadata import version
from typing import Any, Literal

from pathlib import Path

import flask_swagger_ui
from flask import Blueprint, Flask, Response, current_app, jsonify, send_from_directory
from pydantic import BaseModel, Field, create_model
from pydantic.json_schema import models_json_schema

from api.errors import Problem
from api.idempotency import HEADER as IDEMPOTENCY_HEADER
from api.request_id import HEADER as REQUEST_ID_HEADER
from api.request_id import SANE as SANE_REQUEST_ID
from api.schemas import (
    SCALES, SGLANG_IGNORED, CompleteUpload, CreateRequest, DeclareUpload, JobOptions, ListQuery, UpscaleParams,
)  # fmt: skip
from api.services import services
from storage.config import Settings
from storage.jobs import Video, VideoEventList, VideoWebhook
from storage.uploads import PART_MAX_BYTES

blueprint = Blueprint("openapi", __name__)
DOCS_PATH = "/docs"
SPEC_PATH = "/openapi.json"
_REF = "#/components/schemas/{model}"


# -- Response shapes built by hand in the handlers -------------------------------------------------------------------


class VideoList(BaseModel):
    object: Literal["list"]
    data: list[Video]
    first_id: str | None
    last_id: str | None
    has_more: bool = Field(description="pass `last_id` as `after` for the next page")


class Model(BaseModel):
    id: str = Field(description="what to put in `model` on create")
    object: Literal["model"]
    created: int
    owned_by: str
    queue: str = Field(description="the Celery queue (pipeline group) whose workers serve it")
    default: bool = Field(description="the model a create without `model` gets")
    qualities: list[Literal["lossless", "high"]] = Field(
        description="the `quality` tiers its jobs run as asked, by what the workers registered on its queue say: "
        "`lossless` alone where none has a faster path (lanczos, GPUs without FP8 GEMMs: a `high` job runs "
        "`lossless`); every tier while none is registered"
    )


class ModelList(BaseModel):
    object: Literal["list"]
    data: list[Model]


class VideoDeleted(BaseModel):
    id: str
    object: Literal["video.deleted"]
    deleted: Literal[True]


class UploadFile(BaseModel):
    """OpenAI's File object, for a completed upload: its `id` is the upload's."""

    id: str = Field(description="name it as `upload_id`, or as `input_reference.file_id`")
    object: Literal["file"]
    bytes: int
    created_at: int
    expires_at: int
    filename: str
    purpose: str
    status: Literal["processed"]


class Upload(BaseModel):
    """OpenAI's Upload object, with ours: `key`, `sha256`, `content_type`, `received_bytes`, `part_ids`."""

    id: str = Field(description="name it as `upload_id` in a JSON create, or as `input_reference.file_id`")
    object: Literal["upload"]
    bytes: int
    created_at: int
    expires_at: int = Field(description="a pending upload expires then; a completed one no job names is deleted then")
    filename: str
    purpose: str
    status: Literal["pending", "completed", "cancelled", "expired"]
    file: UploadFile | None
    key: str | None = Field(description="where the file is stored, once completed")
    sha256: str | None
    content_type: str
    received_bytes: int = Field(description="the bytes of the parts stored so far")
    part_ids: list[str] = Field(description="pending: the parts stored so far; completed: in the order joined")


class UploadPart(BaseModel):
    id: str = Field(description="name it in `part_ids` to complete the upload")
    object: Literal["upload.part"]
    created_at: int
    upload_id: str
    bytes: int
    sha256: str


class Health(BaseModel):
    status: Literal["ok", "degraded", "unavailable"] = Field(
        description="ok: Redis and storage answer and jobs make progress; degraded: a served queue has no model "
        "worker (or one runs another model than its queue's), the reaper has not passed lately, a job is past its "
        "lease, or Redis would lose jobs (no AOF, eviction) (`problems` says which); unavailable: Redis or storage "
        "is down or refuses the service (503; `problems` says what to check)"
    )
    problems: list[str]
    checks: dict[str, Any]


# -- Request bodies: the create fields, flat, as clients send them ---------------------------------------------------

_REFERENCES = {name: (field.annotation, field) for name, field in CreateRequest.model_fields.items()}
del _REFERENCES["params"], _REFERENCES["options"]
_IGNORED = {
    name: (Any, Field(None, description="accepted for SGLang compatibility; means nothing to super-resolution"))
    for name in sorted(SGLANG_IGNORED)
}
VideoCreateJson = create_model(
    "VideoCreateJson",
    __base__=(UpscaleParams, JobOptions),
    __doc__="A job on a video uploaded before (POST /v1/uploads) or on an https URL: name it by exactly one of "
    "`upload_id`, `input_key` or `video_url`.",
    **_REFERENCES,
    **_IGNORED,
)
VideoCreateForm = create_model(
    "VideoCreateForm",
    __base__=(UpscaleParams, JobOptions),
    __doc__="SGLang's multipart create: the video in `video_reference`, the fields as form values.",
    video_reference=(bytes, Field(description="the video (`input_reference` is accepted too)")),
    **_IGNORED,
)


class EditedVideo(BaseModel):
    id: str = Field(description="one of your completed jobs: its output is the video upscaled")


VideoEditJson = create_model(
    "VideoEditJson",
    __base__=(UpscaleParams, JobOptions),
    __doc__="OpenAI's `videos.edit` as JSON: a completed job's output, named by `video.id`, upscaled again (or, as in "
    "a create, an upload or an https URL).",
    video=(EditedVideo | None, Field(None)),
    **_REFERENCES,
    **_IGNORED,
)
VideoEditForm = create_model(
    "VideoEditForm",
    __base__=(UpscaleParams, JobOptions),
    __doc__="OpenAI's `videos.edit` as its SDK sends it: the video in `video` (or `video[id]` naming a completed "
    "job), the other fields as form values (the SDK's `extra_body`).",
    video=(bytes, Field(description="the video")),
    **_IGNORED,
)
UploadForm = create_model("UploadForm", file=(bytes, Field(description="the video")))
UploadPartForm = create_model(
    "UploadPartForm", data=(bytes, Field(description=f"the part's bytes, at most {PART_MAX_BYTES} (64 MiB)"))
)
UploadDeclareJson = create_model("UploadDeclareJson", __base__=DeclareUpload, __doc__=DeclareUpload.__doc__)
UploadCompleteJson = create_model(
    "UploadCompleteJson",
    __base__=CompleteUpload,
    __doc__="The parts, in the order they make the file; `md5` (hex) is checked against the joined file's.",
)


# -- The document ----------------------------------------------------------------------------------------------------


def _header(description: str, required: bool = True) -> dict[str, Any]:
    return {"description": description, "required": required, "schema": {"type": "string"}}


_PROBLEM = {"content": {"application/problem+json": {"schema": {"$ref": _REF.format(model="Problem")}}}}
# The headers a problem answer of that status always carries: api/auth.py's 401, api/videos.py's 416, and every 429
# (api/ratelimit.py's limits and api/auth.py's throttled guessing say when to come back)
_PROBLEM_HEADERS = {
    401: {"WWW-Authenticate": _header('`Bearer realm="vsrq"`: the scheme to authenticate with')},
    416: {"Content-Range": _header("`bytes */length`: the video's length")},
    429: {"Retry-After": _header("seconds until a request may succeed")},
}


def _problems(*statuses: int) -> dict[str, Any]:
    """problem+json answers: the statuses this operation gives for a reason of its own, and any other one."""
    described = {401: "no valid API key", 404: "no such job (another key's jobs are missing too)"}
    return {
        **{
            str(status): {
                **_PROBLEM,
                "description": described.get(status, "see `code`"),
                **({"headers": _PROBLEM_HEADERS[status]} if status in _PROBLEM_HEADERS else {}),
            }
            for status in statuses
        },
        "default": {**_PROBLEM, "description": "any other error: 4xx is the caller's to fix, 5xx is ours"},
    }


# gunicorn's own answers (api/gunicorn_worker.py), given before the app sees the request, whatever its path: a
# request line or headers over its limits. Declared on every operation, not left to `default`, so that clients can
# tell them apart.
_GUNICORN_REFUSALS = {
    "414": {**_PROBLEM, "description": "the request line is too long (gunicorn's `limit_request_line`)"},
    "431": {**_PROBLEM, "description": "the request's headers are too large or too many (gunicorn's limits)"},
}


_UPLOAD_ID = {"name": "upload_id", "in": "path", "required": True, "schema": {"type": "string"}}


def _json(model: str, description: str) -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": {"$ref": _REF.format(model=model)}}}}


# What a created job's id leads to: lets Schemathesis's stateful phase (and client generators) follow a job.
_JOB_LINKS = {
    name: {"operationId": name, "parameters": {"job_id": "$response.body#/id"}}
    for name in ("getVideo", "getVideoEvents", "cancelVideo", "getVideoContent", "deleteVideo")
}


def _job_operation(
    summary: str,
    headers: tuple[tuple[str, str], ...] = (),
    extra_parameters: list[dict[str, Any]] = (),
    **extra: Any,
) -> dict[str, Any]:
    job_id = {"name": "job_id", "in": "path", "required": True, "schema": {"type": "string"}, "example": "video_..."}
    header_parameters = [
        {"name": name, "in": "header", "required": False, "description": description, "schema": {"type": "string"}}
        for name, description in headers
    ]
    parameters = [job_id, *header_parameters, *extra_parameters]
    return {"summary": summary, "tags": ["videos"], "parameters": parameters, **extra}


# Every answer the app gives carries the request id (api/request_id.py), and every operation takes a client's own:
# declared on each operation, so generated clients expose both, and Schemathesis checks the header on every answer it
# gets. The header is a component (one description, not one per answer); the parameter is written out in each
# operation, as its others are, for readers that look parameters up by name.
_REQUEST_ID_HEADER = {
    "description": "this request's id, which the API's log lines for it and a problem body's `request_id` carry: "
    "quote it to an operator. The client's `X-Request-Id` when it was sane, else `req_` and 32 hex digits",
    "required": True,
    "schema": {"type": "string", "pattern": f"^{SANE_REQUEST_ID}$"},
}
_REQUEST_ID_PARAMETER = {
    "name": REQUEST_ID_HEADER,
    "in": "header",
    "required": False,
    "description": "your own id for this request (a proxy's, a tracer's), kept as the answer's `X-Request-Id` when "
    "it is 1 to 128 characters of letters, digits and `._:/+=@-`, starting with a letter or a digit; any other "
    "value is replaced, never refused",
    "schema": {"type": "string"},  # no pattern: a value off it is replaced, and Schemathesis would expect a 4xx
}


def _with_request_id(paths: dict[str, Any]) -> dict[str, Any]:
    """Every operation with the request id, and gunicorn's refusals (which carry one too)."""
    header = {REQUEST_ID_HEADER: {"$ref": f"#/components/headers/{REQUEST_ID_HEADER}"}}
    return {
        path: {
            method: {
                **operation,
                "parameters": [*operation.get("parameters", ()), _REQUEST_ID_PARAMETER],
                "responses": {
                    status: {**response, "headers": {**response.get("headers", {}), **header}}
                    for status, response in {
                        **operation["responses"],
                        **(_without_bodies(_GUNICORN_REFUSALS) if method == "head" else _GUNICORN_REFUSALS),
                    }.items()
                },
            }
            for method, operation in item.items()
        }
        for path, item in paths.items()
    }


# GET /v1/videos/{job_id}/content (api/videos.py `video_content`), and HEAD, which Flask answers with the same
# view and no body: its headers are what a download manager or a player probes for the size and name.
_CONTENT_HEADERS = (
    ("Range", "one range: `bytes=first-last`, `bytes=first-` or `bytes=-suffix`"),
    ("If-Range", "the ETag the range belongs to: another one gets the whole video"),
    ("If-None-Match", "the ETag you have: 304 while it is still this video"),
)
_VARIANT = {
    "name": "variant",
    "in": "query",
    "required": False,
    "description": "video (the MP4, default), thumbnail (a JPEG of the middle frame) or spritesheet (a JPEG grid of "
    "up to 25 frames across the video, 5 to a row); `0` is taken for the video too, as SGLang numbers its outputs "
    "(not listed: a generated type would offer it beside the names)",
    "schema": {"type": "string", "enum": ["video", "thumbnail", "spritesheet"]},
}
_FILE = {"schema": {"type": "string", "format": "binary"}}
_FILE_HEADERS = {
    "ETag": _header("the file's SHA-256, quoted"),
    "Accept-Ranges": _header("bytes"),
    "Content-Disposition": _header('`attachment; filename="{job_id}.mp4"` (`{job_id}.{variant}.jpg` for a JPEG)'),
}
_CONTENT_RESPONSES = {
    "200": {
        "description": "the MP4, or the JPEG the variant names",
        "headers": {**_FILE_HEADERS, "Content-Length": _header("the file's size in bytes")},
        "content": {"video/mp4": _FILE, "image/jpeg": _FILE},
    },
    "206": {
        "description": "the one byte range a `Range` header asked for",
        "headers": {
            **_FILE_HEADERS,
            "Content-Range": _header("bytes first-last/length"),
            "Content-Length": _header("the range's size in bytes"),
        },
        "content": {"video/mp4": _FILE, "image/jpeg": _FILE},
    },
    "302": {
        "description": "a presigned URL to fetch it from (when the service delivers by redirect)",
        "headers": {"Location": _header("the presigned URL")},
    },
    "304": {
        "description": "`If-None-Match` names the ETag (the output's SHA-256): not modified",
        "headers": _FILE_HEADERS,
    },
    **_problems(401, 404, 409, 410, 416, 422),
}


def _without_bodies(responses: dict[str, Any]) -> dict[str, Any]:
    """A GET's answers as HEAD gets them: the same statuses and headers, no content."""
    return {
        status: {key: part for key, part in answer.items() if key != "content"} for status, answer in responses.items()
    }


def _page(operation_id: str, summary: str) -> dict[str, Any]:
    html = {"description": "an HTML page", "content": {"text/html": {"schema": {"type": "string"}}}}
    return {
        "operationId": operation_id,
        "summary": summary,
        "tags": ["service"],
        "security": [],
        "responses": {"200": html},
    }


# SGLang's cookbook request, as a form's fields: what Swagger UI fills in, and a create the document's own example
# makes (Schemathesis sends it first)
_SGLANG_FORM = {
    "video_reference": "(the video file)", "sr_resolution_scale": "2", "sr_tiles_batch_size": 1,
    "num_inference_steps": 2, "seed": 42,
}  # fmt: skip


# Replicate's sync mode (api/prefer.py): the create answers once its job has ended, or the wait is up
_PREFER = {
    "name": "Prefer",
    "in": "header",
    "required": False,
    "description": "`wait` (up to 60 s) or `wait=N` (1 to 60): answer once the job has ended, or N seconds have "
    "passed, with the job as it then is (`Preference-Applied` says it waited); other preferences are ignored",
    "schema": {"type": "string", "examples": ["wait", "wait=10"]},
}
_PREFERENCE_APPLIED = _header("`wait=N` where the request waited: up to N seconds, less where the job ended", False)


def _creating(
    bodies: str, idempotency_key: dict[str, Any], form_example: dict[str, Any] | None = None
) -> dict[str, Any]:
    """An operation that creates a job from the `{bodies}Form` (multipart) or `{bodies}Json` request body."""
    return {
        "tags": ["videos"],
        "parameters": [idempotency_key, _PREFER],
        "requestBody": {
            "required": True,
            "content": {
                "multipart/form-data": {
                    "schema": {"$ref": _REF.format(model=f"{bodies}Form")},
                    "encoding": {"metadata": {"contentType": "application/json"}},
                    **({"example": form_example} if form_example else {}),
                },
                "application/json": {"schema": {"$ref": _REF.format(model=f"{bodies}Json")}},
            },
        },
        "responses": {
            "200": {
                **_json("Video", "the job, queued; with `Prefer: wait`, as it is once ended or the wait is up"),
                "headers": {"Preference-Applied": _PREFERENCE_APPLIED},
                "links": _JOB_LINKS,
            },
            **_problems(400, 401, 404, 409, 413, 415, 422, 429, 503),
        },
    }


_NULL_AS_TEXT = "in a form, the text `null` (or an empty value) is this null: not given"


def _null_as_text(form: dict[str, Any]) -> None:
    """A form has no null: the text `null` stands for it (`api.uploads._take`), as JavaScript's FormData writes a
    null and Swagger UI's "Try it out" sends a field whose default is null. The null branch of a field's schema says
    so in words: a `const "null"` beside it would make generated types take the text (`number | null | "null"`),
    which no client writes, while the field's values are text in a form anyway."""
    for field in form["properties"].values():
        for kind in field.get("anyOf", []):
            if kind == {"type": "null"}:
                kind["description"] = _NULL_AS_TEXT


# What a job's end POSTs to its `webhook_url` (worker/webhooks.py), signed as Standard Webhooks says
# (storage/signatures.py): one event per ended job, named by the status it ended in.
_WEBHOOKS = {
    "video.completed": "A job completed: `data.output` says what ran, GET /v1/videos/{id}/content downloads it",
    "video.failed": "A job failed: `data.error` says why",
    "video.cancelled": "A job was cancelled",
}
_SIGNATURE_HEADERS = {
    "webhook-id": "the event's id, the body's `id`: the same on every retry, so dedupe on it",
    "webhook-timestamp": "when this attempt was signed (Unix seconds): refuse one far from your clock",
    "webhook-signature": "space-separated `v1,<base64 HMAC-SHA256>` of `{webhook-id}.{webhook-timestamp}.{raw body}`, "
    "one per signing secret of the key (its `webhook_secret`, `whsec_` + base64)",
}


def _webhook(event: str, summary: str) -> dict[str, Any]:
    status = event.removeprefix("video.")
    body = {
        "allOf": [
            {"$ref": _REF.format(model="VideoWebhook")},
            {"properties": {"type": {"const": event}, "data": {"properties": {"status": {"const": status}}}}},
        ]
    }
    return {
        "operationId": f"video{status.title()}Webhook",
        "summary": summary,
        "description": "POSTed to the job's `webhook_url` once it has ended, as JSON. Verify the signature on the raw "
        "body (`standardwebhooks`, or OpenAI's SDK `webhooks.unwrap`) before trusting it.",
        "tags": ["webhooks"],
        "security": [],  # signed, with the key's webhook_secret: no bearer token is sent
        "parameters": [
            {"name": name, "in": "header", "required": True, "description": description, "schema": {"type": "string"}}
            for name, description in _SIGNATURE_HEADERS.items()
        ],
        "requestBody": {"required": True, "content": {"application/json": {"schema": body}}},
        "responses": {
            "2XX": {"description": "delivered: not sent again"},
            "410": {"description": "Gone: the event is given up, not sent again"},
            "default": {
                "description": "sent again later with backoff (not sooner than a `Retry-After`), up to the service's "
                "`webhook_max_attempts`; a 3xx is not followed, and is retried too"
            },
        },
    }


def document(settings: Settings) -> dict[str, Any]:
    models = [
        Video, VideoWebhook, VideoList, VideoEventList, VideoDeleted, Upload, UploadPart, Health, Problem,
        VideoCreateJson, VideoCreateForm, VideoEditJson, VideoEditForm, UploadForm, UploadPartForm, UploadDeclareJson,
        UploadCompleteJson, Model, ModelList,
    ]  # fmt: skip
    _, definitions = models_json_schema(
        [(model, "validation" if model.__name__.endswith(("Json", "Form")) else "serialization") for model in models],
        ref_template=_REF,
    )
    schemas = definitions["$defs"]
    served = {"type": "string", "enum": list(settings.models), "default": settings.default_model}
    for body in ("VideoCreateJson", "VideoCreateForm", "VideoEditJson", "VideoEditForm"):
        schemas[body]["properties"]["model"] = {**served, "description": "a model this deployment serves"}
    for form in ("VideoCreateForm", "VideoEditForm"):
        _null_as_text(schemas[form])
        # the scale as the text a form sends: openapi-python-client's multipart writer cannot send a number `const`
        # (its code calls isinstance on a Literal), while a text enum it writes as it is
        scale = schemas[form]["properties"]["sr_resolution_scale"]
        scale.pop("anyOf")
        scale.update(type="string", enum=[f"{value:g}" for value in SCALES], default=f"{scale['default']:g}")
        # ignored whatever it is (a JSON body may send any value), and a form's value is text
        schemas[form]["properties"]["prompt"]["type"] = "string"
        del schemas[form]["properties"]["prompt"]["default"]  # null, which a text field cannot hold

    listing = ListQuery.model_json_schema()
    list_parameters = [
        {"name": name, "in": "query", "required": False, "schema": schema}
        for name, schema in listing["properties"].items()
    ]
    for parameter in list_parameters:
        if parameter["name"] == "limit":
            parameter["schema"] = {**parameter["schema"], "maximum": settings.list_limit_max}

    idempotency_key = {
        "name": IDEMPOTENCY_HEADER,
        "in": "header",
        "required": False,
        "description": "retry a create safely: the first response is replayed for 24 h (409 while it runs, 422 when "
        "the key is reused for another request)",
        "schema": {"type": "string", "minLength": 1, "maxLength": 255},
    }
    public = {"security": []}
    paths: dict[str, Any] = {
        "/v1/videos": {
            "post": {
                "operationId": "createVideo",
                "summary": "Create a job: upload a video (multipart) or name an upload (JSON)",
                **_creating("VideoCreate", idempotency_key, _SGLANG_FORM),
            },
            "get": {
                "operationId": "listVideos",
                "summary": "List your jobs, newest first",
                "tags": ["videos"],
                "parameters": list_parameters,
                "responses": {"200": _json("VideoList", "a page of jobs"), **_problems(400, 401, 422)},
            },
        },
        "/v1/videos/edits": {
            "post": {
                "operationId": "editVideo",
                "summary": "OpenAI's `videos.edit`: a job on a video file, or on a completed job's output",
                **_creating("VideoEdit", idempotency_key),
            },
        },
        "/v1/videos/{job_id}": {
            "get": _job_operation(
                "Poll a job",
                operationId="getVideo",
                extra_parameters=[_PREFER],
                responses={
                    "200": {
                        **_json("Video", "the job; with `Prefer: wait`, once it has ended or the wait is up"),
                        "headers": {"Preference-Applied": _PREFERENCE_APPLIED},
                    },
                    **_problems(401, 404),
                },
            ),
            "delete": _job_operation(
                "Delete a job and its files (cancel a running one first)",
                operationId="deleteVideo",
                responses={"200": _json("VideoDeleted", "deleted"), **_problems(401, 404, 409)},
            ),
        },
        "/v1/videos/{job_id}/events": {
            "get": _job_operation(
                "What happened to a job, oldest first: its moves, stages, retried attempts and why, webhook deliveries",
                operationId="getVideoEvents",
                responses={"200": _json("VideoEventList", "the job's events"), **_problems(401, 404)},
            )
        },
        "/v1/videos/{job_id}/cancel": {
            "post": _job_operation(
                "Cancel a job (a running one stops at its next tile)",
                operationId="cancelVideo",
                responses={"200": _json("Video", "the job, cancelled or cancelling"), **_problems(401, 404, 409)},
            )
        },
        "/v1/videos/{job_id}/content": {
            "get": _job_operation(
                "Download the upscaled MP4 of a completed job (one byte range at a time, for players that seek), or "
                "its poster frame or sprite sheet",
                operationId="getVideoContent",
                headers=_CONTENT_HEADERS,
                extra_parameters=[_VARIANT],
                responses=_CONTENT_RESPONSES,
            ),
            "head": _job_operation(
                "The headers a download would answer with (its length, ETag, file name), and no body",
                operationId="headVideoContent",
                headers=_CONTENT_HEADERS,
                extra_parameters=[_VARIANT],
                responses=_without_bodies(_CONTENT_RESPONSES),
            ),
        },
        "/v1/models": {
            "get": {
                "operationId": "listModels",
                "summary": "The models this deployment serves (OpenAI's list shape)",
                "tags": ["models"],
                "responses": {"200": _json("ModelList", "the served models"), **_problems(401)},
            }
        },
        "/v1/models/{model_id}": {
            "get": {
                "operationId": "getModel",
                "summary": "One served model",
                "tags": ["models"],
                "parameters": [{"name": "model_id", "in": "path", "required": True, "schema": {"type": "string"}}],
                "responses": {"200": _json("Model", "the model"), **_problems(401, 404)},
            }
        },
        "/v1/uploads": {
            "post": {
                "operationId": "createUpload",
                "summary": "Store a video for later jobs; or, as JSON, declare one that comes in parts",
                "tags": ["uploads"],
                "requestBody": {
                    "required": True,
                    "content": {
                        "multipart/form-data": {"schema": {"$ref": _REF.format(model="UploadForm")}},
                        "application/json": {"schema": {"$ref": _REF.format(model="UploadDeclareJson")}},
                    },
                },
                "responses": {
                    "201": _json("Upload", "stored (completed), or declared (pending)"),
                    **_problems(400, 401, 413, 415, 422, 429),
                },
            }
        },
        "/v1/uploads/{upload_id}": {
            "get": {
                "operationId": "getUpload",
                "summary": "An upload: pending with the parts stored so far, or completed",
                "tags": ["uploads"],
                "parameters": [_UPLOAD_ID],
                "responses": {"200": _json("Upload", "the upload"), **_problems(401, 404, 429)},
            }
        },
        "/v1/uploads/{upload_id}/parts": {
            "post": {
                "operationId": "addUploadPart",
                "summary": "One part of an upload in parts (a failed one is sent again, not the file)",
                "tags": ["uploads"],
                "parameters": [_UPLOAD_ID],
                "requestBody": {
                    "required": True,
                    "content": {"multipart/form-data": {"schema": {"$ref": _REF.format(model="UploadPartForm")}}},
                },
                "responses": {
                    "201": _json("UploadPart", "stored"), **_problems(400, 401, 404, 409, 413, 415, 422, 429)
                },
            }
        },
        "/v1/uploads/{upload_id}/complete": {
            "post": {
                "operationId": "completeUpload",
                "summary": "Join the parts, in the order named, into the file jobs name",
                "tags": ["uploads"],
                "parameters": [_UPLOAD_ID],
                "requestBody": {
                    "required": True,
                    "content": {"application/json": {"schema": {"$ref": _REF.format(model="UploadCompleteJson")}}},
                },
                "responses": {"200": _json("Upload", "completed"), **_problems(400, 401, 404, 409, 413, 422, 429)},
            }
        },
        "/v1/uploads/{upload_id}/cancel": {
            "post": {
                "operationId": "cancelUpload",
                "summary": "Drop a pending upload and its parts",
                "tags": ["uploads"],
                "parameters": [_UPLOAD_ID],
                "responses": {"200": _json("Upload", "cancelled"), **_problems(401, 404, 409, 429)},
            }
        },
        "/livez": {
            "get": {
                "operationId": "live",
                "summary": "Does this API process answer? (a liveness probe: asks nothing else)",
                "tags": ["service"],
                **public,
                "responses": {"200": {"description": "alive", "content": {"application/json": {"schema": {}}}}},
            }
        },
        "/healthz": {
            "get": {
                "operationId": "health",
                "summary": "Can the service do its job? Counts only; checked every second, answered from memory",
                "tags": ["service"],
                **public,
                "responses": {"200": _json("Health", "healthy"), "503": _json("Health", "Redis or storage is down")},
            }
        },
        "/v1/health": {
            "get": {
                "operationId": "healthDetail",
                "summary": "The same, with each registered worker, who answers Celery's ping and queue depths",
                "tags": ["service"],
                "responses": {"200": _json("Health", "healthy"), **_problems(401, 429), "503": _json("Health", "down")},
            }
        },
        "/metrics": {
            "get": {
                "operationId": "metrics",
                "summary": "Prometheus metrics: request latency, queue depth, jobs by status, live workers",
                "tags": ["service"],
                **public,
                "responses": {
                    "200": {"description": "Prometheus' text format", "content": {"text/plain": {"schema": {}}}}
                },
            }
        },
        "/": {"get": _page("webApp", "The web app: upload, watch, compare, download")},
        f"{DOCS_PATH}/": {"get": _page("docs", "This document, in Swagger UI")},
        DOCS_PATH: {
            "get": {
                "operationId": "docsRedirect",
                "summary": f"Redirects to {DOCS_PATH}/ (a relative Location)",
                "tags": ["service"],
                "security": [],
                "responses": {"308": {"description": f"to {DOCS_PATH}/"}},
            }
        },
        SPEC_PATH: {
            "get": {
                "operationId": "openapi",
                "summary": "This document",
                "tags": ["service"],
                **public,
                "responses": {"200": {"description": "OpenAPI 3.1", "content": {"application/json": {}}}},
            }
        },
    }
    return {
        "openapi": "3.1.0",
        "info": {
            "title": "vsrq",
            "version": version("vsrq"),
            "summary": "Video super-resolution jobs (Kandinsky 6 VSR), in SGLang's /v1/videos shape",
            "description": "Send the API key as `Authorization: Bearer <key>`. A key sees only its own jobs and "
            "uploads. Errors are RFC 9457 problem+json with a stable `code`. Every answer carries `X-Request-Id`: "
            "quote it when you report a problem. Try it in the web app at `/`.",
        },
        "tags": [
            {"name": "videos", "description": "super-resolution jobs"},
            {"name": "uploads", "description": "videos stored for later jobs"},
            {"name": "models", "description": "the models served"},
            {"name": "service", "description": "health, metrics and this document"},
            {"name": "webhooks", "description": "what a job's end sends to its `webhook_url`"},
        ],
        # relative: the API serves this document itself, so its own origin is the server (a deployment's public URL
        # is not in its settings)
        "servers": [{"url": "/", "description": "the API that serves this document"}],
        "security": [{"bearer": []}],
        "paths": _with_request_id(paths),
        "webhooks": {event: {"post": _webhook(event, summary)} for event, summary in _WEBHOOKS.items()},
        "components": {
            "schemas": schemas,
            "headers": {REQUEST_ID_HEADER: _REQUEST_ID_HEADER},
            "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer", "description": "an API key"}},
        },
    }


@blueprint.get(SPEC_PATH)
def openapi_json() -> Response:
    cached = current_app.extensions.setdefault("vsrq.openapi", {})
    if "document" not in cached:  # settings are fixed for the app's life: build once per process
        cached["document"] = document(services().settings)
    return jsonify(cached["document"])


_SWAGGER_DIST = Path(flask_swagger_ui.__file__).parent / "dist"
_STATIC = Path(__file__).parent / "static"
# Swagger UI sets style attributes from its scripts, hence 'unsafe-inline' for styles (never for scripts).
DOCS_CSP = (
    "default-src 'self'; script-src 'self'; style-src 'self' 'unsafe-inline'; img-src 'self' data:; "
    "connect-src 'self'; object-src 'none'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'"
)
docs = Blueprint("docs", __name__)


@docs.get(DOCS_PATH)
def docs_redirect() -> Response:
    # relative: an absolute URL would be built from the request's Host header
    return Response(status=308, headers={"Location": f"{DOCS_PATH}/"})


@docs.get(f"{DOCS_PATH}/")
def docs_page() -> Response:
    return send_from_directory(_STATIC, "docs.html")


@docs.get(f"{DOCS_PATH}/<path:filename>")
def docs_asset(filename: str) -> Response:
    return send_from_directory(_SWAGGER_DIST, filename)


@docs.after_request
def _docs_headers(response: Response) -> Response:
    response.headers.update(
        {"Content-Security-Policy": DOCS_CSP, "Referrer-Policy": "no-referrer", "X-Content-Type-Options": "nosniff"}
    )
    return response


def register(app: Flask) -> None:
    app.register_blueprint(blueprint)
    app.register_blueprint(docs)
