"""``BooguSDEPipeline``: vllm-omni's Boogu pipeline with the trainer's SDE rollouts and log-probs.

vllm-omni 0.30's ``BooguImagePipeline`` samples with a deterministic Euler step only. This subclass
keeps everything vllm-omni loads and runs (its Qwen3-VL encoder, its VAE, its Boogu transformer port
with its kernels and CFG-parallel branches, its LoRA manager) and replaces the denoising loop with
``boogu_schedule.sampling.sample_windowed``: the very loop the trainer's in-process engine runs. So
the conventions hold by construction (``t = 1 - sigma`` to the transformer, text CFG in float32 on
Boogu velocities, one negation after CFG, float32 latents and log-probs, the SDE window plan, one
random stream per group seeded ``derive_seed(seed, group_offset + g)`` and drawn in the documented
order), and the same weights and seeds give the local engine's trajectory.

A request for it carries ``extra_args["boogu_rl"]`` (see :meth:`BooguSDEPipeline.forward`); any
other request is served by the parent's plain sampler, unchanged. The worker process
(``boogu_vllm.worker``) calls :meth:`BooguSDEPipeline.rollout` directly on CPU, and through
vllm-omni's engine on GPU (``boogu_vllm.omni_backend``).
"""

from __future__ import annotations

import io
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from typing import Any

import PIL.Image
import torch
from vllm_omni.diffusion.data import DiffusionOutput
from vllm_omni.diffusion.models.boogu_image.boogu_image_transformer import (
    BooguImageDoubleStreamRotaryPosEmbed,
)
from vllm_omni.diffusion.models.boogu_image.image_processor import BooguImageProcessor
from vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image import (
    _MAX_INPUT_IMAGE_PIXELS,
    _MAX_INPUT_IMAGE_SIDE_LENGTH,
    _MAX_VLM_INPUT_PIL_PIXELS,
    _MAX_VLM_INPUT_PIL_SIDE_LENGTH,
    BooguImagePipeline,
)

from boogu_protocol import MAX_SEQUENCE_LENGTH, RolloutSpec, pack, ref_image_key, ref_latent_key
from boogu_schedule import (
    BooguScheduleConfig,
    Sampler,
    WindowPlan,
    boogu_sigmas,
    boogu_time,
    combine_guidance,
    guidance_branches,
    text_cfg,
    uses_cfg,
)
from boogu_schedule.guidance import BRANCH_INPUTS
from boogu_schedule.sampling import (
    dedupe,
    draw_windows,
    group_generators,
    initial_noise,
    output_size,
    reference_generator,
    sample_windowed,
)

__all__ = ["RL_KEY", "BooguSDEPipeline", "window_plan"]

RL_KEY = "boogu_rl"
"""The ``sampling_params.extra_args`` key that turns a request into an RL rollout."""


def window_plan(fields: dict[str, Any]) -> WindowPlan:
    """A ``WindowPlan`` from its wire fields (``window_range`` arrives as a JSON list)."""
    fields = dict(fields)
    if fields.get("window_range") is not None:
        fields["window_range"] = tuple(fields["window_range"])
    return WindowPlan(**fields)


def _row_chunks(batch: int, micro_batch_size: int) -> list[slice]:
    """``batch`` rows as consecutive slices of at most ``micro_batch_size`` rows (0 = one slice)."""
    if micro_batch_size < 0:
        raise ValueError(
            f"spec.micro_batch_size must be >= 0 (0 = the whole request), got {micro_batch_size}"
        )
    size = micro_batch_size or batch
    return [slice(j, min(j + size, batch)) for j in range(0, batch, size)]


@dataclass(frozen=True)
class _RolloutGuidance:
    """The ``true_cfg_scale`` an RL rollout hands vllm-omni's multi-branch CFG dispatch: the scales
    and whether the batch edits, so that :meth:`BooguSDEPipeline.combine_multi_branch_cfg_noise`
    combines the branches with the trainer's rule (``boogu_schedule.combine_guidance``)."""

    text: float
    image: float
    edit: bool


