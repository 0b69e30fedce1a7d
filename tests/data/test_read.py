"""Readers: the reference integration's files read as they are; every malformed file is a DatasetError."""

from __future__ import annotations

import copy
import warnings
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from boogu_data import DatasetError, PromptRecord, ReferenceLayoutWarning, read_records, write_records
from tests.data.helpers import (
    REF_T2I,
    REF_TI2I,
    png,
    reference_edit_rows,
    reference_t2i_rows,
    write_reference,
    write_table,
)


def test_reference_t2i_file_reads(tmp_path: Path) -> None:
    prompts = [('A sign that says "OPEN"', "OPEN"), ('A mug printed "Café ☕"', "Café ☕")]
    path = write_reference(reference_t2i_rows(prompts, split="test"), tmp_path / "test.parquet")
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # a T2I reference file needs no normalisation
        records = list(read_records(path))
    assert records == [
        PromptRecord(
            instruction=text,
            negative="",
            ground_truth=truth,
            data_source="flow_grpo/ocr",
            ability="ocr",
            split="test",
            index=index,
        )
        for index, (text, truth) in enumerate(prompts)
    ]


def test_reference_edit_file_reads_and_warns_once_about_the_prefix(tmp_path: Path) -> None:
    items = [('Change the text to "HELLO"', "HELLO", png(64, 64)), ("Write BYE", "BYE", png(32, 48))]
    path = write_reference(
        reference_edit_rows(items), tmp_path / "train.parquet", edit=True, row_group_size=1
    )
    with pytest.warns(ReferenceLayoutWarning, match="Picture 1: ") as caught:
        records = list(read_records(path))
    assert len([w for w in caught if issubclass(w.category, ReferenceLayoutWarning)]) == 1
    assert [(r.instruction, r.ground_truth, r.ref_image) for r in records] == items
    assert all(r.data_source == "flow_grpo/ocr_edit" and r.ability == "image_edit" for r in records)
    assert [r.index for r in records] == [0, 1]


def test_large_types_read(tmp_path: Path) -> None:
    # Other writers (polars, large datasets) use large_string / large_list; same logical layout.
    message = pa.struct([("role", pa.large_string()), ("content", pa.large_string())])
    schema = pa.schema(
        [
            ("data_source", pa.large_string()),
            ("prompt", pa.large_list(message)),
            ("negative_prompt", pa.large_list(message)),
            ("ability", pa.large_string()),
            ("reward_model", pa.struct([("style", pa.large_string()), ("ground_truth", pa.large_string())])),
            ("extra_info", pa.struct([("split", pa.large_string()), ("index", pa.int32())])),
            ("unrelated", pa.float64()),
        ]
    )
    rows = [dict(reference_t2i_rows([('x "y"', "y")])[0], unrelated=1.5)]
    records = list(read_records(write_table(rows, schema, tmp_path / "large.parquet")))
    assert [(r.instruction, r.ground_truth) for r in records] == [('x "y"', "y")]


# ---------------------------------------------------------------------------------------- errors


def _edit_rows(n: int = 3) -> list[dict]:
    return reference_edit_rows([(f'write "{i}"', str(i), png()) for i in range(n)])


def _set_user(rows: list[dict], row: int, content: str) -> list[dict]:
    rows[row]["prompt"][1]["content"] = content
    return rows


def _edit_case(row: int, change) -> list[dict]:
    rows = copy.deepcopy(_edit_rows())
    change(rows[row])
    return rows


def _big_png() -> bytes:
    # 4096 x 1040 = 4,259,840 px > 2048²; a 1-bit image keeps the test cheap.
    return png(4096, 1040, mode="1")


