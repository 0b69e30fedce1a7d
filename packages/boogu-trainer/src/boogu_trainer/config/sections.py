"""The trainer's config sections: one typed, validated dataclass per component, nested in `TrainerConfig`.

Each section checks its own values in ``__post_init__``; `TrainerConfig` also checks how its
sections fit together (a setting that another setting makes meaningless is refused), so a config
object that exists has passed every check that needs nothing but the config. The rules that need
more (the world size, which keys the user gave) are in :mod:`boogu_trainer.config.checks`.

Every field carries a one-line docstring (shown by ``trainer --help`` and in the README, see
:mod:`boogu_trainer.config.reference`). The defaults are the reference recipe's values for the real
model (docs/reference-integration.md §6); the built-in recipes that pick other values (the demo,
the tests' fast runs) are in :mod:`boogu_trainer.config.recipes`.
"""

from __future__ import annotations

import contextvars
import dataclasses
import difflib
import functools
import math
import re
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from boogu_adapters.model import LORA_TARGET_MODULES
from boogu_adapters.types import OutputSizeError, check_output_size
from boogu_protocol import MAX_SEQUENCE_LENGTH, resolve_dtype_name
from boogu_schedule import WindowPlan, uses_cfg
from boogu_schedule.window import WindowPlanError
from boogu_trainer.config.algorithms import (
    FORWARD_OPTIONS_KEYS,
    LearnerChoice,
    is_user_learner,
    learner_spec,
    user_options,
)
from boogu_trainer.config.fields import ConfigError, check, check_finite, field_hints
from boogu_trainer.data import MAX_DEMO_PROMPTS, OCR_DEMO_PROMPTS

CHECK_REWARD_SPECS: contextvars.ContextVar[bool] = contextvars.ContextVar("check_reward_specs", default=True)
"""False while ``load_config(..., check_rewards=False)`` builds a config (``boogu-sample``, which
scores nothing): reward names and options are not resolved, so a ``module:attribute`` reward is not
imported. Their shape (names, labels, weights) is still checked."""


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    """Parquet files or folders written by boogu-data; empty means the built-in demo prompts."""
    val_files: tuple[str, ...] = ()
    """Parquet files or folders for evaluation (empty: no evaluation set, or with demo_set=scenes or scene_edits the built-in held-out prompts, data.demo_eval_split)."""
    prompts_per_step: int = 32
    """B: prompts per training step (each rolled out group_size times)."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded, resumable)."""
    demo_prompts: int = 32
    """How many built-in prompts the demo uses when train_files is empty (ocr: at most 64; scenes, scene_edits: at most 100000)."""
    demo_set: Literal["ocr", "scenes", "scene_edits"] = "ocr"
    """The built-in prompts: OCR prompts (demo_prompts of the Flow-GRPO test split), procedural-scene captions (boogu-data scenes --layout grid, as the tiny model was pretrained: train-split captions for training; data.demo_eval_split for evaluation when val_files is empty), or the scene edit pairs (boogu-data scenes --edits: an instruction and the rendered source scene as the reference; split as the captions)."""
    demo_eval_split: Literal["heldout", "val", "test"] = "heldout"
    """demo_set=scenes or scene_edits: the evaluation prompts when val_files is empty: heldout (train-split captions or edit instructions never used for training, a quarter of them), or the scene set's val or test split (colour-shape pairs the pretraining never saw)."""
    prompt_stats: str = ""
    """A prompt statistics file (`trainer RECIPE --prompt-stats PATH`: each training prompt's reward spread over a few samples of the starting model): train only on the prompts whose spread there is above prompt_stats_min_std; empty: every prompt."""
    prompt_stats_min_std: float = 0.0
    """With prompt_stats: the reward standard deviation a prompt's samples must exceed to be trained on (0: any spread)."""

    def __post_init__(self) -> None:
        check(self.prompts_per_step >= 1, "data.prompts_per_step", self.prompts_per_step, ">= 1")
        check(
            math.isfinite(self.prompt_stats_min_std) and self.prompt_stats_min_std >= 0,
            "data.prompt_stats_min_std",
            self.prompt_stats_min_std,
            "a finite number >= 0",
        )
        check(self.demo_prompts >= 1, "data.demo_prompts", self.demo_prompts, ">= 1")
        if self.demo_set == "ocr":
            check(
                self.demo_prompts <= OCR_DEMO_PROMPTS,
                "data.demo_prompts",
                self.demo_prompts,
                f"<= {OCR_DEMO_PROMPTS} (the built-in OCR prompts; data.demo_set=scenes has up to {MAX_DEMO_PROMPTS})",
            )
        check(
            self.demo_prompts <= MAX_DEMO_PROMPTS,
            "data.demo_prompts",
            self.demo_prompts,
            f"<= {MAX_DEMO_PROMPTS} (the most built-in scene prompts, drawn up front)",
        )


