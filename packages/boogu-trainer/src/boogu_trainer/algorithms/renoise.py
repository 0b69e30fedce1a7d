"""What the forward-process algorithms, DiffusionNFT and AWM, share: losses on re-noised clean samples.

They ignore the rollout's transitions: each sample's clean latent ``x0`` (the rollout's last
output) is re-noised at ``T`` sampled noise levels, ``x_sigma = (1 - sigma) x0 + sigma eps``, and the
loss compares the policy's Boogu velocity there with the old policy's (DiffusionNFT) or with the
flow-matching target ``x0 - eps`` (AWM), weighted by the sample's advantage. So the rollout may use
any sampler (an ODE included) and training needs no CFG (``guided`` trains the CFG-guided velocity
instead, at twice the training forwards).

Determinism: sample ``i`` (global index, group-major) draws its levels from the stream
``(seed, "levels", step, i)`` and its noise at level ``j`` from ``(seed, "noise", step, i, j)``,
so a sample's training inputs do not depend on micro-batches, mini-batches or ranks. With
``group_noise`` every sample of global group ``g`` takes the streams ``(seed, "group levels",
step, g)`` and ``(seed, "group noise", step, g, j)`` instead: common random numbers. The
advantages sum to zero over a group, so in the advantage-weighted gradient the part that depends
on the noise alone cancels instead of adding variance.

What each optimizer step needs from the old policy (NFT's ``v_old``, AWM's ``log p_old``) is the
policy's own detached value when the weights are still those that rolled out (the first optimizer
step of the update, with NFT's old policy equal to the current one); otherwise it is computed
without gradients before the first optimizer step (one forward per sample and level, counted in
the ``old`` phase). AWM without a clip needs none: its ratio is fixed at 1, so its loss is the
advantage-weighted flow-matching loss at every optimizer step.
"""

from __future__ import annotations

from abc import abstractmethod
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from boogu_adapters.lora import adapters_disabled
from boogu_adapters.step import boogu_velocity
from boogu_schedule import derive_seed, flow_target, forward_noise, make_generator, sample_sigmas
from boogu_schedule.hot import per_iteration
from boogu_trainer.algorithms.base import Algorithm, Policy, Term, micro_batches
from boogu_trainer.losses import PolicyLoss, velocity_kl

if TYPE_CHECKING:
    from boogu_adapters.types import Conditioning, Trajectory
    from boogu_trainer.config import AlgorithmConfig
    from boogu_trainer.scoring import ScoredBatch


