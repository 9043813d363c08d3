"""The engine dialects kvindex speaks, by name (``DIALECTS``): only the composition root
(``kvindex.daemon``, and a shard worker) picks one.

A dialect fixes what differs between engines that share vLLM's framing: where a stream's seq
starts, and how a byte-string block hash maps to a u64.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from adapters.vllm import VllmDecoder
from adapters.vllm_fields import first8_signed, last8_be
from kvindex.events import Decoder


@dataclass(frozen=True, slots=True)
class Dialect:
    name: str
    first_seq: int
    bytes_hash: Callable[[bytes], int]

    def decoder(self) -> Decoder:
        return VllmDecoder(self.bytes_hash)


DIALECTS: dict[str, Dialect] = {
    "vllm": Dialect("vllm", first_seq=0, bytes_hash=last8_be),
    "sglang": Dialect("sglang", first_seq=0, bytes_hash=first8_signed),
    "llmd-sim": Dialect("llmd-sim", first_seq=1, bytes_hash=last8_be),
}
