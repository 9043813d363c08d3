"""The drift audit: what the router believes next to what the engines hold, per decision and per pod.

Definitions (docs/how-it-works.md repeats them):
- For a request R and a pod P, the *belief* ``b(R, P)`` is the approximate index's matched blocks
  on P divided by R's number of approximate blocks (Kthena's match ratio), and the *truth*
  ``h(R, P)`` is the precise index's matched tokens on P divided by R's prompt tokens (what the
  engine would report as cached). Both lie in [0, 1].
- Per decision (R served by P), before recording: ``approx = b``, ``precise = h``, and when the
  router passes the engine's ``cached_tokens``, ``actual = cached_tokens / prompt_tokens``;
  ``approx_error = approx - actual`` and ``precise_error = precise - actual``; ``drift = b - h``.
- Per pod, continuously: a bounded sample of recent decisions is re-checked on a timer. A
  decision (R, P) is *stale* when ``b(R, P) - h(R, P) >= threshold``: the router still believes
  the prefix is there but the engine evicted it. A pod Q is *unseen* for a sampled request R when
  ``h(R, Q) - b(R, Q) >= threshold``: Q's engine holds R's prefix but the router never recorded it
  for Q. ``threshold`` defaults to 0.5.
- ``summary()["overall"]["decisions"]`` counts the sampled decisions of the window (at most
  ``sample_size``); ``["recorded"]`` counts every decision added in it, sampled or not (per-second
  counts, ``window_seconds`` back). ``prefixes(pod)`` groups the sampled prompts by their first
  block and says how much of each the pod holds and is believed to hold now (the dashboard's
  per-pod view).
- The *belief half-life* of a pod is the Kaplan–Meier median of the time from a decision until
  it is first seen stale (decisions not yet stale are censored at their current age); ``None``
  until half of the decisions are expected to go stale.

Invariants: memory is bounded by ``sample_size`` decisions and ``max_bytes`` (each decision's
ids, hashes, keys and pending token ids, estimated by ``decision_bytes``; the oldest leave first;
a decision over the budget is not sampled) and ``history`` snapshots; re-checks read both stores and never change them; a re-check that cannot
reach the store (``StoreUnavailable``) changes nothing (the timer tries again next period).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any

from kvindex import keys as K
from kvindex.budget import str_bytes
from kvindex.index.protocol import ApproxStore, BlockSizeChanged, PreciseStore, StoreUnavailable
from kvindex.settings import DriftSettings


@dataclass(slots=True)
class Decision:
    """One recorded routing decision and what was predicted for it."""

    t: float
    pod: str
    model: str
    hashes: array  # approximate block hashes (u64)
    keys: array  # precise block keys of the cacheable prompt (u64)
    block_size: int  # 0 while the model's block size was unknown: keys come later from ``pending``
    prompt_tokens: int | None  # as the router reported it (else the token count)
    approx: float
    precise: float | None
    actual: float | None
    stale_at: float | None = None  # first re-check that found it stale
    stale_now: bool = False
    pending: tuple[int, array] | None = None  # (key root, cacheable token ids) until keys exist
    truth_tokens: int = 0  # the prompt's token count, the denominator of the truth h (0: prompt_tokens)
    label: str = ""  # what names the prompt to a person: its cache_salt, else its first characters
    precise_model: str = ""  # the model its keys are of, when not ``model`` (a LoRA adapter's base)

    @property
    def approx_error(self) -> float | None:
        return None if self.actual is None else self.approx - self.actual

    @property
    def precise_error(self) -> float | None:
        return None if self.actual is None or self.precise is None else self.precise - self.actual


@dataclass(slots=True)
class PodDrift:
    stale: int = 0
    unseen: int = 0
    sampled: int = 0


@dataclass(slots=True)
class Snapshot:
    t: float
    pods: dict[str, dict[str, Any]] = field(default_factory=dict)


RECHECK_SLICE = 32  # decisions re-checked between two yields to the event loop
DRIFT_SAMPLE_BYTES = 256 << 20  # what the sample may retain, estimated (decision_bytes)


def decision_bytes(d: Decision) -> int:
    """What a sampled decision retains, an upper bound over its life (pending token ids become at
    most one u64 key each)."""
    pending = 8 * len(d.pending[1]) if d.pending is not None else 0
    return (300 + str_bytes(d.pod) + str_bytes(d.model) + str_bytes(d.precise_model) + str_bytes(d.label)
            + 8 * (len(d.hashes) + len(d.keys))
            + pending)


class DriftAudit:
    def __init__(self, precise: PreciseStore, approx: ApproxStore, settings: DriftSettings,
                 clock: Callable[[], float] = time.time, max_bytes: int = DRIFT_SAMPLE_BYTES) -> None:
        self._precise = precise
        self._approx = approx
        self.settings = settings
        self._clock = clock
        self._sample: deque[Decision] = deque()
        self._sizes: deque[int] = deque()  # decision_bytes of each sampled decision, in order
        self.max_bytes = max_bytes
        self.sample_bytes = 0
        self.pods: dict[str, PodDrift] = {}
        self.history: deque[Snapshot] = deque(maxlen=settings.history)
        self.rechecks = 0
        self._watchers: list[set[str]] = []  # pods forgotten during each running recheck_async
        self._counts: deque[list[int]] = deque()  # [second, decisions added in it], window_seconds back

    def _count(self, now: float) -> None:
        second = int(now)
        if self._counts and self._counts[-1][0] == second:
            self._counts[-1][1] += 1
        else:
            self._counts.append([second, 1])
        while self._counts and self._counts[0][0] < second - self.settings.window_seconds:
            self._counts.popleft()

    def recorded(self, window: float) -> int:
        """Decisions added in the last ``window`` seconds (at most ``window_seconds`` back; whole
        seconds: the second the window starts in counts), sampled or not: the sample keeps
        ``sample_size`` of them, this count is not capped."""
        since = self._clock() - min(window, self.settings.window_seconds)
        return sum(n for second, n in self._counts if second + 1 > since)

    # -- decisions -----------------------------------------------------------------------------
    def add(self, decision: Decision) -> None:
        self._count(self._clock())
        size = decision_bytes(decision)
        if size > self.max_bytes:
            return
        while self._sample and (len(self._sample) >= self.settings.sample_size
                                or self.sample_bytes + size > self.max_bytes):
            self._sample.popleft()
            self.sample_bytes -= self._sizes.popleft()
        self._sample.append(decision)
        self._sizes.append(size)
        self.sample_bytes += size

    def forget_pod(self, pod: str) -> None:
        kept = [(d, n) for d, n in zip(self._sample, self._sizes) if d.pod != pod]
        self._sample = deque(d for d, _ in kept)
        self._sizes = deque(n for _, n in kept)
        self.sample_bytes = sum(self._sizes)
        self.pods.pop(pod, None)
        for forgotten in self._watchers:
            forgotten.add(pod)

    def decisions(self, since: float | None = None) -> list[Decision]:
        return [d for d in self._sample if since is None or d.t >= since]

    # -- belief and truth ----------------------------------------------------------------------
    async def belief(self, d: Decision, pods: Iterable[str]) -> dict[str, float]:
        if not d.hashes:
            return {}
        blocks = await self._approx.depth(d.model, d.hashes, pods)  # every pod's belief: no top-k cut-off
        return {p: n / len(d.hashes) for p, n in blocks.items()}

    async def truth(self, d: Decision, pods: Iterable[str] | None) -> dict[str, float]:
        if d.pending is not None:
            await self._resolve_keys(d)
        tokens = d.truth_tokens or d.prompt_tokens
        if not d.keys or not tokens:
            return {}
        pods = None if pods is None else list(pods)
        try:
            matches = await self._precise.match(d.keys, pods, model=d.precise_model or d.model)
        except BlockSizeChanged:  # the keys keep the decision's block size: what engines hold of them now
            matches = await self._precise.match(d.keys, pods, model=d.precise_model or d.model)
        return {p: m.gpu * d.block_size / tokens for p, m in matches.items()}

    async def _resolve_keys(self, d: Decision) -> None:
        """A decision made before any engine published the model's blocks gets its keys now."""
        bs = await self._precise.block_size(d.precise_model or d.model)
        if bs is None or d.pending is None:
            return
        root, tokens = d.pending
        d.keys, d.block_size, d.pending = K.prompt_keys(root, tokens, bs), bs, None

    # -- re-check ------------------------------------------------------------------------------
    async def recheck(self) -> Snapshot:
        """Re-evaluate every sampled decision against both stores now (in one go: for tests and
        small samples; the timer and the HTTP handler use ``recheck_async``)."""
        now = self._clock()
        sample = list(self._sample)
        th = self.settings.threshold
        return await self._commit(now, sample, [await self._recheck_one(d, th) for d in sample], set())

    async def recheck_async(self, every: int = RECHECK_SLICE) -> Snapshot:
        """``recheck`` yielding the event loop every ``every`` decisions (2048 decisions x 64 pods
        take most of a second). Results go to locals and are swapped in at the end, so readers
        never see a half-done re-check. It re-checks the sample as it was when it started
        (decisions added meanwhile wait for the next re-check); a pod forgotten meanwhile is left
        out of the results."""
        now = self._clock()
        sample = list(self._sample)
        th = self.settings.threshold
        forgotten: set[str] = set()
        self._watchers.append(forgotten)
        try:
            results: list[tuple[bool, list[str]]] = []
            for i, d in enumerate(sample):
                if i and i % every == 0:
                    await asyncio.sleep(0)
                results.append(await self._recheck_one(d, th))
            return await self._commit(now, sample, results, forgotten)
        finally:
            self._watchers = [w for w in self._watchers if w is not forgotten]

    async def _recheck_one(self, d: Decision, th: float) -> tuple[bool, list[str]]:
        """One decision: is it stale, and the pods for which its request is unseen. Reads both
        stores and changes nothing (but ``d``'s late-resolved keys)."""
        b = (await self.belief(d, [d.pod])).get(d.pod, 0.0)
        h = (await self.truth(d, [d.pod])).get(d.pod, 0.0)
        return d.precise is not None and b - h >= th, await self._unseen_pods(d, th)

    async def _commit(self, now: float, sample: list[Decision], results: list[tuple[bool, list[str]]],
                forgotten: set[str]) -> Snapshot:
        pods: dict[str, PodDrift] = {}
        for d, (stale, unseen) in zip(sample, results):
            if d.pod in forgotten:
                continue
            mine = pods.setdefault(d.pod, PodDrift())
            mine.sampled += 1
            mine.stale += stale
            for q in unseen:
                if q not in forgotten:
                    pods.setdefault(q, PodDrift()).unseen += 1
        held = await self._held(pods)  # before anything changes: a failed read leaves the last re-check
        for d, (stale, _) in zip(sample, results):
            if d.pod not in forgotten:
                d.stale_now = stale
                if stale and d.stale_at is None:
                    d.stale_at = now
        self.pods = {p: v for p, v in pods.items() if p not in forgotten}
        self.rechecks += 1
        snap = self._snapshot(now, held)
        self.history.append(snap)
        return snap

    async def _held(self, pods: Iterable[str]) -> dict[str, tuple[int, int]]:
        """(gpu blocks, approx entries) of each pod, read from both stores."""
        out: dict[str, tuple[int, int]] = {}
        for pod in pods:
            out[pod] = ((await self._precise.blocks_held(pod))["gpu"], await self._approx.entries(pod))
        return out

    async def _unseen_pods(self, d: Decision, th: float) -> list[str]:
        holders = {p: h for p, h in (await self.truth(d, None)).items() if h >= th}
        if not holders:
            return []
        belief = await self.belief(d, holders)
        return [p for p, h in holders.items() if h - belief.get(p, 0.0) >= th]

    def _snapshot(self, now: float, held: dict[str, tuple[int, int]]) -> Snapshot:
        """Per pod: drift counts, holdings, and the hit rates of the decisions made since the
        previous snapshot (``decisions``; the rates are null when there were none)."""
        since = self.history[-1].t if self.history else float("-inf")
        fresh: dict[str, list[Decision]] = {}
        for d in self._sample:
            if d.t > since:
                fresh.setdefault(d.pod, []).append(d)
        snap = Snapshot(now)
        for pod, s in self.pods.items():
            rates = _aggregate(fresh.get(pod, []), now)
            snap.pods[pod] = {"stale": s.stale, "unseen": s.unseen, "sampled": s.sampled,
                              "blocks": held.get(pod, (0, 0))[0], "approx_entries": held.get(pod, (0, 0))[1],
                              **{k: rates[k] for k in ("decisions", "approx_hit_rate", "precise_hit_rate", "actual_hit_rate")}}
        return snap

    async def run(self) -> None:
        """The re-check timer; owned and cancelled by the daemon."""
        while True:
            await asyncio.sleep(self.settings.recheck_seconds)
            try:
                await self.recheck_async()
            except StoreUnavailable:
                pass  # counted and logged by the store guard; the next period tries again

    # -- summaries -----------------------------------------------------------------------------
    def summary(self, window: float | None = None) -> dict[str, Any]:
        window = self.settings.window_seconds if window is None else window
        now = self._clock()
        recent = self.decisions(now - window)
        by_pod: dict[str, list[Decision]] = {}
        for d in recent:
            by_pod.setdefault(d.pod, []).append(d)
        pods = {pod: self._pod_summary(pod, ds, now) for pod, ds in sorted(by_pod.items())}
        for pod, s in self.pods.items():  # pods that are only unseen holders
            pods.setdefault(pod, self._pod_summary(pod, [], now))
        return {"window_seconds": window, "threshold": self.settings.threshold, "rechecks": self.rechecks,
                "sample_size": self.settings.sample_size,
                "overall": _aggregate(recent, now) | {"stale": sum(s.stale for s in self.pods.values()),
                                                      "unseen": sum(s.unseen for s in self.pods.values()),
                                                      "recorded": self.recorded(window)},
                "pods": pods}

    async def prefixes(self, pod: str, top: int = 10) -> list[dict[str, Any]]:
        """What ``pod`` holds (precise) and is believed to hold (approximate) of the sampled
        decisions' prompts now, grouped by the prompt's first block (a shared prefix: a tenant's
        system prompt, a cache_salt); the ``top`` groups by tokens held. Reads both stores only."""
        groups: dict[int, dict[str, Any]] = {}
        for i, d in enumerate(list(self._sample)):
            if i and i % RECHECK_SLICE == 0:
                await asyncio.sleep(0)  # a large sample does not hold the event loop
            held = (await self.truth(d, [pod])).get(pod, 0.0)
            believed = (await self.belief(d, [pod])).get(pod, 0.0)
            if not d.keys or (held <= 0 and believed <= 0):
                continue
            g = groups.setdefault(d.keys[0], {"prefix": f"{d.keys[0]:016x}", "label": d.label, "requests": 0,
                                              "routed_here": 0, "tokens_held": 0, "held": 0.0, "believed": 0.0})
            g["requests"] += 1
            g["routed_here"] += d.pod == pod
            g["tokens_held"] = max(g["tokens_held"], round(held * (d.truth_tokens or d.prompt_tokens or 0)))
            g["held"] = max(g["held"], round(held, 6))
            g["believed"] = max(g["believed"], round(believed, 6))
        return sorted(groups.values(), key=lambda g: (-g["tokens_held"], -g["requests"], g["prefix"]))[:top]

    def _pod_summary(self, pod: str, ds: list[Decision], now: float) -> dict[str, Any]:
        s = self.pods.get(pod, PodDrift())
        sampled = [d for d in self._sample if d.pod == pod]
        return _aggregate(ds, now) | {
            "stale": s.stale, "unseen": s.unseen, "sampled": s.sampled,
            "stale_fraction": round(s.stale / s.sampled, 6) if s.sampled else None,
            "belief_half_life_seconds": half_life(sampled, now),
        }


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 6) if values else None


