"""The HTTP transport of the rewards that call a server (``vlm_ocr``, ``http``): standard library only.

Every attempt has one overall deadline: connecting, sending the request and reading the whole
answer must end within it (a per-read socket timeout alone would let a server that trickles one
byte a second keep a request alive for ever). `send_once` makes one attempt and sorts its outcome:
a 2xx body, a refusal worth no retry (a description), or `TransientError` (timeouts, connection
errors, HTTP 408/425/429/5xx), which the rewards retry with backoff.
"""

from __future__ import annotations

import base64
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
    "Endpoint",
    "TransientError",
    "excerpt",
    "is_int",
    "is_number",
    "resolve_endpoint",
    "send_once",
]

# Statuses a server returns while overloaded or restarting: worth another try.
RETRYABLE_STATUS = frozenset({408, 425, 429, 500, 502, 503, 504})


class TransientError(Exception):
    """One attempt failed in a way a later attempt may not (message only; the HTTP rewards retry it)."""


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
) -> bytes | str:
    """One HTTP attempt under one deadline (connect, send and read the whole answer).

    Returns the body of a 2xx answer, or a description of a refusal (3xx/4xx that are not worth
    retrying, with ``describe(body)``); raises `TransientError` for timeouts, connection errors and
    retryable statuses."""
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
        raise TransientError(
            f"no {waiting_for} within {timeout_s:g} s (the deadline for connecting, sending "
            "and reading the whole answer)"
        ) from None
    except (OSError, http.client.HTTPException) as error:
        # Connection refused or reset, server closed mid-answer, truncated body: transient.
        raise TransientError(f"{type(error).__name__}: {error}") from None
    finally:
        connection.close()
    if 200 <= response.status < 300:
        return raw
    message = f"HTTP {response.status} {response.reason}: {describe(raw)}"
    if response.status in RETRYABLE_STATUS:
        raise TransientError(message)
    if 300 <= response.status < 400:
        message += f" (redirects are not followed; Location: {response.getheader('Location')})"
    return message


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
