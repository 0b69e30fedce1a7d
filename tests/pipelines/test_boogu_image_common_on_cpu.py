"""Conventions shared by rollout and training: time mapping, schedule, CFG formula and default."""

from __future__ import annotations

import torch

from boogu_adapters.engines import LocalRolloutEngine
from boogu_adapters.types import RolloutRequest
from boogu_schedule import (
    DEFAULT_GUIDANCE_SCALE,
    BooguScheduleConfig,
    WindowPlan,
    boogu_sigmas,
    boogu_time,
    text_cfg,
)
from tests.pipelines.conftest import RecordingTransformer, fake_encoder, record

UNSHIFTED = BooguScheduleConfig(do_shift=False)  # sigmas 1, .75, .5, .25, 0 for N = 4


def _engine(model, schedule=UNSHIFTED):
    return LocalRolloutEngine(
        model,
        encode_prompts=fake_encoder,
        codec=None,
        schedule_config=schedule,
        freqs_cis=[],
        latent_channels=4,
    )


def test_transformer_time_is_one_minus_sigma():
    sigmas = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert boogu_time(sigmas).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]
    assert boogu_sigmas(UNSHIFTED, 4).tolist() == sigmas.tolist()
    model = RecordingTransformer()
    _engine(model).generate(
        RolloutRequest(
            [record()], group_size=2, num_steps=4, guidance_scale=1.0, height=32, width=32, decode=False
        )
    )
    assert [c["timestep"].tolist() for c in model.calls] == [[t, t] for t in (0.0, 0.25, 0.5, 0.75)]


def test_native_schedule_reaches_the_step_without_a_second_shift(step_recorder):
    released = BooguScheduleConfig.released()
    expected = boogu_sigmas(released, 10)
    request = RolloutRequest(
        [record()],
        group_size=1,
        num_steps=10,
        guidance_scale=1.0,
        height=32,
        width=32,
        decode=False,
        window=WindowPlan(size=None),
    )
    _engine(RecordingTransformer(), released).generate(request)
    seen = [float(c["sigma"][0]) for c in step_recorder.calls]
    seen_next = [float(c["sigma_next"][0]) for c in step_recorder.calls]
    assert seen == expected[:-1].tolist() and seen_next == expected[1:].tolist()
    assert abs(seen[1] - 0.966) < 1e-4  # the released static-v1 shift, applied once


def test_cfg_formula_and_default_scale():
    assert text_cfg(torch.tensor([2.0, 4.0]), torch.tensor([1.0, 1.0]), 4.0).tolist() == [5.0, 13.0]
    assert DEFAULT_GUIDANCE_SCALE == 4.0
    assert RolloutRequest([record()]).guidance_scale == 4.0
