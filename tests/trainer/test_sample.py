"""``boogu-sample`` on a real (one-step) checkpoint of the tiny model: sampling, merging, errors, and
the diffusers-layout LoRA file every checkpoint carries; what its outputs may replace (never a run,
a checkpoint, a model or the working directory), the LoRA check it shares with the trainer's resume,
and reading broken, garbage or read-only checkpoints."""

from __future__ import annotations

import copy
import dataclasses
import errno
import hashlib
import io
import json
import logging
import os
import re
import shutil
import subprocess
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from PIL import Image
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

import boogu_data.atomic as atomic
from boogu_adapters.components import build_local_engine
from boogu_adapters.loading import load_boogu
from boogu_adapters.lora import to_peft_keys
from boogu_adapters.step import boogu_velocity
from boogu_data import PromptRecord
from boogu_trainer import sample as sample_cli
from boogu_trainer.checkpoint import DIFFUSERS_LORA_NAME, MANIFEST, CheckpointError, verify_checkpoint
from boogu_trainer.trainer import Trainer
from tests.data.helpers import read_only_storage

from .test_loop import small_config

PROMPT = "a red square"


@pytest.fixture(scope="module")
def trained(tiny_checkpoint, tmp_path_factory):
    """A one-step run with EMA; lr 0.05 so the LoRA visibly moves the model (lora_B starts at 0).
    The trainer stays, for the resume checks."""
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
    trainer = Trainer(config)
    trainer.train()
    return trainer


@pytest.fixture(scope="module")
def checkpoint(trained):
    return trained.config.run_path / "checkpoints" / "step_000001"


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


def replace_file(folder: Path, name: str, data: bytes) -> None:
    """Put ``data`` in the checkpoint's file ``name`` and in its manifest: the folder still verifies."""
    (folder / name).write_bytes(data)
    manifest = json.loads((folder / MANIFEST).read_text())
    manifest[name] = {"size": len(data), "sha256": hashlib.sha256(data).hexdigest()}
    (folder / MANIFEST).write_text(json.dumps(manifest, indent=2, sort_keys=True))


def copy_run(checkpoint: Path, run: Path, steps=(1,)) -> Path:
    """A copy of the checkpoint's run folder (config, metrics) with the checkpoint as each of ``steps``."""
    shutil.copytree(checkpoint.parent.parent, run, ignore=shutil.ignore_patterns("checkpoints"))
    for step in steps:
        shutil.copytree(checkpoint, run / "checkpoints" / f"step_{step:06d}")
    return run


def snapshot(root: Path) -> dict[str, tuple[int, int]]:
    return {str(p.relative_to(root)): (p.stat().st_size, p.stat().st_mtime_ns) for p in root.rglob("*")}


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
    wrong = dataclasses.replace(lora, tensors=renamed)
    with pytest.raises(
        sample_cli.SampleError, match=r"2 of its \d+ tensors adapt no targeted module .*layers\.99"
    ):
        sample_cli.attach_lora(fresh_transformer(tiny_parts), wrong)
    key = f"{lora.modules[0]}.lora_A.weight"
    narrow = {**lora.tensors, key: lora.tensors[key][:, :-1]}
    with pytest.raises(sample_cli.SampleError, match=r"1 tensors have other shapes"):
        sample_cli.check_lora_matches(
            dataclasses.replace(lora, tensors=narrow),
            {n: tuple(p.shape) for n, p in tiny_parts.transformer.named_parameters()},
        )


def other_models_loras(lora) -> dict[str, dict[str, torch.Tensor]]:
    """The checkpoint's LoRA as if trained on the same-width model with one layer fewer or more."""
    layers = {m.group(0) for k in lora.tensors if (m := re.match(r"\w+\.(\d+)\.", k))}
    prefix, last = max((p.split(".")[0], int(p.split(".")[1])) for p in layers)
    fewer = {k: v for k, v in lora.tensors.items() if not k.startswith(f"{prefix}.{last}.")}
    more = dict(lora.tensors)
    for k, v in lora.tensors.items():
        if k.startswith(f"{prefix}.{last}."):
            more[k.replace(f"{prefix}.{last}.", f"{prefix}.{last + 1}.", 1)] = v.clone()
    assert len(fewer) < len(lora.tensors) < len(more)
    return {"fewer": fewer, "more": more}


