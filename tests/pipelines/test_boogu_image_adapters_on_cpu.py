"""Training side: what the training adapter hands to the step function and the transformer."""

from __future__ import annotations

import pytest
import torch

from boogu_adapters.engines import LocalRolloutEngine
from boogu_adapters.recompute import TransitionRecompute
from boogu_adapters.types import Conditioning, RolloutRequest
from boogu_schedule import BooguScheduleConfig, WindowPlan
from tests.pipelines.conftest import FakeCodec, RecordingTransformer, fake_encoder, record


def _trajectory(model, records, guidance=4.0, cfg_mode="batched", codec=None):
    engine = LocalRolloutEngine(
        model,
        encode_prompts=fake_encoder,
        codec=codec,
        schedule_config=BooguScheduleConfig.released(),
        freqs_cis=[],
        latent_channels=4,
        cfg_mode=cfg_mode,
    )
    request = RolloutRequest(
        records,
        group_size=2,
        num_steps=4,
        guidance_scale=guidance,
        height=16,
        width=16,
        decode=False,
        window=WindowPlan(kind="fixed", size=2, start=1),
    )
    return engine.generate(request)


def test_negation_and_cfg_reach_the_step(step_recorder):
    model = RecordingTransformer(pos_value=2.0, neg_value=1.0)
    traj = _trajectory(model, [record()])
    step_recorder.calls.clear()
    TransitionRecompute([]).step_stats(model, traj, 0)
    (call,) = step_recorder.calls
    assert torch.equal(call["velocity"], torch.full_like(call["velocity"], -5.0))  # -(2 + 3 (2 - 1))
    assert torch.equal(call["prev_sample"], traj.latents[:, 1])


def test_step_inputs_are_float32_under_a_bf16_model(step_recorder):
    model = RecordingTransformer(dtype=torch.bfloat16)
    traj = _trajectory(model, [record()])
    step_recorder.calls.clear()
    model.calls.clear()
    TransitionRecompute([]).step_stats(model, traj, 1)
    (call,) = step_recorder.calls
    for key in ("sample", "velocity", "sigma", "sigma_next", "prev_sample"):
        assert call[key].dtype == torch.float32, key
    assert all(c["hidden_dtype"] == torch.bfloat16 for c in model.calls)


def test_t2i_passes_no_reference_latents():
    model = RecordingTransformer()
    traj = _trajectory(model, [record()])
    model.calls.clear()
    TransitionRecompute([]).step_stats(model, traj, 0)
    assert all(c["refs"] is None for c in model.calls)


def test_edit_wraps_reference_latents_and_shares_them_with_the_negative_branch():
    model = RecordingTransformer()
    traj = _trajectory(model, [record(ref=b"png-bytes")], cfg_mode="sequential", codec=FakeCodec())
    model.calls.clear()
    TransitionRecompute([]).step_stats(model, traj, 0)
    pos, neg = model.calls
    assert pos["marker"].gt(0).all() and neg["marker"].lt(0).all()
    assert pos["refs"] is neg["refs"]  # the very same list object for both branches
    assert len(pos["refs"]) == 2 and all(
        isinstance(r, list) and len(r) == 1 and r[0].shape == (4, 2, 2) for r in pos["refs"]
    )
    assert torch.equal(pos["refs"][0][0], traj.conditioning.ref_latents[0])


def test_bad_condition_latents_raise():
    hidden, mask = torch.zeros(2, 3, 8), torch.ones(2, 3)
    with pytest.raises(ValueError, match="must be \\(C, h, w\\)"):
        Conditioning(hidden, mask, ref_latents=(torch.zeros(1, 4, 2, 2), torch.zeros(1, 4, 2, 2)))
    with pytest.raises(ValueError, match="reference entries for batch 2"):
        Conditioning(hidden, mask, ref_latents=(torch.zeros(4, 2, 2),))


def test_guidance_without_negative_features_is_refused():
    model = RecordingTransformer()
    traj = _trajectory(model, [record()], guidance=1.0)
    forged = traj.__class__(**{**traj.__dict__, "guidance_scale": 4.0})
    with pytest.raises(ValueError, match="negative prompt features"):
        TransitionRecompute([]).step_stats(model, forged, 0)
