"""The reward service: the ``http`` reward against the real ``boogu-reward-server`` and broken servers."""

from __future__ import annotations

import base64
import http.client
import json
import logging
import math
import os
import queue
import re
import select
import socket
import struct
import subprocess
import sys
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
import torch

from boogu_data import PromptRecord
from boogu_trainer import reward_server as reward_server_module
from boogu_trainer.config import ConfigError, load_config
from boogu_trainer.reward_server import PixelBudget, RewardServer, is_loopback, main, serve
from boogu_trainer.rewards import RewardError, build_reward, validate_reward_spec
from boogu_trainer.rewards import http as http_module
from boogu_trainer.rewards.http import HttpReward


def _images(n: int, size: int = 16, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n, 3, size, size), dtype=torch.uint8, generator=generator)


def _records(n: int) -> list[PromptRecord]:
    return [
        PromptRecord(
            instruction=f"prompt {i} ✓",
            ground_truth=f"text {i}",
            data_source="test/source",
            ref_image=bytes([i + 1]) * 5 if i % 2 else None,
            index=i,
        )
        for i in range(n)
    ]


def _client(url: str, **kwargs) -> HttpReward:
    options = {"timeout_s": 5.0, "retries": 2, "backoff_s": 0.01} | kwargs
    return build_reward("http", url=url, **options)  # type: ignore[return-value]


class _Recording:
    """A reward that records what it is called with and scores by ``fn`` (default: brightness)."""

    def __init__(self, name: str = "demo_brightness", fn=None) -> None:
        self.name = name
        self.inner = build_reward("demo_brightness")
        self.fn = fn
        self.calls: list[tuple[torch.Tensor, list[PromptRecord]]] = []

    def __call__(self, images, records):
        self.calls.append((images.clone(), list(records)))
        if self.fn is not None:
            return self.fn(images, records)
        return self.inner(images, records)


@pytest.fixture
def served() -> Iterator[tuple[_Recording, RewardServer]]:
    reward = _Recording()
    server = serve(reward, options={"note": "test"})
    try:
        yield reward, server
    finally:
        server.close()


# --- against the real server ----------------------------------------------------------------------


def test_scores_equal_the_in_process_reward_across_chunks(served) -> None:
    reward, server = served
    images, records = _images(7, seed=1), _records(7)
    scores = _client(server.url, batch_size=3, reward="demo_brightness")(images, records)
    assert scores.dtype == torch.float32 and scores.shape == (7,)
    assert torch.equal(scores, build_reward("demo_brightness")(images, records))
    assert [len(call[1]) for call in reward.calls] == [3, 3, 1]
    # The server saw exactly the pixels and records the trainer had.
    assert torch.equal(torch.cat([call[0] for call in reward.calls]), images)
    assert [r for call in reward.calls for r in call[1]] == records


def test_ref_images_can_be_left_out(served) -> None:
    reward, server = served
    _client(server.url, send_ref_images=False)(_images(2), _records(2))
    assert [r.ref_image for r in reward.calls[0][1]] == [None, None]
    assert [r.instruction for r in reward.calls[0][1]] == ["prompt 0 ✓", "prompt 1 ✓"]


def test_health_names_the_reward_and_its_options(served) -> None:
    _, server = served
    assert _client(server.url).health() == {
        "version": 1,
        "status": "ok",
        "reward": "demo_brightness",
        "options": {"note": "test"},
        "in_flight": {"pixels": 0, "max_pixels": 2 * 64 * 2**20, "waiting": 0},
    }


def test_an_empty_batch_sends_nothing(served) -> None:
    reward, server = served
    scores = _client(server.url)(torch.zeros((0, 3, 8, 8), dtype=torch.uint8), [])
    assert scores.shape == (0,) and reward.calls == []


def test_non_finite_scores_round_trip_as_nan() -> None:
    values = torch.tensor([float("nan"), float("inf"), 0.25, float("-inf")])
    with serve(_Recording(fn=lambda images, records: values)) as server:
        scores = _client(server.url)(_images(4), _records(4))
    assert scores.dtype == torch.float32
    assert torch.isnan(scores[[0, 1, 3]]).all() and scores[2].item() == 0.25


def test_a_failing_reward_answers_500_with_its_message() -> None:
    def explode(images, records):
        raise RuntimeError("the judge ran out of memory")

    reward = _Recording(fn=explode)
    with serve(reward) as server:
        start = time.monotonic()
        with pytest.raises(
            RewardError, match=r"after 2 attempt.*HTTP 500.*RuntimeError: the judge ran out of memory"
        ):
            _client(server.url, retries=1)(_images(2), _records(2))
        assert time.monotonic() - start < 2
    assert len(reward.calls) == 2  # a 5xx is retried


