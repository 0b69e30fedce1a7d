"""The `boogu-data` command, the example scripts, and the package's import footprint."""

from __future__ import annotations

import errno
import json
import os
import runpy
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
from PIL import Image

from boogu_data import PromptRecord, ReferenceLayoutWarning, read_records, temp_path, write_records
from boogu_data.cli import main
from boogu_data.write import RecordWriter
from tests.data.helpers import png, reference_edit_rows, write_reference

REPO_ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = REPO_ROOT / "examples" / "flowgrpo_trainer" / "data_process"


def _ocr_folder(folder: Path, train: str = 'a sign "A"\nb sign "B"\n') -> Path:
    folder.mkdir()
    (folder / "train.txt").write_text(train, encoding="utf-8")
    (folder / "test.txt").write_text('c sign "C"\n', encoding="utf-8")
    return folder


def _edit_folder(folder: Path) -> Path:
    (folder / "images").mkdir(parents=True)
    Image.new("RGB", (40, 20), (0, 0, 255)).save(folder / "images" / "0001.png")
    row = json.dumps({"image": "0001.png", "instruction": 'Change the text to "HI"'})
    (folder / "train.jsonl").write_text(row + "\n" + row + "\n")
    (folder / "test.jsonl").write_text(row + "\n")
    return folder


def test_convert_ocr_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _ocr_folder(tmp_path / "in")
    assert main(["convert-ocr", "--input-dir", str(source), "--output-dir", str(tmp_path / "out")]) == 0
    out = capsys.readouterr().out
    assert "train: 2 rows" in out and "test: 1 rows" in out
    assert [r.ground_truth for r in read_records(tmp_path / "out" / "train.parquet")] == ["A", "B"]


