"""Standard Webhooks v1 signatures: the `whsec_` secrets, `sign` (what our deliveries carry) and `verify` (what a
receiver runs on the raw body and headers).

    webhook-id          stable across retries: receivers dedupe on it
    webhook-timestamp   Unix seconds: a message further than TOLERANCE_S from the receiver's clock is refused
    webhook-signature   space-separated `v1,<base64 HMAC-SHA256(key, "{id}.{timestamp}.{body}")>`, one per secret

This module needs only the standard library: receivers may copy it whole.
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import time
from collections.abc import Iterable, Mapping
from secrets import token_bytes

SECRET_PREFIX = "whsec_"
TOLERANCE_S = 300  # Standard Webhooks' default: a message more than 5 min older (or newer) than the clock is refused


class InvalidSecret(ValueError):
    pass


class WebhookVerificationError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code  # missing_headers, invalid_timestamp, stale_timestamp, no_matching_signature


def secret_key(secret: str) -> bytes:
    """The HMAC key of a `whsec_<base64>` secret; raises `InvalidSecret` for anything else."""
    if not secret.startswith(SECRET_PREFIX):
        raise InvalidSecret(f"must start with {SECRET_PREFIX!r}")
    try:
        key = base64.b64decode(secret[len(SECRET_PREFIX) :], validate=True)
    except binascii.Error:
        raise InvalidSecret(f"must be {SECRET_PREFIX!r} followed by standard base64") from None
    if not 24 <= len(key) <= 64:
        raise InvalidSecret(f"must hold 24 to 64 random bytes (this one holds {len(key)})")
    return key


def new_secret() -> str:
    return SECRET_PREFIX + base64.b64encode(token_bytes(32)).decode()


def sign(secret: str, msg_id: str, timestamp: int, body: bytes) -> str:
    """One `v1,<base64 HMAC-SHA256>` signature of `{id}.{timestamp}.{body}`."""
    signed = f"{msg_id}.{timestamp}.".encode() + body
    return "v1," + base64.b64encode(hmac.new(secret_key(secret), signed, hashlib.sha256).digest()).decode()


def signed_headers(secrets: Iterable[str], msg_id: str, timestamp: int, body: bytes) -> dict[str, str]:
    """The three headers; one signature per secret, so that receivers rotating their secret accept either."""
    return {
        "webhook-id": msg_id,
        "webhook-timestamp": str(timestamp),
        "webhook-signature": " ".join(sign(secret, msg_id, timestamp, body) for secret in secrets),
    }


def verify(
    payload: bytes, headers: Mapping[str, str], secrets: Iterable[str], tolerance: float = TOLERANCE_S
) -> None:
    """Checks a received webhook: its raw body, its headers (any case), and the secrets it may be signed with (the
    current and, while rotating, the previous). Raises `WebhookVerificationError` unless one of its `v1` signatures
    matches one of the secrets and its timestamp is within `tolerance` seconds of this machine's clock."""
    lowered = {name.lower(): value for name, value in headers.items()}
    msg_id, stamp, signatures = (lowered.get(f"webhook-{name}") for name in ("id", "timestamp", "signature"))
    if not (msg_id and stamp and signatures):
        raise WebhookVerificationError("missing_headers", "webhook-id, webhook-timestamp and webhook-signature needed")
    try:
        timestamp = int(stamp)
    except ValueError:
        raise WebhookVerificationError("invalid_timestamp", "webhook-timestamp is not a Unix time") from None
    if abs(time.time() - timestamp) > tolerance:
        raise WebhookVerificationError("stale_timestamp", "webhook-timestamp is too far from now (a replay?)")
    received = {signature.removeprefix("v1,") for signature in signatures.split() if signature.startswith("v1,")}
    for secret in secrets:
        expected = sign(secret, msg_id, timestamp, payload).removeprefix("v1,")
        if any(hmac.compare_digest(expected.encode(), candidate.encode()) for candidate in received):  # constant time
            return
    raise WebhookVerificationError("no_matching_signature", "no signature matches the secret")
