"""Procedural scenes (boogu_data.scenes): captions, splits, rendering and the `boogu-data scenes` command."""

from __future__ import annotations

import hashlib
import io
import json
from collections import Counter
from pathlib import Path

import pytest
from PIL import Image

from boogu_data import read_records
from boogu_data.cli import main
from boogu_data.scene_files import write_scenes
from boogu_data.scenes import (
    BACKGROUND,
    COLOURS,
    MARKER,
    MAX_COUNT,
    PALETTE,
    SHAPES,
    TEST_PAIRS,
    VAL_PAIRS,
    ParsedCaption,
    Phrase,
    Scene,
    SceneObject,
    generate_scenes,
    parse_caption,
    render,
    render_png,
    split_of,
)

SMALL = {"train": 16, "val": 4, "test": 4}
WHY_MAX = "(the most scenes of one split that boogu-data draws: image names have five digits)"


def _digests(folder: Path) -> dict[str, str]:
    return {
        str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(folder.rglob("*"))
        if p.is_file()
    }


def test_same_seed_same_bytes_other_seed_other_scenes(tmp_path: Path) -> None:
    write_scenes(tmp_path / "a", seed=3, counts=SMALL)
    write_scenes(tmp_path / "b", seed=3, counts=SMALL)
    write_scenes(tmp_path / "c", seed=4, counts=SMALL)
    a, b, c = (_digests(tmp_path / name) for name in "abc")
    assert len(a) == 3 + 1 + sum(SMALL.values()), "three parquet files, the marker and one PNG per row"
    assert a == b
    assert a["train.parquet"] != c["train.parquet"]


def test_splits_hold_out_the_documented_pairs() -> None:
    scenes = {split: generate_scenes(0, split, 400) for split in ("train", "val", "test")}
    pairs = {split: set().union(*(s.pairs() for s in found)) for split, found in scenes.items()}
    assert not pairs["train"] & (VAL_PAIRS | TEST_PAIRS), "no held-out pair in train"
    assert not pairs["val"] & TEST_PAIRS
    assert all(s.pairs() & VAL_PAIRS for s in scenes["val"])
    assert all(s.pairs() & TEST_PAIRS for s in scenes["test"])
    assert all(split_of(s) == split for split, found in scenes.items() for s in found)
    captions = {split: {s.caption() for s in found} for split, found in scenes.items()}
    assert (
        not captions["train"] & (captions["val"] | captions["test"])
        and not captions["val"] & captions["test"]
    )
    # The held-out pairs' colours and shapes are all seen in training, in other pairs.
    assert {c for c, _ in pairs["train"]} == set(COLOURS) and {s for _, s in pairs["train"]} == set(SHAPES)
    assert len(pairs["train"]) == len(COLOURS) * len(SHAPES) - len(VAL_PAIRS | TEST_PAIRS)
    tags = Counter(s.tag for s in scenes["train"])
    assert set(tags) == {"single_object", "two_object", "counting", "position"}
    assert {len(s.objects) for s in scenes["train"]} == {1, 2, 3, 4}


def test_keep_draws_an_in_order_subset_of_the_same_stream() -> None:
    stream = generate_scenes(0, "train", 200, layout="grid")
    wanted = [s for s in stream if s.tag == "position"]
    assert (
        generate_scenes(0, "train", len(wanted), layout="grid", keep=lambda s: s.tag == "position") == wanted
    )


def test_grid_layout_puts_every_box_on_whole_cells_and_keeps_the_rules() -> None:
    from boogu_data.scenes import CELL, GAP, GRID, GRID_SIZES, _box, _relation, sample_scene

    scenes = {split: generate_scenes(0, split, 300, layout="grid") for split in ("train", "val", "test")}
    assert all(split_of(s) == split for split, found in scenes.items() for s in found)
    for scene in scenes["train"]:
        boxes = [_box(o, GRID) for o in scene.objects]
        for (x0, y0, x1, y1), obj in zip(boxes, scene.objects, strict=True):
            assert round(obj.size * GRID) in GRID_SIZES
            assert all(v % CELL == 0 for v in (x0, y0, x1, y1)), (scene, x0, y0)
            assert min(x0, y0) >= CELL and max(x1, y1) <= GRID - CELL
        for i, a in enumerate(boxes):  # boxes keep the gap (a whole cell, on the grid)
            for b in boxes[i + 1 :]:
                assert max(b[0] - a[2], a[0] - b[2], b[1] - a[3], a[1] - b[3]) >= GAP
        if scene.relation is not None:
            centres = [tuple(round(c * GRID) for c in o.centre) for o in scene.objects]
            assert _relation(centres[0], centres[1]) == scene.relation
    # Every task and object count still occurs, and a grid scene renders exactly what it says.
    assert {s.tag for s in scenes["train"]} == {"single_object", "two_object", "counting", "position"}
    assert {len(s.objects) for s in scenes["train"]} == {1, 2, 3, 4}
    # The default is the free layout, unchanged; a wrong layout is named.
    assert generate_scenes(0, "train", 20) == generate_scenes(0, "train", 20, layout="free")
    assert generate_scenes(0, "train", 20) != generate_scenes(0, "train", 20, layout="grid")
    with pytest.raises(ValueError, match="layout must be one of"):
        sample_scene(__import__("random").Random(0), "tiles")