def test_convert_ocr_command_reports_invalid_input(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _ocr_folder(tmp_path / "in", 'fine "x"\nbroken\n')
    assert main(["convert-ocr", "--input_dir", str(source), "--output_dir", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err
    assert f"boogu-data: error: {source / 'train.txt'}, line 2: no double-quoted span" in err
    assert (
        main(
            ["convert-ocr", "--input-dir", str(source), "--output-dir", str(tmp_path / "o"), "--skip-invalid"]
        )
        == 0
    )
    out = capsys.readouterr().out
    assert "skipped 1 invalid lines" in out and "line 2: no double-quoted span" in out


def test_convert_commands_report_output_errors_without_a_traceback(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _ocr_folder(tmp_path / "in")
    output = tmp_path / "out"
    output.write_text("a file")
    assert main(["convert-ocr", "--input-dir", str(source), "--output-dir", str(output)]) == 1
    assert (
        capsys.readouterr().err
        == f"boogu-data: error: {output}: is a file, not a folder (expected a folder, or a path to create, for train.parquet and test.parquet)\n"
    )

    def full(self: RecordWriter, record: PromptRecord) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(RecordWriter, "write", full)
    edit = _edit_folder(tmp_path / "edit")
    argv = ["convert-edit-ocr", "--input-dir", str(edit), "--output-dir", str(tmp_path / "o")]
    assert main([*argv, "--image-size", "32"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(
        f"boogu-data: error: {tmp_path / 'o' / 'train.parquet'}: cannot write: no space left"
    )
    assert list((tmp_path / "o").iterdir()) == []


def test_convert_notes_replaced_outputs_and_removed_temporaries(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    source = _ocr_folder(tmp_path / "in")
    output = tmp_path / "out"
    argv = ["convert-ocr", "--input-dir", str(source), "--output-dir", str(output)]
    assert main(argv) == 0
    assert "note:" not in capsys.readouterr().err
    # What a killed conversion leaves (a temp_path name whose pid is gone), and a live one's.
    dead = subprocess.Popen(["true"])
    dead.wait()
    live = subprocess.Popen(["sleep", "30"])
    try:
        ours = f"-{os.getpid()}-"
        stale = output / temp_path(output / "train.parquet").name.replace(ours, f"-{dead.pid}-")
        busy = output / temp_path(output / "test.parquet").name.replace(ours, f"-{live.pid}-")
        stale.write_bytes(b"half a parquet file")
        busy.write_bytes(b"being written")
        assert main(argv) == 0
        assert busy.exists() and not stale.exists()
    finally:
        live.kill()
        live.wait()
    err = capsys.readouterr().err.splitlines()
    assert err == [
        f"boogu-data: note: removed {stale}, left behind by a killed conversion",
        f"boogu-data: note: replaced existing {output / 'train.parquet'}",
        f"boogu-data: note: replaced existing {output / 'test.parquet'}",
    ]


def test_convert_edit_ocr_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    source = _edit_folder(tmp_path / "in")
    argv = ["convert-edit-ocr", "--input-dir", str(source), "--output-dir", str(tmp_path / "out")]
    assert main([*argv, "--image-size", "32", "--train-size", "1"]) == 0
    assert "train: 1 rows" in capsys.readouterr().out
    with pytest.raises(SystemExit) as caught:
        main([*argv, "--image-size", "100"])
    assert caught.value.code == 2
    assert "image_size must be a positive multiple of 16" in capsys.readouterr().err


def test_inspect_prints_schema_rows_and_validation(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "x.parquet"
    write_records([PromptRecord(f'sign "{i}"', ground_truth=str(i), index=i) for i in range(5)], path)
    assert main(["inspect", str(path), "--rows", "2"]) == 0
    out = capsys.readouterr().out
    assert "rows: 5 in 1 row group(s)" in out
    assert "layout: boogu-data schema version 1" in out
    assert "prompt: list<element: struct<role: string, content: string>>" in out
    assert "ground_truth: '1'" in out and "ground_truth: '2'" not in out
    assert "validation: OK, 5 rows" in out


def test_inspect_reference_edit_file_and_a_broken_one(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    good = write_reference(reference_edit_rows([('x "y"', "y", png())]), tmp_path / "good.parquet", edit=True)
    assert main(["inspect", str(good)]) == 0
    out = capsys.readouterr().out
    assert "reference integration's layout" in out
    assert "image: 32x32 PNG" in out
    assert "note:" in out and "Picture 1: " in out
    rows = reference_edit_rows([('x "y"', "y", png()), ('x "z"', "z", png(24, 32))])
    bad = write_reference(rows, tmp_path / "bad.parquet", edit=True)
    assert main(["inspect", str(bad)]) == 1
    out = capsys.readouterr().out
    assert f"validation: FAILED after 1 valid rows: {bad}, row 1, column 'images'" in out


def test_example_scripts_call_the_library(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    source = _ocr_folder(tmp_path / "ocr")
    script = EXAMPLES / "boogu_image_ocr.py"
    monkeypatch.setattr(
        sys, "argv", [str(script), "--input_dir", str(source), "--output_dir", str(tmp_path / "o1")]
    )
    with pytest.raises(SystemExit) as caught:
        runpy.run_path(str(script), run_name="__main__")
    assert caught.value.code == 0
    assert len(list(read_records(tmp_path / "o1" / "test.parquet"))) == 1

    source = _edit_folder(tmp_path / "edit")
    script = EXAMPLES / "boogu_image_edit_ocr.py"
    argv = [
        str(script),
        "--input_dir",
        str(source),
        "--output_dir",
        str(tmp_path / "o2"),
        "--image_size",
        "32",
    ]
    monkeypatch.setattr(sys, "argv", argv)
    with pytest.raises(SystemExit) as caught:
        runpy.run_path(str(script), run_name="__main__")
    assert caught.value.code == 0
    with warnings.catch_warnings():
        warnings.simplefilter("error", ReferenceLayoutWarning)  # our own files carry no "Picture 1: "
        assert [r.ground_truth for r in read_records(tmp_path / "o2" / "train.parquet")] == ["HI", "HI"]


def test_import_pulls_in_no_torch() -> None:
    # A fresh interpreter: this test process may already hold torch from other packages' tests.
    code = (
        "import sys, boogu_data, boogu_data.cli, boogu_data.convert;"
        "heavy = sorted(m for m in ('torch', 'transformers', 'diffusers', 'peft') if m in sys.modules);"
        "print(','.join(heavy))"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60
    )
    assert result.stdout.strip() == ""
