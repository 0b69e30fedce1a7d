"""Analytic FLOP count of one ``BooguImageTransformer2DModel`` forward, and of a LoRA training step.

The count follows the forward of `docs/upstream-model.md` §5 (the data flow in ``transformer.py``)
op by op, **per sample and without padding**: a sample with ``Lc`` instruction tokens, reference
grids ``n_j = h_j·w_j`` and a target grid ``n_t = h·w`` (tokens after 2x2 patchify,
:class:`~boogu_adapters.model.layout.TokenLayout`) costs the same whatever else is in its batch.
Conventions:

* 2 FLOPs per multiply-add. Only matmul-like work is counted: every ``nn.Linear`` (``2·in·out`` per
  token; a bias add is not counted) and the attention products ``Q·Kᵀ`` and ``P·V``
  (``2·L²·H·d`` each, with ``H`` query heads: GQA repeats k/v, so it saves no FLOPs). Norms,
  RoPE, softmax, SiLU and other elementwise ops are excluded - the same scope as
  ``torch.utils.flop_counter.FlopCounterMode``.
* LoRA (peft) on an adapted linear adds ``lora_B(lora_A(x))``: ``2·r·(in + out)`` per token.
* Training backward with frozen base weights (:meth:`FlopModel.backward`): a base linear costs only
  its input gradient (``2·in·out`` per token), and nothing when its input does not require grad (the
  first refiner block's q/k/v read the embedders' outputs; the adaLN linears read ``temb``); a LoRA
  pair costs both weight gradients plus ``lora_B``'s input gradient, plus ``lora_A``'s when its
  input requires grad. Attention backward is ``2x`` its forward (the four products of the math
  path, the "model FLOPs" convention for MFU), or ``2.5x`` with ``attention_recompute=True`` (the
  fused flash / memory-efficient kernels recompute ``Q·Kᵀ``, which is what FlopCounterMode books
  for the fused SDPA backward ops).
* Gradient checkpointing (:meth:`FlopModel.recompute`) re-runs the forward of every block (the three
  refiners, the double- and single-stream blocks, ``transformer.py`` ``_run_block``); the embedders
  and ``norm_out`` are not recomputed.

Example::

    from boogu_adapters.model import RELEASED_CONFIG
    from boogu_adapters.model.flops import FlopModel, LoraSpec
    from boogu_adapters.model.layout import TokenLayout

    model = FlopModel(RELEASED_CONFIG, LoraSpec(rank=64))
    layout = TokenLayout(text_lengths=[128], target_grids=[(64, 64)], reference_grids=[[]])
    model.forward(layout).total / 1e12          # ~ TFLOPs of one 1024x1024 T2I sample-forward
    model.training(layout, gradient_checkpointing=True).total  # forward + backward + recompute

Checked against FlopCounterMode within 1% in ``tests/adapters/test_flops.py``; the reference
recipe's totals are in ``benchmarks/flops.py`` (``benchmarks/README.md``, section ``flops.py``).
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from torch import nn

from .layers import ffn_inner_dim
from .presets import LORA_TARGET_MODULES

__all__ = [
    "BLOCK_GROUPS",
    "FlopBreakdown",
    "FlopModel",
    "LoraSpec",
    "TrainingFlops",
    "backward_flops",
    "forward_flops",
    "lora_ranks",
    "lora_ranks_from_model",
    "training_flops",
]

BLOCK_GROUPS: tuple[str, ...] = (
    "embed",
    "context_refiner",
    "noise_refiner",
    "ref_image_refiner",
    "double_stream",
    "single_stream",
    "norm_out",
)
"""Keys of the per-group dicts of :class:`FlopBreakdown`, in forward order. ``embed`` is the
timestep MLP, the caption embedder and both patch embedders."""

_CHECKPOINTED = frozenset(BLOCK_GROUPS[1:-1])
_TEXT_PATH_LINEARS = frozenset({"time_caption_embed.caption_embedder.1"})
"""With the ``context_refiner`` group: what a forward that reuses its text path skips."""


@dataclass(frozen=True)
class LoraSpec:
    """LoRA rank and peft target-module suffixes (``boogu_adapters.lora.add_lora``'s arguments)."""

    rank: int = 64
    target_modules: tuple[str, ...] = LORA_TARGET_MODULES


@dataclass
class FlopBreakdown:
    """FLOPs by kind and block group (keys of :data:`BLOCK_GROUPS`); every value is a plain int.

    ``linear``: base ``nn.Linear`` GEMMs; ``attention``: ``Q·Kᵀ`` + ``P·V`` (their gradients in a
    backward); ``lora``: the LoRA A/B GEMMs.
    """

    linear: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BLOCK_GROUPS, 0))
    attention: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BLOCK_GROUPS, 0))
    lora: dict[str, int] = field(default_factory=lambda: dict.fromkeys(BLOCK_GROUPS, 0))

    @property
    def linear_total(self) -> int:
        return sum(self.linear.values())

    @property
    def attention_total(self) -> int:
        return sum(self.attention.values())

    @property
    def lora_total(self) -> int:
        return sum(self.lora.values())

    @property
    def total(self) -> int:
        return self.linear_total + self.attention_total + self.lora_total

    def __add__(self, other: FlopBreakdown) -> FlopBreakdown:
        out = FlopBreakdown()
        for kind in ("linear", "attention", "lora"):
            mine, theirs, dest = getattr(self, kind), getattr(other, kind), getattr(out, kind)
            for key in BLOCK_GROUPS:
                dest[key] = mine[key] + theirs[key]
        return out

    def __sub__(self, other: FlopBreakdown) -> FlopBreakdown:
        out = FlopBreakdown()
        for kind in ("linear", "attention", "lora"):
            mine, theirs, dest = getattr(self, kind), getattr(other, kind), getattr(out, kind)
            for key in BLOCK_GROUPS:
                dest[key] = mine[key] - theirs[key]
        return out

    def scaled(self, factor: int) -> FlopBreakdown:
        out = FlopBreakdown()
        for kind in ("linear", "attention", "lora"):
            src, dest = getattr(self, kind), getattr(out, kind)
            for key in BLOCK_GROUPS:
                dest[key] = src[key] * factor
        return out

    def as_dict(self) -> dict[str, Any]:
        """JSON-able: the three per-group dicts plus their totals and ``total``."""
        return {
            "linear": dict(self.linear),
            "attention": dict(self.attention),
            "lora": dict(self.lora),
            "linear_total": self.linear_total,
            "attention_total": self.attention_total,
            "lora_total": self.lora_total,
            "total": self.total,
        }


