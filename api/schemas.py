"""What a create request may say, validated with pydantic.

SGLang's K6 SR server takes the same SR fields under the same names and defaults, so its requests work unchanged.
Every other field SGLang's `/v1/videos` accepts is either honoured (an alias, a value that changes nothing) or refused
with a 422 that names it and says why: a generation-only knob silently dropped would let a user believe it ran. The
one exception is `prompt`, which OpenAI's SDK requires and SGLang's SR model ignores too. What we never do is read a
path on the server's disk. README's compatibility table lists every field.
"""

from __future__ import annotations

import json
import math
import re
import secrets
from typing import Annotated, Any, Literal

from pydantic import (
    AfterValidator, BaseModel, ConfigDict, Field, PrivateAttr, StrictInt, ValidationError, ValidationInfo,
    field_validator,
)
from pydantic_core import PydanticCustomError

from api.body import parse_json
from api.errors import ApiError, field_errors

SCALES = (2.0, 2.25, 4.0)
QUALITIES = ("lossless", "high")  # worker/sr/request.py's: the API never imports the worker
CRF_MAX = {"h264": 51, "hevc": 51, "av1": 63}  # worker/media/writer.py's: x264 would cap a higher CRF silently
MIN_SIDE = {"hevc": 64}  # worker/media/writer.py's: the least side x265 is run at (smaller crashed it)
_TARGET = re.compile(r"(hd|fullhd|2k|(\d+)x(\d+))")
_COLOUR = "#[0-9A-Fa-f]{6}"  # `background`
RANDOM_SEED = -1  # SGLang's "draw one": the drawn seed is what the job records and reports

