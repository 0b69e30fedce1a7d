"""The FlowGRPO trainer: rollout, rewards, group advantages, clipped policy updates, weight sync.

Reads like the algorithm (Flow-GRPO, Liu et al. 2025):

    for step in range(total_steps):
        prompts   = data.next_batch()                      # B prompts, deterministic order
        batch     = rollout.run(prompts x n samples)       # SDE rollouts with log-probs, rewards,
                                                           # group-normalised advantages A
        for each mini-batch, each window step k:           # learner.update(batch)
            log p = adapter.step_stats(policy, traj, k)    # same step function as the rollout
            loss  = PPO-clip(exp(log p - log p_old), A) [+ beta KL to the base model]
        AdamW on the LoRA parameters; engine.sync_weights(version=step)

`Trainer` composes the components, each owning its config and its saved state:
`RolloutScorer` (requests, rewards, advantages), `Learner` (optimizer, update, EMA),
`Checkpointer` (run folders, atomic verified checkpoints, resume checks), `MetricsLogger`
(metrics.jsonl, sinks, plots; rank 0 only) and `Evaluator`.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from boogu_adapters.components import build_local_engine
from boogu_adapters.engines import RolloutEngine
from boogu_adapters.loading import BooguParts
from boogu_adapters.lora import LoraMismatchError, peft_sync_config
from boogu_adapters.recompute import TransitionRecompute
from boogu_adapters.vllm_engine import VllmOmniRolloutEngine
from boogu_data import PromptRecord
from boogu_data.atomic import atomic_write_text
from boogu_trainer import checkpoint as ckpt
from boogu_trainer.batches import BatchSource, batch_source
from boogu_trainer.config import (
    ConfigError,
    TrainerConfig,
    check_world_layout,
    config_to_dict,
    config_to_yaml,
)
from boogu_trainer.data import PromptSampler, check_prompt_lengths, demo_records, load_sourced_records
from boogu_trainer.distributed import DistEnv, check_shared_folder, shard_transformer, startup_wait_s
from boogu_trainer.evaluation import EvalResult, Evaluator, GoldTracker, Verdict
from boogu_trainer.faults import fault_point
from boogu_trainer.learner import Learner, UpdateResult
from boogu_trainer.metrics import MetricsLogger, plot_reward_curve, sample_grid
from boogu_trainer.models import (
    base_model_name,
    base_model_path,
    enable_tf32,
    load_base_parts,
    prepare_policy,
)
from boogu_trainer.onpolicy import ON_POLICY_FIX, on_policy_problem
from boogu_trainer.pipeline import InFlight
from boogu_trainer.plan import check_rollout_fits, rank_text_encoder_placement
from boogu_trainer.preflight import PreflightReport, preflight_due, run_preflight
from boogu_trainer.prompt_stats import filter_records
from boogu_trainer.rewards import build_rewards
from boogu_trainer.scoring import RolloutScorer, ScoredBatch
from boogu_trainer.step_metrics import StepMetrics

logger = logging.getLogger("boogu_trainer")


class TrainingStopped(RuntimeError):
    """The run stopped itself (repeated non-finite rewards/losses, non-finite weights); a checkpoint was written first."""


@dataclass
class StepResult:
    metrics: dict[str, Any]
    batch: ScoredBatch


@dataclass
class ResumePoint:
    """Where step k+1 starts from, as a checkpoint of step k keeps it (`Trainer.state_dict`).

    Taken live by a save at the end of step k, and at the start of step k+1 for a stop in its middle
    (`Trainer._save_for_stop`), whose state has moved on by then.
    """

    data: dict[str, int]
    """The prompt sampler's position before step k+1's prompts."""
    rng: dict[str, torch.Tensor]
    """This rank's global RNG states before step k+1's rewards are scored (`ckpt.rng_state`)."""
    flight: InFlight | None
    """Pipelined: the batch step k+1 trains on (rolled out, in flight, or deferred at the last step)."""
    counters: dict[str, int]
    """The learner's counters after step k."""
    nonfinite_streak: int