def test_a_lora_of_another_model_is_refused_by_sampling_merging_and_resume(
    trained, checkpoint, tiny_parts, tmp_path, capsys
):
    from boogu_adapters.lora import expected_lora_shapes, lora_shapes

    lora = sample_cli.read_lora(checkpoint)
    shapes = {n: tuple(p.shape) for n, p in tiny_parts.transformer.named_parameters()}
    # The expected tensors are what the trainer's add_lora attaches: the same check on both sides.
    attached = fresh_transformer(tiny_parts)
    sample_cli.attach_lora(attached, lora)
    assert expected_lora_shapes(shapes, lora.target_modules, lora.rank) == lora_shapes(attached)
    messages = {
        "fewer": r"(\d+) of the \d+ tensors the model's LoRA targets need are missing \(e\.g\. \w+\.\d+\.",
        "more": r"(\d+) of its \d+ tensors adapt no targeted module of the model \(e\.g\. \w+\.\d+\.",
    }
    for kind, tensors in other_models_loras(lora).items():
        with pytest.raises(sample_cli.SampleError, match=messages[kind]):
            sample_cli.attach_lora(fresh_transformer(tiny_parts), dataclasses.replace(lora, tensors=tensors))
        other = tmp_path / kind
        shutil.copytree(checkpoint, other)
        buffer = tmp_path / f"{kind}.safetensors"
        save_file(to_peft_keys(tensors), buffer)
        replace_file(other, "adapter_model.safetensors", buffer.read_bytes())
        merged = tmp_path / f"merged_{kind}"
        assert sample_cli.main(["--checkpoint", str(other), "--merge-to", str(merged)]) == 2
        assert re.search(messages[kind], capsys.readouterr().err) and not merged.exists()
        with pytest.raises(CheckpointError, match=messages[kind]):
            trained.resume(str(other))