# Accepted and ignored: OpenAI's SDK requires a prompt, and super-resolution is not conditioned on text (SGLang's K6
# SR ignores it as well).
SGLANG_IGNORED = frozenset({"prompt"})
# SGLang fields that mean nothing to super-resolution, and why: refused (422) unless the value asks for nothing.
_NOT_TEXT = "super-resolution is not conditioned on text"
_KEEPS_INPUT = "the output keeps the input's frames, frame rate and duration"
_NO_CFG = "the SR model runs without classifier-free guidance"
_NOT_OFFERED = "a generation-time option this service does not offer"
GENERATION_ONLY: dict[str, str] = {
    "negative_prompt": _NOT_TEXT,
    "max_sequence_length": _NOT_TEXT,
    "use_duration_template": _NOT_TEXT,
    "use_resolution_template": _NOT_TEXT,
    "use_system_prompt": _NOT_TEXT,
    "use_guardrails": _NOT_TEXT,
    "guardrails": _NOT_TEXT,
    "seconds": _KEEPS_INPUT,
    "fps": _KEEPS_INPUT,
    "num_frames": _KEEPS_INPUT,
    "size": "the output is the input's size times sr_resolution_scale; bound it with sr_target_resolution",
    "width": "the output is the input's size times sr_resolution_scale; bound it with sr_target_resolution",
    "height": "the output is the input's size times sr_resolution_scale; bound it with sr_target_resolution",
    "guidance_scale": _NO_CFG,
    "guidance_scale_2": _NO_CFG,
    "true_cfg_scale": _NO_CFG,
    "flow_shift": "the checkpoint's scheduler shift is part of its (distilled) schedule",
    "enable_teacache": "every denoising step runs (no TeaCache step skipping)",
    "n": "one output per job: send one job per seed",
    "num_outputs_per_prompt": "one output per job: send one job per seed",
    "enable_frame_interpolation": "frame interpolation is not offered: " + _KEEPS_INPUT,
    "frame_interpolation_exp": "frame interpolation is not offered: " + _KEEPS_INPUT,
    "frame_interpolation_scale": "frame interpolation is not offered: " + _KEEPS_INPUT,
    "enable_upscaling": "this service always upscales (SGLang's post-generation upscaler is its whole job)",
    "output_quality": "set the encoder's quality with output_crf (and output_codec)",
    "output_compression": "set the encoder's quality with output_crf (and output_codec)",
    "diffusers_kwargs": "the engine drives diffusers' model classes itself, not a pipeline call: name the SR fields",
    "generator_device": "the noise is drawn on the CPU from the seed, so a seed gives the same video on any device",
    "profile": "profiling is an operator's tool (bench/), not a request field",
    "num_profiled_timesteps": "profiling is an operator's tool (bench/), not a request field",
    "profile_all_stages": "profiling is an operator's tool (bench/), not a request field",
    "generate_sound": "the input's own audio is carried over unchanged",
    "sound_duration": "the input's own audio is carried over unchanged",
    "task": _NOT_OFFERED,
    "conditions": _NOT_OFFERED,
    "target": _NOT_OFFERED,
    "audio_flow_shift": _NOT_OFFERED,
    "condition_frame_indexes": _NOT_OFFERED,
    "condition_frame_indexes_vision": _NOT_OFFERED,
    "condition_video_keep": _NOT_OFFERED,
    "action_mode": _NOT_OFFERED,
    "domain_id": _NOT_OFFERED,
    "domain_name": _NOT_OFFERED,
    "raw_action_dim": _NOT_OFFERED,
    "action_fps": _NOT_OFFERED,
    "action": _NOT_OFFERED,
    "action_view_point": _NOT_OFFERED,
    "action_normalization": _NOT_OFFERED,
}
# Values of those fields that ask for nothing this service does not already do: accepted. SGLang's own defaults are
# among them, so that a client sending every field at its default (as `VideoGenerationsRequest().model_dump()` does)
# is served: frame interpolation's factor and scale mean nothing while it is off, as SGLang's SR ignores them then.
_NOOP = {
    "n": {"1"},
    "num_outputs_per_prompt": {"1"},
    "enable_teacache": {"false", "0"},
    "enable_frame_interpolation": {"false", "0"},
    "frame_interpolation_exp": {"1"},
    "frame_interpolation_scale": {"1"},
    # true: upscaling is what this service does; false: no post-generation upscaler on top, which none runs here
    "enable_upscaling": {"true", "1", "false", "0"},
    "output_quality": {"default"},  # the encoder's default quality: output_crf's default
    "seconds": {"4"},  # SGLang's and OpenAI's default, which SGLang's SR ignores too: the output keeps the input's
    "generator_device": {"cpu", "cuda"},
    "profile": {"false", "0"},
    "profile_all_stages": {"false", "0"},
    # 1: no guidance (diffusers' convention), SGLang's own default for K6 SR, which clients may send as they found it
    "guidance_scale": {"1"},
    "guidance_scale_2": {"1"},
    "true_cfg_scale": {"1"},
}
SGLANG_UPSCALING_SCALE = "4"  # `upscaling_scale`'s default in SGLang's request
# Paths on the server's disk, which SGLang reads or writes: refused (null or empty: not given).
SERVER_PATHS = frozenset(
    {"video_path", "output_path", "perf_dump_path", "upscaling_model_path", "frame_interpolation_model_path"}
)
# Names an input URL may come under: ours, SGLang's, and OpenAI's `input_reference` given as text.
URL_FIELDS = ("video_url", "reference_url", "input_reference", "video_path")
_UNSET_IF_EMPTY = SERVER_PATHS | set(URL_FIELDS)
NESTED = ("extra_body", "extra_json", "extra_params")  # objects whose fields are merged into the request
REFERENCES = ("upload_id", "input_key", "video_url")  # a JSON create names its input with exactly one


def _https(url: str) -> str:
    if not url.startswith("https://"):
        raise ValueError("must be an https:// URL")
    return url


HttpsUrl = Annotated[str, Field(max_length=2048), AfterValidator(_https)]


def _scales(schema: dict[str, Any]) -> None:
    """`sr_resolution_scale` is one of SCALES: said as numeric `const`s, not a float `enum`, which
    openapi-python-client cannot make a type of (it dropped both creates) while `2 | 2.25 | 4` is what TypeScript
    generators make of these."""
    del schema["type"]
    schema["anyOf"] = [{"type": "number", "const": int(scale) if scale.is_integer() else scale} for scale in SCALES]