class BooguSDEPipeline(BooguImagePipeline):
    """vllm-omni's Boogu pipeline whose RL requests sample with SDE windows and return log-probs."""

    # One RL request is already a batch of groups; the engine must not merge two of them.
    supports_request_batch = False

    def __init__(self, *, od_config, prefix: str = "") -> None:
        super().__init__(od_config=od_config, prefix=prefix)
        model = od_config.model
        # The schedule comes from the checkpoint's raw scheduler config, read by boogu-schedule (the
        # trainer reads the same file the same way), never through a diffusers scheduler object.
        self.schedule_config = BooguScheduleConfig.from_json(
            os.path.join(model, "scheduler", "scheduler_config.json")
        )
        self._reference_processor = BooguImageProcessor(
            vae_scale_factor=self.vae_scale_factor * 2, do_resize=True
        )
        # Set by boogu_vllm.lora.LoraSlot after each load: what the transformer samples with now.
        self.lora_version = 0
        self.lora_fingerprint: str | None = None

    # ---- CFG: Boogu's formula on float32 Boogu velocities ---------------------------------------
    def combine_cfg_noise(
        self, positive_noise_pred, negative_noise_pred, true_cfg_scale, cfg_normalize=False, kwargs=None
    ):
        """Text CFG in float32 (the trainer's ``boogu_schedule.text_cfg``), also under CFG parallel."""
        pos = positive_noise_pred[0] if isinstance(positive_noise_pred, tuple) else positive_noise_pred
        neg = negative_noise_pred[0] if isinstance(negative_noise_pred, tuple) else negative_noise_pred
        if cfg_normalize:
            raise ValueError("BooguSDEPipeline: Boogu's text CFG has no renormalisation")
        return text_cfg(pos.float(), neg.float(), float(true_cfg_scale))

    def combine_multi_branch_cfg_noise(self, predictions, true_cfg_scale, cfg_normalize=False):
        """An RL rollout's branches (``boogu_schedule.guidance_branches``, in order) combined in
        float32 by ``boogu_schedule.combine_guidance``, also under CFG parallel; any other request
        keeps vllm-omni's own combination."""
        if not isinstance(true_cfg_scale, _RolloutGuidance):
            return super().combine_multi_branch_cfg_noise(predictions, true_cfg_scale, cfg_normalize)
        if cfg_normalize:
            raise ValueError("BooguSDEPipeline: Boogu's guidance has no renormalisation")
        values = [(p[0] if isinstance(p, tuple) else p).float() for p in predictions]
        g = true_cfg_scale
        return combine_guidance(values, g.text, g.image, edit=g.edit)

    # ---- the engine entry point ----------------------------------------------------------------
    def forward(self, req) -> list[DiffusionOutput]:
        """RL requests (``extra_args["boogu_rl"] = {"spec": ..., "images": {i: bytes}}``) return one
        ``DiffusionOutput`` whose ``output`` is ``{"boogu_rl": <protocol message bytes>}``; every other
        request goes to vllm-omni's own sampler."""
        sp = req.sampling_params_list[0]
        rl = (getattr(sp, "extra_args", None) or {}).get(RL_KEY)
        if rl is None:
            return super().forward(req)
        if req.num_reqs != 1:
            raise RuntimeError(f"BooguSDEPipeline: RL requests are served one at a time, got {req.num_reqs}")
        spec = RolloutSpec.from_json(rl["spec"])
        images = {int(k): v for k, v in (rl.get("images") or {}).items()}
        meta, tensors = self.rollout(spec, images)
        return [DiffusionOutput(output={RL_KEY: pack(meta, tensors)})]

    # ---- the rollout ---------------------------------------------------------------------------
    def _device(self) -> torch.device:
        return torch.device(self._execution_device)

    @torch.no_grad()
    def rollout(
        self, spec: RolloutSpec, images: dict[int, bytes]
    ) -> tuple[dict[str, Any], dict[str, torch.Tensor]]:
        """One RL rollout: ``len(spec.groups) * spec.group_size`` samples, group-major.

        Returns the protocol's trajectory message: per unique prompt its features (``hidden_states``,
        ``attention_mask``, gathered per sample by ``prompt_rows``), the same for negatives, per
        unique reference its latent (``ref_latent.{u}``, ``ref_rows``), the window tensors, the
        schedule, the final latents and the uint8 images.
        """
        device = self._device()
        timings: dict[str, float] = defaultdict(float)
        n, steps = spec.group_size, spec.num_steps
        num_groups, batch = len(spec.groups), len(spec.groups) * spec.group_size
        cfg = uses_cfg(spec.guidance_scale)
        for g, group in enumerate(spec.groups):
            if group.ref_image is not None and group.ref_image not in images:
                raise ValueError(
                    f"spec.groups[{g}].ref_image = {group.ref_image}, but no {ref_image_key(group.ref_image)} was sent"
                )
        group_gens, batch_gen = group_generators(spec.seed, spec.group_offset, num_groups, device)

        # 1. Prompts: each unique (instruction, reference) once, in one batch (the local engine's way).
        t0 = time.perf_counter()
        decoded: dict[int, PIL.Image.Image] = {
            i: PIL.Image.open(io.BytesIO(data)).convert("RGB") for i, data in images.items()
        }
        keys = [(grp.instruction, grp.ref_image) for grp in spec.groups]
        unique, prompt_rows = dedupe(keys)
        vlm_images = None
        if any(ref is not None for _, ref in unique):
            vlm_images = [None if ref is None else [self._vlm_view(decoded[ref])] for _, ref in unique]
        hidden, mask = self._get_instruction_feature_embeds(
            [instr for instr, _ in unique],
            input_pil_images=vlm_images,
            device=device,
            max_sequence_length=MAX_SEQUENCE_LENGTH,
        )
        tensors: dict[str, torch.Tensor] = {"hidden_states": hidden, "attention_mask": mask}
        if cfg:
            # Negatives are encoded text-only (upstream use_input_images_4_neg_instruct=False).
            negatives, negative_rows = dedupe([grp.negative for grp in spec.groups])
            nh, nm = self._get_instruction_feature_embeds(
                negatives, device=device, max_sequence_length=MAX_SEQUENCE_LENGTH
            )
            tensors.update(negative_hidden_states=nh, negative_attention_mask=nm)
        timings["encode"] += time.perf_counter() - t0

        # 2. Reference latents: once per reference image, from the first group that uses it.
        t0 = time.perf_counter()
        ref_latent: dict[int, torch.Tensor] = {}
        ref_index: dict[int, int] = {}
        sizes: set[tuple[int, int]] = set()
        for g, grp in enumerate(spec.groups):
            if grp.ref_image is None or grp.ref_image in ref_index:
                continue
            pixels = self._reference_processor.preprocess(
                decoded[grp.ref_image],
                max_pixels=_MAX_INPUT_IMAGE_PIXELS,
                max_side_length=_MAX_INPUT_IMAGE_SIDE_LENGTH,
            )
            sizes.add((int(pixels.shape[-2]), int(pixels.shape[-1])))
            ref_index[grp.ref_image] = len(ref_latent)
            # Sampled from the group's stream exactly as the local engine's codec samples it.
            generator = reference_generator(group_gens[g])
            ref_latent[len(ref_latent)] = self._encode_vae_image(
                pixels.to(device), generator=generator
            ).squeeze(0)
        timings["reference"] += time.perf_counter() - t0
        height, width = output_size(spec.height, spec.width, sizes)
        h, w = height // self.vae_scale_factor, width // self.vae_scale_factor
        ref_rows = [-1 if grp.ref_image is None else ref_index[grp.ref_image] for grp in spec.groups]

        # 3. The loop: boogu_schedule's, with this pipeline's transformer as the velocity.
        sigmas = boogu_sigmas(self.schedule_config, steps, num_tokens=h * w).to(device)
        windows = draw_windows(
            window_plan(spec.window), steps, spec.noise_level, spec.iteration, group_gens, batch_gen, n
        )
        x = initial_noise(group_gens, n, (self.transformer.in_channels, h, w), device)
        dtype = next(self.transformer.parameters()).dtype
        rows = torch.tensor([r for r in prompt_rows for _ in range(n)], device=device)
        pos_hidden, pos_mask = hidden[rows].to(dtype), mask[rows]
        neg_hidden = neg_mask = None
        if cfg:
            nrows = torch.tensor([r for r in negative_rows for _ in range(n)], device=device)
            neg_hidden, neg_mask = nh[nrows].to(dtype), nm[nrows]
        refs = None
        if ref_latent:
            refs = [None if r < 0 else [ref_latent[r].to(dtype)] for r in ref_rows for _ in range(n)]
        # The forwards of each step: the trainer's rule (one, text CFG, image or double guidance).
        branches = guidance_branches(spec.guidance_scale, spec.image_guidance_scale, edit=refs is not None)
        guidance = _RolloutGuidance(
            float(spec.guidance_scale), float(spec.image_guidance_scale), refs is not None
        )
        freqs = BooguImageDoubleStreamRotaryPosEmbed.get_freqs_real(
            self.transformer.axes_dim_rope, self.transformer.axes_lens, theta=10000
        )

        # Consecutive row chunks of spec.micro_batch_size (0 = all rows) per transformer call and per
        # VAE decode, as the local engine splits (boogu_adapters.step.boogu_velocity): one call over
        # every latent of a request (128 per rank in the reference recipe) does not fit a GPU.
        chunks = _row_chunks(batch, spec.micro_batch_size)

        def velocity(x: torch.Tensor, sigma: torch.Tensor, i: int) -> torch.Tensor:
            t = boogu_time(sigma).to(dtype)
            latents = x.to(dtype)
            parts = []
            for rows in chunks:
                kwargs = []
                for branch in branches:
                    # drop_text keeps the reference latents (upstream's text-only TI2I guidance);
                    # drop_image and drop_all take none (its image guidance).
                    positive, keeps_refs = BRANCH_INPUTS[branch]
                    hidden_states, attention_mask = (
                        (pos_hidden, pos_mask) if positive else (neg_hidden, neg_mask)
                    )
                    kwargs.append(
                        dict(
                            t=t[rows],
                            latents=latents[rows],
                            instruction_embeds=hidden_states[rows],
                            freqs_real=freqs,
                            instruction_attention_mask=attention_mask[rows],
                            ref_image_hidden_states=refs[rows] if (refs is not None and keeps_refs) else None,
                        )
                    )
                if len(kwargs) == 1:
                    v = self.predict_noise_maybe_with_cfg(
                        do_true_cfg=False,
                        true_cfg_scale=1.0,
                        positive_kwargs=kwargs[0],
                        negative_kwargs=None,
                        cfg_normalize=False,
                    )
                else:
                    v = self.predict_noise_with_multi_branch_cfg(
                        do_true_cfg=True, true_cfg_scale=guidance, branches_kwargs=kwargs, cfg_normalize=False
                    )
                parts.append((v[0] if isinstance(v, tuple) else v).float())
            return parts[0] if len(parts) == 1 else torch.cat(parts)

        t0 = time.perf_counter()
        out = sample_windowed(
            velocity, x, sigmas, windows, group_gens, n, Sampler(spec.sampler), spec.noise_level
        )
        timings["denoise"] += time.perf_counter() - t0
        tensors.update(
            latents=out.latents,
            step_index=out.step_index,
            log_prob=out.log_prob,
            mean=out.mean,
            std=out.std,
            final_latents=out.final,
            sigmas=sigmas,
            prompt_rows=torch.tensor(prompt_rows, dtype=torch.long),
            ref_rows=torch.tensor(ref_rows, dtype=torch.long),
        )
        if cfg:
            tensors["negative_rows"] = torch.tensor(negative_rows, dtype=torch.long)
        for u, z in ref_latent.items():
            tensors[ref_latent_key(u)] = z

        # 4. Decode, as the trainer's codec does: (z / scale + shift) -> VAE -> uint8.
        if spec.decode:
            t0 = time.perf_counter()
            tensors["images"] = torch.cat([self._decode_uint8(out.final[rows]) for rows in chunks])
            timings["decode"] += time.perf_counter() - t0
        meta = {
            "window": [[win.start, win.end] for win in windows],
            "weights_version": self.lora_version,
            "lora_fingerprint": self.lora_fingerprint,
            "nfe": batch * steps * len(branches),
            "size": [height, width],
            "timings": dict(timings),
        }
        return meta, tensors

    def _vlm_view(self, image: PIL.Image.Image) -> PIL.Image.Image:
        """The reference as the Qwen3-VL encoder sees it (vllm-omni's pre-process, upstream's resize)."""
        height, width = self._reference_processor.get_new_height_width(
            image, None, None, _MAX_VLM_INPUT_PIL_PIXELS, _MAX_VLM_INPUT_PIL_SIDE_LENGTH
        )
        return self._reference_processor.resize(image, height, width)

    def _decode_uint8(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) float32 scaled latents to (B, 3, H, W) uint8 (diffusers' postprocess rounding)."""
        z = latents.to(self.vae.dtype)
        if self.vae.config.scaling_factor is not None:
            z = z / self.vae.config.scaling_factor
        if self.vae.config.shift_factor is not None:
            z = z + self.vae.config.shift_factor
        with self._vae_attention_context(z.device):
            image = self.vae.decode(z, return_dict=False)[0]
        image = (image.float() / 2 + 0.5).clamp(0, 1)
        return (image * 255).round().to(torch.uint8).cpu()
