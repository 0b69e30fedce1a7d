"""A learner outside the package, written as a user would: FlowGRPO's loss plus a pull towards an
anchor, its own running average of the LoRA, with options of its own. Nothing in ``boogu_trainer``
names it: it is ``algorithm.name=tests.trainer.toy_learner:AnchoredFlowGRPO`` with
``algorithm.options={pull: ..., decay: ...}``, and its anchor is saved and resumed by the checkpoint's
rule (``learner.anchor.safetensors``). Used by tests/trainer/test_algorithm_seam.py.

One process: the anchor is this rank's copy of each parameter (under FSDP2 a learner keeps its copies
as DTensors and loads them through the module, as `DiffusionNFT`'s old policy does)."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, replace
from typing import Any

import torch

from boogu_adapters.lora import is_lora_param, lora_file_key
from boogu_trainer.algorithms import Term
from boogu_trainer.algorithms.flow_grpo import FlowGRPO
from boogu_trainer.distributed import full_tensor, local_tensor


@dataclass(frozen=True)
class AnchorOptions:
    pull: float = 1.0
    """Weight of sum((p - anchor)^2) over the LoRA, added to every loss term."""
    decay: float = 0.5
    """After each update: anchor <- decay * anchor + (1 - decay) * p."""

    def __post_init__(self) -> None:
        if not self.pull >= 0:
            raise ValueError(f"algorithm.options.pull={self.pull!r}: expected >= 0")
        if not 0 <= self.decay < 1:
            raise ValueError(f"algorithm.options.decay={self.decay!r}: expected in [0, 1)")


class AnchoredFlowGRPO(FlowGRPO):
    """FlowGRPO pulled towards its own running average of the LoRA."""

    name = "anchored_flow_grpo"
    options_class = AnchorOptions

    def __init__(self, config: Any, seed: int, policy: Any):
        super().__init__(config, seed, policy)
        self.options: AnchorOptions = config.options_of()
        self.anchor = [local_tensor(p.detach()).clone() for p in policy.params]

    def losses(
        self, batch: Any, advantages: torch.Tensor, chunk: list[int], *, first: bool
    ) -> Iterator[Term]:
        for term in super().losses(batch, advantages, chunk, first=first):
            pull = sum(((local_tensor(p) - a) ** 2).sum() for p, a in zip(self.policy.params, self.anchor))
            yield replace(term, loss=term.loss + self.options.pull * pull)

    def after_update(self, counters: dict[str, int]) -> None:
        super().after_update(counters)
        d = self.options.decay
        with torch.no_grad():
            for p, a in zip(self.policy.params, self.anchor):
                a.mul_(d).add_(local_tensor(p.detach()), alpha=1 - d)
        counters["anchor_updates"] += 1

    def step_metrics(self) -> dict[str, float]:
        distance = sum(
            float(((local_tensor(p.detach()) - a) ** 2).sum())
            for p, a in zip(self.policy.params, self.anchor)
        )
        return {"anchor/distance": distance}

    def state_dict(self) -> dict[str, Any]:
        return {
            "anchor": {
                lora_file_key(name): full_tensor(a).float().cpu()
                for name, a in zip(self.policy.param_names, self.anchor)
                if is_lora_param(name)
            }
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        saved = state.get("anchor")
        if saved is None:
            raise ValueError(f"algorithm.name={self.name}: the checkpoint has no anchor")
        with torch.no_grad():
            for name, a in zip(self.policy.param_names, self.anchor):
                if is_lora_param(name):
                    a.copy_(saved[lora_file_key(name)].to(a.device, a.dtype))
