"""The TOML file and the command line, read into a ``kvindex.config.Config``.

Invariants:
- Nothing is silently ignored: the TOML document is decoded through ``ConfigFile`` (msgspec
  Structs and ``kvindex.config``'s dataclasses, every table's keys checked by ``kvindex.strict``),
  so an unknown or misspelled key or table is an error naming it and the closest known name; an
  error starts with the file's name (``kvindex.toml: [[engines]] #2 block_size must be ...``).
- Engine spec syntax on the command line: ``--engine ENDPOINT`` or
  ``--engine key=value,key=value`` with the keys of an ``[[engines]]`` TOML table
  (``endpoint`` required; ``pod``, ``model``, ``replay``, ``bind``, ``dialect``, ``block_size``,
  ``dp_rank``, ``url``).
- The values themselves are checked where they are built (``kvindex.config``), once.
- Vocabulary: imports only the standard library, msgspec and other vocabulary modules.
"""

from __future__ import annotations

import tomllib
from dataclasses import replace
from pathlib import Path
from typing import Any

import msgspec
from msgspec import UNSET, UnsetType

from kvindex import strict
from kvindex.config import Config, ConfigError, EngineConfig, ModelConfig
from kvindex.settings import ApproxConfig, DriftSettings, RouteSettings, TierWeights


class _Table(msgspec.Struct, forbid_unknown_fields=True, frozen=True, kw_only=True):
    """A TOML table whose keys are all optional: an omitted key stays UNSET and ``Config`` defaults it."""

    def given(self) -> dict[str, Any]:
        return {k: v for k, v in msgspec.structs.asdict(self).items() if v is not UNSET}


class ServerTable(_Table, frozen=True):
    host: str | UnsetType = UNSET
    port: int | UnsetType = UNSET
    max_message_bytes: int | UnsetType = UNSET
    receive_buffer_bytes: int | UnsetType = UNSET
    receive_queue_messages: int | UnsetType = UNSET
    max_lag_seconds: float | UnsetType = UNSET
    store: str | UnsetType = UNSET
    store_buffer: int | UnsetType = UNSET
    workers: int | UnsetType = UNSET
    auth: str | UnsetType = UNSET
    max_connections: int | UnsetType = UNSET
    idle_timeout: float | UnsetType = UNSET
    body_timeout: float | UnsetType = UNSET
    http_fast_path: bool | UnsetType = UNSET
    max_blocks_per_pod: int | UnsetType = UNSET
    engine_silent_seconds: float | UnsetType = UNSET
    dynamo_dump: bool | UnsetType = UNSET
    ext_proc_port: int | UnsetType = UNSET
    ext_proc_host: str | UnsetType = UNSET
    grpc_port: int | UnsetType = UNSET
    grpc_host: str | UnsetType = UNSET


class RouteModelTable(_Table, frozen=True):
    mode: str | UnsetType = UNSET


class RouteTable(_Table, frozen=True):
    """[route], [route.scorers] (llm-d's scorer names -> weights) and [route.models."<model>"]."""

    mode: str | UnsetType = UNSET
    prefix_index: str | UnsetType = UNSET
    gpu_weight: float | UnsetType = UNSET
    cpu_weight: float | UnsetType = UNSET
    disk_weight: float | UnsetType = UNSET
    match_length_weight: float | UnsetType = UNSET
    match_length_scale_tokens: int | UnsetType = UNSET
    scrape_seconds: float | UnsetType = UNSET
    staleness_seconds: float | UnsetType = UNSET
    max_body_bytes: int | UnsetType = UNSET
    pending_seconds: float | UnsetType = UNSET
    max_pending: int | UnsetType = UNSET
    seed: int | UnsetType = UNSET
    scorers: dict[str, float] | UnsetType = UNSET
    models: dict[str, RouteModelTable] = {}

    def settings(self) -> RouteSettings:
        given = self.given()
        models = {m: t.mode for m, t in given.pop("models", {}).items() if t.mode is not UNSET}
        if "scorers" in given:
            given["weights"] = given.pop("scorers")
        return RouteSettings(**given, models=models)


class StateTable(_Table, frozen=True):
    dir: str | UnsetType = UNSET  # "" as omitted: state in memory only
    snapshot_seconds: float | UnsetType = UNSET
    orphan_grace_seconds: float | UnsetType = UNSET
    fsync: str | UnsetType = UNSET
    peer: str | UnsetType = UNSET
    peer_max_bytes: int | UnsetType = UNSET
    peer_timeout: float | UnsetType = UNSET


