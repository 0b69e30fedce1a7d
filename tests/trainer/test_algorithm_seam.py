"""The algorithm seam: outside ``boogu_trainer/algorithms/`` no code names a learner.

What is particular to a learner (the policy it rolls out with, its state, its metrics, what the
memory plan and the on-policy checks need to know) is asked of its `Algorithm` class, so a new
learner touches its own module and not the trainer, the learner loop, the plan or the checks. The
scan reads the sources (docstrings and comments are prose, not code) for the learners' names as
strings and their classes by name.

`PENDING` lists the modules that still name one, each with what it is and why it is left; an
entry whose module no longer names a learner fails too, so the list only shrinks (issue 47).
"""

from __future__ import annotations

import ast
from pathlib import Path

import boogu_trainer

ROOT = Path(boogu_trainer.__file__).parent
LEARNER_STRINGS = {"flow_grpo", "grpo_guard", "diffusion_nft", "awm", "nft"}
LEARNER_CLASSES = {"FlowGRPO", "DiffusionNFT", "AWM"}

PENDING = {
    "config/sections.py": "the options: algorithm.name's Literal, FORWARD_OPTIONS_KEYS (one options class per learner is issue 47, item 4)",
    "config/checks.py": "the 'ignored key' check of flow_grpo-only keys (item 4 derives it from the options)",
    "dryrun.py": "the fake-CUDA dry run's shipped recipe per learner (it leaves the trainer package, item 5)",
}


def _docstrings(tree: ast.Module) -> set[int]:
    out = set()
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            for i, child in enumerate(body):
                # a module/class/function docstring, or an attribute docstring after an assignment
                first = i == 0 and isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef))
                after_assign = i > 0 and isinstance(body[i - 1], (ast.Assign, ast.AnnAssign))
                if (
                    (first or after_assign)
                    and isinstance(child, ast.Expr)
                    and isinstance(child.value, ast.Constant)
                    and isinstance(child.value.value, str)
                ):
                    out.add(id(child.value))
    return out


def learner_names(source: str) -> list[tuple[int, str]]:
    """Where ``source`` names a learner in code: (line, name)."""
    tree = ast.parse(source)
    docs = _docstrings(tree)
    hits = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Constant) and isinstance(node.value, str) and id(node) not in docs:
            if node.value in LEARNER_STRINGS:
                hits.append((node.lineno, node.value))
        elif isinstance(node, ast.Name) and node.id in LEARNER_CLASSES:
            hits.append((node.lineno, node.id))
        elif isinstance(node, ast.Attribute) and node.attr in LEARNER_CLASSES | {"nft", "awm"}:
            hits.append((node.lineno, node.attr))
        elif isinstance(node, ast.alias) and node.name.rpartition(".")[2] in LEARNER_CLASSES:
            hits.append((node.lineno, node.name))
    return hits


def test_the_scan_finds_a_learner_named_in_code_and_not_in_prose():
    source = '''"""DiffusionNFT and awm, in prose."""
x = "prose is fine"
"""an attribute docstring naming flow_grpo"""
if config.algorithm.name == "diffusion_nft":  # the comment names awm
    pass
from boogu_trainer.algorithms import FlowGRPO
y = config.algorithm.awm.timesteps
'''
    assert sorted(learner_names(source)) == [(4, "diffusion_nft"), (6, "FlowGRPO"), (7, "awm")]


def test_nothing_outside_algorithms_names_a_learner():
    named = {}
    for path in sorted(ROOT.rglob("*.py")):
        rel = path.relative_to(ROOT).as_posix()
        if rel.startswith("algorithms/"):
            continue
        hits = learner_names(path.read_text(encoding="utf-8"))
        if hits:
            named[rel] = hits
    new = {rel: hits for rel, hits in named.items() if rel not in PENDING}
    assert not new, (
        f"these modules name a learner outside boogu_trainer/algorithms/ (line, name): {new}; ask the "
        "learner's Algorithm class instead (e.g. Algorithm.reads_rollout_logprobs, planned_memory, "
        "rollout_weights, step_metrics)"
    )
    done = sorted(set(PENDING) - set(named))
    assert not done, f"no longer name a learner: remove them from PENDING: {done}"