class UpscaleParams(BaseModel):
    """SGLang's SR fields (same names, same defaults) and our output options: what the worker runs with."""

    model_config = ConfigDict(extra="forbid")

    sr_resolution_scale: float = Field(2.25, json_schema_extra=_scales)  # checked by _scale
    sr_tiles_batch_size: int = Field(1, ge=1, le=64)
    sr_tile_min_overlap: float = Field(0.2, ge=0.0, lt=1.0)
    sr_target_resolution: str | None = Field(
        None, description="hd, fullhd, 2k or WxH (e.g. 1280x720): downscale after SR, never up"
    )
    sr_target_resize_mode: Literal["fit", "exact"] = "fit"
    # None: the checkpoint's own (2 for the distilled pi-Flow one, 4 for flow matching; none for lanczos); the job's
    # output reports the steps that ran
    num_inference_steps: int | None = Field(None, ge=1, le=64)
    seed: int = Field(42, ge=RANDOM_SEED, lt=2**63, description="-1 draws a random seed, which the job then reports")
    output_codec: Literal["h264", "hevc", "av1"] = "h264"
    output_crf: int = Field(18, ge=0, le=63)
    deinterlace: Literal["frame", "field", "film"] = Field(
        "frame",
        description="an interlaced source (broadcast, DVD, DV, AVCHD 1080i) comes out progressive: a frame for each "
        "source frame (frame: 50i gives 25p), or for each field, at its own instant (field: 50i gives 50p, smoother "
        "motion, twice the frames to upscale); progressive sources are untouched either way. film: telecined film "
        "(an NTSC DVD or broadcast of a movie, 29.97i from 23.976p) gets its own frames back (inverse telecine: four "
        "of every five, 23.976p); soft-telecined film (pulldown flags) is read at 23.976p whatever this says",
    )
    background: str = Field(
        "#000000",
        json_schema_extra={"pattern": f"^{_COLOUR}$"},  # checked by `_background`, which says it in words
        description="what a source's transparent pixels (GIF, APNG, WebP, WebM, AVIF, ProRes 4444...) are shown over, "
        "as #RRGGBB: MP4 has no alpha. Black by default; dark line art on a transparent background wants #FFFFFF",
    )
    quality: Literal["lossless", "high"] = Field(
        "lossless",
        description="lossless: the exact engine (the default); high: faster, with FP8 arithmetic in the diffusion "
        "transformer, not bit-exact (README says what it changes and costs); the job's output.quality says what ran",
    )

    @field_validator("background")
    @classmethod
    def _background(cls, colour: str) -> str:
        if not re.fullmatch(_COLOUR, colour):
            raise PydanticCustomError("invalid_background", "must be a colour as #RRGGBB, e.g. #FFFFFF for white")
        return colour.lower()  # one spelling: the job's kept windows are named by it

    @field_validator("sr_resolution_scale")
    @classmethod
    def _scale(cls, scale: float) -> float:
        if scale not in SCALES:
            raise ValueError(f"must be one of 2, 2.25 or 4, got {scale:g}")
        return scale

    @field_validator("seed", mode="before")
    @classmethod
    def _random_seed(cls, seed: Any) -> Any:
        if seed == RANDOM_SEED or (isinstance(seed, str) and seed.strip() == str(RANDOM_SEED)):
            return secrets.randbelow(2**31)  # SGLang's range of drawn seeds
        return seed

    @field_validator("quality", mode="before")
    @classmethod
    def _quality(cls, quality: Any) -> Any:
        text = quality.strip().lower() if isinstance(quality, str) else quality
        if text not in QUALITIES:  # SGLang's and OpenAI's encoder-quality values land here too
            raise PydanticCustomError(
                "invalid_quality", "must be lossless or high (the encoder's quality is output_crf)"
            )
        return text

    @field_validator("output_codec")
    @classmethod
    def _codec_fits(cls, codec: str, info: ValidationInfo) -> str:
        """A box smaller than `codec` is written at refused now, not by the worker once the job has waited its turn."""
        target = _TARGET.fullmatch(info.data.get("sr_target_resolution") or "")
        least = MIN_SIDE.get(codec, 0)
        if target and target[2] and min(int(target[2]), int(target[3])) < least:
            raise ValueError(
                f"{codec} is written at {least}x{least} or more, and sr_target_resolution {target[0]} makes the output "
                "smaller: use h264 or av1, or a larger target"
            )
        return codec

    @field_validator("output_crf")
    @classmethod
    def _crf(cls, crf: int, info: ValidationInfo) -> int:
        codec = info.data.get("output_codec", "h264")  # validated before output_crf (declared before it)
        if crf > CRF_MAX[codec]:
            raise ValueError(f"must be 0 to {CRF_MAX[codec]} for {codec} (lower is better), got {crf}")
        return crf

    @field_validator("sr_target_resolution")
    @classmethod
    def _target(cls, target: str | None) -> str | None:
        if target is None or not target.strip() or target.strip().lower() in ("none", "null"):
            return None
        match = _TARGET.fullmatch(target.strip().lower())
        if not match or (match[2] and min(int(match[2]), int(match[3])) < 2):
            raise ValueError("must be hd, fullhd, 2k or WxH (e.g. 1280x720)")
        return match[0]


