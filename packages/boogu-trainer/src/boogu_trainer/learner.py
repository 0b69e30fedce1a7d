"""The learner: the update loop on one scored batch, the optimizer, the EMA; the algorithm's loss.

``algorithm.name`` picks the algorithm (`boogu_trainer.algorithms`): FlowGRPO / GRPO-Guard per
window step, DiffusionNFT / AWM per re-noised level. Every algorithm runs in the same loop: for each
of ``inner_epochs`` passes and each mini-batch (`mini_batch_rows`: the groups whose global index is
``m`` modulo the number of mini-batches, so a run on several ranks updates on exactly the
mini-batches a single rank would), each micro-batch's loss terms (`Algorithm.losses`) go through
backward with their share of the mean over the mini-batch's samples and the terms; then one AdamW
step on the LoRA parameters.

Skips are collective-safe: under several ranks every rank runs the same forwards (FSDP
collectives), and a non-finite loss or gradient on one rank skips the optimizer step on all. After
every optimizer step the LoRA is checked for non-finite values (one fused reduction); a non-finite
update is undone from a snapshot and reported, so the run can stop with the last good weights.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from typing import Any

import torch

from boogu_adapters.lora import (
    adapter_config,
    check_lora_state,
    is_lora_param,
    lora_file_key,
    lora_state_dict,
)
from boogu_adapters.recompute import TransitionRecompute
from boogu_schedule.hot import per_iteration
from boogu_trainer.algorithms import Algorithm, Policy, UpdateResult, build_algorithm
from boogu_trainer.algorithms.base import PhaseCounter, micro_batches
from boogu_trainer.config import AlgorithmConfig, EmaConfig, OptimConfig
from boogu_trainer.distributed import (
    DistEnv,
    full_optimizer_state,
    full_tensor,
    load_full_state,
    local_tensor,
)
from boogu_trainer.losses import RATIO_SQ_DEV, MetricSums, pooled_ratio_std
from boogu_trainer.scoring import ScoredBatch


def mini_batch_rows(group_id: torch.Tensor, group_size: int, mini_batches: int) -> list[list[int]]:
    """The local rows of each mini-batch: whole groups, global group ``g`` in mini-batch ``g % m``
    with ``m = min(mini_batches, local groups)``.

    ``group_id``: (B,) the global group of each local row, group-major (the rollout's numbering). The
    rule depends on global indices only, so with ranks holding contiguous shares of the groups
    (`config.check_world_layout`) every mini-batch is the one a single rank would make.
    """
    n = group_size
    global_group = group_id.cpu()[::n]  # (groups,) global group index of each local group
    num_mb = min(mini_batches, group_id.numel() // n)
    schedule = []
    for mb in range(num_mb):
        local_groups = (global_group % num_mb == mb).nonzero().flatten().tolist()
        schedule.append([g * n + j for g in local_groups for j in range(n)])
    return schedule


class Learner:
    """Owns the trainable LoRA parameters, AdamW, the EMA, the update counters and the algorithm."""

    def __init__(
        self,
        algorithm: AlgorithmConfig,
        optim: OptimConfig,
        ema: EmaConfig,
        transformer: torch.nn.Module,
        recompute: TransitionRecompute,
        dist: DistEnv,
        device: torch.device,
        *,
        seed: int,
        base_model: str = "",
    ):
        self.algorithm_config = algorithm
        self.optim_config = optim
        self.ema_config = ema
        self.base_model = base_model
        """The base model's folder, written into the LoRA's adapter config."""
        self.transformer = transformer
        self.recompute = recompute
        self.dist = dist
        self.device = device
        named = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        o = optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.counters: dict[str, int] = defaultdict(int)
        self.ema: dict[str, torch.Tensor] | None = (
            {k: v.float().clone() for k, v in self.full_lora().items()} if ema.enabled else None
        )
        self._snapshot: list[torch.Tensor] | None = None
        self.policy = Policy(transformer, recompute, device, self.params, self.param_names)
        self.algorithm: Algorithm = build_algorithm(algorithm, seed, self.policy)

    @property
    def count_as(self) -> PhaseCounter:
        """Names the phase of the algorithm's extra forwards ('reference', 'old') for the FE accounting."""
        return self.policy.count_as

    @count_as.setter
    def count_as(self, counter: PhaseCounter) -> None:
        self.policy.count_as = counter

    # ---- the policy the rollouts sample (the algorithm's: DiffusionNFT's old policy while it lags) ----
    def sampling_policy(self) -> contextlib.AbstractContextManager[None]:
        """The module holds the rollout policy's weights inside the block (`Algorithm.sampling_policy`)."""
        return self.algorithm.sampling_policy()

    def rollout_weights(self, full: dict[str, torch.Tensor] | None = None) -> dict[str, torch.Tensor]:
        """The rollout policy's whole LoRA by file key, for an engine with its own copy (a collective
        under FSDP); ``full``: the current LoRA, already gathered (`Algorithm.rollout_weights`)."""
        return self.algorithm.rollout_weights(lambda: self.full_lora() if full is None else full)

    # ---- the update --------------------------------------------------------------------------------
    def update(self, batch: ScoredBatch, step: int = 0) -> UpdateResult:
        """The configured algorithm's update on one rollout batch (``step``: the training step, 0-based,
        which seeds the forward-process algorithms' noise).

        Inside the loops over mini-batches, micro-batches and loss terms nothing is read back from the
        device; each optimizer step makes two host reads (whether the losses and the gradient norm were
        finite, and whether the updated weights are), and the metrics are read once at the end.
        """
        result = self._update(batch, step)
        if result.weights_finite:
            self.algorithm.after_update(self.counters)
        return result

    def _update(self, batch: ScoredBatch, step: int) -> UpdateResult:
        a = self.algorithm_config
        traj = batch.trajectory
        algorithm = self.algorithm
        algorithm.begin(batch, step)
        acc: dict[str, list[torch.Tensor | float]] = defaultdict(list)
        all_finite, weights_finite = True, True
        self.counters["nonfinite_reward_samples"] += int((~batch.finite).sum())
        advantages = self._usable_advantages(batch)
        if not bool(batch.global_advantages.finite.any()):
            return self.finish(acc, finite=False)
        host_advantages = advantages.cpu()  # once per update, before the loops
        schedule = mini_batch_rows(traj.group_id, a.group_size, a.mini_batches)
        algorithm.prepare(schedule)
        # No gradient where A = 0 (without a KL, for most algorithms): skip the compute (a single
        # process only; under FSDP every rank must run the same forwards).
        skip_zero = not self.dist.enabled and a.kl_coef == 0 and algorithm.zero_advantage_has_no_gradient
        self.transformer.train()
        for epoch in range(a.inner_epochs):
            for mb, all_rows in enumerate(schedule):
                rows = [r for r in all_rows if host_advantages[r] != 0] if skip_zero else all_rows
                if not rows:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                bad_loss = self._accumulate(
                    batch,
                    advantages,
                    self.micro_batches(rows),
                    len(all_rows),
                    acc,
                    first=epoch == 0 and mb == 0,
                )
                status = self.optimizer_step(bad_loss, acc)
                if status == "skipped":
                    all_finite = False
                    continue
                if status == "undone":
                    weights_finite = False
                    break
            if not weights_finite:
                break
        return self.finish(acc, finite=all_finite, weights_finite=weights_finite)

    def _usable_advantages(self, batch: ScoredBatch) -> torch.Tensor:
        """(B,) the batch's advantages, 0 where the reward was not finite (those rows get no gradient)."""
        return torch.where(batch.finite.to(self.device), batch.advantages, torch.zeros_like(batch.advantages))

    def gradient(self, batch: ScoredBatch, step: int = 0, rows: list[int] | None = None) -> torch.Tensor:
        """The loss gradient of an update's first optimizer step on ``rows`` of ``batch`` (default: every
        row, as one mini-batch), flattened over the LoRA parameters: (P,) float32 on the device.

        The same loss, micro-batches and weighting as `update` (the mean over the rows and the terms),
        at the weights that rolled the batch out (so the ratio is 1: on-policy). Nothing is stepped:
        the weights, AdamW and the counters are untouched, and the gradients are zeroed again. The
        instruments of `benchmarks/gradient_check.py` (the cosine across batches, the uphill check)
        are built on it. A descent step ``-eps * g`` raises the expected reward when the estimator is right.
        """
        rows = list(range(batch.trajectory.batch_size)) if rows is None else list(rows)
        advantages = self._usable_advantages(batch)
        self.algorithm.begin(batch, step)
        self.algorithm.prepare([rows])
        self.optimizer.zero_grad(set_to_none=True)
        self.transformer.train()
        try:
            acc: dict[str, list[torch.Tensor | float]] = defaultdict(list)
            self._accumulate(batch, advantages, self.micro_batches(rows), len(rows), acc, first=True)
            flat = torch.cat(
                [
                    torch.zeros(p.numel(), device=self.device)
                    if p.grad is None
                    else full_tensor(p.grad).detach().float().flatten()
                    for p in self.params
                ]
            )
        finally:
            self.optimizer.zero_grad(set_to_none=True)
            self.transformer.eval()
        return flat

    def micro_batches(self, rows: torch.Tensor | list[int]) -> list[list[int]]:
        """``rows`` (host indices) in consecutive chunks of ``algorithm.train_micro_batch_size``."""
        return micro_batches(rows, self.algorithm_config.train_micro_batch_size)

    @per_iteration
    def _accumulate(self, batch, advantages, chunks, total_rows, acc, *, first: bool) -> torch.Tensor:
        """Forward + backward of every micro-batch and loss term of one mini-batch.

        Gradients accumulate across micro-batches: each contributes its rows' share of the mean over
        the mini-batch's samples (skipped ones count as zero) and the terms (window steps or levels).
        Returns a device bool: some loss was not finite. Under several ranks such a loss still goes
        through backward, whose FSDP reduce-scatters every rank must join; the optimizer step is then
        skipped on all ranks.
        """
        terms = self.algorithm.num_terms(batch)
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        # Each metric is the mini-batch's mean over samples and terms: chunk values weighted by their
        # share of the rows.
        sums = MetricSums()
        rows = sum(len(chunk) for chunk in chunks)
        for chunk in chunks:
            weight = len(chunk) / total_rows / terms
            share = len(chunk) / rows / terms
            for term in self.algorithm.losses(batch, advantages, chunk, first=first):
                if term.kl is not None:
                    sums.add("kl_ref", term.kl, share)
                bad = bad | ~torch.isfinite(term.loss.detach())
                (term.loss * weight).backward()
                sums.add_loss(term.loss, term.policy, share)
        sums.into(acc)
        return bad

    @per_iteration
    def optimizer_step(self, bad_loss: torch.Tensor, acc: dict[str, list]) -> str:
        """Clip, check, step: 'ok', 'skipped' (a non-finite loss or gradient) or 'undone' (non-finite weights)."""
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, self.optim_config.grad_clip))
        # The one read before the step: were the losses and the gradients finite?
        bad, norm = torch.stack([bad_loss.float(), grad_norm.float().reshape(())]).tolist()
        if self.dist.any(bad > 0, "agree on a non-finite loss"):
            self.optimizer.zero_grad(set_to_none=True)
            return "skipped"
        acc["grad_norm"].append(norm)
        if not math.isfinite(norm):
            self.counters["nonfinite_grad_norm"] += 1
            self.optimizer.zero_grad(set_to_none=True)
            return "skipped"
        self._take_snapshot()
        self.optimizer.step()
        self.counters["optimizer_steps"] += 1
        if not self._weights_finite():
            self._restore_snapshot()
            return "undone"
        return "ok"

    def finish(self, acc, *, finite: bool, weights_finite: bool = True) -> UpdateResult:
        """The update's metrics (the loss terms' and the algorithm's), read from the device once.

        Over several ranks: the loss terms' means are averaged over the ranks (each holds an equal share
        of every mini-batch, so that is the global mean), the algorithm's checks (`Algorithm.metrics`:
        the on-policy log-prob difference, the first step's clip fraction) take their max over the
        ranks; the grad norm is global already. Every rank gets the same record.
        """
        self.transformer.eval()
        out: dict[str, Any] = {}
        means: dict[str, torch.Tensor] = {}
        for key, values in acc.items():
            if not values:
                continue
            if isinstance(values[0], torch.Tensor):
                means[key] = torch.stack([v.double() for v in values]).mean()
            else:
                out[key] = sum(values) / len(values)
        checks: dict[str, torch.Tensor] = {}
        for key, value in self.algorithm.metrics().items():
            if isinstance(value, torch.Tensor):
                checks[key] = value.double().reshape(())
            else:
                out[key] = value
        # The same keys on every rank (they follow the config), so the collectives match.
        if means:
            reduced = self.dist.all_reduce_sum(torch.stack(list(means.values())), "update metrics: mean")
            means = dict(zip(means, reduced / self.dist.world_size, strict=True))
        if checks:
            reduced = self.dist.all_reduce_max(torch.stack(list(checks.values())), "update metrics: max")
            checks = dict(zip(checks, reduced, strict=True))
        if RATIO_SQ_DEV in means:  # the update's ratio std, pooled over every rank's samples
            means["ratio_std"] = pooled_ratio_std(means["ratio_mean"], means.pop(RATIO_SQ_DEV))
        on_device = {**means, **checks}
        if on_device:  # one read of everything the update measured on the device
            out.update(zip(on_device, torch.stack(list(on_device.values())).tolist(), strict=True))
        out["optimizer_steps"] = self.counters["optimizer_steps"]
        return UpdateResult(metrics=out, finite=finite, weights_finite=weights_finite)

    # ---- non-finite weights ------------------------------------------------------------------------
    def _take_snapshot(self) -> None:
        local = [local_tensor(p.detach()) for p in self.params]
        if self._snapshot is None:
            self._snapshot = [torch.empty_like(t) for t in local]
        torch._foreach_copy_(self._snapshot, local)

    def _restore_snapshot(self) -> None:
        assert self._snapshot is not None
        with torch.no_grad():
            torch._foreach_copy_([local_tensor(p.detach()) for p in self.params], self._snapshot)

    @per_iteration
    def _weights_finite(self) -> bool:
        """All LoRA values finite on every rank: one fused norm over the local shards, one all-reduce."""
        norms = torch._foreach_norm([local_tensor(p.detach()) for p in self.params])
        bad = not bool(torch.isfinite(torch.stack(norms).sum()))  # host sync, once per optimizer step
        return not self.dist.any(bad, "check the LoRA for non-finite values")

    # ---- weights and state ----------------------------------------------------------------------------
    def full_lora(self) -> dict[str, torch.Tensor]:
        """The whole LoRA (file keys) on every rank; a collective under FSDP."""
        return {k: full_tensor(v).detach() for k, v in lora_state_dict(self.transformer).items()}

    def update_ema(self, full: dict[str, torch.Tensor]) -> None:
        if self.ema is None:
            return
        d = self.ema_config.decay
        for k, v in full.items():
            self.ema[k].mul_(d).add_(v.float(), alpha=1 - d)

    @contextlib.contextmanager
    def ema_weights(self):
        """The EMA of the LoRA in the transformer for the body of the ``with`` (an evaluation), the
        trained weights put back bitwise after; without an EMA, the trained weights. Every rank calls it
        (under FSDP2 the EMA is loaded into the shards)."""
        if self.ema is None:
            yield
            return
        with torch.no_grad():
            saved = [p.detach().clone() for p in self.params]
        dtypes = {
            lora_file_key(n): p.dtype for n, p in zip(self.param_names, self.params) if is_lora_param(n)
        }
        by_file_key = {lora_file_key(n): n for n in self.param_names if is_lora_param(n)}
        try:
            load_full_state(
                self.transformer, {by_file_key[k]: v.to(dtype=dtypes[k]) for k, v in self.ema.items()}
            )
            yield
        finally:
            with torch.no_grad():
                for p, s in zip(self.params, saved, strict=True):
                    p.copy_(s)

    def apply_optim_config(self) -> None:
        """Set the optimizer's hyper-parameters from the config (after a resume that changed them)."""
        o = self.optim_config
        for group in self.optimizer.param_groups:
            group.update(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    def adapter_config(self) -> dict[str, Any]:
        return adapter_config(self.transformer, base_model_name_or_path=self.base_model)

    def state_dict(self, lora: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """What a checkpoint keeps of the learner, on the CPU (collectives under FSDP: every rank calls it).

        ``lora``, ``lora_config``: the whole LoRA (float32, file keys; ``lora``: already gathered, or
        gathered now) and its adapter config; ``optimizer_tensors``, ``optimizer_meta``: AdamW's state by
        ``"<parameter name>::<field>"`` (full tensors, also under FSDP2) and its hyper-parameters;
        ``ema``; ``counters``; and the algorithm's own parts (`Algorithm.state_dict`: a dict of tensors
        is saved in a file of its own by the checkpoint's rule).
        """
        tensors: dict[str, torch.Tensor] = {}
        if self.optimizer.state:
            sd = full_optimizer_state(self.transformer, self.optimizer)
            for name, state in sd["state"].items():
                for key, value in state.items():
                    tensors[f"{name}::{key}"] = torch.as_tensor(value).detach().to("cpu").contiguous()
            groups = [
                {k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
                for g in sd["param_groups"]
            ]
        else:
            # Before the first step torch's state-dict API would initialise the state (a zero step), so
            # a snapshot (the preflight's) would change what it reads: only the hyper-parameters.
            names = {id(p): n for n, p in zip(self.param_names, self.params)}
            groups = [
                {k: v for k, v in g.items() if k != "params"}
                | {"params": [names[id(p)] for p in g["params"]]}
                for g in self.optimizer.param_groups
            ]
        full = self.full_lora() if lora is None else lora
        return {
            "lora": {k: v.float().cpu() for k, v in full.items()},
            "lora_config": self.adapter_config(),
            "optimizer_tensors": tensors,
            "optimizer_meta": {"param_groups": groups, "names": self.param_names},
            "ema": None if self.ema is None else {k: v.cpu() for k, v in self.ema.items()},
            "counters": dict(self.counters),
        } | self.algorithm.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put a `state_dict` back: the LoRA (float32), AdamW state, EMA, the algorithm's state (NFT's
        old policy) and the counters (also into FSDP2 shards). ``lora_config`` is not read."""
        lora, optimizer_meta = state["lora"], state["optimizer_meta"]
        # The LoRA first: its error names what differs (`check_lora_state`, shared with boogu-sample).
        check_lora_state(
            {
                lora_file_key(n): tuple(p.shape)
                for n, p in zip(self.param_names, self.params)
                if is_lora_param(n)
            },
            {k: tuple(v.shape) for k, v in lora.items()},
            source="the checkpoint",
        )
        if optimizer_meta["names"] != self.param_names:
            raise ValueError(
                "the checkpoint's optimizer was built for different LoRA parameters than this model's"
            )
        # Before the LoRA: DiffusionNFT loads its old policy through the module.
        self.algorithm.load_state_dict(state)
        by_file_key = {lora_file_key(n): n for n in self.param_names if is_lora_param(n)}
        model_sd = {by_file_key[k]: v.to(device=self.device, dtype=torch.float32) for k, v in lora.items()}
        load_full_state(self.transformer, model_sd)
        optim_state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in state["optimizer_tensors"].items():
            name, field = key.rsplit("::", 1)
            optim_state.setdefault(name, {})[field] = value.to(self.device) if value.dim() > 0 else value
        groups = [
            {**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g)
            for g in optimizer_meta["param_groups"]
        ]
        self.optimizer.zero_grad(set_to_none=True)  # a put-back state has no gradients (the preflight's)
        if optim_state:
            load_full_state(
                self.transformer, {}, self.optimizer, {"state": optim_state, "param_groups": groups}
            )
            # Loading first initialises a state for every parameter (a zero-gradient step); a parameter
            # that had never received a gradient (e.g. the reference-image refiner in a T2I run) must
            # stay without one, or its first real update would use a different Adam step count.
            for name, param in zip(self.param_names, self.params):
                if name not in optim_state:
                    self.optimizer.state.pop(param, None)
        else:  # saved before the first step: no state, only the hyper-parameters
            self.optimizer.state.clear()
            for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        if self.ema_config.enabled:
            ema = state.get("ema")
            if ema is None:
                raise ValueError("ema.enabled=true but the checkpoint has no EMA weights")
            self.ema = {
                k: v.to(self.device, torch.float32, copy=True) for k, v in ema.items()
            }  # never aliased
        self.counters = defaultdict(int, state["counters"])
