"""The FlowGRPO trainer: rollout, rewards, group advantages, clipped policy updates, weight sync.

Reads like the algorithm (Flow-GRPO, Liu et al. 2025):

    for step in range(total_steps):
        prompts   = data.next_batch()                      # B prompts, deterministic order
        traj      = engine.generate(prompts x n samples)   # SDE rollouts with log-probs
        rewards   = reward_fn(traj.images, prompts)
        A         = group-normalised advantages
        for each mini-batch, each window step k:
            log p = adapter.step_stats(policy, traj, k)    # same step function as the rollout
            loss  = PPO-clip(exp(log p - log p_old), A) [+ beta KL to the base model]
        AdamW on the LoRA parameters; engine.sync_weights(LoRA)
"""

from __future__ import annotations

import logging
import math
import resource
import time
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import yaml

from boogu_adapters.components import build_local_engine
from boogu_adapters.loading import BooguParts, load_boogu
from boogu_adapters.lora import add_lora, lora_state_dict
from boogu_adapters.training import TrainingAdapter
from boogu_adapters.types import RolloutRequest, Trajectory
from boogu_data import PromptRecord
from boogu_schedule import WindowPlan
from boogu_trainer import checkpoint as ckpt
from boogu_trainer.advantages import compute_advantages
from boogu_trainer.config import TrainerConfig, config_to_dict
from boogu_trainer.data import PromptSampler, demo_records, load_records
from boogu_trainer.distributed import DistEnv, full_tensor, shard_transformer
from boogu_trainer.losses import kl_to_reference, policy_loss
from boogu_trainer.rewards import build_rewards
from boogu_trainer.runlog import RunLog, plot_reward_curve, sample_grid

logger = logging.getLogger("boogu_trainer")

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


class TrainingStopped(RuntimeError):
    """The run stopped itself (repeated non-finite rewards/losses); a checkpoint was written first."""


@dataclass
class StepResult:
    metrics: dict[str, Any]
    trajectory: Trajectory
    records: list[PromptRecord]
    rewards: torch.Tensor | None = None
    """(B,) this rank's weighted rewards, as scored for the update."""


def resolve_device(spec: str) -> torch.device:
    if spec == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    device = torch.device(spec)
    if device.type == "cuda" and not torch.cuda.is_available():
        raise RuntimeError(f"model.device={spec!r} but CUDA is not available on this machine")
    return device


def _mix(seed: int, step: int) -> int:
    return (seed * 1_000_003 + step * 7919 + 1) % (2**62)


