"""Preflight: before GPU-hours are spent, check that the run can learn at all.

The most expensive failure of a run is one that silently trains nothing: a LoRA attached to no
module (or to none of a block type), a reward with no spread within groups (all advantages zero),
weights that never reach the rollout engine. `run_preflight` checks, on a probe batch that costs a
small fraction of one step (``PROBE_PROMPTS`` prompts x ``PROBE_SAMPLES`` samples at the configured
size, ``PROBE_STEPS`` denoising steps with a one-step SDE window inside, one backward):

* ``lora_targets``: per block type (the transformer's block lists: ``noise_refiner``,
  ``double_stream_layers``, ...), the modules ``lora.target_modules`` match (peft's rule: a name or a
  dotted suffix) against the modules actually wrapped; no wrapped module, a block type without one,
  or a matched module left unwrapped is a stop;
* ``gradients``: one backward of the probe's window log-prob gives a non-zero gradient on every
  adapted module the forward ran (modules the probe never runs, e.g. the reference-image refiner on
  text-to-image prompts, are reported, not failed);
* ``on_policy_ratio``: the recomputed log-prob equals the rollout's within what this device and dtype's
  kernels allow (`onpolicy.LOGPROB_TOLERANCE`: 1e-6 on CPU in float32) and, with flow_grpo, within a
  tenth of the clip range (`onpolicy.logprob_diff_limit`), and the loss clips none of the probe's
  ratios: the max over ranks;
* ``reward_spread``: the probe's total reward varies within at least one group, or at least across
  its prompts (a coarse verifier on the probe's few-step images may rate a whole group alike);
* ``weight_sync``: a perturbed LoRA, published through ``Trainer.publish_weights``, changes the
  engine's next deterministic rollout, and the restored LoRA gives back the original one.

Nothing is left behind: the trainer's state is taken as a checkpoint takes it (`Trainer.state_dict`:
LoRA, optimizer state, EMA, RNG states, data position, counters) and put back with its
``load_state_dict`` (which drops the probe's gradients), and the engine's version, sync log and
counters with the engine's own ``state_dict``; the probe's forwards are not the first step's (each
step's meters start at zero). Each failed check
raises `PreflightError` (its ``check`` names it; the message names the cause and the fix);
``preflight=false`` skips all of it, ``trainer --preflight RECIPE`` runs only this.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace
from typing import TYPE_CHECKING, Any, Protocol

import torch
from peft.tuners.tuners_utils import BaseTunerLayer

from boogu_adapters.engines import RelabelableEngine
from boogu_adapters.lora import is_lora_b
from boogu_adapters.model import LORA_TARGET_MODULES
from boogu_adapters.types import RolloutRequest, Trajectory
from boogu_schedule import WindowPlan, derive_seed
from boogu_trainer.distributed import local_tensor
from boogu_trainer.evaluation import deterministic_request
from boogu_trainer.onpolicy import ON_POLICY_FIX, limit_source, logprob_diff_limit, logprob_tolerance
from boogu_trainer.perf import unwrap_transformer

if TYPE_CHECKING:
    from boogu_adapters.engines import RolloutEngine
    from boogu_trainer.config import TrainerConfig
    from boogu_trainer.data import PromptSampler
    from boogu_trainer.distributed import DistEnv
    from boogu_trainer.learner import Learner
    from boogu_trainer.rewards.composite import WeightedRewards
    from boogu_trainer.scoring import RolloutScorer

logger = logging.getLogger("boogu_trainer")

PROBE_PROMPTS = 2
"""Prompts of the probe batch (per rank; fewer if the rank has fewer)."""
PROBE_SAMPLES = 2
"""Samples per probe prompt (a group of 2 is the least that can show spread)."""
PROBE_STEPS = 2
"""Denoising steps of the probe rollout (capped at ``sampler.num_steps``); the SDE window is its first."""
SYNC_PROBE_STEPS = 1
"""Deterministic steps of the weight-sync probes (one forward shows whether the weights changed)."""
SYNC_DELTA = 1e-2
"""Added to every ``lora_B`` for the weight-sync check (then undone)."""

CHECKS = ("lora_targets", "reward_spread", "on_policy_ratio", "gradients", "weight_sync")
_WRAPPERS = ("_orig_mod.", "_checkpoint_wrapped_module.", "_fsdp_wrapped_module.")


class PreflightTarget(Protocol):
    """What the preflight uses of a trainer (`boogu_trainer.trainer.Trainer` is one): its components, the
    weight publishing, and its state as a checkpoint takes it."""

    config: TrainerConfig
    dist: DistEnv
    device: torch.device
    transformer: torch.nn.Module
    engine: RolloutEngine
    local_engine: RolloutEngine
    learner: Learner
    data: PromptSampler
    rollout: RolloutScorer
    rewards: WeightedRewards
    step: int
    preflight_report: PreflightReport | None

    def publish_weights(self, version: int) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class PreflightError(RuntimeError):
    """A preflight check failed: ``check`` names it, the message the cause and the fix."""

    def __init__(self, check: str, message: str, *results: CheckResult, skippable: bool = True):
        skip = " (preflight=false skips the checks)" if skippable else ""
        super().__init__(f"preflight check {check!r} failed: {message}{skip}")
        self.check = check
        self.cause = message
        self.results = list(results)
        """The check results measured before the stop (their numbers go into the report)."""
        self.report: PreflightReport | None = None
        """The whole report, set by `run_preflight`."""


@dataclass
class CheckResult:
    name: str
    passed: bool | None
    """True / False, or None when the check could not run here (``detail`` says why)."""
    numbers: dict[str, Any] = field(default_factory=dict)
    detail: str = ""


@dataclass
class PreflightReport:
    checks: list[CheckResult] = field(default_factory=list)
    seconds: float = 0.0

    @property
    def passed(self) -> bool:
        return all(c.passed is not False for c in self.checks)

    @property
    def failures(self) -> list[CheckResult]:
        return [c for c in self.checks if c.passed is False]

    def __getitem__(self, name: str) -> CheckResult:
        for c in self.checks:
            if c.name == name:
                return c
        raise KeyError(name)

    def render(self) -> str:
        verdict = "passed" if self.passed else f"FAILED ({', '.join(c.name for c in self.failures)})"
        lines = [f"preflight {verdict} in {self.seconds:.2f} s"]
        for c in self.checks:
            mark = {True: "ok  ", False: "FAIL", None: "skip"}[c.passed]
            nums = ", ".join(f"{k}={_fmt(v)}" for k, v in c.numbers.items())
            lines.append(f"  [{mark}] {c.name}: {nums}")
            if c.detail:
                lines.append(f"         {c.detail}")
        return "\n".join(lines)


def _fmt(v: Any) -> str:
    if isinstance(v, float):
        return f"{v:.4g}"
    if isinstance(v, dict):
        return "{" + ", ".join(f"{k}: {_fmt(x)}" for k, x in v.items()) + "}"
    return str(v)


# ---- LoRA targets -----------------------------------------------------------------------------------
def _clean(name: str) -> str:
    for w in _WRAPPERS:
        name = name.replace(w, "")
    return name


def _matches(name: str, targets: Sequence[str] | str) -> bool:
    """peft's rule for a list of targets: the module name or a dotted suffix of it; a string is a regex."""
    if isinstance(targets, str):
        import re

        return re.fullmatch(targets, name) is not None
    return any(name == t or name.endswith("." + t) for t in targets)


