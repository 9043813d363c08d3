"""Deterministic LLM traffic for benchmarks and tests, plus a file format for engine messages.

Traffic invariants:
- All randomness comes from one ``random.Random(seed)`` owned by the ``Workload``: the same
  arguments always give the same request sequence (no global random, no clock, no hashing of str).
- Each ``Tenant`` has a long system prompt of random token ids; every request of a tenant starts
  with it, so tenants share prefixes within themselves and (almost surely) never across.
- A multi-turn conversation grows: the next prompt is the previous prompt + the (simulated)
  answer + a new user turn, so each turn's prompt is a strict prefix-extension of the last one.
- One-off prompts are system prompt + one user turn and are never continued.
- ``Request.text == render_text(Request.token_ids)`` and the rendering is a prefix-preserving
  homomorphism: if ``a`` is a prefix of ``b`` then ``render_text(a)`` is a prefix of
  ``render_text(b)``, so text-based (approximate) and token-based (precise) indexes see the same
  prefix structure.

Message file format (``write_messages`` / ``read_messages``), all integers big-endian:
``MAGIC`` (8 bytes, ``b"KVIXMSG1"``), then per message: u32 topic length, topic (UTF-8),
u64 seq (exactly the 8 bytes of the wire's second frame), u32 payload length, payload.
One record is one 3-frame ZeroMQ message ``[topic, seq, payload]``, in publish order.
"""

from __future__ import annotations

import dataclasses
import struct
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from random import Random
from typing import BinaryIO

MAGIC = b"KVIXMSG1"
_HEAD = struct.Struct(">I")
_SEQ_LEN = struct.Struct(">QI")


def render_text(token_ids: Iterable[int]) -> str:
    """Deterministic text for token ids: ``w{id}`` words joined by single spaces."""
    return " ".join([f"w{t}" for t in token_ids])


@dataclass(frozen=True, slots=True)
class Tenant:
    """A tenant (application) and the system prompt that starts all its requests."""

    name: str
    system_prompt: tuple[int, ...]


@dataclass(frozen=True, slots=True)
class Request:
    """One prompt. Invariant: ``text == render_text(token_ids)``."""

    tenant: str
    conversation: str
    token_ids: tuple[int, ...]
    text: str


@dataclass(frozen=True, slots=True)
class _Conversation:
    """A live conversation: the last prompt sent and how many more turns it will take."""

    cid: str
    tenant: Tenant
    token_ids: tuple[int, ...]
    text: str
    turns_left: int