# ---- what the outputs may replace ----------------------------------------------------------------
@pytest.fixture
def sandbox(checkpoint, tiny_checkpoint, tmp_path, monkeypatch):
    """models/{Boogu-Image (the base), Other}, runs/run (the checkpoint, metrics.jsonl) and work/ (the
    working directory, holding a file), all copies: a test that fails deletes nothing shared."""
    base = tmp_path / "models" / "Boogu-Image"
    shutil.copytree(tiny_checkpoint, base)
    shutil.copytree(tiny_checkpoint / "transformer", tmp_path / "models" / "Other" / "transformer")
    (tmp_path / "models" / "Other" / "model_index.json").write_text("{}")
    run = copy_run(checkpoint, tmp_path / "runs" / "run")
    ckpt = run / "checkpoints" / "step_000001"
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["model"]["path"] = str(base)
    replace_file(ckpt, "config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
    (tmp_path / "work").mkdir()
    (tmp_path / "work" / "notes.txt").write_text("mine")
    monkeypatch.chdir(tmp_path / "work")
    return tmp_path, ckpt


def test_outputs_never_replace_a_run_a_model_the_checkpoint_or_the_working_directory(sandbox, capsys):
    root, ckpt = sandbox
    run = ckpt.parent.parent
    before = snapshot(root)
    cases = [  # (option, folder, what the error must name)
        ("--merge-to", root / "models", "contains the base model \\(.*Boogu-Image\\)"),
        ("--merge-to", root / "models" / "Boogu-Image", "is the base model"),
        ("--merge-to", root / "models" / "Other", "not empty"),
        ("--merge-to", run, "is the checkpoint's run folder"),
        ("--merge-to", root, "contains the checkpoint being read .*the base model .*run folder"),
        ("--output", run, "is the checkpoint's run folder"),
        ("--output", ckpt, "is the checkpoint being read"),
        (
            "--output",
            root / "runs",
            "contains the checkpoint being read .*, the checkpoint's run folder \\(.*run\\)",
        ),
        ("--output", root / "work", "is the current working directory"),
        ("--output", Path("."), "is the current working directory"),
    ]
    for flag, folder, what in cases:
        for extra in ([], ["--overwrite"]):
            args = ["--checkpoint", str(ckpt), flag, str(folder), *extra]
            assert sample_cli.main([*args, "--prompt", PROMPT] if flag == "--output" else args) == 2, args
            err = capsys.readouterr().err
            assert err.startswith(f"boogu-sample: error: {flag} {folder.resolve()} "), err
            if not extra or what != "not empty":
                assert re.search(what, err), (args, err)
    # With --overwrite, a non-empty folder that is not an earlier output of that option is refused too.
    args = ["--checkpoint", str(ckpt), "--merge-to", str(root / "models" / "Other"), "--overwrite"]
    assert sample_cli.main(args) == 2
    assert (
        "is not an earlier `boogu-sample --merge-to` output (no valid merged_lora.json"
        in capsys.readouterr().err
    )
    assert snapshot(root) == before  # nothing deleted, nothing written, no temporaries left


def test_overwrite_replaces_only_an_earlier_output_of_the_same_option(sandbox, capsys):
    root, ckpt = sandbox
    merged, out, empty = root / "merged", root / "out", root / "empty"
    empty.mkdir()
    merge = ["--checkpoint", str(ckpt), "--merge-to"]
    assert sample_cli.main([*merge, str(merged)]) == 0
    assert sample_cli.main([*merge, str(empty)]) == 0  # an empty folder may be used
    assert json.loads((merged / "merged_lora.json").read_text())["checkpoint"] == str(ckpt)
    written = snapshot(merged)
    assert sample_cli.main([*merge, str(merged)]) == 2
    assert f"--merge-to {merged} is not empty" in capsys.readouterr().err and snapshot(merged) == written
    assert sample_cli.main([*merge, str(merged), "--overwrite"]) == 0
    assert (merged / "merged_lora.json").is_file()
    # An earlier --output is not a --merge-to output, nor the reverse.
    common = ["--checkpoint", str(ckpt), "--prompt", PROMPT, "--steps", "1", "--output"]
    assert sample_cli.main([*common, str(out)]) == 0
    assert sample_cli.main([*common, str(merged), "--overwrite"]) == 2
    assert "no valid samples.json" in capsys.readouterr().err
    assert sample_cli.main([*merge, str(out), "--overwrite"]) == 2
    # Something boogu-sample never writes inside an earlier output: never deleted.
    (out / "keep").mkdir()
    (out / "keep" / "metrics.jsonl").write_text("{}\n")
    assert sample_cli.main([*common, str(out), "--overwrite"]) == 2
    assert "looks like a run" in capsys.readouterr().err and (out / "keep" / "metrics.jsonl").is_file()
    (out / "keep" / "metrics.jsonl").unlink()
    # Nor anything else its samples.json does not list: an empty folder, a file of the user's.
    assert sample_cli.main([*common, str(out), "--overwrite"]) == 2
    assert "keep (not listed in its samples.json)" in capsys.readouterr().err and (out / "keep").is_dir()
    (out / "keep").rmdir()
    (out / "notes.txt").write_text("mine")
    assert sample_cli.main([*common, str(out), "--overwrite"]) == 2
    assert "notes.txt (not listed" in capsys.readouterr().err and (out / "notes.txt").read_text() == "mine"
    (out / "notes.txt").unlink()
    assert sample_cli.main([*common, str(out), "--overwrite"]) == 0 and (out / "samples.json").is_file()
    # A merged model: a file of the user's or a changed file is kept; one the merge wrote is replaced.
    (merged / "transformer" / "notes.txt").write_text("mine")
    assert sample_cli.main([*merge, str(merged), "--overwrite"]) == 2
    assert "notes.txt (not in its merged_lora.json)" in capsys.readouterr().err
    (merged / "transformer" / "notes.txt").unlink()
    with (merged / "transformer" / "config.json").open("a") as f:
        f.write(" ")
    assert sample_cli.main([*merge, str(merged), "--overwrite"]) == 2
    assert "config.json (changed since it was written)" in capsys.readouterr().err
    marker = json.loads((merged / "merged_lora.json").read_text())
    del marker["files"]  # an older boogu-sample's marker vouches for nothing
    (merged / "merged_lora.json").write_text(json.dumps(marker))
    assert sample_cli.main([*merge, str(merged), "--overwrite"]) == 2
    assert "without a file list" in capsys.readouterr().err
    assert sorted(p.name for p in root.iterdir() if p.name.startswith(".")) == []  # no temporaries


# ---- reading broken, garbage and read-only checkpoints -------------------------------------------
def test_a_broken_newest_checkpoint_is_skipped_with_a_warning_naming_both(checkpoint, tmp_path, caplog):
    run = copy_run(checkpoint, tmp_path / "run", steps=(1, 2))
    broken = run / "checkpoints" / "step_000002"
    raw = bytearray((broken / "adapter_model.safetensors").read_bytes())
    raw[-1] ^= 0xFF
    (broken / "adapter_model.safetensors").write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING, logger="boogu_trainer"):
        used = sample_cli.resolve_checkpoint(run)
    assert used == run / "checkpoints" / "step_000001"
    assert (
        f"checkpoint {broken} is broken (adapter_model.safetensors does not match its SHA-256" in caplog.text
    )
    assert f"using {used} instead" in caplog.text


