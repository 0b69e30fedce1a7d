"""The rollout worker: serves Boogu SDE rollouts from vllm-omni over the boogu-protocol HTTP endpoints.

Start it in the rollout environment (``packages/boogu-vllm``), on the rollout GPUs or another node::

    uv run --project packages/boogu-vllm python -m boogu_vllm.worker --model /ckpt/Boogu-Image \\
        --host 0.0.0.0 --port 8765 --backend omni

and point the trainer at it (``rollout.engine: vllm_omni``, ``rollout.vllm.url: http://host:8765``),
or let the trainer launch it itself (no ``url``). Backends:

* ``omni`` (GPU): vllm-omni's engine serves ``BooguSDEPipeline`` as a custom pipeline class, with its
  kernels, CFG-parallel branches and LoRA manager (``boogu_vllm.omni_backend``).
* ``direct`` (CPU, tests): the same pipeline class built in this process with the CPU shims
  (``boogu_vllm.cpu``), the same LoRA manager, no engine around it.

Requests are served one at a time (one model). When ``--ready-file`` is given, the worker writes
``{"url", "pid", "backend"}`` to it (atomically) once the model is loaded and it accepts requests.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import threading
import time
import traceback
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any, Protocol

import torch

from boogu_protocol import (
    PROTOCOL_VERSION,
    ProtocolError,
    RolloutSpec,
    auto_dtype,
    checkpoint_identity,
    pack,
    reference_images,
    unpack,
)

__all__ = ["Backend", "DirectBackend", "main", "serve"]

log = logging.getLogger("boogu_vllm.worker")


class Backend(Protocol):
    name: str

    def generate(
        self, spec: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> tuple[dict, dict[str, torch.Tensor]]: ...

    def load_lora(
        self, version: int, peft_config: dict[str, Any], tensors: dict[str, torch.Tensor]
    ) -> dict: ...

    def clear_lora(self, version: int) -> dict: ...

    def close(self) -> None: ...


class DirectBackend:
    """``BooguSDEPipeline`` in this process (CPU): what the tests and a single-process run use."""

    name = "direct"

    def __init__(self, model_dir: str, *, dtype: torch.dtype = torch.float32, device: str = "cpu"):
        from boogu_vllm.cpu import build_pipeline, install_cpu_shims
        from boogu_vllm.lora import LoraSlot
        from boogu_vllm.pipeline import BooguSDEPipeline

        if device == "cpu":
            install_cpu_shims()
        self.pipeline, self._context = build_pipeline(
            model_dir, pipeline_class=BooguSDEPipeline, dtype=dtype, device=device
        )
        self.lora = LoraSlot(self.pipeline, context=self._context)

    def generate(self, spec, tensors):
        with self._context():
            return self.pipeline.rollout(RolloutSpec.from_json(spec), reference_images(tensors))

    def load_lora(self, version, peft_config, tensors):
        with self._context():
            ack = self.lora.load(version, peft_config, tensors)
        self.pipeline.lora_version, self.pipeline.lora_fingerprint = version, ack["fingerprint"]
        return ack

    def clear_lora(self, version):
        with self._context():
            self.lora.clear()
        self.pipeline.lora_version, self.pipeline.lora_fingerprint = version, None
        return {"version": version, "fingerprint": None, "keys": 0}

    def close(self) -> None:
        self.pipeline = None


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def __init__(self, address, backend: Backend, model: str):
        super().__init__(address, _Handler)
        self.backend = backend
        self.model = model
        self.model_identity = checkpoint_identity(model)
        self.busy = threading.Lock()  # one model: requests are served one at a time
        self.lora_version = 0
        self.lora_fingerprint: str | None = None
        self.requests = 0


class _Handler(BaseHTTPRequestHandler):
    server: _Server
    protocol_version = "HTTP/1.1"

    def log_message(self, format: str, *args) -> None:
        log.debug("%s %s", self.address_string(), format % args)

    def _reply(self, status: int, body: bytes, content_type: str = "application/octet-stream") -> None:
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def _json(self, status: int, data: dict) -> None:
        self._reply(status, json.dumps(data).encode(), "application/json")

    def _error(self, status: int, error: BaseException) -> None:
        self._json(status, {"error": str(error), "kind": type(error).__name__})

    def do_GET(self) -> None:
        if self.path != "/health":
            return self._json(
                HTTPStatus.NOT_FOUND, {"error": f"no endpoint GET {self.path}", "kind": "NotFound"}
            )
        srv = self.server
        self._json(
            HTTPStatus.OK,
            {
                "status": "ok",
                "protocol": PROTOCOL_VERSION,
                "backend": srv.backend.name,
                "model": srv.model,
                "model_identity": srv.model_identity,
                "pid": os.getpid(),
                "lora_version": srv.lora_version,
                "lora_fingerprint": srv.lora_fingerprint,
                "requests": srv.requests,
            },
        )

    def do_POST(self) -> None:
        srv = self.server
        length = int(self.headers.get("Content-Length") or 0)
        body = self.rfile.read(length) if length else b""
        if self.path == "/shutdown":
            self._json(HTTPStatus.OK, {"status": "shutting down"})
            threading.Thread(target=srv.shutdown, daemon=True).start()
            return
        if self.path not in ("/generate", "/lora"):
            return self._json(
                HTTPStatus.NOT_FOUND, {"error": f"no endpoint POST {self.path}", "kind": "NotFound"}
            )
        try:
            meta, tensors = unpack(body)
        except ProtocolError as error:
            return self._error(HTTPStatus.BAD_REQUEST, error)
        with srv.busy:
            try:
                if self.path == "/lora":
                    ack = self._lora(meta, tensors)
                    return self._json(HTTPStatus.OK, ack)
                reply_meta, reply = srv.backend.generate(meta.get("spec"), tensors)
                # The server is the authority on which weights are loaded (a relabel changes the
                # version, not the weights).
                reply_meta.update(weights_version=srv.lora_version, lora_fingerprint=srv.lora_fingerprint)
                srv.requests += 1
            except ProtocolError as error:
                return self._error(HTTPStatus.BAD_REQUEST, error)
            except Exception as error:
                name = type(error).__name__
                status = HTTPStatus.CONFLICT if name == "LoraSyncError" else HTTPStatus.UNPROCESSABLE_ENTITY
                if status == HTTPStatus.UNPROCESSABLE_ENTITY and not isinstance(error, ValueError):
                    status = HTTPStatus.INTERNAL_SERVER_ERROR
                    log.error("request %s failed:\n%s", self.path, traceback.format_exc())
                return self._error(status, error)
        self._reply(HTTPStatus.OK, pack(reply_meta, reply))

    def _lora(self, meta: dict, tensors: dict[str, torch.Tensor]) -> dict:
        srv = self.server
        version = meta.get("version")
        if isinstance(version, bool) or not isinstance(version, int) or version < 0:
            raise ProtocolError(f"/lora: version must be an int >= 0, got {version!r}")
        if meta.get("relabel"):
            # The trainer put back weights equal to `version`'s (its preflight): same weights, that label.
            srv.lora_version = version
            return {"version": version, "fingerprint": srv.lora_fingerprint, "keys": None}
        if meta.get("reset"):
            # A trainer (re)connecting: back to the base weights, versions counted from `version`.
            ack = srv.backend.clear_lora(version)
            srv.lora_version, srv.lora_fingerprint = version, None
            return ack
        if version <= srv.lora_version:
            raise ProtocolError(f"/lora: version {version} is not newer than the loaded {srv.lora_version}")
        if meta.get("clear"):
            ack = srv.backend.clear_lora(version)
        else:
            if not tensors:
                raise ProtocolError("/lora: no LoRA tensors were sent (send clear=true for the base weights)")
            ack = srv.backend.load_lora(version, meta.get("peft_config") or {}, tensors)
        srv.lora_version, srv.lora_fingerprint = version, ack.get("fingerprint")
        return ack


def _exit_with_parent(parent_pid: int) -> None:
    """A launched worker must not outlive its trainer (killed with SIGKILL, say), holding the GPUs."""

    def watch() -> None:
        while True:
            if os.getppid() != parent_pid:
                log.error("the trainer (pid %d) is gone: exiting", parent_pid)
                os._exit(3)
            time.sleep(1.0)

    threading.Thread(target=watch, name="parent-watch", daemon=True).start()


def serve(backend: Backend, *, host: str, port: int, model: str, ready_file: str | None = None) -> None:
    """Serve until ``POST /shutdown`` (or SIGTERM); writes ``ready_file`` once listening."""
    server = _Server((host, port), backend, model)
    url = f"http://{server.server_address[0]}:{server.server_address[1]}"
    if ready_file:
        tmp = f"{ready_file}.tmp"
        with open(tmp, "w") as f:
            json.dump({"url": url, "pid": os.getpid(), "backend": backend.name}, f)
        os.replace(tmp, ready_file)
    log.info("boogu_vllm worker (%s backend) serving %s at %s", backend.name, model, url)
    try:
        server.serve_forever(poll_interval=0.2)
    finally:
        server.server_close()
        backend.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="boogu_vllm.worker", description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", required=True, help="local checkpoint folder (diffusers layout)")
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=0, help="0: any free port (see --ready-file)")
    parser.add_argument(
        "--backend",
        choices=("auto", "direct", "omni"),
        default="auto",
        help="auto: omni when CUDA is available, else direct",
    )
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "float16"),
        default=None,
        help="model dtype (default: bfloat16 on GPU, float32 on CPU)",
    )
    parser.add_argument("--ready-file", default=None, help="write {url, pid, backend} here once serving")
    parser.add_argument(
        "--parent-pid", type=int, default=None, help="exit when this process (the trainer) is gone"
    )
    parser.add_argument(
        "--engine-args", default=None, help="omni backend: JSON object of extra vllm-omni engine arguments"
    )
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s boogu_vllm.worker %(levelname)s %(message)s")
    if not os.path.isdir(args.model):
        print(f"boogu_vllm.worker: error: --model {args.model} is not a folder", file=sys.stderr)
        return 2
    if args.parent_pid is not None:
        _exit_with_parent(args.parent_pid)
    backend_name = args.backend
    if backend_name == "auto":
        backend_name = "omni" if torch.cuda.is_available() else "direct"
    t0 = time.perf_counter()
    if backend_name == "omni":
        from boogu_vllm.omni_backend import OmniBackend

        backend: Backend = OmniBackend(
            args.model,
            dtype=args.dtype or auto_dtype("cuda"),  # vllm-omni's engine runs on the GPU
            engine_args=json.loads(args.engine_args) if args.engine_args else None,
        )
    else:
        dtype = getattr(torch, args.dtype or auto_dtype("cpu"))
        backend = DirectBackend(args.model, dtype=dtype, device="cpu")  # the CPU shims' path
    log.info("model loaded in %.1f s", time.perf_counter() - t0)
    serve(backend, host=args.host, port=args.port, model=args.model, ready_file=args.ready_file)
    return 0


if __name__ == "__main__":
    sys.exit(main())
