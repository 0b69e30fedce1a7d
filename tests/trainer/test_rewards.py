"""Rewards: the OCR score formula, local and VLM OCR, JPEG, demo rewards, registry and weighted sums."""

from __future__ import annotations

import base64
import inspect
import io
import json
import logging
import math
import socket
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from functools import cache
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import assume, example, given
from hypothesis import strategies as st
from PIL import Image, ImageDraw, ImageFont

from boogu_data import PromptRecord
from boogu_trainer.rewards import (
    OcrReward,
    RewardError,
    RewardFn,
    RewardOutput,
    TranscriptionReward,
    VlmOcrReward,
    WeightedRewards,
    available_rewards,
    build_reward,
    build_rewards,
    fold_text,
    levenshtein,
    ocr_engine,
    ocr_text_score,
    register_reward,
    validate_reward_spec,
)
from boogu_trainer.rewards import registry as registry_module

# ---------------------------------------------------------------------------------------------
# helpers


def as_batch(*arrays: np.ndarray) -> torch.Tensor:
    """``(H, W, 3)`` uint8 arrays -> ``(B, 3, H, W)`` uint8 tensor."""
    return torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).contiguous()


def flat(value: int | tuple[int, int, int], size: int = 16) -> np.ndarray:
    return np.broadcast_to(np.array(value, dtype=np.uint8), (size, size, 3)).copy()


