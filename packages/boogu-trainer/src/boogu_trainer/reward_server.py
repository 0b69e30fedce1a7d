"""``boogu-reward-server``: serve one registered reward over the reward-service protocol.

An expensive reward (a VLM judge, an aesthetic model) can run in its own process, on its own GPU
or machine, and the trainer scores with the ``http`` reward pointed at it::

    boogu-reward-server --reward demo_target_color --kwargs '{"target": [0, 0, 255]}' --port 8123

The protocol is in docs/reward-service.md: ``POST /score`` with base64 PNGs and their prompt
records, answered by one score per image; ``GET /health`` names the reward and its options.
Standard library only (``http.server``): one reward instance, calls to it serialised by a lock
(requests are decoded in parallel), JSON errors (4xx for a bad request, 500 with the exception's
message when the reward fails). A request is bounded in bytes (``--max-body-mb``), in pixels
before any is decoded (``--max-pixels-per-image``, ``--max-pixels-per-request``) and in time: its
line, headers and body must arrive within ``--request-timeout-s`` in all. The server as a whole is
bounded in the pixels of the requests it decodes or scores at once (``--max-pixels-in-flight``): a
request that does not fit waits its turn, in arrival order, for at most ``--queue-timeout-s``, then
is answered 503 with a ``Retry-After``. It listens on a
loopback address only, unless ``--allow-remote``: the protocol has no TLS, and a bearer token
(``--api-key-env``) is its only access control.
"""

from __future__ import annotations

import argparse
import collections
import hmac
import io
import ipaddress
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import numpy as np
import torch

from boogu_trainer.rewards import RewardFn, build_reward
from boogu_trainer.rewards.base import scores_tensor
from boogu_trainer.rewards.http import (
    PROTOCOL_VERSION,
    ImageTooLarge,
    decode_png,
    png_bytes,
    png_size,
    record_from_json,
    scores_to_json,
)
from boogu_trainer.rewards.transport import DeadlineReader

__all__ = [
    "DEFAULT_MAX_BODY_BYTES",
    "DEFAULT_MAX_PIXELS_PER_IMAGE",
    "DEFAULT_MAX_PIXELS_PER_REQUEST",
    "DEFAULT_QUEUE_TIMEOUT_S",
    "DEFAULT_REQUEST_TIMEOUT_S",
    "RETRY_AFTER_S",
    "PixelBudget",
    "RewardServer",
    "main",
    "serve",
]

logger = logging.getLogger(__name__)

DEFAULT_MAX_BODY_BYTES = 512 * 2**20
"""Largest request body accepted (413 above it): 512 MiB, some hundreds of 1024² PNGs."""

DEFAULT_MAX_PIXELS_PER_IMAGE = 4096 * 4096
"""Most pixels one image may declare in its PNG header (413 above it, before decoding)."""

DEFAULT_MAX_PIXELS_PER_REQUEST = 64 * 2**20
"""Most pixels the images of one request may declare in all: 64 images of 1024², 4 of 4096². Decoded
as uint8 RGB they take 192 MiB, and the batch some copies of that; a black PNG compresses about
1000:1, so without this a 1 MB body could ask for gigabytes."""

DEFAULT_REQUEST_TIMEOUT_S = 60.0
"""Seconds for a request's line, headers and body to arrive, in all (408, or a closed connection)."""

DEFAULT_QUEUE_TIMEOUT_S = 30.0
"""Seconds a request waits for room in ``max_pixels_in_flight`` before it is answered 503. Below the
``http`` reward's default ``timeout_s`` (60), so a queued client hears the 503 and retries rather
than giving up on an answer that would still come."""

RETRY_AFTER_S = 1
"""The ``Retry-After`` (seconds) of a 503 ``overloaded`` answer."""


