"""GPU rollout backend: ``BooguSDEPipeline`` served by vllm-omni 0.30's diffusion engine.

On a CPU machine the rollout worker calls the pipeline directly (``boogu_vllm.worker.DirectBackend``);
on a GPU it goes through this module, which runs the same pipeline inside vllm-omni (its worker, weight
loader, attention backends, LoRA manager, memory pools). `OmniBackend` is the worker's ``Backend``
(``name``, ``generate``, ``load_lora``, ``clear_lora``, ``close``). Nothing here imports vllm or
vllm-omni at module level: the module imports on a CPU-only machine, and `OmniBackend` raises
`RuntimeError` there.

Design
======

Engine object. `OmniBackend` builds a ``vllm_omni.diffusion.diffusion_engine.DiffusionEngine`` (the
object vllm-omni's single-stage ``InlineStageDiffusionClient`` builds), not the top-level
``vllm_omni.Omni``, whose output path runs the model's post-process hook
(``VaeImageProcessor.postprocess``, which rejects a dict). The engine's synchronous
``add_req_and_wait_for_response`` returns the worker's raw ``DiffusionOutput`` before any
post-processing. Its busy-loop thread is never started (only its async methods start it), so requests
and ``collective_rpc`` are serialized by the engine's own lock. With one GPU vllm-omni picks the
in-process executor (``"uni"``): the worker lives in this process. Given
``custom_pipeline_args={"pipeline_class": ...}`` its ``WorkerWrapperBase`` skips the default model load
and builds only the custom class (load format ``"custom_pipeline"``).

Request. One ``OmniDiffusionRequest`` per `OmniBackend.generate` (``max_num_seqs=1``), with
``sampling_params.extra_args = {"boogu_rl": {"spec": <RolloutSpec json>, "images": {i: bytes}}}``
(the contract of ``BooguSDEPipeline.forward``; ``images`` from the ``ref_image.{i}`` tensors), a
placeholder text prompt without ``multi_modal_data`` (upstream's Boogu pre-process hook passes it
through), and ``sampling_params.lora_request`` = the loaded adapter's ``LoRARequest``, or ``None``
with none loaded: the worker's ``execute_model`` calls ``lora_manager.set_active_adapter`` with it on
every request, so a request without it switches the adapter off. The spec is checked here
(``RolloutSpec.from_json``) so that a bad spec is a ``ProtocolError``, as with the direct backend.

Result. The pipeline returns ``DiffusionOutput(output={"boogu_rl": boogu_protocol.pack(meta,
tensors)})``; `generate` returns ``boogu_protocol.unpack`` of it. Bytes cross both executors as they
are (the multi-process executor pickles them).

LoRA. One implementation, ``boogu_vllm.lora.LoraSlot``, the direct backend's: key renames, packed
modules, the in-memory tensor hook, the key check, the read-back fingerprint. `BooguWorkerExtension`
is mixed into vllm-omni's ``DiffusionWorker`` (``worker_extension_cls``) and reached with
``collective_rpc``; it keeps one ``LoraSlot(pipeline, manager=<the worker's lora_manager>)``, rebuilt if
the worker re-initializes its pipeline, whose manager calls run in the worker's forward / vllm /
diffusion config contexts. ``boogu_load_lora`` receives one ``boogu_protocol.pack({"version",
"peft_config"}, tensors)`` blob, calls ``LoraSlot.load`` and, on success, sets the pipeline's
``lora_version`` / ``lora_fingerprint`` (what the rollout metadata reports); ``boogu_clear_lora``
calls ``LoraSlot.clear`` and sets ``lora_version`` = the given version, ``lora_fingerprint = None``.
Both return, never raise (errors as ``{"ok": False, "kind", "error"}``, the same under both
executors), and report which adapter the slot holds afterwards (``serving``: name, int id, path,
version, or ``None``). `OmniBackend` attaches a ``LoRARequest`` with that name / id / path to every
following request: the manager finds the id registered and active and re-binds nothing. The request
carries no tensors; should the manager ever have to load it again, it fails loudly (no such path)
rather than serve other weights. A failed load is raised here with the worker's exception type name
kept (``LoraSyncError`` -> HTTP 409, ``ProtocolError`` / ``ValueError`` -> 400 / 422, else
``RuntimeError``); what is served afterwards is whatever the slot reports (``LoraSlot.load`` decides:
the previous adapter, or the base weights), and if the slot holds none, the pipeline's
``lora_fingerprint`` is set to ``None`` so that the metadata does not claim an adapter. On more than
one GPU a failure on a rank other than 0 raises out of ``collective_rpc`` (below) while rank 0 may
have loaded the new adapter: `OmniBackend` then refuses every `generate`, naming the failed call,
until a load or clear succeeds on every rank, rather than roll out on ranks that disagree.

Untested
========

No GPU was available when this was written: the following was written from reading the vllm-omni
0.30.0 and vllm 0.30.0 sources, and only the CPU-checkable pieces (next section) were run.

* The whole GPU path: engine construction, the start-up warm-up request (``BooguSDEPipeline`` sends a
  request without ``"boogu_rl"`` to the parent's sampler), `generate`, `load_lora`, `clear_lora`,
  `sleep` / `wake_up`, `close`.
* ``LoraSlot`` on the real Boogu port's layers on a GPU (GQA ``to_qkv``, ``img_to_qkv`` /
  ``instruct_to_qkv``, ``gate_up_proj``, released shapes) and inside the worker's contexts.
* That the per-request ``LoRARequest`` (same id as the slot's ``TensorLoRARequest``, no tensors) is
  always found registered and active by ``execute_model``.
* The multi-process executor (``engine_args={"distributed_executor_backend": "mp"}``; the RPC
  arguments and replies are bytes, dicts, ints, strings) and more than one GPU (``collective_rpc``
  runs the LoRA methods on every rank; rank 0's reply is read, and a failure on another rank
  raises there, which vllm-omni's status gather turns into a ``RuntimeError`` naming the rank).
* Sleep mode: ``sleep`` / ``wake_up`` need ``engine_args={"enable_sleep_mode": True}``; the LoRA buffers
  are allocated outside the weights memory pool, so sleep does not free them.

Checked on the CPU with the rollout env's python (scripts outside the repository): this module imports
without CUDA and without importing vllm; `OmniBackend` raises `RuntimeError` without CUDA; the
``OmniDiffusionConfig`` built here constructs; with the engine faked (a ``DiffusionEngine`` stand-in
whose ``collective_rpc`` calls a worker object built from `BooguWorkerExtension` over the tiny
checkpoint's ``BooguSDEPipeline`` and a real ``DiffusionLoRAManager``, and whose request path does
what ``DiffusionWorker.execute_model`` does: ``set_active_adapter(sampling_params.lora_request)``
then ``pipeline.forward``), `generate` / `load_lora` / `clear_lora` give the direct backend's
trajectories and fingerprints, a key that attaches to nothing raises ``LoraSyncError``.

vllm-omni / vllm APIs relied on (paths under ``site-packages``)
===============================================================

* ``vllm_omni/diffusion/data.py``: ``OmniDiffusionConfig.from_kwargs`` (fields ``model``,
  ``model_class_name``, ``dtype``, ``custom_pipeline_args``, ``worker_extension_cls``,
  ``max_num_seqs``), ``OmniDiffusionConfig.enrich_config``, ``DiffusionOutput`` (``output``, ``error``,
  ``aborted``, ``abort_message``, ``peak_memory_mb``).
* ``vllm_omni/diffusion/diffusion_engine.py``: ``DiffusionEngine.make_engine`` (construction and the
  warm-up ``_dummy_run``), ``add_req_and_wait_for_response``, ``collective_rpc`` (kwargs, ``timeout``;
  a one-element list without ``unique_reply_rank``), ``close``.
* ``vllm_omni/diffusion/worker/diffusion_worker.py``: ``WorkerWrapperBase`` (custom pipeline: skips the
  default load, calls the worker's ``re_init_pipeline``; mixes in ``worker_extension_cls``, and mixes in
  ``CustomPipelineWorkerExtension`` only when none is given, hence `BooguWorkerExtension.re_init_pipeline`),
  ``CustomPipelineWorkerExtension.re_init_pipeline``, ``DiffusionWorker.execute_model`` (activates
  ``sampling_params.lora_request``), ``DiffusionWorker.rank`` (its gpu_id), ``WorkerProc._execute_rpc``
  (default reply mode: every rank runs the method and reports an exception in its status, rank 0
  replies; ``executor/multiproc_executor.py`` raises ``RuntimeError`` for any failed rank's status),
  ``DiffusionWorker.lora_manager`` / ``model_runner.pipeline`` /
  ``vllm_config`` / ``od_config``, ``sleep``, ``wake_up``.
* ``vllm_omni/diffusion/forward_context.py``: ``set_forward_context``; ``vllm/config``:
  ``set_current_vllm_config``; ``vllm_omni/diffusion/config.py``: ``set_current_diffusion_config``.
* ``vllm_omni/diffusion/lora/manager.py``: ``DiffusionLoRAManager.set_active_adapter`` (an id already
  registered and active at the same scale is a no-op); everything else through ``boogu_vllm.lora``.
* ``vllm_omni/diffusion/request.py``: ``OmniDiffusionRequest``; ``vllm_omni/inputs/data.py``:
  ``OmniDiffusionSamplingParams`` (``extra_args``, ``lora_request``, ``lora_scale``, ``seed``).
* ``vllm/lora/request.py``: ``LoRARequest``.
"""

