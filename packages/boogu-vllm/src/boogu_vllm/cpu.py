"""vllm-omni's Boogu pipeline on a CPU: the platform shims, and building the pipeline in-process.

vllm-omni 0.30 has no CPU platform. On a machine without an accelerator ``current_omni_platform`` is
``UnspecifiedOmniPlatform``, which has no diffusion attention backend, no distributed backend and
zero devices, so neither ``init_distributed_environment`` nor the Boogu transformer's attention
layers can be built. :func:`install_cpu_shims` fills those gaps (shared notes, cpu-stack.md
§8), and :func:`build_pipeline` then does in one process what vllm-omni's ``DiffusionWorker`` and
``DiffusersPipelineLoader`` do on a GPU worker: config, vllm/forward contexts, a one-rank gloo
process group, the pipeline (which loads mllm, processor, VAE and scheduler itself) and the
transformer weights through the pipeline's own ``load_weights``.

This is the path the CPU tests use to run vllm-omni's own Boogu transformer and LoRA manager
against the workspace's port on the same weights. On a GPU machine the real engine
(``Omni``/``AsyncOmni`` and its worker) builds the pipeline instead; nothing here is needed there.

The transformer's attention layers read the current forward context, vllm config and diffusion
config at call time, so every forward outside vllm-omni's own runner must run inside the context
that :func:`build_pipeline` returns::

    pipeline, context = build_pipeline("/path/to/Boogu-Image")
    with context():
        velocity = pipeline.transformer(latents, t, embeds, freqs, mask)
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import os
import socket
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

__all__ = ["build_pipeline", "install_cpu_shims", "transformer_weights"]

_SDPA_BACKEND = "vllm_omni.diffusion.attention.backends.sdpa.SDPABackend"
_shims_installed = False
_distributed_ready = False


def install_cpu_shims() -> None:
    """Make vllm-omni's diffusion stack runnable on a CPU-only host. Idempotent.

    Patches ``UnspecifiedOmniPlatform`` (the platform vllm-omni falls back to without an
    accelerator) and the SDPA attention implementation. Refuses to run when vllm-omni detected a
    real platform: these shims must never replace a GPU platform's behaviour.
    """
    global _shims_installed
    if _shims_installed:
        return
    from vllm_omni.platforms import current_omni_platform
    from vllm_omni.platforms import interface as pi

    platform_cls = pi.UnspecifiedOmniPlatform
    if not isinstance(current_omni_platform, platform_cls):
        raise RuntimeError(
            f"install_cpu_shims: vllm-omni detected {type(current_omni_platform).__name__}, not the "
            "unspecified (CPU) platform; the CPU shims are only for hosts without an accelerator"
        )

    # No CPU attention backend is registered: the platform's selector raises NotImplementedError.
    platform_cls.get_diffusion_attn_backend_cls = classmethod(
        lambda cls, selected_backend, head_size, allow_trtllm_default=False: _SDPA_BACKEND
    )
    # The unspecified platform's dist_backend is "", which torch.distributed rejects; gloo runs on CPU.
    platform_cls.dist_backend = "gloo"
    # get_device_count() is 0, and init_distributed_environment does rank % device_count.
    platform_cls.get_device_count = classmethod(lambda cls: 1)
    # There is no device to select on a CPU; the base class raises NotImplementedError.
    platform_cls.set_device = classmethod(lambda cls, device: None)

    from vllm_omni.diffusion.attention.backends.sdpa import SDPAImpl

    # SDPAImpl.forward dispatches on the platform (forward_cuda/_hip/_npu/...) and has no branch
    # for the unspecified one; forward_cuda is plain torch.nn.functional.scaled_dot_product_attention.
    SDPAImpl.forward = SDPAImpl.forward_cuda

    from vllm.lora import lora_model

    # vLLM decides pinning from the platform (True here); pin_memory() needs a CUDA driver, and
    # LoRAModel.from_lora_tensors(device="cpu") pins every LoRA tensor it builds.
    lora_model.PIN_MEMORY = False

    if importlib.util.find_spec("torchvision") is None:
        from vllm_omni.diffusion.models.boogu_image import pipeline_boogu_image

        # Qwen3VLProcessor.from_pretrained builds the torchvision-only video processor; Boogu never
        # encodes video, so the pipeline module gets the image-only subclass (same ids and pixels).
        pipeline_boogu_image.Qwen3VLProcessor = _image_only_processor_class()
    _shims_installed = True


def _image_only_processor_class() -> type:
    """``Qwen3VLProcessor`` without the video processor (as ``boogu_adapters._processor`` does)."""
    from transformers import Qwen3VLProcessor

    class ImageOnlyQwen3VLProcessor(Qwen3VLProcessor):
        def __init__(self, image_processor=None, tokenizer=None, chat_template=None, **kwargs):
            # ProcessorMixin loads the sub-processors this signature names: no video_processor.
            kwargs.pop("video_processor", None)
            super().__init__(image_processor, tokenizer, None, chat_template=chat_template, **kwargs)
            self.video_processor = None

    return ImageOnlyQwen3VLProcessor


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _init_distributed_once(vllm_config: Any, od_config: Any) -> None:
    """A one-rank gloo group and vllm-omni's model-parallel groups, once per process."""
    global _distributed_ready
    if _distributed_ready:
        return
    from vllm.config import set_current_vllm_config
    from vllm_omni.diffusion.distributed.parallel_state import (
        init_distributed_environment,
        initialize_model_parallel,
        model_parallel_is_initialized,
    )
    from vllm_omni.diffusion.forward_context import set_forward_context

    # env:// rendezvous; respect whatever a caller (or a launcher) already set.
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(_free_port()))
    os.environ.setdefault("RANK", "0")
    os.environ.setdefault("LOCAL_RANK", "0")
    os.environ.setdefault("WORLD_SIZE", "1")
    with (
        set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config),
        set_current_vllm_config(vllm_config),
    ):
        init_distributed_environment(world_size=1, rank=0, backend="gloo")
        if not model_parallel_is_initialized():
            initialize_model_parallel()
    _distributed_ready = True