class _BadRequest(Exception):
    """The request is malformed: answered 400 (or ``status``, with ``headers``) with the message."""

    def __init__(
        self,
        message: str,
        status: int = 400,
        kind: str = "bad_request",
        headers: Mapping[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.kind = kind
        self.headers = dict(headers or {})


class PixelBudget:
    """The pixels of the requests a server decodes or scores at once, at most ``limit`` in all.

    `acquire` admits requests in arrival order (a large one is not passed by smaller ones behind
    it) and waits at most ``timeout`` seconds for its turn and the room; `release` gives it back.
    ``used`` is what is admitted now, ``waiting`` how many requests wait.
    """

    def __init__(self, limit: int) -> None:
        self.limit = limit
        self.used = 0
        self._queue: collections.deque[object] = collections.deque()
        self._changed = threading.Condition()

    @property
    def waiting(self) -> int:
        with self._changed:
            return len(self._queue)

    def acquire(self, pixels: int, timeout: float) -> bool:
        """Whether ``pixels`` were admitted within ``timeout`` seconds (``pixels <= limit``)."""
        ticket = object()
        deadline = time.monotonic() + timeout
        with self._changed:
            self._queue.append(ticket)
            try:
                while self._queue[0] is not ticket or self.used + pixels > self.limit:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return False
                    self._changed.wait(left)
                self.used += pixels
                return True
            finally:
                # Admitted or given up: the next in line may go now.
                self._queue.remove(ticket)
                self._changed.notify_all()

    def release(self, pixels: int) -> None:
        with self._changed:
            self.used -= pixels
            self._changed.notify_all()


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
        max_pixels_per_image: int = DEFAULT_MAX_PIXELS_PER_IMAGE,
        max_pixels_per_request: int = DEFAULT_MAX_PIXELS_PER_REQUEST,
        max_pixels_in_flight: int | None = None,
        request_timeout_s: float = DEFAULT_REQUEST_TIMEOUT_S,
        queue_timeout_s: float = DEFAULT_QUEUE_TIMEOUT_S,
    ) -> None:
        if max_pixels_in_flight is None:
            max_pixels_in_flight = 2 * max_pixels_per_request
        for option, value in [
            ("max_body_bytes", max_body_bytes),
            ("max_pixels_per_image", max_pixels_per_image),
            ("max_pixels_per_request", max_pixels_per_request),
            ("max_pixels_in_flight", max_pixels_in_flight),
            ("request_timeout_s", request_timeout_s),
        ]:
            if isinstance(value, bool) or not isinstance(value, int | float) or not 0 < value < float("inf"):
                raise ValueError(f"reward server: {option} must be a finite number > 0, got {value!r}")
        wait = queue_timeout_s
        if isinstance(wait, bool) or not isinstance(wait, int | float) or not 0 <= wait < float("inf"):
            raise ValueError(f"reward server: queue_timeout_s must be a finite number >= 0, got {wait!r}")
        if max_pixels_in_flight < max_pixels_per_request:
            raise ValueError(
                f"reward server: max_pixels_in_flight ({max_pixels_in_flight}) must be at least "
                f"max_pixels_per_request ({max_pixels_per_request}), or a request the server accepts "
                "could never be scored"
            )
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
        self.max_pixels_per_image = max_pixels_per_image
        self.max_pixels_per_request = max_pixels_per_request
        self.in_flight = PixelBudget(int(max_pixels_in_flight))
        self.request_timeout_s = float(request_timeout_s)
        self.queue_timeout_s = float(queue_timeout_s)
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
        pngs, pixels = self._checked_pngs(images)
        parsed = []
        for i, record in enumerate(records):
            try:
                parsed.append(record_from_json(record))
            except (TypeError, ValueError) as error:
                raise _BadRequest(f"record {i}: {error}") from None
        if not pngs:
            return {"version": PROTOCOL_VERSION, "reward": self.reward_name, "scores": []}
        # The decoded pixels are the memory a request costs (3 bytes each, copied a few times, and
        # more inside the reward), far beyond its body: hold them to the server-wide budget.
        if not self.in_flight.acquire(pixels, self.queue_timeout_s):
            raise _BadRequest(
                f"the server is busy: this request's {pixels} pixels waited {self.queue_timeout_s:g} s "
                f"(--queue-timeout-s) for room in the {self.in_flight.limit} pixels it decodes and "
                f"scores at once (--max-pixels-in-flight); retry after {RETRY_AFTER_S} s",
                503,
                "overloaded",
                {"Retry-After": str(RETRY_AFTER_S)},
            )
        try:
            return self._score_admitted(pngs, parsed)
        finally:
            self.in_flight.release(pixels)

    def _score_admitted(self, pngs: list[bytes], records: list[Any]) -> dict[str, Any]:
        arrays = []
        for i, data in enumerate(pngs):
            try:
                arrays.append(decode_png(data, self.max_pixels_per_image))
            except ImageTooLarge as error:  # PIL's own bomb limit, when ours is set above it
                raise _BadRequest(f"image {i}: {error}", 413, "too_many_pixels") from None
            except ValueError as error:
                raise _BadRequest(f"image {i}: {error}") from None
        batch = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()
        del arrays
        with self.lock:
            values = self.reward(batch, records)
        scores = scores_tensor(values, len(batch), self.reward_name)
        return {"version": PROTOCOL_VERSION, "reward": self.reward_name, "scores": scores_to_json(scores)}

    def _checked_pngs(self, images: list[object]) -> tuple[list[bytes], int]:
        """The PNGs' bytes and their pixels in all, once their headers fit the pixel limits and one
        size: nothing decoded yet."""
        pngs, sizes = [], []
        for i, image in enumerate(images):
            try:
                data = png_bytes(image)
                width, height = png_size(data)
            except ValueError as error:
                raise _BadRequest(f"image {i}: {error}") from None
            if width * height > self.max_pixels_per_image:
                raise _BadRequest(
                    f"image {i} is {width}x{height}, more than the server's limit of "
                    f"{self.max_pixels_per_image} pixels per image (--max-pixels-per-image)",
                    413,
                    "too_many_pixels",
                )
            pngs.append(data)
            sizes.append((width, height))
        total = sum(width * height for width, height in sizes)
        if total > self.max_pixels_per_request:
            raise _BadRequest(
                f"the {len(sizes)} images have {total} pixels in all, more than the server's limit of "
                f"{self.max_pixels_per_request} per request (--max-pixels-per-request); lower the "
                "http reward's batch_size",
                413,
                "too_many_pixels",
            )
        if len(set(sizes)) > 1:
            shapes = sorted({f"{width}x{height}" for width, height in sizes})
            raise _BadRequest(f"the images of one request must have one size, got {', '.join(shapes)}")
        return pngs, total

    def health(self) -> dict[str, Any]:
        return {
            "version": PROTOCOL_VERSION,
            "status": "ok",
            "reward": self.reward_name,
            "options": self.options,
            "in_flight": {
                "pixels": self.in_flight.used,
                "max_pixels": self.in_flight.limit,
                "waiting": self.in_flight.waiting,
            },
        }


class _Handler(BaseHTTPRequestHandler):
    server: RewardServer
    server_version = "boogu-reward-server"

    def setup(self) -> None:
        super().setup()
        # Every read of a request (its line, headers and body) ends by one deadline, set when the
        # request begins: a per-read socket timeout would let a client that sends a byte now and
        # then hold this thread for as long as it likes.
        self.rfile.close()
        self._reader = DeadlineReader(self.connection, time.monotonic() + self.server.request_timeout_s)
        self.rfile = io.BufferedReader(self._reader)

    def handle_one_request(self) -> None:
        # The wait for a kept-alive connection's next request counts too: an idle one is closed.
        self._reader.deadline = time.monotonic() + self.server.request_timeout_s
        super().handle_one_request()

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
            self._error(error.status, error.kind, str(error), error.headers)
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
        try:
            raw = self._read_body()
        except TimeoutError:
            self.close_connection = True
            raise _BadRequest(
                f"the request did not arrive within the server's {self.server.request_timeout_s:g} s "
                "(--request-timeout-s)",
                408,
                "request_timeout",
            ) from None
        except OSError as error:  # reset by the client: the answer will not reach it either
            self.close_connection = True
            raise _BadRequest(f"the request body could not be read: {error}") from None
        try:
            return json.loads(raw)
        except ValueError as error:
            raise _BadRequest(f"the request body is not JSON: {error}") from None
        except RecursionError:
            raise _BadRequest("the request body is JSON nested too deeply") from None

    def _read_body(self) -> bytes:
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
            self.close_connection = True
            raise _BadRequest(f"the request body ended after {len(raw)} of {length} bytes")
        return raw

    def _authorised(self) -> bool:
        key = self.server.api_key
        if key is None:
            return True
        given = self.headers.get("Authorization", "")
        if hmac.compare_digest(given.encode("utf-8"), f"Bearer {key}".encode()):
            return True
        self._error(401, "unauthorised", "missing or wrong bearer token (Authorization: Bearer ...)")
        return False

    def _error(
        self,
        status: int,
        kind: str,
        message: str,
        headers: Mapping[str, str] | None = None,
        allow: str | None = None,
    ) -> None:
        headers = dict(headers or {}) | ({"Allow": allow} if allow else {})
        self._send(
            status, {"version": PROTOCOL_VERSION, "error": {"type": kind, "message": message}}, headers
        )

    def _send(
        self, status: int, payload: Mapping[str, Any], headers: Mapping[str, str] | None = None
    ) -> None:
        body = json.dumps(payload, allow_nan=False).encode("utf-8")
        try:
            # The reads may have left the socket a short timeout; the answer gets a whole one.
            self.connection.settimeout(self.server.request_timeout_s)
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
    ``allow_remote``, ``api_key``, ``max_body_bytes``, ``max_pixels_per_image``,
    ``max_pixels_per_request``, ``max_pixels_in_flight`` (default twice ``max_pixels_per_request``),
    ``request_timeout_s``, ``queue_timeout_s``).
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
    parser.add_argument(
        "--max-pixels-per-image",
        type=int,
        default=DEFAULT_MAX_PIXELS_PER_IMAGE,
        help="most pixels one image may have (default 4096*4096), checked before decoding",
    )
    parser.add_argument(
        "--max-pixels-per-request",
        type=int,
        default=DEFAULT_MAX_PIXELS_PER_REQUEST,
        help="most pixels the images of one request may have in all (default 64*2**20)",
    )
    parser.add_argument(
        "--max-pixels-in-flight",
        type=int,
        default=None,
        help="most pixels of all the requests decoded or scored at once, server-wide (default twice "
        "--max-pixels-per-request); a request that does not fit waits its turn",
    )
    parser.add_argument(
        "--queue-timeout-s",
        type=float,
        default=DEFAULT_QUEUE_TIMEOUT_S,
        help="seconds a request waits for room in --max-pixels-in-flight before it is answered 503 "
        "with a Retry-After (default 30)",
    )
    parser.add_argument(
        "--request-timeout-s",
        type=float,
        default=DEFAULT_REQUEST_TIMEOUT_S,
        help="seconds for a request's line, headers and body to arrive, in all (default 60)",
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
    for flag, value in [
        ("--max-body-mb", args.max_body_mb),
        ("--max-pixels-per-image", args.max_pixels_per_image),
        ("--max-pixels-per-request", args.max_pixels_per_request),
        ("--request-timeout-s", args.request_timeout_s),
    ]:
        if not 0 < value < float("inf"):
            parser.error(f"{flag} must be > 0, got {value}")
    if args.max_pixels_in_flight is None:
        args.max_pixels_in_flight = 2 * args.max_pixels_per_request
    if args.max_pixels_in_flight < args.max_pixels_per_request:
        parser.error(
            f"--max-pixels-in-flight ({args.max_pixels_in_flight}) must be at least "
            f"--max-pixels-per-request ({args.max_pixels_per_request}), or a request the server "
            "accepts could never be scored"
        )
    if not 0 <= args.queue_timeout_s < float("inf"):
        parser.error(f"--queue-timeout-s must be >= 0, got {args.queue_timeout_s}")
    api_key = None
    if args.api_key_env is not None:
        api_key = os.environ.get(args.api_key_env, "")
        if not api_key:
            parser.error(f"--api-key-env names {args.api_key_env!r}, which is unset or empty")
    try:
        reward = build_reward(args.reward, **kwargs)
    except ValueError as error:
        parser.error(str(error))
    try:
        server = RewardServer(
            reward,
            args.host,
            args.port,
            options=kwargs,
            allow_remote=args.allow_remote,
            api_key=api_key,
            max_body_bytes=int(args.max_body_mb * 2**20),
            max_pixels_per_image=args.max_pixels_per_image,
            max_pixels_per_request=args.max_pixels_per_request,
            max_pixels_in_flight=args.max_pixels_in_flight,
            request_timeout_s=args.request_timeout_s,
            queue_timeout_s=args.queue_timeout_s,
        )
    except OSError as error:  # the port is taken, or the address is not this machine's
        address = f"[{args.host}]:{args.port}" if ":" in args.host else f"{args.host}:{args.port}"
        print(
            f"boogu-reward-server: error: cannot listen on {address}: {error.strerror or error}",
            file=sys.stderr,
        )
        return 2

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
