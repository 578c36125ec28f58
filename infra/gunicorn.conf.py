"""gunicorn settings for the API (`web` in the Procfile). Threads, not more processes: requests mostly wait on
Redis, S3 and the network, and an upload holds its thread for as long as the client takes to send the file."""

import errno
import os
import resource
import shutil
import signal
import tempfile
import time
from pathlib import Path

from infra.children import die_with_parent
from infra.ports import bind_error
from storage.config import Settings, loopback_host
from storage.logs import dict_config, settings_secrets

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
# A master killed with SIGKILL cannot stop its workers, which would keep the listening socket (and answer nothing
# new once their requests end): each worker dies with its master (post_fork), and the socket is opened with
# SO_REUSEPORT, so a new master binds at once even while an old worker is still finishing (a server that keeps the
# address is another matter: `_claim`).
reuse_port = True
# gunicorn's control socket (`gunicornc`) has one default path per user, which every API on the machine took in turn,
# and the first to exit deleted; its signals (HUP, TERM, TTIN, TTOU) do the same work
control_socket_disable = True
accesslog = "-"
logger_class = "api.request_id.AccessLog"  # the access line carries the request id
errorlog = "-"
logconfig_dict = dict_config(_settings.log_format, _settings.log_level, settings_secrets(_settings))

# /metrics (api/metrics.py) sums the samples that every worker process writes to this directory (prometheus-client's
# multiprocess mode). Set here, before the workers fork and import prometheus_client; emptied at start, since the
# files of a previous run would be summed in. One made here goes when the master exits (on_exit); the variable that
# says so is inherited, as the directory is, by a master re-executed with USR2 and read again on a HUP's reload.
if "PROMETHEUS_MULTIPROC_DIR" not in os.environ:
    os.environ["PROMETHEUS_MULTIPROC_DIR"] = tempfile.mkdtemp(prefix="vsrq-metrics-")
    os.environ["_VSRQ_METRICS_DIR"] = os.environ["PROMETHEUS_MULTIPROC_DIR"]


def when_ready(server) -> None:
    """Auth off (VSRQ_AUTH=none) serves loopback only: checked again on the addresses gunicorn binds, since a `--bind`
    on the command line overrides VSRQ_BIND, which storage/config.py checked. The configured addresses, not the
    master's sockets: with `reuse_port` each worker binds its own."""
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
    if not server.master_pid:  # a master re-executed by USR2 serves beside its predecessor's workers on purpose
        _claim(server)
    metrics_dir = Path(os.environ["PROMETHEUS_MULTIPROC_DIR"])
    metrics_dir.mkdir(parents=True, exist_ok=True)
    for stale in metrics_dir.glob("*.db"):
        stale.unlink()


def _claim(server) -> None:
    """That no other server holds an address this one serves (infra/ports.py: with `reuse_port` a second one would share
    it unsaid). Waited for up to 5 s: a master killed hard takes its workers, and their sockets, with it (post_fork),
    and a supervisor may start the next one at once."""
    served = []
    for address in server.cfg.address:
        if isinstance(address, str | bytes):  # a unix socket: gunicorn's own bind says if it is taken
            continue
        host, port = address[0], address[1]
        deadline = time.monotonic() + 5
        while (error := bind_error(host, port)) and error.errno == errno.EADDRINUSE and time.monotonic() < deadline:
            time.sleep(0.1)
        if error is not None:
            taken = "another server holds it" if error.errno == errno.EADDRINUSE else error.strerror
            server.log.error("Cannot serve on %s:%s: %s; stop it or set VSRQ_BIND to another address", host, port,
                             taken)  # fmt: skip
            server.halt("address unavailable", exit_status=1)
        served.append(f"{host or '*'}:{port}")
    # gunicorn's own "Listening at" names none: with `reuse_port` each worker binds, the master nothing
    server.log.info("Serving on %s", ", ".join(served) or "unix sockets")


def on_exit(server) -> None:
    # Not where a master re-executed by USR2 goes on: it may hold the same directory (after a HUP, gunicorn's saved
    # environment names it), which would be deleted under it; one it made of its own is left (an upgrade's, rare)
    made = os.environ.get("_VSRQ_METRICS_DIR")
    if made and made == os.environ.get("PROMETHEUS_MULTIPROC_DIR") and not server.reexec_pid:
        shutil.rmtree(made, ignore_errors=True)


def post_fork(server, worker) -> None:
    # A master killed hard (its own parent-death signal, an OOM kill) takes its workers with it. SIGKILL, not a
    # graceful SIGTERM: a stopping worker keeps its SO_REUSEPORT socket open while it finishes (up to
    # graceful_timeout), and the kernel would still hand it new connections that it no longer accepts.
    die_with_parent(signal.SIGKILL, server.pid)


def post_worker_init(worker) -> None:
    # Each worker process starts its health checks now: started by the first /healthz, that caller would wait for them
    from api.health import monitor

    monitor(worker.wsgi)
