"""The job service's tests run against the real things: Redis and SeaweedFS started by infra.stack, and the API served
by gunicorn on loopback, all for the session. Each test makes its own jobs, under its own API key where it lists."""

from __future__ import annotations

import base64
import json
import os
import random
import secrets
import signal
import struct
import subprocess
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from unittest import mock

import pytest
import redis
import requests

from infra.stack import S3_CONFIG, Stack, free_ports
from storage.blobs import S3BlobStore
from storage.config import Settings
from storage.jobs import JobStore

ROOT = Path(__file__).resolve().parents[2]
MiB = 1024 * 1024
# Small limits, so that the tests cross them with small files: an 11 MiB upload limit over 5 MiB parts means a
# refused upload has already sent parts (a real multipart upload to abort).
UPLOAD_LIMIT = 11 * MiB
PART = 5 * MiB
NAMES = ("alice", "bob", "carol", "dave", "erin", "fuzz", "web", "bulk", "parts")
KEYS = {name: f"sk-test-{name}-{'0' * 16}" for name in NAMES}
# Standard Webhooks secrets: whsec_ + base64 of 32 bytes
WEBHOOK_SECRETS = {name: "whsec_" + base64.b64encode(f"hooks of {name}".ljust(32).encode()).decode() for name in KEYS}
MODELS = {"k6-vsr": "vsrq.k6", "lanczos": "vsrq.cpu"}
# The environment of every worker process the tests start: one OpenMP thread. Workers, the test process and the other
# pytest process share the machine's cores (2 in CI), where torch's OpenMP threads, one per core in each worker, spin
# waiting for each other: two lanczos jobs on the long clip of the fault tests took 11.7 s side by side with the
# default, 5.9 s with one thread each, the same bytes out. (Only the workers: one thread doubled the in-process compile
# tests' time.)
WORKER_THREADS = {"OMP_NUM_THREADS": "1"}
# Bytes no demuxer reads, which pass the upload's checks (text, a song, a photo are refused as they arrive): a job on
# them fails `input_unreadable` at the worker's probe. Seeded: FFmpeg finds sound in about 1 noise file of 150.
UNREADABLE = random.Random(0).randbytes(20_000)


