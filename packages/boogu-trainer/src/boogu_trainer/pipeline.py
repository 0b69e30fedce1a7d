"""``rollout.pipeline=one_step``: step k+1's rollout runs in the worker while step k's update runs.

With an engine that holds its own copy of the weights (``rollout.engine=vllm_omni``), a step's
rollout does not need the trainer's GPUs. `RolloutPipeline` draws step k+1's prompts as soon as step
k's batch is scored and hands the rollout and its rewards (`RolloutScorer.sample`: rank-local, no
collective) to one background thread; the update of step k runs meanwhile. Before step k's new
weights are published the trainer waits for that rollout, so it was sampled, start to end, with the
weights the worker held when it was requested: version k-1, one step stale. Step k+1 then trains on
it (`RolloutScorer.finish`, the collectives, on the main thread).

What a checkpoint of step k holds for the batch in flight (`InFlight`): the data position before its
prompts were drawn, the global RNG states before its rewards were scored (the trainer never draws
from them, a user's reward may) and the weights it was sampled with. A resume puts those weights back in the
engine, draws the same prompts and rolls them out again with the same seeds, so a killed pipelined
run resumes bitwise (`Trainer.resume`). The run's last step records the next batch the same way
without rolling it out (`RolloutPipeline.defer`): a resume with a larger ``total_steps`` rolls it out
with those weights, as a longer run would have.

One order of the global RNG draws in both modes: training's rewards draw from the global states in
step order (step k+1's while step k's update runs, here), and an evaluation draws from states of its
own (`Evaluator.evaluate`), so an evaluation between steps k and k+1 moves nothing that step k+1's
rewards, or a checkpoint of step k, depend on.

Memory: the batch in flight and the weights it was sampled with wait in host memory (pinned on a
GPU: the engine's `trajectories_on_host`, and `hold`'s copy) until that batch is trained on; only
then is it copied to the device (`wait` with ``on_device``, non-blocking from pinned memory), so the
update's peak holds no second batch and no LoRA copy (``trainer --plan`` lists them as host memory).

Timing (`step_times`): the thread records when each rollout ran; a step's record says how much of
its wall time a rollout was running (``time/rollout_busy``), how much of the update it overlapped
(``time/overlap``) and how long each side was idle.
"""

from __future__ import annotations

import contextlib
import dataclasses
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import torch

from boogu_trainer.checkpoint import rng_state
from boogu_trainer.data import PromptSampler
from boogu_trainer.distributed import DistEnv
from boogu_trainer.scoring import RolloutScorer, SampledBatch

__all__ = ["InFlight", "RolloutPipeline", "overlap_seconds"]


@dataclass
class InFlight:
    """A rollout requested for a later step: what it will train on, and what regenerates it."""

    future: Future[tuple[SampledBatch, float, float]] | None
    """The rollout on the thread; None: recorded, not requested (`RolloutPipeline.defer`)."""
    step: int
    """The step (0-based) that trains on it; its seeds drew the rollout."""
    version: int
    """The weights version the engine held when it was requested (it samples with those)."""
    lora: dict[str, torch.Tensor] | None
    """Those weights as they were sent to the engine (file keys; a checkpoint keeps them)."""
    data_state: dict[str, int]
    """The prompt sampler's state before this batch's prompts were drawn."""
    rng: dict[str, torch.Tensor]
    """The global RNG states before its rewards were scored (a user's reward may draw from them)."""

    def state(self) -> dict[str, Any]:
        """What a checkpoint keeps of it (with the data position and the RNG states, kept apart)."""
        return {"step": self.step, "version": self.version, "lora": self.lora}


def overlap_seconds(intervals: list[tuple[float, float]], start: float, end: float) -> float:
    """Seconds of ``[start, end]`` covered by the (disjoint) ``intervals``."""
    return sum(max(0.0, min(b, end) - max(a, start)) for a, b in intervals)


