"""LoRA on the Boogu transformer: attach, read, load, fingerprint, and switch off for the reference.

Adapters are injected in place through peft (diffusers' ``PeftAdapterMixin.add_adapter`` does the
same), so the trainer and the local rollout engine share one module and the state-dict keys are
the plain module paths (``...attn.to_q.lora_A.weight``) that diffusers' ``load_lora_adapter`` reads.

This module is the one place for LoRA key conventions. Three spellings of one tensor exist:

* parameter name: ``blocks.0.attn.to_q.lora_A.default.weight`` (``named_parameters()``; peft puts the
  adapter name in);
* file key: ``blocks.0.attn.to_q.lora_A.weight`` (`lora_state_dict`, what engines and EMA use);
* peft file key: ``base_model.model.blocks.0.attn.to_q.lora_A.weight`` (``adapter_model.safetensors``,
  what ``PeftModel.from_pretrained`` reads).

Use `is_lora_param`, `is_lora_b`, `lora_file_key`, `lora_module` / `lora_pair_keys`,
`to_peft_keys` / `from_peft_keys`, `DIFFUSERS_PREFIX`, `peft_sync_config` and `adapter_config` instead
of spelling them out. Whether a saved LoRA fits a model is decided here too, once, for the
trainer's resume and for ``boogu-sample`` (sampling and ``--merge-to``): `check_lora_state`.

The adapted linears compute their LoRA branch as one accumulate into the base output
(`FusedLoraLinear`, the default of `add_lora`); `set_lora_forward` switches them to peft's own forward.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping, Sequence
from typing import Literal

import torch
from peft import LoraConfig, get_peft_model_state_dict, inject_adapter_in_model, set_peft_model_state_dict
from peft.tuners.lora import Linear as PeftLoraLinear
from peft.tuners.tuners_utils import BaseTunerLayer, check_target_module_exists

from boogu_adapters.model import LORA_TARGET_MODULES

# The prefixes and the fingerprint come from the wire format: the rollout worker (another environment)
# strips the same prefixes and computes the same fingerprint.
from boogu_protocol import DIFFUSERS_PREFIX as DIFFUSERS_PREFIX
from boogu_protocol import PEFT_PREFIX as PEFT_PREFIX
from boogu_protocol import lora_fingerprint as lora_fingerprint  # one algorithm on both sides of a sync

ADAPTER_NAME = "default"
"""peft's adapter name for the one adapter this project trains."""
LORA_MARKER = "lora_"
"""Every LoRA parameter name contains this (``lora_A``, ``lora_B``); base parameters never do."""
LoraForward = Literal["fused", "peft"]
"""How an adapted linear computes its LoRA branch: `FusedLoraLinear`'s one accumulate, or peft's forward."""


def is_lora_param(name: str) -> bool:
    """Whether a parameter (or state-dict) name belongs to a LoRA adapter."""
    return LORA_MARKER in name


def lora_file_key(param_name: str) -> str:
    """``...lora_A.default.weight`` (parameter name) -> ``...lora_A.weight`` (file key)."""
    return param_name.replace(f".{ADAPTER_NAME}.", ".")


def is_lora_b(name: str) -> bool:
    """Whether a parameter name or file key is a ``lora_B`` tensor (the up projection, zero at init)."""
    return f".{LORA_MARKER}B." in name


def lora_module(key: str) -> str:
    """``<module path>.lora_A.weight`` (a file key or a parameter name) -> ``<module path>``."""
    return key.split(f".{LORA_MARKER}")[0]


def lora_pair_keys(module: str) -> tuple[str, str]:
    """The file keys of ``module``'s ``lora_A`` and ``lora_B`` weights."""
    return f"{module}.{LORA_MARKER}A.weight", f"{module}.{LORA_MARKER}B.weight"


def peft_sync_config(rank: int, alpha: float, target_modules: Sequence[str]) -> dict:
    """The peft ``LoraConfig`` fields a rollout engine rebuilds the adapter from (``r``, ``lora_alpha``,
    ``target_modules``), as `add_lora` builds its ``LoraConfig`` from the same settings."""
    return {"r": rank, "lora_alpha": alpha, "target_modules": list(target_modules)}


def lora_file_keys(module: torch.nn.Module) -> set[str]:
    """The file keys of every LoRA parameter of ``module`` (no tensor is read)."""
    return {lora_file_key(name) for name, _ in module.named_parameters() if is_lora_param(name)}


