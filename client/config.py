"""The client's settings, from its environment: a plain module, since the client installs without pydantic-settings
(the service's settings are storage/config.py's). A command-line option overrides each."""

from __future__ import annotations

import os

DEFAULT_API_URL = "http://127.0.0.1:8000"


def api_url() -> str:
    """VSRQ_API_URL: the API's base URL."""
    return os.environ.get("VSRQ_API_URL") or DEFAULT_API_URL


def token() -> str | None:
    """VSRQ_TOKEN: the API key the client sends as its bearer token."""
    return os.environ.get("VSRQ_TOKEN") or None


def service_bucket() -> str:
    """VSRQ_S3_BUCKET: the service's bucket, whose uploads `vsrq bulk` references by key instead of copying."""
    return os.environ.get("VSRQ_S3_BUCKET", "vsrq")
