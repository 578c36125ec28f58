"""The OpenAPI document against the live API under gunicorn: valid OpenAPI 3.1, every route documented, Swagger UI
served from this API alone, and Schemathesis driving every operation (valid and invalid requests) with no 5xx and
every response conforming to the document."""

from __future__ import annotations

import io
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import requests
from openapi_spec_validator import validate

from api.app import create_app
from api.schemas import JobOptions, UpscaleParams
from storage.blobs import attempt_output_key, upload_key
from storage.jobs import InputInfo, OutputInfo
from worker.media.synthetic import write_clip

from .conftest import KEYS, auth

HOOKS = Path(__file__).with_name("schemathesis_hooks.py")  # the examples carry a real video
FUZZ_KEY = "fuzz"  # a key of its own: the jobs Schemathesis creates are cancelled afterwards, and bother no one


@pytest.fixture(scope="module")
def document(api: str) -> dict:
    response = requests.get(f"{api}/openapi.json", timeout=30)
    assert response.status_code == 200 and response.headers["Content-Type"] == "application/json"
    return response.json()


def test_the_document_is_valid_openapi_3_1(document):
    assert document["openapi"] == "3.1.0"
    validate(document)  # raises with the offending path


def test_every_route_of_the_app_is_documented_with_its_methods(document, settings):
    app = create_app(settings)
    served = {
        (re.sub(r"<(?:\w+:)?(\w+)>", r"{\1}", rule.rule), method.lower())
        for rule in app.url_map.iter_rules()
        if not re.search(r"<(?:path:)?(?:path|filename)>", rule.rule)  # static assets
        for method in rule.methods - {"OPTIONS"}
    }
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    # Flask answers HEAD on every GET route: documented where a client has a use for it (a download's size and name)
    assert {route for route in served if route[1] != "head"} - documented == set(), "routes missing"
    assert documented - served == set(), "documented routes that do not exist"


def test_requests_are_described_by_the_models_the_api_validates_with(document, settings):
    schemas = document["components"]["schemas"]
    fields = set(UpscaleParams.model_fields) | set(JobOptions.model_fields)
    assert fields <= set(schemas["VideoCreateForm"]["properties"]) & set(schemas["VideoCreateJson"]["properties"])
    assert {"upload_id", "input_key"} <= set(schemas["VideoCreateJson"]["properties"])
    assert schemas["VideoCreateForm"]["required"] == ["video_reference"]
    assert schemas["VideoCreateForm"]["properties"]["model"]["enum"] == list(settings.models)
    scales = schemas["VideoCreateJson"]["properties"]["sr_resolution_scale"]["anyOf"]
    assert [kind["const"] for kind in scales] == [2, 2.25, 4]
    listing = {parameter["name"]: parameter for parameter in document["paths"]["/v1/videos"]["get"]["parameters"]}
    assert listing["limit"]["schema"]["maximum"] == settings.list_limit_max
    # every operation but the public pages needs the bearer key
    assert document["security"] == [{"bearer": []}]
    public = {path for path, item in document["paths"].items() for op in item.values() if op.get("security") == []}
    assert public == {"/", "/docs", "/docs/", "/openapi.json", "/healthz", "/livez", "/metrics"}


def test_every_answer_declares_its_request_id_and_every_operation_takes_the_clients(document, api):
    """Generated clients read `X-Request-Id` (the id to quote in a support ticket) only where the document declares it:
    on every response of every operation, and as a header a client may send."""

    def resolved(item: dict) -> dict:  # "#/components/headers/X-Request-Id"
        if "$ref" not in item:
            return item
        _, _, kind, name = item["$ref"].split("/")
        return document["components"][kind][name]

    for path, item in document["paths"].items():
        for method, operation in item.items():
            parameters = [resolved(parameter) for parameter in operation.get("parameters", [])]
            assert {"name": "X-Request-Id", "in": "header", "required": False} in [
                {name: parameter[name] for name in ("name", "in", "required")} for parameter in parameters
            ], (path, method)
            for status, response in operation["responses"].items():
                header = resolved(response.get("headers", {}).get("X-Request-Id", {"required": False}))
                assert header["required"], (path, method, status)
    # the header's declared shape holds both ids the API answers with: its own, and a sane one the client sent
    declared = document["paths"]["/healthz"]["get"]["responses"]["200"]["headers"]["X-Request-Id"]
    pattern = re.compile(resolved(declared)["schema"]["pattern"])
    own = requests.get(f"{api}/openapi.json", timeout=30).headers["X-Request-Id"]
    sent = requests.get(f"{api}/openapi.json", headers={"X-Request-Id": "trace-7f3a.1"}, timeout=30)
    assert pattern.search(own) and own.startswith("req_")
    assert sent.headers["X-Request-Id"] == "trace-7f3a.1" and pattern.search("trace-7f3a.1")
    assert not pattern.search("a b") and not pattern.search("x" * 129)


