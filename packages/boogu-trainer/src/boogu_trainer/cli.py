"""``trainer``: FlowGRPO LoRA training for Boogu-Image.

trainer                                   the CPU demo: the tiny Boogu pretrained on procedural scenes
                                          learns to follow their captions (scenes_demo_config; held-out
                                          verdict: runs/demo/heldout.json, heldout_grid.png)
trainer edit [key=value ...]              the Edit demo: the tiny Boogu Edit checkpoint learns to follow edit
                                          instructions on their reference (scenes_edit_demo_config; held-out
                                          verdict: runs/edit_demo/heldout.json, heldout_grid.png)
trainer RECIPE.yaml [key=value ...]       a recipe, with overrides (e.g. optim.lr=1e-4)
trainer resume=auto                       continue the demo (or a recipe run) from its last checkpoint
trainer [RECIPE.yaml] --print-config      print the resolved config and exit
trainer RECIPE.yaml --plan [--gpu-memory GB] [--world-size N] [--references N]   print the expected peak memory per GPU and exit
trainer RECIPE.yaml --preflight           run only the preflight checks (boogu_trainer.preflight); exit 0/1
trainer RECIPE.yaml --prompt-stats PATH [--samples K] [--prompts N]   each training prompt's reward spread
                                          over K samples of the starting model (for data.prompt_stats)
"""

from __future__ import annotations

import os

# Before torch loads OpenMP: spinning idle threads make runs on a busy machine many times slower
# (measured 33x on a shared 2-core box; benchmarks/README.md).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import argparse
import contextlib
import logging
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING

from boogu_trainer import __version__
from boogu_trainer.config import (
    BUILTIN_RECIPES,
    ConfigError,
    TrainerConfig,
    config_reference_markdown,
    config_to_yaml,
    describe,
    learners_table_markdown,
    load_config,
    scenes_demo_config,
)

if TYPE_CHECKING:
    from boogu_trainer.trainer import Trainer

_BUILT_IN = {
    "ocr": "built-in prompts",
    "scenes": "built-in scene captions (held-out: data.demo_eval_split)",
    "scene_edits": "built-in scene edit pairs (held-out: data.demo_eval_split)",
}


def _parse(argv: list[str]) -> tuple[argparse.Namespace, str | None, list[str]]:
    parser = argparse.ArgumentParser(
        prog="trainer",
        description="FlowGRPO LoRA post-training for Boogu-Image. Without a recipe: the CPU demo.",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog="config keys (key=value overrides; see the README for the full reference):\n"
        + "\n".join(_key_lines()),
    )
    parser.add_argument(
        "args",
        nargs="*",
        metavar="RECIPE.yaml | edit | key=value",
        help="a YAML recipe (or 'edit': the built-in Edit demo) and/or overrides",
    )
    parser.add_argument("--print-config", action="store_true", help="print the resolved config and exit")
    parser.add_argument(
        "--config-reference", action="store_true", help="print the config reference as Markdown"
    )
    parser.add_argument(
        "--learners", action="store_true", help="print the built-in learners (algorithm.name) as Markdown"
    )
    parser.add_argument(
        "--plan",
        action="store_true",
        help="print the expected peak memory per GPU (no weights are loaded) and exit",
    )
    parser.add_argument(
        "--preflight",
        action="store_true",
        help="build the model, run only the preflight checks (LoRA targets, gradients, on-policy ratio, "
        "reward spread, weight sync), print the report and exit 0 (passed) or 1; nothing is trained or written",
    )
    parser.add_argument(
        "--prompt-stats",
        metavar="PATH",
        help="roll out each training prompt --samples times with the recipe's rollout settings before any "
        "update, write each prompt's reward mean and spread to PATH (JSON, for data.prompt_stats) and exit",
    )
    parser.add_argument(
        "--samples",
        type=int,
        metavar="K",
        help="with --prompt-stats: samples per prompt (default: algorithm.group_size)",
    )
    parser.add_argument(
        "--prompts",
        type=int,
        metavar="N",
        help="with --prompt-stats: only the first N training prompts (default: all)",
    )
    parser.add_argument(
        "--gpu-memory",
        type=float,
        metavar="GB",
        help="with --plan: GPU memory in GiB, to report the largest micro-batches that fit",
    )
    parser.add_argument(
        "--world-size",
        type=int,
        metavar="N",
        help="with --plan: the number of ranks (FSDP shards the transformer and the LoRA state; default: $WORLD_SIZE or 1)",
    )
    parser.add_argument(
        "--references",
        type=int,
        metavar="N",
        help="with --plan: reference images per prompt (edit data, each at the output size; default 0: T2I)",
    )
    parser.add_argument("--version", action="version", version=f"boogu-trainer {__version__}")
    # Intermixed: options may come before, between or after the recipe and the overrides
    # (``trainer RECIPE --plan --gpu-memory 80 model.device=cuda``), as the README writes them.
    ns = parser.parse_intermixed_args(argv)
    recipe = None
    overrides = []
    for a in ns.args:
        if "=" in a:
            overrides.append(a)
        elif recipe is None:
            recipe = a
        else:
            parser.error(f"more than one recipe given: {recipe!r} and {a!r}")
    return ns, recipe, overrides


