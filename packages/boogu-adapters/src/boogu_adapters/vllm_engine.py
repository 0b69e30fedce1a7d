"""``VllmOmniRolloutEngine``: rollouts in vllm-omni, in its own environment, behind the ``RolloutEngine`` protocol.

The trainer never imports vllm. This engine talks to the rollout worker (``packages/boogu-vllm``,
``python -m boogu_vllm.worker``) over boogu-protocol's HTTP endpoints: it either connects to a
running worker (``url``: another GPU, another node) or launches one itself from the rollout
environment and stops it on :meth:`close`. The worker runs ``boogu_schedule.sampling`` with
vllm-omni's transformer, so its trajectories follow the local engine's conventions and seeds exactly;
``tests/vllm`` checks the two agree.

Weights: the engine holds its own copy (``needs_lora_state``). Each ``sync_weights`` sends the whole
LoRA (the trainer's file keys); the worker swaps it in atomically through vllm-omni's LoRA manager,
checks that every key attached to a module, and acknowledges with the version and the fingerprint
of what it loaded, which must equal the fingerprint of what was sent.

Failures stop the run with a message that says what happened: the rollout environment missing, the
worker exiting (with the tail of its log), a request timing out, a protocol mismatch.
"""

from __future__ import annotations

import contextlib
import dataclasses
import http.client
import json
import os
import shutil
import subprocess
import tempfile
import threading
import time
import urllib.parse
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from boogu_adapters.engines import EngineBookkeeping, EngineStats
from boogu_adapters.lora import WeightSyncError
from boogu_adapters.types import Conditioning, RolloutRequest, Trajectory
from boogu_protocol import (
    PROTOCOL_VERSION,
    GroupSpec,
    ProtocolError,
    RolloutSpec,
    checkpoint_identity,
    lora_fingerprint,
    pack,
    ref_latent_key,
    reference_tensors,
    unpack,
)

__all__ = ["RolloutWorkerError", "VllmOmniRolloutEngine", "default_project_dir"]


_NOT_INHERITED = frozenset(
    {"VIRTUAL_ENV", "PYTHONPATH", "PYTHONHOME", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
     "GROUP_RANK", "ROLE_RANK", "ROLE_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"}
)  # fmt: skip
"""Trainer-process variables a launched worker must not see."""


class RolloutWorkerError(RuntimeError):
    """The rollout worker is missing, died, timed out or answered with an error."""


def default_project_dir() -> Path:
    """``packages/boogu-vllm`` of this checkout (the rollout environment's project)."""
    return Path(__file__).resolve().parents[3] / "boogu-vllm"


def _log_tail(path: Path | None, lines: int = 30) -> str:
    if path is None or not path.exists():
        return ""
    text = path.read_text(errors="replace").splitlines()
    return "\n".join(text[-lines:])