def to_peft_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """File keys -> peft file keys, tensors contiguous on the CPU (ready for safetensors)."""
    return {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def from_peft_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """Peft file keys -> file keys; a key without the peft prefix is an error naming it."""
    out = {}
    for k, v in state.items():
        if not k.startswith(PEFT_PREFIX):
            raise ValueError(f"LoRA file key {k!r} lacks the peft prefix {PEFT_PREFIX!r}")
        out[k[len(PEFT_PREFIX) :]] = v
    return out


def adapter_config(module: torch.nn.Module, base_model_name_or_path: str | None = None) -> dict:
    """The injected adapter's peft ``LoraConfig`` as the JSON ``adapter_config.json`` holds.

    Built from the config peft attached to ``module`` when the adapter was injected, so what is saved
    is what was trained (rank, alpha, targets, init), never a second description of it.
    """
    configs = getattr(module, "peft_config", None) or {}
    if ADAPTER_NAME not in configs:
        raise ValueError("adapter_config: the module has no injected LoRA adapter (add_lora first)")
    raw = configs[ADAPTER_NAME].to_dict()
    raw["base_model_name_or_path"] = base_model_name_or_path
    return {k: _jsonable(v) for k, v in raw.items()}


def _jsonable(value):
    if isinstance(value, set | frozenset):
        return sorted(value)
    if hasattr(value, "value") and type(value).__module__.startswith("peft"):
        return value.value  # peft's enums (PeftType, TaskType)
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_jsonable(v) for v in value]
    if hasattr(value, "__dataclass_fields__"):
        import dataclasses

        return _jsonable(dataclasses.asdict(value))
    return value


class WeightSyncError(RuntimeError):
    """The LoRA weights sent to a rollout engine do not match what it expects or what it applied."""


def add_lora(
    transformer: torch.nn.Module,
    *,
    rank: int = 64,
    alpha: float = 128,
    target_modules: Sequence[str] = LORA_TARGET_MODULES,
    init_lora_weights: bool | str = "gaussian",
    seed: int | None = 0,
    forward: LoraForward = "fused",
) -> torch.nn.Module:
    """Inject LoRA adapters in place; only LoRA parameters stay trainable. Returns the module.

    With ``init_lora_weights="gaussian"`` (the reference recipe) ``lora_A`` is random and ``lora_B`` zero,
    so the adapted model starts exactly at the base model. ``seed`` makes the ``lora_A`` draw repeatable.
    ``forward`` picks how the adapted linears compute (`set_lora_forward`): ``"fused"`` (one accumulate
    into the base output, the default) or ``"peft"`` (peft's own forward, to compare against).
    """
    if forward not in ("fused", "peft"):
        raise ValueError(f"add_lora: forward={forward!r}, expected 'fused' or 'peft'")
    config = LoraConfig(
        **peft_sync_config(rank, alpha, target_modules), init_lora_weights=init_lora_weights, bias="none"
    )
    devices = [p.device for p in transformer.parameters()][:1]
    fork = (
        torch.random.fork_rng(devices=[d for d in devices if d.type == "cuda"])
        if seed is not None
        else contextlib.nullcontext()
    )
    with fork:
        if seed is not None:
            torch.manual_seed(seed)
        inject_adapter_in_model(config, transformer, adapter_name=ADAPTER_NAME)
    for name, param in transformer.named_parameters():
        param.requires_grad_(is_lora_param(name))
    if not any(p.requires_grad for p in transformer.parameters()):
        raise ValueError(f"add_lora: no module matched target_modules={list(target_modules)}")
    set_lora_forward(transformer, forward)
    return transformer


