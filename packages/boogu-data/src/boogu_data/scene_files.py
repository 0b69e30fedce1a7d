"""``boogu-data scenes``: a seeded scene set (or scene edit pairs) written as a dataset folder.

The folder holds ``{train,val,test}.parquet`` in the project's record schema, the rendered targets as
``images/<split>/<index:05d>.png`` and ``scenes.json`` (the arguments, palette and held-out pairs, and
the size and SHA-256 of every other file the command wrote). It sits above :mod:`boogu_data.scenes`
and :mod:`boogu_data.scene_edits`, which only describe and render.

``--overwrite`` follows the one rule of :mod:`boogu_data.atomic` for what a command may replace: an
earlier output is replaced only when every file in it, at any depth, is one ``scenes.json`` lists with
its size and hash (a version-1 ``scenes.json``, written before the list existed, stands for the
names that version wrote: the three parquet files and ``images/<split>/<index:05d>.png`` below its
counts). Anything else, such as ``images/mine/fav.png`` or an edited image, stops the command with
an error naming it, and nothing is deleted.
"""

from __future__ import annotations

import itertools
import json
import os
import shutil
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boogu_data.atomic import (
    FOREIGN_REASONS,
    commit_folder,
    file_record,
    folder_manifest,
    foreign_files,
    remove_stale,
    stage_folder,
)
from boogu_data.errors import OutputError
from boogu_data.record import PromptRecord
from boogu_data.scene_edits import iter_edits
from boogu_data.scenes import (
    BACKGROUND,
    DEFAULT_COUNTS,
    DEFAULT_SIZE,
    LAYOUTS,
    MARKER,
    MAX_COUNT,
    PALETTE,
    SPLITS,
    TEST_PAIRS,
    VAL_PAIRS,
    SceneObject,
    _check_size,
    _png,
    check_count,
    iter_scenes,
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
    stale_removed: tuple[Path, ...] = field(default=())
    """Temporaries of a killed earlier run beside ``output_dir`` that were removed first."""


COMMAND = "`boogu-data scenes`"
MARKER_VERSION = 2
"""2: ``scenes.json`` lists every other file with its size and SHA-256 (``files``); 1 did not."""


def _written_files(output_dir: Path, marker: dict[str, Any]) -> dict[str, Any] | None:
    """The manifest of what an earlier run wrote into ``output_dir``, from its marker; None if the
    marker's list is malformed. A version-1 marker lists no files: the names that version wrote
    stand for them (the three parquet files and, with ``images``, ``images/<split>/<index:05d>.png``
    below its counts), so only those names, whatever their content, may be replaced."""
    files = marker.get("files")
    if files is not None:
        ok = isinstance(files, dict) and all(
            isinstance(v, dict) and isinstance(v.get("bytes"), int) and isinstance(v.get("sha256"), str)
            for v in files.values()
        )
        return files if ok else None
    names = [f"{split}.parquet" for split in SPLITS]
    counts = marker.get("counts")
    if marker.get("images") is True and isinstance(counts, dict):
        for split in SPLITS:
            n = counts.get(split)
            if isinstance(n, int) and not isinstance(n, bool) and 0 <= n <= MAX_COUNT:
                names += [f"images/{split}/{index:05d}.png" for index in range(n)]
    return {name: file_record(output_dir / name) for name in names if (output_dir / name).is_file()}


def check_output_dir(output_dir: Path, *, overwrite: bool) -> bool:
    """Whether ``output_dir`` holds an earlier output to replace; an `OutputError` if it may not be written.

    A missing or empty folder may be written. A non-empty one only with ``overwrite``, and only if it
    is an earlier output of this command (its :data:`MARKER` names ``boogu-data scenes``) in which
    every file, at any depth, is one that output's marker lists, unchanged
    (:func:`boogu_data.atomic.foreign_files`); never the current working directory or a folder
    holding it.
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
    mine = isinstance(marker, dict) and marker.get("command") == "boogu-data scenes"
    written = _written_files(output_dir, marker) if mine else None
    if written is None:
        raise OutputError(
            output_dir,
            f"is not an earlier `boogu-data scenes` output (no valid {MARKER}; it holds {shown})",
            expected="a new or empty folder: --overwrite replaces only earlier outputs",
        )
    foreign = foreign_files(output_dir, written, own=frozenset({MARKER}))
    if foreign:
        name, reason = foreign[0]
        more = f" (and {len(foreign) - 1} more such entries)" if len(foreign) > 1 else ""
        raise OutputError(
            output_dir,
            f"holds {name}, {FOREIGN_REASONS[reason].format(command=COMMAND)}{more}; --overwrite replaces "
            "only what an earlier `boogu-data scenes` wrote, so nothing was deleted",
            expected="a new or empty folder, or move your files out of it first",
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
    records the arguments, the palette, the held-out pairs and every other file's size and SHA-256.
    Rows are generated, written and rendered one at a time (memory does not grow with the counts).
    The folder is built aside and put in place with one rename (:func:`boogu_data.atomic.commit_folder`);
    on any failure the staging folder is removed, and a staging folder that a killed earlier run
    left beside ``output_dir`` is removed first.

    Raises:
        ValueError: a bad ``seed``, ``size``, ``layout`` or count (the message names the option; a
            count is from 1 to :data:`boogu_data.scenes.MAX_COUNT`).
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
        check_count(n, "--count" if split == "train" else f"--{split}-count")
    output_dir = Path(output_dir).expanduser().resolve()
    try:
        stale = tuple(remove_stale(output_dir.parent))
    except OSError as error:
        raise OutputError(
            output_dir, f"cannot write ({type(error).__name__}: {error.strerror or error})"
        ) from None
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
            for record, objects in itertools.islice(_rows(seed, split, size, layout, edits), counts[split]):
                writer.write(record)
                if images:
                    (folder / f"{record.index:05d}.png").write_bytes(_png(render_objects(objects, size)))
            writer.close()
        marker = {
            "command": "boogu-data scenes",
            "version": MARKER_VERSION,
            "seed": seed,
            "size": size,
            "layout": layout,
            "edits": edits,
            "counts": {split: counts[split] for split in SPLITS},
            "images": images,
            "palette": {name: list(rgb) for name, rgb in PALETTE.items()},
            "background": list(BACKGROUND),
            "held_out": {"val": sorted(map(list, VAL_PAIRS)), "test": sorted(map(list, TEST_PAIRS))},
            "files": folder_manifest(staging),
        }
        (staging / MARKER).write_text(json.dumps(marker, indent=2) + "\n", encoding="utf-8")
        check_output_dir(output_dir, overwrite=overwrite)  # again, right before the rename
        commit_folder(staging, output_dir)
    except OSError as error:
        shutil.rmtree(staging, ignore_errors=True)
        where = f" ({error.filename})" if error.filename else ""
        raise OutputError(
            output_dir, f"cannot write ({type(error).__name__}: {error.strerror or error}{where})"
        ) from None
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return ScenesReport(output_dir, dict(counts), images, replaced, stale)


def _rows(
    seed: int, split: str, size: int, layout: str, edits: bool
) -> Iterator[tuple[PromptRecord, tuple[SceneObject, ...]]]:
    """The split's rows, one at a time: (record, the objects its target image shows)."""
    if edits:
        for index, edit in enumerate(iter_edits(seed, split, layout=layout)):
            yield edit.record(split, index, size), edit.target()
    else:
        for index, scene in enumerate(iter_scenes(seed, split, layout=layout)):
            yield scene.record(split, index), scene.objects
