"""Settings value types of the stages above: the approximate index's, the drift audit's, the WAL's,
the tier weights of ``/v1/score``, the request path's (``RouteSettings``: modes, scorer weights, scraping).

Vocabulary: imports nothing of kvindex, so ``kvindex.config`` (which builds them from the command
line and the TOML file) and the stages that use them (``kvindex.index.approx``, ``kvindex.query.drift``,
``kvindex.persist.wal``) all depend on this module and not on each other.

Invariants:
- Every value is frozen and validated when built: an ``ApproxSettings`` holds a known personality
  and positive sizes; ``ApproxSettings.from_toml`` reads Kthena's argument names (``KTHENA_KEYS``)
  plus ``personality`` with Kthena's defaulting (omitted, zero or negative -> the default), and
  refuses unknown keys and non-integers with a ``ValueError`` naming the key.
- ``ApproxConfig.models`` is read-only; model tables inherit the keys ``[approx]`` sets.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from types import MappingProxyType
from typing import Any

FSYNC_POLICIES = ("always", "interval", "never")  # the write-ahead log's fsync policies (--fsync)

KTHENA = "kthena"
GIE_V1_5 = "gie-v1.5"
PERSONALITIES = (KTHENA, GIE_V1_5)

KTHENA_KEYS = (
    ("blockSizeToHash", "block_size_to_hash"),
    ("maxBlocksToMatch", "max_blocks_to_match"),
    ("maxHashCacheSize", "max_hash_cache_size"),
    ("topKMatches", "top_k_matches"),
)


def _positive_int(table: Mapping[str, Any], key: str, default: int) -> int:
    """Kthena's defaulting: omitted, zero or negative -> default; non-integers are errors."""
    if key not in table:
        return default
    value = table[key]
    if isinstance(value, bool) or not isinstance(value, int):
        raise ValueError(f"{key} must be an integer, got {value!r}")
    return value if value > 0 else default


@dataclass(frozen=True, slots=True)
class ApproxSettings:
    """How one model is hashed, stored and scored. All sizes are positive.

    ``block_size_to_hash`` is in bytes of the rendered prompt (GIE: blockSizeTokens x 4).
    ``top_k_matches`` only applies to the Kthena personality.
    """

    personality: str = KTHENA
    block_size_to_hash: int = 64
    max_blocks_to_match: int = 128
    max_hash_cache_size: int = 50000
    top_k_matches: int = 5

    def __post_init__(self) -> None:
        if self.personality not in PERSONALITIES:
            raise ValueError(f"personality must be one of {', '.join(PERSONALITIES)}")
        for f in fields(self)[1:]:
            value = getattr(self, f.name)
            if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
                raise ValueError(f"{f.name} must be a positive integer, got {value!r}")

    @classmethod
    def defaults(cls, personality: str = KTHENA) -> ApproxSettings:
        """The upstream defaults: Kthena 64/128/50000/5, GIE v1.5.0 64/256/31250."""
        if personality == GIE_V1_5:
            return cls(GIE_V1_5, 64, 256, 31250, 5)
        return cls(personality)

    @classmethod
    def from_toml(cls, table: Mapping[str, Any]) -> ApproxSettings:
        """Read Kthena's argument names plus ``personality``; unknown keys are errors."""
        known = {"personality", *(key for key, _ in KTHENA_KEYS)}
        unknown = sorted(set(table) - known)
        if unknown:
            raise ValueError(f"{unknown[0]}: unknown approx setting")
        personality = table.get("personality", KTHENA)
        if personality not in PERSONALITIES:
            choices = ", ".join(PERSONALITIES)
            raise ValueError(f"personality must be one of {choices}, got {personality!r}")
        base = cls.defaults(personality)
        values = {attr: _positive_int(table, key, getattr(base, attr)) for key, attr in KTHENA_KEYS}
        return cls(personality=personality, **values)


@dataclass(frozen=True, slots=True)
class ApproxConfig:
    """Default settings plus per-model overrides (a read-only mapping)."""

    default: ApproxSettings = field(default_factory=ApproxSettings)
    models: Mapping[str, ApproxSettings] = field(default_factory=dict)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))

    def for_model(self, model: str) -> ApproxSettings:
        return self.models.get(model, self.default)

    @classmethod
    def from_toml(cls, approx_table: Mapping[str, Any]) -> ApproxConfig:
        """``[approx]`` plus ``[approx.models."<model>"]``; model tables inherit unset keys."""
        base = {k: v for k, v in approx_table.items() if k != "models"}
        models_table = approx_table.get("models", {})
        if not isinstance(models_table, Mapping):
            raise ValueError("approx.models must be a table")
        try:
            default = ApproxSettings.from_toml(base)
        except ValueError as exc:
            raise ValueError(f"approx.{exc}") from None
        models = {name: _model_settings(name, base, t) for name, t in models_table.items()}
        return cls(default, models)


