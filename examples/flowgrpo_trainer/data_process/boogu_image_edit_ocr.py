"""Convert an edit-OCR dataset to Boogu-Image edit (TI2I) parquet files.

    python examples/flowgrpo_trainer/data_process/boogu_image_edit_ocr.py \
        --input_dir ~/data/ocr_edit --output_dir ~/data/ocr_edit/boogu_image --image_size 512

Reads ``train.jsonl`` and ``test.jsonl`` (rows ``{"image": file, "instruction": ...,
"target_text"?: ...}``) and the files under ``images/``; references are letterboxed onto a white
``image_size`` square and stored as PNG. A thin wrapper over ``boogu_data.convert_edit_ocr``, the
same as ``boogu-data convert-edit-ocr``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from boogu_data import DatasetError, convert_edit_ocr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input_dir", type=Path, required=True, help="folder with {train,test}.jsonl and images/"
    )
    parser.add_argument("--output_dir", type=Path, required=True, help="output folder")
    parser.add_argument("--train_size", type=int, default=-1, help="keep the first N train rows (-1: all)")
    parser.add_argument("--val_size", type=int, default=-1, help="keep the first N test rows (-1: all)")
    parser.add_argument(
        "--image_size", type=int, default=512, help="square side, multiple of 16, at most 2048"
    )
    parser.add_argument("--skip_invalid", action="store_true", help="skip and count invalid lines")
    args = parser.parse_args()
    try:
        report = convert_edit_ocr(
            args.input_dir.expanduser(),
            args.output_dir.expanduser(),
            image_size=args.image_size,
            train_size=args.train_size,
            val_size=args.val_size,
            skip_invalid=args.skip_invalid,
        )
    except DatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    except ValueError as error:
        parser.error(str(error))
    for split in report.splits:
        print(f"{split.split}: {split.rows} rows -> {split.output} ({split.skipped} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
