"""The update of the forward-process learners, DiffusionNFT and AWM, on one scored batch.

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

import contextlib
from collections import defaultdict
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING

import torch

from boogu_adapters.lora import adapters_disabled
from boogu_adapters.step import boogu_velocity
from boogu_adapters.types import Conditioning
from boogu_schedule import derive_seed, flow_target, forward_noise, make_generator, sample_sigmas
from boogu_trainer.losses import MetricSums, awm_log_prob, awm_loss, nft_loss, velocity_kl

if TYPE_CHECKING:
    from boogu_trainer.learner import Learner, UpdateResult
    from boogu_trainer.rollout import ScoredBatch


class LevelPlan:
    """Noise levels and noise of every local sample for one update (levels on the device, noise lazily)."""

    def __init__(self, learner: Learner, batch: ScoredBatch, step: int):
        cfg = learner.config
        a = cfg.algorithm
        opts = a.forward_options
        traj = batch.trajectory
        n = a.group_size
        self.device = learner.device
        self.seed = cfg.seed
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


class ForwardProcessUpdate:
    """One DiffusionNFT or AWM update; `Learner.update` runs it for those algorithms."""

    def __init__(self, learner: Learner, batch: ScoredBatch, step: int):
        self.learner = learner
        self.batch = batch
        self.config = learner.config
        self.algorithm = self.config.algorithm
        self.nft = self.algorithm.name == "diffusion_nft"
        self.guided = self.algorithm.forward_options.guided
        self.plan = LevelPlan(learner, batch, step)
        self.old: dict[tuple[int, int], torch.Tensor] = {}
        """(row, level) -> NFT's old velocity (C, h, w) or AWM's old log-prob (); filled by `precompute_old`."""

    # ---- forwards -------------------------------------------------------------------------------
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, cond: Conditioning) -> torch.Tensor:
        """The policy's Boogu velocity: the conditional one (no CFG, the references'), or with
        ``guided`` the CFG-guided one at the rollout's guidance scale and CFG mode."""
        traj = self.batch.trajectory
        scale, mode = (traj.guidance_scale, traj.cfg_mode) if self.guided else (1.0, "batched")
        return boogu_velocity(
            self.learner.transformer, x, sigma, cond, scale, self.learner.adapter.freqs_cis, cfg_mode=mode
        )

    def inputs(self, rows: list[int], j: int) -> tuple[torch.Tensor, ...]:
        """x0, noise, sigma, x_sigma, target and the conditioning of ``rows`` at level ``j``."""
        traj = self.batch.trajectory
        adapter = self.learner.adapter
        x0 = adapter.rows(traj.final_latents, rows)
        noise = self.plan.noise(rows, j)
        sigma = adapter.rows(self.plan.sigmas, rows)[:, j].contiguous()
        x_sigma = forward_noise(x0, noise, sigma)
        return x0, noise, sigma, x_sigma, flow_target(x0, noise), traj.conditioning.select(rows)

    def precompute_old(self, rows: list[int]) -> None:
        """The old policy's values at every level of ``rows`` (no grad), before any optimizer step."""
        learner = self.learner
        with torch.no_grad(), learner.count_as("old"), learner.sampling_policy():
            for chunk in learner.micro_batches(rows):
                for j in range(self.plan.num_levels):
                    _, _, sigma, x_sigma, target, cond = self.inputs(chunk, j)
                    v = self.velocity(x_sigma, sigma, cond)
                    values = v if self.nft else awm_log_prob(v, target)
                    for i, r in enumerate(chunk):
                        self.old[(r, j)] = values[i]

    # ---- the update ---------------------------------------------------------------------------------
    def run(self) -> UpdateResult:
        learner, a, batch = self.learner, self.algorithm, self.batch
        traj = batch.trajectory
        n = a.group_size
        acc: dict[str, list[torch.Tensor | float]] = defaultdict(list)
        all_finite, weights_finite = True, True
        advantages = torch.where(
            batch.finite.to(learner.device), batch.advantages, torch.zeros_like(batch.advantages)
        )
        if not bool(batch.global_advantages.finite.any()):
            return learner.finish(acc, [], finite=False)
        host_advantages = advantages.cpu()
        groups = traj.batch_size // n
        num_mb = min(a.mini_batches, groups)
        global_group = traj.group_id.cpu()[::n]
        schedule: list[list[int]] = []
        for mb in range(num_mb):
            local_groups = (global_group % num_mb == mb).nonzero().flatten().tolist()
            rows = [g * n + j for g in local_groups for j in range(n)]
            schedule.append(rows)
        # Skipping A = 0 rows is exact only where their loss has no gradient (AWM without KL; NFT's
        # A = 0 still pulls v+ and v- symmetrically) and only on one process (FSDP: same forwards).
        skip_zero = not learner.dist.enabled and a.kl_coef == 0 and not self.nft
        on_policy_first = not self.nft or learner.old_is_current
        # Plain AWM (no clip): the ratio is 1 at every optimizer step, so no old values at all.
        ratio_free = not self.nft and a.awm.clip_range is None
        needs_old = [
            r
            for epoch in range(a.inner_epochs)
            for mb, rows in enumerate(schedule)
            if not (ratio_free or (epoch == 0 and mb == 0 and on_policy_first))
            for r in rows
        ]
        needs_old = sorted(set(needs_old))
        if needs_old:
            learner.transformer.eval()
            self.precompute_old(needs_old)
        learner.transformer.train()
        for epoch in range(a.inner_epochs):
            for mb, all_rows in enumerate(schedule):
                rows = [r for r in all_rows if host_advantages[r] != 0] if skip_zero else all_rows
                if not rows:
                    continue
                learner.optimizer.zero_grad(set_to_none=True)
                current = ratio_free or (epoch == 0 and mb == 0 and on_policy_first)
                bad_loss = self.accumulate(
                    advantages, learner.micro_batches(rows), len(all_rows), acc, current=current
                )
                status = learner.optimizer_step(bad_loss, acc)
                if status == "skipped":
                    all_finite = False
                    continue
                if status == "undone":
                    weights_finite = False
                    break
            if not weights_finite:
                break
        return learner.finish(acc, [], finite=all_finite, weights_finite=weights_finite)

    def accumulate(self, advantages, chunks, total_rows, acc, *, current: bool) -> torch.Tensor:
        """Forward + backward of every micro-batch and level of one mini-batch; a device flag: some loss not finite.

        ``current``: the old values are the policy's own, detached (the weights that rolled out, or
        plain AWM); otherwise they come from `precompute_old`."""
        learner, a = self.learner, self.algorithm
        T = self.plan.num_levels
        bad = torch.zeros((), dtype=torch.bool, device=learner.device)
        sums = MetricSums()

        rows_here = sum(len(c) for c in chunks)
        for chunk in chunks:
            weight = len(chunk) / total_rows / T
            share = len(chunk) / rows_here / T
            adv = learner.adapter.rows(advantages, chunk)
            for j in range(T):
                x0, _, sigma, x_sigma, target, cond = self.inputs(chunk, j)
                v = self.velocity(x_sigma, sigma, cond)
                if self.nft:
                    old = v.detach() if current else torch.stack([self.old[(r, j)] for r in chunk])
                    pl = nft_loss(
                        v,
                        old,
                        x_sigma,
                        x0,
                        sigma,
                        adv,
                        beta=a.nft.beta,
                        adv_clip=a.adv_clip,
                        adaptive_weight=a.nft.adaptive_weight,
                    )
                else:
                    log_prob = awm_log_prob(v, target)
                    old = log_prob.detach() if current else torch.stack([self.old[(r, j)] for r in chunk])
                    pl = awm_loss(log_prob, old, adv, a.awm.clip_range)
                loss = pl.loss
                if a.kl_coef > 0:
                    with (
                        torch.no_grad(),
                        learner.count_as("reference"),
                        adapters_disabled(learner.transformer),
                    ):
                        ref = self.velocity(x_sigma, sigma, cond)
                    kl = velocity_kl(v, ref).mean()
                    loss = loss + a.kl_coef * kl
                    sums.add("kl_ref", kl, share)
                bad = bad | ~torch.isfinite(loss.detach())
                (loss * weight).backward()
                sums.add_loss(loss, pl, share)
        sums.into(acc)
        return bad


@contextlib.contextmanager
def swapped(params: list[torch.Tensor], other: list[torch.Tensor]) -> Iterator[None]:
    """``params`` hold ``other``'s values inside the block (local shards; one copy each way)."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        torch._foreach_copy_([p.detach() for p in params], other)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in params], saved)


def nullphase(_: str) -> contextlib.AbstractContextManager[None]:
    return contextlib.nullcontext()


PhaseCounter = Callable[[str], contextlib.AbstractContextManager[None]]


__all__ = ["ForwardProcessUpdate", "LevelPlan", "PhaseCounter", "nullphase", "swapped"]
