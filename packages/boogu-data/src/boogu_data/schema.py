"""Parquet schemas for Boogu prompt datasets (T2I and edit rows).

The columns are those of the reference integration's converters (docs/reference-integration.md §5), so
files move between it and us in both directions:

========================  ============================================  =================================
column                    type                                          content
========================  ============================================  =================================
``data_source``           string                                        dataset name, e.g. "flow_grpo/ocr"
``prompt``                list<struct<role: string, content: string>>   [system, user] turns
``negative_prompt``       list<struct<role: string, content: string>>   [system, user] turns, text-only
``ability``               string                                        "ocr", "image_edit", ...
``images`` (edit only)    list<struct<bytes: binary>>                   exactly one encoded image
``reward_model``          struct<style: string, ground_truth: string>   style "model"
``extra_info``            struct<split: string, index: int64>           provenance
========================  ============================================  =================================

In an edit row the user turn of ``prompt`` starts with the ``<image>`` placeholder, followed directly
by the instruction; the negative never has one (it is encoded text-only). Files we write carry
``boogu_data.schema_version`` (and ``boogu_data.kind``) in the parquet key-value metadata; files
without it are read as the reference integration's layout.

Readers accept wider physical types for the same logical column (large strings, large lists, any
integer index) and ignore extra columns and extra struct fields, so the reference edit converter's
``extra_info`` with ``instruction``, ``image`` and ``target_text`` reads too.
"""

from __future__ import annotations

from typing import Final

import pyarrow as pa

from boogu_data.record import DatasetKind

__all__ = [
    "EDIT_SCHEMA",
    "KIND_KEY",
    "SCHEMA_VERSION",
    "SCHEMA_VERSION_KEY",
    "T2I_SCHEMA",
    "schema_for",
    "type_problem",
]

SCHEMA_VERSION: Final[str] = "1"
"""Version of the layout this package writes; bumped when a reader of the old one would misread it."""
SCHEMA_VERSION_KEY: Final[bytes] = b"boogu_data.schema_version"
"""Parquet key-value metadata key holding :data:`SCHEMA_VERSION`."""
KIND_KEY: Final[bytes] = b"boogu_data.kind"
"""Parquet key-value metadata key holding ``"t2i"`` or ``"edit"`` (informative; readers go by columns)."""

MESSAGE_TYPE: Final = pa.struct([("role", pa.string()), ("content", pa.string())])
MESSAGES_TYPE: Final = pa.list_(MESSAGE_TYPE)
REWARD_MODEL_TYPE: Final = pa.struct([("style", pa.string()), ("ground_truth", pa.string())])
EXTRA_INFO_TYPE: Final = pa.struct([("split", pa.string()), ("index", pa.int64())])
IMAGES_TYPE: Final = pa.list_(pa.struct([("bytes", pa.binary())]))


def _schema(kind: DatasetKind) -> pa.Schema:
    fields = [
        ("data_source", pa.string()),
        ("prompt", MESSAGES_TYPE),
        ("negative_prompt", MESSAGES_TYPE),
        ("ability", pa.string()),
    ]
    if kind == "edit":
        fields.append(("images", IMAGES_TYPE))
    fields += [("reward_model", REWARD_MODEL_TYPE), ("extra_info", EXTRA_INFO_TYPE)]
    return pa.schema(fields, metadata={SCHEMA_VERSION_KEY: SCHEMA_VERSION.encode(), KIND_KEY: kind.encode()})


T2I_SCHEMA: Final[pa.Schema] = _schema("t2i")
"""Schema of a text-to-image dataset file."""
EDIT_SCHEMA: Final[pa.Schema] = _schema("edit")
"""Schema of an edit (TI2I) dataset file: the T2I columns plus ``images``."""


def schema_for(kind: DatasetKind) -> pa.Schema:
    """The schema this package writes for ``kind`` (``"t2i"`` or ``"edit"``)."""
    if kind == "t2i":
        return T2I_SCHEMA
    if kind == "edit":
        return EDIT_SCHEMA
    raise ValueError(f"kind must be 't2i' or 'edit', got {kind!r}")


def type_problem(actual: pa.DataType, expected: pa.DataType) -> str | None:
    """Why ``actual`` cannot be read as ``expected``, or None when it can.

    Compatible means the same logical type: string/large_string/string_view for a string,
    binary/large_binary/binary_view for binary, any integer for an integer, list/large_list of a
    compatible item for a list, and a struct holding at least the expected fields (extra fields are
    ignored).
    """
    if pa.types.is_string(expected):
        ok = pa.types.is_string(actual) or pa.types.is_large_string(actual) or pa.types.is_string_view(actual)
        return None if ok else f"got {actual}"
    if pa.types.is_binary(expected):
        ok = pa.types.is_binary(actual) or pa.types.is_large_binary(actual) or pa.types.is_binary_view(actual)
        return None if ok else f"got {actual}"
    if pa.types.is_integer(expected):
        return None if pa.types.is_integer(actual) else f"got {actual}"
    if pa.types.is_list(expected):
        if not (pa.types.is_list(actual) or pa.types.is_large_list(actual)):
            return f"got {actual}"
        inner = type_problem(actual.value_type, expected.value_type)
        return None if inner is None else f"list item: {inner}"
    if pa.types.is_struct(expected):
        if not pa.types.is_struct(actual):
            return f"got {actual}"
        for child in expected:
            index = actual.get_field_index(child.name)
            if index < 0:
                return f"struct field {child.name!r} is missing (got {actual})"
            inner = type_problem(actual.field(index).type, child.type)
            if inner is not None:
                return f"struct field {child.name!r}: {inner}"
        return None
    raise AssertionError(f"no compatibility rule for {expected}")  # our own schemas only