class JobOptions(BaseModel):
    """Our extras: which model, where to call back, the caller's own labels."""

    model_config = ConfigDict(extra="forbid")

    model: str | None = None
    webhook_url: HttpsUrl | None = Field(
        None,
        description="an https URL POSTed to once the job ends (the `webhooks` section), signed with the API key's "
        "webhook_secret (a key without one is refused: webhook_secret_missing); a public address only, no redirect "
        "followed; retried with backoff (8 attempts over 2-4 h by default) until it answers 2xx or 410",
    )
    metadata: dict[str, str] = Field(
        default_factory=dict,
        max_length=16,
        description="the caller's own labels, returned with the job: 16 at most, keys of 64 characters, values of 512",
    )

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


class DeclareUpload(BaseModel):
    """OpenAI's `uploads.create` body; `purpose` is kept and shown, nothing more (a video is what every upload is)."""

    model_config = ConfigDict(extra="forbid")

    bytes: StrictInt = Field(ge=1)
    filename: str = Field(min_length=1, max_length=1024, pattern=r"^[^\x00-\x1f\x7f]+$")  # a label: no controls
    mime_type: str = Field(max_length=255, pattern=r"^[\w.+-]+/[\w.+-]+$")  # type/subtype
    purpose: str | None = Field(None, max_length=64)


class CompleteUpload(BaseModel):
    model_config = ConfigDict(extra="forbid")

    part_ids: list[str] = Field(min_length=1)
    md5: str | None = Field(None, pattern=r"^[0-9a-fA-F]{32}$")


class ListQuery(BaseModel):
    model_config = ConfigDict(extra="forbid")

    after: str | None = None
    limit: int = Field(20, ge=1)
    order: Literal["asc", "desc"] = "desc"
    status: Literal["queued", "in_progress", "completed", "failed", "cancelled"] | None = None


def create_request(fields: dict[str, Any], *, references: bool) -> CreateRequest:
    """Sorts a flat SGLang-style body into SR params, our options and the input reference (`references`: the
    request names its input instead of carrying the file).

    Objects nested in `extra_body`, `extra_json` or `extra_params` (JSON objects, or JSON text in a form) are merged
    in first, the top-level fields winning as in SGLang; so are form fields named `name[key]`, the way OpenAI's SDK
    flattens a nested object into a multipart form.
    """
    fields = _merge_nested(_unflatten_form(fields))
    # SGLang's paths and input names left null or empty (a client sending its whole request model) name nothing
    fields = {name: value for name, value in fields.items() if value not in (None, "") or name not in _UNSET_IF_EMPTY}
    _reference_object(fields)
    _refuse_inline_or_listed(fields)
    url_field = _url_input(fields, references)
    paths = sorted(SERVER_PATHS & fields.keys())
    if paths or isinstance(fields.get("input_reference"), str):
        raise ApiError(
            422,
            "server_path_refused",
            "Inputs are never read from (nor outputs written to) paths on the server: upload the video "
            "(multipart `video_reference`, or POST /v1/uploads and then `upload_id`), or name an https URL.",
            errors=[
                {"field": name, "code": "server_path_refused", "message": "not accepted"}
                for name in paths or ["input_reference"]
            ],
        )
    if not references and any(fields.get(name) not in (None, "") for name in REFERENCES):
        raise ApiError(422, "two_videos", "Send the video once: as the multipart file, or by reference, not both.")
    _upscaling_scale(fields)
    _refuse_generation_only(fields)

    params = {name: value for name, value in fields.items() if name in UpscaleParams.model_fields}
    options = {name: value for name, value in fields.items() if name in JobOptions.model_fields}
    references_given = {name: value for name, value in fields.items() if references and name in REFERENCES}
    known = params.keys() | options.keys() | references_given.keys() | SGLANG_IGNORED | GENERATION_ONLY.keys()
    unknown = sorted(fields.keys() - known)
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
    references_given = {name: value for name, value in references_given.items() if value not in ("", None)}
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


