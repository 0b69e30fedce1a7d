"""The config reference: every key's type, default and docstring, as rows and as a Markdown table.

The table is the README's (between its ``<!-- config-reference`` markers; tests/trainer/test_readme.py
checks it is current, ``uv run python tools/update_readme_config.py`` rewrites it) and
``trainer --config-reference``'s; ``trainer --help`` lists the keys from `describe`.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import itertools
import json
import textwrap

from boogu_trainer.config.fields import field_default, field_hints, plain, type_name
from boogu_trainer.config.sections import TrainerConfig


def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it in the class body (or in the body of the
    dataclass base that declares it: `AlgorithmConfig`'s first fields are `LearnerChoice`'s)."""
    docs: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if base is not cls and dataclasses.is_dataclass(base):
            docs.update(field_docs(base))
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):
        return docs
    body = ast.parse(source).body[0].body  # type: ignore[attr-defined]
    for node, nxt in itertools.pairwise(body):
        if (
            isinstance(node, ast.AnnAssign)
            and isinstance(node.target, ast.Name)
            and isinstance(nxt, ast.Expr)
            and isinstance(nxt.value, ast.Constant)
            and isinstance(nxt.value.value, str)
        ):
            docs[node.target.id] = " ".join(nxt.value.value.split())
    return docs


def describe(cls: type | None = None, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """Rows ``(dotted key, type, default as JSON, doc)`` of every field of ``cls`` (default
    `TrainerConfig`), depth first; a section's row has type ``"section"``."""
    cls = TrainerConfig if cls is None else cls
    rows = []
    docs = field_docs(cls)
    for f in dataclasses.fields(cls):
        key = f"{prefix}{f.name}"
        tp = field_hints(cls)[f.name]
        if dataclasses.is_dataclass(tp):
            rows.append((key, "section", "", docs.get(f.name, "")))
            rows.extend(describe(tp, f"{key}."))  # type: ignore[arg-type]
            continue
        rows.append((key, type_name(tp), json.dumps(plain(field_default(f))), docs.get(f.name, "")))
    return rows


def config_reference_markdown() -> str:
    """The config reference table (for ``--help`` and the README), from the field docstrings."""
    lines = ["| key | type | default | meaning |", "|---|---|---|---|"]
    for key, tp, default, doc in describe():
        doc = doc.replace("|", "\\|")  # a bare | would end the table cell
        if tp == "section":
            lines.append(f"| **`{key}`** | | | {doc} |")
        else:
            bar = "\\|"
            lines.append(f"| `{key}` | {tp.replace('|', bar)} | `{default.replace('|', bar)}` | {doc} |")
    return "\n".join(lines)
