"""The trainer's LoRA into vllm-omni's Boogu transformer, from in-memory tensors.

The reference sync (flowgrpo-reference §8.6) accumulates the actor's LoRA tensors in the rollout
worker, then calls ``remove_lora(id)`` and one atomic ``add_lora`` of a request that carries the
tensors and the peft config, through vllm-omni's own ``DiffusionLoRAManager``. vllm-omni 0.30 has
no tensor-carrying request of its own; its manager's hook for one is the pipeline method
``_load_diffusion_lora_adapter(lora_request, lora_path, dtype) -> (LoRAModel, PEFTHelper) | None``.
:class:`TensorLoRARequest` is that request and :func:`load_tensor_lora_adapter` that hook;
:class:`LoraSlot` drives the manager (remove, add, activate, read back, fingerprint).

Names. The trainer sends workspace file keys (``boogu_adapters.lora.lora_file_key``:
``double_stream_layers.0.img_instruct_attn.processor.img_to_q.lora_A.weight``), optionally with
the peft prefix ``base_model.model.`` or diffusers' prefix ``transformer.`` (``boogu_protocol``'s
``PEFT_PREFIX`` and ``DIFFUSERS_PREFIX``, which ``boogu_adapters.lora`` names keys with). vllm-omni's port names
two things differently, exactly as its ``load_weights`` maps the base weights:
``.img_instruct_attn.processor.`` -> ``.img_instruct_attn.`` and ``.to_out.0`` -> ``.to_out``
(also in ``target_modules``: peft's ``to_out.0`` becomes ``to_out``). Q/K/V and the SwiGLU
gate/input are fused in vllm-omni (``to_qkv``, ``img_to_qkv``, ``instruct_to_qkv``,
``*feed_forward.gate_up_proj``); the manager binds the logical sub-projections (``to_q``,
``linear_1``/``linear_3``, ...) to slices of those through the packed mapping it derives from
the transformer's ``stacked_params_mapping``, and :func:`plan_keys` checks every key against that
same mapping before anything is touched. A key or target that would attach to nothing raises
:class:`LoraSyncError`.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from vllm.lora.request import LoRARequest

from boogu_protocol import DIFFUSERS_PREFIX, PEFT_PREFIX, lora_fingerprint

__all__ = [
    "LORA_INT_ID",
    "LORA_NAME",
    "LORA_PATH",
    "LoraSlot",
    "LoraSyncError",
    "TensorLoRARequest",
    "install_tensor_lora_hook",
    "load_tensor_lora_adapter",
    "plan_keys",
    "to_vllm_module_name",
    "to_vllm_target",
]

LORA_NAME = "boogu_flowgrpo_lora"
LORA_INT_ID = 1
LORA_PATH = "/boogu-flowgrpo/in-memory-lora"
"""An absolute placeholder: the manager resolves ``lora_path`` before the hook runs, and an
absolute path is returned as is (a relative one could be looked up on the Hugging Face hub)."""

_LIST = 5  # keys an error message names before summarising


class LoraSyncError(RuntimeError):
    """The LoRA sent to vllm-omni does not fit its transformer, or was not applied as sent."""


class TensorLoRARequest(LoRARequest):  # type: ignore[misc]
    """A ``LoRARequest`` that carries its adapter: a peft config dict and ``{file key: tensor}``."""

    peft_config: dict | None = None
    lora_tensors: dict | None = None


# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

_RENAMES = ((".img_instruct_attn.processor.", ".img_instruct_attn."),)


def _strip(key: str) -> str:
    for prefix in (PEFT_PREFIX, DIFFUSERS_PREFIX):
        if key.startswith(prefix):
            key = key[len(prefix) :]
    return key


def to_vllm_module_name(module: str) -> str:
    """Workspace module path (no prefix) -> vllm-omni's module path under ``transformer``."""
    name = f".{module}."
    for old, new in _RENAMES:
        name = name.replace(old, new)
    name = re.sub(r"\.to_out\.0\.", ".to_out.", name)
    return name[1:-1]


def to_vllm_target(target: str) -> str:
    """A peft ``target_modules`` entry -> the same suffix in vllm-omni's names (``to_out.0`` -> ``to_out``)."""
    return re.sub(r"(^|\.)to_out\.0$", r"\1to_out", target)


def _split_key(key: str) -> tuple[str, str]:
    """``<module>.lora_A.weight`` -> (module, "A"); anything else is a LoraSyncError."""
    parts = key.split(".")
    if len(parts) < 3 or parts[-1] != "weight" or parts[-2] not in ("lora_A", "lora_B"):
        raise LoraSyncError(f"LoRA key {key!r} is not '<module>.lora_A.weight' or '<module>.lora_B.weight'")
    return ".".join(parts[:-2]), parts[-2][-1]


