"""The trainer's configuration: one typed, validated dataclass per component, nested.

Recipes are YAML files of these sections; ``a.b=c`` overrides on the command line go on top.
Every field carries a one-line docstring (shown by ``trainer --help`` and in the README). The
defaults are the reference recipe's values for the real model (spec flowgrpo-reference.md §4);
the demo (``trainer`` with no arguments) starts from :func:`demo_config`.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from boogu_adapters.model import LORA_TARGET_MODULES
from boogu_trainer import _configlib

ConfigError = _configlib.ConfigError


def _check(cond: bool, key: str, value: Any, allowed: str) -> None:
    if not cond:
        raise ConfigError(f"{key}={value!r}: expected {allowed}")


@dataclass(frozen=True)
class DataConfig:
    train_files: tuple[str, ...] = ()
    """Parquet files or folders written by boogu-data; empty means the built-in demo prompts."""
    val_files: tuple[str, ...] = ()
    """Parquet files or folders for evaluation (empty: no evaluation set)."""
    prompts_per_step: int = 32
    """B: prompts per training step (each rolled out group_size times)."""
    shuffle: bool = True
    """Reshuffle the prompts every epoch (seeded, resumable)."""
    demo_prompts: int = 32
    """How many built-in prompts the demo uses when train_files is empty."""

    def __post_init__(self) -> None:
        _check(self.prompts_per_step >= 1, "data.prompts_per_step", self.prompts_per_step, ">= 1")
        _check(self.demo_prompts >= 1, "data.demo_prompts", self.demo_prompts, ">= 1")


@dataclass(frozen=True)
class ModelConfig:
    path: str = ""
    """Boogu checkpoint folder; empty builds and uses the tiny random checkpoint (tiny_path)."""
    tiny_path: str = "~/models/tiny-random/Boogu-Image"
    """Where the tiny random checkpoint is built when path is empty."""
    transformer: Literal["auto", "native", "canonical"] = "native"
    """Our port (native), the checkpoint's own class (canonical, needs trust_remote_code), or auto."""
    trust_remote_code: bool = False
    """Allow executing code shipped in the checkpoint folder (canonical transformer only)."""
    dtype: Literal["float32", "bfloat16", "float16"] = "float32"
    """Dtype of the frozen base model (LoRA weights and optimizer state stay float32)."""
    device: str = "auto"
    """'auto' (cuda if available), 'cpu' or 'cuda[:i]'."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in backward; null turns it on for models with hidden size >= 1024."""
    max_sequence_length: int = 1280
    """Prompt token cap (upstream's default); longer prompts are an error, never silently cut."""

    def __post_init__(self) -> None:
        _check(self.max_sequence_length >= 16, "model.max_sequence_length", self.max_sequence_length, ">= 16")
        _check(
            self.device == "auto" or self.device == "cpu" or self.device.startswith("cuda"),
            "model.device",
            self.device,
            "'auto', 'cpu' or 'cuda[:i]'",
        )


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
        _check(self.rank >= 1, "lora.rank", self.rank, ">= 1")
        _check(self.alpha > 0, "lora.alpha", self.alpha, "> 0")
        _check(len(self.target_modules) > 0, "lora.target_modules", self.target_modules, "a non-empty list")


