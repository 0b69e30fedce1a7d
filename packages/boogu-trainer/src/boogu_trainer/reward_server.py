"""``boogu-reward-server``: serve one registered reward over the reward-service protocol.

An expensive reward (a VLM judge, an aesthetic model) can run in its own process, on its own GPU
or machine, and the trainer scores with the ``http`` reward pointed at it::

    boogu-reward-server --reward demo_target_color --kwargs '{"target": [0, 0, 255]}' --port 8123

The protocol is in docs/reward-service.md: ``POST /score`` with base64 PNGs and their prompt
records, answered by one score per image; ``GET /health`` names the reward and its options.
Standard library only (``http.server``): one reward instance, calls to it serialised by a lock
(requests are decoded in parallel), JSON errors (400 for a bad request, 500 with the exception's
message when the reward fails). It listens on a loopback address only, unless ``--allow-remote``:
the protocol has no TLS, and a bearer token (``--api-key-env``) is its only access control.
"""

from __future__ import annotations

import argparse
import hmac
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch

from boogu_trainer.rewards import RewardFn, build_reward
from boogu_trainer.rewards.base import scores_tensor
from boogu_trainer.rewards.http import (
    PROTOCOL_VERSION,
    decode_png,
    record_from_json,
    scores_to_json,
)

__all__ = ["DEFAULT_MAX_BODY_BYTES", "RewardServer", "main", "serve"]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 512 * 2**20
"""Largest request body accepted (413 above it): 512 MiB, some hundreds of 1024² PNGs."""


class _BadRequest(Exception):
    """The request is malformed: answered 400 (or ``status``) with the message."""

    def __init__(self, message: str, status: int = 400, kind: str = "bad_request") -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind


