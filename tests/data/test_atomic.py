"""boogu_data.atomic: temporary names and their owners, stale clean-up, atomic files and folders."""

from __future__ import annotations

import hashlib
import logging
import os
import re
import socket
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

import boogu_data.atomic as atomic
from boogu_data.atomic import (
    AtomicOutputs,
    ForeignFilesError,
    atomic_file,
    atomic_write_bytes,
    atomic_write_text,
    check_replaceable,
    commit_folder,
    folder_manifest,
    foreign_files,
    fsync_dir,
    owner_alive,
    recover_folder,
    remove_stale,
    stage_folder,
    temp_path,
)
from tests.data.helpers import read_only_storage

HOST = re.sub(r"[^A-Za-z0-9._]", "_", socket.gethostname())


@pytest.fixture
def live_pid() -> Iterator[int]:
    """The pid of a running process that is not this one."""
    process = subprocess.Popen(["sleep", "30"])
    yield process.pid
    process.kill()
    process.wait()


@pytest.fixture
def dead_pid() -> int:
    """The pid of a process that has exited and been reaped."""
    process = subprocess.Popen(["true"])
    process.wait()
    return process.pid


def _name(final: str, pid: int, tag: str = "tmp", host: str = HOST, suffix: str = "") -> str:
    """A temp_path-style name built by hand (the format the module documents)."""
    return f".{final}.{tag}-{host}-{pid}-0123abcd{suffix}"


