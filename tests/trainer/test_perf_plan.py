"""perf.py (peak TFLOPs, the FLOP meter) and plan.py (the memory plan) on CPU.

The plan's transformer activations are simulated on the meta device; here they are checked against
the live tensor bytes measured (same tracker, real CPU kernels) on the mid-size model.
"""

from __future__ import annotations

import dataclasses
import platform
import subprocess
import sys
import time

import pytest
import torch

from boogu_adapters.lora import adapters_disabled, add_lora, is_lora_param
from boogu_adapters.model import (
    LORA_TARGET_MODULES,
    TINY_CONFIG,
    BooguImageTransformer2DModel,
    get_freqs_cis,
    randomize_parameters,
)
from boogu_adapters.model.flops import FlopModel
from boogu_trainer import perf
from boogu_trainer.config import demo_config
from boogu_trainer.perf import FlopMeter, lookup_gpu_peak, peak_tflops, step_perf
from boogu_trainer.plan import LiveBytes, _build_transformer, plan_memory, transformer_activation_bytes

MID_CONFIG = {
    **TINY_CONFIG,
    "hidden_size": 256,
    "num_layers": 8,
    "num_double_stream_layers": 4,
    "axes_dim_rope": (16, 24, 24),
    "instruction_feature_configs": {**TINY_CONFIG["instruction_feature_configs"], "instruction_feat_dim": 64},
}


@pytest.mark.parametrize(
    ("name", "dtype", "expected"),
    [
        ("NVIDIA H100 80GB HBM3", torch.bfloat16, 989.4),
        ("NVIDIA H100 PCIe", torch.bfloat16, 756.0),
        ("NVIDIA H200", torch.bfloat16, 989.4),
        ("NVIDIA H20", torch.bfloat16, 148.0),
        ("NVIDIA A100-SXM4-80GB", torch.float32, 156.0),
        ("NVIDIA L40S", torch.float16, 362.1),
        ("NVIDIA GeForce RTX 4090", torch.bfloat16, 165.2),
        ("AMD Instinct MI300X", torch.bfloat16, 1307.4),
        ("NVIDIA B200", torch.bfloat16, 2250.0),
    ],
)
def test_gpu_peak_table(name, dtype, expected):
    _, peak = lookup_gpu_peak(name)
    assert peak.for_dtype(dtype, tf32_enabled=True) == expected
    assert lookup_gpu_peak("Some Future Accelerator") is None


def test_cpu_peak_is_measured_once_and_override_wins(monkeypatch):
    perf._MEASURED.clear()
    start = time.perf_counter()
    first = peak_tflops(torch.device("cpu"), torch.float32)
    # A 0.3 s budget; the bound is loose because the tests may share the cores (pytest-xdist).
    assert time.perf_counter() - start < 2.0 and first > 0

    def no_second_measurement(*args, **kwargs):
        raise AssertionError("the CPU peak was measured again")

    monkeypatch.setattr(perf.torch, "randn", no_second_measurement)
    assert peak_tflops(torch.device("cpu"), torch.float32) == first  # cached: no matmul, no tensor
    assert peak_tflops(torch.device("cpu"), torch.float32, 123.0) == 123.0


def _inputs(model, batch, text, grid):
    p = model.config.patch_size
    latents = torch.randn(batch, model.config.in_channels, grid[0] * p, grid[1] * p)
    instruct = torch.randn(batch, text, model.preprocessed_instruction_feat_dim)
    mask = torch.ones(batch, text, dtype=torch.bool)
    mask[1:, text - 2 :] = False  # sample 1 has 2 padded instruction tokens
    freqs = get_freqs_cis(model.config.axes_dim_rope, model.config.axes_lens, 10000)
    return latents, torch.rand(batch), instruct, freqs, mask