_DEVICE = re.compile(r"auto|cpu|cuda(:\d+)?")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    """Boogu checkpoint folder; empty builds and uses the tiny random checkpoint (tiny_path)."""
    tiny_path: str = "~/models/tiny-random/Boogu-Image"
    """Where the tiny random checkpoint is built when path is empty."""
    tiny: Literal["random", "scenes", "scenes_edit"] = "random"
    """Which tiny checkpoint an empty path means: random weights (tiny_path), the one pretrained on the procedural scenes (boogu-tiny --trained, installed at tiny_scenes_path), or its Edit fine-tune on the scene edit pairs (boogu-tiny --trained --edit, at tiny_scenes_edit_path)."""
    tiny_scenes_path: str = "~/models/tiny-scenes/Boogu-Image"
    """Where the pretrained tiny checkpoint is installed when path is empty and tiny is 'scenes'."""
    tiny_scenes_edit_path: str = "~/models/tiny-scenes-edit/Boogu-Image"
    """Where the tiny Edit checkpoint is installed when path is empty and tiny is 'scenes_edit'."""
    transformer: Literal["auto", "native", "canonical"] = "native"
    """Our port (native), the checkpoint's own class (canonical, needs trust_remote_code), or auto."""
    trust_remote_code: bool = False
    """Allow executing code shipped in the checkpoint folder (canonical transformer only)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """Compute dtype of the frozen base model and the LoRA forwards; 'auto' is bfloat16 on CUDA and float32 on CPU (LoRA master weights, optimizer state, latents, CFG and log-probs stay float32)."""
    tf32: bool = True
    """On CUDA, let float32 matmuls and convolutions use TF32 tensor cores (the work left in float32 after model.dtype)."""
    compile: bool = False
    """Regional torch.compile of the repeated transformer blocks (each block class compiles once)."""
    compile_bucket: int = 64
    """With compile: pad instruction and joint sequences to multiples of this many tokens, so new prompt lengths reuse compiled graphs."""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda[:i]'."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in backward; null turns it on for models with hidden size >= 1024."""
    max_sequence_length: int = MAX_SEQUENCE_LENGTH
    """Prompt token cap (upstream's default); longer prompts are an error, never silently cut."""
    edit_vlm_view: Literal["upstream", "processor"] = "upstream"
    """An edit reference's VLM copy: resized to 384² first as upstream does, or as is (the reference's)."""
    text_encoder_offload: Literal["auto", "always", "never"] = "auto"
    """The Qwen3-VL text encoder with rollout.engine=local: 'always' keeps it in host memory and moves it to the GPU for each encode only; 'never' keeps it on the GPU; 'auto' offloads on CUDA when the memory plan says the run does not fit the GPU with it resident. With rollout.engine=vllm_omni the worker encodes and the trainer loads no text encoder weights."""

    def __post_init__(self) -> None:
        check(self.max_sequence_length >= 16, "model.max_sequence_length", self.max_sequence_length, ">= 16")
        check(
            _DEVICE.fullmatch(self.device) is not None,
            "model.device",
            self.device,
            "'auto', 'cpu', 'cuda' or 'cuda:N'",
        )
        check(self.compile_bucket >= 1, "model.compile_bucket", self.compile_bucket, ">= 1")


def resolved_model_dtype(spec: str, device_type: str) -> str:
    """``model.dtype`` as run on a device of this type: 'auto' is bfloat16 on CUDA, float32 elsewhere."""
    return resolve_dtype_name(spec, device_type)


@dataclass(frozen=True)
class LoraConfig:
    rank: int = 64
    """LoRA rank r."""
    alpha: float = 128.0
    """LoRA alpha (scale alpha / r)."""
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES
    """Module-name suffixes to adapt (peft matching: 'to_q' does not match 'img_to_q')."""
    init: Literal["gaussian", "default"] = "gaussian"
    """lora_A init ('gaussian' as the reference; lora_B is zero, so training starts at the base model)."""

    def __post_init__(self) -> None:
        check_finite(self, "lora.")
        check(self.rank >= 1, "lora.rank", self.rank, ">= 1")
        check(self.alpha > 0, "lora.alpha", self.alpha, "> 0")
        check(len(self.target_modules) > 0, "lora.target_modules", self.target_modules, "a non-empty list")
        check(
            all(m.strip() for m in self.target_modules),
            "lora.target_modules",
            self.target_modules,
            "non-empty module-name suffixes",
        )


# WindowPlan field -> the sampler key that sets it (for errors from WindowPlan.validate).
_WINDOW_KEYS = {
    "num_steps": "num_steps",
    "size": "window_size",
    "window_range": "window_range",
    "start": "window_start",
    "stride": "window_stride",
    "every": "window_every",
}


