"""CLIP-family rewards (clip_score, pickscore, aesthetic, edit_preservation) on tiny random CLIP folders."""

from __future__ import annotations

import io
import os

import numpy as np
import pytest
import torch
from PIL import Image

from boogu_data import PromptRecord
from boogu_trainer.rewards import clip as clip_rewards
from boogu_trainer.rewards.base import RewardError
from boogu_trainer.rewards.registry import available_rewards, build_reward
from boogu_trainer.rewards.tiny_clip import (
    MARKER_NAME,
    ensure_tiny_clip,
    is_complete_tiny_clip,
    write_tiny_aesthetic_head,
)

os.environ.setdefault("HF_HUB_OFFLINE", "1")

PROMPTS = ["a photo of a cat", "a red sign", "a photo of a cat", "make the dog blue", "the text " * 60]


@pytest.fixture(scope="module")
def folders(tmp_path_factory):
    root = tmp_path_factory.mktemp("clip")
    clip = ensure_tiny_clip(root / "clip", seed=0)
    head = write_tiny_aesthetic_head(root / "head.safetensors", input_dim=16, seed=0)
    head_pth = write_tiny_aesthetic_head(root / "head.pth", input_dim=16, seed=0)
    return {"root": root, "clip": str(clip), "head": str(head), "head_pth": str(head_pth)}


def _images(n: int = 5, size: tuple[int, int] = (48, 64)) -> torch.Tensor:
    """Varied structured images (solid colours, gradients, noise): a random CLIP tells them apart."""
    generator = torch.Generator().manual_seed(1)
    height, width = size
    ramp = torch.linspace(0, 255, width).expand(height, width)
    images = [
        torch.zeros(3, height, width),
        torch.stack([ramp, ramp.flip(1), torch.full_like(ramp, 40.0)]),
        torch.tensor([255.0, 30.0, 30.0]).view(3, 1, 1).expand(3, height, width),
        torch.randint(0, 256, (3, height, width), generator=generator).float(),
        torch.full((3, height, width), 255.0),
    ]
    return torch.stack([images[i % len(images)] for i in range(n)]).round().to(torch.uint8)


def _records(n: int = 5) -> list[PromptRecord]:
    return [PromptRecord(instruction=PROMPTS[i % len(PROMPTS)]) for i in range(n)]


def _png(image: torch.Tensor) -> bytes:
    buffer = io.BytesIO()
    Image.fromarray(image.permute(1, 2, 0).numpy()).save(buffer, format="PNG")
    return buffer.getvalue()


def _all_rewards(folders):
    return [
        clip_rewards.ClipScoreReward(folders["clip"]),
        clip_rewards.PickScoreReward(folders["clip"]),
        clip_rewards.AestheticReward(folders["clip"], folders["head"]),
    ]


def _reference_embeddings(folder: str, images: torch.Tensor, texts: list[str]):
    """Float64 image/text embeddings from an independently loaded copy of the model and processor."""
    from transformers import AutoTokenizer, CLIPModel
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    model = CLIPModel.from_pretrained(folder, local_files_only=True, dtype=torch.float64).eval()
    processor = CLIPImageProcessorPil.from_pretrained(folder, local_files_only=True)
    tokenizer = AutoTokenizer.from_pretrained(folder, local_files_only=True)
    arrays = [image.permute(1, 2, 0).numpy() for image in images]
    pixels = processor(images=arrays, return_tensors="pt")["pixel_values"].to(torch.float64)
    tokens = tokenizer(texts, padding=True, truncation=True, max_length=77, return_tensors="pt")
    with torch.no_grad():
        image = clip_rewards._features(model.get_image_features(pixel_values=pixels))
        text = clip_rewards._features(
            model.get_text_features(input_ids=tokens["input_ids"], attention_mask=tokens["attention_mask"])
        )
    return image, text, float(model.logit_scale.detach().double().exp())


def test_registered_and_built_by_name(folders):
    assert {"clip_score", "pickscore", "aesthetic", "edit_preservation"} <= set(available_rewards())
    reward = build_reward("clip_score", path=folders["clip"], scale=100.0, batch_size=2)
    assert reward.name == "clip_score" and reward.scale == 100.0


def test_shapes_dtype_and_determinism(folders):
    images, records = _images(), _records()
    for reward in _all_rewards(folders):
        first = reward(images, records)
        assert first.shape == (5,) and first.dtype == torch.float32 and first.device.type == "cpu"
        assert torch.isfinite(first).all()
        assert torch.equal(first, reward(images, records)), reward.name