@pytest.mark.parametrize(
    ("name", "problem"),
    [
        ("adapter_model.safetensors", "is not a valid safetensors file"),
        ("adapter_config.json", "is not valid JSON"),
    ],
)
def test_a_file_that_matches_its_manifest_but_is_not_what_it_says(
    name, problem, trained, checkpoint, tmp_path, capsys
):
    garbage = tmp_path / "step_000001"
    shutil.copytree(checkpoint, garbage)
    replace_file(garbage, name, b"not a safetensors file at all, nor JSON" * 4)
    assert verify_checkpoint(garbage) is None
    wanted = f"{garbage / name} {problem}"
    assert sample_cli.main(["--checkpoint", str(garbage), "--merge-to", str(tmp_path / "m")]) == 2
    assert wanted in capsys.readouterr().err and not (tmp_path / "m").exists()
    with pytest.raises(CheckpointError, match=re.escape(wanted)):
        trained.resume(str(garbage))


def test_a_run_on_read_only_storage_is_read_past_a_dead_writers_temporary(
    checkpoint, tmp_path, monkeypatch, caplog
):
    run = copy_run(checkpoint, tmp_path / "run")
    dead = subprocess.Popen(["true"])
    dead.wait()
    monkeypatch.setattr(atomic.os, "getpid", lambda: dead.pid)
    staging = atomic.stage_folder(run / "checkpoints" / "step_000002")
    monkeypatch.undo()
    (staging / "adapter_model.safetensors").write_bytes(b"half")
    with read_only_storage(run, monkeypatch), caplog.at_level(logging.WARNING):
        assert sample_cli.resolve_checkpoint(run) == run / "checkpoints" / "step_000001"
    assert staging.is_dir() and f"cannot remove {staging}" in caplog.text


