"""The vllm-omni engine against the local engine, on the tiny checkpoint (``bash tests/vllm/run.sh``).

One rollout worker (``boogu_vllm.worker``, the direct backend: vllm-omni's pipeline class and LoRA
manager in the rollout environment, torch 2.13 / transformers 5.14 / diffusers 0.40) serves the whole
module; the local engine runs here in the workspace's environment. Same weights and seeds must give
the same trajectories, with and without CFG, for T2I and Edit, before and after a LoRA sync.
"""

from __future__ import annotations

import contextlib
import io
import json
import shutil
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch
from PIL import Image, ImageDraw

from boogu_adapters.components import build_local_engine
from boogu_adapters.loading import load_boogu
from boogu_adapters.lora import WeightSyncError, add_lora, lora_fingerprint, lora_state_dict
from boogu_adapters.model import LORA_TARGET_MODULES
from boogu_adapters.recompute import TransitionRecompute
from boogu_adapters.types import RolloutRequest, Trajectory
from boogu_adapters.vllm_engine import RolloutWorkerError, VllmOmniRolloutEngine, default_project_dir
from boogu_data import PromptRecord
from boogu_protocol import PROTOCOL_VERSION, checkpoint_identity, pack
from boogu_schedule import WindowPlan

pytestmark = pytest.mark.vllm

TOL = 1e-5
"""Latents, means and log-probs: two implementations of the transformer (ours and vllm-omni's port),
two torch and transformers releases, the same float32 math."""


def png(text: str, size: tuple[int, int] = (32, 32)) -> bytes:
    img = Image.new("RGB", size, "white")
    ImageDraw.Draw(img).text((2, 10), text, fill="black")
    buf = io.BytesIO()
    img.save(buf, format="PNG")
    return buf.getvalue()


T2I = [
    PromptRecord(instruction='A sign that says "OPEN"', ground_truth="OPEN", negative="blurry"),
    PromptRecord(instruction='A mug printed with "TEA"', ground_truth="TEA"),
]
EDIT = [
    # Non-square and not the request's 32x32: the output follows the reference's size (48 wide, 32 high).
    PromptRecord(
        instruction='Change the text to "SALE"', ground_truth="SALE", ref_image=png("OPEN", (48, 32))
    ),
    PromptRecord(instruction='Change the text to "TEA"', ground_truth="TEA", ref_image=png("MUG", (48, 32))),
]


def request(
    records, guidance_scale: float, seed: int = 5, image_guidance_scale: float = 1.0
) -> RolloutRequest:
    return RolloutRequest(
        records,
        group_size=2,
        num_steps=4,
        guidance_scale=guidance_scale,
        image_guidance_scale=image_guidance_scale,
        height=32,
        width=32,
        seed=seed,
        group_offset=3,
        window=WindowPlan(kind="random", size=2, window_range=(0, 3)),
    )


def max_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return (a.double().cpu() - b.double().cpu()).abs().max().item()


def assert_agree(remote: Trajectory, local: Trajectory, tol: float = TOL) -> dict[str, float]:
    assert remote.window == local.window
    assert torch.equal(remote.step_index.cpu(), local.step_index.cpu())
    assert torch.equal(remote.group_id.cpu(), local.group_id.cpu())
    assert torch.equal(remote.sigmas.cpu(), local.sigmas.cpu())
    assert remote.nfe == local.nfe
    assert remote.log_prob.dtype == remote.latents.dtype == torch.float32
    diffs = {
        name: max_diff(getattr(remote, name), getattr(local, name))
        for name in ("latents", "mean", "std", "log_prob", "final_latents")
    }
    rc, lc = remote.conditioning, local.conditioning
    assert rc.lengths == lc.lengths and rc.negative_lengths == lc.negative_lengths
    assert torch.equal(rc.attention_mask.cpu(), lc.attention_mask.cpu())
    diffs["hidden_states"] = max_diff(rc.hidden_states, lc.hidden_states)
    if lc.negative_hidden_states is not None:
        diffs["negative_hidden_states"] = max_diff(rc.negative_hidden_states, lc.negative_hidden_states)
    else:
        assert rc.negative_hidden_states is None
    assert rc.is_edit == lc.is_edit
    if lc.is_edit:
        diffs["ref_latents"] = max(max_diff(a, b) for a, b in zip(rc.ref_latents, lc.ref_latents))
    bad = {k: v for k, v in diffs.items() if not v <= tol}
    assert not bad, f"the engines disagree beyond {tol}: {bad} (all: {diffs})"
    assert remote.images.shape == local.images.shape and remote.images.dtype == torch.uint8
    # uint8 rounding of values that differ by ~1e-6 may flip by one level.
    assert max_diff(remote.images.float(), local.images.float()) <= 1
    return diffs