def _block_type(name: str, block_lists: set[str]) -> str:
    head = name.split(".", 1)[0]
    return head if head in block_lists else "(outside blocks)"


def lora_target_counts(
    transformer: torch.nn.Module, target_modules: Sequence[str] | str
) -> dict[str, dict[str, int]]:
    """Per block type: ``blocks``, ``linears``, ``matched`` (by the targets), ``wrapped`` (LoRA layers),
    ``recommended`` (what `LORA_TARGET_MODULES` would match). Works before and after `add_lora`."""
    named = [(_clean(n), m) for n, m in transformer.named_modules()]
    block_lists = {n for n, m in named if n and "." not in n and isinstance(m, torch.nn.ModuleList)}
    tuner_prefixes = [n + "." for n, m in named if isinstance(m, BaseTunerLayer)]
    out: dict[str, dict[str, int]] = {}
    for b in sorted(block_lists):
        out[b] = {"blocks": len(getattr(transformer, b, [])), "linears": 0, "matched": 0, "wrapped": 0}
        out[b]["recommended"] = 0
    for name, module in named:
        if any(name.startswith(p) for p in tuner_prefixes):
            continue  # base_layer, lora_A, lora_B of a wrapped layer
        wrapped = isinstance(module, BaseTunerLayer)
        if not (wrapped or isinstance(module, torch.nn.Linear)):
            continue
        kind = _block_type(name, block_lists)
        row = out.setdefault(kind, {"blocks": 0, "linears": 0, "matched": 0, "wrapped": 0, "recommended": 0})
        row["linears"] += 1
        row["matched"] += _matches(name, target_modules)
        row["wrapped"] += wrapped
        row["recommended"] += _matches(name, LORA_TARGET_MODULES)
    return out


