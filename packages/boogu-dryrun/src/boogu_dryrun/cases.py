"""One case of the dry run: the parts built on fake CUDA at a preset's size, then one training step
(rollout, update, weight sync) and one evaluation call of a shipped recipe (`run_case`), with the
memory of each phase measured and planned (``benchmarks/gpu_dryrun.py`` runs every case)."""

from __future__ import annotations

import contextlib
import logging
import math
import traceback
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from boogu_dryrun.session import DryRunError, Session, fake_cuda

logger = logging.getLogger("boogu_trainer")

# ------------------------------------------------------------------------------------------------
# One case: build the parts on fake CUDA, one training step (rollout, update, weight sync) and one
# evaluation call of a recipe.


RECIPES = {
    "flow_grpo": "examples/flowgrpo_trainer/boogu_image/boogu_image_ocr_lora.yaml",
    "grpo_guard": "examples/flowgrpo_trainer/boogu_image/boogu_image_ocr_grpo_guard_lora.yaml",
    "diffusion_nft": "examples/diffusion_nft_trainer/boogu_image/boogu_image_ocr_lora.yaml",
    "awm": "examples/awm_trainer/boogu_image/boogu_image_ocr_lora.yaml",
}
"""The shipped recipe of each algorithm (paths from the repository root)."""

RECIPE_RANKS = 4
"""The recipes are written for 4 GPUs: a rank's share of the evaluation prompts is a quarter."""

EVAL_STEPS = 2
"""Denoising steps of the dry run's evaluation call (each step is the same call; the recipes' 50 only
take longer)."""


