"""The denoising schedule of one tile, stepped with nothing read back from the GPU and few kernels launched.

diffusers' schedulers look their first step up on the device (`nonzero().item()`), and PiFlow's reads its policy's
substep count back (`max_num_substeps.item()`) at every step. Each read waits for the transformer call queued before
it, and the GPU then idles while the host launches the next call. PiFlow's rollout then integrates its policy over
~128 substeps a schedule, ~34 operations each, 25 of them on one number per tile: the GPU runs them about as fast
as the host launches them. The schedule is known on the host: this module takes the first step as the first, and
runs every scalar of the rollout there once per schedule (diffusers' float32 ops, in its order: IEEE rounds them
alike on any device), so the device runs only the 7 operations a substep has on the latents, with the same operands
(the same bits).
"""

from __future__ import annotations

import functools

import torch
from diffusers import PiflowScheduler
from diffusers.schedulers.scheduling_piflow import shift_timesteps

from worker.sr.devices import to_device


def fresh(scheduler):
    """A scheduler configured as `scheduler`, with step state of its own (one per device thread)."""
    kind = HostRolledPiflow if isinstance(scheduler, PiflowScheduler) else type(scheduler)
    return kind.from_config(scheduler.config)


def restart(scheduler, num_inference_steps: int, device: torch.device) -> None:
    """`scheduler`'s timesteps on `device`, its next step the first (a chunk of tiles denoises from the start)."""
    scheduler.set_timesteps(num_inference_steps, device=device)
    scheduler.set_begin_index(0)  # known here: not looked up on the device


class HostRolledPiflow(PiflowScheduler):
    """`PiflowScheduler` whose policy rollout takes its scalars from the host: its substep count, and per substep the
    grid point, interpolation weights, divisor and sigma step that diffusers' `policy_rollout_fm` computes on the
    device. Every tile of a chunk is at the same timestep, so its active-substep mask is all true and left out."""

    def set_timesteps(self, num_inference_steps: int | None = None, device=None, **kwargs) -> None:
        super().set_timesteps(num_inference_steps, device="cpu", **kwargs)
        self._host = (self._piflow_raw_timesteps.tolist(), self.sigmas.tolist())
        self._tables = getattr(self, "_tables", {})  # the steps' scalars on devices: kept for the clip's next chunks
        super().set_timesteps(num_inference_steps, device=device, **kwargs)

    def _policy_step(self, model_output: torch.Tensor, sample: torch.Tensor, step_index: int) -> torch.Tensor:
        raws, sigmas = self._host
        raw_dst = raws[step_index + 1] if step_index + 1 < len(raws) else self.eps
        step = (raws[step_index], raw_dst, sigmas[step_index], float(self.config.shift), self.eps, self.n_grid,
                self.num_policy_substeps)
        grid_points, table = _rollout_plan(*step)
        # DXPolicy's grid of x_0 predictions, (batch, n_grid, ...): diffusers' two operations on the same operands
        batch = sample.shape[0]
        sigma = self.sigmas[step_index].to(device=sample.device).expand(batch)
        sigma = sigma.reshape(batch, *((sample.ndim - 1) * [1]))
        x_0 = sample.unsqueeze(1) - sigma.unsqueeze(1) * self._to_grid(model_output, sample)
        scalars = self._on_device(step, table, sample)
        x_t = sample
        for (weight_0, weight_1, divisor, sigma_step), at in zip(scalars, grid_points):
            x_0_at = weight_0 * x_0[:, at] + weight_1 * x_0[:, at + 1] if self.n_grid > 1 else x_0[:, 0]
            velocity = (x_t - x_0_at) / divisor
            x_t = x_t + velocity * sigma_step
        return x_t

    def _on_device(self, step: tuple, table: torch.Tensor, sample: torch.Tensor) -> torch.Tensor:
        """`step`'s `table` on the sample's device, each scalar shaped to broadcast over it: copied once for this
        scheduler (a clip's tiles), without waiting for the steps queued before it."""
        key = (step, sample.device, sample.ndim)
        if key not in self._tables:
            self._tables[key] = to_device(table.reshape(*table.shape, *(sample.ndim * [1])), sample.device)
        return self._tables[key]


@functools.lru_cache(maxsize=64)
def _rollout_plan(
    raw_src: float, raw_dst: float, sigma_src: float, shift: float, eps: float, n_grid: int, total_substeps: int
) -> tuple[tuple[int, ...], torch.Tensor]:
    """The scalars of diffusers' `DXPolicy` and `policy_rollout_fm` for one step, on the host in float32 as diffusers
    computes them on the device: per substep the lower grid point, and a row of the two points' interpolation weights,
    the velocity's divisor and the sigma step."""
    raw_src_t, raw_dst_t, sigma = (torch.tensor([v], dtype=torch.float32) for v in (raw_src, raw_dst, sigma_src))

    def unwarp(sigma_t: torch.Tensor) -> torch.Tensor:  # DXPolicy._unwarp_t
        return sigma_t / (shift + (1 - shift) * sigma_t)

    # DXPolicy's segment
    policy_src = unwarp(sigma)
    policy_dst = (policy_src - (raw_src_t - raw_dst_t)).clamp(min=0)
    segment_size = (policy_src - policy_dst).clamp(min=eps)
    # policy_rollout_fm's substeps
    delta_raw_t = raw_src_t - raw_dst_t
    num_substeps = (delta_raw_t * total_substeps).round().to(torch.long).clamp(min=1)
    substep_size = delta_raw_t / num_substeps
    raw_t, sigma_t = raw_src_t, sigma
    points, rows = [], []
    for _ in range(int(num_substeps)):
        # DXPolicy.pi: where the policy's grid is read, and its divisor
        t = (unwarp(sigma_t) - policy_dst) / segment_size
        t = t.clamp(min=0, max=1) * (n_grid - 1)
        t0 = t.floor().to(torch.long).clamp(min=0, max=max(n_grid - 2, 0))
        t1 = t0 + 1
        divisor = sigma_t.clamp(min=eps)
        # the rollout's Euler step
        raw_t_minus = (raw_t - substep_size).clamp(min=0)
        sigma_t_minus = shift_timesteps(raw_t_minus, shift)
        points.append(int(t0))
        rows.append(torch.cat([t1 - t, t - t0, divisor, sigma_t_minus - sigma_t]))
        raw_t, sigma_t = raw_t_minus, sigma_t_minus
    return tuple(points), torch.stack(rows)