class Trainer:
    """One FlowGRPO run. ``train()`` runs to ``total_steps``; ``state_dict()`` is everything a resume needs.

    A fresh run never writes into a used run folder: ``self.config.run_path`` may differ from the
    given config's (``name_1``, ...; ``self.run_note`` says so). The run folder is locked from the
    constructor on, before anything is loaded, until `close` (or the end of a ``with`` block).
    """

    def __init__(
        self,
        config: TrainerConfig,
        *,
        dist: DistEnv | None = None,
        parts: BooguParts | None = None,
        worker_log_dir: Path | None = None,
        lock: bool = True,
    ):
        self.dist = dist or DistEnv.single(config.model.device, config.distributed.timeout_s)
        self.device = self.dist.device
        """This rank's device (``DistEnv`` owns it: ``cuda:LOCAL_RANK`` under torchrun)."""
        if self.dist.enabled and not config.distributed.fsdp:
            raise ConfigError(
                f"distributed.fsdp=false on {self.dist.world_size} ranks: without FSDP2 nothing averages "
                "the gradients over the ranks, so each rank would train its own LoRA and only rank 0's would "
                "be saved. Use distributed.fsdp=true (the default), or run on one rank"
            )
        # Before any folder or weight: a rank layout whose mini-batches differ from one rank's.
        check_world_layout(config, self.dist.world_size)
        enable_tf32(config, self.device)
        self.config, self.run_note = ckpt.resolve_run_folder(config, self.dist)
        config = self.config
        self.run_dir = config.run_path
        self.run_lock = ckpt.RunFolderLock(self.run_dir)
        """Held (rank 0) from here, before the data, the model or a rollout worker are loaded, to
        `close`: a second writer of a live run stops at once and writes nothing (docs/reliability.md).
        ``lock=False`` (``trainer --preflight``, which writes nothing there) leaves it to `train`/`resume`."""
        if lock:
            self.lock_run_folder()
        try:
            if lock and self.dist.multi_node:  # rank 0 writes the checkpoints every rank resumes from
                check_shared_folder(self.run_dir, self.dist)
            self._start(config, parts, worker_log_dir)
        except BaseException:
            self.close()  # a launched rollout worker stops with a failed start; then the lock goes
            raise

    def _start(self, config: TrainerConfig, parts: BooguParts | None, worker_log_dir: Path | None) -> None:
        """The data, the model, the rollout engine and the components (`_build_components`)."""
        ckpt.seed_global_rngs(config.seed)
        # The prompts before the model: a data error costs seconds, not a model load.
        self._train_rows = self._read_records(config.data.train_files, "data.train_files")
        if config.data.prompt_stats:  # only the prompts whose samples differed there (prompt_stats.py)
            try:
                self._train_rows = filter_records(
                    *self._train_rows, config.data.prompt_stats, config.data.prompt_stats_min_std
                )
            except ValueError as error:
                raise ConfigError(f"data.prompt_stats={config.data.prompt_stats!r}: {error}") from error
        self._val_rows = (
            self._read_records(config.data.val_files, "data.val_files")
            if config.data.val_files or config.data.demo_set != "ocr"
            else None
        )
        if len(self._train_rows[0]) < config.data.prompts_per_step:
            raise ConfigError(
                f"data.prompts_per_step={config.data.prompts_per_step}: the training prompts "
                f"({', '.join(config.data.train_files) or 'built-in demo prompts'}"
                f"{', those with a spread in ' + config.data.prompt_stats if config.data.prompt_stats else ''}) hold only "
                f"{len(self._train_rows[0])}; a step needs {config.data.prompts_per_step}"
            )
        # Before the model, and before anything is written in the run folder (it holds only its lock).
        edit = any(record.ref_image is not None for record in self._train_rows[0])
        check_rollout_fits(config, self.device, self.dist.world_size, edit=edit)
        self.text_encoder_placement = rank_text_encoder_placement(
            config, self.device, self.dist.world_size, reference_images=int(edit)
        )
        """Where the text encoder's weights are: on the GPU, in host memory between encodes, or not
        loaded (the vllm-omni worker encodes); `plan.text_encoder_placement`."""
        self.parts = parts if parts is not None else self._load_parts()
        self.transformer = prepare_policy(self.parts.transformer, config)
        if self.dist.enabled:
            shard_transformer(self.transformer, self.dist)
        self.local_engine = build_local_engine(
            self.parts,
            transformer=self.transformer,
            max_sequence_length=config.model.max_sequence_length,
            cfg_mode=config.rollout.cfg_mode,
            device=self.device,
            edit_vlm_view=config.model.edit_vlm_view,
            micro_batch_size=config.rollout.micro_batch_size,
            # Under FSDP2 a reused text path skips its blocks' all-gathers: every rank would have to
            # reuse alike, step for step. It saves little at the sizes that shard; keep it to one rank.
            cache_text_path=not self.dist.enabled,
            text_encoder_offload=self.device if self.text_encoder_placement == "offloaded" else None,
        )
        """The in-process engine: the encoders and RoPE tables training uses, and the rollouts unless
        ``rollout.engine`` names another engine."""
        self._worker_log_dir = worker_log_dir if worker_log_dir is not None else config.run_path / "logs"
        self.engine: RolloutEngine = (
            self.local_engine
            if config.rollout.engine == "local"
            # Every rank's worker up before any rank goes on, waiting on a group whose timeout covers a
            # worker's start-up: on the NCCL group a slow worker would trip distributed.timeout_s.
            else self.dist.start_on_every_rank(
                self._remote_engine,
                "start its rollout worker",
                startup_wait_s(config.rollout.vllm.startup_timeout_s, self.dist.timeout_s),
            )
        )
        self._build_components(config)

    @property
    def data(self) -> PromptSampler:
        """The training prompts, in the order the steps draw them (their position is checkpointed)."""
        return self._data

    @data.setter
    def data(self, sampler: PromptSampler) -> None:
        """Another set of training prompts (a benchmark's, the GPU dry run's edit rows): the batch
        source draws the coming steps' prompts from it. Kept in one place: a sampler set here but not
        there would be checkpointed while the steps trained on the old one."""
        self._data = sampler
        self.batches.use_data(sampler)

    def _build_components(self, config: TrainerConfig) -> None:
        self.rewards = build_rewards(config.reward.rewards)
        self._data = PromptSampler(
            self._checked_records(*self._train_rows),
            config.data.prompts_per_step,
            shuffle=config.data.shuffle,
            seed=config.seed,
        )
        val = self._checked_records(*self._val_rows) if self._val_rows is not None else []
        self.rollout = RolloutScorer(
            config.sampler,
            config.algorithm,
            self.engine,
            self.rewards,
            self.dist,
            self.device,
            seed=config.seed,
            micro_batch_size=config.rollout.micro_batch_size,
        )
        self.learner = Learner(
            config.algorithm,
            config.optim,
            config.ema,
            self.transformer,
            TransitionRecompute(self.local_engine.freqs_cis),
            self.dist,
            self.device,
            seed=config.seed,
            base_model=base_model_name(config),
        )
        self.checkpointer = ckpt.Checkpointer(config, self.dist)
        self.evaluator = Evaluator(
            config.eval,
            config.sampler,
            self.engine,
            self.rewards,
            self.dist,
            val,
            seed=config.seed,
            total_steps=config.total_steps,
            micro_batch_size=config.rollout.micro_batch_size,
        )
        self.step_metrics = StepMetrics(
            self.transformer, self.dist, self.device, peak_override=config.perf.peak_tflops
        )
        self.learner.count_as = self.step_metrics.forwards.counting
        if config.rollout.pipeline == "one_step" and not self.engine.needs_lora_state:
            raise ConfigError(
                f"rollout.pipeline=one_step: the {type(self.engine).__name__} samples with the module the "
                "update changes; pipelining needs an engine with its own copy of the weights "
                "(rollout.engine=vllm_omni)"
            )
        self.batches: BatchSource = batch_source(
            config.rollout.pipeline,
            self.rollout,
            self._data,
            self.dist,
            self.device,
            sampling_policy=self.learner.sampling_policy,
            engine_version=lambda: self.engine.weights_version,
            rollout_weights=lambda: self._rollout_lora(None),
        )
        """Where each step's batch comes from (``rollout.pipeline``: `boogu_trainer.batches`)."""
        self.metrics: MetricsLogger | None = None
        self._published: tuple[int, dict[str, torch.Tensor] | None] = (0, None)
        """``(version, full LoRA)`` of the last `publish_weights` that gathered it (reused by a
        checkpoint of the same step)."""
        self.step = 0
        """Steps completed. Step ``self.step + 1`` is the next; its rollout and update are seeded by
        ``self.step`` (0-based), everything a person reads (logs, collectives, faults) says ``step k``."""
        self.nonfinite_streak = 0
        self._step_start: ResumePoint | None = None
        """Step k's end as step k+1 started from it: what a stop in step k+1 saves as step k."""
        self.preflight_report: PreflightReport | None = None
        self.last_evaluation: EvalResult | None = None
        """The latest evaluation of this process (the held-out comparison reuses that of the last step)."""
        self.gold = GoldTracker(k=config.eval.stop_on_divergence)

    # ---- construction --------------------------------------------------------------------------
    def _load_parts(self) -> BooguParts:
        return load_base_parts(self.config, self.device, self.text_encoder_placement)

    def _remote_engine(self) -> RolloutEngine:
        """``rollout.engine=vllm_omni``: a rollout worker in vllm-omni's environment, connected at
        ``rollout.vllm.url`` or launched now (one per rank), loading this run's checkpoint."""
        cfg = self.config
        v = cfg.rollout.vllm
        args = ["--backend", v.backend]
        if v.dtype != "auto":
            args += ["--dtype", v.dtype]
        if v.engine_args:
            args += ["--engine-args", json.dumps(v.engine_args)]
        rank, world = self.dist.rank, self.dist.world_size
        if v.url is None and world > 1 and v.devices is None and self.device.type == "cuda":
            raise ConfigError(
                f"rollout.engine=vllm_omni on {world} ranks launches one worker per rank: set rollout.vllm.devices "
                "to one GPU group per rank (e.g. '4;5;6;7'), or start the workers yourself and list their "
                "rollout.vllm.url"
            )
        log_path = self._worker_log_dir / f"rollout_worker_rank{rank}.log" if v.url is None else None
        return VllmOmniRolloutEngine(
            base_model_path(cfg),
            url=v.url_for_rank(rank, world),
            project_dir=v.project,
            python=v.python,
            device=self.device,
            worker_args=args,
            env={"CUDA_VISIBLE_DEVICES": v.devices_for_rank(rank, world)} if v.devices is not None else None,
            startup_timeout_s=v.startup_timeout_s,
            request_timeout_s=v.request_timeout_s,
            log_path=log_path,
            peft_config=peft_sync_config(cfg.lora.rank, cfg.lora.alpha, cfg.lora.target_modules),
            micro_batch_size=cfg.rollout.micro_batch_size,
        )

    def close(self) -> None:
        """Stop what the run started outside this process (a launched rollout worker), then unlock the
        run folder: the lock is held to the end of everything that writes it, the demo's held-out
        comparison after `train` included. Safe after a failed ``__init__`` and when called twice."""
        try:
            if hasattr(self, "step_metrics"):
                self.step_metrics.close()
            engine = getattr(self, "engine", None)
            if engine is not None and engine is not getattr(self, "local_engine", None):
                engine.close()  # first: a rollout in flight then ends at once
            if getattr(self, "batches", None) is not None:
                self.batches.close()
        finally:
            self.run_lock.release()  # last: a launched worker writes logs/ until it stops

    def __enter__(self) -> Trainer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def lock_run_folder(self) -> None:
        """Take the run folder's lock on rank 0 (`ckpt.RunFolderLock`); every rank raises
        `ckpt.RunFolderLocked` when another live process holds it."""
        error: tuple[bool, str] | None = None
        if self.dist.is_main:
            try:
                self.run_lock.acquire()
            except ckpt.RunFolderLocked as e:
                error = (True, str(e))
            except OSError as e:  # told to every rank, which would otherwise wait for rank 0
                error = (False, f"cannot create and lock the run folder {self.run_dir}: {e}")
        error = self.dist.broadcast_object(error, "lock the run folder")
        if error is not None:
            locked, message = error
            raise (ckpt.RunFolderLocked if locked else ckpt.CheckpointError)(message)

    def _read_records(self, files, key: str) -> tuple[list[PromptRecord], list[str]]:
        """The dataset's records and where each came from (the built-in demo prompts when ``files`` is
        empty); a missing or invalid file is a `ConfigError` naming ``key``."""
        if not files:
            data = self.config.data
            if key == "data.val_files":  # only the scene sets have built-in held-out prompts
                records = demo_records(
                    self.config.eval.num_prompts, data.demo_set, split=data.demo_eval_split
                )
            else:
                records = demo_records(data.demo_prompts, data.demo_set)
            return records, [f"built-in {data.demo_set} prompt {r.split} {r.index}" for r in records]
        try:
            return load_sourced_records(files)
        except (OSError, ValueError) as error:
            raise ConfigError(f"{key}={list(files)!r}: {error}") from error

    def _checked_records(self, records: list[PromptRecord], sources: list[str]) -> list[PromptRecord]:
        """``records``, every prompt's token count checked (naming file and row): needs the tokenizer."""
        check_prompt_lengths(
            records,
            sources,
            self.local_engine.encode_prompts.token_counts,
            self.config.model.max_sequence_length,
        )
        return records

    # ---- the loop ------------------------------------------------------------------------------
    def preflight(self) -> PreflightReport | None:
        """Run the preflight if it is due (``preflight`` on, a fresh run, not run yet); the report, or
        None when it is not due. A failed check raises `PreflightError` before any output."""
        if preflight_due(self):
            self.preflight_report = run_preflight(self)
            return self.preflight_report
        return None

    def train(self, progress: Callable[[int, dict[str, Any]], None] | None = None) -> list[dict[str, Any]]:
        cfg = self.config
        self.lock_run_folder()  # held since __init__ unless lock=False; kept until `close`
        self.preflight()
        if self.metrics is None:
            self.metrics = self._open_metrics()
            self.metrics.truncate_to(0)
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            atomic_write_text(self.run_dir / "config.yaml", config_to_yaml(cfg))
        try:
            while self.step < cfg.total_steps:
                result = self.train_step()
                self.step += 1
                record = {"step": self.step, **result.metrics}
                self.gold.observe_step(float(result.metrics.get("reward/mean", math.nan)))
                evaluation = self._evaluate() if self.evaluator.due(self.step) else None
                if evaluation is not None:
                    record.update(evaluation[0].metrics)
                self._write_outputs(record, result)
                saved = None
                if (cfg.checkpoint.save_every and self.step % cfg.checkpoint.save_every == 0) or (
                    self.step == cfg.total_steps
                ):
                    saved = self.save()
                if evaluation is not None:
                    self._after_evaluation(*evaluation, saved)
                fault_point("step_end", self.step, self.dist.rank)
                if progress is not None:
                    progress(self.step, record)
        finally:
            self.metrics.close()  # the run lock stays: what follows a run (the held-out comparison) writes too
        return self.metrics.history

    def train_step(self) -> StepResult:
        """One step: take the batch (`boogu_trainer.batches`: rolled out now, or one step ahead),
        update the policy, publish the new weights, check."""
        done, step, rank, meter, source = (
            self.step,
            self.step + 1,
            self.dist.rank,
            self.step_metrics,
            self.batches,
        )
        meter.start()
        start = time.perf_counter()
        fault_point("step_start", step, rank)
        source.begin(done)
        self._step_start = self._resume_point()
        batch = source.next(done, meter)
        fault_point("after_rollout", step, rank)
        source.before_update(done, self.config.total_steps)
        update_start = time.perf_counter()
        with meter.phase("train"), self.dist.collective(f"update, step {step}"):
            update = self.learner.update(batch, step=done)
        update_span = (update_start, time.perf_counter())
        fault_point("after_update", step, rank)
        source.after_update(meter)
        self._check_failures(update)  # a stop keeps the engine (and the EMA) at step k's weights
        with meter.phase("sync"), self.dist.collective(f"weight sync, step {step}"):
            self.publish_weights(version=step)
        extra = {**self._state_metrics(), **source.step_metrics(done, start, update_span)}
        metrics = meter.finish(batch, update, extra, remote=self.engine is not self.local_engine)
        metrics = source.relabel(metrics)
        self._warn_logprob_diff(metrics, step)
        return StepResult(metrics=metrics, batch=batch)

    def _state_metrics(self) -> dict[str, Any]:
        """The counters a step's record shows: skipped updates, non-finite rewards, the weights version."""
        counters = self.learner.counters
        out = {
            "skipped_updates": counters["skipped_updates"],
            "nonfinite_reward_samples": counters["nonfinite_reward_samples"],
            "weights_version": self.engine.weights_version,
        }
        out.update(self.learner.algorithm.step_metrics())
        return out

    def evaluation_weights(self) -> contextlib.AbstractContextManager[None]:
        """The weights an evaluation judges: the EMA with ``ema.enabled`` and ``ema.evaluate`` (put
        back after), else the trained ones."""
        if self.config.ema.enabled and self.config.ema.evaluate:
            return self.learner.ema_weights()
        return contextlib.nullcontext()

    def _evaluate(self) -> tuple[EvalResult, Verdict]:
        """Evaluate now; rank 0 writes ``eval/step_XXXXXX/``. Updates the best gold score and the
        divergence streak (their state goes into the checkpoint of this step)."""
        with self.evaluation_weights():
            result = self.evaluator.evaluate(self.step)
        self.evaluator.write(result, self.run_dir)
        self.last_evaluation = result
        return result, self.gold.evaluation(self.step, result.gold, ckpt.step_dir_name(self.step))

    def _after_evaluation(self, result: EvalResult, verdict: Verdict, saved: Path | None) -> None:
        """``checkpoint.keep_best``: a new best gold score gets a checkpoint and ``checkpoints/best.json``;
        ``eval.stop_on_divergence``: warn, or stop with a checkpoint."""
        cfg = self.config
        if verdict.new_best and cfg.checkpoint.keep_best:
            saved = saved or self.save()
            self.checkpointer.mark_best(self.step, result.gold, saved)
        if verdict.diverging:
            logger.warning("%s", verdict.message)
            if cfg.eval.divergence_action == "stop":
                path = saved or self.save()
                raise TrainingStopped(
                    f"{verdict.message}; stopped (eval.divergence_action=stop), the state is saved in {path}"
                )

    def _warn_logprob_diff(self, metrics: dict[str, Any], step: int) -> None:
        """Warn when the first optimizer step was not on-policy as the loss sees it (`boogu_trainer.onpolicy`):
        the recomputed log-probs drift from the engine's by more than a tenth of the clip range (another
        engine's kernels, other row counts, dtype or weights), or the clip acted on some of its ratios.
        The metrics are the maxima over the ranks (`Learner.finish`)."""
        problem = on_policy_problem(self.config, metrics)
        if problem is not None:
            logger.warning(
                "step %d: not on-policy at the first optimizer step (%s engine): %s; %s",
                step,
                self.config.rollout.engine,
                problem,
                ON_POLICY_FIX,
            )

    def publish_weights(self, version: int) -> None:
        """Hand the new weights to the rollout engine; the full LoRA is gathered only if someone needs
        it (the EMA, an engine with its own copy), and then kept for a checkpoint of the same step."""
        needs_full = self.learner.ema is not None or self.engine.needs_lora_state
        full = self.learner.full_lora() if needs_full else None
        self._sync_engine(version, self._rollout_lora(full))
        if full is not None:
            self.learner.update_ema(full)
        self._published = (version, full)

    def _sync_engine(self, version: int, sent: dict[str, torch.Tensor] | None) -> None:
        """The engine adopts ``sent`` as ``version``; a pipelined run records what it now samples with."""
        self.engine.sync_weights(version, sent, module=self.transformer)
        self.batches.published(version, sent)

    def _rollout_lora(self, full: dict[str, torch.Tensor] | None) -> dict[str, torch.Tensor] | None:
        """What an engine with its own copy of the weights rolls out with: the LoRA, or NFT's old
        policy while it lags (an engine sharing the module gets None: `Learner.sampling_policy`)."""
        if not self.engine.needs_lora_state:
            return None
        return self.learner.rollout_weights(full)

    def _full_lora(self) -> dict[str, torch.Tensor]:
        """The whole LoRA as published this step, or gathered now (a collective under FSDP)."""
        version, full = self._published
        if full is not None and version == self.engine.weights_version:
            return full
        return self.learner.full_lora()

    def _check_failures(self, update: UpdateResult) -> None:
        """Count skipped updates; stop (with a checkpoint of the last good weights) when it is hopeless."""
        cfg = self.config
        if not update.weights_finite:
            path = self._save_for_stop()
            raise TrainingStopped(
                f"step {self.step + 1}: the update made the LoRA weights non-finite (check optim.lr="
                f"{cfg.optim.lr:g} and the rewards); it was undone and the last good weights are saved in {path}"
            )
        if update.finite:
            self.nonfinite_streak = 0
            return
        self.nonfinite_streak += 1
        self.learner.counters["skipped_updates"] += 1
        logger.warning("step %d: non-finite rewards or loss; the update was skipped", self.step + 1)
        if self.nonfinite_streak >= cfg.reward.max_nonfinite_steps:
            path = self._save_for_stop()
            raise TrainingStopped(
                f"{self.nonfinite_streak} consecutive steps had non-finite rewards or losses "
                f"(reward.max_nonfinite_steps={cfg.reward.max_nonfinite_steps}); the last good state is "
                f"saved in {path}. Check the reward functions (metrics.jsonl has per-reward stats)."
            )

    def _save_for_stop(self) -> Path:
        """The checkpoint a stop in the middle of step ``k + 1`` leaves (``k = self.step``).

        A committed checkpoint of step k is kept untouched and named. Only when there is none is step k
        written now: the weights (a skipped update left them, an undone one put them back), and from
        `_step_start` what has moved on since: the data position, the global RNG states, the batch
        in flight (pipelined), the counters. The engine was not synced (`_check_failures` runs before
        `publish_weights`), so it is a checkpoint of step k that a resume continues like any other.
        An undone update has moved AdamW's moments, and, with DiffusionNFT, a skipped one the old
        policy's average: those stay as they are (docs/reliability.md).
        """
        committed = self.checkpointer.committed(self.step)
        return committed if committed is not None else self.save(at=self._step_start)

    # ---- outputs -------------------------------------------------------------------------------
    def _open_metrics(self) -> MetricsLogger:
        c = self.config.logging
        return MetricsLogger(
            self.run_dir,
            is_main=self.dist.is_main,
            tensorboard=c.tensorboard,
            wandb=c.wandb,
            config=config_to_dict(self.config),
        )

    def _write_outputs(self, record: dict[str, Any], result: StepResult) -> None:
        assert self.metrics is not None
        self.metrics.log(record)
        if not self.dist.is_main:
            return
        plot_every = self.config.logging.plot_every
        if plot_every and (self.step % plot_every == 0 or self.step == self.config.total_steps):
            labels = list(self.rewards.labels)  # one line per reward, plus the weighted total if several
            keys = ["reward", *labels] if len(labels) > 1 else ["reward"]
            plot_reward_curve(self.metrics.history, self.run_dir / "reward_curve.png", keys)
        every = self.config.logging.sample_every
        if every and (self.step % every == 0 or self.step == 1):
            self._write_samples(result.batch)

    def _write_samples(self, batch: ScoredBatch) -> None:
        traj = batch.trajectory
        if traj.images is None:
            return
        k = min(self.config.logging.num_samples, traj.batch_size)
        n = self.config.algorithm.group_size
        # Spread the picks over groups so the grid shows different prompts.
        order = sorted(range(traj.batch_size), key=lambda i: (i % n, i // n))[:k]
        totals = batch.scores.total[order].tolist()  # the rewards the update used
        captions = [
            f"{batch.records[i // n].ground_truth or batch.records[i // n].instruction[:40]} | r={s:.3f}"
            for i, s in zip(order, totals)
        ]
        folder = self.run_dir / "samples"
        folder.mkdir(exist_ok=True)
        sample_grid(traj.images[order], captions, folder / f"step_{self.step:04d}.png")

    # ---- state ---------------------------------------------------------------------------------
    def state_dict(self, at: ResumePoint | None = None) -> dict[str, Any]:
        """The run's state by component: what a checkpoint holds (`ckpt.write_checkpoint` lays it out in
        files by one rule) and what the preflight puts back. Collectives under FSDP (the LoRA and the optimizer
        state are gathered; so are the ranks' RNG states). ``at``: where the next step starts from
        (`ResumePoint`; by default as it is now)."""
        point = at if at is not None else self._resume_point()
        learner = self.learner.state_dict(lora=self._full_lora())
        learner["counters"] = point.counters
        return {
            "trainer": {
                "step": self.step,
                "nonfinite_streak": point.nonfinite_streak,
                "weights_version": self.engine.weights_version,
                "world_size": self.dist.world_size,
            },
            "learner": learner,
            "data": point.data,
            "pipeline": None if point.flight is None else point.flight.state(),
            "gold": self.gold.state_dict(),
            "totals": self.step_metrics.state_dict(),
            "rng": ckpt.rng_states_of_ranks(self.dist.gather_objects(point.rng, "rng gather")),
        }

    def _resume_point(self) -> ResumePoint:
        """Where the next step starts from now. With a batch in flight (or deferred) the data position
        before its prompts and the global RNG states before its rewards: a resume rolls it out again."""
        data, rng, flight = self.batches.resume_point()
        return ResumePoint(data, rng, flight, dict(self.learner.counters), self.nonfinite_streak)

    def _accepts_other_prompts(self) -> bool:
        """Whether ``resume_allow_changes`` lets a resume continue on other prompts than its
        checkpoint's (``data.train_files`` or the whole ``data`` section listed)."""
        return bool({"data", "data.train_files"} & set(self.config.resume_allow_changes))

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put every component back as `state_dict` gave it. The rollout engine is not touched: a resume
        publishes the loaded weights (`resume`), the preflight puts the engine's own state back."""
        self.learner.load_state_dict(state["learner"])
        self.step_metrics.load_state_dict(state["totals"])
        own = state["trainer"]
        self.step = int(own["step"])
        self.nonfinite_streak = int(own["nonfinite_streak"])
        self.data.load_state_dict(state["data"], accept_other_prompts=self._accepts_other_prompts())
        self.gold.load_state_dict(state["gold"])
        self.checkpointer.restore_best(self.gold.best)
        self._published = (0, None)
        self.batches.forget_published()  # recorded again before the engine rolls out
        if state["rng"] is None:
            return
        mine = ckpt.rng_state_of_rank(state["rng"], self.dist.rank)
        if mine is None:
            logger.warning(
                "resume: %s holds no global RNG states for rank %d (it was saved by %s ranks); this rank "
                "keeps its seeded states, so a reward drawing from torch/numpy/random globals differs",
                self.run_dir,
                self.dist.rank,
                own.get("world_size", "?"),
            )
        else:
            ckpt.set_rng_state(mine, self.device)

    def save(self, step: int | None = None, at: ResumePoint | None = None) -> Path:
        with self.dist.collective("checkpoint gather"):
            state = self.state_dict(at)
        return self.checkpointer.save(self.step if step is None else step, state)

    def resume(self, spec: str) -> Path | None:
        """``'auto'``: the newest intact checkpoint of this run (None if there is none); else a path."""
        folder = self.checkpointer.find(spec)
        if folder is None:
            return None
        self.lock_run_folder()
        state = self.checkpointer.load(folder).state
        if self.config.resume_allow_changes:
            logger.warning("resume: accepted config changes in %s", list(self.config.resume_allow_changes))
        try:
            # the prompts first: a checkpoint of other prompts is refused before anything is loaded
            other = self.data.check_state(state["data"], accept_other_prompts=self._accepts_other_prompts())
        except ValueError as error:
            raise ckpt.CheckpointError(f"resume={spec} ({folder}): {error}") from None
        if other:
            logger.warning(
                "resume: %s was saved over other prompts (their SHA-256 differs); continuing on these at "
                "its data position, as resume_allow_changes=%s accepts",
                folder,
                list(self.config.resume_allow_changes),
            )
        try:
            self.load_state_dict(state)
        except LoraMismatchError as error:  # raised before anything is loaded
            raise ckpt.CheckpointError(f"resume={spec} ({folder}): {error}") from None
        self.learner.apply_optim_config()  # an opted-in change of optim.* takes effect
        pending = state.get("pipeline")
        if (
            pending is not None and self.step < self.config.total_steps
        ):  # none with no step left to train on it
            self.batches.roll_out_again(pending, self.step, folder, self._sync_engine)
        # The engine adopts the loaded weights, those of the checkpoint's step. Version 0 (a stop in
        # step 1 writes step 0) is the base, which a fresh engine holds already: a sync would have to
        # be version 1, which step 1 publishes (an engine refuses a version that is not newer).
        version = int(state["trainer"]["weights_version"])
        if version > 0 or self.engine.weights_version > 0:
            self._sync_engine(max(version, 1), self._rollout_lora(None))
        self.metrics = self._open_metrics()
        self.metrics.truncate_to(self.step)
        return folder
