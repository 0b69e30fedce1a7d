"""Atomic, pickle-free checkpoints: a folder per step, written under a temporary name, then renamed.

Layout of ``checkpoints/step_000030/``:

* ``adapter_model.safetensors`` + ``adapter_config.json``: the LoRA in peft's layout
  (``PeftModel.from_pretrained(model, folder)``; diffusers:
  ``model.load_lora_adapter(folder, weight_name="adapter_model.safetensors", prefix="base_model.model")``).
* ``ema.safetensors``: the EMA of the LoRA weights (when enabled), same keys.
* ``optimizer.safetensors`` + ``optimizer.json``: AdamW moments and hyper-parameters, by parameter name.
* ``rng.safetensors``: the torch RNG states.
* ``trainer_state.json``: step, data position, counters.
* ``config.yaml``: the resolved config.

Nothing is ever unpickled: tensors are safetensors, everything else JSON or YAML. A crash while
writing leaves only a ``.tmp-*`` folder that is ignored and cleaned up.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import load_file, save_file

STEP_DIR = re.compile(r"^step_(\d{6,})$")
COMPLETE = "COMPLETE"
PEFT_PREFIX = "base_model.model."


def step_dir_name(step: int) -> str:
    return f"step_{step:06d}"


def to_peft_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {PEFT_PREFIX + k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def from_peft_keys(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    out = {}
    for k, v in state.items():
        if not k.startswith(PEFT_PREFIX):
            raise ValueError(f"LoRA file key {k!r} lacks the peft prefix {PEFT_PREFIX!r}")
        out[k[len(PEFT_PREFIX) :]] = v
    return out


def optimizer_to_files(
    model: torch.nn.Module, optimizer: torch.optim.Optimizer, names: list[str]
) -> tuple[dict[str, torch.Tensor], dict]:
    """AdamW state keyed by parameter name (full tensors, also under FSDP2) plus hyper-parameters (JSON)."""
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_optimizer_state_dict

    sd = get_optimizer_state_dict(
        model, optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=False)
    )
    tensors: dict[str, torch.Tensor] = {}
    for name, state in sd["state"].items():
        for key, value in state.items():
            tensors[f"{name}::{key}"] = torch.as_tensor(value).detach().to("cpu").contiguous()
    groups = [
        {k: v for k, v in g.items() if k != "params"} | {"params": list(g["params"])}
        for g in sd["param_groups"]
    ]
    return tensors, {"param_groups": groups, "names": names}


def load_lora_and_optimizer(
    model: torch.nn.Module,
    optimizer: torch.optim.Optimizer,
    names: list[str],
    contents: CheckpointContents,
    device: torch.device,
) -> None:
    """Put a checkpoint's LoRA weights (float32) and AdamW state back, also into FSDP2-sharded modules."""
    from torch.distributed.checkpoint.state_dict import (
        StateDictOptions,
        set_model_state_dict,
        set_optimizer_state_dict,
    )

    meta = contents.optimizer_meta
    if meta["names"] != names:
        raise ValueError(
            "the checkpoint's optimizer was built for different LoRA parameters than this model's"
        )
    # Model keys carry peft's adapter name; the file's do not.
    by_file_key = {n.replace(".default.", "."): n for n in names}
    missing = sorted(set(by_file_key) - set(contents.lora))
    unexpected = sorted(set(contents.lora) - set(by_file_key))
    if missing or unexpected:
        raise ValueError(
            f"checkpoint LoRA keys do not match the model: missing {missing[:3]}, unexpected {unexpected[:3]}"
        )
    model_sd = {by_file_key[k]: v.to(device=device, dtype=torch.float32) for k, v in contents.lora.items()}
    opts = StateDictOptions(full_state_dict=True, strict=False)
    set_model_state_dict(model, model_sd, options=opts)
    state: dict[str, dict[str, torch.Tensor]] = {}
    for key, value in contents.optimizer_tensors.items():
        name, field = key.rsplit("::", 1)
        state.setdefault(name, {})[field] = value.to(device) if value.dim() > 0 else value
    groups = []
    for g in meta["param_groups"]:
        g = dict(g)
        if "betas" in g:
            g["betas"] = tuple(g["betas"])
        groups.append(g)
    set_optimizer_state_dict(model, optimizer, {"state": state, "param_groups": groups}, options=opts)


