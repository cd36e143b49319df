"""uvicorn's h11 protocol with the two guards it lacks: a deadline for a request's headers (a
connection that never finishes them, or never sends anything, is closed instead of held forever),
and oversized or malformed headers answered with their own status (431, 400) and an OpenAI-shaped
body instead of uvicorn's plain-text 400.
"""

from __future__ import annotations

import asyncio
import json

import h11
from uvicorn.protocols.http.h11_impl import DEFAULT_MAX_INCOMPLETE_EVENT_SIZE, H11Protocol

_REASONS = {400: b"Bad Request", 408: b"Request Timeout", 431: b"Request Header Fields Too Large"}


class _Connection(h11.Connection):
    """Remembers the status h11 suggests for the last protocol error (431 for headers too large)."""

    error_status = 400

    def next_event(self):
        try:
            return super().next_event()
        except h11.RemoteProtocolError as e:
            self.error_status = e.error_status_hint
            raise


def guarded_protocol(header_timeout: float) -> type[H11Protocol]:
    """The protocol class to pass as uvicorn.Config(http=...)."""

    class GuardedH11Protocol(H11Protocol):
        def __init__(self, config, server_state, app_state, _loop=None):
            super().__init__(config, server_state, app_state, _loop)
            size = config.h11_max_incomplete_event_size or DEFAULT_MAX_INCOMPLETE_EVENT_SIZE
            self.conn = _Connection(h11.SERVER, size)
            self._max_head = size
            self._header_timer: asyncio.TimerHandle | None = None

        # -- the header deadline: armed while waiting for a request's headers -------------------
        def _arm(self) -> None:
            self._disarm()
            self._header_timer = self.loop.call_later(header_timeout, self._headers_too_slow)

        def _disarm(self) -> None:
            if self._header_timer is not None:
                self._header_timer.cancel()
                self._header_timer = None

        def _headers_too_slow(self) -> None:
            self._header_timer = None
            if self.conn.their_state != h11.IDLE:
                return  # a request is past its headers (a slow body is the application's concern)
            if self.conn.trailing_data[0]:
                self._reply(408, "request headers not received in time")
            else:
                self.transport.close()  # nothing sent: an idle connection, just closed

        def connection_made(self, transport) -> None:
            super().connection_made(transport)
            self._arm()

        def connection_lost(self, exc) -> None:
            self._disarm()
            super().connection_lost(exc)

        def handle_events(self) -> None:
            had_cycle = self.cycle
            super().handle_events()
            if self.cycle is not had_cycle:  # a request's headers arrived
                self._disarm()

        def on_response_complete(self) -> None:
            super().on_response_complete()
            if not self.transport.is_closing():
                self._arm()  # the next request on this keep-alive connection has the same deadline

        # -- malformed or oversized headers ------------------------------------------------------
        def data_received(self, data: bytes) -> None:
            # h11 enforces its size limit only on a request still incomplete: headers that arrive
            # whole in one read pass it, so the limit is checked here too.
            if self.conn.their_state == h11.IDLE:
                pending = self.conn.trailing_data[0] + data
                end = pending.find(b"\r\n\r\n")
                if (len(pending) if end < 0 else end) > self._max_head:
                    self._reply(431, "request headers too large")
                    return
            super().data_received(data)

        def send_400_response(self, msg: str) -> None:
            status = self.conn.error_status
            if status == 431:
                msg = "request headers too large"
            self._reply(status if status in _REASONS else 400, msg)

        def _reply(self, status: int, message: str) -> None:
            body = json.dumps({"error": {"message": message, "type": "BadRequestError", "param": None,
                                         "code": status}}).encode()
            head = (f"HTTP/1.1 {status} ".encode() + _REASONS.get(status, b"Error") + b"\r\n"
                    b"content-type: application/json\r\nconnection: close\r\n"
                    b"content-length: " + str(len(body)).encode() + b"\r\n\r\n")
            self._disarm()
            self.transport.write(head + body)
            self.transport.close()

    return GuardedH11Protocol