class VllmOmniRolloutEngine(EngineBookkeeping):
    """Rollouts served by a ``boogu_vllm.worker`` process.

    Args:
        model_dir: the checkpoint folder the worker loads (the same one the trainer loads).
        url: a running worker (``http://host:port``); None launches one from ``project_dir``.
        project_dir: the rollout environment's project (``packages/boogu-vllm``); its ``.venv`` must
            exist (``uv sync --locked --project packages/boogu-vllm``) unless ``python`` is given.
        python: the rollout environment's interpreter (default ``project_dir/.venv/bin/python``).
        device: where trajectories are placed for training (the trainer's device).
        worker_args: extra command-line arguments for a launched worker (``--backend``, ``--dtype``, ...).
        env: extra environment variables for a launched worker (e.g. ``CUDA_VISIBLE_DEVICES``).
        startup_timeout_s / request_timeout_s: how long to wait for the worker to load / to answer.
        log_path: where a launched worker's stdout and stderr go (default: a temporary file).
        peft_config: the trainer's LoRA settings (``r``, ``lora_alpha``, ``target_modules``), sent
            with every sync so the worker builds the same adapter.
        micro_batch_size: at most this many latents per transformer call and per VAE decode in the
            worker (``rollout.micro_batch_size``, sent with every request; 0 = the whole request).
    """

    def __init__(
        self,
        model_dir: str | os.PathLike[str],
        *,
        url: str | None = None,
        project_dir: str | os.PathLike[str] | None = None,
        python: str | None = None,
        device: torch.device | str = "cpu",
        worker_args: Sequence[str] = (),
        env: Mapping[str, str] | None = None,
        startup_timeout_s: float = 600.0,
        request_timeout_s: float = 1800.0,
        log_path: str | os.PathLike[str] | None = None,
        peft_config: Mapping[str, Any] | None = None,
        micro_batch_size: int = 0,
    ):
        if (
            isinstance(micro_batch_size, bool)
            or not isinstance(micro_batch_size, int)
            or micro_batch_size < 0
        ):
            raise ValueError(f"micro_batch_size must be an int >= 0 (0 = no split), got {micro_batch_size!r}")
        self.micro_batch_size = micro_batch_size
        self.peft_config = dict(peft_config or {})
        self.model_dir = str(Path(model_dir).resolve())
        self.device = torch.device(device)
        self.request_timeout_s = request_timeout_s
        self.stats = EngineStats()
        self.sync_log: list[tuple[int, str]] = []
        self._version = 0
        self._on_host = threading.local()
        """Per thread: trajectories stay in (pinned) host memory (`trajectories_on_host`)."""
        self._process: subprocess.Popen | None = None
        self._tmp: tempfile.TemporaryDirectory | None = None
        self.log_path: Path | None = None
        self.url: str | None = None
        self._host: str | None = None
        self._port = 0
        try:  # a launched worker never outlives a failed start (nor a Ctrl-C while it loads)
            self._connect(url, project_dir, python, worker_args, env, startup_timeout_s, log_path)
        except BaseException:
            self.close()
            raise

    def _connect(self, url, project_dir, python, worker_args, env, startup_timeout_s, log_path) -> None:
        if url is None:
            url = self._launch(project_dir, python, worker_args, env, startup_timeout_s, log_path)
        self.url = url.rstrip("/")
        parsed = urllib.parse.urlsplit(self.url)
        if parsed.scheme != "http" or not parsed.hostname:
            raise ValueError(f"rollout.vllm.url must look like http://host:port, got {url!r}")
        self._host, self._port = parsed.hostname, parsed.port or 80
        health = self.health()
        if health.get("protocol") != PROTOCOL_VERSION:
            raise RolloutWorkerError(
                f"the rollout worker at {self.url} speaks protocol {health.get('protocol')!r}, this trainer "
                f"speaks {PROTOCOL_VERSION}: update packages/boogu-vllm on the worker side"
            )
        mine = checkpoint_identity(self.model_dir)
        if health.get("model_identity") != mine:
            raise RolloutWorkerError(
                f"the rollout worker at {self.url} serves {health.get('model')} (identity "
                f"{health.get('model_identity')}), the trainer trains {self.model_dir} ({mine}): both must "
                "load the same checkpoint (only the LoRA travels)"
            )
        self.worker_info = health
        # Start from the base weights at version 0, whatever an earlier trainer left loaded.
        self._call("POST", "/lora", pack({"version": 0, "reset": True}))

    # ---- process management --------------------------------------------------------------------
    def _launch(self, project_dir, python, worker_args, env, timeout_s: float, log_path) -> str:
        project = Path(project_dir) if project_dir is not None else default_project_dir()
        interpreter = python or str(project / ".venv" / "bin" / "python")
        if python is None and not Path(interpreter).exists():
            raise RolloutWorkerError(
                f"rollout.engine=vllm_omni: the rollout environment is missing ({interpreter} does not exist). "
                f"Set it up once with `uv sync --locked --project {project}` (add `--extra gpu` on a GPU "
                "machine), or point rollout.vllm.url at a running worker"
            )
        if python is not None and shutil.which(python) is None and not Path(python).exists():
            raise RolloutWorkerError(f"rollout.vllm.python: {python} is not an executable")
        self._tmp = tempfile.TemporaryDirectory(prefix="boogu-vllm-")
        ready = Path(self._tmp.name) / "ready.json"
        self.log_path = Path(log_path) if log_path is not None else Path(self._tmp.name) / "worker.log"
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        cmd = [interpreter, "-m", "boogu_vllm.worker", "--model", self.model_dir, "--port", "0",
               "--ready-file", str(ready), "--parent-pid", str(os.getpid()), *worker_args]  # fmt: skip
        # The worker runs in its own environment and its own (one-process) distributed world: neither
        # the trainer's virtualenv nor torchrun's rendezvous variables may leak into it.
        child_env = {
            k: v
            for k, v in os.environ.items()
            if k not in _NOT_INHERITED and not k.startswith("TORCHELASTIC_")
        }
        child_env.update(env or {})
        log = open(self.log_path, "ab")  # noqa: SIM115 (the child owns it for its lifetime)
        try:
            self._process = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env)
        finally:
            log.close()
        deadline = time.monotonic() + timeout_s
        while not ready.exists():
            code = self._process.poll()
            if code is not None:
                raise RolloutWorkerError(
                    f"the rollout worker exited with code {code} while loading {self.model_dir} "
                    f"(log {self.log_path}):\n{_log_tail(self.log_path)}"
                )
            if time.monotonic() > deadline:
                self._kill()
                raise RolloutWorkerError(
                    f"the rollout worker did not come up within rollout.vllm.startup_timeout_s={timeout_s:g} s "
                    f"(log {self.log_path}):\n{_log_tail(self.log_path)}"
                )
            time.sleep(0.1)
        return json.loads(ready.read_text())["url"]

    def _kill(self) -> None:
        if self._process is not None and self._process.poll() is None:
            self._process.terminate()
            try:
                self._process.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self._process.kill()
                self._process.wait()

    def _check_alive(self) -> None:
        if self._process is not None and self._process.poll() is not None:
            raise RolloutWorkerError(
                f"the rollout worker (pid {self._process.pid}) exited with code {self._process.returncode} "
                f"(log {self.log_path}):\n{_log_tail(self.log_path)}"
            )

    # ---- HTTP ----------------------------------------------------------------------------------
    def _call(self, method: str, path: str, body: bytes | None = None, timeout: float | None = None) -> bytes:
        self._check_alive()
        timeout = self.request_timeout_s if timeout is None else timeout
        conn = http.client.HTTPConnection(self._host, self._port, timeout=timeout)
        try:
            conn.request(method, path, body=body, headers={"Content-Type": "application/octet-stream"})
            response = conn.getresponse()
            data = response.read()
        except TimeoutError:
            raise RolloutWorkerError(
                f"{method} {self.url}{path} timed out after {timeout:g} s (rollout.vllm.request_timeout_s)"
            ) from None
        except (ConnectionError, http.client.HTTPException, OSError) as error:
            self._check_alive()
            raise RolloutWorkerError(f"{method} {self.url}{path} failed: {error}") from None
        finally:
            conn.close()
        if response.status != 200:
            try:
                detail = json.loads(data)
            except ValueError:
                detail = None
            if isinstance(detail, dict):
                message, kind = detail.get("error", data.decode(errors="replace")), detail.get("kind", "")
            else:
                message, kind = data.decode(errors="replace"), ""
            if kind == "LoraSyncError":
                raise WeightSyncError(f"the rollout worker refused the LoRA: {message}")
            raise RolloutWorkerError(f"{method} {self.url}{path} -> {response.status} {kind}: {message}")
        return data

    def health(self) -> dict[str, Any]:
        return json.loads(self._call("GET", "/health", timeout=30.0))

    # ---- RolloutEngine -------------------------------------------------------------------------
    @property
    def weights_version(self) -> int:
        return self._version

    @property
    def needs_lora_state(self) -> bool:
        return True

    def sync_weights(
        self,
        version: int,
        lora_state: Mapping[str, torch.Tensor] | None = None,
        *,
        module: torch.nn.Module | None = None,
    ) -> None:
        """Send the whole LoRA (file keys) as ``version``; the worker's fingerprint must match."""
        if version <= self._version and self.sync_log:
            raise WeightSyncError(f"sync: version {version} is not newer than {self._version}")
        if lora_state is None:
            raise WeightSyncError(
                f"sync v{version}: the vllm-omni engine holds its own copy and needs the LoRA state"
            )
        sent = lora_fingerprint(lora_state)
        meta = {"version": version, "peft_config": self.peft_config}
        ack = json.loads(self._call("POST", "/lora", pack(meta, dict(lora_state))))
        if ack.get("version") != version or ack.get("fingerprint") != sent:
            raise WeightSyncError(
                f"sync v{version}: the rollout worker acknowledged version {ack.get('version')} holding "
                f"{ack.get('fingerprint')}, the trainer sent {sent}"
            )
        self._version = version
        self.sync_log.append((version, sent))

    def relabel(self, version: int) -> None:
        """Call the worker's current weights ``version`` (the trainer restored weights equal to
        that version's and re-synced them under a newer number, as its preflight does)."""
        self._call("POST", "/lora", pack({"version": version, "relabel": True}))
        self._version = version

    def close(self) -> None:
        if self._process is not None:
            if self._process.poll() is None and self._host is not None:
                try:
                    self._call("POST", "/shutdown", b"", timeout=10.0)
                    self._process.wait(timeout=30)
                except (RolloutWorkerError, subprocess.TimeoutExpired):
                    pass
            self._kill()
            self._process = None
        if self._tmp is not None:
            self._tmp.cleanup()
            self._tmp = None

    def __del__(self) -> None:  # a crashed trainer must not leave a worker holding a GPU
        with contextlib.suppress(Exception):
            self._kill()

    def spec(self, request: RolloutRequest) -> tuple[RolloutSpec, dict[str, torch.Tensor]]:
        """The wire form of ``request``: the spec and the reference images (each distinct one once)."""
        images: dict[bytes, int] = {}
        groups = []
        for r in request.records:
            ref = None
            if r.ref_image is not None:
                ref = images.setdefault(r.ref_image, len(images))
            groups.append(GroupSpec(instruction=r.instruction, negative=r.negative, ref_image=ref))
        window = dataclasses.asdict(request.window)  # WindowPlan's fields (enums are str, as JSON wants)
        spec = RolloutSpec(
            groups=tuple(groups),
            group_size=request.group_size,
            num_steps=request.num_steps,
            guidance_scale=float(request.guidance_scale),
            image_guidance_scale=float(request.image_guidance_scale),
            sampler=str(request.sampler),
            noise_level=float(request.noise_level),
            window=window,
            height=request.height,
            width=request.width,
            seed=request.seed,
            group_offset=request.group_offset,
            iteration=request.iteration,
            decode=request.decode,
            micro_batch_size=self.micro_batch_size,
        )
        return spec, reference_tensors({i: data for data, i in images.items()})

    @contextlib.contextmanager
    def trajectories_on_host(self) -> Iterator[None]:
        """Inside, on this thread only: `generate` leaves the trajectory in host memory (pinned when
        ``device`` is a GPU) instead of moving it to ``device``; the caller moves it when it trains on
        it (``rollout.pipeline=one_step``: the next batch waits there during the update's peak)."""
        self._on_host.active = True
        try:
            yield
        finally:
            self._on_host.active = False

    def generate(self, request: RolloutRequest) -> Trajectory:
        if not request.records:
            raise ValueError("RolloutRequest has no records")
        spec, tensors = self.spec(request)
        t0 = time.perf_counter()
        data = self._call("POST", "/generate", pack({"spec": spec.to_json()}, tensors))
        self.stats.seconds["worker"] += time.perf_counter() - t0
        try:
            meta, out = unpack(data)
        except ProtocolError as error:
            raise RolloutWorkerError(f"the rollout worker's answer does not decode: {error}") from None
        if meta.get("weights_version") != self._version:
            raise RolloutWorkerError(
                f"the rollout worker sampled with weights version {meta.get('weights_version')}, the trainer "
                f"published {self._version}: another trainer shares this worker"
            )
        if getattr(self._on_host, "active", False):
            traj = self._trajectory(request, meta, out, torch.device("cpu"))
            if self.device.type == "cuda" and torch.cuda.is_available():
                traj = traj.map_tensors(torch.Tensor.pin_memory)  # copied in without a host wait
            return traj
        return self._trajectory(request, meta, out, self.device)

    def _trajectory(
        self, request: RolloutRequest, meta: dict[str, Any], out: dict[str, torch.Tensor], dev: torch.device
    ) -> Trajectory:
        n, batch = request.group_size, request.batch_size
        for key, value in meta.get("timings", {}).items():
            self.stats.seconds[f"worker/{key}"] += float(value)

        def per_sample(rows: torch.Tensor) -> torch.Tensor:
            return rows.repeat_interleave(n)

        prompt_rows = per_sample(out["prompt_rows"])
        mask = out["attention_mask"][prompt_rows]
        lengths = tuple(int(v) for v in mask.sum(dim=1).tolist())  # host copies, once per batch
        neg_hidden = neg_mask = neg_lengths = None
        if "negative_rows" in out:
            neg_rows = per_sample(out["negative_rows"])
            neg_hidden = out["negative_hidden_states"][neg_rows].to(dev)
            neg_mask_host = out["negative_attention_mask"][neg_rows]
            neg_lengths = tuple(int(v) for v in neg_mask_host.sum(dim=1).tolist())
            neg_mask = neg_mask_host.to(dev)
        refs = None
        ref_rows = out["ref_rows"].tolist()
        if any(r >= 0 for r in ref_rows):
            latent = {r: out[ref_latent_key(r)].to(dev) for r in set(ref_rows) if r >= 0}
            refs = tuple(None if r < 0 else latent[r] for r in ref_rows for _ in range(n))
        cond = Conditioning(
            hidden_states=out["hidden_states"][prompt_rows].to(dev),
            attention_mask=mask.to(dev),
            negative_hidden_states=neg_hidden,
            negative_attention_mask=neg_mask,
            ref_latents=refs,
            lengths=lengths,
            negative_lengths=neg_lengths,
        )
        group_id = torch.arange(len(request.records), device=dev).repeat_interleave(n) + request.group_offset
        self.stats.samples += batch
        self.stats.transformer_sample_forwards += int(meta["nfe"])
        self.stats.images_decoded += batch if "images" in out else 0
        return Trajectory(
            latents=out["latents"].to(dev),
            step_index=out["step_index"].to(dev),
            sigmas=out["sigmas"].to(dev),
            log_prob=out["log_prob"].to(dev),
            mean=out["mean"].to(dev),
            std=out["std"].to(dev),
            window=tuple((int(a), int(b)) for a, b in meta["window"]),
            group_id=group_id,
            conditioning=cond,
            final_latents=out["final_latents"].to(dev),
            images=out.get("images"),
            nfe=int(meta["nfe"]),
            sampler=request.sampler,
            noise_level=request.noise_level,
            guidance_scale=request.guidance_scale,
            image_guidance_scale=request.image_guidance_scale,
            weights_version=int(meta["weights_version"]),
            # The worker runs positive and negative as two forwards (or on two CFG-parallel ranks).
            cfg_mode="sequential",
        )
