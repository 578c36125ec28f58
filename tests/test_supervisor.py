"""infra/supervisor.py on real processes: one that dies is started again after its backoff; one that keeps dying is
given up, loudly; a stop says what it waits for."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from infra.stack import stop_processes
from infra.supervisor import Supervisor


def _python(code: str):
    return lambda: subprocess.Popen([sys.executable, "-c", code])


def test_a_killed_process_is_started_again_and_one_that_keeps_exiting_is_given_up(capfd):
    supervisor = Supervisor(max_restarts=3, window_s=30, every_s=0.02, backoff_s=(0.1, 0.2))
    try:
        first = supervisor.add("sleeper", _python("import time; time.sleep(60)"))
        supervisor.add("crasher", _python("raise SystemExit(3)"))
        os.kill(first.pid, signal.SIGKILL)
        deadline = time.monotonic() + 10
        while supervisor.processes["sleeper"].pid == first.pid or "crasher" not in supervisor.gave_up:
            assert time.monotonic() < deadline, (supervisor.processes, supervisor.gave_up)
            time.sleep(0.02)
        assert supervisor.processes["sleeper"].poll() is None and "crasher" not in supervisor.processes
        err = capfd.readouterr().err
        assert "sleeper exited (-9); restarting in 0.1 s" in err
        assert "crasher exited 4 times within 30 s (last exit 3): gave up on it" in err
    finally:
        for process in supervisor.stop().values():
            process.kill()
            process.wait()
        supervisor.close()


def test_a_stop_says_what_it_waits_for_and_what_it_killed():
    """Ctrl-C on `vsrq dev` with a long job running: 30 s with nothing said after "stopping", then the worker killed
    without a word (a chaos trial). What still runs two seconds into a stop is named, with the time left, and what
    was killed is returned (`vsrq dev` says it)."""
    said: list[str] = []
    processes = {
        "web": subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"]),  # stops on SIGTERM
        "worker": subprocess.Popen([sys.executable, "-c", "import signal, time; signal.signal(signal.SIGTERM, "
                                    "signal.SIG_IGN); print('up', flush=True); time.sleep(60)"],
                                   stdout=subprocess.PIPE, text=True),  # fmt: skip
    }
    processes["worker"].stdout.readline()  # its handler is set
    worker = processes["worker"]
    started = time.monotonic()
    killed = stop_processes(processes, 4, said.append)
    assert 4 <= time.monotonic() - started < 7 and processes == {} and worker.returncode == -signal.SIGKILL
    assert (said, killed) == (["waiting up to 2 s more for worker to stop"], ["worker"]), said
