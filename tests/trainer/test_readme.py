"""The README's config reference and learners' table are the ones the code generates, and the README's
commands are the CI's."""

from __future__ import annotations

from pathlib import Path

from boogu_trainer.config import config_reference_markdown, learners_table_markdown

ROOT = Path(__file__).resolve().parents[2]


def test_readme_config_reference_is_current():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("<!-- config-reference")
    body = readme[readme.index("\n", start) + 1 : readme.index("<!-- /config-reference -->")]
    assert body.strip() == config_reference_markdown().strip(), (
        "regenerate with: uv run python tools/update_readme_config.py"
    )


def test_readme_learners_table_is_generated_from_the_one_list():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index("<!-- learners")
    body = readme[readme.index("\n", start) + 1 : readme.index("<!-- /learners -->")]
    assert body.strip() == learners_table_markdown().strip(), (
        "regenerate with: uv run python tools/update_readme_config.py"
    )


def test_ci_runs_the_readme_test_command():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert "uv run trainer " in readme and "uv run pytest " in readme
    assert "\nuv run pytest\n" in (ROOT / ".ci" / "run").read_text(encoding="utf-8")
