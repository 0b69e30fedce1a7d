"""The flow-matching math Boogu-Image needs, as pure functions over tensors.

Conventions (the contract of this package; every one has a test that fails if it breaks):

* **Time.** Boogu runs ``t`` from 0 (pure noise) to 1 (data): ``x_t = t * x0 + (1 - t) * eps``.
  Schedules and the SDE math use the noise level ``sigma = 1 - t`` (``sigma = 1`` is noise, ``0`` is
  data), like diffusers' flow-matching schedulers. The transformer receives ``t = boogu_time(sigma)``.
* **Velocity.** Boogu predicts ``v_boogu = x0 - eps``. The SDE math uses ``v = eps - x0``:
  ``to_sde_velocity`` negates exactly once, after CFG and before the step.
* **Guidance.** Text CFG is ``v_pos + (g - 1) * (v_pos - v_neg)`` on Boogu velocities, no renormalisation;
  Edit's image guidance adds upstream's reference-free branches (``guidance_branches``, ``combine_guidance``).
* **Forward process.** Re-noising a clean sample is ``x_t = t * x0 + (1 - t) * eps`` and its
  target is the raw ``x0 - eps`` (``forward_noise``, ``flow_target``; no negation there).
* **Float32.** Everything that feeds a log-probability is float32; the step functions refuse other dtypes.
* **Randomness** only through an explicit ``torch.Generator``; results are small frozen dataclasses.
"""

from boogu_schedule.forward import flow_target, forward_noise, predict_x0, sample_sigmas
from boogu_schedule.guidance import (
    DEFAULT_GUIDANCE_SCALE,
    GuidanceBranch,
    combine_guidance,
    double_guidance,
    guidance_branches,
    image_guidance,
    text_cfg,
    uses_cfg,
)
from boogu_schedule.schedule import (
    BooguScheduleConfig,
    boogu_sigmas,
    boogu_time,
    boogu_timesteps,
    sigma_from_time,
    to_sde_velocity,
)
from boogu_schedule.sde import (
    Sampler,
    SdeStep,
    euler_step_boogu,
    gaussian_kl,
    sde_step,
)
from boogu_schedule.seeding import derive_seed, generator_factory, make_generator
from boogu_schedule.window import (
    SdeWindow,
    WindowKind,
    WindowPlan,
    WindowScope,
    fixed_window,
    full_window,
    plan_windows,
    progressive_window,
    random_window,
)

__version__ = "0.1.0"

__all__ = [
    "DEFAULT_GUIDANCE_SCALE",
    "BooguScheduleConfig",
    "GuidanceBranch",
    "Sampler",
    "SdeStep",
    "SdeWindow",
    "WindowKind",
    "WindowPlan",
    "WindowScope",
    "boogu_sigmas",
    "boogu_time",
    "boogu_timesteps",
    "combine_guidance",
    "derive_seed",
    "double_guidance",
    "euler_step_boogu",
    "fixed_window",
    "flow_target",
    "forward_noise",
    "full_window",
    "gaussian_kl",
    "generator_factory",
    "guidance_branches",
    "image_guidance",
    "make_generator",
    "plan_windows",
    "predict_x0",
    "progressive_window",
    "random_window",
    "sample_sigmas",
    "sde_step",
    "sigma_from_time",
    "text_cfg",
    "to_sde_velocity",
    "uses_cfg",
]