def _layer_names(transformer: torch.nn.Module, kind: str, limit: int = 6) -> list[str]:
    """Distinct Linear names (block index dropped) of one block type, for a fix hint."""
    names: list[str] = []
    for n, m in transformer.named_modules():
        n = _clean(n)
        if n.startswith(kind + ".") and isinstance(m, torch.nn.Linear | BaseTunerLayer):
            parts = n.split(".")[2:]
            if parts and parts[-1] not in ("base_layer", "default") and "lora_" not in n:
                short = ".".join(parts)
                if short not in names:
                    names.append(short)
    return names[:limit]


def lora_targets_error(
    transformer: torch.nn.Module, target_modules: Sequence[str] | str, cause: Exception | None = None
) -> PreflightError | None:
    """The named stop for targets that match no module of ``transformer`` (`add_lora` raises on the
    base model before any preflight can run); None if the targets do match something."""
    counts = lora_target_counts(transformer, target_modules)
    if any(v["matched"] for v in counts.values()) and cause is not None:
        return None
    hint = {k: _layer_names(transformer, k, 4) for k in counts if k != "(outside blocks)"}
    first = next(iter(hint.values()), [])
    return PreflightError(
        "lora_targets",
        f"lora.target_modules={list(target_modules) if not isinstance(target_modules, str) else target_modules} "
        f"matches no module of the transformer ({type(transformer).__name__}"
        + (f"; {type(cause).__name__}: {cause}" if cause else "")
        + "). Its blocks' Linear layers are e.g. "
        + "; ".join(f"{k}: {', '.join(v)}" for k, v in hint.items())
        + f". Fix: use names or dotted suffixes of those (e.g. lora.target_modules=[{', '.join(first[:2])}]), "
        "or leave lora.target_modules at its default (the recommended attention + FFN targets).",
        skippable=cause is None,
    )


def check_lora_targets(trainer: PreflightTarget) -> CheckResult:
    targets = trainer.config.lora.target_modules
    counts = lora_target_counts(trainer.transformer, targets)
    blocks = {k: v for k, v in counts.items() if k != "(outside blocks)"}
    wrapped = sum(v["wrapped"] for v in counts.values())
    numbers = {"wrapped": wrapped, **{k: f"{v['wrapped']}/{v['matched']}" for k, v in counts.items()}}
    detail = "per block type: wrapped/matched by lora.target_modules"
    if wrapped == 0:
        error = lora_targets_error(trainer.transformer, targets)
        assert error is not None
        raise error
    missing = [k for k, v in blocks.items() if v["wrapped"] == 0]
    if missing:
        hint = "; ".join(f"{k}: {', '.join(_layer_names(trainer.transformer, k))}" for k in missing)
        raise PreflightError(
            "lora_targets",
            f"lora.target_modules={list(targets)} adapts no module of the block type(s) {missing} "
            f"(their Linear layers: {hint}); those blocks would not train. Fix: add their names to "
            f"lora.target_modules, or use the default targets ({numbers})",
        )
    short = {k: v for k, v in counts.items() if v["wrapped"] != v["matched"]}
    if short:
        raise PreflightError(
            "lora_targets",
            f"the targets match {numbers} (wrapped/matched) but fewer of them are wrapped by LoRA in "
            f"{sorted(short)}: peft skipped some "
            "(a module type it cannot adapt?). Fix: check lora.target_modules against the model's layers",
        )
    return CheckResult("lora_targets", True, numbers, detail)