@dataclass(frozen=True)
class SamplerConfig:
    num_steps: int = 10
    """N: denoising steps per rollout."""
    guidance_scale: float = 4.0
    """Text CFG scale; 1.0 skips the negative forward and halves rollout cost."""
    image_guidance_scale: float = 1.0
    """Edit rows only: upstream's image guidance (a forward without the reference; with text CFG, its double guidance, three forwards); 1.0 is off."""
    height: int = 1024
    """Output height (multiple of 16, area at most 2048^2); edit rows follow their reference."""
    width: int = 1024
    """Output width (multiple of 16)."""
    sampler: Literal["flow_sde", "cps", "dance_sde"] = "flow_sde"
    """Transition kernel inside the SDE window."""
    noise_level: float = 1.2
    """eta inside the window (the recipe's 1.2; 0.7 is gentler)."""
    window_size: int | None = 2
    """Stochastic (trained) steps per rollout; null means every step but the last; 0: ODE rollouts (diffusion_nft and awm only)."""
    window_range: tuple[int, int] = (0, 5)
    """The window lies inside [lo, hi) (the last step is always excluded)."""
    window_kind: Literal["random", "fixed", "progressive"] = "random"
    """How the window start is chosen: drawn, fixed at window_start, or sliding (MixGRPO)."""
    window_scope: Literal["group", "batch", "sample"] = "group"
    """Who shares a window: each prompt group (default), the whole batch, or each sample (reference)."""
    window_start: int = 0
    """fixed windows: the first stochastic step."""
    window_stride: int = 1
    """progressive windows: steps moved per advance."""
    window_every: int = 1
    """progressive windows: training steps between advances."""

    def __post_init__(self) -> None:
        check_finite(self, "sampler.")
        check(self.num_steps >= 2, "sampler.num_steps", self.num_steps, ">= 2")
        check(self.guidance_scale >= 1.0, "sampler.guidance_scale", self.guidance_scale, ">= 1.0")
        check(
            self.image_guidance_scale >= 1.0,
            "sampler.image_guidance_scale",
            self.image_guidance_scale,
            ">= 1.0 (1 = off)",
        )
        try:
            check_output_size(self.height, self.width)  # the rule the rollout request applies too
        except OutputSizeError as e:
            value = self.height * self.width if e.field == "height*width" else getattr(self, e.field)
            raise ConfigError(f"sampler.{e.field}={value!r}: {e}") from None
        check(self.noise_level > 0, "sampler.noise_level", self.noise_level, "> 0")
        if self.window_size is not None:
            check(self.window_size >= 0, "sampler.window_size", self.window_size, ">= 0 or null")
        try:
            # The window rule lives in boogu_schedule (the rollouts apply the same checks).
            self.window_plan.validate(self.num_steps)
        except WindowPlanError as e:
            key = _WINDOW_KEYS.get(e.field, e.field)
            raise ConfigError(f"sampler.{key}={getattr(self, key, None)!r}: {e}") from None

    @property
    def window_plan(self) -> WindowPlan:
        """The `boogu_schedule.WindowPlan` that the window_* fields describe."""
        return WindowPlan(
            kind=self.window_kind,
            size=self.window_size,
            window_range=self.window_range,
            start=self.window_start,
            scope=self.window_scope,
            stride=self.window_stride,
            every=self.window_every,
        )


