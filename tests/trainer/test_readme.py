"""The README's config reference and learners' table are the ones the code generates, and the README's
commands are the CI's."""

from __future__ import annotations

from pathlib import Path

import pytest

from boogu_trainer.config import config_reference_markdown, learners_table_markdown

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize(
    ("part", "generate"),
    [("config-reference", config_reference_markdown), ("learners", learners_table_markdown)],
)
def test_readme_generated_parts_are_current(part, generate):
    # The config reference (field docstrings) and the learners' table (config.algorithms.BUILTIN).
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index(f"<!-- {part}")
    body = readme[readme.index("\n", start) + 1 : readme.index(f"<!-- /{part} -->")]
    assert body.strip() == generate().strip(), "regenerate with: uv run python tools/update_readme_config.py"


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "uv run trainer " in readme and "uv run pytest " in readme
    assert "\nuv run pytest\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
