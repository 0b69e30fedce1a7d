"""Shared helpers for the boogu-data tests: images, reference-layout parquet files, leftovers."""

from __future__ import annotations

import contextlib
import errno
import io
import os
from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

# The reference integration's system prompts, typed out again here rather than imported, so the
# reference-layout files below do not depend on the code under test.
REF_T2I = (
    "You are a helpful assistant that generates high-quality images based on user instructions. "
    "The instructions are as follows."
)
REF_TI2I = (
    "Describe the key features of the input image (color, shape, size, texture, objects, background), "
    "then explain how the user's text instruction should alter or modify the image. Generate a new "
    "image that meets the user's requirements while maintaining consistency with the original input "
    "where appropriate."
)

_MESSAGES = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
_REWARD = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])


def png(
    width: int = 32, height: int = 32, color: tuple[int, int, int] = (200, 30, 30), mode: str = "RGB"
) -> bytes:
    """A solid-colour image encoded as PNG."""
    buffer = io.BytesIO()
    fill = color if mode == "RGB" else color[0]
    Image.new(mode, (width, height), fill).save(buffer, format="PNG")
    return buffer.getvalue()


def reference_t2i_rows(prompts: list[tuple[str, str]], split: str = "train") -> list[dict]:
    """Rows as the reference `boogu_image_ocr.py` builds them: (prompt, ground truth) pairs."""
    return [
        {
            "data_source": "flow_grpo/ocr",
            "prompt": [{"role": "system", "content": REF_T2I}, {"role": "user", "content": text}],
            "negative_prompt": [{"role": "system", "content": REF_TI2I}, {"role": "user", "content": ""}],
            "ability": "ocr",
            "reward_model": {"style": "model", "ground_truth": truth},
            "extra_info": {"split": split, "index": index},
        }
        for index, (text, truth) in enumerate(prompts)
    ]


def reference_edit_rows(items: list[tuple[str, str, bytes]], split: str = "train") -> list[dict]:
    """Rows as the reference `boogu_image_edit_ocr.py` builds them, "Picture 1: " prefix included."""
    return [
        {
            "data_source": "flow_grpo/ocr_edit",
            "prompt": [
                {"role": "system", "content": REF_TI2I},
                {"role": "user", "content": "Picture 1: <image>" + instruction},
            ],
            "negative_prompt": [{"role": "system", "content": REF_TI2I}, {"role": "user", "content": ""}],
            "ability": "image_edit",
            "images": [{"bytes": image}],
            "reward_model": {"style": "model", "ground_truth": target},
            "extra_info": {
                "split": split,
                "index": index,
                "instruction": instruction,
                "image": f"{index:04d}.png",
                "target_text": target,
            },
        }
        for index, (instruction, target, image) in enumerate(items)
    ]


def write_reference(rows: list[dict], path: Path, *, edit: bool = False, row_group_size: int = 500) -> Path:
    """Write rows with the types the reference's writers produce, and no boogu-data metadata."""
    fields = [
        ("data_source", pa.string()),
        ("prompt", _MESSAGES),
        ("negative_prompt", _MESSAGES),
        ("ability", pa.string()),
    ]
    if edit:
        fields.append(("images", pa.list_(pa.struct([("bytes", pa.binary())]))))
    fields.append(("reward_model", _REWARD))
    extra = [("split", pa.string()), ("index", pa.int64())]
    if edit:
        extra += [("instruction", pa.string()), ("image", pa.string()), ("target_text", pa.string())]
    fields.append(("extra_info", pa.struct(extra)))
    table = pa.Table.from_pylist(rows, schema=pa.schema(fields))
    pq.write_table(table, path, row_group_size=row_group_size)
    return path


def write_table(rows: list[dict], schema: pa.Schema, path: Path) -> Path:
    """Write arbitrary rows with an explicit schema (for malformed-file tests)."""
    pq.write_table(pa.Table.from_pylist(rows, schema=schema), path)
    return path


def leftovers(folder: Path) -> list[str]:
    """Names of hidden or temporary files in ``folder`` (an atomic writer must leave none)."""
    return sorted(p.name for p in folder.iterdir() if p.name.startswith(".") or p.name.endswith(".tmp"))


@contextlib.contextmanager
def read_only_storage(folder: Path, monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """While the block runs, nothing under ``folder`` can be removed or renamed.

    Every folder of the tree loses its write bits. As root, where the permission bits restrict
    nothing, `boogu_data.atomic`'s removal and ``os.replace`` raise ``EROFS`` instead, as a
    read-only mount would.
    """
    import boogu_data.atomic as atomic

    if os.geteuid() == 0:

        def refuse(path, *args) -> None:
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(path))

        with monkeypatch.context() as patch:
            patch.setattr(atomic, "_remove", refuse)
            patch.setattr(atomic.os, "replace", refuse)
            yield
        return
    folders = [folder, *(p for p in folder.rglob("*") if p.is_dir() and not p.is_symlink())]
    modes = {p: p.stat().st_mode for p in folders}
    for p in folders:
        p.chmod(modes[p] & ~0o222)
    try:
        yield
    finally:
        for p in folders:
            p.chmod(modes[p])
