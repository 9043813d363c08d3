"""Settings value types of the stages above: the approximate index's, the drift audit's, the WAL's,
the tier weights of ``/v1/score``.

Vocabulary: imports nothing of kvindex, so ``kvindex.config`` (which builds them from the command
line and the TOML file) and the stages that use them (``kvindex.index.approx``, ``kvindex.drift``,
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
    """How the drift audit samples and re-checks decisions ([drift] in the TOML; kvindex.drift)."""

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
