"""The tiny checkpoint loaded upstream's way: ``BooguImagePipeline.from_pretrained`` (opt-in).

Skipped unless ``BOOGU_UPSTREAM_SRC`` names upstream's source (see
``test_model_upstream_parity.py``). transformers 5.x cannot build a stock ``Qwen3VLProcessor``
without torchvision (``boogu_adapters._processor`` explains why), so without torchvision the plain
call must fail at that wall and nowhere earlier: every file the loader reads before it is there.
"""

from __future__ import annotations

import os
import sys
import warnings
from pathlib import Path

import pytest
import torch
from transformers.utils import is_torchvision_available

from boogu_adapters.loading import load_processor
from boogu_adapters.tiny import ensure_tiny_checkpoint

UPSTREAM_SRC = os.environ.get("BOOGU_UPSTREAM_SRC")
if not UPSTREAM_SRC:
    pytest.skip("set BOOGU_UPSTREAM_SRC to upstream's source to run these tests", allow_module_level=True)
if "cuda" in os.environ.get("device", "cpu"):  # noqa: SIM112 - upstream's lower-case name
    pytest.skip("upstream reads env 'device'; these tests pin its CPU path", allow_module_level=True)
sys.path[:0] = [p for p in UPSTREAM_SRC.split(os.pathsep) if p]
with warnings.catch_warnings():
    warnings.simplefilter("ignore")  # upstream warns about missing triton / flash-attn
    upstream_pipeline = pytest.importorskip("boogu.pipelines.boogu.pipeline_boogu")


@pytest.fixture(scope="module")
def fresh_tiny(tmp_path_factory) -> Path:
    return ensure_tiny_checkpoint(tmp_path_factory.mktemp("tiny") / "Boogu-Image")


def _from_pretrained(path: Path, **kwargs):
    # upstream's inference scripts: trust_remote_code=True (the two shims) and torch_dtype.
    return upstream_pipeline.BooguImagePipeline.from_pretrained(
        str(path), trust_remote_code=True, torch_dtype=torch.float32, **kwargs
    )


def test_plain_from_pretrained_reads_the_released_layout(fresh_tiny: Path) -> None:
    if is_torchvision_available():
        pipe = _from_pretrained(fresh_tiny)
        assert type(pipe.processor).__name__ == "Qwen3VLProcessor"
        assert type(pipe.processor.video_processor).__name__ == "Qwen3VLVideoProcessor"
        return
    # Before the layout fix this was OSError "Can't load video processor" (a missing file).
    with pytest.raises(ImportError, match="Qwen3VLVideoProcessor requires the Torchvision library"):
        _from_pretrained(fresh_tiny)


def test_from_pretrained_with_the_torchvision_free_processor(fresh_tiny: Path) -> None:
    processor = load_processor(fresh_tiny)
    pipe = _from_pretrained(fresh_tiny, processor=processor)
    assert pipe.processor is processor
    assert type(pipe.transformer).__name__ == "BooguImageTransformer2DModel"
    assert pipe.transformer.__module__.startswith("boogu.")  # upstream's class, through the shim
    assert type(pipe.scheduler).__module__.startswith("boogu.")
