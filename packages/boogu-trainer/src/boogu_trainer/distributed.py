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
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import torch
import torch.distributed as dist

from boogu_protocol import resolve_device_type

logger = logging.getLogger("boogu_trainer")


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: another rank stalled, died or diverged."""


class DeviceError(ValueError):
    """A device setting that cannot work on this machine or with this many ranks."""


T = TypeVar("T")

STARTUP_MARGIN_S = 120.0
"""Seconds a rank waits for the others beyond a rollout worker's start-up limit: ranks reach the
launch a little apart (model loads differ), and the slowest worker may take the whole limit."""


def startup_wait_s(startup_timeout_s: float, timeout_s: float) -> float:
    """How long ranks wait for each other's rollout workers: the workers' start-up limit plus
    `STARTUP_MARGIN_S`, and never less than the process group's own timeout."""
    return max(startup_timeout_s + STARTUP_MARGIN_S, timeout_s)


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
    local_world_size: int | None = None
    """Ranks on this node (torchrun's ``LOCAL_WORLD_SIZE``); fewer than ``world_size``: several nodes.
    None (a group built by hand: the dry run's fake group, tests): one node."""

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def multi_node(self) -> bool:
        """The ranks span several nodes (`check_multi_node_env`, `check_shared_folder`)."""
        return self.local_world_size is not None and self.world_size > self.local_world_size

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
        local_world = int(os.environ.get("LOCAL_WORLD_SIZE", str(world)))
        check_multi_node_env(os.environ)  # before the process group waits on a wrong address
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
            local_world_size=local_world,
        )

    @contextlib.contextmanager
    def collective(self, name: str, timeout_s: float | None = None) -> Iterator[None]:
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
                limit = (
                    f"distributed.timeout_s={self.timeout_s:g} s"
                    if timeout_s is None
                    else f"its group's {timeout_s:g} s"
                )
                raise CollectiveTimeout(
                    f"rank {self.rank}/{self.world_size}: collective '{name}' did not complete within "
                    f"{limit} (another rank stalled, died or diverged): "
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

    def all_reduce_max(self, tensor: torch.Tensor, name: str = "all_reduce max") -> torch.Tensor:
        """The elementwise max over ranks, on this rank's device (NaN wins: a check must not hide it)."""
        tensor = self.to_device(tensor)
        if self.enabled:
            nan = torch.isnan(tensor)
            # gloo's and NCCL's MAX need not propagate NaN: NaN travels as +inf, then comes back.
            both = torch.stack([torch.where(nan, torch.inf, tensor), nan.to(tensor.dtype)])
            with self.collective(name):
                dist.all_reduce(both, op=dist.ReduceOp.MAX)
            tensor = torch.where(both[1] > 0, torch.nan, both[0])
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

    def gather_objects(
        self, obj: Any, name: str, group: Any = None, timeout_s: float | None = None
    ) -> Sequence[Any]:
        """Every rank's ``obj``, in rank order, on every rank (over ``group``, whose timeout is
        ``timeout_s``: a `waiting_group`; default the process group)."""
        if not self.enabled:
            return [obj]
        out: list[Any] = [None] * self.world_size
        with self.collective(name, timeout_s):
            if group is None:
                dist.all_gather_object(out, obj)
            else:
                dist.all_gather_object(out, obj, group=group)
        return out

    def waiting_group(self, timeout_s: float) -> Any:
        """A gloo group of every rank whose collectives wait up to ``timeout_s`` (None on one process):
        for a wait longer than ``distributed.timeout_s`` allows on the NCCL group (a rollout worker's
        start-up). Every rank creates it at the same point, as a collective."""
        if not self.enabled:
            return None
        with self.collective("create a waiting group"):
            return dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))

    def start_on_every_rank(self, start: Callable[[], T], name: str, timeout_s: float) -> T:
        """``start()`` on every rank, then every rank waits for all the others on a `waiting_group` of
        ``timeout_s`` (not on the NCCL group, which a slow start would time out). A rank whose
        ``start`` raised re-raises it; the others raise naming it, so no rank is left waiting."""
        group = self.waiting_group(timeout_s)  # before any rank starts: they are all here together
        result: Any = None
        failure: Exception | None = None
        try:
            result = start()
        except Exception as error:  # told to every rank below
            failure = error
        own = None if failure is None else f"{type(failure).__name__}: {failure}"
        errors = self.gather_objects(own, f"wait for every rank: {name}", group=group, timeout_s=timeout_s)
        if failure is not None:
            raise failure
        failed = [(rank, e) for rank, e in enumerate(errors) if e is not None]
        if failed:
            close = getattr(result, "close", None)
            if close is not None:
                close()
            rank, error = failed[0]
            raise RuntimeError(f"rank {rank} could not {name}: {error}")
        return result

    def barrier(self, name: str = "barrier") -> None:
        if self.enabled:
            with self.collective(name):
                dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


