"""storage.logs: one JSON object per line with the job id while a job is in hand, text for people, no secrets."""

from __future__ import annotations

import io
import json
import logging

import pytest

from storage.logs import configure, job_context


@pytest.fixture
def lines():
    root = logging.getLogger()
    handlers, level = root.handlers[:], root.level
    stream = io.StringIO()

    def read(log_format: str, secrets: tuple[str, ...] = ()) -> list[str]:
        configure(log_format, "INFO", secrets)
        root.handlers[0].setStream(stream)
        log = logging.getLogger("vsrq.test")
        log.info("before")
        with job_context("video_abc"):
            log.info("fetching https://s3/x?X-Amz-Credential=AK%%2F1&X-Amz-Signature=%s&a=1", "deadbeef")
            log.warning("token %s, header Bearer sk-live-1234567890abcdef, secret whsec_QUJD+/==", "sk-configured-0123")
        log.info("after", extra={"job_id": "video_given"})
        return stream.getvalue().splitlines()

    yield read
    root.handlers[:] = handlers
    root.setLevel(level)


def test_json_lines_carry_the_job_id_and_no_secret(lines):
    records = [json.loads(line) for line in lines("json", ("sk-configured-0123",))]
    assert [record.get("job_id") for record in records] == [None, "video_abc", "video_abc", "video_given"]
    assert "job_id" not in records[0] and {"time", "level", "logger", "message"} <= set(records[0])
    text = "\n".join(record["message"] for record in records)
    for secret in ("deadbeef", "AK%2F1", "sk-live-1234567890abcdef", "QUJD", "sk-configured-0123"):
        assert secret not in text
    assert "X-Amz-Signature=[redacted]&a=1" in text and "Bearer [redacted]" in text


def test_text_lines_for_people(lines):
    text = lines("text")
    assert text[0].endswith("INFO vsrq.test: before") and " vsrq.test [video_abc]: fetching" in text[1]