_BRACKETS = re.compile(r"([^\[\]]+)((?:\[[^\[\]]*\])+)")


def _unflatten_form(fields: dict[str, Any]) -> dict[str, Any]:
    """`metadata[ref]=a` as {"metadata": {"ref": "a"}}: OpenAI's SDK sends nested objects in a form that way."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        match = _BRACKETS.fullmatch(name) if isinstance(name, str) else None
        if match is None:
            if isinstance(out.get(name), dict):
                raise ApiError(400, "malformed_form", f"`{name}` is sent both whole and as `{name}[...]` fields.")
            out[name] = value
            continue
        keys = [match[1], *re.findall(r"\[([^\[\]]*)\]", match[2])]
        node = out
        for key in keys[:-1]:
            node = node.setdefault(key, {})
            if not isinstance(node, dict):
                raise ApiError(400, "malformed_form", f"`{name}` nests under a field that is not an object.")
        if keys[-1] == "":  # `name[]`: a list, as the SDK sends arrays (`seed=[1, 2]`: SGLang's seeds, one output each)
            field = ".".join(keys[:-1])
            raise ApiError(
                422,
                "invalid_request",
                f"`{field}` is a list (sent as `{name}`): no field of this API takes one; send one job per value.",
                errors=[{"field": field, "code": "list_not_accepted", "message": "one value, not a list"}],
            )
        if keys[-1] in node:
            raise ApiError(400, "malformed_form", f"`{name}` is given twice.")
        node[keys[-1]] = value
    return out


def _merge_nested(fields: dict[str, Any]) -> dict[str, Any]:
    fields = dict(fields)
    for nested in NESTED:
        extra = fields.pop(nested, None)
        if isinstance(extra, str):
            try:
                extra = parse_json(extra, f"`{nested}`") if extra.strip() else None
            except json.JSONDecodeError:
                raise ApiError(400, "malformed_extra_body", f"`{nested}` is not valid JSON.") from None
        if extra is not None and not isinstance(extra, dict):
            raise ApiError(400, "malformed_extra_body", f"`{nested}` must be a JSON object.")
        fields = {**(extra or {}), **fields}
    if any(name in fields for name in NESTED):  # nested twice over: one level is what SGLang merges
        raise ApiError(400, "malformed_extra_body", f"`{'`, `'.join(NESTED)}` may not nest in each other.")
    return fields


def _reference_object(fields: dict[str, Any]) -> None:
    """OpenAI's `input_reference` object, {"image_url": an https URL} or {"file_id": an upload's id} (its SDK sends it
    in a form as `input_reference[image_url]`), as the URL or the `upload_id` it names."""
    reference = fields.get("input_reference")
    if not isinstance(reference, dict):
        return
    given = {name: value for name, value in reference.items() if value not in (None, "")}
    if len(given) != 1 or not given.keys() <= {"image_url", "file_id"} or not isinstance([*given.values()][0], str):
        raise ApiError(
            422,
            "invalid_request",
            "`input_reference` as an object names the video with one of `image_url` (an https URL) or `file_id` "
            "(the id POST /v1/uploads answered).",
            errors=[{"field": "input_reference", "code": "invalid_reference", "message": "one of image_url, file_id"}],
        )
    del fields["input_reference"]
    if "image_url" in given:
        fields["input_reference"] = given["image_url"]  # as SGLang's input_reference given as a URL
    elif fields.get("upload_id") not in (None, ""):
        raise ApiError(422, "missing_video", "Name the upload once: in `upload_id` or `input_reference.file_id`.")
    else:
        fields["upload_id"] = given["file_id"]


def _refuse_inline_or_listed(fields: dict[str, Any]) -> None:
    """A list of inputs, or a video inline as a `data:` URL, under a name that takes a URL or a path: each refused for
    what it is (without this, both fell through to "a path on the server"). Inline videos are refused rather than
    decoded: a JSON body is held whole in memory and capped at 1 MiB (base64 adds a third), while a file sent as
    multipart streams to storage up to the upload limit; OpenAI's SDK sends its `input_reference` file that way."""
    for name in URL_FIELDS:
        value = fields.get(name)
        if isinstance(value, list):
            raise ApiError(
                422,
                "invalid_request",
                f"`{name}` is a list: one job per video. Name one https URL, or upload the file.",
                errors=[{"field": name, "code": "list_not_accepted", "message": "one value, not a list"}],
            )
        if isinstance(value, str) and value.lstrip()[:5].lower() == "data:":
            raise ApiError(
                422,
                "data_url_not_accepted",
                f"`{name}` carries the video inline as a data: URL, which is not accepted: send the file as the "
                "multipart file `video_reference` (or POST /v1/uploads, then `upload_id`), or name an https URL.",
                errors=[{"field": name, "code": "data_url_not_accepted", "message": "send the file as multipart"}],
            )