def rendered(text: str, size: tuple[int, int] = (256, 64), font_size: int = 32) -> np.ndarray:
    """Black text on white, drawn with Pillow's bundled scalable font (no system font needed)."""
    image = Image.new("RGB", size, "white")
    ImageDraw.Draw(image).text(
        (8, (size[1] - font_size) // 2), text, fill="black", font=ImageFont.load_default(font_size)
    )
    return np.asarray(image).copy()


def records(*ground_truths: str) -> list[PromptRecord]:
    return [PromptRecord(instruction=f'a sign that says "{gt}"', ground_truth=gt) for gt in ground_truths]


# ---------------------------------------------------------------------------------------------
# the OCR text score, against an independent reference written here


@cache
def reference_levenshtein(a: str, b: str) -> int:
    """Textbook recursive edit distance (only for the short strings hypothesis draws)."""
    if not a or not b:
        return len(a) + len(b)
    return min(
        reference_levenshtein(a[1:], b) + 1,
        reference_levenshtein(a, b[1:]) + 1,
        reference_levenshtein(a[1:], b[1:]) + (a[0] != b[0]),
    )


def reference_score(transcription: str, ground_truth: str) -> float:
    """verl-omni's compute_score_ocr formula, restated: fold, containment, clamp, normalise."""
    gt = "".join(ch for ch in ground_truth if not ch.isspace()).lower()
    text = "".join(ch for ch in transcription if not ch.isspace()).lower()
    distance = 0 if gt in text else reference_levenshtein(text, gt)
    distance = min(distance, len(gt))
    if gt:
        return 1 - distance / len(gt)
    return 1.0 if not text else 0.0


short_text = st.text(alphabet="abcAB \t\n", max_size=8)
ascii_text = st.text(alphabet="abcxyzABCXYZ019", max_size=10)


@given(short_text, short_text)
@example("", "")
@example("kitten", "sitting")
def test_levenshtein_matches_reference(a: str, b: str) -> None:
    assert levenshtein(a, b) == reference_levenshtein(a, b)
    assert levenshtein(a, b) == levenshtein(b, a)


@given(short_text, short_text, st.integers(0, 9))
@example("a" * 20, "b", 3)
@example("Aaa A", "AAAABBaa", 5)  # no row exceeds the cap, but the final distance does
def test_levenshtein_cap_only_saturates(a: str, b: str, cap: int) -> None:
    # Below the cap the exact distance; above it exactly cap + 1.
    assert levenshtein(a, b, max_distance=cap) == min(reference_levenshtein(a, b), cap + 1)


def test_levenshtein_rejects_negative_cap() -> None:
    with pytest.raises(ValueError, match="max_distance"):
        levenshtein("a", "b", max_distance=-1)


@given(short_text, short_text)
@example("", "")
@example("", "abc")
@example("abc", "")
@example("x" * 50, "ab")
@example("HELLO  world!!!", "hello world")
def test_ocr_text_score_matches_reference_formula(transcription: str, ground_truth: str) -> None:
    score = ocr_text_score(transcription, ground_truth)
    assert score == pytest.approx(reference_score(transcription, ground_truth), abs=1e-12)
    assert 0.0 <= score <= 1.0


@given(st.text(max_size=12))
def test_ocr_text_score_identical_is_one(text: str) -> None:
    assert ocr_text_score(text, text) == 1.0


@given(st.text(max_size=6), st.text(min_size=1, max_size=8), st.text(max_size=6))
def test_ocr_text_score_containment_is_one(before: str, truth: str, after: str) -> None:
    # Folding can break containment in two rare ways the reference shares: a whitespace-only truth
    # folds to "" (then only an empty transcription scores 1), and str.lower() is context-sensitive
    # (a final Greek sigma lower-cases differently at the end of a word).
    assume(fold_text(truth) and fold_text(truth) in fold_text(before + truth + after))
    assert ocr_text_score(before + truth + after, truth) == 1.0


@given(
    st.text(min_size=1, max_size=10).filter(lambda s: fold_text(s) != ""),
    st.text(alphabet=" \t\n", max_size=3),
)
def test_ocr_text_score_empty_recognition_is_zero(truth: str, blank: str) -> None:
    assert ocr_text_score(blank, truth) == 0.0


@given(
    ascii_text, ascii_text, st.lists(st.integers(0, 10), max_size=4), st.sampled_from([" ", "\t", "\n", "  "])
)
def test_ocr_text_score_is_case_and_whitespace_invariant(
    transcription: str, truth: str, cuts: list[int], space: str
) -> None:
    spaced = transcription
    for cut in sorted(cuts, reverse=True):
        spaced = spaced[:cut] + space + spaced[cut:]
    expected = ocr_text_score(transcription, truth)
    assert ocr_text_score(spaced.upper(), truth.lower()) == expected
    assert ocr_text_score(transcription.swapcase(), space + truth.upper() + space) == expected


@pytest.mark.parametrize(
    ("transcription", "truth", "expected"),
    [
        ("Helo World", "Hello World", 0.9),  # one deletion over 10 folded characters
        ("Open 24 hours, OPEN!", "open", 1.0),  # contained
        ("xyz", "ab", 0.0),  # distance 3 clamped to len("ab")
        ("a very long hallucinated answer" * 20, "Sale", 0.0),
        ("Sal", "Sale", 0.75),
    ],
)
def test_ocr_text_score_values(transcription: str, truth: str, expected: float) -> None:
    assert ocr_text_score(transcription, truth) == pytest.approx(expected)


# ---------------------------------------------------------------------------------------------
# local OCR on real rendered text


def test_ocr_reads_rendered_text_and_scores_blank_zero() -> None:
    reward = build_reward("ocr")
    images = as_batch(rendered("Hello World"), rendered(""), rendered("Hello World"))
    scores = reward(images, records("Hello World", "Hello World", "Goodbye Moon"))
    assert scores.dtype == torch.float32 and scores.shape == (3,)
    assert scores[0] > 0.8, f"the image shows the ground truth: {scores}"
    assert scores[1] == 0.0, "no text found scores 0"
    assert scores[2] < 0.5, "text that is not the ground truth scores low"


def test_ocr_engine_is_created_once_and_shared() -> None:
    assert ocr_engine() is ocr_engine()
    assert ocr_engine(min_confidence=0.3) is not ocr_engine()
    with pytest.raises(ValueError, match="det_limit_side_len"):
        build_reward("ocr", det_limit_side_len=8)


# ---------------------------------------------------------------------------------------------
# VLM OCR against a local OpenAI-compatible stub (loopback only)


@dataclass
class StubState:
    fail_first: int = 0
    """Answer HTTP 503 to this many requests first."""
    status: int | None = None
    """Answer every request with this HTTP error status."""
    hang_s: float = 0.0
    """Wait this long (or until teardown) before answering."""
    raw_body: bytes | None = None
    """Answer 200 with these bytes instead of a chat completion."""
    trickle_s: float = 0.0
    """Send the answer one byte every this many seconds (until teardown)."""
    trickle_from: str = "status line"
    """With ``trickle_s``: "status line" trickles all of it, "body" sends the headers at once."""
    answer: Callable[[np.ndarray], str] = lambda image: "Hello World"
    requests: list[dict] = field(default_factory=list)
    paths: list[str] = field(default_factory=list)
    headers: list[dict] = field(default_factory=list)
    in_flight: int = 0
    max_in_flight: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock)
    release: threading.Event = field(default_factory=threading.Event)


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        pass  # a client that timed out closes its socket; the late write fails, as intended


