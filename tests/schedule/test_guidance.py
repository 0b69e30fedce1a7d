"""Text CFG and upstream's image/double guidance."""

from __future__ import annotations

import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from boogu_schedule import DEFAULT_GUIDANCE_SCALE, double_guidance, image_guidance, text_cfg, to_sde_velocity
from tests.strategies import same_shape_tensors

scales = st.floats(0.0, 10.0, allow_nan=False)


def test_pinned_value_and_default_scale():
    out = text_cfg(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 1.0]), 4.0)
    assert out.tolist() == [5.0, 13.0]
    assert DEFAULT_GUIDANCE_SCALE == 4.0
    # CFG before the single negation: positive 2, negative 1, scale 4 -> -5.
    assert to_sde_velocity(text_cfg(torch.tensor([2.0]), torch.tensor([1.0]), 4.0)).item() == -5.0


@given(xs=same_shape_tensors(2))
def test_scale_one_returns_the_positive_and_needs_no_negative(xs):
    pos, neg = xs
    assert text_cfg(pos, neg, 1.0) is pos
    assert text_cfg(pos, None, 1.0) is pos


@given(xs=same_shape_tensors(2), g=scales)
@example(xs=(torch.ones(1, 1), torch.zeros(1, 1)), g=0.0)
def test_cfg_equals_float64_reference(xs, g):
    pos, neg = xs
    expected = neg.double() + g * (pos.double() - neg.double())  # the equivalent v_neg + g (v_pos - v_neg)
    torch.testing.assert_close(text_cfg(pos, neg, g).double(), expected, rtol=1e-5, atol=1e-4)


@given(xs=same_shape_tensors(2), a=scales, b=scales)
def test_cfg_is_affine_in_the_scale(xs, a, b):
    pos, neg = xs
    mid = (a + b) / 2
    lhs = text_cfg(pos, neg, mid).double()
    rhs = (text_cfg(pos, neg, a).double() + text_cfg(pos, neg, b).double()) / 2
    torch.testing.assert_close(lhs, rhs, rtol=1e-5, atol=1e-4)


def test_cfg_refuses_a_missing_or_misshapen_negative():
    with pytest.raises(ValueError, match="negative"):
        text_cfg(torch.ones(2), None, 4.0)
    with pytest.raises(ValueError, match="differ"):
        text_cfg(torch.ones(2), torch.ones(3), 4.0)


@given(xs=same_shape_tensors(3), tg=scales, ig=scales)
def test_double_guidance_equals_upstream_formula(xs, tg, ig):
    cond, drop_text, drop_all = xs
    c, t, a = (x.double() for x in xs)
    expected = c + (tg - 1) * (c - t) + (ig - 1) * (t - a)
    torch.testing.assert_close(
        double_guidance(cond, drop_text, drop_all, tg, ig).double(), expected, rtol=1e-5, atol=1e-3
    )
    # With image guidance 1 it is text CFG against drop_text.
    torch.testing.assert_close(
        double_guidance(cond, drop_text, drop_all, tg, 1.0), text_cfg(cond, drop_text, tg)
    )


@given(xs=same_shape_tensors(2), ig=scales)
def test_image_guidance_alone(xs, ig):
    cond, drop_image = xs
    expected = cond.double() + (ig - 1) * (cond.double() - drop_image.double())
    torch.testing.assert_close(image_guidance(cond, drop_image, ig).double(), expected, rtol=1e-5, atol=1e-4)


@example(g=1.0)
@example(g=0.0)
@given(g=scales)
def test_uses_cfg_is_the_predicate_text_cfg_applies(g):
    # One predicate for "CFG is on": exactly the scales at which text_cfg needs the negative.
    from boogu_schedule import uses_cfg

    assert uses_cfg(g) == (g != 1.0)
    pos = torch.tensor([2.0, 4.0])
    if uses_cfg(g):
        with pytest.raises(ValueError, match="needs a negative"):
            text_cfg(pos, None, g)
    else:
        assert text_cfg(pos, None, g) is pos


# Upstream's branch choice (pipeline_boogu.py's denoising loop; docs/upstream-model.md §9.7):
# TI2I tg>1 and ig>1: cond, drop_text, drop_all; TI2I ig>1 only: cond, drop_image; text CFG:
# cond, drop_text (upstream's T2I "uncond" has no references either way); image guidance needs references.
BRANCH_CASES = [
    (1.0, 1.0, False, ("cond",)),
    (4.0, 1.0, False, ("cond", "drop_text")),
    (1.0, 2.0, False, ("cond",)),
    (4.0, 2.0, False, ("cond", "drop_text")),
    (1.0, 1.0, True, ("cond",)),
    (4.0, 1.0, True, ("cond", "drop_text")),
    (1.0, 2.0, True, ("cond", "drop_image")),
    (4.0, 2.0, True, ("cond", "drop_text", "drop_all")),
]


@pytest.mark.parametrize(("tg", "ig", "edit", "branches"), BRANCH_CASES)
def test_guidance_branches_follow_upstream(tg, ig, edit, branches):
    from boogu_schedule import guidance_branches

    assert guidance_branches(tg, ig, edit=edit) == branches


@pytest.mark.parametrize(("tg", "ig", "edit", "branches"), BRANCH_CASES)
def test_combine_guidance_is_upstreams_formula_for_its_branches(tg, ig, edit, branches):
    from boogu_schedule import combine_guidance

    # Per branch a distinct constant: cond 2.5, drop_text 1.5, drop_image 2, drop_all 1.
    value = {"cond": 2.5, "drop_text": 1.5, "drop_image": 2.0, "drop_all": 1.0}
    predictions = [torch.full((2, 3), value[b]) for b in branches]
    expected = {
        ("cond",): 2.5,
        ("cond", "drop_text"): 2.5 + (tg - 1) * (2.5 - 1.5),
        ("cond", "drop_image"): 2.5 + (ig - 1) * (2.5 - 2.0),
        ("cond", "drop_text", "drop_all"): 2.5 + (tg - 1) * (2.5 - 1.5) + (ig - 1) * (1.5 - 1.0),
    }[branches]
    out = combine_guidance(predictions, tg, ig, edit=edit)
    assert torch.equal(out, torch.full((2, 3), expected))
    with pytest.raises(ValueError, match="predictions for the branches"):
        combine_guidance([*predictions, predictions[0]], tg, ig, edit=edit)
    if len(predictions) > 1:
        with pytest.raises(ValueError, match="differ"):
            combine_guidance([predictions[0], *(p[:1] for p in predictions[1:])], tg, ig, edit=edit)