def _tree(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _folder(path: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (path / name).parent.mkdir(parents=True, exist_ok=True)
        (path / name).write_text(text)
    return path


# ------------------------------------------------------------------------------ names and owners


def test_temp_path_is_a_fresh_hidden_sibling_naming_host_and_pid(tmp_path: Path) -> None:
    final = tmp_path / "my-data.v2.parquet"
    first, second = temp_path(final), temp_path(final, "retired")
    assert first.parent == tmp_path and second.parent == tmp_path
    assert re.fullmatch(
        rf"\.my-data\.v2\.parquet\.tmp-{re.escape(HOST)}-{os.getpid()}-[0-9a-f]{{8}}", first.name
    )
    assert second.name.startswith(f".my-data.v2.parquet.retired-{HOST}-{os.getpid()}-")
    assert not first.exists() and not second.exists()  # a name only: nothing is created
    assert len({temp_path(final).name for _ in range(50)}) == 50
    with pytest.raises(ValueError, match="tag must be"):
        temp_path(final, "bad-tag")


def test_temp_path_skips_names_that_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    tokens = iter(["aaaaaaaa", "aaaaaaaa", "bbbbbbbb"])
    monkeypatch.setattr(atomic.secrets, "token_hex", lambda n: next(tokens))
    taken = temp_path(tmp_path / "x")
    taken.write_text("someone's")
    assert temp_path(tmp_path / "x").name.endswith("-bbbbbbbb")


def test_owner_alive(tmp_path: Path, live_pid: int, dead_pid: int) -> None:
    assert owner_alive(temp_path(tmp_path / "x"))  # this process
    assert owner_alive(tmp_path / _name("x", live_pid))
    assert owner_alive(tmp_path / _name("x.png", live_pid, suffix=".png"))
    assert not owner_alive(tmp_path / _name("x", dead_pid))
    # Another machine's processes cannot be checked from here: assume alive.
    assert owner_alive(tmp_path / _name("x", dead_pid, host="othermachine"))
    for foreign in ("x.parquet", ".x.parquet.abcd1234.tmp", _name("x", 0), f".x.tmp-{HOST}-12-xyz"):
        assert not owner_alive(tmp_path / foreign)


def test_owner_alive_counts_permission_error_as_alive(
    tmp_path: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    def refuse(pid: int, signal: int) -> None:
        raise PermissionError(1, "Operation not permitted")  # another user's process

    monkeypatch.setattr(atomic.os, "kill", refuse)
    assert owner_alive(tmp_path / _name("x", dead_pid))


def test_fsync_dir_is_best_effort(tmp_path: Path) -> None:
    assert fsync_dir(tmp_path) is None
    assert fsync_dir(tmp_path / "missing") is None  # refused: no error


# ------------------------------------------------------------------------------ remove_stale


def test_remove_stale_removes_dead_owners_only(tmp_path: Path, live_pid: int, dead_pid: int) -> None:
    (tmp_path / "keep.parquet").write_text("data")
    (tmp_path / ".hidden").write_text("not ours")
    live = tmp_path / _name("train.parquet", live_pid)
    live.write_text("in progress")
    remote = tmp_path / _name("train.parquet", dead_pid, host="elsewhere")
    remote.write_text("another machine's")
    dead_file = tmp_path / _name("test.parquet", dead_pid)
    dead_file.write_text("half written")
    dead_folder = _folder(tmp_path / _name("ckpt", dead_pid), {"a/b.bin": "x"})
    (tmp_path / "ckpt").mkdir()
    dead_retired = _folder(tmp_path / _name("ckpt", dead_pid, tag="retired"), {"old": "x"})
    live_retired = _folder(tmp_path / _name("other", live_pid, tag="retired"), {"old": "x"})

    assert remove_stale(tmp_path) == sorted([dead_file, dead_folder, dead_retired])
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(
        [".hidden", "keep.parquet", "ckpt", live.name, remote.name, live_retired.name]
    )
    assert remove_stale(tmp_path) == []
    assert remove_stale(tmp_path / "missing") == []


def test_remove_stale_keeps_a_retired_folder_whose_target_is_missing(tmp_path: Path, dead_pid: int) -> None:
    # A kill between commit_folder's renames: the retired folder is the only complete copy.
    retired = _folder(tmp_path / _name("ckpt", dead_pid, tag="retired"), {"weights": "old"})
    assert remove_stale(tmp_path) == []
    assert retired.is_dir()


def test_remove_stale_cleans_a_killed_writer(tmp_path: Path, live_pid: int, dead_pid: int) -> None:
    # Names made by temp_path itself, in a process whose pid is then dead or alive.
    for pid in (dead_pid, live_pid):
        with pytest.MonkeyPatch.context() as patch:
            patch.setattr(atomic.os, "getpid", lambda pid=pid: pid)
            temp_path(tmp_path / f"{pid}.bin").write_text("x")
    assert [p.name.split(".")[1] for p in remove_stale(tmp_path)] == [str(dead_pid)]
    assert [p.name.split(".")[1] for p in tmp_path.iterdir()] == [str(live_pid)]


def test_read_only_storage_leaves_dead_temporaries_with_a_warning(
    tmp_path: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # A run copied to (or mounted from) read-only storage: listing it must still work.
    (tmp_path / "ckpt").mkdir()
    dead = _folder(tmp_path / _name("ckpt", dead_pid), {"a/b.bin": "half"})
    orphan = _folder(tmp_path / _name("old", dead_pid, tag="retired"), {"w": "complete"})
    before = {p: _tree(p) for p in (dead, orphan)}
    with read_only_storage(tmp_path, monkeypatch), caplog.at_level(logging.WARNING, "boogu_data.atomic"):
        assert remove_stale(tmp_path) == []
        assert recover_folder(tmp_path / "old") is False
    assert {p: _tree(p) for p in (dead, orphan)} == before
    assert f"cannot remove {dead}" in caplog.text and f"cannot put {orphan} back" in caplog.text
    # Writable again: the same calls do their work.
    assert remove_stale(tmp_path) == [dead]
    assert recover_folder(tmp_path / "old") and _tree(tmp_path / "old") == {"w": b"complete"}


# ------------------------------------------------------------------------------ files


def test_atomic_write_bytes_and_text(tmp_path: Path) -> None:
    target = tmp_path / "sub" / "file.json"
    atomic_write_text(target, "ünï\n")
    assert target.read_bytes() == "ünï\n".encode()
    atomic_write_text(target, "é", encoding="latin-1")
    assert target.read_bytes() == b"\xe9"
    atomic_write_bytes(target, b"\x00\x01")
    assert target.read_bytes() == b"\x00\x01"
    assert sorted(p.name for p in target.parent.iterdir()) == ["file.json"]


def test_atomic_file_keeps_the_suffix_and_renames_on_exit(tmp_path: Path) -> None:
    target = tmp_path / "plot.png"
    target.write_bytes(b"old")
    with atomic_file(target) as temporary:
        assert temporary.parent == tmp_path and temporary.name.startswith(".plot.png.tmp-")
        assert temporary.suffix == ".png" and temporary.is_file()
        temporary.write_bytes(b"new")
        assert target.read_bytes() == b"old"  # nothing visible before the block ends
    assert target.read_bytes() == b"new"
    assert [p.name for p in tmp_path.iterdir()] == ["plot.png"]


def test_atomic_file_removes_its_temporary_on_exception(tmp_path: Path) -> None:
    target = tmp_path / "state.json"
    target.write_text("old")
    with pytest.raises(RuntimeError, match="boom"), atomic_file(target) as temporary:
        temporary.write_text("half")
        raise RuntimeError("boom")
    assert not temporary.exists()
    assert target.read_text() == "old"
    assert [p.name for p in tmp_path.iterdir()] == ["state.json"]
    with pytest.raises(IsADirectoryError), atomic_file(tmp_path):
        pass


def test_atomic_outputs_commit_together_and_abort(tmp_path: Path, dead_pid: int) -> None:
    with AtomicOutputs() as outputs:
        a, b = (
            outputs.reserve(tmp_path / "out" / "a.parquet"),
            outputs.reserve(tmp_path / "out" / "b.parquet"),
        )
        a.write_text("A")
        b.write_text("B")
        assert not a.name.endswith(".parquet") and owner_alive(a)  # a temp_path name
        outputs.commit()
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.parquet", "b.parquet"]

    with AtomicOutputs() as outputs:
        outputs.reserve(tmp_path / "out" / "a.parquet").write_text("never")
    assert (tmp_path / "out" / "a.parquet").read_text() == "A"
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == ["a.parquet", "b.parquet"]

    # A killed converter's temporary (its pid is dead) is what remove_stale cleans.
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(atomic.os, "getpid", lambda: dead_pid)
        leftover = AtomicOutputs().reserve(tmp_path / "out" / "a.parquet")
    assert remove_stale(tmp_path / "out") == [leftover]


# ------------------------------------------------------------------------------ folders


def test_stage_and_commit_a_new_folder(tmp_path: Path) -> None:
    final = tmp_path / "parent" / "ckpt"
    staging = stage_folder(final)
    assert staging.is_dir() and staging.parent == final.parent and owner_alive(staging)
    assert not any(staging.iterdir())
    _folder(staging, {"model.bin": "new", "sub/cfg.json": "{}"})
    commit_folder(staging, final)
    assert _tree(final) == {"model.bin": b"new", "sub/cfg.json": b"{}"}
    assert [p.name for p in final.parent.iterdir()] == ["ckpt"]


def test_commit_folder_replaces_an_existing_folder(tmp_path: Path) -> None:
    final = _folder(tmp_path / "ckpt", {"model.bin": "old", "stale.bin": "gone"})
    staging = _folder(stage_folder(final), {"model.bin": "new"})
    commit_folder(staging, final)
    assert _tree(final) == {"model.bin": b"new"}
    assert [p.name for p in tmp_path.iterdir()] == ["ckpt"]  # no retired copy left


class _Killed(OSError):
    """Stands in for the process dying at a named point: nothing after it may run."""


def _replace_failing_from(call: int, forever: bool, monkeypatch: pytest.MonkeyPatch) -> list[tuple]:
    calls: list[tuple] = []
    real = os.replace

    def replace(src, dst):
        calls.append((Path(src).name, Path(dst).name))
        if len(calls) == call or (forever and len(calls) > call):
            raise _Killed("killed between the renames")
        real(src, dst)

    monkeypatch.setattr(atomic.os, "replace", replace)
    return calls


def test_a_kill_between_the_renames_is_recovered(
    tmp_path: Path, dead_pid: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = _folder(tmp_path / "ckpt", {"model.bin": "old", "sub/x": "old"})
    staging = _folder(stage_folder(final), {"model.bin": "new"})
    with monkeypatch.context() as patch:
        patch.setattr(atomic.os, "getpid", lambda: dead_pid)  # the retired name records a dead owner
        calls = _replace_failing_from(2, True, patch)  # the process is gone from the 2nd rename on
        with pytest.raises(_Killed):
            commit_folder(staging, final)
    assert calls[0][0] == "ckpt" and calls[0][1].startswith(f".ckpt.retired-{HOST}-{dead_pid}-")
    assert not final.exists()
    retired = tmp_path / calls[0][1]
    assert _tree(retired) == {"model.bin": b"old", "sub/x": b"old"}

    assert remove_stale(tmp_path) == []  # neither the only old copy nor our live staging folder
    assert recover_folder(final)
    assert _tree(final) == {"model.bin": b"old", "sub/x": b"old"}
    assert not retired.exists()
    assert not recover_folder(final)  # nothing left to do
    assert staging.is_dir()  # the unfinished new build is the builder's to discard


def test_a_failed_second_rename_puts_the_old_folder_back(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    final = _folder(tmp_path / "ckpt", {"model.bin": "old"})
    staging = _folder(stage_folder(final), {"model.bin": "new"})
    _replace_failing_from(2, False, monkeypatch)
    with pytest.raises(_Killed):
        commit_folder(staging, final)
    assert _tree(final) == {"model.bin": b"old"}
    assert sorted(p.name for p in tmp_path.iterdir()) == sorted(["ckpt", staging.name])


def test_recover_folder_picks_the_newest_dead_retired_sibling(
    tmp_path: Path, live_pid: int, dead_pid: int
) -> None:
    final = tmp_path / "ckpt"
    older = _folder(tmp_path / _name("ckpt", dead_pid, tag="retired"), {"v": "1"})
    newer = _folder(tmp_path / f".ckpt.retired-{HOST}-{dead_pid}-ffffffff", {"v": "2"})
    os.utime(older, ns=(1_000_000_000, 1_000_000_000))
    os.utime(newer, ns=(2_000_000_000, 2_000_000_000))
    _folder(tmp_path / _name("ckpt", live_pid, tag="retired").replace("0123abcd", "99999999"), {"v": "3"})
    _folder(tmp_path / _name("other", dead_pid, tag="retired"), {"v": "4"})
    _folder(tmp_path / _name("ckpt", dead_pid, tag="tmp"), {"v": "5"})
    assert recover_folder(final)
    assert _tree(final) == {"v": b"2"}
    assert older.is_dir()  # only one is put back
    assert not recover_folder(final)  # final exists now


def test_recover_folder_leaves_a_live_commit_alone(tmp_path: Path, live_pid: int) -> None:
    retired = _folder(tmp_path / _name("ckpt", live_pid, tag="retired"), {"v": "1"})
    assert not recover_folder(tmp_path / "ckpt")
    assert retired.is_dir() and not (tmp_path / "ckpt").exists()
    assert not recover_folder(tmp_path / "missing-parent" / "ckpt")


# ------------------------------------------------------------------------------ what may be replaced


def test_only_a_folder_of_the_commands_own_unchanged_files_may_be_replaced(tmp_path: Path) -> None:
    out = _folder(
        tmp_path / "out", {"a.parquet": "rows", "images/train/00000.png": "png", "marker.json": "{}"}
    )
    manifest = folder_manifest(out, exclude=lambda name: name == "marker.json")
    assert list(manifest) == ["a.parquet", "images/train/00000.png"]
    assert manifest["a.parquet"] == {"bytes": 4, "sha256": hashlib.sha256(b"rows").hexdigest()}
    own = frozenset({"marker.json"})
    assert foreign_files(out, manifest, own=own) == []
    check_replaceable(out, manifest, command="cmd", own=own)  # nothing foreign: no error
    assert foreign_files(tmp_path / "missing", manifest) == []
    # Anything else, at any depth, is foreign: a nested file, a changed file, a link, an empty folder.
    (out / "images" / "mine").mkdir()
    (out / "images" / "mine" / "fav.png").write_text("mine")
    (out / "a.parquet").write_text("ROWS")
    (out / "link").symlink_to(out / "a.parquet")
    (out / "empty").mkdir()
    found = foreign_files(out, manifest, own=own)
    assert found == [
        ("a.parquet", "changed"),
        ("empty/", "empty folder"),
        ("images/mine/fav.png", "unlisted"),
        ("link", "link"),
    ]
    before = _tree(out)
    with pytest.raises(ForeignFilesError) as error:
        check_replaceable(out, manifest, command="cmd", own=own, advice="Do this.")
    assert str(error.value) == (
        f"{out} holds a.parquet, which changed since cmd wrote it (and 3 more such entries); refusing to "
        "replace the folder (nothing was deleted). Do this."
    )
    assert isinstance(error.value, FileExistsError) and error.value.foreign == found
    assert _tree(out) == before