def test_an_edit_is_sampled_with_image_guidance(checkpoint, tmp_path, capsys):
    """``--image-guidance`` reaches the edit's request: the image differs from the unguided one."""
    ref = tmp_path / "ref.png"
    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    ref.write_bytes(buf.getvalue())
    base = ["--checkpoint", str(checkpoint), "--prompt", "make it blue", "--image", str(ref), "--steps", "2"]
    outputs = {}
    for name, extra in (("plain", []), ("guided", ["--image-guidance", "3"])):
        assert sample_cli.main([*base, *extra, "--output", str(tmp_path / name)]) == 0, (
            capsys.readouterr().err
        )
        (png,) = sorted(p for p in (tmp_path / name).glob("*.png") if p.name != "grid.png")
        outputs[name] = np.asarray(Image.open(png))
    assert outputs["plain"].shape == outputs["guided"].shape
    assert not np.array_equal(outputs["plain"], outputs["guided"])


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


def test_the_config_of_a_demo_run_loads_back(tmp_path):
    """The demo trains diffusion_nft, whose config.yaml (every key written) holds flow_grpo's
    clip_range: `run_config` reads it as the run's own config, not as a recipe that sets it."""
    from boogu_trainer.config import config_to_yaml, scenes_demo_config

    config = scenes_demo_config()
    (tmp_path / "config.yaml").write_text(config_to_yaml(config))  # as a run writes it
    assert sample_cli.run_config(tmp_path) == config
    assert sample_cli.run_config(tmp_path, device="cuda").model.device == "cuda"


# ---- bad arguments, bad files, a disk that refuses: named errors, nothing written ----------------
@pytest.mark.parametrize(
    ("flag", "value", "problem"),
    [
        ("--height", "0", "--height 0: expected a positive multiple of 16; leave it out for the run's size"),
        ("--width", "-16", "--width -16: expected a positive multiple of 16"),
        ("--guidance", "nan", "--guidance nan: expected a finite number >= 1"),
        ("--guidance", "inf", "--guidance inf: expected a finite number >= 1"),
        ("--guidance", "0.5", "--guidance 0.5: expected a finite number >= 1"),
        ("--seed", str(10**20), f"--seed {10**20}: expected a whole number in [0, 2**63)"),
        ("--seed", "-1", "--seed -1: expected a whole number in [0, 2**63)"),
        ("--image-guidance", "0.5", "--image-guidance 0.5: expected a finite number >= 1"),
        (
            "--image-guidance",
            "2",
            "--image-guidance guides an edit by its reference image: give --image REF too",
        ),
    ],
)
def test_sampling_arguments_that_would_be_silently_different_are_refused(
    flag, value, problem, checkpoint, tmp_path, capsys
):
    args = ["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--output", str(tmp_path / "o")]
    with pytest.raises(SystemExit) as exit_info:
        sample_cli.main([*args, flag, value])
    assert exit_info.value.code == 2 and problem in capsys.readouterr().err
    assert not (tmp_path / "o").exists()


def test_more_images_than_memory_holds_is_refused_before_the_model_loads(checkpoint, tmp_path, capsys):
    out = tmp_path / "o"
    args = ["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--output", str(out)]
    assert sample_cli.main([*args, "--num-images", "100000000"]) == 2
    err = capsys.readouterr().err
    assert re.search(r"--num-images 100000000 for 1 prompt\(s\): 100000000 images of 32x32 at once need", err)
    assert "more than the" in err and not out.exists()


def test_a_run_whose_reward_cannot_be_imported_is_still_sampled(checkpoint, tmp_path, capsys):
    """Sampling and merging score nothing: the run's rewards are not resolved, nor their modules imported."""
    ckpt = copy_run(checkpoint, tmp_path / "run") / "checkpoints" / "step_000001"
    config = yaml.safe_load((ckpt / "config.yaml").read_text())
    config["reward"]["rewards"] = [{"name": "boogu_judge_on_another_machine:score", "weight": 1.0}]
    replace_file(ckpt, "config.yaml", yaml.safe_dump(config, sort_keys=False).encode())
    args = ["--checkpoint", str(ckpt), "--prompt", PROMPT, "--steps", "1", "--output", str(tmp_path / "o")]
    assert sample_cli.main(args) == 0, capsys.readouterr().err
    assert (tmp_path / "o" / "samples.json").is_file()
    assert sample_cli.main(["--checkpoint", str(ckpt), "--merge-to", str(tmp_path / "m")]) == 0
    assert (tmp_path / "m" / "merged_lora.json").is_file()


