"""Configuration: frozen dataclasses built from the command line and a TOML file.

Invariants:
- Everything is validated here, once; a bad value raises ``ConfigError`` naming the key.
- Nothing downstream reads the environment or a dict of options: it gets these objects.
- Engine spec syntax on the command line: ``--engine ENDPOINT`` or
  ``--engine key=value,key=value`` with the keys of an ``[[engines]]`` TOML table
  (``endpoint`` required; ``pod``, ``model``, ``replay``, ``bind``, ``dialect``, ``block_size``,
  ``dp_rank``).
"""

from __future__ import annotations

import tomllib
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from kvindex.settings import FSYNC_POLICIES, ApproxConfig, ApproxSettings, DriftSettings
from kvindex.storeurl import MEMORY, check_store_url, describe, is_memory

MAX_WORKERS = 64
DIALECT_NAMES = ("vllm", "sglang", "llmd-sim")
TOKENIZER_NAMES = ("none", "engine", "llmd-sim")


class ConfigError(ValueError):
    pass


@dataclass(frozen=True, slots=True)
class EngineConfig:
    """One engine replica's KV-event publisher (one SUB socket)."""

    endpoint: str
    pod: str | None = None  # None: taken from the topic kv@<pod>@<model>, else the endpoint
    model: str | None = None  # None: taken from the topic
    replay: str | None = None  # the engine's ROUTER replay endpoint
    bind: bool = False  # vLLM binds its PUB (we connect); llm-d-inference-sim dials (we bind)
    dialect: str = "vllm"
    block_size: int | None = None
    dp_rank: int | None = None  # overrides the batch's rank (one publisher per rank)

    def __post_init__(self) -> None:
        if not self.endpoint or "://" not in self.endpoint:
            raise ConfigError(f"engine endpoint {self.endpoint!r} is not a ZeroMQ address like tcp://host:5557")
        if self.dialect not in DIALECT_NAMES:
            raise ConfigError(f"engine dialect {self.dialect!r}: expected one of {', '.join(DIALECT_NAMES)}")
        if self.block_size is not None and self.block_size <= 0:
            raise ConfigError("engine block_size must be a positive integer")

    @property
    def name(self) -> str:
        return self.pod or self.endpoint

    @property
    def lane_key(self) -> str:
        """A configured engine's lane: one SUB socket per endpoint (ranks of a pod have their own)."""
        return f"config:{self.endpoint}"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per model: how its prompts are tokenized for the precise index, and its block size."""

    tokenizer: str = "none"
    tokenize_url: str | None = None
    block_size: int | None = None

    def __post_init__(self) -> None:
        if self.tokenizer not in TOKENIZER_NAMES:
            raise ConfigError(f"tokenizer {self.tokenizer!r}: expected one of {', '.join(TOKENIZER_NAMES)}")
        if self.tokenizer == "engine" and not self.tokenize_url:
            raise ConfigError('tokenizer = "engine" needs tokenize_url (the engine\'s base URL)')


@dataclass(frozen=True, slots=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8080
    engines: tuple[EngineConfig, ...] = ()
    models: dict[str, ModelConfig] = field(default_factory=dict)
    approx: ApproxConfig = field(default_factory=lambda: ApproxConfig(ApproxSettings(), {}))
    drift: DriftSettings = field(default_factory=DriftSettings)
    max_body_bytes: int = 8 << 20
    max_token_ids: int = 1 << 20
    replay_timeout: float = 2.0
    rcvhwm: int = 1_000_000
    max_message_bytes: int = 64 << 20  # ZeroMQ MAXMSGSIZE of the SUB and replay sockets ([server] max_message_bytes)
    state_dir: Path | None = None  # snapshots + write-ahead log; None: state lives in memory only
    snapshot_seconds: float = 60.0
    fsync: str = "interval"  # always | interval | never (the write-ahead log's fsync policy)
    peer: str | None = None  # base URL of a running kvindex whose state is loaded before serving
    store: str = MEMORY  # where the indexes live: memory:// or a Redis URL shared by replicas
    store_buffer: int = 10_000  # batches per lane kept while the store is unreachable
    workers: int = 1  # ingest worker processes (1: everything in this process; kvindex.shard.supervisor)

    def __post_init__(self) -> None:
        try:
            check_store_url(self.store)
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        if not is_memory(self.store):
            for what, value in (("--state-dir", self.state_dir), ("--peer", self.peer)):
                if value is not None:
                    raise ConfigError(f"{what} cannot be used with --store {describe(self.store)}: the state lives "
                                      "in Redis, shared by every replica")
        self._check_workers()
        if type(self.store_buffer) is not int or self.store_buffer < 1:
            raise ConfigError("store_buffer must be a positive integer (batches per engine lane)")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync {self.fsync!r}: expected one of {', '.join(FSYNC_POLICIES)}")
        if type(self.max_message_bytes) is not int or self.max_message_bytes <= 0:
            raise ConfigError("max_message_bytes must be a positive integer (bytes)")
        if not self.snapshot_seconds > 0:
            raise ConfigError("snapshot_seconds must be > 0")
        if self.peer is not None and not self.peer.startswith(("http://", "https://")):
            raise ConfigError(f"peer {self.peer!r} is not an http(s):// URL of a running kvindex")

    def _check_workers(self) -> None:
        if type(self.workers) is not int or not 1 <= self.workers <= MAX_WORKERS:
            raise ConfigError(f"workers must be an integer from 1 to {MAX_WORKERS}")
        if self.workers > 1:
            for what, value in (("--store", None if is_memory(self.store) else self.store),
                                ("--state-dir", self.state_dir), ("--peer", self.peer)):
                if value is not None:
                    raise ConfigError(f"--workers {self.workers} cannot be used with {what} yet: sharded ingest keeps "
                                      "each worker's index in its own memory (no shared store, snapshot or peer state)")

    def model(self, name: str) -> ModelConfig:
        return self.models.get(name) or self.models.get("*") or ModelConfig()


_ENGINE_KEYS = {"endpoint", "pod", "model", "replay", "bind", "dialect", "block_size", "dp_rank"}


def unique_endpoints(engines: tuple[EngineConfig, ...]) -> tuple[EngineConfig, ...]:
    seen: set[str] = set()
    for e in engines:
        if e.endpoint in seen:
            raise ConfigError(f"engine endpoint {e.endpoint} is configured twice (one SUB socket per endpoint)")
        seen.add(e.endpoint)
    return engines


def engine_from_table(table: dict[str, Any]) -> EngineConfig:
    unknown = set(table) - _ENGINE_KEYS
    if unknown:
        raise ConfigError(f"unknown engine key(s): {', '.join(sorted(unknown))}")
    if "endpoint" not in table:
        raise ConfigError("an engine needs an endpoint")
    try:
        return EngineConfig(
            endpoint=str(table["endpoint"]),
            pod=_opt_str(table.get("pod")),
            model=_opt_str(table.get("model")),
            replay=_opt_str(table.get("replay")),
            bind=_bool(table.get("bind", False), "bind"),
            dialect=str(table.get("dialect", "vllm")),
            block_size=_opt_int(table.get("block_size"), "block_size"),
            dp_rank=_opt_int(table.get("dp_rank"), "dp_rank"),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def parse_engine_spec(spec: str) -> EngineConfig:
    """``tcp://host:5557`` or ``endpoint=tcp://host:5557,pod=vllm-0,replay=tcp://host:5558``."""
    if "=" not in spec.split("://", 1)[0]:
        return engine_from_table({"endpoint": spec})
    table: dict[str, Any] = {}
    for part in spec.split(","):
        key, sep, value = part.partition("=")
        if not sep:
            raise ConfigError(f"engine spec part {part!r} is not key=value")
        table[key.strip()] = value.strip()
    return engine_from_table(table)


