"""Device-honesty lints: code patterns that pass every CPU test and fail on a GPU, found by reading the AST.

On a CPU every tensor, generator and collective lives on one device, so these mistakes are invisible
to the test suite; the fake-CUDA dry run (``boogu_dryrun``) catches them at run time on the
paths it runs, and these lints catch them everywhere, statically:

* a random factory given ``generator=`` without ``device=`` (``torch.randint(..., generator=cuda_gen)``
  makes a CPU tensor, which a CUDA generator refuses);
* a ``torch.Generator`` made anywhere but ``boogu_schedule.seeding.make_generator`` (the seam the dry
  run replaces: a CUDA generator cannot be made without a driver);
* ``torch.distributed`` used outside ``boogu_trainer/distributed.py`` (`DistEnv` owns the device and
  every collective);
* a ``.cpu()`` result handed to a collective (a pure NCCL group takes CUDA tensors only);
* ``torch.tensor(...)`` without ``device=`` in the body of a loop of the rollout, the update or the
  evaluation (a CPU tensor there is either a device mix or a blocking copy per iteration), unless it
  goes straight into ``host_to_device`` / ``host_tensor`` (a pinned, non-blocking copy).

Each lint is checked to fire on a small snippet with the mistake, so none of them passes vacuously.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
SOURCES = sorted((ROOT / "packages").glob("*/src/**/*.py"))

RANDOM_FACTORIES = {"randn", "rand", "randint", "randperm", "normal", "bernoulli", "multinomial", "poisson"}
COLLECTIVES = {"all_gather_cat", "all_reduce_sum", "any", "broadcast_object", "gather_objects"}
HOST_COPIES = {"host_to_device", "host_tensor"}

# The functions whose loop bodies run once per denoising step, micro-batch, window step or level.
LOOP_FUNCTIONS = {
    "boogu-schedule/src/boogu_schedule/sampling.py": {"sample_windowed", "initial_noise"},
    "boogu-adapters/src/boogu_adapters/engines.py": {"generate", "encode"},
    "boogu-adapters/src/boogu_adapters/step.py": None,  # every function
    "boogu-adapters/src/boogu_adapters/recompute.py": None,
    "boogu-adapters/src/boogu_adapters/model/transformer.py": None,
    "boogu-adapters/src/boogu_adapters/model/attention.py": None,
    "boogu-adapters/src/boogu_adapters/model/blocks.py": None,
    "boogu-trainer/src/boogu_trainer/learner.py": None,
    "boogu-trainer/src/boogu_trainer/algorithms/flow_grpo.py": None,
    "boogu-trainer/src/boogu_trainer/algorithms/renoise.py": None,
    "boogu-trainer/src/boogu_trainer/algorithms/diffusion_nft.py": None,
    "boogu-trainer/src/boogu_trainer/algorithms/awm.py": None,
    "boogu-trainer/src/boogu_trainer/evaluation.py": {"evaluate"},
    "boogu-trainer/src/boogu_trainer/scoring.py": {"run"},
    "boogu-vllm/src/boogu_vllm/pipeline.py": None,
}


def _rel(path: Path) -> str:
    return str(path.relative_to(ROOT / "packages"))


def _parse(path: Path) -> ast.Module:
    return ast.parse(path.read_text(encoding="utf-8"), filename=str(path))


def _call_name(call: ast.Call) -> str | None:
    f = call.func
    if isinstance(f, ast.Attribute):
        return f.attr
    if isinstance(f, ast.Name):
        return f.id
    return None


def _is_torch_attr(call: ast.Call, names: set[str]) -> bool:
    f = call.func
    return (
        isinstance(f, ast.Attribute)
        and f.attr in names
        and isinstance(f.value, ast.Name)
        and f.value.id == "torch"
    )


def _kwarg_names(call: ast.Call) -> set[str]:
    return {k.arg for k in call.keywords if k.arg is not None}


def random_without_device(tree: ast.AST) -> list[int]:
    """Lines of ``torch.<random factory>(..., generator=...)`` calls without ``device=``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and _is_torch_attr(node, RANDOM_FACTORIES)
        and "generator" in _kwarg_names(node)
        and "device" not in _kwarg_names(node)
    ]


