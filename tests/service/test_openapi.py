"""The OpenAPI document against the live API under gunicorn: valid OpenAPI 3.1, every route documented, Swagger UI
served from this API alone, and Schemathesis driving every operation (valid and invalid requests) with no 5xx and
every response conforming to the document."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import requests
from openapi_spec_validator import validate

from api.app import create_app
from api.schemas import JobOptions, UpscaleParams
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
        for method in rule.methods - {"HEAD", "OPTIONS"}
    }
    documented = {(path, method) for path, item in document["paths"].items() for method in item}
    assert served - documented == set(), "routes missing from api/openapi.py"
    assert documented - served == set(), "documented routes that do not exist"


def test_requests_are_described_by_the_models_the_api_validates_with(document, settings):
    schemas = document["components"]["schemas"]
    fields = set(UpscaleParams.model_fields) | set(JobOptions.model_fields)
    assert fields <= set(schemas["VideoCreateForm"]["properties"]) & set(schemas["VideoCreateJson"]["properties"])
    assert {"upload_id", "input_key"} <= set(schemas["VideoCreateJson"]["properties"])
    assert schemas["VideoCreateForm"]["required"] == ["video_reference"]
    assert schemas["VideoCreateForm"]["properties"]["model"]["enum"] == list(settings.models)
    assert schemas["VideoCreateJson"]["properties"]["sr_resolution_scale"]["enum"] == [2, 2.25, 4]
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
