"""``http``: any reward served over HTTP by the reward-service protocol (docs/reward-service.md).

The images of a batch are sent as base64 PNGs, with their prompt records, in chunks of
``batch_size`` to ``POST {url}/score``; the answer is one score per image (``null`` for a
non-finite one, read back as NaN). ``boogu-reward-server`` (`boogu_trainer.reward_server`)
serves any registered reward this way, so an expensive reward can run on its own GPU or machine.

The transport is `boogu_trainer.rewards.transport` (standard library ``http.client``, shared with
`vlm_ocr`): every attempt has an overall deadline, ``timeout_s``, for connecting, sending the
request and reading the whole answer;
transient failures (connection errors, a missed deadline, HTTP 408/425/429/5xx) are retried with
exponential backoff; after the last retry, or at once for any other status (3xx, 4xx; redirects
are not followed) or a malformed answer (not JSON, the wrong protocol version, the wrong number of
scores, a score that is not a number or null, longer than `answer_limit`), a `RewardError` names
the URL, the images and what was wrong, with an excerpt of the answer.
"""

from __future__ import annotations

import base64
import dataclasses
import io
import json
import logging
import math
import os
import struct
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import numpy as np
import torch
from PIL import Image

from boogu_data import PromptRecord
from boogu_trainer.rewards.base import RewardError, check_batch, check_on_error, images_to_numpy
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

__all__ = [
    "PROTOCOL_VERSION",
    "HttpReward",
    "ImageTooLarge",
    "answer_limit",
    "check_options",
    "decode_png",
    "encode_png",
    "png_bytes",
    "png_size",
    "record_from_json",
    "record_to_json",
    "scores_from_json",
    "scores_to_json",
]

logger = logging.getLogger(__name__)

PROTOCOL_VERSION = 1
"""The reward-service protocol version this module speaks (the ``"version"`` of every message)."""

ANSWER_BASE_BYTES = 4 * 2**20
ANSWER_BYTES_PER_IMAGE = 64 * 2**10
"""An answer may have `ANSWER_BASE_BYTES` plus this per image (`answer_limit`): a score takes some
25 bytes, the rest leaves room for fields a server adds (a judge's reasons, say)."""

# PromptRecord fields holding bytes: base64 text on the wire.
_BYTES_FIELDS = frozenset({"ref_image"})

_PNG_SIGNATURE = b"\x89PNG\r\n\x1a\n"


class ImageTooLarge(ValueError):
    """An image has more pixels than allowed (a decompression bomb, or a batch too large)."""


# --- the protocol's encodings, shared with the server ---------------------------------------------


def encode_png(rgb: np.ndarray) -> str:
    """One ``(H, W, 3)`` uint8 RGB array as base64 PNG text (lossless; compression level 1)."""
    buffer = io.BytesIO()
    # Level 1: the trainer's CPU time is scarcer than bytes on the wire.
    Image.fromarray(rgb).save(buffer, format="PNG", compress_level=1)
    return base64.b64encode(buffer.getvalue()).decode("ascii")


def png_bytes(text: object) -> bytes:
    """Base64 PNG text -> the PNG's bytes, checked to start like a PNG. Raises ValueError."""
    if not isinstance(text, str):
        raise ValueError(f"an image must be base64 PNG text, got {type(text).__name__}")
    try:
        data = base64.b64decode(text, validate=True)
    except ValueError as error:
        raise ValueError(f"an image is not valid base64: {error}") from None
    if not data.startswith(_PNG_SIGNATURE):
        raise ValueError(f"an image must be a PNG, got {_format_name(data)}")
    return data


def png_size(data: bytes) -> tuple[int, int]:
    """``(width, height)`` from a PNG's IHDR chunk, the first after the signature: no pixel is read.

    The decoder allocates what IHDR declares, so this is the size to bound before decoding.
    """
    # Signature (8 bytes), then the IHDR chunk: length (4), b"IHDR", width and height (big-endian).
    if len(data) < 24 or data[12:16] != b"IHDR":
        raise ValueError("an image could not be decoded as PNG: no IHDR chunk after the signature")
    width, height = struct.unpack(">II", data[16:24])
    return width, height


