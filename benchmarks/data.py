"""Throughput and peak memory of the boogu-data converters (and of reading the result back).

Builds OCR inputs of two sizes (N/10 and N prompts, default N = 100,000; the test split holds 1% on
top), converts each in a fresh child process, and prints rows/s and the child's peak RSS. Peak RSS
that stays flat from N/10 to N shows the conversion streams. Targets for N = 100,000: under 10 s
and under 200 MB peak. A small edit-OCR conversion (letterboxing and PNG encoding) is timed too.

    uv run python benchmarks/data.py [--rows 100000] [--edit-rows 200] [--json out.json]

Prompts are the 300 real ones from ../shared/data/ocr/prompts.txt when present (cycled, each line
numbered so no two are equal), otherwise synthetic ones.
"""

from __future__ import annotations

import argparse
import json
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

SHARED_PROMPTS = Path(__file__).resolve().parents[1].parent / "shared" / "data" / "ocr" / "prompts.txt"


def _prompts() -> list[str]:
    if SHARED_PROMPTS.is_file():
        return SHARED_PROMPTS.read_text(encoding="utf-8").splitlines()
    return [f'A storefront sign that says "Shop {i}" under warm evening light' for i in range(300)]


def _write_ocr_input(folder: Path, rows: int) -> None:
    base = _prompts()
    folder.mkdir(parents=True)
    for name, count in (("train.txt", rows), ("test.txt", max(1, rows // 100))):
        with open(folder / name, "w", encoding="utf-8") as handle:
            for i in range(count):
                handle.write(f"{base[i % len(base)]} (variant {i})\n")


def _write_edit_input(folder: Path, rows: int) -> None:
    from PIL import Image, ImageDraw

    (folder / "images").mkdir(parents=True)
    with open(folder / "train.jsonl", "w") as train, open(folder / "test.jsonl", "w") as test:
        for i in range(rows):
            image = Image.new("RGB", (640, 480), (i * 7 % 256, 90, 160))
            ImageDraw.Draw(image).text((40, 200), f"SIGN {i}", fill=(255, 255, 255))
            image.save(folder / "images" / f"{i:05d}.jpg", quality=90)
            row = json.dumps({"image": f"{i:05d}.jpg", "instruction": f'Change the text to "OPEN {i}"'})
            (test if i % 10 == 9 else train).write(row + "\n")


def _peak_rss_mb() -> float:
    """This process's peak resident memory in MB.

    Linux's VmHWM belongs to the current program image; ``ru_maxrss`` is not used there because it
    carries over the parent's size at fork, which would blur a child's figure.
    """
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return round(int(line.split()[1]) / 1024, 1)
    except OSError:
        pass
    return round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1)


def _child(kind: str, source: str, output: str) -> None:
    """Run in a fresh process: one conversion and a full read, figures as JSON on stdout."""
    import boogu_data

    baseline_mb = _peak_rss_mb()
    start = time.perf_counter()
    if kind == "ocr":
        report = boogu_data.convert_ocr(source, output)
    else:
        report = boogu_data.convert_edit_ocr(source, output, image_size=512)
    convert_s = time.perf_counter() - start
    figures = {
        "rows": report.rows,
        "convert_s": round(convert_s, 3),
        "convert_rows_per_s": round(report.rows / convert_s),
        "baseline_rss_mb": baseline_mb,
        "peak_rss_convert_mb": _peak_rss_mb(),
    }
    start = time.perf_counter()
    count = sum(1 for _ in boogu_data.read_records(output))
    read_s = time.perf_counter() - start
    figures.update(read_rows_per_s=round(count / read_s), read_s=round(read_s, 3))
    figures["peak_rss_mb"] = _peak_rss_mb()
    figures["output_mb"] = round(sum(p.stat().st_size for p in Path(output).glob("*.parquet")) / 2**20, 2)
    print(json.dumps(figures))


def _run_child(kind: str, source: Path, output: Path) -> dict:
    result = subprocess.run(
        [sys.executable, __file__, "--child", kind, str(source), str(output)],
        capture_output=True,
        text=True,
        check=True,
    )
    return json.loads(result.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", type=int, default=100_000, help="prompts in the large OCR train split")
    parser.add_argument("--edit-rows", type=int, default=200, help="rows of the edit benchmark (0: skip)")
    parser.add_argument("--json", help="also write the figures to this JSON file")
    parser.add_argument("--child", nargs=3, metavar=("KIND", "SOURCE", "OUTPUT"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(*args.child)
        return

    results: dict[str, dict] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for rows in (args.rows // 10, args.rows):
            source = Path(tmp) / f"ocr_{rows}"
            _write_ocr_input(source, rows)
            figures = _run_child("ocr", source, Path(tmp) / f"out_{rows}")
            results[f"ocr_{rows}"] = figures
            print(
                f"ocr  {figures['rows']:>7} rows: convert {figures['convert_s']:6.2f} s "
                f"({figures['convert_rows_per_s']:>7} rows/s), peak RSS {figures['peak_rss_convert_mb']:6.1f} MB "
                f"(after imports {figures['baseline_rss_mb']:.1f} MB); read back {figures['read_rows_per_s']:>7} "
                f"rows/s, peak RSS {figures['peak_rss_mb']:6.1f} MB; output {figures['output_mb']} MB"
            )
        if args.edit_rows > 0:
            source = Path(tmp) / "edit"
            _write_edit_input(source, args.edit_rows)
            figures = _run_child("edit", source, Path(tmp) / "out_edit")
            results[f"edit_{args.edit_rows}"] = figures
            print(
                f"edit {figures['rows']:>7} rows: convert {figures['convert_s']:6.2f} s "
                f"({figures['convert_rows_per_s']:>7} rows/s, 640x480 JPEG -> 512² PNG), peak RSS "
                f"{figures['peak_rss_convert_mb']:6.1f} MB; read back {figures['read_rows_per_s']:>7} rows/s, "
                f"peak RSS {figures['peak_rss_mb']:6.1f} MB; output {figures['output_mb']} MB"
            )
    large = results[f"ocr_{args.rows}"]
    results["targets"] = {
        "rows": args.rows,
        "convert_under_10_s": large["convert_s"] < 10,
        "peak_rss_under_200_mb": large["peak_rss_convert_mb"] < 200,
    }
    print(json.dumps(results, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