def _handler(state: StubState) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with state.lock:
                state.requests.append(body)
                state.paths.append(self.path)
                state.headers.append(dict(self.headers))
                number = len(state.requests)
                state.in_flight += 1
                state.max_in_flight = max(state.max_in_flight, state.in_flight)
            try:
                if state.hang_s:
                    state.release.wait(state.hang_s)
                if state.status is not None:
                    self._send(state.status, b'{"error": "bad request: unknown model"}')
                elif number <= state.fail_first:
                    self._send(503, b"overloaded")
                elif state.raw_body is not None:
                    self._send(200, state.raw_body)
                else:
                    url = body["messages"][1]["content"][0]["image_url"]["url"]
                    png = base64.b64decode(url.removeprefix("data:image/png;base64,"))
                    image = np.asarray(Image.open(io.BytesIO(png)).convert("RGB"))
                    time.sleep(0.1)  # long enough for concurrent requests to overlap
                    answer = {
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": state.answer(image)}}
                        ]
                    }
                    self._send(200, json.dumps(answer).encode())
            finally:
                with state.lock:
                    state.in_flight -= 1

        def _send(self, status: int, payload: bytes) -> None:
            if state.trickle_s:
                self._trickle(status, payload)
                return
            self.send_response(status)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

        def _trickle(self, status: int, payload: bytes) -> None:
            head = f"HTTP/1.0 {status} OK\r\nContent-Type: application/json\r\n"
            head += f"Content-Length: {len(payload)}\r\n\r\n"
            rest = head.encode() + payload
            if state.trickle_from == "body":
                self.wfile.write(head.encode())
                rest = payload
            for i in range(len(rest)):
                self.wfile.write(rest[i : i + 1])
                if state.release.wait(state.trickle_s):
                    return  # teardown

    return Handler


@pytest.fixture
def stub() -> Iterator[tuple[StubState, str]]:
    """An OpenAI-compatible chat endpoint on 127.0.0.1 (ephemeral port): (state, base_url)."""
    state = StubState()
    server = _Server(("127.0.0.1", 0), _handler(state))
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield state, f"http://127.0.0.1:{server.server_address[1]}/v1"
    finally:
        state.release.set()
        server.shutdown()
        server.server_close()


def _vlm(base_url: str, **kwargs) -> VlmOcrReward:
    options = {"timeout_s": 5.0, "max_retries": 2, "backoff_s": 0.01} | kwargs
    return build_reward("vlm_ocr", base_url=base_url, **options)  # type: ignore[return-value]


def test_vlm_ocr_scores_answers_in_order_with_concurrency(stub, monkeypatch) -> None:
    state, base_url = stub
    # The stub reads each image back and answers by its grey level, so a mixed-up order shows.
    answers = {0: "hello world", 60: "HELLO W0rld", 120: "nothing here", 180: ""}
    state.answer = lambda image: answers[int(image[0, 0, 0])]
    monkeypatch.setenv("TEST_VLM_KEY", "sk-test")
    reward = _vlm(
        base_url, concurrency=4, model="my-vlm", temperature=0.0, seed=7, api_key_env="TEST_VLM_KEY"
    )
    images = as_batch(*(flat(v) for v in answers))
    scores = reward(images, records(*["Hello World"] * 4))
    expected = torch.tensor([1.0, 0.9, ocr_text_score("nothing here", "Hello World"), 0.0])
    torch.testing.assert_close(scores, expected, rtol=0, atol=1e-6)
    assert state.max_in_flight > 1, "images are scored concurrently"
    assert state.paths == ["/v1/chat/completions"] * 4
    request = state.requests[0]
    assert request["model"] == "my-vlm"
    assert (request["temperature"], request["top_p"], request["max_tokens"], request["seed"]) == (
        0.0,
        0.8,
        4096,
        7,
    )
    system, user = request["messages"]
    assert system == {"role": "system", "content": "You are a helpful assistant."}
    assert user["content"][1]["text"].startswith("Please output only the text content from the image")
    assert all(h["Authorization"] == "Bearer sk-test" for h in state.headers)


def test_vlm_ocr_retries_transient_failures(stub) -> None:
    state, base_url = stub
    state.fail_first = 2
    scores = _vlm(base_url, max_retries=2)(as_batch(flat(0)), records("hello world"))
    assert scores.tolist() == [1.0]
    assert len(state.requests) == 3, "two 503s, then success"


def test_vlm_ocr_fails_clearly_after_retries(stub) -> None:
    state, base_url = stub
    state.fail_first = 100
    with pytest.raises(RewardError) as info:
        _vlm(base_url, max_retries=2)(as_batch(flat(0)), records("x"))
    message = str(info.value)
    assert f"{base_url}/chat/completions" in message and "3 attempt" in message and "503" in message
    assert len(state.requests) == 3


def test_vlm_ocr_times_out_on_a_hung_server(stub) -> None:
    state, base_url = stub
    state.hang_s = 10.0
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"no answer within 0\.2 s"):
        _vlm(base_url, timeout_s=0.2, max_retries=1)(as_batch(flat(0)), records("x"))
    assert time.monotonic() - start < 5.0
    assert len(state.requests) == 2