def test_captions_parse_back_to_their_scene() -> None:
    for scene in generate_scenes(1, "train", 300) + generate_scenes(1, "test", 100):
        parsed = parse_caption(scene.caption())
        asked = Counter({(p.colour, p.shape): p.count for p in parsed.phrases})
        assert asked == Counter((o.colour, o.shape) for o in scene.objects), scene.caption()
        assert parsed.relation == scene.relation
        assert Scene.from_json(scene.to_json()) == scene


@pytest.mark.parametrize(
    ("text", "expected"),
    [
        ("a red circle", ParsedCaption((Phrase("red", "circle"),))),
        ("A photo of a Red Circle.", ParsedCaption((Phrase("red", "circle"),))),
        ("four yellow squares", ParsedCaption((Phrase("yellow", "square", 4),))),
        ("3 blue triangles", ParsedCaption((Phrase("blue", "triangle", 3),))),
        (
            "a red circle to the left of a blue square",
            ParsedCaption((Phrase("red", "circle"), Phrase("blue", "square")), "left of"),
        ),
        (
            "a green triangle below a green circle",
            ParsedCaption((Phrase("green", "triangle"), Phrase("green", "circle")), "below"),
        ),
        (
            "a red circle, a blue square and a red circle",
            ParsedCaption((Phrase("red", "circle", 2), Phrase("blue", "square"))),
        ),
    ],
)
def test_parse_caption_forms(text: str, expected: ParsedCaption) -> None:
    assert parse_caption(text) == expected


@pytest.mark.parametrize(
    "text",
    [
        "",
        "a sign that says OPEN",
        "a purple circle",
        "a red hexagon",
        "five red circles",
        "a red circle left of a red circle",
        "red circle",
    ],
)
def test_parse_caption_refuses_other_text(text: str) -> None:
    with pytest.raises(ValueError, match="not a scene caption"):
        parse_caption(text)


@pytest.mark.parametrize("size", [64, 128, 48])
def test_render_draws_each_object_in_its_colour_at_its_place(size: int) -> None:
    for scene in generate_scenes(2, "train", 50):
        image = render(scene, size)
        assert image.size == (size, size) and image.mode == "RGB"
        for obj in scene.objects:
            # The centre of the bounding box is inside every shape (a triangle is half as wide there).
            assert (
                image.getpixel((int(obj.centre[0] * size), int(obj.centre[1] * size))) == PALETTE[obj.colour]
            )
        assert image.getpixel((0, 0)) == BACKGROUND and image.getpixel((size - 1, size - 1)) == BACKGROUND
        colours = {rgb for _, rgb in image.getcolors()}
        assert colours == {BACKGROUND} | {PALETTE[o.colour] for o in scene.objects}, "hard edges only"


def test_scene_checks_its_fields() -> None:
    red = SceneObject("circle", "red", (0.5, 0.5), 0.25)
    with pytest.raises(ValueError, match="shape must be one of"):
        SceneObject("hexagon", "red", (0.5, 0.5), 0.25)
    with pytest.raises(ValueError, match="colour must be one of"):
        SceneObject("circle", "purple", (0.5, 0.5), 0.25)
    with pytest.raises(ValueError, match="single_object scene has 1 object"):
        Scene("single_object", (red, red))
    with pytest.raises(ValueError, match="relation is given for position scenes only"):
        Scene("position", (red, SceneObject("square", "blue", (0.1, 0.1), 0.2)))
    with pytest.raises(ValueError, match="one colour and shape"):
        Scene("counting", (red, SceneObject("square", "red", (0.1, 0.1), 0.2)))