def test_a_reward_returning_the_wrong_shape_is_a_500() -> None:
    with (
        serve(_Recording(fn=lambda images, records: [0.5])) as server,
        pytest.raises(RewardError, match=r"HTTP 500.*shape \(1,\); expected \(2,\)"),
    ):
        _client(server.url, retries=0)(_images(2), _records(2))


def test_the_wrong_reward_is_refused_at_once(served) -> None:
    reward, server = served
    with pytest.raises(RewardError, match=r"rejected.*HTTP 400.*serves reward 'demo_brightness', not 'ocr'"):
        _client(server.url, reward="ocr")(_images(1), _records(1))
    assert reward.calls == []


def test_the_api_key_is_checked(monkeypatch) -> None:
    monkeypatch.setenv("BOOGU_TEST_REWARD_KEY", "s3cret")
    with serve(_Recording(), api_key="s3cret") as server:
        with pytest.raises(RewardError, match=r"HTTP 401.*bearer token"):
            _client(server.url)(_images(1), _records(1))
        scores = _client(server.url, api_key_env="BOOGU_TEST_REWARD_KEY")(_images(1), _records(1))
    assert torch.equal(scores, build_reward("demo_brightness")(_images(1), _records(1)))


def _raw_request(url: str, method: str, path: str, body: bytes | None = None) -> tuple[int, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=5)
    try:
        connection.request(method, path, body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, json.loads(response.read())
    finally:
        connection.close()


def _score_body(**overrides) -> bytes:
    client = HttpReward(url="http://127.0.0.1:1")
    rgb = _images(2).permute(0, 2, 3, 1).numpy()
    return json.dumps(client.request_body(rgb, _records(2)) | overrides).encode()


@pytest.mark.parametrize(
    ("method", "path", "body", "status", "match"),
    [
        ("POST", "/score", b"{not json", 400, "not JSON"),
        ("POST", "/score", b"[1, 2]", 400, "JSON object"),
        ("POST", "/score", _score_body(version=2), 400, "unsupported protocol version 2"),
        ("POST", "/score", _score_body(images=["aGVsbG8="] * 2), 400, "image 0: .*PNG"),
        ("POST", "/score", _score_body(images=["%%%"] * 2), 400, "image 0: .*base64"),
        ("POST", "/score", _score_body(records=[{"index": 0}] * 2), 400, "record 0: .*instruction"),
        ("POST", "/score", _score_body(records=[{"instruction": "x", "index": -1}] * 2), 400, "record 0"),
        ("POST", "/score", _score_body(records=[]), 400, "2 images but 0 records"),
        ("POST", "/score", b"[" * 100_000, 400, "nested too deeply"),
        ("GET", "/score", None, 405, "POST /score"),
        ("GET", "/nope", None, 404, "/nope"),
    ],
)
def test_bad_requests_get_json_errors(served, method, path, body, status, match) -> None:
    reward, server = served
    got_status, payload = _raw_request(server.url, method, path, body)
    assert got_status == status
    assert payload["version"] == 1
    assert re.search(match, payload["error"]["message"])
    assert reward.calls == []


def test_a_too_large_request_is_refused() -> None:
    with (
        serve(_Recording(), max_body_bytes=100_000) as server,
        pytest.raises(RewardError, match=r"HTTP 413.*limit of 100000.*batch_size"),
    ):
        # 256x256 noise: a body of some 260 kB, more than the sockets buffer, so the server must
        # read it to be heard.
        _client(server.url, retries=0)(_images(1, size=256), _records(1))


def test_only_loopback_hosts_unless_allowed(capsys) -> None:
    assert is_loopback("127.0.0.1") and is_loopback("::1") and is_loopback("localhost")
    assert not is_loopback("0.0.0.0") and not is_loopback("") and not is_loopback("8.8.8.8")
    with pytest.raises(ValueError, match="not a loopback address"):
        RewardServer(_Recording(), "0.0.0.0")
    with pytest.raises(SystemExit) as exit_info:
        main(["--reward", "demo_brightness", "--host", "0.0.0.0"])
    assert exit_info.value.code == 2 and "--allow-remote" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--reward", "no_such_reward"])
    assert "unknown reward 'no_such_reward'" in capsys.readouterr().err


def test_the_cli_serves_a_reward_with_options() -> None:
    """``python -m boogu_trainer.reward_server`` prints its URL first and stops cleanly on SIGTERM."""
    command = [sys.executable, "-m", "boogu_trainer.reward_server", "--reward", "demo_target_color"]
    command += ["--kwargs", '{"target": [0, 0, 255]}', "--port", "0", "--log-level", "WARNING"]
    env = os.environ | {"OMP_WAIT_POLICY": "PASSIVE"}
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(process.stdout.readline()), daemon=True).start()
        try:
            url = lines.get(timeout=60).strip()
        except queue.Empty:
            pytest.fail("the server printed no URL within 60 s")
        assert url.startswith("http://127.0.0.1:"), (url, process.stderr.read() if process.poll() else "")
        client = _client(url, batch_size=2, reward="demo_target_color")
        assert client.health()["options"] == {"target": [0, 0, 255]}
        images, records = _images(5, seed=3), _records(5)
        expected = build_reward("demo_target_color", target=[0, 0, 255])(images, records)
        assert torch.equal(client(images, records), expected)
    finally:
        process.terminate()
        rc = process.wait(timeout=20)
    assert rc == 0, process.stderr.read()


