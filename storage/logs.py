"""Logs of the API, the workers and the reaper: one line per record on stderr, JSON (`VSRQ_LOG_FORMAT=json`, the
default: what a log pipeline parses) or text (`text`: the dev stack, for people), with the job id on every line logged
while a job is in hand and no secret on any line.

python-json-logger rather than structlog: every process here logs through the standard library already (gunicorn,
Celery, botocore, our `logging.getLogger` calls), and a formatter on the root handler makes all of them JSON without
changing one call site; structlog would need the same stdlib bridge to reach gunicorn's and Celery's lines.

    with job_context(job_id): ...   # every line logged inside carries "job_id"
"""

from __future__ import annotations

import logging
import logging.config
import re
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Literal

from pythonjsonlogger.json import JsonFormatter

from storage.config import Settings

LogFormat = Literal["json", "text"]
current_job: ContextVar[str | None] = ContextVar("vsrq_job_id", default=None)
current_request: ContextVar[str | None] = ContextVar("vsrq_request_id", default=None)

# Secrets that could reach a message through an URL, a header or an error: shown as [redacted].
_PATTERNS = (
    re.compile(r"(?i)(bearer\s+)\S+"),
    re.compile(r"(whsec_)[A-Za-z0-9+/=_-]+"),
    re.compile(r"(?i)((?:x-amz-signature|x-amz-credential|x-amz-security-token|signature)=)[^&\s\"']+"),
    re.compile(r"(?i)(webhook-signature[\"']?\s*[:=]\s*[\"']?)[^\s\"',]+"),
)


@contextmanager
def job_context(job_id: str | None) -> Iterator[None]:
    token = current_job.set(job_id)
    try:
        yield
    finally:
        current_job.reset(token)


def redact(text: str, secrets: Iterable[str] = ()) -> str:
    for secret in secrets:
        text = text.replace(secret, "[redacted]")
    for pattern in _PATTERNS:
        text = pattern.sub(r"\1[redacted]", text)
    return text


class ContextFilter(logging.Filter):
    """On the handler, so it sees every record that reaches it (a logger's filter misses its children's): adds
    `job_id` and `request_id` and renders the message once, without secrets. `secrets` are the configured ones,
    redacted verbatim."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        super().__init__()
        self.secrets = tuple(secret for secret in secrets if secret)

    def filter(self, record: logging.LogRecord) -> bool:
        if getattr(record, "job_id", None) is None:
            record.job_id = current_job.get()
        if getattr(record, "request_id", None) is None:
            record.request_id = current_request.get()
        record.msg, record.args = redact(record.getMessage(), self.secrets), None
        if record.exc_info and not record.exc_text:  # a traceback can quote a URL or a header too
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info), self.secrets)
        return True


class JsonLineFormatter(JsonFormatter):
    def __init__(self) -> None:
        super().__init__(
            "%(asctime)s %(levelname)s %(name)s %(message)s",
            rename_fields={"asctime": "time", "levelname": "level", "name": "logger"},
            timestamp=False,
        )

    def add_fields(self, log_data: dict[str, Any], record: logging.LogRecord, message_dict: dict[str, Any]) -> None:
        super().add_fields(log_data, record, message_dict)
        for name in ("job_id", "request_id"):  # lines about no job carry no "job_id": null
            if log_data.get(name) is None:
                log_data.pop(name, None)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__("%(asctime)s %(levelname)s %(name)s%(job)s%(request)s: %(message)s")

    def format(self, record: logging.LogRecord) -> str:
        job_id, request_id = getattr(record, "job_id", None), getattr(record, "request_id", None)
        record.job = f" [{job_id}]" if job_id else ""
        record.request = f" [{request_id}]" if request_id else ""
        return super().format(record)


def dict_config(log_format: LogFormat, level: str = "INFO", secrets: Iterable[str] = ()) -> dict[str, Any]:
    """A `logging.config.dictConfig` dict: the root logger and gunicorn's two (which do not propagate) on one stderr
    handler. gunicorn takes it as `logconfig_dict` (infra/gunicorn.conf.py)."""
    formatter = JsonLineFormatter if log_format == "json" else TextFormatter
    return {
        "version": 1,
        "disable_existing_loggers": False,
        "filters": {"context": {"()": ContextFilter, "secrets": list(secrets)}},
        "formatters": {"line": {"()": formatter}},
        "handlers": {
            "stderr": {"class": "logging.StreamHandler", "formatter": "line", "filters": ["context"]},
        },
        "root": {"level": level, "handlers": ["stderr"]},
        "loggers": {
            name: {"level": level, "handlers": ["stderr"], "propagate": False}
            for name in ("gunicorn.error", "gunicorn.access")
        },
    }


def configure(log_format: LogFormat, level: str | int = "INFO", secrets: Iterable[str] = ()) -> None:
    """Replaces the root logger's handlers with the one line-per-record stderr handler."""
    level = logging.getLevelName(level) if isinstance(level, int) else level.upper()
    logging.config.dictConfig(dict_config(log_format, level, secrets))


def settings_secrets(settings: Settings) -> list[str]:
    """The secrets the settings hold: API tokens, webhook signing secrets, the S3 secret key."""
    found = [settings.s3_secret_key]
    for key in settings.api_keys:
        found += [key.token, key.webhook_secret]
    return [secret.get_secret_value() for secret in found if secret is not None]