@dataclass
class TrainingFlops:
    """One training sample-forward: forward, its backward and (with checkpointing) the recompute."""

    forward: FlopBreakdown
    backward: FlopBreakdown
    recompute: FlopBreakdown

    @property
    def total(self) -> int:
        return self.forward.total + self.backward.total + self.recompute.total


# ------------------------------------------------------------------------------------------------
# The op list of one sample.


@dataclass(frozen=True)
class _Linear:
    group: str
    name: str  # full module path, e.g. "single_stream_layers.3.attn.to_q"
    fan_in: int
    fan_out: int
    tokens: int
    input_grad: bool  # does the input require grad in a LoRA training forward?


@dataclass(frozen=True)
class _Attention:
    group: str
    length: int
    needs_grad: bool


def _config_dict(config: Mapping[str, Any] | Any) -> dict[str, Any]:
    if isinstance(config, Mapping):
        return dict(config)
    return dict(config.items()) if hasattr(config, "items") else dict(vars(config))


@dataclass(frozen=True)
class _Dims:
    patch_in: int
    patch_out: int
    dim: int
    heads: int
    head_dim: int
    kv_width: int
    ffn: int
    cond: int
    feat: int
    freq: int
    refiners: int
    doubles: int
    singles: int

    @classmethod
    def from_config(cls, config: Mapping[str, Any] | Any) -> _Dims:
        from .transformer import instruction_feature_dim  # a late import: transformer imports diffusers

        c = _config_dict(config)
        p, cin = int(c.get("patch_size", 2)), int(c.get("in_channels", 16))
        cout = int(c.get("out_channels") or cin)
        dim, heads = int(c.get("hidden_size", 2304)), int(c.get("num_attention_heads", 24))
        kv_heads = int(c.get("num_kv_heads", 8))
        layers, doubles = int(c.get("num_layers", 26)), int(c.get("num_double_stream_layers", 2))
        head_dim = dim // heads
        feature_configs = c.get("instruction_feature_configs") or {"instruction_feat_dim": 1024}
        return cls(
            patch_in=p * p * cin,
            patch_out=p * p * cout,
            dim=dim,
            heads=heads,
            head_dim=head_dim,
            kv_width=kv_heads * head_dim,
            ffn=ffn_inner_dim(dim, int(c.get("multiple_of", 256)), c.get("ffn_dim_multiplier")),
            cond=min(dim, 1024),
            feat=instruction_feature_dim(dict(feature_configs)),
            freq=256,
            refiners=int(c.get("num_refiner_layers", 2)),
            doubles=doubles,
            singles=layers - doubles,
        )


