"""Regenerate the README's generated parts: the config reference (from the config dataclasses' field
docstrings) and the learners' table (from ``boogu_trainer.config.algorithms.BUILTIN``).

uv run python tools/update_readme_config.py
"""

from __future__ import annotations

from pathlib import Path

from boogu_trainer.config import config_reference_markdown, learners_table_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
PARTS = {
    ("<!-- config-reference", "<!-- /config-reference -->"): config_reference_markdown,
    ("<!-- learners", "<!-- /learners -->"): learners_table_markdown,
}

text = README.read_text(encoding="utf-8")
for (start, end), generate in PARTS.items():
    begin = text.index("\n", text.index(start)) + 1
    stop = text.index(end)
    text = text[:begin] + generate() + "\n" + text[stop:]
README.write_text(text, encoding="utf-8")
print(f"updated {README}")