from __future__ import annotations

import contextlib
import logging
import os
import time
import uuid
from collections.abc import Iterator, Mapping
from typing import Any

import torch

from boogu_protocol import ProtocolError, RolloutSpec, pack, reference_images, unpack

PIPELINE_CLASS = "boogu_vllm.pipeline.BooguSDEPipeline"
"""Qualified name of the custom pipeline class vllm-omni's worker builds."""
WORKER_EXTENSION_CLASS = "boogu_vllm.omni_backend.BooguWorkerExtension"
"""Qualified name of the worker mixin that carries the LoRA RPCs."""
MODEL_CLASS_NAME = "BooguImagePipeline"
"""vllm-omni's registry name for the parent pipeline: it selects the pre-process hook and the warm-up."""

_PLACEHOLDER_PROMPT = "[boogu_rl]"
_RPC_TIMEOUT_S = 600.0
_ERROR_TYPES: dict[str, type[Exception]] = {"ProtocolError": ProtocolError, "ValueError": ValueError}

log = logging.getLogger(__name__)


# ---- the worker side ---------------------------------------------------------------------------
class BooguWorkerExtension:
    """Mixed into vllm-omni's ``DiffusionWorker`` through ``worker_extension_cls``; reached by
    ``collective_rpc``. ``self`` is the worker (``lora_manager``, ``model_runner``, ``vllm_config``,
    ``od_config``)."""

    def re_init_pipeline(self, custom_pipeline_args: dict[str, Any]) -> None:
        # vllm-omni mixes in its CustomPipelineWorkerExtension (which builds the custom pipeline)
        # only when no worker_extension_cls is given, yet always calls re_init_pipeline: delegate.
        from vllm_omni.diffusion.worker.diffusion_worker import CustomPipelineWorkerExtension

        CustomPipelineWorkerExtension.re_init_pipeline(self, custom_pipeline_args)

    @contextlib.contextmanager
    def _boogu_context(self) -> Iterator[None]:
        """The contexts the worker loads and runs the model in (vLLM layers read them when built)."""
        from vllm.config import set_current_vllm_config
        from vllm_omni.diffusion.config import set_current_diffusion_config
        from vllm_omni.diffusion.forward_context import set_forward_context

        with (
            set_forward_context(vllm_config=self.vllm_config, omni_diffusion_config=self.od_config),
            set_current_vllm_config(self.vllm_config),
            set_current_diffusion_config(self.od_config),
        ):
            yield

    def _boogu_slot(self) -> Any:
        """The worker's one ``LoraSlot``, over the current pipeline and LoRA manager."""
        from boogu_vllm.lora import LoraSlot

        pipeline = self.model_runner.pipeline
        manager = getattr(self, "lora_manager", None)
        if pipeline is None or manager is None:
            raise RuntimeError(
                "the diffusion worker has no pipeline or no LoRA manager (not loaded, or LoRA fused at load time)"
            )
        slot = getattr(self, "_boogu_lora_slot", None)
        if slot is None or slot.pipeline is not pipeline or slot.manager is not manager:
            slot = LoraSlot(pipeline, manager=manager, context=self._boogu_context)
            self._boogu_lora_slot = slot
        return slot

    def _boogu_reply(self, reply: dict[str, Any]) -> dict[str, Any]:
        slot = getattr(self, "_boogu_lora_slot", None)
        request = None if slot is None else slot.request
        reply["serving"] = (
            None
            if request is None
            else {
                "lora_name": request.lora_name,
                "lora_int_id": request.lora_int_id,
                "lora_path": request.lora_path,
                "version": slot.version,
            }
        )
        pipeline = self.model_runner.pipeline
        if request is None and pipeline is not None:
            pipeline.lora_fingerprint = None  # the base weights serve: no fingerprint to report
        return reply

    def _boogu_error(self, what: str, exc: Exception) -> dict[str, Any]:
        """The failure reply of rank 0. Any other rank raises instead: ``collective_rpc`` (default
        reply mode) returns rank 0's result only, so a reply from another rank would be dropped; a
        raise reaches the caller through vllm-omni's gather of every rank's status, as
        ``RuntimeError("RPC '<method>' failed on worker rank(s): rank N: <type>: <message>")``."""
        if getattr(self, "rank", 0) != 0:  # DiffusionWorker.rank (= its gpu_id)
            raise exc
        if type(exc).__name__ not in ("LoraSyncError", "ProtocolError"):
            log.exception("%s failed in the diffusion worker", what)
        return {"ok": False, "kind": type(exc).__name__, "error": str(exc)}

    def boogu_load_lora(self, message: bytes) -> dict[str, Any]:
        """``message`` = ``pack({"version", "peft_config"}, tensors)``: ``LoraSlot.load`` it.

        Returns ``{"ok": True, "ack": {"version", "fingerprint", "keys"}, "serving"}`` or ``{"ok":
        False, "kind", "error", "serving"}``.
        """
        try:
            meta, tensors = unpack(message)
            version = meta["version"]
            slot = self._boogu_slot()
            ack = slot.load(version, meta["peft_config"], tensors)
            pipeline = self.model_runner.pipeline
            pipeline.lora_version, pipeline.lora_fingerprint = version, ack["fingerprint"]
            reply: dict[str, Any] = {"ok": True, "ack": ack}
        except Exception as exc:  # reported to the caller with the state it left
            reply = self._boogu_error("boogu_load_lora", exc)
        return self._boogu_reply(reply)

    def boogu_clear_lora(self, version: int) -> dict[str, Any]:
        """Back to the base weights (``LoraSlot.clear``); the pipeline reports ``version``."""
        try:
            self._boogu_slot().clear()
            self.model_runner.pipeline.lora_version = version
            self.model_runner.pipeline.lora_fingerprint = None
            reply: dict[str, Any] = {"ok": True}
        except Exception as exc:
            reply = self._boogu_error("boogu_clear_lora", exc)
        return self._boogu_reply(reply)