def rng_state() -> dict[str, torch.Tensor]:
    out = {"torch_cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        for i, s in enumerate(torch.cuda.get_rng_state_all()):
            out[f"torch_cuda_{i}"] = s
    return out


def set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    torch.set_rng_state(state["torch_cpu"])
    cuda = [state[k] for k in sorted(k for k in state if k.startswith("torch_cuda_"))]
    if cuda and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(cuda)


@dataclass(frozen=True)
class CheckpointContents:
    lora: dict[str, torch.Tensor]
    """LoRA tensors keyed by module path (no peft prefix)."""
    lora_config: dict[str, Any]
    """peft LoraConfig as a dict (written as adapter_config.json)."""
    optimizer_tensors: dict[str, torch.Tensor]
    optimizer_meta: dict[str, Any]
    trainer_state: dict[str, Any]
    config_yaml: str
    ema: dict[str, torch.Tensor] | None = None
    rng: dict[str, torch.Tensor] | None = None


def save_checkpoint(
    root: str | os.PathLike[str], step: int, contents: CheckpointContents, keep_last: int
) -> Path:
    """Write ``root/step_XXXXXX`` atomically and prune older ones; returns the folder."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    final = root / step_dir_name(step)
    tmp = root / f".tmp-{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    try:
        save_file(to_peft_keys(contents.lora), tmp / "adapter_model.safetensors", metadata={"format": "pt"})
        (tmp / "adapter_config.json").write_text(json.dumps(contents.lora_config, indent=2, sort_keys=True))
        if contents.ema is not None:
            save_file(to_peft_keys(contents.ema), tmp / "ema.safetensors", metadata={"format": "pt"})
        save_file(contents.optimizer_tensors, tmp / "optimizer.safetensors")
        (tmp / "optimizer.json").write_text(json.dumps(contents.optimizer_meta, indent=2))
        save_file(
            {k: v.contiguous() for k, v in (contents.rng or rng_state()).items()}, tmp / "rng.safetensors"
        )
        (tmp / "trainer_state.json").write_text(json.dumps(contents.trainer_state, indent=2, sort_keys=True))
        (tmp / "config.yaml").write_text(contents.config_yaml)
        (tmp / COMPLETE).write_text(str(step))
        _fsync_dir(tmp)
        if final.exists():  # re-saving the same step (e.g. the end of a resumed run): replace it
            shutil.rmtree(final)
        os.replace(tmp, final)
        _fsync_dir(root)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    prune(root, keep_last)
    return final


def _fsync_dir(path: Path) -> None:
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    except OSError:
        pass
    finally:
        os.close(fd)


def complete_checkpoints(root: str | os.PathLike[str]) -> list[tuple[int, Path]]:
    """``(step, folder)`` of every complete checkpoint, oldest first; stale temporaries are removed."""
    root = Path(root)
    if not root.is_dir():
        return []
    found = []
    for child in root.iterdir():
        if child.name.startswith(".tmp-"):
            shutil.rmtree(child, ignore_errors=True)
            continue
        m = STEP_DIR.match(child.name)
        if m and (child / COMPLETE).is_file():
            found.append((int(m.group(1)), child))
    return sorted(found)


def latest_checkpoint(root: str | os.PathLike[str]) -> Path | None:
    found = complete_checkpoints(root)
    return found[-1][1] if found else None


def prune(root: Path, keep_last: int) -> None:
    found = complete_checkpoints(root)
    for _, folder in found[:-keep_last]:
        shutil.rmtree(folder, ignore_errors=True)


def load_checkpoint(folder: str | os.PathLike[str]) -> CheckpointContents:
    folder = Path(folder)
    if not (folder / COMPLETE).is_file():
        raise FileNotFoundError(f"{folder} is not a complete checkpoint (no {COMPLETE} marker)")
    ema_path = folder / "ema.safetensors"
    return CheckpointContents(
        lora=from_peft_keys(load_file(folder / "adapter_model.safetensors")),
        lora_config=json.loads((folder / "adapter_config.json").read_text()),
        optimizer_tensors=load_file(folder / "optimizer.safetensors"),
        optimizer_meta=json.loads((folder / "optimizer.json").read_text()),
        trainer_state=json.loads((folder / "trainer_state.json").read_text()),
        config_yaml=(folder / "config.yaml").read_text(),
        ema=from_peft_keys(load_file(ema_path)) if ema_path.exists() else None,
        rng=load_file(folder / "rng.safetensors"),
    )
