"""Rollout engines: turn prompts into trajectories with per-step log-probabilities.

``LocalRolloutEngine`` runs the Boogu denoising loop in-process with the very module the trainer
trains, on CPU or GPU. Every step goes through :func:`boogu_adapters.step.boogu_velocity` and
``boogu_schedule.sde_step``, the same functions the training adapter uses, so the on-policy ratio
is exactly 1.

What it does that the reference integration does not: each prompt (and its negative) is encoded
once per group, not once per sample; the n samples of a group are batched; positive and negative
forwards run as one batched forward; reference latents are encoded once per prompt and shared by
the group; one SDE window per group by default. Work that does not change from step to step runs
once: the transformer's text path (caption embedder and context refiner) once per rollout, not
once per denoising step (`RolloutTextCache`), and a prompt batch the encoder has seen, such as the
negative ``[""]`` of every step, comes from its cache (`components.QwenPromptEncoder`). Neither
changes a number.
"""

from __future__ import annotations

import copy
import time
from collections import defaultdict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol, runtime_checkable

import torch

from boogu_adapters.lora import (
    WeightSyncError,
    check_lora_keys,
    load_lora_state_dict,
    lora_file_keys,
    lora_fingerprint,
    lora_state_dict,
)
from boogu_adapters.step import CfgMode, RolloutTextCache, boogu_velocity, forwards_per_step
from boogu_adapters.types import Conditioning, RolloutRequest, Trajectory
from boogu_data import PromptRecord
from boogu_schedule import BooguScheduleConfig, boogu_sigmas, uses_cfg
from boogu_schedule.sampling import (
    dedupe,
    draw_windows,
    group_generators,
    initial_noise,
    output_size,
    sample_windowed,
)


@runtime_checkable
class RolloutEngine(Protocol):
    """What the trainer needs from a rollout backend."""

    def generate(self, request: RolloutRequest) -> Trajectory: ...

    def sync_weights(
        self,
        version: int,
        lora_state: Mapping[str, torch.Tensor] | None = None,
        *,
        module: torch.nn.Module | None = None,
    ) -> None:
        """Make the engine sample with the trainer's weights from now on, as ``version``.

        An engine that holds the trainer's own module (``module`` is it) only records the version; one
        that holds a copy needs the full LoRA state (``lora_state``, file keys) and verifies what it applied.
        """
        ...

    @property
    def needs_lora_state(self) -> bool:
        """Whether ``sync_weights`` needs the full LoRA tensors (the engine holds its own copy)."""
        ...

    @property
    def weights_version(self) -> int: ...

    def close(self) -> None: ...