class Workload:
    """Endless deterministic request stream over ``tenants`` tenants.

    ``turn_tokens`` / ``answer_tokens`` are inclusive (low, high) lengths of a user turn and of a
    model answer. Each tenant keeps ``conversations_per_tenant`` slots; a non-one-off request
    picks a slot at random, continuing its conversation or starting a new one if it is empty.
    Tenants are picked with weight ``1 / (rank + 1) ** tenant_skew``.
    """

    def __init__(
        self,
        seed: int,
        tenants: int = 32,
        vocab: int = 32000,
        system_tokens: int = 2000,
        turn_tokens: tuple[int, int] = (32, 256),
        answer_tokens: tuple[int, int] = (64, 384),
        one_off_fraction: float = 0.2,
        max_turns: int = 8,
        conversations_per_tenant: int = 4,
        tenant_skew: float = 0.5,
    ) -> None:
        if tenants < 1 or vocab < 2 or max_turns < 1 or conversations_per_tenant < 1:
            raise ValueError("tenants, vocab, max_turns and conversations_per_tenant must be >= 1")
        self._rng = Random(seed)
        self._vocab = vocab
        self._turn = turn_tokens
        self._answer = answer_tokens
        self._one_off = one_off_fraction
        self._max_turns = max_turns
        self.tenants: tuple[Tenant, ...] = tuple(
            Tenant(f"tenant-{i}", self._tokens(system_tokens)) for i in range(tenants)
        )
        self._system_text = {t.name: render_text(t.system_prompt) for t in self.tenants}
        self._weights = [1.0 / (i + 1) ** tenant_skew for i in range(tenants)]
        self._slots: dict[str, list[_Conversation | None]] = {
            t.name: [None] * conversations_per_tenant for t in self.tenants
        }
        self._count = 0

    def _tokens(self, n: int) -> tuple[int, ...]:
        """``n`` uniform token ids in ``[0, vocab)`` (4 random bytes per token, reduced)."""
        raw = self._rng.randbytes(4 * n)
        vocab = self._vocab
        return tuple([w % vocab for w in struct.unpack(f"<{n}I", raw)])

    def _span(self, bounds: tuple[int, int]) -> tuple[int, ...]:
        return self._tokens(self._rng.randint(bounds[0], bounds[1]))

    def _fresh(self, tenant: Tenant, cid: str, turns: int) -> _Conversation:
        """A new conversation's first prompt: system prompt + one user turn."""
        user = self._span(self._turn)
        text = self._system_text[tenant.name] + " " + render_text(user)
        return _Conversation(cid, tenant, tenant.system_prompt + user, text, turns)

    def _continue(self, conv: _Conversation) -> _Conversation:
        """The next turn: previous prompt + answer + new user turn."""
        added = self._span(self._answer) + self._span(self._turn)
        text = conv.text + " " + render_text(added)
        return dataclasses.replace(
            conv, token_ids=conv.token_ids + added, text=text, turns_left=conv.turns_left - 1
        )

    def _pick_tenant(self) -> Tenant:
        return self._rng.choices(self.tenants, weights=self._weights)[0]

    def next_request(self) -> Request:
        """The next request of the stream (advances the generator)."""
        tenant = self._pick_tenant()
        self._count += 1
        if self._rng.random() < self._one_off:
            conv = self._fresh(tenant, f"{tenant.name}/o{self._count}", 0)
        else:
            slots = self._slots[tenant.name]
            slot = self._rng.randrange(len(slots))
            old = slots[slot]
            if old is None:
                turns = self._rng.randint(1, self._max_turns)
                conv = self._fresh(tenant, f"{tenant.name}/c{self._count}", turns - 1)
            else:
                conv = self._continue(old)
            slots[slot] = conv if conv.turns_left > 0 else None
        return Request(tenant.name, conv.cid, conv.token_ids, conv.text)

    def take(self, n: int) -> list[Request]:
        """The next ``n`` requests."""
        return [self.next_request() for _ in range(n)]


def write_messages(path: str | Path, messages: Iterable[tuple[str, int, bytes]]) -> int:
    """Write ``(topic, seq, payload)`` records in the module's framing; return the count."""
    count = 0
    with open(path, "wb") as out:
        out.write(MAGIC)
        for topic, seq, payload in messages:
            raw_topic = topic.encode("utf-8")
            out.write(_HEAD.pack(len(raw_topic)))
            out.write(raw_topic)
            out.write(_SEQ_LEN.pack(seq, len(payload)))
            out.write(payload)
            count += 1
    return count


def _read_exact(src: BinaryIO, n: int) -> bytes:
    data = src.read(n)
    if len(data) != n:
        raise ValueError("truncated message file")
    return data


def read_messages(path: str | Path) -> Iterator[tuple[str, int, bytes]]:
    """Yield the ``(topic, seq, payload)`` records of a file written by ``write_messages``."""
    with open(path, "rb") as src:
        if src.read(len(MAGIC)) != MAGIC:
            raise ValueError(f"{path}: not a kvindex message file")
        while head := src.read(_HEAD.size):
            if len(head) != _HEAD.size:
                raise ValueError("truncated message file")
            (topic_len,) = _HEAD.unpack(head)
            topic = _read_exact(src, topic_len).decode("utf-8")
            seq, payload_len = _SEQ_LEN.unpack(_read_exact(src, _SEQ_LEN.size))
            yield topic, seq, _read_exact(src, payload_len)


def seq_frame(seq: int) -> bytes:
    """The wire's second frame for ``seq``: 8-byte big-endian unsigned."""
    return seq.to_bytes(8, "big")