class LevelPlan:
    """Noise levels and noise of every local sample for one update (levels on the device, noise lazily)."""

    def __init__(
        self, config: AlgorithmConfig, opts: Any, seed: int, device: torch.device, traj: Trajectory, step: int
    ):
        n = config.group_size
        self.device = device
        self.seed = seed
        self.step = step
        schedule = traj.sigmas.cpu() if opts.time_sampling == "schedule" else None  # one read per update
        num = opts.timesteps if opts.timesteps is not None else traj.sigmas.numel() - 2
        self.num_levels = num
        group_ids = traj.group_id.cpu()[::n].tolist()  # global group of each local group
        self.global_index = [g * n + j for g in group_ids for j in range(n)]
        # Each local sample's random stream: its own, or its group's (common random numbers).
        self.prefix = "group " if opts.group_noise else ""
        self.stream = [i // n if opts.group_noise else i for i in self.global_index]
        rows = []
        for index in self.stream:
            gen = make_generator(derive_seed(self.seed, self.prefix + "levels", step, index))
            rows.append(sample_sigmas(1, num, gen, schedule=schedule, sigma_range=tuple(opts.sigma_range))[0])
        self.sigmas_host = torch.stack(rows) if rows else torch.zeros(0, num)
        self.sigmas = self.sigmas_host.to(self.device, non_blocking=True)  # (B, T) float32
        self.shape = tuple(traj.final_latents.shape[1:])

    def noise(self, rows: list[int], j: int) -> torch.Tensor:
        """(b, C, h, w) float32 noise of level ``j`` for the local ``rows``."""
        drawn: dict[int, torch.Tensor] = {}  # one draw per stream (a group's rows share theirs)
        for r in rows:
            index = self.stream[r]
            if index not in drawn:
                gen = make_generator(
                    derive_seed(self.seed, self.prefix + "noise", self.step, index, j), self.device
                )
                drawn[index] = torch.randn(self.shape, generator=gen, device=self.device, dtype=torch.float32)
        return torch.stack([drawn[self.stream[r]] for r in rows])


class ForwardProcessAlgorithm(Algorithm):
    """DiffusionNFT's and AWM's update: one loss term per micro-batch and noise level."""

    forward_process = True

    def __init__(self, config: AlgorithmConfig, seed: int, policy: Policy):
        super().__init__(config, seed, policy)
        self.options = config.forward_options
        """The learner's options (``algorithm.nft`` / ``algorithm.awm``, or ``algorithm.options``), built once."""

    def begin(self, batch: ScoredBatch, step: int) -> None:
        self.batch = batch
        self.plan = LevelPlan(
            self.config, self.options, self.seed, self.policy.device, batch.trajectory, step
        )
        self.old_values: dict[tuple[int, int], torch.Tensor] = {}
        """(row, level) -> NFT's old velocity (C, h, w) or AWM's old log-prob (); filled by `precompute_old`."""

    @abstractmethod
    def own_old_values(self, first: bool) -> bool:
        """The old values of this optimizer step are the policy's own, detached (no precomputed ones)."""

    @abstractmethod
    def old_value(self, velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """What the loss compares with the old policy's (no grad): NFT's velocity, AWM's log-prob."""

    @abstractmethod
    def level_loss(
        self,
        velocity: torch.Tensor,
        old: torch.Tensor | None,
        x0: torch.Tensor,
        x_sigma: torch.Tensor,
        sigma: torch.Tensor,
        target: torch.Tensor,
        advantages: torch.Tensor,
    ) -> PolicyLoss:
        """The objective at one level (``old`` None: the policy's own values, detached)."""

    # ---- forwards -------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The policy's Boogu velocity: the conditional one (no CFG, the references'), or with
        ``guided`` the guided one at the rollout's guidance scales (text and image) and CFG mode."""
        traj = self.batch.trajectory
        guided = self.options.guided
        scale, image_scale, mode = (
            (traj.guidance_scale, traj.image_guidance_scale, traj.cfg_mode)
            if guided
            else (1.0, 1.0, "batched")
        )
        policy = self.policy
        return boogu_velocity(
            policy.transformer,
            x,
            sigma,
            cond,
            scale,
            policy.recompute.freqs_cis,
            cfg_mode=mode,
            image_guidance_scale=image_scale,
        )

    def inputs(self, rows: list[int], j: int) -> tuple[torch.Tensor, ...]:
        """x0, noise, sigma, x_sigma, target and the conditioning of ``rows`` at level ``j``."""
        traj = self.batch.trajectory
        recompute = self.policy.recompute
        x0 = recompute.rows(traj.final_latents, rows)
        noise = self.plan.noise(rows, j)
        sigma = recompute.rows(self.plan.sigmas, rows)[:, j].contiguous()
        x_sigma = forward_noise(x0, noise, sigma)
        return x0, noise, sigma, x_sigma, flow_target(x0, noise), traj.conditioning.select(rows)

    # ---- the update ---------------------------------------------------------------------------------
    def prepare(self, schedule: list[list[int]]) -> None:
        """The old values of every row some optimizer step needs them for, before the first one."""
        needs_old = [
            r
            for epoch in range(self.config.inner_epochs)
            for mb, rows in enumerate(schedule)
            if not self.own_old_values(epoch == 0 and mb == 0)
            for r in rows
        ]
        needs_old = sorted(set(needs_old))
        if needs_old:
            self.policy.transformer.eval()
            self.precompute_old(needs_old)

    @per_iteration
    def precompute_old(self, rows: list[int]) -> None:
        """The old policy's values at every level of ``rows`` (no grad), before any optimizer step."""
        policy = self.policy
        with torch.no_grad(), policy.count_as("old"), self.sampling_policy():
            for chunk in micro_batches(rows, self.config.train_micro_batch_size):
                for j in range(self.plan.num_levels):
                    _, _, sigma, x_sigma, target, cond = self.inputs(chunk, j)
                    values = self.old_value(self.velocity(x_sigma, sigma, cond), target)
                    for i, r in enumerate(chunk):
                        self.old_values[(r, j)] = values[i]

    def num_terms(self, batch: ScoredBatch) -> int:
        return self.plan.num_levels

    def losses(
        self, batch: ScoredBatch, advantages: torch.Tensor, chunk: list[int], *, first: bool
    ) -> Iterator[Term]:
        a, policy = self.config, self.policy
        own = self.own_old_values(first)
        adv = policy.recompute.rows(advantages, chunk)
        for j in range(self.plan.num_levels):
            x0, _, sigma, x_sigma, target, cond = self.inputs(chunk, j)
            v = self.velocity(x_sigma, sigma, cond)
            old = None if own else torch.stack([self.old_values[(r, j)] for r in chunk])
            pl = self.level_loss(v, old, x0, x_sigma, sigma, target, adv)
            loss, kl = pl.loss, None
            if a.kl_coef > 0:
                with torch.no_grad(), policy.count_as("reference"), adapters_disabled(policy.transformer):
                    ref = self.velocity(x_sigma, sigma, cond)
                kl = velocity_kl(v, ref).mean()
                loss = loss + a.kl_coef * kl
            yield Term(loss, pl, kl)


__all__ = ["ForwardProcessAlgorithm", "LevelPlan"]