@pytest.mark.parametrize("trickle_from", ["status line", "body"])
def test_vlm_ocr_deadline_covers_the_whole_answer(stub, trickle_from: str) -> None:
    # One byte every 1.5 s never trips a 2-s per-read socket timeout: only a deadline over the
    # whole exchange ends the request. Two attempts of 2 s each, then RewardError.
    state, base_url = stub
    state.trickle_s, state.trickle_from = 1.5, trickle_from
    reward = _vlm(base_url, timeout_s=2, max_retries=1, backoff_s=0)
    outcome: list[BaseException | None] = []

    def call() -> None:
        try:
            reward(as_batch(flat(0)), records("hello world"))
            outcome.append(None)
        except BaseException as error:
            outcome.append(error)

    start = time.monotonic()
    # A daemon thread bounds the test: without a deadline the call would outlive it by minutes
    # (the fixture's teardown then ends the trickle, and with it the stray call).
    thread = threading.Thread(target=call, daemon=True)
    thread.start()
    thread.join(timeout=10.0)
    elapsed = time.monotonic() - start
    assert not thread.is_alive(), "vlm_ocr was still reading a trickling answer after 10 s"
    (error,) = outcome
    assert isinstance(error, RewardError), f"expected RewardError, got {error!r}"
    message = str(error)
    assert f"{base_url}/chat/completions" in message and "sample 0" in message
    assert "after 2 attempt" in message and "deadline 2 s" in message and "no answer within 2 s" in message
    assert len(state.requests) == 2, "the missed deadline is transient: retried once"
    assert 2 * 2.0 <= elapsed < 10.0, f"each attempt lasts its whole deadline, no more: {elapsed:.2f} s"


def test_vlm_ocr_proxies_only_with_use_proxy_env(stub, monkeypatch) -> None:
    state, base_url = stub
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        dead_port = sock.getsockname()[1]
    for variable in ("no_proxy", "NO_PROXY", "HTTP_PROXY"):
        monkeypatch.delenv(variable, raising=False)
    # By default an inherited proxy is ignored: the endpoint is reached directly.
    monkeypatch.setenv("http_proxy", f"http://127.0.0.1:{dead_port}")
    assert _vlm(base_url)(as_batch(flat(0)), records("hello world")).tolist() == [1.0]
    assert state.paths == ["/v1/chat/completions"]
    # With use_proxy_env the stub is the proxy: it gets the absolute URL and the credentials.
    monkeypatch.setenv("http_proxy", base_url.replace("http://", "http://user:s%3Acret@").removesuffix("/v1"))
    reward = _vlm("http://vlm.invalid:8000/v1", use_proxy_env=True)
    assert reward(as_batch(flat(0)), records("hello world")).tolist() == [1.0]
    assert state.paths[1] == "http://vlm.invalid:8000/v1/chat/completions"
    assert state.headers[1]["Host"] == "vlm.invalid:8000"
    token = base64.b64encode(b"user:s:cret").decode()
    assert state.headers[1]["Proxy-Authorization"] == f"Basic {token}"
    monkeypatch.setenv("http_proxy", "socks5://127.0.0.1:1080")
    with pytest.raises(ValueError, match=r"^vlm_ocr: the http_proxy.*http:// proxy.*socks5"):
        _vlm("http://vlm.invalid:8000/v1", use_proxy_env=True)
    # The transport is shared: the http reward's error names the http reward.
    from boogu_trainer.rewards.http import HttpReward

    with pytest.raises(ValueError, match=r"^http: the http_proxy.*http:// proxy.*socks5"):
        HttpReward(url="http://reward.invalid:8000", use_proxy_env=True)


def test_vlm_ocr_does_not_retry_a_rejected_request(stub) -> None:
    state, base_url = stub
    state.status = 400
    with pytest.raises(RewardError, match=r"rejected.*HTTP 400.*unknown model"):
        _vlm(base_url)(as_batch(flat(0)), records("x"))
    assert len(state.requests) == 1


def test_vlm_ocr_reports_a_malformed_answer(stub) -> None:
    state, base_url = stub
    state.raw_body = b'{"result": "not a chat completion"}'
    with pytest.raises(RewardError, match=r"choices\[0\]\.message\.content.*not a chat completion"):
        _vlm(base_url)(as_batch(flat(0)), records("x"))


def test_vlm_ocr_on_error_nan_reports_the_sample(stub, caplog) -> None:
    state, base_url = stub
    state.status = 503
    with caplog.at_level(logging.WARNING, logger="boogu_trainer.rewards"):
        scores = _vlm(base_url, max_retries=1, on_error="nan")(as_batch(flat(0), flat(1)), records("x", "y"))
    assert torch.isnan(scores).all()
    assert "scored NaN" in caplog.text and base_url in caplog.text