def lora_state_dict(transformer: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The LoRA tensors, keyed like peft/diffusers LoRA files (no adapter name)."""
    return get_peft_model_state_dict(transformer, adapter_name=ADAPTER_NAME)


def load_lora_state_dict(transformer: torch.nn.Module, state: Mapping[str, torch.Tensor]) -> None:
    """Load LoRA tensors, refusing any missing or unexpected key (never a silent partial load)."""
    expected = set(lora_state_dict(transformer))
    check_lora_keys(expected, set(state))
    result = set_peft_model_state_dict(transformer, dict(state), adapter_name=ADAPTER_NAME)
    unexpected = getattr(result, "unexpected_keys", None) or []
    if unexpected:
        raise WeightSyncError(f"LoRA load: {len(unexpected)} unexpected keys, e.g. {sorted(unexpected)[:3]}")


def check_lora_keys(expected: set[str], got: set[str]) -> None:
    missing, unexpected = sorted(expected - got), sorted(got - expected)
    if missing or unexpected:
        raise WeightSyncError(
            f"LoRA keys do not match the module: {len(missing)} missing (e.g. {missing[:3]}), "
            f"{len(unexpected)} unexpected (e.g. {unexpected[:3]})"
        )


class LoraMismatchError(ValueError):
    """A saved LoRA does not fit a model: tensors missing, extra, or of other shapes."""


def expected_lora_shapes(
    weight_shapes: Mapping[str, Sequence[int]], target_modules: Sequence[str] | str, rank: int
) -> dict[str, tuple[int, int]]:
    """File key -> shape of every LoRA tensor that `add_lora` with these targets and rank gives a model.

    ``weight_shapes`` maps the base model's tensor names (``<module path>.weight``, from
    ``named_parameters()`` or a safetensors header) to their shapes; the modules are the linear ones
    (2-D weight) whose path peft's own matching selects. ``lora_A`` is ``(rank, in)``, ``lora_B``
    ``(out, rank)``.
    """
    config = LoraConfig(r=rank, target_modules=target_modules)
    out: dict[str, tuple[int, int]] = {}
    for name, shape in weight_shapes.items():
        module = name.removesuffix(".weight")
        if module == name or len(shape) != 2 or is_lora_param(name):
            continue
        if check_target_module_exists(config, module):
            out_features, in_features = (int(d) for d in shape)
            out[f"{module}.lora_A.weight"] = (rank, in_features)
            out[f"{module}.lora_B.weight"] = (out_features, rank)
    return out


def lora_shapes(module: torch.nn.Module) -> dict[str, tuple[int, ...]]:
    """File key -> shape of every LoRA parameter of ``module`` (global shapes, also under FSDP2)."""
    return {lora_file_key(n): tuple(p.shape) for n, p in module.named_parameters() if is_lora_param(n)}


def check_lora_state(
    expected: Mapping[str, Sequence[int]], got: Mapping[str, Sequence[int]], *, source: str
) -> None:
    """Refuse a saved LoRA (``got``: file key -> shape) unless it has exactly the ``expected`` tensors.

    Every saved tensor must belong to a module the model's targets adapt, every such module must have
    its tensors, and the shapes must be equal: a LoRA trained on another model (more or fewer layers,
    another width, other targets) is never applied to part of this one. Raises `LoraMismatchError`
    naming ``source``, the counts and a few example names of each kind of difference.
    """
    missing = sorted(set(expected) - set(got))
    extra = sorted(set(got) - set(expected))
    wrong = sorted(k for k in set(expected) & set(got) if tuple(expected[k]) != tuple(got[k]))
    if not (missing or extra or wrong):
        return
    problems = []
    if missing:
        problems.append(
            f"{len(missing)} of the {len(expected)} tensors the model's LoRA targets need are missing "
            f"(e.g. {_examples(missing)})"
        )
    if extra:
        problems.append(
            f"{len(extra)} of its {len(got)} tensors adapt no targeted module of the model (e.g. {_examples(extra)})"
        )
    if wrong:
        shown = ", ".join(f"{k} {tuple(got[k])} vs {tuple(expected[k])}" for k in wrong[:3])
        problems.append(f"{len(wrong)} tensors have other shapes (saved vs model: {shown})")
    raise LoraMismatchError(
        f"the LoRA in {source} was not trained on this model: " + "; ".join(problems) + ". "
        "Use the base model and lora.target_modules / lora.rank the run was trained with."
    )


def _examples(names: Sequence[str], limit: int = 3) -> str:
    return ", ".join(names[:limit]) + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _tuner_layers(module: torch.nn.Module) -> list[BaseTunerLayer]:
    return [m for m in module.modules() if isinstance(m, BaseTunerLayer)]


@contextlib.contextmanager
def adapters_disabled(module: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Run the base (reference) model: every LoRA layer bypassed, restored on exit.

    Works for a ``peft.PeftModel`` (its ``disable_adapter``) and for adapters injected in place.
    """
    if hasattr(module, "disable_adapter") and hasattr(module, "base_model"):
        with module.disable_adapter():
            yield module
        return
    layers = _tuner_layers(module)
    if not layers:
        raise ValueError("adapters_disabled: the module has no LoRA layers")
    was_disabled = [layer.disable_adapters for layer in layers]
    for layer in layers:
        layer.enable_adapters(False)
    try:
        yield module
    finally:
        for layer, disabled in zip(layers, was_disabled):
            layer.enable_adapters(not disabled)
            # enable_adapters(True) re-marks adapter weights trainable; keep the base frozen as it was.
        for name, param in module.named_parameters():
            if not is_lora_param(name):
                param.requires_grad_(False)


class InputDtypeLinear(torch.nn.Linear):
    """A LoRA ``lora_A``/``lora_B`` linear whose (float32 master) weight is cast to the input's dtype.

    The cast is part of the autograd graph, so the gradient reaches the float32 weight as float32,
    while the product runs in the model's compute dtype (bf16 on GPU) like the base layer's.
    """

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        bias = None if self.bias is None else self.bias.to(x.dtype)
        return torch.nn.functional.linear(x, self.weight.to(x.dtype), bias)