@dataclass(frozen=True)
class _Site:
    """Where one logical LoRA module lands in vllm-omni: a layer (full name) and a slice index."""

    layer: str  # "transformer.<vllm module path>" of the replaceable (possibly packed) layer
    slice: int
    module: str  # vllm module name (relative to the transformer) the LoRAModel is keyed by


def _match(name: str, targets: list[str]) -> bool:
    # vllm-omni's _match_target_modules (peft's suffix rule): full name or ".<target>" suffix.
    return any(name == t or re.match(rf".*\.{t}$", name) for t in targets)


def _lora_capable(transformer: torch.nn.Module) -> dict[str, torch.nn.Module]:
    """vllm-omni layers the manager can wrap (LinearBase or already wrapped), by module path."""
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.model_executor.layers.linear import LinearBase

    out = {}
    for name, module in transformer.named_modules():
        if "base_layer" in name.split("."):
            continue
        if isinstance(module, (LinearBase, BaseLayerWithLoRA)):
            out[name] = module
    return out


def _n_slices(module: torch.nn.Module) -> int:
    from vllm.lora.layers import BaseLayerWithLoRA
    from vllm.model_executor.layers.linear import MergedColumnParallelLinear, QKVParallelLinear

    if isinstance(module, BaseLayerWithLoRA):
        return int(getattr(module, "n_slices", 1))
    if isinstance(module, QKVParallelLinear):
        return 3
    if isinstance(module, MergedColumnParallelLinear):
        return 2
    return 1


def plan_keys(
    manager: Any, transformer: torch.nn.Module, keys: list[str], target_modules: list[str]
) -> dict[str, _Site]:
    """Map every sent LoRA module to its vllm-omni layer and slice; raise on anything unattached.

    ``manager`` is the ``DiffusionLoRAManager`` (its packed mapping is the one used to bind).
    Returns ``{sent module path: _Site}``. Raises LoraSyncError naming keys that map to no
    vllm-omni layer, keys without their lora_A/lora_B partner, keys outside ``target_modules``
    (the manager would not wrap their layer), and targets that match no layer.
    """
    capable = _lora_capable(transformer)
    packed = dict(getattr(manager, "_packed_modules_mapping", {}) or {})
    # sub-module path -> (packed layer path, slice) for every packed layer
    sub_sites: dict[str, tuple[str, int]] = {}
    for layer_name, module in capable.items():
        n = _n_slices(module)
        if n <= 1:
            continue
        prefix, _, leaf = layer_name.rpartition(".")
        subs = packed.get(leaf)
        if subs and len(subs) == n:
            for i, sub in enumerate(subs):
                sub_sites[f"{prefix}.{sub}" if prefix else sub] = (layer_name, i)

    vtargets = [to_vllm_target(t) for t in target_modules]
    known = (*capable, *sub_sites)
    unknown_targets = [
        t for t, vt in zip(target_modules, vtargets) if not any(_match(n, [vt]) for n in known)
    ]
    if unknown_targets:
        raise LoraSyncError(
            f"LoRA sync: {len(unknown_targets)} of {len(target_modules)} peft target_modules match no layer "
            f"of vllm-omni's Boogu transformer: {unknown_targets[:_LIST]}"
        )

    halves: dict[str, set[str]] = {}
    for key in keys:
        module, half = _split_key(_strip(key))
        halves.setdefault(module, set()).add(half)
    unpaired = sorted(m for m, h in halves.items() if h != {"A", "B"})
    sites: dict[str, _Site] = {}
    unattached, untargeted = [], []
    for module in sorted(halves):
        vname = to_vllm_module_name(module)
        if vname in capable and _n_slices(capable[vname]) == 1:
            site = _Site(f"transformer.{vname}", 0, vname)
        elif vname in sub_sites:
            layer, i = sub_sites[vname]
            site = _Site(f"transformer.{layer}", i, vname)
        else:
            unattached.append(module)
            continue
        if not _match(f"transformer.{vname}", vtargets):
            untargeted.append(module)
            continue
        sites[module] = site
    problems = []
    if unattached:
        problems.append(
            f"{len(unattached)} attach to no module of vllm-omni's Boogu transformer, e.g. {unattached[:_LIST]}"
        )
    if untargeted:
        problems.append(
            f"{len(untargeted)} are outside target_modules={target_modules}, e.g. {untargeted[:_LIST]}"
        )
    if unpaired:
        problems.append(f"{len(unpaired)} lack their lora_A or lora_B partner, e.g. {unpaired[:_LIST]}")
    if problems:
        raise LoraSyncError(f"LoRA sync: of {len(keys)} keys ({len(halves)} modules), " + "; ".join(problems))
    return sites