# --- against servers that are down, slow or broken -------------------------------------------------


def test_a_server_that_is_down_fails_clearly_after_the_retries() -> None:
    with socket.socket() as sock:  # a loopback port that nothing listens on
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(
        RewardError, match=rf"127.0.0.1:{port}/score failed for images 0-1 after 3 attempt.*Refused"
    ):
        _client(f"http://127.0.0.1:{port}", retries=2, backoff_s=0.05, timeout_s=1.0)(_images(2), _records(2))
    assert time.monotonic() - start < 1.0  # two backoffs of 0.05 and 0.1 s, refusals are immediate


def test_on_error_nan_scores_a_failed_chunk_nan(caplog) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    with caplog.at_level(logging.WARNING, logger="boogu_trainer.rewards.http"):
        scores = _client(f"http://127.0.0.1:{port}", retries=0, on_error="nan")(_images(3), _records(3))
    assert torch.isnan(scores).all() and "scored NaN" in caplog.text


@dataclass
class _Script:
    """What the fake server answers: ``answers[i]`` for request i (the last one repeats)."""

    answers: list[tuple[int, bytes]] = field(default_factory=list)
    hang_s: float = 0.0
    requests: list[dict] = field(default_factory=list)
    release: threading.Event = field(default_factory=threading.Event)


class _FakeServer(ThreadingHTTPServer):
    daemon_threads = True
    block_on_close = False

    def handle_error(self, request, client_address) -> None:
        pass  # a client that gave up closed its socket; the late write fails, as intended


