"""The HTTP transport of the rewards that call a server (``vlm_ocr``, ``http``): standard library only.

Every attempt has one overall deadline: connecting, sending the request and reading the whole
answer must end within it (a per-read socket timeout alone would let a server that trickles one
byte a second keep a request alive for ever). `send_once` makes one attempt and sorts its outcome:
a 2xx body, a refusal worth no retry (a description), or `TransientError` (timeouts, connection
errors, HTTP 408/425/429/5xx), which the rewards retry with backoff (`retry_delay`: at least the
server's ``Retry-After``). An answer longer than the
caller's limit is `AnswerTooLarge`, found while reading (not after), and not retried.

`service_url` is the one rule for the rewards' URL options, applied when a config loads (through
the registry's ``check``) and again when the reward is built.
"""

from __future__ import annotations

import base64
import datetime
import email.utils
import http.client
import io
import math
import socket
import time
import urllib.parse
import urllib.request
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

__all__ = [
    "RETRYABLE_STATUS",
    "AnswerTooLarge",
    "DeadlineReader",
    "Endpoint",
    "TransientError",
    "excerpt",
    "is_int",
    "is_number",
    "resolve_endpoint",
    "retry_after_seconds",
    "retry_delay",
    "send_once",
    "service_url",
]

# Statuses a server returns while overloaded or restarting: worth another try.
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class TransientError(Exception):
    """One attempt failed in a way a later attempt may not (the HTTP rewards retry it).

    ``retry_after_s`` is the wait the server asked for (its ``Retry-After``), or None."""

    def __init__(self, message: str, retry_after_s: float | None = None) -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s


def retry_after_seconds(value: str | None, now: float | None = None) -> float | None:
    """A ``Retry-After`` header's wait in seconds: delta-seconds or an HTTP-date (RFC 9110 10.2.3),
    at least 0; None when absent or unreadable."""
    if value is None:
        return None
    value = value.strip()
    if value.isascii() and value.isdigit():  # str.isdigit also takes '²' (a latin-1 header byte)
        return float(value)
    try:
        when = email.utils.parsedate_to_datetime(value)
    except (TypeError, ValueError, IndexError):
        return None
    if when.tzinfo is None:  # an HTTP-date is GMT
        when = when.replace(tzinfo=datetime.UTC)
    return max(0.0, when.timestamp() - (time.time() if now is None else now))


def retry_delay(attempt: int, backoff_s: float, backoff_max_s: float, error: TransientError | None) -> float:
    """The wait before retry ``attempt`` (1 for the first): ``backoff_s * 2**(attempt-1)``, at least
    the server's ``Retry-After`` when the failed attempt had one, at most ``backoff_max_s``."""
    wait = backoff_s * 2 ** (attempt - 1)
    if error is not None and error.retry_after_s is not None:
        wait = max(wait, error.retry_after_s)
    return min(wait, backoff_max_s)


class AnswerTooLarge(Exception):
    """The answer is longer than the caller's limit (message only; not retried: it would be again)."""


@dataclass(frozen=True)
class Endpoint:
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


def send_once(
    endpoint: Endpoint,
    method: str,
    body: bytes | None,
    headers: dict[str, str],
    timeout_s: float,
    describe: Callable[[bytes], str],
    max_answer_bytes: int,
) -> bytes | str:
    """One HTTP attempt under one deadline (connect, send and read the whole answer).

    Returns the body of a 2xx answer, or a description of a refusal (3xx/4xx that are not worth
    retrying, with ``describe(body)``); raises `TransientError` for timeouts, connection errors and
    retryable statuses, and `AnswerTooLarge` for an answer (of any status) longer than
    ``max_answer_bytes``: its Content-Length is checked first, then the bytes as they come."""
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
        raw = _read_capped(response, max_answer_bytes)
    except TimeoutError:
        raise TransientError(
            f"no {waiting_for} within {timeout_s:g} s (the deadline for connecting, sending "
            "and reading the whole answer)"
        ) from None
    except ConnectionRefusedError:
        raise TransientError(
            f"ConnectionRefusedError: nothing listens on {_host_port(endpoint.host, endpoint.port)} "
            "(is the server running?)"
        ) from None
    except (OSError, http.client.HTTPException) as error:
        # Connection reset, server closed mid-answer, truncated body: transient.
        raise TransientError(f"{type(error).__name__}: {error}") from None
    finally:
        connection.close()
    if 200 <= response.status < 300:
        return raw
    message = f"HTTP {response.status} {response.reason}: {describe(raw)}"
    if response.status in RETRYABLE_STATUS:
        raise TransientError(message, retry_after_seconds(response.getheader("Retry-After")))
    if 300 <= response.status < 400:
        message += f" (redirects are not followed; Location: {response.getheader('Location')})"
    return message