def load_toml(path: Path) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            return tomllib.load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}") from None
    except tomllib.TOMLDecodeError as exc:
        raise ConfigError(f"config {path} is not valid TOML: {exc}") from None


def config_from_toml(doc: dict[str, Any]) -> Config:
    server = doc.get("server", {})
    engines = unique_endpoints(tuple(engine_from_table(t) for t in doc.get("engines", [])))
    models = {name: _model(name, t) for name, t in doc.get("models", {}).items()}
    try:
        approx = ApproxConfig.from_toml(doc.get("approx", {}))
    except ValueError as exc:
        raise ConfigError(f"[approx]: {exc}") from None
    drift = _drift(doc.get("drift", {}))
    state = doc.get("state", {})
    unknown = set(state) - {"dir", "snapshot_seconds", "fsync", "peer"}
    if unknown:
        raise ConfigError(f"[state]: unknown key(s): {', '.join(sorted(unknown))}")
    try:
        return Config(
            host=str(server.get("host", "127.0.0.1")),
            port=int(server.get("port", 8080)),
            max_message_bytes=int(server.get("max_message_bytes", 64 << 20)),
            store=str(server.get("store", MEMORY)),
            store_buffer=int(server.get("store_buffer", 10_000)),
            workers=int(server.get("workers", 1)),
            engines=engines,
            models=models,
            approx=approx,
            drift=drift,
            state_dir=Path(state["dir"]) if state.get("dir") else None,
            snapshot_seconds=float(state.get("snapshot_seconds", 60.0)),
            fsync=str(state.get("fsync", "interval")),
            peer=_opt_str(state.get("peer")),
        )
    except (TypeError, ValueError) as exc:
        if isinstance(exc, ConfigError):
            raise
        raise ConfigError(f"[state]/[server]: {exc}") from None


