"""HPACK (RFC 7541): the header blocks of kvindex's gRPC server, read from Envoy and written back.

Invariants:
- ``Decoder`` keeps the peer's dynamic table exactly as RFC 7541 §4 defines it: entries of
  ``len(name) + len(value) + 32`` bytes, newest first, evicted oldest first; its size never
  exceeds the limit this side advertised (``SETTINGS_HEADER_TABLE_SIZE``), and a size update
  above it is a ``HpackError``. Steady traffic from one peer (Envoy) is mostly one-byte indexed
  references into that table, so Huffman decoding runs only on a header's first appearance.
- Every malformed block (a bad index, a truncated integer or string, Huffman padding that is not
  the EOS prefix, an EOS symbol, a size update past the first representation, a header list over
  ``max_list_bytes``) raises ``HpackError``: the connection answers COMPRESSION_ERROR. A failed
  block may leave the table changed: the connection is then closed, never reused.
- The Huffman code is canonical (RFC 7541 Appendix B): it is rebuilt here from its 257 code
  lengths, the only table this module carries besides the 61 static entries (Appendix A).
- ``literal`` encodes a header as a literal never touching the peer's table and without Huffman:
  what this side sends needs no encoder state.
"""

from __future__ import annotations

from collections import deque

STATIC = (
    (b":authority", b""), (b":method", b"GET"), (b":method", b"POST"), (b":path", b"/"),
    (b":path", b"/index.html"), (b":scheme", b"http"), (b":scheme", b"https"), (b":status", b"200"),
    (b":status", b"204"), (b":status", b"206"), (b":status", b"304"), (b":status", b"400"),
    (b":status", b"404"), (b":status", b"500"), (b"accept-charset", b""), (b"accept-encoding", b"gzip, deflate"),
) + tuple((name.encode(), b"") for name in (
    "accept-language accept-ranges accept access-control-allow-origin age allow authorization cache-control "
    "content-disposition content-encoding content-language content-length content-location content-range "
    "content-type cookie date etag expect expires from host if-match if-modified-since if-none-match if-range "
    "if-unmodified-since last-modified link location max-forwards proxy-authenticate proxy-authorization range "
    "referer refresh retry-after server set-cookie strict-transport-security transfer-encoding user-agent vary "
    "via www-authenticate").split())
"""RFC 7541 Appendix A: index 1 is ``STATIC[0]``."""

CODE_LENGTHS = (
    13, 23, 28, 28, 28, 28, 28, 28, 28, 24, 30, 28, 28, 30, 28, 28, 28, 28, 28, 28, 28, 28, 30, 28, 28, 28, 28,
    28, 28, 28, 28, 28, 6, 10, 10, 12, 13, 6, 8, 11, 10, 10, 8, 11, 8, 6, 6, 6, 5, 5, 5, 6, 6, 6, 6, 6, 6, 6, 7,
    8, 15, 6, 12, 10, 13, 6, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 7, 8, 7, 8, 13, 19,
    13, 14, 6, 15, 5, 6, 5, 6, 5, 6, 6, 6, 5, 7, 7, 6, 6, 6, 5, 6, 7, 6, 5, 5, 6, 7, 7, 7, 7, 7, 15, 11, 14, 13,
    28, 20, 22, 20, 20, 22, 22, 22, 23, 22, 23, 23, 23, 23, 23, 24, 23, 24, 24, 22, 23, 24, 23, 23, 23, 23, 21,
    22, 23, 22, 23, 23, 24, 22, 21, 20, 22, 22, 23, 23, 21, 23, 22, 22, 24, 21, 22, 23, 23, 21, 21, 22, 21, 23,
    22, 23, 23, 20, 22, 22, 22, 23, 22, 22, 23, 26, 26, 20, 19, 22, 23, 22, 25, 26, 26, 26, 27, 27, 26, 24, 25,
    19, 21, 26, 27, 27, 26, 27, 24, 21, 21, 26, 26, 28, 27, 27, 27, 20, 24, 20, 21, 22, 21, 21, 23, 22, 22, 25,
    25, 24, 24, 26, 23, 26, 27, 26, 26, 27, 27, 27, 27, 27, 28, 27, 27, 27, 27, 27, 26, 30)
"""RFC 7541 Appendix B: the Huffman code length of each symbol 0..255 and EOS (256)."""
EOS = 256
ENTRY_OVERHEAD = 32


class HpackError(ValueError):
    """A header block that cannot be decoded (the connection's COMPRESSION_ERROR)."""


class _Huffman:
    """The canonical Huffman decoder: per code length, the first code, how many, where they start."""

    def __init__(self, lengths: tuple[int, ...]) -> None:
        self.symbols = sorted(range(len(lengths)), key=lambda s: (lengths[s], s))
        self.first: dict[int, tuple[int, int, int]] = {}  # length -> (first code, count, offset)
        code, prev = 0, lengths[self.symbols[0]]
        for i, s in enumerate(self.symbols):
            if i:
                code = (code + 1) << (lengths[s] - prev)
            prev = lengths[s]
            if lengths[s] not in self.first:
                self.first[lengths[s]] = (code, 0, i)
            first, count, offset = self.first[lengths[s]]
            self.first[lengths[s]] = (first, count + 1, offset)
        self.lengths = sorted(self.first)

    def decode(self, data: bytes) -> bytes:
        """Byte by byte: the accumulator never holds more than 37 bits (linear in ``data``)."""
        out = bytearray()
        acc = bits = 0
        for byte in data:
            acc, bits = (acc << 8) | byte, bits + 8
            while True:
                symbol, used = self._next(acc, bits)
                if symbol is None:
                    break
                if symbol == EOS:
                    raise HpackError("Huffman string contains EOS")
                out.append(symbol)
                bits -= used
                acc &= (1 << bits) - 1
        if bits >= 8 or acc != (1 << bits) - 1:  # padding: under 8 bits, all ones (EOS's prefix)
            raise HpackError("Huffman string has bad padding")
        return bytes(out)

    def _next(self, acc: int, left: int) -> tuple[int | None, int]:
        for length in self.lengths:
            if length > left:
                return None, 0
            code = (acc >> (left - length)) & ((1 << length) - 1)
            first, count, offset = self.first[length]
            if code < first + count:
                return self.symbols[offset + code - first], length
        return None, 0