# ---- the probe ---------------------------------------------------------------------------------------
def _probe_records(trainer: PreflightTarget) -> tuple[list, int]:
    """This rank's first prompts of the first batch (the data position is put back), and the group offset."""
    state = trainer.data.state_dict()
    records = trainer.data.next_batch()
    trainer.data.load_state_dict(state)
    lo, hi = trainer.dist.shard(len(records))
    mine = records[lo:hi][:PROBE_PROMPTS]
    return mine, lo


def _probe_steps(trainer: PreflightTarget) -> int:
    return max(1, min(PROBE_STEPS, trainer.config.sampler.num_steps))


def probe_request(trainer: PreflightTarget, records: list, group_offset: int) -> RolloutRequest:
    """The training request shape at the configured size, with few steps and a one-step window inside."""
    s = trainer.config.sampler
    steps = _probe_steps(trainer)
    start = 0  # the last step is never stochastic
    base = trainer.rollout.request(records, group_offset, step=0)
    return replace(
        base,
        group_size=min(PROBE_SAMPLES, trainer.config.algorithm.group_size),
        num_steps=steps,
        window=WindowPlan(kind="fixed", size=1 if steps >= 2 else 0, start=start),
        seed=derive_seed(trainer.config.seed, "preflight", 0),
        noise_level=s.noise_level,
        decode=True,
    )


def check_reward_spread(trainer: PreflightTarget, traj: Trajectory, records: list, n: int) -> CheckResult:
    dist = trainer.dist
    scores = trainer.rewards(
        traj.images,
        [r for r in records for _ in range(n)],
        micro_batch_size=trainer.config.rollout.micro_batch_size,
    )
    total = dist.all_gather_cat(scores.total.float(), "preflight: gather rewards").cpu()
    per = {
        k: dist.all_gather_cat(v.float(), f"preflight: gather reward {k!r}").cpu()
        for k, v in scores.per_reward.items()
    }

    def group_std(v: torch.Tensor) -> list[float]:
        out = []
        for g in v.reshape(-1, n):
            g = g[torch.isfinite(g)]
            out.append(float(g.std(unbiased=False)) if g.numel() >= 2 else math.nan)
        return out

    stds = group_std(total)
    labels = list(trainer.rewards.labels)
    per_std = {
        k: max((s for s in group_std(v) if math.isfinite(s)), default=math.nan) for k, v in per.items()
    }
    numbers = {
        "groups": len(stds),
        "max_group_std": max((s for s in stds if math.isfinite(s)), default=math.nan),
        "reward_mean": float(total[torch.isfinite(total)].mean())
        if bool(torch.isfinite(total).any())
        else math.nan,
        "per_reward_max_std": per_std,
    }
    if not any(math.isfinite(x) for x in stds):
        # Non-finite rewards have their own guard (reward.max_nonfinite_steps stops with a checkpoint).
        logger.warning("preflight: no probe group has two finite rewards (%s); spread not checked", labels)
        return CheckResult(
            "reward_spread",
            None,
            numbers,
            "no probe group has two finite rewards (see reward.max_nonfinite_steps)",
        )
    finite = total[torch.isfinite(total)]
    if not any(math.isfinite(x) and x > 0 for x in stds):
        if bool((finite != finite[0]).any()):
            # The probe's images are PROBE_STEPS-step samples: a verifier with few distinct values
            # (a pretrained model's partial-credit score) may rate both of a group alike and still
            # tell prompts apart. A reward that varies at all is not the constant this check is for.
            detail = (
                f"the rewards {labels} vary across the probe's prompts but within none of its "
                f"{len(stds)} groups of {n} (its images have {PROBE_STEPS} denoising steps)"
            )
            logger.warning("preflight: %s", detail)
            return CheckResult("reward_spread", True, numbers, detail)
        values = sorted({round(float(x), 6) for x in finite.tolist()})[:4]
        verdicts = _one_verdict(trainer.rewards, per)
        others = [label for label in labels if label not in verdicts and trainer.rewards.weights[label] != 0]
        if verdicts and (not others or set(verdicts.values()) == {1.0}):
            # A verdict (0 or 1) that the base model earns a fraction of the time gives all of a few
            # few-step probe images the same verdict often (a pass rate of 0.3 leaves 4 images all
            # failing one time in four): no evidence of a broken reward. When every image passes, a
            # partial-credit reward beside the verdict may rightly give them all its top score (one
            # that is 1 exactly when the verdict is 1: scene_edit_dense beside scene_edit_exact);
            # beside failing verdicts it must vary. The run's reward/zero_std_share shows whether the
            # groups ever split.
            said = sorted(set(verdicts.values()))
            detail = (
                f"the pass/fail reward(s) {list(verdicts)} gave all {finite.numel()} probe images the verdict "
                + ("/".join(f"{v:g}" for v in said))
                + (f", and {others} a constant beside it" if others else "")
                + f" (images of {PROBE_STEPS} denoising steps): spread not checked; watch reward/zero_std_share"
            )
            logger.warning("preflight: %s", detail)
            return CheckResult("reward_spread", None, numbers, detail)
        raise PreflightError(
            "reward_spread",
            f"the rewards {labels} do not vary within or across any of the probe's {len(stds)} groups of {n} "
            f"(values seen: {values}): every advantage would be 0 and the run would train nothing. "
            "Fix: check the reward (a constant, a saturated threshold, the wrong image range) and "
            "reward.rewards; a reward that is rightly sparse on early samples can skip this with preflight=false",
        )
    flat = [k for k, s in per_std.items() if not (math.isfinite(s) and s > 0)]
    detail = f"rewards with no spread on the probe: {flat}" if flat else ""
    if flat:
        logger.warning("preflight: the reward(s) %s do not vary within the probe's groups", flat)
    return CheckResult("reward_spread", True, numbers, detail)


