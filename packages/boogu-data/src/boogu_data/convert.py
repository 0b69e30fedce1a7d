"""Converters from the Flow-GRPO OCR inputs to Boogu parquet datasets.

* :func:`convert_ocr` (text-to-image): ``train.txt`` and ``test.txt``, one prompt per line, whose
  first double-quoted span is the text the image must show (the OCR ground truth).
* :func:`convert_edit_ocr` (edit): ``train.jsonl`` and ``test.jsonl`` rows
  ``{"image": file, "instruction": ..., "target_text"?: ...}`` with the files under ``images/``.

Both write ``train.parquet`` and ``test.parquet`` into the output folder and share these properties:

* Streaming: inputs are read a line at a time and written a row group at a time, so memory does not
  grow with the input.
* Deterministic: the same input gives byte-identical parquet files (row order is line order, row
  ``index`` counts the rows written per split).
* Atomic: both outputs are written under hidden temporary names in the output folder and renamed
  only once both are complete; on any failure neither appears and no temporary file remains. An
  existing output is replaced this way (the report says so), and temporaries that a killed
  conversion left in the output folder are removed first (the report lists them).
* Clear errors: a bad line is a :class:`DatasetError` naming the input file and 1-based line (and
  the JSON key). With ``skip_invalid=True`` bad lines are skipped and counted instead. An output
  folder that is a file or not writable, or a full disk, is an :class:`OutputError` naming the path.

The output layout is the reference integration's (docs/reference-integration.md §5), minus its
``"Picture 1: "`` prefix, with ``data_source`` ``"flow_grpo/ocr"`` / ``"flow_grpo/ocr_edit"`` and
ability ``"ocr"`` / ``"image_edit"``.
"""

from __future__ import annotations

import errno
import json
import os
import warnings
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from PIL import Image

from boogu_data.atomic import AtomicOutputs, remove_stale
from boogu_data.errors import DatasetError, OutputError
from boogu_data.images import MAX_IMAGE_PIXELS, SIZE_MULTIPLE, letterbox_png
from boogu_data.record import DatasetKind, PromptRecord
from boogu_data.write import RecordWriter

__all__ = [
    "EDIT_OCR_ABILITY",
    "EDIT_OCR_DATA_SOURCE",
    "OCR_ABILITY",
    "OCR_DATA_SOURCE",
    "SPLITS",
    "ConversionReport",
    "SplitReport",
    "convert_edit_ocr",
    "convert_ocr",
    "first_quoted_span",
]

OCR_DATA_SOURCE: Final[str] = "flow_grpo/ocr"
OCR_ABILITY: Final[str] = "ocr"
EDIT_OCR_DATA_SOURCE: Final[str] = "flow_grpo/ocr_edit"
EDIT_OCR_ABILITY: Final[str] = "image_edit"
SPLITS: Final[tuple[str, str]] = ("train", "test")
"""Input splits, each written to ``<split>.parquet``."""
DEFAULT_IMAGE_SIZE: Final[int] = 512
_MAX_SKIP_EXAMPLES: Final[int] = 10


@dataclass(frozen=True, slots=True)
class SplitReport:
    """What a converter did with one split."""

    split: str
    """``"train"`` or ``"test"``."""
    source: Path
    """The input file."""
    output: Path
    """The parquet file written."""
    rows: int
    """Rows written."""
    skipped: int
    """Invalid lines skipped (only with ``skip_invalid``)."""
    skip_reasons: tuple[str, ...]
    """The error messages of the first few skipped lines."""
    replaced: bool = False
    """Whether a file already at ``output`` was replaced (atomically)."""


@dataclass(frozen=True, slots=True)
class ConversionReport:
    """What a converter did, split by split."""

    splits: tuple[SplitReport, ...]
    """One report per split, in :data:`SPLITS` order."""
    stale_removed: tuple[Path, ...] = ()
    """Temporaries of killed writers found in the output folder and removed before writing."""

    @property
    def rows(self) -> int:
        """Rows written over all splits."""
        return sum(split.rows for split in self.splits)

    @property
    def skipped(self) -> int:
        """Lines skipped over all splits."""
        return sum(split.skipped for split in self.splits)


