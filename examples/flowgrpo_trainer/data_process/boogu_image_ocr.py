"""Convert the Flow-GRPO OCR prompts to Boogu-Image text-to-image parquet files.

    python examples/flowgrpo_trainer/data_process/boogu_image_ocr.py \
        --input_dir ~/data/ocr --output_dir ~/data/ocr/boogu_image

Reads ``train.txt`` and ``test.txt`` (one prompt per line, the first double-quoted span is the OCR
ground truth) and writes ``train.parquet`` and ``test.parquet``. A thin wrapper over
``boogu_data.convert_ocr``, the same as ``boogu-data convert-ocr``.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from boogu_data import DatasetError, convert_ocr


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--input_dir", type=Path, default=Path("~/data/ocr"), help="folder with train.txt, test.txt"
    )
    parser.add_argument(
        "--output_dir", type=Path, default=Path("~/data/ocr/boogu_image"), help="output folder"
    )
    parser.add_argument("--skip_invalid", action="store_true", help="skip and count invalid lines")
    args = parser.parse_args()
    try:
        report = convert_ocr(
            args.input_dir.expanduser(), args.output_dir.expanduser(), skip_invalid=args.skip_invalid
        )
    except DatasetError as error:
        print(f"error: {error}", file=sys.stderr)
        return 1
    for split in report.splits:
        print(f"{split.split}: {split.rows} rows -> {split.output} ({split.skipped} skipped)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
