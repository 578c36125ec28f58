"""The `vsrq` commands that run or read the service on this machine: demo, dev (the embedded stack), status and events
(client/cli.py defines their arguments and imports this module when one runs)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import TYPE_CHECKING
from urllib.parse import urlsplit

if TYPE_CHECKING:  # imported where a command runs: `vsrq --help` needs neither
    from storage.config import Settings
    from storage.jobs import JobStore
    from storage.overview import Running


def demo(args: argparse.Namespace) -> int:
    """The main job end to end on the embedded stack: a generated clip with audio goes in over the API, a job runs
    on a CPU worker with a tiny random checkpoint, the MP4 comes back."""
    from client.http import Client
    from infra.dev import DevStack, StackUnavailable, claim
    from worker.media.synthetic import write_clip
    from worker.sr.checkpoint import write_tiny

    try:
        held = claim(args.dir)  # before its files are written: another demo may be reading them
    except StackUnavailable as error:
        print(f"vsrq demo: {error.code}: {error.message}", file=sys.stderr)
        return 2
    with held:
        model = args.dir / "tiny-checkpoint"
        if not (model / "model_index.json").exists():
            write_tiny(model, "piflow", True, 0)
            print(f"wrote a tiny random piflow checkpoint to {model}")
        source = write_clip(args.dir / "input.mp4", num_frames=33, size=(64, 96), audio_codec="aac")
        print(f"generated {source} (96x64, 33 frames, stereo tone)")
        with DevStack(args.dir / "stack", str(model)) as stack:
            print(f"stack up: Redis, SeaweedFS, API {stack.url}, a CPU worker, the reaper (logs in {stack.root})")
            api = Client(stack.url, stack.token)
            job = api.create_from_file(source, {"sr_resolution_scale": "2"})  # SGLang's request form, unchanged
            print(f"POST /v1/videos -> {job['id']} {job['status']}")
            job = api.wait(job["id"], poll_s=0.5, on_update=lambda job: print(
                f"  {job['status']:<11} {job.get('stage') or '':<10} {job['progress']:3d} %"))  # fmt: skip
            if job["status"] != "completed":
                print(f"vsrq: the job ended {job['status']}: {job.get('error')}", file=sys.stderr)
                return 1
            output = api.download(job["id"], args.dir / "output-x2.mp4", sha256=job["output"]["sha256"])
        print(f"{output}: {json.dumps(job['output'])}")
        return 0


def status(args: argparse.Namespace) -> int:
    """Read from the Redis that VSRQ_REDIS_URL names (unset: the running `vsrq dev` stack's), as the API reads it
    (storage.overview)."""
    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from storage.blobs import open_blob_store
    from storage.overview import overview, storage_problem
    from storage.workers import WorkerRegistry

    settings, jobs = _job_store()
    redis = jobs.redis
    try:
        now = overview(
            jobs,
            WorkerRegistry(redis, ttl_s=settings.worker_ttl_s),
            settings.models,
            settings.reaper_stale_s,
            running=True,
        )
    except (RedisConnectionError, RedisTimeoutError) as error:
        print(f"vsrq: redis_unavailable: {_unreachable(settings, error)}", file=sys.stderr)
        return 1
    # what /healthz checks beside Redis (api/health.py): jobs cannot be sent nor their outputs read without it, and
    # writes too (a key that may only read). S3 only (a local store's check would make its directory here), with short
    # timeouts: a status is read at once
    if settings.blob_backend == "s3":
        try:
            open_blob_store(settings.model_copy(update={"s3_timeout_s": 3.0})).check(write=True)
        except Exception as error:
            now.health.problems.append(f"storage: {storage_problem(error)}")
    if args.json:
        print(now.model_dump_json(indent=2))
        return 0
    seconds = WorkerRegistry(redis).now()
    health = now.health
    reaper = f"{health.reaper_last_pass_s:.0f}s ago" if health.reaper_last_pass_s is not None else "never"
    print(f"health   {'ok' if health.ok else 'degraded: ' + '; '.join(health.problems)}")
    print(f"reaper   last pass {reaper}  jobs past their lease {health.overdue_jobs}")
    print("queues   " + "  ".join(f"{queue} {depth}" for queue, depth in now.queues.items()))
    print("jobs     " + "  ".join(f"{status} {count}" for status, count in now.jobs.items()))
    print(f"workers  {len(now.workers)}")
    for worker in now.workers:
        runs = f"{worker.model} on {','.join(worker.devices)}" if worker.model else "no model"
        gpus = f" ({', '.join(worker.gpus)})" if worker.gpus else ""
        job = _job(now.running, worker.job, seconds)
        print(f"  {worker.name}  {','.join(worker.queues)}  {runs}{gpus}  job {job}  "
              f"beat {seconds - worker.heartbeat_at:.0f}s ago")  # fmt: skip
    return 0


def _job(running: dict[str, Running], job_id: str | None, now: float) -> str:
    """`video_… upscaling 45 % attempt 2, running 13s (3m10s since its first), about 4m05s left`: how far a worker's
    job got (its record may have gone); the time is this attempt's."""
    job = running.get(job_id)
    if job is None:
        return job_id or "-"
    began = job.attempt_started_at or job.started_at
    since = f", running {_clock(now - began)}" if began else ""
    if job.attempt > 1 and job.started_at and began != job.started_at:
        since += f" ({_clock(now - job.started_at)} since its first)"
    left = f", about {_clock(job.eta - now)} left" if job.eta else ""
    return f"{job_id} {job.stage or 'starting'} {job.progress} % attempt {job.attempt}{since}{left}"


def _clock(seconds: float) -> str:
    minutes, seconds = divmod(max(0, int(seconds)), 60)
    hours, minutes = divmod(minutes, 60)
    return f"{hours}h{minutes:02d}m" if hours else f"{minutes}m{seconds:02d}s" if minutes else f"{seconds}s"


def dev(args: argparse.Namespace) -> int:
    import signal

    from client import devstate
    from infra.dev import DevStack, StackUnavailable

    stack = DevStack(args.dir, args.model, args.devices, args.port)
    try:
        stack.start()  # not `with stack`: entering would start it a second time, on the port it now holds
    except StackUnavailable as error:
        print(f"vsrq dev: {error.code}: {error.message}", file=sys.stderr)
        return 2
    try:
        print(
            f"vsrq dev: API {stack.url}, serving {stack.served} (worker: {args.model} on {args.devices}), logs in "
            f"{stack.root}\n"
            f"  export VSRQ_TOKEN={stack.token}\n"
            f"  export VSRQ_API_URL={stack.url} OPENAI_BASE_URL={stack.url}/v1 OPENAI_API_KEY=$VSRQ_TOKEN\n"
            f"  export OPENAI_WEBHOOK_SECRET={stack.secret}  # webhooks are signed with it: OpenAI().webhooks.unwrap\n"
            "No key is needed from this machine (auth is off on loopback): SGLang's request works as is,\n"
            f'  curl -sS --fail-with-body {stack.url}/v1/videos -F "video_reference=@IN.mp4;type=video/mp4" '
            "-F sr_resolution_scale=2\n"
            f"{_found_by(devstate.read(), stack.url)}\n"
            "Ctrl-C stops everything.",
            flush=True,
        )
        try:
            signal.pause()
        except KeyboardInterrupt:
            print("vsrq dev: stopping", flush=True)
    finally:
        stack.stop()
    return 0


def _found_by(anywhere: dict | None, url: str) -> str:
    """What finds this stack: the user's state file, or (another stack's there) only the exports above."""
    from client import devstate

    if anywhere is not None and anywhere.get("url") != url:
        return (f"`vsrq status` and `vsrq bulk` find the other `vsrq dev` ({anywhere.get('url')}) by themselves: "
                "export the lines above for this one.")  # fmt: skip
    return f"`vsrq status` and `vsrq bulk` find this stack by themselves ({devstate.user_path()})."


def events(args: argparse.Namespace) -> int:
    """A job's whole history for an operator, from the Redis that VSRQ_REDIS_URL names (unset: the running `vsrq
    dev` stack's): every event as stored, the workers' names and each attempt's timings (`run`) included, which the
    owner's GET /v1/videos/{id}/events leaves out."""
    from datetime import UTC, datetime

    from redis.exceptions import ConnectionError as RedisConnectionError
    from redis.exceptions import TimeoutError as RedisTimeoutError

    from storage.jobs import JobNotFound

    settings, jobs = _job_store()
    try:
        job = jobs.require(args.job_id)
        history = jobs.events(args.job_id)
    except JobNotFound:
        kept = f"ended jobs are kept {settings.result_ttl_s} s"
        print(f"vsrq: job_not_found: no job {args.job_id} ({kept})", file=sys.stderr)
        return 2
    except (RedisConnectionError, RedisTimeoutError) as error:
        print(f"vsrq: redis_unavailable: {_unreachable(settings, error)}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps([event.model_dump(mode="json") for event in history], indent=2))
        return 0
    print(f"{job.id}  owner {job.owner}  {job.model} on {job.queue}  {job.status}  attempt {job.attempt}")
    for event in history:
        at = datetime.fromtimestamp(event.at, UTC).strftime("%H:%M:%S.%f")[:-3]
        since = event.at - history[0].at
        detail = json.dumps(event.detail, separators=(",", ":")) if event.detail else ""
        print(f"  {at}  +{since:8.3f}s  #{event.attempt}  {event.type:<16} {event.status:<11} {detail}")
    return 0


def _unreachable(settings: Settings, error: Exception) -> str:
    """Why the stack's Redis does not answer, and what to do: as `vsrq bulk` says of an API that does not."""
    from redis.exceptions import AuthenticationError

    from storage.overview import redis_problem
    from storage.primary import FailedOver, Unwritable

    url = urlsplit(settings.redis_url)
    shown = url._replace(netloc=url.netloc.rpartition("@")[2]).geturl() if "@" in url.netloc else settings.redis_url
    if isinstance(error, FailedOver):  # it answers, as a replica: its endpoint has not moved to the new primary yet
        return (f"{shown} reaches a replica ({error}): a failover is under way (try again once its endpoint has "
                "moved), or VSRQ_REDIS_URL names a replica, not the primary")
    if isinstance(error, AuthenticationError):  # it answers: it is up
        return f"{shown} {redis_problem(error)}: the password or user there is not the service's"
    if isinstance(error, Unwritable):
        return f"{error}: free memory there, or raise its maxmemory"
    return (
        f"{shown} does not answer ({error}): is the stack up? `vsrq dev` starts one here (and these commands find "
        "it); VSRQ_REDIS_URL names another"
    )


def _job_store() -> tuple[Settings, JobStore]:
    """The settings and job store of the service this machine reaches (`_dev_stack_env`)."""
    from storage.config import Settings
    from storage.jobs import JobStore

    _dev_stack_env()
    settings = Settings()
    return settings, JobStore.from_settings(settings)


def _dev_stack_env() -> None:
    """With no VSRQ_REDIS_URL, the running `vsrq dev` stack's settings (client.devstate); what is set wins."""
    from client import devstate

    if os.environ.get("VSRQ_REDIS_URL"):
        return
    state = devstate.read()
    if state is not None:
        for name, value in state["env"].items():
            os.environ.setdefault(name, value)
