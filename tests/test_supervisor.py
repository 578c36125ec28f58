"""infra/supervisor.py on real processes: one that dies is started again after its backoff; one that keeps dying is
given up, loudly."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

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