def _one_verdict(rewards: WeightedRewards, per: dict[str, torch.Tensor]) -> dict[str, float]:
    """The pass/fail rewards that enter the total (each declares its scores to be verdicts in {0, 1})
    with the one verdict each gave every finite probe score, by label; empty when no such reward
    enters the total or one of them gave two verdicts or a score outside {0, 1}."""
    verdicts = {}
    for label, weight, reward in rewards.terms:
        if weight == 0 or getattr(reward, "pass_fail", False) is not True:
            continue
        scores = per[label][torch.isfinite(per[label])]
        seen = {float(x) for x in scores.tolist()}
        if len(seen) != 1 or not seen <= {0.0, 1.0}:
            return {}
        verdicts[label] = seen.pop()
    return verdicts


def check_ratio_and_gradients(trainer: PreflightTarget, traj: Trajectory) -> tuple[CheckResult, CheckResult]:
    """One forward with grad per micro-batch of the probe's window step, one backward: the recomputed
    log-prob against the rollout's, and the gradient reaching every adapted module."""
    learner, dist, device = trainer.learner, trainer.dist, trainer.device
    transformer = trainer.transformer
    layers = [(n, m) for n, m in transformer.named_modules() if isinstance(m, BaseTunerLayer)]
    ran = torch.zeros(len(layers), dtype=torch.float64)
    hooks = []
    root = unwrap_transformer(transformer)
    for i, (_, m) in enumerate(layers):

        def hook(module, args, output, i=i):
            # The reference stage's placeholder pass under FSDP (zero gradients by design) is not a run.
            if not getattr(root, "placeholder_running", False):
                ran[i] = 1.0

        hooks.append(m.register_forward_hook(hook))
    lora_params = [
        [p for pn, p in m.named_parameters() if "lora_" in pn and p.requires_grad] for _, m in layers
    ]
    was_training = transformer.training
    transformer.train()
    diff = torch.zeros((), dtype=torch.float64, device=device)
    clipped = torch.zeros((), dtype=torch.float64, device=device)  # the loss's clipped ratios
    rows = torch.arange(traj.batch_size)
    chunks = learner.micro_batches(rows)
    # a loss with a ratio against the rollout's log-probs: its clip on the recomputed steps
    algorithm = learner.algorithm if learner.algorithm.reads_rollout_logprobs else None
    try:
        for k in range(traj.window_size):
            for chunk in chunks:
                stats = learner.recompute.step_stats(transformer, traj, k, index=chunk)
                old = learner.recompute.rows(traj.log_prob, chunk)[:, k]
                diff = torch.maximum(diff, (stats.log_prob.detach().double() - old.double()).abs().max())
                if algorithm is not None:  # the clip of the run's own loss (PPO-clip or GRPO-Guard)
                    with torch.no_grad():
                        step = learner.recompute.rows(traj.step_index, chunk)[:, k]
                        dt = traj.sigmas[step + 1] - traj.sigmas[step]
                        ones = torch.ones(len(chunk), device=old.device)
                        pl = algorithm.objective(stats, traj, k, chunk, ones, dt)
                    clipped = clipped + pl.metrics["clipfrac"].double() * len(chunk)
                (stats.log_prob.mean() * len(chunk) / traj.batch_size).backward()
    finally:
        for h in hooks:
            h.remove()
        transformer.train(was_training)
    norms = torch.stack(
        [
            torch.stack([local_tensor(p.grad).double().abs().sum() for p in ps if p.grad is not None]).sum()
            if any(p.grad is not None for p in ps)
            else torch.zeros((), dtype=torch.float64, device=device)
            for ps in lora_params
        ]
    )
    both = torch.cat([norms, ran.to(device)])
    host = dist.all_reduce_sum(both, "preflight: gradient check").cpu()
    norms_h, ran_h = host[: len(layers)], host[len(layers) : 2 * len(layers)]
    worst = dist.all_reduce_max(
        torch.stack([diff, clipped / (traj.window_size * traj.batch_size)]), "preflight: ratio check"
    )
    diff_h, clipfrac_h = worst.tolist()  # the max over ranks

    # An engine with its own copy of the model (vllm-omni's transformer port, another process) agrees
    # to float rounding; the local engine runs the very same ops (`onpolicy.LOGPROB_TOLERANCE`).
    own_copy = trainer.engine is not trainer.local_engine
    base_dtype = next(p.dtype for n, p in transformer.named_parameters() if "lora_" not in n)
    kernels = logprob_tolerance(device.type, base_dtype, own_copy=own_copy)
    limit = logprob_diff_limit(trainer.config)
    tol = kernels if limit is None else min(kernels, limit)
    who = (
        type(trainer.engine).__name__
        if own_copy
        else f"{device.type} {str(base_dtype).removeprefix('torch.')}"
    )
    rule = f"|diff| <= {kernels:g} ({who})" + (
        "" if limit is None else f" and {limit:g} ({limit_source(trainer.config)}), no clipped ratio"
    )
    ratio = CheckResult(
        "on_policy_ratio",
        diff_h <= tol and not clipfrac_h > 0,
        {
            "max_abs_logprob_diff": diff_h,
            "tolerance": tol,
            "clipfrac": clipfrac_h,
            "window_steps": traj.window_size,
        },
        rule,
    )
    exercised = [i for i in range(len(layers)) if ran_h[i] > 0]
    dead = [layers[i][0] for i in exercised if not (norms_h[i] > 0 and math.isfinite(float(norms_h[i])))]
    unused = [layers[i][0] for i in range(len(layers)) if ran_h[i] == 0]
    grads = CheckResult(
        "gradients",
        not dead and bool(exercised),
        {"adapted": len(layers), "ran": len(exercised), "nonzero_grad": len(exercised) - len(dead)},
        (f"not run by the probe (no check): {_summarize(unused)}" if unused else ""),
    )
    if not ratio.passed and not diff_h <= kernels:  # NaN too
        raise PreflightError(
            "on_policy_ratio",
            f"the learner's recomputed log-prob differs from the rollout's by {diff_h:.3g} "
            f"(allowed {kernels:.3g} for {who}) before any update: the ratio is not 1, the PPO clip would act on noise. "
            "Fix: the rollout and the training step must run the same function with the same weights "
            "(dropout? lora.* differing between engine and trainer? model.compile only on one side?)",
            ratio,
            grads,
        )
    if not ratio.passed:
        raise PreflightError(
            "on_policy_ratio",
            f"the learner's recomputed log-prob differs from the rollout's by {diff_h:.3g}, within what "
            f"{who} kernels do ({kernels:.3g}) but above {limit_source(trainer.config)} = {tol:.3g}, and the "
            f"loss clips {clipfrac_h:.3g} of the probe's ratios before any update: {ON_POLICY_FIX}",
            ratio,
            grads,
        )
    if not grads.passed:
        raise PreflightError(
            "gradients",
            f"{len(dead)} of {len(exercised)} adapted modules that the forward ran got a zero or non-finite "
            f"gradient from one backward ({_summarize(dead)}): they would never train. "
            "Fix: check that the LoRA parameters require grad and are the optimizer's, and that nothing "
            "detaches their outputs (e.g. a no_grad or a .detach() in the model)",
            ratio,
            grads,
        )
    return ratio, grads