@dataclass(frozen=True)
class VllmConfig:
    url: str | None = None
    """A running rollout worker (http://host:port; a comma-separated list gives rank r the r-th); null: each rank launches one from the rollout environment."""
    project: str | None = None
    """The rollout environment's project folder (null: packages/boogu-vllm of this checkout); its .venv comes from `uv sync --locked --project packages/boogu-vllm`."""
    python: str | None = None
    """The rollout environment's Python (null: <project>/.venv/bin/python)."""
    backend: Literal["auto", "omni", "direct"] = "auto"
    """A launched worker's backend: omni (vllm-omni's engine, GPU), direct (the same pipeline in-process, CPU), auto (omni when CUDA is there)."""
    dtype: Literal["auto", "float32", "bfloat16", "float16"] = "auto"
    """A launched worker's model dtype (auto: bfloat16 on GPU, float32 on CPU)."""
    devices: str | None = None
    """CUDA_VISIBLE_DEVICES for a launched worker (e.g. '4,5'; per rank separated by ';': '4,5;6,7' gives rank r the r-th); null: inherited."""
    engine_args: dict[str, Any] = field(default_factory=dict)
    """Extra vllm-omni engine arguments for a launched omni worker (e.g. {cfg_parallel_size: 2})."""
    startup_timeout_s: float = 900.0
    """How long a launched worker may take to load the model."""
    request_timeout_s: float = 1800.0
    """How long one rollout or LoRA sync may take before the run stops."""

    def __post_init__(self) -> None:
        check(self.startup_timeout_s > 0, "rollout.vllm.startup_timeout_s", self.startup_timeout_s, "> 0")
        check(
            0 < self.request_timeout_s < math.inf,
            "rollout.vllm.request_timeout_s",
            self.request_timeout_s,
            "a finite number > 0 (seconds)",
        )
        if self.url is not None:
            for url in self.url.split(","):
                check(
                    url.strip().startswith("http://"),
                    "rollout.vllm.url",
                    self.url,
                    "http://host:port[,http://...]",
                )

    def devices_for_rank(self, rank: int, world_size: int = 1) -> str | None:
        """This rank's worker's CUDA_VISIBLE_DEVICES: one ';'-separated group per rank."""
        if self.devices is None:
            return None
        groups = [d.strip() for d in self.devices.split(";")]
        if len(groups) != world_size:
            raise ConfigError(
                f"rollout.vllm.devices={self.devices!r} gives {len(groups)} device group(s) for {world_size} "
                "rank(s): give one per rank, separated by ';' (each rank launches its own worker)"
            )
        return groups[rank]

    def url_for_rank(self, rank: int, world_size: int = 1) -> str | None:
        """This rank's worker: one URL per rank (a worker serves one trainer rank)."""
        if self.url is None:
            return None
        urls = [u.strip() for u in self.url.split(",")]
        if len(urls) != world_size:
            raise ConfigError(
                f"rollout.vllm.url lists {len(urls)} worker(s) for {world_size} rank(s): give one per rank "
                "(a worker serves one trainer rank; two ranks sharing one would reset each other's weights)"
            )
        return urls[rank]


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["local", "vllm_omni"] = "local"
    """'local': in-process with the trained module; 'vllm_omni': vllm-omni in its own environment (rollout.vllm.*), on other GPUs, processes or nodes."""
    cfg_mode: Literal["batched", "sequential"] = "batched"
    """Run positive and negative prompts in one forward (batched) or two."""
    micro_batch_size: int = 0
    """Latents per transformer call, VAE decode and reward call (0: the whole batch); with batched CFG a call runs twice as many sample-forwards."""
    logprob_diff_warn: float | None = None
    """Warn (and the preflight fails) when the first update's recomputed log-prob differs from the engine's by more than this (max over the window and the ranks); null: algorithm.clip_range / 10 with flow_grpo (a larger difference is clipped as if it were a policy change; boogu_trainer.onpolicy), no limit for diffusion_nft and awm (their loss never reads the rollout's log-probs)."""
    pipeline: Literal["off", "one_step"] = "off"
    """'one_step': step k+1's rollout (and its rewards) runs in the worker while step k's update runs, with the weights the worker holds (one step stale); needs an engine with its own copy of the weights (engine=vllm_omni). 'off': rollout, update, sync in turn."""
    vllm: VllmConfig = field(default_factory=VllmConfig)
    """The vllm-omni engine's worker."""

    def __post_init__(self) -> None:
        check(
            self.micro_batch_size >= 0,
            "rollout.micro_batch_size",
            self.micro_batch_size,
            ">= 0 (0 = no split)",
        )
        if self.logprob_diff_warn is not None:
            check(
                self.logprob_diff_warn > 0, "rollout.logprob_diff_warn", self.logprob_diff_warn, "> 0 or null"
            )
        check(
            self.pipeline == "off" or self.engine != "local",
            "rollout.pipeline",
            self.pipeline,
            "'off' with rollout.engine=local (the local engine samples with the very module the update "
            "changes; pipelining needs rollouts on their own copy of the weights: rollout.engine=vllm_omni)",
        )