def test_flop_meter_books_rollout_and_training_forwards():
    model = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG), 0)
    model.requires_grad_(False)
    add_lora(model, rank=4)
    model.enable_gradient_checkpointing()
    meter = FlopMeter(model)
    args = _inputs(model, 2, 6, (4, 4))
    with torch.no_grad():
        model(*args)
    model(*args).square().mean().backward()
    taken = meter.take()
    layout = model.last_layout if getattr(model, "last_layout", None) is not None else None
    layout = layout or meter._layout_from_inputs(model, args, {})
    assert layout.text_lengths == [6, 4]
    flops = FlopModel(model.config, model)
    rollout = flops.forward(layout).total / 1e12
    train = flops.training(layout, gradient_checkpointing=True).total / 1e12
    assert taken["perf/tflops_rollout"] == pytest.approx(rollout)
    assert taken["perf/tflops_train"] == pytest.approx(train)
    assert taken["perf/tflops"] == pytest.approx(rollout + train)
    assert taken["perf/sample_forwards"] == 4
    assert meter.take()["perf/tflops"] == 0  # reset
    with torch.no_grad(), adapters_disabled(model):
        model(*args)
    assert meter.take()["perf/tflops_rollout"] == pytest.approx(
        FlopModel(model.config).forward(layout).total / 1e12
    )
    meter.close()
    with torch.no_grad():
        model(*args)
    assert meter.take()["perf/tflops"] == 0
    record = step_perf({"perf/tflops": 10.0}, 2.0, images=4, peak=20.0)
    assert record["perf/mfu"] == pytest.approx(0.25) and record["perf/tflops_per_image"] == 2.5


def test_flop_meter_leaves_out_a_reused_text_path():
    from boogu_adapters.model.transformer import InstructionCache

    model = randomize_parameters(BooguImageTransformer2DModel(**TINY_CONFIG), 0)
    model.requires_grad_(False)
    meter = FlopMeter(model)
    latents, t, instruct, freqs, mask = _inputs(model, 2, 6, (4, 4))
    cache = InstructionCache()
    booked = []
    with torch.no_grad():
        for step in (1.0, 0.5):  # two denoising steps of one rollout: the second reuses the text path
            model(latents, t * step, instruct, freqs, mask, instruction_cache=cache)
            booked.append(meter.take()["perf/tflops_rollout"])
    flops = FlopModel(model.config)
    assert booked[0] == pytest.approx(flops.forward(model.last_layout).total / 1e12)
    assert booked[1] == pytest.approx(flops.forward(model.last_layout, text_path=False).total / 1e12)
    assert booked[1] < booked[0]
    meter.close()


# Page faults of the last of 8 rounds of four tensors of 3 to 40 MiB written (every page touched) and
# freed, in a fresh process. With glibc's defaults they are mmapped or trimmed off the heap and
# faulted in again every round; kept, the heap grows over the first rounds and is then reused.
_FAULT_PROBE = """
import resource, sys, torch
if sys.argv[1] == "keep":
    from boogu_trainer.host_memory import keep_freed_host_memory
    assert keep_freed_host_memory()
for _ in range(8):
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    tensors = [torch.ones(mib * 2**18) for mib in (8, 24, 40, 3)]
    del tensors
    faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
print(faults)
"""


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="mallopt is glibc's")
def test_kept_host_memory_is_not_faulted_in_again():
    def faults(mode: str) -> int:
        run = subprocess.run(
            [sys.executable, "-c", _FAULT_PROBE, mode], capture_output=True, text=True, check=True
        )
        return int(run.stdout.split()[-1])

    default, kept = faults("default"), faults("keep")
    # 75 MiB a round: up to ~19000 pages of 4 KiB by default (fewer with transparent huge pages).
    assert default > 0 and kept * 20 < default, (default, kept)


def _measured(config, *, rank, checkpointing, batch, grid, train, reference_images=0):
    model = _build_transformer(config, torch.float32, rank, LORA_TARGET_MODULES, checkpointing)
    model = model.to_empty(device="cpu")
    randomize_parameters(model, 0)
    for name, p in model.named_parameters():
        p.requires_grad_(is_lora_param(name))
    return transformer_activation_bytes(
        model, batch=batch, text_tokens=24, target_grid=grid, train=train, reference_images=reference_images
    )