class ApproxModelTable(_Table, frozen=True):
    """[approx] and [approx.models."<model>"]: Kthena's argument names (``KTHENA_KEYS``); the values
    are taken as written and checked by ``ApproxSettings.from_toml`` (Kthena's defaulting)."""

    personality: Any = UNSET
    block_size_to_hash: Any = msgspec.field(default=UNSET, name="blockSizeToHash")
    max_blocks_to_match: Any = msgspec.field(default=UNSET, name="maxBlocksToMatch")
    max_hash_cache_size: Any = msgspec.field(default=UNSET, name="maxHashCacheSize")
    top_k_matches: Any = msgspec.field(default=UNSET, name="topKMatches")


class ApproxTable(ApproxModelTable, frozen=True):
    models: dict[str, ApproxModelTable] = {}


class ConfigFile(_Table, frozen=True):
    """The whole TOML file: every table kvindex reads, and nothing else."""

    server: ServerTable = ServerTable()
    engines: list[EngineConfig] = []
    models: dict[str, ModelConfig] = {}
    approx: ApproxTable = ApproxTable()
    drift: DriftSettings = msgspec.field(default_factory=DriftSettings)
    tiers: TierWeights = msgspec.field(default_factory=TierWeights)
    state: StateTable = StateTable()
    route: RouteTable = RouteTable()


def unique_endpoints(engines: tuple[EngineConfig, ...]) -> tuple[EngineConfig, ...]:
    seen: set[str] = set()
    for e in engines:
        if e.endpoint in seen:
            raise ConfigError(f"engine endpoint {e.endpoint} is configured twice (one SUB socket per endpoint)")
        seen.add(e.endpoint)
    return engines


def parse_engine_spec(spec: str) -> EngineConfig:
    """``tcp://host:5557`` or ``endpoint=tcp://host:5557,pod=vllm-0,replay=tcp://host:5558``."""
    if "=" not in spec.split("://", 1)[0]:
        return EngineConfig(endpoint=spec)
    table: dict[str, Any] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"--engine {spec}: part {part!r} is not key=value")
        if key.strip() in table:
            raise ConfigError(f"--engine {spec}: {key.strip()} is given twice")
        table[key.strip()] = value.strip()
    try:
        return strict.decode(_bind_yes_no(table), EngineConfig, label=f"--engine {spec}")
    except strict.Refused as exc:
        raise ConfigError(str(exc)) from None


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None


def load_file(path: Path) -> Config:
    """The ``--config`` file as a ``Config``; errors start with the file's name."""
    return config_from_toml(load_toml(path), source=str(path))


def _bind_yes_no(table: Any) -> Any:
    """An engine table whose ``bind`` may also be "yes" / "no" (accepted as ever, besides
    true/false and 1/0), with that word as a bool; anything else as it is."""
    if isinstance(table, dict) and str(table.get("bind")).lower() in ("yes", "no"):
        return {**table, "bind": str(table["bind"]).lower() == "yes"}
    return table


def config_from_toml(doc: dict[str, Any], source: str | None = None) -> Config:
    try:
        if isinstance(doc.get("engines"), list):
            doc = {**doc, "engines": [_bind_yes_no(t) for t in doc["engines"]]}
        f = strict.decode(doc, ConfigFile)
        try:
            approx = ApproxConfig.from_toml(msgspec.to_builtins(f.approx))
        except ValueError as exc:
            raise ConfigError(f"[approx]: {exc}") from None
        state = f.state.given()
        if "dir" in state:
            state_dir = state.pop("dir")
            state["state_dir"] = Path(state_dir) if state_dir else None
        return Config(**f.server.given(), **state, engines=unique_endpoints(tuple(f.engines)), models=f.models,
                      approx=approx, drift=_checked_drift(f.drift), tiers=f.tiers, route=f.route.settings())
    except (ConfigError, strict.Refused) as exc:
        raise ConfigError(f"{source}: {exc}" if source else str(exc)) from None


def with_overrides(cfg: Config, *, engines: list[str], **flags: Any) -> Config:
    """``cfg`` with the command line on top: each flag is a ``Config`` field (None: not given, the
    file's value stays; an unknown name is a TypeError), and ``engines`` (``--engine`` specs) join
    the file's engines."""
    given = {name: value for name, value in flags.items() if value is not None}
    return replace(cfg, engines=unique_endpoints(cfg.engines + tuple(parse_engine_spec(s) for s in engines)), **given)


def _checked_drift(d: DriftSettings) -> DriftSettings:
    if d.sample_size < 1 or d.recheck_seconds <= 0 or not 0 < d.threshold <= 1 or d.history < 1:
        raise ConfigError("[drift]: sample_size and history must be >= 1, recheck_seconds > 0, 0 < threshold <= 1")
    return d