def shape_preserving_prompts(config: Any) -> int:
    """The fewest prompts per rank whose rollout and training calls have the recipe's shapes: one full
    rollout micro-batch of latents, and whole mini-batches of whole training micro-batches.

    A rank of the reference recipe (32 prompts over 4 GPUs, groups of 16) makes 4 rollout calls of 32
    latents and 32 training micro-batches of 8 per window step; the dry run makes one call of each
    shape (the memory peak is the largest call, not their number)."""
    a = config.algorithm
    mb = config.rollout.micro_batch_size or a.group_size
    prompts = max(math.ceil(mb / a.group_size), a.mini_batches)
    while (prompts % a.mini_batches) or (
        a.train_micro_batch_size and (prompts // a.mini_batches * a.group_size) % a.train_micro_batch_size
    ):
        prompts += 1
    return prompts


@dataclass(frozen=True)
class Preset:
    """The model sizes of a dry run: the transformer config, the text encoder's and the VAE's."""

    name: str
    transformer: dict[str, Any]
    mllm: dict[str, Any] | None
    """A Qwen3-VL config (None: the tiny checkpoint's encoder config)."""
    vae: dict[str, Any] | None
    """An AutoencoderKL config (None: the tiny checkpoint's)."""
    height: int | None = None
    """Output size (None: the recipe's)."""


def presets() -> dict[str, Preset]:
    from boogu_adapters.model import RELEASED_CONFIG, TINY_CONFIG
    from boogu_trainer.plan import RELEASED_MLLM_CONFIG, RELEASED_VAE_CONFIG

    mid = {
        **TINY_CONFIG,
        "hidden_size": 256,
        "num_layers": 8,
        "num_double_stream_layers": 4,
        "axes_dim_rope": (16, 24, 24),
    }
    return {
        "released": Preset("released", dict(RELEASED_CONFIG), RELEASED_MLLM_CONFIG, RELEASED_VAE_CONFIG),
        "mid": Preset("mid", mid, None, None, height=256),
        "tiny": Preset("tiny", dict(TINY_CONFIG), None, None, height=64),
    }


_INITIALISERS = (
    "uniform_",
    "normal_",
    "trunc_normal_",
    "constant_",
    "ones_",
    "zeros_",
    "eye_",
    "dirac_",
    "xavier_uniform_",
    "xavier_normal_",
    "kaiming_uniform_",
    "kaiming_normal_",
    "orthogonal_",
    "sparse_",
)


@contextlib.contextmanager
def _skip_initialisers() -> Iterator[None]:
    """``torch.nn.init`` does nothing inside: fake weights have no values, and the initialisers would
    draw from the default CUDA generator (which needs a driver) or read bounds back to the host."""
    saved = {name: getattr(torch.nn.init, name) for name in _INITIALISERS}
    try:
        for name in _INITIALISERS:
            setattr(torch.nn.init, name, lambda tensor, *args, **kwargs: tensor)
        yield
    finally:
        for name, fn in saved.items():
            setattr(torch.nn.init, name, fn)


def build_parts(preset: Preset, tiny_root: Path, device: torch.device, dtype: torch.dtype):
    """`BooguParts` of ``preset`` on ``device`` (fake CUDA inside :func:`fake_cuda`), random weights;
    processor and scheduler from the tiny checkpoint at ``tiny_root``."""
    import json

    from diffusers import AutoencoderKL
    from transformers import Qwen3VLConfig, Qwen3VLModel

    from boogu_adapters.loading import BooguParts, load_processor, load_schedule_config
    from boogu_adapters.model import BooguImageTransformer2DModel

    tiny_mllm = json.loads((tiny_root / "mllm" / "config.json").read_text())
    tiny_vae = json.loads((tiny_root / "vae" / "config.json").read_text())
    mllm = preset.mllm or tiny_mllm
    hidden = int(mllm.get("text_config", mllm)["hidden_size"])
    cfg = {
        **preset.transformer,
        "instruction_feature_configs": {
            **preset.transformer["instruction_feature_configs"],
            "instruction_feat_dim": hidden,
        },
    }
    # Built straight on the (fake) device: the initialisers run as shape-only ops that draw from no
    # generator, and a fake tensor's values do not exist anyway.
    keys = {k: v for k, v in mllm.items() if k not in ("architectures", "model_type", "transformers_version")}
    # The prompts are tokenised by the tiny checkpoint's processor: its special-token ids.
    keys.update({k: v for k, v in tiny_mllm.items() if k.endswith("_token_id")})
    vae_cfg = {k: v for k, v in (preset.vae or tiny_vae).items() if not k.startswith("_")}
    for k in ("scaling_factor", "shift_factor"):
        vae_cfg.setdefault(k, tiny_vae.get(k))
    with torch.device(device), _skip_initialisers():
        transformer = BooguImageTransformer2DModel(**cfg).to(dtype).eval()
        encoder = Qwen3VLModel._from_config(Qwen3VLConfig(**keys), torch_dtype=dtype).eval()
        vae = AutoencoderKL.from_config(vae_cfg).to(dtype).eval()
    return BooguParts(
        transformer=transformer,
        vae=vae,
        text_encoder=encoder,
        processor=load_processor(tiny_root),
        schedule_config=load_schedule_config(tiny_root),
        vae_scale_factor=2 ** (len(vae.config.block_out_channels) - 1),
        path=tiny_root,
        transformer_kind="native",
    )


def edit_records(count: int, height: int, width: int) -> list:
    """``count`` edit rows, each with a PNG reference image of ``height x width`` (output follows it)."""
    import io

    import numpy as np
    from PIL import Image

    from boogu_data import PromptRecord

    rows = []
    for i in range(count):
        buffer = io.BytesIO()
        pixels = np.full((height, width, 3), (37 * i) % 256, dtype=np.uint8)
        Image.fromarray(pixels).save(buffer, format="PNG")
        rows.append(
            PromptRecord(
                index=i,
                instruction=f'Replace the sign\'s text with "BOOGU {i}"',
                negative="",
                ground_truth=f"BOOGU {i}",
                ref_image=buffer.getvalue(),
            )
        )
    return rows


def measured_peaks(session: Session) -> dict[str, float]:
    """Peak live GiB of the rollout, the update and the evaluation call, and of the whole step."""
    peaks: dict[str, float] = {}
    for phase, peak in session.phase_peaks.items():
        key = phase.split(",")[0].strip()
        key = {"update": "train"}.get(key, key)
        peaks[key] = max(peaks.get(key, 0.0), peak / 2**30)
    peaks["step"] = session.peak_bytes / 2**30
    return {k: round(v, 3) for k, v in peaks.items()}


def shape_folder(preset: Preset, tiny_root: Path, folder: Path) -> Path:
    """A checkpoint folder with only the ``config.json`` files of ``preset`` (what ``trainer --plan``
    reads), for the plan of the dry run's sizes."""
    import json

    for part, cfg in (("transformer", preset.transformer), ("vae", preset.vae), ("mllm", preset.mllm)):
        target = folder / part / "config.json"
        target.parent.mkdir(parents=True, exist_ok=True)
        if cfg is None:
            target.write_text((tiny_root / part / "config.json").read_text())
        else:
            target.write_text(json.dumps(cfg, default=list))
    mllm = json.loads((folder / "mllm" / "config.json").read_text())
    transformer = json.loads((folder / "transformer" / "config.json").read_text())
    transformer["instruction_feature_configs"]["instruction_feat_dim"] = int(
        mllm.get("text_config", mllm)["hidden_size"]
    )
    (folder / "transformer" / "config.json").write_text(json.dumps(transformer))
    return folder


def planned_peaks(
    config: Any, preset: Preset, tiny_root: Path, work: Path, world_size: int, reference_images: int = 0
) -> dict[str, float]:
    """``trainer --plan``'s expected peak GiB of the same phases, for the same recipe and sizes."""
    import dataclasses

    from boogu_trainer.plan import plan_memory

    folder = shape_folder(preset, tiny_root, work / f"shapes-{preset.name}")
    model = dataclasses.replace(config.model, path=str(folder))
    plan = plan_memory(
        dataclasses.replace(config, model=model),
        world_size=world_size,
        device_type="cuda",
        reference_images=reference_images,
    )
    static = plan.static_total
    rollout = max(plan.phases[k].bytes for k in ("rollout", "vae decode", "text encoder") if k in plan.phases)
    out = {"rollout": static + rollout, "train": static + plan.phases["train"].bytes, "step": plan.peak}
    return {k: round(v / 2**30, 3) for k, v in out.items()}


@dataclass
class CaseResult:
    name: str
    ok: bool
    error: str | None
    seconds: float
    session: Session | None = None
    peaks: dict[str, float] = field(default_factory=dict)
    """Measured peak GiB per phase (``rollout``, ``train``, ``evaluation``, ``step``)."""
    plan: dict[str, float] = field(default_factory=dict)
    """``trainer --plan``'s expected peak GiB per phase for the same recipe and world size."""
    traceback: str | None = None
    reference_images: dict[str, int] = field(default_factory=dict)
    """Reference images this rank's engine encoded in the rollout and in the evaluation: the prompts
    of each on this rank for an edit case, 0 for T2I (the proof that an edit case ran edit rows)."""

    def as_json(self) -> dict[str, Any]:
        reads = self.session.host_read_summary() if self.session is not None else {}
        return {
            "ok": self.ok,
            "error": self.error,
            "seconds": round(self.seconds, 2),
            "host_reads_in_loops": reads.get("host_reads_in_loops"),
            "host_reads": reads,
            "collectives": len(self.session.collectives) if self.session else None,
            "stand_ins": dict(self.session.stand_ins) if self.session else {},
            "peak_memory_gb": self.peaks.get("step"),
            "plan_peak_gb": self.plan.get("step"),
            "peaks_gb": self.peaks,
            "plan_gb": self.plan,
            "reference_images": self.reference_images,
        }


@dataclass(frozen=True)
class CaseConfig:
    """The trainer config of one dry-run case and the batch it makes per rank."""

    config: Any
    prompts_per_rank: int
    eval_prompts_per_rank: int
    size: int


def case_config(
    algorithm: str,
    name: str,
    *,
    preset: Preset,
    repo: Path,
    tiny_root: Path,
    work: Path,
    world_size: int = 1,
    prompts_per_rank: int | None = None,
    eval_prompts_per_rank: int | None = None,
    eval_steps: int | None = None,
    overrides: Sequence[str] = (),
) -> CaseConfig:
    """The shipped recipe of ``algorithm`` as the dry run runs it: fake CUDA in bf16, ``preset``'s
    output size, the fewest prompts per rank with the recipe's call shapes, host-scored rewards."""
    from boogu_trainer.config import load_config

    recipe = load_config(repo / RECIPES[algorithm], [f"model.path={tiny_root}"])
    per_rank = prompts_per_rank or shape_preserving_prompts(recipe)
    eval_per_rank = eval_prompts_per_rank or max(recipe.eval.num_prompts // RECIPE_RANKS, 1)
    size = preset.height or recipe.sampler.height
    config = load_config(
        repo / RECIPES[algorithm],
        [
            f"model.path={tiny_root}",
            "model.device=cuda",
            "model.dtype=bfloat16",
            "data.train_files=[]",
            "data.val_files=[]",
            f"data.prompts_per_step={per_rank * world_size}",
            f"sampler.height={size}",
            f"sampler.width={size}",
            "reward.rewards=[{name: 'boogu_dryrun.session:HostScores'}]",
            "eval.rewards=[]",
            "eval.every=0",  # no val_files: the evaluation call below is made directly
            f"eval.num_prompts={eval_per_rank * world_size}",
            f"eval.num_steps={eval_steps or EVAL_STEPS}",
            "preflight=false",
            "total_steps=1",
            "checkpoint.save_every=0",
            f"logging.run_dir={work}",
            f"logging.name={name}",
            "logging.sample_every=0",
            "logging.plot_every=0",
            "logging.progress=false",
            "logging.tensorboard=false",
            *overrides,
        ],
    )
    return CaseConfig(config, per_rank, eval_per_rank, size)


def run_case(
    algorithm: str,
    edit: bool,
    *,
    preset: Preset,
    repo: Path,
    tiny_root: Path,
    work: Path,
    world_size: int = 1,
    **options: Any,
) -> CaseResult:
    """One dry-run case: the recipe of ``algorithm`` at ``preset``'s sizes, T2I or edit, on
    ``world_size`` fake ranks (this process rank 0): one training step and one evaluation call.
    ``options``: `case_config`'s batch and override arguments."""
    import os
    import time

    from boogu_trainer.data import PromptSampler, demo_records
    from boogu_trainer.distributed import DistEnv
    from boogu_trainer.trainer import Trainer

    name = f"{algorithm}-{'edit' if edit else 't2i'}"
    t0 = time.perf_counter()
    case = case_config(
        algorithm,
        name,
        preset=preset,
        repo=repo,
        tiny_root=tiny_root,
        work=work,
        world_size=world_size,
        **options,
    )
    config, per_rank, eval_per_rank, size = (
        case.config,
        case.prompts_per_rank,
        case.eval_prompts_per_rank,
        case.size,
    )
    result = CaseResult(name=name, ok=False, error=None, seconds=0.0)
    env = {"WORLD_SIZE": str(world_size), "LOCAL_RANK": "0", "RANK": "0"}
    saved_env = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        with fake_cuda(world_size) as session:
            result.session = session
            # `DistEnv.from_environment` asks `torch.cuda.is_available()`, which must stay False here (fake
            # mode takes the real CUDA path for a CPU-to-CUDA copy when it is True); its device
            # handling is tested on its own (tests/trainer/test_gpu_path.py).
            dist = DistEnv(
                rank=0,
                world_size=world_size,
                local_rank=0,
                device=torch.device("cuda", 0),
                timeout_s=config.distributed.timeout_s,
            )
            parts = build_parts(preset, tiny_root, dist.device, torch.bfloat16)
            trainer = Trainer(config, dist=dist, parts=parts)
            records = (
                edit_records(per_rank * world_size, size, size)
                if edit
                else demo_records(config.data.demo_prompts)
            )
            trainer.data = PromptSampler(
                records, config.data.prompts_per_step, shuffle=False, seed=config.seed
            )
            eval_records = (
                edit_records(eval_per_rank * world_size, size, size)
                if edit
                else (records * eval_per_rank * world_size)[: eval_per_rank * world_size]
            )
            trainer.evaluator.records = eval_records
            session.reset_peak()
            stats = trainer.engine.stats
            trainer.train_step()
            rollout_refs = stats.reference_images_encoded
            trainer.evaluator.evaluate(step=1)
            result.reference_images = {
                "rollout": rollout_refs,
                "evaluation": stats.reference_images_encoded - rollout_refs,
            }
            expected = (
                {"rollout": per_rank, "evaluation": eval_per_rank}
                if edit
                else {"rollout": 0, "evaluation": 0}
            )
            if result.reference_images != expected:
                raise DryRunError(
                    f"the {name} case's engine encoded {result.reference_images} reference images on this "
                    f"rank, expected {expected}: its rows are not the case's"
                )
            if session.errors:
                raise DryRunError("; ".join(session.errors))
        result.peaks = measured_peaks(session)
        result.plan = planned_peaks(config, preset, tiny_root, work, world_size, reference_images=int(edit))
        result.ok = True
    except Exception as error:  # the case's verdict: the report names it
        result.error = f"{type(error).__name__}: {error}"
        logger.debug("dry run %s failed", name, exc_info=True)
        result.traceback = traceback.format_exc()
    finally:
        for k, v in saved_env.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        result.seconds = time.perf_counter() - t0
    return result