def test_the_docs_page_is_served_from_this_api_alone(api):
    page = requests.get(f"{api}/docs", timeout=30)  # redirected to /docs/
    assert page.status_code == 200 and "text/html" in page.headers["Content-Type"]
    assets = re.findall(r'(?:src|href)="([^"]+)"', page.text)
    # no inline script (the page's CSP allows none): its own script names the document
    assert "<script>" not in page.text and "script-src 'self'" in page.headers["Content-Security-Policy"]
    assert "/openapi.json" in requests.get(f"{api}/web/docs.js", timeout=30).text
    assert any(asset.endswith("swagger-ui-bundle.js") for asset in assets), assets
    for asset in assets:
        assert not re.match(r"(https?:)?//", asset), f"{asset} is fetched from another host"
        assert requests.get(f"{api}{asset}", timeout=30).status_code == 200, asset


def cancel_queued_jobs(api: str, key: str) -> int:
    """Jobs Schemathesis created wait in queues no worker of this module serves: cancelled, they leave the queues.
    Returns how many there were."""
    after, cancelled = None, 0
    while True:
        params = {"limit": 100, "status": "queued", **({"after": after} if after else {})}
        listing = requests.get(f"{api}/v1/videos", params=params, headers=auth(key), timeout=30).json()
        for job in listing["data"]:
            cancelled += requests.post(f"{api}/v1/videos/{job['id']}/cancel", headers=auth(key), timeout=30).ok
        if not listing["has_more"]:
            return cancelled
        after = listing["last_id"]


def test_schemathesis_finds_no_5xx_and_no_response_off_the_document(api, tmp_path):
    # The CLI, not the pytest plugin: the plugin's lazy schema loading does not run under pytest 9.
    checks = [
        "not_a_server_error",  # never a 5xx, whatever is sent
        "status_code_conformance",
        "content_type_conformance",
        "response_headers_conformance",
        "response_schema_conformance",
        "negative_data_rejection",  # what the document says is invalid is refused with a 4xx
    ]
    command = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{api}/openapi.json",
        "--header", f"Authorization: Bearer {KEYS[FUZZ_KEY]}",
        "--checks", ",".join(checks),
        "--max-examples", "10", "--generation-deterministic",  # the same requests on every run: CI stays stable
        "--workers", "1", "--request-timeout", "30", "--no-color", "--report-dir", str(tmp_path),
    ]  # fmt: skip
    write_clip(tmp_path / "clip.mp4", 9, (32, 48))
    hooks = {"SCHEMATHESIS_HOOKS": str(HOOKS), "VSRQ_FUZZ_VIDEO": str(tmp_path / "clip.mp4")}
    try:
        run = subprocess.run(command, capture_output=True, text=True, timeout=300, cwd=tmp_path,
                             env=os.environ | hooks)  # fmt: skip
    finally:
        created = cancel_queued_jobs(api, FUZZ_KEY)
    print(run.stdout[-3000:])
    assert run.returncode == 0, run.stdout[-20000:] + run.stderr[-5000:]
    assert created > 0, "no generated create was accepted: the document describes requests the API refuses"


# -- What client generators make of the document (openapi-python-client, openapi-typescript + openapi-fetch) ---------


def nodes(node: Any, where: str = "#") -> Iterator[tuple[str, dict]]:
    """Every object in the document, with its JSON pointer."""
    if isinstance(node, dict):
        yield where, node
        for key, value in node.items():
            yield from nodes(value, f"{where}/{key}")
    elif isinstance(node, list):
        for index, value in enumerate(node):
            yield from nodes(value, f"{where}/{index}")


def test_generated_types_are_what_a_client_writes(document):
    """What generators could not type, or typed as no client writes a value: a float enum made openapi-python-client
    drop both creates; a `type: null` property is dropped from openapi-typescript's types; a `const "null"` beside a
    form's number gave `number | null | "null"`; an enum or a field with no type came out `unknown`."""
    for where, node in nodes(document):
        if isinstance(node.get("enum"), list):
            assert "type" in node, f"{where}: an enum with no type"
            assert not any(isinstance(value, float) for value in node["enum"]), f"{where}: a float enum"
        assert node.get("const") != "null", f"{where}: the text null as a value"
    schemas = document["components"]["schemas"]
    for name, schema in schemas.items():
        nulls = [field for field, kind in schema.get("properties", {}).items() if kind.get("type") == "null"]
        assert nulls == [], f"{name}: {nulls} typed as null alone"
    for name in ("prompt", "remixed_from_video_id"):  # OpenAI's string | null; always null here
        assert [kind["type"] for kind in schemas["Video"]["properties"][name]["anyOf"]] == ["string", "null"]
    for body in ("VideoCreateJson", "VideoEditJson"):
        kinds = schemas[body]["properties"]["sr_resolution_scale"]["anyOf"]
        assert [(kind["type"], kind["const"]) for kind in kinds] == [("number", 2), ("number", 2.25), ("number", 4)]
    for form in ("VideoCreateForm", "VideoEditForm"):
        properties = schemas[form]["properties"]
        # a form's values are text: the scales as a form writes them (a number const broke the generated form writer)
        assert properties["sr_resolution_scale"]["enum"] == ["2", "2.25", "4"]
        untyped = [name for name, field in properties.items() if "type" not in field and "anyOf" not in field]
        assert untyped == [], f"{form}: no type for {untyped}"
    content = document["paths"]["/v1/videos/{job_id}/content"]["get"]["parameters"]
    [variant] = [parameter for parameter in content if parameter["name"] == "variant"]
    assert variant["schema"]["enum"] == ["video", "thumbnail", "spritesheet"]  # `0` is taken, not offered