def first_quoted_span(text: str) -> str | None:
    """The text between the first two ASCII double quotes of ``text``, or None without a pair.

    For well-formed prompts this equals the reference's ``text.split('"')[1]``; unlike it, an
    unclosed quote is not a span.
    """
    start = text.find('"')
    if start < 0:
        return None
    end = text.find('"', start + 1)
    return None if end < 0 else text[start + 1 : end]


# --------------------------------------------------------------------------- text-to-image OCR


def convert_ocr(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    skip_invalid: bool = False,
) -> ConversionReport:
    """Convert ``input_dir/{train,test}.txt`` to ``output_dir/{train,test}.parquet`` (T2I rows).

    Each non-empty line is one prompt, used verbatim as the instruction (only its line ending is
    removed); its first double-quoted span is the ground truth. The negative is upstream's default
    ``""``.

    Raises:
        DatasetError: an input file is missing or has no valid line, or (without ``skip_invalid``) a
            line is empty, has no non-empty double-quoted span, is not UTF-8, or contains the
            ``<image>`` placeholder.
        OutputError: ``output_dir`` is a file or not writable, or the disk is full (no output and
            no temporary file is left behind).
    """
    input_dir = Path(input_dir)
    plan = [(split, input_dir / f"{split}.txt", None) for split in SPLITS]

    def parse(source: Path, split: str, line: int, text: str, index: int) -> PromptRecord:
        if text.strip() == "":
            raise DatasetError(source, "empty line", line=line, expected="one prompt per line")
        span = first_quoted_span(text)
        if not span:
            problem = "the double-quoted span is empty" if span == "" else "no double-quoted span"
            raise DatasetError(
                source,
                problem,
                line=line,
                expected='a prompt quoting the text to render, e.g. a sign that says "OPEN"',
            )
        return _record(
            source,
            line,
            instruction=text,
            ground_truth=span,
            data_source=OCR_DATA_SOURCE,
            ability=OCR_ABILITY,
            split=split,
            index=index,
        )

    return _convert(plan, Path(output_dir), "t2i", parse, skip_invalid)


# --------------------------------------------------------------------------- edit OCR