EDIT_ERRORS = [
    (
        "no-placeholder",
        lambda r: r["prompt"][1].update(content="write it"),
        "prompt",
        "placeholder is missing from the user turn",
    ),
    (
        "placeholder-in-middle",
        lambda r: r["prompt"][1].update(content="write <image> it"),
        "prompt",
        "not at the start",
    ),
    (
        "two-placeholders",
        lambda r: r["prompt"][1].update(content="<image><image>x"),
        "prompt",
        "more than one image placeholder",
    ),
    ("two-images", lambda r: r.update(images=[{"bytes": png()}, {"bytes": png()}]), "images", "2 images"),
    ("no-image", lambda r: r.update(images=[]), "images", "0 images"),
    ("null-images", lambda r: r.update(images=None), "images", "value is null"),
    ("null-bytes", lambda r: r.update(images=[{"bytes": None}]), "images", "not encoded bytes"),
    (
        "undecodable",
        lambda r: r.update(images=[{"bytes": b"\x89PNG garbage"}]),
        "images",
        "not a decodable image",
    ),
    ("side-not-16", lambda r: r.update(images=[{"bytes": png(40, 32)}]), "images", "multiples of 16"),
    ("area-too-big", lambda r: r.update(images=[{"bytes": _big_png()}]), "images", "at most 2048x2048"),
    (
        "negative-placeholder",
        lambda r: r["negative_prompt"][1].update(content="Picture 1: <image> "),
        "negative_prompt",
        "negatives are encoded text-only",
    ),
    (
        "wrong-system",
        lambda r: r["prompt"][0].update(content=REF_T2I),
        "prompt",
        "SYSTEM_PROMPT_TI2I for a non-empty instruction with an image",
    ),
    ("one-turn", lambda r: r.update(prompt=[r["prompt"][1]]), "prompt", "value is 1 turns"),
    (
        "roles-swapped",
        lambda r: r.update(prompt=r["prompt"][::-1]),
        "prompt",
        "turn 0 is",
    ),
    (
        "null-ground-truth",
        lambda r: r["reward_model"].update(ground_truth=None),
        "reward_model",
        "ground_truth",
    ),
    ("null-data-source", lambda r: r.update(data_source=None), "data_source", "value is null"),
    ("null-split", lambda r: r["extra_info"].update(split=None), "extra_info", "split is null"),
    ("negative-index", lambda r: r["extra_info"].update(index=-3), "extra_info", "index is -3"),
]


@pytest.mark.parametrize(
    ("change", "column", "match"), [c[1:] for c in EDIT_ERRORS], ids=[c[0] for c in EDIT_ERRORS]
)
def test_edit_row_errors_name_file_row_and_column(tmp_path: Path, change, column: str, match: str) -> None:
    path = write_reference(_edit_case(2, change), tmp_path / "bad.parquet", edit=True, row_group_size=2)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceLayoutWarning)
        records = read_records(path)
        assert next(records).ground_truth == "0"  # rows before the bad one still stream out
        with pytest.raises(DatasetError) as caught:
            list(records)
    error = caught.value
    assert (error.path, error.row, error.column) == (str(path), 2, column)
    message = str(error)
    assert message.startswith(f"{path}, row 2, column {column!r}: ")
    assert match in message


T2I_ERRORS = [
    (
        "placeholder-without-image",
        lambda r: r["prompt"][1].update(content="<image>a sign"),
        "prompt",
        "no images",
    ),
    (
        "fixed-quirk",  # someone "fixed" the empty negative to the T2I prompt: refused, not corrected
        lambda r: r["negative_prompt"][0].update(content=REF_T2I),
        "negative_prompt",
        "SYSTEM_PROMPT_TI2I for an empty instruction without an image",
    ),
    (
        "foreign-system",
        lambda r: r["prompt"][0].update(content="Describe the image by detailing the color, shape, size"),
        "prompt",
        "breaks upstream Boogu's selection rule",
    ),
    ("null-prompt", lambda r: r.update(prompt=None), "prompt", "value is null"),
]


@pytest.mark.parametrize(
    ("change", "column", "match"), [c[1:] for c in T2I_ERRORS], ids=[c[0] for c in T2I_ERRORS]
)
def test_t2i_row_errors_name_file_row_and_column(tmp_path: Path, change, column: str, match: str) -> None:
    rows = reference_t2i_rows([('a "b"', "b")] * 2)
    change(rows[1])
    path = write_reference(rows, tmp_path / "bad.parquet")
    with pytest.raises(DatasetError) as caught:
        list(read_records(path))
    assert (caught.value.row, caught.value.column) == (1, column)
    assert str(caught.value).startswith(f"{path}, row 1, column {column!r}: ")
    assert match in str(caught.value)


def _t2i_schema(**replace: pa.DataType) -> pa.Schema:
    message = pa.list_(pa.struct([("role", pa.string()), ("content", pa.string())]))
    types = {
        "data_source": pa.string(),
        "prompt": message,
        "negative_prompt": message,
        "ability": pa.string(),
        "reward_model": pa.struct([("style", pa.string()), ("ground_truth", pa.string())]),
        "extra_info": pa.struct([("split", pa.string()), ("index", pa.int64())]),
    }
    types.update(replace)
    return pa.schema([(name, kind) for name, kind in types.items() if kind is not None])