def compute_lora_in_input_dtype(module: torch.nn.Module) -> int:
    """Run every LoRA product in the dtype of the activations it receives; returns the layers changed.

    peft casts a LoRA layer's input to the adapter weight's dtype, so float32 master adapters on a
    bf16 base make every wrapped linear compute its LoRA branch in float32 (upcast activations,
    fp32 GEMMs). After this the branch computes in the activation dtype (bf16 on GPU) and the
    weights stay float32 (the optimizer's master copy); for a float32 model nothing changes, bit
    for bit. State-dict keys are unchanged.
    """
    changed = 0
    for layer in _tuner_layers(module):
        if not hasattr(layer, "cast_input_dtype_enabled"):
            raise TypeError(
                f"{type(layer).__name__}: this peft version has no cast_input_dtype_enabled switch"
            )
        layer.cast_input_dtype_enabled = False
        for linears in (getattr(layer, "lora_A", {}), getattr(layer, "lora_B", {})):
            for linear in linears.values():
                if type(linear) is torch.nn.Linear:
                    linear.__class__ = InputDtypeLinear
        changed += 1
    return changed


class FusedLoraLinear(PeftLoraLinear):
    """peft's LoRA ``Linear`` whose LoRA branch is one accumulate into the base layer's output.

    peft computes ``result + lora_B(lora_A(x)) * scaling``: a full-width ``lora_B`` output, then a
    ``mul`` and an ``add`` over it, three extra passes over the ``(tokens, out)`` activation (the LoRA
    GEMMs themselves are rank ``r`` thin). Here the branch is ``addmm(result, x @ A^T, B^T,
    alpha=scaling)``: the scaling folded into the GEMM and the sum into its epilogue, so the output is
    read and written once, and the backward has no full-width ``mul`` either. The same values as peft's
    within float rounding (one rounding instead of three), the same parameters (this is only another
    class for the same module: state-dict keys, checkpoints, FSDP2, ``merge``/``unmerge`` and the
    gradients to ``lora_A``/``lora_B`` are peft's). Dtypes follow peft: the branch computes in the
    adapter weight's dtype (peft's input cast), or, with ``cast_input_dtype_enabled`` off
    (`compute_lora_in_input_dtype`), in the input's dtype with the weights cast inside autograd.

    Whatever peft does that this does not (dropout, DoRA and other variants, a ``lora_B`` bias,
    per-row ``adapter_names``, extra forward arguments, merged or disabled adapters) goes to peft's
    own forward, unchanged.
    """

    def _fusable(self, x: torch.Tensor, args: tuple, kwargs: dict) -> bool:
        if args or kwargs or self.disable_adapters or self.merged or not x.is_floating_point():
            return False
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            if (
                name in self.lora_variant
                or not isinstance(self.lora_dropout[name], torch.nn.Identity)
                or not isinstance(self.lora_A[name], torch.nn.Linear)
                or not isinstance(self.lora_B[name], torch.nn.Linear)
                or self.lora_A[name].bias is not None
                or self.lora_B[name].bias is not None
            ):
                return False
        return True

    def forward(self, x: torch.Tensor, *args, **kwargs) -> torch.Tensor:
        if not self._fusable(x, args, kwargs):
            return super().forward(x, *args, **kwargs)
        result = self.base_layer(x)  # (..., out)
        result_dtype, shape = result.dtype, result.shape
        flat = result.reshape(-1, shape[-1])  # (tokens, out): a view for a contiguous output
        inputs = x.reshape(-1, x.shape[-1])  # (tokens, in)
        cast_input = getattr(self, "cast_input_dtype_enabled", True)
        for name in self.active_adapters:
            if name not in self.lora_A:
                continue
            a, b = self.lora_A[name].weight, self.lora_B[name].weight  # (r, in), (out, r)
            dtype = a.dtype if cast_input else inputs.dtype  # peft's _cast_input_dtype / InputDtypeLinear
            inputs = inputs.to(dtype)  # peft keeps the cast input for the next adapter too
            down = torch.mm(inputs, a.to(dtype).t())  # (tokens, r)
            flat = torch.addmm(flat.to(dtype), down, b.to(dtype).t(), alpha=self.scaling[name])
        return flat.to(result_dtype).reshape(shape)


def set_lora_forward(module: torch.nn.Module, forward: LoraForward = "fused") -> int:
    """Make every peft LoRA ``Linear`` of ``module`` compute with `FusedLoraLinear` (``"fused"``) or with
    peft's own forward (``"peft"``); returns how many layers now do. Only the class changes: parameters,
    keys and adapter state stay as they are, so the two can be compared on one model."""
    if forward not in ("fused", "peft"):
        raise ValueError(f"set_lora_forward: forward={forward!r}, expected 'fused' or 'peft'")
    target = FusedLoraLinear if forward == "fused" else PeftLoraLinear
    changed = 0
    for layer in _tuner_layers(module):
        if type(layer) in (PeftLoraLinear, FusedLoraLinear):
            layer.__class__ = target
            changed += 1
    return changed