def _key_lines() -> list[str]:
    return [f"  {key:34s} {doc}" for key, tp, _, doc in describe() if tp != "section"]


def _quiet_libraries() -> None:
    """Library progress bars and config chatter would bury the run's own progress line."""
    import diffusers
    import transformers

    diffusers.utils.logging.set_verbosity_error()
    diffusers.utils.logging.disable_progress_bar()
    transformers.utils.logging.set_verbosity_error()
    transformers.utils.logging.disable_progress_bar()


def main(argv: list[str] | None = None) -> int:
    ns, recipe, overrides = _parse(sys.argv[1:] if argv is None else argv)
    if ns.config_reference:
        print(config_reference_markdown())
        return 0
    if ns.learners:
        print(learners_table_markdown())
        return 0
    try:
        builtin = BUILTIN_RECIPES.get(recipe) if recipe is not None and not Path(recipe).exists() else None
        if builtin is not None:  # a built-in recipe by its name (`trainer edit`): a demo
            config = load_config(None, overrides, base=builtin())
            recipe = None
        else:
            config = load_config(recipe, overrides, base=None if recipe else scenes_demo_config())
    except ConfigError as e:
        print(f"trainer: config error: {e}", file=sys.stderr)
        return 2
    if ns.print_config:
        print(config_to_yaml(config), end="")
        return 0
    if ns.prompt_stats is None and (ns.samples is not None or ns.prompts is not None):
        print("trainer: --samples and --prompts only apply with --prompt-stats", file=sys.stderr)
        return 2
    if (ns.samples is not None and ns.samples < 2) or (ns.prompts is not None and ns.prompts < 1):
        print(
            f"trainer: --samples {ns.samples} / --prompts {ns.prompts}: need >= 2 samples and >= 1 prompt",
            file=sys.stderr,
        )
        return 2
    if not ns.plan and (ns.gpu_memory is not None or ns.world_size is not None or ns.references is not None):
        print("trainer: --gpu-memory, --world-size and --references only apply with --plan", file=sys.stderr)
        return 2
    if ns.plan:
        from boogu_trainer.plan import plan_memory

        _quiet_libraries()
        world = ns.world_size or int(os.environ.get("WORLD_SIZE", "1"))
        try:
            plan = plan_memory(
                config, world_size=world, gpu_memory_gb=ns.gpu_memory, reference_images=ns.references or 0
            )
        except ConfigError as e:  # a batch layout the trainer would refuse on this many ranks
            print(f"trainer: config error: {e}", file=sys.stderr)
            return 2
        print(plan.render())
        return 0
    logging.basicConfig(
        level=os.environ.get("BOOGU_LOG_LEVEL", "WARNING"), format="%(levelname)s %(name)s: %(message)s"
    )
    if ns.preflight:
        return preflight_only(config)
    if ns.prompt_stats is not None:
        return prompt_stats_only(config, ns.prompt_stats, samples=ns.samples, limit=ns.prompts or 0)
    return run(config, demo=recipe is None)


