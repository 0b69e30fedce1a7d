"""``boogu-sample`` on a real (one-step) checkpoint of the tiny model: sampling, merging, errors, and
the diffusers-layout LoRA file every checkpoint carries."""

from __future__ import annotations

import copy
import io
import json

import numpy as np
import pytest
import torch
from PIL import Image
from safetensors.torch import load_file

from boogu_adapters.components import build_local_engine
from boogu_adapters.loading import load_boogu
from boogu_adapters.step import boogu_velocity
from boogu_data import PromptRecord
from boogu_trainer import sample as sample_cli
from boogu_trainer.checkpoint import DIFFUSERS_LORA_NAME, MANIFEST, verify_checkpoint
from boogu_trainer.loop import Trainer

from .test_loop import small_config

PROMPT = "a red square"


@pytest.fixture(scope="module")
def checkpoint(tiny_checkpoint, tmp_path_factory):
    """A one-step run with EMA; lr 0.05 so the LoRA visibly moves the model (lora_B starts at 0)."""
    run_dir = tmp_path_factory.mktemp("sample_runs")
    config = small_config(
        tiny_checkpoint,
        run_dir,
        "total_steps=1",
        "optim.lr=5e-2",
        "ema.enabled=true",
        "logging.sample_every=0",
        "logging.plot_every=0",
        "eval.num_steps=3",
    )
    Trainer(config).train()
    return run_dir / "run" / "checkpoints" / "step_000001"


@pytest.fixture(scope="module")
def probe(tiny_parts):
    """A fixed transformer input: latents, sigma and the encoded prompt (with CFG)."""
    engine = build_local_engine(tiny_parts)
    gen = torch.Generator().manual_seed(0)
    cond = engine.encode([PromptRecord(instruction=PROMPT)], 1, 2.0, [gen])
    x = torch.randn(1, 16, 4, 4, generator=gen)
    return x, torch.tensor([0.7]), cond, engine.freqs_cis


def velocity(transformer, probe) -> torch.Tensor:
    x, sigma, cond, freqs = probe
    with torch.no_grad():
        return boogu_velocity(transformer, x, sigma, cond, 2.0, freqs).double()


def fresh_transformer(tiny_parts):
    return copy.deepcopy(tiny_parts.transformer)


def test_diffusers_file_is_in_the_manifest_and_reproduces_the_lora(checkpoint, tiny_parts, probe):
    assert verify_checkpoint(checkpoint) is None
    assert DIFFUSERS_LORA_NAME in json.loads((checkpoint / MANIFEST).read_text())
    diffusers_state = load_file(checkpoint / DIFFUSERS_LORA_NAME)
    peft_state = load_file(checkpoint / "adapter_model.safetensors")
    assert {k.removeprefix("transformer.") for k in diffusers_state} == {
        k.removeprefix("base_model.model.") for k in peft_state
    }
    assert all(k.startswith("transformer.") for k in diffusers_state)

    ours = fresh_transformer(tiny_parts)
    trained = sample_cli.read_lora(checkpoint)
    assert trained.scale == 2.0  # small_config: rank 4, alpha 8
    sample_cli.attach_lora(ours, trained)
    # diffusers' own loader, with no alphas (what upstream's load_lora_weights passes).
    theirs = fresh_transformer(tiny_parts)
    theirs.load_lora_adapter(diffusers_state, prefix="transformer", adapter_name="shipped")
    attached = {n.split(".lora_A")[0] for n, _ in theirs.named_parameters() if ".lora_A." in n}
    assert attached == set(trained.modules)
    base = velocity(tiny_parts.transformer, probe)
    v_ours, v_theirs = velocity(ours, probe), velocity(theirs, probe)
    assert (v_ours - base).abs().max() > 1e-3  # the LoRA changes the model
    torch.testing.assert_close(v_theirs, v_ours, rtol=1e-5, atol=1e-6)