def test_models_load_once_per_process(folders):
    a = clip_rewards.ClipScoreReward(folders["clip"])
    b = clip_rewards.PickScoreReward(folders["clip"], batch_size=3)
    c = clip_rewards.AestheticReward(folders["clip"], folders["head"])
    assert a.clip is b.clip is c.clip
    assert c.head is clip_rewards.AestheticReward(folders["clip"], folders["head"]).head


def test_batching_matches_one_by_one(folders):
    images, records = _images(), _records()
    for reward in _all_rewards(folders):
        batched = reward(images, records)
        single = torch.cat([reward(images[i : i + 1], records[i : i + 1]) for i in range(5)])
        scale = reward.clip.logit_scale if reward.name == "pickscore" else 1.0
        torch.testing.assert_close(batched / scale, single / scale, atol=1e-6, rtol=0, msg=reward.name)
    chunked = clip_rewards.PickScoreReward(folders["clip"], batch_size=2)(images, records)
    whole = clip_rewards.PickScoreReward(folders["clip"], batch_size=32)(images, records)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


def test_clip_score_and_pickscore_formulas_in_float64(folders):
    images, records = _images(), _records()
    image, text, logit_scale = _reference_embeddings(
        folders["clip"], images, [r.instruction for r in records]
    )
    cosine = (image / image.norm(dim=-1, keepdim=True) * (text / text.norm(dim=-1, keepdim=True))).sum(-1)
    assert (cosine > 0).any() and (cosine < 0).any()  # both sides of the clamp are exercised

    clip_score = clip_rewards.ClipScoreReward(folders["clip"])(images, records)
    torch.testing.assert_close(clip_score.double(), 2.5 * cosine.clamp(min=0), atol=1e-5, rtol=0)
    torchmetrics_style = clip_rewards.ClipScoreReward(folders["clip"], scale=100.0)(images, records)
    torch.testing.assert_close(torchmetrics_style.double(), 100 * cosine.clamp(min=0), atol=1e-4, rtol=0)

    pick = clip_rewards.PickScoreReward(folders["clip"])(images, records)
    torch.testing.assert_close(pick.double(), logit_scale * cosine, atol=1e-4, rtol=0)


def test_prefix_is_prepended(folders):
    images, records = _images(2), _records(2)
    prefixed = clip_rewards.PickScoreReward(folders["clip"], prefix="A photo depicts ")(images, records)
    manual = [PromptRecord(instruction="A photo depicts " + r.instruction) for r in records]
    torch.testing.assert_close(prefixed, clip_rewards.PickScoreReward(folders["clip"])(images, manual))


def test_aesthetic_mlp_in_float64(folders):
    images, records = _images(), _records()
    image, _, _ = _reference_embeddings(folders["clip"], images, ["a"])
    x = image / image.norm(dim=-1, keepdim=True)
    state = clip_rewards.load_aesthetic_weights(folders["head"])
    for i in (0, 2, 4, 6, 7):  # no activations between the layers
        x = x @ state[f"layers.{i}.weight"].double().T + state[f"layers.{i}.bias"].double()
    scores = clip_rewards.AestheticReward(folders["clip"], folders["head"])(images, records)
    torch.testing.assert_close(scores.double(), x.squeeze(-1), atol=1e-5, rtol=0)
    from_pth = clip_rewards.AestheticReward(folders["clip"], folders["head_pth"])(images, records)
    torch.testing.assert_close(from_pth, scores, atol=0, rtol=0)


def test_bfloat16_runs_and_stays_close(folders):
    images, records = _images(), _records()
    bf16 = clip_rewards.PickScoreReward(folders["clip"], dtype="bfloat16")
    assert (
        bf16.clip.model.dtype == torch.bfloat16
        and bf16.clip is not clip_rewards.PickScoreReward(folders["clip"]).clip
    )
    scores = bf16(images, records)
    assert scores.dtype == torch.float32
    torch.testing.assert_close(
        scores, clip_rewards.PickScoreReward(folders["clip"])(images, records), atol=0.5, rtol=0
    )


