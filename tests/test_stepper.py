"""The engine's scheduler steps: diffusers' bits, with nothing read back from the device."""

from __future__ import annotations

import pytest
import torch
from diffusers import FlowMatchEulerDiscreteScheduler, PiflowScheduler

from bench.rollout import Operations
from worker.sr import stepper


def steps(scheduler, samples: torch.Tensor, outputs: list[torch.Tensor]) -> torch.Tensor:
    for t, output in zip(scheduler.timesteps, outputs):
        samples = scheduler.step(output, t, samples, return_dict=False)[0]
    return samples


@pytest.mark.parametrize("num_steps", [1, 2, 3, 5])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shift, n_grid", [(5.0, 10), (3.5, 4)])
def test_piflow_steps_give_diffusers_bits(num_steps, dtype, shift, n_grid):
    """Every step of the host-rolled PiFlow equals diffusers' scheduler's, bit for bit, over whole schedules (the
    model's widened output: `n_grid` points a channel, 10 and shift 5 in the released checkpoint; a batch of two tiles
    as `tiles_batch_size` makes them)."""
    generator = torch.Generator().manual_seed(num_steps)
    sample = torch.randn(2, 3, 4, 6, 8, generator=generator).to(dtype)
    outputs = [torch.randn(2, 3, 4, 6, 8 * n_grid, generator=generator).to(dtype) for _ in range(num_steps)]
    theirs = PiflowScheduler(n_grid=n_grid, shift=shift)
    theirs.set_timesteps(num_steps)
    ours = stepper.fresh(theirs)
    stepper.restart(ours, num_steps, torch.device("cpu"))
    assert isinstance(ours, stepper.HostRolledPiflow) and ours.config == theirs.config
    expected, got = steps(theirs, sample, outputs), steps(ours, sample, outputs)
    assert got.dtype == dtype and torch.equal(got, expected)
    assert not torch.equal(got, sample)


def test_a_step_reads_nothing_back_from_the_device():
    """On the meta device every read-back fails (`.item()`, `nonzero`): diffusers' PiFlow step reads its substep
    count and its first step back; the engine's steps whole schedules there."""
    meta = torch.device("meta")
    sample, outputs = torch.empty(1, 3, 4, 6, 8, device=meta), [torch.empty(1, 3, 4, 6, 80, device=meta)] * 2
    theirs = PiflowScheduler(n_grid=10)
    theirs.set_timesteps(2, device=meta)
    with pytest.raises((RuntimeError, NotImplementedError)):
        steps(theirs, sample, outputs)
    ours = stepper.fresh(theirs)
    for _ in range(2):  # a chunk of tiles after another: each from the first step
        stepper.restart(ours, 2, meta)
        assert steps(ours, sample, outputs).shape == sample.shape


def test_a_piflow_substep_is_seven_operations_on_the_latents():
    """diffusers' rollout works each scalar of a substep out on the device beside the latents: ~34 operations a
    substep, two thirds of them on one number per tile, each a kernel launch that a small tile's GPU waits for. The
    engine's schedule sends the device the 7 that touch the latents."""
    cpu = torch.device("cpu")
    sample, outputs = torch.randn(1, 3, 4, 6, 8), [torch.randn(1, 3, 4, 6, 80) for _ in range(2)]
    theirs = PiflowScheduler(n_grid=10, shift=5.0)
    theirs.set_timesteps(2)
    raw = [*theirs._piflow_raw_timesteps.tolist(), theirs.eps]
    substeps = sum(round((raw[i] - raw[i + 1]) * theirs.num_policy_substeps) for i in range(2))
    ours = stepper.fresh(theirs)
    stepper.restart(ours, 2, cpu)
    steps(ours, sample, outputs)  # the host's plan for this schedule: made once a process
    stepper.restart(ours, 2, cpu)
    with Operations(cpu) as launches:
        steps(ours, sample, outputs)
    # per step: the sample to float32 and back, the x_0 grid (2), the scalars' copy; then 7 a substep
    assert substeps == 128 and 7 * substeps <= launches.count <= 7 * substeps + 2 * 5
    with Operations(cpu) as launches:
        steps(theirs, sample, outputs)
    assert launches.count > 30 * substeps


def test_other_schedulers_start_at_their_first_step_without_a_lookup():
    """A flow-matching Euler checkpoint keeps its own scheduler class, told its first step instead of looking it up."""
    theirs = FlowMatchEulerDiscreteScheduler(shift=3.5)
    ours = stepper.fresh(theirs)
    stepper.restart(ours, 2, torch.device("cpu"))
    assert type(ours) is FlowMatchEulerDiscreteScheduler and ours.begin_index == 0
    sample, outputs = torch.randn(1, 2, 3, 4, 5), [torch.randn(1, 2, 3, 4, 5) for _ in range(2)]
    theirs.set_timesteps(2)
    assert torch.equal(steps(ours, sample, outputs), steps(theirs, sample, outputs))
