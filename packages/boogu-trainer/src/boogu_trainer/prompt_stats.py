"""Per-prompt reward statistics of the model a run starts from, and the training-prompt filter that
reads them (``trainer RECIPE --prompt-stats PATH``, ``data.prompt_stats``).

A group whose samples all score alike has zero advantages: it costs a rollout and teaches nothing.
When the model's verdict on a prompt is nearly decided by the prompt (the tiny Edit checkpoint edits
an instruction right, or wrong, in all 8 draws for two thirds of them: benchmarks/README.md, "The
Edit demo over ten seeds"), most of a step's rollouts are spent so. `measure_prompt_stats` rolls each
training prompt out ``samples`` times with the recipe's own rollout settings, before any update, and
records the mean and the standard deviation of its total reward; `filter_records` keeps the
prompts whose samples differed (``std > data.prompt_stats_min_std``). Prompts are matched by
`prompt_key` (their text, negative and reference image), not by position, so the file serves any
order or subset of the same prompts, and a prompt it never measured is an error, not a guess.

The file is JSON: ``format`` (:data:`FORMAT`), ``samples``, ``seed``, ``rewards`` (the labels and
weights summed), ``model`` and ``sampler`` (what measured it), and ``prompts``: one
``{"key", "prompt", "mean", "std", "per_reward"}`` per measured prompt, in the dataset's order.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Callable, Sequence
from dataclasses import asdict, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

from boogu_data import PromptRecord
from boogu_data.atomic import atomic_write_text
from boogu_schedule import derive_seed
from boogu_trainer.data import prompt_key

if TYPE_CHECKING:
    from boogu_adapters.engines import RolloutEngine
    from boogu_trainer.config import TrainerConfig
    from boogu_trainer.data import PromptSampler
    from boogu_trainer.distributed import DistEnv
    from boogu_trainer.rewards.composite import WeightedRewards
    from boogu_trainer.scoring import RolloutScorer


class StatsTarget(Protocol):
    """What the measurement uses of a trainer (`boogu_trainer.trainer.Trainer` is one)."""

    config: TrainerConfig
    dist: DistEnv
    engine: RolloutEngine
    data: PromptSampler
    rollout: RolloutScorer
    rewards: WeightedRewards


FORMAT = "boogu-prompt-stats/1"
"""The ``format`` of a prompt statistics file (a reader refuses any other)."""


def measure_prompt_stats(
    trainer: StatsTarget,
    *,
    samples: int,
    limit: int = 0,
    progress: Callable[[int, int], None] | None = None,
    partial: str | os.PathLike | None = None,
) -> dict[str, Any]:
    """Roll out each of the trainer's training prompts (the first ``limit``; 0: all) ``samples``
    times with its rollout settings and weights as built (before any update), score them with its
    rewards, and return the statistics file's content. ``data.prompts_per_step`` prompts per engine
    call; the noise comes from ``derive_seed(seed, "prompt_stats", call)``, apart from the training
    rollouts'. One process only (the statistics would otherwise need gathering).

    ``partial``: a file the prompts measured so far are written to after each call; a measurement
    that finds one of its own (same settings, same prompts so far) goes on from it, and its result
    equals an uninterrupted one's (the noise of a call depends only on its index).

    Raises:
        ValueError: ``samples`` below 2 (a standard deviation needs two), a run on several ranks, or
            a ``partial`` file of another measurement.
    """
    if samples < 2:
        raise ValueError(f"--samples {samples}: the spread of a prompt's rewards needs at least 2 samples")
    if trainer.dist.world_size != 1:
        raise ValueError(
            f"prompt statistics run on one process (this run has {trainer.dist.world_size} ranks): "
            "launch `trainer RECIPE --prompt-stats PATH` without torchrun"
        )
    config = trainer.config
    records = list(trainer.data.records)
    if limit:
        records = records[:limit]
    chunk = config.data.prompts_per_step
    # The settings as JSON gives them back (tuples become lists), to compare with a partial file's.
    header = json.loads(
        json.dumps(
            {
                "format": FORMAT,
                "samples": samples,
                "seed": config.seed,
                "rewards": trainer.rewards.weights,
                "model": config.model.path or f"tiny {config.model.tiny}",
                "sampler": asdict(config.sampler),
            }
        )
    )
    rows = _resumed_rows(partial, header, records) if partial is not None else []
    for call, start in enumerate(range(0, len(records), chunk)):
        if start < len(rows):
            continue
        batch = records[start : start + chunk]
        request = replace(
            trainer.rollout.request(batch, group_offset=0, step=0),
            group_size=samples,
            seed=derive_seed(config.seed, "prompt_stats", call),
        )
        traj = trainer.engine.generate(request)
        scores = trainer.rewards(
            traj.images,
            [r for r in batch for _ in range(samples)],
            micro_batch_size=config.rollout.micro_batch_size,
        )
        total = scores.total.float().cpu().reshape(len(batch), samples)
        per = {k: v.float().cpu().reshape(len(batch), samples) for k, v in scores.per_reward.items()}
        for i, record in enumerate(batch):
            rows.append(
                {
                    "key": prompt_key(record),
                    "prompt": record.instruction,
                    "mean": _finite_or_none(total[i].mean()),
                    "std": _finite_or_none(total[i].std(unbiased=False)),
                    "per_reward": {k: _finite_or_none(v[i].mean()) for k, v in per.items()},
                }
            )
        if partial is not None:
            write_prompt_stats({**header, "prompts": rows}, partial)
        if progress is not None:
            progress(len(rows), len(records))
    return {**header, "prompts": rows}


def _resumed_rows(
    partial: str | os.PathLike, header: dict[str, Any], records: Sequence[PromptRecord]
) -> list[dict[str, Any]]:
    """The rows of an interrupted measurement with these settings and prompts (none without a file)."""
    path = Path(partial).expanduser()
    if not path.exists():
        return []
    try:
        saved = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} (an interrupted measurement) cannot be read: {error}; remove it") from None
    differ = [k for k in header if not isinstance(saved, dict) or saved.get(k) != header[k]]
    rows = saved.get("prompts") if isinstance(saved, dict) else None
    if differ or not isinstance(rows, list):
        raise ValueError(
            f"{path} holds an interrupted measurement with other settings ({', '.join(differ) or 'prompts'}); "
            "remove it to measure again"
        )
    keys = [prompt_key(r) for r in records[: len(rows)]]
    if len(rows) > len(records) or [r.get("key") for r in rows] != keys:
        raise ValueError(
            f"{path} holds an interrupted measurement of other prompts; remove it to measure again"
        )
    return rows


def _finite_or_none(value) -> float | None:
    x = float(value)
    return x if math.isfinite(x) else None


def write_prompt_stats(stats: dict[str, Any], path: str | os.PathLike) -> Path:
    """Write ``stats`` to ``path`` whole or not at all (`boogu_data.atomic.atomic_write_text`)."""
    path = Path(path).expanduser()
    atomic_write_text(path, json.dumps(stats, indent=1) + "\n")
    return path


def read_prompt_stats(path: str | os.PathLike) -> dict[str, float | None]:
    """The standard deviation of each measured prompt's rewards, by `prompt_key`.

    Raises:
        ValueError: naming the file and what is wrong (missing, not JSON, another format, a row
            without its key or standard deviation).
    """
    path = Path(path).expanduser()
    try:
        stats = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ValueError(
            f"{path} does not exist; write it with `trainer RECIPE --prompt-stats {path}`"
        ) from None
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as error:
        raise ValueError(f"{path} is not a prompt statistics file: {error}") from None
    if not isinstance(stats, dict) or stats.get("format") != FORMAT:
        found = stats.get("format") if isinstance(stats, dict) else type(stats).__name__
        raise ValueError(f"{path}: format {found!r}, expected {FORMAT!r} (`trainer RECIPE --prompt-stats`)")
    rows = stats.get("prompts")
    if not isinstance(rows, list):
        raise ValueError(f"{path}: 'prompts' must be a list of measured prompts")
    spread: dict[str, float | None] = {}
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or not isinstance(row.get("key"), str) or "std" not in row:
            raise ValueError(f"{path}: prompts[{i}] needs a 'key' (text) and a 'std' (number or null)")
        std = row["std"]
        if std is not None and (isinstance(std, bool) or not isinstance(std, int | float)):
            raise ValueError(f"{path}: prompts[{i}].std is {std!r}, expected a number or null")
        spread[row["key"]] = std
    return spread


def filter_records(
    records: Sequence[PromptRecord], sources: Sequence[str], path: str, min_std: float
) -> tuple[list[PromptRecord], list[str]]:
    """The records whose measured reward spread in ``path`` exceeds ``min_std``, with their sources;
    a prompt measured with non-finite rewards (std null) is dropped.

    Raises:
        ValueError: the file's own errors (`read_prompt_stats`), a record the file never measured
            (naming the first one's source and how many), or no record left.
    """
    spread = read_prompt_stats(path)
    missing = [i for i, r in enumerate(records) if prompt_key(r) not in spread]
    if missing:
        raise ValueError(
            f"{path} has no statistics for {sources[missing[0]]} ({records[missing[0]].instruction[:60]!r}); "
            f"{len(missing)} of {len(records)} training prompts are missing: measure these prompts with "
            f"`trainer RECIPE --prompt-stats {path}`"
        )
    keep = [i for i, r in enumerate(records) if (s := spread[prompt_key(r)]) is not None and s > min_std]
    if not keep:
        raise ValueError(
            f"none of the {len(records)} training prompts has a reward spread above {min_std} in {path}"
        )
    return [records[i] for i in keep], [sources[i] for i in keep]


__all__ = [
    "FORMAT",
    "filter_records",
    "measure_prompt_stats",
    "prompt_key",
    "read_prompt_stats",
    "write_prompt_stats",
]
