"""HTTP/2's vocabulary for ``kvindex.route.h2``: frame types, flags, error codes, settings, the
limits a connection enforces, one stream's state, and the frame writer (RFC 9113 §4, §6, §7).

Invariants: values only, no I/O; ``frame`` writes one frame exactly as §4.1 lays it out.
"""

from __future__ import annotations

import struct
from collections import deque
from dataclasses import dataclass, field

PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n"
DATA, HEADERS, PRIORITY, RST_STREAM, SETTINGS, PUSH_PROMISE, PING, GOAWAY, WINDOW_UPDATE, CONTINUATION = range(10)
END_STREAM, ACK, END_HEADERS, PADDED, PRIORITY_FLAG = 0x1, 0x1, 0x4, 0x8, 0x20
NO_ERROR, PROTOCOL_ERROR, INTERNAL_ERROR, FLOW_CONTROL_ERROR = 0x0, 0x1, 0x2, 0x3
STREAM_CLOSED, FRAME_SIZE_ERROR, REFUSED_STREAM, CANCEL, COMPRESSION_ERROR = 0x5, 0x6, 0x7, 0x8, 0x9
S_HEADER_TABLE_SIZE, S_MAX_CONCURRENT_STREAMS, S_INITIAL_WINDOW_SIZE, S_MAX_FRAME_SIZE, S_MAX_HEADER_LIST = 1, 3, 4, 5, 6
DEFAULT_WINDOW, DEFAULT_FRAME, MAX_WINDOW = 65535, 16384, (1 << 31) - 1


@dataclass(frozen=True, slots=True)
class Limits:
    max_streams: int = 1024
    stream_window: int = 4 << 20  # bytes a stream may send before we reopen its window
    connection_window: int = 64 << 20
    max_frame: int = 1 << 20  # SETTINGS_MAX_FRAME_SIZE we accept (the peer sends fewer, larger frames)
    max_header_bytes: int = 64 << 10
    max_pending_bytes: int = 256 << 20  # outbound bytes waiting for the peer's windows, per connection


class ProtocolViolation(Exception):
    """A connection error: GOAWAY with ``code``, ``reason`` its metric label."""

    def __init__(self, code: int, reason: str) -> None:
        super().__init__(reason)
        self.code, self.reason = code, reason


@dataclass(slots=True)
class StreamState:
    send_window: int
    recv_unacked: int = 0
    remote_ended: bool = False
    local_ended: bool = False
    pending: deque[tuple[int, bytes, bool]] = field(default_factory=deque)  # (frame type, payload, end)


def frame(kind: int, flags: int, sid: int, payload: bytes = b"") -> bytes:
    return struct.pack(">I", len(payload))[1:] + bytes((kind, flags)) + struct.pack(">I", sid) + payload
