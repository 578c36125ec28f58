"""Bearer API keys from the settings. A key sees only its own jobs and uploads: the key's id owns what it creates.

With `VSRQ_AUTH=none` (the local dev stack) a request without a known key, or with any other bearer token (SGLang's
and OpenAI's clients send `EMPTY` or a placeholder), acts as the one anonymous owner (`Settings.anonymous_key`).
"""

from __future__ import annotations

import hashlib

from flask import g, request

from api.errors import ApiError
from api.services import services
from storage.config import ApiKey, Settings


def authenticate(settings: Settings) -> ApiKey:
    """The caller's key, also kept as `g.api_key`; 401 without a known bearer token."""
    scheme, _, token = request.headers.get("Authorization", "").partition(" ")
    limiter, address = services().limiter, request.remote_addr or "unknown"
    # a guess is not even checked while throttled; with auth off there is nothing to guess
    if token and settings.anonymous_key is None and (wait_s := limiter.guessing(address, settings)):
        raise _guessing(wait_s)
    key = (
        settings.keys_by_token_hash.get(hashlib.sha256(token.strip().encode()).digest())
        if scheme.lower() == "bearer"
        else None
    )
    if key is None:
        key = settings.anonymous_key
    if key is None:
        if token and (wait_s := limiter.failed(address, settings)):
            raise _guessing(wait_s)
        raise ApiError(
            401,
            "unauthorized",
            "Send a valid API key as `Authorization: Bearer <key>`.",
            headers={"WWW-Authenticate": 'Bearer realm="vsrq"'},
        )
    g.api_key = key
    return key


def _guessing(wait_s: int) -> ApiError:
    return ApiError(
        429,
        "too_many_failed_authentications",
        "Too many requests with an invalid API key from this address; retry after the pause.",
        headers={"Retry-After": str(wait_s)},
    )


def owner() -> str:
    """The id of the authenticated key: what its jobs are filed under."""
    return g.api_key.id


def admit_caller() -> None:
    """Every request of a blueprint that serves API keys: who is calling (401), and may they, now (429)."""
    svc = services()
    svc.limiter.admit(authenticate(svc.settings), svc.settings)