def _aggregate(ds: list[Decision], now: float) -> dict[str, Any]:
    actual = [d for d in ds if d.actual is not None]
    return {
        "decisions": len(ds),
        "approx_hit_rate": _mean([d.approx for d in ds]),
        "precise_hit_rate": _mean([d.precise for d in ds if d.precise is not None]),
        "actual_hit_rate": _mean([d.actual for d in actual if d.actual is not None]),
        "approx_mean_abs_error": _mean([abs(e) for d in actual if (e := d.approx_error) is not None]),
        "precise_mean_abs_error": _mean([abs(e) for d in actual if (e := d.precise_error) is not None]),
        "drift": _mean([d.approx - d.precise for d in ds if d.precise is not None]),
    }


def half_life(ds: list[Decision], now: float) -> float | None:
    """Kaplan–Meier median time to staleness; decisions never seen stale are censored now."""
    # at equal ages events come before censorings (the Kaplan-Meier convention)
    times = sorted(((d.stale_at if d.stale_at is not None else now) - d.t, d.stale_at is None) for d in ds)
    at_risk, survival = len(times), 1.0
    for age, censored in times:
        event = not censored
        if event:
            survival *= 1 - 1 / at_risk
            if survival <= 0.5:
                return round(age, 3)
        at_risk -= 1
    return None
