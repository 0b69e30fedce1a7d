"""The fake-CUDA machinery of the dry run: the session, its dispatch mode (devices, host reads,
collectives, memory), the stand-ins for what a fake tensor or a missing driver cannot do, and the
reward stand-in. What it checks and why: the package's docstring (`boogu_dryrun`)."""

from __future__ import annotations

import contextlib
import logging
import sys
import traceback
import weakref
from collections import Counter
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch._subclasses.fake_tensor import (
    DataDependentOutputException,
    DynamicOutputShapeException,
    FakeTensor,
    unset_fake_temporarily,
)
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_map
from torch.utils.weak import WeakIdKeyDictionary

from boogu_schedule import generator_factory
from boogu_schedule.hot import is_per_iteration

logger = logging.getLogger("boogu_trainer")

__all__ = [
    "BY_DESIGN",
    "SHADOW_LIMIT",
    "STAND_IN_ANSWERS",
    "CollectiveCall",
    "CudaStandIns",
    "DryRunError",
    "DryRunMode",
    "FakeCudaGenerator",
    "HostRead",
    "HostScores",
    "RandomOpCheck",
    "Session",
    "fake_cuda",
]

SHADOW_LIMIT = 1 << 16
"""Largest tensor (elements) whose values the dry run computes on real CPU copies."""

# The loops' functions are marked where they are defined (`boogu_schedule.hot.per_iteration`: the
# denoising loop, every transformer call, FlowGRPO's recomputed transition, the update's micro-batch x
# loss-term loop, every learner's `losses`, the old values of DiffusionNFT / AWM, the optimizer step):
# a host read under a marked frame stalls the GPU's queue at every iteration.


BY_DESIGN = {
    "boogu_trainer.learner:Learner.optimizer_step": "one read per optimizer step: were the losses and "
    "the gradient norm finite (skips the step on every rank)",
    "boogu_trainer.learner:Learner._weights_finite": "one read per optimizer step: did the update keep "
    "the LoRA finite (undoes it)",
    "boogu_trainer.distributed:DistEnv.any": "the all-reduced flag of the two reads above, on several ranks",
}
"""Host reads inside the loops that the design makes on purpose, by site, with why."""


STAND_IN_ANSWERS = {"boogu_trainer.learner:Learner._weights_finite": True}
"""The "no problem" answer of a yes/no host read whose value a fake tensor does not have, by site
(the default, False, is "no problem" for questions such as "was anything non-finite?")."""


class DryRunError(RuntimeError):
    """The code did something on fake CUDA that a real GPU would refuse (or stall on)."""


# ------------------------------------------------------------------------------------------------
# Generators


class FakeCudaGenerator(torch.Generator):
    """A CPU generator standing in for one on ``device`` (a CUDA generator needs a driver).

    ``.device`` answers the device it stands for, so code that writes ``device=generator.device``
    behaves as on a GPU; :class:`RandomOpCheck` compares every random op's device with it.
    """

    def __new__(cls, device: torch.device | str) -> FakeCudaGenerator:
        self = super().__new__(cls)
        self._stands_for = torch.device(device)
        return self

    @property
    def device(self) -> torch.device:  # type: ignore[override]
        return self._stands_for


def _fake_generator(device: torch.device) -> torch.Generator:
    if device.type == "cuda":
        return FakeCudaGenerator(torch.device("cuda", device.index or 0))
    return FakeCudaGenerator(device)  # a CPU generator that says so


RANDOM_FACTORIES = ("randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial")