def _model_settings(name: str, base: Mapping[str, Any], table: Any) -> ApproxSettings:
    where = f'approx.models."{name}"'
    if not isinstance(table, Mapping):
        raise ValueError(f"{where} must be a table")
    try:
        return ApproxSettings.from_toml({**base, **table})
    except ValueError as exc:
        raise ValueError(f"{where}.{exc}") from None


@dataclass(frozen=True, slots=True)
class DriftSettings:
    """How the drift audit samples and re-checks decisions ([drift] in the TOML; kvindex.query.drift)."""

    sample_size: int = 2048
    recheck_seconds: float = 5.0
    window_seconds: float = 300.0
    threshold: float = 0.5
    history: int = 720


@dataclass(frozen=True, slots=True)
class TierWeights:
    """What one matched block is worth per tier in ``/v1/score``'s ``tier_score`` ([tiers] in the
    TOML; checked by kvindex.config). Defaults as Dynamo's router (``KvRouterConfig``:
    ``overlap_score_credit`` 1.0 for the device, ``host_cache_hit_weight`` 0.75,
    ``disk_cache_hit_weight`` 0.25): a block loaded back from a slower tier saves less prefill."""

    device_weight: float = 1.0
    host_weight: float = 0.75
    disk_weight: float = 0.25


PICK, OBSERVE = "pick", "observe"
ROUTE_MODES = (PICK, OBSERVE)
PREFIX_SCORER, KV_SCORER, QUEUE_SCORER, NO_HIT_LRU_SCORER = (
    "prefix-cache-scorer", "kv-cache-utilization-scorer", "queue-scorer", "no-hit-lru-scorer")
SCORERS = (PREFIX_SCORER, KV_SCORER, QUEUE_SCORER, NO_HIT_LRU_SCORER)
PRECISE_PROFILE = MappingProxyType({PREFIX_SCORER: 2.0, KV_SCORER: 1.0, QUEUE_SCORER: 1.0})
"""llm-d's precise-prefix-cache profile (deploy/config/epp-precise-prefix-cache-config.yaml)."""


@dataclass(frozen=True, slots=True)
class RouteSettings:
    """The request path ([route] in the TOML; ``kvindex.route``): whether kvindex picks engines or
    only watches a gateway pick them, per model; the scorers' weights by llm-d's names; the
    engines' load scraping. Checked by ``kvindex.config``."""

    mode: str = PICK  # pick | observe, for models without their own
    models: Mapping[str, str] = field(default_factory=dict)  # model -> mode
    weights: Mapping[str, float] = field(default_factory=lambda: dict(PRECISE_PROFILE))  # scorer name -> weight
    prefix_index: str = "precise"  # what feeds prefix-cache-scorer: precise | approx
    gpu_weight: float = 1.0  # a matched block per tier, as llm-d's precise producer weighs it
    cpu_weight: float = 0.8
    disk_weight: float = 0.0
    match_length_weight: float = 0.0  # prefix-cache-scorer's matchLengthWeight / matchLengthScaleTokens
    match_length_scale_tokens: int = 8192
    scrape_seconds: float = 0.05  # each engine's /metrics, this often (llm-d's --refresh-metrics-interval)
    staleness_seconds: float = 2.0  # load older than this is neutral and flagged (--metrics-staleness-threshold)
    max_body_bytes: int = 32 << 20  # request body the picker holds; past it: 413 (pick) or not predicted (observe)
    pending_seconds: float = 600.0  # a request unanswered this long is forgotten (counted)
    max_pending: int = 65536  # requests in flight at once that kvindex tracks
    seed: int | None = None  # the tie-break's random seed (None: from the OS)

    def __post_init__(self) -> None:
        object.__setattr__(self, "models", MappingProxyType(dict(self.models)))
        object.__setattr__(self, "weights", MappingProxyType(dict(self.weights)))

    def mode_of(self, model: str) -> str:
        return self.models.get(model, self.mode)