@pytest.fixture(scope="module")
def worker(tiny_checkpoint, tmp_path_factory):
    """A worker launched from the rollout environment, the way the trainer launches it."""
    if not (default_project_dir() / ".venv" / "bin" / "python").exists():
        pytest.fail("the rollout environment is missing: run `bash tests/vllm/run.sh`")
    log = tmp_path_factory.mktemp("worker") / "worker.log"
    engine = VllmOmniRolloutEngine(
        tiny_checkpoint,
        worker_args=["--backend", "direct"],
        log_path=log,
        startup_timeout_s=300,
        request_timeout_s=300,
        peft_config={"r": 4, "lora_alpha": 8, "target_modules": list(LORA_TARGET_MODULES)},
    )
    yield engine
    engine.close()
    assert engine._process is None  # it was stopped


@pytest.fixture(scope="module")
def base_engine(tiny_checkpoint):
    parts = load_boogu(tiny_checkpoint, transformer="native")
    return build_local_engine(parts, cfg_mode="sequential")


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["no_cfg", "cfg"])
@pytest.mark.parametrize("records", [T2I, EDIT], ids=["t2i", "edit"])
def test_worker_trajectories_equal_the_local_engines(worker, base_engine, records, guidance):
    req = request(records, guidance)
    remote, local = worker.generate(req), base_engine.generate(req)
    diffs = assert_agree(remote, local)
    print(f"max |vllm-omni - local| ({'edit' if records is EDIT else 't2i'}, g={guidance}):", diffs)
    assert remote.weights_version == 0
    if records is EDIT:
        assert remote.conditioning.is_edit and remote.images.shape[-2:] == (32, 48)


@pytest.mark.parametrize("guidance", [1.0, 3.0], ids=["image_only", "double"])
def test_worker_image_guidance_equals_the_local_engines(worker, base_engine, guidance):
    """Upstream's Edit image guidance in the worker (vllm-omni's multi-branch CFG dispatch, combined by
    the trainer's rule): the forward without the reference latents, alone or as double guidance, gives
    the local engine's trajectory, and its forwards are counted alike."""
    req = request(EDIT, guidance, image_guidance_scale=2.0)
    remote, local = worker.generate(req), base_engine.generate(req)
    diffs = assert_agree(remote, local)
    print(f"max |vllm-omni - local| (edit, g={guidance}, image guidance 2):", diffs)
    assert remote.image_guidance_scale == local.image_guidance_scale == 2.0
    assert remote.nfe == local.nfe == req.batch_size * req.num_steps * (3 if guidance > 1 else 2)
    plain = base_engine.generate(request(EDIT, guidance))
    assert max_diff(plain.final_latents, local.final_latents) > 1e-3  # the guidance did something