# ---- the backend ---------------------------------------------------------------------------------
class OmniBackend:
    """The rollout worker's ``Backend`` on one GPU: vllm-omni's engine, one request at a time."""

    name = "omni"

    def __init__(
        self,
        model_dir: str,
        *,
        dtype: str = "bfloat16",
        devices: str | None = None,
        engine_args: dict | None = None,
    ) -> None:
        """Build the engine serving `PIPELINE_CLASS` (loads every component, runs vllm-omni's warm-up).

        ``devices``: ``CUDA_VISIBLE_DEVICES`` for this process (e.g. ``"3"``); set before CUDA starts.
        ``engine_args``: extra ``OmniDiffusionConfig`` fields (e.g. ``enable_sleep_mode``,
        ``diffusion_attention_config``); the ones this backend depends on cannot be overridden.
        """
        self._engine: Any = None
        self._lora_request: Any = None
        self._unsynced: str | None = None
        """Set when a LoRA call raised out of ``collective_rpc`` (a rank other than 0 failed, or the
        RPC did): the ranks may now hold different adapters, so `generate` refuses until a load or
        clear succeeds."""
        self.last_stats: dict[str, float] = {}
        """``wall_s`` and ``peak_memory_mb`` of the last `generate`."""
        if devices is not None:
            _set_visible_devices(devices)
        if not torch.cuda.is_available():
            raise RuntimeError(
                "OmniBackend needs a CUDA GPU (vllm-omni's diffusion worker has no CPU platform); "
                "on a CPU machine use the direct backend (boogu_vllm.worker.DirectBackend)"
            )
        fixed = {
            "model": model_dir,
            "model_class_name": MODEL_CLASS_NAME,
            "dtype": dtype,
            "custom_pipeline_args": {"pipeline_class": PIPELINE_CLASS},
            "worker_extension_cls": WORKER_EXTENSION_CLASS,
            "max_num_seqs": 1,
        }
        clash = sorted(set(engine_args or {}) & set(fixed))
        if clash:
            raise ValueError(f"engine_args may not set {clash}: OmniBackend fixes them")

        from vllm_omni.diffusion.data import OmniDiffusionConfig
        from vllm_omni.diffusion.diffusion_engine import DiffusionEngine

        od_config = OmniDiffusionConfig.from_kwargs(**{**(engine_args or {}), **fixed})
        od_config.enrich_config()  # model_index.json + transformer/config.json, as vllm-omni's stage client does
        self._engine = DiffusionEngine.make_engine(od_config)

    # ---- rollouts --------------------------------------------------------------------------------
    def generate(
        self, spec: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> tuple[dict, dict[str, torch.Tensor]]:
        """One rollout request (``spec``: a ``RolloutSpec`` as JSON; ``tensors``: ``ref_image.{i}``);
        returns the pipeline's ``(meta, tensors)``."""
        self._check_open()
        if self._unsynced is not None:
            raise RuntimeError(
                f"the vllm-omni ranks may hold different LoRA weights since {self._unsynced}; "
                "load or clear a LoRA before the next rollout"
            )
        from vllm_omni.diffusion.request import OmniDiffusionRequest
        from vllm_omni.inputs.data import OmniDiffusionSamplingParams

        from boogu_vllm.pipeline import RL_KEY

        RolloutSpec.from_json(spec)  # a bad spec is a ProtocolError here, not an error inside the engine
        sampling_params = OmniDiffusionSamplingParams(
            num_outputs_per_prompt=1,
            seed=0,  # the pipeline draws its noise from the spec's seeds; this only fixes the runner's generator
            extra_args={RL_KEY: {"spec": spec, "images": reference_images(tensors)}},
            lora_request=self._lora_request,
            lora_scale=1.0,
        )
        request = OmniDiffusionRequest(
            prompt={"prompt": _PLACEHOLDER_PROMPT},
            sampling_params=sampling_params,
            request_id=f"boogu-rl-{uuid.uuid4().hex}",
        )
        start = time.perf_counter()
        output = self._engine.add_req_and_wait_for_response(request)
        if output.aborted:
            raise RuntimeError(f"rollout request aborted: {output.abort_message}")
        if output.error:
            raise RuntimeError(f"BooguSDEPipeline failed in the vllm-omni worker: {output.error}")
        result = output.output
        if not isinstance(result, Mapping) or not isinstance(result.get(RL_KEY), (bytes, bytearray)):
            got = sorted(result) if isinstance(result, Mapping) else type(result).__name__
            raise RuntimeError(
                f"BooguSDEPipeline returned {got}; expected {{{RL_KEY!r}: <protocol message>}}"
            )
        meta, out = unpack(bytes(result[RL_KEY]))
        self.last_stats = {
            "wall_s": time.perf_counter() - start,
            "peak_memory_mb": float(output.peak_memory_mb or 0.0),
        }
        return meta, out

    # ---- LoRA --------------------------------------------------------------------------------------
    def load_lora(self, version: int, peft_config: dict[str, Any], tensors: dict[str, torch.Tensor]) -> dict:
        """Serve ``tensors`` (the trainer's LoRA file keys) for every following `generate`, through the
        worker's ``LoraSlot``. Returns ``{"version", "fingerprint", "keys"}`` (the fingerprint read back
        from vllm-omni's LoRA layers); raises the worker's error (``LoraSyncError`` for a LoRA that does
        not fit) and then serves what the slot holds."""
        self._check_open()
        message = pack({"version": version, "peft_config": dict(peft_config)}, tensors)
        reply = self._lora_rpc(f"load_lora v{version}", "boogu_load_lora", message=message)
        self._serve(reply)
        if not reply["ok"]:
            raise self._error(f"load_lora v{version}", reply)
        return reply["ack"]

    def clear_lora(self, version: int) -> dict:
        """Serve the base weights from now on; the rollouts report ``version``."""
        self._check_open()
        reply = self._lora_rpc(f"clear_lora v{version}", "boogu_clear_lora", version=version)
        self._serve(reply)
        if not reply["ok"]:
            raise self._error(f"clear_lora v{version}", reply)
        return {"version": version, "fingerprint": None, "keys": 0}

    def _lora_rpc(self, what: str, method: str, **kwargs: Any) -> dict[str, Any]:
        """A LoRA RPC on every rank. A failure of rank 0 alone comes back as its reply. A failure of
        any other rank raises out of ``collective_rpc``, and rank 0 (or another rank) may have
        succeeded: the ranks may now serve different weights, so `generate` refuses from then on,
        until a load or clear succeeds on every rank."""
        try:
            reply = self._rpc(method, **kwargs)
        except Exception as exc:  # not rank 0's reply: another rank failed, or the RPC itself
            self._unsynced = f"{what} raised {type(exc).__name__}"
            raise
        if reply["ok"]:
            self._unsynced = None
        return reply

    def _serve(self, reply: Mapping[str, Any]) -> None:
        """The ``LoRARequest`` every following request carries: the adapter the worker's slot holds."""
        serving = reply.get("serving")
        if serving is None:
            self._lora_request = None
            return
        from vllm.lora.request import LoRARequest

        self._lora_request = LoRARequest(
            lora_name=serving["lora_name"], lora_int_id=serving["lora_int_id"], lora_path=serving["lora_path"]
        )

    @staticmethod
    def _error(what: str, reply: Mapping[str, Any]) -> Exception:
        kind, message = reply["kind"], reply["error"]
        serving = reply.get("serving")
        now = "base weights" if serving is None else f"v{serving['version']}"
        if kind == "LoraSyncError":
            from boogu_vllm.lora import LoraSyncError

            return LoraSyncError(f"{message} (serving: {now})")
        error_type = _ERROR_TYPES.get(kind, RuntimeError)
        return error_type(f"{what} failed in the vllm-omni worker: {kind}: {message} (serving: {now})")

    # ---- memory --------------------------------------------------------------------------------------
    def sleep(self, level: int = 1) -> None:
        """Free GPU memory between rollouts (level 1 offloads weights to the CPU). Needs
        ``engine_args={"enable_sleep_mode": True}``. Untested."""
        self._check_open()
        self._rpc_positional("sleep", level)

    def wake_up(self) -> None:
        """Undo `sleep`. Untested."""
        self._check_open()
        self._rpc_positional("wake_up", None)

    def close(self) -> None:
        """Shut the engine and its worker down; idempotent."""
        engine, self._engine = self._engine, None
        if engine is not None:
            engine.close()

    # ---- internals -------------------------------------------------------------------------------------
    def _check_open(self) -> None:
        if self._engine is None:
            raise RuntimeError("OmniBackend is closed")

    def _rpc(self, method: str, **kwargs: Any) -> Any:
        # Default reply mode: every rank runs the method, rank 0 answers, the result is a 1-list.
        result = self._engine.collective_rpc(method, timeout=_RPC_TIMEOUT_S, kwargs=kwargs)
        return result[0] if isinstance(result, list) else result

    def _rpc_positional(self, method: str, *args: Any) -> Any:
        result = self._engine.collective_rpc(method, timeout=_RPC_TIMEOUT_S, args=args)
        return result[0] if isinstance(result, list) else result

    def __enter__(self) -> OmniBackend:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _set_visible_devices(devices: str) -> None:
    """Pin this process to ``devices`` before CUDA starts (afterwards the variable has no effect)."""
    devices = devices.strip()
    if not devices:
        raise ValueError("devices must name at least one GPU, e.g. '0'")
    current = os.environ.get("CUDA_VISIBLE_DEVICES")
    if torch.cuda.is_initialized() and current != devices:
        raise RuntimeError(
            f"CUDA is already initialized with CUDA_VISIBLE_DEVICES={current!r}; cannot use {devices!r}"
        )
    os.environ["CUDA_VISIBLE_DEVICES"] = devices