@dataclass(frozen=True)
class AlgorithmConfig(LearnerChoice):
    """``algorithm.*``: the learner and its options (`LearnerChoice`: ``name``, ``loss``, ``nft``,
    ``awm``, ``options``, first), then what every learner shares: groups, advantages, clip, KL,
    epochs and mini-batches."""

    group_size: int = 16
    """n: samples per prompt; advantages are normalised within each group."""
    std_scope: Literal["group", "batch"] = "batch"
    """Divide by the std of the group or of the whole batch (the reference's global_std=True)."""
    normalize_std: bool = True
    """Divide advantages by the std at all (false: Dr.GRPO, mean-centred only)."""
    adv_eps: float = 1e-4
    """Added to the std before dividing."""
    adv_clip: float = 5.0
    """Advantages are clamped to [-adv_clip, adv_clip]."""
    per_reward_normalization: bool = False
    """With several rewards: normalise each within its group before the weighted sum."""
    clip_range: float = 1e-4
    """PPO ratio clip epsilon (log-probs are per-element means, so it is tiny)."""
    kl_coef: float = 0.0
    """Weight of the KL penalty to the reference (base) model; 0 skips the reference pass. diffusion_nft and awm: the velocity MSE mean((v - v_ref)^2) (the references' 1e-4)."""
    kl_kind: Literal["mean", "transition", "velocity"] = "mean"
    """'mean': flow_grpo's and verl-omni's KL on the transition means, mean((mu - mu_ref)^2) /
    (2 std_dev_t^2), 1/|dt| times smaller than the exact transition KL for flow_sde; 'transition':
    the exact Gaussian KL of the two transitions; 'velocity': the squared velocity difference."""
    inner_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the batch is split by groups)."""
    train_micro_batch_size: int = 0
    """Samples per forward/backward in the update (0: the whole mini-batch); gradients accumulate over the micro-batches of a mini-batch."""
    advantage_sign: float = 1.0
    """+1 for training; -1 flips the objective (a diagnostic: the reward must then go down)."""

    def __post_init__(self) -> None:
        check_finite(self, "algorithm.")
        try:
            spec = learner_spec(self.name)
        except ValueError as error:
            raise ConfigError(f"algorithm.name={self.name!r}: {error}") from None
        if is_user_learner(self.name):
            try:  # its options_class checks the values; the messages name algorithm.options.<key>
                user_options(self.name, self.options, "algorithm.options")
            except ConfigError:
                raise
            except (ValueError, TypeError) as error:
                raise ConfigError(str(error)) from None
        if self.options and not is_user_learner(self.name):
            own = f"; {self.name}'s options are algorithm.{spec.options_key}.*" if spec.options_key else ""
            raise ConfigError(
                f"algorithm.options={dict(self.options)!r}: only a learner of your own "
                f"(algorithm.name='package.module:Class') reads it{own}"
            )
        check(
            self.group_size >= 2,
            "algorithm.group_size",
            self.group_size,
            ">= 2 (advantages are relative to the group)",
        )
        check(self.clip_range > 0, "algorithm.clip_range", self.clip_range, "> 0")
        check(self.adv_clip > 0, "algorithm.adv_clip", self.adv_clip, "> 0")
        check(self.adv_eps >= 0, "algorithm.adv_eps", self.adv_eps, ">= 0")
        check(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, ">= 0")
        check(self.inner_epochs >= 1, "algorithm.inner_epochs", self.inner_epochs, ">= 1")
        check(
            self.train_micro_batch_size >= 0,
            "algorithm.train_micro_batch_size",
            self.train_micro_batch_size,
            ">= 0 (0 = no split)",
        )
        check(self.mini_batches >= 1, "algorithm.mini_batches", self.mini_batches, ">= 1")
        check(self.advantage_sign in (1.0, -1.0), "algorithm.advantage_sign", self.advantage_sign, "1 or -1")


@dataclass(frozen=True)
class RewardSpec:
    # No __post_init__: RewardConfig checks each entry, so that errors name its index.
    name: str = "ocr"
    """A registered reward ('ocr', 'vlm_ocr', 'jpeg_compressibility', ...) or 'module:function'."""
    weight: float = 1.0
    """Weight in the sum of rewards."""
    label: str = ""
    """Name of this reward in logs and metrics (empty: the reward's name); labels must differ."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the reward's constructor."""


@dataclass(frozen=True)
class RewardConfig:
    rewards: tuple[RewardSpec, ...] = (RewardSpec(),)
    """The rewards, each {name, weight, label, kwargs}: a registered reward or 'module:function', its weight in the sum, its name in logs (empty: the name) and its constructor's keyword arguments."""
    max_nonfinite_steps: int = 3
    """Stop the run after this many consecutive steps with non-finite rewards or losses."""

    def __post_init__(self) -> None:
        check(len(self.rewards) >= 1, "reward.rewards", self.rewards, "at least one reward")
        check(self.max_nonfinite_steps >= 1, "reward.max_nonfinite_steps", self.max_nonfinite_steps, ">= 1")
        _check_reward_specs(self.rewards, "reward.rewards")
        # Weight-0 rewards are logged metrics only and never enter the advantage: with every
        # weight 0 there is nothing to train on, and every advantage would be 0.
        if all(spec.weight == 0 for spec in self.rewards):
            raise ConfigError(
                f"reward.rewards[*].weight={tuple(spec.weight for spec in self.rewards)!r}: expected at least "
                "one reward with a nonzero weight (a weight-0 reward is a logged metric only)"
            )


def _check_reward_specs(specs: tuple[RewardSpec, ...], key: str) -> None:
    """Each spec names a known reward with known options (unless `CHECK_REWARD_SPECS` is off);
    labels are unique."""
    labels: dict[str, int] = {}
    for i, spec in enumerate(specs):
        item = f"{key}[{i}]"
        check(isinstance(spec, RewardSpec), item, spec, "a mapping of name, weight, label, kwargs")
        check_finite(spec, f"{item}.")
        check(bool(spec.name), f"{item}.name", spec.name, "a reward name")
        if CHECK_REWARD_SPECS.get():
            from boogu_trainer.rewards import validate_reward_spec  # the registry loads the built-ins

            try:
                validate_reward_spec(spec.name, spec.kwargs)
            except ValueError as e:
                raise ConfigError(f"{item}: {e}") from None
        label = spec.label or spec.name
        if label in labels:
            raise ConfigError(
                f"{key}: entries {labels[label]} and {i} share the label {label!r}; give one of them a distinct label"
            )
        labels[label] = i


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate (constant)."""
    weight_decay: float = 1e-4
    """AdamW weight decay."""
    betas: tuple[float, float] = (0.9, 0.999)
    """AdamW betas."""
    eps: float = 1e-8
    """AdamW epsilon."""
    grad_clip: float = 1.0
    """Clip the LoRA gradient norm; a non-finite norm skips the step."""

    def __post_init__(self) -> None:
        check_finite(self, "optim.")
        # Above 1 AdamW's step overflows (1e39 is inf in float32) or wrecks the LoRA in one step.
        check(0 < self.lr <= 1, "optim.lr", self.lr, "in (0, 1] (LoRA learning rates are ~1e-5 to 1e-3)")
        check(self.weight_decay >= 0, "optim.weight_decay", self.weight_decay, ">= 0")
        check(all(0 <= b < 1 for b in self.betas), "optim.betas", self.betas, "each in [0, 1)")
        check(self.eps > 0, "optim.eps", self.eps, "> 0")
        check(self.grad_clip > 0, "optim.grad_clip", self.grad_clip, "> 0")


@dataclass(frozen=True)
class EmaConfig:
    enabled: bool = False
    """Keep an exponential moving average of the LoRA weights (saved with checkpoints)."""
    decay: float = 0.9
    """EMA decay per training step."""
    evaluate: bool = True
    """With ``enabled``: evaluations (``eval.every``, ``keep_best``, the demo's held-out comparison) judge
    the EMA weights, as flow_grpo and DiffusionNFT do; rollouts always use the trained weights."""

    def __post_init__(self) -> None:
        check(0 < self.decay < 1, "ema.decay", self.decay, "in (0, 1)")


@dataclass(frozen=True)
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend under torchrun (auto: nccl on GPUs, gloo on CPU)."""
    fsdp: bool = True
    """Shard the transformer with FSDP2 (fully_shard per block) when there are several ranks."""
    timeout_s: float = 600.0
    """Seconds a collective may wait for the other ranks before the run stops with an error naming it."""

    def __post_init__(self) -> None:
        check_finite(self, "distributed.")
        check(self.timeout_s > 0, "distributed.timeout_s", self.timeout_s, "> 0")


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 30
    """Save every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Keep this many complete checkpoints."""
    keep_best: bool = False
    """Also keep the checkpoint with the best gold evaluation score (eval.rewards' weighted total); checkpoints/best points to it."""

    def __post_init__(self) -> None:
        check(self.save_every >= 0, "checkpoint.save_every", self.save_every, ">= 0")
        check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")


@dataclass(frozen=True)
class LoggingConfig:
    run_dir: str = "runs"
    """Parent folder of the run folders."""
    name: str = "boogu_flowgrpo"
    """Run name: outputs go to run_dir/name."""
    sample_every: int = 5
    """Write a grid of generated images every this many steps (0: never)."""
    num_samples: int = 8
    """Images in each sample grid."""
    tensorboard: bool = False
    """Also log scalars to TensorBoard (needs the tensorboard extra)."""
    wandb: bool = False
    """Also log to Weights & Biases (needs the wandb extra)."""
    progress: bool = True
    """Show a progress bar with the running reward."""
    plot_every: int = 1
    """Redraw reward_curve.png every this many steps and at the last step (0: never)."""

    def __post_init__(self) -> None:
        check(bool(self.name) and "/" not in self.name, "logging.name", self.name, "a folder name")
        check(self.plot_every >= 0, "logging.plot_every", self.plot_every, ">= 0 (0 = never)")
        check(self.sample_every >= 0, "logging.sample_every", self.sample_every, ">= 0")
        check(self.num_samples >= 1, "logging.num_samples", self.num_samples, ">= 1")


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Evaluate on data.val_files every this many steps (0: never)."""
    num_steps: int = 50
    """Denoising steps for evaluation (deterministic ODE sampling)."""
    num_prompts: int = 16
    """Evaluation prompts per evaluation."""
    guidance_scale: float | None = None
    """Text CFG of the evaluation's samples; null: sampler.guidance_scale (set it when the rollouts sample without CFG)."""
    image_guidance_scale: float | None = None
    """Edit rows: image guidance of the evaluation's samples; null: sampler.image_guidance_scale."""
    rewards: tuple[RewardSpec, ...] = ()
    """Held-out "gold" rewards, computed only on the evaluation set (same form as reward.rewards); empty: the training rewards."""
    stop_on_divergence: int = 0
    """k > 0: act when the training reward rose and the gold reward fell over each of the last k evaluations (0: off)."""
    divergence_action: Literal["warn", "stop"] = "warn"
    """What a divergence does: log a warning, or stop the run with a checkpoint."""

    def __post_init__(self) -> None:
        check(self.every >= 0, "eval.every", self.every, ">= 0")
        check(
            self.stop_on_divergence >= 0, "eval.stop_on_divergence", self.stop_on_divergence, ">= 0 (0 = off)"
        )
        _check_reward_specs(self.rewards, "eval.rewards")
        check(self.num_steps >= 1, "eval.num_steps", self.num_steps, ">= 1")
        check(self.num_prompts >= 1, "eval.num_prompts", self.num_prompts, ">= 1")
        check(
            self.num_prompts <= MAX_DEMO_PROMPTS,
            "eval.num_prompts",
            self.num_prompts,
            f"<= {MAX_DEMO_PROMPTS} (the most evaluation prompts; built-in scene prompts are drawn up front)",
        )
        if self.guidance_scale is not None:
            check(self.guidance_scale >= 1.0, "eval.guidance_scale", self.guidance_scale, ">= 1 or null")
        if self.image_guidance_scale is not None:
            check(
                self.image_guidance_scale >= 1.0,
                "eval.image_guidance_scale",
                self.image_guidance_scale,
                ">= 1 or null",
            )


@dataclass(frozen=True)
class PerfConfig:
    peak_tflops: float | None = None
    """Peak dense TFLOPs of one device for perf/mfu; null: looked up from the GPU's name (bf16 dense), measured once on CPU."""

    def __post_init__(self) -> None:
        check_finite(self, "perf.")
        check(
            self.peak_tflops is None or self.peak_tflops > 0,
            "perf.peak_tflops",
            self.peak_tflops,
            "> 0 or null",
        )


@dataclass(frozen=True)
class TrainerConfig:
    data: DataConfig = field(default_factory=DataConfig)
    """Datasets and batching."""
    model: ModelConfig = field(default_factory=ModelConfig)
    """Checkpoint and dtype."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapters."""
    sampler: SamplerConfig = field(default_factory=SamplerConfig)
    """Rollout sampling: steps, guidance, size, SDE kernel and windows."""
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    """Rollout engine."""
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    """FlowGRPO: groups, advantages, clipping, KL, update schedule."""
    reward: RewardConfig = field(default_factory=RewardConfig)
    """Rewards and their weights."""
    optim: OptimConfig = field(default_factory=OptimConfig)
    """Optimizer."""
    ema: EmaConfig = field(default_factory=EmaConfig)
    """EMA of the LoRA weights."""
    distributed: DistributedConfig = field(default_factory=DistributedConfig)
    """torchrun / FSDP2."""
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    """Checkpointing."""
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    """Outputs and progress."""
    eval: EvalConfig = field(default_factory=EvalConfig)
    """Evaluation."""
    perf: PerfConfig = field(default_factory=PerfConfig)
    """FLOP and MFU accounting."""
    total_steps: int = 300
    """Training steps (one rollout batch each)."""
    seed: int = 42
    """Seeds data order, rollouts, windows and LoRA init."""
    resume: str = ""
    """'' (fresh run; refuses a run folder that has checkpoints), 'auto' (latest complete checkpoint) or a checkpoint path."""
    preflight: bool = True
    """Before the first step, check that the run can learn (LoRA modules matched, gradients on every adapted module, on-policy ratio 1, rewards vary within groups, a synced update reaches the engine); stop with the named cause otherwise."""
    resume_allow_changes: tuple[str, ...] = ()
    """Config keys allowed to differ from the checkpoint's on resume (e.g. [optim.lr]); the new values take effect. Keys that cannot change the numbers (total_steps, logging.*, checkpoint.*, eval.*, the rollout worker's url, devices and timeouts; docs/reliability.md) and other spellings of a value (a path's trailing slash) may always change."""

    def __post_init__(self) -> None:
        check(self.total_steps >= 1, "total_steps", self.total_steps, ">= 1")
        a = self.algorithm
        spec = a.spec
        if not spec.forward_process and self.sampler.window_size == 0:
            raise ConfigError(
                f"sampler.window_size=0: {a.name} trains on the SDE window's transitions and needs at least "
                f"one; ODE rollouts (0) work with algorithm.name={' or '.join(FORWARD_OPTIONS_KEYS)}"
            )
        if self.rollout.engine == "vllm_omni" and self.model.edit_vlm_view != "upstream":
            raise ConfigError(
                f"model.edit_vlm_view={self.model.edit_vlm_view!r}: the vllm-omni worker encodes edit references "
                "the upstream way only; use edit_vlm_view=upstream (the default) or rollout.engine=local"
            )
        if a.loss != "ppo_clip" and not spec.policy_ratio:
            raise ConfigError(
                f"algorithm.loss={a.loss!r}: GRPO-Guard is a flow_grpo objective; "
                f"algorithm.name={a.name!r} has its own loss (leave algorithm.loss=ppo_clip)"
            )
        opts, key = a.forward_options, f"algorithm.{a.forward_key}"
        if opts is not None and opts.time_sampling == "schedule":
            levels = self.sampler.num_steps
            wanted = opts.timesteps if opts.timesteps is not None else levels - 1  # NFT's null: all but one
            check(wanted <= levels, f"{key}.timesteps", opts.timesteps, f"<= sampler.num_steps ({levels})")
        s = self.sampler
        if (
            opts is not None
            and opts.guided
            and not (uses_cfg(s.guidance_scale) or uses_cfg(s.image_guidance_scale))
        ):
            raise ConfigError(
                f"{key}.guided=true trains the CFG-guided velocity, but "
                f"sampler.guidance_scale={s.guidance_scale} rolls out without CFG; "
                f"set sampler.guidance_scale > 1 or {key}.guided=false"
            )
        # Every stream is derived from the seed's low 63 bits (boogu_schedule.seeding): a larger seed
        # would silently give another seed's run.
        check(0 <= self.seed < 2**63, "seed", self.seed, "a whole number in [0, 2**63)")
        self._check_contradictions()
        keys = _config_keys()
        for i, key in enumerate(self.resume_allow_changes):
            if key not in keys:
                close = difflib.get_close_matches(key, keys, n=3)
                hint = f" (did you mean {', '.join(close)}?)" if close else ""
                raise ConfigError(
                    f"resume_allow_changes[{i}]={key!r}: expected a config key or section "
                    f"such as optim.lr or optim{hint}"
                )

    def _check_contradictions(self) -> None:
        """Refuse settings that another setting makes meaningless: each would otherwise be ignored,
        or clamped, without a word."""
        a = self.algorithm
        groups = self.data.prompts_per_step
        if a.mini_batches > groups:
            raise ConfigError(
                f"algorithm.mini_batches={a.mini_batches} with data.prompts_per_step={groups}: a mini-batch "
                f"holds whole prompt groups, so at most {groups} mini-batches (one group each)"
            )
        # Settings that act on evaluations, which need both data.val_files and eval.every > 0.
        on_evaluations = [
            f"{key}={value!r}"
            for key, value, on in (
                ("eval.rewards", [r.name for r in self.eval.rewards], bool(self.eval.rewards)),
                ("eval.stop_on_divergence", self.eval.stop_on_divergence, self.eval.stop_on_divergence > 0),
                ("checkpoint.keep_best", self.checkpoint.keep_best, self.checkpoint.keep_best),
            )
            if on
        ]
        if not self.data.val_files and self.data.demo_set == "ocr":  # the scene sets have held-out prompts
            uses = [f"eval.every={self.eval.every}"] * (self.eval.every > 0) + on_evaluations
            if uses:
                raise ConfigError(
                    f"{', '.join(uses)} without data.val_files: evaluation runs on the validation prompts; "
                    "set data.val_files (parquet files or folders) or data.demo_set=scenes (or scene_edits), or turn "
                    "evaluation off"
                )
        elif self.eval.every == 0 and on_evaluations:
            raise ConfigError(
                f"{', '.join(on_evaluations)} with eval.every=0: these act on evaluations, and none runs; "
                "set eval.every > 0"
            )

    @property
    def run_path(self) -> Path:
        return Path(self.logging.run_dir).expanduser() / self.logging.name


@functools.cache
def _config_keys() -> frozenset[str]:
    """Every dotted key and section name of `TrainerConfig`."""

    def walk(cls: type, prefix: str) -> Iterable[str]:
        for name, tp in field_hints(cls).items():
            yield prefix + name
            if dataclasses.is_dataclass(tp):
                yield from walk(tp, f"{prefix}{name}.")  # type: ignore[arg-type]

    return frozenset(walk(TrainerConfig, ""))