class RolloutPipeline:
    """The batch in flight, the weights the engine holds, and the thread that rolls out."""

    def __init__(self, scorer: RolloutScorer, data: PromptSampler, dist: DistEnv, device: torch.device):
        self.scorer = scorer
        self.data = data
        self.dist = dist
        self.device = device
        self.in_flight: InFlight | None = None
        self.held: tuple[int, dict[str, torch.Tensor] | None] | None = None
        """``(version, weights as sent)`` the engine samples with now (None: not recorded yet)."""
        self._executor: ThreadPoolExecutor | None = None
        self._busy: list[tuple[float, float]] = []
        """When rollouts ran (host clock), pruned to the current step."""

    # ---- weights -------------------------------------------------------------------------------
    def hold(self, version: int, lora: dict[str, torch.Tensor] | None) -> None:
        """The engine now samples with ``lora`` as ``version``; a copy is kept in host memory (the
        optimizer moves the trainer's tensors in place), since a checkpoint may need it while a batch
        is in flight. Once a step, after the weights were sent (which read them to the host already)."""
        copy = None if lora is None else {k: v.detach().to("cpu", copy=True) for k, v in lora.items()}
        self.held = (version, copy)

    # ---- rollouts ------------------------------------------------------------------------------
    def submit(self, step: int) -> InFlight:
        """Draw step ``step``'s prompts (0-based) and roll them out on the thread with the held weights."""
        assert self.held is not None, "RolloutPipeline.hold() records the engine's weights first"
        data_state, rng = self.data.state_dict(), rng_state(self.device)
        records = self.data.next_batch()
        lo, hi = self.dist.shard(len(records))
        if self._executor is None:
            self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="boogu-rollout")
        future = self._executor.submit(self._sample, records[lo:hi], lo, step)
        version, lora = self.held
        self.in_flight = InFlight(future, step, version, lora, data_state, rng)
        return self.in_flight

    def defer(self, step: int) -> InFlight:
        """Record step ``step``'s batch (0-based) as `submit` would request it (the held weights, the
        data position and global RNG states now) without rolling it out: the run's last step. Its
        checkpoint keeps it, so a resume with a larger ``total_steps`` samples that batch with the
        weights a longer run would have, one version stale (docs/pipelining.md)."""
        assert self.held is not None, "RolloutPipeline.hold() records the engine's weights first"
        version, lora = self.held
        self.in_flight = InFlight(None, step, version, lora, self.data.state_dict(), rng_state(self.device))
        return self.in_flight

    def _sample(self, records, group_offset: int, step: int) -> tuple[SampledBatch, float, float]:
        if self.device.type == "cuda":  # the current device is per thread: this rank's, not GPU 0
            torch.cuda.set_device(self.device)
        t0 = time.perf_counter()
        on_host = getattr(self.scorer.engine, "trajectories_on_host", None)
        with on_host() if on_host is not None else contextlib.nullcontext():
            sampled = self.scorer.sample(records, group_offset, step)
        return sampled, t0, time.perf_counter()

    def wait(self, flight: InFlight, *, on_device: bool = False) -> SampledBatch:
        """The rollout of ``flight`` (its rewards scored); re-raises what the thread raised.
        ``on_device``: its trajectory copied to the trainer's device (the batch about to be trained
        on); otherwise it stays where the engine left it (host memory, for a pipelining engine)."""
        assert flight.future is not None, f"step {flight.step + 1}'s batch was deferred, not requested"
        sampled, t0, t1 = flight.future.result()
        if (t0, t1) not in self._busy:
            self._busy.append((t0, t1))
        if on_device:
            device = self.device
            trajectory = sampled.trajectory.map_tensors(
                lambda t: t if t.device == device else t.to(device, non_blocking=t.is_pinned())
            )
            sampled = dataclasses.replace(sampled, trajectory=trajectory)
        return sampled

    def check_version(self, flight: InFlight, sampled: SampledBatch, step: int) -> None:
        """The batch was sampled with the weights the trainer recorded for it, or the run stops."""
        got = sampled.trajectory.weights_version
        if got != flight.version:
            raise RuntimeError(
                f"step {step}: the rollout engine sampled the batch with weights version {got}, but the "
                f"trainer had published version {flight.version} when it asked for it; the batch's "
                "log-probs and staleness would be recorded wrongly, so it is not trained on"
            )

    def step_times(
        self, start: float, end: float, update: tuple[float, float], waited: float
    ) -> dict[str, float]:
        """``time/*`` of a pipelined step ``[start, end]`` whose update ran over ``update``: how long a
        rollout ran in it, how much of the update it overlapped, how long the trainer waited for one
        (``waited``). The worker's idle time is ``time/step`` less ``time/rollout_busy``."""
        busy = overlap_seconds(self._busy, start, end)
        overlap = overlap_seconds(self._busy, *update)
        self._busy = [(a, b) for a, b in self._busy if b > end]
        return {"time/rollout_busy": busy, "time/overlap": overlap, "time/trainer_idle": waited}

    def close(self) -> None:
        """Stop the thread (after its rollout, which a closed engine ends quickly)."""
        if self._executor is not None:
            self._executor.shutdown(wait=True, cancel_futures=True)
            self._executor = None
        self.in_flight = None
