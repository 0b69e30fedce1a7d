"""The pretrained tiny checkpoint: its build (a smoke build, twice: deterministic) and the committed files.

The full build (`uv run boogu-tiny-pretrain --output-dir DIR`, ~30 min on 2 cores) is not run here;
its figures are in the committed `pretrain_report.json` and the README.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
from pathlib import Path

import pytest

from boogu_tiny.checkpoints import (
    MARKER_NAME,
    TRAINED_ASSETS,
    AssetError,
    ensure_trained_checkpoint,
    is_complete_tiny_checkpoint,
    save_trained_assets,
    verify_trained_assets,
)
from boogu_tiny.checkpoints import (
    main as tiny_main,
)


def _weights_digest(folder: Path) -> str:
    digest = hashlib.sha256()
    for path in sorted(folder.rglob("*.safetensors")):
        digest.update(path.relative_to(folder).as_posix().encode())
        digest.update(path.read_bytes())
    return digest.hexdigest()


@pytest.fixture(scope="module")
def quick_builds(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, Path, dict]:
    from boogu_tiny.scenes_pretrain import PretrainConfig, pretrain

    root = tmp_path_factory.mktemp("pretrain")
    lines: list[str] = []
    report = pretrain(root / "a", PretrainConfig.quick(), log=lines.append)
    pretrain(root / "b", PretrainConfig.quick(), log=lambda _: None)
    assert any(line.startswith("vae step") for line in lines) and any(
        "transformer step" in line for line in lines
    )
    return root / "a", root / "b", report


def test_a_smoke_build_runs_every_stage_and_writes_a_loadable_checkpoint(quick_builds) -> None:
    from boogu_adapters.loading import load_boogu
    from boogu_tiny.scenes_pretrain import PretrainConfig, transformer_config

    folder, _, report = quick_builds
    assert is_complete_tiny_checkpoint(folder)
    assert (folder / "samples.png").is_file()
    assert json.loads((folder / "pretrain_report.json").read_text()) == json.loads(json.dumps(report))
    assert set(report["scores"]) == {"unseen", "val", "test"}
    for split in ("unseen", "val", "test"):
        scores = report["scores"][split]
        assert scores["prompts"] == 8 and 0.0 <= scores["scene_exact"] <= scores["scene_dense"] <= 1.0
    parts = load_boogu(folder, transformer="native")
    expected = transformer_config(PretrainConfig())
    assert expected["hidden_size"] == PretrainConfig().hidden_size
    assert {k: v for k, v in dict(parts.transformer.config).items() if k in expected} == {
        k: (list(v) if isinstance(v, tuple) else v) for k, v in expected.items()
    }
    assert report["vae"]["val_psnr_db"] > 0
    assert report["transformer"]["parameters"] == sum(p.numel() for p in parts.transformer.parameters())
    # The checkpoint's own schedule: the static v1 shift at the configured seq_len.
    assert parts.schedule_config.seq_len == PretrainConfig().schedule_seq_len
    # The VAE's factors standardise the train latents (set from them, not the FLUX constants).
    assert parts.vae.config.scaling_factor == pytest.approx(report["vae"]["scaling_factor"])
    assert parts.vae.config.shift_factor == pytest.approx(report["vae"]["shift_factor"])
    # The transformer was trained: its zero-initialised output head moved.
    assert (
        parts.transformer.state_dict()[next(k for k in parts.transformer.state_dict() if "norm_out" in k)]
        .abs()
        .sum()
        > 0
    )


def test_vae_crops_are_aligned_windows_of_the_batch() -> None:
    import torch

    from boogu_schedule import make_generator
    from boogu_tiny.scenes_pretrain import _crop

    images = torch.arange(2 * 3 * 128 * 128).reshape(2, 3, 128, 128)
    generator = make_generator(0)
    corners = set()
    for _ in range(40):
        window = _crop(images, 64, generator)
        assert window.shape == (2, 3, 64, 64)
        top, left = divmod(int(window[0, 0, 0, 0]), 128)
        assert top % 8 == 0 and left % 8 == 0 and top <= 64 and left <= 64
        assert torch.equal(window, images[..., top : top + 64, left : left + 64])
        corners.add((top, left))
    assert len(corners) > 20  # the windows move
    assert _crop(images[..., :64, :64], 64, generator).shape == (2, 3, 64, 64)  # no room: whole image


def test_the_build_is_deterministic(quick_builds) -> None:
    a, b, _ = quick_builds
    assert _weights_digest(a) == _weights_digest(b)
    drop = lambda r: {k: v for k, v in r.items() if k != "minutes"}  # noqa: E731
    assert drop(json.loads((a / "pretrain_report.json").read_text())) == drop(
        json.loads((b / "pretrain_report.json").read_text())
    )


def test_a_folder_it_did_not_write_is_refused(tmp_path: Path) -> None:
    from boogu_tiny.scenes_pretrain import PretrainConfig, pretrain

    (tmp_path / "mine.txt").write_text("keep me")
    with pytest.raises(FileExistsError, match="not a boogu-tiny-pretrain output"):
        pretrain(tmp_path, PretrainConfig.quick(), log=lambda _: None)
    assert (tmp_path / "mine.txt").read_text() == "keep me"


def test_an_earlier_build_is_replaced_only_when_nothing_else_is_in_it(quick_builds, tmp_path: Path) -> None:
    from boogu_tiny.scenes_pretrain import REPORT_NAME, PretrainConfig, check_output_folder, pretrain

    folder, _, report = quick_builds
    assert "samples.png" in report["files"] and REPORT_NAME not in report["files"]
    copy = tmp_path / "copy"
    shutil.copytree(folder, copy)
    check_output_folder(copy, REPORT_NAME, "boogu-tiny-pretrain")  # an earlier build, file for file
    # A file of the user's deep inside an earlier build: refused before any work, nothing touched.
    (copy / "transformer" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match=r"transformer/notes\.txt"):
        pretrain(copy, PretrainConfig.quick(), log=lambda _: None)
    assert (copy / "transformer" / "notes.txt").read_text() == "mine"
    (copy / "transformer" / "notes.txt").unlink()
    # A build's file changed since: also not the command's to replace.
    with (copy / "samples.png").open("ab") as f:
        f.write(b"x")
    with pytest.raises(FileExistsError, match=r"samples\.png"):
        check_output_folder(copy, REPORT_NAME, "boogu-tiny-pretrain")
    # A report without the file list (an older build) cannot vouch for the rest of the folder.
    older = json.loads((copy / REPORT_NAME).read_text())
    del older["files"]
    (copy / REPORT_NAME).write_text(json.dumps(older))
    with pytest.raises(FileExistsError, match="lists no files"):
        check_output_folder(copy, REPORT_NAME, "boogu-tiny-pretrain")


def test_evaluate_scores_a_built_checkpoint_without_building(quick_builds, capsys) -> None:
    from boogu_tiny.scenes_pretrain import main

    folder, _, report = quick_builds
    assert main(["--quick", "--evaluate", str(folder)]) == 0
    printed = json.loads(capsys.readouterr().out)
    assert printed == json.loads(json.dumps(report["scores"]))  # the same samples, the same scores
    assert main(["--quick"]) == 2 and "--output-dir is required" in capsys.readouterr().err


def test_overrides_name_the_field() -> None:
    from boogu_tiny.scenes_pretrain import main

    with pytest.raises(SystemExit):
        main(["--output-dir", "x", "--set"])
    assert main(["--output-dir", "x", "--set", "no_such=1"]) == 2


def test_the_committed_files_match_their_manifest() -> None:
    manifest = verify_trained_assets()
    names = set(manifest["files"])
    assert {
        "transformer/config.json",
        "vae/config.json",
        "mllm/model.safetensors",
        "pretrain_report.json",
    } <= names
    assert not any(name.endswith(".py") for name in names)


def test_trained_install_is_a_verified_copy_that_loads(tmp_path: Path) -> None:
    from boogu_adapters.loading import load_boogu

    target = ensure_trained_checkpoint(tmp_path / "ckpt")
    assert is_complete_tiny_checkpoint(target)
    marker = json.loads((target / MARKER_NAME).read_text())
    assert (
        marker["trained_assets"]
        == hashlib.sha256((TRAINED_ASSETS / "manifest.json").read_bytes()).hexdigest()
    )
    parts = load_boogu(target, transformer="native")
    reference = json.loads((TRAINED_ASSETS / "pretrain_report.json").read_text())
    assert parts.vae.config.scaling_factor == pytest.approx(reference["vae"]["scaling_factor"])
    # Same files again: kept, not rewritten.
    stamp = (target / MARKER_NAME).stat().st_mtime_ns
    assert ensure_trained_checkpoint(tmp_path / "ckpt") == target
    assert (target / MARKER_NAME).stat().st_mtime_ns == stamp
    # The CLI installs it too, and refuses options that would change what the transformer reads.
    assert tiny_main(["--trained", "--output-dir", str(tmp_path / "cli")]) == 0
    assert is_complete_tiny_checkpoint(tmp_path / "cli")
    assert tiny_main(["--trained", "--seed", "3", "--output-dir", str(tmp_path / "bad")]) == 2
    assert not (tmp_path / "bad").exists()


def test_a_changed_committed_file_is_named_and_nothing_is_installed(tmp_path: Path) -> None:
    assets = tmp_path / "assets"
    shutil.copytree(TRAINED_ASSETS, assets)
    with (assets / "vae" / "config.json").open("a") as f:
        f.write(" ")
    (assets / "extra.bin").write_bytes(b"x")
    (assets / "processor" / "tokenizer.json").unlink()
    with pytest.raises(AssetError) as error:
        ensure_trained_checkpoint(tmp_path / "ckpt", assets=assets)
    message = str(error.value)
    assert "vae/config.json: sha256" in message
    assert "extra.bin: present but not in the manifest" in message
    assert "processor/tokenizer.json: listed in the manifest but missing" in message
    assert not (tmp_path / "ckpt").exists()


def test_a_foreign_folder_is_never_replaced(tmp_path: Path) -> None:
    (tmp_path / "ckpt").mkdir()
    (tmp_path / "ckpt" / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="refusing to replace it"):
        ensure_trained_checkpoint(tmp_path / "ckpt")
    assert (tmp_path / "ckpt" / "notes.txt").read_text() == "mine"


def test_save_assets_round_trips(quick_builds, tmp_path: Path) -> None:
    folder, _, _ = quick_builds
    assets = save_trained_assets(folder, tmp_path / "assets")
    manifest = verify_trained_assets(assets)
    assert "pretrain_report.json" in manifest["files"]
    installed = ensure_trained_checkpoint(tmp_path / "ckpt", assets=assets)
    assert _weights_digest(installed) == _weights_digest(folder)
    with pytest.raises(FileNotFoundError, match="not a finished boogu-tiny-pretrain output"):
        save_trained_assets(tmp_path / "nothing", tmp_path / "assets2")


def test_the_edit_smoke_build_trains_the_refiner_and_keeps_the_rest(quick_builds, tmp_path: Path) -> None:
    # The Edit fine-tune (boogu-tiny-edit-pretrain) from a T2I build: the reference latents reach the
    # transformer through the reference-image refiner (whose weights the T2I build never trained),
    # the VAE and the text side stay the base's byte for byte, and the build is deterministic.
    from safetensors.torch import load_file

    from boogu_adapters.loading import load_boogu
    from boogu_tiny.edit_pretrain import EditPretrainConfig, edit_pretrain
    from boogu_tiny.edit_pretrain import main as edit_main

    base, _, _ = quick_builds
    lines: list[str] = []
    report = edit_pretrain(tmp_path / "a", EditPretrainConfig.quick(str(base)), log=lines.append)
    assert any(line.startswith("transformer step 3/3") for line in lines)
    assert set(report["scores"]) == {"unseen", "val", "test"} and "t2i_base_val" in report
    assert edit_main(["--quick", "--base", str(base), "--output-dir", str(tmp_path / "b")]) == 0
    assert _weights_digest(tmp_path / "a") == _weights_digest(tmp_path / "b")

    def tensors(folder: Path) -> dict:
        return {
            k: v
            for p in sorted((folder / "transformer").glob("*.safetensors"))
            for k, v in load_file(p).items()
        }

    before, after = tensors(base), tensors(tmp_path / "a")
    assert before.keys() == after.keys()
    moved = {k for k in before if not (before[k] == after[k]).all()}
    assert any(k.startswith("ref_image_refiner.") for k in moved) and any(
        k.startswith("context_refiner.") for k in moved
    )
    for sub in ("vae", "mllm", "processor", "scheduler"):
        for path in sorted((base / sub).rglob("*")):
            if path.is_file():
                assert (
                    path.read_bytes() == (tmp_path / "a" / sub / path.relative_to(base / sub)).read_bytes()
                ), path
    assert load_boogu(tmp_path / "a", transformer="native").transformer is not None
    assert (
        edit_main(["--quick", "--base", str(base), "--output-dir", str(tmp_path / "c"), "--set", "nope=1"])
        == 2
    )


def test_edit_assets_keep_only_what_the_edit_build_changed_and_install_on_their_base(
    quick_builds, tmp_path: Path
) -> None:
    """``save_trained_edit_assets`` stores the Edit build's transformer, report and samples and names
    the base assets it was built on; ``ensure_trained_edit_checkpoint`` (``boogu-tiny --trained
    --edit``) installs the base's text encoder, VAE, processor and scheduler with them."""
    from boogu_adapters.loading import load_boogu
    from boogu_tiny.checkpoints import (
        ensure_trained_edit_checkpoint,
        save_trained_edit_assets,
    )
    from boogu_tiny.edit_pretrain import EditPretrainConfig, edit_pretrain

    base, _, _ = quick_builds
    base_assets = save_trained_assets(base, tmp_path / "base_assets")
    build = tmp_path / "edit_build"
    edit_pretrain(build, EditPretrainConfig.quick(str(base)), log=lambda _: None)
    # The build loaded its base from disk; its saved config must not name that machine's folder.
    assert "_name_or_path" not in json.loads((build / "transformer" / "config.json").read_text())
    assets = save_trained_edit_assets(build, tmp_path / "edit_assets", base_assets=base_assets)
    manifest = verify_trained_assets(assets)
    assert set(manifest["files"]) == {
        "edit_pretrain_report.json",
        "samples.png",
        *(f"transformer/{p.name}" for p in (build / "transformer").iterdir() if p.suffix != ".py"),
    }
    assert (
        manifest["base_manifest"] == hashlib.sha256((base_assets / "manifest.json").read_bytes()).hexdigest()
    )

    target = ensure_trained_edit_checkpoint(tmp_path / "ckpt", assets=assets, base_assets=base_assets)
    assert is_complete_tiny_checkpoint(target)
    assert json.loads((target / MARKER_NAME).read_text())["kind"] == "trained_edit"
    assert _weights_digest(target / "transformer") == _weights_digest(build / "transformer")
    assert _weights_digest(target / "vae") == _weights_digest(base / "vae")
    assert not (target / "pretrain_report.json").exists() and (target / "edit_pretrain_report.json").is_file()
    assert load_boogu(target, transformer="native").transformer is not None
    stamp = (target / MARKER_NAME).stat().st_mtime_ns
    assert ensure_trained_edit_checkpoint(target, assets=assets, base_assets=base_assets) == target
    assert (target / MARKER_NAME).stat().st_mtime_ns == stamp  # complete: kept
    with pytest.raises(
        FileExistsError, match=r"holds the pretrained tiny Edit checkpoint \(boogu-tiny --trained --edit\)"
    ):
        ensure_trained_checkpoint(target, assets=base_assets)

    # Edit assets installed over other base assets: the transformer read other features.
    other = shutil.copytree(base, tmp_path / "other_base")
    with open(other / "pretrain_report.json", "a") as f:
        f.write(" ")  # another build's report: other base assets
    other_assets = save_trained_assets(other, tmp_path / "other_base_assets")
    with pytest.raises(AssetError, match="built on the base assets"):
        ensure_trained_edit_checkpoint(tmp_path / "ckpt2", assets=assets, base_assets=other_assets)
    assert not (tmp_path / "ckpt2").exists()

    # A build whose VAE is not the base's did not start from these base assets: refused, by name.
    with open(build / "vae" / "config.json", "a") as f:
        f.write(" ")
    with pytest.raises(AssetError, match=r"\['vae/config.json'\] differ from the base assets"):
        save_trained_edit_assets(build, tmp_path / "edit_assets2", base_assets=base_assets)
    assert not (tmp_path / "edit_assets2").exists()
    with pytest.raises(FileNotFoundError, match="not a finished boogu-tiny-edit-pretrain output"):
        save_trained_edit_assets(base, tmp_path / "edit_assets3", base_assets=base_assets)
    assert tiny_main(["--edit", "--output-dir", str(tmp_path / "cli")]) == 2  # --edit needs --trained
    assert not (tmp_path / "cli").exists()


