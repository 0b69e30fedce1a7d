"""``boogu_vllm.omni_backend`` against ``boogu_vllm.worker.DirectBackend``, with vllm-omni's engine faked.

Run with the rollout environment's python (``tests/vllm/test_omni_backend.py`` does)::

    packages/boogu-vllm/.venv/bin/python tests/vllm/omni_backend_check.py <tiny checkpoint dir> <targets,...>

A script, not a pytest module: ``boogu_vllm`` and vllm-omni live in the rollout environment
(packages/boogu-vllm, its own lock: torch 2.13, transformers 5.14, diffusers 0.40), which has neither
the workspace packages nor pytest, so the workspace's test launches this as a subprocess. For the same
reason the LoRA tensors are built here, from the checkpoint's own transformer weights, not with
``boogu_adapters``.

`OmniBackend` needs a GPU for vllm-omni's ``DiffusionEngine``. This check runs the rest of it on the
CPU: an `OmniBackend` whose engine is a stand-in (``collective_rpc`` calls a worker object built from
``BooguWorkerExtension`` over the checkpoint's ``BooguSDEPipeline`` and a real
``DiffusionLoRAManager``; the request path does what ``DiffusionWorker.execute_model`` does,
``lora_manager.set_active_adapter(sampling_params.lora_request)`` then ``pipeline.forward``). It asserts:

* importing ``boogu_vllm.omni_backend`` imports no vllm, and `OmniBackend` raises ``RuntimeError``
  without CUDA (CUDA is hidden from this process);
* `generate` gives the direct backend's trajectories bit for bit (one request with a T2I group with a
  negative and an edit group, CFG on): base weights, after LoRA v1, after v2, after a refused load,
  after `clear_lora`; a LoRA changes the rollout, `clear_lora` gives the base rollout back;
* `load_lora` acks equal the direct backend's, with the fingerprint = ``boogu_protocol.lora_fingerprint``
  of the sent tensors, and the rollout metadata reports that version and fingerprint;
* a key that attaches to nothing raises ``LoraSyncError`` (naming it) and the previous version keeps
  serving;
* every request sent to the engine carries the loaded adapter's ``LoRARequest`` (``None`` when none
  is loaded); the RPC arguments and replies survive pickling (the multi-process executor's transport);
* a LoRA load or clear that fails returns an error reply on rank 0 and raises on any other rank
  (whose reply ``collective_rpc`` would drop; vllm-omni reports a raise in its status gather);
  after such a raise (rank 0 may have loaded the new LoRA) `generate` refuses, naming the failed
  call, until a load succeeds on every rank;
* a bad spec raises ``ProtocolError`` before anything reaches the engine; `close` is idempotent.

Exit code 0 only if every check passes; the last line printed is a one-line summary.
"""

from __future__ import annotations

import os

os.environ["CUDA_VISIBLE_DEVICES"] = ""  # before torch: the no-CUDA check holds on a GPU machine too

import argparse
import io
import pickle
import sys
import time
from pathlib import Path

import torch
from PIL import Image

SUMMARY = "omni_backend_check: OK"
"""Start of the last line printed when every check passed (the pytest wrapper looks for it)."""

RANK, ALPHA = 4, 8

_checks: list[str] = []


def passed(what: str) -> None:
    _checks.append(what)
    print(f"ok  {what}", flush=True)


def expect_raises(call, error: type[BaseException], text: str, otherwise: str) -> None:
    """``call()`` must raise ``error`` with ``text`` in its message; ``otherwise`` says what went wrong."""
    try:
        call()
    except error as exc:
        assert text in str(exc), f"{otherwise}: the {error.__name__} does not say {text!r}: {exc}"
    else:
        raise AssertionError(otherwise)


