"""Datasets are checked against the prompt-length limit when they load, naming file and row."""

from __future__ import annotations

import io
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from boogu_adapters.components import QwenPromptEncoder
from boogu_data import PromptRecord, write_records
from boogu_trainer.data import check_prompt_lengths, load_records, load_sourced_records

LIMIT = 1280  # model.max_sequence_length's default
# About 3000 characters of varied words: far more tokens than LIMIT with the tiny tokenizer.
LONG_PROMPT = " ".join(f"q{i}x{i * 7919 % 1000}z" for i in range(300))[:3000].ljust(3000, "w")


def _records(prompts: list[str], *, negative: str = "", image: bytes | None = None) -> list[PromptRecord]:
    return [
        PromptRecord(
            instruction=p,
            negative=negative,
            ground_truth="hi",
            data_source="flow_grpo/ocr",
            index=i,
            ref_image=image,
        )
        for i, p in enumerate(prompts)
    ]


def _png(height: int, width: int) -> bytes:
    pixels = np.random.default_rng(0).integers(0, 256, (height, width, 3), dtype=np.uint8)
    buffer = io.BytesIO()
    Image.fromarray(pixels).save(buffer, format="PNG")
    return buffer.getvalue()


@pytest.fixture(scope="module")
def count_tokens(tiny_parts):
    # No text encoder: the check must need the tokenizer only.
    return QwenPromptEncoder(None, tiny_parts.processor, max_sequence_length=LIMIT).token_counts


def test_load_records_names_file_and_row(tmp_path: Path) -> None:
    first, second = tmp_path / "data" / "a.parquet", tmp_path / "data" / "b.parquet"
    write_records(_records(["a cat", "a dog"]), first)
    write_records(_records(["x", "y", "z"]), second)
    records, sources = load_sourced_records([str(tmp_path / "data"), str(first)])
    assert [r.instruction for r in records] == ["a cat", "a dog", "x", "y", "z", "a cat", "a dog"]
    assert sources == [
        f"{first} row 0",
        f"{first} row 1",
        f"{second} row 0",
        f"{second} row 1",
        f"{second} row 2",
        f"{first} row 0",
        f"{first} row 1",
    ]
    assert load_records([str(tmp_path / "data"), str(first)]) == records


def test_an_over_long_prompt_is_named_by_file_and_row(tmp_path: Path, count_tokens) -> None:
    assert len(LONG_PROMPT) >= 3000
    assert count_tokens([LONG_PROMPT], None)[0] > LIMIT
    write_records(_records(["a cat", "a dog"]), tmp_path / "data" / "a.parquet")
    bad = tmp_path / "data" / "b.parquet"
    write_records(_records(["x", "y", LONG_PROMPT, "z", LONG_PROMPT + " again"]), bad)
    records, sources = load_sourced_records([str(tmp_path / "data")])
    with pytest.raises(ValueError) as error:
        check_prompt_lengths(records, sources, count_tokens, LIMIT)
    message = str(error.value)
    tokens = count_tokens([LONG_PROMPT], None)[0]
    assert message.startswith(f"{bad} row 2: ")
    assert f"has {tokens} tokens, more than model.max_sequence_length={LIMIT}" in message
    assert "2 of 7 rows exceed it" in message
    with pytest.raises(ValueError, match=re.escape("more than rollout.max_tokens=1280")):
        check_prompt_lengths(records, sources, count_tokens, LIMIT, key="rollout.max_tokens")


def test_a_dataset_within_the_limit_passes(tmp_path: Path, count_tokens) -> None:
    path = tmp_path / "ok.parquet"
    write_records(_records(["a cat", "", LONG_PROMPT[:500], "ünïcödé 文字 🙂"]), path)
    records, sources = load_sourced_records([str(path)])
    assert check_prompt_lengths(records, sources, count_tokens, LIMIT) is None
    # The limit is inclusive: the longest prompt at exactly the limit passes, one less fails.
    longest = max(count_tokens([r.instruction for r in records], None))
    check_prompt_lengths(records, sources, count_tokens, longest)
    with pytest.raises(ValueError, match=re.escape(f"{path} row 2: ")):
        check_prompt_lengths(records, sources, count_tokens, longest - 1)


def test_negatives_are_checked_text_only(tmp_path: Path, count_tokens) -> None:
    path = tmp_path / "neg.parquet"
    write_records(_records(["a cat", "a dog"], negative=LONG_PROMPT), path)
    records, sources = load_sourced_records([str(path)])
    with pytest.raises(ValueError, match=r"row 0: the negative prompt .* has \d+ tokens.*2 of 2 rows"):
        check_prompt_lengths(records, sources, count_tokens, LIMIT)


def test_edit_prompts_are_counted_with_their_image(tmp_path: Path, count_tokens) -> None:
    path = tmp_path / "edit.parquet"
    image = _png(64, 48)
    write_records(_records(["a", "make it blue"], image=image), path, "edit")
    records, sources = load_sourced_records([str(path)])
    with_image = count_tokens(["make it blue"], [image])[0]
    assert with_image > count_tokens(["make it blue"], None)[0]
    assert count_tokens(["a"], [image])[0] < with_image
    check_prompt_lengths(records, sources, count_tokens, with_image)
    with pytest.raises(
        ValueError, match=re.escape(f"{path} row 1: the prompt 'make it blue' has {with_image} tokens")
    ):
        check_prompt_lengths(records, sources, count_tokens, with_image - 1)


def test_sources_must_match_records(count_tokens) -> None:
    with pytest.raises(ValueError, match="one source per record"):
        check_prompt_lengths(_records(["a"]), [], count_tokens, LIMIT)
