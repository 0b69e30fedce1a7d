"""The ``boogu-data`` command: convert OCR inputs to Boogu parquet datasets and inspect datasets.

::

    boogu-data convert-ocr --input-dir ~/data/ocr --output-dir ~/data/ocr/boogu_image
    boogu-data convert-edit-ocr --input-dir ~/data/ocr_edit --output-dir ~/data/ocr_edit/boogu_image
    boogu-data inspect ~/data/ocr/boogu_image/train.parquet
    boogu-data scenes --output-dir ~/data/scenes --seed 0 --size 64 --count 2000

Exit status: 0 on success, 1 when the input is invalid (the message names file, line or row, and
column) or the output cannot be written (a file in the way, no permission, disk full, a non-empty
folder that is not an earlier output of the same command), 2 for a bad command line. Notes on stderr say when an existing output was replaced and when temporaries left by
a killed conversion were removed.
"""

from __future__ import annotations

import argparse
import io
import sys
import warnings
from collections.abc import Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from PIL import Image

from boogu_data.convert import DEFAULT_IMAGE_SIZE, ConversionReport, convert_edit_ocr, convert_ocr
from boogu_data.errors import DatasetError
from boogu_data.read import dataset_files, read_records
from boogu_data.record import PromptRecord
from boogu_data.scene_files import write_scenes
from boogu_data.scenes import DEFAULT_COUNTS, DEFAULT_SIZE, LAYOUTS, MAX_COUNT
from boogu_data.schema import SCHEMA_VERSION_KEY

__all__ = ["build_parser", "main"]


def build_parser() -> argparse.ArgumentParser:
    """The argument parser of ``boogu-data`` (both ``--input-dir`` and ``--input_dir`` spellings)."""
    parser = argparse.ArgumentParser(
        prog="boogu-data",
        description="Boogu-Image FlowGRPO datasets: convert OCR inputs, inspect parquet files.",
    )
    commands = parser.add_subparsers(dest="command", required=True, metavar="COMMAND")

    ocr = commands.add_parser(
        "convert-ocr",
        help="text-to-image OCR: {train,test}.txt -> {train,test}.parquet",
        description="One prompt per line; its first double-quoted span is the OCR ground truth.",
    )
    _add_io_arguments(ocr)

    edit = commands.add_parser(
        "convert-edit-ocr",
        help="edit OCR: {train,test}.jsonl + images/ -> {train,test}.parquet",
        description='Rows {"image": file under images/, "instruction": ..., "target_text"?: ...}; references '
        "are letterboxed onto a white square and stored as PNG.",
    )
    _add_io_arguments(edit)
    edit.add_argument(
        "--image-size",
        "--image_size",
        type=int,
        default=DEFAULT_IMAGE_SIZE,
        help="side of the square reference images: a multiple of 16, at most 2048 (default %(default)s)",
    )
    edit.add_argument(
        "--train-size", "--train_size", type=int, default=-1, help="keep the first N train rows (-1: all)"
    )
    edit.add_argument(
        "--val-size", "--val_size", type=int, default=-1, help="keep the first N test rows (-1: all)"
    )

    inspect = commands.add_parser(
        "inspect", help="print a parquet file's schema, row count, first rows and validation result"
    )
    inspect.add_argument("path", type=Path, metavar="FILE", help="a parquet file, or a folder of them")
    inspect.add_argument("--rows", type=int, default=3, help="rows to print (default %(default)s)")

    scenes = commands.add_parser(
        "scenes",
        help="procedural shape scenes with GenEval-style captions -> {train,val,test}.parquet + images/",
        description="Seeded scenes of 1-4 coloured shapes (boogu_data.scenes); val and test hold out "
        "colour-shape pairs (green square; blue triangle, yellow circle). The caption is the prompt, "
        "the scene spec (JSON) the ground truth, the rendered target images/<split>/<index>.png.",
    )
    scenes.add_argument(
        "--output-dir", "--output_dir", type=Path, required=True, help="a new or empty folder"
    )
    scenes.add_argument("--seed", type=int, default=0, help="seed of all three splits (default %(default)s)")
    scenes.add_argument(
        "--size",
        type=int,
        default=DEFAULT_SIZE,
        help="image side: a multiple of 16 from 32 (default %(default)s)",
    )
    for split, flag in (("train", "--count"), ("val", "--val-count"), ("test", "--test-count")):
        scenes.add_argument(
            flag,
            flag.replace("-count", "_count") if split != "train" else flag,
            dest=f"{split}_count",
            type=int,
            default=DEFAULT_COUNTS[split],
            help=f"{split} rows, from 1 to {MAX_COUNT} (default %(default)s)",
        )
    scenes.add_argument(
        "--layout",
        choices=LAYOUTS,
        default="free",
        help="free: objects anywhere; grid: on whole 8-unit cells, as the tiny model trains (default %(default)s)",
    )
    scenes.add_argument(
        "--edits",
        action="store_true",
        help="edit pairs instead (boogu_data.scene_edits): recolour / add / remove / move one shape; the "
        "reference image is the source scene, images/ the edited scenes",
    )
    scenes.add_argument("--no-images", action="store_true", help="write the parquet files only")
    scenes.add_argument(
        "--overwrite",
        action="store_true",
        help="replace an earlier `boogu-data scenes` output in --output-dir (only if every file in it, at "
        "any depth, is one that output wrote, unchanged)",
    )
    return parser


