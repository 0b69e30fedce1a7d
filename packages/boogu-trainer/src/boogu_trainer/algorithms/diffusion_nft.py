"""DiffusionNFT (``algorithm.name=diffusion_nft``; Zheng et al. 2025, NVlabs/DiffusionNFT) and its old policy.

The loss (`losses.nft_loss`) compares the policy's velocity on re-noised clean samples
(`algorithms.renoise`) with the old policy's: ``v+ = v_old + beta (v - v_old)`` should predict
``x0`` for good samples, ``v- = v_old - beta (v - v_old)`` for bad ones. The old policy is a second
copy of the LoRA, sharded like it: rollouts use it (`DiffusionNFT.sampling_policy`), and after every
update it is soft-updated, ``old <- d old + (1 - d) current`` with ``d`` from ``algorithm.nft.old_decay_*``
over the optimizer steps so far. It is saved as ``old_policy.safetensors`` and resumes bitwise.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

from boogu_adapters.lora import is_lora_param, lora_file_key
from boogu_trainer.algorithms.base import Policy
from boogu_trainer.algorithms.renoise import ForwardProcessAlgorithm
from boogu_trainer.distributed import full_tensor, load_full_state, local_tensor
from boogu_trainer.losses import PolicyLoss, nft_loss

if TYPE_CHECKING:
    from boogu_trainer.config import AlgorithmConfig


class DiffusionNFT(ForwardProcessAlgorithm):
    """DiffusionNFT's loss per noise level, and the old (sampling) policy it compares with."""

    name = "diffusion_nft"
    # A = 0 still pulls v+ and v- symmetrically (r = 1/2): those rows have a gradient.
    zero_advantage_has_no_gradient = False

    def __init__(self, config: AlgorithmConfig, seed: int, policy: Policy):
        super().__init__(config, seed, policy)
        self.old: list[torch.Tensor] = [p.detach().clone() for p in policy.params]
        """The old (sampling) policy: one tensor per LoRA parameter, sharded like it."""
        self.old_is_current = True
        """The old policy equals the current one (no lag yet, or ``old_decay_max = 0``)."""
        self.last_old_decay = 0.0

    @classmethod
    def planned_memory(cls, lora_bytes: float, rows: int, levels: int, latent_bytes: int) -> dict[str, float]:
        return {
            "NFT old policy (LoRA copy)": lora_bytes,
            # worst case: every sample's old velocity at every level, computed before the first step
            f"NFT old velocities ({rows} samples x {levels} levels)": rows * levels * latent_bytes,
        }

    def own_old_values(self, first: bool) -> bool:
        return first and self.old_is_current

    def old_value(self, velocity: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        return velocity

    def level_loss(self, velocity, old, x0, x_sigma, sigma, target, advantages) -> PolicyLoss:
        a = self.config
        return nft_loss(
            velocity,
            velocity.detach() if old is None else old,
            x_sigma,
            x0,
            sigma,
            advantages,
            beta=a.nft.beta,
            adv_clip=a.adv_clip,
            adaptive_weight=a.nft.adaptive_weight,
        )

    # ---- the old policy ---------------------------------------------------------------------------
    @contextlib.contextmanager
    def sampling_policy(self) -> Iterator[None]:
        """The module holds the old policy's weights inside the block while it lags."""
        if self.old_is_current:
            yield
            return
        params = self.policy.params
        with swapped([local_tensor(p.detach()) for p in params], [local_tensor(o) for o in self.old]):
            yield

    def after_update(self, counters: dict[str, int]) -> None:
        """old <- d old + (1 - d) current, d from ``algorithm.nft`` and the optimizer steps so far."""
        d = self.config.nft.old_decay(counters["optimizer_steps"])
        local_old = [local_tensor(o) for o in self.old]
        current = [local_tensor(p.detach()) for p in self.policy.params]
        with torch.no_grad():
            if d == 0.0:
                torch._foreach_copy_(local_old, current)
            else:
                torch._foreach_mul_(local_old, d)
                torch._foreach_add_(local_old, current, alpha=1.0 - d)
        self.old_is_current = d == 0.0
        counters["old_lags"] = int(d != 0.0)
        self.last_old_decay = d

    def rollout_weights(self, current: Callable[[], dict[str, torch.Tensor]]) -> dict[str, torch.Tensor]:
        """The old policy while it lags, else the current LoRA."""
        return current() if self.old_is_current else self.old_state()

    def step_metrics(self) -> dict[str, float]:
        return {"nft/old_decay": self.last_old_decay}

    def old_state(self) -> dict[str, torch.Tensor]:
        """The whole old policy by LoRA file key (a collective under FSDP)."""
        return {
            lora_file_key(name): full_tensor(o).detach()
            for name, o in zip(self.policy.param_names, self.old)
            if is_lora_param(name)
        }

    def state_dict(self) -> dict[str, Any]:
        return {"old": {k: v.float().cpu() for k, v in self.old_state().items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """The old policy of ``state["old"]`` (file keys, as ``state["lora"]``); whether it lags from
        ``state["counters"]``. Loaded through the module, so the values land in this rank's shards like
        the LoRA's own: the LoRA must be loaded after this."""
        old, lora = state.get("old"), state["lora"]
        if old is None:
            raise ValueError(
                "algorithm.name=diffusion_nft but the checkpoint has no old policy (old_policy.safetensors)"
            )
        if set(old) != set(lora):
            raise ValueError("the checkpoint's old policy has other LoRA keys than its LoRA")
        policy = self.policy
        by_file_key = {lora_file_key(n): n for n in policy.param_names if is_lora_param(n)}
        old_sd = {by_file_key[k]: v.to(device=policy.device, dtype=torch.float32) for k, v in old.items()}
        load_full_state(policy.transformer, old_sd)
        with torch.no_grad():
            torch._foreach_copy_(
                [local_tensor(o) for o in self.old], [local_tensor(p.detach()) for p in policy.params]
            )
        self.old_is_current = not state["counters"].get("old_lags", 0)


@contextlib.contextmanager
def swapped(params: list[torch.Tensor], other: list[torch.Tensor]) -> Iterator[None]:
    """``params`` hold ``other``'s values inside the block (local shards; one copy each way)."""
    saved = [p.detach().clone() for p in params]
    with torch.no_grad():
        torch._foreach_copy_([p.detach() for p in params], other)
    try:
        yield
    finally:
        with torch.no_grad():
            torch._foreach_copy_([p.detach() for p in params], saved)


__all__ = ["DiffusionNFT", "swapped"]