def test_lora_sync_round_trip(worker, base_engine, tiny_checkpoint):
    """Weights trained one step here, synced, and the next rollout moves away from the base model
    exactly as the local engine's does; a key that attaches to nothing is refused and changes nothing."""
    parts = load_boogu(tiny_checkpoint, transformer="native")
    model = add_lora(parts.transformer, rank=4, alpha=8, seed=0)
    local = build_local_engine(parts, transformer=model, cfg_mode="sequential")
    req = request(T2I, 3.0)
    # One training step: raise the log-prob of the rollout's first window transition (a real update
    # of every adapter, lora_B included, which starts at zero).
    traj = local.generate(req)
    lora = [p for n, p in model.named_parameters() if "lora_" in n]
    for p in lora:
        p.requires_grad_(True)
    optim = torch.optim.AdamW(lora, lr=5e-2)
    stats = TransitionRecompute(local.freqs_cis).step_stats(model, traj, 0)
    (-stats.log_prob.mean()).backward()
    optim.step()
    state = {k: v.detach().clone() for k, v in lora_state_dict(model).items()}
    assert any(v.abs().max() > 0 for k, v in state.items() if "lora_B" in k)

    base_worker = worker.generate(req)  # the worker's base rollout, before the sync
    assert base_worker.weights_version == 0
    worker.sync_weights(1, state)
    assert worker.weights_version == 1 and worker.sync_log[-1] == (1, lora_fingerprint(state))
    assert worker.health()["lora_fingerprint"] == lora_fingerprint(state)
    local.sync_weights(1, module=model)
    remote_lora, local_lora = worker.generate(req), local.generate(req)
    assert remote_lora.weights_version == 1
    assert_agree(remote_lora, local_lora)
    base_remote, base_local = base_worker, base_engine.generate(req)
    moved_remote = remote_lora.final_latents - base_remote.final_latents
    moved_local = local_lora.final_latents - base_local.final_latents
    assert moved_local.abs().max() > 1e-2, "the trained LoRA should change the rollout"
    assert max_diff(moved_remote, moved_local) <= TOL

    # A renamed key attaches to nothing in the worker: refused with its name, the loaded LoRA stays.
    renamed = {k.replace("to_q", "to_qq"): v for k, v in state.items()}
    with pytest.raises(WeightSyncError, match="to_qq"):
        worker.sync_weights(2, renamed)
    assert worker.weights_version == 1
    again = worker.generate(req)
    assert torch.equal(again.final_latents, remote_lora.final_latents)

    # A trainer reconnecting resets the worker to the base weights.
    fresh = VllmOmniRolloutEngine(tiny_checkpoint, url=worker.url)
    back = fresh.generate(req)
    assert back.weights_version == 0
    assert torch.equal(back.final_latents, base_remote.final_latents)


def test_clear_errors(worker, tiny_checkpoint, tmp_path):
    with pytest.raises(RolloutWorkerError, match="rollout environment is missing"):
        VllmOmniRolloutEngine(tiny_checkpoint, project_dir=tmp_path / "nowhere")
    with pytest.raises(RolloutWorkerError, match="exited with code"):
        VllmOmniRolloutEngine(tmp_path / "not-a-checkpoint", startup_timeout_s=60)
    other = tmp_path / "other"
    shutil.copytree(tiny_checkpoint, other)
    config = other / "scheduler" / "scheduler_config.json"
    config.write_text(config.read_text().replace("{", '{"note": "another checkpoint", ', 1))
    with pytest.raises(RolloutWorkerError, match="both must load the same checkpoint"):
        VllmOmniRolloutEngine(other, url=worker.url)
    spec = {**worker.spec(request(T2I, 1.0))[0].to_json(), "groups": []}
    with pytest.raises(RolloutWorkerError, match=r"400 ProtocolError: spec.groups must be a non-empty list"):
        worker._call("POST", "/generate", pack({"spec": spec}))