def test_vlm_ocr_connection_refused() -> None:
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with pytest.raises(RewardError, match=r"after 2 attempt.*Connection ?Refused"):
        _vlm(f"http://127.0.0.1:{port}/v1", max_retries=1)(as_batch(flat(0)), records("x"))


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"base_url": "127.0.0.1:8000/v1"}, "http://"),
        ({"base_url": "http://127.0.0.1:8000/v1/chat/completions"}, "API root"),
        ({"base_url": "http://127.0.0.1:1/v1", "timeout_s": 0}, "timeout_s"),
        ({"base_url": "http://127.0.0.1:1/v1", "max_retries": -1}, "max_retries"),
        (
            {"base_url": "http://127.0.0.1:1/v1", "api_key_env": "BOOGU_TEST_UNSET_KEY"},
            "BOOGU_TEST_UNSET_KEY",
        ),
        ({}, "base_url"),
    ],
)
def test_vlm_ocr_rejects_bad_options(options: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_reward("vlm_ocr", **options)


# ---------------------------------------------------------------------------------------------
# JPEG and demo rewards


def test_jpeg_rewards_are_the_jpeg_size_in_kb() -> None:
    noise = np.random.default_rng(0).integers(0, 256, (64, 64, 3), dtype=np.uint8)
    images = as_batch(noise, flat(128, 64))
    sizes = build_reward("jpeg_incompressibility")(images, records("", ""))
    for score, array in zip(sizes.tolist(), (noise, flat(128, 64))):
        buffer = io.BytesIO()
        Image.fromarray(array).save(buffer, format="JPEG", quality=95)
        assert score == pytest.approx(len(buffer.getvalue()) / 1000, rel=1e-6)
    assert sizes[0] > 3 * sizes[1], "noise compresses worse than a flat image"
    torch.testing.assert_close(build_reward("jpeg_compressibility")(images, records("", "")), -sizes)
    with pytest.raises(ValueError, match="quality"):
        build_reward("jpeg_compressibility", quality=0)


@given(st.lists(st.integers(0, 255), min_size=3, max_size=3), st.integers(1, 3), st.integers(0, 2**31 - 1))
def test_demo_rewards_match_their_formulas(target: list[int], batch: int, seed: int) -> None:
    images = torch.from_numpy(np.random.default_rng(seed).integers(0, 256, (batch, 3, 5, 4), dtype=np.uint8))
    brightness = build_reward("demo_brightness")(images, records(*[""] * batch))
    closeness = build_reward("demo_target_color", target=target)(images, records(*[""] * batch))
    pixels = images.numpy().astype(np.float64)
    mean_rgb = pixels.mean(axis=(2, 3))
    expected = 1 - np.linalg.norm(mean_rgb - np.array(target, dtype=np.float64), axis=1) / (
        255 * math.sqrt(3)
    )
    np.testing.assert_allclose(brightness.numpy(), pixels.mean(axis=(1, 2, 3)) / 255, atol=1e-6)
    np.testing.assert_allclose(closeness.numpy(), expected, atol=1e-6)
    assert brightness.dtype == closeness.dtype == torch.float32
    for scores in (brightness, closeness):
        assert ((scores >= 0) & (scores <= 1)).all()


def test_demo_reward_extremes() -> None:
    images = as_batch(flat(0), flat(255), flat((255, 128, 0)))
    assert build_reward("demo_brightness")(images, records("", "", "")).tolist()[:2] == [0.0, 1.0]
    closeness = build_reward("demo_target_color", target=(255, 255, 255))(images, records("", "", ""))
    assert closeness[0] == pytest.approx(0.0, abs=1e-6) and closeness[1] == 1.0
    assert build_reward("demo_target_color")(images, records("", "", ""))[2] == 1.0, (
        "default target is (255, 128, 0)"
    )
    with pytest.raises(ValueError, match="target"):
        build_reward("demo_target_color", target=(300, 0, 0))


@pytest.mark.parametrize(
    ("images", "match"),
    [
        (torch.zeros(2, 3, 8, 8), "uint8"),
        (torch.zeros(2, 4, 8, 8, dtype=torch.uint8), r"\(B, 3, H, W\)"),
        (torch.zeros(3, 3, 8, 8, dtype=torch.uint8), "3 images but 2 records"),
        (np.zeros((2, 3, 8, 8), dtype=np.uint8), "torch.Tensor"),
    ],
)
def test_rewards_reject_bad_inputs(images: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_reward("demo_brightness")(images, records("", ""))  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------------------
# registry, user rewards and weighted sums

USER_MODULE = textwrap.dedent(
    """
    import torch

    def constant(images, records, value=0.5):
        return [value] * images.shape[0]

    def nan_at_one(images, records):
        scores = torch.ones(images.shape[0])
        scores[1] = float("nan")
        return scores

    def inf_at_zero(images, records):
        scores = torch.zeros(images.shape[0], dtype=torch.float64)
        scores[0] = float("inf")
        return scores

    def wrong_shape(images, records):
        return torch.ones(images.shape[0], 1)

    def broken(images, records):
        raise KeyError("no such field")

    class Scaled:
        def __init__(self, scale=1.0):
            self.scale = scale

        def __call__(self, images, records):
            return torch.full((images.shape[0],), self.scale)

    BUILT = []

    class Recorded(Scaled):
        def __init__(self, scale=1.0):
            BUILT.append(scale)
            super().__init__(scale)

    NOT_CALLABLE = 3
    """
)


@pytest.fixture(scope="module")
def user_module(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    folder = tmp_path_factory.mktemp("user_rewards")
    (folder / "boogu_test_user_rewards.py").write_text(USER_MODULE)
    sys.path.insert(0, str(folder))
    try:
        yield "boogu_test_user_rewards"
    finally:
        sys.path.remove(str(folder))
        sys.modules.pop("boogu_test_user_rewards", None)


def test_registry_lists_and_builds_builtins() -> None:
    assert set(available_rewards()) >= {
        "ocr",
        "vlm_ocr",
        "jpeg_compressibility",
        "jpeg_incompressibility",
        "demo_brightness",
        "demo_target_color",
    }
    built = 0
    for name in available_rewards():
        required = [
            p.name
            for p in inspect.signature(registry_module._REGISTRY[name]).parameters.values()
            if p.default is inspect.Parameter.empty and p.kind is not inspect.Parameter.VAR_KEYWORD
        ]
        if required or name == "edit_preservation":  # vlm_ocr's base_url, http's url, a model folder
            continue
        reward = build_reward(name)
        assert isinstance(reward, RewardFn) and reward.name == name
        built += 1
    assert built >= 6


def test_unknown_reward_lists_available_names() -> None:
    with pytest.raises(
        ValueError, match=r"unknown reward 'ocrr'; available: .*jpeg_compressibility.*ocr.*vlm_ocr"
    ):
        build_reward("ocrr")
    with pytest.raises(ValueError, match="min_confidance"):
        build_reward("ocr", min_confidance=0.3)


def test_register_reward(monkeypatch) -> None:
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))

    @register_reward("test_half")
    class Half:
        name = "test_half"

        def __call__(self, images, records):
            return torch.full((images.shape[0],), 0.5)

    assert register_reward("test_half")(Half) is Half, "re-registering the same factory is harmless"
    assert build_reward("test_half")(as_batch(flat(0)), records("")).tolist() == [0.5]
    with pytest.raises(ValueError, match="already registered"):
        register_reward("test_half")(lambda: Half())
    with pytest.raises(ValueError, match="':'"):
        register_reward("pkg:thing")


def test_user_reward_by_import_path(user_module: str) -> None:
    images, recs = as_batch(flat(0), flat(9)), records("", "")
    function = build_reward(f"{user_module}:constant", value=0.25)
    assert isinstance(function, RewardFn) and function.name == f"{user_module}:constant"
    assert function(images, recs).tolist() == [0.25, 0.25], "a function gets its kwargs on every call"
    scaled = build_reward(f"{user_module}:Scaled", scale=3.0)
    assert scaled(images, recs).tolist() == [3.0, 3.0], "a class is instantiated with its kwargs"
    with pytest.raises(RewardError, match=r"wrong_shape.*shape \(2, 1\).*expected \(2,\)"):
        build_reward(f"{user_module}:wrong_shape")(images, recs)
    with pytest.raises(RewardError, match=r"broken.*KeyError"):
        build_reward(f"{user_module}:broken")(images, recs)


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("boogu_no_such_module:fn", {}, "cannot import module"),
        ("{m}:missing", {}, "has no attribute 'missing'"),
        ("{m}:NOT_CALLABLE", {}, "not a function or class"),
        ("{m}:constant", {"valeu": 1}, "valeu"),
        ("{m}:Scaled", {"sclae": 1}, "sclae"),
        ("{m}:", {}, "package.module:function"),
    ],
)
def test_user_reward_errors(user_module: str, name: str, kwargs: dict, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_reward(name.format(m=user_module), **kwargs)


@dataclass(frozen=True)
class ConfigEntry:
    """Stands in for the trainer config's typed reward entry (config.RewardSpec): the same fields."""

    name: str
    weight: float = 1.0
    label: str = ""
    kwargs: dict = field(default_factory=dict)


def test_build_rewards_weighted_sum(user_module: str) -> None:
    rewards = build_rewards(
        [
            ConfigEntry("demo_brightness", 2.0),
            {"name": f"{user_module}:constant", "weight": -1, "kwargs": {"value": 0.25}, "label": "penalty"},
            {"name": "demo_brightness", "weight": 0, "label": "brightness_metric"},
        ]
    )
    assert isinstance(rewards, WeightedRewards)
    assert rewards.labels == ("demo_brightness", "penalty", "brightness_metric")
    output = rewards(as_batch(flat(0), flat(51), flat(255)), records("", "", ""))
    assert isinstance(output, RewardOutput)
    brightness = torch.tensor([0.0, 0.2, 1.0])
    torch.testing.assert_close(output.per_reward["demo_brightness"], brightness)
    torch.testing.assert_close(output.total, 2 * brightness - 0.25)
    assert output.total.dtype == torch.float32 and output.finite.all() and output.num_nonfinite == 0
    assert output.stacked().shape == (3, 3)
    assert rewards.weights == {"demo_brightness": 2.0, "penalty": -1.0, "brightness_metric": 0.0}


def test_build_rewards_from_config_records() -> None:
    # The same reward twice with distinct labels; an empty label means the name.
    black, white = (0, 0, 0), (255, 255, 255)
    rewards = build_rewards(
        (
            ConfigEntry("demo_target_color", 1.0, "", {"target": black}),
            ConfigEntry("demo_target_color", 0.5, "whiteness", {"target": white}),
            SimpleNamespace(name="demo_brightness", weight=0.0, label="", kwargs={}),
        )
    )
    assert rewards.labels == ("demo_target_color", "whiteness", "demo_brightness")
    assert rewards.weights == {"demo_target_color": 1.0, "whiteness": 0.5, "demo_brightness": 0.0}
    output = rewards(as_batch(flat(0), flat(255)), records("", ""))
    torch.testing.assert_close(output.per_reward["demo_target_color"], torch.tensor([1.0, 0.0]))
    torch.testing.assert_close(output.per_reward["whiteness"], torch.tensor([0.0, 1.0]))
    torch.testing.assert_close(output.total, torch.tensor([1.0, 0.5]))


def test_build_rewards_from_the_trainer_configs_own_records() -> None:
    from boogu_trainer.config import RewardSpec, load_config

    config = load_config(
        None,
        [
            "reward.rewards=[{name: demo_target_color, kwargs: {target: [0, 0, 0]}},"
            " {name: demo_target_color, weight: 0.5, label: whiteness, kwargs: {target: [255, 255, 255]}}]"
        ],
    )
    assert all(isinstance(spec, RewardSpec) for spec in config.reward.rewards)
    rewards = build_rewards(config.reward.rewards)
    assert rewards.labels == ("demo_target_color", "whiteness")
    output = rewards(as_batch(flat(0), flat(255)), records("", ""))
    torch.testing.assert_close(output.total, torch.tensor([1.0, 0.5]))


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([ConfigEntry("demo_brightness"), ConfigEntry("demo_brightness")], "'demo_brightness' is used twice"),
        (
            [ConfigEntry("demo_brightness", label="b"), ConfigEntry("demo_sky", label="b")],
            "'b' is used twice",
        ),
        (
            [ConfigEntry("demo_brightness", label="demo_sky"), ConfigEntry("demo_sky")],
            "'demo_sky' is used twice",
        ),
        (
            [ConfigEntry("demo_brightness", kwargs={"gamma": 2})],
            r"rewards\[0\]: reward 'demo_brightness'.*gamma",
        ),
        (
            [SimpleNamespace(name="demo_brightness", weight=1.0)],
            r"rewards\[0\] must be a mapping.*attributes",
        ),
    ],
)
def test_build_rewards_rejects_bad_records(specs: list, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_rewards(specs)


def test_validate_reward_spec_builds_nothing(user_module: str, monkeypatch) -> None:
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))
    built: list[float] = []

    @register_reward("test_counted")
    def counted(scale: float = 1.0) -> RewardFn:
        built.append(scale)
        raise AssertionError("validate_reward_spec must not build the reward")

    assert validate_reward_spec("test_counted", {"scale": 2.0}) is None
    assert validate_reward_spec(f"{user_module}:Recorded", {"scale": 2.0}) is None
    assert validate_reward_spec(f"{user_module}:constant", {"value": 0.1}) is None
    assert validate_reward_spec("vlm_ocr", {"base_url": "http://127.0.0.1:1/v1", "timeout_s": 1}) is None
    assert built == [] and sys.modules[user_module].BUILT == []


