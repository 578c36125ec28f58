"""Processes of the service dying and coming back (issue 27): a gunicorn master killed with SIGKILL mid-upload must
leave no worker holding its listening socket, so its replacement serves at once."""

from __future__ import annotations

import os
import signal
import socket
import time

import psutil

from infra.stack import free_ports

from . import processes
from .conftest import TOKENS


def test_a_killed_gunicorn_master_leaves_no_worker_holding_the_socket(rel_env, tmp_path):
    port = free_ports(1)[0]
    url = f"http://127.0.0.1:{port}"
    first = processes.serving(processes.api(rel_env, port, tmp_path).start(), url)
    workers = psutil.Process(first.pid).children()
    upload = socket.create_connection(("127.0.0.1", port), timeout=30)  # a long upload, in flight when it dies
    upload.sendall(
        f"POST /v1/uploads HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer {TOKENS['alice']}\r\n"
        f"Content-Type: multipart/form-data; boundary=b\r\nContent-Length: 5000000\r\n\r\n--b\r\n".encode()
    )
    time.sleep(0.5)
    killed = time.monotonic()
    os.kill(first.pid, signal.SIGKILL)  # the master alone, as the OOM killer would pick it
    second = processes.api(rel_env, port, tmp_path)
    try:
        _, alive = psutil.wait_procs(workers, timeout=5)
        workers_gone = time.monotonic() - killed
        processes.serving(second.start(), url, timeout_s=30)
        serving = time.monotonic() - killed
        print(f"FIGURE gunicorn master SIGKILLed mid-upload: its workers gone after {workers_gone:.2f} s "
              f"({len(alive)} left), the replacement serving {serving:.1f} s after the kill")
        assert not alive and serving < 10
    finally:
        upload.close()
        second.stop()
        for worker in workers:
            if worker.is_running():
                worker.kill()