# -- Every header and status the API really sends is declared ------------------------------------------------------

# Framing and the standard entity headers: every HTTP client reads them whatever the document says.
FRAMING = {"content-type", "content-length", "date", "server", "connection", "keep-alive", "transfer-encoding"}


@pytest.fixture(scope="module")
def completed(jobs, s3, tmp_path_factory) -> tuple[str, int]:
    """A completed job of erin's whose output is a real MP4 in SeaweedFS, promoted through the real state machine (as
    test_range.py's): (its id, the MP4's size)."""
    body = write_clip(tmp_path_factory.mktemp("openapi") / "out.mp4", 9, (32, 48)).read_bytes()
    job = jobs.create(
        owner="erin", model="lanczos", queue="vsrq.openapi-test", params={},
        input=InputInfo(key=upload_key("erin", "x")),
    )  # fmt: skip
    lease = jobs.lease(job.id, "openapi-test", lease_s=60)
    stored = s3.put(attempt_output_key(job.id, lease.attempt, lease.token), io.BytesIO(body), content_type="video/mp4")
    lease.complete(OutputInfo(key=stored.key, bytes=stored.size, sha256=stored.sha256))
    return job.id, len(body)


def off_the_document(document: dict, path: str, method: str, response: requests.Response) -> set[str]:
    """The headers `response` carries that its operation's answer of that status does not declare, and those it
    declares required that `response` lacks (or the status itself, where only `default` covers it)."""
    answers = document["paths"][path][method.lower()]["responses"]
    if str(response.status_code) not in answers:
        return {f"status {response.status_code}"}
    declared = answers[str(response.status_code)].get("headers", {})
    required = {name.lower() for name, header in declared.items() if header.get("required")}
    sent = {name.lower() for name in response.headers}
    return (sent - {name.lower() for name in declared} - FRAMING) | {f"no {name}" for name in required - sent}


def test_every_header_the_api_sends_is_declared(document, api, completed):
    job_id, size = completed
    content, erin = "/v1/videos/{job_id}/content", auth("erin")
    url = f"{api}/v1/videos/{job_id}/content"
    etag = requests.head(url, headers=erin, timeout=30).headers.get("ETag")
    many_headers = {f"X-Field-{number}": "1" for number in range(120)}
    sent = {
        "401": ("/v1/videos", requests.get(f"{api}/v1/videos", headers={"Authorization": "Bearer x"}, timeout=30)),
        "200": (content, requests.get(url, headers=erin, timeout=30)),
        "206": (content, requests.get(url, headers=erin | {"Range": "bytes=0-9"}, timeout=30)),
        "304": (content, requests.get(url, headers=erin | {"If-None-Match": str(etag)}, timeout=30)),
        "416": (content, requests.get(url, headers=erin | {"Range": f"bytes={size}-"}, timeout=30)),
        "HEAD 200": (content, requests.head(url, headers=erin, timeout=30)),
        "HEAD 206": (content, requests.head(url, headers=erin | {"Range": "bytes=0-9"}, timeout=30)),
        # gunicorn's refusals, before the app: a request line over its 4094 bytes, more than its 100 header fields
        "414": ("/v1/videos", requests.get(f"{api}/v1/videos?after={'x' * 5000}", headers=erin, timeout=30)),
        "431": ("/v1/videos", requests.get(f"{api}/v1/videos", headers=many_headers, timeout=30)),
    }  # fmt: skip
    for case, (path, response) in sent.items():
        assert str(response.status_code) == case.split()[-1], (case, response.status_code, response.text[:200])
        assert off_the_document(document, path, response.request.method, response) == set(), case
    # the HEAD tells a download's size and name without its bytes
    head = sent["HEAD 200"][1]
    assert head.content == b"" and int(head.headers["Content-Length"]) == size
    assert head.headers["Content-Disposition"] == f'attachment; filename="{job_id}.mp4"'
    # `0`, no longer offered in the document, is still the video
    assert requests.get(url, params={"variant": "0"}, headers=erin, timeout=30).headers["ETag"] == etag


# -- servers and webhooks ------------------------------------------------------------------------------------------


def test_the_document_names_its_server_and_the_webhooks_a_job_sends(document):
    """A `servers` entry (redocly lints its absence as an error) and the `webhooks` a job's end sends: what a real
    delivery carries is checked against them in test_webhooks.py (`..._sends_video_failed`)."""
    assert document["servers"] == [{"url": "/", "description": "the API that serves this document"}]
    assert set(document["webhooks"]) == {"video.completed", "video.failed", "video.cancelled"}
