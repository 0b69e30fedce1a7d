"""Process-group plumbing: a no-op for one process, torchrun + gloo/NCCL for several.

Each rank rolls out its share of the prompt groups (a group never spans ranks); rewards are
gathered so advantages use the statistics of the whole global batch. Every collective the trainer
issues itself goes through `DistEnv` with a name, and the process group has a finite timeout
(``distributed.timeout_s``): a rank that stalls or dies makes the others stop with a
`CollectiveTimeout` that names the collective and the step, instead of hanging silently.
"""

from __future__ import annotations

import contextlib
import datetime
import os
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist


class CollectiveTimeout(RuntimeError):
    """A collective did not complete: another rank stalled, died or diverged."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    timeout_s: float = 600.0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environment(
        cls, backend: str = "auto", device_type: str = "cpu", timeout_s: float = 600.0
    ) -> DistEnv:
        """Join torchrun's process group when ``WORLD_SIZE`` > 1; otherwise a single process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls(timeout_s=timeout_s)
        if not dist.is_initialized():
            if backend == "auto":
                backend = "nccl" if device_type == "cuda" else "gloo"
            if backend == "nccl":
                # Without async error handling a timed-out NCCL collective blocks forever.
                os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
            dist.init_process_group(backend, timeout=datetime.timedelta(seconds=timeout_s))
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
            timeout_s=timeout_s,
        )

    @contextlib.contextmanager
    def collective(self, name: str) -> Iterator[None]:
        """Name what runs inside: a timeout or a peer failure there becomes a `CollectiveTimeout`.

        Wraps the trainer's own collectives and the phases whose model forwards hold FSDP collectives
        (rollout, update, evaluation, checkpoint gathers).
        """
        if not self.enabled:
            yield
            return
        try:
            yield
        except CollectiveTimeout:
            raise
        except (RuntimeError, dist.DistError) as error:  # gloo/NCCL timeouts, a closed peer
            text = str(error)
            if not any(w in text.lower() for w in ("timeout", "timed out", "connection", "closed", "peer")):
                raise
            raise CollectiveTimeout(
                f"rank {self.rank}/{self.world_size}: collective '{name}' did not complete within "
                f"distributed.timeout_s={self.timeout_s:g} s (another rank stalled, died or diverged): "
                f"{text.splitlines()[0] if text else type(error).__name__}"
            ) from error

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
        """Indices of ``count`` items for this rank, strided, padded with None to ``ceil(count/world)``.

        Every rank gets the same number of slots (so model forwards, which are FSDP collectives, run
        the same number of times everywhere); the None slots are fillers whose results are dropped.
        """
        per = -(-count // self.world_size)
        mine: list[int | None] = list(range(self.rank, count, self.world_size))
        return mine + [None] * (per - len(mine))

    def all_gather_cat(self, tensor: torch.Tensor, name: str = "all_gather") -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along dim 0 (rank order)."""
        if not self.enabled:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        with self.collective(name):
            dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def all_reduce_sum(self, tensor: torch.Tensor, name: str = "all_reduce") -> torch.Tensor:
        if self.enabled:
            with self.collective(name):
                dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def any(self, flag: bool, device: torch.device, name: str) -> bool:
        """True on every rank when ``flag`` is True on any rank (one small all-reduce)."""
        if not self.enabled:
            return flag
        t = torch.tensor([1.0 if flag else 0.0], device=device)
        return float(self.all_reduce_sum(t, name)) > 0

    def broadcast_object(self, obj: Any, name: str, src: int = 0) -> Any:
        """Rank ``src``'s ``obj`` on every rank (a small picklable value: a path, a list of strings)."""
        if not self.enabled:
            return obj
        box: list[Any] = [obj if self.rank == src else None]
        with self.collective(name):
            dist.broadcast_object_list(box, src=src)
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


def shard_transformer(transformer: torch.nn.Module, device_type: str) -> torch.nn.Module:
    """FSDP2: ``fully_shard`` every transformer block, then the root, on a 1-D mesh of all ranks."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh(device_type, (dist.get_world_size(),))
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
