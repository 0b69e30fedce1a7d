"""Process-group plumbing: a no-op for one process, torchrun + gloo/NCCL for several.

`DistEnv` owns the rank's device and every collective the trainer issues. Under torchrun each rank
takes ``cuda:LOCAL_RANK`` (``torch.cuda.set_device`` before the process group starts, and
``device_id=`` to ``init_process_group``), and every component takes its device from
``DistEnv.device``. A tensor handed to a collective is moved to that device first: a pure NCCL
group accepts CUDA tensors only, and CPU tensors would pass every CPU test and fail on the GPU.
No module of the trainer calls ``torch.distributed`` itself (a test checks it).

Each rank rolls out its share of the prompt groups (a group never spans ranks); rewards are
gathered so advantages use the statistics of the whole global batch. Every collective goes through
`DistEnv` with a name, and the process group has a finite timeout (``distributed.timeout_s``): on
gloo a rank that stalls or dies makes the others stop with a `CollectiveTimeout` that names the
collective and the step. On NCCL, the watchdog's asynchronous error handling aborts the process
group and ends the process instead (``TORCH_NCCL_ASYNC_ERROR_HANDLING=1``, which torchrun reports as
a failed rank): the name of the last collective each rank entered is logged at debug level and
kept in :func:`current_collective`.
"""

from __future__ import annotations

import contextlib
import contextvars
import datetime
import logging
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from boogu_protocol import resolve_device_type

