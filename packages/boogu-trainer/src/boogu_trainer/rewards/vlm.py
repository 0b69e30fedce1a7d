"""``vlm_ocr``: the reference's OCR score, read by a VLM behind an OpenAI-compatible chat endpoint.

The reference (verl-omni ``genrm_ocr.py``) serves Qwen3-VL-8B-Instruct with vLLM and asks it to
transcribe each image; this reward sends the same request (system prompt, image as a data URL,
then the transcription prompt; temperature 0.7, top_p 0.8, max_tokens 4096 by default) to
``{base_url}/chat/completions`` and scores the answer with `ocr_text_score`.

Standard library only (``http.client``), so it adds no dependency. Unlike the reference, which
waits forever on a dead server, every attempt has an overall deadline: connecting, sending the
request and reading the whole answer must end within ``timeout_s``. A per-read socket timeout
alone would not do: a server that sends one byte a second would keep a request alive for ever.
Transient failures (connection errors, a missed deadline, HTTP 408/429/5xx) are retried with
exponential backoff, and after the last retry a `RewardError` names the URL, the sample, the
deadline and the last error. Other HTTP statuses (3xx, 400, 401, 404, ...; redirects are not
followed) and malformed answers are configuration problems and fail at once.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import logging
import math
import os
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from boogu_trainer.rewards.base import RewardError, TranscriptionReward, check_on_error, images_to_numpy
from boogu_trainer.rewards.registry import register_reward

__all__ = ["DEFAULT_MODEL", "DEFAULT_PROMPT", "DEFAULT_SYSTEM_PROMPT", "VlmOcrReward"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "Qwen/Qwen3-VL-8B-Instruct"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
DEFAULT_PROMPT = (
    "Please output only the text content from the image without any additional descriptions or formatting."
)

# Statuses a server returns while overloaded or restarting: worth another try.
_RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class _TransientError(Exception):
    """One attempt failed in a way a later attempt may not (message only; the HTTP rewards retry it)."""


@dataclass(frozen=True)
class _Endpoint:
    """Where one attempt connects and what it asks for (resolved once, from ``base_url`` and proxies)."""

    https: bool
    """TLS to ``host`` (through a CONNECT tunnel when there is a proxy)."""
    host: str
    port: int
    target: str
    """The request target: the path, or the absolute URL when sent to an HTTP proxy."""
    tunnel: tuple[str, int] | None = None
    """(host, port) of the endpoint behind an HTTPS proxy tunnel; ``host``/``port`` are the proxy's."""
    proxy_headers: tuple[tuple[str, str], ...] = ()
    """Proxy-Authorization, when the proxy URL has credentials."""


def _send_once(
    endpoint: _Endpoint,
    method: str,
    body: bytes | None,
    headers: dict[str, str],
    timeout_s: float,
    describe: Callable[[bytes], str],
) -> bytes | str:
    """One HTTP attempt under one deadline (connect, send and read the whole answer).

    Returns the body of a 2xx answer, or a description of a refusal (3xx/4xx that are not worth
    retrying, with ``describe(body)``); raises `_TransientError` for timeouts, connection errors and
    retryable statuses. Shared by ``vlm_ocr`` and the ``http`` reward.
    """
    connection_class = _DeadlineHTTPSConnection if endpoint.https else _DeadlineHTTPConnection
    connection = connection_class(endpoint.host, endpoint.port, deadline=time.monotonic() + timeout_s)
    if endpoint.tunnel is not None:
        connection.set_tunnel(*endpoint.tunnel, headers=dict(endpoint.proxy_headers))
    waiting_for = "connection"
    try:
        connection.connect()
        waiting_for = "answer"
        connection.request(method, endpoint.target, body=body, headers=headers)
        response = connection.getresponse()
        raw = response.read()
    except TimeoutError:
        raise _TransientError(
            f"no {waiting_for} within {timeout_s:g} s (the deadline for connecting, sending "
            "and reading the whole answer)"
        ) from None
    except (OSError, http.client.HTTPException) as error:
        # Connection refused or reset, server closed mid-answer, truncated body: transient.
        raise _TransientError(f"{type(error).__name__}: {error}") from None
    finally:
        connection.close()
    if 200 <= response.status < 300:
        return raw
    message = f"HTTP {response.status} {response.reason}: {describe(raw)}"
    if response.status in _RETRYABLE_STATUS:
        raise _TransientError(message)
    if 300 <= response.status < 400:
        message += f" (redirects are not followed; Location: {response.getheader('Location')})"
    return message


