"""LoRA adapters by served name: which model names are adapters of which base model, and from where
kvindex knows it.

A router sends ``"model": "<adapter>"`` (vLLM serves an adapter under its own name, which is also
the ``lora_name`` of the blocks it stores); the precise index keys such blocks by (base model,
adapter). ``resolve`` turns what a query names into that pair.

Invariants:
- An adapter has exactly one base model; a name is never its own base, and a base is never itself
  an adapter (no chains, no cycles): resolving twice is resolving once. A base is a name known as
  one: a configured model or engine model, a stream's model, an engine's card without a parent, or
  an adapter's base; such a name is never learned as an adapter (a stray ``lora_name`` equal to a
  real model's name must not re-key that model's queries), and a name becoming known as a base
  forgets an adapter learned (engine, events) under it earlier, counted in
  ``kvindex_lora_adapters_forgotten_total{source, reason="base_model"}``. Configuration beats all:
  a configured adapter stays one when a stream or an engine card names it as a base model (that
  claim is refused, counted as ``kvindex_lora_adapters_refused_total{source, reason="configured"}``,
  and the name is not recorded as a base).
- Three sources, by precedence: ``config`` (``[models."<adapter>"] base_model``) over ``engine``
  (an engine's ``/v1/models``: cards with a ``parent``) over ``events`` (a ``BlockStored`` with
  ``lora_name`` L on a stream of base model M). A source replaces what a lower one said, never what
  an equal or higher one says (that is a ``conflict``, refused and counted).
- Learned entries (engine, events) are bounded: at most ``max_learned``; one more is refused and
  counted (``cap``). Configured ones are not counted against it (the file is finite).
- Every refused (adapter, base, source) is counted once in
  ``kvindex_lora_adapters_refused_total{source, reason}`` (events name it in batch after batch;
  past ``max_learned`` distinct refusals, each one is counted), every entry learned in
  ``kvindex_lora_adapters_learned_total{source}``; nothing here raises on input from an engine.
- No I/O here: the poller of ``/v1/models`` is ``adapters.engine_models``.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any, Protocol

CONFIG, ENGINE, EVENTS = "config", "engine", "events"
PRECEDENCE = {CONFIG: 2, ENGINE: 1, EVENTS: 0}
MAX_LEARNED_ADAPTERS = 1024  # adapters learned from engines and events; vLLM's --max-loras is usually < 100
MAX_BASE_MODELS = 4096  # names remembered as base models (configured, streams', engines' cards)
MAX_ADAPTER_CHARS = 256  # a longer lora_name is never learned (kvindex.limits: MAX_ID_CHARS)


def checked_adapters(tables: Mapping[str, str | None], engines: Iterable[tuple[str, str | None]] = ()) -> dict[str, str]:
    """``[models."<adapter>"] base_model`` (``tables``: model -> its base_model or None) as adapter ->
    base; ``ValueError`` naming the key for an adapter of itself, of an adapter (a chain or a cycle),
    of or as ``"*"``, or served by a configured engine (its events are of a base model). A base is
    taken as written: it may be known from engines' topics and registrations alone."""
    bases = {name: base for name, base in tables.items() if base is not None}
    for name, base in bases.items():
        where = f'[models."{name}"] base_model'
        if name == "*" or base == "*":
            raise ValueError(f'{where}: "*" is every model\'s default table, neither an adapter nor a base')
        if base == name:
            raise ValueError(f"{where} = {base!r}: an adapter cannot be its own base model")
        if base in bases:
            raise ValueError(f"{where} = {base!r}: {base!r} is itself an adapter (of {bases[base]!r}); a LoRA "
                             "adapter applies to a base model, not to another adapter (a chain or a cycle)")
    for engine, model in engines:
        if model in bases:
            raise ValueError(f"engine {engine} serves model {model!r}, which [models] declares a LoRA adapter "
                             "(base_model): an engine's events are of its base model")
    return bases


class Counters(Protocol):
    """What of ``kvindex.metrics.Metrics`` this module counts with (not imported: config imports this)."""

    lora_learned: Any
    lora_refused: Any
    lora_forgotten: Any


class AdapterConflict(ValueError):
    """A query naming an adapter as its model and a different ``lora_name``."""


@dataclass(frozen=True, slots=True)
class Adapter:
    name: str
    base: str
    source: str  # CONFIG, ENGINE or EVENTS
    origin: str  # the config table, the engine URL, or the pod whose events named it

    def to_json(self) -> dict[str, Any]:
        return {"id": self.name, "object": "model", "parent": self.base, "source": self.source,
                "learned_from": self.origin}


