"""What a run writes for people: metrics as JSON lines (+ TensorBoard / wandb), a reward curve,
sample grids; plus the timers and counters the step's record is built from.

Only rank 0 writes: on other ranks `MetricsLogger` keeps no files and no sinks. Every file is
written atomically (`boogu_data.atomic`), so a reader never sees half a PNG. On resume,
``metrics.jsonl`` is cut back to the checkpoint's step so the log matches the weights.
"""

from __future__ import annotations

import contextlib
import json
import math
import textwrap
import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from PIL import Image, ImageDraw, ImageFont

from boogu_data.atomic import atomic_file, atomic_write_text


class MetricsLogger:
    """``metrics.jsonl`` plus the optional TensorBoard / wandb sinks, on rank 0 only; `close` them."""

    def __init__(
        self,
        run_dir: Path,
        *,
        is_main: bool,
        tensorboard: bool = False,
        wandb: bool = False,
        config: dict | None = None,
    ):
        self.run_dir = run_dir
        self.path = run_dir / "metrics.jsonl"
        self.is_main = is_main
        self.history: list[dict[str, Any]] = []
        self._tb = self._wandb = None
        if not is_main:
            return
        run_dir.mkdir(parents=True, exist_ok=True)
        if tensorboard:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError as e:
                raise RuntimeError(
                    "logging.tensorboard=true needs the tensorboard package (pip install 'boogu-trainer[tensorboard]')"
                ) from e
            self._tb = SummaryWriter(str(run_dir / "tensorboard"))
        if wandb:
            try:
                import wandb as wandb_mod
            except ImportError as e:
                raise RuntimeError(
                    "logging.wandb=true needs the wandb package (pip install 'boogu-trainer[wandb]')"
                ) from e
            self._wandb = wandb_mod.init(
                project="boogu-flowgrpo", name=run_dir.name, config=config, dir=str(run_dir), resume="allow"
            )

    def truncate_to(self, step: int) -> None:
        """Keep only records with ``step <= step`` (a fresh run: 0; a resume: its step) as history."""
        if not self.is_main:
            return
        kept = []
        if self.path.exists():
            for line in self.path.read_text(encoding="utf-8").splitlines():
                try:
                    rec = json.loads(line)
                except json.JSONDecodeError:
                    continue  # a line cut by a kill
                if rec.get("step", math.inf) <= step:
                    kept.append(rec)
        atomic_write_text(self.path, "".join(json.dumps(r) + "\n" for r in kept))
        self.history = kept

    def log(self, record: dict[str, Any]) -> None:
        if not self.is_main:
            return
        self.history.append(record)
        with open(self.path, "a", encoding="utf-8") as f:
            f.write(json.dumps(record) + "\n")
        step = int(record["step"])
        scalars = {k: v for k, v in record.items() if isinstance(v, int | float) and k != "step"}
        if self._tb is not None:
            for k, v in scalars.items():
                self._tb.add_scalar(k, v, step)
        if self._wandb is not None:
            self._wandb.log(scalars, step=step)

    def close(self) -> None:
        """Flush and close the sinks (idempotent)."""
        if self._tb is not None:
            self._tb.close()
            self._tb = None
        if self._wandb is not None:
            self._wandb.finish()
            self._wandb = None


class StepTimer:
    """Wall-clock seconds per phase of one step (``time/<phase>``)."""

    def __init__(self, device: torch.device):
        self.device = device
        self.seconds: dict[str, float] = defaultdict(float)
        self.t0 = time.perf_counter()

    @contextlib.contextmanager
    def __call__(self, phase: str) -> Iterator[None]:
        start = time.perf_counter()
        try:
            yield
        finally:
            if self.device.type == "cuda":
                torch.cuda.synchronize(self.device)  # host sync, once per phase: the time is the GPU's
            self.seconds[phase] += time.perf_counter() - start

    def metrics(self) -> dict[str, float]:
        out = {f"time/{k}": v for k, v in self.seconds.items()}
        out["time/step"] = time.perf_counter() - self.t0
        return out


