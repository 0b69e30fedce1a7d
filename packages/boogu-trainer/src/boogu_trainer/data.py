"""Prompt datasets for training: parquet files through boogu-data, or the built-in demo prompts,
drawn in a deterministic, resumable order."""

from __future__ import annotations

import functools
import hashlib
from collections.abc import Callable, Sequence
from importlib import resources
from pathlib import Path

import torch

from boogu_data import PromptRecord, dataset_files, read_records
from boogu_data.convert import first_quoted_span
from boogu_data.scenes import MAX_COUNT
from boogu_schedule import derive_seed, make_generator

SCENES_SEED = 0
"""The seed of the built-in scene prompts (``boogu-data scenes --seed 0 --layout grid``: what the tiny
model was pretrained on, so its train split is the pretraining's, and val and test are held out)."""
SCENES_LAYOUT = "grid"
"""The layout of the built-in scenes: the pretraining's (both constants are tested against the
committed checkpoint's ``pretrain_report.json``)."""
SCENE_SPLITS = ("train", "heldout", "val", "test")
"""The built-in scene prompts (``data.demo_eval_split`` picks the evaluation's):

* ``train``: train-split scenes whose caption is not held out: what the demo trains on;
* ``heldout``: train-split scenes whose caption is held out (:func:`scene_caption_held_out`, about a
  quarter of the 396 train captions): colour-shape pairs and captions the pretraining saw, never
  a prompt of the RL run;
* ``val`` and ``test``: the scene set's own held-out colour-shape pairs (never in pretraining
  either: a generalisation check).

``data.demo_set=scene_edits`` has the same four splits of the scene edit pairs
(:mod:`boogu_data.scene_edits`, same seed and layout, the reference rendered at
:data:`SCENE_EDITS_SIZE`): ``heldout`` holds the train-split pairs whose instruction is held out
(:func:`scene_caption_held_out` of the instruction's text, about a quarter)."""
SCENE_EDITS_SIZE = 64
"""The side of the built-in edit pairs' reference images: the tiny VAE's ``sample_size``, as the Edit
build (``boogu_tiny.edit_pretrain``) renders them."""
OCR_DEMO_PROMPTS = 64
"""How many built-in OCR prompts there are (the lines of ``assets/demo_prompts.txt``; a test pins it)."""
MAX_DEMO_PROMPTS = MAX_COUNT
"""The most built-in scene prompts of one split (:data:`boogu_data.scenes.MAX_COUNT`): the scene
stream is drawn up front, so a count beyond it is refused when the config loads (``data.demo_prompts``,
``eval.num_prompts``) instead of drawing until memory runs out."""


def scene_caption_held_out(caption: str) -> bool:
    """Whether a train-split caption is kept out of the built-in training prompts: the first byte of
    its SHA-256 is a multiple of 4 (fixed, so any run and any test agree)."""
    return hashlib.sha256(caption.encode("utf-8")).digest()[0] % 4 == 0


def demo_records(limit: int = 32, demo_set: str = "ocr", *, split: str = "train") -> list[PromptRecord]:
    """The built-in prompts (``data.demo_set``): the first lines of the Flow-GRPO OCR test split shipped
    in this package, or the first ``limit`` scenes of one of :data:`SCENE_SPLITS` of the procedural
    scenes (`boogu_data.scenes`, seed :data:`SCENES_SEED`, layout :data:`SCENES_LAYOUT`; the scene as
    JSON in ``ground_truth``; ``index`` counts within the split's stream, ``split`` names it)."""
    if demo_set == "scenes":
        return _scene_records(limit, split)
    if demo_set == "scene_edits":
        return _scene_edit_records(limit, split)
    if demo_set != "ocr" or split != "train":
        raise ValueError(f"no built-in {demo_set!r} prompts of split {split!r}")
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


