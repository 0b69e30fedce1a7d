"""``vlm_ocr``: the reference's OCR score, read by a VLM behind an OpenAI-compatible chat endpoint.

The reference (verl-omni ``genrm_ocr.py``) serves Qwen3-VL-8B-Instruct with vLLM and asks it to
transcribe each image; this reward sends the same request (system prompt, image as a data URL,
then the transcription prompt; temperature 0.7, top_p 0.8, max_tokens 4096 by default) to
``{base_url}/chat/completions`` and scores the answer with `ocr_text_score`.

Standard library only (``http.client``, through `boogu_trainer.rewards.transport`), so it adds no
dependency. Unlike the reference, which waits forever on a dead server, every attempt has an
overall deadline: connecting, sending the request and reading the whole answer must end within
``timeout_s``. A per-read socket timeout alone would not do: a server that sends one byte a
second would keep a request alive for ever.
Transient failures (connection errors, a missed deadline, HTTP 408/429/5xx) are retried with
exponential backoff, and after the last retry a `RewardError` names the URL, the sample, the
deadline and the last error. Other HTTP statuses (3xx, 400, 401, 404, ...; redirects are not
followed) and malformed answers are configuration problems and fail at once.
"""

from __future__ import annotations

import base64
import io
import json
import logging
import os
import time
from collections.abc import Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch
from PIL import Image

from boogu_trainer.rewards.base import RewardError, TranscriptionReward, check_on_error, images_to_numpy
from boogu_trainer.rewards.registry import register_reward
from boogu_trainer.rewards.transport import (
    AnswerTooLarge,
    TransientError,
    excerpt,
    is_int,
    is_number,
    resolve_endpoint,
    retry_delay,
    send_once,
    service_url,
)

__all__ = ["DEFAULT_MODEL", "DEFAULT_PROMPT", "DEFAULT_SYSTEM_PROMPT", "VlmOcrReward"]

logger = logging.getLogger(__name__)

DEFAULT_MODEL = "Qwen/Qwen3-VL-8B-Instruct"
DEFAULT_SYSTEM_PROMPT = "You are a helpful assistant."
DEFAULT_PROMPT = (
    "Please output only the text content from the image without any additional descriptions or formatting."
)

_MAX_ANSWER_BYTES = 16 * 2**20
"""The longest chat completion read: ``max_tokens`` of text is far less, even with logprobs."""


def api_root(base_url: object) -> str:
    """The ``base_url`` option, checked (`service_url`'s rule, and not the endpoint), without trailing ``/``."""
    base_url = service_url(base_url, "vlm_ocr", "base_url")
    if base_url.endswith("/chat/completions"):
        raise ValueError(
            f"vlm_ocr: base_url must be the API root (e.g. http://127.0.0.1:8000/v1), got {base_url!r}; "
            "'/chat/completions' is appended"
        )
    return base_url


def _check_options(options: Mapping[str, Any]) -> None:
    """The registry's cheap check when a config loads: the URL (the other values when built)."""
    if "base_url" in options:
        api_root(options["base_url"])


@register_reward("vlm_ocr", check=_check_options)
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
    ``min(max(backoff_s * 2**(k-1), Retry-After), backoff_max_s)`` first (the server's
    ``Retry-After``, when a retryable answer gave one); ``api_key_env`` names an environment
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
        base_url = api_root(base_url)
        _require(is_number(timeout_s) and timeout_s > 0, "timeout_s", timeout_s, "> 0")
        _require(is_int(max_retries) and max_retries >= 0, "max_retries", max_retries, "an int >= 0")
        _require(is_number(backoff_s) and backoff_s >= 0, "backoff_s", backoff_s, ">= 0")
        _require(is_number(backoff_max_s) and backoff_max_s >= 0, "backoff_max_s", backoff_max_s, ">= 0")
        _require(is_int(concurrency) and concurrency >= 1, "concurrency", concurrency, "an int >= 1")
        _require(is_int(max_tokens) and max_tokens >= 1, "max_tokens", max_tokens, "an int >= 1")
        _require(is_number(temperature) and temperature >= 0, "temperature", temperature, ">= 0")
        _require(is_number(top_p) and 0 < top_p <= 1, "top_p", top_p, "in (0, 1]")
        _require(seed is None or is_int(seed), "seed", seed, "an int or None")
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
        self._endpoint = resolve_endpoint(self.url, use_proxy_env, "vlm_ocr")
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
        last_error: TransientError | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(retry_delay(attempt, self.backoff_s, self.backoff_max_s, last_error))
            try:
                return self._post_once(body, index)
            except TransientError as error:
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
        try:
            raw = send_once(
                self._endpoint, "POST", body, self._headers, self.timeout_s, excerpt, _MAX_ANSWER_BYTES
            )
        except AnswerTooLarge as error:
            raise RewardError(
                f"vlm_ocr: POST {self.url} answered sample {index} with too much: {error}"
            ) from None
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
                f"(is it an OpenAI-compatible chat endpoint?): {excerpt(raw)}"
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
                f"vlm_ocr: {self.url} answered sample {index} with non-text content: {excerpt(raw)}"
            )
        return content


def _require(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"vlm_ocr: {field} must be {allowed}, got {value!r}")
