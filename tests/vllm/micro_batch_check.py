"""``BooguSDEPipeline.rollout`` with ``spec.micro_batch_size``: chunked rollouts equal the unchunked one.

Run with the rollout environment's python (``tests/vllm/test_micro_batch.py`` does)::

    packages/boogu-vllm/.venv/bin/python tests/vllm/micro_batch_check.py <tiny checkpoint dir>

A script, not a pytest module, for the reason ``omni_backend_check.py`` gives (``boogu_vllm`` and
vllm-omni live in the rollout environment, which has no pytest). One request of 6 samples (a T2I group
with a negative, a T2I group without, an edit group; 2 samples each), CFG on and off, float32 on the
CPU, with ``micro_batch_size`` 0 (the whole request), 1, 2, 4 (a ragged last chunk of 2), 6 and 8. It
asserts:

* every returned tensor (latents, log-probs, means, final latents, uint8 images, features) and the
  metadata (timings aside) are bit for bit those of the unchunked rollout: the same seeds give the
  same noise whatever the chunking, and each chunk is the same rows in the same order;
* the transformer runs ``steps * ceil(6 / mb)`` times per branch (twice that with CFG) and the VAE
  decodes ``ceil(6 / mb)`` times, each call with at most ``mb`` samples (counted by wrapping the
  transformer's ``forward`` and the VAE's ``decode``);
* a negative ``micro_batch_size`` is refused by the spec's validation, naming the field.

Exit code 0 only if every check passes; the last line printed is a one-line summary.
"""

from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: the CPU path, also on a GPU machine

import argparse
import io
import math
import sys
import time
from pathlib import Path

import torch
from PIL import Image

SUMMARY = "micro_batch_check: OK"
"""Start of the last line printed when every check passed (the pytest wrapper looks for it)."""

STEPS = 3
SIZES = (1, 2, 4, 6, 8)


class CallLog:
    """Wraps ``owner.<name>`` (an instance attribute shadowing the method) and records each call's
    batch size (the first dimension of ``latent_arg``, a positional index or a keyword).

    ``rowwise``: the call runs one row at a time and concatenates the rows. vllm-omni's transformer
    is not batch-invariant on a CPU (its ``timestep_embedder.linear_1`` gives a row of a 4-row batch
    and of a 2-row batch 2.5e-7 apart: the matrix kernels block by row count), so only a rowwise
    model can show that chunking itself changes nothing, bit for bit: which rows go together, their
    conditioning, their order, the CFG pairing and the noise."""

    def __init__(self, owner, name: str, latent_arg: int | str, rowwise: bool = False) -> None:
        self.batches: list[int] = []
        inner = getattr(owner, name)

        def wrapped(*args, **kwargs):
            latents = args[latent_arg] if isinstance(latent_arg, int) else kwargs[latent_arg]
            rows = int(latents.shape[0])
            self.batches.append(rows)
            if not rowwise or rows == 1:
                return inner(*args, **kwargs)
            outs = [inner(*_row(args, rows, r), **_row(kwargs, rows, r)) for r in range(rows)]
            if isinstance(outs[0], tuple):
                return (torch.cat([o[0] for o in outs]),)
            return torch.cat(outs)

        setattr(owner, name, wrapped)

    def take(self) -> list[int]:
        out, self.batches = self.batches, []
        return out