@pytest.mark.parametrize("train", [False, True], ids=["no-grad", "train"])
def test_simulated_activations_of_edit_rows_match_measured_on_cpu(train):
    """An edit row's reference image joins every transformer call: the plan counts its tokens
    (`trainer --plan --references 1`), which the T2I plan missed by ~30% at the released size."""
    grid = (16, 16)
    meta = _build_transformer(MID_CONFIG, torch.float32, 8, LORA_TARGET_MODULES, False)
    t2i = transformer_activation_bytes(meta, batch=2, text_tokens=24, target_grid=grid, train=train)
    simulated = transformer_activation_bytes(
        meta, batch=2, text_tokens=24, target_grid=grid, train=train, reference_images=1
    )
    measured = _measured(
        MID_CONFIG, rank=8, checkpointing=False, batch=2, grid=grid, train=train, reference_images=1
    )
    assert simulated == pytest.approx(measured, rel=0.2)
    assert simulated > 1.3 * t2i


@pytest.mark.parametrize("grid", [(16, 16), (24, 24)], ids=["256-tokens", "576-tokens"])
@pytest.mark.parametrize(
    ("train", "checkpointing"),
    [(False, False), (True, False), (True, True)],
    ids=["no-grad", "train", "train-gc"],
)
def test_simulated_activations_match_measured_on_cpu(grid, train, checkpointing):
    meta = _build_transformer(MID_CONFIG, torch.float32, 8, LORA_TARGET_MODULES, checkpointing)
    simulated = transformer_activation_bytes(meta, batch=2, text_tokens=24, target_grid=grid, train=train)
    measured = _measured(MID_CONFIG, rank=8, checkpointing=checkpointing, batch=2, grid=grid, train=train)
    assert simulated == pytest.approx(measured, rel=0.2)


def test_live_bytes_books_new_storages_only():
    x = torch.zeros(1000)
    with LiveBytes() as live:
        view = x.view(10, 100)  # an alias: nothing allocated
        y = torch.ones(500)
        assert live.current == 2000
        del y
        assert live.current == 0 and live.peak == 2000
    del view


def test_plan_of_the_demo_recipe(tiny_checkpoint):
    config = demo_config()
    config = dataclasses.replace(
        config, model=dataclasses.replace(config.model, tiny_path=str(tiny_checkpoint))
    )
    plan = plan_memory(config, world_size=1, gpu_memory_gb=1.0, device_type="cpu")
    assert plan.dtype == "float32" and not plan.gradient_checkpointing
    assert set(plan.phases) == {"rollout", "train", "vae decode", "text encoder"}
    assert plan.static["transformer weights"] == pytest.approx(561_920 * 4)
    assert plan.peak > plan.static_total > 0
    assert plan.max_micro_batch("train") >= 1
    text = plan.render()
    assert "expected peak" in text and "largest rollout.micro_batch_size" in text


def test_plan_counts_one_row_per_guidance_branch(tiny_checkpoint):
    """Batched CFG holds every guidance branch of a latent in one call: two rows with text CFG, three
    with Edit double guidance (image guidance only matters with reference images)."""
    base = demo_config()
    base = dataclasses.replace(base, model=dataclasses.replace(base.model, tiny_path=str(tiny_checkpoint)))

    def plan(image_guidance: float, references: int):
        sampler = dataclasses.replace(base.sampler, guidance_scale=4.0, image_guidance_scale=image_guidance)
        config = dataclasses.replace(base, sampler=sampler)
        return plan_memory(config, world_size=1, device_type="cpu", reference_images=references)

    text, double, t2i = plan(1.0, 1), plan(2.0, 1), plan(2.0, 0)
    assert "CFG x2 sample-forwards per rollout latent" in text.render()
    assert "CFG x3 sample-forwards per rollout latent" in double.render()
    assert "CFG x2 sample-forwards per rollout latent" in t2i.render()
    assert double.phases["rollout"].bytes > text.phases["rollout"].bytes


def test_trainer_plan_command_prints_the_plan_without_training(tiny_checkpoint, tmp_path, capsys):
    from boogu_trainer.cli import main

    run_dir = tmp_path / "runs"
    code = main(
        [
            "--plan",
            "--gpu-memory",
            "1",
            "--world-size",
            "2",
            "model.tiny=random",
            f"model.tiny_path={tiny_checkpoint}",
            f"logging.run_dir={run_dir}",
        ]
    )
    out = capsys.readouterr().out
    assert code == 0 and "memory plan per GPU: 2 rank(s)" in out and "largest rollout.micro_batch_size" in out
    assert not run_dir.exists()  # nothing was trained or written
