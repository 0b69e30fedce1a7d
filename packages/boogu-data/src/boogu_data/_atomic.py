"""All-or-nothing output files: write under temporary names beside the targets, rename at the end.

A temporary file lives in the same folder as its target, so the final ``os.replace`` is a rename on
one filesystem (atomic on POSIX): a reader sees either the old file or the complete new one, never a
partial file. Several outputs (a converter's ``train.parquet`` and ``test.parquet``) are committed
together, only after every one of them was written.
"""

from __future__ import annotations

import contextlib
import os
import secrets
from pathlib import Path

__all__ = ["AtomicOutputs"]

TMP_SUFFIX = ".tmp"


class AtomicOutputs:
    """Temporary paths for a set of output files, renamed into place by :meth:`commit`.

    Use as a context manager: leaving the block with an exception (including KeyboardInterrupt)
    removes every temporary file; leaving it normally without a commit does the same, so a forgotten
    commit never publishes anything.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []  # (temporary, final)

    def reserve(self, final: str | os.PathLike[str]) -> Path:
        """Create an empty temporary file beside ``final`` (creating its folder) and return its path."""
        final = Path(final)
        if final.is_dir():
            raise IsADirectoryError(f"{final} is a directory; expected a file path")
        final.parent.mkdir(parents=True, exist_ok=True)
        # A hidden name with a random part: two concurrent writers never share a temporary file, and
        # one left by a killed process is recognisable and ignored by folder readers (not *.parquet).
        temporary = final.with_name(f".{final.name}.{secrets.token_hex(4)}{TMP_SUFFIX}")
        # "x" refuses to reuse an existing name; the normal umask applies, unlike mkstemp's 0600,
        # so the committed file has the permissions users expect.
        with open(temporary, "xb"):
            pass
        self._pending.append((temporary, final))
        return temporary

    def commit(self) -> None:
        """Flush every temporary file to disk and rename each onto its final path."""
        for temporary, _ in self._pending:
            with open(temporary, "rb+") as handle:
                os.fsync(handle.fileno())
        folders = set()
        for temporary, final in self._pending:
            os.replace(temporary, final)
            folders.add(final.parent)
        self._pending.clear()
        for folder in sorted(folders):
            _fsync_folder(folder)

    def abort(self) -> None:
        """Remove every temporary file that was not committed."""
        for temporary, _ in self._pending:
            with contextlib.suppress(FileNotFoundError):
                temporary.unlink()
        self._pending.clear()

    def __enter__(self) -> AtomicOutputs:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.abort()


def _fsync_folder(folder: Path) -> None:
    # Makes the renames themselves durable; not every platform lets a folder be opened for this.
    try:
        descriptor = os.open(folder, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)
