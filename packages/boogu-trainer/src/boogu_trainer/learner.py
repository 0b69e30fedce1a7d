"""The learner: the policy update on one scored batch, the optimizer, the EMA, NFT's old policy.

``algorithm.name`` picks the update:

* ``flow_grpo``: for each of ``inner_epochs`` passes and each mini-batch (the groups whose global
  index is ``m`` modulo the number of mini-batches, so a run on several ranks updates on exactly the
  mini-batches a single rank would), every window step ``k`` is recomputed through the same step
  function as the rollout and contributes ``PPO-clip(exp(log p - log p_old), A) [+ beta KL]`` (or
  GRPO-Guard's, ``algorithm.loss``) to a mean over the mini-batch's samples and the window's steps;
  then one AdamW step on the LoRA parameters.
* ``diffusion_nft`` and ``awm``: the same mini-batches and optimizer steps, with losses on re-noised
  clean samples (`boogu_trainer.forward_process`). DiffusionNFT's old policy is a second copy of
  the LoRA, soft-updated after every update (``algorithm.nft.old_decay_*``); rollouts use it.

Skips are collective-safe: under several ranks every rank runs the same forwards (FSDP
collectives), and a non-finite loss or gradient on one rank skips the optimizer step on all. After
every optimizer step the LoRA is checked for non-finite values (one fused reduction); a non-finite
update is undone from a snapshot and reported, so the run can stop with the last good weights.
"""

from __future__ import annotations

import contextlib
import math
from collections import defaultdict
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

from boogu_adapters.lora import (
    adapter_config,
    check_lora_state,
    is_lora_param,
    lora_file_key,
    lora_state_dict,
)
from boogu_adapters.training import TrainingAdapter
from boogu_trainer.config import TrainerConfig
from boogu_trainer.distributed import (
    DistEnv,
    full_optimizer_state,
    full_tensor,
    load_full_state,
    local_tensor,
)
from boogu_trainer.forward_process import ForwardProcessUpdate, PhaseCounter, nullphase, swapped
from boogu_trainer.losses import (
    RATIO_SQ_DEV,
    MetricSums,
    grpo_guard_loss,
    kl_to_reference,
    policy_loss,
    pooled_ratio_std,
)
from boogu_trainer.rollout import ScoredBatch


@dataclass(frozen=True)
class UpdateResult:
    metrics: dict[str, Any]
    """Averaged loss terms, ratio/clip statistics, grad norm, on-policy log-prob differences."""
    finite: bool
    """Every loss and gradient was finite (no optimizer step was skipped for non-finite values)."""
    weights_finite: bool = True
    """The LoRA stayed finite; False means the last update was undone (see `Learner`)."""


