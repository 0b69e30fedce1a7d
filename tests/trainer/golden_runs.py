"""Fixed-seed 4-step CPU runs whose final weights must not change when the trainer's code is reshaped.

Each case trains the tiny checkpoint for 4 steps (EMA on, a checkpoint at the end) and hashes the
final checkpoint's LoRA, AdamW state and EMA (and DiffusionNFT's old policy). `tests/trainer/
golden_runs.json` holds the hashes recorded before a refactor; `test_golden_runs.py` reruns every case
and compares. A change that means to move a number re-records them (``python -m
tests.trainer.golden_runs --record``) and says why in its commit.

The hashes are bitwise, so they hold for one CPU kernel family and one torch build: the file keeps one
recording per `machine` (``recordings``), and the test compares with the one of the machine it runs
on. Machines differ: the sandbox and CI have run on AVX2 and on AVX-512 CPUs. A recording for a new
kind is added (``--record`` replaces only this machine's) from the same commit as the others, after
checking that commit's numbers did not move on the machines already recorded.
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import sys
import tempfile
from pathlib import Path

import torch

GOLDEN = Path(__file__).with_name("golden_runs.json")

HASHED = ("adapter_model.safetensors", "optimizer.safetensors", "ema.safetensors", "old_policy.safetensors")

COMMON = [
    "model.device=cpu",
    "model.dtype=float32",
    "data.prompts_per_step=2",
    "algorithm.group_size=4",
    "sampler.num_steps=4",
    "sampler.height=32",
    "sampler.width=32",
    "lora.rank=4",
    "lora.alpha=8",
    "ema.enabled=true",
    "total_steps=4",
    "checkpoint.save_every=0",
    "logging.progress=false",
    "logging.sample_every=0",
    "logging.plot_every=0",
    "preflight=false",
    "seed=7",
]
SDE = [
    "sampler.guidance_scale=2.0",
    "sampler.noise_level=0.8",
    "sampler.window_size=2",
    "sampler.window_range=[0,3]",
]
ODE = ["sampler.guidance_scale=1.0", "sampler.window_size=0", "algorithm.mini_batches=1"]

CASES: dict[str, list[str]] = {
    "flow_grpo": [*SDE, "algorithm.mini_batches=2", "algorithm.clip_range=1e-3", "optim.lr=1e-3"],
    "grpo_guard": [*SDE, "algorithm.loss=grpo_guard", "algorithm.clip_range=1e-4", "optim.lr=1e-3"],
    "diffusion_nft": [
        "algorithm.name=diffusion_nft",
        *ODE,
        "algorithm.nft.timesteps=2",
        "algorithm.nft.old_decay_rate=0.3",
        "algorithm.kl_coef=1e-4",
        "optim.lr=1e-3",
    ],
    "awm": ["algorithm.name=awm", *ODE, "algorithm.awm.timesteps=2", "optim.lr=1e-3"],
    "flow_grpo_edit": [*SDE, "algorithm.clip_range=1e-3", "optim.lr=1e-3", "EDIT"],
}
"""Overrides per case, on top of `COMMON` and the demo config; ``EDIT`` stands for edit rows."""


def machine() -> dict[str, str]:
    """What bitwise equality of CPU float results depends on here."""
    return {
        "torch": torch.__version__.split("+")[0],
        "cpu_capability": torch.backends.cpu.get_cpu_capability(),
    }


def edit_rows(folder: Path) -> Path:
    """``folder/edit.parquet``: two edit prompts, each with its own 48x32 noise reference image."""
    import numpy as np
    from PIL import Image

    from boogu_data import PromptRecord, write_records

    def png(seed: int) -> bytes:
        pixels = np.random.default_rng(seed).integers(0, 256, (32, 48, 3), dtype=np.uint8)
        buffer = io.BytesIO()
        Image.fromarray(pixels).save(buffer, format="PNG")
        return buffer.getvalue()

    path = folder / "edit.parquet"
    prompts = ["make it orange", "make it blue"]
    rows = [
        PromptRecord(instruction=p, ground_truth="hi", data_source="golden/edit", index=i, ref_image=png(i))
        for i, p in enumerate(prompts)
    ]
    write_records(rows, path, "edit")
    return path


def run_case(name: str, tiny_checkpoint: Path, work: Path) -> dict[str, str]:
    """Train case ``name`` in ``work``; the sha256 of each hashed file of its final checkpoint."""
    from boogu_trainer.checkpoint import checkpoint_folders
    from boogu_trainer.config import demo_config, load_config
    from boogu_trainer.trainer import Trainer

    extra = list(CASES[name])
    if "EDIT" in extra:
        extra.remove("EDIT")
        extra.append(f"data.train_files=[{edit_rows(work)}]")
    config = load_config(
        None,
        [f"model.path={tiny_checkpoint}", f"logging.run_dir={work}", f"logging.name={name}", *COMMON, *extra],
        base=demo_config(),
    )
    trainer = Trainer(config)
    try:
        trainer.train()
    finally:
        trainer.close()
    (_, folder), *_ = reversed(checkpoint_folders(work / name / "checkpoints"))
    return {
        f: hashlib.sha256((folder / f).read_bytes()).hexdigest() for f in HASHED if (folder / f).is_file()
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--record", action="store_true", help=f"write the hashes to {GOLDEN.name}")
    parser.add_argument("--cases", default=",".join(CASES), help="comma-separated subset")
    args = parser.parse_args(argv)
    from boogu_tiny.checkpoints import ensure_tiny_checkpoint

    with tempfile.TemporaryDirectory(prefix="boogu-golden-") as tmp:
        tiny = Path(ensure_tiny_checkpoint(Path(tmp) / "tiny"))
        hashes = {}
        for name in args.cases.split(","):
            (Path(tmp) / name).mkdir()
            hashes[name] = run_case(name, tiny, Path(tmp) / name)
            print(name, json.dumps(hashes[name], indent=1))
    if args.record:
        others = [r for r in recordings() if r["machine"] != machine()]
        mine = {"machine": machine(), "cases": hashes}
        GOLDEN.write_text(json.dumps({"recordings": [*others, mine]}, indent=2, sort_keys=True) + "\n")
        print(f"recorded {GOLDEN} for {machine()}")
    return 0


def recordings() -> list[dict]:
    """Every recording in `GOLDEN`: ``[{"machine": ..., "cases": {case: {file: sha256}}}]``."""
    if not GOLDEN.is_file():
        return []
    return json.loads(GOLDEN.read_text())["recordings"]


def recorded_here() -> dict | None:
    """The recording of this machine (`machine`), or None."""
    return next((r for r in recordings() if r["machine"] == machine()), None)


if __name__ == "__main__":
    sys.exit(main())
