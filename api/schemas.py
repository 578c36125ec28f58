"""What a create request may say, validated with pydantic.

SGLang's K6 SR server takes the same SR fields under the same names and defaults, so its requests work unchanged: the
generic generation fields it also accepts (a prompt, frame counts...) mean nothing to super-resolution and are
ignored, as SGLang ignores them for this model. What we never do is read a path on the server's disk.
"""

from __future__ import annotations

import json
import re
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, ValidationError, field_validator

from api.body import parse_json
from api.errors import ApiError, field_errors

SCALES = (2.0, 2.25, 4.0)
_TARGET = re.compile(r"(hd|fullhd|2k|(\d+)x(\d+))")

# Accepted by SGLang's /v1/videos for every model, meaningless for SR.
SGLANG_IGNORED = frozenset(
    {
        "prompt", "negative_prompt", "n", "num_outputs_per_prompt", "seconds", "size", "fps", "num_frames",
        "generator_device", "guidance_scale", "guidance_scale_2", "true_cfg_scale", "max_sequence_length",
        "flow_shift", "enable_teacache", "quality", "output_quality", "output_compression",
    }
)  # fmt: skip
# Paths on the server's disk, which SGLang reads or writes: refused.
SERVER_PATHS = frozenset(
    {"video_path", "output_path", "perf_dump_path", "upscaling_model_path", "frame_interpolation_model_path"}
)
REFERENCES = ("upload_id", "input_key", "video_url")  # a JSON create names its input with exactly one


def _https(url: str) -> str:
    if not url.startswith("https://"):
        raise ValueError("must be an https:// URL")
    return url


HttpsUrl = Annotated[str, Field(max_length=2048), AfterValidator(_https)]


class UpscaleParams(BaseModel):
    """SGLang's SR fields (same names, same defaults) and our output options: what the worker runs with."""

    model_config = ConfigDict(extra="forbid")

    sr_resolution_scale: float = Field(2.25, json_schema_extra={"enum": list(SCALES)})  # checked by _scale
    sr_tiles_batch_size: int = Field(1, ge=1, le=64)
    sr_tile_min_overlap: float = Field(0.2, ge=0.0, lt=1.0)
    sr_target_resolution: str | None = Field(
        None, description="hd, fullhd, 2k or WxH (e.g. 1280x720): downscale after SR, never up"
    )
    sr_target_resize_mode: Literal["fit", "exact"] = "fit"
    num_inference_steps: int | None = Field(None, ge=1, le=64)  # None: the model's own (2 for the distilled one)
    seed: int = Field(42, ge=0, lt=2**63)
    output_codec: Literal["h264", "hevc", "av1"] = "h264"
    output_crf: int = Field(18, ge=0, le=63)

    @field_validator("sr_resolution_scale")
    @classmethod
    def _scale(cls, scale: float) -> float:
        if scale not in SCALES:
            raise ValueError(f"must be one of 2, 2.25 or 4, got {scale:g}")
        return scale

    @field_validator("sr_target_resolution")
    @classmethod
    def _target(cls, target: str | None) -> str | None:
        if target is None or not target.strip():
            return None
        match = _TARGET.fullmatch(target.strip().lower())
        if not match or (match[2] and min(int(match[2]), int(match[3])) < 2):
            raise ValueError("must be hd, fullhd, 2k or WxH (e.g. 1280x720)")
        return match[0]