@contextlib.contextmanager
def _probe_trainer(config: TrainerConfig, prefix: str) -> Iterator[Trainer]:
    """A trainer for a command that only probes (``--preflight``, ``--prompt-stats``): it writes no
    run folder (``lock=False``: neither creates nor locks it), and a launched rollout worker logs to a
    temporary folder (``prefix``) removed with everything else at the end, passed or failed."""
    from boogu_trainer.distributed import DistEnv
    from boogu_trainer.trainer import Trainer

    _quiet_libraries()
    dist = DistEnv.from_environment(
        config.distributed.backend, config.model.device, config.distributed.timeout_s
    )
    trainer = None
    log_dir = tempfile.TemporaryDirectory(prefix=prefix)
    try:
        trainer = Trainer(config, dist=dist, worker_log_dir=Path(log_dir.name), lock=False)
        yield trainer
    finally:
        if trainer is not None:
            trainer.close()
        dist.close()
        log_dir.cleanup()


def preflight_only(config: TrainerConfig) -> int:
    """``--preflight``: build the trainer (no run folder is written), run the checks, print the report."""
    from boogu_trainer.preflight import PreflightError, run_preflight

    try:
        with _probe_trainer(config, "boogu-preflight-") as trainer:
            report = run_preflight(trainer, raise_on_failure=False)
            is_main = trainer.dist.is_main
    except PreflightError as e:
        print(f"trainer: {e}", file=sys.stderr)
        return 1
    if is_main:
        print(report.render())
        for failure in report.failures:
            print(f"trainer: preflight check {failure.name!r} failed: {failure.detail}", file=sys.stderr)
    return 0 if report.passed else 1


def prompt_stats_only(config: TrainerConfig, path: str, *, samples: int | None, limit: int) -> int:
    """``--prompt-stats PATH``: build the trainer (no run folder is written) on every training prompt
    (``data.prompt_stats`` is ignored: the file measures the prompts it would filter), roll each out
    ``samples`` times, write the statistics (`boogu_trainer.prompt_stats`) and print a summary. The
    prompts measured so far are kept in ``PATH.partial``: the same command goes on after a kill."""
    from dataclasses import replace

    from boogu_trainer.prompt_stats import measure_prompt_stats, write_prompt_stats

    config = replace(config, data=replace(config.data, prompt_stats=""))
    samples = samples or config.algorithm.group_size
    # A killed measurement goes on from here (the prompts measured so far); removed when PATH is written.
    partial = Path(path).expanduser().with_name(Path(path).name + ".partial")
    started = time.perf_counter()

    def progress(done: int, total: int) -> None:
        print(f"  prompt stats: {done}/{total} prompts ({time.perf_counter() - started:.0f} s)", flush=True)

    try:
        with _probe_trainer(config, "boogu-prompt-stats-") as trainer:
            stats = measure_prompt_stats(
                trainer, samples=samples, limit=limit, progress=progress, partial=partial
            )
    except (ConfigError, ValueError) as e:
        print(f"trainer: {e}", file=sys.stderr)
        return 2
    written = write_prompt_stats(stats, path)
    partial.unlink(missing_ok=True)
    rows = stats["prompts"]
    spread = sum(1 for r in rows if r["std"] is not None and r["std"] > 0)
    print(
        f"{written}: {len(rows)} prompts x {samples} samples; {spread} ({spread / len(rows):.0%}) have a "
        f"reward spread (std > 0), the rest scored alike in every sample"
    )
    return 0


