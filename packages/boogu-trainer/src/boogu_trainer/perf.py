"""FLOP and MFU accounting of a training step: peak TFLOPs per device, and a no-sync FLOP meter.

* :func:`peak_tflops` gives the dense peak of one device for a compute dtype: a table by GPU name
  (:data:`GPU_PEAK_TFLOPS`, vendor datasheets, dense - no 2:4 sparsity), a measured matmul rate for
  an unknown GPU (with a warning) and for the CPU (cached per process), or ``perf.peak_tflops``.
* :class:`FlopMeter` hooks the transformer's forward and books each call's FLOPs from
  ``boogu_adapters.model.flops`` (the analytic count, per sample without padding; checked against
  ``FlopCounterMode`` in ``tests/adapters/test_flops.py``). It reads the call's
  ``transformer.last_layout`` (host ints), so it never reads a device tensor nor synchronises.

Example (what the trainer does each step)::

    meter = FlopMeter(transformer)                       # after add_lora / gradient checkpointing
    peak = peak_tflops(device, compute_dtype, config.perf.peak_tflops)
    t0 = time.perf_counter()
    ...  # rollout (no grad), then the update (forwards under grad + backward)
    record |= step_perf(meter.take(), time.perf_counter() - t0, images=len(samples), peak=peak)
    # record["perf/tflops"], ["perf/tflops_rollout"], ["perf/tflops_train"], ["perf/mfu"], ...
    meter.close()                                        # removes the hooks

Counted per forward call: a call under ``torch.is_grad_enabled()`` is a training forward and adds its
LoRA backward and, when ``transformer.gradient_checkpointing`` is on, the recompute
(``FlopModel.training``); any other call is a rollout or reference forward (``FlopModel.forward``,
without the LoRA FLOPs when the adapters are disabled). The numbers are this process's (this rank's)
FLOPs; MFU divides by this device's peak.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn

from boogu_adapters.model.flops import FlopModel, lora_ranks_from_model
from boogu_adapters.model.layout import TokenLayout
from boogu_schedule import guidance_branches
from boogu_schedule.guidance import BRANCH_INPUTS
from boogu_schedule.seeding import make_generator

__all__ = [
    "GPU_PEAK_TFLOPS",
    "FlopMeter",
    "GpuPeak",
    "lookup_gpu_peak",
    "measure_matmul_tflops",
    "peak_tflops",
    "step_perf",
]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class GpuPeak:
    """Dense peak TFLOPs of one GPU: 16-bit tensor cores, TF32 tensor cores, plain FP32."""

    bf16: float
    tf32: float | None
    fp32: float
    fp16: float | None = None  # None: same as bf16

    def for_dtype(self, dtype: torch.dtype, tf32_enabled: bool) -> float:
        if dtype == torch.float16:
            return self.fp16 or self.bf16
        if dtype == torch.bfloat16:
            return self.bf16
        if dtype == torch.float32 and tf32_enabled and self.tf32:
            return self.tf32
        return self.fp32


GPU_PEAK_TFLOPS: tuple[tuple[str, str, GpuPeak], ...] = (
    # (regex searched in torch.cuda.get_device_name, label, peak). First match wins: specific first.
    (r"GB200", "GB200 (per GPU)", GpuPeak(bf16=2500.0, tf32=1250.0, fp32=80.0)),
    (r"B200", "B200", GpuPeak(bf16=2250.0, tf32=1100.0, fp32=80.0)),
    (r"H200.*NVL", "H200 NVL", GpuPeak(bf16=835.0, tf32=418.0, fp32=60.0)),
    (r"H200", "H200 SXM", GpuPeak(bf16=989.4, tf32=494.7, fp32=66.9)),
    (r"\bH20\b", "H20", GpuPeak(bf16=148.0, tf32=74.0, fp32=44.0)),
    (r"H100.*PCIe", "H100 PCIe", GpuPeak(bf16=756.0, tf32=378.0, fp32=51.2)),
    (r"H100.*NVL", "H100 NVL", GpuPeak(bf16=835.0, tf32=418.0, fp32=60.0)),
    (r"H100|H800", "H100 SXM / H800", GpuPeak(bf16=989.4, tf32=494.7, fp32=66.9)),
    (r"A100|A800", "A100 / A800", GpuPeak(bf16=312.0, tf32=156.0, fp32=19.5)),
    (r"\bA10\b", "A10", GpuPeak(bf16=125.0, tf32=62.5, fp32=31.2)),
    (r"L40S", "L40S", GpuPeak(bf16=362.1, tf32=183.0, fp32=91.6)),
    (r"\bL40\b", "L40", GpuPeak(bf16=181.0, tf32=90.5, fp32=90.5)),
    (r"\bL4\b", "L4", GpuPeak(bf16=121.0, tf32=60.0, fp32=30.3)),
    (r"RTX 6000 Ada", "RTX 6000 Ada", GpuPeak(bf16=364.2, tf32=182.1, fp32=91.1)),
    # GeForce: 16-bit tensor rate with fp32 accumulation (what PyTorch uses) is half the fp16-acc rate.
    (r"RTX 4090", "RTX 4090", GpuPeak(bf16=165.2, tf32=82.6, fp32=82.6)),
    (r"RTX 3090", "RTX 3090", GpuPeak(bf16=71.0, tf32=35.6, fp32=35.6)),
    (r"V100", "V100", GpuPeak(bf16=15.7, tf32=None, fp32=15.7, fp16=125.0)),  # no bf16 tensor cores
    (r"\bT4\b", "T4", GpuPeak(bf16=8.1, tf32=None, fp32=8.1, fp16=65.0)),
    (r"MI325X|MI300X", "MI300X / MI325X", GpuPeak(bf16=1307.4, tf32=653.7, fp32=163.4)),
    (r"MI250X", "MI250X", GpuPeak(bf16=383.0, tf32=None, fp32=95.7)),
)
"""Dense (non-sparse) peak TFLOPs by device name, from the vendors' datasheets (SXM/OAM boards at
their default power unless the name says otherwise)."""


def lookup_gpu_peak(name: str) -> tuple[str, GpuPeak] | None:
    """The table entry (label, peak) whose pattern matches a device name, or None."""
    for pattern, label, peak in GPU_PEAK_TFLOPS:
        if re.search(pattern, name, flags=re.IGNORECASE):
            return label, peak
    return None


_MEASURED: dict[tuple[str, str], float] = {}


def measure_matmul_tflops(device: torch.device, dtype: torch.dtype, budget_s: float = 0.3) -> float:
    """Best matmul rate seen in about ``budget_s`` seconds of square matmuls; cached per process.

    On CPU it times 512² (or 1024² float32) products; on CUDA 8192² ones with events (this one
    measurement synchronises). A lower bound of the true peak, good enough for an MFU estimate.
    """
    device = torch.device(device)
    key = (str(device), str(dtype))
    if key in _MEASURED:
        return _MEASURED[key]
    # Its own generator: a draw from the global RNG here would shift the stream of a user's reward
    # in the first step of every process, so a resumed run would differ from an uninterrupted one.
    generator = make_generator(0, device)
    if device.type == "cuda":
        n, reps = 8192, 5
        a = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        b = torch.randn(n, n, device=device, dtype=dtype, generator=generator)
        a @ b  # warm-up (cuBLAS handle, heuristics)
        torch.cuda.synchronize(device)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(reps):
            a @ b
        end.record()
        end.synchronize()
        rate = 2 * n**3 * reps / (start.elapsed_time(end) / 1e3) / 1e12
    else:
        n = 1024 if dtype in (torch.float32, torch.float64) else 512
        a = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
        b = torch.randn(n, n, dtype=dtype, device=device, generator=generator)
        a @ b
        best, deadline = 0.0, time.perf_counter() + budget_s
        while time.perf_counter() < deadline:
            t0 = time.perf_counter()
            a @ b
            best = max(best, 2 * n**3 / max(time.perf_counter() - t0, 1e-9))
        rate = best / 1e12
    _MEASURED[key] = rate
    return rate


def peak_tflops(device: torch.device, dtype: torch.dtype, override: float | None = None) -> float:
    """Dense peak TFLOPs of ``device`` for matmuls in ``dtype`` (``perf.peak_tflops`` wins if set).

    CUDA: the :data:`GPU_PEAK_TFLOPS` entry of ``torch.cuda.get_device_name`` (float32 reads the TF32
    rate when ``torch.backends.cuda.matmul.allow_tf32`` is on, e.g. ``model.tf32``); an unknown name
    logs a warning and returns a measured matmul rate. CPU (and anything else): the measured rate,
    cached per process (under 0.5 s the first time).
    """
    if override is not None:
        return float(override)
    device = torch.device(device)
    if device.type == "cuda":
        name = torch.cuda.get_device_name(device)
        entry = lookup_gpu_peak(name)
        if entry is not None:
            return entry[1].for_dtype(dtype, torch.backends.cuda.matmul.allow_tf32)
        rate = measure_matmul_tflops(device, dtype)
        logger.warning(
            "perf: no peak TFLOPs known for GPU %r; using a measured %s matmul rate of %.0f TFLOPs "
            "for perf/mfu (set perf.peak_tflops to the datasheet's dense value instead)",
            name,
            str(dtype).removeprefix("torch."),
            rate,
        )
        return rate
    return measure_matmul_tflops(device, dtype)


def step_perf(
    taken: Mapping[str, float], step_seconds: float, *, images: int, peak: float
) -> dict[str, float]:
    """``taken`` (:meth:`FlopMeter.take`) plus ``perf/mfu`` and ``perf/tflops_per_image``.

    ``perf/mfu = perf/tflops / (step_seconds · peak)`` (peak in TFLOPs of one device, as this
    process's FLOPs are one device's); ``perf/tflops_per_image`` divides by the images this process
    trained on (0 when none).
    """
    out = dict(taken)
    tflops = float(taken.get("perf/tflops", 0.0))
    out["perf/mfu"] = tflops / (step_seconds * peak) if step_seconds > 0 and peak > 0 else 0.0
    out["perf/tflops_per_image"] = tflops / images if images > 0 else 0.0
    out["perf/tflops_per_s"] = tflops / step_seconds if step_seconds > 0 else 0.0
    return out


def unwrap_transformer(module: nn.Module) -> nn.Module:
    """The transformer inside wrappers that keep it as ``.module`` (DDP) or ``.model`` (peft)."""
    for attr in ("module", "model"):
        inner = getattr(module, attr, None)
        if isinstance(inner, nn.Module) and hasattr(inner, "config"):
            return inner
    return module


class FlopMeter:
    """Books every transformer forward's FLOPs from forward hooks; :meth:`take` returns and resets.

    Args:
        transformer: the (LoRA-injected) ``BooguImageTransformer2DModel``; hooks are registered on it.
        lora: what ``FlopModel`` takes; default: the ranks of the peft layers found on the module.
        attention_recompute: book attention backward at 2.5x its forward (the fused kernels'
            recompute) instead of the model-FLOPs 2x.

    The layout of a call is ``transformer.last_layout`` (set by the forward); when the model has no
    such attribute it is rebuilt from the call's arguments, using the instruction mask only if it
    is on the CPU (a device mask is not read: the padded width is booked instead, with a warning).
    """

    def __init__(
        self,
        transformer: nn.Module,
        *,
        lora: Any = None,
        attention_recompute: bool = False,
    ) -> None:
        self.transformer = transformer
        model = unwrap_transformer(transformer)
        ranks = lora if lora is not None else lora_ranks_from_model(model, include_disabled=True)
        self._with_lora = FlopModel(model.config, ranks)
        self._without_lora = FlopModel(model.config, None)
        self._lora_layers = [m for m in model.modules() if hasattr(m, "disable_adapters") and hasattr(m, "r")]
        self.attention_recompute = attention_recompute
        self._warned = False
        self._patch = int(model.config.patch_size)
        self._rollout = 0
        self._train = 0
        self._remote = 0
        self._forwards = 0
        self._train_forwards = 0
        self._samples = 0
        self._handle = transformer.register_forward_hook(self._hook, with_kwargs=True)

    # ---- hooks ---------------------------------------------------------------------------------
    def _layout(self, module: nn.Module, args: tuple, kwargs: dict) -> TokenLayout | None:
        layout = getattr(unwrap_transformer(module), "last_layout", None)
        if layout is not None:
            return layout
        return self._layout_from_inputs(module, args, kwargs)

    def _layout_from_inputs(self, module: nn.Module, args: tuple, kwargs: dict) -> TokenLayout | None:
        names = ("hidden_states", "timestep", "instruction_hidden_states", "freqs_cis")
        names += ("instruction_attention_mask", "ref_image_hidden_states")
        bound = dict(zip(names, args, strict=False)) | kwargs
        latents = bound.get("hidden_states")
        if latents is None:
            return None
        p = int(unwrap_transformer(module).config.patch_size)
        targets = list(latents.unbind(0)) if isinstance(latents, torch.Tensor) else list(latents)
        batch = len(targets)
        feats = bound.get("instruction_hidden_states")
        feats = feats[0] if isinstance(feats, (list, tuple)) else feats
        width = int(feats.shape[1]) if feats is not None else 0
        mask = bound.get("instruction_attention_mask")
        if mask is None:
            text = [width] * batch
        elif mask.device.type == "cpu":
            text = [int(v) for v in mask.to(torch.bool).sum(dim=1).tolist()]
        else:
            if not self._warned:
                logger.warning(
                    "perf: the transformer has no last_layout and the instruction mask is on %s; "
                    "booking the padded text width (an overestimate) rather than synchronising",
                    mask.device,
                )
                self._warned = True
            text = [width] * batch
        refs_in = bound.get("ref_image_hidden_states") or [None] * batch
        refs = [[(r.shape[-2] // p, r.shape[-1] // p) for r in (rs or [])] for rs in refs_in]
        grids = [(t.shape[-2] // p, t.shape[-1] // p) for t in targets]
        return TokenLayout(text_lengths=text, target_grids=grids, reference_grids=refs)

    def _hook(self, module: nn.Module, args: tuple, kwargs: dict, output: Any) -> None:
        layout = self._layout(module, args, kwargs)
        if layout is None:
            return
        # peft switches adapters off layer by layer (the reference pass); the first layer tells.
        lora_on = not self._lora_layers or not self._lora_layers[0].disable_adapters
        model = self._with_lora if lora_on else self._without_lora
        self._forwards += 1
        self._samples += len(layout.text_lengths)
        if torch.is_grad_enabled():
            checkpointing = bool(getattr(unwrap_transformer(module), "gradient_checkpointing", False))
            flops = model.training(
                layout, gradient_checkpointing=checkpointing, attention_recompute=self.attention_recompute
            ).total
            self._train += flops
            self._train_forwards += 1
        else:
            # A rollout's later denoising steps reuse the text path of its first (InstructionCache).
            reused = bool(getattr(unwrap_transformer(module), "last_text_path_reused", False))
            self._rollout += model.forward(layout, text_path=not reused).total

    def book_remote_rollout(self, trajectory: Any) -> None:
        """Book the model FLOPs of a rollout another process ran (the vllm-omni worker), from the
        ``trajectory``'s layout: each of its N steps runs every sample's forward once per guidance
        branch (``boogu_schedule.guidance_branches``: the positive one; with CFG the negative prompt's
        tokens; with image guidance the same without the references). The LoRA's
        FLOPs count once the worker serves trained weights (``weights_version`` > 0). They go to
        ``perf/tflops_worker``, not to this process's ``perf/tflops`` (nor its MFU)."""
        cond = trajectory.conditioning
        p = self._patch
        batch = trajectory.final_latents.shape[0]
        grid = (int(trajectory.final_latents.shape[-2]) // p, int(trajectory.final_latents.shape[-1]) // p)
        refs_in = cond.ref_latents or (None,) * batch
        refs = [[] if r is None else [(int(r.shape[-2]) // p, int(r.shape[-1]) // p)] for r in refs_in]
        model = self._with_lora if trajectory.weights_version > 0 else self._without_lora
        steps = int(trajectory.sigmas.numel()) - 1

        def forward(lengths: Any, mask: torch.Tensor, references: list) -> int:
            text = list(lengths) if lengths is not None else mask.to(torch.bool).sum(dim=1).tolist()
            layout = TokenLayout(text_lengths=text, target_grids=[grid] * batch, reference_grids=references)
            return model.forward(layout).total

        flops = 0
        for branch in guidance_branches(
            trajectory.guidance_scale, trajectory.image_guidance_scale, edit=cond.is_edit
        ):
            positive, keeps_refs = BRANCH_INPUTS[branch]
            text = (
                (cond.lengths, cond.attention_mask)
                if positive
                else (cond.negative_lengths, cond.negative_attention_mask)
            )
            flops += forward(*text, refs if keeps_refs else [[]] * batch)
        self._remote += steps * flops

    # ---- results -------------------------------------------------------------------------------
    def take(self) -> dict[str, float]:
        """This step's totals since the last take, then reset: ``perf/tflops`` (all of this process),
        ``perf/tflops_rollout`` (forwards without grad: rollout, reference, evaluation),
        ``perf/tflops_train`` (training forwards + backward + recompute), ``perf/tflops_worker``
        (`book_remote_rollout`), ``perf/transformer_calls`` and ``perf/sample_forwards``."""
        out = {
            "perf/tflops": (self._rollout + self._train) / 1e12,
            "perf/tflops_rollout": self._rollout / 1e12,
            "perf/tflops_train": self._train / 1e12,
            "perf/tflops_worker": self._remote / 1e12,
            "perf/transformer_calls": float(self._forwards),
            "perf/sample_forwards": float(self._samples),
        }
        self._rollout = self._train = self._remote = self._forwards = self._train_forwards = self._samples = 0
        return out

    def close(self) -> None:
        """Remove the hook (idempotent)."""
        if self._handle is not None:
            self._handle.remove()
            self._handle = None
