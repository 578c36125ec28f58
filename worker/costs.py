"""What a job may cost, from its key's settings (storage/config.py): output pixels per frame and megapixel-frames per
job (`Limits`, checked at probe time), and the key's megapixel-frames per hour (storage/budget.py), charged before
any work."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from storage.budget import Budget
from storage.jobs import JobRecord
from worker import service
from worker.media.errors import BudgetExceeded
from worker.media.limits import Limits


def job_limits(job: JobRecord, limits: Limits = Limits()) -> Limits:
    settings = service.settings()
    pixels, per_job, _ = settings.compute_limits(job.owner)
    seconds = settings.max_input_seconds
    return replace(
        limits,
        max_output_pixels=pixels,
        max_output_megapixel_frames=per_job,
        max_seconds=seconds,
        max_frames=None if seconds is None else max(limits.max_frames or 0, round(seconds * 60)),
    )


def charge(job: JobRecord) -> Callable[[float], None]:
    """What `UpscaleOptions.admit` calls with the job's cost: charges the key's hourly budget, or fails the job."""

    def admit(megapixel_frames: float) -> None:
        _, _, per_hour = service.settings().compute_limits(job.owner)
        if per_hour is None:
            return
        if megapixel_frames > per_hour:
            raise BudgetExceeded(
                f"the output would be {megapixel_frames:,.0f} megapixel-frames, more than this key's budget of "
                f"{per_hour:,.0f} per hour (megapixel_frames_per_hour)"
            )
        jobs = service.jobs()
        wait_s = Budget(jobs.redis, prefix=jobs.prefix).charge(job.owner, job.id, megapixel_frames, per_hour)
        if wait_s:
            raise BudgetExceeded(
                f"this key's budget of {per_hour:,.0f} output megapixel-frames per hour (megapixel_frames_per_hour) "
                f"is spent; a job of {megapixel_frames:,.0f} fits again in {wait_s} s"
            )

    return admit