def convert_edit_ocr(
    input_dir: str | os.PathLike[str],
    output_dir: str | os.PathLike[str],
    *,
    image_size: int = DEFAULT_IMAGE_SIZE,
    train_size: int | None = None,
    val_size: int | None = None,
    skip_invalid: bool = False,
) -> ConversionReport:
    """Convert ``input_dir/{train,test}.jsonl`` plus ``input_dir/images/`` to edit parquet files.

    Each JSON line is ``{"image": <file under images/>, "instruction": <edit text>,
    "target_text": <optional>}``; the ground truth is ``target_text`` when given, otherwise the
    instruction's first double-quoted span. Each reference image is fitted onto a white
    ``image_size``×``image_size`` square (centred, LANCZOS, EXIF orientation applied) and stored as
    PNG bytes. The negative is ``""``.

    Args:
        image_size: side of the square references; a multiple of 16, at most 2048.
        train_size: keep only the first N valid rows of ``train.jsonl`` (None or -1: all).
        val_size: the same for ``test.jsonl``.
        skip_invalid: skip and count bad lines instead of stopping at the first.

    Raises:
        ValueError: ``image_size``, ``train_size`` or ``val_size`` is out of range.
        DatasetError: an input file or ``images/`` is missing, or (without ``skip_invalid``) a line
            is not a JSON object with the expected keys, names an image outside ``images/`` or a
            missing or undecodable file, or has no ground truth.
        OutputError: ``output_dir`` is a file or not writable, or the disk is full (no output and
            no temporary file is left behind).
    """
    if isinstance(image_size, bool) or not isinstance(image_size, int):
        raise ValueError(f"image_size must be an int, got {image_size!r}")
    if image_size <= 0 or image_size % SIZE_MULTIPLE or image_size * image_size > MAX_IMAGE_PIXELS:
        raise ValueError(
            f"image_size must be a positive multiple of {SIZE_MULTIPLE} up to 2048, got {image_size}"
        )
    limits = {"train": _limit("train_size", train_size), "test": _limit("val_size", val_size)}
    input_dir = Path(input_dir)
    images_dir = input_dir / "images"
    if not images_dir.is_dir():
        raise DatasetError(
            images_dir, "missing folder", expected="the reference images under <input_dir>/images/"
        )
    plan = [(split, input_dir / f"{split}.jsonl", limits[split]) for split in SPLITS]

    def parse(source: Path, split: str, line: int, text: str, index: int) -> PromptRecord:
        def fail(problem: str, column: str | None = None, expected: str | None = None) -> DatasetError:
            return DatasetError(source, problem, line=line, column=column, expected=expected)

        try:
            row = json.loads(text)
        except json.JSONDecodeError as error:
            raise fail(f"not valid JSON ({error.msg} at character {error.pos + 1})") from None
        if not isinstance(row, dict):
            raise fail(f"the line is a JSON {type(row).__name__}", expected="a JSON object per line")
        image_name = row.get("image")
        if not isinstance(image_name, str) or not image_name:
            raise fail(f"value is {image_name!r}", "image", "the image's file name under images/")
        instruction = row.get("instruction")
        if not isinstance(instruction, str) or not instruction.strip():
            raise fail(f"value is {instruction!r}", "instruction", "a non-empty string")
        target_text = row.get("target_text")
        if target_text is None:
            target_text = first_quoted_span(instruction)
            if not target_text:
                raise fail(
                    "no target_text and no non-empty double-quoted span in the instruction",
                    "target_text",
                    'a "target_text" key, or the text to render in double quotes in the instruction',
                )
        elif not isinstance(target_text, str) or not target_text:
            raise fail(f"value is {target_text!r}", "target_text", "a non-empty string")
        image_path = _inside(images_dir, image_name)
        if image_path is None:
            raise fail(f"{image_name!r} points outside {images_dir}", "image", "a path inside images/")
        if not image_path.is_file():
            raise fail(f"image file {image_path} does not exist", "image")
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error", Image.DecompressionBombWarning)
                with Image.open(image_path) as image:
                    png = letterbox_png(image, image_size)
        except (
            OSError,
            SyntaxError,
            ValueError,
            Image.DecompressionBombWarning,
            Image.DecompressionBombError,
        ) as error:
            raise fail(f"cannot decode {image_path} ({type(error).__name__}: {error})", "image") from None
        return _record(
            source,
            line,
            instruction=instruction,
            ground_truth=target_text,
            data_source=EDIT_OCR_DATA_SOURCE,
            ability=EDIT_OCR_ABILITY,
            ref_image=png,
            split=split,
            index=index,
        )

    return _convert(plan, Path(output_dir), "edit", parse, skip_invalid)


def _limit(name: str, value: int | None) -> int | None:
    # The reference scripts use -1 for "all rows"; None means the same here.
    if value is None or value == -1:
        return None
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(f"{name} must be -1 (all rows) or a positive int, got {value!r}")
    return value


def _inside(folder: Path, name: str) -> Path | None:
    """``folder/name`` when ``name`` stays inside ``folder`` lexically, else None.

    Checked on the path text, before anything is opened: absolute names and ``..`` that climb out
    are refused. Symlinks inside the folder are followed as the user laid them out.
    """
    if os.path.isabs(name) or name.startswith(("/", "\\")):
        return None
    root = os.path.normpath(folder)
    joined = os.path.normpath(os.path.join(root, name))
    if joined == root or os.path.commonpath([root, joined]) != root:
        return None
    return Path(joined)


# --------------------------------------------------------------------------- shared machinery

_Parse = Callable[[Path, str, int, str, int], PromptRecord]  # (source, split, line, text, index)


def _record(source: Path, line: int, **fields: object) -> PromptRecord:
    try:
        return PromptRecord(**fields)  # type: ignore[arg-type]
    except (TypeError, ValueError) as error:
        raise DatasetError(source, str(error), line=line) from None