def _summarize(names: list[str], limit: int = 4) -> str:
    more = f" and {len(names) - limit} more" if len(names) > limit else ""
    return ", ".join(names[:limit]) + more


def check_weight_sync(trainer: PreflightTarget, records: list) -> CheckResult:
    """Perturb every ``lora_B``, publish, roll out the deterministic probe; restore, publish, roll out again."""
    engine, dist = trainer.engine, trainer.dist
    if not isinstance(engine, RelabelableEngine):
        return CheckResult(
            "weight_sync", None, {}, f"{type(engine).__name__} cannot be put back to its version: not checked"
        )
    s = trainer.config.sampler
    request = replace(
        deterministic_request(
            records[:1],
            num_steps=SYNC_PROBE_STEPS,
            guidance_scale=s.guidance_scale,
            image_guidance_scale=s.image_guidance_scale,
            height=s.height,
            width=s.width,
            seed=derive_seed(trainer.config.seed, "preflight", 1),
        ),
        decode=False,
    )

    def probe() -> torch.Tensor:
        with dist.collective("preflight: sync probe"):
            return engine.generate(request).final_latents.detach().float().clone()

    before = probe()
    v0 = engine.weights_version
    b_params = [p for n, p in trainer.transformer.named_parameters() if is_lora_b(n)]
    saved = [local_tensor(p.detach()).clone() for p in b_params]
    cuda = trainer.device.type == "cuda"
    try:
        with torch.no_grad():
            for p in b_params:
                local_tensor(p.detach()).add_(SYNC_DELTA)
        trainer.publish_weights(version=v0 + 1)
        recorded = engine.weights_version
        after = probe()
    finally:
        with torch.no_grad():
            torch._foreach_copy_([local_tensor(p.detach()) for p in b_params], saved)
    trainer.publish_weights(version=v0 + 2)
    restored = probe()
    changed = float((after - before).abs().max())
    back = float((restored - before).abs().max())
    back_tol = 1e-3 * max(1.0, float(before.abs().max())) if cuda else 0.0
    flags = torch.tensor(
        [recorded != v0 + 1, changed == 0, back > back_tol], dtype=torch.float64, device=trainer.device
    )
    flags = dist.all_reduce_sum(flags, "preflight: sync check").cpu()
    numbers = {
        "engine": type(engine).__name__,
        "needs_lora_state": engine.needs_lora_state,
        "perturbed_diff": changed,
        "restored_diff": back,
    }
    result = CheckResult("weight_sync", not bool(flags.any()), numbers)
    if flags[0]:
        raise PreflightError(
            "weight_sync",
            f"after sync_weights({v0 + 1}) the engine reports weights_version={recorded}: the sync did "
            f"nothing ({type(engine).__name__}.sync_weights). Fix: the engine's sync_weights must adopt the "
            "weights and record the version",
            result,
        )
    if flags[1]:
        raise PreflightError(
            "weight_sync",
            f"a LoRA update published with sync_weights did not change the engine's next rollout "
            f"(max |diff| = 0; {type(engine).__name__}, needs_lora_state={engine.needs_lora_state}): the "
            "rollouts would keep sampling the initial weights. Fix: the engine must load the LoRA state "
            "it is sent (or sample with the trainer's own module)",
            result,
        )
    if flags[2]:
        raise PreflightError(
            "weight_sync",
            f"after restoring the LoRA and syncing again the engine's rollout differs from the original "
            f"by {back:.3g}: the engine does not take back the weights it is sent. Fix: its sync must "
            "apply every LoRA tensor, not only changes",
            result,
        )
    return result


