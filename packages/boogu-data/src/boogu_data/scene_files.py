"""``boogu-data scenes``: a seeded scene set (or scene edit pairs) written as a dataset folder.

The folder holds ``{train,val,test}.parquet`` in the project's record schema, the rendered targets as
``images/<split>/<index:05d>.png`` and ``scenes.json`` (the arguments, palette and held-out pairs). It
sits above :mod:`boogu_data.scenes` and :mod:`boogu_data.scene_edits`, which only describe and render.
"""

from __future__ import annotations

import json
import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Final

from boogu_data.atomic import commit_folder, stage_folder
from boogu_data.errors import OutputError
from boogu_data.scene_edits import generate_edits
from boogu_data.scenes import (
    BACKGROUND,
    DEFAULT_COUNTS,
    DEFAULT_SIZE,
    LAYOUTS,
    MARKER,
    PALETTE,
    SPLITS,
    TEST_PAIRS,
    VAL_PAIRS,
    _check_size,
    _png,
    generate_scenes,
    render_objects,
)
from boogu_data.write import RecordWriter

__all__ = ["ScenesReport", "check_output_dir", "write_scenes"]


@dataclass(frozen=True, slots=True)
class ScenesReport:
    """What :func:`write_scenes` wrote."""

    output_dir: Path
    rows: dict[str, int]
    """Rows per split."""
    images: bool
    """Whether ``images/<split>/<index>.png`` were written."""
    replaced: bool
    """Whether an earlier output was replaced."""


_OUTPUT_NAMES: Final[frozenset[str]] = frozenset({MARKER, "images", *(f"{s}.parquet" for s in SPLITS)})


def check_output_dir(output_dir: Path, *, overwrite: bool) -> bool:
    """Whether ``output_dir`` holds an earlier output to replace; an `OutputError` if it may not be written.

    A missing or empty folder may be written. A non-empty one only with ``overwrite``, and only if it
    is an earlier output of this command (its :data:`MARKER` names ``boogu-data scenes``) holding
    nothing else; never the current working directory or a folder holding it.
    """
    if output_dir.exists() and not output_dir.is_dir():
        raise OutputError(output_dir, "is a file, not a folder", expected="a new or empty folder")
    cwd = Path.cwd().resolve()
    if output_dir == cwd or output_dir in cwd.parents:
        raise OutputError(output_dir, "is or holds the current working directory; choose a new folder")
    entries = sorted(p.name for p in output_dir.iterdir()) if output_dir.is_dir() else []
    if not entries:
        return False
    shown = ", ".join(entries[:5]) + (", ..." if len(entries) > 5 else "")
    if not overwrite:
        raise OutputError(
            output_dir,
            f"is not empty (it holds {shown})",
            expected="a new or empty folder, or --overwrite to replace an earlier `boogu-data scenes` output",
        )
    try:
        marker = json.loads((output_dir / MARKER).read_text(encoding="utf-8"))
    except (OSError, ValueError):
        marker = None
    if not isinstance(marker, dict) or marker.get("command") != "boogu-data scenes":
        raise OutputError(
            output_dir,
            f"is not an earlier `boogu-data scenes` output (no valid {MARKER}; it holds {shown})",
            expected="a new or empty folder: --overwrite replaces only earlier outputs",
        )
    foreign = [name for name in entries if name not in _OUTPUT_NAMES]
    if foreign:
        raise OutputError(
            output_dir,
            f"holds {', '.join(foreign[:5])}, which `boogu-data scenes` does not write",
            expected="a new or empty folder",
        )
    return True


def write_scenes(
    output_dir: str | os.PathLike[str],
    *,
    seed: int = 0,
    size: int = DEFAULT_SIZE,
    counts: dict[str, int] | None = None,
    images: bool = True,
    overwrite: bool = False,
    layout: str = "free",
    edits: bool = False,
) -> ScenesReport:
    """Write ``{train,val,test}.parquet`` (and ``images/<split>/<index:05d>.png``) into ``output_dir``.

    Each row is a T2I :class:`PromptRecord`: the caption as instruction, the scene's JSON
    (:meth:`Scene.to_json`) as ``ground_truth``, ``data_source`` ``"boogu/scenes"``, the tag as
    ``ability``. The T2I schema has no target-image column (its ``images`` column is an edit
    row's input), so the rendered targets are PNGs named by split and row index. With ``edits``
    the rows are edit pairs instead (:mod:`boogu_data.scene_edits`: the instruction, the rendered
    source scene as the reference image, :meth:`SceneEdit.to_json` as ``ground_truth``), and the
    PNGs the edited scenes. ``scenes.json``
    records the arguments, the palette and the held-out pairs. The folder is built aside and put in
    place with one rename (:func:`boogu_data.atomic.commit_folder`).

    Raises:
        ValueError: a bad ``seed``, ``size``, ``layout`` or count (the message names the option).
        OutputError: ``output_dir`` may not be written (see :func:`check_output_dir`) or writing failed.
    """
    counts = dict(DEFAULT_COUNTS if counts is None else counts)
    if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
        raise ValueError(f"--seed must be an int >= 0, got {seed!r}")
    _check_size(size)
    if layout not in LAYOUTS:
        raise ValueError(f"--layout must be one of {LAYOUTS}, got {layout!r}")
    if set(counts) != set(SPLITS):
        raise ValueError(f"counts must give {SPLITS}, got {sorted(counts)}")
    for split, n in counts.items():
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            flag = "--count" if split == "train" else f"--{split}-count"
            raise ValueError(f"{flag} must be an int >= 1, got {n!r}")
    output_dir = Path(output_dir).expanduser().resolve()
    replaced = check_output_dir(output_dir, overwrite=overwrite)
    try:
        staging = stage_folder(output_dir)
    except OSError as error:
        raise OutputError(
            output_dir, f"cannot write ({type(error).__name__}: {error.strerror or error})"
        ) from None
    try:
        for split in SPLITS:
            writer = RecordWriter(staging / f"{split}.parquet", "edit" if edits else "t2i")
            folder = staging / "images" / split
            if images:
                folder.mkdir(parents=True)
            if edits:
                rows = [
                    (edit.record(split, index, size), edit.target())
                    for index, edit in enumerate(generate_edits(seed, split, counts[split], layout=layout))
                ]
            else:
                rows = [
                    (scene.record(split, index), scene.objects)
                    for index, scene in enumerate(generate_scenes(seed, split, counts[split], layout=layout))
                ]
            for record, objects in rows:
                writer.write(record)
                if images:
                    (folder / f"{record.index:05d}.png").write_bytes(_png(render_objects(objects, size)))
            writer.close()
        marker = {
            "command": "boogu-data scenes",
            "version": 1,
            "seed": seed,
            "size": size,
            "layout": layout,
            "edits": edits,
            "counts": {split: counts[split] for split in SPLITS},
            "images": images,
            "palette": {name: list(rgb) for name, rgb in PALETTE.items()},
            "background": list(BACKGROUND),
            "held_out": {"val": sorted(map(list, VAL_PAIRS)), "test": sorted(map(list, TEST_PAIRS))},
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        commit_folder(staging, output_dir)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        raise OutputError(
            output_dir, f"cannot write ({type(error).__name__}: {error.strerror or error})"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ScenesReport(output_dir, dict(counts), images, replaced)
