"""gunicorn settings for the API (`web` in the Procfile). Threads, not more processes: requests mostly wait on
Redis, S3 and the network, and an upload holds its thread for as long as the client takes to send the file."""

import os
import resource
import shutil
import signal
from pathlib import Path

from infra.children import die_with_parent
from storage.config import Settings, loopback_host, say_unknown_variables
from storage.held_dirs import held_directory
from storage.logs import dict_config, settings_secrets

METRICS_PREFIX = "vsrq-api-metrics-"  # not the "vsrq-metrics-" of releases before: theirs have no lock to read

_settings = Settings()  # VSRQ_BIND, VSRQ_WEB_WORKERS, VSRQ_WEB_THREADS among them
bind = _settings.bind
workers = _settings.web_workers
worker_class = "api.gunicorn_worker.ProblemWorker"  # gthread, answering its own errors as problem+json
threads = _settings.web_threads
keepalive = _settings.web_keepalive_s
# Idle kept-alive connections pile up to `worker_connections`: one accept() past the open-file limit (EMFILE) kills the
# worker and its requests. So the soft limit goes up to the hard one, with room below it for the threads' own files.
_hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
try:
    resource.setrlimit(resource.RLIMIT_NOFILE, (_hard, _hard))
except (ValueError, OSError):  # an unlimited hard limit above the kernel's nr_open: the soft one stays
    pass
_files = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
_files = 1 << 20 if _files == resource.RLIM_INFINITY else _files
worker_connections = max(threads, min(1000, _files - 64 - 4 * threads))
timeout = 120  # a worker process silent this long is restarted; streaming requests keep it alive
graceful_timeout = 60
# One listening socket, the master's, shared by its workers, not one each (SO_REUSEPORT: a HUP reset connections
# queued on a stopping worker's, a USR2 master had none to take over, a second server shared the address unsaid).
# A master killed with SIGKILL cannot stop its workers, which would keep the socket: each dies with it (post_fork).
reuse_port = False
# gunicorn's control socket (`gunicornc`) has one default path per user, which every API on the machine took in turn,
# and the first to exit deleted; its signals (HUP, TERM, TTIN, TTOU) do the same work
control_socket_disable = True
accesslog = "-"
logger_class = "api.request_id.AccessLog"  # the access line carries the request id
errorlog = "-"
logconfig_dict = dict_config(_settings.log_format, _settings.log_level, settings_secrets(_settings))

# /metrics (api/metrics.py) sums the samples that every worker process writes to this directory (prometheus-client's
# multiprocess mode). Set here, before the workers fork and import prometheus_client; emptied at start, since the
# files of a previous run would be summed in. One made here goes when the master exits (on_exit). A HUP's reload
# reads the variable again; a master USR2 re-executes gets gunicorn's environment from before this file first ran,
# so it makes one of its own, unless a HUP came before (then it shares this one, hence on_exit's test).
# Held (storage.held_dirs), so that the next API started in this temporary directory removes it where the master was
# killed (SIGKILL, the OOM killer) and on_exit never ran; inherited by a re-executed master, which may use it.
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    _made, _held = held_directory(METRICS_PREFIX)
    os.set_inheritable(_held, True)
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = os.environ["_VSRQ_METRICS_DIR"] = str(_made)


def when_ready(server) -> None:
    """Auth off (VSRQ_AUTH=none) serves loopback only: checked again on the addresses gunicorn binds, since a `--bind`
    on the command line overrides VSRQ_BIND, which storage/config.py checked."""
    if _settings.auth != "none" or _settings.auth_none_public:
        return
    exposed = [
        f"{address[0] or '*'}:{address[1]}"
        for address in server.cfg.address
        if not isinstance(address, str | bytes) and not loopback_host(address[0])  # a str: a unix socket
    ]
    if exposed:
        server.log.error(
            "VSRQ_AUTH=none refused on %s: bind to loopback, configure VSRQ_API_KEYS, or set "
            "VSRQ_AUTH_NONE_PUBLIC=true if a gate in front of the API authenticates",
            ", ".join(exposed),
        )
        server.halt("auth off on a public address", exit_status=1)


def on_starting(server) -> None:
    say_unknown_variables(server.log)
    metrics_dir = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    metrics_dir.mkdir(parents=True, exist_ok=True)
    for stale in metrics_dir.glob("*.db"):
        stale.unlink()


def on_exit(server) -> None:
    # Not where a master re-executed by USR2 goes on: it may hold the same directory (after a HUP, gunicorn's saved
    # environment names it), which would be deleted under it; one it made of its own goes at the next start
    made = os.environ.get("_VSRQ_METRICS_DIR")
    if made and made == os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not server.reexec_pid:
        shutil.rmtree(made, ignore_errors=True)


def post_fork(server, worker) -> None:
    # A master killed hard (its own parent-death signal, an OOM kill) takes its workers with it. SIGKILL, not a
    # graceful SIGTERM: a stopping worker keeps the listening socket open while it finishes (up to graceful_timeout),
    # and a new master could not bind it meanwhile.
    die_with_parent(signal.SIGKILL, server.pid)


def post_worker_init(worker) -> None:
    # Each worker process starts its health checks now: started by the first /healthz, that caller would wait for them
    from api.health import monitor

    monitor(worker.wsgi)