def test_two_steps_train_and_resume_exactly(worker, tiny_checkpoint, tmp_path):
    """A CPU run with rollout.engine=vllm_omni (its preflight included): 2 steps, then a resume from
    step 1 repeats step 2 bitwise."""
    from boogu_trainer.trainer import Trainer
    from tests.trainer.test_loop import small_config

    def config(run_dir, *extra):
        return small_config(
            tiny_checkpoint,
            run_dir,
            "rollout.engine=vllm_omni",
            f"rollout.vllm.url={worker.url}",
            "total_steps=2",
            "checkpoint.save_every=1",
            "optim.lr=1e-2",
            *extra,
        )

    first = Trainer(config(tmp_path / "a"))
    history = first.train()
    first.close()
    assert [h["step"] for h in history] == [1, 2]
    for h in history:
        assert h["nfe/rollout_per_image"] == 8.0  # 4 steps x 2 (CFG), counted by the worker
        diffs = [v for k, v in h.items() if k.startswith("logprob_diff/")]
        assert diffs and max(diffs) < 1e-3, h  # training's recomputation matches the worker's log-probs
        # The worker's rollout FLOPs are booked from the batch's layout; cum/tflops counts them.
        assert h["perf/tflops_worker"] > 0
    assert history[-1]["cum/tflops"] == pytest.approx(
        sum(h["perf/tflops"] + h["perf/tflops_worker"] for h in history), rel=1e-12
    )
    lora_a = {k: v.clone() for k, v in lora_state_dict(first.transformer).items()}

    shutil.copytree(tmp_path / "a", tmp_path / "b")
    shutil.rmtree(next((tmp_path / "b" / "run" / "checkpoints").glob("step_000002")))
    resumed = Trainer(config(tmp_path / "b", "resume=auto"))
    assert resumed.resume("auto") is not None and resumed.step == 1
    again = resumed.train()
    resumed.close()
    assert [h["step"] for h in again] == [1, 2]
    assert again[-1]["reward/mean"] == history[-1]["reward/mean"]
    for k, v in lora_state_dict(resumed.transformer).items():
        assert torch.equal(v, lora_a[k]), k


class _SlowWorker(BaseHTTPRequestHandler):
    """Answers like a worker, but never finishes a rollout in time."""

    protocol_version = "HTTP/1.1"
    identity = ""  # the checkpoint identity it claims to serve

    def log_message(self, *args) -> None:
        pass

    def _send(self, body: bytes) -> None:
        self.send_response(200)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self) -> None:
        health = {
            "status": "ok",
            "protocol": PROTOCOL_VERSION,
            "backend": "slow",
            "model_identity": self.identity,
        }
        self._send(json.dumps(health).encode())

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length") or 0))
        if self.path == "/generate":
            time.sleep(3)
        # The client gives up after its 0.5 s timeout, as the test wants: its socket is gone. Unsuppressed,
        # the broken pipe prints a traceback from the server's thread after the test has ended (outside
        # pytest's capture when the test is among the last of its pytest-xdist worker).
        with contextlib.suppress(BrokenPipeError, ConnectionResetError):
            self._send(json.dumps({"version": 0, "fingerprint": None, "keys": 0}).encode())


def test_a_request_that_times_out_stops_with_the_setting_named(tiny_checkpoint):
    _SlowWorker.identity = checkpoint_identity(tiny_checkpoint)
    server = ThreadingHTTPServer(("127.0.0.1", 0), _SlowWorker)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        engine = VllmOmniRolloutEngine(tiny_checkpoint, url=url, request_timeout_s=0.5)
        with pytest.raises(
            RolloutWorkerError, match=r"timed out after 0.5 s \(rollout.vllm.request_timeout_s\)"
        ):
            engine.generate(request(T2I, 1.0))
    finally:
        server.shutdown()
        server.server_close()


def test_a_worker_that_dies_stops_the_run_with_its_log(worker):
    """Last in this module: it kills the module's worker."""
    worker._process.kill()
    worker._process.wait()
    with pytest.raises(RolloutWorkerError, match=r"exited with code -9 \(log .*worker.log\)"):
        worker.generate(request(T2I, 1.0))
