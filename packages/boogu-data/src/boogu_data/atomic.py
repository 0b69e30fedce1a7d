"""Atomic commits of files and folders: build under a temporary sibling name, fsync, rename.

This is the one place boogu packages commit outputs atomically (the converters, the tiny
checkpoint builder, the trainer's checkpoints and run logs). A temporary lives in the same folder
as its target, so the final ``os.replace`` is a rename on one filesystem, atomic on POSIX: a reader
sees either the old target or the complete new one, never a partial one.

Every temporary name comes from :func:`temp_path`::

    .{target name}.{tag}-{host}-{pid}-{8 hex}[{suffix}]

Hidden (folder readers such as :func:`boogu_data.dataset_files` skip it), unique per process and
call, and it records its owner, so :func:`remove_stale` can tell a killed writer's leftovers from a live
writer's work in progress, also on a filesystem shared by several machines. ``host`` is
``socket.gethostname()`` with every character other than letters, digits, ``.`` and ``_`` replaced
by ``_``, so that the name parses back unambiguously.

A folder is replaced in two renames (:func:`commit_folder`): the old folder to a ``retired`` name,
then the staging folder to the target. A kill between them leaves the old complete folder under its
retired name; :func:`recover_folder` puts it back, and :func:`remove_stale` never deletes a retired
folder whose target is missing.

Reading must work on read-only storage (a shared checkpoint mount, a copied run): where removing a
dead writer's temporary or putting back a retired folder is refused (``EROFS``, ``EACCES``,
``EPERM``), :func:`remove_stale` and :func:`recover_folder` leave it as it is, log a warning naming
it and go on.

What a command may replace (one rule for every command that replaces an output folder: ``boogu-tiny``,
``boogu-data scenes --overwrite``): a folder only when every file in it, at any depth, is one the
command wrote itself, as its manifest records it (:func:`folder_manifest`: relative name, size and
SHA-256). :func:`check_replaceable` raises :class:`ForeignFilesError` naming the first file that is
not listed, or that changed since it was written; nothing is deleted then, whatever the options.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import logging
import os
import re
import secrets
import shutil
import socket
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path

__all__ = [
    "FOREIGN_REASONS",
    "AtomicOutputs",
    "ForeignFilesError",
    "atomic_file",
    "atomic_write_bytes",
    "atomic_write_text",
    "check_replaceable",
    "commit_folder",
    "file_record",
    "folder_manifest",
    "foreign_files",
    "fsync_dir",
    "owner_alive",
    "recover_folder",
    "remove_stale",
    "stage_folder",
    "temp_path",
]

logger = logging.getLogger(__name__)

RETIRED_TAG = "retired"
"""The tag of a folder that :func:`commit_folder` moved aside to make room for its replacement."""

_TAG = re.compile(r"[A-Za-z0-9_]+")
# Parsed from the right: pid and token are fixed shapes, the host has no "-" (see _host), and the
# tag is the word right before the host, so a target name with dots or dashes still parses.
_TEMP_NAME = re.compile(
    r"\.(?P<target>.+)\.(?P<tag>[A-Za-z0-9_]+)-(?P<host>[A-Za-z0-9._]+)-(?P<pid>[0-9]+)"
    r"-(?P<token>[0-9a-f]{8})(?P<suffix>\.[^.]*)?"
)


@dataclass(frozen=True, slots=True)
class _Owner:
    target: str
    tag: str
    host: str
    pid: int


def _host() -> str:
    return re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname()) or "unknown"


def _parse(name: str) -> _Owner | None:
    match = _TEMP_NAME.fullmatch(name)
    if match is None:
        return None
    pid = int(match["pid"])
    if pid <= 0:  # os.kill(0, ...) would signal our own process group; never a real owner
        return None
    return _Owner(match["target"], match["tag"], match["host"], pid)


def fsync_dir(path: Path) -> None:
    """Flush a folder's entries (the renames into it) to disk; best effort, never raises.

    Not every platform or filesystem lets a folder be opened or fsynced (Windows, some network
    filesystems); there the rename is as durable as that filesystem makes it.
    """
    try:
        descriptor = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:
        return
    try:
        os.fsync(descriptor)
    except OSError:
        pass
    finally:
        os.close(descriptor)


def _temp_name(final: Path, tag: str, suffix: str = "") -> Path:
    if not _TAG.fullmatch(tag):
        raise ValueError(f"tag must be letters, digits or '_', got {tag!r}")
    final = Path(final)
    prefix = f".{final.name}.{tag}-{_host()}-{os.getpid()}-"
    while True:
        candidate = final.with_name(f"{prefix}{secrets.token_hex(4)}{suffix}")
        if not os.path.lexists(candidate):
            return candidate


def temp_path(final: Path, tag: str = "tmp") -> Path:
    """A hidden sibling name ``.{final.name}.{tag}-{host}-{pid}-{8 hex}`` that does not exist yet.

    Nothing is created: callers that need the name reserved create it themselves (exclusively).

    Raises:
        ValueError: ``tag`` is not made of letters, digits and ``_``.
    """
    return _temp_name(final, tag)


def owner_alive(path: Path) -> bool:
    """Whether the process that made the :func:`temp_path` name ``path`` may still be using it.

    True when the name records another host (its processes cannot be checked from here) or a pid
    that is alive on this host; False when that pid is gone, and for names not made by
    :func:`temp_path`.
    """
    owner = _parse(Path(path).name)
    if owner is None:
        return False
    if owner.host != _host() or os.name == "nt":  # on Windows os.kill(pid, 0) would terminate it
        return True
    try:
        os.kill(owner.pid, 0)  # signal 0: existence check only
    except ProcessLookupError:
        return False
    except PermissionError:  # it exists, under another user
        return True
    except (OverflowError, OSError):  # not a pid this system can have
        return False
    return True


def _read_only(error: OSError) -> bool:
    """Whether ``error`` says the storage may be read but not changed (EACCES, EPERM, EROFS)."""
    return isinstance(error, PermissionError) or error.errno == errno.EROFS


def _remove(path: Path) -> bool:
    try:
        if path.is_dir() and not path.is_symlink():
            shutil.rmtree(path)
        else:
            path.unlink()
    except FileNotFoundError:  # another process cleaned it up first
        return False
    return True


def remove_stale(folder: Path) -> list[Path]:
    """Remove the :func:`temp_path` files and folders in ``folder`` whose owner is dead.

    Temporaries of live processes, of other hosts and names not made by :func:`temp_path` are left
    alone, and so is a retired folder whose target is missing: it is the only complete copy, and
    :func:`recover_folder` puts it back. A missing ``folder`` holds nothing to remove. A temporary
    that cannot be removed because the storage is read-only (or not ours to change) is left where it
    is, with a warning naming it: listing a read-only folder must work.

    Returns:
        The removed paths, in name order.
    """
    folder = Path(folder)
    try:
        entries = sorted(folder.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return []
    removed = []
    for entry in entries:
        owner = _parse(entry.name)
        if owner is None or owner_alive(entry):
            continue
        if owner.tag == RETIRED_TAG and not os.path.lexists(folder / owner.target):
            continue
        try:
            gone = _remove(entry)
        except OSError as error:
            if not _read_only(error):
                raise
            logger.warning(
                "cannot remove %s, a temporary of the dead process %d on %s (%s); leaving it there",
                entry,
                owner.pid,
                owner.host,
                error.strerror or error,
            )
            continue
        if gone:
            removed.append(entry)
    return removed


def _fsync_file(path: Path) -> None:
    # POSIX fsyncs through a read-only descriptor (so read-only files work); Windows needs write access.
    descriptor = os.open(path, os.O_RDWR if os.name == "nt" else os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


@contextlib.contextmanager
def atomic_file(path: Path) -> Iterator[Path]:
    """Yield an empty temporary file beside ``path``; on normal exit, fsync it and rename it onto ``path``.

    The temporary's name ends with ``path``'s suffix (``.{name}.tmp-{host}-{pid}-{hex}{suffix}``),
    so writers that choose a format from the extension (PIL, matplotlib) pick the right one. The
    parent folder is created if needed. Leaving the block with an exception removes the temporary
    and leaves ``path`` untouched.

    Raises:
        IsADirectoryError: ``path`` is a folder.
    """
    path = Path(path)
    if path.is_dir():
        raise IsADirectoryError(f"{path} is a directory; expected a file path")
    path.parent.mkdir(parents=True, exist_ok=True)
    temporary = _temp_name(path, "tmp", path.suffix)
    # "x" refuses an existing name; the umask applies (unlike mkstemp's 0600), so the committed file
    # has the permissions users expect.
    with open(temporary, "xb"):
        pass
    try:
        yield temporary
        _fsync_file(temporary)
        os.replace(temporary, path)
    except BaseException:
        with contextlib.suppress(FileNotFoundError):
            temporary.unlink()
        raise
    fsync_dir(path.parent)


def atomic_write_bytes(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as temporary:
        temporary.write_bytes(data)


def atomic_write_text(path: Path, text: str, encoding: str = "utf-8") -> None:
    """Write ``text`` to ``path`` atomically (see :func:`atomic_file`)."""
    with atomic_file(path) as temporary:
        temporary.write_text(text, encoding=encoding)


def stage_folder(final: Path) -> Path:
    """Create an empty temporary sibling folder in which to build ``final``; return its path.

    The parent folder is created if needed; the umask applies (unlike mkdtemp's 0700).
    """
    final = Path(final)
    final.parent.mkdir(parents=True, exist_ok=True)
    while True:
        staging = temp_path(final, "tmp")
        try:
            staging.mkdir()
        except FileExistsError:  # taken between the check and the mkdir
            continue
        return staging


def _fsync_tree(root: Path) -> None:
    # Children before their folder, so each folder's fsync covers entries that are already durable.
    for folder, _, files in os.walk(root, topdown=False):
        for name in files:
            file = Path(folder, name)
            if file.is_file() and not file.is_symlink():
                _fsync_file(file)
        fsync_dir(Path(folder))


def commit_folder(staging: Path, final: Path) -> None:
    """Put the finished folder ``staging`` at ``final``, replacing any folder there, by renames only.

    Every file under ``staging`` is fsynced first. An existing ``final`` is renamed to
    ``temp_path(final, "retired")``, ``staging`` is renamed to ``final``, the parent is fsynced and
    the retired folder removed. If the second rename fails the old folder is put back. A kill at
    any instant leaves the old or the new complete folder at ``final``, or (between the two
    renames) the old one under its retired name, which :func:`recover_folder` puts back.
    """
    staging, final = Path(staging), Path(final)
    _fsync_tree(staging)
    retired = None
    if os.path.lexists(final):
        retired = temp_path(final, RETIRED_TAG)
        os.replace(final, retired)
    try:
        os.replace(staging, final)
    except BaseException:
        if retired is not None:
            with contextlib.suppress(OSError):
                os.replace(retired, final)
        raise
    fsync_dir(final.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def recover_folder(final: Path) -> bool:
    """Undo a :func:`commit_folder` that was killed between its two renames.

    When ``final`` is missing and a retired sibling of it with a dead owner exists, the newest such
    sibling (by modification time) is renamed back to ``final``. On read-only storage the rename is
    refused: the sibling stays under its retired name, with a warning naming it.

    Returns:
        True when a folder was put back.
    """
    final = Path(final)
    if os.path.lexists(final):
        return False
    try:
        siblings = list(final.parent.iterdir())
    except (FileNotFoundError, NotADirectoryError):
        return False
    retired = []
    for sibling in siblings:
        owner = _parse(sibling.name)
        if owner is None or owner.tag != RETIRED_TAG or owner.target != final.name:
            continue
        if owner_alive(sibling):  # mid-commit in a live process: it finishes or rolls back itself
            continue
        with contextlib.suppress(FileNotFoundError):
            retired.append((sibling.lstat().st_mtime_ns, sibling.name, sibling))
    if not retired:
        return False
    newest = max(retired)[2]
    try:
        os.replace(newest, final)
    except FileNotFoundError:  # another process recovered it first
        return False
    except OSError as error:
        if not _read_only(error):
            raise
        logger.warning(
            "cannot put %s back as %s (%s); it stays under its retired name",
            newest,
            final.name,
            error.strerror or error,
        )
        return False
    fsync_dir(final.parent)
    return True


class AtomicOutputs:
    """Temporary paths for a set of output files, renamed into place together by :meth:`commit`.

    Several outputs (a converter's ``train.parquet`` and ``test.parquet``) are committed only after
    every one of them was written. Use as a context manager: leaving the block with an exception
    (including KeyboardInterrupt) removes every temporary file; leaving it normally without a commit
    does the same, so a forgotten commit never publishes anything. The temporaries are named by
    :func:`temp_path`, so those of a killed process are found by :func:`remove_stale`.
    """

    def __init__(self) -> None:
        self._pending: list[tuple[Path, Path]] = []  # (temporary, final)

    def reserve(self, final: str | os.PathLike[str]) -> Path:
        """Create an empty temporary file beside ``final`` (creating its folder) and return its path."""
        final = Path(final)
        if final.is_dir():
            raise IsADirectoryError(f"{final} is a directory; expected a file path")
        final.parent.mkdir(parents=True, exist_ok=True)
        # No suffix: the name must not end in ".parquet", so folder readers never pick it up.
        temporary = temp_path(final, "tmp")
        with open(temporary, "xb"):  # exclusive, and the umask applies (see atomic_file)
            pass
        self._pending.append((temporary, final))
        return temporary

    def commit(self) -> None:
        """Flush every temporary file to disk and rename each onto its final path."""
        for temporary, _ in self._pending:
            _fsync_file(temporary)
        folders = set()
        for temporary, final in self._pending:
            os.replace(temporary, final)
            folders.add(final.parent)
        self._pending.clear()
        for folder in sorted(folders):
            fsync_dir(folder)

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


# ------------------------------------------------------------------------------ what may be replaced


FOREIGN_REASONS: dict[str, str] = {
    "unlisted": "which {command} did not write",
    "changed": "which changed since {command} wrote it",
    "link": "a link, which {command} never writes",
    "empty folder": "an empty folder {command} did not make",
}
"""Why :func:`foreign_files` counts an entry as foreign, as the message of :class:`ForeignFilesError` says it."""


def file_record(path: Path) -> dict[str, int | str]:
    """``{"bytes": size, "sha256": hex digest}`` of the file at ``path``: one manifest entry."""
    digest = hashlib.sha256()
    size = 0
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
            size += len(block)
    return {"bytes": size, "sha256": digest.hexdigest()}


def _walk(root: Path) -> Iterator[tuple[str, Path, bool]]:
    """(relative posix name, path, is a plain file) of every entry under ``root``, depth first, sorted.

    Symbolic links are reported (as not plain files) and never followed.
    """
    for entry in sorted(root.iterdir(), key=lambda p: p.name):
        name = entry.relative_to(root).as_posix()
        if entry.is_dir() and not entry.is_symlink():
            yield name, entry, False
            for child, path, plain in _walk(entry):
                yield f"{name}/{child}", path, plain
        else:
            yield name, entry, entry.is_file() and not entry.is_symlink()


def folder_manifest(
    root: Path, *, exclude: Callable[[str], bool] = lambda name: False
) -> dict[str, dict[str, int | str]]:
    """The manifest of every plain file under ``root`` (at any depth) whose relative name
    ``exclude`` does not reject: ``{relative posix name: file_record}``, in name order."""
    root = Path(root)
    return {name: file_record(path) for name, path, plain in _walk(root) if plain and not exclude(name)}


def foreign_files(
    folder: Path, manifest: Mapping[str, Mapping[str, object]], *, own: frozenset[str] = frozenset()
) -> list[tuple[str, str]]:
    """What in ``folder`` (at any depth) was not written by the command whose ``manifest`` it is.

    A plain file is the command's when ``manifest`` lists its relative name with its size and SHA-256
    (or its name is in ``own``: the command's marker, which holds the manifest). Everything else is
    foreign: a file not listed, a listed file whose size or hash changed, a symbolic link, and a folder
    that is empty and holds no listed file's path (a folder with content is judged by its content).

    Returns:
        ``(relative name, reason)`` pairs in name order, the reason one of :data:`FOREIGN_REASONS`;
        empty when the folder may be replaced.
    """
    folder = Path(folder)
    if not folder.is_dir():
        return []
    parents = {str(Path(name).parent.as_posix()) for name in manifest}
    needed = set()
    for parent in parents:
        while parent not in ("", "."):
            needed.add(parent)
            parent = str(Path(parent).parent.as_posix())
    found = []
    for name, path, plain in _walk(folder):
        if plain:
            if name in own:
                continue
            expected = manifest.get(name)
            if expected is None:
                found.append((name, "unlisted"))
                continue
            actual = file_record(path)
            if actual["bytes"] != expected.get("bytes") or actual["sha256"] != expected.get("sha256"):
                found.append((name, "changed"))
        elif path.is_symlink() or not path.is_dir():
            found.append((name, "link"))
        elif name not in needed and not any(path.iterdir()):
            found.append((name + "/", "empty folder"))
    return found


class ForeignFilesError(FileExistsError):
    """An output folder holds something its command did not write; the folder was left as it is.

    ``folder`` is the folder, ``foreign`` the ``(relative name, reason)`` pairs of
    :func:`foreign_files`; the message names the first of them and what to do.
    """

    def __init__(self, folder: Path, foreign: list[tuple[str, str]], *, command: str, advice: str) -> None:
        self.folder = Path(folder)
        self.foreign = list(foreign)
        name, reason = self.foreign[0]
        why = FOREIGN_REASONS[reason].format(command=command)
        more = f" (and {len(self.foreign) - 1} more such entries)" if len(self.foreign) > 1 else ""
        super().__init__(
            f"{self.folder} holds {name}, {why}{more}; refusing to replace the folder (nothing was "
            f"deleted). {advice}"
        )

    def __reduce__(self):  # picklable with its fields (OSError pickles its args only)
        return (_rebuild_foreign, (self.folder, self.foreign, str(self)))


def _rebuild_foreign(folder: Path, foreign: list[tuple[str, str]], message: str) -> ForeignFilesError:
    error = ForeignFilesError.__new__(ForeignFilesError)
    FileExistsError.__init__(error, message)
    error.folder, error.foreign = folder, foreign
    return error


def check_replaceable(
    folder: Path,
    manifest: Mapping[str, Mapping[str, object]],
    *,
    command: str,
    own: frozenset[str] = frozenset(),
    advice: str = "Move your files out of it, or choose another output folder.",
) -> None:
    """Raise :class:`ForeignFilesError` unless everything in ``folder`` is ``command``'s own output
    (see :func:`foreign_files`); a missing folder may always be written."""
    foreign = foreign_files(folder, manifest, own=own)
    if foreign:
        raise ForeignFilesError(Path(folder), foreign, command=command, advice=advice)