@runtime_checkable
class RelabelableEngine(RolloutEngine, Protocol):
    """An engine whose weight version a caller can put back (the preflight does, after perturbing
    and restoring the weights): it keeps a log of its syncs and can be relabelled, and its run-time
    state (version, sync log, counters) round-trips through ``state_dict``. Both engines of this
    package are (`EngineBookkeeping`)."""

    sync_log: list[tuple[int, str]]
    """``(version, fingerprint)`` of every sync, in order."""

    def relabel(self, version: int) -> None:
        """Call the weights the engine holds ``version`` (the caller restored that version's weights)."""
        ...

    def state_dict(self) -> dict[str, Any]:
        """A copy of the engine's run-time state: weights version, sync log, counters."""
        ...

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Put back a `state_dict` (the caller restored that version's weights)."""
        ...


class PromptEncoder(Protocol):
    """Instructions (and optional reference images for the VLM) to padded instruction features."""

    def __call__(
        self, instructions: Sequence[str], images: Sequence[bytes | None] | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Returns ``(hidden (P, L, D), mask (P, L))``, right-padded, one row per instruction."""
        ...


class ImageCodec(Protocol):
    """The VAE side: reference images to scaled latents, final latents to uint8 images."""

    def encode_references(self, images: Sequence[bytes], generator: torch.Generator) -> list[torch.Tensor]:
        """Per image a (C, h, w) scaled latent ``(z - shift) * scale``, sampled with ``generator``."""
        ...

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """(B, C, h, w) float32 scaled latents to (B, 3, H, W) uint8 images."""
        ...

    def latent_size(self, height: int, width: int) -> tuple[int, int]: ...

    def reference_size(self, image: bytes) -> tuple[int, int]:
        """The output (height, width) an edit row's reference dictates (docs/upstream-model.md §9.6)."""
        ...


@dataclass
class EngineStats:
    """Counters and wall times (seconds) since the engine was built."""

    prompts_encoded: int = 0
    """Positive prompts encoded (once per unique prompt of a request, not per sample)."""
    negatives_encoded: int = 0
    """Negative prompts encoded (once per unique negative of a request)."""
    encoder_calls: int = 0
    reference_images_encoded: int = 0
    transformer_calls: int = 0
    transformer_sample_forwards: int = 0
    images_decoded: int = 0
    samples: int = 0
    seconds: dict[str, float] = field(default_factory=lambda: defaultdict(float))
    pending: list[tuple[str, Any, Any]] = field(default_factory=list)
    """CUDA (key, start event, end event) not yet added to ``seconds`` (see :meth:`settle`)."""

    def settle(self) -> None:
        """Add the recorded CUDA event pairs to ``seconds`` (waits for the last one)."""
        if self.pending:
            self.pending[-1][2].synchronize()
            for key, start, end in self.pending:
                self.seconds[key] += start.elapsed_time(end) / 1000.0
            self.pending.clear()

    def as_dict(self) -> dict[str, Any]:
        self.settle()
        d = {k: v for k, v in self.__dict__.items() if k not in ("seconds", "pending")}
        d.update({f"time/{k}": v for k, v in self.seconds.items()})
        return d


class EngineBookkeeping:
    """The run-time state of an engine of this package: the version of the weights it holds, the log
    of its syncs and its counters (`RelabelableEngine`)."""

    stats: EngineStats
    sync_log: list[tuple[int, str]]
    _version: int

    def relabel(self, version: int) -> None:
        """Call the current weights ``version`` (a caller put back weights equal to that version's,
        as the preflight does after its sync check)."""
        self._version = version

    def state_dict(self) -> dict[str, Any]:
        return {
            "weights_version": self._version,
            "sync_log": list(self.sync_log),
            "stats": copy.deepcopy(self.stats),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.relabel(int(state["weights_version"]))
        self.sync_log[:] = state["sync_log"]
        self.stats = copy.deepcopy(state["stats"])


class _Timer:
    """Wall time of a block into ``stats.seconds[key]``; on CUDA, GPU time between two events.

    CUDA timings are read in :meth:`EngineStats.settle` (after the loop), never inside it: a
    synchronize per timed call would stall the GPU's queue on every denoising step.
    """

    def __init__(self, stats: EngineStats, key: str, device: torch.device):
        self.stats, self.key, self.device = stats, key, device

    def __enter__(self):
        if self.device.type == "cuda":
            self.start = torch.cuda.Event(enable_timing=True)
            self.start.record()
        else:
            self.t0 = time.perf_counter()

    def __exit__(self, *exc):
        if self.device.type == "cuda":
            end = torch.cuda.Event(enable_timing=True)
            end.record()
            self.stats.pending.append((self.key, self.start, end))
        else:
            self.stats.seconds[self.key] += time.perf_counter() - self.t0


class LocalRolloutEngine(EngineBookkeeping):
    """In-process rollouts with the trainer's own transformer module.

    Args:
        transformer: the Boogu transformer (LoRA-injected or not); shared with the trainer.
        encode_prompts: a :class:`PromptEncoder`.
        codec: an :class:`ImageCodec` (VAE), or None for latent-only rollouts (no edit, no images).
        schedule_config: the checkpoint's scheduler config (read raw, never through diffusers).
        freqs_cis: the RoPE tables (``get_freqs_cis(axes_dim_rope, axes_lens, 10000)``).
        cfg_mode: ``"batched"`` (one forward for positive and negative) or ``"sequential"``.
        latent_channels: the transformer's ``in_channels``.
        shares_module: the transformer is the trainer's own module (the default local set-up):
            ``sync_weights`` then checks the module's identity instead of copying.
        micro_batch_size: at most this many latents per transformer call and per VAE decode
            (0 = the whole batch). Per-sample results do not depend on it beyond float rounding.
        cache_text_path: hand the transformer a :class:`~boogu_adapters.step.RolloutTextCache` for
            each rollout, so the text path (caption embedder, context refiner) runs once per rollout
            rather than once per denoising step; results are bitwise the same either way.
    """

    def __init__(
        self,
        transformer: torch.nn.Module,
        *,
        encode_prompts: PromptEncoder,
        codec: ImageCodec | None,
        schedule_config: BooguScheduleConfig,
        freqs_cis: Sequence[torch.Tensor],
        latent_channels: int = 16,
        cfg_mode: CfgMode = "batched",
        device: torch.device | str | None = None,
        on_step: Callable[[int, int], None] | None = None,
        shares_module: bool = False,
        micro_batch_size: int = 0,
        cache_text_path: bool = True,
    ):
        self.transformer = transformer
        self.encode_prompts = encode_prompts
        self.codec = codec
        self.schedule_config = schedule_config
        self.freqs_cis = list(freqs_cis)
        self.latent_channels = latent_channels
        self.cfg_mode = cfg_mode
        self.device = torch.device(device) if device is not None else next(transformer.parameters()).device
        self.on_step = on_step
        self.shares_module = shares_module
        if micro_batch_size < 0:
            raise ValueError(f"micro_batch_size must be >= 0 (0 = no split), got {micro_batch_size}")
        self.micro_batch_size = micro_batch_size
        self.cache_text_path = cache_text_path
        self.stats = EngineStats()
        self._version = 0
        self.sync_log: list[tuple[int, str]] = []

    # ---- weights -------------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        return self._version

    @property
    def needs_lora_state(self) -> bool:
        return not self.shares_module

    def sync_weights(
        self,
        version: int,
        lora_state: Mapping[str, torch.Tensor] | None = None,
        *,
        module: torch.nn.Module | None = None,
    ) -> None:
        """Adopt the trainer's weights as ``version`` (strictly newer than the current one).

        When the engine shares the trainer's module there is nothing to copy: it checks that ``module``
        is the very module it samples with (a different object would mean rollouts from stale weights)
        and records the version. Otherwise ``lora_state`` (file keys, full tensors) is loaded; its key
        set must equal the module's LoRA key set (a trained adapter the engine does not use is an error,
        never a silent no-op: the reference's prefix-scoped sync lost such adapters), and what the
        module then holds must fingerprint equal to what was sent. Each sync is recorded in ``sync_log``
        as ``(version, fingerprint or "shared")``.
        """
        if version <= self._version and self.sync_log:
            raise WeightSyncError(f"sync: version {version} is not newer than {self._version}")
        if self.shares_module:
            if module is not self.transformer:
                raise WeightSyncError(
                    f"sync v{version}: the engine shares the trainer's module, but was handed "
                    f"{'no module' if module is None else 'a different module'}; its rollouts would use stale weights"
                )
            self._version = version
            self.sync_log.append((version, "shared"))
            return
        if lora_state is None:
            raise WeightSyncError(f"sync v{version}: this engine holds its own copy and needs the LoRA state")
        check_lora_keys(lora_file_keys(self.transformer), set(lora_state))
        sent = lora_fingerprint(lora_state)
        load_lora_state_dict(self.transformer, lora_state)
        applied = lora_fingerprint(lora_state_dict(self.transformer))
        if applied != sent:
            raise WeightSyncError(f"sync v{version}: engine holds {applied}, trainer sent {sent}")
        self._version = version
        self.sync_log.append((version, sent))

    def close(self) -> None:
        self.transformer = None  # type: ignore[assignment]

    # ---- encoding ------------------------------------------------------------------------------
    def _timer(self, key: str) -> _Timer:
        return _Timer(self.stats, key, self.device)

    def encode(
        self,
        records: Sequence[PromptRecord],
        group_size: int,
        guidance_scale: float,
        generators: Sequence[torch.Generator],
    ) -> Conditioning:
        """Conditioning for ``len(records) * group_size`` samples, encoding each unique input once."""
        with self._timer("encode"):
            keys = [(r.instruction, r.ref_image) for r in records]
            unique, idx = dedupe(keys)
            hidden, mask = self.encode_prompts([k[0] for k in unique], [k[1] for k in unique])
            # Valid tokens per prompt, read to the host once here (not in every forward).
            lengths = mask.sum(dim=1).tolist()
            self.stats.encoder_calls += 1
            self.stats.prompts_encoded += len(unique)
            sample_rows = torch.tensor(idx, device=hidden.device).repeat_interleave(group_size)
            neg_hidden = neg_mask = neg_lengths = None
            if uses_cfg(guidance_scale):
                # Negatives are encoded text-only (upstream use_input_images_4_neg_instruct=False).
                negs, neg_idx = dedupe([r.negative for r in records])
                nh, nm = self.encode_prompts(negs, None)
                self.stats.encoder_calls += 1
                self.stats.negatives_encoded += len(negs)
                rows = torch.tensor(neg_idx, device=nh.device).repeat_interleave(group_size)
                neg_hidden, neg_mask = nh[rows], nm[rows]
                per_negative = nm.sum(dim=1).tolist()
                neg_lengths = tuple(per_negative[i] for i in neg_idx for _ in range(group_size))
            refs = None
            if any(r.ref_image is not None for r in records):
                if self.codec is None:
                    raise ValueError("edit rows need a VAE codec to encode their reference images")
                # Sampled once per prompt from that group's stream, and shared by the group.
                per_record: list[torch.Tensor | None] = []
                seen: dict[bytes, torch.Tensor] = {}
                for r, gen in zip(records, generators):
                    if r.ref_image is None:
                        per_record.append(None)
                        continue
                    if r.ref_image not in seen:
                        (seen[r.ref_image],) = self.codec.encode_references([r.ref_image], gen)
                        self.stats.reference_images_encoded += 1
                    per_record.append(seen[r.ref_image].to(self.device))
                refs = tuple(ref for ref in per_record for _ in range(group_size))
        return Conditioning(
            hidden_states=hidden[sample_rows],
            attention_mask=mask[sample_rows],
            negative_hidden_states=neg_hidden,
            negative_attention_mask=neg_mask,
            ref_latents=refs,
            lengths=tuple(lengths[i] for i in idx for _ in range(group_size)),
            negative_lengths=neg_lengths,
        )

    def _output_size(self, request: RolloutRequest) -> tuple[int, int]:
        sizes = (
            {self.codec.reference_size(r.ref_image) for r in request.records if r.ref_image is not None}
            if self.codec
            else set()
        )
        return output_size(request.height, request.width, sizes)

    # ---- the denoising loop --------------------------------------------------------------------
    def _calls_per_step(self, batch: int, branches: int) -> int:
        mb = self.micro_batch_size or batch
        chunks = -(-batch // mb)
        return chunks * (branches if self.cfg_mode != "batched" else 1)

    @torch.no_grad()
    def generate(self, request: RolloutRequest) -> Trajectory:
        if self.transformer is None:
            raise RuntimeError("the engine is closed")
        n, steps = request.group_size, request.num_steps
        num_prompts, batch = len(request.records), request.batch_size
        if num_prompts == 0:
            raise ValueError("RolloutRequest has no records")
        # One stream per group (and one for the batch), used in the order boogu_schedule.sampling
        # documents: reference latents (in encode), window, initial noise, SDE noise.
        group_gens, batch_gen = group_generators(request.seed, request.group_offset, num_prompts, self.device)
        cond = self.encode(request.records, n, request.guidance_scale, group_gens)

        height, width = self._output_size(request)
        h, w = self.codec.latent_size(height, width) if self.codec else (height // 8, width // 8)
        # Static schedules ignore num_tokens; dynamic ones use the latent area (latent pixels).
        sigmas = boogu_sigmas(self.schedule_config, steps, num_tokens=h * w).to(self.device)
        windows = draw_windows(
            request.window, steps, request.noise_level, request.iteration, group_gens, batch_gen, n
        )
        group_of = torch.arange(num_prompts, device=self.device).repeat_interleave(n)
        x = initial_noise(group_gens, n, (self.latent_channels, h, w), self.device)
        # The conditioning and the weights are fixed for the whole rollout: every step shares its inputs.
        text_cache = RolloutTextCache() if self.cache_text_path else None
        guidance = (request.guidance_scale, request.image_guidance_scale)
        per_step = forwards_per_step(batch, *guidance, edit=cond.is_edit)

        def velocity(x: torch.Tensor, sigma: torch.Tensor, i: int) -> torch.Tensor:
            with self._timer("transformer"):
                v = boogu_velocity(
                    self.transformer,
                    x,
                    sigma,
                    cond,
                    request.guidance_scale,
                    self.freqs_cis,
                    cfg_mode=self.cfg_mode,
                    micro_batch_size=self.micro_batch_size,
                    text_cache=text_cache,
                    image_guidance_scale=request.image_guidance_scale,
                )
            self.stats.transformer_calls += self._calls_per_step(batch, per_step // batch)
            self.stats.transformer_sample_forwards += per_step
            return v

        out = sample_windowed(
            velocity, x, sigmas, windows, group_gens, n, request.sampler, request.noise_level, self.on_step
        )
        x = out.final

        images = None
        if request.decode:
            if self.codec is None:
                raise ValueError("decode=True needs a VAE codec")
            with self._timer("decode"):
                mb = self.micro_batch_size or batch
                images = torch.cat([self.codec.decode(x[j : j + mb]) for j in range(0, batch, mb)])
            self.stats.images_decoded += batch
        self.stats.samples += batch
        self.stats.settle()
        return Trajectory(
            latents=out.latents,
            step_index=out.step_index,
            sigmas=sigmas,
            log_prob=out.log_prob,
            mean=out.mean,
            std=out.std,
            window=tuple((win.start, win.end) for win in windows),
            group_id=group_of + request.group_offset,
            conditioning=cond,
            final_latents=x,
            images=images,
            nfe=per_step * steps,
            sampler=request.sampler,
            noise_level=request.noise_level,
            guidance_scale=request.guidance_scale,
            image_guidance_scale=request.image_guidance_scale,
            weights_version=self._version,
            cfg_mode=self.cfg_mode,
        )
