"""Write `PromptRecord`s to parquet in the layout of :mod:`boogu_data.schema`, atomically and streaming.

Rows are buffered one row group at a time and built column by column with pyarrow, so memory is
bounded by the row-group size whatever the number of records. The same records always give the same
bytes (for a given pyarrow version): nothing time- or machine-dependent is written.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterable
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from boogu_data.atomic import AtomicOutputs
from boogu_data.images import check_image
from boogu_data.record import DatasetKind, PromptRecord
from boogu_data.schema import EXTRA_INFO_TYPE, IMAGES_TYPE, MESSAGES_TYPE, REWARD_MODEL_TYPE, schema_for
from boogu_data.template import IMAGE_PLACEHOLDER, select_system_prompt

__all__ = ["DEFAULT_ROW_GROUP_ROWS", "RecordWriter", "write_records"]

DEFAULT_ROW_GROUP_ROWS: dict[str, int] = {"t2i": 8192, "edit": 256}
"""Rows per row group. T2I rows are ~1 kB, so 8192 keeps a group around 10 MB; edit rows carry an
image, hence the smaller count (and the byte cap below)."""
ROW_GROUP_IMAGE_BYTES = 16 * 1024 * 1024
"""An edit row group is also closed once its images reach this many bytes: a reader holds a whole
row group's image column in memory (several times over, transiently), so this bounds its memory."""
REWARD_STYLE = "model"  # the reference converters' value; rewards are dispatched on data_source