def with_overrides(cfg: Config, *, host: str | None, port: int | None, engines: list[str],
                   state_dir: Path | None = None, snapshot_seconds: float | None = None, fsync: str | None = None,
                   peer: str | None = None, store: str | None = None, store_buffer: int | None = None,
                   workers: int | None = None) -> Config:
    extra = tuple(parse_engine_spec(s) for s in engines)
    return replace(
        cfg,
        host=host if host is not None else cfg.host,
        port=port if port is not None else cfg.port,
        engines=unique_endpoints(cfg.engines + extra),
        state_dir=state_dir if state_dir is not None else cfg.state_dir,
        snapshot_seconds=snapshot_seconds if snapshot_seconds is not None else cfg.snapshot_seconds,
        fsync=fsync if fsync is not None else cfg.fsync,
        peer=peer if peer is not None else cfg.peer,
        store=store if store is not None else cfg.store,
        store_buffer=store_buffer if store_buffer is not None else cfg.store_buffer,
        workers=workers if workers is not None else cfg.workers,
    )


def _drift(table: dict[str, Any]) -> DriftSettings:
    d = DriftSettings()
    try:
        out = DriftSettings(
            sample_size=int(table.get("sample_size", d.sample_size)),
            recheck_seconds=float(table.get("recheck_seconds", d.recheck_seconds)),
            window_seconds=float(table.get("window_seconds", d.window_seconds)),
            threshold=float(table.get("threshold", d.threshold)),
            history=int(table.get("history", d.history)),
        )
    except (TypeError, ValueError) as exc:
        raise ConfigError(f"[drift]: {exc}") from None
    if out.sample_size < 1 or out.recheck_seconds <= 0 or not 0 < out.threshold <= 1 or out.history < 1:
        raise ConfigError("[drift]: sample_size and history must be >= 1, recheck_seconds > 0, 0 < threshold <= 1")
    return out


def _model(name: str, table: dict[str, Any]) -> ModelConfig:
    try:
        return ModelConfig(
            tokenizer=str(table.get("tokenizer", "none")),
            tokenize_url=_opt_str(table.get("tokenize_url")),
            block_size=_opt_int(table.get("block_size"), "block_size"),
        )
    except ConfigError as exc:
        raise ConfigError(f"[models.{name!r}]: {exc}") from None


def _opt_str(v: Any) -> str | None:
    return None if v is None else str(v)


def _opt_int(v: Any, name: str) -> int | None:
    if v is None:
        return None
    try:
        return int(v)
    except (TypeError, ValueError):
        raise ConfigError(f"{name} must be an integer, got {v!r}") from None


def _bool(v: Any, name: str) -> bool:
    if isinstance(v, bool):
        return v
    if str(v).lower() in ("1", "true", "yes"):
        return True
    if str(v).lower() in ("0", "false", "no"):
        return False
    raise ConfigError(f"{name} must be true or false, got {v!r}")