@pytest.fixture
def fake() -> Iterator[tuple[_Script, str]]:
    script = _Script()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args) -> None:
            pass

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            script.requests.append(body)
            if script.hang_s and script.release.wait(script.hang_s):
                return
            status, payload, *headers = script.answers[min(len(script.requests), len(script.answers)) - 1]
            self.send_response(status)
            for name, value in (headers[0] if headers else {}).items():
                self.send_header(name, value)
            self.send_header("Content-Length", str(len(payload)))
            self.end_headers()
            self.wfile.write(payload)

    server = _FakeServer(("127.0.0.1", 0), Handler)
    thread = threading.Thread(target=server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
    thread.start()
    try:
        yield script, f"http://127.0.0.1:{server.server_address[1]}"
    finally:
        script.release.set()
        server.shutdown()
        server.server_close()


def test_a_slow_server_misses_the_deadline_quickly(fake) -> None:
    script, url = fake
    script.hang_s = 30.0
    script.answers = [(200, b'{"version": 1, "scores": [0.5]}')]
    start = time.monotonic()
    with pytest.raises(RewardError, match=r"after 2 attempt.*no answer within 0.3 s"):
        _client(url, timeout_s=0.3, retries=1, backoff_s=0.0)(_images(1), _records(1))
    assert time.monotonic() - start < 1.5
    assert len(script.requests) == 2


def test_transient_statuses_are_retried(fake) -> None:
    script, url = fake
    script.answers = [
        (503, b"overloaded"),
        (429, b"slow down"),
        (200, b'{"version": 1, "scores": [0.5, null]}'),
    ]
    scores = _client(url)(_images(2), _records(2))
    assert scores[0].item() == 0.5 and math.isnan(scores[1].item())
    assert len(script.requests) == 3


def test_a_retry_waits_at_least_the_servers_retry_after_within_backoff_max(fake) -> None:
    script, url = fake
    script.answers = [(503, b"overloaded", {"Retry-After": "1"}), (200, b'{"version": 1, "scores": [0.5]}')]
    start = time.monotonic()
    assert _client(url, backoff_s=0.0, backoff_max_s=5.0)(_images(1), _records(1)).tolist() == [0.5]
    assert 1.0 <= time.monotonic() - start < 4.0 and len(script.requests) == 2
    script.requests.clear()
    start = time.monotonic()  # backoff_max_s bounds what a server may ask for
    assert _client(url, backoff_s=0.0, backoff_max_s=0.2)(_images(1), _records(1)).tolist() == [0.5]
    assert time.monotonic() - start < 0.9 and len(script.requests) == 2


def test_retry_after_is_read_as_seconds_or_an_http_date() -> None:
    from boogu_trainer.rewards.transport import TransientError, retry_after_seconds, retry_delay

    assert retry_after_seconds("3") == 3.0 and retry_after_seconds(None) is None
    assert retry_after_seconds("soon") is None and retry_after_seconds("-1") is None
    assert retry_after_seconds("\u00b2") is None  # a digit to str.isdigit, not to float()
    now = 1_700_000_000.0  # Tue, 14 Nov 2023 22:13:20 GMT
    assert retry_after_seconds("Tue, 14 Nov 2023 22:13:30 GMT", now=now) == pytest.approx(10.0)
    assert retry_after_seconds("Tue, 14 Nov 2023 22:13:00 GMT", now=now) == 0.0  # past: at once
    assert retry_delay(3, 0.5, 10.0, None) == 2.0
    assert retry_delay(1, 0.5, 10.0, TransientError("503", retry_after_s=4.0)) == 4.0
    assert retry_delay(1, 0.5, 3.0, TransientError("503", retry_after_s=4.0)) == 3.0


@pytest.mark.parametrize(
    ("answer", "match"),
    [
        ((200, b"<html>hello</html>"), r"not JSON.*<html>hello</html>"),
        ((200, b'{"scores": [0.5, 0.5]}'), r"protocol version None"),
        ((200, b'{"version": 2, "scores": [0.5, 0.5]}'), r"protocol version 2"),
        ((200, b'{"version": 1, "scores": [0.5]}'), r"malformed answer: got 1 scores for 2 images"),
        ((200, b'{"version": 1, "scores": ["0.5", "high"]}'), r"score 0 is '0.5', not a number"),
        ((200, b'{"version": 1, "scores": [true, 0.5]}'), r"score 0 is True"),
        ((200, b'{"version": 1, "scores": {"a": 1}}'), r"'scores' must be a list"),
        ((200, b'{"version": 1}'), r"not a JSON object with 'scores'"),
        ((200, b"[0.5, 0.5]"), r"protocol version None"),
        ((404, b"no such page"), r"rejected for images 0-1: HTTP 404 .*no such page"),
        (
            (400, b'{"version": 1, "error": {"type": "x", "message": "you sent junk"}}'),
            r"HTTP 400.*you sent junk",
        ),
        ((302, b""), r"redirects are not followed"),
    ],
)
def test_garbage_answers_are_named_errors(fake, answer, match) -> None:
    script, url = fake
    script.answers = [answer]
    with pytest.raises(RewardError, match=match) as error_info:
        _client(url)(_images(2), _records(2))
    assert f"{url}/score" in str(error_info.value)
    assert len(script.requests) == 1  # not retried


def test_the_request_follows_the_protocol(fake) -> None:
    script, url = fake
    script.answers = [(200, b'{"version": 1, "scores": [1, 2]}')]
    scores = _client(url, reward="some_reward")(_images(2), _records(2))
    assert scores.tolist() == [1.0, 2.0]
    (body,) = script.requests
    assert body["version"] == 1 and body["reward"] == "some_reward" and len(body["images"]) == 2
    assert body["records"][1] | {"ref_image": None} == {
        "instruction": "prompt 1 ✓",
        "negative": "",
        "ground_truth": "text 1",
        "data_source": "test/source",
        "ability": "",
        "ref_image": None,
        "split": "train",
        "index": 1,
    }
    assert body["records"][1]["ref_image"] == "AgICAgI=" and body["records"][0]["ref_image"] is None


@pytest.mark.parametrize(
    ("options", "match"),
    [
        ({"url": "127.0.0.1:8123"}, "http://"),
        ({"url": "http://127.0.0.1:8123/score"}, "service root"),
        ({"url": "http://127.0.0.1:8123", "batch_size": 0}, "batch_size"),
        ({"url": "http://127.0.0.1:8123", "timeout_s": 0}, "timeout_s"),
        ({"url": "http://127.0.0.1:8123", "retries": -1}, "retries"),
        ({"url": "http://127.0.0.1:8123", "on_error": "skip"}, "on_error"),
        ({"url": "http://127.0.0.1:8123", "api_key_env": "BOOGU_TEST_UNSET_KEY"}, "BOOGU_TEST_UNSET_KEY"),
    ],
)
def test_bad_options_are_refused(options, match) -> None:
    with pytest.raises(ValueError, match=match):
        build_reward("http", **options)


# --- bounds on a request: pixels, time; a taken port ----------------------------------------------


def _png(width: int, height: int, idat: bytes | None = None) -> bytes:
    """A black 8-bit RGB PNG built by hand (rows of zeros compress about 1000:1, so a large one is
    cheap to make); ``idat`` replaces its compressed pixel data."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    if idat is None:
        compressor = zlib.compressobj(9)
        row = bytes(1 + 3 * width)  # filter byte 0, then the row's RGB bytes
        idat = b"".join(compressor.compress(row) for _ in range(height)) + compressor.flush()
    header = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)  # 8-bit RGB, no interlace
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", header) + chunk(b"IDAT", idat) + chunk(b"IEND", b"")


def _pngs_body(*pngs: bytes) -> bytes:
    images = [base64.b64encode(png).decode("ascii") for png in pngs]
    records = [{"instruction": f"prompt {i}"} for i in range(len(pngs))]
    return json.dumps({"version": 1, "images": images, "records": records}).encode()


def test_a_decompression_bomb_is_refused_from_its_header(served) -> None:
    reward, server = served
    bomb = _png(5000, 5000)  # 25 M pixels, 75 MB decoded, more than the default 4096² per image
    assert len(bomb) < 200_000
    status, payload = _raw_request(server.url, "POST", "/score", _pngs_body(bomb))
    assert status == 413 and payload["error"]["type"] == "too_many_pixels"
    assert re.search(
        r"image 0 is 5000x5000, .*limit of 16777216 pixels per image", payload["error"]["message"]
    )
    # The header is read, not the pixels: a PNG whose data is junk is refused for its size too (a
    # decoder would have failed on the junk, 400), also above PIL's own bomb limit.
    for size in (5000, 100_000):
        status, payload = _raw_request(server.url, "POST", "/score", _pngs_body(_png(size, size, b"junk")))
        assert status == 413 and f"{size}x{size}" in payload["error"]["message"]
    assert reward.calls == []


def test_the_pixels_of_a_request_are_bounded() -> None:
    reward = _Recording()
    with serve(reward, max_pixels_per_image=32 * 32, max_pixels_per_request=3 * 32 * 32) as server:
        client = _client(server.url, batch_size=4)
        with pytest.raises(
            RewardError, match=r"HTTP 413.*4 images have 4096 pixels in all.*3072 per request"
        ):
            client(_images(4, size=32), _records(4))
        assert reward.calls == []  # refused before decoding, and a 413 is not retried
        with pytest.raises(RewardError, match=r"HTTP 413.*image 0 is 33x33, .*1024 pixels per image"):
            client(_images(1, size=33), _records(1))
        scores = _client(server.url, batch_size=3)(_images(4, size=32), _records(4))
    assert [len(call[1]) for call in reward.calls] == [3, 1]
    assert torch.equal(scores, build_reward("demo_brightness")(_images(4, size=32), _records(4)))


class _DecodeCounter:
    """Counts the images the server has decoded and not yet scored (a reward call ends them)."""

    def __init__(self, monkeypatch) -> None:
        self.lock = threading.Lock()
        self.live = self.peak = 0
        decode = reward_server_module.decode_png

        def counting(data, max_pixels):
            array = decode(data, max_pixels)
            with self.lock:
                self.live += 1
                self.peak = max(self.peak, self.live)
            return array

        monkeypatch.setattr(reward_server_module, "decode_png", counting)

    def scored(self, n: int) -> None:
        with self.lock:
            self.live -= n


def _raw_post(url: str, body: bytes) -> tuple[int, dict, dict]:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=30)
    try:
        connection.request("POST", "/score", body=body, headers={"Content-Type": "application/json"})
        response = connection.getresponse()
        return response.status, dict(response.getheaders()), json.loads(response.read())
    finally:
        connection.close()


def test_the_pixels_in_flight_are_bounded_and_the_excess_is_told_to_retry(monkeypatch) -> None:
    """Six concurrent requests, room for two: two are decoded and scored, the other four wait
    their turn, then get a 503 with a Retry-After; sent again they are scored. Nothing is lost."""
    counter = _DecodeCounter(monkeypatch)
    gate, entered = threading.Event(), threading.Event()
    inner = build_reward("demo_brightness")

    def gated(images, records):
        entered.set()
        assert gate.wait(30)
        counter.scored(len(images))
        return inner(images, records)

    batches = [_images(4, size=8, seed=seed) for seed in range(6)]
    client = HttpReward(url="http://127.0.0.1:1")
    bodies = [
        json.dumps(client.request_body(b.permute(0, 2, 3, 1).numpy(), _records(4))).encode() for b in batches
    ]
    answers: queue.Queue[tuple[int, tuple[int, dict, dict]]] = queue.Queue()
    limits = {"max_pixels_per_request": 4 * 64, "max_pixels_in_flight": 2 * 4 * 64}
    with serve(_Recording(fn=gated), queue_timeout_s=0.3, **limits) as server:
        threads = [
            threading.Thread(target=lambda i=i: answers.put((i, _raw_post(server.url, bodies[i]))))
            for i in range(6)
        ]
        for thread in threads:
            thread.start()
        assert entered.wait(30)
        # The reward is held: the four requests without room wait, then are refused.
        refused = [answers.get(timeout=30) for _ in range(4)]
        assert counter.peak == 8 and counter.live == 8  # two requests' images decoded, no more
        gate.set()
        done = [answers.get(timeout=30) for _ in range(2)]
        for thread in threads:
            thread.join(30)
        assert all(status == 503 for _, (status, _, _) in refused)
        for _, (_, headers, payload) in refused:
            assert headers["Retry-After"] == "1" and payload["error"]["type"] == "overloaded"
            assert re.search(
                r"busy: this request's 256 pixels waited 0.3 s \(--queue-timeout-s\) for room in the "
                r"512 pixels .*\(--max-pixels-in-flight\); retry after 1 s",
                payload["error"]["message"],
            )
        # Sent again (what the http reward does with a 503), the refused ones are scored too.
        again = [(i, _raw_post(server.url, bodies[i])) for i, _ in refused]
        health = _client(server.url).health()
    scores = {i: payload["scores"] for i, (status, _, payload) in done + again if status == 200}
    assert sorted(scores) == list(range(6))
    for i, batch in enumerate(batches):
        assert scores[i] == inner(batch, _records(4)).tolist()
    assert counter.peak == 8 and counter.live == 0
    assert health["in_flight"] == {"pixels": 0, "max_pixels": 512, "waiting": 0}


def test_requests_without_room_wait_their_turn_within_the_bound(monkeypatch) -> None:
    """With a queue timeout to spare, concurrent clients are all scored, one request's pixels
    decoded beside the one being scored at most (the default: twice the per-request limit)."""
    counter = _DecodeCounter(monkeypatch)
    inner = build_reward("demo_brightness")

    def slow(images, records):
        time.sleep(0.1)
        counter.scored(len(images))
        return inner(images, records)

    batches = [_images(3, size=8, seed=seed) for seed in range(6)]
    results: dict[int, torch.Tensor] = {}
    with serve(_Recording(fn=slow), max_pixels_per_request=3 * 64) as server:
        assert server.in_flight.limit == 2 * 3 * 64

        def score(i: int) -> None:
            results[i] = _client(server.url, retries=0)(batches[i], _records(3))

        threads = [threading.Thread(target=score, args=(i,)) for i in range(6)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(30)
    assert sorted(results) == list(range(6))
    for i, batch in enumerate(batches):
        assert torch.equal(results[i], inner(batch, _records(3)))
    assert counter.peak <= 6 and counter.live == 0


def test_the_budget_admits_in_arrival_order() -> None:
    """A large request waiting for room is not passed by a small one that would fit now."""
    budget = PixelBudget(10)
    assert budget.acquire(6, 0)
    admitted: list[str] = []

    def take(name: str, pixels: int) -> None:
        assert budget.acquire(pixels, 30)
        admitted.append(name)

    large = threading.Thread(target=take, args=("large", 8))
    large.start()
    while budget.waiting < 1:
        time.sleep(0.01)
    small = threading.Thread(target=take, args=("small", 3))  # 6 + 3 would fit
    small.start()
    while budget.waiting < 2:
        time.sleep(0.01)
    assert not budget.acquire(1, 0.05)  # a third waits behind both and times out
    assert admitted == [] and budget.used == 6
    budget.release(6)
    large.join(30)
    assert admitted == ["large"] and budget.used == 8 and budget.waiting == 1  # 8 + 3 do not fit
    budget.release(8)
    small.join(30)
    assert admitted == ["large", "small"] and budget.used == 3 and budget.waiting == 0


def test_the_budget_in_flight_must_hold_a_whole_request(capsys) -> None:
    with pytest.raises(ValueError, match=r"max_pixels_in_flight \(100\) must be at least max_pixels_per"):
        RewardServer(_Recording(), max_pixels_per_request=200, max_pixels_in_flight=100)
    flags = ["--max-pixels-per-request", "200", "--max-pixels-in-flight", "100"]
    with pytest.raises(SystemExit) as exit_info:
        main(["--reward", "demo_brightness", *flags])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--max-pixels-in-flight (100) must be at least --max-pixels-per-request (200)" in err
    with pytest.raises(SystemExit):
        main(["--reward", "demo_brightness", "--queue-timeout-s", "-1"])
    assert "--queue-timeout-s must be >= 0" in capsys.readouterr().err


def _connect(url: str) -> socket.socket:
    host, port = url.removeprefix("http://").rsplit(":", 1)
    return socket.create_connection((host, int(port)), timeout=5)


def _read_answer(sock: socket.socket) -> tuple[int, dict]:
    """The status and JSON body of the answer on ``sock``, read until the server closes it."""
    data = b""
    while chunk := sock.recv(65536):
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split()[1]), json.loads(body)


_HEAD = (
    b"POST /score HTTP/1.1\r\nHost: test\r\nContent-Type: application/json\r\nContent-Length: 1000\r\n\r\n"
)


def test_a_body_that_stops_short_is_a_408() -> None:
    with serve(_Recording(), request_timeout_s=0.3) as server, _connect(server.url) as sock:
        start = time.monotonic()
        sock.sendall(_HEAD + b'{"version": 1')  # 13 of the 1000 bytes promised, then silence
        status, payload = _read_answer(sock)
    assert status == 408 and payload["error"]["type"] == "request_timeout"
    assert "0.3 s" in payload["error"]["message"] and time.monotonic() - start < 2


def test_a_dripping_body_is_cut_at_the_total_deadline() -> None:
    """One byte every 0.1 s: each read is quick, only a deadline for the whole request ends it."""
    with serve(_Recording(), request_timeout_s=0.55) as server, _connect(server.url) as sock:
        start = time.monotonic()
        sock.sendall(_HEAD)
        # Stop dripping once the answer is there (1000 bytes would take 100 s).
        while not select.select([sock], [], [], 0.1)[0] and time.monotonic() - start < 5:
            sock.sendall(b" ")
        status, payload = _read_answer(sock)
    assert status == 408 and payload["error"]["type"] == "request_timeout"
    assert time.monotonic() - start < 2


def test_dripping_headers_are_cut_at_the_total_deadline() -> None:
    with serve(_Recording(), request_timeout_s=0.55) as server, _connect(server.url) as sock:
        start = time.monotonic()
        sock.sendall(b"POST /score HTTP/1.1\r\nX-Slow: ")
        closed = False
        while not closed and time.monotonic() - start < 5:
            if select.select([sock], [], [], 0.1)[0]:
                try:
                    closed = sock.recv(1024) == b""
                except ConnectionResetError:
                    closed = True
            else:
                sock.sendall(b"a")
    assert closed and time.monotonic() - start < 2


def test_a_taken_port_is_a_one_line_error(capsys) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = taken.getsockname()[1]
        assert main(["--reward", "demo_brightness", "--port", str(port), "--log-level", "WARNING"]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and f"cannot listen on 127.0.0.1:{port}" in err and "in use" in err


def test_the_server_options_are_checked(capsys) -> None:
    for flag in ("--max-pixels-per-image", "--max-pixels-per-request", "--request-timeout-s"):
        with pytest.raises(SystemExit) as exit_info:
            main(["--reward", "demo_brightness", flag, "0"])
        assert exit_info.value.code == 2 and f"{flag} must be > 0" in capsys.readouterr().err
    with pytest.raises(ValueError, match="request_timeout_s"):
        RewardServer(_Recording(), request_timeout_s=float("inf"))


# --- the client: a server that is down, answers without end, or a bad url ----------------------------


def test_a_server_that_is_down_asks_whether_it_runs() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RewardError) as error_info:
        _client(url, retries=1, backoff_s=0.0)(_images(1), _records(1))
    message = str(error_info.value)
    assert (
        f"{url}/score" in message
        and f"nothing listens on 127.0.0.1:{port} (is the server running?)" in message
    )


class _Answers(ThreadingHTTPServer):
    """A server whose every answer is ``handler``'s; counts the bytes of the answers it sent."""

    daemon_threads = True
    block_on_close = False

    def __init__(self, answer) -> None:
        server = self
        self.sent = 0

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def do_POST(self) -> None:
                self.rfile.read(int(self.headers["Content-Length"]))
                answer(self, server)

        super().__init__(("127.0.0.1", 0), Handler)

    def handle_error(self, request, client_address) -> None:
        pass  # the client hung up on the answer, as intended

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.server_address[1]}"

    def __enter__(self) -> _Answers:
        threading.Thread(target=self.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True).start()
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()
        self.server_close()