def test_the_committed_edit_checkpoint_matches_its_manifest_and_installs(tmp_path: Path) -> None:
    """The committed tiny Edit checkpoint: its files match their manifest, it was built on the
    committed base (``base_manifest``), and ``boogu-tiny --trained --edit`` installs a loadable
    checkpoint whose report says what the build reached (the README's and docs/tiny-model.md's figures)."""
    from boogu_adapters.loading import load_boogu
    from boogu_tiny.checkpoints import TRAINED_EDIT_ASSETS

    manifest = verify_trained_assets(TRAINED_EDIT_ASSETS)
    assert (
        manifest["base_manifest"]
        == hashlib.sha256((TRAINED_ASSETS / "manifest.json").read_bytes()).hexdigest()
    )
    assert tiny_main(["--trained", "--edit", "--output-dir", str(tmp_path / "edit")]) == 0
    target = tmp_path / "edit"
    assert json.loads((target / MARKER_NAME).read_text())["kind"] == "trained_edit"
    parts = load_boogu(target, transformer="native")
    assert parts.transformer is not None and parts.vae.config.sample_size == 64
    report = json.loads((target / "edit_pretrain_report.json").read_text())
    assert report["config"]["seed"] == 0 and report["config"]["layout"] == "grid"
    assert report["scores"]["unseen"]["scene_edit_exact"] >= 0.3  # the target for the base
    # No committed file names a folder of the machine that built it (a clone elsewhere has none).
    for assets in (TRAINED_ASSETS, TRAINED_EDIT_ASSETS):
        for path in sorted(assets.rglob("*.json")):
            text = path.read_text(encoding="utf-8")
            assert "_name_or_path" not in text, path
            absolute = [v for v in _json_strings(json.loads(text)) if ABSOLUTE_PATH.match(v)]
            assert not absolute, (path, absolute)


ABSOLUTE_PATH = re.compile(r"^(?:/[\w.-]+|[A-Za-z]:\\[\w.-]+)[/\\][\w.-]")
"""A string that names a folder of one machine: ``/x/y`` or ``C:\\x\\y`` (``~/x``, a default folder under
any user's home, is portable; a tokenizer's ``/`` token is no path)."""


def _json_strings(value):
    """Every string in a parsed JSON document (keys and values)."""
    if isinstance(value, str):
        yield value
    elif isinstance(value, dict):
        for k, v in value.items():
            yield k
            yield from _json_strings(v)
    elif isinstance(value, list):
        for v in value:
            yield from _json_strings(v)
