"""One home per rule (issue 26): the callers of each rule agree, and no copy of it comes back.

The agreement tests call every caller of a rule; the source scan (``ast``, code only, not comments
or docstrings) fails when a rule is spelled again outside its home.
"""

from __future__ import annotations

import ast
import dataclasses
from pathlib import Path

import pytest
import torch

from boogu_protocol import auto_dtype, resolve_device_type

PACKAGES = Path(__file__).resolve().parents[2] / "packages"


def _plan_dtype(tiny_checkpoint, device_type=None, device="auto"):
    from boogu_trainer.config import demo_config
    from boogu_trainer.plan import plan_memory

    config = demo_config()
    model = dataclasses.replace(config.model, tiny_path=str(tiny_checkpoint), dtype="auto", device=device)
    return plan_memory(dataclasses.replace(config, model=model), world_size=1, device_type=device_type).dtype


@pytest.mark.parametrize("device_type", ["cpu", "cuda"])
def test_auto_dtype_is_one_rule_for_the_trainer_the_plan_and_the_rewards(device_type, tiny_checkpoint):
    from boogu_trainer.config import resolved_model_dtype
    from boogu_trainer.models import resolve_dtype
    from boogu_trainer.rewards.clip import resolve_dtype as reward_dtype

    want = "bfloat16" if device_type == "cuda" else "float32"
    assert auto_dtype(device_type) == want
    assert resolved_model_dtype("auto", device_type) == want
    assert resolve_dtype("auto", torch.device(device_type)) == getattr(torch, want)
    assert reward_dtype("auto", torch.device(device_type)) == getattr(torch, want)
    assert _plan_dtype(tiny_checkpoint, device_type) == want


@pytest.mark.parametrize("cuda", [False, True])
def test_auto_device_is_the_trainers_everywhere(cuda, tiny_checkpoint, monkeypatch):
    # The plan used to assume CUDA for model.device=auto; it now plans what the trainer would run here.
    monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda)
    want = "cuda" if cuda else "cpu"
    assert resolve_device_type("auto") == want
    assert _plan_dtype(tiny_checkpoint) == auto_dtype(want)
    assert _plan_dtype(tiny_checkpoint, device="cpu") == "float32"
    if not cuda:  # resolving a CUDA device needs a real one
        from boogu_trainer.distributed import resolve_device
        from boogu_trainer.rewards.clip import resolve_device as reward_device

        assert resolve_device("auto").type == reward_device("auto").type == want


def test_gradient_checkpointing_default():
    from boogu_trainer.models import gradient_checkpointing_on

    assert gradient_checkpointing_on(None, 1024) and not gradient_checkpointing_on(None, 1023)
    assert gradient_checkpointing_on(True, 64) and not gradient_checkpointing_on(False, 4096)


def test_lora_key_names_and_the_peft_sync_config():
    from boogu_adapters.lora import (
        PEFT_PREFIX,
        from_peft_keys,
        is_lora_b,
        lora_file_key,
        lora_module,
        lora_pair_keys,
        peft_sync_config,
        to_peft_keys,
    )

    name = "blocks.0.attn.to_q.lora_B.default.weight"
    key = lora_file_key(name)
    assert key == "blocks.0.attn.to_q.lora_B.weight" and is_lora_b(name) and is_lora_b(key)
    assert not is_lora_b("blocks.0.attn.to_q.lora_A.weight")
    assert lora_module(key) == lora_module(name) == "blocks.0.attn.to_q"
    assert lora_pair_keys("blocks.0.attn.to_q")[1] == key
    peft = to_peft_keys({key: torch.zeros(1)})
    assert list(peft) == [PEFT_PREFIX + key] and list(from_peft_keys(peft)) == [key]
    assert peft_sync_config(4, 8.0, ("to_q", "to_k")) == {
        "r": 4,
        "lora_alpha": 8.0,
        "target_modules": ["to_q", "to_k"],
    }


def test_reference_image_wire_names_round_trip():
    from boogu_protocol import ProtocolError, ref_image_key, reference_images, reference_tensors

    images = {0: b"\x89PNG one", 3: b"\x89PNG two"}
    tensors = reference_tensors(images)
    assert sorted(tensors) == [ref_image_key(0), ref_image_key(3)]
    assert reference_images(tensors) == images
    with pytest.raises(ProtocolError, match="unexpected tensor 'latents'"):
        reference_images({"latents": torch.zeros(1, dtype=torch.uint8)})


