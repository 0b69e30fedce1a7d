"""Recording fakes for the model-level convention tests: a transformer that returns constants and
remembers what it was given, a prompt encoder that marks positive/negative features, and a
recorder around ``sde_step``."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest
import torch

import boogu_schedule.sampling as sampling_mod
from boogu_data import PromptRecord

POS, NEG = 1.0, -1.0  # feature markers the fake encoder writes and the fake transformer reads


class RecordingTransformer(torch.nn.Module):
    """Predicts ``pos_value`` for positive prompts and ``neg_value`` for negative ones, plus
    ``ref_value`` for a sample given reference latents (so that image guidance's branches differ)."""

    def __init__(
        self,
        pos_value: float = 3.0,
        neg_value: float = 1.0,
        dtype: torch.dtype = torch.float32,
        ref_value: float = 0.0,
    ):
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros((), dtype=dtype))
        self.pos_value, self.neg_value, self.ref_value = pos_value, neg_value, ref_value
        self.calls: list[dict] = []

    def forward(
        self,
        hidden_states,
        timestep,
        instruction_hidden_states,
        freqs_cis,
        instruction_attention_mask,
        ref_image_hidden_states=None,
        attention_kwargs=None,
        return_dict=False,
    ):
        marker = instruction_hidden_states[:, 0, 0].float()  # (B,)
        self.calls.append(
            dict(
                hidden_dtype=hidden_states.dtype,
                timestep=timestep.detach().clone(),
                marker=marker.clone(),
                refs=ref_image_hidden_states,
                batch=hidden_states.shape[0],
            )
        )
        value = torch.where(marker > 0, self.pos_value, self.neg_value)
        if ref_image_hidden_states is not None:
            has_ref = torch.tensor([bool(r) for r in ref_image_hidden_states])
            value = value + self.ref_value * has_ref
        value = value.to(hidden_states.dtype)
        return value.view(-1, 1, 1, 1).expand_as(hidden_states) + self.weight * 0


def fake_encoder(instructions, images):
    """One row per instruction, marked POS for non-empty text and NEG for the empty negative."""
    hidden = torch.zeros(len(instructions), 4, 8)
    for i, text in enumerate(instructions):
        hidden[i] = POS if text else NEG
    return hidden, torch.ones(len(instructions), 4, dtype=torch.long)


class FakeCodec:
    """Reference 'images' are bytes; their latent is a constant (C, h, w) tensor per image."""

    def __init__(self, channels: int = 4):
        self.channels = channels
        self.encoded: list[bytes] = []

    def encode_references(self, images, generator):
        self.encoded.extend(images)
        return [torch.full((self.channels, 2, 2), float(len(img))) for img in images]

    def decode(self, latents):
        return torch.zeros(latents.shape[0], 3, latents.shape[2] * 8, latents.shape[3] * 8, dtype=torch.uint8)

    def latent_size(self, height, width):
        return height // 8, width // 8

    def reference_size(self, image):
        return 16, 16


@dataclass
class StepRecorder:
    calls: list[dict] = field(default_factory=list)


@pytest.fixture
def step_recorder(monkeypatch):
    """Wraps ``sde_step`` where ``boogu_schedule.sampling.sde_transition`` calls it: the one place the
    rollout loop and the training step function (``boogu_adapters.step.transition``) reach it."""
    recorder = StepRecorder()
    real = sampling_mod.sde_step

    def recording(
        sampler, sample, velocity, sigma, sigma_next, noise_level, generator=None, prev_sample=None, **kw
    ):
        recorder.calls.append(
            dict(
                sampler=str(sampler),
                sample=sample,
                velocity=velocity,
                sigma=sigma,
                sigma_next=sigma_next,
                noise_level=noise_level,
                prev_sample=prev_sample,
            )
        )
        return real(sampler, sample, velocity, sigma, sigma_next, noise_level, generator, prev_sample, **kw)

    monkeypatch.setattr(sampling_mod, "sde_step", recording)
    return recorder


def record(text: str = "a sign that says OPEN", ref: bytes | None = None, negative: str = "") -> PromptRecord:
    return PromptRecord(
        instruction=text,
        negative=negative,
        ground_truth="OPEN",
        data_source="test",
        ref_image=ref,
        split="train",
        index=0,
    )
