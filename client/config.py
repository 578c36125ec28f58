"""The client's settings, from its environment: a plain module, since the client installs without pydantic-settings
(the service's settings are storage/config.py's). A command-line option overrides each; with neither, the running
`vsrq dev` stack's (client.devstate)."""

from __future__ import annotations

import os

from client import devstate

DEFAULT_API_URL = "http://127.0.0.1:8000"


def api_url() -> str:
    """VSRQ_API_URL: the API's base URL."""
    return os.environ.get("VSRQ_API_URL") or _dev_stack().get("url") or DEFAULT_API_URL


def token() -> str | None:
    """VSRQ_TOKEN: the API key the client sends as its bearer token (the dev stack's only when the URL is its own)."""
    if os.environ.get("VSRQ_TOKEN"):
        return os.environ["VSRQ_TOKEN"]
    stack = _dev_stack()
    return stack.get("token") if stack and api_url() == stack.get("url") else None


def dev_api(directory: str | None, token: str | None = None) -> tuple[str, str | None] | None:
    """The URL of the `vsrq dev` stack running on `directory` (its jobs and keys: another stack's are not these), and
    the key to use there (`token`, else VSRQ_TOKEN, else the stack's); read afresh, so a stack started again on
    another port is found. None while it does not run."""
    stack = _dev_stack()
    if not stack.get("url") or stack.get("dir") != directory:
        return None
    return stack["url"], token or os.environ.get("VSRQ_TOKEN") or stack.get("token")


def dev_stack_directory() -> str | None:
    """The directory of the dev stack whose URL the client uses (nothing else names one), else None."""
    stack = _dev_stack()
    return None if os.environ.get("VSRQ_API_URL") or not stack.get("url") else stack.get("dir")


def _dev_stack() -> dict:
    return devstate.read() or {}


def service_bucket() -> str:
    """VSRQ_S3_BUCKET: the service's bucket, whose uploads `vsrq bulk` references by key instead of copying."""
    return os.environ.get("VSRQ_S3_BUCKET", "vsrq")
