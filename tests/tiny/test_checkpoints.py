"""The tiny random checkpoint builder: layout, idempotence, force, verbatim copies, atomicity."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from boogu_adapters.loading import load_boogu, load_processor, load_schedule_config
from boogu_adapters.model import get_freqs_cis
from boogu_tiny import checkpoints as tiny
from boogu_tiny.checkpoints import (
    DEFAULT_SEED,
    MARKER_NAME,
    ensure_tiny_checkpoint,
    is_complete_tiny_checkpoint,
    main,
    write_text_side,
)


def _tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _leftovers(target: Path) -> list[str]:
    """Hidden staging or retired siblings a build may have left next to ``target``."""
    return sorted(p.name for p in target.parent.iterdir() if p.name.startswith(f".{target.name}."))


def _fake_source(root: Path, processor_from: Path) -> Path:
    """A Boogu snapshot stand-in: real-looking processor/, a scheduler config with keys a
    diffusers round trip would not keep, and weight shards that are not loadable at all."""
    shutil.copytree(processor_from, root / "processor")
    (root / "processor" / "NOTICE").write_text("copied verbatim\n")
    (root / "scheduler").mkdir(parents=True)
    (root / "scheduler" / "scheduler_config.json").write_text(
        '{"_class_name": "FlowMatchEulerDiscreteScheduler", "_diffusers_version": "0.35.2",\n'
        ' "do_shift": true, "dynamic_time_shift": false, "num_train_timesteps": 1000,\n'
        ' "seq_len": 4096, "time_shift_version": "v1", "time_shift_v2_half_scaling_factor": 30.0,\n'
        ' "boogu_only": {"kept": [1, 2, 3]}}'
    )
    (root / "scheduler" / "scheduling_flow_match_euler_discrete_time_shifting.py").write_text(
        "# upstream shim\n"
    )
    (root / "transformer").mkdir()
    (root / "transformer" / "diffusion_pytorch_model-00001-of-00003.safetensors").write_bytes(
        b"not a tensor file"
    )
    (root / "mllm").mkdir()
    (root / "mllm" / "model-00001-of-00004.safetensors").write_bytes(b"not a tensor file")
    return root


def test_layout(tiny_checkpoint: Path) -> None:
    assert is_complete_tiny_checkpoint(tiny_checkpoint)
    index = json.loads((tiny_checkpoint / "model_index.json").read_text())
    assert index["_class_name"] == "BooguImagePipeline"
    assert index["transformer"] == ["transformer_boogu", "BooguImageTransformer2DModel"]
    assert index["vae"] == ["diffusers", "AutoencoderKL"]
    assert index["mllm"] == ["transformers", "Qwen3VLForConditionalGeneration"]
    assert index["scheduler"] == [
        "scheduling_flow_match_euler_discrete_time_shifting",
        "FlowMatchEulerDiscreteScheduler",
    ]

    transformer = tiny_checkpoint / "transformer"
    config = json.loads((transformer / "config.json").read_text())
    assert config["auto_map"] == {"AutoModel": "transformer_boogu.BooguImageTransformer2DModel"}
    shim = (transformer / "transformer_boogu.py").read_text()
    assert "from boogu.models.transformers.transformer_boogu import BooguImageTransformer2DModel" in shim
    assert "from boogu_adapters.model import BooguImageTransformer2DModel" in shim
    weight_map = json.loads((transformer / "diffusion_pytorch_model.safetensors.index.json").read_text())[
        "weight_map"
    ]
    assert len(set(weight_map.values())) >= 2  # sharded, like the release

    # The Qwen3-VL text width is the transformer's instruction feature width.
    mllm = json.loads((tiny_checkpoint / "mllm" / "config.json").read_text())
    assert mllm["text_config"]["hidden_size"] == config["instruction_feature_configs"]["instruction_feat_dim"]

    vae = json.loads((tiny_checkpoint / "vae" / "config.json").read_text())
    assert (vae["latent_channels"], len(vae["block_out_channels"])) == (16, 4)
    assert (vae["scaling_factor"], vae["shift_factor"]) == (0.3611, 0.1159)

    scheduler = json.loads((tiny_checkpoint / "scheduler" / "scheduler_config.json").read_text())
    assert scheduler == {
        "_class_name": "FlowMatchEulerDiscreteScheduler",
        "_diffusers_version": "0.35.2",
        "do_shift": True,
        "dynamic_time_shift": False,
        "num_train_timesteps": 1000,
        "seq_len": 4096,
        "time_shift_version": "v1",
    }


def test_builds_fast(tiny_build: tuple[Path, float]) -> None:
    assert tiny_build[1] < 20.0


def test_weights_are_random_and_outputs_non_zero(tiny_parts) -> None:
    transformer = tiny_parts.transformer
    # Upstream zero-initialises adaLN and the output head; the builder randomises them.
    zero = [name for name, p in transformer.named_parameters() if not p.detach().abs().sum() > 0]
    assert zero == []
    latents = torch.randn(1, 16, 8, 8, generator=torch.Generator().manual_seed(0))
    features = torch.randn(1, 5, transformer.config.instruction_feature_configs["instruction_feat_dim"])
    freqs = get_freqs_cis(transformer.config.axes_dim_rope, transformer.config.axes_lens, 10000)
    with torch.no_grad():
        velocity = transformer(
            latents, torch.tensor([0.5]), features, freqs, torch.ones(1, 5, dtype=torch.int64)
        )
    assert velocity.shape == latents.shape
    assert velocity.abs().mean() > 1e-3


def test_fabricated_processor_has_the_released_layout(tiny_checkpoint: Path) -> None:
    """processor/ holds a stock Qwen3VLProcessor's files and no remote code (what upstream's loader reads)."""
    from transformers.models.qwen3_vl.video_processing_qwen3_vl import Qwen3VLVideoProcessor

    folder = tiny_checkpoint / "processor"
    assert sorted(p.name for p in folder.iterdir()) == [
        "chat_template.jinja",
        "preprocessor_config.json",
        "tokenizer.json",
        "tokenizer_config.json",
        "video_preprocessor_config.json",
    ]
    configs = {
        name: json.loads((folder / name).read_text())
        for name in ("preprocessor_config.json", "video_preprocessor_config.json", "tokenizer_config.json")
    }
    assert {c["processor_class"] for c in configs.values()} == {"Qwen3VLProcessor"}
    assert not any("auto_map" in c for c in configs.values())
    assert configs["preprocessor_config.json"]["image_processor_type"] == "Qwen2VLImageProcessor"
    assert configs["video_preprocessor_config.json"]["video_processor_type"] == "Qwen3VLVideoProcessor"
    # The stock video processor class reads its config back (it needs torchvision only to process videos).
    video = Qwen3VLVideoProcessor.from_pretrained(str(folder), local_files_only=True)
    assert (video.patch_size, video.temporal_patch_size, video.merge_size) == (16, 2, 2)
    assert json.loads((tiny_checkpoint / "model_index.json").read_text())["processor"] == [
        "transformers",
        "Qwen3VLProcessor",
    ]


def test_fabricated_tokenizer_round_trips(tiny_checkpoint: Path) -> None:
    processor = load_processor(tiny_checkpoint)
    text = 'a sign that says "OPEN", ünïcödé 文字'
    ids = processor.tokenizer(text)["input_ids"]
    assert processor.tokenizer.decode(ids) == text
    specials = [
        "<|endoftext|>",
        "<|im_start|>",
        "<|im_end|>",
        "<|vision_start|>",
        "<|image_pad|>",
        "<|vision_end|>",
    ]
    assert all(len(processor.tokenizer(s)["input_ids"]) == 1 for s in specials)


def test_write_text_side_adds_words_and_keeps_the_random_build_otherwise(
    tiny_checkpoint: Path, checkpoint_copy: Path
) -> None:
    # No extra corpus: byte for byte the random build's text side (the seed is the build's seed + 2).
    write_text_side(checkpoint_copy, seed=DEFAULT_SEED + 2)
    for name in ("processor/tokenizer.json", "mllm/config.json"):
        assert (checkpoint_copy / name).read_bytes() == (tiny_checkpoint / name).read_bytes()
    before = _tensors(tiny_checkpoint / "mllm")
    after = _tensors(checkpoint_copy / "mllm")
    assert set(after) == set(before) and all(torch.equal(after[k], before[k]) for k in before)

    write_text_side(checkpoint_copy, seed=DEFAULT_SEED + 2, corpus=["a green triangle", "a yellow square"])
    tokenizer = load_processor(checkpoint_copy).tokenizer
    assert [tokenizer.decode([i]) for i in tokenizer("a green triangle")["input_ids"]] == [
        "a",
        " green",
        " triangle",
    ]
    assert len(load_processor(tiny_checkpoint).tokenizer("a green triangle")["input_ids"]) > 3
    # The text encoder's table follows the new vocabulary; the folder still loads as a whole.
    config = json.loads((checkpoint_copy / "mllm" / "config.json").read_text())
    assert config["text_config"]["vocab_size"] == len(tokenizer)
    parts = load_boogu(checkpoint_copy, transformer="native")
    assert parts.text_encoder.get_input_embeddings().num_embeddings == len(tokenizer)


def test_is_idempotent(tiny_checkpoint: Path) -> None:
    before = {p: p.stat().st_mtime_ns for p in tiny_checkpoint.rglob("*") if p.is_file()}
    assert ensure_tiny_checkpoint(tiny_checkpoint) == tiny_checkpoint
    after = {p: p.stat().st_mtime_ns for p in tiny_checkpoint.rglob("*") if p.is_file()}
    assert after == before


def test_force_rebuilds_deterministically(checkpoint_copy: Path) -> None:
    before = _tensors(checkpoint_copy / "transformer")
    marker_inode = (checkpoint_copy / MARKER_NAME).stat().st_ino
    assert ensure_tiny_checkpoint(checkpoint_copy, force=True) == checkpoint_copy
    assert (checkpoint_copy / MARKER_NAME).stat().st_ino != marker_inode  # really rebuilt
    assert is_complete_tiny_checkpoint(checkpoint_copy)
    after = _tensors(checkpoint_copy / "transformer")
    assert set(after) == set(before)
    assert all(torch.equal(after[name], before[name]) for name in before)  # same seed, same weights
    assert _leftovers(checkpoint_copy) == []

    ensure_tiny_checkpoint(checkpoint_copy, force=True, seed=7)
    reseeded = _tensors(checkpoint_copy / "transformer")
    assert not all(torch.equal(reseeded[name], before[name]) for name in before)


@pytest.mark.parametrize("via", ["argument", "environment"])
def test_copies_processor_and_scheduler_verbatim(
    via: str, tiny_checkpoint: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _fake_source(tmp_path / "snapshot", tiny_checkpoint / "processor")
    target = tmp_path / "out" / "Boogu-Image"
    if via == "environment":
        monkeypatch.setenv("SOURCE_MODEL", str(source))
        ensure_tiny_checkpoint(target)
    else:
        monkeypatch.delenv("SOURCE_MODEL", raising=False)
        ensure_tiny_checkpoint(target, source_model=source)

    for folder in ("processor", "scheduler"):
        copied = sorted(p.relative_to(target / folder) for p in (target / folder).rglob("*"))
        original = sorted(p.relative_to(source / folder) for p in (source / folder).rglob("*"))
        assert copied == original
        for relative in original:
            if (source / folder / relative).is_file():
                assert (target / folder / relative).read_bytes() == (source / folder / relative).read_bytes()
    # The source's weight shards were neither read (they are garbage) nor copied.
    assert b"not a tensor file" not in b"".join(p.read_bytes() for p in target.rglob("*.safetensors"))
    # Keys that only the Boogu scheduler knows, and a key nobody models, reach the loader.
    schedule = load_schedule_config(target)
    assert schedule.time_shift_v2_half_scaling_factor == 30.0
    assert schedule.extra["boogu_only"] == {"kept": [1, 2, 3]}
    assert json.loads((target / MARKER_NAME).read_text())["source_model"] == str(source.absolute())


def test_bad_source_model(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    with pytest.raises(FileNotFoundError, match="not a local folder"):
        ensure_tiny_checkpoint(tmp_path / "a", source_model=tmp_path / "nowhere")
    (tmp_path / "snapshot" / "processor").mkdir(parents=True)
    with pytest.raises(FileNotFoundError, match=r"missing scheduler/scheduler_config\.json"):
        ensure_tiny_checkpoint(tmp_path / "b", source_model=tmp_path / "snapshot")
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()
    # A hub id in SOURCE_MODEL (the reference integration's default) is not a folder: fabricate.
    monkeypatch.setenv("SOURCE_MODEL", "Boogu/Boogu-Image-0.1-Base")
    assert is_complete_tiny_checkpoint(ensure_tiny_checkpoint(tmp_path / "c"))
    assert "not a local folder" in caplog.text


def test_failure_leaves_nothing_that_passes_as_complete(
    tmp_path: Path, checkpoint_copy: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    def crash(*args, **kwargs):
        raise RuntimeError("injected failure")

    monkeypatch.setattr(tiny, "_write_vae", crash)
    target = tmp_path / "fresh" / "Boogu-Image"
    with pytest.raises(RuntimeError, match="injected failure"):
        ensure_tiny_checkpoint(target)
    assert not target.exists()
    assert _leftovers(target) == []

    # A forced rebuild that fails keeps the previous checkpoint, untouched.
    before = {p: p.read_bytes() for p in checkpoint_copy.rglob("*") if p.is_file()}
    with pytest.raises(RuntimeError, match="injected failure"):
        ensure_tiny_checkpoint(checkpoint_copy, force=True)
    assert {p: p.read_bytes() for p in checkpoint_copy.rglob("*") if p.is_file()} == before
    assert _leftovers(checkpoint_copy) == []


def test_incomplete_folders(checkpoint_copy: Path, tmp_path: Path) -> None:
    # Everything but the marker (what a non-atomic builder could leave) is not complete...
    (checkpoint_copy / MARKER_NAME).unlink()
    assert not is_complete_tiny_checkpoint(checkpoint_copy)
    # ...and a folder the builder did not write is never replaced, not even with force.
    for force in (False, True):
        with pytest.raises(FileExistsError, match="refusing to replace it"):
            ensure_tiny_checkpoint(checkpoint_copy, force=force)
    assert (checkpoint_copy / "model_index.json").is_file()
    # An empty folder is simply filled.
    empty = tmp_path / "empty"
    empty.mkdir()
    assert is_complete_tiny_checkpoint(ensure_tiny_checkpoint(empty))


def test_default_path_expands_user(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("SOURCE_MODEL", raising=False)
    path = ensure_tiny_checkpoint()
    assert path == tmp_path / "models" / "tiny-random" / "Boogu-Image"
    assert is_complete_tiny_checkpoint(path)


def test_cli(tiny_checkpoint: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--output-dir", str(tiny_checkpoint)]) == 0
    assert capsys.readouterr().out.strip() == str(tiny_checkpoint)
    assert main(["--output-dir", str(tmp_path / "x"), "--source-model", str(tmp_path / "nowhere")]) == 2
    assert "not a local folder" in capsys.readouterr().err


# ---------------------------------------------------------------- what boogu-tiny keeps and replaces
# (issue 49 items 2, 3 and 10; the rule: boogu_data.atomic, docs/tiny-model.md)


def _files(folder: Path) -> dict[str, bytes]:
    return {
        p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()
    }


def _marker_of(folder: Path) -> dict:
    return json.loads((folder / MARKER_NAME).read_text())


def test_trained_over_a_random_build_asks_first_and_never_deletes_your_files(
    checkpoint_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (checkpoint_copy / "NOTES.txt").write_text("mine")
    (checkpoint_copy / "my_lora").mkdir()
    (checkpoint_copy / "my_lora" / "adapter_model.safetensors").write_bytes(b"my weights")
    before = _files(checkpoint_copy)
    argv = ["--trained", "--output-dir", str(checkpoint_copy)]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "holds the tiny random checkpoint (seed 42), not the pretrained tiny checkpoint" in err
    assert "Pass --force" in err and _files(checkpoint_copy) == before
    # --force replaces another model, but never a file boogu-tiny did not write.
    assert main([*argv, "--force"]) == 2
    err = capsys.readouterr().err
    assert "holds NOTES.txt, which boogu-tiny did not write (and 1 more such entries)" in err
    assert "nothing was deleted" in err and _files(checkpoint_copy) == before
    (checkpoint_copy / "NOTES.txt").unlink()
    assert main([*argv, "--force"]) == 2
    assert (
        "holds my_lora/adapter_model.safetensors, which boogu-tiny did not write" in capsys.readouterr().err
    )
    shutil.rmtree(checkpoint_copy / "my_lora")
    assert main([*argv, "--force"]) == 0
    assert _marker_of(checkpoint_copy)["kind"] == "trained"
    assert _leftovers(checkpoint_copy) == []


def test_a_folder_is_complete_only_when_it_holds_what_was_asked(
    checkpoint_copy: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    # A random build over a pretrained install: not "complete; nothing to do".
    trained = tiny.ensure_trained_checkpoint(tmp_path / "trained")
    installed = _files(trained)
    assert main(["--output-dir", str(trained)]) == 2
    assert (
        "holds the pretrained tiny checkpoint (boogu-tiny --trained), not the tiny random checkpoint (seed 42)"
        in (capsys.readouterr().err)
    )
    assert _files(trained) == installed
    # --seed 7 over a seed-42 build: refused without --force, rebuilt with it.
    with pytest.raises(
        FileExistsError, match=r"holds the tiny random checkpoint \(seed 42\), not the tiny random "
    ):
        ensure_tiny_checkpoint(checkpoint_copy, seed=7)
    assert _marker_of(checkpoint_copy)["seed"] == DEFAULT_SEED
    ensure_tiny_checkpoint(checkpoint_copy, seed=7, force=True)
    assert _marker_of(checkpoint_copy)["seed"] == 7
    assert ensure_tiny_checkpoint(checkpoint_copy, seed=7) == checkpoint_copy  # now complete


def test_every_installed_file_is_checked_and_a_changed_one_is_never_replaced(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    target = tiny.ensure_trained_checkpoint(tmp_path / "ckpt")
    shard = "transformer/diffusion_pytorch_model-00001-of-00003.safetensors"
    with (target / shard).open("r+b") as f:  # one byte of a weight, same size
        f.seek(4096)
        byte = f.read(1)
        f.seek(4096)
        f.write(bytes([byte[0] ^ 1]))
    tampered = _files(target)
    for force in (False, True):
        with pytest.raises(FileExistsError, match=f"holds {shard}, which changed since boogu-tiny wrote it"):
            tiny.ensure_trained_checkpoint(target, force=force)
        assert _files(target) == tampered
    # A listed file that is missing is simply put back (the folder is still boogu-tiny's own).
    with (target / shard).open("r+b") as f:
        f.seek(4096)
        f.write(byte)
    recorded = _marker_of(target)["files"]
    assert set(recorded) == {name for name in _files(target) if name != MARKER_NAME}
    (target / "vae" / "config.json").unlink()
    tiny.ensure_trained_checkpoint(target)
    assert "is not current (vae/config.json is missing); rebuilding it" in caplog.text
    assert (target / "vae" / "config.json").is_file() and _marker_of(target)["files"] == recorded


def test_markers_from_before_the_file_list(checkpoint_copy: Path, tmp_path: Path) -> None:
    # A pretrained install from before (like ~/models/tiny-scenes) is still complete: the committed
    # manifest says what its files are. It is kept as it is, and still checked.
    trained = tiny.ensure_trained_checkpoint(tmp_path / "trained")
    marker = _marker_of(trained)
    marker.pop("files", None), marker.pop("kind", None)
    (trained / MARKER_NAME).write_text(json.dumps(marker))
    stamp = (trained / MARKER_NAME).stat().st_mtime_ns
    assert tiny.ensure_trained_checkpoint(trained) == trained
    assert (trained / MARKER_NAME).stat().st_mtime_ns == stamp
    (trained / "vae" / "config.json").write_text("{}")
    with pytest.raises(
        FileExistsError, match=r"holds vae/config\.json, which changed since boogu-tiny wrote it"
    ):
        tiny.ensure_trained_checkpoint(trained)
    # A random build from before (builder version 3) is rebuilt; the layout's paths stand for its
    # files, so one of yours outside them is still never deleted.
    marker = _marker_of(checkpoint_copy)
    marker.pop("files", None), marker.pop("kind", None)
    marker["builder_version"] = 3
    (checkpoint_copy / MARKER_NAME).write_text(json.dumps(marker))
    (checkpoint_copy / "transformer" / "mine").mkdir()
    (checkpoint_copy / "transformer" / "mine" / "notes.txt").write_text("mine")
    with pytest.raises(
        FileExistsError, match=r"holds transformer/mine/notes\.txt, which boogu-tiny did not write"
    ):
        ensure_tiny_checkpoint(checkpoint_copy)
    shutil.rmtree(checkpoint_copy / "transformer" / "mine")
    ensure_tiny_checkpoint(checkpoint_copy)
    assert _marker_of(checkpoint_copy)["builder_version"] == tiny.BUILDER_VERSION


def test_a_full_or_read_only_disk_is_a_named_error_and_leaves_nothing(
    checkpoint_copy: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    import errno
    import os

    from safetensors import SafetensorError

    def disk_full(*args, **kwargs):  # what safetensors raises when a shard does not fit
        raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")

    target = tmp_path / "fresh" / "Boogu-Image"
    with monkeypatch.context() as patch:
        patch.setattr(tiny, "_write_mllm", disk_full)  # after the transformer and VAE were written
        assert main(["--output-dir", str(target)]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"boogu-tiny: error: cannot write the tiny checkpoint at {target} (")
    assert "No space left on device" in err and "Traceback" not in err
    assert not target.exists() and _leftovers(target) == []

    def read_only(final: Path) -> Path:
        raise OSError(errno.EROFS, os.strerror(errno.EROFS), str(final.parent / f".{final.name}.tmp-x"))

    with monkeypatch.context() as patch:
        patch.setattr(tiny, "stage_folder", read_only)
        assert main(["--output-dir", str(target)]) == 1
    assert f"({os.strerror(errno.EROFS)}: {target.parent}/.Boogu-Image.tmp-x)" in capsys.readouterr().err

    # A forced rebuild whose rename fails keeps the previous checkpoint, byte for byte.
    before = _files(checkpoint_copy)

    def no_space(staging: Path, final: Path) -> None:
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))

    with monkeypatch.context() as patch:
        patch.setattr(tiny, "commit_folder", no_space)
        assert main(["--output-dir", str(checkpoint_copy), "--force"]) == 1
    assert "No space left on device" in capsys.readouterr().err
    assert _files(checkpoint_copy) == before and _leftovers(checkpoint_copy) == []
