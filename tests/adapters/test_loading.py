"""load_boogu on the tiny checkpoint: both transformer loaders, the remote-code refusal, broken folders."""

from __future__ import annotations

import json
import logging
import os
import shutil
import sys
import types
from pathlib import Path

import pytest
import torch
from diffusers import AutoencoderKL
from safetensors.torch import load_file, save_file
from transformers import Qwen3VLModel

from boogu_adapters.loading import (
    CheckpointError,
    load_boogu,
    load_text_encoder,
    load_transformer,
    resolve_transformer_kind,
)
from boogu_adapters.model import BooguImageTransformer2DModel
from boogu_schedule import BooguScheduleConfig


def _stored_tensors(folder: Path) -> dict[str, torch.Tensor]:
    tensors: dict[str, torch.Tensor] = {}
    for shard in sorted(folder.glob("*.safetensors")):
        tensors.update(load_file(shard))
    return tensors


def _rewrite_shard(folder: Path, edit) -> None:
    """Apply ``edit(dict)`` to the first transformer shard and write it back."""
    shard = sorted(folder.glob("diffusion_pytorch_model-*.safetensors"))[0]
    tensors = load_file(shard)
    edit(tensors)
    save_file(tensors, shard, metadata={"format": "pt"})


def test_native_load_returns_typed_parts(tiny_parts, tiny_checkpoint: Path) -> None:
    parts = tiny_parts
    assert parts.transformer_kind == "native"
    assert type(parts.transformer) is BooguImageTransformer2DModel
    assert not parts.transformer.training
    assert parts.path == tiny_checkpoint.resolve()
    # Every stored tensor arrived unchanged (float32 on disk, float32 requested).
    stored = _stored_tensors(tiny_checkpoint / "transformer")
    state = parts.transformer.state_dict()
    assert set(stored) == set(state)
    for name, tensor in stored.items():
        assert torch.equal(state[name], tensor), name

    assert isinstance(parts.vae, AutoencoderKL)
    assert parts.vae.config.scaling_factor == pytest.approx(0.3611)
    assert parts.vae.config.shift_factor == pytest.approx(0.1159)
    assert parts.vae_scale_factor == 8

    # The inner model only: upstream encodes with mllm.model, the lm_head is never built.
    assert type(parts.text_encoder) is Qwen3VLModel
    assert not any(name.startswith("lm_head") for name in parts.text_encoder.state_dict())
    assert (
        parts.text_encoder.config.text_config.hidden_size
        == (parts.transformer.config.instruction_feature_configs["instruction_feat_dim"])
    )

    assert parts.processor.tokenizer.pad_token == "<|endoftext|>"
    assert parts.processor.chat_template is not None

    # Raw JSON: the released static-v1 keys, not the class defaults (dynamic v2).
    assert isinstance(parts.schedule_config, BooguScheduleConfig)
    assert parts.schedule_config.time_shift_version == "v1"
    assert parts.schedule_config.dynamic_time_shift is False
    assert parts.schedule_config.seq_len == 4096
    assert parts.schedule_config.extra["_class_name"] == "FlowMatchEulerDiscreteScheduler"


def test_canonical_load_goes_through_the_shim(tiny_parts, tiny_checkpoint: Path, modules_cache: Path) -> None:
    parts = load_boogu(tiny_checkpoint, transformer="canonical", trust_remote_code=True)
    assert parts.transformer_kind == "canonical"
    # diffusers imported the checkpoint's transformer_boogu.py from its module cache...
    assert (modules_cache / "diffusers_modules" / "local" / "transformer_boogu.py").is_file()
    # ...and the shim re-exported upstream's class if `boogu` imports, ours otherwise.
    try:
        from boogu.models.transformers.transformer_boogu import BooguImageTransformer2DModel as expected
    except ImportError:
        expected = BooguImageTransformer2DModel
    assert type(parts.transformer) is expected
    native = tiny_parts.transformer.state_dict()
    canonical = parts.transformer.state_dict()
    assert set(native) == set(canonical)
    for name, tensor in native.items():
        assert torch.equal(canonical[name], tensor), name


