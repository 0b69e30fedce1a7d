"""PromptRecord validation, write_records, and the write -> read round trip."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from hypothesis import given
from hypothesis import strategies as st

from boogu_data import (
    EDIT_SCHEMA,
    SCHEMA_VERSION,
    SYSTEM_PROMPT_T2I,
    SYSTEM_PROMPT_TI2I,
    T2I_SCHEMA,
    PromptRecord,
    read_records,
    write_records,
)
from tests.data.helpers import leftovers, png
from tests.data.strategies import prompt_records


@given(st.lists(prompt_records("t2i"), max_size=12))
def test_t2i_round_trip(records: list[PromptRecord]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t2i.parquet"
        assert write_records(records, path, "t2i", row_group_rows=5) == len(records)
        assert list(read_records(path)) == records


@given(st.lists(prompt_records("edit"), min_size=1, max_size=4))
def test_edit_round_trip(records: list[PromptRecord]) -> None:
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "edit.parquet"
        assert write_records(records, path, "edit", row_group_rows=3) == len(records)
        back = list(read_records(path))
        assert back == records
        assert all(record.ref_image is not None and record.kind == "edit" for record in back)


def test_written_layout_and_metadata(tmp_path: Path) -> None:
    records = [
        PromptRecord('a sign "A"', ground_truth="A", data_source="flow_grpo/ocr", ability="ocr", index=0),
        PromptRecord(" ", negative="blurry", ground_truth="", split="test", index=7),
    ]
    path = tmp_path / "x.parquet"
    write_records(records, path)
    metadata = pq.read_metadata(path).metadata
    assert metadata[b"boogu_data.schema_version"] == SCHEMA_VERSION.encode()
    assert metadata[b"boogu_data.kind"] == b"t2i"
    table = pq.read_table(path)
    assert table.schema.names == T2I_SCHEMA.names
    rows = table.to_pylist()
    assert rows[0]["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT_T2I},
        {"role": "user", "content": 'a sign "A"'},
    ]
    assert rows[0]["negative_prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT_TI2I},
        {"role": "user", "content": ""},
    ]
    # A whitespace-only instruction takes TI2I, a non-empty negative takes T2I (text-only encoding).
    assert rows[1]["prompt"][0]["content"] == SYSTEM_PROMPT_TI2I
    assert rows[1]["negative_prompt"][0]["content"] == SYSTEM_PROMPT_T2I
    assert rows[1]["reward_model"] == {"style": "model", "ground_truth": ""}
    assert rows[1]["extra_info"] == {"split": "test", "index": 7}


def test_edit_layout_has_one_image_and_a_leading_placeholder(tmp_path: Path) -> None:
    image = png(48, 32)
    path = tmp_path / "e.parquet"
    write_records([PromptRecord("say HI", ref_image=image)], path, "edit")
    assert pq.read_schema(path).names == EDIT_SCHEMA.names
    row = pq.read_table(path).to_pylist()[0]
    assert row["images"] == [{"bytes": image}]
    assert row["prompt"] == [
        {"role": "system", "content": SYSTEM_PROMPT_TI2I},
        {"role": "user", "content": "<image>say HI"},
    ]
    assert row["negative_prompt"][1] == {"role": "user", "content": ""}


def test_writing_is_deterministic(tmp_path: Path) -> None:
    records = [PromptRecord(f'sign "{i}"', ground_truth=str(i), index=i) for i in range(50)]
    write_records(records, tmp_path / "a.parquet", row_group_rows=16)
    write_records(iter(records), tmp_path / "b.parquet", row_group_rows=16)
    assert (tmp_path / "a.parquet").read_bytes() == (tmp_path / "b.parquet").read_bytes()
    assert pq.ParquetFile(tmp_path / "a.parquet").metadata.num_row_groups == 4


def _failing(records: list[PromptRecord]):
    yield from records
    raise RuntimeError("input broke mid-way")


@pytest.mark.parametrize(
    ("kind", "records", "error", "match"),
    [
        (
            "t2i",
            [PromptRecord("a"), PromptRecord("b", ref_image=png())],
            ValueError,
            "record 1 has a ref_image",
        ),
        (
            "edit",
            [PromptRecord("a", ref_image=png()), PromptRecord("b")],
            ValueError,
            "record 1 has no ref_image",
        ),
        (
            "edit",
            [PromptRecord("a", ref_image=b"not an image")],
            ValueError,
            "record 0: ref_image: not a decodable",
        ),
        ("edit", [PromptRecord("a", ref_image=png(20, 32))], ValueError, "multiples of 16"),
        ("t2i", _failing([PromptRecord("a")] * 3), RuntimeError, "mid-way"),
        ("t2i", ["not a record"], TypeError, "PromptRecord"),
    ],
    ids=["image-in-t2i", "no-image-in-edit", "undecodable", "bad-size", "iterator-fails", "wrong-type"],
)
def test_failed_write_leaves_nothing_and_keeps_the_old_file(
    tmp_path: Path, kind: str, records: list, error: type, match: str
) -> None:
    path = tmp_path / "out.parquet"
    path.write_bytes(b"previous content")
    with pytest.raises(error, match=match):
        write_records(records, path, kind)  # type: ignore[arg-type]
    assert path.read_bytes() == b"previous content"
    assert leftovers(tmp_path) == []


def test_write_records_rejects_unknown_kind(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="kind"):
        write_records([], tmp_path / "x.parquet", "video")  # type: ignore[arg-type]
    assert list(tmp_path.iterdir()) == []


def test_write_creates_the_parent_folder(tmp_path: Path) -> None:
    path = tmp_path / "a" / "b" / "x.parquet"
    write_records([PromptRecord("a")], path)
    assert [r.instruction for r in read_records(path)] == ["a"]


def test_folder_reads_files_in_name_order_and_skips_hidden(tmp_path: Path) -> None:
    write_records([PromptRecord("second")], tmp_path / "b.parquet")
    write_records([PromptRecord("first")], tmp_path / "a.parquet")
    (tmp_path / ".b.parquet.1234abcd.tmp").write_bytes(b"killed writer")
    (tmp_path / "notes.txt").write_text("ignored")
    assert [r.instruction for r in read_records(tmp_path)] == ["first", "second"]


@pytest.mark.parametrize(
    ("fields", "match"),
    [
        ({"instruction": "a <image> b"}, "instruction must not contain"),
        ({"negative": "<image>"}, "negative must not contain"),
        ({"instruction": 3}, "instruction must be a str"),
        ({"ground_truth": None}, "ground_truth must be a str"),
        ({"instruction": "bad \ud800 surrogate"}, "not valid Unicode"),
        ({"index": -1}, "index must be an int >= 0"),
        ({"index": True}, "index must be an int >= 0"),
        ({"ref_image": b""}, "ref_image must be non-empty bytes"),
        ({"ref_image": bytearray(b"x")}, "ref_image must be non-empty bytes"),
    ],
)
def test_prompt_record_rejects_invalid_fields(fields: dict, match: str) -> None:
    values = {"instruction": "ok", **fields}
    with pytest.raises((TypeError, ValueError), match=match):
        PromptRecord(**values)


def test_prompt_record_is_frozen_and_builds_its_messages() -> None:
    record = PromptRecord("write HI", negative="", ref_image=png())
    with pytest.raises(AttributeError):
        record.instruction = "other"  # type: ignore[misc]
    assert record.kind == "edit"
    assert record.messages(image="PIL")[1]["content"][0] == {"type": "image", "image": "PIL"}
    assert record.negative_messages()[1]["content"] == [{"type": "text", "text": ""}]
    with pytest.raises(ValueError, match="no reference image"):
        PromptRecord("t2i").messages(image="PIL")


@pytest.mark.parametrize("rows", [0, -1, 2.5])
def test_row_group_rows_must_be_positive(tmp_path: Path, rows: object) -> None:
    with pytest.raises(ValueError, match="row_group_rows must be an int >= 1"):
        write_records([PromptRecord("a")], tmp_path / "x.parquet", row_group_rows=rows)  # type: ignore[arg-type]
    assert leftovers(tmp_path) == [] and list(tmp_path.iterdir()) == []


def test_edit_row_groups_are_capped_by_image_bytes(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import boogu_data.write

    monkeypatch.setattr(boogu_data.write, "ROW_GROUP_IMAGE_BYTES", 1)  # every image closes a group
    records = [PromptRecord(f"r{i}", ref_image=png(), index=i) for i in range(3)]
    write_records(records, tmp_path / "e.parquet", "edit")
    assert pq.ParquetFile(tmp_path / "e.parquet").metadata.num_row_groups == 3
    assert list(read_records(tmp_path / "e.parquet")) == records