# ---- the whole preflight -----------------------------------------------------------------------------
def _snapshot(trainer: PreflightTarget) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """The trainer's state (as a checkpoint takes it) and the engine's run-time state."""
    engine = trainer.engine
    with trainer.dist.collective("preflight: snapshot"):
        state = copy.deepcopy(trainer.state_dict())  # tensors cloned: later in-place updates cannot reach it
    return state, engine.state_dict() if isinstance(engine, RelabelableEngine) else None


def _put_back(trainer: PreflightTarget, saved: tuple[dict[str, Any], dict[str, Any] | None]) -> None:
    state, engine_state = saved
    trainer.load_state_dict(copy.deepcopy(state))  # the snapshot stays intact for a second put-back
    if engine_state is not None:  # the weights are back (re-synced under a newer number): so is the label
        trainer.engine.load_state_dict(engine_state)


def preflight_due(trainer: PreflightTarget) -> bool:
    """Whether a run starts with the preflight: ``preflight`` on, a fresh run (step 0), not run yet.

    On several ranks every rank runs the same probe (its collectives are named like the step's);
    the 2-rank kill/resume and 2-ranks-equal-1-rank tests run with it and stay bitwise exact.
    """
    return bool(trainer.config.preflight and trainer.step == 0 and trainer.preflight_report is None)


