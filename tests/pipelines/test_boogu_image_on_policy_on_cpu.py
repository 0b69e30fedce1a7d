"""The test the reference lacks: rollout and training compute the same log-probs, with the real
tiny checkpoint (Qwen3-VL encoder, VAE, transformer with LoRA), for T2I and for edit."""

from __future__ import annotations

import io

import pytest
import torch
from PIL import Image, ImageDraw

from boogu_adapters.components import build_local_engine
from boogu_adapters.loading import load_boogu
from boogu_adapters.lora import WeightSyncError, add_lora, lora_fingerprint, lora_state_dict
from boogu_adapters.recompute import TransitionRecompute
from boogu_adapters.types import RolloutRequest
from boogu_data import PromptRecord
from boogu_schedule import WindowPlan


def png(text: str, size: int = 32) -> bytes:
    img = Image.new("RGB", (size, size), "white")
    ImageDraw.Draw(img).text((2, 10), text, fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


@pytest.fixture(scope="module")
def lora_parts(tiny_checkpoint):
    parts = load_boogu(tiny_checkpoint, transformer="native")
    model = add_lora(parts.transformer, rank=4, alpha=8, seed=0)
    with torch.no_grad():  # a non-zero LoRA, so the adapted policy differs from the base
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.05, generator=torch.Generator().manual_seed(len(name)))
    return parts, model


T2I = [
    PromptRecord(instruction='A sign that says "OPEN"', ground_truth="OPEN"),
    PromptRecord(instruction='A mug printed with "TEA"', ground_truth="TEA"),
]
EDIT = [
    PromptRecord(instruction='Change the text to "SALE"', ground_truth="SALE", ref_image=png("OPEN")),
    PromptRecord(instruction='Change the text to "TEA"', ground_truth="TEA", ref_image=png("MUG")),
]


@pytest.mark.parametrize("records", [T2I, EDIT], ids=["t2i", "edit"])
@pytest.mark.parametrize("cfg_mode", ["batched", "sequential"])
def test_training_recomputes_the_rollout_log_prob_bitwise(lora_parts, records, cfg_mode):
    parts, model = lora_parts
    engine = build_local_engine(parts, transformer=model, cfg_mode=cfg_mode)
    request = RolloutRequest(
        records,
        group_size=3,
        num_steps=5,
        guidance_scale=3.0,
        height=32,
        width=32,
        seed=11,
        window=WindowPlan(kind="random", size=2, window_range=(0, 4)),
    )
    traj = engine.generate(request)
    assert traj.images.shape == (6, 3, 32, 32) and traj.images.dtype == torch.uint8
    if records is EDIT:
        assert traj.conditioning.is_edit and engine.stats.reference_images_encoded == 2  # once per prompt
    assert (engine.stats.prompts_encoded, engine.stats.negatives_encoded) == (
        2,
        1,
    )  # once per group, not per sample
    adapter = TransitionRecompute(engine.freqs_cis)
    for k in range(traj.window_size):
        full = adapter.step_stats(model, traj, k)
        assert torch.equal(full.log_prob, traj.log_prob[:, k])
        assert torch.equal(full.mean, traj.mean[:, k])
        # A subset runs GEMMs of another batch size, whose rounding differs (~2e-7 in the timestep
        # embedder): equal within 1e-6, bitwise only for the rollout's own batch above.
        part = adapter.step_stats(model, traj, k, index=[4, 1])
        torch.testing.assert_close(part.log_prob, traj.log_prob[[4, 1], k], rtol=0, atol=1e-6)
        torch.testing.assert_close(part.mean, traj.mean[[4, 1], k], rtol=0, atol=1e-5)
        ref = adapter.step_stats(model, traj, k, use_adapters=False)
        assert not torch.equal(ref.log_prob, full.log_prob)  # the reference policy differs


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["image-only", "double"])
def test_edit_image_guidance_is_recomputed_bitwise_in_both_cfg_modes(lora_parts, guidance):
    """Upstream's image guidance on the real tiny model (a forward without the reference latents;
    with text CFG, double guidance): training recomputes every window log-prob bitwise in each CFG
    mode, the two modes agree within float tolerance, and the guidance changes the trajectory."""
    parts, model = lora_parts

    def request(image_guidance: float) -> RolloutRequest:
        return RolloutRequest(
            EDIT,
            group_size=2,
            num_steps=4,
            guidance_scale=guidance,
            image_guidance_scale=image_guidance,
            height=32,
            width=32,
            seed=7,
            window=WindowPlan(kind="fixed", size=2, start=1),
        )

    runs = {}
    for cfg_mode in ("batched", "sequential"):
        engine = build_local_engine(parts, transformer=model, cfg_mode=cfg_mode)
        traj = runs[cfg_mode] = engine.generate(request(2.0))
        branches = 3 if guidance > 1 else 2
        assert traj.nfe == 4 * 4 * branches == engine.stats.transformer_sample_forwards
        adapter = TransitionRecompute(engine.freqs_cis)
        for k in range(traj.window_size):
            full = adapter.step_stats(model, traj, k)
            assert torch.equal(full.log_prob, traj.log_prob[:, k])
            assert torch.equal(full.mean, traj.mean[:, k])
    a, b = runs["batched"], runs["sequential"]
    torch.testing.assert_close(a.latents, b.latents, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.log_prob, b.log_prob, rtol=1e-4, atol=1e-4)
    off = build_local_engine(parts, transformer=model).generate(request(1.0))
    assert (off.final_latents - a.final_latents).abs().max() > 1e-3