@pytest.mark.skipif(
    not os.environ.get("BOOGU_UPSTREAM_SRC"),
    reason="set BOOGU_UPSTREAM_SRC to upstream's boogu/ source (see test_model_upstream_parity.py)",
)
def test_auto_loads_upstream_class_when_boogu_imports(
    tiny_checkpoint: Path, tiny_parts, monkeypatch: pytest.MonkeyPatch
) -> None:
    for entry in reversed([p for p in os.environ["BOOGU_UPSTREAM_SRC"].split(os.pathsep) if p]):
        monkeypatch.syspath_prepend(entry)
    upstream = pytest.importorskip("boogu.models.transformers.transformer_boogu")
    model, kind = load_transformer(tiny_checkpoint, kind="auto", trust_remote_code=True)
    assert kind == "canonical"
    assert type(model) is upstream.BooguImageTransformer2DModel  # the shim's first choice
    state = tiny_parts.transformer.state_dict()
    assert set(model.state_dict()) == set(state)  # the same 942-style parameter tree
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())


def test_canonical_without_auto_map_uses_model_index(checkpoint_copy: Path, tiny_parts) -> None:
    # The released checkpoints have no auto_map: the class comes from model_index.json's
    # ["transformer_boogu", "BooguImageTransformer2DModel"] and transformer/transformer_boogu.py.
    config_path = checkpoint_copy / "transformer" / "config.json"
    config = json.loads(config_path.read_text())
    del config["auto_map"]
    config_path.write_text(json.dumps(config))
    model, kind = load_transformer(checkpoint_copy, kind="canonical", trust_remote_code=True)
    assert kind == "canonical"
    state = tiny_parts.transformer.state_dict()
    assert all(torch.equal(tensor, state[name]) for name, tensor in model.state_dict().items())

    (checkpoint_copy / "transformer" / "transformer_boogu.py").unlink()
    with pytest.raises(CheckpointError, match=r"transformer_boogu\.py does not exist"):
        load_transformer(checkpoint_copy, kind="canonical", trust_remote_code=True)


def test_canonical_is_refused_without_trust_remote_code(tiny_checkpoint: Path) -> None:
    with pytest.raises(ValueError, match=r"remote code.*trust_remote_code=True") as excinfo:
        load_boogu(tiny_checkpoint, transformer="canonical")
    assert "transformer_boogu.py" in str(excinfo.value)
    assert "transformer='native'" in str(excinfo.value)


def test_auto_picks_and_logs_its_choice(
    monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="boogu_adapters.loading")
    assert resolve_transformer_kind("auto", trust_remote_code=False) == "native"
    assert "native" in caplog.text and "trust_remote_code=False" in caplog.text

    caplog.clear()
    monkeypatch.setitem(sys.modules, "boogu", None)  # makes `import boogu` raise ImportError
    assert resolve_transformer_kind("auto", trust_remote_code=True) == "native"
    assert "'boogu' package does not import" in caplog.text

    caplog.clear()
    monkeypatch.setitem(sys.modules, "boogu", types.ModuleType("boogu"))
    assert resolve_transformer_kind("auto", trust_remote_code=True) == "canonical"
    assert "canonical" in caplog.text

    monkeypatch.setenv("DIFFUSERS_DISABLE_REMOTE_CODE", "1")
    assert resolve_transformer_kind("auto", trust_remote_code=True) == "native"
    with pytest.raises(ValueError, match="DIFFUSERS_DISABLE_REMOTE_CODE"):
        resolve_transformer_kind("canonical", trust_remote_code=True)
    with pytest.raises(ValueError, match="'auto', 'native' or 'canonical'"):
        resolve_transformer_kind("upstream", trust_remote_code=True)  # type: ignore[arg-type]


def test_missing_subfolder(checkpoint_copy: Path) -> None:
    shutil.rmtree(checkpoint_copy / "vae")
    with pytest.raises(CheckpointError, match=r"missing subfolder 'vae/'"):
        load_boogu(checkpoint_copy)


