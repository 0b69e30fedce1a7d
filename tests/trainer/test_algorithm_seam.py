"""The algorithm seam: outside ``boogu_trainer/algorithms/`` no code names a learner.

What is particular to a learner (the policy it rolls out with, its state, its metrics, what the
memory plan and the on-policy checks need to know) is asked of its `Algorithm` class, so a new
learner touches its own module and not the trainer, the learner loop, the plan or the checks. The
scan reads the sources (docstrings and comments are prose, not code) for the learners' names as
strings and their classes by name.

`HOMES` lists the two modules outside it whose job is to name them: the one list of the built-in
learners with their option classes, and the built-in recipes (which pick a learner as a user's
recipe does). An entry whose module no longer names a learner fails too.

A learner of one's own is one module outside the package (`tests.trainer.toy_learner`): picked by
``algorithm.name=package.module:Class`` with ``algorithm.options``, its own tensor state saved by the
checkpoint's rule; killed with SIGKILL and resumed, it ends bitwise where a straight run ends.
"""

from __future__ import annotations

import ast
import json
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

import boogu_trainer
from boogu_trainer.checkpoint import checkpoint_folders, load_checkpoint

ROOT = Path(boogu_trainer.__file__).parent
LEARNER_STRINGS = {"flow_grpo", "grpo_guard", "diffusion_nft", "awm", "nft"}
LEARNER_CLASSES = {"FlowGRPO", "DiffusionNFT", "AWM"}

HOMES = {
    "config/algorithms.py": "the one list of the built-in learners (BUILTIN): names, options keys, traits, "
    "their option classes and the LearnerChoice fields they make",
    "config/recipes.py": "the built-in recipes (the demo, the scenes task, the tests' fast run) pick a learner",
}
"""Modules whose job is to name the learners."""


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
    new = {rel: hits for rel, hits in named.items() if rel not in HOMES}
    assert not new, (
        f"these modules name a learner outside boogu_trainer/algorithms/ (line, name): {new}; ask the "
        "learner's Algorithm class instead (e.g. Algorithm.reads_rollout_logprobs, planned_memory, "
        "rollout_weights, step_metrics)"
    )
    done = sorted(set(HOMES) - set(named))
    assert not done, f"no longer name a learner: remove them from HOMES: {done}"


TOY = [
    "algorithm.name=tests.trainer.toy_learner:AnchoredFlowGRPO",
    "algorithm.options={pull: 20.0, decay: 0.5}",
]


def test_the_builtin_learners_classes_and_specs_agree():
    # One list (config.algorithms.BUILTIN) for the config's checks, one registry of classes: the same
    # names, and each class's traits are what the config assumes of it.
    from boogu_trainer.algorithms import ALGORITHMS as CLASSES
    from boogu_trainer.algorithms import algorithm_class
    from boogu_trainer.config.algorithms import ALGORITHMS, SPECS

    assert tuple(CLASSES) == ALGORITHMS
    for name, spec in SPECS.items():
        cls = algorithm_class(name)
        assert (cls.forward_process, cls.reads_rollout_logprobs) == (
            spec.forward_process,
            spec.policy_ratio,
        ), name
    # The option sections LearnerChoice declares (algorithm.nft, algorithm.awm) are the specs' keys.
    import dataclasses

    from boogu_trainer.config import AlgorithmConfig
    from boogu_trainer.config.algorithms import LearnerChoice
    from boogu_trainer.config.fields import field_hints

    sections = {name for name, tp in field_hints(LearnerChoice).items() if dataclasses.is_dataclass(tp)}
    assert sections == {s.options_key for s in SPECS.values() if s.options_key}
    assert [f.name for f in dataclasses.fields(AlgorithmConfig)][
        : len(dataclasses.fields(LearnerChoice))
    ] == [f.name for f in dataclasses.fields(LearnerChoice)]


def test_a_learner_of_ones_own_is_checked_at_load():
    from boogu_trainer.config import ConfigError, load_config
    from tests.trainer.toy_learner import AnchorOptions

    config = load_config(None, [*TOY, "sampler.window_size=2"])
    assert config.algorithm.options_of() == AnchorOptions(pull=20.0, decay=0.5)
    spec = config.algorithm.spec
    assert (spec.forward_process, spec.policy_ratio, spec.options_key) == (False, True, "options")
    for overrides, message in (
        (
            ["algorithm.options={pul: 1}"],
            r"algorithm.options.pul: .* no such option \(did you mean 'pull'\?\)",
        ),
        (["algorithm.options={decay: 1.5}"], r"algorithm.options.decay=1.5: expected in \[0, 1\)"),
        (["sampler.window_size=0"], "AnchoredFlowGRPO trains on the SDE window"),
    ):
        with pytest.raises(ConfigError, match=message):
            load_config(None, [*TOY, "sampler.window_size=2", *overrides])
    with pytest.raises(
        ConfigError, match=r"algorithm.name=.tests.trainer.toy_learner:Nope.: .* no attribute"
    ):
        load_config(None, ["algorithm.name=tests.trainer.toy_learner:Nope"])
    with pytest.raises(ConfigError, match=r"not a subclass of boogu_trainer\.algorithms\.Algorithm"):
        load_config(None, ["algorithm.name=tests.trainer.toy_learner:AnchorOptions"])
    with pytest.raises(ConfigError, match=r"algorithm.options=.*only a learner of your own.*algorithm.nft"):
        load_config(None, ["algorithm.name=diffusion_nft", "algorithm.options={beta: 2}"])


@pytest.mark.slow
def test_a_learner_of_ones_own_with_its_own_state_resumes_bitwise_after_sigkill(tiny_checkpoint, tmp_path):
    from tests.trainer.test_distributed_and_resume import overrides, run, same

    steps = ["total_steps=4", "checkpoint.save_every=1", "checkpoint.keep_last=2", *TOY]
    run([sys.executable, "-m", "boogu_trainer", *overrides(tiny_checkpoint, tmp_path / "straight", *steps)])
    killed = tmp_path / "killed"
    args = [sys.executable, "-m", "boogu_trainer", *overrides(tiny_checkpoint, killed, *steps)]
    run(args, fault="kill:checkpoint_staged:3", expect=-9)
    assert [s for s, _ in checkpoint_folders(killed / "run" / "checkpoints")] == [1, 2]
    run([*args, "resume=auto"])
    (_, a), (_, b) = (
        checkpoint_folders(d / "run" / "checkpoints")[-1] for d in (tmp_path / "straight", killed)
    )
    for name in ("adapter_model.safetensors", "learner.anchor.safetensors", "optimizer.safetensors"):
        assert same(load_file(a / name), load_file(b / name)), name
    # The anchor is the learner's own state, and it matters: it lags the LoRA, and the pull is logged.
    anchor, lora = load_file(a / "learner.anchor.safetensors"), load_checkpoint(a).state["learner"]["lora"]
    assert anchor.keys() == lora.keys() and not same(anchor, lora)
    assert load_checkpoint(a).state["learner"]["counters"]["anchor_updates"] == 4
    lines = [json.loads(x) for x in (killed / "run" / "metrics.jsonl").read_text().splitlines()]
    straight = [
        json.loads(x) for x in (tmp_path / "straight" / "run" / "metrics.jsonl").read_text().splitlines()
    ]
    assert [m["step"] for m in lines] == [1, 2, 3, 4]
    assert [m["anchor/distance"] for m in lines] == [m["anchor/distance"] for m in straight]
    assert lines[-1]["anchor/distance"] > 0
