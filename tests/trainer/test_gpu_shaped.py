"""The GPU-shaped rollout and update, proven on CPU: micro-batches, compute dtypes, no host syncs.

What a GPU run depends on and a CPU run can check: splitting a batch into micro-batches changes no
sample's numbers (beyond the rounding of a GEMM of another size), LoRA products run in the model's
dtype while its master weights and gradients stay float32, and neither the denoising loop nor the
update's loops read a device value on the host (each such read stalls a GPU's queue).
"""

from __future__ import annotations

import contextlib
import dataclasses

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from boogu_adapters.components import build_local_engine
from boogu_adapters.loading import load_boogu
from boogu_adapters.lora import (
    InputDtypeLinear,
    add_lora,
    compute_lora_in_input_dtype,
    lora_state_dict,
    set_lora_forward,
)
from boogu_adapters.model import TINY_CONFIG, BooguImageTransformer2DModel, randomize_parameters
from boogu_adapters.recompute import TransitionRecompute
from boogu_adapters.types import RolloutRequest
from boogu_data import PromptRecord
from boogu_schedule import WindowPlan
from boogu_trainer.config import config_changes, config_to_dict, load_config
from boogu_trainer.models import resolve_dtype
from boogu_trainer.trainer import Trainer
from tests.host_sync import HostSyncGuard, no_tolist

PROMPTS = [
    PromptRecord(index=0, instruction="a red circle on a white wall", negative=""),
    PromptRecord(index=1, instruction="the word BOOGU", negative=""),
]


def _request(**kw) -> RolloutRequest:
    args = dict(
        records=PROMPTS,
        group_size=3,
        num_steps=4,
        guidance_scale=2.0,
        height=32,
        width=32,
        seed=5,
        window=WindowPlan(kind="random", size=2, window_range=(0, 3), scope="sample"),
    )
    return RolloutRequest(**{**args, **kw})


def _config(tiny_checkpoint, run_dir, *overrides):
    return load_config(
        None,
        [
            f"model.path={tiny_checkpoint}",
            "model.device=cpu",
            "data.prompts_per_step=2",
            "algorithm.group_size=4",
            "sampler.num_steps=4",
            "sampler.height=32",
            "sampler.width=32",
            "sampler.guidance_scale=2.0",
            "sampler.window_size=2",
            "sampler.window_range=[0,3]",
            "lora.rank=4",
            "lora.alpha=8",
            "lora.init=default",  # lora_B random too: the adapted model differs from the base
            "optim.lr=1e-3",
            "reward.rewards=[{name: demo_brightness}]",
            "total_steps=1",
            "checkpoint.save_every=0",
            f"logging.run_dir={run_dir}",
            "logging.sample_every=0",
            "logging.plot_every=0",
            "logging.progress=false",
            "seed=3",
            *overrides,
        ],
    )