class Trainer:
    """One FlowGRPO run. ``train()`` runs to ``total_steps``; ``state_dict()`` is everything a resume needs."""

    def __init__(
        self, config: TrainerConfig, *, dist: DistEnv | None = None, parts: BooguParts | None = None
    ):
        self.config = config
        self.device = resolve_device(config.model.device)
        self.dist = dist or DistEnv()
        self.run_dir = config.run_path
        torch.manual_seed(config.seed)
        self.parts = parts if parts is not None else self._load_parts()
        self.transformer = self._prepare_transformer(self.parts.transformer)
        if self.dist.enabled and config.distributed.fsdp:
            shard_transformer(self.transformer, self.device.type)
        self.engine = build_local_engine(
            self.parts,
            transformer=self.transformer,
            max_sequence_length=config.model.max_sequence_length,
            cfg_mode=config.rollout.cfg_mode,
            device=self.device,
        )
        self.adapter = TrainingAdapter(self.engine.freqs_cis)
        named = [(n, p) for n, p in self.transformer.named_parameters() if p.requires_grad]
        self.param_names = [n for n, _ in named]
        self.params = [p for _, p in named]
        o = config.optim
        self.optimizer = torch.optim.AdamW(
            self.params, lr=o.lr, betas=o.betas, eps=o.eps, weight_decay=o.weight_decay
        )
        self.rewards = build_rewards(list(config.reward.rewards))
        self.data = PromptSampler(
            self._records(config.data.train_files),
            config.data.prompts_per_step,
            shuffle=config.data.shuffle,
            seed=config.seed,
        )
        self.ema: dict[str, torch.Tensor] | None = (
            {k: v.float().clone() for k, v in self.full_lora_state().items()} if config.ema.enabled else None
        )
        self.step = 0
        self.nonfinite_streak = 0
        self.counters: dict[str, int] = defaultdict(int)
        self.window_plan = WindowPlan(
            kind=config.sampler.window_kind,
            size=config.sampler.window_size,
            window_range=config.sampler.window_range,
            start=config.sampler.window_start,
            scope=config.sampler.window_scope,
            stride=config.sampler.window_stride,
            every=config.sampler.window_every,
        )
        self.log: RunLog | None = None
        self.val_records = (
            load_records(config.data.val_files)[: config.eval.num_prompts] if config.data.val_files else []
        )

    # ---- construction --------------------------------------------------------------------------
    def _load_parts(self) -> BooguParts:
        cfg = self.config.model
        path = cfg.path
        if not path:
            from boogu_adapters.tiny import ensure_tiny_checkpoint

            path = str(ensure_tiny_checkpoint(Path(cfg.tiny_path).expanduser()))
        return load_boogu(
            path,
            transformer=cfg.transformer,
            trust_remote_code=cfg.trust_remote_code,
            dtype=DTYPES[cfg.dtype],
            device=self.device,
        )

    def _prepare_transformer(self, transformer: torch.nn.Module) -> torch.nn.Module:
        cfg = self.config
        for p in transformer.parameters():
            p.requires_grad_(False)
        add_lora(
            transformer,
            rank=cfg.lora.rank,
            alpha=cfg.lora.alpha,
            target_modules=cfg.lora.target_modules,
            init_lora_weights=True if cfg.lora.init == "default" else "gaussian",
            seed=cfg.seed,
        )
        # float32 master weights for the adapters even when the base runs in bf16.
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.data = p.data.float()
        checkpointing = cfg.model.gradient_checkpointing
        if checkpointing is None:
            checkpointing = transformer.config.hidden_size >= 1024
        if checkpointing:
            transformer.enable_gradient_checkpointing()
        return transformer

    def _records(self, files) -> list[PromptRecord]:
        if files:
            return load_records(files)
        return demo_records(self.config.data.demo_prompts)

    # ---- the loop ------------------------------------------------------------------------------
    def train(self, progress: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        cfg = self.config
        self.run_dir.mkdir(parents=True, exist_ok=True)
        if self.log is None:
            self.log = RunLog(
                self.run_dir,
                tensorboard=cfg.logging.tensorboard,
                wandb=cfg.logging.wandb,
                config=config_to_dict(cfg),
            )
            if self.step == 0:
                self.log.truncate_to(0)
        (self.run_dir / "config.yaml").write_text(yaml.safe_dump(config_to_dict(cfg), sort_keys=False))
        while self.step < cfg.total_steps:
            result = self.train_step()
            self.step += 1
            record = {"step": self.step, **result.metrics}
            if (
                cfg.eval.every
                and self.val_records
                and (self.step % cfg.eval.every == 0 or self.step == cfg.total_steps)
            ):
                record.update(self.evaluate())
            if self.dist.is_main:
                self.log.log(record)
                # One line per reward, plus the weighted total when there are several.
                labels = list(self.rewards.labels)
                plot_reward_curve(
                    self.log.history,
                    self.run_dir / "reward_curve.png",
                    ["reward", *labels] if len(labels) > 1 else ["reward"],
                )
                if cfg.logging.sample_every and (self.step % cfg.logging.sample_every == 0 or self.step == 1):
                    self._write_samples(result)
            if (
                cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0
            ) or self.step == cfg.total_steps:
                self.save()
            if progress is not None:
                progress(self.step, record)
        return self.log.history

    def train_step(self) -> StepResult:
        cfg = self.config
        timings: dict[str, float] = {}
        t_step = time.perf_counter()
        records = self.data.next_batch()
        lo, hi = self.dist.shard(len(records))
        local = records[lo:hi]

        t0 = time.perf_counter()
        engine_before = dict(self.engine.stats.seconds)
        traj = self.rollout(local, group_offset=lo)
        timings["time/rollout"] = time.perf_counter() - t0
        timings["time/encode"] = self.engine.stats.seconds.get("encode", 0.0) - engine_before.get(
            "encode", 0.0
        )

        t0 = time.perf_counter()
        sample_records = [r for r in local for _ in range(cfg.algorithm.group_size)]
        scores = self.rewards(traj.images, sample_records)
        timings["time/reward"] = time.perf_counter() - t0

        per_reward = {k: self.dist.all_gather_cat(v.float()) for k, v in scores.per_reward.items()}
        group_id = self.dist.all_gather_cat(traj.group_id.cpu())
        a = cfg.algorithm
        adv = compute_advantages(
            per_reward,
            self.rewards.weights,
            group_id,
            std_scope=a.std_scope,
            normalize_std=a.normalize_std,
            eps=a.adv_eps,
            clip=a.adv_clip,
            per_reward_normalization=a.per_reward_normalization,
            sign=a.advantage_sign,
        )
        metrics: dict[str, Any] = {}
        for name, v in {"reward": adv.rewards, **per_reward}.items():
            finite = v[torch.isfinite(v)]
            metrics[f"{name}/mean"] = float(finite.mean()) if finite.numel() else math.nan
            metrics[f"{name}/std"] = float(finite.std(unbiased=False)) if finite.numel() else math.nan
        metrics.update(adv.stats())
        if not bool(adv.finite.all()):
            self.counters["nonfinite_reward_samples"] += int((~adv.finite).sum())
            logger.warning(
                "step %d: %d samples with non-finite rewards get no gradient",
                self.step + 1,
                int((~adv.finite).sum()),
            )

        t0 = time.perf_counter()
        local_adv = adv.advantages[lo * a.group_size : hi * a.group_size].to(self.device)
        update_ok = bool(adv.finite.any())
        if update_ok:
            train_metrics = self.update(traj, local_adv, adv.finite[lo * a.group_size : hi * a.group_size])
            update_ok = train_metrics.pop("_finite")
            metrics.update(train_metrics)
        timings["time/train"] = time.perf_counter() - t0
        if update_ok:
            self.nonfinite_streak = 0
        else:
            self.nonfinite_streak += 1
            self.counters["skipped_updates"] += 1
            logger.warning("step %d: non-finite rewards or loss; the update was skipped", self.step + 1)
            if self.nonfinite_streak >= cfg.reward.max_nonfinite_steps:
                path = self.save(step=self.step)
                raise TrainingStopped(
                    f"{self.nonfinite_streak} consecutive steps had non-finite rewards or losses "
                    f"(reward.max_nonfinite_steps={cfg.reward.max_nonfinite_steps}); the last good state is "
                    f"saved in {path}. Check the reward functions (metrics.jsonl has per-reward stats)."
                )

        t0 = time.perf_counter()
        self.sync()
        timings["time/sync"] = time.perf_counter() - t0
        if self.ema is not None:
            d = cfg.ema.decay
            for k, v in self.full_lora_state().items():
                self.ema[k].mul_(d).add_(v.detach().float(), alpha=1 - d)

        step_time = time.perf_counter() - t_step
        images = traj.batch_size * self.dist.world_size
        metrics.update(timings)
        metrics.update(
            {
                "time/step": step_time,
                "images_per_s": images / step_time,
                "nfe/rollout_per_image": traj.nfe_per_image,
                "nfe/train_per_image": traj.window_size
                * (1 if traj.guidance_scale == 1.0 else 2)
                * a.inner_epochs
                * (2 if a.kl_coef > 0 else 1),
                "prompt_encodings_per_prompt": self.engine.stats.prompts_encoded
                / max(self.engine.stats.samples / a.group_size, 1),
                "peak_memory_gb": _peak_memory_gb(self.device),
                "skipped_updates": self.counters["skipped_updates"],
                "nonfinite_reward_samples": self.counters["nonfinite_reward_samples"],
                "weights_version": self.engine.weights_version,
                "samples": traj.batch_size * self.dist.world_size,
                "edit_samples": int(
                    self.dist.all_reduce_sum(
                        torch.tensor(
                            [sum(r.ref_image is not None for r in local) * a.group_size], device=self.device
                        )
                    )
                ),
            }
        )
        return StepResult(metrics=metrics, trajectory=traj, records=local, rewards=scores.total)

    def rollout(self, records: list[PromptRecord], group_offset: int = 0) -> Trajectory:
        s = self.config.sampler
        request = RolloutRequest(
            records=records,
            group_size=self.config.algorithm.group_size,
            num_steps=s.num_steps,
            guidance_scale=s.guidance_scale,
            sampler=s.sampler,
            noise_level=s.noise_level,
            window=self.window_plan,
            height=s.height,
            width=s.width,
            seed=_mix(self.config.seed, self.step),
            group_offset=group_offset,
            iteration=self.step,
            decode=True,
        )
        if self.transformer.training:
            self.transformer.eval()
        return self.engine.generate(request)

    def update(self, traj: Trajectory, advantages: torch.Tensor, finite: torch.Tensor) -> dict[str, Any]:
        """Policy-gradient updates on one rollout batch; returns averaged metrics (and ``_finite``).

        Mini-batch ``m`` holds the groups whose global index is ``m`` modulo the number of
        mini-batches, so a run on several ranks updates on exactly the mini-batches a single rank
        would. Each mini-batch's loss is a mean over all its samples; samples that carry no gradient
        (zero advantage, non-finite reward) are skipped on a single process, where that only saves
        compute. Under several ranks every rank runs the same forwards (FSDP collectives).
        """
        cfg = self.config.algorithm
        n = cfg.group_size
        groups = traj.batch_size // n
        if not self.transformer.training:
            self.transformer.train()
        acc: dict[str, list[float]] = defaultdict(list)
        logprob_diff = [0.0] * traj.window_size
        all_finite = True
        num_mb = min(cfg.mini_batches, groups)
        global_group = traj.group_id.cpu()[::n]  # (groups,) global group index of each local group
        advantages = torch.where(finite.to(advantages.device), advantages, torch.zeros_like(advantages))
        for epoch in range(cfg.inner_epochs):
            for mb in range(num_mb):
                local_groups = (global_group % num_mb == mb).nonzero().flatten().tolist()
                rows = torch.tensor([g * n + j for g in local_groups for j in range(n)], dtype=torch.long)
                total_rows = rows.numel()
                if not self.dist.enabled and cfg.kl_coef == 0:
                    rows = rows[(advantages[rows].cpu() != 0)]  # no policy gradient there: skip the compute
                if rows.numel() == 0:
                    continue
                self.optimizer.zero_grad(set_to_none=True)
                step_finite = True
                for k in range(traj.window_size):
                    stats = self.adapter.step_stats(self.transformer, traj, k, index=rows)
                    old = traj.log_prob[rows, k]
                    if epoch == 0 and mb == 0:
                        # Before any update the recomputed log-prob must equal the rollout's (on-policy check).
                        logprob_diff[k] = float((stats.log_prob.detach() - old).abs().max())
                    pl = policy_loss(stats.log_prob, old, advantages[rows], cfg.clip_range)
                    loss = pl.loss
                    if cfg.kl_coef > 0:
                        with torch.no_grad():
                            ref = self.adapter.step_stats(
                                self.transformer, traj, k, index=rows, use_adapters=False
                            )
                        step = traj.step_index[rows, k]
                        dt = traj.sigmas[step + 1] - traj.sigmas[step]
                        kl = kl_to_reference(stats.mean, ref.mean, stats.std, dt, cfg.kl_kind).mean()
                        loss = loss + cfg.kl_coef * kl
                        acc["kl_ref"].append(float(kl))
                    step_finite &= bool(torch.isfinite(loss))
                    if not step_finite and not self.dist.enabled:
                        break
                    # Mean over the mini-batch's samples (skipped ones count as zero), averaged over steps.
                    scale = rows.numel() / total_rows / traj.window_size
                    if step_finite:
                        (loss * scale).backward()
                    acc["loss"].append(float(loss.detach()))
                    acc["policy_loss"].append(float(pl.loss.detach()))
                    for key, value in pl.metrics.items():
                        acc[key].append(value)
                if self.dist.enabled:  # skip together: one rank's NaN must not desynchronise the others
                    flag = torch.tensor([0.0 if step_finite else 1.0], device=self.device)
                    step_finite = float(self.dist.all_reduce_sum(flag)) == 0.0
                if not step_finite:
                    all_finite = False
                    self.optimizer.zero_grad(set_to_none=True)
                    continue
                grad_norm = full_tensor(
                    torch.nn.utils.clip_grad_norm_(self.params, self.config.optim.grad_clip)
                )
                acc["grad_norm"].append(float(grad_norm))
                if not torch.isfinite(grad_norm):
                    self.counters["nonfinite_grad_norm"] += 1
                    self.optimizer.zero_grad(set_to_none=True)
                    all_finite = False
                    continue
                self.optimizer.step()
                self.counters["optimizer_steps"] += 1
        self.transformer.eval()
        out: dict[str, Any] = {k: sum(v) / len(v) for k, v in acc.items() if v}
        for k, d in enumerate(logprob_diff):
            out[f"logprob_diff/step{k}"] = d
        out["optimizer_steps"] = self.counters["optimizer_steps"]
        out["_finite"] = all_finite
        return out

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        """Deterministic (ODE) samples of the validation prompts with a fixed seed, scored by the rewards.

        Uses ``eval.num_steps`` steps, so its curve is comparable across training steps but not with
        the training reward (rollouts use ``sampler.num_steps`` and SDE noise).
        """
        s = self.config.sampler
        lo, hi = (
            self.dist.shard(len(self.val_records))
            if len(self.val_records) % self.dist.world_size == 0
            else (0, 0)
        )
        records = self.val_records[lo:hi] if self.dist.enabled else self.val_records
        request = RolloutRequest(
            records=records,
            group_size=1,
            num_steps=self.config.eval.num_steps,
            guidance_scale=s.guidance_scale,
            noise_level=0.0,
            window=WindowPlan(kind="fixed", size=0, start=0),
            height=s.height,
            width=s.width,
            seed=self.config.seed,
            group_offset=lo,
        )
        traj = self.engine.generate(request)
        scores = self.rewards(traj.images, records)
        total = self.dist.all_gather_cat(scores.total.float())
        out = {"eval/reward/mean": float(total[torch.isfinite(total)].mean())}
        for name, v in scores.per_reward.items():
            v = self.dist.all_gather_cat(v.float())
            out[f"eval/{name}/mean"] = float(v[torch.isfinite(v)].mean())
        return out

    def full_lora_state(self) -> dict[str, torch.Tensor]:
        """The whole LoRA state (peft keys) on every rank; collective under FSDP."""
        return {k: full_tensor(v).detach() for k, v in lora_state_dict(self.transformer).items()}

    def sync(self) -> None:
        """Hand the new LoRA weights to the rollout engine (verified there)."""
        self.engine.sync_weights(self.full_lora_state(), version=self.step + 1)

    # ---- outputs -------------------------------------------------------------------------------
    def _write_samples(self, result: StepResult) -> None:
        traj = result.trajectory
        if traj.images is None:
            return
        k = min(self.config.logging.num_samples, traj.batch_size)
        n = self.config.algorithm.group_size
        # Spread the picks over groups so the grid shows different prompts.
        order = sorted(range(traj.batch_size), key=lambda i: (i % n, i // n))[:k]
        sample_records = [result.records[i // n] for i in order]
        # The rewards the update used (no second scoring pass on rank 0 only).
        totals = result.rewards[order].tolist() if result.rewards is not None else [float("nan")] * len(order)
        captions = [
            f"{r.ground_truth or r.instruction[:40]} | r={s:.3f}" for r, s in zip(sample_records, totals)
        ]
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        sample_grid(traj.images[order], captions, folder / f"step_{self.step:04d}.png")

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self) -> ckpt.CheckpointContents:
        tensors, meta = ckpt.optimizer_to_files(self.transformer, self.optimizer, self.param_names)
        lora = {k: v.float().cpu() for k, v in self.full_lora_state().items()}
        return ckpt.CheckpointContents(
            lora=lora,
            lora_config=self._peft_config(),
            optimizer_tensors=tensors,
            optimizer_meta=meta,
            trainer_state={
                "step": self.step,
                "data": self.data.state_dict(),
                "nonfinite_streak": self.nonfinite_streak,
                "counters": dict(self.counters),
                "weights_version": self.engine.weights_version,
            },
            config_yaml=yaml.safe_dump(config_to_dict(self.config), sort_keys=False),
            ema=None if self.ema is None else {k: v.cpu() for k, v in self.ema.items()},
        )

    def load_state_dict(self, contents: ckpt.CheckpointContents) -> None:
        ckpt.load_lora_and_optimizer(
            self.transformer, self.optimizer, self.param_names, contents, device=self.device
        )
        state = contents.trainer_state
        self.step = int(state["step"])
        self.data.load_state_dict(state["data"])
        self.nonfinite_streak = int(state["nonfinite_streak"])
        self.counters = defaultdict(int, state["counters"])
        if self.ema is not None:
            if contents.ema is None:
                raise ValueError("ema.enabled=true but the checkpoint has no EMA weights")
            self.ema = {k: v.float().to(self.device) for k, v in contents.ema.items()}
        if contents.rng is not None:
            ckpt.set_rng_state(contents.rng)
        self.engine.sync_weights(
            lora_state_dict(self.transformer), version=max(int(state["weights_version"]), 1)
        )

    def save(self, step: int | None = None) -> Path:
        contents = self.state_dict()
        path = self.run_dir / "checkpoints"
        if not self.dist.is_main:
            return path
        return ckpt.save_checkpoint(
            path, self.step if step is None else step, contents, self.config.checkpoint.keep_last
        )

    def resume(self, spec: str) -> Path | None:
        """``'auto'``: the latest complete checkpoint of this run (None if there is none); else a path."""
        folder = (
            ckpt.latest_checkpoint(self.run_dir / "checkpoints")
            if spec == "auto"
            else Path(spec).expanduser()
        )
        if folder is None:
            return None
        self.load_state_dict(ckpt.load_checkpoint(folder))
        self.log = RunLog(
            self.run_dir, tensorboard=self.config.logging.tensorboard, wandb=self.config.logging.wandb
        )
        self.log.truncate_to(self.step)
        return folder

    def _peft_config(self) -> dict[str, Any]:
        c = self.config.lora
        return {
            "peft_type": "LORA",
            "task_type": None,
            "r": c.rank,
            "lora_alpha": c.alpha,
            "target_modules": list(c.target_modules),
            "lora_dropout": 0.0,
            "bias": "none",
            "init_lora_weights": "gaussian" if c.init == "gaussian" else True,
            "base_model_name_or_path": self.config.model.path or self.config.model.tiny_path,
        }


def _peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux


def summarize_rewards(history: list[dict[str, Any]], window: int = 5) -> dict[str, float]:
    """First-vs-last ``window`` steps of the reward mean, with the standard error of the difference."""
    means = [h["reward/mean"] for h in history if math.isfinite(h.get("reward/mean", math.nan))]
    if len(means) < 2 * window:
        window = max(1, len(means) // 2)
    first, last = means[:window], means[-window:]

    def stats(xs):
        m = sum(xs) / len(xs)
        var = sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)
        return m, var / len(xs)

    m1, v1 = stats(first)
    m2, v2 = stats(last)
    return {"first": m1, "last": m2, "gain": m2 - m1, "stderr": math.sqrt(v1 + v2), "window": window}