class RandomOpCheck:
    """Wraps ``torch.<random factory>``: with ``generator=``, the op's device must be the generator's.

    A real CUDA generator refuses to fill a CPU tensor (and a CPU generator a CUDA one); fake mode does
    not check either, so this does. The device of the op is its ``device=`` argument, else its first
    tensor argument's, else the CPU (PyTorch's default).
    """

    def __init__(self, session: Session):
        self.session = session
        self._saved: dict[str, Callable[..., Any]] = {}

    def __enter__(self) -> RandomOpCheck:
        for name in RANDOM_FACTORIES:
            original = getattr(torch, name)
            self._saved[name] = original
            setattr(torch, name, self._wrap(name, original))
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, original in self._saved.items():
            setattr(torch, name, original)
        self._saved.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        def checked(*args: Any, **kwargs: Any) -> Any:
            generator = kwargs.get("generator")
            if generator is not None:
                if "device" in kwargs and kwargs["device"] is not None:
                    device = torch.device(kwargs["device"])
                else:
                    tensors = [a for a in args if isinstance(a, torch.Tensor)]
                    device = tensors[0].device if tensors else torch.device("cpu")
                made_for = generator.device
                if device.type != made_for.type:
                    self.session.fail(
                        f"torch.{name} draws a {device.type} tensor from a generator made for "
                        f"{made_for} (a real {made_for.type} generator refuses this): pass "
                        f"device=generator.device"
                    )
            return original(*args, **kwargs)

        return checked


# ------------------------------------------------------------------------------------------------
# torch.cuda without a driver


class _Stream:
    def __init__(self, device: Any = None, priority: int = 0, **kwargs: Any) -> None:
        self.device = torch.device("cuda", 0)
        self.priority = priority
        self.device_index, self.device_type = 0, "cuda"

    def wait_event(self, event: Any) -> None: ...

    def wait_stream(self, stream: Any) -> None: ...

    def record_event(self, event: Any = None) -> Any:
        event = event or _Event()
        event.record(self)
        return event

    def synchronize(self) -> None: ...

    def query(self) -> bool:
        return True


class _Event:
    def __init__(self, enable_timing: bool = False, blocking: bool = False, interprocess: bool = False):
        self.enable_timing = enable_timing

    def record(self, stream: Any = None) -> None: ...

    def wait(self, stream: Any = None) -> None: ...

    def query(self) -> bool:
        return True

    def synchronize(self) -> None: ...

    def elapsed_time(self, end: Any) -> float:
        return 0.0


class CudaStandIns:
    """Replaces the ``torch.cuda`` functions that need a driver, for the dry run only.

    Streams and events do nothing (so stream-ordering bugs are not checked); ``synchronize`` is
    recorded as a host read; the device count is the world size, the name an H200's (its datasheet
    peak gives ``perf/mfu``); memory statistics read the dry run's own tracker.
    """

    def __init__(self, session: Session, world_size: int):
        self.session = session
        self.world_size = world_size
        self._saved: dict[str, Any] = {}
        self._default = _Stream()

    def _replacements(self) -> dict[str, Any]:
        session = self.session
        return {
            "device_count": lambda: self.world_size,
            "current_device": lambda: 0,
            "set_device": lambda device: None,
            "get_device_name": lambda device=None: "NVIDIA H200",
            "get_device_capability": lambda device=None: (9, 0),
            # Only fake tensors reach a CUDA device here; nothing needs the driver initialised.
            "_lazy_init": lambda: None,
            "Stream": _Stream,
            "Event": _Event,
            "current_stream": lambda device=None: self._default,
            "default_stream": lambda device=None: self._default,
            "stream": lambda s=None: contextlib.nullcontext(),
            "synchronize": lambda device=None: session.synchronize(),
            "max_memory_allocated": lambda device=None: session.peak_bytes,
            "memory_allocated": lambda device=None: session.live_bytes,
            "reset_peak_memory_stats": lambda device=None: session.reset_peak(),
            "empty_cache": lambda: None,
            "get_rng_state": lambda device="cuda": torch.zeros(16, dtype=torch.uint8, device="cpu"),
            "set_rng_state": lambda state, device="cuda": None,
            "get_rng_state_all": lambda: [],
            "set_rng_state_all": lambda states: None,
            "manual_seed_all": lambda seed: None,
        }

    def __enter__(self) -> CudaStandIns:
        for name, value in self._replacements().items():
            self._saved[name] = getattr(torch.cuda, name)
            setattr(torch.cuda, name, value)
        return self

    def __exit__(self, *exc: Any) -> None:
        for name, value in self._saved.items():
            setattr(torch.cuda, name, value)
        self._saved.clear()