def vsrq(service_env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    """The `vsrq` command, as an operator on this machine runs it against this stack."""
    return subprocess.run(
        [sys.executable, "-m", "client.cli", *args],
        cwd=ROOT, env={**os.environ, **service_env}, capture_output=True, text=True, timeout=60,
    )  # fmt: skip


# More SeaweedFS identities: one that may read and list but not write (a policy without PutObject), one that may not
# list (without ListBucket)
READ_ONLY = {"VSRQ_S3_ACCESS_KEY": "vsrq-read-only", "VSRQ_S3_SECRET_KEY": "read-only-secret-for-loopback-only"}
NO_LIST = {"VSRQ_S3_ACCESS_KEY": "vsrq-no-list", "VSRQ_S3_SECRET_KEY": "no-list-secret-for-loopback-only"}


def embedded_stack(root: Path) -> Stack:
    """The embedded stack, its SeaweedFS also knowing the `READ_ONLY` and `NO_LIST` keys."""
    config = json.loads(S3_CONFIG.read_text())
    for name, key, actions in (("read-only", READ_ONLY, ["Read", "List"]), ("no-list", NO_LIST, ["Read", "Write"])):
        credentials = [{"accessKey": key["VSRQ_S3_ACCESS_KEY"], "secretKey": key["VSRQ_S3_SECRET_KEY"]}]
        config["identities"].append({"name": name, "actions": actions, "credentials": credentials})
    (root / "s3.json").write_text(json.dumps(config))
    return Stack(root / "data", s3_config=root / "s3.json")


@pytest.fixture(scope="session")
def stack(tmp_path_factory) -> Iterator[Stack]:
    with embedded_stack(tmp_path_factory.mktemp("stack")) as running:
        yield running


@pytest.fixture(scope="session")
def service_env(stack: Stack) -> dict[str, str]:
    """The VSRQ_* settings of the API under test (and of anything else the tests start against it)."""
    keys = [{"id": name, "token": token, "webhook_secret": WEBHOOK_SECRETS[name]} for name, token in KEYS.items()]
    return {
        **stack.env(),
        "VSRQ_API_KEYS": json.dumps(keys),
        "VSRQ_MODELS": json.dumps(MODELS),
        "VSRQ_MAX_UPLOAD_BYTES": str(UPLOAD_LIMIT),
        "VSRQ_S3_PART_BYTES": str(PART),
        "VSRQ_FETCH_ALLOW_LOOPBACK": "true",  # input URLs served by the tests' own HTTPS origin (test_url_input.py)
        # One key here sends what many users would (200 uploads at once in test_load.py): the per-key defaults are
        # raised; the limits themselves are tested with keys of their own (tests/reliability/test_hostile.py).
        "VSRQ_RATE_LIMIT_REQUESTS": "1000000",
        "VSRQ_MAX_CONCURRENT_BODIES_PER_KEY": "1000",
    }


@pytest.fixture(scope="session")
def settings(service_env: dict[str, str]) -> Settings:
    with mock.patch.dict(os.environ, service_env):  # read exactly as the API reads them
        return Settings(_env_file=None)


@pytest.fixture(scope="session")
def api_log(tmp_path_factory) -> Path:
    """gunicorn's output for `api`: the API's log lines (JSON, the default format)."""
    return tmp_path_factory.mktemp("gunicorn") / "gunicorn.log"


@pytest.fixture(scope="session")
def api(service_env: dict[str, str], api_log: Path) -> Iterator[str]:
    """The API under gunicorn, as the Procfile runs it: its base URL."""
    with serve_api(service_env, api_log) as url:
        yield url


@contextmanager
def serve_api(service_env: dict[str, str], log: Path) -> Iterator[str]:
    """gunicorn serving the API with these settings on a free loopback port, its output in `log`: its base URL."""
    port = free_ports(1)[0]
    env = {
        **os.environ,
        **service_env,
        "VSRQ_BIND": f"127.0.0.1:{port}",
        "VSRQ_WEB_WORKERS": "2",
        "VSRQ_WEB_THREADS": "4",
    }
    with open(log, "wb") as out:
        server = subprocess.Popen(
            [sys.executable, "-m", "gunicorn", "--config", "infra/gunicorn.conf.py", "api.app:create_app()"],
            cwd=ROOT, env=env, stdout=out, stderr=subprocess.STDOUT,
        )  # fmt: skip
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            assert server.poll() is None, f"gunicorn exited:\n{log.read_text()}"
            try:
                if requests.get(f"{url}/healthz", timeout=5).status_code in (200, 503):
                    break
            except (requests.ConnectionError, requests.Timeout):  # still starting (or a busy CI machine)
                assert time.monotonic() < deadline, f"gunicorn not answering:\n{log.read_text()}"
            time.sleep(0.2)
        yield url
    finally:
        server.terminate()
        server.wait(30)


@pytest.fixture(scope="session")
def redis_client(stack: Stack) -> redis.Redis:
    return redis.Redis.from_url(stack.redis_url)


@pytest.fixture(scope="module")
def queue(request, redis_client) -> Iterator[str]:
    """A Celery queue of the test module's own (vsrq.{module}-{random}), deleted after it."""
    name = f"vsrq.{request.module.__name__.rsplit('.', 1)[-1].removeprefix('test_')}-{secrets.token_hex(3)}"
    yield name
    redis_client.delete(name)


@pytest.fixture(scope="session")
def jobs(redis_client: redis.Redis, settings: Settings) -> JobStore:
    return JobStore(redis_client, result_ttl_s=settings.result_ttl_s, max_attempts=settings.max_attempts)


@pytest.fixture(scope="session")
def s3(settings: Settings) -> S3BlobStore:
    return S3BlobStore.from_settings(settings)


@pytest.fixture(scope="session")
def clip(tmp_path_factory) -> bytes:
    """A real MP4 (H.264, 9 frames of 48x32)."""
    from worker.media.synthetic import write_clip

    return write_clip(tmp_path_factory.mktemp("clip") / "clip.mp4", 9, (32, 48)).read_bytes()


def as_a_shell_starts_it() -> None:
    """A `preexec_fn`: Ctrl-C (SIGINT) handled by default and not blocked, as a shell starts a command. A test
    process's own state, which a library in it may have changed (CI saw SIGINT not reach a child), must not decide
    whether an interrupt reaches the command under test."""
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def log_lines(log: Path, request_id: str) -> list[dict]:
    """The API's JSON log lines that carry `request_id`: gunicorn writes its access line once the answer is sent."""
    deadline = time.monotonic() + 5
    while True:
        lines = [json.loads(line) for line in log.read_text().splitlines() if line.startswith("{")]
        found = [line for line in lines if line.get("request_id") == request_id]
        if found or time.monotonic() > deadline:
            return found
        time.sleep(0.05)


def padded(video: bytes, size: int) -> bytes:
    """`video` (an MP4) grown to `size` bytes by a `free` box, MP4's own padding: a larger real file to upload."""
    padding = size - len(video) - 8
    return video + struct.pack(">I4s", 8 + padding, b"free") + bytes(padding)


def auth(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {KEYS[name]}"}


def broker_messages(redis_client: redis.Redis, queue: str) -> list[dict]:
    """The Celery messages waiting in a queue on the Redis broker, decoded: {task, id, args, kwargs}."""
    messages = []
    for raw in redis_client.lrange(queue, 0, -1):
        envelope = json.loads(raw)
        args, kwargs, _ = json.loads(base64.b64decode(envelope["body"]))
        messages.append(
            {"task": envelope["headers"]["task"], "id": envelope["headers"]["id"], "args": args, "kwargs": kwargs}
        )
    return messages
