"""One step's record: time per phase, forwards and model FLOPs, throughput, MFU, cumulative compute.

`StepMetrics` owns the step's meters (a `StepTimer`, the `ForwardCounter` and the `FlopMeter` on the
policy module) and the run's cumulative totals (``cum/*``, kept in checkpoints). The trainer opens a
step with `start`, runs each phase inside `phase`, and gets the record from `finish`; nothing else
does arithmetic on metrics.
"""

from __future__ import annotations

import contextlib
import resource
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

import torch

from boogu_adapters.lora import is_lora_param
from boogu_trainer.distributed import DistEnv
from boogu_trainer.metrics import ForwardCounter, StepTimer, forward_equivalents
from boogu_trainer.perf import FlopMeter, peak_tflops, step_perf, unwrap_transformer

if TYPE_CHECKING:
    from boogu_trainer.learner import UpdateResult
    from boogu_trainer.scoring import ScoredBatch

TOTALS = ("fe", "backward", "tflops", "images", "time_s")
"""The run's cumulative totals, all ranks: forward-equivalents, backwards, model TFLOP, images, seconds."""


class StepMetrics:
    """The meters of a step and the run's cumulative compute (``state_dict``: the totals)."""

    def __init__(
        self,
        transformer: torch.nn.Module,
        dist: DistEnv,
        device: torch.device,
        *,
        peak_override: float | None = None,
    ):
        self.transformer = transformer
        self.dist = dist
        self.device = device
        self.peak_override = peak_override
        self.forwards = ForwardCounter(transformer)
        self.flops = FlopMeter(transformer, attention_recompute=device.type == "cuda")
        self.totals: dict[str, float] = dict.fromkeys(TOTALS, 0.0)
        self._peak: float | None = None
        self._timer: StepTimer | None = None

    # ---- a step ------------------------------------------------------------------------------------
    def start(self) -> None:
        """Open a step: what ran since the last one (an evaluation, the preflight) is not its compute."""
        self.forwards.take()
        self.flops.take()
        self._timer = StepTimer(self.device)

    @contextlib.contextmanager
    def phase(self, name: str) -> Iterator[None]:
        """Time ``name`` (``time/<name>``) and count its forwards as ``name``'s."""
        assert self._timer is not None, "StepMetrics.start() opens a step"
        with self._timer(name), self.forwards.counting(name):
            yield

    def finish(
        self, batch: ScoredBatch, update: UpdateResult, extra: dict[str, Any], *, remote: bool
    ) -> dict[str, Any]:
        """The step's record: the rollout's and the update's metrics, ``extra``, times, forwards and
        FLOPs per image, MFU and the cumulative totals. ``remote``: the rollout ran in a worker (its
        forwards are the trajectory's ``nfe``, its FLOPs are booked from its layout)."""
        assert self._timer is not None, "StepMetrics.start() opens a step"
        traj, batch_metrics = batch.trajectory, batch.metrics
        forwards = self.forwards.take()
        if remote:
            forwards["rollout"] = forwards.get("rollout", 0) + traj.nfe
            self.flops.book_remote_rollout(traj)
        images = traj.batch_size
        out = {**batch_metrics, **update.metrics, **self._timer.metrics()}
        seconds = out["time/step"]
        out.update(
            {
                "images_per_s": batch_metrics["samples"] / seconds,
                "nfe/rollout_per_image": forwards.get("rollout", 0) / images,
                "nfe/train_per_image": forwards.get("train", 0) / images,
                "peak_memory_gb": peak_memory_gb(self.device),
                **extra,
            }
        )
        perf = step_perf(self.flops.take(), seconds, images=images, peak=self._peak_tflops())
        out.update(perf)
        out.update(self._compute(forwards, perf, images, seconds))
        self._timer = None
        return out

    def _compute(
        self, forwards: dict[str, int], perf: dict[str, float], images: int, seconds: float
    ) -> dict[str, float]:
        """Forward-equivalents per image by phase (this rank), and the run's cumulative totals (all
        ranks), so that curves can be drawn against compute as well as steps."""
        checkpointing = bool(getattr(unwrap_transformer(self.transformer), "gradient_checkpointing", False))
        fe = forward_equivalents(forwards, checkpointing=checkpointing)
        out = {f"fe/{k}_per_image": v / max(images, 1) for k, v in fe.items()}
        # This rank's model TFLOP of the step (totals, not rates), with its worker's rollout.
        step_tflops = perf.get("perf/tflops", 0.0) + perf.get("perf/tflops_worker", 0.0)
        local = torch.tensor([fe["total"], fe["backward"], step_tflops, images], dtype=torch.float64)
        total = self.dist.all_reduce_sum(local, "compute totals").tolist()  # one host read per step
        for key, value in zip(("fe", "backward", "tflops", "images"), total):
            self.totals[key] += value
        self.totals["time_s"] += seconds
        out.update({f"cum/{k}": float(v) for k, v in self.totals.items()})
        return out

    def _peak_tflops(self) -> float:
        """This device's peak for the base weights' dtype (measured or looked up once)."""
        if self._peak is None:
            dtype = next(p.dtype for n, p in self.transformer.named_parameters() if not is_lora_param(n))
            self._peak = peak_tflops(self.device, dtype, self.peak_override)
        return self._peak

    # ---- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, float]:
        return dict(self.totals)

    def load_state_dict(self, state: dict[str, float]) -> None:
        self.totals.update(state)

    def close(self) -> None:
        self.forwards.close()


def peak_memory_gb(device: torch.device) -> float:
    """The process's peak memory: CUDA's allocator on a GPU, the resident set size elsewhere."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 2**30
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB on Linux
