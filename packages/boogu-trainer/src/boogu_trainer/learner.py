"""The learner: FlowGRPO's policy update on one scored batch, the optimizer, the EMA.

For each of ``inner_epochs`` passes and each mini-batch (the groups whose global index is ``m``
modulo the number of mini-batches, so a run on several ranks updates on exactly the mini-batches
a single rank would), every window step ``k`` is recomputed through the same step function as the
rollout and contributes ``PPO-clip(exp(log p - log p_old), A) [+ beta KL]`` to a mean over the
mini-batch's samples and the window's steps; then one AdamW step on the LoRA parameters.

Skips are collective-safe: under several ranks every rank runs the same forwards (FSDP
collectives), and a non-finite loss or gradient on one rank skips the optimizer step on all. After
every optimizer step the LoRA is checked for non-finite values (one fused reduction); a non-finite
update is undone from a snapshot and reported, so the run can stop with the last good weights.
"""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import torch

from boogu_adapters.lora import adapter_config, is_lora_param, lora_file_key, lora_state_dict
from boogu_adapters.training import TrainingAdapter
from boogu_trainer.config import TrainerConfig
from boogu_trainer.distributed import DistEnv, full_tensor, local_tensor
from boogu_trainer.losses import kl_to_reference, policy_loss
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
        o = config.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.counters: dict[str, int] = defaultdict(int)
        self.ema: dict[str, torch.Tensor] | None = (
            {k: v.float().clone() for k, v in self.full_lora().items()} if config.ema.enabled else None
        )
        self._snapshot: list[torch.Tensor] | None = None

    # ---- the update --------------------------------------------------------------------------------
    def update(self, batch: ScoredBatch) -> UpdateResult:
        """Policy-gradient updates on one rollout batch."""
        a = self.config.algorithm
        traj = batch.trajectory
        n = a.group_size
        self.transformer.train()
        acc: dict[str, list[float]] = defaultdict(list)
        logprob_diff = [0.0] * traj.window_size
        all_finite, weights_finite = True, True
        self.counters["nonfinite_reward_samples"] += int((~batch.finite).sum())
        advantages = torch.where(
            batch.finite.to(self.device), batch.advantages, torch.zeros_like(batch.advantages)
        )
        if not bool(batch.global_advantages.finite.any()):
            return self._finish(acc, logprob_diff, finite=False)
        groups = traj.batch_size // n
        num_mb = min(a.mini_batches, groups)
        global_group = traj.group_id.cpu()[::n]  # (groups,) global group index of each local group
        for epoch in range(a.inner_epochs):
            for mb in range(num_mb):
                local_groups = (global_group % num_mb == mb).nonzero().flatten().tolist()
                rows = torch.tensor([g * n + j for g in local_groups for j in range(n)], dtype=torch.long)
                total_rows = rows.numel()
                if not self.dist.enabled and a.kl_coef == 0:
                    # No policy gradient where A = 0: skip the compute (a single process only; under
                    # FSDP every rank must run the same forwards).
                    rows = rows[advantages[rows].cpu() != 0]  # host sync, once per mini-batch
                if rows.numel() == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                finite = self._accumulate(batch, advantages, rows, total_rows, acc, logprob_diff, epoch, mb)
                finite = not self.dist.any(not finite, self.device, "agree on a non-finite loss")
                if not finite:
                    all_finite = False
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                grad_norm = full_tensor(
                    torch.nn.utils.clip_grad_norm_(self.params, self.config.optim.grad_clip)
                )
                acc["grad_norm"].append(float(grad_norm))  # host sync, once per optimizer step
                if not torch.isfinite(grad_norm):
                    self.counters["nonfinite_grad_norm"] += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    all_finite = False
                    continue
                self._take_snapshot()
                self.optimizer.step()
                self.counters["optimizer_steps"] += 1
                if not self._weights_finite():
                    self._restore_snapshot()
                    weights_finite = False
                    break
            if not weights_finite:
                break
        return self._finish(acc, logprob_diff, finite=all_finite, weights_finite=weights_finite)

    def _accumulate(self, batch, advantages, rows, total_rows, acc, logprob_diff, epoch, mb) -> bool:
        """Forward + backward of every window step of one mini-batch; False if a loss was not finite."""
        a = self.config.algorithm
        traj = batch.trajectory
        finite = True
        for k in range(traj.window_size):
            stats = self.adapter.step_stats(self.transformer, traj, k, index=rows)
            old = traj.log_prob[rows, k]
            if epoch == 0 and mb == 0:
                # Before any update the recomputed log-prob must equal the rollout's (on-policy check).
                logprob_diff[k] = float((stats.log_prob.detach() - old).abs().max())
            pl = policy_loss(stats.log_prob, old, advantages[rows], a.clip_range)
            loss = pl.loss
            if a.kl_coef > 0:
                with torch.no_grad():
                    ref = self.adapter.step_stats(self.transformer, traj, k, index=rows, use_adapters=False)
                step = traj.step_index[rows, k]
                dt = traj.sigmas[step + 1] - traj.sigmas[step]
                kl = kl_to_reference(stats.mean, ref.mean, stats.std, dt, a.kl_kind, traj.sampler).mean()
                loss = loss + a.kl_coef * kl
                acc["kl_ref"].append(float(kl))
            finite &= bool(torch.isfinite(loss))  # host sync, once per window step
            if not finite and not self.dist.enabled:
                return False
            # Mean over the mini-batch's samples (skipped ones count as zero), averaged over steps.
            # Under several ranks a non-finite loss still goes through backward, whose FSDP
            # reduce-scatters every rank must join; the optimizer step is then skipped on all ranks.
            (loss * (rows.numel() / total_rows / traj.window_size)).backward()
            acc["loss"].append(float(loss.detach()))
            acc["policy_loss"].append(float(pl.loss.detach()))
            for key, value in pl.metrics.items():
                acc[key].append(value)
        return finite

    def _finish(self, acc, logprob_diff, *, finite: bool, weights_finite: bool = True) -> UpdateResult:
        self.transformer.eval()
        out: dict[str, Any] = {k: sum(v) / len(v) for k, v in acc.items() if v}
        for k, d in enumerate(logprob_diff):
            out[f"logprob_diff/step{k}"] = d
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
        return not self.dist.any(bad, self.device, "check the LoRA for non-finite values")

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
        from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

        sd = get_optimizer_state_dict(
            self.transformer,
            self.optimizer,
            options=StateDictOptions(full_state_dict=True, cpu_offload=False),
        )
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
    ) -> None:
        """Put a checkpoint's LoRA (float32), AdamW state, EMA and counters back (also into FSDP2 shards)."""
        from torch.distributed.checkpoint.state_dict import (
            StateDictOptions,
            set_model_state_dict,
            set_optimizer_state_dict,
        )

        if optimizer_meta["names"] != self.param_names:
            raise ValueError(
                "the checkpoint's optimizer was built for different LoRA parameters than this model's"
            )
        by_file_key = {lora_file_key(n): n for n in self.param_names if is_lora_param(n)}
        missing = sorted(set(by_file_key) - set(lora))
        unexpected = sorted(set(lora) - set(by_file_key))
        if missing or unexpected:
            raise ValueError(
                f"checkpoint LoRA keys do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
            )
        opts = StateDictOptions(full_state_dict=True, strict=False)
        model_sd = {by_file_key[k]: v.to(device=self.device, dtype=torch.float32) for k, v in lora.items()}
        set_model_state_dict(self.transformer, model_sd, options=opts)
        state: dict[str, dict[str, torch.Tensor]] = {}
        for key, value in optimizer_tensors.items():
            name, field = key.rsplit("::", 1)
            state.setdefault(name, {})[field] = value.to(self.device) if value.dim() > 0 else value
        groups = [
            {**g, "betas": tuple(g["betas"])} if "betas" in g else dict(g)
            for g in optimizer_meta["param_groups"]
        ]
        set_optimizer_state_dict(
            self.transformer, self.optimizer, {"state": state, "param_groups": groups}, options=opts
        )
        # Loading first initialises a state for every parameter (a zero-gradient step); a parameter
        # that had never received a gradient (e.g. the reference-image refiner in a T2I run) must stay
        # without one, or its first real update would use a different Adam step count.
        for name, param in zip(self.param_names, self.params):
            if name not in state:
                self.optimizer.state.pop(param, None)
        if self.config.ema.enabled:
            if ema is None:
                raise ValueError("ema.enabled=true but the checkpoint has no EMA weights")
            self.ema = {k: v.float().to(self.device) for k, v in ema.items()}
        self.counters = defaultdict(int, counters)