class JobOptions(BaseModel):
    """Our extras: which model, where to call back, the caller's own labels."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    webhook_url: HttpsUrl | None = None
    metadata: dict[str, str] = Field(default_factory=dict, max_length=16)

    @field_validator("metadata", mode="before")
    @classmethod
    def _metadata_json(cls, value: Any) -> Any:
        if isinstance(value, str):  # a multipart form carries it as JSON text
            try:
                return parse_json(value, "`metadata`") if value.strip() else {}
            except json.JSONDecodeError:
                raise ValueError("must be a JSON object of strings") from None
        return value

    @field_validator("metadata")
    @classmethod
    def _metadata_size(cls, metadata: dict[str, str]) -> dict[str, str]:
        if any(len(key) > 64 or len(value) > 512 for key, value in metadata.items()):
            raise ValueError("keys are at most 64 characters, values at most 512")
        return metadata


class CreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    params: UpscaleParams
    options: JobOptions
    upload_id: str | None = Field(None, pattern=r"^upload_[0-9a-f]{24}$")
    input_key: str | None = Field(None, max_length=1024)
    video_url: HttpsUrl | None = Field(
        None, description='an https URL the worker fetches the video from when the job runs ({"url": ...} too)'
    )
    _video_url_field: str = PrivateAttr("video_url")  # the name the caller gave it (SGLang: `input_reference`)

    @field_validator("video_url", mode="before")
    @classmethod
    def _url_part(cls, value: Any) -> Any:
        # OpenAI-style content parts name it {"url": ...}
        return value.get("url") if isinstance(value, dict) else value

    @property
    def video_url_field(self) -> str:
        """The name the caller gave the URL, for errors to use."""
        return self._video_url_field


class ListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    after: str | None = None
    limit: int = Field(20, ge=1)
    order: Literal["asc", "desc"] = "desc"
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"] | None = None


def create_request(fields: dict[str, Any], *, references: bool) -> CreateRequest:
    """Sorts a flat SGLang-style body into SR params, our options and (JSON only) the input reference.

    SGLang clients may nest fields in `extra_body` (a JSON object, or JSON text in a form); it is flattened first.
    """
    fields = dict(fields)
    for nested in ("extra_body", "extra_json"):
        extra = fields.pop(nested, None)
        if isinstance(extra, str):
            try:
                extra = parse_json(extra, f"`{nested}`")
            except json.JSONDecodeError:
                raise ApiError(400, "malformed_extra_body", f"`{nested}` is not valid JSON.") from None
        if extra is not None and not isinstance(extra, dict):
            raise ApiError(400, "malformed_extra_body", f"`{nested}` must be a JSON object.")
        fields = {**(extra or {}), **fields}

    url_field, reference = "video_url", fields.get("input_reference")
    if references and isinstance(reference, str) and "://" in reference:  # SGLang clients may name a URL there
        if "video_url" in fields:
            raise ApiError(422, "missing_video", "Name the input URL in one of `video_url` or `input_reference`.")
        fields["video_url"], url_field = fields.pop("input_reference"), "input_reference"
    paths = sorted(SERVER_PATHS & fields.keys())
    if paths or isinstance(fields.get("input_reference"), str):
        raise ApiError(
            422,
            "server_path_refused",
            "Inputs are never read from (nor outputs written to) paths on the server: upload the video "
            "(multipart `video_reference`, or POST /v1/uploads and then `upload_id`).",
            errors=[
                {"field": name, "code": "server_path_refused", "message": "not accepted"}
                for name in paths or ["input_reference"]
            ],
        )

    params = {name: value for name, value in fields.items() if name in UpscaleParams.model_fields}
    options = {name: value for name, value in fields.items() if name in JobOptions.model_fields}
    references_given = {name: value for name, value in fields.items() if references and name in REFERENCES}
    unknown = sorted(fields.keys() - params.keys() - options.keys() - references_given.keys() - SGLANG_IGNORED)
    if unknown:
        raise ApiError(
            422,
            "unknown_field",
            f"Unknown field(s): {', '.join(unknown)}.",
            errors=[{"field": name, "code": "unknown_field", "message": "not a field of this API"} for name in unknown],
        )
    # Optional fields that forms send empty mean "not given".
    params = {name: value for name, value in params.items() if value not in ("", None)}
    options = {name: value for name, value in options.items() if value not in ("", None)}
    try:
        create = CreateRequest.model_validate({"params": params, "options": options, **references_given})
    except ValidationError as error:
        errors = field_errors(error)
        for item in errors:  # name the field as the caller sent it, flat
            item["field"] = (item["field"] or "").removeprefix("params.").removeprefix("options.") or None
            if item["field"] == "video_url":
                item["field"] = url_field
        raise ApiError(422, "invalid_request", "The request has invalid fields: see `errors`.", errors=errors) from None
    create._video_url_field = url_field
    return create