def test_scenes_command_writes_records_and_images(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "scenes"
    argv = [
        "scenes",
        "--output-dir",
        str(out),
        "--seed",
        "1",
        "--count",
        "12",
        "--val-count",
        "3",
        "--test-count",
        "4",
    ]
    assert main([*argv, "--size", "128"]) == 0
    assert "train: 12 scenes" in capsys.readouterr().out
    marker = json.loads((out / MARKER).read_text())
    assert marker["command"] == "boogu-data scenes" and marker["size"] == 128 and marker["seed"] == 1
    assert marker["held_out"] == {
        "val": [["green", "square"]],
        "test": [["blue", "triangle"], ["yellow", "circle"]],
    }
    for split, rows in (("train", 12), ("val", 3), ("test", 4)):
        records = list(read_records(out / f"{split}.parquet"))
        assert len(records) == rows and [r.index for r in records] == list(range(rows))
        for record in records:
            scene = Scene.from_json(record.ground_truth)
            assert record.instruction == scene.caption() and record.split == split == split_of(scene)
            assert (
                record.data_source == "boogu/scenes"
                and record.ability == scene.tag
                and record.ref_image is None
            )
            png = (out / "images" / split / f"{record.index:05d}.png").read_bytes()
            assert png == render_png(scene, 128)
            with Image.open(io.BytesIO(png)) as image:
                assert image.size == (128, 128)
    assert marker["layout"] == "free"
    # --layout grid writes the grid scenes of the same seed, and says so in the marker.
    grid = tmp_path / "grid"
    assert main(["scenes", "--output-dir", str(grid), "--seed", "1", "--count", "5", "--layout", "grid"]) == 0
    assert json.loads((grid / MARKER).read_text())["layout"] == "grid"
    rows = [Scene.from_json(r.ground_truth) for r in read_records(grid / "train.parquet")]
    assert rows == generate_scenes(1, "train", 5, layout="grid")


def test_scenes_command_refuses_bad_arguments_in_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = str(tmp_path / "o")
    for extra, message in (
        (["--size", "50"], "--size must be a multiple of 16 from 32 to 2048, got 50"),
        (["--size", "16"], "--size must be a multiple of 16 from 32 to 2048, got 16"),
        (["--count", "0"], f"--count must be an int from 1 to {MAX_COUNT} {WHY_MAX}, got 0"),
        (["--test-count", "-1"], f"--test-count must be an int from 1 to {MAX_COUNT} {WHY_MAX}, got -1"),
        (["--seed", "-2"], "--seed must be an int >= 0, got -2"),
    ):
        assert main(["scenes", "--output-dir", out, *extra]) == 2
        assert capsys.readouterr().err == f"boogu-data scenes: error: {message}\n"
    assert not (tmp_path / "o").exists()
    with pytest.raises(SystemExit) as caught:
        main(["scenes", "--output-dir", out, "--size", "big"])
    assert caught.value.code == 2


def test_scenes_command_replaces_only_its_own_earlier_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    argv = ["scenes", "--output-dir", str(out), "--count", "4", "--val-count", "1", "--test-count", "1"]
    assert main(argv) == 0
    first = _digests(out)
    assert main([*argv, "--seed", "5"]) == 1, "a non-empty folder needs --overwrite"
    assert "is not empty" in capsys.readouterr().err and _digests(out) == first
    assert main([*argv, "--seed", "5", "--overwrite", "--no-images"]) == 0
    assert "replaced the earlier output" in capsys.readouterr().err
    assert not (out / "images").exists() and _digests(out)["train.parquet"] != first["train.parquet"]
    (out / "notes.txt").write_text("mine")
    assert main([*argv, "--overwrite"]) == 1
    assert "notes.txt, which `boogu-data scenes` did not write" in capsys.readouterr().err
    assert (out / "notes.txt").read_text() == "mine"
    other = tmp_path / "other"
    other.mkdir()
    (other / "data.txt").write_text("keep")
    assert main(["scenes", "--output-dir", str(other), "--overwrite"]) == 1
    assert "not an earlier `boogu-data scenes` output" in capsys.readouterr().err
    assert [p.name for p in other.iterdir()] == ["data.txt"]
    blocker = tmp_path / "file"
    blocker.write_text("x")
    assert main(["scenes", "--output-dir", str(blocker)]) == 1
    assert "is a file, not a folder" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["file", "o", "other"], "no temporary is left"


def test_overwrite_refuses_files_nested_in_an_earlier_output(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # Issue 49 item 12: only top-level names were checked, so images/mine/fav.png was deleted.
    out = tmp_path / "o"
    argv = ["scenes", "--output-dir", str(out), "--count", "3", "--val-count", "1", "--test-count", "1"]
    assert main(argv) == 0
    capsys.readouterr()
    (out / "images" / "mine").mkdir()
    (out / "images" / "mine" / "fav.png").write_bytes(b"my favourite")
    before = _digests(out)
    assert main([*argv, "--seed", "9", "--overwrite"]) == 1
    err = capsys.readouterr().err
    assert "holds images/mine/fav.png, which `boogu-data scenes` did not write" in err
    assert "nothing was deleted" in err and _digests(out) == before
    # A file the command wrote but the user changed is theirs now, and so is an empty folder they made.
    (out / "images" / "mine" / "fav.png").unlink()
    (out / "images" / "mine").rmdir()
    (out / "images" / "train" / "00001.png").write_bytes(b"edited by hand")
    assert main([*argv, "--overwrite"]) == 1
    assert (
        "images/train/00001.png, which changed since `boogu-data scenes` wrote it" in capsys.readouterr().err
    )
    assert (out / "images" / "train" / "00001.png").read_bytes() == b"edited by hand"
    (out / "images" / "train" / "00001.png").unlink()
    (out / "images" / "mine").mkdir()
    assert main([*argv, "--overwrite"]) == 1
    assert "images/mine/, an empty folder `boogu-data scenes` did not make" in capsys.readouterr().err
    (out / "images" / "mine").rmdir()
    # With only its own files left (one missing is fine), the earlier output is replaced.
    assert main([*argv, "--seed", "9", "--overwrite"]) == 0
    assert json.loads((out / MARKER).read_text())["seed"] == 9
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"], "no temporary is left"


def test_overwrite_of_a_version_1_output_allows_only_the_names_it_wrote(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "o"
    argv = ["scenes", "--output-dir", str(out), "--count", "2", "--val-count", "1", "--test-count", "1"]
    assert main(argv) == 0
    marker = json.loads((out / MARKER).read_text())
    marker.pop("files", None)  # what version 1 wrote: no file list
    marker["version"] = 1
    (out / MARKER).write_text(json.dumps(marker))
    (out / "images" / "train" / "00002.png").write_bytes(b"beyond its count of 2: not its own")
    assert main([*argv, "--overwrite"]) == 1
    assert "holds images/train/00002.png, which `boogu-data scenes` did not write" in capsys.readouterr().err
    (out / "images" / "train" / "00002.png").unlink()
    assert main([*argv, "--overwrite"]) == 0
    assert json.loads((out / MARKER).read_text())["version"] == 2


def test_counts_are_bounded_up_front(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    # Issue 49 item 8: --count 100000000000 drew scenes until memory ran out. Any draw now fails the
    # test at once, instead of hanging it.
    import boogu_data.scene_edits
    import boogu_data.scenes

    def no_draw(*args, **kwargs):
        raise AssertionError("a scene was drawn before the count was checked")

    monkeypatch.setattr(boogu_data.scenes, "sample_scene", no_draw)
    monkeypatch.setattr(boogu_data.scene_edits, "sample_edit", no_draw)
    out = tmp_path / "o"
    for extra, flag in (([], "--count"), (["--edits"], "--count"), (["--edits"], "--val-count")):
        argv = ["scenes", "--output-dir", str(out), *extra, flag, "100000000000"]
        assert main(argv) == 2
        assert capsys.readouterr().err == (
            f"boogu-data scenes: error: {flag} must be an int from 1 to {MAX_COUNT} {WHY_MAX}, got 100000000000\n"
        )
    assert list(tmp_path.iterdir()) == [], "no output and no staging folder"
    for call in (generate_scenes, boogu_data.scene_edits.generate_edits):
        with pytest.raises(ValueError, match=f"count must be an int from 0 to {MAX_COUNT}"):
            call(0, "train", MAX_COUNT + 1)


def test_a_killed_runs_staging_folder_is_removed_first(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    import socket
    import subprocess

    process = subprocess.Popen(["true"])
    process.wait()  # its pid is now dead: the owner of the staging folder below
    host = "".join(c if c.isalnum() or c in "._" else "_" for c in socket.gethostname())
    leftover = tmp_path / f".o.tmp-{host}-{process.pid}-0123abcd"
    (leftover / "images" / "train").mkdir(parents=True)
    (leftover / "train.parquet").write_bytes(b"half written")
    argv = [
        "scenes",
        "--output-dir",
        str(tmp_path / "o"),
        "--count",
        "2",
        "--val-count",
        "1",
        "--test-count",
        "1",
    ]
    assert main(argv) == 0
    assert f"removed {leftover}, left behind by a killed run" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["o"]
