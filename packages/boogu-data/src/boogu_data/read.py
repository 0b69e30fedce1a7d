"""Read Boogu prompt datasets into validated `PromptRecord`s, streaming.

A parquet file is read a batch at a time (never more than one row group), so memory does not grow
with the file. Every row is checked against the layout in :mod:`boogu_data.schema` and against
upstream's template rule; the first problem stops the read with a :class:`DatasetError` naming the
file, the row (0-based position in the file), the column, and what was expected.

Files written by the reference integration read as they are. Its edit converter writes the user turn
as ``"Picture 1: <image>" + instruction``, a prefix copied from Qwen-Image-Edit that upstream Boogu
never uses (docs/reference-integration.md §9, item 6); the reader strips it and warns once per call.
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, Final

import pyarrow as pa
import pyarrow.parquet as pq

from boogu_data.errors import DatasetError, ReferenceLayoutWarning
from boogu_data.images import check_image
from boogu_data.record import DatasetKind, PromptRecord
from boogu_data.schema import EDIT_SCHEMA, SCHEMA_VERSION, SCHEMA_VERSION_KEY, T2I_SCHEMA, type_problem
from boogu_data.template import (
    IMAGE_PLACEHOLDER,
    SYSTEM_PROMPT_T2I,
    SYSTEM_PROMPT_TI2I,
    is_empty_instruction,
    select_system_prompt,
)

__all__ = ["REFERENCE_IMAGE_PREFIX", "check_schema", "dataset_files", "read_records"]

REFERENCE_IMAGE_PREFIX: Final[str] = "Picture 1: "
"""What the reference edit converter writes before the placeholder; stripped on read."""

# Rows converted to Python objects at a time; edit rows hold an image each, so fewer of them.
_BATCH_ROWS: Final[dict[DatasetKind, int]] = {"t2i": 256, "edit": 16}

# Builds the DatasetError for the current row: fail(column, problem, expected=None).
_Fail = Callable[..., DatasetError]


def dataset_files(path: str | os.PathLike[str]) -> list[Path]:
    """The parquet files a dataset path stands for: the file itself, or a folder's ``*.parquet``.

    A folder's files are taken in name order (so the record order is reproducible), not recursively;
    hidden files, including temporary files of an unfinished write, are skipped.
    """
    path = Path(path)
    if path.is_dir():
        files = sorted(p for p in path.glob("*.parquet") if p.is_file() and not p.name.startswith("."))
        if not files:
            raise DatasetError(path, "folder holds no *.parquet files")
        return files
    if not path.is_file():
        raise DatasetError(path, "no such file or folder")
    return [path]


def read_records(path: str | os.PathLike[str], *, decode_images: bool = True) -> Iterator[PromptRecord]:
    """Yield every row of a parquet file, or of a folder of them, as a validated `PromptRecord`.

    ``decode_images=False`` checks reference images from their headers only (format and size
    rules), for callers that decode every image right after anyway; a fully decoded 512² PNG costs
    a few milliseconds.

    A path that is neither a file nor a folder of parquet files raises here. Files are opened and
    checked lazily, as iteration reaches them, so problems inside them surface from the iteration.

    Raises:
        DatasetError: missing columns, wrong types, a user turn whose ``<image>`` placeholder does
            not match the row's image, more or fewer than one image in an edit row, undecodable image
            bytes, image sides that are not multiples of 16 or an area over 2048², system prompts
            that break upstream's selection rule, or a schema version newer than this reader's.

    Warns:
        ReferenceLayoutWarning: once per call, when rows carry the reference integration's
            ``"Picture 1: "`` prefix (it is stripped).
    """
    return _read_all(dataset_files(path), decode_images)


def _read_all(files: list[Path], decode_images: bool) -> Iterator[PromptRecord]:
    warned = [False]  # shared by every file of this call: warn once per call
    for file in files:
        yield from _read_file(file, warned, decode_images)


def check_schema(schema: pa.Schema, path: str | os.PathLike[str]) -> DatasetKind:
    """Check a file's arrow schema and metadata; return its kind (edit when it has ``images``).

    Raises:
        DatasetError: a required column is missing or has an incompatible type, or the file was
            written with a newer schema version.
    """
    metadata = schema.metadata or {}
    version = metadata.get(SCHEMA_VERSION_KEY)
    if version is not None and version.decode(errors="replace") != SCHEMA_VERSION:
        raise DatasetError(
            path,
            f"written with boogu-data schema version {version.decode(errors='replace')!r}",
            expected=f"schema version {SCHEMA_VERSION!r}, or none (reference layout); upgrade boogu-data",
        )
    kind: DatasetKind = "edit" if "images" in schema.names else "t2i"
    expected = EDIT_SCHEMA if kind == "edit" else T2I_SCHEMA
    for field in expected:
        index = schema.get_field_index(field.name)
        if index < 0:
            found = "duplicated" if field.name in schema.names else "missing"
            raise DatasetError(
                path, f"column is {found}", column=field.name, expected=f"one {field.type} column"
            )
        problem = type_problem(schema.field(index).type, field.type)
        if problem is not None:
            raise DatasetError(path, f"wrong type: {problem}", column=field.name, expected=str(field.type))
    return kind


def _read_file(path: Path, warned: list[bool], decode_images: bool) -> Iterator[PromptRecord]:
    try:
        # pre_buffer=False: with it, pyarrow caches the column chunks of every row group it is asked
        # for, so reading a large file would hold all of it in memory by the end.
        parquet = pq.ParquetFile(path, pre_buffer=False)
    except (pa.ArrowException, OSError) as error:
        raise DatasetError(path, f"not a readable parquet file ({error})") from None
    with parquet:
        kind = check_schema(parquet.schema_arrow, path)
        columns = (EDIT_SCHEMA if kind == "edit" else T2I_SCHEMA).names
        row = 0
        for row_group in range(parquet.num_row_groups):
            batches = parquet.iter_batches(
                batch_size=_BATCH_ROWS[kind], row_groups=[row_group], columns=columns
            )
            while True:
                try:
                    batch = next(batches)
                except StopIteration:
                    break
                except (pa.ArrowException, OSError) as error:
                    raise DatasetError(
                        path, f"cannot read the rows from here on ({error})", row=row
                    ) from None
                values = {name: batch.column(name).to_pylist() for name in columns}
                for offset in range(batch.num_rows):
                    yield _to_record(
                        path,
                        row,
                        kind,
                        {name: values[name][offset] for name in columns},
                        warned,
                        decode_images,
                    )
                    row += 1


def _to_record(
    path: Path,
    row: int,
    kind: DatasetKind,
    values: Mapping[str, Any],
    warned: list[bool],
    decode_images: bool,
) -> PromptRecord:
    def fail(column: str, problem: str, expected: str | None = None) -> DatasetError:
        return DatasetError(path, problem, row=row, column=column, expected=expected)

    data_source = _string(values["data_source"], fail, "data_source")
    ability = _string(values["ability"], fail, "ability")
    system, user = _turns(values["prompt"], fail, "prompt")
    negative_system, negative = _turns(values["negative_prompt"], fail, "negative_prompt")

    ref_image = _image(values["images"], fail, decode_images) if kind == "edit" else None
    if ref_image is not None:
        if user.startswith(REFERENCE_IMAGE_PREFIX + IMAGE_PLACEHOLDER):
            user = user[len(REFERENCE_IMAGE_PREFIX) :]
            if not warned[0]:
                warned[0] = True
                warnings.warn(
                    ReferenceLayoutWarning(
                        f"{path}: edit rows carry the reference integration's {REFERENCE_IMAGE_PREFIX!r} "
                        "prefix before the image placeholder; upstream Boogu never uses it, so it is "
                        "stripped (warned once)"
                    ),
                    stacklevel=4,
                )
        if not user.startswith(IMAGE_PLACEHOLDER):
            placement = "not at the start of" if IMAGE_PLACEHOLDER in user else "missing from"
            raise fail(
                "prompt",
                f"the row has an image but the {IMAGE_PLACEHOLDER!r} placeholder is {placement} the user turn",
                f"the user turn to start with {IMAGE_PLACEHOLDER!r} (Boogu puts the image before the text)",
            )
        instruction = user[len(IMAGE_PLACEHOLDER) :]
        if IMAGE_PLACEHOLDER in instruction:
            raise fail(
                "prompt", "the user turn has more than one image placeholder", "exactly one, for one image"
            )
    else:
        if IMAGE_PLACEHOLDER in user:
            raise fail(
                "prompt",
                f"the user turn has an {IMAGE_PLACEHOLDER!r} placeholder but the file has no images column",
                "no placeholder in a text-to-image row",
            )
        instruction = user
    if IMAGE_PLACEHOLDER in negative:
        raise fail(
            "negative_prompt",
            f"the negative user turn has an {IMAGE_PLACEHOLDER!r} placeholder",
            "no placeholder: negatives are encoded text-only",
        )
    _check_system(system, instruction, ref_image is not None, fail, "prompt")
    _check_system(negative_system, negative, False, fail, "negative_prompt")

    reward_model = values["reward_model"]
    if reward_model is None:
        raise fail("reward_model", "value is null", "a {style, ground_truth} struct")
    ground_truth = _string(reward_model["ground_truth"], fail, "reward_model", "reward_model.ground_truth")
    extra_info = values["extra_info"]
    if extra_info is None:
        raise fail("extra_info", "value is null", "a {split, index} struct")
    split = _string(extra_info["split"], fail, "extra_info", "extra_info.split")
    index = extra_info["index"]
    if index is None or index < 0:
        raise fail("extra_info", f"extra_info.index is {index!r}", "an integer >= 0")
    try:
        return PromptRecord(
            instruction=instruction,
            negative=negative,
            ground_truth=ground_truth,
            data_source=data_source,
            ability=ability,
            ref_image=ref_image,
            split=split,
            index=index,
        )
    except (TypeError, ValueError) as error:  # defensive: the checks above should cover everything
        raise DatasetError(path, str(error), row=row) from None


def _string(value: object, fail: _Fail, column: str, what: str | None = None) -> str:
    if not isinstance(value, str):
        raise fail(column, f"{what or 'value'} is {_show(value)}", "a string")
    return value


def _turns(value: object, fail: _Fail, column: str) -> tuple[str, str]:
    expected = "[{role: 'system', content: str}, {role: 'user', content: str}]"
    if not isinstance(value, list) or len(value) != 2:
        found = f"{len(value)} turns" if isinstance(value, list) else _show(value)
        raise fail(column, f"value is {found}", expected)
    contents = []
    for turn, role in zip(value, ("system", "user")):
        if not isinstance(turn, dict) or turn.get("role") != role or not isinstance(turn.get("content"), str):
            raise fail(column, f"turn {len(contents)} is {_show(turn)}", expected)
        contents.append(turn["content"])
    return contents[0], contents[1]


def _image(value: object, fail: _Fail, decode: bool) -> bytes:
    expected = "a list holding exactly one {bytes: binary} image"
    if not isinstance(value, list):
        raise fail("images", f"value is {_show(value)}", expected)
    if len(value) != 1:
        raise fail("images", f"the row has {len(value)} images; Boogu edit rows take exactly one", expected)
    item = value[0]
    data = item.get("bytes") if isinstance(item, dict) else None
    if not isinstance(data, bytes) or not data:
        raise fail("images", f"the image is {_show(item)}, not encoded bytes", expected)
    try:
        check_image(data, decode=decode)
    except ValueError as error:
        raise fail(
            "images", str(error), "PNG/JPEG bytes, sides multiples of 16, area at most 2048x2048"
        ) from None
    return data


def _check_system(system: str, instruction: str, has_image: bool, fail: _Fail, column: str) -> None:
    # The record drops the system prompt and encoders rebuild it with build_messages, so a file
    # whose system prompt differs from upstream's rule would be silently "corrected". Refuse it.
    wanted = select_system_prompt(instruction, has_images=has_image)
    if system == wanted:
        return
    situation = (
        f"{'an empty' if is_empty_instruction(instruction) else 'a non-empty'} instruction "
        f"{'with' if has_image else 'without'} an image"
    )
    name = "SYSTEM_PROMPT_T2I" if wanted == SYSTEM_PROMPT_T2I else "SYSTEM_PROMPT_TI2I"
    raise fail(
        column,
        f"the system turn is {_describe_system(system)}, which breaks upstream Boogu's selection rule",
        f"{name} for {situation}",
    )


def _describe_system(system: str) -> str:
    if system == SYSTEM_PROMPT_T2I:
        return "SYSTEM_PROMPT_T2I"
    if system == SYSTEM_PROMPT_TI2I:
        return "SYSTEM_PROMPT_TI2I"
    return _show(system)


def _show(value: object, limit: int = 60) -> str:
    if value is None:
        return "null"
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."