class MultiNodeError(DeviceError):
    """A multi-node job that cannot work: no reachable ``MASTER_ADDR``, or a run folder not shared."""


LOOPBACK = ("127.", "localhost", "::1", "0.0.0.0")


def check_multi_node_env(env: Mapping[str, str]) -> None:
    """Refuse a job over several nodes whose ``MASTER_ADDR`` is unset or a loopback address.

    Several nodes: ``NNODES`` > 1 (the launch scripts' variable), or torchrun's ``WORLD_SIZE`` above
    its ``LOCAL_WORLD_SIZE``. Every node would look for rank 0's store on itself and wait until
    ``distributed.timeout_s``; this says why at once.
    """
    world = int(env.get("WORLD_SIZE", "1"))
    local_world = int(env.get("LOCAL_WORLD_SIZE", str(world)))
    nnodes = int(env.get("NNODES", "1") or "1")
    if nnodes <= 1 and world <= local_world:
        return
    addr = env.get("MASTER_ADDR", "").strip()
    if not addr or addr.lower().startswith(LOOPBACK):
        nodes = f"NNODES={nnodes}" if nnodes > 1 else f"WORLD_SIZE={world} > LOCAL_WORLD_SIZE={local_world}"
        raise MultiNodeError(
            f"MASTER_ADDR={addr or '(unset)'} on several nodes ({nodes}): every node would wait for rank 0 "
            "on itself. Set MASTER_ADDR to the address of the node with NODE_RANK=0, the same on every node "
            "(docs/reliability.md, 'Several nodes')"
        )


SHARED_CHECK_PREFIX = ".shared_check_"


def check_shared_folder(
    folder: Path, env: DistEnv, key: str = "logging.run_dir", wait_s: float = 10.0
) -> None:
    """Every rank sees a file rank 0 writes into ``folder`` (which rank 0 has created), or a
    `MultiNodeError` naming ``key`` and the ranks that do not.

    Checkpoints are written by rank 0 and read by every rank on resume, so a job over several nodes
    needs the run folder on a filesystem they share. A network filesystem may show a new file to
    another node a moment late (attribute caching): each rank looks for up to ``wait_s`` seconds.
    Collective: every rank calls it.
    """
    import secrets
    import socket
    import time

    token = secrets.token_hex(8) if env.is_main else None
    path = None
    if env.is_main:
        path = folder / f"{SHARED_CHECK_PREFIX}{token}"
        path.write_text(token)
    token = env.broadcast_object(token, "check the run folder is shared")
    deadline = time.monotonic() + wait_s
    mine = folder / f"{SHARED_CHECK_PREFIX}{token}"
    while True:
        try:
            seen = mine.read_text() == token
        except OSError:
            seen = False
        if seen or time.monotonic() > deadline:
            break
        time.sleep(0.5)
    seen_by = env.gather_objects((seen, socket.gethostname()), "check the run folder is shared: results")
    if path is not None:
        path.unlink(missing_ok=True)
    missing = [f"rank {r} on {host}" for r, (ok, host) in enumerate(seen_by) if not ok]
    if missing:
        raise MultiNodeError(
            f"{key}={folder}: {', '.join(missing)} cannot see a file rank 0 wrote there. Rank 0 writes the "
            "checkpoints and every rank reads them on resume: on several nodes the run folder must be on a "
            "filesystem every node mounts at the same path (docs/reliability.md, 'Several nodes')"
        )


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
    collective returns at once without moving data (the dry run's, ``boogu_dryrun``)."""
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