def lora_tensors(checkpoint: Path, seed: int, targets: tuple[str, ...]) -> dict[str, torch.Tensor]:
    """A trained-looking LoRA in the trainer's file keys (``boogu_adapters.lora.lora_file_key``:
    ``<module>.lora_A.weight`` (r, in), ``<module>.lora_B.weight`` (out, r)) for every linear weight of
    the checkpoint's transformer that peft's matching of ``targets`` hits (the module name or a
    dotted suffix of it). Random lora_A, nonzero lora_B."""
    from safetensors import safe_open

    shapes: dict[str, list[int]] = {}
    for file in sorted((checkpoint / "transformer").glob("*.safetensors")):
        with safe_open(str(file), "pt") as f:
            for key in f.keys():  # noqa: SIM118 (a safetensors handle, not a dict: no __iter__)
                shapes[key] = list(f.get_slice(key).get_shape())
    g = torch.Generator().manual_seed(seed)
    out: dict[str, torch.Tensor] = {}
    for key in sorted(shapes):
        module = key.removesuffix(".weight")
        if module == key or len(shapes[key]) != 2:
            continue
        if not any(module == t or module.endswith("." + t) for t in targets):
            continue
        out_features, in_features = shapes[key]
        out[f"{module}.lora_A.weight"] = torch.randn(RANK, in_features, generator=g) / in_features**0.5
        out[f"{module}.lora_B.weight"] = torch.randn(out_features, RANK, generator=g) * 0.05
    assert out, f"no linear weight in {checkpoint / 'transformer'} matches the LoRA targets"
    # Every target names some layer of the tiny model (it has every kind of block).
    missing = [t for t in targets if not any(k.endswith(f".{t}.lora_A.weight") for k in out)]
    assert not missing, f"LoRA targets that match nothing in the checkpoint: {missing}"
    return out


def same(omni_result, direct_result) -> tuple[dict, dict[str, torch.Tensor]]:
    """The two backends' ``(meta, tensors)`` agree bit for bit (timings aside); returns omni's."""
    (m_omni, t_omni), (m_direct, t_direct) = omni_result, direct_result
    m_omni, m_direct = dict(m_omni), dict(m_direct)
    m_omni.pop("timings")
    m_direct.pop("timings")
    assert m_omni == m_direct, f"metadata differs: omni {m_omni} vs direct {m_direct}"
    assert sorted(t_omni) == sorted(t_direct), f"tensor keys differ: {sorted(t_omni)} vs {sorted(t_direct)}"
    for key in t_direct:
        a, b = t_omni[key], t_direct[key]
        assert a.dtype == b.dtype and a.shape == b.shape, (
            f"{key}: {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}"
        )
        assert torch.equal(a, b), (
            f"{key} differs: max |omni - direct| = {(a.double() - b.double()).abs().max()}"
        )
    return m_omni, t_omni


