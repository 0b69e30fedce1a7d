"""SDE window plans: invariants for all N, sizes, ranges and seeds."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from boogu_schedule import (
    SdeWindow,
    WindowPlan,
    fixed_window,
    full_window,
    plan_windows,
    progressive_window,
    random_window,
)
from tests.strategies import seeds


@st.composite
def window_problems(draw):
    """(N, size, (lo, hi)) with a window of that size fitting inside [lo, min(hi, N - 1))."""
    n = draw(st.integers(2, 60))
    lo = draw(st.integers(0, n - 2))
    hi = draw(st.integers(lo + 1, n + 5))
    size = draw(st.integers(0, min(hi, n - 1) - lo))
    return n, size, (lo, hi)


def assert_invariants(window: SdeWindow, n: int, size: int, rng: tuple[int, int]):
    assert window.size == size
    assert rng[0] <= window.start and window.end <= min(rng[1], n - 1)
    assert not window.contains(n - 1)  # the last step is never stochastic
    levels = window.noise_levels(n)
    inside = torch.zeros(n, dtype=torch.bool)
    inside[window.start : window.end] = True
    assert bool((levels[~inside] == 0).all())
    assert bool((levels[inside] == window.noise_level).all())


@given(problem=window_problems(), seed=seeds, eta=st.floats(0.1, 2.0))
def test_random_windows_obey_invariants_and_are_seeded(problem, seed, eta):
    n, size, rng = problem
    a = random_window(n, size, rng, eta, torch.Generator().manual_seed(seed))
    b = random_window(n, size, rng, eta, torch.Generator().manual_seed(seed))
    assert a == b
    assert_invariants(a, n, size, rng)


def test_random_windows_cover_every_allowed_start():
    gen = torch.Generator().manual_seed(0)
    starts = {random_window(10, 2, (0, 5), 1.2, gen).start for _ in range(200)}
    assert starts == {0, 1, 2, 3}  # the recipe: size 2 in [0, 5) over 10 steps


@given(
    problem=window_problems(),
    iteration=st.integers(0, 1000),
    stride=st.integers(1, 4),
    every=st.integers(1, 5),
)
def test_progressive_windows_obey_invariants_advance_and_wrap(problem, iteration, stride, every):
    n, size, (lo, hi) = problem
    w = progressive_window(n, size, (lo, hi), 1.0, iteration, stride, every)
    assert_invariants(w, n, size, (lo, hi))
    positions = min(hi, n - 1) - size - lo + 1
    assert w.start == lo + ((iteration // every) * stride) % positions
    assert progressive_window(n, size, (lo, hi), 1.0, iteration + every * positions, stride, every) == w


@given(n=st.integers(1, 60), eta=st.floats(0.0, 2.0))
def test_full_window_is_every_step_but_the_last(n, eta):
    w = full_window(n, eta)
    assert (w.start, w.end) == (0, n - 1)
    assert w.noise_levels(n)[-1].item() == 0.0


def test_window_over_the_last_step_or_too_big_is_refused():
    with pytest.raises(ValueError, match="last step"):
        fixed_window(6, 2, 4, 1.0)
    with pytest.raises(ValueError, match="does not fit"):
        random_window(6, 6, None, 1.0, torch.Generator())
    with pytest.raises(ValueError, match="start <= end"):
        SdeWindow(3, 2, 1.0)


def test_degenerate_window_has_no_stochastic_step():
    w = full_window(1, 1.0)
    assert w.size == 0 and w.noise_levels(1).tolist() == [0.0]


@given(
    problem=window_problems(),
    groups=st.integers(0, 5),
    group_size=st.integers(1, 6),
    seed=seeds,
    scope=st.sampled_from(["group", "batch", "sample"]),
    kind=st.sampled_from(["fixed", "random", "progressive"]),
)
def test_plans_share_windows_as_their_scope_says(problem, groups, group_size, seed, scope, kind):
    n, size, rng = problem
    plan = WindowPlan(kind=kind, size=size, window_range=rng, start=rng[0], scope=scope)
    windows = plan_windows(plan, n, 1.0, groups, group_size, torch.Generator().manual_seed(seed))
    assert len(windows) == groups * group_size
    for w in windows:
        assert_invariants(w, n, size, rng)
    for g in range(groups):  # with every scope but "sample", a group shares one window
        group = windows[g * group_size : (g + 1) * group_size]
        if scope != "sample":
            assert len(set(group)) == 1
    if scope == "batch":
        assert len(set(windows)) <= 1
    again = plan_windows(plan, n, 1.0, groups, group_size, torch.Generator().manual_seed(seed))
    assert again == windows


def test_group_scope_draws_independent_windows_per_group():
    plan = WindowPlan(kind="random", size=2, window_range=(0, 5), scope="group")
    windows = plan_windows(plan, 10, 1.2, 50, 4, torch.Generator().manual_seed(1))
    assert len({windows[4 * g] for g in range(50)}) > 1


def test_no_size_means_full_window():
    plan = WindowPlan(size=None)
    assert plan_windows(plan, 6, 1.0, 1, 2, torch.Generator()) == [full_window(6, 1.0)] * 2