def run(config: TrainerConfig, *, demo: bool = False) -> int:
    """Train with ``config`` (under torchrun: this rank's part); returns the process exit code."""
    from boogu_adapters.vllm_engine import RolloutWorkerError
    from boogu_trainer.checkpoint import CheckpointError
    from boogu_trainer.distributed import (
        RECORD_ENV,
        CollectiveTimeout,
        DeviceError,
        DistEnv,
        MultiNodeError,
        record_collectives,
    )
    from boogu_trainer.metrics import reward_verdict, summarize_rewards
    from boogu_trainer.preflight import PreflightError
    from boogu_trainer.trainer import Trainer, TrainingStopped

    _quiet_libraries()
    try:
        dist = DistEnv.from_environment(
            config.distributed.backend, config.model.device, config.distributed.timeout_s
        )
    except DeviceError as e:  # a device or a multi-node layout that cannot work (MASTER_ADDR)
        print(f"trainer: error: {e}", file=sys.stderr)
        return 2
    if dist.device.type == "cpu":
        from boogu_trainer.host_memory import keep_freed_host_memory

        keep_freed_host_memory()  # no page faults for every activation of every step (host_memory.py)
    main_rank = dist.is_main
    bar = None
    trainer = None
    heldout = None
    t0 = time.perf_counter()
    try:
        trainer = Trainer(config, dist=dist)
        config = trainer.config  # a fresh run may have moved to an unused folder
        if main_rank:
            if trainer.run_note:
                print(trainer.run_note)
            if demo and not config.model.path and not config.data.train_files:
                what = {
                    "scenes": "demo: tiny Boogu pretrained on procedural scenes, scene captions",
                    "scenes_edit": "Edit demo: tiny Boogu Edit fine-tuned on scene edit pairs, edit instructions",
                }.get(config.model.tiny, "demo: tiny random Boogu checkpoint, built-in prompts")
            else:
                what = (
                    f"model {config.model.path or f'tiny {config.model.tiny} checkpoint'}, "
                    f"data {', '.join(config.data.train_files) or _BUILT_IN[config.data.demo_set]}"
                )
            print(
                f"boogu-trainer {__version__} | {what} | {config.total_steps} steps | "
                f"{dist.world_size} rank(s) | outputs: {config.run_path}"
            )
        if config.resume:
            folder = trainer.resume(config.resume)
            if main_rank:
                print(
                    f"resumed from {folder} at step {trainer.step}"
                    if folder
                    else "no checkpoint yet: starting fresh"
                )
        report = trainer.preflight()  # before the progress bar; `train` would run it otherwise
        if report is not None and main_rank:
            print(report.render())
        if main_rank and config.logging.progress:
            from tqdm import tqdm

            bar = tqdm(total=config.total_steps, initial=trainer.step, unit="step", dynamic_ncols=True)

        def progress(step: int, record: dict) -> None:
            if bar is not None:
                bar.update(1)
                bar.set_postfix(
                    reward=f"{record['reward/mean']:.4f}", s_per_step=f"{record['time/step']:.1f}"
                )

        with record_collectives(os.environ.get(RECORD_ENV), dist.rank):
            history = trainer.train(progress)
        if config.data.demo_set != "ocr" and not config.data.val_files and not config.data.train_files:
            from boogu_trainer.demo import heldout_comparison

            if bar is not None:
                bar.close()
                bar = None
            if main_rank:
                print(
                    f"scoring the base model and the trained LoRA on {len(trainer.evaluator.records)} held-out prompts ..."
                )
            heldout = heldout_comparison(trainer, config.run_path)
    except ConfigError as e:  # what only the world size can refuse (`check_world_layout`)
        print(f"trainer: config error: {e}", file=sys.stderr)
        return 2
    except TrainingStopped as e:
        print(f"trainer: stopped: {e}", file=sys.stderr)
        return 3
    except PreflightError as e:
        print(f"trainer: stopped: {e}", file=sys.stderr)
        return 1
    except (CheckpointError, CollectiveTimeout, RolloutWorkerError, MultiNodeError) as e:
        print(f"trainer: error: {e}", file=sys.stderr)
        return 4
    except OSError as e:  # a full or read-only disk under the run folder (docs/reliability.md)
        where = f" {e.filename}" if e.filename else ""
        print(
            f"trainer: error: cannot write{where}: {e.strerror or e}. The run stopped; its committed "
            "checkpoints are intact (each is written aside and committed by one rename): free space or "
            "fix the permissions, then continue with resume=auto",
            file=sys.stderr,
        )
        return 4
    finally:
        if bar is not None:
            bar.close()
        if trainer is not None:
            trainer.close()  # a launched rollout worker stops with the run
        dist.close()
    if main_rank:
        print("\n" + reward_verdict(summarize_rewards(history)))
        if heldout is not None:
            from boogu_trainer.demo import HELDOUT_GRID, HELDOUT_JSON

            gold = ", ".join(heldout["gold_rewards"])
            print(
                f"held-out {gold} on {heldout['prompts']} prompts: base {heldout['base']:.3f} -> trained "
                f"{heldout['trained']:.3f} (difference {heldout['diff']:+.3f}, standard error {heldout['se_diff']:.3f}: "
                f"{'more than' if heldout['significant'] else 'not more than'} twice the standard error)"
            )
            print(f"  {config.run_path / HELDOUT_JSON}\n  {config.run_path / HELDOUT_GRID}")
        print(f"done in {time.perf_counter() - t0:.0f} s. outputs in {config.run_path}:")
        for name in ("metrics.jsonl", "reward_curve.png", "samples/", "checkpoints/", "config.yaml"):
            print(f"  {config.run_path / name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
