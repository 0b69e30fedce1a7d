"""Mini-batches on several ranks: the layouts `check_world_layout` refuses are exactly those whose
update differs from the same recipe on one rank, and the memory plan's training micro-batch is the
one the learner cuts.

The ranks are simulated without a process group: each rank's `Learner` gets the share of groups
`DistEnv.shard` gives it (with their global group ids, as the rollout numbers them) and runs its
real mini-batch and micro-batch schedule; the forward/backward and the optimizer step are replaced
by a recorder. A row of a rank's mini-batch enters the loss with weight 1 / (that rank's rows in the
mini-batch) (`Learner._accumulate`) and FSDP averages the ranks' gradients, so a row's weight in an
optimizer step is 1 / (world x the rank's rows); on one rank it is 1 / (the mini-batch's rows).
"""

from __future__ import annotations

import dataclasses
from fractions import Fraction
from types import SimpleNamespace

import pytest
import torch

from boogu_trainer.cli import main
from boogu_trainer.config import (
    ConfigError,
    TrainerConfig,
    check_world_layout,
    demo_config,
    scenes_demo_config,
)
from boogu_trainer.distributed import DistEnv
from boogu_trainer.learner import Learner, UpdateResult
from boogu_trainer.plan import plan_memory, train_micro_batch_rows

GROUP_SIZE = 2


def _config(prompts: int, mini_batches: int, micro: int = 0, group_size: int = GROUP_SIZE) -> TrainerConfig:
    c = demo_config()
    return dataclasses.replace(
        c,
        data=dataclasses.replace(c.data, prompts_per_step=prompts),
        algorithm=dataclasses.replace(
            c.algorithm, group_size=group_size, mini_batches=mini_batches, train_micro_batch_size=micro
        ),
    )


def _rank_schedule(config: TrainerConfig, rank: int, world: int) -> list[tuple[list[list[int]], int]]:
    """(micro-batches as global rows, the rank's rows in the mini-batch) of each optimizer step."""
    n = config.algorithm.group_size
    lo, hi = DistEnv(rank=rank, world_size=world).shard(config.data.prompts_per_step)
    group_id = torch.arange(lo, hi).repeat_interleave(n)  # the rollout's global group ids
    rows = group_id.numel()
    learner = Learner(
        config.algorithm,
        config.optim,
        config.ema,
        torch.nn.Linear(1, 1),
        None,
        DistEnv(rank=rank, world_size=world),
        torch.device("cpu"),
        seed=config.seed,
    )
    steps: list[tuple[list[list[int]], int]] = []

    def record(batch, advantages, chunks, total_rows, *rest, **kwargs):
        to_global = [[int(group_id[r]) * n + r % n for r in chunk] for chunk in chunks]
        steps.append((to_global, total_rows))
        return torch.zeros((), dtype=torch.bool)

    learner._accumulate = record
    learner.optimizer_step = lambda bad_loss, acc: "ok"
    learner.finish = lambda *args, **kwargs: UpdateResult(metrics={}, finite=True)
    ones = torch.ones(rows)  # every advantage non-zero: one rank skips no row
    batch = SimpleNamespace(
        trajectory=SimpleNamespace(batch_size=rows, group_id=group_id, window_size=1),
        advantages=ones,
        finite=torch.ones(rows, dtype=torch.bool),
        global_advantages=SimpleNamespace(finite=torch.ones(1, dtype=torch.bool)),
    )
    learner.update(batch)
    return steps


def _optimizer_steps(config: TrainerConfig, world: int) -> tuple[list[dict[int, Fraction]], bool]:
    """Each optimizer step's weight per global row over all ranks, and whether every rank runs as
    many micro-batches in each step (else their FSDP collectives would not pair up).

    Raises AssertionError when the ranks make different numbers of optimizer steps."""
    per_rank = [_rank_schedule(config, r, world) for r in range(world)]
    assert len({len(s) for s in per_rank}) == 1, f"optimizer steps per rank: {[len(s) for s in per_rank]}"
    weights: list[dict[int, Fraction]] = []
    micro_batches_agree = True
    for step in zip(*per_rank):
        w: dict[int, Fraction] = {}
        for chunks, total in step:
            for chunk in chunks:
                for row in chunk:
                    w[row] = w.get(row, Fraction(0)) + Fraction(1, world * total)
        weights.append(w)
        micro_batches_agree &= len({len(chunks) for chunks, _ in step}) == 1
    return weights, micro_batches_agree