def _lines(source: Path) -> Iterator[tuple[int, str | DatasetError]]:
    """``(line number, text)`` per line, without line endings; a DatasetError for non-UTF-8 lines."""
    with open(source, "rb") as handle:
        for number, raw in enumerate(handle, start=1):
            raw = raw.removesuffix(b"\n").removesuffix(b"\r")
            if number == 1:
                raw = raw.removeprefix(b"\xef\xbb\xbf")  # a UTF-8 byte-order mark is not prompt text
            try:
                yield number, raw.decode("utf-8")
            except UnicodeDecodeError as error:
                yield (
                    number,
                    DatasetError(
                        source, f"not valid UTF-8 (byte {error.start + 1}: {error.reason})", line=number
                    ),
                )


def _convert(
    plan: list[tuple[str, Path, int | None]],
    output_dir: Path,
    kind: DatasetKind,
    parse: _Parse,
    skip_invalid: bool,
) -> ConversionReport:
    # Every input must exist before anything is created in the output folder.
    for _, source, _ in plan:
        if not source.is_file():
            raise DatasetError(
                source,
                "missing input file",
                expected=f"{' and '.join(s.name for _, s, _ in plan)} in {source.parent}",
            )
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputError(
            output_dir,
            "is a file, not a folder",
            expected="a folder, or a path to create, for train.parquet and test.parquet",
        )
    try:
        # Hidden temporaries of conversions that were killed (their pid is gone); live ones stay.
        stale = tuple(remove_stale(output_dir))
    except OSError as error:
        raise _output_error(output_dir, error) from error
    reports = []
    with AtomicOutputs() as outputs:
        for split, source, limit in plan:
            output = output_dir / f"{split}.parquet"
            replaced = os.path.lexists(output)
            try:
                writer = RecordWriter(outputs.reserve(output), kind, check_images=False)
            except OSError as error:
                raise _output_error(output, error) from error
            skipped, reasons = 0, []
            try:
                for line, text in _lines(source):
                    # The row index counts written rows, as in the reference converters.
                    index = writer.rows_written + writer.rows_buffered
                    if index == limit:
                        break
                    try:
                        if isinstance(text, DatasetError):
                            raise text
                        record = parse(source, split, line, text, index)
                    except DatasetError as error:
                        if not skip_invalid:
                            raise
                        skipped += 1
                        if len(reasons) < _MAX_SKIP_EXAMPLES:
                            reasons.append(str(error))
                        continue
                    try:
                        writer.write(record)
                    except OSError as error:
                        raise _output_error(output, error) from error
                try:
                    writer.close()
                except OSError as error:
                    raise _output_error(output, error) from error
            except BaseException:
                writer.discard()
                raise
            if writer.rows_written == 0:
                raise DatasetError(
                    source,
                    "no valid rows" + (f" ({skipped} invalid lines skipped)" if skipped else ""),
                    expected="at least one row per split",
                )
            reports.append(
                SplitReport(split, source, output, writer.rows_written, skipped, tuple(reasons), replaced)
            )
        try:
            outputs.commit()
        except OSError as error:
            raise _output_error(output_dir, error) from error
    return ConversionReport(tuple(reports), stale)


def _output_error(path: Path, error: OSError) -> OutputError:
    """An :class:`OutputError` naming ``path`` (the output folder or file) and what the OS refused."""
    detail = error.strerror or str(error)
    if error.errno in (errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)):
        problem = f"cannot write: no space left ({detail}); the partial output was removed"
    elif isinstance(error, PermissionError):
        # The refused name is the folder being created or the temporary being created in a folder:
        # either way its parent is the folder that is not writable.
        named = error.filename
        folder = Path(os.fsdecode(named)).parent if isinstance(named, (str, bytes, os.PathLike)) else path
        problem = f"cannot write: permission denied, the folder {folder} is not writable"
    elif error.errno == errno.EROFS:
        problem = "cannot write: the file system is read-only"
    elif isinstance(error, IsADirectoryError):
        problem = "is a folder, not a file; remove it or choose another output folder"
    elif isinstance(error, (NotADirectoryError, FileExistsError)):
        problem = "cannot create the folder: part of the path is a file, not a folder"
    else:
        problem = f"cannot write ({type(error).__name__}: {detail})"
    return OutputError(path, problem)
