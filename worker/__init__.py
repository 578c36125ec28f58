"""vsrq GPU worker: the SR engine (`worker.sr`) and, around it, the job runner."""
