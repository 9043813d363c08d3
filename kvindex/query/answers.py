"""What a query answers: per pod, each index's matched prefix, and the errors a query can raise.

Plain values, built by ``kvindex.query.service.QueryService`` and read by the decisions, the drift audit
and the HTTP layer (which turns ``QueryError`` into a 4xx naming the field). Invariants: immutable
(a ``PreciseAnswer``'s ``keys`` are the ``array("Q")`` ``kvindex.keys`` made for it, which nothing
writes: no Python int per key is made unless a reader asks for one);
``ratio`` is a fraction of the prompt's tokens (precise) or of its approximate blocks; ``drift`` is
the approximate fraction minus the precise one for the same pod.

Tiers in a precise answer (``PodMatch``'s depths are cumulative: gpu, gpu+cpu, any tier):
``blocks``/``tokens``/``ratio`` are the device's; ``total_blocks``/``total_tokens`` the prefix held
block by block on any tier (what vLLM's ``cached_tokens`` counts with CPU offloading on: it loads
those back); ``tier_blocks`` splits the total as Dynamo's tiered answer does (device, then what the
host tier adds past it, then disk); ``tier_score`` weighs those by ``TierWeights``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvindex.settings import TierWeights
from kvindex.types import PodMatch


def cacheable_tokens(token_ids: Sequence[int]) -> int:
    """vLLM never serves the block holding the last prompt token from cache."""
    return max(len(token_ids) - 1, 0)


class QueryError(ValueError):
    """A query that cannot be answered; ``field`` names the offending input, ``status`` the HTTP code."""

    def __init__(self, message: str, field: str | None = None, status: int = 400, reason: str = "bad_request") -> None:
        super().__init__(message)
        self.field = field
        self.status = status
        self.reason = reason


@dataclass(frozen=True, slots=True)
class PreciseAnswer:
    block_size: int  # 0 when no engine has published a block of the model yet
    prompt_tokens: int
    keys: Sequence[int]  # keys of the blocks that may be served from cache (an array("Q") nobody writes, or ())
    matches: dict[str, PodMatch]
    root: int = 0

    def blocks(self, pod: str) -> int:
        m = self.matches.get(pod)
        return m.gpu if m else 0

    def ratio(self, pod: str) -> float:
        return self.blocks(pod) * self.block_size / self.prompt_tokens if self.prompt_tokens else 0.0


@dataclass(frozen=True, slots=True)
class ApproxAnswer:
    hashes: tuple[int, ...]
    blocks: dict[str, int]
    scores: dict[str, float]

    def ratio(self, pod: str) -> float:
        return self.blocks.get(pod, 0) / len(self.hashes) if self.hashes else 0.0


@dataclass(frozen=True, slots=True)
class PodAnswer:
    pod: str
    precise: PreciseAnswer | None
    approx: ApproxAnswer | None

    def to_json(self, weights: TierWeights = TierWeights()) -> dict[str, Any]:
        out: dict[str, Any] = {"precise": None, "approx": None}
        if self.precise is not None:
            p = self.precise
            out["precise"] = {"blocks": p.blocks(self.pod), "tokens": p.blocks(self.pod) * p.block_size,
                              "ratio": round(p.ratio(self.pod), 6)}
            m = p.matches.get(self.pod)
            if m is not None and (m.cpu > m.gpu or m.disk > m.gpu):
                out["precise"].update(cpu_tokens=m.cpu * p.block_size, disk_tokens=m.disk * p.block_size)
            out["precise"].update(tier_fields(m, p.block_size, weights))
        if self.approx is not None:
            out["approx"] = {"blocks": self.approx.blocks.get(self.pod, 0), "score": self.approx.scores.get(self.pod, 0)}
        out["drift"] = self.drift()
        return out

    def drift(self) -> float | None:
        if self.precise is None or self.approx is None:
            return None
        return round(self.approx.ratio(self.pod) - self.precise.ratio(self.pod), 6)


def tier_fields(m: PodMatch | None, block_size: int, weights: TierWeights) -> dict[str, Any]:
    """A pod's match over every tier (see the module's docstring), for a precise answer."""
    device, host, total = (m.gpu, m.cpu, m.disk) if m is not None else (0, 0, 0)
    split = {"device": device, "host": host - device, "disk": total - host}
    score = weights.device_weight * split["device"] + weights.host_weight * split["host"] + weights.disk_weight * split["disk"]
    return {"total_blocks": total, "total_tokens": total * block_size, "tier_blocks": split, "tier_score": round(score, 6)}