def _url_input(fields: dict[str, Any], references: bool) -> str:
    """Moves an input URL given under SGLang's or OpenAI's names to `video_url`; returns the name it came under."""
    given = [
        name
        for name in URL_FIELDS
        if isinstance(fields.get(name), str)
        and fields[name].strip()
        and (name == "video_url" or "://" in fields[name])  # a URL, maybe of a refused scheme: then said so
    ]
    if len(given) > 1:
        raise ApiError(
            422, "missing_video", f"Name the input URL in one field, not in `{'` and `'.join(given)}`."
        )
    if not given:
        return "video_url"
    name = given[0]
    if not references:
        raise ApiError(422, "two_videos", f"Send the video once: as the multipart file, or in `{name}`, not both.")
    fields["video_url"] = fields.pop(name)
    return name


def _upscaling_scale(fields: dict[str, Any]) -> None:
    """SGLang's `upscaling_scale` (its post-generation upscaler's factor) as `sr_resolution_scale`."""
    scale = fields.pop("upscaling_scale", None)
    if scale in (None, ""):
        return
    if _plain(fields.get("enable_upscaling")) in ("false", "0"):
        # SGLang's upscaler off: its factor is inert at SGLang's default, and contradicts the request at another
        if _plain(scale) == SGLANG_UPSCALING_SCALE:
            return
        raise ApiError(
            422,
            "invalid_request",
            "`upscaling_scale` is set while `enable_upscaling` is false: send the scale as `sr_resolution_scale`.",
            errors=[{"field": "upscaling_scale", "code": "conflict", "message": "set while enable_upscaling is false"}],
        )
    if fields.get("sr_resolution_scale") not in (None, "") and str(fields["sr_resolution_scale"]) != str(scale):
        raise ApiError(
            422,
            "invalid_request",
            "`upscaling_scale` and `sr_resolution_scale` disagree: send one.",
            errors=[{"field": "upscaling_scale", "code": "conflict", "message": "disagrees with sr_resolution_scale"}],
        )
    fields["sr_resolution_scale"] = scale


def _refuse_generation_only(fields: dict[str, Any]) -> None:
    refused = [
        name
        for name in sorted(GENERATION_ONLY.keys() & fields.keys())
        if fields[name] not in (None, "") and _plain(fields[name]) not in _NOOP.get(name, set())
    ]
    if refused:
        raise ApiError(
            422,
            "generation_only_field",
            f"Field(s) for video generation, not super-resolution: {', '.join(refused)}. See `errors` for why.",
            errors=[
                {"field": name, "code": "generation_only_field", "message": GENERATION_ONLY[name]} for name in refused
            ],
        )


def _plain(value: Any) -> str | None:
    """A scalar as a form would spell it, to compare with the values that ask for nothing."""
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        return f"{value:g}" if math.isfinite(value) else None
    if isinstance(value, str):
        text = value.strip().lower()
        try:
            number = float(text)
        except ValueError:
            return text
        return f"{number:g}" if math.isfinite(number) and number == int(number) else text
    return None