# --------------------------------------------------------------------------------------------
# The manager hook
# --------------------------------------------------------------------------------------------


def load_tensor_lora_adapter(lora_request: Any, lora_path: str, dtype: torch.dtype, fallback: Any = None):
    """``DiffusionLoRAManager``'s ``_load_diffusion_lora_adapter`` hook for :class:`TensorLoRARequest`.

    Builds the ``LoRAModel`` with vLLM's ``from_lora_tensors`` from the request's tensors, renamed
    to vllm-omni's module names. The tensors are copied first: the manager's ``optimize()`` folds
    the scaling into lora_B in place, and ``.to()`` of a CPU tensor already in ``dtype`` is the
    caller's own tensor. Any other request goes to ``fallback`` (or None: the manager then reads
    ``lora_path`` from disk).
    """
    tensors = getattr(lora_request, "lora_tensors", None)
    if tensors is None:
        return fallback(lora_request=lora_request, lora_path=lora_path, dtype=dtype) if fallback else None
    from vllm.lora.lora_model import LoRAModel
    from vllm.lora.peft_helper import PEFTHelper

    peft_config = dict(lora_request.peft_config or {})
    if "target_modules" in peft_config and isinstance(peft_config["target_modules"], (list, tuple, set)):
        peft_config["target_modules"] = [to_vllm_target(t) for t in peft_config["target_modules"]]
    helper = PEFTHelper.from_dict(peft_config)
    renamed = {}
    for key, tensor in tensors.items():
        module, half = _split_key(_strip(key))
        renamed[f"{to_vllm_module_name(module)}.lora_{half}.weight"] = (
            tensor.detach().to("cpu", dtype).clone()
        )
    model = LoRAModel.from_lora_tensors(
        lora_model_id=lora_request.lora_int_id, tensors=renamed, peft_helper=helper, device="cpu", dtype=dtype
    )
    return model, helper


def install_tensor_lora_hook(pipeline: torch.nn.Module) -> None:
    """Give ``pipeline`` the tensor hook (chaining to a hook its class already has). Idempotent."""
    current = getattr(pipeline, "_load_diffusion_lora_adapter", None)
    if getattr(current, "_boogu_tensor_hook", False):
        return

    def hook(lora_request, lora_path, dtype):
        return load_tensor_lora_adapter(lora_request, lora_path, dtype, fallback=current)

    hook._boogu_tensor_hook = True  # type: ignore[attr-defined]
    # An instance attribute, so a pipeline class (or vllm-omni's engine) need not know about it.
    object.__setattr__(pipeline, "_load_diffusion_lora_adapter", hook)


# --------------------------------------------------------------------------------------------
# The slot
# --------------------------------------------------------------------------------------------