@pytest.mark.parametrize("metric", ["clip", "pixel"])
def test_edit_preservation(folders, metric):
    images = _images(4)
    reference = images[1]
    reward = clip_rewards.EditPreservationReward(folders["clip"], metric=metric)
    edited = images[1].clone()
    edited[:, :24] = 255 - edited[:, :24]  # half the image changed
    outputs = torch.stack([reference, edited, images[2], images[3]])
    records = [PromptRecord(instruction="edit it", ref_image=_png(reference)) for _ in range(4)]
    scores = reward(outputs, records)
    assert scores.shape == (4,) and scores.dtype == torch.float32
    assert scores[0] == pytest.approx(1.0, abs=1e-5)
    assert (scores[1:] < scores[0] - 1e-4).all()
    if metric == "pixel":
        diff = (outputs[1].double() - reference.double()).abs().mean() / 255
        assert scores[1].item() == pytest.approx(1 - diff.item(), abs=1e-6)

    # A reference of another size is resized to the output's size first.
    big = torch.from_numpy(
        np.array(
            Image.fromarray(reference.permute(1, 2, 0).numpy()).resize((128, 96), Image.Resampling.BICUBIC)
        )
    ).permute(2, 0, 1)
    resized = reward(reference[None], [PromptRecord(instruction="e", ref_image=_png(big))])
    assert resized[0] > 0.9


def test_edit_preservation_text_to_image_rows(folders):
    images = _images(2)
    t2i = [PromptRecord(instruction="edit", ref_image=_png(images[0])), PromptRecord(instruction="t2i row")]
    with pytest.raises(RewardError, match="record 1 has no ref_image"):
        clip_rewards.EditPreservationReward(metric="pixel")(images, t2i)
    scores = clip_rewards.EditPreservationReward(folders["clip"], on_missing="nan")(images, t2i)
    assert scores[0] == pytest.approx(1.0, abs=1e-5) and torch.isnan(scores[1])
    with pytest.raises(RewardError, match="cannot decode record 0"):
        clip_rewards.EditPreservationReward(metric="pixel")(
            images[:1], [PromptRecord(instruction="e", ref_image=b"not an image")]
        )


def test_missing_paths_and_bad_options_name_the_path(folders, tmp_path):
    missing = tmp_path / "no-such-clip"
    for make in (
        lambda: clip_rewards.ClipScoreReward(str(missing)),
        lambda: clip_rewards.PickScoreReward(folders["clip"], processor_path=str(missing)),
        lambda: clip_rewards.AestheticReward(str(missing), folders["head"]),
        lambda: clip_rewards.EditPreservationReward(str(missing)),
    ):
        with pytest.raises(FileNotFoundError, match="no-such-clip"):
            make()
    with pytest.raises(FileNotFoundError, match=r"head-missing\.pth"):
        clip_rewards.AestheticReward(folders["clip"], str(tmp_path / "head-missing.pth"))
    wide = write_tiny_aesthetic_head(tmp_path / "wide.safetensors", input_dim=768)
    with pytest.raises(ValueError, match="768-wide"):
        clip_rewards.AestheticReward(folders["clip"], str(wide))
    torch.save({"fc.weight": torch.zeros(1, 16)}, tmp_path / "bad.pth")
    with pytest.raises(ValueError, match=r"layers\.0\.weight"):
        clip_rewards.AestheticReward(folders["clip"], str(tmp_path / "bad.pth"))
    with pytest.raises(ValueError, match="metric"):
        clip_rewards.EditPreservationReward(metric="lpips")
    with pytest.raises(ValueError, match="needs path"):
        clip_rewards.EditPreservationReward()
    with pytest.raises(ValueError, match="batch_size"):
        clip_rewards.ClipScoreReward(folders["clip"], batch_size=0)
    with pytest.raises(ValueError, match="dtype"):
        clip_rewards.ClipScoreReward(folders["clip"], dtype="float8")


def test_tiny_clip_builder_is_deterministic_and_atomic(folders, tmp_path):
    again = ensure_tiny_clip(tmp_path / "clip", seed=0)
    original = folders["root"] / "clip"
    assert is_complete_tiny_clip(again)
    assert (again / "model.safetensors").read_bytes() == (original / "model.safetensors").read_bytes()
    stamp = (again / MARKER_NAME).stat().st_mtime_ns
    assert ensure_tiny_clip(again, seed=0) == again and (again / MARKER_NAME).stat().st_mtime_ns == stamp
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temporaries left
    foreign = tmp_path / "foreign"
    foreign.mkdir()
    (foreign / "keep.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="foreign"):
        ensure_tiny_clip(foreign)
    assert (foreign / "keep.txt").read_text() == "mine"