class Learner:
    """Owns the trainable LoRA parameters, AdamW, the EMA and the update counters."""

    def __init__(
        self,
        config: TrainerConfig,
        transformer: torch.nn.Module,
        adapter: TrainingAdapter,
        dist: DistEnv,
        device: torch.device,
    ):
        self.config = config
        self.transformer = transformer
        self.adapter = adapter
        self.dist = dist
        self.device = device
        named = [(n, p) for n, p in transformer.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        self._names = {id(p): n for n, p in named}
        o = config.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.counters: dict[str, int] = defaultdict(int)
        self.ema: dict[str, torch.Tensor] | None = (
            {k: v.float().clone() for k, v in self.full_lora().items()} if config.ema.enabled else None
        )
        self._snapshot: list[torch.Tensor] | None = None
        self.count_as: PhaseCounter = nullphase
        """Names the phase of the learner's extra forwards ('reference', 'old') for the FE accounting."""
        self.old: list[torch.Tensor] | None = (
            [p.detach().clone() for p in self.params] if config.algorithm.name == "diffusion_nft" else None
        )
        """DiffusionNFT's old (sampling) policy: one tensor per LoRA parameter, sharded like it."""
        self.old_is_current = True
        """The old policy equals the current one (no lag yet, or ``old_decay_max = 0``)."""
        self.last_old_decay = 0.0

    # ---- the update --------------------------------------------------------------------------------
    def update(self, batch: ScoredBatch, step: int = 0) -> UpdateResult:
        """The configured algorithm's update on one rollout batch (``step``: the training step, 0-based,
        which seeds the forward-process algorithms' noise)."""
        if self.config.algorithm.name == "flow_grpo":
            return self._update_policy(batch)
        result = ForwardProcessUpdate(self, batch, step).run()
        if self.old is not None and result.weights_finite:
            self._update_old()
        return result

    @contextlib.contextmanager
    def sampling_policy(self) -> Iterator[None]:
        """The module holds the rollout policy's weights inside the block: NFT's old policy when it lags."""
        if self.old is None or self.old_is_current:
            yield
            return
        with swapped([local_tensor(p.detach()) for p in self.params], [local_tensor(o) for o in self.old]):
            yield

    def _update_old(self) -> None:
        """old <- d old + (1 - d) current, d from ``algorithm.nft`` and the optimizer steps so far."""
        assert self.old is not None
        d = self.config.algorithm.nft.old_decay(self.counters["optimizer_steps"])
        local_old = [local_tensor(o) for o in self.old]
        current = [local_tensor(p.detach()) for p in self.params]
        with torch.no_grad():
            if d == 0.0:
                torch._foreach_copy_(local_old, current)
            else:
                torch._foreach_mul_(local_old, d)
                torch._foreach_add_(local_old, current, alpha=1.0 - d)
        self.old_is_current = d == 0.0
        self.counters["old_lags"] = int(d != 0.0)
        self.last_old_decay = d

    def old_state(self) -> dict[str, torch.Tensor] | None:
        """The whole old policy by LoRA file key (a collective under FSDP), or None."""
        if self.old is None:
            return None
        return {
            lora_file_key(name): full_tensor(o).detach()
            for name, o in zip(self.param_names, self.old)
            if is_lora_param(name)
        }

    def optimizer_step(self, bad_loss: torch.Tensor, acc: dict[str, list]) -> str:
        """Clip, check, step: 'ok', 'skipped' (a non-finite loss or gradient) or 'undone' (non-finite weights)."""
        grad_norm = full_tensor(torch.nn.utils.clip_grad_norm_(self.params, self.config.optim.grad_clip))
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

    def _update_policy(self, batch: ScoredBatch) -> UpdateResult:
        """FlowGRPO's policy-gradient updates on one rollout batch.

        Inside the loops over mini-batches, micro-batches and window steps nothing is read back from
        the device; each optimizer step makes two host reads (whether the losses and the gradient norm
        were finite, and whether the updated weights are), and the metrics are read once at the end.
        """
        a = self.config.algorithm
        traj = batch.trajectory
        n = a.group_size
        self.transformer.train()
        acc: dict[str, list[torch.Tensor | float]] = defaultdict(list)
        logprob_diff: list[torch.Tensor | None] = [None] * traj.window_size
        all_finite, weights_finite = True, True
        self.counters["nonfinite_reward_samples"] += int((~batch.finite).sum())
        advantages = torch.where(
            batch.finite.to(self.device), batch.advantages, torch.zeros_like(batch.advantages)
        )
        if not bool(batch.global_advantages.finite.any()):
            return self.finish(acc, logprob_diff, finite=False)
        host_advantages = advantages.cpu()  # once per update, before the loops
        groups = traj.batch_size // n
        num_mb = min(a.mini_batches, groups)
        global_group = traj.group_id.cpu()[::n]  # (groups,) global group index of each local group
        for epoch in range(a.inner_epochs):
            for mb in range(num_mb):
                local_groups = (global_group % num_mb == mb).nonzero().flatten().tolist()
                # Host indices (read once above): the mini-batch's rows stay on the CPU.
                rows = torch.tensor(
                    [g * n + j for g in local_groups for j in range(n)], dtype=torch.long, device="cpu"
                )
                total_rows = rows.numel()
                if not self.dist.enabled and a.kl_coef == 0:
                    # No policy gradient where A = 0: skip the compute (a single process only; under
                    # FSDP every rank must run the same forwards).
                    rows = rows[host_advantages[rows] != 0]
                if rows.numel() == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                bad_loss = self._accumulate(
                    batch,
                    advantages,
                    self.micro_batches(rows),
                    total_rows,
                    acc,
                    logprob_diff,
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
        return self.finish(acc, logprob_diff, finite=all_finite, weights_finite=weights_finite)

    def micro_batches(self, rows: torch.Tensor | list[int]) -> list[list[int]]:
        """``rows`` (host indices) in consecutive chunks of ``algorithm.train_micro_batch_size``."""
        rows = rows.tolist() if isinstance(rows, torch.Tensor) else list(rows)
        size = self.config.algorithm.train_micro_batch_size or len(rows)
        return [rows[i : i + size] for i in range(0, len(rows), size)]

    def _accumulate(
        self, batch, advantages, chunks, total_rows, acc, logprob_diff, *, first: bool
    ) -> torch.Tensor:
        """Forward + backward of every micro-batch and window step of one mini-batch.

        Gradients accumulate across micro-batches: each contributes its rows' share of the mean over
        the mini-batch's samples (skipped ones count as zero) and the window's steps. Returns a device
        bool: some loss was not finite. Under several ranks such a loss still goes through backward,
        whose FSDP reduce-scatters every rank must join; the optimizer step is then skipped on all ranks.
        """
        a = self.config.algorithm
        traj = batch.trajectory
        bad = torch.zeros((), dtype=torch.bool, device=self.device)
        # Each metric is the mini-batch's mean over samples and window steps: chunk values weighted
        # by their share of the rows.
        sums = MetricSums()
        add = sums.add

        rows = sum(len(chunk) for chunk in chunks)
        for chunk in chunks:
            weight = len(chunk) / total_rows / traj.window_size
            share = len(chunk) / rows / traj.window_size
            chunk_advantages = self.adapter.rows(advantages, chunk)
            for k in range(traj.window_size):
                stats = self.adapter.step_stats(self.transformer, traj, k, index=chunk)
                old = self.adapter.rows(traj.log_prob, chunk)[:, k]
                if first:
                    # Before any update the recomputed log-prob must equal the rollout's (on-policy check).
                    diff = (stats.log_prob.detach() - old).abs().max()
                    logprob_diff[k] = (
                        diff if logprob_diff[k] is None else torch.maximum(logprob_diff[k], diff)
                    )
                step = self.adapter.rows(traj.step_index, chunk)[:, k]
                dt = traj.sigmas[step + 1] - traj.sigmas[step]
                if a.loss == "grpo_guard":
                    old_mean = self.adapter.rows(traj.mean, chunk)[:, k]
                    pl = grpo_guard_loss(
                        stats.log_prob,
                        old,
                        stats.mean,
                        old_mean,
                        stats.std,
                        dt,
                        chunk_advantages,
                        a.clip_range,
                        sampler=traj.sampler,
                    )
                else:
                    pl = policy_loss(stats.log_prob, old, chunk_advantages, a.clip_range)
                loss = pl.loss
                if a.kl_coef > 0:
                    with torch.no_grad(), self.count_as("reference"):
                        ref = self.adapter.step_stats(
                            self.transformer, traj, k, index=chunk, use_adapters=False
                        )
                    kl = kl_to_reference(stats.mean, ref.mean, stats.std, dt, a.kl_kind, traj.sampler).mean()
                    loss = loss + a.kl_coef * kl
                    add("kl_ref", kl, share)
                bad = bad | ~torch.isfinite(loss.detach())
                (loss * weight).backward()
                sums.add_loss(loss, pl, share)
        sums.into(acc)
        return bad

    def finish(self, acc, logprob_diff, *, finite: bool, weights_finite: bool = True) -> UpdateResult:
        """The update's metrics, read from the device once."""
        self.transformer.eval()
        out: dict[str, Any] = {}
        on_device: list[tuple[str, torch.Tensor]] = []
        for key, values in acc.items():
            if not values:
                continue
            if isinstance(values[0], torch.Tensor):
                on_device.append((key, torch.stack([v.double() for v in values]).mean()))
            else:
                out[key] = sum(values) / len(values)
        means = dict(on_device)
        if RATIO_SQ_DEV in means:  # the update's ratio std, pooled (read with the rest, no extra sync)
            std = pooled_ratio_std(means["ratio_mean"], means[RATIO_SQ_DEV])
            on_device = [(k, v) for k, v in on_device if k != RATIO_SQ_DEV] + [("ratio_std", std)]
        for k, d in enumerate(logprob_diff):
            if d is None:
                out[f"logprob_diff/step{k}"] = 0.0
            else:
                on_device.append((f"logprob_diff/step{k}", d.double()))
        if on_device:  # one read of everything the update measured on the device
            out.update(
                zip([k for k, _ in on_device], torch.stack([v for _, v in on_device]).tolist(), strict=True)
            )
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
        d = self.config.ema.decay
        for k, v in full.items():
            self.ema[k].mul_(d).add_(v.float(), alpha=1 - d)

    def apply_optim_config(self) -> None:
        """Set the optimizer's hyper-parameters from the config (after a resume that changed them)."""
        o = self.config.optim
        for group in self.optimizer.param_groups:
            group.update(lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay)

    def adapter_config(self) -> dict[str, Any]:
        base = self.config.model.path or self.config.model.tiny_path
        return adapter_config(self.transformer, base_model_name_or_path=base)

    def optimizer_state(self) -> tuple[dict[str, torch.Tensor], dict[str, Any]]:
        """AdamW state keyed by parameter name (full tensors, also under FSDP2) plus hyper-parameters."""
        if not self.optimizer.state:
            # Before the first step: torch's state-dict API would initialise the state (a zero step),
            # so a snapshot (the preflight's) would change what it reads.
            groups = [
                {k: v for k, v in g.items() if k != "params"}
                | {"params": [self._names[id(p)] for p in g["params"]]}
                for g in self.optimizer.param_groups
            ]
            return {}, {"param_groups": groups, "names": self.param_names}
        sd = full_optimizer_state(self.transformer, self.optimizer)
        tensors: dict[str, torch.Tensor] = {}
        for name, state in sd["state"].items():
            for key, value in state.items():
                tensors[f"{name}::{key}"] = torch.as_tensor(value).detach().to("cpu").contiguous()
        groups = [
            {k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
            for g in sd["param_groups"]
        ]
        return tensors, {"param_groups": groups, "names": self.param_names}

    def load(
        self,
        lora: dict[str, torch.Tensor],
        optimizer_tensors: dict[str, torch.Tensor],
        optimizer_meta: dict[str, Any],
        ema: dict[str, torch.Tensor] | None,
        counters: dict[str, int],
        old: dict[str, torch.Tensor] | None = None,
    ) -> None:
        """Put a checkpoint's LoRA (float32), AdamW state, EMA, NFT old policy and counters back (also
        into FSDP2 shards)."""
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
        by_file_key = {lora_file_key(n): n for n in self.param_names if is_lora_param(n)}
        if self.old is not None:
            if old is None:
                raise ValueError(
                    "algorithm.name=diffusion_nft but the checkpoint has no old policy (old_policy.safetensors)"
                )
            if set(old) != set(lora):
                raise ValueError("the checkpoint's old policy has other LoRA keys than its LoRA")
            # Through the module, so the values land in this rank's shards like the LoRA's own.
            old_sd = {by_file_key[k]: v.to(device=self.device, dtype=torch.float32) for k, v in old.items()}
            load_full_state(self.transformer, old_sd)
            with torch.no_grad():
                torch._foreach_copy_(
                    [local_tensor(o) for o in self.old], [local_tensor(p.detach()) for p in self.params]
                )
        model_sd = {by_file_key[k]: v.to(device=self.device, dtype=torch.float32) for k, v in lora.items()}
        load_full_state(self.transformer, model_sd)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in optimizer_tensors.items():
            name, field = key.rsplit("::", 1)
            state.setdefault(name, {})[field] = value.to(self.device) if value.dim() > 0 else value
        groups = [
            {**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g)
            for g in optimizer_meta["param_groups"]
        ]
        if state:
            load_full_state(self.transformer, {}, self.optimizer, {"state": state, "param_groups": groups})
            # Loading first initialises a state for every parameter (a zero-gradient step); a parameter
            # that had never received a gradient (e.g. the reference-image refiner in a T2I run) must
            # stay without one, or its first real update would use a different Adam step count.
            for name, param in zip(self.param_names, self.params):
                if name not in state:
                    self.optimizer.state.pop(param, None)
        else:  # saved before the first step: no state, only the hyper-parameters
            self.optimizer.state.clear()
            for group, saved in zip(self.optimizer.param_groups, groups, strict=True):
                group.update({k: v for k, v in saved.items() if k != "params"})
        if self.config.ema.enabled:
            if ema is None:
                raise ValueError("ema.enabled=true but the checkpoint has no EMA weights")
            self.ema = {
                k: v.to(self.device, torch.float32, copy=True) for k, v in ema.items()
            }  # never aliased
        self.counters = defaultdict(int, counters)
        self.old_is_current = not self.counters.get("old_lags", 0)

    def state_dict(self, full_lora: dict[str, torch.Tensor] | None = None) -> dict[str, Any]:
        """LoRA (file keys, float32), its peft config, AdamW state, EMA, NFT old policy and counters;
        ``full_lora``: the whole LoRA if already gathered. A collective under FSDP."""
        tensors, meta = self.optimizer_state()
        lora = full_lora if full_lora is not None else self.full_lora()
        old = self.old_state()
        return {
            "lora": {k: v.float().cpu() for k, v in lora.items()},
            "lora_config": self.adapter_config(),
            "optimizer_tensors": tensors,
            "optimizer_meta": meta,
            "ema": None if self.ema is None else {k: v.cpu() for k, v in self.ema.items()},
            "old": None if old is None else {k: v.float().cpu() for k, v in old.items()},
            "counters": dict(self.counters),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.zero_grad(set_to_none=True)
        self.load(
            state["lora"],
            state["optimizer_tensors"],
            state["optimizer_meta"],
            state["ema"],
            state["counters"],
            old=state["old"],
        )