class LoraSlot:
    """One switchable LoRA on a vllm-omni Boogu pipeline, replaced as a whole on every sync.

    Args:
        pipeline: a built ``BooguImagePipeline`` (or subclass).
        manager: its ``DiffusionLoRAManager`` (a worker's ``lora_manager``); None builds one
            (``max_cached_adapters=1``) on the transformer's device and dtype.
        context: what :func:`boogu_vllm.cpu.build_pipeline` returned as its second value, entered
            around the manager calls (layer replacement builds vLLM layers); None: no context.
    """

    def __init__(self, pipeline: torch.nn.Module, manager: Any = None, *, context: Any = None):
        from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager

        self.pipeline = pipeline
        param = next(pipeline.transformer.parameters())
        self.dtype = param.dtype
        self._context = context
        install_tensor_lora_hook(pipeline)
        with self._ctx():
            self.manager = manager or DiffusionLoRAManager(
                pipeline, device=param.device, dtype=self.dtype, max_cached_adapters=1
            )
        self.version: int | None = None
        self.request: TensorLoRARequest | None = None

    def _ctx(self):
        if self._context is None:
            return contextlib.nullcontext()
        return self._context() if callable(self._context) else self._context

    def load(self, version: int, peft_config: Mapping[str, Any], tensors: Mapping[str, torch.Tensor]) -> dict:
        """Replace the adapter: remove the previous one, add this one atomically, activate it.

        ``tensors`` are the trainer's LoRA with workspace file keys (``boogu_adapters.lora``;
        ``base_model.model.`` or ``transformer.`` prefixes are accepted), ``peft_config`` a dict
        with at least ``r``, ``lora_alpha`` and ``target_modules``. Every key is checked against
        vllm-omni's transformer first (:func:`plan_keys`); on any failure the previous adapter (or
        the base model) serves again, never a partial one.

        Returns ``{"version", "fingerprint", "keys"}``. Every sent pair is **read back from
        vllm-omni's LoRA layers** (the ``lora_a_stacked``/``lora_b_stacked`` slots of each wrapped
        layer, trimmed to the rank) and checked bit for bit: A against ``sent_A.to(dtype)``, B
        against ``sent_B.to(dtype) * scaling`` (the manager folds alpha/r into B). Only then is the
        fingerprint :func:`lora_fingerprint` of the tensors as received, which equals the trainer's
        for any model dtype (a bf16 worker holds bf16 copies of the float32 LoRA it was sent).
        """
        peft = dict(peft_config)
        for field in ("r", "lora_alpha", "target_modules"):
            if field not in peft:
                raise LoraSyncError(f"LoRA sync: peft_config lacks {field!r}: {sorted(peft)}")
        targets = peft["target_modules"]
        targets = [targets] if isinstance(targets, str) else list(targets)
        sites = plan_keys(self.manager, self.pipeline.transformer, list(tensors), targets)
        request = TensorLoRARequest(
            lora_name=LORA_NAME,
            lora_int_id=LORA_INT_ID,
            lora_path=LORA_PATH,
            peft_config={**peft, "target_modules": targets},
            lora_tensors=dict(tensors),
        )
        previous = (self.version, self.request)
        self.clear()
        try:
            with self._ctx():
                # set_active_adapter = add_adapter (build LoRAModel, wrap target layers) + bind.
                self.manager.set_active_adapter(request, 1.0)
            fingerprint = self._read_back(sites, peft, tensors)
        except Exception as exc:
            self._restore(*previous)
            if isinstance(exc, LoraSyncError):
                raise
            raise LoraSyncError(f"LoRA sync: vllm-omni's manager refused the adapter: {exc}") from exc
        self.version, self.request = version, request
        return {"version": version, "fingerprint": fingerprint, "keys": len(tensors)}

    def _restore(self, version: int | None, request: TensorLoRARequest | None) -> None:
        """After a failed load: the previous adapter serves again (or the base model if there was none)."""
        self.clear()
        if request is not None:
            with self._ctx():
                self.manager.set_active_adapter(request, 1.0)
            self.version, self.request = version, request

    def clear(self) -> None:
        """Back to the base model: the adapter is removed and every LoRA layer reset."""
        if LORA_INT_ID in self.manager.list_adapters():
            self.manager.remove_adapter(LORA_INT_ID)
        self.manager.set_active_adapter(None)
        self.version, self.request = None, None

    @property
    def active(self) -> bool:
        return self.manager._active_adapter_id == LORA_INT_ID

    def _read_back(self, sites: dict[str, _Site], peft: dict, tensors: Mapping[str, torch.Tensor]) -> str:
        r = int(peft["r"])
        if peft.get("use_rslora"):
            scaling = float(peft["lora_alpha"]) / r**0.5
        else:
            scaling = float(peft["lora_alpha"]) / r
        by_module: dict[str, dict[str, str]] = {}
        for key in tensors:
            module, half = _split_key(_strip(key))
            by_module.setdefault(module, {})[half] = key
        layers = self.manager._lora_modules
        held: dict[str, torch.Tensor] = {}
        mismatched, missing = [], []
        for module, site in sites.items():
            layer = layers.get(site.layer)
            if layer is None or not getattr(layer, "_diffusion_lora_active_slices", (False,))[site.slice]:
                missing.append(module)
                continue
            key_a, key_b = by_module[module]["A"], by_module[module]["B"]
            sent_a = tensors[key_a].detach().to("cpu", self.dtype)
            sent_b = tensors[key_b].detach().to("cpu", self.dtype)
            got_a = layer.lora_a_stacked[site.slice][0, 0, : sent_a.shape[0], : sent_a.shape[1]].to("cpu")
            got_b = layer.lora_b_stacked[site.slice][0, 0, : sent_b.shape[0], : sent_b.shape[1]].to("cpu")
            want_b = sent_b * scaling if scaling != 1 else sent_b
            if not (torch.equal(got_a, sent_a) and torch.equal(got_b, want_b)):
                mismatched.append(module)
                continue
            # What the layers hold is proven bit for bit to be the sent tensors in this model's dtype
            # (B with the scaling folded in); the fingerprint is then that of the tensors as received,
            # so a bf16 worker acknowledges the trainer's float32 fingerprint.
            held[key_a] = tensors[key_a].detach()
            held[key_b] = tensors[key_b].detach()
        if missing or mismatched:
            raise LoraSyncError(
                f"LoRA sync: after loading, {len(missing)} modules have no active LoRA in vllm-omni "
                f"(e.g. {sorted(missing)[:_LIST]}) and {len(mismatched)} hold other values than sent "
                f"(e.g. {sorted(mismatched)[:_LIST]})"
            )
        return lora_fingerprint(held)
