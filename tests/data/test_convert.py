"""The OCR (T2I) and edit-OCR converters: real input, determinism, errors, atomicity."""

from __future__ import annotations

import errno
import io
import json
import os
import re
import shutil
import signal
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest
from PIL import Image

import boogu_data.atomic
from boogu_data import DatasetError, OutputError, convert_edit_ocr, convert_ocr, read_records
from boogu_data.write import RecordWriter
from tests.data.helpers import leftovers, png

# ------------------------------------------------------------------------------------ OCR (T2I)


def _ocr_input(folder: Path, train: bytes | str, test: bytes | str = 'a sign "T"\n') -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    for name, content in (("train.txt", train), ("test.txt", test)):
        data = content.encode() if isinstance(content, str) else content
        (folder / name).write_bytes(data)
    return folder


def test_real_prompts_convert_to_300_rows_per_split(tmp_path: Path, ocr_prompts: Path) -> None:
    source = tmp_path / "in"
    source.mkdir()
    shutil.copy(ocr_prompts, source / "train.txt")
    shutil.copy(ocr_prompts, source / "test.txt")
    report = convert_ocr(source, tmp_path / "out")
    lines = ocr_prompts.read_text(encoding="utf-8").splitlines()
    # An independent reading of the rule: the text between the first pair of double quotes.
    spans = [re.search(r'"([^"]*)"', line).group(1) for line in lines]  # type: ignore[union-attr]
    assert len(lines) == 300
    assert [(s.split, s.rows, s.skipped) for s in report.splits] == [("train", 300, 0), ("test", 300, 0)]
    for split in ("train", "test"):
        records = list(read_records(tmp_path / "out" / f"{split}.parquet"))
        assert [r.ground_truth for r in records] == spans
        assert [r.instruction for r in records] == lines
        assert [r.index for r in records] == list(range(300))
        assert {(r.split, r.data_source, r.ability, r.negative, r.ref_image) for r in records} == {
            (split, "flow_grpo/ocr", "ocr", "", None)
        }
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["test.parquet", "train.parquet"]