@pytest.mark.parametrize(
    ("name", "kwargs", "match"),
    [
        ("ocrr", {}, r"unknown reward 'ocrr'; available: .*demo_brightness.*ocr.*vlm_ocr.*module:function"),
        ("ocr", {"min_confidance": 0.3}, r"reward 'ocr'.*min_confidance.*takes \(.*min_confidence"),
        ("vlm_ocr", {}, r"reward 'vlm_ocr'.*base_url"),
        ("ocr", [("num_threads", 1)], r"reward 'ocr': 'kwargs' must be a mapping"),
        ("", {}, "non-empty string"),
        ("{m}:Recorded", {"sclae": 2}, r"reward '.*:Recorded'.*sclae.*scale"),
        ("{m}:missing", {}, "has no attribute 'missing'"),
        ("{m}:NOT_CALLABLE", {}, "not a function or class"),
        ("boogu_no_such_module:fn", {}, "cannot import module"),
    ],
)
def test_validate_reward_spec_rejects_typos(user_module: str, name: str, kwargs: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        validate_reward_spec(name.format(m=user_module), kwargs)  # type: ignore[arg-type]
    assert sys.modules[user_module].BUILT == []


def test_a_registered_check_sees_the_option_values(monkeypatch) -> None:
    monkeypatch.setattr(registry_module, "_REGISTRY", dict(registry_module._REGISTRY))
    monkeypatch.setattr(registry_module, "_CHECKS", dict(registry_module._CHECKS))
    seen: list[dict] = []

    def check(kwargs) -> None:
        seen.append(dict(kwargs))
        if kwargs.get("scale", 1.0) <= 0:
            raise ValueError(f"test_checked: scale must be > 0, got {kwargs['scale']!r}")

    @register_reward("test_checked", check=check)
    def checked(scale: float = 1.0) -> RewardFn:
        raise AssertionError("validate_reward_spec must not build the reward")

    assert validate_reward_spec("test_checked", {"scale": 2.0}) is None
    with pytest.raises(ValueError, match="scale must be > 0, got -1"):
        validate_reward_spec("test_checked", {"scale": -1})
    with pytest.raises(ValueError, match="nope"):  # names first: the check sees only known options
        validate_reward_spec("test_checked", {"nope": 1})
    assert seen == [{"scale": 2.0}, {"scale": -1}]


@pytest.mark.parametrize(
    ("base_url", "problem"),
    [
        ("http://127.0.0.1:notaport/v1", "Port could not be cast"),
        ("http://[::1/v1", "Invalid IPv6 URL"),
        ("http://127.0.0.1:8000/v1?key=x", "query or fragment"),
        ("http://127.0.0.1:70000/v1", "Port out of range"),
    ],
)
def test_vlm_ocr_base_url_is_checked_without_building(base_url: str, problem: str) -> None:
    for check in (
        lambda: validate_reward_spec("vlm_ocr", {"base_url": base_url}),
        lambda: build_reward("vlm_ocr", base_url=base_url),
    ):
        with pytest.raises(ValueError, match=rf"^vlm_ocr: base_url .*{problem}"):
            check()


def test_transcription_rewards_share_one_scoring() -> None:
    class Fixed(TranscriptionReward):
        name = "fixed"

        def transcribe(self, images: torch.Tensor) -> list[str | None]:
            return ["Hello  World", None, "", "Helo World"][: images.shape[0]]

    scores = Fixed()(as_batch(*(flat(0) for _ in range(4))), records(*["hello world"] * 4))
    torch.testing.assert_close(scores, torch.tensor([1.0, float("nan"), 0.0, 0.9]), equal_nan=True)
    with pytest.raises(ValueError, match="3 images but 2 records"):
        Fixed()(as_batch(flat(0), flat(0), flat(0)), records("", ""))
    for reward in (OcrReward, VlmOcrReward):
        assert issubclass(reward, TranscriptionReward) and "__call__" not in vars(reward)


def test_non_finite_scores_are_reported_not_replaced(user_module: str, caplog) -> None:
    rewards = build_rewards(
        [
            {"name": f"{user_module}:nan_at_one"},
            {"name": f"{user_module}:inf_at_zero", "weight": 0.5},
            {"name": "demo_brightness"},
        ]
    )
    with caplog.at_level(logging.WARNING, logger="boogu_trainer.rewards"):
        output = rewards(as_batch(flat(0), flat(0), flat(0)), records("", "", ""))
    assert output.finite.tolist() == [False, False, True]
    assert math.isinf(output.total[0]) and math.isnan(output.total[1]) and output.total[2] == 1.0
    assert math.isnan(output.per_reward[f"{user_module}:nan_at_one"][1])
    assert output.num_nonfinite == 2
    assert output.nonfinite_counts() == {
        f"{user_module}:nan_at_one": 1,
        f"{user_module}:inf_at_zero": 1,
        "demo_brightness": 0,
    }
    assert "nan_at_one" in caplog.text and "indices [1]" in caplog.text


def test_weight_zero_reward_does_not_drop_samples(user_module: str, caplog) -> None:
    rewards = build_rewards(
        [{"name": "demo_brightness"}, {"name": f"{user_module}:nan_at_one", "weight": 0.0}]
    )
    with caplog.at_level(logging.WARNING, logger="boogu_trainer.rewards"):
        output = rewards(as_batch(flat(0), flat(0)), records("", ""))
    assert output.finite.all() and output.nonfinite_counts()[f"{user_module}:nan_at_one"] == 1
    assert "weight 0" in caplog.text


@pytest.mark.parametrize(
    ("specs", "match"),
    [
        ([], "non-empty"),
        ({"name": "ocr"}, "non-empty list"),
        ([{"name": "ocr", "wieght": 1.0}], r"rewards\[0\]: unknown key\(s\) \['wieght'\]"),
        ([{"weight": 1.0}], "'name'"),
        ([{"name": "demo_brightness", "weight": float("nan")}], "finite number"),
        ([{"name": "demo_brightness", "weight": True}], "finite number"),
        ([{"name": "demo_brightness", "kwargs": [1]}], "'kwargs'"),
        ([{"name": "demo_brightness"}, {"name": "demo_brightness"}], "used twice"),
        ([{"name": "demo_brightness"}, {"name": "nope"}], r"rewards\[1\]: unknown reward 'nope'; available"),
    ],
)
def test_build_rewards_rejects_bad_specs(specs: object, match: str) -> None:
    with pytest.raises(ValueError, match=match):
        build_rewards(specs)  # type: ignore[arg-type]