# ------------------------------------------------------------------------------------------------
# Module.to and backward on fake tensors


@contextlib.contextmanager
def _fake_module_conversion() -> Iterator[None]:
    """``Module.to`` / ``to_empty`` swap every fake parameter (``torch.utils.swap_tensors``), which the
    fake mode's own weak references refuse; the parameter takes the converted data in place instead
    (what ``param.data = ...`` did before swapping was the default)."""
    import torch.utils

    swap = torch.utils.swap_tensors

    def swap_or_set(t1: torch.Tensor, t2: torch.Tensor) -> None:
        try:
            swap(t1, t2)
        except RuntimeError as error:
            if "weakref" not in str(error) or not _is_fake(t1):
                raise
            t1.data = t2.detach()
            t1.fake_device = t2.fake_device  # a fake tensor's device is this attribute, not its data's

    torch.utils.swap_tensors = swap_or_set
    try:
        yield
    finally:
        torch.utils.swap_tensors = swap


@contextlib.contextmanager
def _fused_attention(session: Session) -> Iterator[None]:
    """``F.scaled_dot_product_attention`` takes the fused kernel an H200 takes: flash attention
    without a mask, memory-efficient attention with one (flash takes no mask).

    Without a driver PyTorch picks the math kernel, whose ``L x L`` scores (55 GB for one released
    rollout call) a GPU never materialises; the fused kernels' fake implementations book what the
    real ones keep (the output and a float32 log-sum-exp)."""
    import torch.nn.functional as F

    original = F.scaled_dot_product_attention
    aten = torch.ops.aten

    def attention(
        query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False
    ):
        if not _is_fake(query) or query.device.type != "cuda":
            return original(
                query, key, value, attn_mask, dropout_p, is_causal, scale=scale, enable_gqa=enable_gqa
            )
        if enable_gqa and key.shape[-3] != query.shape[-3]:
            repeat = query.shape[-3] // key.shape[-3]
            key, value = key.repeat_interleave(repeat, -3), value.repeat_interleave(repeat, -3)
        if attn_mask is None and query.dtype in (torch.float16, torch.bfloat16):
            session.stand_in("attention kernel: flash (as on an H200)")
            return aten._scaled_dot_product_flash_attention(
                query, key, value, dropout_p, is_causal, scale=scale
            )[0]
        session.stand_in("attention kernel: memory-efficient (as on an H200)")
        bias = None
        if attn_mask is not None:
            if attn_mask.dtype == torch.bool:
                bias = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device)
                bias = bias.masked_fill(~attn_mask, float("-inf"))
            else:
                bias = attn_mask.to(query.dtype)
            bias = bias.expand(query.shape[0], query.shape[-3], query.shape[-2], key.shape[-2])
        need_lse = torch.is_grad_enabled() and any(t.requires_grad for t in (query, key, value))
        return aten._scaled_dot_product_efficient_attention(
            query, key, value, bias, need_lse, dropout_p, is_causal, scale=scale
        )[0]

    F.scaled_dot_product_attention = attention
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


@contextlib.contextmanager
def _tensor_from_fake_scalars() -> Iterator[None]:
    """``torch.tensor([t0, t1, ...])`` of 0-d CUDA tensors reads each to the host (Qwen3-VL's rope
    index does this); PyTorch's C++ path copies real memory for it, so the values are read here
    first, through the fake tensors' host reads (recorded like any other)."""
    original = torch.tensor

    def tensor(data: Any, *args: Any, **kwargs: Any) -> torch.Tensor:
        if isinstance(data, (list, tuple)):
            data = tree_map(lambda x: x.item() if isinstance(x, torch.Tensor) and _is_fake(x) else x, data)
        return original(data, *args, **kwargs)

    torch.tensor = tensor  # type: ignore[assignment]
    try:
        yield
    finally:
        torch.tensor = original  # type: ignore[assignment]