def tensors_equal(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> bool:
    return sorted(a) == sorted(b) and all(torch.equal(a[k], b[k]) for k in a)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument(
        "checkpoint", type=Path, help="a tiny Boogu checkpoint folder (boogu_tiny.checkpoints)"
    )
    parser.add_argument("targets", help="the trainer's LoRA target modules, comma-separated")
    args = parser.parse_args()
    # The trainer's targets (boogu_adapters.model.LORA_TARGET_MODULES; the rollout env has no boogu_adapters).
    targets = tuple(t for t in args.targets.split(",") if t)
    assert targets, "no LoRA targets given"
    peft_config = {"r": RANK, "lora_alpha": ALPHA, "target_modules": list(targets)}
    checkpoint = args.checkpoint.resolve()
    assert (checkpoint / "transformer").is_dir(), f"{checkpoint} is not a Boogu checkpoint folder"
    start = time.perf_counter()

    # ---- without CUDA --------------------------------------------------------------------------
    import boogu_vllm.omni_backend as ob

    def vllm_modules() -> list[str]:
        return sorted(m for m in sys.modules if m.split(".")[0] in ("vllm", "vllm_omni"))

    assert not vllm_modules(), f"importing boogu_vllm.omni_backend imported {vllm_modules()[:5]}"
    assert not torch.cuda.is_available()
    expect_raises(
        lambda: ob.OmniBackend(str(checkpoint)), RuntimeError, "CUDA", "OmniBackend built without CUDA"
    )
    assert not vllm_modules(), f"OmniBackend's CUDA check imported {vllm_modules()[:5]}"
    passed("the module imports no vllm; OmniBackend raises RuntimeError without CUDA")

    # ---- the faked engine ------------------------------------------------------------------------
    from vllm_omni.diffusion.lora.manager import DiffusionLoRAManager
    from vllm_omni.diffusion.vllm_config import create_diffusion_vllm_config
    from vllm_omni.diffusion.worker.request_batch import DiffusionRequestBatch

    from boogu_protocol import GroupSpec, ProtocolError, RolloutSpec, bytes_tensor, lora_fingerprint
    from boogu_vllm.cpu import build_pipeline
    from boogu_vllm.lora import LORA_INT_ID, LORA_NAME, LORA_PATH, LoraSyncError
    from boogu_vllm.pipeline import BooguSDEPipeline
    from boogu_vllm.worker import DirectBackend

    direct = DirectBackend(str(checkpoint))
    pipeline, context = build_pipeline(checkpoint, pipeline_class=BooguSDEPipeline)

    class Runner:
        pass

    class FakeWorker(ob.BooguWorkerExtension):
        """What ``DiffusionWorker`` gives the extension: ``model_runner.pipeline``, ``od_config``,
        ``vllm_config``, ``lora_manager``."""

        def __init__(self) -> None:
            self.model_runner = Runner()
            self.model_runner.pipeline = pipeline
            self.od_config = pipeline.od_config
            self.vllm_config = create_diffusion_vllm_config(torch.device("cpu"), pipeline.od_config)
            with context():
                self.lora_manager = DiffusionLoRAManager(
                    pipeline, device=torch.device("cpu"), dtype=torch.float32, max_cached_adapters=1
                )

    class FakeEngine:
        """``DiffusionEngine``'s surface that `OmniBackend` uses, over one in-process `FakeWorker`."""

        def __init__(self) -> None:
            self.worker = FakeWorker()
            self.requests: list = []
            self.closed = 0

        def collective_rpc(self, method, timeout=None, args=(), kwargs=None):
            # Through pickle both ways, as the multi-process executor sends them.
            args, kwargs = pickle.loads(pickle.dumps((args, kwargs or {})))
            reply = getattr(self.worker, method)(*args, **kwargs)
            return [pickle.loads(pickle.dumps(reply))]

        def add_req_and_wait_for_response(self, request):
            self.requests.append(request)
            sp = request.sampling_params
            with context():  # what DiffusionWorker.execute_model does
                self.worker.lora_manager.set_active_adapter(sp.lora_request, sp.lora_scale)
                with torch.inference_mode():
                    return pipeline.forward(DiffusionRequestBatch(requests=[request]))[0]

        def close(self) -> None:
            self.closed += 1

    engine = FakeEngine()
    omni = ob.OmniBackend.__new__(ob.OmniBackend)  # everything __init__ sets, but the real engine
    omni._engine, omni._lora_request, omni.last_stats = engine, None, {}

    buf = io.BytesIO()
    Image.new("RGB", (32, 32), "red").save(buf, format="PNG")
    spec = RolloutSpec(
        groups=(GroupSpec("a red square", "blurry"), GroupSpec("make it blue", ref_image=0)),
        group_size=2,
        num_steps=3,
        guidance_scale=2.0,
        sampler="flow_sde",
        noise_level=0.7,
        window={"kind": "random", "size": 2},
        height=32,
        width=32,
        seed=3,
    ).to_json()
    images = {"ref_image.0": bytes_tensor(buf.getvalue())}

    serving: dict = {"request": None}
    """The ``LoRARequest`` (name, id, path) every request must carry from now on, or None."""

    def rollout() -> tuple[dict, dict[str, torch.Tensor]]:
        sent = len(engine.requests)
        result = same(omni.generate(spec, images), direct.generate(spec, images))
        assert len(engine.requests) == sent + 1, "one generate, one engine request"
        lora_request = engine.requests[-1].sampling_params.lora_request
        got = (
            None
            if lora_request is None
            else (lora_request.lora_name, lora_request.lora_int_id, lora_request.lora_path)
        )
        assert got == serving["request"], (
            f"the request carries LoRARequest {got}, expected {serving['request']}"
        )
        assert set(omni.last_stats) == {"wall_s", "peak_memory_mb"}, omni.last_stats
        return result

    # A clear before any load: a no-op on both.
    assert omni.clear_lora(0) == direct.clear_lora(0) == {"version": 0, "fingerprint": None, "keys": 0}
    assert omni._lora_request is None
    meta, base = rollout()
    assert meta["weights_version"] == 0 and meta["lora_fingerprint"] is None, meta
    assert meta["nfe"] == 4 * 3 * 2 and "ref_latent.0" in base and "negative_rows" in base, (
        meta,
        sorted(base),
    )
    passed("base weights: omni == direct bit for bit (T2I + edit, CFG), no LoRARequest")

    # ---- LoRA v1, v2 ---------------------------------------------------------------------------------
    runs = {0: base}
    for version in (1, 2):
        tensors = lora_tensors(checkpoint, seed=version, targets=targets)
        ack = omni.load_lora(version, peft_config, tensors)
        assert ack == direct.load_lora(version, peft_config, tensors), ack
        assert ack == {"version": version, "fingerprint": lora_fingerprint(tensors), "keys": len(tensors)}, (
            ack
        )
        serving["request"] = (LORA_NAME, LORA_INT_ID, LORA_PATH)
        meta, runs[version] = rollout()
        assert meta["weights_version"] == version and meta["lora_fingerprint"] == ack["fingerprint"], meta
        assert not tensors_equal(runs[version], runs[version - 1]), (
            f"LoRA v{version} did not change the rollout"
        )
        passed(f"LoRA v{version} ({len(tensors)} tensors): ack == direct's, fingerprint == the sent tensors'")
    fingerprint_v2 = ack["fingerprint"]

    # ---- a key that attaches to nothing ----------------------------------------------------------------
    bad = lora_tensors(checkpoint, seed=3, targets=targets)
    bad["single_stream_layers.0.attn.nope.lora_A.weight"] = torch.zeros(RANK, 64)
    bad["single_stream_layers.0.attn.nope.lora_B.weight"] = torch.zeros(64, RANK)
    for backend in (omni, direct):
        expect_raises(
            lambda b=backend: b.load_lora(3, peft_config, bad),
            LoraSyncError,
            "nope",
            f"{backend.name}: a key that attaches to nothing was accepted",
        )
    assert omni._lora_request is not None and omni._lora_request.lora_int_id == LORA_INT_ID
    meta, after = rollout()
    assert meta["weights_version"] == 2 and meta["lora_fingerprint"] == fingerprint_v2, meta
    assert tensors_equal(after, runs[2]), "after a refused load the rollout is not v2's"
    passed("a key that attaches to nothing: LoraSyncError naming it, v2 keeps serving")

    # ---- clear -----------------------------------------------------------------------------------------
    assert omni.clear_lora(4) == direct.clear_lora(4) == {"version": 4, "fingerprint": None, "keys": 0}
    assert omni._lora_request is None
    serving["request"] = None
    meta, cleared = rollout()
    assert meta["weights_version"] == 4 and meta["lora_fingerprint"] is None, meta
    assert tensors_equal(cleared, base), "after clear_lora the rollout is not the base weights' rollout"
    passed("clear_lora: omni == direct == the base rollout, no LoRARequest")

    # ---- a failure on another rank -------------------------------------------------------------------
    # collective_rpc returns rank 0's reply only; another rank must raise so that vllm-omni's status
    # gather reports it. Workers without a LoRA manager fail in _boogu_slot (their pipeline is None,
    # so nothing shared is touched).
    from boogu_protocol import pack

    message = pack(
        {"version": 5, "peft_config": peft_config}, lora_tensors(checkpoint, seed=5, targets=targets)
    )
    for rank in (0, 1):
        worker = FakeWorker.__new__(FakeWorker)
        worker.rank, worker.model_runner = rank, Runner()
        worker.model_runner.pipeline = None
        for call in (lambda w=worker: w.boogu_load_lora(message), lambda w=worker: w.boogu_clear_lora(5)):
            if rank == 0:
                reply = call()
                assert reply["ok"] is False and reply["kind"] == "RuntimeError", reply
                assert "no LoRA manager" in reply["error"] and reply["serving"] is None, reply
                continue
            expect_raises(
                call,
                RuntimeError,
                "no LoRA manager",
                "a failure on rank 1 returned a reply that collective_rpc drops",
            )
    passed("a LoRA failure: rank 0 replies with it, rank 1 raises it (vllm-omni's status gather)")

    # ---- the backend after a failure on another rank -------------------------------------------------
    # Rank 0 loads v6 and rank 1 fails: collective_rpc raises (vllm-omni's status gather) and the ranks
    # may serve different weights, so generate must refuse until a load succeeds everywhere.
    real_rpc = engine.collective_rpc

    def rank_1_fails(method, timeout=None, args=(), kwargs=None):
        real_rpc(method, timeout=timeout, args=args, kwargs=kwargs)  # rank 0's run (it succeeds)
        raise RuntimeError(
            f"RPC '{method}' failed on worker rank(s): rank 1: RuntimeError: CUDA out of memory"
        )

    engine.collective_rpc = rank_1_fails
    v6 = lora_tensors(checkpoint, seed=6, targets=targets)
    expect_raises(
        lambda: omni.load_lora(6, peft_config, v6), RuntimeError, "rank 1", "a load that failed on rank 1"
    )
    engine.collective_rpc = real_rpc
    sent = len(engine.requests)
    expect_raises(
        lambda: omni.generate(spec, images),
        RuntimeError,
        "different LoRA weights since load_lora v6 raised RuntimeError",
        "a rollout ran while the ranks may hold different LoRA weights",
    )
    assert len(engine.requests) == sent, "a rollout reached the engine after a failure on rank 1"
    tensors = lora_tensors(checkpoint, seed=7, targets=targets)
    ack = omni.load_lora(7, peft_config, tensors)
    assert ack == direct.load_lora(7, peft_config, tensors), ack
    serving["request"] = (LORA_NAME, LORA_INT_ID, LORA_PATH)
    meta, _ = rollout()
    assert meta["weights_version"] == 7 and meta["lora_fingerprint"] == ack["fingerprint"], meta
    passed("after a LoRA failure on rank 1, generate refuses until a load succeeds on every rank")

    # ---- a bad spec, close -------------------------------------------------------------------------------
    sent = len(engine.requests)
    expect_raises(
        lambda: omni.generate({**spec, "protocol": 99}, images),
        ProtocolError,
        "",
        "a spec with protocol 99 was accepted",
    )
    assert len(engine.requests) == sent, "a bad spec reached the engine"
    passed("a bad spec raises ProtocolError before the engine")

    omni.close()
    omni.close()
    assert engine.closed == 1, engine.closed
    expect_raises(lambda: omni.generate(spec, images), RuntimeError, "closed", "generate after close")
    passed("close is idempotent; a closed backend refuses requests")

    print(f"{SUMMARY}: {len(_checks)} checks passed in {time.perf_counter() - start:.1f} s", flush=True)
    return 0


if __name__ == "__main__":
    if not __debug__:
        sys.exit("omni_backend_check: run without -O (the checks are assert statements)")
    sys.exit(main())
