"""What a run writes for people: metrics as JSON lines, a reward curve, sample grids.

All files are written atomically (temporary name, then rename), so a reader never sees half a PNG.
On resume, ``metrics.jsonl`` is cut back to the checkpoint's step so the log matches the weights.
"""

from __future__ import annotations

import json
import math
import os
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont


def atomic_write_bytes(path: Path, data: bytes) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_bytes(data)
    os.replace(tmp, path)


class RunLog:
    """``metrics.jsonl`` plus optional TensorBoard / wandb sinks."""

    def __init__(
        self, run_dir: Path, *, tensorboard: bool = False, wandb: bool = False, config: dict | None = None
    ):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.history: list[dict[str, Any]] = []
        self._tb = self._wandb = None
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(
                    "logging.tensorboard=true needs the tensorboard package (pip install tensorboard)"
                ) from e
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError as e:
                raise RuntimeError("logging.wandb=true needs the wandb package (pip install wandb)") from e
            self._wandb = wandb_mod.init(
                project="boogu-flowgrpo", name=run_dir.name, config=config, dir=str(run_dir)
            )

    def truncate_to(self, step: int) -> None:
        """Keep only records with ``step <= step`` (resume) and load them as history."""
        kept = []
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if rec.get("step", math.inf) <= step:
                    kept.append(rec)
        atomic_write_bytes(self.path, "".join(json.dumps(r) + "\n" for r in kept).encode())
        self.history = kept

    def log(self, record: dict[str, Any]) -> None:
        self.history.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
            f.flush()
        step = int(record["step"])
        if self._tb is not None:
            for k, v in record.items():
                if isinstance(v, int | float) and k != "step":
                    self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log({k: v for k, v in record.items() if isinstance(v, int | float)}, step=step)

    def close(self) -> None:
        if self._tb is not None:
            self._tb.close()
        if self._wandb is not None:
            self._wandb.finish()


def plot_reward_curve(history: Sequence[dict[str, Any]], path: Path, reward_keys: Sequence[str]) -> None:
    """Reward mean with a +-1 std band per step, one line per reward (and the weighted total)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4), dpi=100)
    steps = [h["step"] for h in history]
    for key in reward_keys:
        mean = np.array([h.get(f"{key}/mean", np.nan) for h in history], dtype=float)
        std = np.array([h.get(f"{key}/std", np.nan) for h in history], dtype=float)
        ax.plot(steps, mean, label=key)
        ax.fill_between(steps, mean - std, mean + std, alpha=0.2)
    ax.set_xlabel("training step")
    ax.set_ylabel("reward")
    ax.set_title("reward per step (mean ± std over the batch)")
    ax.grid(alpha=0.3)
    ax.legend(loc="best")
    fig.tight_layout()
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    fig.savefig(tmp)
    plt.close(fig)
    os.replace(tmp, path)


def sample_grid(
    images: torch.Tensor, captions: Sequence[str], path: Path, columns: int = 4, cell: int = 192
) -> None:
    """A grid of (B, 3, H, W) uint8 images, each upscaled to ``cell`` px with its caption under it."""
    n = images.shape[0]
    cols = min(columns, n)
    rows = math.ceil(n / cols)
    caption_h = 46
    grid = Image.new("RGB", (cols * cell, rows * (cell + caption_h)), "white")
    draw = ImageDraw.Draw(grid)
    font = ImageFont.load_default(size=11)
    for i in range(n):
        img = Image.fromarray(images[i].permute(1, 2, 0).cpu().numpy()).resize(
            (cell, cell), Image.Resampling.NEAREST
        )
        x, y = (i % cols) * cell, (i // cols) * (cell + caption_h)
        grid.paste(img, (x, y))
        text = "\n".join(textwrap.wrap(captions[i], width=34)[:3])
        draw.multiline_text((x + 3, y + cell + 2), text, fill="black", font=font, spacing=1)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}.png")
    grid.save(tmp)
    os.replace(tmp, path)