def _graph_leaves(roots: Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """The leaf tensors (``AccumulateGrad`` nodes) an autograd graph reaches from ``roots``."""
    leaves, seen, stack = [], set(), [t.grad_fn for t in roots if t.grad_fn is not None]
    while stack:
        node = stack.pop()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        variable = getattr(node, "variable", None)
        if variable is not None:
            leaves.append(variable)
        stack.extend(next_node for next_node, _ in node.next_functions)
    return leaves


class _Saved:
    """A tensor saved for backward, released by `BackwardStandIn.backward`."""

    __slots__ = ("__weakref__", "tensor")

    def __init__(self, tensor: torch.Tensor):
        self.tensor: torch.Tensor | None = tensor


class BackwardStandIn:
    """``backward`` on fake CUDA: every leaf the graph reaches gets a zero gradient of its own shape,
    dtype and device (accumulated as autograd would), then the graph is dropped.

    PyTorch's autograd engine asks the CUDA driver whether a device has a context before it runs a
    graph with CUDA tensors (``Engine::compute_dependencies`` → ``CUDAHooks::hasPrimaryContext``), so a
    real backward cannot run without a driver. What this leaves out, and the dry run says so: the
    backward kernels' devices (they follow the forward's, which are checked), FSDP2's backward
    collectives (the reduce-scatter of each unit) and the recomputation of checkpointed blocks (one
    block's activations, a small part of the training peak).
    """

    def __init__(self, session: Session):
        self.session = session
        self._saved: dict[str, Any] = {}
        self._held: weakref.WeakSet[_Saved] = weakref.WeakSet()
        self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)

    # Every tensor a forward saves for backward goes through these, so that a stand-in backward can
    # release them as a real one does (the training peak is one micro-batch's activations, not two).
    # Weakly held here: a graph that is dropped without a backward frees its tensors as it would.
    def _pack(self, tensor: torch.Tensor) -> _Saved:
        saved = _Saved(tensor)
        self._held.add(saved)
        return saved

    @staticmethod
    def _unpack(saved: _Saved) -> torch.Tensor:
        if saved.tensor is None:
            raise DryRunError("a saved tensor was used after its graph's backward (retain_graph)")
        return saved.tensor

    def __enter__(self) -> BackwardStandIn:
        self._hooks.__enter__()
        self._saved = {"backward": torch.autograd.backward, "tensor_backward": torch.Tensor.backward}
        torch.autograd.backward = self.backward  # type: ignore[assignment]
        torch.Tensor.backward = lambda t, gradient=None, retain_graph=None, create_graph=False, inputs=None: (  # type: ignore[method-assign]
            self.backward(t, gradient, retain_graph, create_graph, inputs=inputs)
        )
        return self

    def __exit__(self, *exc: Any) -> None:
        torch.autograd.backward = self._saved["backward"]  # type: ignore[assignment]
        torch.Tensor.backward = self._saved["tensor_backward"]  # type: ignore[method-assign]
        self._hooks.__exit__(*exc)
        self._held.clear()

    def backward(
        self,
        tensors: Any,
        grad_tensors: Any = None,
        retain_graph: Any = None,
        create_graph: bool = False,
        grad_variables: Any = None,
        inputs: Any = None,
    ) -> None:
        roots = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        self.session.stand_in("backward: zero gradients on every reached leaf (the engine needs a driver)")
        for leaf in inputs if inputs is not None else _graph_leaves(roots):
            if not leaf.requires_grad:
                continue
            with torch.no_grad():
                grad = torch.zeros_like(leaf)
                if leaf.grad is None:
                    leaf.grad = grad
                else:
                    leaf.grad.add_(grad)
            for hook in (getattr(leaf, "_post_accumulate_grad_hooks", None) or {}).values():
                hook(leaf)
        if not retain_graph:
            for saved in list(self._held):  # the graphs' saved activations die here, as in a real backward
                saved.tensor = None
            self._held.clear()


# ------------------------------------------------------------------------------------------------
# The dispatch mode: shadows, host reads, collectives, memory