def _add_io_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--input-dir", "--input_dir", type=Path, required=True, help="folder holding the inputs"
    )
    parser.add_argument(
        "--output-dir",
        "--output_dir",
        type=Path,
        required=True,
        help="folder for train.parquet and test.parquet",
    )
    parser.add_argument(
        "--skip-invalid",
        "--skip_invalid",
        action="store_true",
        help="skip and count invalid lines instead of stopping at the first",
    )


def main(argv: Sequence[str] | None = None) -> int:
    """Run ``boogu-data`` with ``argv`` (default: the process arguments); return the exit status."""
    parser = build_parser()
    args = parser.parse_args(argv)
    try:
        if args.command == "convert-ocr":
            report = convert_ocr(
                args.input_dir.expanduser(), args.output_dir.expanduser(), skip_invalid=args.skip_invalid
            )
            _print_report(report)
        elif args.command == "convert-edit-ocr":
            try:
                report = convert_edit_ocr(
                    args.input_dir.expanduser(),
                    args.output_dir.expanduser(),
                    image_size=args.image_size,
                    train_size=args.train_size,
                    val_size=args.val_size,
                    skip_invalid=args.skip_invalid,
                )
            except DatasetError:
                raise
            except ValueError as error:  # argument ranges: a usage error, exit status 2
                parser.error(str(error))
            _print_report(report)
        elif args.command == "scenes":
            return _scenes(args)
        else:
            return _inspect(args.path.expanduser(), args.rows)
    except DatasetError as error:
        print(f"boogu-data: error: {error}", file=sys.stderr)
        return 1
    return 0


def _print_report(report: ConversionReport) -> None:
    for path in report.stale_removed:
        print(f"boogu-data: note: removed {path}, left behind by a killed conversion", file=sys.stderr)
    for split in report.splits:
        skipped = f", skipped {split.skipped} invalid lines" if split.skipped else ""
        if split.replaced:
            print(f"boogu-data: note: replaced existing {split.output}", file=sys.stderr)
        print(f"{split.split}: {split.rows} rows from {split.source} -> {split.output}{skipped}")
        for reason in split.skip_reasons:
            print(f"  skipped: {reason}")
        if split.skipped > len(split.skip_reasons):
            print(f"  ... and {split.skipped - len(split.skip_reasons)} more")


def _scenes(args: argparse.Namespace) -> int:
    try:
        report = write_scenes(
            args.output_dir,
            seed=args.seed,
            size=args.size,
            counts={"train": args.train_count, "val": args.val_count, "test": args.test_count},
            images=not args.no_images,
            overwrite=args.overwrite,
            layout=args.layout,
            edits=args.edits,
        )
    except DatasetError:
        raise
    except ValueError as error:  # argument ranges: a usage error, one line, exit status 2
        print(f"boogu-data scenes: error: {error}", file=sys.stderr)
        return 2
    for path in report.stale_removed:
        print(f"boogu-data: note: removed {path}, left behind by a killed run", file=sys.stderr)
    if report.replaced:
        print(f"boogu-data: note: replaced the earlier output in {report.output_dir}", file=sys.stderr)
    for split, rows in report.rows.items():
        images = f" + {report.output_dir / 'images' / split}/*.png" if report.images else ""
        what = "edit pairs" if args.edits else "scenes"
        print(f"{split}: {rows} {what} -> {report.output_dir / f'{split}.parquet'}{images}")
    return 0


def _inspect(path: Path, rows: int) -> int:
    status = 0
    for file in dataset_files(path):
        try:
            with pq.ParquetFile(file) as parquet:
                metadata = parquet.metadata
                schema = parquet.schema_arrow
        except (pa.ArrowException, OSError) as error:
            raise DatasetError(file, f"not a readable parquet file ({error})") from None
        version = (schema.metadata or {}).get(SCHEMA_VERSION_KEY)
        print(f"file: {file}")
        print(f"rows: {metadata.num_rows} in {metadata.num_row_groups} row group(s)")
        if version is None:
            print("layout: no boogu-data metadata (read as the reference integration's layout)")
        else:
            print(f"layout: boogu-data schema version {version.decode(errors='replace')}")
        print("schema:")
        for field in schema:
            print(f"  {field.name}: {field.type}")
        print(f"first {rows} rows:" if rows > 0 else "rows: (not shown)")
        count = 0
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            try:
                for record in read_records(file):
                    if count < rows:
                        print(_describe(count, record))
                    count += 1
                result = f"validation: OK, {count} rows"
            except DatasetError as error:
                result = f"validation: FAILED after {count} valid rows: {error}"
                status = 1
        for warning in caught:
            print(f"note: {warning.message}")
        print(result)
    return status


def _describe(row: int, record: PromptRecord) -> str:
    lines = [
        f"  [{row}] split={record.split!r} index={record.index} data_source={record.data_source!r} "
        f"ability={record.ability!r}",
        f"      instruction: {_clip(record.instruction)}",
        f"      negative: {_clip(record.negative)}",
        f"      ground_truth: {_clip(record.ground_truth)}",
    ]
    if record.ref_image is not None:
        with Image.open(io.BytesIO(record.ref_image)) as image:
            lines.append(
                f"      image: {image.width}x{image.height} {image.format}, {len(record.ref_image)} bytes"
            )
    return "\n".join(lines)


def _clip(text: str, limit: int = 100) -> str:
    shown = repr(text)
    return shown if len(shown) <= limit else shown[: limit - 3] + "..."


if __name__ == "__main__":
    sys.exit(main())