def safetensors_disk_full(tensors, path, metadata=None):
    """What `safetensors.torch.save_file` raises on a full disk (the form of its message as a real
    write past a file size limit gives it: "... I/O error: File too large (os error 27)")."""
    raise SafetensorError("Error while serializing: I/O error: No space left on device (os error 28)")


def _disk_error(code: int):
    def fail(*args, **kwargs):
        raise OSError(code, os.strerror(code), str(args[-1] if args else "?"))

    return fail


def test_an_output_that_cannot_be_written_is_found_before_sampling(checkpoint, tmp_path, monkeypatch, capsys):
    def sampled(*args, **kwargs):
        raise AssertionError("sampled before finding that the output cannot be written")

    monkeypatch.setattr(sample_cli, "sample", sampled)
    monkeypatch.setattr(sample_cli.tempfile, "mkdtemp", _disk_error(errno.EROFS))
    out = tmp_path / "new" / "o"
    args = ["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--output", str(out)]
    assert sample_cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"--output {out} cannot be written: Read-only file system ({tmp_path}); nothing was sampled" in err
    assert sorted(tmp_path.iterdir()) == []  # not even the missing parent was made


def test_a_disk_that_fills_up_while_writing_leaves_nothing(checkpoint, tmp_path, monkeypatch, capsys):
    images = torch.zeros(2, 3, 32, 32, dtype=torch.uint8)
    monkeypatch.setattr(sample_cli, "sample", lambda *a, **k: (images, ["a | LoRA step 1"] * 2))
    monkeypatch.setattr(Image.Image, "save", _disk_error(errno.ENOSPC))
    out = tmp_path / "o"
    args = ["--checkpoint", str(checkpoint), "--prompt", PROMPT, "--num-images", "2", "--output", str(out)]
    assert sample_cli.main(args) == 2
    err = capsys.readouterr().err
    assert f"--output {out}: cannot be written: No space left on device (" in err
    assert "nothing was written there" in err
    # safetensors reports a refused write as its own SafetensorError, not an OSError
    monkeypatch.setattr("boogu_trainer.checkpoint.save_file", safetensors_disk_full)
    assert sample_cli.main(["--checkpoint", str(checkpoint), "--merge-to", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert f"--merge-to {tmp_path / 'm'}: cannot be written: No space left on device" in err
    assert sorted(tmp_path.iterdir()) == []  # no output, no staging folder


@pytest.mark.parametrize(
    ("contents", "problem"),
    [
        ([], r"json: expected a JSON object \(peft's LoraConfig: r, lora_alpha, \.\.\.\), got list"),
        ({"r": 0, "lora_alpha": 8}, r"json: r=0: expected the LoRA rank, a whole number >= 1"),
        ({"r": 4, "lora_alpha": "x"}, r"json: lora_alpha='x': expected a finite number > 0"),
        ({"r": 8, "lora_alpha": 8}, r"json: r=8, but the run's config\.yaml has lora\.rank=4"),
    ],
)
def test_an_adapter_config_that_matches_its_manifest_but_is_not_one(
    contents, problem, checkpoint, tmp_path, capsys
):
    bad = tmp_path / "step_000001"
    shutil.copytree(checkpoint, bad)
    replace_file(bad, "adapter_config.json", json.dumps(contents).encode())
    assert verify_checkpoint(bad) is None
    assert sample_cli.main(["--checkpoint", str(bad), "--merge-to", str(tmp_path / "m")]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"boogu-sample: error: {bad / 'adapter_config.json'}") and re.search(problem, err)
    assert not (tmp_path / "m").exists()
