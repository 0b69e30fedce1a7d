"""A checkpoint's diffusers-layout LoRA in upstream's own pipeline (opt-in).

Skipped unless ``BOOGU_UPSTREAM_SRC`` names upstream's source (pattern and set-up:
tests/adapters/test_model_upstream_parity.py), e.g.::

    BOOGU_UPSTREAM_SRC=/tmp/upsrc:/tmp/upextra uv run pytest tests/trainer/test_lora_upstream.py

Upstream's ``BooguImagePipeline`` is built from components loaded with our loader (its transformer
is upstream's class, ``transformer="canonical"``), then ``load_lora_weights`` is called the way a user
would. The attached modules are counted against the trained ones, and images generated with
upstream's LoRA-loaded transformer, through the evaluation path and through upstream's own
``__call__`` (fed the engine's initial noise), equal ``boogu-sample``'s.
"""

from __future__ import annotations

import torch

from tests.upstream import import_upstream

pipeline_boogu, scheduling = import_upstream(
    "boogu.pipelines.boogu.pipeline_boogu",
    "boogu.schedulers.scheduling_flow_match_euler_discrete_time_shifting",
)

from boogu_adapters.loading import load_boogu  # noqa: E402
from boogu_schedule import derive_seed  # noqa: E402
from boogu_trainer import sample as sample_cli  # noqa: E402
from boogu_trainer.checkpoint import DIFFUSERS_LORA_NAME  # noqa: E402

from .test_sample import PROMPT, checkpoint  # noqa: E402, F401 - the one-step checkpoint fixture


def test_upstream_load_lora_weights_attaches_every_module(checkpoint, tiny_checkpoint):  # noqa: F811
    parts = load_boogu(tiny_checkpoint, transformer="canonical", trust_remote_code=True)
    assert type(parts.transformer).__module__.startswith("boogu.")  # upstream's class, not our port
    scheduler = scheduling.FlowMatchEulerDiscreteScheduler.from_pretrained(tiny_checkpoint / "scheduler")
    pipe = pipeline_boogu.BooguImagePipeline(
        transformer=parts.transformer,
        vae=parts.vae,
        scheduler=scheduler,
        mllm=parts.text_encoder,
        processor=parts.processor,
    )
    pipe.load_lora_weights(str(checkpoint), weight_name=DIFFUSERS_LORA_NAME)

    trained = sample_cli.read_lora(checkpoint)
    attached = {n.split(".lora_A")[0] for n, _ in pipe.transformer.named_parameters() if ".lora_A." in n}
    assert getattr(pipe.transformer, "peft_config", None)
    assert attached == set(trained.modules) and len(attached) > 0

    # The same images as boogu-sample with the LoRA (the project's own path, our port + our loader).
    spec = sample_cli.SampleSpec([PROMPT], num_images=2, seed=11)
    theirs, _ = sample_cli.sample(checkpoint, spec, lora="none", parts=parts)  # LoRA already in
    ours, _ = sample_cli.sample(checkpoint, spec, lora="lora")
    base, _ = sample_cli.sample(checkpoint, spec, lora="none")
    assert not torch.equal(ours, base)
    assert (theirs.int() - ours.int()).abs().max() <= 1  # uint8 images; float rounding of two ports

    # Upstream's own __call__ with its LoRA-loaded transformer, on boogu-sample's noise: prompt 0's
    # stream (seed 11, group 0) draws both images' (C, h, w) float32 noise at once.
    config = sample_cli.run_config(checkpoint)
    h, w = config.sampler.height // 8, config.sampler.width // 8
    noise = torch.randn(2, 16, h, w, generator=torch.Generator().manual_seed(derive_seed(11, 0)))
    pipe.set_progress_bar_config(disable=True)
    out = pipe(
        instruction=PROMPT,
        negative_instruction="",
        num_images_per_instruction=2,
        height=config.sampler.height,
        width=config.sampler.width,
        num_inference_steps=config.eval.num_steps,
        text_guidance_scale=config.sampler.guidance_scale,
        latents=noise,
        output_type="pt",  # (x / 2 + 0.5).clamp(0, 1) float32; PIL output rounds x * 255
        device="cpu",
    )
    upstream_call = (out.images * 255).round().to(torch.uint8)
    assert (upstream_call.int() - ours.int()).abs().max() <= 1  # as above