def _sample_ops(
    dims: _Dims, ranks: Mapping[str, int], lc: int, target: int, refs: Sequence[int]
) -> Iterator[_Linear | _Attention]:
    """Every counted op of one sample, in forward order, with grad flags for a LoRA training step."""
    dm, kv, ffn = dims.dim, dims.kv_width, dims.ffn

    def adapted(*names: str) -> bool:
        return any(ranks.get(n, 0) > 0 for n in names)

    def attention_block(group, prefix, length, grad, modulated, adaln_rows):
        """Refiner / single-stream block (blocks.py BooguImageTransformerBlock); returns out grad."""
        if modulated:
            yield _Linear(group, f"{prefix}.norm1.linear", dims.cond, 4 * dm, adaln_rows, False)
        qkv = [f"{prefix}.attn.to_q", f"{prefix}.attn.to_k", f"{prefix}.attn.to_v"]
        for name, width in zip(qkv, (dm, kv, kv), strict=True):
            yield _Linear(group, name, dm, width, length, grad)
        attn_grad = grad or adapted(*qkv)
        yield _Attention(group, length, attn_grad)
        out = f"{prefix}.attn.to_out.0"
        yield _Linear(group, out, dm, dm, length, attn_grad)
        grad = grad or attn_grad or adapted(out)
        ff = f"{prefix}.feed_forward"
        l1, l2, l3 = f"{ff}.linear_1", f"{ff}.linear_2", f"{ff}.linear_3"
        yield _Linear(group, l1, dm, ffn, length, grad)
        yield _Linear(group, l3, dm, ffn, length, grad)
        mid = grad or adapted(l1, l3)
        yield _Linear(group, l2, ffn, dm, length, mid)
        return mid or adapted(l2)

    image = sum(refs) + target
    joint = lc + image
    # 1-2. Timestep MLP (one row per sample) and caption embedder (transformer.py steps 1-2).
    tce = "time_caption_embed"
    yield _Linear("embed", f"{tce}.timestep_embedder.linear_1", dims.freq, dims.cond, 1, False)
    yield _Linear("embed", f"{tce}.timestep_embedder.linear_2", dims.cond, dims.cond, 1, False)
    yield _Linear("embed", f"{tce}.caption_embedder.1", dims.feat, dm, lc, False)
    text_grad = False
    for i in range(dims.refiners):
        text_grad = yield from attention_block(
            "context_refiner", f"context_refiner.{i}", lc, text_grad, False, 0
        )
    yield _Linear("embed", "x_embedder", dims.patch_in, dm, target, False)
    target_grad = False
    for i in range(dims.refiners):
        target_grad = yield from attention_block(
            "noise_refiner", f"noise_refiner.{i}", target, target_grad, True, 1
        )
    ref_grad = False
    if refs:
        yield _Linear("embed", "ref_image_patch_embedder", dims.patch_in, dm, sum(refs), False)
        for i in range(dims.refiners):
            grads = []
            for n in refs:
                g = yield from attention_block(
                    "ref_image_refiner", f"ref_image_refiner.{i}", n, ref_grad, True, 1
                )
                grads.append(g)
            ref_grad = any(grads)
    img_grad, ins_grad = target_grad or ref_grad, text_grad
    for i in range(dims.doubles):
        img_grad, ins_grad = yield from _double_block(dims, ranks, i, lc, image, img_grad, ins_grad)
    grad = img_grad or ins_grad
    for i in range(dims.singles):
        grad = yield from attention_block("single_stream", f"single_stream_layers.{i}", joint, grad, True, 1)
    yield _Linear("norm_out", "norm_out.linear_1", dims.cond, dm, 1, False)
    yield _Linear("norm_out", "norm_out.linear_2", dm, dims.patch_out, joint, grad)