def test_an_endless_answer_is_cut_at_the_limit(monkeypatch) -> None:
    monkeypatch.setattr(http_module, "ANSWER_BASE_BYTES", 100_000)
    limit = http_module.answer_limit(2)

    def endless(handler, server) -> None:  # no Content-Length: the body ends when the server closes
        handler.send_response(200)
        handler.end_headers()
        piece = b" " * 2**16
        for _ in range(1024):  # 64 MiB
            handler.wfile.write(piece)
            server.sent += len(piece)

    with _Answers(endless) as server:
        start = time.monotonic()
        with pytest.raises(
            RewardError, match=rf"{server.url}/score answered images 0-1 with too much.*limit of {limit}"
        ):
            _client(server.url)(_images(2), _records(2))
        assert time.monotonic() - start < 2
        deadline = time.monotonic() + 5
        while server.sent < 2**20 and time.monotonic() < deadline:  # let the handler see the hang-up
            time.sleep(0.01)
    # Reading stopped at the limit: what the sockets buffered was sent too, not the 64 MiB.
    assert limit < server.sent < 32 * 2**20


def test_a_too_long_content_length_fails_before_reading(monkeypatch) -> None:
    released = threading.Event()

    def promise(handler, server) -> None:
        handler.send_response(200)
        handler.send_header("Content-Length", str(10**9))
        handler.end_headers()
        handler.wfile.flush()
        released.wait(10)  # and send nothing

    with _Answers(promise) as server:
        start = time.monotonic()
        try:
            with pytest.raises(
                RewardError, match=r"Content-Length is 1000000000 bytes, more than the limit of"
            ):
                _client(server.url, timeout_s=2.0, retries=0)(_images(1), _records(1))
        finally:
            released.set()
    assert time.monotonic() - start < 1


