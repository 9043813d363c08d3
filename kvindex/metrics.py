"""Prometheus metrics, in a registry that is passed in (never the global one).

Invariants: labels come from fixed vocabularies (event types, reason labels chosen in code) or
pod/model ids, never from exception text. State that can be read off the indexes (blocks held,
entries, sync state) is computed at scrape time by a collector, not maintained on the hot path.
A pod or model id a *request* carries is a label only when it is known (``KnownNames``: configured,
registered or seen in an engine's events, at most ``MAX_LABEL_CHARS`` long, at most ``limit`` of
them); any other id is counted under ``OTHER``, so requests cannot grow ``/metrics``.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

LATENCY_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 1.0)
RATIO_BUCKETS = (0, 0.1, 0.25, 0.5, 0.75, 0.9, 0.95, 0.99, 1)
OTHER = "other"  # the label of every pod or model id that is not a known one
MAX_LABEL_CHARS = 256  # a longer id is never a label value


class KnownNames:
    """The ids (pods or models) that may be label values: at most ``limit`` ids from trusted
    sources (configuration, registrations, engine events; ``admit``) plus at most ``learned``
    ids that authorised writes named (``learn``: a router's decisions about pods no engine
    reports). ``label`` maps any other id to ``OTHER``."""

    def __init__(self, limit: int = 4096, learned: int = 64) -> None:
        self._limit, self._learned_limit = limit, learned
        self._names: set[str] = set()
        self._learned = 0

    def __contains__(self, name: object) -> bool:
        return name in self._names

    def __len__(self) -> int:
        return len(self._names)

    def admit(self, name: str | None) -> None:
        if name and len(name) <= MAX_LABEL_CHARS and name != OTHER and len(self._names) < self._limit:
            self._names.add(name)

    def learn(self, name: str) -> None:
        if name not in self._names and self._learned < self._learned_limit:
            before = len(self._names)
            self.admit(name)
            self._learned += len(self._names) - before

    def label(self, name: str) -> str:
        return name if name in self._names else OTHER

    def fold(self, samples: Iterable[tuple[list[str], float]]) -> list[tuple[list[str], float]]:
        """Gauge samples whose first label is an id: unknown ids summed under ``OTHER``."""
        out: dict[tuple[str, ...], float] = {}
        for values, value in samples:
            key = (self.label(values[0]), *values[1:])
            out[key] = out.get(key, 0.0) + value
        return [(list(k), v) for k, v in out.items()]


class Metrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.registry = registry
        self.pods = KnownNames()  # pod ids that may be label values of the request-fed metrics
        self.models = KnownNames()  # model ids likewise
        self.events_applied = Counter("kvindex_events_applied", "KV events applied, by pod and type", ["pod", "type"], registry=r)
        self.blocks_stored = Counter("kvindex_blocks_stored", "Block copies stored by BlockStored events", ["pod"], registry=r)
        self.blocks_reannounced = Counter("kvindex_blocks_reannounced", "Blocks of BlockStored events re-announcing "
                                          "held hashes (vLLM kv_cache_report_mode full): no copy added", ["pod"], registry=r)
        self.blocks_removed = Counter("kvindex_blocks_removed", "Block copies removed by BlockRemoved events", ["pod"], registry=r)
        self.decode_errors = Counter("kvindex_decode_errors", "Messages, events or fields that could not be used, by reason", ["pod", "reason"], registry=r)
        self.events_skipped = Counter("kvindex_events_skipped", "Well-formed events that never reach the index, by reason "
                                      "(non_prefix_group: a hybrid model's sliding-window, Mamba, ... group)", ["pod", "reason"], registry=r)
        self.seq_gaps = Counter("kvindex_seq_gaps", "Sequence gaps detected on an engine stream", ["pod"], registry=r)
        self.replays = Counter("kvindex_replays", "Replay requests to an engine's replay endpoint, by outcome: ok, history_lost, failed, or the bound that cut the answer short (replay_timeout, replay_too_large, replay_too_many_frames)", ["pod", "outcome"], registry=r)
        self.restarts = Counter("kvindex_engine_restarts", "Engine restarts detected (seq went back with other bytes, or a watermark the engine no longer holds)", ["pod"], registry=r)
        self.orphan_blocks = Counter("kvindex_orphan_blocks", "Stored blocks kept without a key (unknown parent, no tokens, block size mismatch)", ["pod"], registry=r)
        self.blocks_refused = Counter("kvindex_blocks_refused", "Block copies of BlockStored events refused because "
                                      "their pod holds more than --max-blocks-per-pod", ["pod"], registry=r)
        self.pod_over_capacity = Gauge("kvindex_pod_over_capacity", "1 while the pod holds more blocks than "
                                       "--max-blocks-per-pod (its stores are refused; it is unsynced)", ["pod"], registry=r)
        self.unknown_removals = Counter("kvindex_unknown_removals", "BlockRemoved for a hash the pod does not hold", ["pod"], registry=r)
        self.lag_seconds = Gauge("kvindex_ingest_lag_seconds", "Seconds between kvindex receiving a batch and applying it (the engine's ts is not trusted)", ["pod"], registry=r)
        self.receive_dropped = Counter("kvindex_receive_dropped_batches", "Batches dropped because the engine's inbox "
                                       "was over receive_buffer_bytes (recovered from the replay)", ["engine"], registry=r)
        self.http_rejections = Counter("kvindex_http_rejections", "HTTP requests refused with a 4xx, by endpoint and reason", ["endpoint", "reason"], registry=r)
        self.http_connections_refused = Counter("kvindex_http_connections_refused", "HTTP connections refused (503, closed) because max_connections were open", registry=r)
        self.http_fast_answers = Counter("kvindex_http_fast_path_answers", "Requests answered by the HTTP fast path "
                                         "(kvindex.http.fastpath) before aiohttp, by endpoint", ["endpoint"], registry=r)
        self.query_seconds = Histogram("kvindex_query_duration_seconds", "Time to answer a query, by endpoint", ["endpoint"], buckets=LATENCY_BUCKETS, registry=r)
        self._query_timers: dict[str, Histogram] = {}  # endpoint -> its query_seconds child (query_timer)
        self.approx_match_ratio = Histogram("kvindex_approx_match_ratio", "Approximate index: longest match / prompt blocks per scored request (Kthena's prefix_cache_match_ratio)", ["model"], buckets=RATIO_BUCKETS, registry=r)
        self.approx_evictions = Counter("kvindex_approx_evictions", "Approximate index: capacity evictions (Kthena's prefix_cache_evictions_total)", ["model"], registry=r)
        self.batches_skipped = Counter("kvindex_batches_skipped", "Engine batches not applied by this replica, by "
                                       "outcome: duplicate (applied already: by another replica, or delivered twice), stale (an "
                                       "engine life that has ended), dropped (past the store buffer)",
                                       ["pod", "outcome"], registry=r)
        self.store_errors = Counter("kvindex_store_errors", "Store calls that failed (store unreachable or lost), by "
                                    "operation", ["op"], registry=r)
        self.store_up = Gauge("kvindex_store_up", "1 while the store answers, 0 after a failed call", registry=r)
        self.store_buffered = Gauge("kvindex_store_buffered_batches", "Engine batches waiting for the store, summed "
                                    "over lanes", registry=r)
        self.lora_learned = Counter("kvindex_lora_adapters_learned", "LoRA adapters learned (or replaced by a "
                                    "higher-precedence source), by source: engine (/v1/models), events", ["source"],
                                    registry=r)
        self.lora_refused = Counter("kvindex_lora_adapters_refused", "LoRA adapters not learned, by source and reason: "
                                    "cap (max learned), conflict (another base from an equal or higher source), self, "
                                    "chain (an adapter of an adapter, or a base model's name), configured (a configured "
                                    "adapter named as a base model: configuration wins), bad_name", ["source", "reason"], registry=r)
        self.lora_forgotten = Counter("kvindex_lora_adapters_forgotten", "Learned LoRA adapters forgotten, by the "
                                      "source that taught them and reason: base_model (the name is known as a base "
                                      "model: a stream's model, an engine's card without parent), unloaded (its "
                                      "engine no longer lists it)", ["source", "reason"], registry=r)
        self.lora_poll_failures = Counter("kvindex_lora_models_poll_failures", "Failed polls of an engine's /v1/models "
                                          "(its LoRA adapters), by the model table whose URL it is", ["model"], registry=r)
        self.decisions = Counter("kvindex_decisions", "Routing decisions recorded", ["pod"], registry=r)
        self.peer_refusals = Counter("kvindex_peer_refusals", "Peer states (--peer) not loaded, by reason: too_large "
                                     "(past --peer-max-bytes), timeout (--peer-timeout, or silent mid-answer), "
                                     "http_status, unreachable, malformed", ["reason"], registry=r)
        self.decision_fraction = Histogram("kvindex_decision_hit_fraction", "Per decision: the prompt fraction predicted "
                                           "cached (approx, precise) and reported cached by the engine (actual)",
                                           ["pod", "source"], buckets=RATIO_BUCKETS, registry=r)
        self.decision_tokens = Counter("kvindex_decision_tokens", "Prompt tokens of recorded decisions, by source "
                                       "(pick, observe, api) and kind: prompt (all of them), realized (the engine's "
                                       "cached_tokens), precise and approx (what each index predicted cached on the pod "
                                       "that served it); a hit rate is a ratio of these sums", ["source", "kind"],
                                       registry=r)
        self.decision_error = Histogram("kvindex_decision_abs_error", "Per decision: |prediction - actual| of each index",
                                        ["pod", "predictor"], buckets=RATIO_BUCKETS, registry=r)

    def query_timer(self, endpoint: str) -> Histogram:
        """``query_seconds``'s child for ``endpoint`` (a route's path, named in code), made on first
        use and kept: ``labels()`` costs ~2 us a call, a noticeable part of a /query_by_hash."""
        child = self._query_timers.get(endpoint)
        if child is None:
            child = self._query_timers[endpoint] = self.query_seconds.labels(endpoint)
        return child

    def peer_refused(self, reason: str) -> None:
        self.peer_refusals.labels(reason).inc()

    def known(self, pod: str | None, model: str | None) -> None:
        """A pod and model a trusted source names (configuration, a registration, an engine's events)."""
        self.pods.admit(pod)
        self.models.admit(model)

    def observe_decision(self, pod: str, fractions: dict[str, float | None], errors: dict[str, float | None]) -> None:
        """One routing decision: the cached fraction per source (approx, precise, actual) and each
        index's error against the engine's own report (``kvindex.query.drift.Decision`` computes both).
        A decision is an authorised write: its pod may become a label (``KnownNames.learn``)."""
        self.pods.learn(pod)
        pod = self.pods.label(pod)
        self.decisions.labels(pod).inc()
        for source, value in fractions.items():
            if value is not None:
                self.decision_fraction.labels(pod, source).observe(value)
        for predictor, err in errors.items():
            if err is not None:
                self.decision_error.labels(pod, predictor).observe(abs(err))


    def observe_tokens(self, source: str, prompt: int | None, realized: int | None, precise: int | None,
                       approx: int | None) -> None:
        """One decision's tokens into ``kvindex_decision_tokens``: only a decision whose engine
        reported its cached tokens counts, so that every kind shares one denominator."""
        if prompt is None or realized is None:
            return
        for kind, value in (("prompt", prompt), ("realized", realized), ("precise", precise), ("approx", approx)):
            if value is not None:
                self.decision_tokens.labels(source, kind).inc(value)


class StateCollector(Collector):
    """Gauges read off live state at scrape time. ``read`` returns (name, help, labels, samples)."""

    def __init__(self, read: Callable[[], Iterable[tuple[str, str, list[str], list[tuple[list[str], float]]]]]) -> None:
        self._read = read

    def collect(self) -> Iterable[Metric]:
        for name, help_, labels, samples in self._read():
            family = GaugeMetricFamily(name, help_, labels=labels)
            for values, value in samples:
                family.add_metric(values, value)
            yield family