def _double_block(
    dims: _Dims, ranks: Mapping[str, int], i: int, lc: int, image: int, img_grad: bool, ins_grad: bool
) -> Iterator[_Linear | _Attention]:
    """Double-stream block (blocks.py BooguImageDoubleStreamTransformerBlock)."""
    g, dm, kv, ffn = "double_stream", dims.dim, dims.kv_width, dims.ffn
    prefix = f"double_stream_layers.{i}"

    def adapted(*names: str) -> bool:
        return any(ranks.get(n, 0) > 0 for n in names)

    for norm in ("img_norm1", "img_norm2", "img_norm3", "instruct_norm1", "instruct_norm2"):
        yield _Linear(g, f"{prefix}.{norm}.linear", dims.cond, 4 * dm, 1, False)
    proc = f"{prefix}.img_instruct_attn.processor"
    projections = []
    for stream, tokens, grad in (("img", image, img_grad), ("instruct", lc, ins_grad)):
        for what, width in (("q", dm), ("k", kv), ("v", kv)):
            name = f"{proc}.{stream}_to_{what}"
            projections.append(name)
            yield _Linear(g, name, dm, width, tokens, grad)
    joint_grad = img_grad or ins_grad or adapted(*projections)
    yield _Attention(g, lc + image, joint_grad)
    shared_out = f"{prefix}.img_instruct_attn.to_out.0"
    yield _Linear(g, f"{proc}.instruct_out", dm, dm, lc, joint_grad)
    yield _Linear(g, shared_out, dm, dm, lc, joint_grad or adapted(f"{proc}.instruct_out"))
    yield _Linear(g, f"{proc}.img_out", dm, dm, image, joint_grad)
    yield _Linear(g, shared_out, dm, dm, image, joint_grad or adapted(f"{proc}.img_out"))
    ins_attn_grad = joint_grad or adapted(f"{proc}.instruct_out", shared_out)
    img_attn_grad = joint_grad or adapted(f"{proc}.img_out", shared_out)
    sa = f"{prefix}.img_self_attn"
    qkv = [f"{sa}.to_q", f"{sa}.to_k", f"{sa}.to_v"]
    for name, width in zip(qkv, (dm, kv, kv), strict=True):
        yield _Linear(g, name, dm, width, image, img_grad)
    self_grad = img_grad or adapted(*qkv)
    yield _Attention(g, image, self_grad)
    yield _Linear(g, f"{sa}.to_out.0", dm, dm, image, self_grad)
    self_grad = self_grad or adapted(f"{sa}.to_out.0")
    out_grads = []
    # Both MLPs read the block input (blocks.py: img_norm2 / instruct_norm2 of img0 / ins0).
    for stream, tokens, grad in (("img", image, img_grad), ("instruct", lc, ins_grad)):
        ff = f"{prefix}.{stream}_feed_forward"
        yield _Linear(g, f"{ff}.linear_1", dm, ffn, tokens, grad)
        yield _Linear(g, f"{ff}.linear_3", dm, ffn, tokens, grad)
        mid = grad or adapted(f"{ff}.linear_1", f"{ff}.linear_3")
        yield _Linear(g, f"{ff}.linear_2", ffn, dm, tokens, mid)
        out_grads.append(mid or adapted(f"{ff}.linear_2"))
    new_img = img_grad or img_attn_grad or self_grad or out_grads[0]
    new_ins = ins_grad or ins_attn_grad or out_grads[1]
    return new_img, new_ins


