"""The on-policy checks, keyed to the loss the run trains with.

At the first optimizer step of an update the weights are those that rolled the batch out, so
FlowGRPO's ratio ``exp(log p - log p_rollout)`` is 1 up to the difference ``d`` between the
training recomputation and the rollout engine's numbers (other kernels, other row counts per call,
another dtype). The PPO clip acts where ``|ratio - 1| > algorithm.clip_range``, and ``ratio - 1 ~ d``:
with clip ranges of 1e-4 (FlowGRPO) and 2e-6 (GRPO-Guard) a 0.1-1% velocity difference (2e-7 to
1.6e-5 in log-prob) clips part of the first step without a word. So the checks are keyed to the
clip, not to a fixed number:

* `logprob_diff_limit`: the largest rollout/recompute difference the loss tolerates, a tenth of
  the clip range (``rollout.logprob_diff_warn`` when set);
* the trainer warns when the first optimizer step's ``logprob_diff/step*`` (max over ranks) exceeds
  it, or when any of that step's ratios was clipped (``clipfrac_first``, max over ranks);
* the preflight fails on the same bound, and on `LOGPROB_TOLERANCE`: how far a correct setup's
  recomputation may differ on this device and dtype (a larger difference is a bug: weights, dtype,
  schedule). ``tests/special_e2e/run_flowgrpo_boogu_image.sh`` checks its runs against that table.

DiffusionNFT and AWM never compare with the rollout's log-probs: their first optimizer step uses the
policy's own values (ratio exactly 1, AWM's ``clip_range`` included), so nothing of the loss is
keyed to the engine's numbers, and only the device table applies (in the preflight).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from boogu_trainer.config import TrainerConfig

CLIP_FRACTION_OF_LIMIT = 0.1
"""The rollout/recompute difference allowed, as a fraction of ``algorithm.clip_range``."""

LOGPROB_TOLERANCE: dict[tuple[str, str], float] = {
    ("cpu", "float32"): 1e-6,
    ("cpu", "bfloat16"): 1e-4,
    ("cpu", "float16"): 1e-4,
    ("cuda", "float32"): 1e-5,
    ("cuda", "bfloat16"): 1e-4,
    ("cuda", "float16"): 1e-4,
}
"""Max |log p_recompute - log p_rollout| (log-prob units: per-element-mean Gaussian log-densities)
that the local engine shows on a correct setup, by (device type, ``model.dtype``).

CPU float32: exact where rollout and training calls hold as many rows, a few float32 ulps where a
CPU's matrix kernels block by row count (6e-8 to 1e-7 measured). bf16/fp16: a bf16 ulp of the
velocity (0.4-0.8%) moves the log-prob by up to ~1.6e-5 at the sizes measured; the table leaves
about x6 on that. CUDA float32: TF32 matmuls (``model.tf32``). The CUDA rows are estimates from the
CPU figures: no GPU run has measured them yet (docs/gpu-path.md)."""

OWN_COPY_TOLERANCE = 1e-4
"""An engine with its own copy of the model (vllm-omni's transformer port, another process): other
kernels and fusions, float rounding apart."""


def dtype_name(dtype: str | torch.dtype) -> str:
    """``torch.bfloat16`` or ``'bfloat16'`` -> ``'bfloat16'``."""
    return str(dtype).removeprefix("torch.")


def logprob_tolerance(device_type: str, dtype: str | torch.dtype, *, own_copy: bool = False) -> float:
    """`LOGPROB_TOLERANCE` of this device type and dtype (``own_copy``: at least `OWN_COPY_TOLERANCE`)."""
    key = (device_type, dtype_name(dtype))
    if key not in LOGPROB_TOLERANCE:
        raise ValueError(
            f"no log-prob tolerance for device {key[0]!r} and dtype {key[1]!r}: {sorted(LOGPROB_TOLERANCE)}"
        )
    tol = LOGPROB_TOLERANCE[key]
    return max(tol, OWN_COPY_TOLERANCE) if own_copy else tol


def logprob_diff_limit(config: TrainerConfig) -> float | None:
    """The rollout/recompute log-prob difference the loss tolerates at the first optimizer step.

    ``rollout.logprob_diff_warn`` when set; else ``algorithm.clip_range / 10`` for flow_grpo (PPO-clip
    and GRPO-Guard: their ratio is against the rollout's log-probs); None for diffusion_nft and awm
    (their loss never reads the rollout's log-probs)."""
    if config.rollout.logprob_diff_warn is not None:
        return config.rollout.logprob_diff_warn
    from boogu_trainer.algorithms import algorithm_class  # the learners, not needed to import this module

    if not algorithm_class(config.algorithm.name).reads_rollout_logprobs:
        return None
    return config.algorithm.clip_range * CLIP_FRACTION_OF_LIMIT


def limit_source(config: TrainerConfig) -> str:
    """Where `logprob_diff_limit` comes from, for a message."""
    if config.rollout.logprob_diff_warn is not None:
        return f"rollout.logprob_diff_warn={config.rollout.logprob_diff_warn:g}"
    return f"algorithm.clip_range/10 = {config.algorithm.clip_range:g}/10"


def on_policy_problem(config: TrainerConfig, metrics: dict[str, float]) -> str | None:
    """What is wrong with a step's first optimizer step, from its metrics (maxima over ranks), or None.

    ``logprob_diff/step*``: max |log p - log p_rollout| per window step; ``clipfrac_first``: the
    fraction of that step's ratios the clip acted on. Both are 0 on-policy."""
    limit = logprob_diff_limit(config)
    diffs = [float(v) for k, v in metrics.items() if k.startswith("logprob_diff/")]
    worst = max(diffs, default=0.0, key=lambda d: float("inf") if d != d else d)  # NaN counts as the worst
    clipped = float(metrics.get("clipfrac_first", 0.0))
    problems = []
    if limit is not None and diffs and not worst <= limit:
        problems.append(
            f"the recomputed log-probs differ from the rollout's by up to {worst:.3g} (> {limit_source(config)} = {limit:.3g})"
        )
    if not clipped <= 0.0:
        problems.append(f"{clipped:.3g} of the first optimizer step's ratios were clipped (on-policy: 0)")
    return "; ".join(problems) or None


ON_POLICY_FIX = (
    "the clip acts on the difference between the rollout's and the update's numbers, not on a policy "
    "change. Fix: the same dtype and row counts on both sides (rollout.micro_batch_size equal to "
    "algorithm.train_micro_batch_size, mini_batches that keep the rollout's composition), float32 "
    "(model.dtype), or a larger algorithm.clip_range; rollout.logprob_diff_warn sets the limit explicitly"
)


__all__ = [
    "CLIP_FRACTION_OF_LIMIT",
    "LOGPROB_TOLERANCE",
    "ON_POLICY_FIX",
    "OWN_COPY_TOLERANCE",
    "dtype_name",
    "limit_source",
    "logprob_diff_limit",
    "logprob_tolerance",
    "on_policy_problem",
]