@pytest.mark.parametrize("world", [2, 3, 4])
def test_refused_exactly_where_the_ranks_update_differs_from_one_rank(world):
    outcomes = set()
    for prompts in range(1, 4 * world + 1):
        for mini_batches in range(1, 5):
            if mini_batches > prompts:  # more mini-batches than groups: refused on any world size
                with pytest.raises(ConfigError, match=r"^algorithm\.mini_batches=.* at most"):
                    _config(prompts, mini_batches, micro=GROUP_SIZE)
                continue
            config = _config(prompts, mini_batches, micro=GROUP_SIZE)  # micro-batches of one group
            try:
                check_world_layout(config, world)
                refused = False
            except ConfigError:
                refused = True
            one_rank, _ = _optimizer_steps(config, 1)
            try:
                ranks, micro_batches_agree = _optimizer_steps(config, world)
                same = ranks == one_rank and micro_batches_agree
            except (AssertionError, ValueError):  # unequal step counts; groups that cannot be shared out
                same = False
            assert refused == (not same), (
                f"prompts_per_step={prompts}, mini_batches={mini_batches}, {world} ranks: "
                f"refused={refused} but the update {'equals' if same else 'differs from'} one rank's"
            )
            outcomes.add(refused)
    assert outcomes == {True, False}  # the grid holds layouts of both kinds


@pytest.mark.parametrize(
    ("prompts", "mini_batches", "micro"), [(4, 2, 0), (8, 2, 3), (8, 4, 2), (12, 3, 5), (12, 2, 0)]
)
def test_two_ranks_make_the_one_rank_mini_batches(prompts, mini_batches, micro):
    config = _config(prompts, mini_batches, micro)
    check_world_layout(config, 2)
    one_rank, _ = _optimizer_steps(config, 1)
    ranks, micro_batches_agree = _optimizer_steps(config, 2)
    assert len(one_rank) == mini_batches
    assert [set(w) for w in ranks] == [set(w) for w in one_rank]  # the same rows in each mini-batch
    assert ranks == one_rank  # with the same weights
    assert micro_batches_agree


@pytest.mark.parametrize(
    ("prompts", "mini_batches", "micro", "world", "rows"),
    [
        (3, 2, 0, 1, 8),  # groups {0, 2} and {1}: the largest mini-batch has 2 groups x 4 rows
        (4, 4, 0, 1, 4),  # 4 mini-batches of 4 groups: one group each
        (4, 2, 12, 1, 8),  # a micro-batch is never larger than its mini-batch
        (6, 4, 5, 1, 5),  # 4 mini-batches of 2, 2, 1, 1 groups, cut in 5-row micro-batches
        (8, 2, 0, 2, 8),  # 4 groups per rank, 2 in each mini-batch
    ],
)
def test_plan_micro_batch_is_the_learners_in_rows(prompts, mini_batches, micro, world, rows):
    config = _config(prompts, mini_batches, micro, group_size=4)
    assert train_micro_batch_rows(config, world) == rows
    per_rank = [_rank_schedule(config, r, world) for r in range(world)]
    assert max(len(c) for steps in per_rank for chunks, _ in steps for c in chunks) == rows


def test_plan_sizes_the_train_phase_in_the_learners_rows(tiny_checkpoint):
    # 3 groups of 8 in 2 mini-batches: the learner trains on 2 groups (16 rows), then 1 group
    config = _config(3, 2, group_size=8)
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, tiny_path=str(tiny_checkpoint))
    )
    plan = plan_memory(config, world_size=1, device_type="cpu")
    assert plan.phases["train"].items == 16


@pytest.mark.parametrize(
    ("prompts", "mini_batches", "world", "expected"),
    [
        (12, 1, 8, "data.prompts_per_step=12 over 8 ranks: expected a multiple of 8"),
        (
            12,
            4,
            2,
            "algorithm.mini_batches=4 with data.prompts_per_step=12 over 2 ranks (6 groups per rank): "
            "expected algorithm.mini_batches to divide the groups per rank (one of 1, 2, 3, 6), or "
            "data.prompts_per_step a multiple of 8",
        ),
    ],
)
def test_refusal_names_the_keys_values_and_what_is_allowed(prompts, mini_batches, world, expected):
    config = _config(prompts, mini_batches)
    with pytest.raises(ConfigError, match="^" + expected.replace("(", r"\(").replace(")", r"\)")):
        check_world_layout(config, world)
    check_world_layout(config, 1)  # one rank is the reference layout: nothing to refuse


def test_plan_command_refuses_a_layout_the_trainer_would_refuse(tmp_path, capsys):
    # the demo's prompts per step (16) cannot be split over twice as many ranks
    prompts = scenes_demo_config().data.prompts_per_step
    code = main(["--plan", "--world-size", str(2 * prompts), f"logging.run_dir={tmp_path / 'runs'}"])
    err = capsys.readouterr().err
    assert code == 2 and f"config error: data.prompts_per_step={prompts} over {2 * prompts} ranks" in err