@pytest.mark.parametrize(
    ("schema", "column", "match"),
    [
        (_t2i_schema(negative_prompt=None), "negative_prompt", "column is missing"),
        (_t2i_schema(prompt=pa.string()), "prompt", "wrong type: got string"),
        (
            _t2i_schema(reward_model=pa.struct([("style", pa.string())])),
            "reward_model",
            "struct field 'ground_truth' is missing",
        ),
        (
            _t2i_schema(extra_info=pa.struct([("split", pa.string()), ("index", pa.string())])),
            "extra_info",
            "index",
        ),
        (_t2i_schema(images=pa.list_(pa.string())), "images", "list item: got string"),
    ],
    ids=[
        "missing-column",
        "prompt-is-string",
        "missing-struct-field",
        "index-is-string",
        "images-wrong-item",
    ],
)
def test_schema_errors_name_the_column_and_expected_type(
    tmp_path: Path, schema: pa.Schema, column: str, match: str
) -> None:
    path = write_table([], schema, tmp_path / "schema.parquet")
    with pytest.raises(DatasetError) as caught:
        list(read_records(path))
    assert caught.value.column == column
    assert str(caught.value).startswith(f"{path}, column {column!r}: ")
    assert match in str(caught.value)
    assert "expected" in str(caught.value)


def test_newer_schema_version_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "new.parquet"
    write_records([PromptRecord("a")], path)
    table = pq.read_table(path)
    newer = table.replace_schema_metadata({b"boogu_data.schema_version": b"99"})
    pq.write_table(newer, path)
    with pytest.raises(DatasetError, match=r"schema version '99'.*upgrade boogu-data"):
        list(read_records(path))


@pytest.mark.parametrize("content", [b"", b"PAR1 but not really", b"hello"])
def test_not_a_parquet_file(tmp_path: Path, content: bytes) -> None:
    path = tmp_path / "junk.parquet"
    path.write_bytes(content)
    with pytest.raises(DatasetError, match=f"^{path}: not a readable parquet file"):
        list(read_records(path))


def test_missing_path_and_empty_folder(tmp_path: Path) -> None:
    with pytest.raises(DatasetError, match="no such file or folder"):
        read_records(tmp_path / "absent.parquet")
    with pytest.raises(DatasetError, match=r"holds no \*\.parquet files"):
        read_records(tmp_path)


def test_ti2i_system_on_edit_negative_with_text_is_refused(tmp_path: Path) -> None:
    # A non-empty edit negative is encoded text-only, so upstream gives it the T2I prompt.
    rows = _edit_rows(1)
    rows[0]["negative_prompt"] = [
        {"role": "system", "content": REF_TI2I},
        {"role": "user", "content": "blurry"},
    ]
    path = write_reference(rows, tmp_path / "neg.parquet", edit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceLayoutWarning)
        with pytest.raises(
            DatasetError, match="SYSTEM_PROMPT_T2I for a non-empty instruction without an image"
        ):
            list(read_records(path))
    rows[0]["negative_prompt"][0]["content"] = REF_T2I
    path = write_reference(rows, tmp_path / "neg_ok.parquet", edit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceLayoutWarning)
        assert [r.negative for r in read_records(path)] == ["blurry"]


def test_decode_images_false_checks_headers_only(tmp_path: Path) -> None:
    truncated = png(32, 32)[:-30]  # header intact, pixel data cut short
    rows = reference_edit_rows([('x "y"', "y", truncated)])
    path = write_reference(rows, tmp_path / "cut.parquet", edit=True)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ReferenceLayoutWarning)
        with pytest.raises(DatasetError, match="not a decodable image"):
            list(read_records(path))
        assert [r.ref_image for r in read_records(path, decode_images=False)] == [truncated]
        # Size rules come from the header, so they hold either way.
        rows = reference_edit_rows([('x "y"', "y", png(40, 32))])
        path = write_reference(rows, tmp_path / "size.parquet", edit=True)
        with pytest.raises(DatasetError, match="multiples of 16"):
            list(read_records(path, decode_images=False))