@register_reward("vlm_ocr")
class VlmOcrReward(TranscriptionReward):
    """How well the image shows ``record.ground_truth``, read by a VLM over HTTP.

    Measures: the reference's OCR score (`ocr_text_score`) of the VLM's transcription.
    Range: [0, 1]; stochastic at the reference's temperature 0.7 (use ``temperature=0`` for a
    deterministic judge).
    Cost: one chat completion per image, ``concurrency`` in flight; seconds per batch on the
    server's GPUs, almost nothing on the trainer's side (a PNG encode per image).

    Options: ``base_url`` is the API root (e.g. ``http://127.0.0.1:8000/v1``); ``timeout_s`` is
    the deadline of one attempt: connecting, sending the request and reading the whole answer
    must end within it, or the attempt fails as transient (over https the few reads of the TLS
    handshake each wait at most ``timeout_s`` too); attempt k > 0 waits
    ``min(backoff_s * 2**(k-1), backoff_max_s)`` first; ``api_key_env`` names an environment
    variable holding a bearer token; proxies from the environment (``http_proxy``,
    ``https_proxy``, ``no_proxy``; http:// proxies only) are ignored unless ``use_proxy_env``
    (endpoints are usually in-cluster, where an inherited ``http_proxy`` only reroutes them);
    ``on_error="nan"`` scores a sample that still fails after the retries NaN instead of raising.
    """

    name = "vlm_ocr"

    def __init__(
        self,
        *,
        base_url: str,
        model: str = DEFAULT_MODEL,
        prompt: str = DEFAULT_PROMPT,
        system_prompt: str = DEFAULT_SYSTEM_PROMPT,
        temperature: float = 0.7,
        top_p: float = 0.8,
        max_tokens: int = 4096,
        seed: int | None = None,
        timeout_s: float = 60.0,
        max_retries: int = 3,
        backoff_s: float = 1.0,
        backoff_max_s: float = 30.0,
        concurrency: int = 8,
        api_key_env: str | None = None,
        use_proxy_env: bool = False,
        on_error: str = "raise",
    ) -> None:
        if not isinstance(base_url, str) or not base_url.startswith(("http://", "https://")):
            raise ValueError(f"vlm_ocr: base_url must start with http:// or https://, got {base_url!r}")
        base_url = base_url.rstrip("/")
        if base_url.endswith("/chat/completions"):
            raise ValueError(
                f"vlm_ocr: base_url must be the API root (e.g. http://127.0.0.1:8000/v1), got {base_url!r}; "
                "'/chat/completions' is appended"
            )
        _require(_is_number(timeout_s) and timeout_s > 0, "timeout_s", timeout_s, "> 0")
        _require(_is_int(max_retries) and max_retries >= 0, "max_retries", max_retries, "an int >= 0")
        _require(_is_number(backoff_s) and backoff_s >= 0, "backoff_s", backoff_s, ">= 0")
        _require(_is_number(backoff_max_s) and backoff_max_s >= 0, "backoff_max_s", backoff_max_s, ">= 0")
        _require(_is_int(concurrency) and concurrency >= 1, "concurrency", concurrency, "an int >= 1")
        _require(_is_int(max_tokens) and max_tokens >= 1, "max_tokens", max_tokens, "an int >= 1")
        _require(_is_number(temperature) and temperature >= 0, "temperature", temperature, ">= 0")
        _require(_is_number(top_p) and 0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
        _require(seed is None or _is_int(seed), "seed", seed, "an int or None")
        self.url = f"{base_url}/chat/completions"
        self.model = model
        self.prompt = prompt
        self.system_prompt = system_prompt
        self.sampling: dict[str, Any] = {"temperature": temperature, "top_p": top_p, "max_tokens": max_tokens}
        if seed is not None:
            self.sampling["seed"] = seed
        self.timeout_s = float(timeout_s)
        self.max_retries = max_retries
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.concurrency = concurrency
        self.on_error = check_on_error(on_error, self.name)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise ValueError(f"vlm_ocr: api_key_env names {api_key_env!r}, which is unset or empty")
            self._headers["Authorization"] = f"Bearer {key}"
        self._endpoint = _endpoint(self.url, use_proxy_env)
        self._headers.update(self._endpoint.proxy_headers)

    def transcribe(self, images: torch.Tensor) -> list[str | None]:
        """The VLM's answer for each ``(3, H, W)`` uint8 image (None: failed, with ``on_error="nan"``)."""
        arrays = images_to_numpy(images)
        if len(arrays) == 0:
            return []
        with ThreadPoolExecutor(min(self.concurrency, len(arrays)), thread_name_prefix="vlm_ocr") as pool:
            futures = [pool.submit(self._transcribe_one, i, rgb) for i, rgb in enumerate(arrays)]
            try:
                return [future.result() for future in futures]
            except BaseException:
                for future in futures:
                    future.cancel()  # do not start requests for a batch that already failed
                raise

    def request_body(self, rgb: np.ndarray) -> dict[str, Any]:
        """The chat-completion request for one ``(H, W, 3)`` uint8 RGB image."""
        buffer = io.BytesIO()
        # PNG: lossless, so the judge reads exactly the pixels the policy produced; level 1
        # because the trainer's CPU time is scarcer than bytes on the wire.
        Image.fromarray(rgb).save(buffer, format="PNG", compress_level=1)
        data_url = "data:image/png;base64," + base64.b64encode(buffer.getvalue()).decode("ascii")
        return {
            "model": self.model,
            "messages": [
                {"role": "system", "content": self.system_prompt},
                {
                    "role": "user",
                    "content": [
                        {"type": "image_url", "image_url": {"url": data_url}},
                        {"type": "text", "text": self.prompt},
                    ],
                },
            ],
            **self.sampling,
        }

    def _transcribe_one(self, index: int, rgb: np.ndarray) -> str | None:
        body = json.dumps(self.request_body(rgb)).encode("utf-8")
        try:
            return self._complete(body, index)
        except RewardError as error:
            if self.on_error == "raise":
                raise
            logger.warning("%s (scored NaN)", error)
            return None

    def _complete(self, body: bytes, index: int) -> str:
        attempts = self.max_retries + 1
        last_error: _TransientError | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(min(self.backoff_s * 2 ** (attempt - 1), self.backoff_max_s))
            try:
                return self._post_once(body, index)
            except _TransientError as error:
                last_error = error
                logger.info(
                    "vlm_ocr: sample %d, attempt %d/%d failed: %s", index, attempt + 1, attempts, error
                )
        raise RewardError(
            f"vlm_ocr: POST {self.url} failed for sample {index} after {attempts} attempt(s) "
            f"(deadline {self.timeout_s:g} s each, for connecting, sending and the whole answer); "
            f"last error: {last_error}"
        )

    def _post_once(self, body: bytes, index: int) -> str:
        raw = _send_once(self._endpoint, "POST", body, self._headers, self.timeout_s, _excerpt)
        if isinstance(raw, str):  # a 3xx/4xx refusal, described
            raise RewardError(f"vlm_ocr: POST {self.url} was rejected for sample {index}: {raw}")
        return self._parse(raw, index)

    def _parse(self, raw: bytes, index: int) -> str:
        try:
            payload = json.loads(raw)
            content = payload["choices"][0]["message"]["content"]
        except (ValueError, KeyError, IndexError, TypeError):
            raise RewardError(
                f"vlm_ocr: {self.url} answered sample {index} without choices[0].message.content "
                f"(is it an OpenAI-compatible chat endpoint?): {_excerpt(raw)}"
            ) from None
        if content is None:
            return ""  # no text at all: the model saw nothing to transcribe
        if isinstance(content, list):
            # Some servers answer with content parts, like the request's.
            content = "".join(
                part.get("text", "")
                for part in content
                if isinstance(part, dict) and part.get("type") == "text"
            )
        if not isinstance(content, str):
            raise RewardError(
                f"vlm_ocr: {self.url} answered sample {index} with non-text content: {_excerpt(raw)}"
            )
        return content


def _require(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"vlm_ocr: {field} must be {allowed}, got {value!r}")


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _excerpt(raw: bytes, limit: int = 300) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


def _endpoint(url: str, use_proxy_env: bool) -> _Endpoint:
    """Resolve ``url`` (and, with ``use_proxy_env``, the environment's proxy for it) once."""
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if https else 80)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    proxy = urllib.request.getproxies().get(parts.scheme) if use_proxy_env else None
    if not proxy or urllib.request.proxy_bypass(parts.netloc):
        return _Endpoint(https, host, port, path)
    proxy_parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if proxy_parts.scheme != "http" or not proxy_parts.hostname:
        raise ValueError(
            f"vlm_ocr: the {parts.scheme}_proxy from the environment must be an http:// proxy, got "
            f"{proxy!r}; unset it or set use_proxy_env=False"
        )
    headers: tuple[tuple[str, str], ...] = ()
    if proxy_parts.username is not None:
        credentials = f"{urllib.parse.unquote(proxy_parts.username)}:"
        credentials += urllib.parse.unquote(proxy_parts.password or "")
        token = base64.b64encode(credentials.encode("utf-8")).decode("ascii")
        headers = (("Proxy-Authorization", f"Basic {token}"),)
    proxy_host, proxy_port = proxy_parts.hostname, proxy_parts.port or 80
    if https:  # TLS end to end, through a CONNECT tunnel
        return _Endpoint(True, proxy_host, proxy_port, path, tunnel=(host, port), proxy_headers=headers)
    return _Endpoint(False, proxy_host, proxy_port, url, proxy_headers=headers)