# ------------------------------------------------------------------------------------------------
# LoRA ranks.


def _peft_matches(name: str, targets: Sequence[str]) -> bool:
    """peft's rule for a list of targets: the module name equals a target or ends with '.' + it."""
    return any(name == t or name.endswith("." + t) for t in targets)


def lora_ranks(config: Mapping[str, Any] | Any, rank: int, target_modules: Sequence[str]) -> dict[str, int]:
    """Full module path -> rank for every linear that peft would adapt (docs/upstream-model.md §2.7)."""
    dims = _Dims.from_config(config)
    names = set()
    for op in _sample_ops(dims, {}, 1, 1, (1,)):
        if isinstance(op, _Linear):
            names.add(op.name)
    return {n: rank for n in sorted(names) if _peft_matches(n, target_modules)}


def lora_ranks_from_model(model: nn.Module, *, include_disabled: bool = False) -> dict[str, int]:
    """Full module path -> active rank of every peft LoRA layer of ``model`` (no tensor is read).

    Layers whose adapters are disabled (``disable_adapter_layers``) are left out unless
    ``include_disabled``.
    """
    from peft.tuners.lora import LoraLayer

    from boogu_adapters.lora import PEFT_PREFIX

    ranks = {}
    for name, module in model.named_modules():
        if isinstance(module, LoraLayer) and (include_disabled or not module.disable_adapters):
            rank = sum(int(module.r[a]) for a in module.active_adapters if a in module.lora_A)
            if rank:
                ranks[name.removeprefix(PEFT_PREFIX)] = rank
    return ranks


# ------------------------------------------------------------------------------------------------
# The model.


def _sample_key(layout: Any, b: int) -> tuple[int, int, tuple[int, ...]]:
    h, w = layout.target_grids[b]
    return int(layout.text_lengths[b]), h * w, tuple(rh * rw for rh, rw in layout.reference_grids[b])