def _read_capped(response: http.client.HTTPResponse, limit: int) -> bytes:
    """The whole body of ``response``, read in pieces; `AnswerTooLarge` as soon as it passes ``limit``."""
    if response.length is not None and response.length > limit:
        raise AnswerTooLarge(f"its Content-Length is {response.length} bytes, more than the limit of {limit}")
    chunks: list[bytes] = []
    size = 0
    while chunk := response.read(min(2**16, limit + 1 - size)):
        chunks.append(chunk)
        size += len(chunk)
        if size > limit:
            raise AnswerTooLarge(f"it is longer than the limit of {limit} bytes (reading stopped there)")
    raw = b"".join(chunks)
    if response.length:  # read(amt) does not raise on a short body, unlike read()
        raise http.client.IncompleteRead(raw, response.length)
    return raw


def service_url(url: object, owner: str, option: str) -> str:
    """``url`` checked as the root of an HTTP service; returned without its trailing ``/``.

    The rule for the rewards' URL options (``http``'s ``url``, ``vlm_ocr``'s ``base_url``): scheme
    http or https, a host (an IPv6 address in brackets), a port in 1-65535 or none, a path or none,
    and nothing else: no credentials (use ``api_key_env``), query, fragment, spaces or control
    characters. Cheap (no network): the config checks it when it loads. Raises ValueError naming
    ``owner`` and ``option``.
    """
    where = f"{owner}: {option}"
    if not isinstance(url, str) or not url.startswith(("http://", "https://")):
        raise ValueError(f"{where} must start with http:// or https://, got {url!r}")
    if any(char.isspace() or not char.isprintable() for char in url):
        raise ValueError(f"{where} must not contain spaces or control characters, got {url!r}")
    try:
        parts = urllib.parse.urlsplit(url)
        port = parts.port  # parsed on access: ValueError for "notaport" or 99999
    except ValueError as error:
        raise ValueError(f"{where} is not a valid URL ({error}), got {url!r}") from None
    if not parts.hostname:
        raise ValueError(f"{where} has no host, got {url!r}")
    if port == 0:
        raise ValueError(f"{where} has port 0, which cannot be connected to, got {url!r}")
    if parts.username is not None or parts.password is not None:
        raise ValueError(f"{where} must not hold credentials (use api_key_env), got {url!r}")
    if "?" in url or "#" in url:
        raise ValueError(f"{where} must not have a query or fragment ('?', '#'), got {url!r}")
    return url.rstrip("/")


def is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def is_number(value: object) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def excerpt(raw: bytes, limit: int = 300) -> str:
    text = raw.decode("utf-8", errors="replace").strip()
    return text if len(text) <= limit else text[:limit] + "..."


def resolve_endpoint(url: str, use_proxy_env: bool, reward: str) -> Endpoint:
    """Resolve ``url`` (and, with ``use_proxy_env``, the environment's proxy for it) once; errors name
    the ``reward``."""
    parts = urllib.parse.urlsplit(url)
    https = parts.scheme == "https"
    host, port = parts.hostname or "", parts.port or (443 if https else 80)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    proxy = urllib.request.getproxies().get(parts.scheme) if use_proxy_env else None
    if not proxy or urllib.request.proxy_bypass(parts.netloc):
        return Endpoint(https, host, port, path)
    proxy_parts = urllib.parse.urlsplit(proxy if "://" in proxy else f"http://{proxy}")
    if proxy_parts.scheme != "http" or not proxy_parts.hostname:
        raise ValueError(
            f"{reward}: the {parts.scheme}_proxy from the environment must be an http:// proxy, got "
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
        return Endpoint(True, proxy_host, proxy_port, path, tunnel=(host, port), proxy_headers=headers)
    return Endpoint(False, proxy_host, proxy_port, url, proxy_headers=headers)


class _DeadlineMixin:
    """An ``http.client`` connection whose every socket operation ends by ``deadline``.

    Before each connect, send and read, the socket timeout is set to the time left (``sendall``
    counts its timeout over the whole call); once it is spent, TimeoutError. Reads go through
    `DeadlineReader`, so a server that trickles the status line, the headers or the body cannot
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
        return io.BufferedReader(DeadlineReader(self._sock, self._deadline))


class DeadlineReader(io.RawIOBase):
    """Raw reads from a socket, each waiting at most until ``deadline``; TimeoutError after it.

    The client reads an answer through it; the reward server reads each request through one,
    moving ``deadline`` when a request begins.
    """

    def __init__(self, sock: socket.socket, deadline: float) -> None:
        self._sock = sock
        # The socket's own raw file keeps the descriptor open after http.client closes the
        # connection object (it does that when the answer ends with the connection).
        self._raw = sock.makefile("rb", buffering=0)
        self.deadline = deadline
        """``time.monotonic()`` by which every read must be over."""

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int | None:
        self._sock.settimeout(_time_left(self.deadline))
        return self._raw.readinto(buffer)

    def close(self) -> None:
        self._raw.close()
        super().close()


def _host_port(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


def _time_left(deadline: float) -> float:
    """Seconds until ``deadline`` (a ``time.monotonic()`` value); TimeoutError once it has passed."""
    left = deadline - time.monotonic()
    if left <= 0:
        raise TimeoutError("the request's deadline has passed")
    return left
