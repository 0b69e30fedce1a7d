"""The README's config reference and learners' table are the ones the code generates, its demos'
ten-seed tables are the committed sweeps, and the README's commands are the CI's."""

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


@pytest.mark.parametrize(
    ("first_seed", "sweep"),
    [(300, "demo_seeds_stable"), (710, "edit_demo_partial_credit_seeds")],
    ids=["t2i-demo", "edit-demo"],
)
def test_readme_ten_seed_tables_are_the_committed_sweeps(first_seed, sweep):
    # The README's ten-seed tables of the two demos, cell by cell, and the interval quoted beside them
    # are the committed sweep's files (benchmarks/demo_seeds.py), not figures copied by hand.
    import json

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    start = readme.index(f"| seed | {first_seed} |")
    table = readme[start : readme.index("\n\n", start)].splitlines()
    rows = {line.split("|")[1].strip(): [c.strip() for c in line.split("|")[2:-1]] for line in table}
    results = ROOT / "benchmarks" / "results" / sweep
    summary = json.loads((results / "summary.json").read_text(encoding="utf-8"))
    assert [int(s) for s in rows["seed"]] == summary["seeds"] and len(summary["seeds"]) == 10
    for i, seed in enumerate(summary["seeds"]):
        heldout = json.loads((results / f"seed_{seed}" / "heldout.json").read_text(encoding="utf-8"))
        assert rows["base"][i] == f"{heldout['base']:.3f}", seed
        assert rows["trained"][i] == f"{heldout['trained']:.3f}", seed
        assert rows["difference (se)"][i] == f"{heldout['diff']:+.3f} ({heldout['se_diff']:.3f})", seed
    mean, interval = summary["mean_interval"].split(" ", 1)
    low, high = interval.strip("()").split(" to ")
    assert (
        f"{mean} (95% t interval {low} to {high})" in readme
        or f"{mean} (95% interval {low} to {high})" in readme
    )


def test_readme_head_to_head_table_is_the_committed_summary():
    # Issue 45: "Choosing an algorithm" follows the head-to-head's committed ten-seed summary, whatever
    # it says: its table and the design's reading are generated from the summary (tools/update_readme_config.py).
    import json
    import runpy

    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    summary = ROOT / "benchmarks" / "results" / "scenes" / "h2h" / "summary.json"
    if not summary.is_file():
        assert "<!-- head-to-head" not in readme, "a head-to-head table in the README without its summary"
        pytest.skip("the head-to-head's ten-seed summary is not committed yet (issue 45)")
    figures = json.loads(summary.read_text(encoding="utf-8"))
    assert figures["seed_list"] == list(range(500, 510)) and figures["regime"] == "v2"
    assert not figures["reading"]["interim"]
    tool = runpy.run_path(str(ROOT / "tools" / "update_readme_config.py"), run_name="update_readme_config")
    start = readme.index("<!-- head-to-head")
    body = readme[readme.index("\n", start) + 1 : readme.index("<!-- /head-to-head -->")]
    assert body.strip() == tool["head_to_head_markdown"]().strip(), (
        "regenerate with: uv run python tools/update_readme_config.py"
    )
