"""A key's hourly compute budget (storage/budget.py) on a real Redis, with a window of 2 s standing for the hour: a job
is charged once for its whole life, whichever attempt runs it and however late."""

from __future__ import annotations

import secrets
import time

from storage.budget import Budget

from .test_jobs import make

WINDOW_S = 2


def test_a_job_is_charged_once_however_late_it_is_retried(jobs, redis_client):
    """A job admitted and charged (0.6 of 1.0), retried within the window and again after it (a requeue that waited
    out a worker's death, then its turn): charged once. Its late attempt is not refused for the charges that came
    after it (it was admitted), and it takes nothing from the new window's room."""
    budget, owner = Budget(redis_client, window_s=WINDOW_S), "budget-" + secrets.token_hex(4)
    first, later, after = (make(jobs, owner) for _ in range(3))
    assert budget.charge(owner, first.id, 0.6, per_hour=1.0) == 0  # attempt 1
    assert budget.charge(owner, first.id, 0.6, per_hour=1.0) == 0  # attempt 2, within the window
    assert budget.used(owner)[0] == 0.6
    time.sleep(WINDOW_S + 0.2)
    assert budget.used(owner)[0] == 0  # the charge left the window
    assert budget.charge(owner, later.id, 0.6, per_hour=1.0) == 0  # a new job fills the new window
    assert budget.charge(owner, first.id, 0.6, per_hour=1.0) == 0  # attempt 3 of the first: admitted long ago
    assert budget.used(owner)[0] == 0.6  # the new job alone
    assert budget.charge(owner, after.id, 0.3, per_hour=1.0) == 0  # room is what the new job left
