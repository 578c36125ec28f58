"""When to try again: exponential backoff with jitter, never sooner than the other side's Retry-After. Webhook
deliveries (worker.webhooks) and inputs fetched by URL (worker.fetch, retried by worker.attempt) wait by it."""

from __future__ import annotations

import random
import re
import time
from email.utils import parsedate_to_datetime


def retry_after_s(header: str | None) -> float | None:
    """Retry-After as seconds from now: a number of seconds, or an HTTP date; None when absent or unreadable."""
    if not header:
        return None
    if seconds := re.fullmatch(r"[ \t]*([0-9]+)[ \t]*", header):  # str.isdigit takes "²", \s "\x1c": float() neither
        return float(seconds[1])
    try:
        return max(0.0, parsedate_to_datetime(header).timestamp() - time.time())
    except (TypeError, ValueError):
        return None


def backoff_s(attempt: int, base_s: float, max_s: float, retry_after: float | None = None) -> float:
    """Seconds until the attempt after `attempt` (1 for the first): base x 2^(attempt-1), at most `max_s`, of which a
    random half to whole (jitter: a server coming back up is not hit by every retry at once); never sooner than its
    Retry-After (itself capped at `max_s`)."""
    delay = min(max_s, base_s * 2 ** (attempt - 1)) * random.uniform(0.5, 1.0)
    if retry_after is not None:
        delay = max(delay, min(retry_after, max_s))
    return delay
