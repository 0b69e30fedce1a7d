"""Regenerate the README's config reference from the config dataclasses' field docstrings.

uv run python tools/update_readme_config.py
"""

from __future__ import annotations

from pathlib import Path

from boogu_trainer.config import config_reference_markdown

README = Path(__file__).resolve().parents[1] / "README.md"
START, END = "<!-- config-reference", "<!-- /config-reference -->"

text = README.read_text(encoding="utf-8")
begin = text.index("\n", text.index(START)) + 1
end = text.index(END)
README.write_text(text[:begin] + config_reference_markdown() + "\n" + text[end:], encoding="utf-8")
print(f"updated {README}")