class FlopModel:
    """FLOPs of forwards of one transformer config with one LoRA, cached per distinct sample shape.

    Args:
        config: the transformer config: a dict like ``RELEASED_CONFIG``, ``model.config`` or a
            ``transformer/config.json`` mapping.
        lora: None (no LoRA), a :class:`LoraSpec`, a module carrying peft LoRA layers (ranks read
            with :func:`lora_ranks_from_model`), or a ``{module path: rank}`` mapping.
    """

    def __init__(
        self, config: Mapping[str, Any] | Any, lora: LoraSpec | nn.Module | Mapping[str, int] | None = None
    ):
        self.dims = _Dims.from_config(config)
        if lora is None:
            self.ranks: dict[str, int] = {}
        elif isinstance(lora, LoraSpec):
            self.ranks = lora_ranks(config, lora.rank, lora.target_modules)
        elif isinstance(lora, nn.Module):
            self.ranks = lora_ranks_from_model(lora)
        else:
            self.ranks = dict(lora)
        self._cache: dict[tuple[Any, ...], tuple[FlopBreakdown, ...]] = {}

    def _sample(self, key: tuple[int, int, tuple[int, ...]]) -> tuple[FlopBreakdown, ...]:
        """(forward, backward at 2x attention, backward at 2.5x attention, recompute, the forward's
        text path) of one sample."""
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        fwd, bwd, bwd_fused, rec = FlopBreakdown(), FlopBreakdown(), FlopBreakdown(), FlopBreakdown()
        text = FlopBreakdown()
        d = self.dims
        for op in _sample_ops(d, self.ranks, *key):
            on_text_path = op.group == "context_refiner" or (
                isinstance(op, _Linear) and op.name in _TEXT_PATH_LINEARS
            )
            if isinstance(op, _Attention):
                flops = 4 * op.length * op.length * d.heads * d.head_dim  # Q·Kᵀ + P·V
                fwd.attention[op.group] += flops
                if on_text_path:
                    text.attention[op.group] += flops
                if op.needs_grad:
                    bwd.attention[op.group] += 2 * flops
                    bwd_fused.attention[op.group] += 5 * flops // 2
                if op.group in _CHECKPOINTED:
                    rec.attention[op.group] += flops
                continue
            base = 2 * op.fan_in * op.fan_out * op.tokens
            rank = self.ranks.get(op.name, 0)
            lora = 2 * rank * (op.fan_in + op.fan_out) * op.tokens
            fwd.linear[op.group] += base
            fwd.lora[op.group] += lora
            if on_text_path:
                text.linear[op.group] += base
                text.lora[op.group] += lora
            if op.input_grad:
                bwd.linear[op.group] += base
            if rank:
                # lora_B: weight + input grads; lora_A: weight grad, input grad if x needs grad.
                back = 2 * rank * op.tokens * (2 * op.fan_out + op.fan_in * (2 if op.input_grad else 1))
                bwd.lora[op.group] += back
            if op.group in _CHECKPOINTED:
                rec.linear[op.group] += base
                rec.lora[op.group] += lora
        for src in (bwd,):
            bwd_fused.linear.update(src.linear)
            bwd_fused.lora.update(src.lora)
        result = (fwd, bwd, bwd_fused, rec, text)
        self._cache[key] = result
        return result

    def _sum(self, layout: Any, index: int) -> FlopBreakdown:
        total = FlopBreakdown()
        for b in range(len(layout.text_lengths)):
            total = total + self._sample(_sample_key(layout, b))[index]
        return total

    def forward(self, layout: Any, *, text_path: bool = True) -> FlopBreakdown:
        """FLOPs of one forward over ``layout`` (a TokenLayout), summed over its samples.

        ``text_path=False``: a forward that reused its caption embedding and context refiner
        (``InstructionCache``), which therefore did not compute them.
        """
        total = self._sum(layout, 0)
        return total if text_path else total - self._sum(layout, 4)

    def backward(self, layout: Any, *, attention_recompute: bool = False) -> FlopBreakdown:
        """FLOPs of the LoRA training backward of that forward (base weights frozen)."""
        return self._sum(layout, 2 if attention_recompute else 1)

    def recompute(self, layout: Any) -> FlopBreakdown:
        """Extra forward FLOPs of gradient checkpointing (every block re-run once in backward)."""
        return self._sum(layout, 3)

    def training(
        self, layout: Any, *, gradient_checkpointing: bool, attention_recompute: bool = False
    ) -> TrainingFlops:
        """Forward + backward (+ recompute) of a training forward over ``layout``."""
        return TrainingFlops(
            forward=self.forward(layout),
            backward=self.backward(layout, attention_recompute=attention_recompute),
            recompute=self.recompute(layout) if gradient_checkpointing else FlopBreakdown(),
        )

    def sample_totals(self, text: int, target: int, refs: Sequence[int] = ()) -> tuple[int, int, int]:
        """(forward, backward, recompute) totals of one sample given token counts; cached."""
        fwd, bwd, _, rec, _ = self._sample((int(text), int(target), tuple(int(r) for r in refs)))
        return fwd.total, bwd.total, rec.total


def forward_flops(
    config: Mapping[str, Any] | Any, layout: Any, lora: LoraSpec | nn.Module | Mapping[str, int] | None = None
) -> FlopBreakdown:
    """FLOPs of one forward (see :class:`FlopModel` for the arguments)."""
    return FlopModel(config, lora).forward(layout)


def backward_flops(
    config: Mapping[str, Any] | Any,
    layout: Any,
    lora: LoraSpec | nn.Module | Mapping[str, int] | None,
    *,
    attention_recompute: bool = False,
) -> FlopBreakdown:
    """FLOPs of the LoRA training backward (see :meth:`FlopModel.backward`)."""
    return FlopModel(config, lora).backward(layout, attention_recompute=attention_recompute)


def training_flops(
    config: Mapping[str, Any] | Any,
    layout: Any,
    lora: LoraSpec | nn.Module | Mapping[str, int] | None,
    *,
    gradient_checkpointing: bool,
    attention_recompute: bool = False,
) -> TrainingFlops:
    """Forward + backward (+ checkpointing's recompute) of one training forward."""
    return FlopModel(config, lora).training(
        layout, gradient_checkpointing=gradient_checkpointing, attention_recompute=attention_recompute
    )