def run_preflight(trainer: PreflightTarget, *, raise_on_failure: bool = True) -> PreflightReport:
    """Run every check on a probe batch; put the trainer back exactly as it was.

    Returns the report (also logged); with ``raise_on_failure`` the first failed check raises its
    `PreflightError` (carrying the report), else failures are only in the report.
    """
    t0 = time.perf_counter()
    report = PreflightReport()
    errors: list[PreflightError] = []

    def attempt(name: str, fn: Callable[[], Any]) -> Any:
        try:
            out = fn()
        except PreflightError as e:
            errors.append(e)
            results = e.results or [CheckResult(e.check, False)]
            if e.check not in [r.name for r in results]:
                results.append(CheckResult(e.check, False))
            for r in results:
                if r.name == e.check:
                    r.passed, r.detail = False, e.cause
            report.checks.extend(results)
            return None
        results = out if isinstance(out, tuple) else (out,)
        report.checks.extend(results)
        return out

    attempt("lora_targets", lambda: check_lora_targets(trainer))
    saved = _snapshot(trainer)
    try:
        records, offset = _probe_records(trainer)
        request = probe_request(trainer, records, offset)
        with trainer.dist.collective("preflight: probe rollout"):
            traj = trainer.engine.generate(request)
        attempt("reward_spread", lambda: check_reward_spread(trainer, traj, records, request.group_size))
        if traj.window_size:
            attempt("on_policy_ratio", lambda: check_ratio_and_gradients(trainer, traj))
        else:
            report.checks.append(CheckResult("on_policy_ratio", None, {}, "sampler.num_steps=1: no window"))
        _put_back(trainer, saved)  # no gradient is left for the sync check
        attempt("weight_sync", lambda: check_weight_sync(trainer, records))
    finally:
        _put_back(trainer, saved)
    report.seconds = time.perf_counter() - t0
    if trainer.dist.is_main:
        logger.info("%s", report.render())
    if errors and raise_on_failure:
        err = errors[0]
        err.report = report
        raise err
    return report