class _DeadlineMixin:
    """An ``http.client`` connection whose every socket operation ends by ``deadline``.

    Before each connect, send and read, the socket timeout is set to the time left (``sendall``
    counts its timeout over the whole call); once it is spent, TimeoutError. Reads go through
    `_DeadlineReader`, so a server that trickles the status line, the headers or the body cannot
    outlast the deadline.
    """

    sock: socket.socket | None
    timeout: float | None

    def __init__(self, host: str, port: int, *, deadline: float) -> None:
        super().__init__(host, port)  # type: ignore[call-arg]
        self.deadline = deadline
        """``time.monotonic()`` by which the whole exchange must be over."""

    def connect(self) -> None:
        self.timeout = _time_left(self.deadline)  # what socket.create_connection waits
        super().connect()  # type: ignore[misc]

    def send(self, data: Any) -> None:
        if self.sock is not None:
            self.sock.settimeout(_time_left(self.deadline))
        super().send(data)  # type: ignore[misc]

    def response_class(self, sock: socket.socket, *args: Any, **kwargs: Any) -> http.client.HTTPResponse:
        # http.client builds its responses (and the proxy tunnel's) as
        # ``self.response_class(self.sock, ...)``; this method stands in for the class so that the
        # response reads through the deadline.
        deadline_sock: Any = _DeadlineSocket(sock, self.deadline)
        return http.client.HTTPResponse(deadline_sock, *args, **kwargs)


class _DeadlineHTTPConnection(_DeadlineMixin, http.client.HTTPConnection):
    pass


class _DeadlineHTTPSConnection(_DeadlineMixin, http.client.HTTPSConnection):
    pass


class _DeadlineSocket:
    """What `http.client.HTTPResponse` needs of a socket (``makefile``), reading by a deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        self._deadline = deadline

    def makefile(self, mode: str) -> io.BufferedReader:
        if mode != "rb":
            raise ValueError(f"only 'rb' is supported, got {mode!r}")
        return io.BufferedReader(_DeadlineReader(self._sock, self._deadline))


class _DeadlineReader(io.RawIOBase):
    """Raw reads from a socket, each waiting at most until the deadline."""

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        # The socket's own raw file keeps the descriptor open after http.client closes the
        # connection object (it does that when the answer ends with the connection).
        self._raw = sock.makefile("rb", buffering=0)
        self._deadline = deadline

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self._sock.settimeout(_time_left(self._deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


def _time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline has passed")
    return left
