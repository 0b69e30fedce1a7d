"""Where a step's batch comes from: rolled out when the step starts, or one step ahead.

`Trainer.train_step` is one function for both forms of ``rollout.pipeline``; what differs lives
here, behind `BatchSource`:

* `SyncBatches` (``off``): step k's prompts are drawn and rolled out when step k starts, with the
  policy the algorithm samples with (`Learner.sampling_policy`).
* `OneStepBatches` (``one_step``): step k trains on the batch rolled out while step k-1's update
  ran; step k+1's rollout is requested before step k's update and waited for before step k's new
  weights are published (`boogu_trainer.pipeline`: the thread, the batch in flight, the timing).

A step calls, in order: `begin`, `resume_point` (what a stop in this step saves as the last one),
`next` (the scored batch), `before_update`, the update, `after_update`, the weight sync (after which
the trainer reports what the engine holds with `published`), then `step_metrics` and `relabel`.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from boogu_data import PromptRecord
from boogu_trainer.checkpoint import CheckpointError, rng_state
from boogu_trainer.data import PromptSampler
from boogu_trainer.distributed import DistEnv
from boogu_trainer.pipeline import InFlight, RolloutPipeline
from boogu_trainer.scoring import RolloutScorer, ScoredBatch
from boogu_trainer.step_metrics import StepMetrics

__all__ = ["BatchSource", "OneStepBatches", "SyncBatches", "batch_source"]


class BatchSource:
    """The batches a run trains on, step by step (0-based ``step``: the step that trains on it)."""

    def __init__(self, scorer: RolloutScorer, data: PromptSampler, dist: DistEnv, device: torch.device):
        self.scorer = scorer
        self.data = data
        self.dist = dist
        self.device = device

    @property
    def in_flight(self) -> InFlight | None:
        """The batch requested for a later step (one-step pipelining), else None."""
        return None

    def use_data(self, data: PromptSampler) -> None:
        """Draw the prompts of the steps to come from ``data`` (`Trainer.data`'s setter)."""
        self.data = data

    def begin(self, step: int) -> None:
        """Step ``step`` starts (before its resume point is taken)."""

    def resume_point(self) -> tuple[dict[str, int], dict[str, torch.Tensor], InFlight | None]:
        """Where the next batch starts from now: the data position, the global RNG states and the
        batch in flight (a resume rolls that out again)."""
        return self.data.state_dict(), rng_state(self.device), None

    def next(self, step: int, meter: StepMetrics) -> ScoredBatch:
        """The scored batch step ``step`` trains on (the rollout's collectives included)."""
        raise NotImplementedError

    def before_update(self, step: int, total_steps: int) -> None:
        """Between the batch and the update of step ``step``."""

    def after_update(self, meter: StepMetrics) -> None:
        """Between the update and the weight sync."""

    def published(self, version: int, sent: dict[str, torch.Tensor] | None) -> None:
        """The engine now samples with ``sent`` as ``version`` (after every sync)."""

    def forget_published(self) -> None:
        """A resume loaded other weights: what the engine holds is recorded again before it samples."""

    def step_metrics(self, step: int, start: float, update_span: tuple[float, float]) -> dict[str, Any]:
        """This step's own metrics (``start``: when the step began; ``update_span``: the update's)."""
        return {}

    def relabel(self, metrics: dict[str, Any]) -> dict[str, Any]:
        """The step's record as this form reports it."""
        return metrics

    def roll_out_again(
        self, pending: dict[str, Any], step: int, folder: Path, sync: Callable[[int, Any], None]
    ) -> None:
        """A resume of a checkpoint (``folder``, of step ``step``) whose batch was in flight: here
        nothing, since the step rolls it out when it starts (the data position is the one before its
        prompts)."""

    def close(self) -> None:
        """Stop what the source started."""


class SyncBatches(BatchSource):
    """``rollout.pipeline=off``: each step's prompts drawn and rolled out when the step starts."""

    def __init__(self, *args: Any, sampling_policy: Callable[[], Any]):
        super().__init__(*args)
        self.sampling_policy = sampling_policy
        """The module holds the rollout policy's weights inside it (`Learner.sampling_policy`)."""

    def next(self, step: int, meter: StepMetrics) -> ScoredBatch:
        records: list[PromptRecord] = self.data.next_batch()
        lo, hi = self.dist.shard(len(records))
        with (
            meter.phase("rollout"),
            self.dist.collective(f"rollout, step {step + 1}"),
            self.sampling_policy(),  # DiffusionNFT rolls out with its old policy
        ):
            return self.scorer.run(records[lo:hi], group_offset=lo, step=step)


class OneStepBatches(BatchSource):
    """``rollout.pipeline=one_step``: train on the batch rolled out during the last step (or now, on
    the first), and roll out the next one while the update runs (`boogu_trainer.pipeline`)."""

    def __init__(
        self,
        *args: Any,
        engine_version: Callable[[], int],
        rollout_weights: Callable[[], dict[str, torch.Tensor] | None],
    ):
        super().__init__(*args)
        self.pipe = RolloutPipeline(self.scorer, self.data, self.dist, self.device)
        self.engine_version = engine_version
        self.rollout_weights = rollout_weights
        """What the engine rolls out with now, when nothing recorded it yet (`Trainer._rollout_lora`)."""
        self._flight: InFlight | None = None
        self._waited = 0.0

    @property
    def in_flight(self) -> InFlight | None:
        return self.pipe.in_flight

    def use_data(self, data: PromptSampler) -> None:
        if self.pipe.in_flight is not None:
            raise RuntimeError(
                "the prompts cannot be replaced while a batch drawn from the old ones is in flight "
                "(rollout.pipeline=one_step): replace them before the run's first step"
            )
        super().use_data(data)
        self.pipe.data = data

    def begin(self, step: int) -> None:
        pipe = self.pipe
        if pipe.in_flight is None:  # the run's first step (or a resume from a sync checkpoint)
            if pipe.held is None:
                pipe.hold(self.engine_version(), self.rollout_weights())
            pipe.submit(step)
        flight = pipe.in_flight
        assert flight is not None and flight.future is not None and flight.step == step, (flight, step)
        self._flight = flight

    def resume_point(self) -> tuple[dict[str, int], dict[str, torch.Tensor], InFlight | None]:
        flight = self.pipe.in_flight
        if flight is None:
            return super().resume_point()
        # the data position before its prompts and the global RNG states before its rewards
        return flight.data_state, flight.rng, flight

    def next(self, step: int, meter: StepMetrics) -> ScoredBatch:
        flight = self._flight
        assert flight is not None, "OneStepBatches.begin() requests the step's batch first"
        waited = time.perf_counter()
        with meter.phase("rollout_wait"), self.dist.collective(f"rollout, step {step + 1}"):
            sampled = self.pipe.wait(flight, on_device=True)  # the next batch waited in host memory
            self._waited = time.perf_counter() - waited
            self.pipe.check_version(flight, sampled, step + 1)
            return self.scorer.finish(sampled)

    def before_update(self, step: int, total_steps: int) -> None:
        if step + 1 < total_steps:
            self.pipe.submit(step + 1)  # step k+1's rollout, with the weights the engine holds now
        else:  # recorded for a resume with more steps, not rolled out (docs/pipelining.md)
            self.pipe.defer(step + 1)

    def after_update(self, meter: StepMetrics) -> None:
        pipe = self.pipe
        if pipe.in_flight is not None and pipe.in_flight.future is not None:  # none under the sync
            t0 = time.perf_counter()
            with meter.phase("rollout_wait"):
                pipe.wait(pipe.in_flight)
            self._waited += time.perf_counter() - t0

    def published(self, version: int, sent: dict[str, torch.Tensor] | None) -> None:
        self.pipe.hold(version, sent)

    def forget_published(self) -> None:
        self.pipe.held = None

    def step_metrics(self, step: int, start: float, update_span: tuple[float, float]) -> dict[str, Any]:
        flight = self._flight
        assert flight is not None
        return {
            "rollout/weights_version": flight.version,
            "rollout/staleness": step - flight.version,
            **self.pipe.step_times(start, time.perf_counter(), update_span, self._waited),
        }

    def relabel(self, metrics: dict[str, Any]) -> dict[str, Any]:
        metrics["time/worker_idle"] = max(0.0, metrics["time/step"] - metrics["time/rollout_busy"])
        if metrics["rollout/staleness"]:  # the ratio against a stale policy: not an on-policy check
            metrics = {
                (f"staleness/{k}" if k.startswith("logprob_diff/") or k == "clipfrac_first" else k): v
                for k, v in metrics.items()
            }
        return metrics

    def roll_out_again(
        self, pending: dict[str, Any], step: int, folder: Path, sync: Callable[[int, Any], None]
    ) -> None:
        """The batch that was in flight when ``folder`` was saved, rolled out again as it was: the
        engine gets the weights it was sampled with (``sync``), the same prompts are drawn (the data
        position is the one before them) with the same seeds."""
        if int(pending["step"]) != step or pending["lora"] is None:
            raise CheckpointError(
                f"{folder}: its batch in flight is for step {int(pending['step']) + 1} with "
                f"{'no' if pending['lora'] is None else 'its'} weights, the checkpoint is of step {step}"
            )
        version = int(pending["version"])
        if version == 0 and self.engine_version() == 0:
            # Version 0 is the base model, which a fresh engine holds (a worker refuses a sync that is
            # not newer than what it holds): the batch is sampled as it was, without a sync.
            self.pipe.hold(0, pending["lora"])
        else:
            sync(version, pending["lora"])
        self.pipe.wait(self.pipe.submit(step))  # done before the next sync

    def close(self) -> None:
        self.pipe.close()


def batch_source(
    pipeline: str,
    scorer: RolloutScorer,
    data: PromptSampler,
    dist: DistEnv,
    device: torch.device,
    *,
    sampling_policy: Callable[[], Any],
    engine_version: Callable[[], int],
    rollout_weights: Callable[[], dict[str, torch.Tensor] | None],
) -> BatchSource:
    """The form ``rollout.pipeline`` names (``off`` or ``one_step``)."""
    if pipeline == "one_step":
        return OneStepBatches(
            scorer, data, dist, device, engine_version=engine_version, rollout_weights=rollout_weights
        )
    return SyncBatches(scorer, data, dist, device, sampling_policy=sampling_policy)