HUFFMAN = _Huffman(CODE_LENGTHS)


def read_int(block: bytes, pos: int, prefix: int) -> tuple[int, int]:
    """The integer at ``pos`` with a ``prefix``-bit prefix (RFC 7541 §5.1) and the position after it."""
    if pos >= len(block):
        raise HpackError("header block truncated")
    mask = (1 << prefix) - 1
    value = block[pos] & mask
    pos += 1
    if value < mask:
        return value, pos
    shift = 0
    while True:
        if pos >= len(block) or shift > 28:
            raise HpackError("header block integer truncated or too large")
        byte = block[pos]
        pos += 1
        value += (byte & 0x7F) << shift
        shift += 7
        if not byte & 0x80:
            return value, pos


def read_string(block: bytes, pos: int) -> tuple[bytes, int]:
    if pos >= len(block):
        raise HpackError("header block truncated")
    huffman = block[pos] & 0x80
    length, pos = read_int(block, pos, 7)
    end = pos + length
    if end > len(block):
        raise HpackError("header string truncated")
    raw = block[pos:end]
    return (HUFFMAN.decode(raw) if huffman else raw), end


class Decoder:
    """One connection's inbound header decoding (RFC 7541 §2.3, §6)."""

    def __init__(self, max_table_bytes: int = 4096, max_list_bytes: int = 64 << 10) -> None:
        self.max_table_bytes = max_table_bytes  # what SETTINGS_HEADER_TABLE_SIZE told the peer
        self.max_list_bytes = max_list_bytes
        self.table_limit = max_table_bytes  # the peer's current limit (a size update lowers it)
        self._table: deque[tuple[bytes, bytes]] = deque()
        self.table_bytes = 0

    def _entry(self, index: int) -> tuple[bytes, bytes]:
        if 1 <= index <= len(STATIC):
            return STATIC[index - 1]
        dynamic = index - len(STATIC) - 1
        if 0 <= dynamic < len(self._table):
            return self._table[dynamic]
        raise HpackError(f"header index {index} is not in the tables")

    def _insert(self, name: bytes, value: bytes) -> None:
        size = len(name) + len(value) + ENTRY_OVERHEAD
        self._evict_to(self.table_limit - size)
        if size <= self.table_limit:
            self._table.appendleft((name, value))
            self.table_bytes += size

    def _evict_to(self, limit: int) -> None:
        while self._table and self.table_bytes > max(limit, 0):
            name, value = self._table.pop()
            self.table_bytes -= len(name) + len(value) + ENTRY_OVERHEAD

    def decode(self, block: bytes) -> list[tuple[bytes, bytes]]:
        headers: list[tuple[bytes, bytes]] = []
        pos, total, first = 0, 0, True
        while pos < len(block):
            byte = block[pos]
            if byte & 0x80:  # indexed
                index, pos = read_int(block, pos, 7)
                header = self._entry(index)
            elif byte & 0xE0 == 0x20:  # dynamic table size update: only before the first header
                size, pos = read_int(block, pos, 5)
                if not first or size > self.max_table_bytes:
                    raise HpackError(f"table size update to {size} not allowed here")
                self.table_limit = size
                self._evict_to(size)
                continue
            else:
                header, pos = self._literal(block, pos, byte)
            first = False
            total += len(header[0]) + len(header[1]) + ENTRY_OVERHEAD
            if total > self.max_list_bytes:
                raise HpackError(f"header list over {self.max_list_bytes} bytes")
            headers.append(header)
        return headers

    def _literal(self, block: bytes, pos: int, byte: int) -> tuple[tuple[bytes, bytes], int]:
        indexing = byte & 0xC0 == 0x40
        index, pos = read_int(block, pos, 6 if indexing else 4)
        if index:
            name = self._entry(index)[0]
        else:
            name, pos = read_string(block, pos)
        value, pos = read_string(block, pos)
        if indexing:
            self._insert(name, value)
        return (name, value), pos


def write_int(value: int, prefix: int, flags: int = 0) -> bytes:
    """``value`` with a ``prefix``-bit prefix, the prefix byte's other bits ``flags`` (§5.1)."""
    mask = (1 << prefix) - 1
    if value < mask:
        return bytes([flags | value])
    out = bytearray([flags | mask])
    value -= mask
    while value >= 0x80:
        out.append((value & 0x7F) | 0x80)
        value >>= 7
    out.append(value)
    return bytes(out)


def literal(name: bytes, value: bytes) -> bytes:
    """One header as a literal without indexing, new name, no Huffman (§6.2.2)."""
    return b"\x00" + write_int(len(name), 7) + name + write_int(len(value), 7) + value


STATUS_200 = b"\x88"  # ":status: 200", static index 8
