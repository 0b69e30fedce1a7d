"""Schedules, the time mapping, the velocity sign and the config round trip."""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch
from hypothesis import example, given
from hypothesis import strategies as st

from boogu_schedule import (
    BooguScheduleConfig,
    boogu_sigmas,
    boogu_time,
    boogu_timesteps,
    euler_step_boogu,
    sde_step,
    sigma_from_time,
    to_sde_velocity,
)
from tests.strategies import f32_floats, same_shape_tensors

RELEASED = BooguScheduleConfig.released()
RELEASED_N10 = [1.0, 0.966, 0.9266, 0.8805, 0.8257, 0.7595, 0.678, 0.5751, 0.4412, 0.2598, 0.0]


def upstream_timesteps(cfg: dict, n: int, num_tokens: int | None) -> np.ndarray:
    """Upstream's ``set_timesteps``, re-stated independently in numpy float32 (docs/upstream-model.md §8.2)."""
    t = np.linspace(0, 1, n + 1, dtype=np.float32)[:-1]

    def lin(x):
        m = (cfg.get("max_shift", 1.15) - cfg.get("base_shift", 0.5)) / (4096 - 256)
        return m * x + (cfg.get("base_shift", 0.5) - m * 256)

    def v1(t, mu):
        t1 = np.clip(1.0 - t, 1e-8, 1.0 - 1e-8)
        return (1.0 - math.exp(mu) / (math.exp(mu) + np.power(1.0 / t1 - 1.0, 1.0))).astype(np.float32)

    def v2(t, m):
        return (t / (m - m * t + t)).astype(np.float32)

    half = cfg.get("time_shift_v2_half_scaling_factor", 60.0)
    if cfg.get("do_shift", True):
        version = cfg.get("time_shift_version", "v2")
        if cfg.get("dynamic_time_shift", True):
            length = num_tokens
            if version == "v1":
                t = v1(t, lin(max(1, length // 4)))
            else:
                t = v2(t, float(np.sqrt(length)) / (2 * half))
        elif cfg.get("seq_len"):
            length = cfg["seq_len"]
            t = v1(t, lin(length)) if version == "v1" else v2(t, float(np.sqrt(length)) / (2 * half))
    return np.concatenate([t, np.ones(1, np.float32)])


schedule_configs = st.fixed_dictionaries(
    {
        "do_shift": st.booleans(),
        "dynamic_time_shift": st.booleans(),
        "time_shift_version": st.sampled_from(["v1", "v2"]),
        "seq_len": st.one_of(st.none(), st.integers(16, 16384)),
        "base_shift": st.floats(0.0, 1.0),
        "max_shift": st.floats(0.5, 3.0),
        "time_shift_v2_half_scaling_factor": st.floats(10.0, 200.0),
    }
)


def test_released_schedule_matches_the_published_vector():
    torch.testing.assert_close(boogu_sigmas(RELEASED, 10), torch.tensor(RELEASED_N10), atol=5e-5, rtol=0)


def test_released_times_match_upstream_test_vectors_exactly():
    assert (
        boogu_timesteps(RELEASED, 4).tolist()
        == np.array([0.0, 0.095469236, 0.24048907, 0.48715585, 1.0], np.float32).tolist()
    )
    assert (
        boogu_timesteps(RELEASED, 8).tolist()
        == np.array(
            [0.0, 0.04327631, 0.09546924, 0.15965122, 0.24048907, 0.34543324, 0.48715585, 0.68909895, 1.0],
            np.float32,
        ).tolist()
    )
    t50 = boogu_timesteps(RELEASED, 50)
    assert t50[1].item() == np.float32(0.0064204931) and t50[-2].item() == np.float32(0.93944979)


def test_class_defaults_are_dynamic_v2():
    expected = [0, 0.11811, 0.23810, 0.36, 0.48387, 0.60976, 0.73770, 0.86777, 1.0]
    torch.testing.assert_close(
        boogu_timesteps(BooguScheduleConfig(), 8, num_tokens=128 * 128),
        torch.tensor(expected),
        atol=1e-5,
        rtol=0,
    )


@given(cfg=schedule_configs, n=st.integers(1, 60), num_tokens=st.integers(1, 256 * 256))
@example(
    cfg={"do_shift": True, "dynamic_time_shift": False, "time_shift_version": "v1", "seq_len": 4096},
    n=10,
    num_tokens=64,
)
def test_sigmas_equal_upstream_float32_bit_for_bit(cfg, n, num_tokens):
    ours = boogu_timesteps(BooguScheduleConfig.from_dict(cfg), n, num_tokens)
    assert ours.dtype == torch.float32
    np.testing.assert_array_equal(ours.numpy(), upstream_timesteps(cfg, n, num_tokens))


@given(cfg=schedule_configs, n=st.integers(1, 60), num_tokens=st.integers(1, 256 * 256))
def test_sigmas_strictly_decrease_from_one_to_zero(cfg, n, num_tokens):
    sigmas = boogu_sigmas(BooguScheduleConfig.from_dict(cfg), n, num_tokens)
    assert sigmas.shape == (n + 1,) and sigmas.dtype == torch.float32
    assert sigmas[0].item() == 1.0 and sigmas[-1].item() == 0.0
    assert bool((sigmas[1:] < sigmas[:-1]).all())


@given(n=st.integers(1, 50), a=st.integers(1, 2**16), b=st.integers(1, 2**16))
def test_static_config_ignores_num_tokens(n, a, b):
    assert torch.equal(boogu_sigmas(RELEASED, n, a), boogu_sigmas(RELEASED, n, b))
    assert torch.equal(boogu_sigmas(RELEASED, n, a), boogu_sigmas(RELEASED, n))


@pytest.mark.parametrize("version", ["v1", "v2"])
def test_dynamic_config_depends_on_num_tokens_and_requires_it(version):
    cfg = BooguScheduleConfig(dynamic_time_shift=True, time_shift_version=version)
    assert not torch.equal(boogu_sigmas(cfg, 10, 32 * 32), boogu_sigmas(cfg, 10, 128 * 128))
    with pytest.raises(ValueError, match="num_tokens"):
        boogu_sigmas(cfg, 10)


@given(sigma=st.floats(0, 1, width=32))
def test_boogu_time_is_one_minus_sigma_and_inverts(sigma):
    assert boogu_time(sigma) == 1.0 - sigma
    assert sigma_from_time(boogu_time(sigma)) == pytest.approx(sigma, abs=1e-12)
    s = torch.tensor([1.0, 0.75, 0.5, 0.25, 0.0])
    assert boogu_time(s).tolist() == [0.0, 0.25, 0.5, 0.75, 1.0]


@given(xs=same_shape_tensors(1))
def test_to_sde_velocity_negates_once(xs):
    (v,) = xs
    assert torch.equal(to_sde_velocity(v), -v)
    assert torch.equal(to_sde_velocity(to_sde_velocity(v)), v)


@given(xs=same_shape_tensors(2), t=f32_floats(0, 0.999), dt=f32_floats(1e-3, 1.0))
@example(xs=(torch.ones(1, 1), torch.full((1, 1), 3.0)), t=0.0, dt=1.0)
def test_boogu_euler_equals_ode_step_with_negated_velocity(xs, t, dt):
    x, v_boogu = xs
    t_next = min(t + dt, 1.0)
    if t_next <= t:
        return
    boogu = euler_step_boogu(x, t, t_next, v_boogu)
    ode = sde_step("ode", x, to_sde_velocity(v_boogu), 1.0 - t, 1.0 - t_next, 0.0).prev_sample
    reference = x.double() + (t_next - t) * v_boogu.double()  # float64, Boogu's own direction
    # The two float32 paths round (t_next - t) and ((1 - t_next) - (1 - t)) differently: a few ulps.
    torch.testing.assert_close(boogu.double(), reference, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(ode.double(), reference, rtol=1e-5, atol=1e-5)


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(-1000, 1000) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=5), inner, max_size=3),
    max_leaves=6,
)


@given(
    cfg=schedule_configs, unknown=st.dictionaries(st.text(min_size=1, max_size=12), json_values, max_size=4)
)
@example(cfg={}, unknown={"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.33.1"})
def test_config_round_trips_every_key_known_or_unknown(cfg, unknown, tmp_path_factory):
    unknown = {k: v for k, v in unknown.items() if k not in BooguScheduleConfig.known_keys() and k != "extra"}
    mapping = {**cfg, **unknown}
    config = BooguScheduleConfig.from_dict(mapping)
    out = config.to_dict()
    for key, value in mapping.items():
        assert out[key] == value
    assert set(out) == set(BooguScheduleConfig.known_keys()) | set(unknown)
    assert BooguScheduleConfig.from_dict(out) == config
    path = tmp_path_factory.mktemp("cfg") / "scheduler_config.json"
    path.write_text(json.dumps(mapping))
    assert BooguScheduleConfig.from_json(path) == config


def test_defaults_equal_upstream_class_defaults():
    assert BooguScheduleConfig().to_dict() == {
        "num_train_timesteps": 1000,
        "do_shift": True,
        "dynamic_time_shift": True,
        "time_shift_version": "v2",
        "seq_len": None,
        "base_shift": 0.5,
        "max_shift": 1.15,
        "time_shift_v2_half_scaling_factor": 60.0,
    }


@pytest.mark.parametrize(
    ("mapping", "key"),
    [
        ({"time_shift_version": "v3"}, "time_shift_version"),
        ({"do_shift": "yes"}, "do_shift"),
        ({"seq_len": 4096.5}, "seq_len"),
        ({"num_train_timesteps": 0}, "num_train_timesteps"),
        ({"max_shift": float("nan")}, "max_shift"),
    ],
)
def test_bad_config_values_name_the_key(mapping, key, tmp_path):
    with pytest.raises(ValueError, match=key):
        BooguScheduleConfig.from_dict(mapping)
    path = tmp_path / "scheduler_config.json"
    path.write_text(json.dumps(mapping))
    with pytest.raises(ValueError, match=str(path)):
        BooguScheduleConfig.from_json(path)
