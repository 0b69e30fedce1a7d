"""The built-in recipes: the settings ``trainer`` runs with no arguments (`scenes_demo_config`), the
scenes task the benchmarks build on (`scenes_task_config`) and the tests' fast CPU run
(`demo_config`). Each is a `TrainerConfig` as a YAML recipe would give it; like a recipe, each picks
its learner (``examples/tiny_scenes/scenes_demo.yaml`` is the demo's, a test holds the two equal).
"""

from __future__ import annotations

from dataclasses import replace

from boogu_trainer.config.algorithms import NftConfig
from boogu_trainer.config.sections import (
    AlgorithmConfig,
    CheckpointConfig,
    DataConfig,
    EvalConfig,
    LoggingConfig,
    LoraConfig,
    ModelConfig,
    OptimConfig,
    RewardConfig,
    RewardSpec,
    SamplerConfig,
    TrainerConfig,
)


def scenes_task_config() -> TrainerConfig:
    """The scenes task as the benchmarks run it (`benchmarks/algorithms_scenes.py`, `gradient_check.py`,
    `ceiling.py`, `demo_throughput.py`, `pipeline.py` build their recipes on it): the tiny Boogu
    pretrained on procedural scenes (``model.tiny: scenes``, docs/tiny-model.md) learns to follow
    their captions, judged on captions it never trained on.

    DiffusionNFT on CFG-4 ODE rollouts trains the conditional velocity (``guided: false``) on the
    pass/fail verifier (``scene_exact``), one noise level per sample with common noise per group,
    the old policy equal to the current one; lr 1e-3 for 30 steps of 8 prompts x 8 samples (the
    demo's settings until issue 44's ten-seed comparison; ``examples/tiny_scenes/scenes_quick.yaml``).
    The settings and the runs that led to them are in docs/tiny-model.md. The run ends with the
    held-out comparison (``boogu_trainer.demo.heldout_comparison``: 400 captions, base vs LoRA on
    the same seeds), which reuses the run's one evaluation (``eval.every: 30``: the last step)."""
    return TrainerConfig(
        data=DataConfig(prompts_per_step=8, demo_prompts=2000, demo_set="scenes", demo_eval_split="heldout"),
        model=ModelConfig(device="cpu", tiny="scenes"),
        lora=LoraConfig(rank=8, alpha=16.0),
        sampler=SamplerConfig(num_steps=10, guidance_scale=4.0, height=64, width=64, window_size=0),
        algorithm=AlgorithmConfig(
            name="diffusion_nft",
            nft=NftConfig(beta=1.0, timesteps=1, group_noise=True, guided=False, old_decay_max=0.0),
            group_size=8,
            std_scope="group",
            mini_batches=1,
        ),
        reward=RewardConfig(rewards=(RewardSpec(name="scene_exact"),)),
        eval=EvalConfig(every=30, num_steps=20, num_prompts=400, rewards=(RewardSpec(name="scene_exact"),)),
        optim=OptimConfig(lr=1e-3, weight_decay=0.0),
        checkpoint=CheckpointConfig(save_every=10, keep_last=2),
        # The reward curve every 5 steps, not every step: a draw costs ~0.1 s, 1-2% of a CPU step.
        logging=LoggingConfig(name="demo", sample_every=10, num_samples=8, plot_every=5),
        total_steps=30,
        seed=0,
    )


def scenes_demo_config() -> TrainerConfig:
    """``trainer`` with no arguments: the scenes task (`scenes_task_config`) with a shorter, less
    noisy step, the recipe that won the pre-registered ten-seed comparison (benchmarks/README.md,
    "The demo over ten seeds"): 40 steps of 16 prompts x 8 samples (128 images per update), two
    noise levels per sample, lr 5e-4; the held-out comparison reuses the last step's evaluation
    (``eval.every: 40``). ``examples/tiny_scenes/scenes_demo.yaml`` is the same as a recipe,
    ``scenes_quick.yaml`` the task's quicker settings."""
    task = scenes_task_config()
    return replace(
        task,
        data=replace(task.data, prompts_per_step=16),
        algorithm=replace(task.algorithm, nft=replace(task.algorithm.nft, timesteps=2)),
        eval=replace(task.eval, every=40),
        optim=replace(task.optim, lr=5e-4),
        total_steps=40,
    )


def scenes_edit_demo_config() -> TrainerConfig:
    """``trainer edit``: the Edit demo. The tiny Boogu Edit checkpoint (the scenes checkpoint
    fine-tuned on the scene edit pairs, ``model.tiny: scenes_edit``, docs/tiny-model.md) learns to
    follow edit instructions on their reference image: the T2I demo's learner and settings
    (`scenes_demo_config`) on the built-in edit pairs (``data.demo_set: scene_edits``), trained on
    the exact edit verifier plus its partial credit (``scene_edit_exact`` + ``scene_edit_dense``,
    the pre-registered candidate that won the ten-seed comparison, benchmarks/README.md) and judged
    by the exact verifier alone on held-out instructions, with upstream's image guidance 1.5 in the
    rollouts and the evaluation (+0.10 on the base's held-out score), 20 steps, and a 10-step
    evaluation (the rollouts' sampler): an edit forward costs about twice a T2I one.
    ``examples/tiny_scenes/edit_demo.yaml`` is the same as a recipe."""
    demo = scenes_demo_config()
    return replace(
        demo,
        data=replace(demo.data, demo_set="scene_edits"),
        model=replace(demo.model, tiny="scenes_edit"),
        sampler=replace(demo.sampler, image_guidance_scale=1.5),
        reward=RewardConfig(
            rewards=(RewardSpec(name="scene_edit_exact"), RewardSpec(name="scene_edit_dense"))
        ),
        eval=replace(demo.eval, every=20, num_steps=10, rewards=(RewardSpec(name="scene_edit_exact"),)),
        logging=replace(demo.logging, name="edit_demo"),
        total_steps=20,
    )


BUILTIN_RECIPES = {"edit": scenes_edit_demo_config}
"""The built-in recipes ``trainer NAME`` runs (a word, not a file): ``trainer edit`` is the Edit
demo; ``trainer`` with no recipe is the T2I demo (`scenes_demo_config`)."""


def demo_config() -> TrainerConfig:
    """The fast CPU run of the tests and the first algorithm benchmark (``trainer`` with no arguments
    before the scene demo): tiny random checkpoint, built-in OCR prompts, a cheap reward that a
    random model can move."""
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


__all__ = [
    "BUILTIN_RECIPES",
    "demo_config",
    "scenes_demo_config",
    "scenes_edit_demo_config",
    "scenes_task_config",
]
