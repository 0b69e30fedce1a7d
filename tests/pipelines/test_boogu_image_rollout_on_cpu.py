"""Rollout side: what the local engine hands to the transformer and the step function."""

from __future__ import annotations

import pytest
import torch

from boogu_adapters.engines import LocalRolloutEngine
from boogu_adapters.recompute import TransitionRecompute
from boogu_adapters.types import RolloutRequest
from boogu_schedule import BooguScheduleConfig, WindowPlan, boogu_sigmas
from tests.pipelines.conftest import FakeCodec, RecordingTransformer, fake_encoder, record

RELEASED = BooguScheduleConfig.released()


def _run(model, *, guidance=4.0, steps=6, window=None, cfg_mode="batched", group_size=1):
    engine = LocalRolloutEngine(
        model,
        encode_prompts=fake_encoder,
        codec=None,
        schedule_config=RELEASED,
        freqs_cis=[],
        latent_channels=4,
        cfg_mode=cfg_mode,
    )
    request = RolloutRequest(
        [record()],
        group_size=group_size,
        num_steps=steps,
        guidance_scale=guidance,
        height=16,
        width=16,
        decode=False,
        window=window or WindowPlan(kind="fixed", size=3, start=1),
    )
    return engine, engine.generate(request)


def test_a_prediction_of_three_reaches_the_step_as_minus_three(step_recorder):
    _run(RecordingTransformer(pos_value=3.0), guidance=1.0)
    for call in step_recorder.calls:
        assert torch.equal(call["velocity"], torch.full_like(call["velocity"], -3.0))
        assert call["velocity"].dtype == torch.float32 and call["sample"].dtype == torch.float32


@pytest.mark.parametrize("cfg_mode", ["batched", "sequential"])
def test_cfg_before_negation_with_two_forwards(step_recorder, cfg_mode):
    model = RecordingTransformer(pos_value=2.0, neg_value=1.0)
    _, traj = _run(model, cfg_mode=cfg_mode)
    for call in step_recorder.calls:
        assert torch.equal(call["velocity"], torch.full_like(call["velocity"], -5.0))
    forwards = sum(c["batch"] for c in model.calls)
    assert forwards == 2 * 6 == traj.nfe  # a positive and a negative forward per step for one sample
    assert len(model.calls) == (6 if cfg_mode == "batched" else 12)


def test_one_forward_per_step_when_guidance_is_one():
    model = RecordingTransformer()
    _, traj = _run(model, guidance=1.0)
    assert len(model.calls) == 6 and all(c["marker"].gt(0).all() for c in model.calls)
    assert traj.nfe == 6 and traj.conditioning.negative_hidden_states is None


def test_transformer_gets_boogu_time_while_the_step_gets_sigma(step_recorder):
    model = RecordingTransformer()
    _run(model, guidance=1.0)
    sigmas = boogu_sigmas(RELEASED, 6)
    for i, call in enumerate(model.calls):
        assert torch.equal(call["timestep"], (1.0 - sigmas[i]).expand(1))
    assert [float(c["sigma"][0]) for c in step_recorder.calls] == sigmas[:-1].tolist()


def test_float32_stepping_under_a_bf16_model(step_recorder):
    model = RecordingTransformer(dtype=torch.bfloat16)
    _, traj = _run(model)
    assert all(c["hidden_dtype"] == torch.bfloat16 for c in model.calls)
    for call in step_recorder.calls:
        assert call["sample"].dtype == call["velocity"].dtype == torch.float32
    for t in (traj.latents, traj.log_prob, traj.mean, traj.std, traj.final_latents):
        assert t.dtype == torch.float32


def test_window_one_to_four_over_six_steps_is_collected_contiguously(step_recorder):
    model = RecordingTransformer()
    _, traj = _run(model, window=WindowPlan(kind="fixed", size=3, start=1), guidance=1.0)
    assert traj.latents.shape[:2] == (1, 4) and traj.log_prob.shape == (1, 3)
    assert traj.step_index.tolist() == [[1, 2, 3]] and traj.window == ((1, 4),)
    stepped = {i: c for i, c in enumerate(step_recorder.calls)}
    # entry k is the input of window step k and entry k+1 its output
    for k, i in enumerate(range(1, 4)):
        assert torch.equal(traj.latents[0, k], stepped[i]["sample"][0])
    assert torch.equal(traj.latents[0, 3], stepped[4]["sample"][0])
    assert bool(torch.isfinite(traj.log_prob).all())


def test_noise_only_inside_the_window(step_recorder):
    _run(RecordingTransformer(), window=WindowPlan(kind="fixed", size=3, start=1), guidance=1.0)
    levels = [(c["sampler"], c["noise_level"]) for c in step_recorder.calls]
    assert levels == [
        ("ode", 0.0),
        ("flow_sde", 0.7),
        ("flow_sde", 0.7),
        ("flow_sde", 0.7),
        ("ode", 0.0),
        ("ode", 0.0),
    ]


def test_the_last_step_is_never_stochastic():
    with pytest.raises(ValueError, match="last step"):
        _run(RecordingTransformer(), window=WindowPlan(kind="fixed", size=2, start=4))


def test_degenerate_window_reports_no_trajectory():
    model = RecordingTransformer()
    _, traj = _run(model, steps=1, window=WindowPlan(size=None), guidance=1.0)
    assert traj.window_size == 0 and traj.log_prob.shape == (1, 0)
    with pytest.raises(ValueError, match="empty SDE window"):
        TransitionRecompute([]).step_stats(model, traj, 0)