@dataclass
class HostRead:
    site: str
    """``module:qualname`` of the innermost function of our packages that read."""
    phase: str
    """The `DistEnv.collective` block it ran in (``rollout, step 1``, ``update, step 1``, ...)."""
    in_loop: bool
    stand_in: bool
    """No real value was known (a fake tensor's value): the read returned 0 / 0.0 / False."""


@dataclass
class CollectiveCall:
    op: str
    phase: str
    shapes: tuple[tuple[int, ...], ...]
    dtypes: tuple[str, ...]
    devices: tuple[str, ...]


_OUR_PACKAGES = ("boogu_schedule", "boogu_data", "boogu_adapters", "boogu_trainer", "boogu_vllm")


def _our_frames() -> list[tuple[str, str]]:
    """(module, qualname) of the frames of our packages on the stack, innermost first."""
    frames = []
    f = sys._getframe(2)
    while f is not None:
        path = Path(f.f_code.co_filename)
        parts = path.parts
        for package in _OUR_PACKAGES:
            if package in parts:
                i = parts.index(package)
                module = ".".join((*parts[i:-1], path.stem))
                if module != __name__:  # the dry run's own frames are not the reader
                    frames.append((module, f.f_code.co_qualname))
                break
        f = f.f_back
    return frames


def _in_per_iteration() -> bool:
    """Whether a frame on the stack is a function marked `boogu_schedule.hot.per_iteration`."""
    f = sys._getframe(2)
    while f is not None:
        if is_per_iteration(f.f_code):
            return True
        f = f.f_back
    return False


def _tensors(obj: Any) -> list[torch.Tensor]:
    """The tensors in an op's arguments or results (tuples, lists and dicts of them), in order."""
    if isinstance(obj, torch.Tensor):
        return [obj]
    found: list[torch.Tensor] = []
    stack = [obj]
    while stack:
        item = stack.pop()
        if isinstance(item, torch.Tensor):
            found.append(item)
        elif isinstance(item, (list, tuple)):
            stack.extend(reversed(item))
        elif isinstance(item, dict):
            stack.extend(reversed(list(item.values())))
    return found


def _is_fake(t: torch.Tensor) -> bool:
    return isinstance(t, FakeTensor)


_IN_PLACE_RANDOM = frozenset(
    {
        torch.ops.aten.uniform_,
        torch.ops.aten.normal_,
        torch.ops.aten.random_,
        torch.ops.aten.bernoulli_,
        torch.ops.aten.exponential_,
        torch.ops.aten.log_normal_,
        torch.ops.aten.cauchy_,
        torch.ops.aten.geometric_,
    }
)


_UNINITIALISED = frozenset(
    {torch.ops.aten.empty, torch.ops.aten.empty_strided, torch.ops.aten.empty_like, torch.ops.aten.new_empty}
)