def test_missing_tensors_are_listed(checkpoint_copy: Path) -> None:
    removed: list[str] = []

    def drop(tensors: dict[str, torch.Tensor]) -> None:
        for name in sorted(tensors)[:7]:
            removed.append(name)
            del tensors[name]

    _rewrite_shard(checkpoint_copy / "transformer", drop)
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(checkpoint_copy, kind="native")
    message = str(excinfo.value)
    assert "7 tensors missing from the checkpoint (expected by BooguImageTransformer2DModel)" in message
    assert all(name in message for name in removed[:5])
    assert removed[5] not in message and "and 2 more" in message


def test_unexpected_tensors_are_listed(checkpoint_copy: Path) -> None:
    def add(tensors: dict[str, torch.Tensor]) -> None:
        tensors["prompt_embedding.weight"] = torch.zeros(3, 4)

    _rewrite_shard(checkpoint_copy / "transformer", add)
    with pytest.raises(
        CheckpointError, match=r"1 unexpected tensors in the checkpoint: prompt_embedding\.weight"
    ):
        load_transformer(checkpoint_copy, kind="native")


def test_shape_mismatch_names_tensor_expected_and_found(checkpoint_copy: Path) -> None:
    name = "x_embedder.weight"
    folder = checkpoint_copy / "transformer"
    shard = json.loads((folder / "diffusion_pytorch_model.safetensors.index.json").read_text())["weight_map"][
        name
    ]
    tensors = load_file(folder / shard)
    expected = list(tensors[name].shape)
    tensors[name] = torch.zeros(expected[0], expected[1] + 1)
    save_file(tensors, folder / shard, metadata={"format": "pt"})
    with pytest.raises(CheckpointError) as excinfo:
        load_transformer(checkpoint_copy, kind="native")
    message = str(excinfo.value)
    assert f"'{name}'" in message
    assert f"has shape {[expected[0], expected[1] + 1]}" in message
    assert f"expects {expected}" in message


def test_canonical_loader_checks_tensors_too(checkpoint_copy: Path) -> None:
    _rewrite_shard(checkpoint_copy / "transformer", lambda t: t.pop(sorted(t)[0]))
    with pytest.raises(CheckpointError, match="1 tensors missing"):
        load_transformer(checkpoint_copy, kind="canonical", trust_remote_code=True)


def test_pickled_weights_are_never_loaded(checkpoint_copy: Path) -> None:
    folder = checkpoint_copy / "transformer"
    for file in [*folder.glob("*.safetensors"), folder / "diffusion_pytorch_model.safetensors.index.json"]:
        file.unlink()
    (folder / "diffusion_pytorch_model.bin").write_bytes(b"not loaded")
    with pytest.raises(CheckpointError, match="pickled weights are never loaded"):
        load_transformer(checkpoint_copy, kind="native")


def test_unknown_time_shift_version(checkpoint_copy: Path) -> None:
    config_path = checkpoint_copy / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config["time_shift_version"] = "v3"
    config_path.write_text(json.dumps(config))
    with pytest.raises(CheckpointError) as excinfo:
        load_boogu(checkpoint_copy)
    message = str(excinfo.value)
    assert str(config_path) in message
    assert "time_shift_version" in message and "'v3'" in message


def test_missing_scheduler_config(checkpoint_copy: Path) -> None:
    (checkpoint_copy / "scheduler" / "scheduler_config.json").unlink()
    with pytest.raises(CheckpointError, match=r"scheduler: missing scheduler_config\.json"):
        load_boogu(checkpoint_copy)


def test_text_encoder_with_missing_tensor(checkpoint_copy: Path) -> None:
    weights = checkpoint_copy / "mllm" / "model.safetensors"
    tensors = load_file(weights)
    del tensors["model.language_model.norm.weight"]
    save_file(tensors, weights, metadata={"format": "pt"})
    with pytest.raises(CheckpointError, match=r"1 missing from the checkpoint: language_model\.norm\.weight"):
        load_text_encoder(checkpoint_copy)