def test_group_shares_one_encoding_and_one_window():
    model = RecordingTransformer()
    engine, traj = _run(model, group_size=4, window=WindowPlan(kind="random", size=2, window_range=(0, 5)))
    assert (engine.stats.prompts_encoded, engine.stats.negatives_encoded) == (1, 1)  # once for 4 samples
    assert len(set(traj.window)) == 1


def test_a_groups_samples_do_not_depend_on_the_other_groups_in_the_request():
    model = RecordingTransformer()
    engine = LocalRolloutEngine(
        model,
        encode_prompts=fake_encoder,
        codec=None,
        schedule_config=RELEASED,
        freqs_cis=[],
        latent_channels=4,
    )
    common = dict(
        group_size=3,
        num_steps=6,
        height=16,
        width=16,
        decode=False,
        seed=5,
        window=WindowPlan(kind="random", size=2, window_range=(0, 5)),
    )
    both = engine.generate(RolloutRequest([record("first"), record("second")], **common))
    alone = engine.generate(RolloutRequest([record("second")], group_offset=1, **common))
    assert torch.equal(both.latents[3:], alone.latents) and both.window[3:] == alone.window
    assert both.group_id.tolist() == [0, 0, 0, 1, 1, 1] and alone.group_id.tolist() == [1, 1, 1]


# Edit image guidance (upstream's TI2I branches): the fake transformer predicts 2 for the instruction,
# 1 for the negative, plus 0.5 with the reference. So cond 2.5, drop_text 1.5, drop_image 2, drop_all 1.
IMAGE_GUIDANCE_CASES = [
    # (text scale, image scale, velocity the step gets, forwards per sample-step)
    (4.0, 1.0, -(2.5 + 3 * 1.0), 2),  # text CFG, the negative keeps the reference
    (1.0, 3.0, -(2.5 + 2 * 0.5), 2),  # image guidance alone: the instruction without the reference
    (4.0, 3.0, -(2.5 + 3 * 1.0 + 2 * 0.5), 3),  # double guidance
]


def _edit_run(model, guidance, image_guidance, cfg_mode, ref=b"png-bytes"):
    engine = LocalRolloutEngine(
        model,
        encode_prompts=fake_encoder,
        codec=FakeCodec(),
        schedule_config=RELEASED,
        freqs_cis=[],
        latent_channels=4,
        cfg_mode=cfg_mode,
    )
    request = RolloutRequest(
        [record(ref=ref)],
        group_size=2,
        num_steps=4,
        guidance_scale=guidance,
        image_guidance_scale=image_guidance,
        height=16,
        width=16,
        decode=False,
        window=WindowPlan(kind="fixed", size=2, start=1),
    )
    return engine, engine.generate(request)


@pytest.mark.parametrize("cfg_mode", ["batched", "sequential"])
@pytest.mark.parametrize(("guidance", "image_guidance", "velocity", "branches"), IMAGE_GUIDANCE_CASES)
def test_edit_image_guidance_branches_before_negation(
    step_recorder, cfg_mode, guidance, image_guidance, velocity, branches
):
    model = RecordingTransformer(pos_value=2.0, neg_value=1.0, ref_value=0.5)
    engine, traj = _edit_run(model, guidance, image_guidance, cfg_mode)
    for call in step_recorder.calls:
        assert torch.equal(call["velocity"], torch.full_like(call["velocity"], velocity))
    assert traj.nfe == 2 * 4 * branches == engine.stats.transformer_sample_forwards
    assert (
        len(model.calls) == engine.stats.transformer_calls == (4 if cfg_mode == "batched" else 4 * branches)
    )
    assert traj.image_guidance_scale == image_guidance and traj.guidance_scale == guidance
    # Which rows took the reference: per branch, upstream's inputs (drop_image/drop_all: none).
    first = model.calls[: 1 if cfg_mode == "batched" else branches]
    rows = [(float(m), bool(r)) for c in first for m, r in zip(c["marker"], c["refs"] or [None] * c["batch"])]
    expected = {
        2: [(1.0, True), (-1.0, True)] if guidance != 1.0 else [(1.0, True), (1.0, False)],
        3: [(1.0, True), (-1.0, True), (-1.0, False)],
    }[branches]
    assert rows == [row for row in expected for _ in range(2)]  # two samples per branch, in order
    # Training recomputes the same velocity through the same branches (bitwise log-probs).
    step_recorder.calls.clear()
    stats = TransitionRecompute([]).step_stats(model, traj, 0)
    (call,) = step_recorder.calls
    assert torch.equal(call["velocity"], torch.full_like(call["velocity"], velocity))
    assert torch.equal(stats.log_prob, traj.log_prob[:, 0])


@pytest.mark.parametrize("cfg_mode", ["batched", "sequential"])
def test_image_guidance_is_ignored_without_a_reference(step_recorder, cfg_mode):
    # Upstream forces image_guidance_scale to 1 for T2I: the text CFG forwards only.
    model = RecordingTransformer(pos_value=2.0, neg_value=1.0, ref_value=0.5)
    _, traj = _edit_run(model, 4.0, 3.0, cfg_mode, ref=None)
    for call in step_recorder.calls:
        assert torch.equal(call["velocity"], torch.full_like(call["velocity"], -5.0))
    assert traj.nfe == 2 * 4 * 2 and all(c["refs"] is None for c in model.calls)


def test_image_guidance_below_one_is_refused():
    with pytest.raises(ValueError, match="image_guidance_scale must be >= 1"):
        RolloutRequest([record()], image_guidance_scale=0.5)