class DryRunMode(TorchDispatchMode):
    """Sees every op under the fake mode: keeps shadows, answers host reads, checks collectives,
    books memory."""

    def __init__(self, session: Session):
        super().__init__()
        self.session = session
        self.shadows: WeakIdKeyDictionary = WeakIdKeyDictionary()

    # ---- shadows -----------------------------------------------------------------------------------
    def shadow_of(self, t: torch.Tensor) -> torch.Tensor | None:
        if not _is_fake(t):
            return t if t.device.type == "cpu" else None
        return self.shadows.get(t)

    def _real(self, x: Any) -> Any:
        if isinstance(x, torch.Tensor):
            return self.shadow_of(x)
        if isinstance(x, torch.device) and x.type != "cpu":
            return torch.device("cpu")
        return x

    def _shadow(self, func: Any, args: tuple, kwargs: dict, out: Any, outs: list[torch.Tensor]) -> None:
        if func.overloadpacket in _UNINITIALISED:
            return  # no values to know (and no weak reference on new parameters, which `Module.to` swaps)
        outs = [t for t in outs if _is_fake(t)]
        if not outs:
            return
        known = all(o.numel() <= SHADOW_LIMIT for o in outs) and all(
            self.shadow_of(t) is not None for t in _tensors((args, kwargs))
        )
        real_out = None
        if known:
            try:
                real_args, real_kwargs = tree_map(self._real, (args, kwargs))
                with unset_fake_temporarily():
                    real_out = func(*real_args, **real_kwargs)
            except Exception:  # an op the CPU cannot run (dtype, stand-in indices): no shadow
                real_out = None
        reals = _tensors(real_out) if real_out is not None else []
        if len(reals) != len(outs):
            for o in outs:
                self.shadows.pop(o, None)
            return
        for o, r in zip(outs, reals):
            self.shadows[o] = r

    # ---- dispatch ------------------------------------------------------------------------------------
    def __torch_dispatch__(self, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        aten = torch.ops.aten
        if func is aten._local_scalar_dense.default:
            return self.session.host_read(args[0], self.shadow_of(args[0]))
        if func is aten._pin_memory.default:
            self.session.stand_in("pinned memory (needs a driver): the tensor itself")
            out = args[0]
            return out
        if func is aten.is_pinned.default:
            return True
        if func.overloadpacket in _IN_PLACE_RANDOM and kwargs.get("generator") is None and _is_fake(args[0]):
            # Weight initialisers draw from the default CUDA generator, which needs a driver; a fake
            # tensor has no values to fill.
            self.session.stand_in("in-place random fill without a generator (initialisers): skipped")
            return args[0]
        namespace = getattr(func, "namespace", "")
        if namespace in ("c10d", "_c10d_functional"):
            self.session.collective(func, args, kwargs)
            out = func(*args, **kwargs)
            self._replicate(func, args, out)
            return out
        try:
            out = func(*args, **kwargs)
        except (DynamicOutputShapeException, DataDependentOutputException):
            out = self._from_shadows(func, args, kwargs)
        outs = _tensors(out)
        self._book(outs)
        self._shadow(func, args, kwargs, out, outs)
        return out

    def _from_shadows(self, func: Any, args: tuple, kwargs: dict) -> Any:
        """An op whose output shape depends on values (``nonzero``, ``unique``, boolean indexing): run
        it on the inputs' shadows and make fake tensors of the result on the inputs' device. An input
        without a shadow (the data that a known mask selects from) takes zeros of its shape: the
        result's shape is right, its values unknown. Without the values that decide the shape, the
        dry run cannot follow the op, and says which."""
        inputs = _tensors((args, kwargs))
        unknown = [t for t in inputs if self.shadow_of(t) is None]
        deciding = [
            t for t in unknown if t.dtype in (torch.bool, torch.int64, torch.int32) or t.numel() > 1 << 26
        ]
        if deciding:
            raise DryRunError(
                f"{func} has a value-dependent output shape and the values that decide it are unknown "
                f"here (shapes {[tuple(t.shape) for t in deciding]}): the dry run cannot follow it"
            )
        device = inputs[0].device if inputs else torch.device("cpu")

        def real(x: Any) -> Any:
            if isinstance(x, torch.Tensor) and self.shadow_of(x) is None:
                with unset_fake_temporarily():
                    return torch.zeros(x.shape, dtype=x.dtype)
            return self._real(x)

        real_args, real_kwargs = tree_map(real, (args, kwargs))
        with unset_fake_temporarily():
            real_out = func(*real_args, **real_kwargs)
        fake_mode = next(t.fake_mode for t in inputs if _is_fake(t))

        def to_fake(r: Any) -> Any:
            if not isinstance(r, torch.Tensor):
                return r
            return torch.ops.aten._to_copy.default(fake_mode.from_tensor(r), device=device)

        out = tree_map(to_fake, real_out)
        if not unknown:
            for o, r in zip(_tensors(out), _tensors(real_out)):
                if isinstance(o, torch.Tensor):
                    self.shadows[o] = r
        return out

    # ---- memory --------------------------------------------------------------------------------------
    def _book(self, outs: list[torch.Tensor]) -> None:
        """Book the storage of every new CUDA tensor an op made (views and in-place results alias a
        booked storage and make none); unbook it when the storage dies."""
        for t in outs:
            if t.device.type != "cuda":
                continue
            storage = t.untyped_storage()
            key = storage._cdata
            if key in self.session.booked:
                continue
            self.session.book(key, storage.nbytes())
            weakref.finalize(storage, self.session.unbook, key)

    def _replicate(self, func: Any, args: tuple, out: Any) -> None:
        """The fake group moves no data: every output of a small collective takes this rank's values."""
        name = func._schema.name
        if "allgather" in name or "all_gather" in name:
            outputs, inputs = args[0], args[1]
            outs = _tensors(outputs)
            ins = _tensors(inputs)
            if len(ins) == 1:
                source = self.shadow_of(ins[0])
                for o in outs:
                    if source is not None and o.numel() % max(source.numel(), 1) == 0:
                        reps = o.numel() // max(source.numel(), 1)
                        with unset_fake_temporarily():
                            self.shadows[o] = source.reshape(-1).repeat(reps).reshape(o.shape).clone()
                    else:
                        self.shadows.pop(o, None)
        # all_reduce / broadcast work in place: the input keeps its (replicated) values.


# ------------------------------------------------------------------------------------------------
# The session


@dataclass
class Session:
    """Everything one dry run recorded."""

    world_size: int = 1
    rank: int = 0
    host_reads: list[HostRead] = field(default_factory=list)
    collectives: list[CollectiveCall] = field(default_factory=list)
    stand_ins: Counter = field(default_factory=Counter)
    errors: list[str] = field(default_factory=list)
    live_bytes: int = 0
    peak_bytes: int = 0
    phase_peaks: dict[str, int] = field(default_factory=dict)
    mode: DryRunMode | None = None

    # ---- checks ----------------------------------------------------------------------------------------
    def fail(self, message: str) -> None:
        where = "".join(traceback.format_stack(limit=14)[:-2])
        self.errors.append(message)
        raise DryRunError(f"{message}\n{where}")

    def stand_in(self, what: str) -> None:
        self.stand_ins[what] += 1

    def phase(self) -> str:
        from boogu_trainer.distributed import current_collective

        return current_collective() or "setup"

    def host_read(self, tensor: torch.Tensor, shadow: torch.Tensor | None) -> Any:
        frames = _our_frames()
        site = f"{frames[0][0]}:{frames[0][1]}" if frames else "(outside our packages)"
        in_loop = _in_per_iteration()
        device_read = tensor.device.type != "cpu"
        if device_read:
            self.host_reads.append(HostRead(site, self.phase(), in_loop, shadow is None))
        if shadow is not None:
            with unset_fake_temporarily():
                return shadow.reshape(()).item()
        if tensor.dtype == torch.bool:
            return STAND_IN_ANSWERS.get(site, False)
        return 0.0 if tensor.is_floating_point() or tensor.is_complex() else 0

    def synchronize(self) -> None:
        frames = _our_frames()
        site = f"{frames[0][0]}:{frames[0][1]} (torch.cuda.synchronize)" if frames else "synchronize"
        in_loop = _in_per_iteration()
        self.host_reads.append(HostRead(site, self.phase(), in_loop, False))

    def collective(self, func: Any, args: tuple, kwargs: dict) -> None:
        tensors = _tensors((args, kwargs))
        devices = tuple(str(t.device) for t in tensors)
        call = CollectiveCall(
            op=func._schema.name,
            phase=self.phase(),
            shapes=tuple(tuple(t.shape) for t in tensors),
            dtypes=tuple(str(t.dtype).removeprefix("torch.") for t in tensors),
            devices=devices,
        )
        self.collectives.append(call)
        wrong = sorted({d for d in devices if not d.startswith("cuda")})
        if wrong:
            self.fail(
                f"collective {call.op} in '{call.phase}' got tensors on {wrong} (shapes {call.shapes}): "
                "a NCCL process group takes CUDA tensors only"
            )

    # ---- memory ------------------------------------------------------------------------------------------
    booked: dict[int, int] = field(default_factory=dict)
    """Live CUDA storages (by ``_cdata``) and their bytes."""

    def book(self, key: int, nbytes: int) -> None:
        self.booked[key] = nbytes
        self._grow(nbytes)

    def unbook(self, key: int) -> None:
        self.live_bytes -= self.booked.pop(key, 0)

    def resized(self, key: int, nbytes: int) -> None:
        """A booked storage changed size in place (FSDP2 frees and re-allocates unsharded parameters so)."""
        if key in self.booked:
            self._grow(nbytes - self.booked[key])
            self.booked[key] = nbytes

    def _grow(self, delta: int) -> None:
        self.live_bytes += delta
        if self.live_bytes > self.peak_bytes:
            self.peak_bytes = self.live_bytes
        if delta > 0:
            phase = self.phase()
            if self.live_bytes > self.phase_peaks.get(phase, 0):
                self.phase_peaks[phase] = self.live_bytes

    def reset_peak(self) -> None:
        self.peak_bytes = self.live_bytes

    # ---- report ------------------------------------------------------------------------------------------
    def host_read_summary(self) -> dict[str, Any]:
        in_loops = Counter(r.site for r in self.host_reads if r.in_loop and r.site not in BY_DESIGN)
        by_design = Counter(r.site for r in self.host_reads if r.in_loop and r.site in BY_DESIGN)
        outside = Counter(r.site for r in self.host_reads if not r.in_loop)
        return {
            "host_reads_in_loops": sum(in_loops.values()),
            "in_loops": dict(in_loops),
            "by_design": {k: {"count": v, "why": BY_DESIGN[k]} for k, v in by_design.items()},
            "outside_loops": dict(outside),
            "stand_in_values": sum(r.stand_in for r in self.host_reads),
        }


@contextlib.contextmanager
def fake_cuda(world_size: int = 1) -> Iterator[Session]:
    """Run the block on fake CUDA: fake tensors, the fake process group (``world_size`` ranks, this
    process rank 0), the CUDA stand-ins, the generator seam and the checks. Yields the `Session`."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from boogu_trainer.distributed import fake_process_group

    session = Session(world_size=world_size)
    group = fake_process_group(world_size) if world_size > 1 else contextlib.nullcontext()
    mode = DryRunMode(session)
    session.mode = mode
    resize = torch.UntypedStorage.resize_

    def tracked_resize(storage: torch.UntypedStorage, size: int) -> Any:
        out = resize(storage, size)
        session.resized(storage._cdata, storage.nbytes())
        return out

    torch.UntypedStorage.resize_ = tracked_resize  # type: ignore[method-assign]
    try:
        with (
            group,
            CudaStandIns(session, world_size),
            _fake_module_conversion(),
            _tensor_from_fake_scalars(),
            _fused_attention(session),
            BackwardStandIn(session),
            generator_factory(_fake_generator),
            RandomOpCheck(session),
            FakeTensorMode(allow_non_fake_inputs=True),
            mode,
        ):
            yield session
    finally:
        torch.UntypedStorage.resize_ = resize  # type: ignore[method-assign]


# ------------------------------------------------------------------------------------------------
# The reward stand-in


class HostScores:
    """A reward for fake images: a seeded random score in [0, 1) per image, computed on the host.

    Images of a fake model have no pixels, so no real reward can score them; this one checks what a
    reward receives (uint8 (B, 3, H, W) on the rollout's device) and returns host values, as a remote
    scorer would. Used by the dry run only, by import path: ``boogu_dryrun.session:HostScores``.
    """

    def __init__(self, seed: int = 0):
        self.seed = seed
        self.calls = 0

    def __call__(self, images: torch.Tensor, records: Sequence[Any]) -> torch.Tensor:
        if images.dtype != torch.uint8 or images.dim() != 4 or images.shape[1] != 3:
            raise DryRunError(
                f"HostScores: expected uint8 (B, 3, H, W) images, got {images.dtype} {tuple(images.shape)}"
            )
        self.calls += 1
        from boogu_schedule import make_generator

        gen = make_generator(self.seed + self.calls)
        return torch.rand(images.shape[0], generator=gen, device="cpu")
