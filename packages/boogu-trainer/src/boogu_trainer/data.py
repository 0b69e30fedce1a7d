"""Prompt datasets for training: parquet files through boogu-data, or the built-in demo prompts,
drawn in a deterministic, resumable order."""

from __future__ import annotations

from collections.abc import Sequence
from importlib import resources
from pathlib import Path

import torch

from boogu_data import PromptRecord, read_records
from boogu_data.convert import first_quoted_span


def demo_records(limit: int = 32) -> list[PromptRecord]:
    """The built-in prompts: the first lines of the Flow-GRPO OCR test split shipped in this package."""
    text = resources.files("boogu_trainer").joinpath("assets/demo_prompts.txt").read_text(encoding="utf-8")
    records = []
    for i, line in enumerate(text.splitlines()[:limit]):
        records.append(
            PromptRecord(
                instruction=line,
                ground_truth=first_quoted_span(line) or "",
                data_source="demo/ocr",
                split="train",
                index=i,
            )
        )
    return records


def load_records(files: Sequence[str]) -> list[PromptRecord]:
    """Every record of the given parquet files or folders, validated by boogu-data."""
    records: list[PromptRecord] = []
    for f in files:
        path = Path(f).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data file {path} does not exist (data.train_files / data.val_files)")
        records.extend(read_records(path))
    if not records:
        raise ValueError(f"no records in {list(files)}")
    return records


class PromptSampler:
    """Batches of prompts, reshuffled each epoch from ``seed + epoch``; resumable from ``state_dict``.

    Batches never straddle epochs: the tail of an epoch that is shorter than a batch is dropped
    (with shuffling it differs every epoch), so every batch has exactly ``batch_size`` prompts.
    """

    def __init__(
        self, records: Sequence[PromptRecord], batch_size: int, *, shuffle: bool = True, seed: int = 0
    ):
        if len(records) < batch_size:
            raise ValueError(
                f"{len(records)} prompts cannot fill a batch of {batch_size} (data.prompts_per_step)"
            )
        self.records = list(records)
        self.batch_size, self.shuffle, self.seed = batch_size, shuffle, seed
        self.epoch, self.cursor = 0, 0
        self._order = self._permutation(0)

    def _permutation(self, epoch: int) -> list[int]:
        if not self.shuffle:
            return list(range(len(self.records)))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        return torch.randperm(len(self.records), generator=g).tolist()

    def next_batch(self) -> list[PromptRecord]:
        if self.cursor + self.batch_size > len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return [self.records[i] for i in idx]

    def state_dict(self) -> dict[str, int]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "num_records": len(self.records),
            "seed": self.seed,
        }

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state["num_records"] != len(self.records):
            raise ValueError(
                f"the checkpoint's dataset had {state['num_records']} prompts, this one has {len(self.records)}: "
                "resuming would not continue the same data order"
            )
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