def _scene_records(limit: int, split: str) -> list[PromptRecord]:
    from boogu_data.scenes import generate_scenes

    if split not in SCENE_SPLITS:
        raise ValueError(f"no built-in scenes prompts of split {split!r}: one of {SCENE_SPLITS}")
    keep = None
    if split in ("train", "heldout"):  # the train split's stream, divided by caption

        def keep(scene):
            return scene_caption_held_out(scene.caption()) == (split == "heldout")

    stream = "train" if split == "heldout" else split
    scenes = generate_scenes(SCENES_SEED, stream, limit, layout=SCENES_LAYOUT, keep=keep)
    return [scene.record(split, i) for i, scene in enumerate(scenes)]


def _scene_edit_records(limit: int, split: str) -> list[PromptRecord]:
    from boogu_data.scene_edits import iter_edits

    if split not in SCENE_SPLITS:
        raise ValueError(f"no built-in scene_edits prompts of split {split!r}: one of {SCENE_SPLITS}")
    stream = iter_edits(SCENES_SEED, "train" if split == "heldout" else split, layout=SCENES_LAYOUT)
    if split in ("train", "heldout"):  # the train split's stream, divided by instruction
        stream = (e for e in stream if scene_caption_held_out(e.instruction.text()) == (split == "heldout"))
    edits = [e for _, e in zip(range(limit), stream, strict=False)]
    return [e.record(split, i, SCENE_EDITS_SIZE) for i, e in enumerate(edits)]


def load_sourced_records(files: Sequence[str]) -> tuple[list[PromptRecord], list[str]]:
    """Every record of the given parquet files or folders, validated by boogu-data, and where each
    came from (for error messages): ``sources[i]`` is ``"<parquet file> row <r>"``, ``r`` counting
    from 0 within that file (a folder stands for its ``*.parquet`` files, as
    :func:`boogu_data.dataset_files` lists them)."""
    records: list[PromptRecord] = []
    sources: list[str] = []
    for f in files:
        path = Path(f).expanduser()
        if not path.exists():
            raise FileNotFoundError(f"data file {path} does not exist (data.train_files / data.val_files)")
        for file in dataset_files(path):
            before = len(records)
            records.extend(read_records(file))
            sources.extend(f"{file} row {row}" for row in range(len(records) - before))
    if not records:
        raise ValueError(f"no records in {list(files)}")
    return records, sources


def load_records(files: Sequence[str]) -> list[PromptRecord]:
    """Every record of the given parquet files or folders, validated by boogu-data."""
    return load_sourced_records(files)[0]


CountTokens = Callable[[Sequence[str], Sequence[bytes | None] | None], list[int]]
"""Token counts of a batch of prompts, as the engine's prompt encoder would see them
(``QwenPromptEncoder.token_counts``): instructions and their reference images (None: text-only)."""


def check_prompt_lengths(
    records: Sequence[PromptRecord],
    sources: Sequence[str],
    count_tokens: CountTokens,
    limit: int,
    *,
    key: str = "model.max_sequence_length",
) -> None:
    """Refuse a dataset with a prompt longer than ``limit`` tokens, before training starts.

    Positives are counted with their reference image, negatives text-only, as the rollout engine
    encodes them. Without this check such a prompt fails only at the step that draws it.

    Raises:
        ValueError: naming the first offending row's source, its token count, ``limit`` and
            ``key``, and how many rows exceed the limit.
    """
    if len(sources) != len(records):
        raise ValueError(f"{len(sources)} sources for {len(records)} records; pass one source per record")
    if not records:
        return
    images = [r.ref_image for r in records]
    positive = count_tokens(
        [r.instruction for r in records], images if any(b is not None for b in images) else None
    )
    negative = count_tokens([r.negative for r in records], None)
    too_long = [i for i in range(len(records)) if max(positive[i], negative[i]) > limit]
    if not too_long:
        return
    i = too_long[0]
    which, text, tokens = (
        ("prompt", records[i].instruction, positive[i])
        if positive[i] > limit
        else ("negative prompt", records[i].negative, negative[i])
    )
    raise ValueError(
        f"{sources[i]}: the {which} {text[:60]!r} has {tokens} tokens, more than {key}={limit}; "
        f"{len(too_long)} of {len(records)} rows exceed it. Shorten or drop those prompts, or raise {key}"
    )