def test_ocr_conversion_is_byte_deterministic(tmp_path: Path, ocr_prompts: Path) -> None:
    lines = ocr_prompts.read_bytes().splitlines(keepends=True)
    source = _ocr_input(tmp_path / "in", b"".join(lines), b"".join(lines[:10]))
    convert_ocr(source, tmp_path / "a")
    convert_ocr(source, tmp_path / "b")
    for name in ("train.parquet", "test.parquet"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()


def test_ocr_line_endings_bom_and_verbatim_text(tmp_path: Path) -> None:
    train = '\ufeffA "one"  \r\nB \u201c"two"\u201d\nC "\u0627\u0644\u0639\u0631\u0628\u064a\u0629" end'
    source = _ocr_input(tmp_path / "in", train.encode("utf-8"))
    convert_ocr(source, tmp_path / "out")
    records = list(read_records(tmp_path / "out" / "train.parquet"))
    assert [r.instruction for r in records] == ['A "one"  ', 'B \u201c"two"\u201d', 'C "العربية" end']
    assert [r.ground_truth for r in records] == ["one", "two", "العربية"]


OCR_ERRORS = [
    ("no-span", 'a "x"\nno quotes here\n', 2, "no double-quoted span"),
    ("unclosed", 'a "x"\nan "unclosed quote\n', 2, "no double-quoted span"),
    ("empty-span", 'a "x"\nsays "" nothing\n', 2, "the double-quoted span is empty"),
    ("empty-line", 'a "x"\n\nb "y"\n', 2, "empty line"),
    ("blank-line", 'a "x"\nb "y"\n   \t\n', 3, "empty line"),
    ("bad-utf8", b'a "x"\nb "y"\nc "\xff\xfe"\n', 3, "not valid UTF-8"),
    ("placeholder", 'a "x"\n<image> "y"\n', 2, "must not contain the image placeholder"),
]


@pytest.mark.parametrize(
    ("train", "line", "match"), [c[1:] for c in OCR_ERRORS], ids=[c[0] for c in OCR_ERRORS]
)
def test_ocr_errors_name_file_and_line_and_leave_nothing(
    tmp_path: Path, train: str | bytes, line: int, match: str
) -> None:
    source = _ocr_input(tmp_path / "in", train)
    output = tmp_path / "out"
    output.mkdir()
    (output / "train.parquet").write_bytes(b"from an earlier run")
    with pytest.raises(DatasetError) as caught:
        convert_ocr(source, output)
    assert (caught.value.path, caught.value.line) == (str(source / "train.txt"), line)
    assert str(caught.value).startswith(f"{source / 'train.txt'}, line {line}: ")
    assert match in str(caught.value)
    # All-or-nothing: the earlier file is untouched, nothing else appeared, no temporary file.
    assert sorted(p.name for p in output.iterdir()) == ["train.parquet"]
    assert (output / "train.parquet").read_bytes() == b"from an earlier run"


def test_ocr_failure_in_test_split_discards_the_finished_train_split(tmp_path: Path) -> None:
    source = _ocr_input(tmp_path / "in", 'a "x"\n' * 10, 'fine "y"\nbroken\n')
    with pytest.raises(DatasetError, match=r"test\.txt, line 2: no double-quoted span"):
        convert_ocr(source, tmp_path / "out")
    assert list((tmp_path / "out").iterdir()) == []


def test_ocr_skip_invalid_counts_and_reports(tmp_path: Path) -> None:
    source = _ocr_input(tmp_path / "in", b'a "x"\nnothing\n\nb "y"\n\xff\n')
    report = convert_ocr(source, tmp_path / "out", skip_invalid=True)
    train = report.splits[0]
    assert (train.rows, train.skipped) == (2, 3)
    assert [reason.split(": ", 1)[0] for reason in train.skip_reasons] == [
        f"{source / 'train.txt'}, line {n}" for n in (2, 3, 5)
    ]
    records = list(read_records(tmp_path / "out" / "train.parquet"))
    assert [(r.ground_truth, r.index) for r in records] == [("x", 0), ("y", 1)]


def test_ocr_missing_input_or_no_rows(tmp_path: Path) -> None:
    source = tmp_path / "in"
    source.mkdir()
    (source / "train.txt").write_text('a "x"\n')
    with pytest.raises(
        DatasetError, match=r"test\.txt: missing input file \(expected train\.txt and test\.txt"
    ):
        convert_ocr(source, tmp_path / "out")
    assert not (tmp_path / "out").exists()
    (source / "test.txt").write_text("")
    with pytest.raises(DatasetError, match=r"test\.txt: no valid rows"):
        convert_ocr(source, tmp_path / "out")
    (source / "test.txt").write_text("junk\n")
    with pytest.raises(DatasetError, match=r"no valid rows \(1 invalid lines skipped\)"):
        convert_ocr(source, tmp_path / "out", skip_invalid=True)
    assert leftovers(tmp_path / "out") == []
    assert list((tmp_path / "out").iterdir()) == []


# ------------------------------------------------------------------------------------ edit OCR


def _edit_input(folder: Path, train: list, test: list | None = None) -> Path:
    (folder / "images").mkdir(parents=True, exist_ok=True)
    Image.new("RGB", (60, 30), (255, 0, 0)).save(folder / "images" / "wide.png")
    Image.new("L", (20, 40), 0).save(folder / "images" / "tall.jpg")
    (folder / "images" / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n not really")
    test = test if test is not None else [{"image": "wide.png", "instruction": 'Write "T"'}]
    for name, rows in (("train.jsonl", train), ("test.jsonl", test)):
        text = "".join((row if isinstance(row, str) else json.dumps(row)) + "\n" for row in rows)
        (folder / name).write_text(text, encoding="utf-8")
    return folder


def _decode(data: bytes) -> Image.Image:
    image = Image.open(io.BytesIO(data))
    image.load()
    return image


def test_edit_conversion_letterboxes_and_finds_ground_truth(tmp_path: Path) -> None:
    source = _edit_input(
        tmp_path / "in",
        [
            {"image": "wide.png", "instruction": 'Change the text to "HELLO"'},
            {"image": "tall.jpg", "instruction": "Write bye", "target_text": "BYE", "extra": 1},
        ],
    )
    report = convert_edit_ocr(source, tmp_path / "out", image_size=64)
    assert [(s.split, s.rows) for s in report.splits] == [("train", 2), ("test", 1)]
    records = list(read_records(tmp_path / "out" / "train.parquet"))
    assert [(r.instruction, r.ground_truth, r.negative) for r in records] == [
        ('Change the text to "HELLO"', "HELLO", ""),
        ("Write bye", "BYE", ""),
    ]
    assert {(r.data_source, r.ability) for r in records} == {("flow_grpo/ocr_edit", "image_edit")}
    wide = _decode(records[0].ref_image)  # type: ignore[arg-type]
    assert (wide.format, wide.mode, wide.size) == ("PNG", "RGB", (64, 64))
    # 60x30 fits as 64x32, centred: white bands above and below, red in the middle.
    assert wide.getpixel((32, 32)) == (255, 0, 0)
    assert wide.getpixel((0, 0)) == wide.getpixel((63, 63)) == (255, 255, 255)
    assert wide.getpixel((32, 15)) == (255, 255, 255) and wide.getpixel((32, 17)) == (255, 0, 0)
    tall = _decode(records[1].ref_image)  # type: ignore[arg-type]
    assert (
        tall.size == (64, 64)
        and tall.getpixel((32, 32)) == (0, 0, 0)
        and tall.getpixel((2, 32)) == (255,) * 3
    )


def test_edit_conversion_is_deterministic_and_limits_rows(tmp_path: Path) -> None:
    rows = [{"image": "wide.png", "instruction": f'Write "{i}"'} for i in range(5)]
    source = _edit_input(tmp_path / "in", rows)
    convert_edit_ocr(source, tmp_path / "a", image_size=32, train_size=3)
    convert_edit_ocr(source, tmp_path / "b", image_size=32, train_size=3, val_size=-1)
    assert (tmp_path / "a" / "train.parquet").read_bytes() == (tmp_path / "b" / "train.parquet").read_bytes()
    assert pq.read_metadata(tmp_path / "a" / "train.parquet").num_rows == 3


EDIT_ERRORS = [
    ("missing-image", {"image": "nope.png", "instruction": 'x "y"'}, "image", "does not exist"),
    ("traversal", {"image": "../train.jsonl", "instruction": 'x "y"'}, "image", "points outside"),
    ("absolute", {"image": "/etc/hostname", "instruction": 'x "y"'}, "image", "points outside"),
    ("undecodable", {"image": "broken.png", "instruction": 'x "y"'}, "image", "cannot decode"),
    ("no-ground-truth", {"image": "wide.png", "instruction": "no quotes"}, "target_text", "no target_text"),
    (
        "empty-target",
        {"image": "wide.png", "instruction": "x", "target_text": ""},
        "target_text",
        "value is ''",
    ),
    ("no-instruction", {"image": "wide.png"}, "instruction", "value is None"),
    ("image-not-str", {"image": 3, "instruction": 'x "y"'}, "image", "value is 3"),
    ("not-json", '{"image": "wide.png", ', None, "not valid JSON"),
    ("not-object", "[1, 2]", None, "the line is a JSON list"),
    ("blank-line", "", None, "not valid JSON"),
]


@pytest.mark.parametrize(
    ("row", "column", "match"), [c[1:] for c in EDIT_ERRORS], ids=[c[0] for c in EDIT_ERRORS]
)
def test_edit_errors_name_file_line_and_key(
    tmp_path: Path, row: dict | str, column: str | None, match: str
) -> None:
    source = _edit_input(tmp_path / "in", [{"image": "wide.png", "instruction": 'ok "1"'}, row])
    output = tmp_path / "out"
    with pytest.raises(DatasetError) as caught:
        convert_edit_ocr(source, output, image_size=32)
    error = caught.value
    assert (error.path, error.line, error.column) == (str(source / "train.jsonl"), 2, column)
    prefix = f"{source / 'train.jsonl'}, line 2" + (f", column {column!r}" if column else "")
    assert str(error).startswith(prefix + ": ")
    assert match in str(error)
    assert list(output.iterdir()) == []


def test_edit_skip_invalid(tmp_path: Path) -> None:
    rows = [
        {"image": "nope.png", "instruction": 'x "y"'},
        {"image": "wide.png", "instruction": 'ok "1"'},
        "{",
    ]
    source = _edit_input(tmp_path / "in", rows)
    report = convert_edit_ocr(source, tmp_path / "out", image_size=32, skip_invalid=True)
    assert (report.splits[0].rows, report.splits[0].skipped, report.skipped) == (1, 2, 2)


@pytest.mark.parametrize(
    ("arguments", "match"),
    [
        ({"image_size": 500}, "multiple of 16"),
        ({"image_size": 2064}, "up to 2048"),
        ({"image_size": 0}, "positive"),
        ({"train_size": 0}, "train_size must be -1"),
        ({"val_size": -2}, "val_size must be -1"),
    ],
)
def test_edit_bad_arguments(tmp_path: Path, arguments: dict, match: str) -> None:
    source = _edit_input(tmp_path / "in", [{"image": "wide.png", "instruction": 'ok "1"'}])
    with pytest.raises(ValueError, match=match):
        convert_edit_ocr(source, tmp_path / "out", **arguments)
    assert not (tmp_path / "out").exists()


def test_edit_missing_images_folder(tmp_path: Path) -> None:
    source = tmp_path / "in"
    source.mkdir()
    (source / "train.jsonl").write_text("{}\n")
    with pytest.raises(DatasetError, match=r"images: missing folder"):
        convert_edit_ocr(source, tmp_path / "out")


def test_edit_reads_an_existing_reference_style_image_unchanged_size(tmp_path: Path) -> None:
    # A square input at the target size is only re-encoded, never resized.
    source = _edit_input(tmp_path / "in", [{"image": "square.png", "instruction": 'Write "Q"'}])
    (source / "images" / "square.png").write_bytes(png(32, 32, (1, 2, 3)))
    convert_edit_ocr(source, tmp_path / "out", image_size=32)
    record = next(read_records(tmp_path / "out" / "train.parquet"))
    image = _decode(record.ref_image)  # type: ignore[arg-type]
    assert image.size == (32, 32) and image.getcolors() == [(32 * 32, (1, 2, 3))]


def test_interrupted_edit_conversion_leaves_nothing(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import boogu_data.convert

    rows = [{"image": "wide.png", "instruction": f'Write "{i}"'} for i in range(3)]
    source = _edit_input(tmp_path / "in", rows)
    calls = []

    def interrupted(image: Image.Image, size: int) -> bytes:
        calls.append(size)
        if len(calls) == 3:
            raise KeyboardInterrupt  # Ctrl-C in the middle of the train split
        return png(size, size)

    monkeypatch.setattr(boogu_data.convert, "letterbox_png", interrupted)
    with pytest.raises(KeyboardInterrupt):
        convert_edit_ocr(source, tmp_path / "out", image_size=32)
    assert list((tmp_path / "out").iterdir()) == []


# ------------------------------------------------------------------------------------ output folder


def test_output_dir_that_is_a_file(tmp_path: Path) -> None:
    source = _ocr_input(tmp_path / "in", 'a "x"\n')
    output = tmp_path / "out"
    output.write_text("not a folder")
    with pytest.raises(OutputError, match=rf"^{re.escape(str(output))}: is a file, not a folder"):
        convert_ocr(source, output)
    assert output.read_text() == "not a folder"
    # A file higher up the path: the folder cannot be created.
    with pytest.raises(OutputError, match="part of the path is a file, not a folder") as caught:
        convert_ocr(source, output / "sub")
    assert caught.value.path == str(output / "sub" / "train.parquet")
    assert leftovers(tmp_path) == []


def test_output_dir_not_writable(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _ocr_input(tmp_path / "in", 'a "x"\n')
    output = tmp_path / "out"
    output.mkdir()
    output.chmod(0o500)
    if os.geteuid() == 0:
        # Root ignores permission bits: refuse the temporary's creation the way the OS would.
        def refusing_open(file, mode="r", *args, **kwargs):
            if "x" in mode and Path(file).parent == output:
                raise PermissionError(errno.EACCES, "Permission denied", str(file))
            return open(file, mode, *args, **kwargs)

        monkeypatch.setattr(boogu_data.atomic, "open", refusing_open, raising=False)
    try:
        with pytest.raises(OutputError) as caught:
            convert_ocr(source, output)
    finally:
        output.chmod(0o700)
    assert caught.value.path == str(output / "train.parquet")
    assert f"permission denied, the folder {output} is not writable" in str(caught.value)
    assert list(output.iterdir()) == []


def test_disk_full_leaves_the_earlier_outputs_and_no_temporaries(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _ocr_input(tmp_path / "in", 'a "x"\nb "y"\n')
    output = tmp_path / "out"
    convert_ocr(source, output)
    before = {p.name: p.read_bytes() for p in output.iterdir()}
    writes = []
    real_write = RecordWriter.write

    def full(self: RecordWriter, record) -> None:
        writes.append(record)
        if len(writes) == 3:  # the first test row: train.parquet's temporary is complete by now
            raise OSError(errno.ENOSPC, "No space left on device")
        real_write(self, record)

    monkeypatch.setattr(RecordWriter, "write", full)
    with pytest.raises(OutputError, match="cannot write: no space left") as caught:
        convert_ocr(source, output)
    assert caught.value.path == str(output / "test.parquet")
    assert isinstance(caught.value.__cause__, OSError) and caught.value.__cause__.errno == errno.ENOSPC
    assert {p.name: p.read_bytes() for p in output.iterdir()} == before  # untouched, nothing added


def test_a_killed_conversion_leaves_a_temporary_the_next_one_removes(tmp_path: Path) -> None:
    source = _ocr_input(tmp_path / "in", 'a "x"\n')
    output = tmp_path / "out"
    # Killed at a named point (the first row write, after train.parquet's temporary exists).
    code = (
        "import os, signal, sys\n"
        "from boogu_data import convert\n"
        "class Killed(convert.RecordWriter):\n"
        "    def write(self, record):\n"
        "        os.kill(os.getpid(), signal.SIGKILL)\n"
        "convert.RecordWriter = Killed\n"
        "convert.convert_ocr(sys.argv[1], sys.argv[2])\n"
    )
    killed = subprocess.run(
        [sys.executable, "-c", code, str(source), str(output)], capture_output=True, timeout=120
    )
    assert killed.returncode == -signal.SIGKILL, killed.stderr.decode()
    left = leftovers(output)
    assert len(left) == 1 and left[0].startswith(".train.parquet.tmp-"), left

    report = convert_ocr(source, output)
    assert report.stale_removed == (output / left[0],)
    assert sorted(p.name for p in output.iterdir()) == ["test.parquet", "train.parquet"]
    assert convert_ocr(source, output).stale_removed == ()


def test_existing_outputs_are_replaced_and_reported(tmp_path: Path) -> None:
    source = _ocr_input(tmp_path / "in", 'a "x"\n')
    output = tmp_path / "out"
    output.mkdir()
    (output / "test.parquet").write_bytes(b"from an earlier run")
    report = convert_ocr(source, output)
    assert [(s.split, s.replaced) for s in report.splits] == [("train", False), ("test", True)]
    assert [r.ground_truth for r in read_records(output / "test.parquet")] == ["T"]
    assert [s.replaced for s in convert_ocr(source, output).splits] == [True, True]
    assert leftovers(output) == []