def test_sample_with_and_without_lora(checkpoint, tiny_checkpoint, tmp_path, capsys):
    out_lora, out_base = tmp_path / "lora", tmp_path / "base"
    common = ["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--num-images", "2", "--seed", "5"]
    assert sample_cli.main([*common, "--output", str(out_lora)]) == 0
    assert sample_cli.main([*common, "--output", str(out_base), "--no-lora"]) == 0
    files = json.loads((out_lora / "samples.json").read_text())
    assert [f["file"] for f in files] == ["000_a-red-square_0.png", "000_a-red-square_1.png"]
    assert "LoRA step 1" in files[0]["caption"] and (out_lora / "grid.png").is_file()
    lora_png = [np.array(Image.open(out_lora / f["file"])) for f in files]
    base_png = [np.array(Image.open(out_base / f["file"])) for f in files]
    assert lora_png[0].shape == (32, 32, 3)
    assert not np.array_equal(lora_png[0], lora_png[1])  # two noise streams

    # --no-lora is exactly the base model's evaluation-path image for that prompt and seed.
    parts = load_boogu(tiny_checkpoint, transformer="native")
    spec = sample_cli.SampleSpec([PROMPT], num_images=2, seed=5)
    base, _ = sample_cli.sample(checkpoint, spec, lora="none", parts=parts)
    assert np.array_equal(base_png[1], base[1].permute(1, 2, 0).numpy())
    assert any(not np.array_equal(a, b) for a, b in zip(lora_png, base_png))


def test_merge_equals_base_plus_lora(checkpoint, tiny_parts, tmp_path, probe):
    merged_dir = tmp_path / "merged"
    assert sample_cli.main(["--checkpoint", str(checkpoint), "--merge-to", str(merged_dir)]) == 0
    base_files = {p.relative_to(tiny_parts.path) for p in tiny_parts.path.rglob("*") if p.is_file()}
    merged_files = {p.relative_to(merged_dir) for p in merged_dir.rglob("*") if p.is_file()}
    assert base_files <= merged_files
    assert (merged_dir / "transformer" / "config.json").read_text() == (
        tiny_parts.path / "transformer" / "config.json"
    ).read_text()
    merged = load_boogu(merged_dir, transformer="native").transformer
    with_lora = fresh_transformer(tiny_parts)
    sample_cli.attach_lora(with_lora, sample_cli.read_lora(checkpoint))
    torch.testing.assert_close(velocity(merged, probe), velocity(with_lora, probe), rtol=1e-5, atol=1e-5)


def test_ema_weights_are_used(checkpoint):
    lora, ema = sample_cli.read_lora(checkpoint), sample_cli.read_lora(checkpoint, "ema")
    assert ema.source.name == "ema.safetensors" and set(ema.tensors) == set(lora.tensors)
    assert any(not torch.equal(ema.tensors[k], lora.tensors[k]) for k in lora.tensors)


def test_not_a_checkpoint(tmp_path, capsys):
    assert (
        sample_cli.main(["--checkpoint", str(tmp_path), "--prompt", "x", "--output", str(tmp_path / "o")])
        == 2
    )
    err = capsys.readouterr().err
    assert err.startswith("boogu-sample: error:") and "is not a checkpoint folder" in err


def test_lora_that_does_not_match_the_model(checkpoint, tiny_parts):
    lora = sample_cli.read_lora(checkpoint)
    renamed = {k.replace(lora.modules[0], "layers.99.attn.to_q"): v for k, v in lora.tensors.items()}
    wrong = sample_cli.TrainedLora(renamed, lora.scale, lora.source)
    with pytest.raises(
        sample_cli.SampleError, match=r"1 of its \d+ modules are not in it: layers\.99\.attn\.to_q"
    ):
        sample_cli.attach_lora(fresh_transformer(tiny_parts), wrong)
    key = f"{lora.modules[0]}.lora_A.weight"
    narrow = {**lora.tensors, key: lora.tensors[key][:, :-1]}
    with pytest.raises(sample_cli.SampleError, match="other shapes"):
        sample_cli.check_lora_matches(
            sample_cli.TrainedLora(narrow, lora.scale, lora.source),
            {n: tuple(p.shape) for n, p in tiny_parts.transformer.named_parameters()},
        )


def test_reference_image_the_edit_rules_refuse(checkpoint, tmp_path, capsys):
    ref = tmp_path / "ref.png"
    buf = io.BytesIO()
    Image.new("RGB", (30, 32)).save(buf, format="PNG")
    ref.write_bytes(buf.getvalue())
    args = [
        "--checkpoint",
        str(checkpoint),
        "--prompt",
        "x",
        "--image",
        str(ref),
        "--output",
        str(tmp_path / "o"),
    ]
    assert sample_cli.main(args) == 2
    err = capsys.readouterr().err
    assert "--image" in err and "multiples of 16" in err
    assert not (tmp_path / "o").exists()
