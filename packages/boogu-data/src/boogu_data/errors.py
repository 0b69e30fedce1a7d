"""Errors and warnings raised by boogu-data.

Every problem with a dataset is a :class:`DatasetError` that says where it is (file, and the line,
row and column when they apply) and what was expected, so a user can fix the input without reading
our code (docs/reliability.md).
"""

from __future__ import annotations

import os

__all__ = ["DatasetError", "OutputError", "ReferenceLayoutWarning"]


class DatasetError(ValueError):
    """A dataset file, or a line or row in it, is not what boogu-data expects.

    The structured fields are kept as attributes so callers (the CLI, ``--skip-invalid``) can act on
    them; ``str(error)`` is the full message.
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        problem: str,
        *,
        line: int | None = None,
        row: int | None = None,
        column: str | None = None,
        expected: str | None = None,
    ) -> None:
        self.path = os.fspath(path)
        """The file the problem is in."""
        self.problem = problem
        """What is wrong, in words."""
        self.line = line
        """1-based line number in a text input (converters), or None."""
        self.row = row
        """0-based row position in a parquet file (readers), or None."""
        self.column = column
        """Parquet column or JSON key the problem is in, or None."""
        self.expected = expected
        """What would have been accepted, or None when the problem says it."""
        super().__init__(self._format())

    def _format(self) -> str:
        where = [self.path]
        if self.line is not None:
            where.append(f"line {self.line}")
        if self.row is not None:
            where.append(f"row {self.row}")
        if self.column is not None:
            where.append(f"column {self.column!r}")
        message = f"{', '.join(where)}: {self.problem}"
        if self.expected is not None:
            message += f" (expected {self.expected})"
        return message

    def __reduce__(self):  # keep the error picklable (e.g. across dataloader worker processes)
        return (
            _rebuild_dataset_error,
            (self.path, self.problem, self.line, self.row, self.column, self.expected),
        )


def _rebuild_dataset_error(path, problem, line, row, column, expected) -> DatasetError:
    return DatasetError(path, problem, line=line, row=row, column=column, expected=expected)


class OutputError(DatasetError):
    """An output cannot be written: its folder is a file or not writable, or the disk is full.

    ``path`` is the output folder or file and ``problem`` what the operating system refused. It is
    a :class:`DatasetError`, so everything that reports dataset problems (the ``boogu-data``
    command) reports it too; the converters raise it only after removing their temporary files.
    """

    def __reduce__(self):  # picklable as itself, not as the base class
        return (_rebuild_output_error, (self.path, self.problem, self.expected))


def _rebuild_output_error(path, problem, expected) -> OutputError:
    return OutputError(path, problem, expected=expected)


class ReferenceLayoutWarning(UserWarning):
    """A file in the reference integration's layout was read, and something in it was normalised.

    Emitted once per :func:`boogu_data.read_records` call, for the ``"Picture 1: "`` prefix the
    reference edit converter writes before the image placeholder (upstream Boogu never uses it).
    """