@dataclass(frozen=True)
class SamplerConfig:
    num_steps: int = 10
    """N: denoising steps per rollout."""
    guidance_scale: float = 4.0
    """Text CFG scale; 1.0 skips the negative forward and halves rollout cost."""
    height: int = 1024
    """Output height (multiple of 16, area at most 2048^2); edit rows follow their reference."""
    width: int = 1024
    """Output width (multiple of 16)."""
    sampler: Literal["flow_sde", "cps", "dance_sde"] = "flow_sde"
    """Transition kernel inside the SDE window."""
    noise_level: float = 1.2
    """eta inside the window (the recipe's 1.2; 0.7 is gentler)."""
    window_size: int | None = 2
    """Stochastic (trained) steps per rollout; null means every step but the last."""
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
        _check(self.num_steps >= 2, "sampler.num_steps", self.num_steps, ">= 2")
        _check(self.guidance_scale >= 1.0, "sampler.guidance_scale", self.guidance_scale, ">= 1.0")
        for key in ("height", "width"):
            v = getattr(self, key)
            _check(v >= 16 and v % 16 == 0, f"sampler.{key}", v, "a positive multiple of 16")
        _check(
            self.height * self.width <= 2048 * 2048,
            "sampler.height*width",
            self.height * self.width,
            "<= 2048^2",
        )
        _check(
            math.isfinite(self.noise_level) and self.noise_level > 0,
            "sampler.noise_level",
            self.noise_level,
            "> 0",
        )
        if self.window_size is not None:
            _check(self.window_size >= 1, "sampler.window_size", self.window_size, ">= 1 or null")
            lo, hi = self.window_range
            _check(0 <= lo < hi, "sampler.window_range", self.window_range, "0 <= lo < hi")
            _check(
                min(hi, self.num_steps - 1) - lo >= self.window_size,
                "sampler.window_size",
                self.window_size,
                f"a window that fits in {list(self.window_range)} over {self.num_steps} steps (last step excluded)",
            )


@dataclass(frozen=True)
class RolloutConfig:
    engine: Literal["local"] = "local"
    """'local': in-process with the trained module (the only engine built so far; a vllm-omni
    engine needs its own environment and an SDE/log-prob path that vllm-omni 0.30 lacks for Boogu)."""
    cfg_mode: Literal["batched", "sequential"] = "batched"
    """Run positive and negative prompts in one forward (batched) or two."""


@dataclass(frozen=True)
class AlgorithmConfig:
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
    """Weight of the KL penalty to the reference (base) model; 0 skips the reference pass."""
    kl_kind: Literal["mean", "velocity"] = "mean"
    """KL on the transition means (Gaussian KL) or on the velocity difference."""
    inner_epochs: int = 1
    """Passes over each rollout batch."""
    mini_batches: int = 1
    """Optimizer steps per pass (the batch is split by groups)."""
    advantage_sign: float = 1.0
    """+1 for training; -1 flips the objective (a diagnostic: the reward must then go down)."""

    def __post_init__(self) -> None:
        _check(
            self.group_size >= 2,
            "algorithm.group_size",
            self.group_size,
            ">= 2 (advantages are relative to the group)",
        )
        _check(self.clip_range > 0, "algorithm.clip_range", self.clip_range, "> 0")
        _check(self.adv_clip > 0, "algorithm.adv_clip", self.adv_clip, "> 0")
        _check(self.adv_eps >= 0, "algorithm.adv_eps", self.adv_eps, ">= 0")
        _check(self.kl_coef >= 0, "algorithm.kl_coef", self.kl_coef, ">= 0")
        _check(self.inner_epochs >= 1, "algorithm.inner_epochs", self.inner_epochs, ">= 1")
        _check(self.mini_batches >= 1, "algorithm.mini_batches", self.mini_batches, ">= 1")
        _check(self.advantage_sign in (1.0, -1.0), "algorithm.advantage_sign", self.advantage_sign, "1 or -1")


@dataclass(frozen=True)
class RewardSpec:
    name: str = "ocr"
    """A registered reward ('ocr', 'vlm_ocr', 'jpeg_compressibility', ...) or 'module:function'."""
    weight: float = 1.0
    """Weight in the sum of rewards."""
    kwargs: dict[str, Any] = field(default_factory=dict)
    """Keyword arguments for the reward's constructor."""

    def __post_init__(self) -> None:
        _check(bool(self.name), "reward.rewards[].name", self.name, "a reward name")
        _check(math.isfinite(self.weight), "reward.rewards[].weight", self.weight, "a finite number")


@dataclass(frozen=True)
class RewardConfig:
    rewards: tuple[RewardSpec, ...] = (RewardSpec(),)
    """The rewards and their weights."""
    max_nonfinite_steps: int = 3
    """Stop the run after this many consecutive steps with non-finite rewards or losses."""

    def __post_init__(self) -> None:
        _check(len(self.rewards) >= 1, "reward.rewards", self.rewards, "at least one reward")
        _check(self.max_nonfinite_steps >= 1, "reward.max_nonfinite_steps", self.max_nonfinite_steps, ">= 1")


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
        _check(self.lr > 0, "optim.lr", self.lr, "> 0")
        _check(self.grad_clip > 0, "optim.grad_clip", self.grad_clip, "> 0")