class ForwardCounter:
    """Counts transformer sample-forwards (batch rows per call of the root module), per phase.

    Forwards under grad mode are also counted as ``"<phase>:grad"``: each is followed by one
    backward of the same rows (see `forward_equivalents`).

    A forward pre-hook on the root module sees every call the rollout engine and the training
    adapter make (gradient checkpointing re-runs blocks, not the root, so it is not counted twice).
    """

    def __init__(self, transformer: torch.nn.Module):
        self.phase = "other"
        self.counts: dict[str, int] = defaultdict(int)
        self._handle = transformer.register_forward_pre_hook(self._hook, with_kwargs=True)

    def _hook(self, module, args, kwargs) -> None:
        x = args[0] if args else kwargs.get("hidden_states")
        self.counts[self.phase] += int(x.shape[0])
        if torch.is_grad_enabled():  # a forward that a backward will follow: counted as ``phase:grad`` too
            self.counts[f"{self.phase}:grad"] += int(x.shape[0])

    @contextlib.contextmanager
    def counting(self, phase: str) -> Iterator[None]:
        previous, self.phase = self.phase, phase
        try:
            yield
        finally:
            self.phase = previous

    def take(self) -> dict[str, int]:
        """The counts since the last call, then reset."""
        out = dict(self.counts)
        self.counts.clear()
        return out

    def close(self) -> None:
        self._handle.remove()


def forward_equivalents(counts: dict[str, int], *, checkpointing: bool) -> dict[str, int]:
    """One step's compute in forward-equivalents (FE) from `ForwardCounter` counts, per phase.

    A sample-forward is 1 FE; its backward is 2 (the usual 2x of the forward's FLOPs) plus 1 more
    for the recomputed forward with activation checkpointing. ``train`` is the update's forwards
    with their backwards; ``reference`` (KL) and ``old`` (an old policy's values) are its extra
    no-grad forwards; ``total`` adds the rollout.
    """
    backward = sum(v for k, v in counts.items() if k.endswith(":grad"))
    train = counts.get("train", 0) + (3 if checkpointing else 2) * backward
    out = {
        "rollout": counts.get("rollout", 0),
        "train": train,
        "reference": counts.get("reference", 0),
        "old": counts.get("old", 0),
        "backward": backward,
    }
    out["total"] = out["rollout"] + out["train"] + out["reference"] + out["old"]
    return out


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
    with atomic_file(path) as tmp:
        fig.savefig(tmp, format="png")
    plt.close(fig)


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
    with atomic_file(path) as tmp:
        grid.save(tmp, format="PNG")


def summarize_rewards(history: list[dict[str, Any]], window: int = 5) -> dict[str, float]:
    """First-vs-last ``window`` steps of the reward mean, with the standard error of the difference.

    With fewer than 2 finite steps there is nothing to compare: ``gain`` and ``stderr`` are NaN.
    """
    means = [h["reward/mean"] for h in history if math.isfinite(h.get("reward/mean", math.nan))]
    if len(means) < 2:
        m = means[0] if means else math.nan
        return {"first": m, "last": m, "gain": math.nan, "stderr": math.nan, "window": len(means)}
    if len(means) < 2 * window:
        window = len(means) // 2
    first, last = means[:window], means[-window:]

    def stats(xs):
        m = sum(xs) / len(xs)
        var = sum((x - m) ** 2 for x in xs) / max(len(xs) - 1, 1)
        return m, var / len(xs)

    m1, v1 = stats(first)
    m2, v2 = stats(last)
    return {"first": m1, "last": m2, "gain": m2 - m1, "stderr": math.sqrt(v1 + v2), "window": window}


def reward_verdict(summary: dict[str, float]) -> str:
    """One line for the end of a run: did the reward go up by more than twice its standard error?"""
    s = summary
    if s["window"] < 2 or not math.isfinite(s["stderr"]):
        return (
            f"reward {s['first']:.4f} over {s['window']} step(s): too few steps to tell whether it rose "
            "(at least 4 are needed)"
        )
    verdict = "up" if s["gain"] > 2 * s["stderr"] else "not clearly up"
    return (
        f"reward, first {s['window']} steps: {s['first']:.4f} | last {s['window']} steps: {s['last']:.4f} | "
        f"gain {s['gain']:+.4f} (2 x std err = {2 * s['stderr']:.4f}): {verdict}"
    )