def prompt_key(record: PromptRecord) -> str:
    """The identity of a prompt as a rollout sees it: SHA-256 of its instruction, negative prompt and
    reference image bytes (hex, 24 characters). The key of the prompt statistics
    (`boogu_trainer.prompt_stats`, which re-exports it) and a part of `PromptSampler.records_sha256`."""
    digest = hashlib.sha256()
    for part in (
        record.instruction.encode("utf-8"),
        record.negative.encode("utf-8"),
        record.ref_image or b"",
    ):
        digest.update(len(part).to_bytes(8, "little"))
        digest.update(part)
    return digest.hexdigest()[:24]


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
        g = make_generator(derive_seed(self.seed, "data", epoch))
        return torch.randperm(len(self.records), generator=g, device="cpu").tolist()

    def next_batch(self) -> list[PromptRecord]:
        if self.cursor + self.batch_size > len(self._order):
            self.epoch += 1
            self.cursor = 0
            self._order = self._permutation(self.epoch)
        idx = self._order[self.cursor : self.cursor + self.batch_size]
        self.cursor += self.batch_size
        return [self.records[i] for i in idx]

    @functools.cached_property
    def records_sha256(self) -> str:
        """A SHA-256 of the prompts in their order: each one's `prompt_key` (instruction, negative,
        reference image) and what it is rewarded against (ground truth, data source, ability); not
        its split or row index, which train nothing. Computed once (the records never change),
        recorded in `state_dict`."""
        digest = hashlib.sha256()
        for r in self.records:
            for part in (prompt_key(r), r.ground_truth, r.data_source, r.ability):
                encoded = part.encode("utf-8")
                digest.update(len(encoded).to_bytes(8, "little"))  # length-prefixed: no two splits collide
                digest.update(encoded)
        return digest.hexdigest()

    def state_dict(self) -> dict[str, int | str]:
        return {
            "epoch": self.epoch,
            "cursor": self.cursor,
            "num_records": len(self.records),
            "records_sha256": self.records_sha256,
            "seed": self.seed,
        }

    def check_state(self, state: dict[str, int | str], *, accept_other_prompts: bool = False) -> bool:
        """Refuse a state saved over other prompts: another count always (the order would index
        other rows), the same count with other content or order (an edited ``data.train_files``, a
        ``data.prompt_stats`` file measured again) unless ``accept_other_prompts``. States written
        before the digest existed are checked by their count only. Returns whether the state's
        prompts are other ones (accepted).

        Raises:
            ValueError: naming both counts, or both digests and the opt-in.
        """
        if state["num_records"] != len(self.records):
            raise ValueError(
                f"the checkpoint's dataset had {state['num_records']} prompts, this one has {len(self.records)}: "
                "resuming would not continue the same data order"
            )
        saved = state.get("records_sha256")
        other = saved is not None and saved != self.records_sha256
        if other and not accept_other_prompts:
            raise ValueError(
                f"the checkpoint's {state['num_records']} prompts are not these (records SHA-256 "
                f"{str(saved)[:12]}... in the checkpoint, {self.records_sha256[:12]}... now: another "
                "content or order of data.train_files, or another data.prompt_stats filter): resuming "
                "would not continue the same data. Restore the prompts, or continue on these with "
                "resume_allow_changes=[data.train_files]"
            )
        return other

    def load_state_dict(self, state: dict[str, int | str], *, accept_other_prompts: bool = False) -> None:
        self.check_state(state, accept_other_prompts=accept_other_prompts)
        self.epoch, self.cursor = int(state["epoch"]), int(state["cursor"])
        self._order = self._permutation(self.epoch)