def transformer_weights(model_dir: str | os.PathLike[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """``("transformer.<name>", tensor)`` for every tensor in the checkpoint's transformer shards."""
    from safetensors import safe_open

    files = sorted(glob.glob(os.path.join(os.fspath(model_dir), "transformer", "*.safetensors")))
    if not files:
        raise FileNotFoundError(f"no safetensors files under {model_dir}/transformer")
    for path in files:
        with safe_open(path, framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield f"transformer.{name}", f.get_tensor(name)


def build_pipeline(
    model_dir: str | os.PathLike[str],
    *,
    pipeline_class: type | None = None,
    dtype: torch.dtype = torch.float32,
    device: str | torch.device = "cpu",
    **od_kwargs: Any,
) -> tuple[Any, Callable[[], contextlib.AbstractContextManager]]:
    """Build vllm-omni's ``BooguImagePipeline`` (or ``pipeline_class``, a subclass) on the CPU.

    Args:
        model_dir: a local Boogu checkpoint folder (diffusers layout: mllm/ processor/ scheduler/
            transformer/ vae/).
        pipeline_class: the class to construct (default vllm-omni's ``BooguImagePipeline``); it
            must take the parent's constructor (``od_config=...``).
        dtype: dtype of every component (``OmniDiffusionConfig.dtype``).
        device: only ``"cpu"`` is supported (a GPU runs the real engine instead).
        od_kwargs: extra ``OmniDiffusionConfig`` fields.

    Returns:
        ``(pipeline, context)``: ``context()`` is a fresh context manager that re-enters the
        forward context, the current vllm config and the current diffusion config that vllm-omni's
        layers read at call time. Run every transformer forward inside it.

    Raises:
        ValueError: ``device`` is not the CPU, or the transformer weights do not cover every
            parameter of vllm-omni's transformer.
    """
    if torch.device(device).type != "cpu":
        raise ValueError(f"build_pipeline builds on the CPU only, got device={device!r}")
    install_cpu_shims()
    from vllm.config import set_current_vllm_config
    from vllm.utils.torch_utils import set_default_torch_dtype
    from vllm_omni.diffusion.config import set_current_diffusion_config
    from vllm_omni.diffusion.data import OmniDiffusionConfig, TransformerConfig
    from vllm_omni.diffusion.forward_context import set_forward_context
    from vllm_omni.diffusion.models.boogu_image.pipeline_boogu_image import BooguImagePipeline
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config

    model_dir = os.fspath(Path(model_dir).resolve())
    tf_config = json.loads(Path(model_dir, "transformer", "config.json").read_text())
    od_config = OmniDiffusionConfig.from_kwargs(
        model=model_dir,
        model_class_name="BooguImagePipeline",
        tf_model_config=TransformerConfig.from_dict(tf_config),
        dtype=dtype,
        **od_kwargs,
    )
    cpu = torch.device("cpu")
    vllm_config = create_diffusion_vllm_config(cpu, od_config)

    @contextlib.contextmanager
    def context() -> Iterator[None]:
        # The worker wraps load and execute in these; attention layers and vLLM custom ops read them.
        with (
            set_forward_context(vllm_config=vllm_config, omni_diffusion_config=od_config),
            set_current_vllm_config(vllm_config),
            set_current_diffusion_config(od_config),
        ):
            yield

    _init_distributed_once(vllm_config, od_config)
    cls = pipeline_class or BooguImagePipeline
    if not (isinstance(cls, type) and issubclass(cls, BooguImagePipeline)):
        raise TypeError(f"pipeline_class must subclass BooguImagePipeline, got {cls!r}")
    # The loader builds the pipeline under the config dtype as the torch default dtype.
    with context(), set_default_torch_dtype(dtype):
        pipeline = cls(od_config=od_config)
        loaded = pipeline.load_weights(transformer_weights(model_dir))
    expected = {f"transformer.{n}" for n, _ in pipeline.transformer.named_parameters()}
    missing = sorted(expected - set(loaded))
    if missing:
        raise ValueError(
            f"build_pipeline: {len(missing)} transformer parameters were not loaded from "
            f"{model_dir}/transformer, e.g. {missing[:5]}"
        )
    _process_weights_after_loading(pipeline.transformer)
    pipeline.eval()
    return pipeline, context


def _process_weights_after_loading(module: torch.nn.Module) -> None:
    # What DiffusersPipelineLoader does after load_weights (a no-op for unquantized float linears).
    from vllm.model_executor.layers.quantization.base_config import QuantizeMethodBase

    for sub in module.modules():
        method = getattr(sub, "quant_method", None)
        if isinstance(method, QuantizeMethodBase):
            method.process_weights_after_loading(sub)
