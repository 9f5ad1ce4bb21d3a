"""The HTTP connection layer: uvicorn's h11 protocol with a header deadline and a connection limit.

uvicorn closes a kept-alive connection that stays idle between requests, but a connection that opens and then
sends nothing, or sends its headers a byte at a time, stays open for ever; a few hundred of them use up the
process's file descriptors and lock everyone out, /health included. Here every request's headers must be
complete within `read_timeout` seconds of their first byte (or of the connection opening); the body's deadline
is the app's (quasar.serve.app.Guard). At `max_connections`, a new connection closes the idle one (between
requests, or yet to send one) that has been quiet longest; when every one is mid-request, the newcomer gets HTTP 503
and is closed.
"""

from __future__ import annotations

import asyncio
import logging
import math
import os
import resource
import time
from typing import Any, NamedTuple

from uvicorn.protocols.http.h11_impl import H11Protocol

log = logging.getLogger("quasar")
TIMEOUT_RESPONSE = b"HTTP/1.1 408 Request Timeout\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
FULL_RESPONSE = b"HTTP/1.1 503 Service Unavailable\r\nconnection: close\r\ncontent-length: 0\r\n\r\n"
FD_RESERVE = 16  # descriptors kept for files the process opens later (logs, checkpoints)
MAX_CONNECTIONS = 1024


class GuardedH11Protocol(H11Protocol):
    def __init__(self, *args: Any, read_timeout: float, max_connections: int, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.read_timeout, self.max_connections = read_timeout, max_connections
        self.last_active = time.monotonic()  # when the connection opened, sent bytes or got an answer
        self.header_timer: asyncio.TimerHandle | None = None
        self.awaited: object = None  # the request cycle current when the header timer started

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        if len(self.connections) >= self.max_connections and not self._close_quietest_idle():
            transport.write(FULL_RESPONSE)
            transport.close()
            return
        super().connection_made(transport)
        self._start_header_timer()

    def data_received(self, data: bytes) -> None:
        self.last_active = time.monotonic()
        if self.header_timer is None and self.idle:
            self._start_header_timer()
        super().data_received(data)
        if self.header_timer is not None and self.cycle is not self.awaited:  # the headers are in
            self._stop_header_timer()

    def connection_lost(self, exc: Exception | None) -> None:
        self._stop_header_timer()
        if self.transport is not None:  # None: refused in connection_made, never registered
            super().connection_lost(exc)

    def on_response_complete(self) -> None:
        self.last_active = time.monotonic()
        super().on_response_complete()

    @property
    def idle(self) -> bool:
        """No request is being received or answered on this connection."""
        return self.cycle is None or self.cycle.response_complete

    def _start_header_timer(self) -> None:
        self.awaited = self.cycle
        self.header_timer = self.loop.call_later(self.read_timeout, self._headers_late)

    def _stop_header_timer(self) -> None:
        if self.header_timer is not None:
            self.header_timer.cancel()
            self.header_timer = None

    def _headers_late(self) -> None:
        self.header_timer = None
        if self.cycle is self.awaited and not self.transport.is_closing():
            self.transport.write(TIMEOUT_RESPONSE)
            self.transport.close()

    def _close_quietest_idle(self) -> bool:
        idle = [c for c in self.connections if isinstance(c, GuardedH11Protocol) and c.idle]
        if not idle:
            return False
        quietest = min(idle, key=lambda c: c.last_active)  # a client between requests outlives a silent socket
        quietest.transport.close()
        self.connections.discard(quietest)
        return True


class Limits(NamedTuple):
    connections: int  # open connections at most
    backlog: int  # the listen queue, also how many connections asyncio accepts in one go


def connection_limits(requested: int | None) -> Limits:
    """The connection limit and listen backlog that keep the process within its open-file limit (raised to the
    hard limit first): asyncio accepts up to `backlog` connections before any of them is seen, and a closed one
    frees its descriptor a loop turn later, so the limit leaves room for a few backlogs on top."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != resource.RLIM_INFINITY and (hard == resource.RLIM_INFINITY or soft < hard):
        try:
            soft = max(soft, 65536 if hard == resource.RLIM_INFINITY else min(hard, 65536))
            resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        except (ValueError, OSError):
            soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    free = 65536 if soft == resource.RLIM_INFINITY else soft - open_files() - FD_RESERVE
    backlog = min(2048, max(4, free // 8))
    allowed = max(4, min(MAX_CONNECTIONS, free - 3 * backlog))
    if requested is not None and requested > allowed:
        log.warning("--max-connections %d is over what the open-file limit allows; using %d", requested, allowed)
    return Limits(allowed if requested is None else min(requested, allowed), backlog)


def open_files() -> int:
    try:
        return len(os.listdir("/proc/self/fd"))
    except OSError:  # not Linux: assume a few dozen
        return 32


class OncePerInterval(logging.Filter):
    """Lets a repeated asyncio message through once per `interval` seconds: when the process runs out of file
    descriptors, asyncio logs one traceback per connection it could not accept, thousands a second."""

    def __init__(self, interval: float = 10.0) -> None:
        super().__init__()
        self.interval, self.last = interval, -math.inf

    def filter(self, record: logging.LogRecord) -> bool:
        if "out of system resource" not in record.getMessage():
            return True
        now = time.monotonic()
        if now - self.last < self.interval:
            return False
        self.last = now
        record.exc_info, record.exc_text = None, None
        return True
