"""The rules both rollout engines share through ``boogu_schedule.sampling``: the output size and the
SDE transition (the one negation + the sampler's step) that the training recomputation reuses."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from boogu_schedule import Sampler, sde_step, to_sde_velocity
from boogu_schedule.sampling import MAX_OUTPUT_PIXELS, output_size, sde_transition

sides = st.integers(1, 4096 // 16).map(lambda k: 16 * k)


@example(h=2048, w=2048)
@example(h=16, w=16)
@given(h=sides, w=sides)
def test_a_valid_size_is_generated_as_asked_and_an_oversized_one_is_scaled_down(h, w):
    got = output_size(h, w)
    if h * w <= MAX_OUTPUT_PIXELS:
        assert got == (h, w)
    else:
        # Upstream's T2I rule, written out in float64: area clamp, floor to multiples of 16.
        ratio = (MAX_OUTPUT_PIXELS / (h * w)) ** 0.5
        assert got == (int(h * ratio) // 16 * 16, int(w * ratio) // 16 * 16)
        assert got[0] * got[1] <= MAX_OUTPUT_PIXELS


def test_edit_rows_follow_their_shared_reference_size():
    assert output_size(1024, 1024, [(512, 768), (512, 768)]) == (512, 768)
    assert output_size(1000, 1000) == (992, 992)
    with pytest.raises(ValueError, match="share a reference size"):
        output_size(1024, 1024, [(512, 768), (768, 512)])
    with pytest.raises(ValueError, match="positive"):
        output_size(0, 1024)


@pytest.mark.parametrize("sampler", [s for s in Sampler if s is not Sampler.ODE])  # ODE has no log-prob
def test_sde_transition_negates_once_then_steps(sampler):
    gen = torch.Generator().manual_seed(0)
    x, v = torch.randn(3, 2, 4, 4, generator=gen), torch.randn(3, 2, 4, 4, generator=gen)
    sigma, sigma_next = torch.full((3,), 0.7), torch.full((3,), 0.6)
    noise = torch.randn(3, 2, 4, 4, generator=gen)
    got = sde_transition(sampler, x, v, sigma, sigma_next, 0.7, noise=noise)
    want = sde_step(sampler, x, to_sde_velocity(v), sigma, sigma_next, 0.7, noise=noise)
    assert torch.equal(got.prev_sample, want.prev_sample) and torch.equal(got.log_prob, want.log_prob)
    # Scoring the drawn sample (the training side) gives the same log-prob bitwise.
    scored = sde_transition(sampler, x, v, sigma, sigma_next, 0.7, prev_sample=got.prev_sample)
    assert torch.equal(scored.log_prob, got.log_prob)
    # A second negation (a copy of the convention coming back) walks the other way.
    flipped = sde_transition(sampler, x, to_sde_velocity(v), sigma, sigma_next, 0.0)
    assert not torch.equal(
        flipped.prev_sample, sde_transition(sampler, x, v, sigma, sigma_next, 0.0).prev_sample
    )