def test_batched_cfg_equals_sequential_within_float_tolerance(lora_parts):
    parts, model = lora_parts
    request = RolloutRequest(
        T2I,
        group_size=2,
        num_steps=4,
        guidance_scale=4.0,
        height=32,
        width=32,
        seed=3,
        window=WindowPlan(kind="fixed", size=2, start=1),
    )
    a = build_local_engine(parts, transformer=model, cfg_mode="batched").generate(request)
    b = build_local_engine(parts, transformer=model, cfg_mode="sequential").generate(request)
    # Padding the shorter prompt to the longer one's length is invisible to the model (masked).
    torch.testing.assert_close(a.latents, b.latents, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close(a.log_prob, b.log_prob, rtol=1e-4, atol=1e-4)


def test_same_request_same_weights_same_trajectory(lora_parts):
    parts, model = lora_parts
    engine = build_local_engine(parts, transformer=model)
    request = RolloutRequest(EDIT, group_size=2, num_steps=4, height=32, width=32, seed=5)
    a, b = engine.generate(request), engine.generate(request)
    assert torch.equal(a.latents, b.latents) and torch.equal(a.images, b.images) and a.window == b.window


@pytest.mark.parametrize("records", [T2I, EDIT], ids=["t2i", "edit"])
def test_the_engines_caches_change_no_number(lora_parts, records):
    """Prompt batches kept by the encoder, and the text path of a rollout's first step reused by its
    later ones: the trajectory is bitwise the one with both off, in each CFG mode and micro-batched."""
    parts, model = lora_parts
    request = RolloutRequest(
        records,
        group_size=3,
        num_steps=4,
        guidance_scale=3.0,
        height=32,
        width=32,
        seed=5,
        window=WindowPlan(kind="random", size=2, window_range=(0, 3)),
    )
    fields = ("latents", "log_prob", "mean", "std", "final_latents", "images")
    for cfg_mode, micro in (("batched", 0), ("sequential", 0), ("batched", 4)):
        plain = build_local_engine(
            parts,
            transformer=model,
            cfg_mode=cfg_mode,
            micro_batch_size=micro,
            encode_cache=False,
            cache_text_path=False,
        )
        cached = build_local_engine(parts, transformer=model, cfg_mode=cfg_mode, micro_batch_size=micro)
        want = plain.generate(request)
        assert plain.encode_prompts.cache is None and not model.last_text_path_reused
        for _ in range(2):  # the second rollout's prompt batches come from the encoder's cache
            got = cached.generate(request)
            assert model.last_text_path_reused  # the last step ran on the first step's text path
            for name in fields:
                assert torch.equal(getattr(got, name), getattr(want, name)), (cfg_mode, micro, name)
            assert torch.equal(got.conditioning.hidden_states, want.conditioning.hidden_states)
        # positives and the negative: encoded by the first rollout, served to the second
        assert (cached.encode_prompts.cache.misses, cached.encode_prompts.cache.hits) == (2, 2)


def test_sync_weights_verifies_keys_and_values(lora_parts, tiny_checkpoint):
    parts, model = lora_parts
    # The engine that shares the trainer's module copies nothing: it checks it was handed that very
    # module and records the version.
    shared = build_local_engine(parts, transformer=model)
    assert not shared.needs_lora_state
    shared.sync_weights(1, module=model)
    assert shared.weights_version == 1 and shared.sync_log == [(1, "shared")]
    with pytest.raises(WeightSyncError, match="not newer"):
        shared.sync_weights(1, module=model)
    with pytest.raises(WeightSyncError, match="a different module"):
        shared.sync_weights(2, module=torch.nn.Linear(2, 2))
    with pytest.raises(WeightSyncError, match="no module"):
        shared.sync_weights(2)
    # A separate module (e.g. another process's engine) gets the values loaded and checked.
    state = {k: v.detach().clone() for k, v in lora_state_dict(model).items()}
    other_parts = load_boogu(tiny_checkpoint, transformer="native")
    other_model = add_lora(other_parts.transformer, rank=4, alpha=8, seed=1)
    separate = build_local_engine(other_parts)
    assert separate.transformer is other_model and not separate.shares_module and separate.needs_lora_state
    with pytest.raises(WeightSyncError, match="needs the LoRA state"):
        separate.sync_weights(7)
    missing = dict(list(state.items())[1:])
    with pytest.raises(WeightSyncError, match="1 missing"):
        separate.sync_weights(7, missing)
    extra = {**state, "x_embedder.lora_A.weight": torch.zeros(4, 4)}
    with pytest.raises(WeightSyncError, match="1 unexpected"):
        separate.sync_weights(7, extra)
    separate.sync_weights(7, state)
    for k, v in lora_state_dict(other_model).items():
        assert torch.equal(v, state[k])
    assert separate.sync_log == [(7, lora_fingerprint(state))]


def test_bf16_model_float32_trajectory_and_on_policy_log_probs(tiny_checkpoint):
    parts = load_boogu(tiny_checkpoint, transformer="native", dtype=torch.bfloat16)
    model = add_lora(parts.transformer, rank=4, alpha=8, seed=0)
    engine = build_local_engine(parts, transformer=model)
    traj = engine.generate(
        RolloutRequest(
            T2I,
            group_size=2,
            num_steps=4,
            height=32,
            width=32,
            seed=2,
            window=WindowPlan(kind="fixed", size=2, start=0),
        )
    )
    assert traj.latents.dtype == traj.log_prob.dtype == torch.float32
    adapter = TransitionRecompute(engine.freqs_cis)
    for k in range(2):
        again = adapter.step_stats(model, traj, k)
        torch.testing.assert_close(again.log_prob, traj.log_prob[:, k], rtol=0, atol=1e-6)
