"""The parent <-> worker channel's framing: a message is a few frames on a Unix stream socket.

On the wire (both ends on one host: native sizes, little-endian lengths), one message is::

    u8 frame count (1..MAX_FRAMES) | per frame: u32 length | that many bytes

A request is ``[request id, msgpack request]`` plus, for ``Match`` only, the packed keys; a reply
is ``[request id, msgpack reply]`` (``kvindex.shard.channel`` says what the frames hold).

Invariants:
- ``framed`` and ``read_message`` are each other's inverse; a message is written with one
  ``write`` call, so messages from concurrent tasks never interleave on a stream.
- A frame count out of range is ``BrokenFraming``: nothing after it on that stream can be
  trusted, so its reader closes the stream. A stream that ends inside a message raises
  ``asyncio.IncompleteReadError`` (at a message boundary too: the peer closed it).
"""

from __future__ import annotations

import asyncio
import struct
from collections.abc import Sequence

MAX_FRAMES = 4
_COUNT = struct.Struct("<B")
_LENGTH = struct.Struct("<I")
_JOIN_BELOW = 1 << 16  # a frame up to this size is read with the next length (then copied out)


class BrokenFraming(ValueError):
    """The stream is not framed as ``framed`` writes it (its reader closes it)."""


def framed(frames: Sequence[bytes]) -> bytes:
    """One message's bytes."""
    if not 1 <= len(frames) <= MAX_FRAMES:
        raise ValueError(f"a message is 1..{MAX_FRAMES} frames, not {len(frames)}")
    parts = [_COUNT.pack(len(frames))]
    for frame in frames:
        parts += (_LENGTH.pack(len(frame)), frame)
    return b"".join(parts)


async def read_message(reader: asyncio.StreamReader) -> list[bytes]:
    """The next message's frames. Each read takes a frame with the length of the next one (the
    count with the first length): a message of n frames is n + 1 reads, not 2n + 1 (each read is a
    coroutine step on the channel's hot path, ~1.5 us)."""
    head = await reader.readexactly(_COUNT.size + _LENGTH.size)
    (count,) = _COUNT.unpack_from(head)
    if not 1 <= count <= MAX_FRAMES:
        raise BrokenFraming(f"a message of {count} frames (1..{MAX_FRAMES})")
    (size,) = _LENGTH.unpack_from(head, _COUNT.size)
    frames = []
    for _ in range(count - 1):
        if size > _JOIN_BELOW:  # a big frame (an Apply, a restore) is not copied out of a joined read
            frames.append(await reader.readexactly(size))
            (size,) = _LENGTH.unpack(await reader.readexactly(_LENGTH.size))
            continue
        chunk = await reader.readexactly(size + _LENGTH.size)
        frames.append(chunk[:size])
        (size,) = _LENGTH.unpack_from(chunk, size)
    frames.append(await reader.readexactly(size))
    return frames