logger = logging.getLogger("boogu_trainer")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: another rank stalled, died or diverged."""


class DeviceError(ValueError):
    """A device setting that cannot work on this machine or with this many ranks."""


_current: contextvars.ContextVar[str | None] = contextvars.ContextVar("boogu_collective", default=None)


def current_collective() -> str | None:
    """The name of the innermost `DistEnv.collective` block being run (None outside any)."""
    return _current.get()


def resolve_device(spec: str | torch.device, local_rank: int = 0, world_size: int = 1) -> torch.device:
    """The device of this rank for ``model.device``: always an indexed ``cuda:N`` or ``cpu``.

    ``auto``: ``cuda:LOCAL_RANK`` when CUDA is available, else the CPU. ``cuda``: ``cuda:LOCAL_RANK``.
    ``cuda:N`` names one GPU, so it is refused on more than one rank (every rank would use it).
    """
    text = str(spec)
    if text == "auto":
        text = resolve_device_type(text)  # cuda when CUDA is available, else cpu
    try:
        device = torch.device(text)
    except (RuntimeError, TypeError) as error:
        raise DeviceError(f"model.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {text!r}") from error
    if device.type not in ("cpu", "cuda"):
        raise DeviceError(f"model.device must be 'auto', 'cpu', 'cuda' or 'cuda:N', got {text!r}")
    if device.type == "cpu":
        return torch.device("cpu")
    if not torch.cuda.is_available():
        raise DeviceError(f"model.device={text!r} but CUDA is not available on this machine")
    if device.index is not None:
        if world_size > 1:
            raise DeviceError(
                f"model.device={text!r} names one GPU, but this job has {world_size} ranks (every rank "
                "would use it): use model.device=cuda or auto, and each rank takes cuda:LOCAL_RANK"
            )
        return device
    count = torch.cuda.device_count()
    if local_rank >= count:
        raise DeviceError(
            f"LOCAL_RANK={local_rank} but this node shows {count} CUDA device(s) "
            f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES', 'unset')}): start at most "
            f"{count} ranks per node"
        )
    return torch.device("cuda", local_rank)


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    timeout_s: float = 600.0
    device: torch.device = field(default_factory=lambda: torch.device("cpu"))
    """This rank's device: every component puts its tensors here, every collective runs here."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def single(cls, device: str | torch.device = "cpu", timeout_s: float = 600.0) -> DistEnv:
        """One process on ``model.device`` (resolved: ``cuda:0`` or an explicit ``cuda:N``, or the CPU)."""
        return cls(timeout_s=timeout_s, device=resolve_device(device))

    @classmethod
    def from_environment(
        cls, backend: str = "auto", device: str | torch.device = "auto", timeout_s: float = 600.0
    ) -> DistEnv:
        """Join torchrun's process group when ``WORLD_SIZE`` > 1; otherwise a single process.

        ``device`` is ``model.device``. On CUDA the rank's GPU (``cuda:LOCAL_RANK``) becomes the
        current device before the process group starts, so NCCL, FSDP2, CUDA generators and every
        library that uses the current device (the CLIP rewards) land on it.
        """
        world = int(os.environ.get("WORLD_SIZE", "1"))
        local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        resolved = resolve_device(device, local_rank=local_rank, world_size=world)
        if resolved.type == "cuda":
            torch.cuda.set_device(resolved)
        if world <= 1:
            return cls(timeout_s=timeout_s, device=resolved)
        if not dist.is_initialized():
            if backend == "auto":
                backend = "nccl" if resolved.type == "cuda" else "gloo"
            if backend == "nccl":
                # Without async error handling a timed-out NCCL collective blocks forever.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            dist.init_process_group(
                backend,
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=resolved if resolved.type == "cuda" else None,
            )
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=local_rank,
            timeout_s=timeout_s,
            device=resolved,
        )

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Name what runs inside: a timeout or a peer failure there becomes a `CollectiveTimeout`.

        Wraps the trainer's own collectives and the phases whose model forwards hold FSDP collectives
        (rollout, update, evaluation, checkpoint gathers). :func:`current_collective` gives the name
        of the innermost block (recorders of the collectives label what they see with it).
        """
        token = _current.set(name)
        try:
            if not self.enabled:
                yield
                return
            try:
                yield
            except CollectiveTimeout:
                raise
            except (RuntimeError, dist.DistError) as error:  # gloo/NCCL timeouts, a closed peer
                text = str(error)
                if not any(
                    w in text.lower() for w in ("timeout", "timed out", "connection", "closed", "peer")
                ):
                    raise
                raise CollectiveTimeout(
                    f"rank {self.rank}/{self.world_size}: collective '{name}' did not complete within "
                    f"distributed.timeout_s={self.timeout_s:g} s (another rank stalled, died or diverged): "
                    f"{text.splitlines()[0] if text else type(error).__name__}"
                ) from error
        finally:
            _current.reset(token)

    def to_device(self, tensor: torch.Tensor) -> torch.Tensor:
        """``tensor`` on this rank's device (a no-op when it is there already)."""
        return tensor if tensor.device == self.device else tensor.to(self.device)

    def shard(self, count: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``count`` groups (contiguous, equal shares)."""
        if count % self.world_size:
            raise ValueError(
                f"{count} prompt groups per step cannot be split evenly over {self.world_size} ranks "
                "(data.prompts_per_step must be a multiple of the number of ranks)"
            )
        per = count // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def padded_share(self, count: int) -> list[int | None]:
        """This rank's block of ``count`` items: ``ceil(count/world)`` slots from ``rank * per``, the
        ones past the end None.

        Every rank gets the same number of slots (so model forwards, which are FSDP collectives, run
        the same number of times everywhere); the None slots are fillers whose results are dropped.
        Item ``i`` sits in slot ``i - rank * per``, so a per-slot stream keyed ``rank * per + slot``
        is the item's own, whatever the number of ranks.
        """
        per = -(-count // self.world_size)
        start = self.rank * per
        return [i if i < count else None for i in range(start, start + per)]

    def all_gather_cat(self, tensor: torch.Tensor, name: str = "all_gather") -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along dim 0 (rank order), on this rank's device."""
        tensor = self.to_device(tensor)
        if not self.enabled:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.collective(name):
            dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def all_reduce_sum(self, tensor: torch.Tensor, name: str = "all_reduce") -> torch.Tensor:
        """The sum over ranks, on this rank's device (in place when ``tensor`` is already there)."""
        tensor = self.to_device(tensor)
        if self.enabled:
            with self.collective(name):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool | torch.Tensor, name: str) -> bool:
        """True on every rank when ``flag`` is True on any rank (one small all-reduce, one host read).

        ``flag`` may be a device tensor (a bool or a count): then the all-reduce needs no host read
        before it, and the one read is of the reduced value.
        """
        if not self.enabled:
            return bool(flag)
        if isinstance(flag, torch.Tensor):
            t = self.to_device(flag.detach().reshape(()).to(torch.float32)).clone()
        else:
            t = torch.tensor(1.0 if flag else 0.0, device=self.device)
        return bool(self.all_reduce_sum(t, name) > 0)

    def broadcast_object(self, obj: Any, name: str, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (a small picklable value: a path, a list of strings)."""
        if not self.enabled:
            return obj
        box: list[Any] = [obj if self.rank == src else None]
        with self.collective(name):
            dist.broadcast_object_list(box, src=src, device=self.device)
        return box[0]

    def gather_objects(self, obj: Any, name: str) -> Sequence[Any]:
        """Every rank's ``obj``, in rank order, on every rank."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.collective(name):
            dist.all_gather_object(out, obj)
        return out

    def barrier(self, name: str = "barrier") -> None:
        if self.enabled:
            with self.collective(name):
                dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


FSDP_BLOCK_LISTS = (
    "context_refiner",
    "noise_refiner",
    "ref_image_refiner",
    "double_stream_layers",
    "single_stream_layers",
)
"""The transformer's block lists; each block becomes one FSDP2 unit (the reference's fsdp_layer_prefixes)."""


def shard_transformer(transformer: torch.nn.Module, env: DistEnv) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every transformer block, then the root, on a 1-D mesh of all ranks.

    Every rank must then run the same units in every forward: the native transformer runs its
    reference stage on a placeholder when a batch has no reference image (``pad_reference_stage``),
    so a rank with edit rows and one without issue the same all-gathers and reduce-scatters.
    """
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    if hasattr(transformer, "pad_reference_stage"):
        transformer.pad_reference_stage = True
    else:
        logger.warning(
            "%s has no placeholder reference stage: under FSDP, a step whose edit rows sit on some ranks "
            "only would issue different collectives on different ranks (keep edit and T2I rows apart, or use "
            "model.transformer=native)",
            type(transformer).__name__,
        )
    mesh = init_device_mesh(env.device.type, (env.world_size,))
    units = 0
    for name in FSDP_BLOCK_LISTS:
        for block in getattr(transformer, name, []):
            fully_shard(block, mesh=mesh)
            units += 1
    if units == 0:
        raise ValueError(f"shard_transformer: the model has none of the block lists {FSDP_BLOCK_LISTS}")
    fully_shard(transformer, mesh=mesh)
    return transformer


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """The whole tensor of a DTensor shard (collective: every rank must call it), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t.full_tensor() if isinstance(t, DTensor) else t


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """This rank's shard of a DTensor (no communication), else the tensor."""
    from torch.distributed.tensor import DTensor

    return t.to_local() if isinstance(t, DTensor) else t


def reshard(model: torch.nn.Module) -> None:
    """Shard every FSDP2 unit of ``model`` again. FSDP2 keeps the root's parameters unsharded after a
    forward without a backward (an evaluation, the preflight's probes); the state-dict API reads and
    writes them as DTensors."""
    from torch.distributed.fsdp import FSDPModule

    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def full_optimizer_state(model: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
    """The optimizer's state dict with whole tensors keyed by parameter name (a collective under FSDP2)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    reshard(model)
    return get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )


def load_full_state(
    model: torch.nn.Module,
    model_state: dict[str, torch.Tensor],
    optimizer: torch.optim.Optimizer | None = None,
    optimizer_state: dict[str, Any] | None = None,
) -> None:
    """Put whole tensors (by parameter name) into the model, and optionally the optimizer, also into
    FSDP2 shards (each rank keeps its slice). Keys not given are left as they are."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    opts = StateDictOptions(full_state_dict=True, strict=False)
    reshard(model)
    if model_state:
        set_model_state_dict(model, model_state, options=opts)
    if optimizer is not None and optimizer_state is not None:
        set_optimizer_state_dict(model, optimizer, optimizer_state, options=opts)


@contextlib.contextmanager
def fake_process_group(world_size: int) -> Iterator[None]:
    """``torch.distributed``'s ``fake`` backend as this process's group: rank 0 of ``world_size``, every
    collective returns at once without moving data (the dry run's, ``boogu_trainer.dryrun``)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise RuntimeError("fake_process_group: a process group is already initialised in this process")
    dist.init_process_group("fake", store=FakeStore(), rank=0, world_size=world_size)
    try:
        yield
    finally:
        dist.destroy_process_group()


RECORD_ENV = "BOOGU_RECORD_COLLECTIVES"
"""A folder: the trainer command writes each rank's collectives to ``rank<k>.json`` there."""


class CollectiveRecorder:
    """Records every collective this process issues, FSDP2's included: ``(op, shapes, dtypes)`` and
    the `DistEnv.collective` block it ran in, in order.

    A `TorchDispatchMode`: ``c10d`` ops go through the dispatcher whatever calls them. Two ranks
    must issue the same sequence, or NCCL waits forever; ``tests/trainer/test_distributed_and_resume.py``
    compares the ranks' records of a real 2-rank run.
    """

    def __init__(self) -> None:
        from torch.utils._python_dispatch import TorchDispatchMode

        recorder = self

        class _Mode(TorchDispatchMode):
            def __torch_dispatch__(self, func, types, args=(), kwargs=None):
                kwargs = kwargs or {}
                if getattr(func, "namespace", "") in ("c10d", "_c10d_functional"):
                    recorder._record(func, args, kwargs)
                return func(*args, **kwargs)

        self.calls: list[dict[str, Any]] = []
        self._mode = _Mode()

    def _record(self, func: Any, args: tuple, kwargs: dict) -> None:
        from torch.utils._pytree import tree_leaves

        tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
        self.calls.append(
            {
                "op": func._schema.name,
                "shapes": [list(t.shape) for t in tensors],
                "dtypes": [str(t.dtype).removeprefix("torch.") for t in tensors],
                "block": current_collective(),
            }
        )

    def __enter__(self) -> CollectiveRecorder:
        self._mode.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        self._mode.__exit__(*exc)


@contextlib.contextmanager
def record_collectives(
    folder: str | os.PathLike[str] | None, rank: int
) -> Iterator[CollectiveRecorder | None]:
    """Record this rank's collectives into ``folder/rank<rank>.json`` (nothing when ``folder`` is None)."""
    if not folder:
        yield None
        return
    import json
    from pathlib import Path

    recorder = CollectiveRecorder()
    try:
        with recorder:
            yield recorder
    finally:
        path = Path(folder) / f"rank{rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(recorder.calls))