@pytest.mark.parametrize(
    ("url", "problem"),
    [
        ("http://127.0.0.1:notaport", "Port could not be cast to integer value as 'notaport'"),
        ("http://127.0.0.1:99999", "Port out of range"),
        ("http://127.0.0.1:0", "port 0"),
        ("http://[::1", "Invalid IPv6 URL"),
        ("http://::1:8123", "Port could not be cast"),
        ("http://127.0.0.1:8123?reward=x", "query or fragment"),
        ("http://127.0.0.1:8123/#top", "query or fragment"),
        ("http://:8123", "no host"),
        ("http://user:pw@127.0.0.1:8123", "credentials"),
        ("http://127.0.0.1:8123 ", "spaces"),
        ("ftp://127.0.0.1:8123", "http:// or https://"),
        ("http://127.0.0.1:8123/health", "service root"),
    ],
)
def test_bad_urls_are_refused_when_the_config_loads(url: str, problem: str) -> None:
    with pytest.raises(ValueError, match=re.escape(problem)):
        validate_reward_spec("http", {"url": url})
    with pytest.raises(ValueError, match=re.escape(problem)):  # the same rule when built
        build_reward("http", url=url)
    override = f"reward.rewards=[{{name: http, kwargs: {{url: '{url}'}}}}]"
    with pytest.raises(ConfigError) as error_info:
        load_config(None, [override])
    message = str(error_info.value)
    assert message.startswith("reward.rewards[0]: http reward: url") and problem in message


def test_good_urls_pass(served) -> None:
    _, server = served
    for url in ("http://[::1]:8123", "https://judge.example:443/rewards/aesthetic/", "http://localhost"):
        assert validate_reward_spec("http", {"url": url, "batch_size": 4}) is None
    with pytest.raises(ValueError, match="batch_size must be an int >= 1, got 0"):
        validate_reward_spec("http", {"url": "http://127.0.0.1:8123", "batch_size": 0})
    assert _client(server.url + "/").url == server.url