def decode_png(text: str | bytes, max_pixels: int | None = None) -> np.ndarray:
    """Base64 PNG text (or `png_bytes`' bytes) -> ``(H, W, 3)`` uint8 RGB array.

    Raises ValueError saying what is wrong; `ImageTooLarge` (checked from the header, before any
    pixel is decoded) for more than ``max_pixels`` pixels, or more than PIL's own bomb limit.
    """
    data = text if isinstance(text, bytes) else png_bytes(text)
    width, height = png_size(data)
    if max_pixels is not None and width * height > max_pixels:
        raise ImageTooLarge(f"an image of {width}x{height} has more than {max_pixels} pixels")
    try:
        with Image.open(io.BytesIO(data)) as image:
            if image.format != "PNG":
                raise ValueError(f"an image must be a PNG, got {image.format or 'an unknown format'}")
            rgb = np.asarray(image.convert("RGB"), dtype=np.uint8)
    except Image.DecompressionBombError as error:
        raise ImageTooLarge(f"an image of {width}x{height} is refused by PIL: {error}") from None
    except (OSError, SyntaxError) as error:
        raise ValueError(f"an image could not be decoded as PNG: {error}") from None
    return rgb


def _format_name(data: bytes) -> str:
    """The image format PIL finds in ``data`` (header only), for an error message."""
    try:
        with Image.open(io.BytesIO(data)) as image:
            return image.format or "an unknown format"
    except Exception:  # not an image at all, or one PIL refuses to open
        return "an unknown format"


def record_to_json(record: PromptRecord, *, ref_image: bool = True) -> dict[str, Any]:
    """A record's fields as JSON values; ``ref_image`` bytes as base64 (None without ``ref_image``)."""
    out: dict[str, Any] = {}
    for field in dataclasses.fields(PromptRecord):
        value = getattr(record, field.name)
        if field.name in _BYTES_FIELDS:
            value = base64.b64encode(value).decode("ascii") if value is not None and ref_image else None
        out[field.name] = value
    return out


def record_from_json(value: object) -> PromptRecord:
    """A record from `record_to_json`'s form; unknown keys are ignored, missing ones take defaults.

    Raises ValueError (or TypeError from `PromptRecord`'s own checks) saying what is wrong.
    """
    if not isinstance(value, Mapping):
        raise ValueError(f"a record must be a JSON object, got {type(value).__name__}")
    kwargs: dict[str, Any] = {}
    for field in dataclasses.fields(PromptRecord):
        if field.name not in value:
            continue
        item = value[field.name]
        if field.name in _BYTES_FIELDS and item is not None:
            if not isinstance(item, str):
                raise ValueError(f"record.{field.name} must be base64 text or null")
            try:
                item = base64.b64decode(item, validate=True)
            except ValueError as error:
                raise ValueError(f"record.{field.name} is not valid base64: {error}") from None
        kwargs[field.name] = item
    if "instruction" not in kwargs:
        raise ValueError("a record needs an 'instruction'")
    return PromptRecord(**kwargs)


def scores_to_json(scores: torch.Tensor) -> list[float | None]:
    """``(B,)`` scores as JSON numbers; a non-finite score (NaN, ±inf) as null."""
    return [value if math.isfinite(value) else None for value in scores.to(torch.float64).tolist()]


def answer_limit(images: int) -> int:
    """The most bytes the client reads of an answer about ``images`` images (0: ``/health``)."""
    return ANSWER_BASE_BYTES + ANSWER_BYTES_PER_IMAGE * images


def scores_from_json(value: object, count: int) -> list[float]:
    """Check an answer's ``scores``: ``count`` numbers or nulls (NaN). Raises ValueError otherwise."""
    if not isinstance(value, list):
        raise ValueError(f"'scores' must be a list, got {type(value).__name__}")
    if len(value) != count:
        raise ValueError(f"got {len(value)} scores for {count} images")
    out: list[float] = []
    for i, item in enumerate(value):
        if item is None:
            out.append(math.nan)
        elif isinstance(item, int | float) and not isinstance(item, bool):
            out.append(float(item))
        else:
            raise ValueError(f"score {i} is {item!r}, not a number or null")
    return out


# --- the reward ----------------------------------------------------------------------------------


def service_root(url: object) -> str:
    """The ``url`` option, checked (`service_url`'s rule, and not an endpoint), without trailing ``/``."""
    url = service_url(url, "http reward", "url")
    if url.endswith(("/score", "/health")):
        raise ValueError(
            f"http reward: url must be the service root (e.g. http://127.0.0.1:8123), got {url!r}; "
            "'/score' is appended"
        )
    return url