class LoraAdapters:
    def __init__(self, configured: Mapping[str, str] = {}, metrics: Counters | None = None,
                 max_learned: int = MAX_LEARNED_ADAPTERS, bases: Iterable[str] = ()) -> None:
        self._metrics = metrics
        self._max_learned = max_learned
        self._by_name: dict[str, Adapter] = {}
        self._learned = 0
        self._refused: set[tuple[str, str, str]] = set()  # counted already
        self._bases: set[str] = set(bases) | set(configured.values())  # names known as base models
        for name, base in configured.items():  # checked by kvindex.config: no self, no chains
            self._by_name[name] = Adapter(name, base, CONFIG, f'[models."{name}"]')

    def __len__(self) -> int:
        return len(self._by_name)

    def base_of(self, model: str) -> str | None:
        """The base model of adapter ``model``; None when ``model`` is not a known adapter."""
        a = self._by_name.get(model)
        return a.base if a is not None else None

    def resolve(self, model: str, lora_name: str | None) -> tuple[str, str | None]:
        """(model, lora_name) a query is keyed by. ``model`` an adapter: (its base, its name); an
        explicit ``lora_name`` is kept as given (on a base model, or naming the same adapter);
        an adapter as ``model`` with another ``lora_name``: ``AdapterConflict``."""
        a = self._by_name.get(model)
        if a is None:
            return model, lora_name
        if lora_name is not None and lora_name != model:
            raise AdapterConflict(f"model {model!r} is a LoRA adapter of {a.base!r}, but lora_name is {lora_name!r}: "
                                  f"send model {a.base!r} with lora_name, or model {model!r} alone")
        return a.base, model

    def learn(self, name: str, base: str, source: str, origin: str) -> bool:
        """``name`` is an adapter of ``base`` (``source``, from ``origin``); False if refused (counted)."""
        have = self._by_name.get(name)
        if have is not None and have.base == base and PRECEDENCE[have.source] >= PRECEDENCE[source]:
            return True  # known already, as well or better
        reason = self._refusal(name, base, source, have)
        if reason is not None:
            self._count_refused((name, base, source), source, reason)
            return False
        if have is None:
            self._learned += 1
        self._by_name[name] = Adapter(name, base, source, origin)
        self._base(base, source)
        if self._metrics is not None:
            self._metrics.lora_learned.labels(source).inc()
        return True

    def _refusal(self, name: str, base: str, source: str, have: Adapter | None) -> str | None:
        if not name or not base or len(name) > MAX_ADAPTER_CHARS or len(base) > MAX_ADAPTER_CHARS:
            return "bad_name"
        if name == base:
            return "self"
        if base in self._by_name or name in self._bases:
            return "chain"  # its base is an adapter, or it is a base model
        if have is not None and PRECEDENCE[have.source] >= PRECEDENCE[source]:
            return "conflict"
        if have is None and self._learned >= self._max_learned:
            return "cap"
        return None

    def _count_refused(self, key: tuple[str, str, str], source: str, reason: str) -> None:
        """Counted once per ``key`` (up to ``max_learned`` keys remembered)."""
        if key not in self._refused and self._metrics is not None:
            self._metrics.lora_refused.labels(source, reason).inc()
        if len(self._refused) < self._max_learned:
            self._refused.add(key)

    def _base(self, name: str, source: str) -> None:
        """``name`` is known as a base model (said by ``source``): a learned adapter of that name is
        forgotten (the real model's queries are its own again); a configured one stays (the claim
        refused)."""
        have = self._by_name.get(name)
        if have is not None:
            if have.source == CONFIG:
                self._count_refused((name, "", source), source, "configured")
                return
            self._forget(name, "base_model")
        if len(self._bases) < MAX_BASE_MODELS:
            self._bases.add(name)

    def _forget(self, name: str, reason: str) -> None:
        a = self._by_name.pop(name)
        self._learned -= 1
        if self._metrics is not None:
            self._metrics.lora_forgotten.labels(a.source, reason).inc()

    def learn_from_events(self, pod: str, base: str, lora_names: Iterable[str]) -> None:
        """The ``lora_name``s of a stream's BlockStored events (its model ``base``; none: the
        stream's first batch, its model known as a base)."""
        self._base(base, EVENTS)
        for name in lora_names:
            if self._by_name.get(name) is None or self._by_name[name].base != base:
                self.learn(name, base, EVENTS, pod)

    def sync_engine(self, origin: str, listed: Mapping[str, str], bases: Iterable[str] = ()) -> None:
        """An engine's ``/v1/models`` answer: its adapters (name -> parent) are learned, and those
        it listed before and no longer lists (unloaded) are forgotten; ``bases``: its cards without
        a parent."""
        for name in bases:
            self._base(name, ENGINE)
        for name, a in list(self._by_name.items()):
            if a.source == ENGINE and a.origin == origin and name not in listed:
                self._forget(name, "unloaded")
        for name, base in listed.items():
            self.learn(name, base, ENGINE, origin)

    def views(self) -> list[dict[str, Any]]:
        return [a.to_json() for _, a in sorted(self._by_name.items())]