def test_rollout_micro_batches_equal_the_whole_batch(tiny_parts):
    """Chunks of 2 and of 4 (a ragged last chunk) against one call: every sample's latents, log-probs
    and images are the same to float32 rounding. On many CPUs they are bit for bit; on an
    AVX-512/AMX Xeon the matrix kernels block by row count and 1-3 ulps differ (2.4e-7 seen on
    latents of |x| ~4). A wrong noise stream, chunk order or CFG pairing differs by O(1)."""
    whole = build_local_engine(tiny_parts, max_sequence_length=256).generate(_request())
    for size in (2, 4):
        engine = build_local_engine(tiny_parts, max_sequence_length=256, micro_batch_size=size)
        got = engine.generate(_request())
        assert engine.stats.transformer_calls == 4 * -(-6 // size)  # 4 steps, batched CFG
        assert engine.stats.transformer_sample_forwards == 4 * 6 * 2
        for name in ("latents", "log_prob", "mean", "final_latents"):
            torch.testing.assert_close(getattr(got, name), getattr(whole, name), rtol=0, atol=2e-6)
        assert torch.equal(got.step_index, whole.step_index)
        # uint8 images: an ulp may flip a rounding by one level
        assert int((got.images.int() - whole.images.int()).abs().max()) <= 1
        assert got.window == whole.window


@pytest.mark.parametrize("kind", ["t2i-cfg", "edit-cfg", "t2i-no-cfg", "edit-image-no-cfg", "edit-image-cfg"])
def test_a_remote_rollout_books_the_flops_the_local_engine_measures(kind, tiny_parts):
    """The vllm-omni worker's rollout FLOPs, booked from the trajectory's layout
    (`FlopMeter.book_remote_rollout`), equal what the FLOP meter's hooks measure when the local
    engine runs the same request: every step, the positive forward and, with CFG, the negative one
    (its own prompt length, the same references); with image guidance the forwards without the
    references (upstream's drop_image, or drop_all in double guidance). The worker runs each forward whole, so the local
    engine's reuse of the text path across steps (`RolloutTextCache`) is off for the comparison."""
    import io

    import numpy as np
    from PIL import Image

    from boogu_trainer.perf import FlopMeter

    records = [
        PromptRecord(
            index=0, instruction="a red circle on a white wall", negative="blurry, dark, low quality"
        ),
        PromptRecord(index=1, instruction="the word BOOGU", negative=""),
    ]
    if kind.startswith("edit"):
        buffer = io.BytesIO()
        Image.fromarray(np.random.default_rng(0).integers(0, 256, (32, 48, 3), dtype=np.uint8)).save(
            buffer, format="PNG"
        )
        records = [dataclasses.replace(r, ref_image=buffer.getvalue()) for r in records]
    engine = build_local_engine(tiny_parts, max_sequence_length=256, cache_text_path=False)
    meter = FlopMeter(engine.transformer)
    try:
        traj = engine.generate(
            _request(
                records=records,
                guidance_scale=1.0 if "no-cfg" in kind else 2.0,
                image_guidance_scale=1.5 if "image" in kind else 1.0,
            )
        )
        measured = meter.take()
        meter.book_remote_rollout(traj)
        booked = meter.take()
    finally:
        meter.close()
    assert traj.conditioning.is_edit == kind.startswith("edit")
    branches = {"t2i-no-cfg": 1, "edit-image-no-cfg": 2, "edit-image-cfg": 3}.get(kind, 2)
    assert traj.nfe == branches * traj.batch_size * 4
    assert measured["perf/tflops_rollout"] > 0 and measured["perf/tflops_worker"] == 0
    assert booked["perf/tflops"] == 0  # not this process's FLOPs
    assert booked["perf/tflops_worker"] == pytest.approx(measured["perf/tflops_rollout"], rel=1e-12)


def test_velocity_micro_batches_refuse_gradients():
    """``boogu_velocity(micro_batch_size=)`` splits a no-grad forward; under autograd it would keep
    every chunk's activations until one backward, which is what micro-batching must avoid."""
    from boogu_adapters.step import boogu_velocity

    x, sigma = torch.zeros(4, 16, 2, 2), torch.full((4,), 0.5)
    with pytest.raises(RuntimeError, match="micro_batch_size=2 is for forwards without gradients"):
        boogu_velocity(None, x, sigma, None, 1.0, (), micro_batch_size=2)


def test_training_micro_batches_accumulate_to_the_same_update(tiny_checkpoint, tmp_path):
    """One step with micro-batches of 3 (chunks 3 + 1 of each 4-sample mini-batch) and rollout chunks
    of 2 makes the same LoRA update as the unsplit step: the gradients accumulate with each chunk's
    share of the mean. Equal within 1e-6 (the float sum runs in another order), not bitwise."""
    results = []
    for i, extra in enumerate(
        [
            [],
            ["algorithm.train_micro_batch_size=3", "rollout.micro_batch_size=2"],
        ]
    ):
        trainer = Trainer(_config(tiny_checkpoint, tmp_path / str(i), "algorithm.mini_batches=2", *extra))
        before = {k: v.clone() for k, v in lora_state_dict(trainer.transformer).items()}
        metrics = trainer.train_step().metrics
        after = lora_state_dict(trainer.transformer)
        results.append((before, {k: v.detach().clone() for k, v in after.items()}, metrics))
    (b0, a0, m0), (b1, a1, m1) = results
    assert all(torch.equal(b0[k], b1[k]) for k in b0)
    assert m0["optimizer_steps"] == m1["optimizer_steps"] == 2
    moved = max(float((a0[k] - b0[k]).abs().max()) for k in a0)
    assert moved > 1e-5  # the update did something
    # 1e-5, not 1e-6: Adam divides each gradient by its own running magnitude, so for a LoRA element
    # whose gradient is tiny the float-order difference of the two sums is magnified in the update (a
    # CI run saw 1.19e-6 on one element of 1024, on the same code that had passed; not measured further).
    for k in a0:
        torch.testing.assert_close(a1[k], a0[k], rtol=0, atol=1e-5 * max(moved, 1.0))
    assert m0["logprob_diff/step0"] == m1["logprob_diff/step0"] == 0.0
    assert abs(m0["loss"] - m1["loss"]) < 1e-6 + 1e-3 * abs(m0["loss"])
    # The ratio's statistics are pooled over the update, not averaged over chunks: the second
    # mini-batch's ratios (after the first optimizer step) spread the same however it is split.
    assert m0["ratio_std"] > 0
    assert m1["ratio_std"] == pytest.approx(m0["ratio_std"], rel=1e-3)
    assert m1["ratio_mean"] == pytest.approx(m0["ratio_mean"], rel=1e-6)


@contextlib.contextmanager
def lengths_from_host(guard: HostSyncGuard):
    """Record whether every forward got the prompt lengths from the host (a list of flags). With them,
    a mask on a GPU is never read; a CPU mask is cross-checked against them on the host, which is
    exempt from ``guard`` here, as a GPU run skips it."""
    text_lengths = BooguImageTransformer2DModel._text_lengths
    given: list[bool] = []

    def checked(self, mask, batch, width, instruction_lengths=None):
        given.append(instruction_lengths is not None)
        previous, guard.armed = guard.armed, False
        try:
            return text_lengths(self, mask, batch, width, instruction_lengths)
        finally:
            guard.armed = previous

    BooguImageTransformer2DModel._text_lengths = checked
    try:
        yield given
    finally:
        BooguImageTransformer2DModel._text_lengths = text_lengths


def test_no_host_sync_inside_the_denoising_and_update_loops(tiny_checkpoint, tmp_path):
    """The rollout's denoising loop (model forwards included) and the update's micro-batch/window
    loop run under a guard that fails on every op that reads a device value on the host."""
    trainer = Trainer(
        _config(
            tiny_checkpoint,
            tmp_path,
            "algorithm.kl_coef=0.01",  # the reference forward and the KL term are inside the loop too
            "algorithm.train_micro_batch_size=2",
            "rollout.micro_batch_size=4",
            "model.edit_vlm_view=upstream",
        )
    )
    guard = HostSyncGuard()
    engine = trainer.engine
    steps = trainer.config.sampler.num_steps

    def arm(*_):
        guard.armed = True  # from the first transformer forward of the rollout ...

    def on_step(i, n):
        guard.armed = i < n - 1  # ... to the end of its last denoising step

    hook = engine.transformer.register_forward_pre_hook(arm)
    engine.on_step = on_step
    accumulate = trainer.learner._accumulate

    def guarded(*args, **kwargs):
        with guard.region():
            return accumulate(*args, **kwargs)

    trainer.learner._accumulate = guarded
    try:
        with guard, no_tolist(guard), lengths_from_host(guard) as given:
            metrics = trainer.train_step().metrics
    finally:
        hook.remove()
    assert not guard.armed
    assert metrics["optimizer_steps"] >= 1 and "kl_ref" in metrics
    # rollout (2 calls per step with micro-batches of 4 of 8 latents), training and reference forwards
    assert len(given) >= 2 * steps + 4 and all(given)


def _lora_tiny(dtype: torch.dtype) -> BooguImageTransformer2DModel:
    model = BooguImageTransformer2DModel(**TINY_CONFIG)
    randomize_parameters(model, 0)
    add_lora(model, rank=4, alpha=8, init_lora_weights=True, seed=0)
    model.to(dtype)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    return model


def _inputs(dtype):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(2, 16, 8, 8, generator=g).to(dtype)
    hidden = torch.randn(2, 5, 64, generator=g).to(dtype)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    return x, torch.tensor([0.3, 0.7], dtype=dtype), hidden, mask


class _RankGemms(TorchDispatchMode):
    """The input dtypes of every matrix product with a LoRA-rank (4) side: the LoRA branch's GEMMs."""

    def __init__(self):
        super().__init__()
        self.dtypes: set[tuple[torch.dtype, ...]] = set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func.overloadpacket in (torch.ops.aten.mm, torch.ops.aten.addmm):
            mats = [a for a in args if isinstance(a, torch.Tensor) and a.dim() == 2]
            if any(4 in m.shape for m in mats[-2:]):
                self.dtypes.add(tuple(m.dtype for m in mats))
        return func(*args, **(kwargs or {}))


def test_lora_products_run_in_the_model_dtype_with_float32_masters():
    model = _lora_tiny(torch.bfloat16)
    assert compute_lora_in_input_dtype(model) > 0
    assert any(isinstance(m, InputDtypeLinear) for m in model.modules())  # what peft's fallback calls
    x, t, hidden, mask = _inputs(torch.bfloat16)
    with _RankGemms() as gemms:
        out = model(x, t, hidden, None, mask)
        out.float().square().mean().backward()
    assert gemms.dtypes and all(set(d) == {torch.bfloat16} for d in gemms.dtypes), gemms.dtypes
    grads = [p.grad for n, p in model.named_parameters() if "lora_" in n and p.grad is not None]
    assert grads and all(g.dtype == torch.float32 for g in grads)
    assert any(float(g.abs().sum()) > 0 for g in grads)
    # peft's own path would have upcast the activations to the adapters' float32.
    baseline = _lora_tiny(torch.bfloat16)
    set_lora_forward(baseline, "peft")
    with torch.no_grad(), _RankGemms() as peft_gemms:
        baseline(x, t, hidden, None, mask)
    assert peft_gemms.dtypes and all(set(d) == {torch.float32} for d in peft_gemms.dtypes), peft_gemms.dtypes


def test_lora_compute_switch_changes_nothing_in_float32():
    a, b = _lora_tiny(torch.float32), _lora_tiny(torch.float32)
    compute_lora_in_input_dtype(b)
    assert lora_state_dict(a).keys() == lora_state_dict(b).keys()
    x, t, hidden, mask = _inputs(torch.float32)
    assert torch.equal(a(x, t, hidden, None, mask), b(x, t, hidden, None, mask))


def test_bfloat16_rollout_and_recomputation_take_the_same_path(tiny_checkpoint):
    """With a bf16 base and float32 LoRA masters computing in bf16, the training recomputation of a
    rollout's window log-probs is still bit-exact (both go through one step function)."""
    parts = load_boogu(tiny_checkpoint, transformer="native", dtype=torch.bfloat16)
    model = parts.transformer
    add_lora(model, rank=4, alpha=8, init_lora_weights=True, seed=1)
    for name, p in model.named_parameters():
        if "lora_" in name:
            p.data = p.data.float()
    compute_lora_in_input_dtype(model)
    engine = build_local_engine(dataclasses.replace(parts, transformer=model), max_sequence_length=256)
    traj = engine.generate(_request(decode=False))
    assert traj.latents.dtype == traj.log_prob.dtype == torch.float32
    adapter = TransitionRecompute(engine.freqs_cis)
    for k in range(traj.window_size):
        again = adapter.step_stats(model, traj, k)
        assert torch.equal(again.log_prob, traj.log_prob[:, k])


@pytest.mark.parametrize(
    ("spec", "device", "expected"),
    [
        ("auto", "cpu", torch.float32),
        ("auto", "cuda", torch.bfloat16),
        ("float16", "cuda", torch.float16),
        ("bfloat16", "cpu", torch.bfloat16),
    ],
)
def test_model_dtype_auto(spec, device, expected):
    assert resolve_dtype(spec, torch.device(device)) is expected


def test_resume_treats_auto_as_the_dtype_it_stands_for(tmp_path):
    explicit = config_to_dict(load_config(None, ["model.dtype=float32"]))
    auto = config_to_dict(load_config(None, []))
    expected = [] if not torch.cuda.is_available() else [("model.dtype", "float32", "auto")]
    assert config_changes(explicit, auto) == expected
    assert config_changes(explicit, config_to_dict(load_config(None, ["model.dtype=bfloat16"])))


def test_model_compile_compiles_the_trained_module_per_block(tiny_checkpoint, tmp_path, monkeypatch):
    """model.compile=true reaches the transformer after LoRA and checkpointing (the compile itself is
    tested in tests/adapters/test_model_fast_paths.py)."""
    seen = []

    def record(self, bucket=64, **kwargs):
        seen.append((bucket, any("lora_A" in k for k in self.state_dict())))

    monkeypatch.setattr(BooguImageTransformer2DModel, "enable_regional_compile", record)
    Trainer(_config(tiny_checkpoint, tmp_path, "model.compile=true", "model.compile_bucket=32"))
    assert seen == [(32, True)]


@pytest.mark.parametrize("algorithm", ["diffusion_nft", "awm"])
def test_no_host_sync_inside_the_forward_process_update(algorithm, tiny_checkpoint, tmp_path):
    """DiffusionNFT's and AWM's micro-batch x level loop, and the old values computed before it
    (NFT's old policy lagging, a second mini-batch), with the KL's base-model forwards: no host reads."""
    from boogu_trainer.algorithms.renoise import ForwardProcessAlgorithm
    from boogu_trainer.learner import Learner

    trainer = Trainer(
        _config(
            tiny_checkpoint,
            tmp_path,
            f"algorithm.name={algorithm}",
            "sampler.window_size=0",
            "sampler.guidance_scale=1.0",
            "algorithm.mini_batches=2",
            "algorithm.kl_coef=0.01",
            "algorithm.train_micro_batch_size=2",
            "algorithm.nft.timesteps=2",
            "algorithm.nft.old_decay_rate=0.5",
            "algorithm.awm.timesteps=2",
            "algorithm.awm.clip_range=0.1",  # AWM's ratio needs old log-probs only with a clip
        )
    )
    trainer.train_step()  # NFT: the old policy now lags, so the next update precomputes its values
    trainer.step = 1
    guard = HostSyncGuard()
    regions = []
    originals = {
        name: (owner, getattr(owner, name))
        for owner, name in ((Learner, "_accumulate"), (ForwardProcessAlgorithm, "precompute_old"))
    }

    def wrap(name):
        def guarded(self, *args, **kwargs):
            regions.append(name)
            with guard.region():
                return originals[name][1](self, *args, **kwargs)

        return guarded

    try:
        for name, (owner, _) in originals.items():
            setattr(owner, name, wrap(name))
        with guard, no_tolist(guard), lengths_from_host(guard) as given:
            metrics = trainer.train_step().metrics
    finally:
        for name, (owner, fn) in originals.items():
            setattr(owner, name, fn)
    assert given and all(given)
    assert metrics["optimizer_steps"] == 4 and "kl_ref" in metrics
    assert regions.count("_accumulate") == 2 and "precompute_old" in regions
    assert metrics["fe/reference_per_image"] == 2 and metrics["fe/old_per_image"] > 0