def generator_constructions(tree: ast.AST) -> list[int]:
    """Lines that make a ``torch.Generator(...)``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call) and _is_torch_attr(node, {"Generator"})
    ]


def distributed_uses(tree: ast.AST) -> list[int]:
    """Lines that import or name ``torch.distributed``."""
    lines = []
    for node in ast.walk(tree):
        imports = isinstance(node, ast.Import) and any(
            a.name.startswith("torch.distributed") for a in node.names
        )
        imports_from = isinstance(node, ast.ImportFrom) and (node.module or "").startswith(
            "torch.distributed"
        )
        attribute = (
            isinstance(node, ast.Attribute)
            and node.attr == "distributed"
            and isinstance(node.value, ast.Name)
            and node.value.id == "torch"
        )
        if imports or imports_from or attribute:
            lines.append(node.lineno)
    return lines


def _has_cpu_call(node: ast.AST) -> bool:
    return any(
        isinstance(n, ast.Call) and isinstance(n.func, ast.Attribute) and n.func.attr == "cpu"
        for n in ast.walk(node)
    )


def cpu_into_collective(tree: ast.AST) -> list[int]:
    """Lines of ``<x>.<collective>(<expression with .cpu()>, ...)``."""
    return [
        node.lineno
        for node in ast.walk(tree)
        if isinstance(node, ast.Call)
        and isinstance(node.func, ast.Attribute)
        and node.func.attr in COLLECTIVES
        and node.args
        and _has_cpu_call(node.args[0])
    ]


def host_tensors_in_loops(tree: ast.AST, functions: set[str] | None) -> list[int]:
    """Lines of ``torch.tensor(...)`` without ``device=`` inside a for/while body or a comprehension of
    ``functions`` (None: every function), unless the call is the argument of a host-to-device copy."""
    lines: set[int] = set()
    for fn in ast.walk(tree):
        if not isinstance(fn, ast.FunctionDef | ast.AsyncFunctionDef):
            continue
        if functions is not None and fn.name not in functions:
            continue
        wrapped = {
            id(arg)
            for node in ast.walk(fn)
            if isinstance(node, ast.Call) and _call_name(node) in HOST_COPIES
            for arg in node.args
        }
        loops = [
            n
            for n in ast.walk(fn)
            if isinstance(
                n, ast.For | ast.While | ast.ListComp | ast.GeneratorExp | ast.SetComp | ast.DictComp
            )
        ]
        for loop in loops:
            parts = loop.body if isinstance(loop, ast.For | ast.While) else [loop]
            for part in parts:
                for node in ast.walk(part):
                    if (
                        isinstance(node, ast.Call)
                        and _is_torch_attr(node, {"tensor"})
                        and "device" not in _kwarg_names(node)
                        and id(node) not in wrapped
                    ):
                        lines.add(node.lineno)
    return sorted(lines)


def _findings(check, paths) -> list[str]:
    return [f"{_rel(p)}:{line}" for p in paths for line in check(_parse(p))]


def test_random_factories_given_a_generator_name_their_device():
    assert _findings(random_without_device, SOURCES) == []


def test_generators_are_made_only_through_make_generator():
    seam = ROOT / "packages/boogu-schedule/src/boogu_schedule/seeding.py"
    assert _findings(generator_constructions, [p for p in SOURCES if p != seam]) == []
    assert generator_constructions(_parse(seam)), "the seam itself makes the generators"


def test_only_distributed_py_touches_torch_distributed():
    owner = ROOT / "packages/boogu-trainer/src/boogu_trainer/distributed.py"
    checked = [p for p in SOURCES if p != owner and "boogu-vllm" not in str(p)]
    assert _findings(distributed_uses, checked) == []


def test_no_cpu_tensor_goes_into_a_collective():
    assert _findings(cpu_into_collective, SOURCES) == []


def test_no_host_tensor_is_built_inside_the_loops():
    found = []
    for rel, functions in LOOP_FUNCTIONS.items():
        path = ROOT / "packages" / rel
        assert path.is_file(), f"the lint's list names a missing file: {rel}"
        found += [f"{rel}:{line}" for line in host_tensors_in_loops(_parse(path), functions)]
    assert found == []


@pytest.mark.parametrize(
    "check, bad, good",
    [
        (
            random_without_device,
            "torch.randint(0, 5, (1,), generator=g)",
            "torch.randint(0, 5, (1,), generator=g, device=g.device)",
        ),
        (generator_constructions, "g = torch.Generator(device='cuda')", "g = make_generator(0, 'cuda')"),
        (distributed_uses, "import torch.distributed as dist", "import torch"),
        (distributed_uses, "from torch.distributed.tensor import DTensor", "from torch import nn"),
        (distributed_uses, "x = torch.distributed.get_rank()", "x = torch.cuda.is_available()"),
        (
            cpu_into_collective,
            "env.all_gather_cat(ids.cpu(), 'ids')",
            "env.all_gather_cat(ids, 'ids').cpu()",
        ),
        (
            lambda tree: host_tensors_in_loops(tree, None),
            "def f(xs, device):\n    for x in xs:\n        t = torch.tensor([x])\n",
            "def f(xs, device):\n    for x in xs:\n        t = host_to_device(torch.tensor([x]), device)\n"
            "        u = torch.tensor([x], device=device)\n",
        ),
        (
            lambda tree: host_tensors_in_loops(tree, None),
            "def f(xs):\n    return [torch.tensor(x) for x in xs]\n",
            "def f(xs):\n    return torch.tensor(xs)\n",
        ),
    ],
)
def test_each_lint_fires_on_its_mistake(check, bad, good):
    assert check(ast.parse(bad)), f"the lint missed: {bad}"
    assert not check(ast.parse(good)), f"the lint flagged: {good}"