def _row(values, rows: int, r: int):
    """Row ``r`` of every per-sample argument in ``values`` (a tuple or a dict): tensors and lists
    with ``rows`` entries; anything else (the RoPE tables, None) as is."""

    def pick(v):
        if isinstance(v, torch.Tensor) and v.dim() > 0 and v.shape[0] == rows:
            return v[r : r + 1]
        if isinstance(v, list) and len(v) == rows:
            return v[r : r + 1]
        return v

    if isinstance(values, dict):
        return {k: pick(v) for k, v in values.items()}
    return tuple(pick(v) for v in values)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", type=Path, help="a tiny Boogu checkpoint folder (boogu_tiny.checkpoints)"
    )
    args = parser.parse_args()
    checkpoint = args.checkpoint.resolve()
    assert (checkpoint / "transformer").is_dir(), f"{checkpoint} is not a Boogu checkpoint folder"
    start = time.perf_counter()

    from boogu_protocol import GroupSpec, ProtocolError, RolloutSpec
    from boogu_vllm.cpu import build_pipeline
    from boogu_vllm.pipeline import BooguSDEPipeline

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    images = {0: buf.getvalue()}
    groups = (
        GroupSpec("a red square", "blurry"),
        GroupSpec("a blue circle"),
        GroupSpec("make it blue", ref_image=0),
    )
    batch = len(groups) * 2

    def spec_for(guidance_scale: float, micro_batch_size: int) -> RolloutSpec:
        spec = RolloutSpec(
            groups=groups,
            group_size=2,
            num_steps=STEPS,
            guidance_scale=guidance_scale,
            sampler="flow_sde",
            noise_level=0.7,
            window={"kind": "random", "size": 2},
            height=32,
            width=32,
            seed=3,
            micro_batch_size=micro_batch_size,
        )
        # Through the wire form, as the worker receives it.
        parsed = RolloutSpec.from_json(spec.to_json())
        assert parsed.micro_batch_size == micro_batch_size
        return parsed

    checks = 0
    # Rowwise (bit for bit) with every chunk size, then vllm-omni's batched transformer and VAE as they
    # are (equal to float32 rounding); each run counts the transformer's calls and the VAE's decodes.
    for rowwise, sizes, tolerance in ((True, SIZES, 0.0), (False, (2, 4), 2e-6)):
        pipeline, context = build_pipeline(checkpoint, pipeline_class=BooguSDEPipeline, dtype=torch.float32)
        if rowwise:  # pipeline.predict(t=, latents=, ...) is one transformer call of one CFG branch
            calls = CallLog(pipeline, "predict", "latents", rowwise=True)
        else:  # nn.Module.__call__ looks forward up on the instance: every call goes through the log
            calls = CallLog(pipeline.transformer, "forward", 0)
        decodes = CallLog(pipeline.vae, "decode", 0, rowwise=rowwise)

        def rollout(spec: RolloutSpec, pipeline=pipeline, context=context):
            with context(), torch.inference_mode():
                meta, tensors = pipeline.rollout(spec, images)
            meta = dict(meta)
            meta.pop("timings")
            return meta, tensors

        for guidance_scale in (2.0, 1.0):
            branches = 2 if guidance_scale != 1.0 else 1
            meta0, whole = rollout(spec_for(guidance_scale, 0))
            assert calls.take() == [batch] * STEPS * branches
            assert decodes.take() == [batch]
            assert "images" in whole and whole["images"].dtype == torch.uint8
            for mb in sizes:
                meta, got = rollout(spec_for(guidance_scale, mb))
                chunks = math.ceil(batch / mb)
                chunk_rows = [min(mb, batch - j) for j in range(0, batch, mb)]
                made = calls.take()
                assert len(made) == STEPS * chunks * branches, (
                    f"mb={mb}, g={guidance_scale}: {len(made)} transformer calls, expected "
                    f"{STEPS} steps x {chunks} chunks x {branches} branches"
                )
                assert sorted(made) == sorted(chunk_rows * STEPS * branches), (mb, made)
                decoded = decodes.take()
                assert decoded == chunk_rows, f"mb={mb}: VAE decodes of {decoded}, expected {chunk_rows}"
                assert meta == meta0, f"mb={mb}, g={guidance_scale}: metadata {meta} vs {meta0}"
                assert sorted(got) == sorted(whole), (sorted(got), sorted(whole))
                for key, want in whole.items():
                    have = got[key]
                    assert have.dtype == want.dtype and have.shape == want.shape, (
                        key,
                        have.shape,
                        want.shape,
                    )
                    diff = (have.double() - want.double()).abs().max().item() if want.numel() else 0.0
                    # uint8 images: a rounding of values an ulp apart may flip by one level.
                    allowed = 0.0 if rowwise else (1.0 if key == "images" else tolerance)
                    if want.is_floating_point() or key == "images":
                        ok = torch.equal(have, want) if allowed == 0 else diff <= allowed
                    else:
                        ok = torch.equal(have, want)
                    assert ok, (
                        f"mb={mb}, g={guidance_scale}, rowwise={rowwise}: {key} differs from the unchunked "
                        f"rollout by {diff} (allowed {allowed})"
                    )
                checks += 1
                what = "bitwise equal" if rowwise else f"equal within {tolerance:g}"
                print(
                    f"ok  rowwise={rowwise} g={guidance_scale} mb={mb}: {chunks} chunks, {what}", flush=True
                )

    try:
        RolloutSpec.from_json({**spec_for(1.0, 0).to_json(), "micro_batch_size": -1})
    except ProtocolError as error:
        assert "spec.micro_batch_size" in str(error), error
    else:
        raise AssertionError("a negative micro_batch_size was accepted")

    elapsed = time.perf_counter() - start
    print(f"{SUMMARY}: {checks} chunked rollouts equal the unchunked ones in {elapsed:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    if not __debug__:
        sys.exit("micro_batch_check: run without -O (the checks are assert statements)")
    sys.exit(main())