class RecordWriter:
    """Streams records of one kind into a parquet file at ``path`` (usually a temporary path).

    Call :meth:`write` per record and :meth:`close` once; the caller owns atomicity (see
    :func:`write_records` and :class:`boogu_data.atomic.AtomicOutputs`).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        kind: DatasetKind,
        *,
        row_group_rows: int | None = None,
        check_images: bool = True,
    ) -> None:
        self.kind: DatasetKind = kind
        self.schema = schema_for(kind)
        self.rows_written = 0
        if row_group_rows is None:
            row_group_rows = DEFAULT_ROW_GROUP_ROWS[kind]
        if isinstance(row_group_rows, bool) or not isinstance(row_group_rows, int) or row_group_rows < 1:
            raise ValueError(f"row_group_rows must be an int >= 1, got {row_group_rows!r}")
        self._row_group_rows = row_group_rows
        self._check_images = check_images
        self._writer = pq.ParquetWriter(
            os.fspath(path),
            self.schema,
            compression="snappy",
            # Dictionary encoding pays off for the repeated system prompts and labels, but not for
            # image bytes: every image is unique, and trying costs time and reader memory.
            use_dictionary=[leaf for leaf in _leaf_paths(self.schema) if leaf != _IMAGE_BYTES_PATH],
        )
        self._reset()

    def _reset(self) -> None:
        self._data_source: list[str] = []
        self._ability: list[str] = []
        self._prompt: list[str] = []  # flattened [system, user] contents, two per row
        self._negative: list[str] = []
        self._images: list[bytes] = []
        self._ground_truth: list[str] = []
        self._split: list[str] = []
        self._index: list[int] = []
        self._image_bytes = 0

    @property
    def rows_buffered(self) -> int:
        """Rows accepted by :meth:`write` but not yet flushed to a row group."""
        return len(self._index)

    def write(self, record: PromptRecord) -> None:
        """Buffer one record, flushing a row group when it is full."""
        if not isinstance(record, PromptRecord):
            raise TypeError(f"expected a PromptRecord, got {type(record).__name__}")
        position = self.rows_written + len(self._index)
        has_image = record.ref_image is not None
        if self.kind == "t2i" and has_image:
            raise ValueError(f"record {position} has a ref_image, but this is a t2i file; use kind='edit'")
        if self.kind == "edit":
            if not has_image:
                raise ValueError(f"record {position} has no ref_image; every edit row needs exactly one")
            if self._check_images:
                try:
                    check_image(record.ref_image)
                except ValueError as error:
                    raise ValueError(f"record {position}: ref_image: {error}") from None
            self._images.append(record.ref_image)
            self._image_bytes += len(record.ref_image)
        self._data_source.append(record.data_source)
        self._ability.append(record.ability)
        self._prompt += [
            select_system_prompt(record.instruction, has_images=has_image),
            # Images come before the text, as in upstream's chat messages.
            (IMAGE_PLACEHOLDER + record.instruction) if has_image else record.instruction,
        ]
        # Negatives are encoded text-only in both modes, so their system prompt ignores the image.
        self._negative += [select_system_prompt(record.negative, has_images=False), record.negative]
        self._ground_truth.append(record.ground_truth)
        self._split.append(record.split)
        self._index.append(record.index)
        if len(self._index) >= self._row_group_rows or self._image_bytes >= ROW_GROUP_IMAGE_BYTES:
            self._flush()

    def _flush(self) -> None:
        rows = len(self._index)
        if rows == 0:
            return
        columns: dict[str, pa.Array] = {
            "data_source": pa.array(self._data_source, pa.string()),
            "prompt": _messages_array(self._prompt, rows),
            "negative_prompt": _messages_array(self._negative, rows),
            "ability": pa.array(self._ability, pa.string()),
            "reward_model": pa.StructArray.from_arrays(
                [pa.array([REWARD_STYLE] * rows, pa.string()), pa.array(self._ground_truth, pa.string())],
                fields=list(REWARD_MODEL_TYPE),
            ),
            "extra_info": pa.StructArray.from_arrays(
                [pa.array(self._split, pa.string()), pa.array(self._index, pa.int64())],
                fields=list(EXTRA_INFO_TYPE),
            ),
        }
        if self.kind == "edit":
            one_each = pa.array(range(rows + 1), pa.int32())
            items = pa.StructArray.from_arrays(
                [pa.array(self._images, pa.binary())], fields=list(IMAGES_TYPE.value_type)
            )
            columns["images"] = pa.ListArray.from_arrays(one_each, items, type=IMAGES_TYPE)
        table = pa.Table.from_arrays([columns[name] for name in self.schema.names], schema=self.schema)
        self._writer.write_table(table, row_group_size=rows)
        self.rows_written += rows
        self._reset()

    def close(self) -> None:
        """Flush the last row group and finish the file (it is not readable before this)."""
        self._flush()
        self._writer.close()

    def discard(self) -> None:
        """Drop buffered rows and release the file after a failure (its content is then garbage)."""
        self._reset()
        with contextlib.suppress(Exception):
            self._writer.close()


_IMAGE_BYTES_PATH = "images.list.element.bytes"


def _leaf_paths(schema: pa.Schema) -> list[str]:
    """Parquet leaf column paths of ``schema`` (lists appear as ``<name>.list.element``)."""

    def walk(path: str, kind: pa.DataType) -> list[str]:
        if pa.types.is_list(kind):
            return walk(f"{path}.list.element", kind.value_type)
        if pa.types.is_struct(kind):
            return [leaf for child in kind for leaf in walk(f"{path}.{child.name}", child.type)]
        return [path]

    return [leaf for field in schema for leaf in walk(field.name, field.type)]


def _messages_array(contents: list[str], rows: int) -> pa.Array:
    # Every row is exactly [system, user]: offsets 0, 2, 4, ... over the flattened contents.
    offsets = pa.array(range(0, 2 * rows + 1, 2), pa.int32())
    roles = pa.array(["system", "user"] * rows, pa.string())
    items = pa.StructArray.from_arrays(
        [roles, pa.array(contents, pa.string())], fields=list(MESSAGES_TYPE.value_type)
    )
    return pa.ListArray.from_arrays(offsets, items, type=MESSAGES_TYPE)


def write_records(
    records: Iterable[PromptRecord],
    path: str | os.PathLike[str],
    kind: DatasetKind = "t2i",
    *,
    row_group_rows: int | None = None,
) -> int:
    """Write ``records`` to the parquet file ``path`` atomically; return the number of rows.

    The file appears only once complete: it is written under a hidden temporary name in the same
    folder (created if needed) and renamed at the end; on any error the temporary file is removed
    and an existing file at ``path`` is left untouched.

    Args:
        records: any iterable, consumed once and streamed.
        path: the output file.
        kind: ``"t2i"`` (no record may carry a ref_image) or ``"edit"`` (every record carries one
            decodable image whose sides are multiples of 16 and whose area is at most 2048²).
        row_group_rows: rows per row group; the default suits each kind.

    Raises:
        ValueError: a record does not fit ``kind`` or its image breaks the rules; the message names
            the record's position.
    """
    schema_for(kind)  # validates kind before anything is created
    with AtomicOutputs() as outputs:
        temporary = outputs.reserve(Path(path))
        writer = RecordWriter(temporary, kind, row_group_rows=row_group_rows)
        try:
            for record in records:
                writer.write(record)
            writer.close()
        except BaseException:
            writer.discard()
            raise
        outputs.commit()
    return writer.rows_written