class RewardServer(ThreadingHTTPServer):
    """A threading HTTP server for one reward; `serve` builds and starts one.

    ``url`` is its root (``http://127.0.0.1:PORT``); `close` stops it and frees the port.
    """

    daemon_threads = True
    block_on_close = False
    allow_reuse_address = True

    def __init__(
        self,
        reward: RewardFn,
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        options: Mapping[str, Any] | None = None,
        allow_remote: bool = False,
        api_key: str | None = None,
        max_body_bytes: int = DEFAULT_MAX_BODY_BYTES,
        client_timeout_s: float = 120.0,
    ) -> None:
        if not allow_remote and not is_loopback(host):
            raise ValueError(
                f"reward server: refusing to listen on {host!r}, which is not a loopback address "
                "(the protocol has no TLS); pass allow_remote=True (--allow-remote) to serve other "
                "machines, ideally with an API key, or tunnel to 127.0.0.1 with ssh -L"
            )
        if isinstance(host, str) and ":" in host:
            self.address_family = socket.AF_INET6
        self.reward = reward
        self.reward_name = str(getattr(reward, "name", type(reward).__name__))
        self.options = dict(options or {})
        self.api_key = api_key
        self.max_body_bytes = max_body_bytes
        self.client_timeout_s = client_timeout_s
        self.lock = threading.Lock()
        self._thread: threading.Thread | None = None
        super().__init__((host, port), _Handler)

    def handle_error(self, request: Any, client_address: Any) -> None:
        # A client that gave up closes its socket; the late write fails. Not worth a traceback.
        logger.debug("reward server: request from %s failed", client_address, exc_info=True)

    @property
    def url(self) -> str:
        host, port = self.server_address[:2]
        host = f"[{host}]" if ":" in str(host) else host
        return f"http://{host}:{port}"

    def start(self) -> RewardServer:
        """Serve in a daemon thread (what `serve` does); returns self."""
        self._thread = threading.Thread(
            target=self.serve_forever, kwargs={"poll_interval": 0.05}, name="reward-server", daemon=True
        )
        self._thread.start()
        return self

    def close(self) -> None:
        """Stop serving (when started) and close the listening socket."""
        if self._thread is not None:
            self.shutdown()
            self._thread.join()
            self._thread = None
        self.server_close()

    def __enter__(self) -> RewardServer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def score(self, payload: object) -> dict[str, Any]:
        """Answer one ``POST /score`` payload (parsed JSON); raises `_BadRequest` for a bad one."""
        if not isinstance(payload, dict):
            raise _BadRequest("the request must be a JSON object")
        version = payload.get("version")
        if version != PROTOCOL_VERSION:
            raise _BadRequest(
                f"unsupported protocol version {version!r}; this server speaks version {PROTOCOL_VERSION}",
                kind="unsupported_version",
            )
        wanted = payload.get("reward")
        if wanted is not None and wanted != self.reward_name:
            raise _BadRequest(
                f"this server serves reward {self.reward_name!r}, not {wanted!r}", kind="wrong_reward"
            )
        images, records = payload.get("images"), payload.get("records")
        if not isinstance(images, list) or not isinstance(records, list):
            raise _BadRequest("'images' and 'records' must be lists")
        if len(images) != len(records):
            raise _BadRequest(
                f"got {len(images)} images but {len(records)} records; record i describes image i"
            )
        arrays = []
        for i, image in enumerate(images):
            try:
                arrays.append(decode_png(image))
            except ValueError as error:
                raise _BadRequest(f"image {i}: {error}") from None
        if len({array.shape for array in arrays}) > 1:
            shapes = sorted({f"{a.shape[1]}x{a.shape[0]}" for a in arrays})
            raise _BadRequest(f"the images of one request must have one size, got {', '.join(shapes)}")
        parsed = []
        for i, record in enumerate(records):
            try:
                parsed.append(record_from_json(record))
            except (TypeError, ValueError) as error:
                raise _BadRequest(f"record {i}: {error}") from None
        if not arrays:
            return {"version": PROTOCOL_VERSION, "reward": self.reward_name, "scores": []}
        batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
        with self.lock:
            values = self.reward(batch, parsed)
        scores = scores_tensor(values, len(arrays), self.reward_name)
        return {"version": PROTOCOL_VERSION, "reward": self.reward_name, "scores": scores_to_json(scores)}

    def health(self) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "status": "ok",
            "reward": self.reward_name,
            "options": self.options,
        }


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "boogu-reward-server"

    def setup(self) -> None:
        # A client that stops sending mid-request must not hold a thread for ever.
        self.timeout = self.server.client_timeout_s
        super().setup()

    def do_GET(self) -> None:
        if not self._authorised():
            return
        if self.path.split("?", 1)[0] == "/health":
            self._send(200, self.server.health())
        elif self.path.split("?", 1)[0] == "/score":
            self._error(405, "method_not_allowed", "use POST /score", allow="POST")
        else:
            self._error(404, "not_found", f"no {self.path!r}; the endpoints are POST /score and GET /health")

    def do_POST(self) -> None:
        if not self._authorised():
            return
        if self.path.split("?", 1)[0] != "/score":
            if self.path.split("?", 1)[0] == "/health":
                self._error(405, "method_not_allowed", "use GET /health", allow="GET")
            else:
                self._error(
                    404, "not_found", f"no {self.path!r}; the endpoints are POST /score and GET /health"
                )
            return
        try:
            payload = self._read_json()
            answer = self.server.score(payload)
        except _BadRequest as error:
            self._error(error.status, error.kind, str(error))
            return
        except Exception as error:
            logger.exception("reward %r failed", self.server.reward_name)
            self._error(
                500,
                "reward_error",
                f"reward {self.server.reward_name!r} raised {type(error).__name__}: {error}",
            )
            return
        self._send(200, answer)

    def _read_json(self) -> object:
        length_header = self.headers.get("Content-Length")
        if length_header is None:
            raise _BadRequest(
                "the request needs a Content-Length (chunked bodies are not read)", 411, "length_required"
            )
        try:
            length = int(length_header)
        except ValueError:
            raise _BadRequest(f"bad Content-Length {length_header!r}") from None
        if length < 0:
            raise _BadRequest(f"bad Content-Length {length_header!r}")
        if length > self.server.max_body_bytes:
            # Read the body anyway (discarding it): a client still sending when the server closes
            # the connection would see a reset, not this answer.
            self.close_connection = True
            left = length
            while left > 0 and (chunk := self.rfile.read(min(left, 2**20))):
                left -= len(chunk)
            raise _BadRequest(
                f"the request body has {length} bytes, more than the server's limit of "
                f"{self.server.max_body_bytes}; lower the http reward's batch_size",
                413,
                "too_large",
            )
        raw = self.rfile.read(length)
        if len(raw) != length:
            raise _BadRequest(f"the request body ended after {len(raw)} of {length} bytes")
        try:
            return json.loads(raw)
        except ValueError as error:
            raise _BadRequest(f"the request body is not JSON: {error}") from None

    def _authorised(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode("utf-8"), f"Bearer {key}".encode()):
            return True
        self._error(401, "unauthorised", "missing or wrong bearer token (Authorization: Bearer ...)")
        return False

    def _error(self, status: int, kind: str, message: str, allow: str | None = None) -> None:
        headers = {"Allow": allow} if allow else {}
        self._send(
            status, {"version": PROTOCOL_VERSION, "error": {"type": kind, "message": message}}, headers
        )

    def _send(
        self, status: int, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        body = json.dumps(payload, allow_nan=False).encode("utf-8")
        try:
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            for name, value in (headers or {}).items():
                self.send_header(name, value)
            self.end_headers()
            self.wfile.write(body)
        except OSError as error:  # the client gave up (its deadline passed): nothing to answer
            logger.info("reward server: could not answer %s: %s", self.client_address, error)
            self.close_connection = True

    def log_message(self, format: str, *args: Any) -> None:
        logger.debug("%s - %s", self.address_string(), format % args)


def is_loopback(host: str) -> bool:
    """Whether every address ``host`` resolves to is a loopback address ("" and 0.0.0.0 are not)."""
    if not isinstance(host, str) or not host:
        return False
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(host, None)
    except OSError:
        return False
    return bool(infos) and all(ipaddress.ip_address(info[4][0].split("%")[0]).is_loopback for info in infos)


def serve(
    reward: RewardFn,
    host: str = "127.0.0.1",
    port: int = 0,
    **kwargs: Any,
) -> RewardServer:
    """Serve ``reward`` on ``host:port`` (0: a free port) in a background thread.

    Returns the started `RewardServer`: ``.url`` is where to point the ``http`` reward, and
    ``.close()`` stops it. ``kwargs`` are `RewardServer`'s (``options`` shown by ``/health``,
    ``allow_remote``, ``api_key``, ``max_body_bytes``, ``client_timeout_s``).
    """
    return RewardServer(reward, host, port, **kwargs).start()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="boogu-reward-server",
        description="Serve one registered reward over the reward-service protocol (docs/reward-service.md).",
    )
    parser.add_argument("--reward", required=True, help="registered reward name, or package.module:attribute")
    parser.add_argument("--kwargs", default="{}", help="the reward's options as a JSON object")
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    parser.add_argument("--port", type=int, default=0, help="port (default 0: a free one, printed)")
    parser.add_argument(
        "--allow-remote", action="store_true", help="allow a non-loopback --host (no TLS: use an API key)"
    )
    parser.add_argument(
        "--api-key-env", default=None, help="environment variable holding a bearer token clients must send"
    )
    parser.add_argument(
        "--max-body-mb", type=float, default=DEFAULT_MAX_BODY_BYTES / 2**20, help="largest request body, MiB"
    )
    parser.add_argument("--log-level", default="INFO", help="logging level (default INFO)")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """The ``boogu-reward-server`` command: prints the service URL as the first line on stdout."""
    parser = _parser()
    args = parser.parse_args(argv)
    logging.basicConfig(
        level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s"
    )
    try:
        kwargs = json.loads(args.kwargs)
    except ValueError as error:
        parser.error(f"--kwargs is not JSON: {error}")
    if not isinstance(kwargs, dict):
        parser.error(f"--kwargs must be a JSON object, got {args.kwargs!r}")
    if not args.allow_remote and not is_loopback(args.host):
        parser.error(f"--host {args.host!r} is not a loopback address; pass --allow-remote to serve it")
    if not 0 <= args.port <= 65535:
        parser.error(f"--port must be in [0, 65535], got {args.port}")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "")
        if not api_key:
            parser.error(f"--api-key-env names {args.api_key_env!r}, which is unset or empty")
    try:
        reward = build_reward(args.reward, **kwargs)
    except ValueError as error:
        parser.error(str(error))
    server = RewardServer(
        reward,
        args.host,
        args.port,
        options=kwargs,
        allow_remote=args.allow_remote,
        api_key=api_key,
        max_body_bytes=int(args.max_body_mb * 2**20),
    )

    def stop(signum: int, frame: object) -> None:
        raise KeyboardInterrupt

    signal.signal(signal.SIGTERM, stop)
    print(server.url, flush=True)
    logger.info("serving reward %r (options %s) at %s", server.reward_name, kwargs, server.url)
    try:
        server.serve_forever(poll_interval=0.2)
    except KeyboardInterrupt:
        logger.info("stopping")
    finally:
        server.server_close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
