"""Regenerate the README's generated parts: the config reference (from the config dataclasses' field
docstrings), the learners' table (from ``boogu_trainer.config.algorithms.BUILTIN``) and, once the
README has its markers, the head-to-head's table (from the committed
``benchmarks/results/scenes/h2h/summary.json``: ``algorithms_scenes.readme_markdown``).

uv run python tools/update_readme_config.py
"""

from __future__ import annotations

import json
import runpy
import sys
from pathlib import Path

from boogu_trainer.config import config_reference_markdown, learners_table_markdown

ROOT = Path(__file__).resolve().parents[1]
README = ROOT / "README.md"
HEAD_TO_HEAD = ROOT / "benchmarks" / "results" / "scenes" / "h2h" / "summary.json"


def head_to_head_markdown() -> str:
    """The head-to-head's README table from its committed summary (benchmarks/algorithms_scenes.py)."""
    sys.path.insert(0, str(ROOT / "benchmarks"))  # algorithms_scenes imports its sibling _common
    scenes = runpy.run_path(str(ROOT / "benchmarks" / "algorithms_scenes.py"), run_name="algorithms_scenes")
    return scenes["readme_markdown"](json.loads(HEAD_TO_HEAD.read_text(encoding="utf-8")))


PARTS = {
    ("<!-- config-reference", "<!-- /config-reference -->"): config_reference_markdown,
    ("<!-- learners", "<!-- /learners -->"): learners_table_markdown,
    ("<!-- head-to-head", "<!-- /head-to-head -->"): head_to_head_markdown,
}


def main() -> None:
    text = README.read_text(encoding="utf-8")
    for (start, end), generate in PARTS.items():
        if start == "<!-- head-to-head" and start not in text:
            continue  # the README gets the table when the ten-seed summary is committed (issue 45)
        begin = text.index("\n", text.index(start)) + 1
        stop = text.index(end)
        text = text[:begin] + generate() + "\n" + text[stop:]
    README.write_text(text, encoding="utf-8")
    print(f"updated {README}")


if __name__ == "__main__":
    main()
