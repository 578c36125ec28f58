"""The denoising schedule of one tile, stepped without reading anything back from the GPU.

diffusers' schedulers look their first step up on the device (`nonzero().item()`), and PiFlow's reads its policy's
substep count back (`max_num_substeps.item()`) at every step. Each read waits for the transformer call queued before
it, and the GPU then idles while the host launches the next few thousand small kernels: on a clip of many small tiles
(a 1080p clip to 2160p: 42 tiles, two steps each) that is seconds. The schedule is known on the host: this module takes
the first step as the first and PiFlow's substep counts from a host copy of its timesteps; the arithmetic on the
device is diffusers' own, op for op (the same bits).
"""

from __future__ import annotations

import torch
from diffusers import PiflowScheduler
from diffusers.schedulers.scheduling_piflow import DXPolicy, shift_timesteps


def fresh(scheduler):
    """A scheduler configured as `scheduler`, with step state of its own (one per device thread)."""
    kind = HostCountedPiflow if isinstance(scheduler, PiflowScheduler) else type(scheduler)
    return kind.from_config(scheduler.config)


def restart(scheduler, num_inference_steps: int, device: torch.device) -> None:
    """`scheduler`'s timesteps on `device`, its next step the first (a chunk of tiles denoises from the start)."""
    scheduler.set_timesteps(num_inference_steps, device=device)
    scheduler.set_begin_index(0)  # known here: not looked up on the device


class HostCountedPiflow(PiflowScheduler):
    """`PiflowScheduler` whose policy rollout takes its substep count from the host's schedule."""

    def set_timesteps(self, num_inference_steps: int | None = None, device=None, **kwargs) -> None:
        super().set_timesteps(num_inference_steps, device="cpu", **kwargs)
        host = self._piflow_raw_timesteps
        # the same float32 ops as the rollout's count on the device (IEEE-rounded alike on both)
        ends = torch.cat([host[1:], host.new_full((1,), self.eps)])
        self._substeps = ((host - ends) * self.num_policy_substeps).round().to(torch.long).clamp(min=1).tolist()
        super().set_timesteps(num_inference_steps, device=device, **kwargs)

    def _policy_step(self, model_output: torch.Tensor, sample: torch.Tensor, step_index: int) -> torch.Tensor:
        # diffusers' `_policy_step`, the rollout's loop count given
        model_output = self._to_grid(model_output, sample)
        raw_src = self._piflow_raw_timesteps[step_index].to(device=sample.device)
        raw_dst = (
            self._piflow_raw_timesteps[step_index + 1]
            if step_index + 1 < self._piflow_raw_timesteps.numel()
            else self._piflow_raw_timesteps.new_full((), self.eps)
        ).to(device=sample.device)
        batch = sample.shape[0]
        sigma = self.sigmas[step_index].to(device=sample.device).expand(batch)
        sigma = sigma.reshape(batch, *((sample.ndim - 1) * [1]))
        segment = (raw_src - raw_dst).expand(batch)
        policy = DXPolicy(model_output, sample, sigma, segment, float(self.config.shift), mode="grid", eps=self.eps)
        start, end = raw_src.expand(batch), raw_dst.expand(batch)
        return rollout(sample, sigma, start, end, self.num_policy_substeps, policy, self._substeps[step_index])


def rollout(x_t, sigma_t, raw_t, raw_t_end, total_substeps: int, policy: DXPolicy, substeps: int) -> torch.Tensor:
    """diffusers' `policy_rollout_fm` (its sample only), looping `substeps` times: the count it reads from the GPU."""
    shape = (x_t.size(0), *((x_t.dim() - 1) * [1]))
    raw_t, raw_t_end, sigma_t = raw_t.reshape(shape), raw_t_end.reshape(shape), sigma_t.reshape(shape)
    delta_raw_t = raw_t - raw_t_end
    num_substeps = (delta_raw_t * total_substeps).round().to(torch.long).clamp(min=1)
    substep_size = delta_raw_t / num_substeps
    for substep_id in range(substeps):
        velocity = policy.pi(x_t, sigma_t)
        raw_t_minus = (raw_t - substep_size).clamp(min=0)
        sigma_t_minus = shift_timesteps(raw_t_minus, policy.shift)
        x_t_minus = x_t + velocity * (sigma_t_minus - sigma_t)
        active_mask = num_substeps > substep_id
        x_t = torch.where(active_mask, x_t_minus, x_t)
        sigma_t = torch.where(active_mask, sigma_t_minus, sigma_t)
        raw_t = torch.where(active_mask, raw_t_minus, raw_t)
    return x_t