# ---- the source scan ---------------------------------------------------------------------------


def _sources():
    for path in sorted(PACKAGES.glob("*/src/**/*.py")):
        yield path.relative_to(PACKAGES).as_posix(), ast.parse(path.read_text(), filename=str(path))


def _name(node) -> str:
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Call):
        return _name(node.func)
    return ""


def _constant(node, values) -> bool:
    return isinstance(node, ast.Constant) and not isinstance(node.value, bool) and node.value in values


def _copies(rel: str, tree: ast.AST) -> list[str]:
    found = []
    for node in ast.walk(tree):
        where = f"{rel}:{getattr(node, 'lineno', '?')}"
        if isinstance(node, ast.Compare) and len(node.ops) == 1:
            left, op, right = node.left, node.ops[0], node.comparators[0]
            # "CFG is on" spelled as a comparison of a guidance scale with 1 (range checks >= 1 are fine)
            if (
                "guidance_scale" in _name(left)
                and isinstance(op, ast.Eq | ast.NotEq | ast.Gt | ast.LtE)
                and _constant(right, {1})
            ):
                found.append(f"{where}: guidance scale compared with 1 (use boogu_schedule.uses_cfg)")
            if isinstance(op, ast.GtE) and _constant(right, {1024}):
                found.append(f"{where}: a >= 1024 rule (use boogu_trainer.models.gradient_checkpointing_on)")
        if _constant(node, {1280}):
            found.append(f"{where}: 1280 (use boogu_protocol.MAX_SEQUENCE_LENGTH)")
        # (vllm-omni's own module paths start with its pipeline's "transformer." attribute: not a key prefix)
        prefixes = {"base_model.model.", "ref_image.", "ref_latent."}
        if _constant(node, prefixes if rel.startswith("boogu-vllm/") else {*prefixes, "transformer."}):
            found.append(
                f"{where}: {node.value!r} (a wire or key prefix: boogu_protocol / boogu_adapters.lora)"
            )
        if not rel.startswith("boogu-vllm/") and _constant(
            node, {".lora_", "lora_A", "lora_B", ".lora_A.", ".lora_B.", ".lora_A.weight", ".lora_B.weight"}
        ):
            found.append(f"{where}: LoRA key spelled out {node.value!r} (use boogu_adapters.lora)")
        if isinstance(node, ast.IfExp) and (
            _constant(node.body, {"bfloat16"}) or _name(node.body) == "bfloat16"
        ):
            found.append(f"{where}: an auto-dtype rule (use boogu_protocol.auto_dtype)")
        if isinstance(node, ast.Call) and _name(node.func) == "to_sde_velocity":
            found.append(
                f"{where}: a negation outside sde_transition (use boogu_schedule.sampling.sde_transition)"
            )
        if isinstance(node, ast.Call) and _name(node.func) == "fsync":
            found.append(f"{where}: an fsync outside boogu_data.atomic")
        if (
            isinstance(node, ast.ImportFrom)
            and rel.endswith("omni_backend.py")
            and node.module == "boogu_vllm.worker"
        ):
            found.append(f"{where}: omni_backend imports the worker (the wire names live in boogu_protocol)")
    return found


HOMES = {
    "boogu-schedule/src/boogu_schedule/guidance.py",  # uses_cfg
    "boogu-schedule/src/boogu_schedule/sampling.py",  # sde_transition
    "boogu-protocol/src/boogu_protocol/__init__.py",  # wire names, prefixes, auto dtype, 1280
    "boogu-adapters/src/boogu_adapters/lora.py",  # LoRA key naming
    "boogu-trainer/src/boogu_trainer/models.py",  # gradient_checkpointing_on
    "boogu-data/src/boogu_data/atomic.py",  # fsync
}


def test_no_rule_is_written_twice():
    copies = [c for rel, tree in _sources() if rel not in HOMES for c in _copies(rel, tree)]
    assert not copies, "\n".join(copies)


def test_the_scan_sees_a_copy():
    bad = ast.parse(
        "a = guidance_scale != 1.0\nb = 1280\nc = 'bfloat16' if cuda else 'float32'\nd = to_sde_velocity(v)\n"
        "e = f'ref_image.{i}'\nf = hidden_size >= 1024\ng = k.split('.lora_')\nos.fsync(f)\n"
    )
    assert len(_copies("x.py", bad)) == 8
