"""Process-group plumbing: a no-op for one process, torchrun + gloo/NCCL for several.

Each rank rolls out its share of the prompt groups (a group never spans ranks); rewards are
gathered so advantages use the statistics of the whole global batch.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch
import torch.distributed as dist


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @classmethod
    def from_environment(cls, backend: str = "auto", device_type: str = "cpu") -> DistEnv:
        """Join torchrun's process group when ``WORLD_SIZE`` > 1; otherwise a single process."""
        world = int(os.environ.get("WORLD_SIZE", "1"))
        if world <= 1:
            return cls()
        if not dist.is_initialized():
            if backend == "auto":
                backend = "nccl" if device_type == "cuda" else "gloo"
            dist.init_process_group(backend)
        return cls(
            rank=dist.get_rank(),
            world_size=dist.get_world_size(),
            local_rank=int(os.environ.get("LOCAL_RANK", 0)),
        )

    def shard(self, count: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``count`` groups (contiguous, as even as possible)."""
        if count % self.world_size:
            raise ValueError(
                f"{count} prompt groups per step cannot be split evenly over {self.world_size} ranks "
                "(data.prompts_per_step must be a multiple of the number of ranks)"
            )
        per = count // self.world_size
        return self.rank * per, (self.rank + 1) * per

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along dim 0 (rank order)."""
        if not self.enabled:
            return tensor
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        dist.all_gather(parts, tensor.contiguous())
        return torch.cat(parts)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        if self.enabled:
            dist.all_reduce(tensor, op=dist.ReduceOp.SUM)
        return tensor

    def barrier(self) -> None:
        if self.enabled:
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