@dataclass(frozen=True)
class EmaConfig:
    enabled: bool = False
    """Keep an exponential moving average of the LoRA weights (saved with checkpoints)."""
    decay: float = 0.9
    """EMA decay per training step."""

    def __post_init__(self) -> None:
        _check(0 < self.decay < 1, "ema.decay", self.decay, "in (0, 1)")


@dataclass(frozen=True)
class DistributedConfig:
    backend: Literal["auto", "nccl", "gloo"] = "auto"
    """Process-group backend under torchrun (auto: nccl on GPUs, gloo on CPU)."""
    fsdp: bool = True
    """Shard the transformer with FSDP2 (fully_shard per block) when there are several ranks."""


@dataclass(frozen=True)
class CheckpointConfig:
    save_every: int = 30
    """Save every this many steps (and at the end); 0 saves only at the end."""
    keep_last: int = 3
    """Keep this many complete checkpoints."""

    def __post_init__(self) -> None:
        _check(self.save_every >= 0, "checkpoint.save_every", self.save_every, ">= 0")
        _check(self.keep_last >= 1, "checkpoint.keep_last", self.keep_last, ">= 1")


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

    def __post_init__(self) -> None:
        _check(bool(self.name) and "/" not in self.name, "logging.name", self.name, "a folder name")


@dataclass(frozen=True)
class EvalConfig:
    every: int = 0
    """Evaluate on data.val_files every this many steps (0: never)."""
    num_steps: int = 50
    """Denoising steps for evaluation (deterministic ODE sampling)."""
    num_prompts: int = 16
    """Evaluation prompts per evaluation."""


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
    total_steps: int = 300
    """Training steps (one rollout batch each)."""
    seed: int = 42
    """Seeds data order, rollouts, windows and LoRA init."""
    resume: str = ""
    """'' (fresh run; refuses a run folder that has checkpoints), 'auto' (latest complete checkpoint) or a checkpoint path."""

    def __post_init__(self) -> None:
        _check(self.total_steps >= 1, "total_steps", self.total_steps, ">= 1")

    @property
    def run_path(self) -> Path:
        return Path(self.logging.run_dir).expanduser() / self.logging.name


def demo_config() -> TrainerConfig:
    """The self-contained CPU demo: tiny random checkpoint, built-in prompts, a cheap reward."""
    return TrainerConfig(
        data=DataConfig(prompts_per_step=4, demo_prompts=32),
        model=ModelConfig(device="cpu"),
        lora=LoraConfig(rank=8, alpha=16.0),
        sampler=SamplerConfig(
            num_steps=6,
            guidance_scale=2.0,
            height=64,
            width=64,
            noise_level=0.8,
            window_size=2,
            window_range=(0, 4),
        ),
        algorithm=AlgorithmConfig(group_size=8, std_scope="group", clip_range=1e-3, mini_batches=2),
        reward=RewardConfig(rewards=(RewardSpec(name="demo_brightness"),)),
        optim=OptimConfig(lr=3e-3, weight_decay=0.0),
        checkpoint=CheckpointConfig(save_every=10, keep_last=2),
        logging=LoggingConfig(name="demo", sample_every=10, num_samples=8),
        total_steps=30,
        seed=0,
    )


def load_config(
    recipe: str | Path | None = None, overrides: list[str] | None = None, base: TrainerConfig | None = None
) -> TrainerConfig:
    """Defaults (or ``base``), then the YAML recipe, then ``a.b=c`` overrides."""
    return _configlib.load(TrainerConfig, recipe, overrides, base=base)


def config_to_dict(config: TrainerConfig) -> dict[str, Any]:
    return _configlib.to_mapping(config)


def config_reference_markdown() -> str:
    """The config reference table (for ``--help`` and the README), from the field docstrings."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in _configlib.describe(TrainerConfig):
        if tp == "section":
            lines.append(f"| **`{key}`** | | | {doc} |")
        else:
            bar = "\\|"
            lines.append(f"| `{key}` | {tp.replace('|', bar)} | `{default.replace('|', bar)}` | {doc} |")
    return "\n".join(lines)