_RULES: dict[str, tuple[Callable[[Any], bool], str]] = {
    "reward": (lambda value: value is None or (isinstance(value, str) and bool(value)), "a name or None"),
    "batch_size": (lambda value: is_int(value) and value >= 1, "an int >= 1"),
    "timeout_s": (lambda value: is_number(value) and value > 0, "> 0"),
    "retries": (lambda value: is_int(value) and value >= 0, "an int >= 0"),
    "backoff_s": (lambda value: is_number(value) and value >= 0, ">= 0"),
    "backoff_max_s": (lambda value: is_number(value) and value >= 0, ">= 0"),
    "on_error": (lambda value: value in ("raise", "nan"), "'raise' or 'nan'"),
    "name": (lambda value: isinstance(value, str) and bool(value), "a non-empty string"),
}


def check_options(options: Mapping[str, Any]) -> None:
    """The ``http`` reward's rules for the option values given (the others take valid defaults).

    Cheap, no environment and no network: the registry runs it when a config loads, and
    `HttpReward` when it is built. Raises ValueError naming the option.
    """
    for option, value in options.items():
        if option == "url":
            service_root(value)
        elif option in _RULES:
            ok, allowed = _RULES[option]
            _require(ok(value), option, value, allowed)


@register_reward("http", check=check_options)
class HttpReward:
    """A reward computed by a reward service (``boogu-reward-server`` or any server of the protocol).

    Measures: whatever the served reward measures; its range and cost are the served reward's,
    plus a PNG encode per image here and one request per ``batch_size`` images.

    Options: ``url`` is the service root (``http://127.0.0.1:8123``); requests go to
    ``{url}/score``. ``reward``, when set, is the name the service must serve (it answers 400
    otherwise), so a config cannot silently score with the wrong server. ``batch_size`` images
    go in one request, one request at a time. ``timeout_s`` is the deadline of one attempt:
    connecting, sending the request and reading the whole answer must end within it. ``retries``
    more attempts follow a transient failure, attempt k > 0 waiting
    ``min(max(backoff_s * 2**(k-1), Retry-After), backoff_max_s)`` first (the server's
    ``Retry-After``, when a retryable answer gave one). ``api_key_env`` names an environment
    variable holding a bearer token. Proxies from the environment (http:// proxies only) are
    ignored unless ``use_proxy_env``. ``send_ref_images=False`` leaves the records' reference
    images out of the requests. ``on_error="nan"`` scores the images of a request that still fails
    NaN (with a warning) instead of raising. ``name`` is the key the scores are logged under.
    """

    def __init__(
        self,
        *,
        url: str,
        reward: str | None = None,
        batch_size: int = 16,
        timeout_s: float = 60.0,
        retries: int = 3,
        backoff_s: float = 0.5,
        backoff_max_s: float = 10.0,
        api_key_env: str | None = None,
        use_proxy_env: bool = False,
        send_ref_images: bool = True,
        on_error: str = "raise",
        name: str = "http",
    ) -> None:
        check_options(
            {
                "reward": reward,
                "batch_size": batch_size,
                "timeout_s": timeout_s,
                "retries": retries,
                "backoff_s": backoff_s,
                "backoff_max_s": backoff_max_s,
                "name": name,
            }
        )
        self.name = name
        self.url = service_root(url)
        self.score_url = f"{self.url}/score"
        self.reward = reward
        self.batch_size = batch_size
        self.timeout_s = float(timeout_s)
        self.retries = retries
        self.backoff_s = float(backoff_s)
        self.backoff_max_s = float(backoff_max_s)
        self.send_ref_images = bool(send_ref_images)
        self.on_error = check_on_error(on_error, name)
        self._headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if api_key_env is not None:
            key = os.environ.get(api_key_env, "")
            if not key:
                raise ValueError(f"http reward: api_key_env names {api_key_env!r}, which is unset or empty")
            self._headers["Authorization"] = f"Bearer {key}"
        self._endpoints = {
            path: resolve_endpoint(f"{self.url}{path}", use_proxy_env, "http")
            for path in ("/score", "/health")
        }
        self._headers.update(self._endpoints["/score"].proxy_headers)

    def __call__(self, images: torch.Tensor, records: Sequence[PromptRecord]) -> torch.Tensor:
        batch_size = check_batch(images, records, self.name)
        arrays = images_to_numpy(images)
        scores: list[float] = []
        for start in range(0, batch_size, self.batch_size):
            stop = min(start + self.batch_size, batch_size)
            try:
                scores.extend(self._score_chunk(arrays[start:stop], records[start:stop], start))
            except RewardError as error:
                if self.on_error == "raise":
                    raise
                logger.warning("%s (images %d-%d scored NaN)", error, start, stop - 1)
                scores.extend([math.nan] * (stop - start))
        return torch.tensor(scores, dtype=torch.float32)

    def request_body(self, rgb: np.ndarray, records: Sequence[PromptRecord]) -> dict[str, Any]:
        """The ``POST /score`` request for ``(n, H, W, 3)`` uint8 RGB images and their n records."""
        body: dict[str, Any] = {
            "version": PROTOCOL_VERSION,
            "images": [encode_png(image) for image in rgb],
            "records": [record_to_json(record, ref_image=self.send_ref_images) for record in records],
        }
        if self.reward is not None:
            body["reward"] = self.reward
        return body

    def health(self) -> dict[str, Any]:
        """The service's ``GET /health`` answer (its reward's name and options), with the retries."""
        payload = self._exchange("GET", "/health", None, "the health check", answer_limit(0))
        if not isinstance(payload, dict):
            raise RewardError(f"http reward: GET {self.url}/health answered {payload!r}, not a JSON object")
        return payload

    def _score_chunk(self, rgb: np.ndarray, records: Sequence[PromptRecord], start: int) -> list[float]:
        what = f"images {start}-{start + len(rgb) - 1}"
        body = json.dumps(self.request_body(rgb, records)).encode("utf-8")
        payload, raw = self._exchange("POST", "/score", body, what, answer_limit(len(rgb)), with_raw=True)
        try:
            if not isinstance(payload, dict) or "scores" not in payload:
                raise ValueError("the answer is not a JSON object with 'scores'")
            return scores_from_json(payload["scores"], len(rgb))
        except ValueError as error:
            raise RewardError(
                f"http reward: POST {self.score_url} answered {what} with a malformed answer: {error}: "
                f"{excerpt(raw)}"
            ) from None

    def _exchange(
        self, method: str, path: str, body: bytes | None, what: str, limit: int, *, with_raw: bool = False
    ) -> Any:
        """One request with the retries: the parsed JSON answer (and the raw bytes, ``with_raw``).

        An answer longer than ``limit`` bytes is a `RewardError` at once."""
        attempts = self.retries + 1
        last_error: TransientError | None = None
        for attempt in range(attempts):
            if attempt:
                time.sleep(retry_delay(attempt, self.backoff_s, self.backoff_max_s, last_error))
            try:
                raw = self._attempt(method, path, body, what, limit)
            except TransientError as error:
                last_error = error
                logger.info("http reward: %s %s%s, attempt %d/%d failed: %s", method, self.url, path,
                            attempt + 1, attempts, error)  # fmt: skip
                continue
            payload = self._parse(raw, method, path, what)
            return (payload, raw) if with_raw else payload
        raise RewardError(
            f"http reward: {method} {self.url}{path} failed for {what} after {attempts} attempt(s) "
            f"(deadline {self.timeout_s:g} s each, for connecting, sending and the whole answer); "
            f"last error: {last_error}"
        )

    def _attempt(self, method: str, path: str, body: bytes | None, what: str, limit: int) -> bytes:
        endpoint = self._endpoints[path]
        try:
            raw = send_once(endpoint, method, body, self._headers, self.timeout_s, _server_message, limit)
        except AnswerTooLarge as error:
            raise RewardError(
                f"http reward: {method} {self.url}{path} answered {what} with too much: {error} "
                "(is it a reward service?)"
            ) from None
        if isinstance(raw, str):  # a 3xx/4xx refusal, described
            raise RewardError(f"http reward: {method} {self.url}{path} was rejected for {what}: {raw}")
        return raw

    def _parse(self, raw: bytes, method: str, path: str, what: str) -> Any:
        try:
            payload = json.loads(raw)
        except ValueError:
            raise RewardError(
                f"http reward: {method} {self.url}{path} answered {what} with something that is not "
                f"JSON (is it a reward service?): {excerpt(raw)}"
            ) from None
        version = payload.get("version") if isinstance(payload, dict) else None
        if version != PROTOCOL_VERSION:
            raise RewardError(
                f"http reward: {method} {self.url}{path} answered {what} with protocol version "
                f"{version!r}; this client speaks version {PROTOCOL_VERSION}: {excerpt(raw)}"
            )
        return payload

    def __repr__(self) -> str:
        return f"HttpReward(url={self.url!r}, reward={self.reward!r})"


def _server_message(raw: bytes) -> str:
    """The ``error.message`` of a protocol error answer, else an excerpt of the body."""
    try:
        payload = json.loads(raw)
        message = payload["error"]["message"]
    except (ValueError, KeyError, TypeError):
        return excerpt(raw)
    return excerpt(str(message).encode("utf-8"), limit=1000)


def _require(ok: bool, field: str, value: object, allowed: str) -> None:
    if not ok:
        raise ValueError(f"http reward: {field} must be {allowed}, got {value!r}")
