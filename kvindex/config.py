"""Configuration: frozen values built from the command line and a TOML file, and nothing else.

Invariants:
- Everything is validated here, once; a bad value raises ``ConfigError`` naming the key and
  where it is (``kvindex.toml: [[engines]] #2 block_size must be an integer, got 'x'``).
- Nothing is silently ignored: ``kvindex.configfile`` decodes the TOML file and the command line
  into these values (an unknown or misspelled key is an error naming it).
- Nothing downstream reads the environment or a dict of options: it gets these objects.
- An engine endpoint (and replay endpoint) is a ZeroMQ address kvindex can use
  (``check_zmq_endpoint``): ``http://...`` and the like are refused with the reason.
- Vocabulary: imports only the standard library, msgspec and other vocabulary modules.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from urllib.parse import urlsplit

from kvindex.events import MAX_BLOCK_SIZE, MAX_DP_RANK
from kvindex.lora import checked_adapters
from kvindex.settings import (
    FSYNC_POLICIES,
    ROUTE_MODES,
    SCORERS,
    ApproxConfig,
    ApproxSettings,
    DriftSettings,
    RouteSettings,
    TierWeights,
)
from kvindex.storeurl import MEMORY, check_store_url, describe, is_memory

MAX_WORKERS = 64
AUTH_MODES = ("writes", "all")  # what the bearer token guards (--auth; kvindex.http.app)
DIALECT_NAMES = ("vllm", "sglang", "llmd-sim")
TOKENIZER_NAMES = ("none", "engine", "llmd-sim", "hf", "render")
# ZeroMQ transports a SUB (and the replay DEALER) socket can use; each needs libzmq built with it
ZMQ_TRANSPORTS = {"tcp": None, "ipc": "ipc", "inproc": None, "pgm": "pgm", "epgm": "pgm", "tipc": "tipc",
                  "norm": "norm", "vmci": "vmci", "ws": "draft", "wss": "draft"}


class ConfigError(ValueError):
    pass


def check_zmq_endpoint(endpoint: str, what: str) -> None:
    """Refuse (``ConfigError``, one line) an address a ZeroMQ socket of kvindex cannot use."""
    scheme, sep, rest = endpoint.partition("://")
    if not sep or not scheme:
        raise ConfigError(f"{what} {endpoint!r} is not a ZeroMQ address like tcp://host:5557")
    if scheme not in ZMQ_TRANSPORTS:
        hint = ("; kvindex subscribes to the engine's ZeroMQ KV-event publisher (vLLM: --kv-events-config "
                "endpoint), not to its HTTP API" if scheme in ("http", "https") else "")
        raise ConfigError(f"{what} {endpoint!r}: {scheme}:// is not a ZeroMQ transport (use tcp://host:port, "
                          f"ipc:///path or inproc://name){hint}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port.isdigit() or port == "*"):
            raise ConfigError(f"{what} {endpoint!r}: tcp:// needs host:port, e.g. tcp://10.0.0.5:5557")
    elif not rest:
        raise ConfigError(f"{what} {endpoint!r}: {scheme}:// needs an address after it")
    capability = ZMQ_TRANSPORTS[scheme]
    if capability is not None:
        import zmq

        if not zmq.has(capability):
            raise ConfigError(f"{what} {endpoint!r}: this libzmq {zmq.zmq_version()} was built without {scheme}://")


def check_engine_url(url: str) -> None:
    """An engine's OpenAI base URL: ``http(s)://host[:port]`` (a path after it is kept)."""
    parts = urlsplit(url)
    try:
        port = parts.port
    except ValueError:
        port = -1
    if parts.scheme not in ("http", "https") or not parts.hostname or port == -1:
        raise ConfigError(f"engine url {url!r} is not the engine's base URL like http://10.0.0.5:8000")


def check_block_size(value: int | None, what: str) -> None:
    if value is not None and not 1 <= value <= MAX_BLOCK_SIZE:
        raise ConfigError(f"{what} must be an integer from 1 to {MAX_BLOCK_SIZE}")


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
    url: str | None = None  # the engine's OpenAI base URL: where requests go, where /metrics is read

    def __post_init__(self) -> None:
        check_zmq_endpoint(self.endpoint, "engine endpoint")
        if self.url is not None:
            check_engine_url(self.url)
        if self.replay:
            check_zmq_endpoint(self.replay, "engine replay endpoint")
        if self.dialect not in DIALECT_NAMES:
            raise ConfigError(f"engine dialect {self.dialect!r}: expected one of {', '.join(DIALECT_NAMES)}")
        check_block_size(self.block_size, "engine block_size")
        if self.dp_rank is not None and not 0 <= self.dp_rank <= MAX_DP_RANK:
            raise ConfigError(f"engine dp_rank must be an integer from 0 to {MAX_DP_RANK}")

    @property
    def name(self) -> str:
        return self.pod or self.endpoint

    @property
    def lane_key(self) -> str:
        """A configured engine's lane: one SUB socket per endpoint (ranks of a pod have their own)."""
        return f"config:{self.endpoint}"


@dataclass(frozen=True, slots=True)
class ModelConfig:
    """Per model: how its prompts are tokenized for the precise index, and its block size; for a
    LoRA adapter (``base_model``), the model it adapts; ``models_url``: an engine whose ``/v1/models``
    lists adapters (default: ``tokenize_url``; "" for none)."""

    tokenizer: str = "none"
    tokenize_url: str | None = None
    tokenizer_path: str | None = None  # tokenizer = "hf": the folder of tokenizer.json + tokenizer_config.json
    trust_request_chat_template: bool = False  # tokenizer = "hf": render a body's own chat_template
    block_size: int | None = None
    base_model: str | None = None
    models_url: str | None = None

    def __post_init__(self) -> None:
        check_block_size(self.block_size, "model block_size")
        if self.tokenizer not in TOKENIZER_NAMES:
            raise ConfigError(f"tokenizer {self.tokenizer!r}: expected one of {', '.join(TOKENIZER_NAMES)}")
        if self.tokenizer in ("engine", "render") and not self.tokenize_url:
            raise ConfigError(f'tokenizer = "{self.tokenizer}" needs tokenize_url (the engine\'s base URL)')
        if self.tokenizer == "hf":
            check_tokenizer_path(self.tokenizer_path)
        for key, value in (("tokenizer_path", self.tokenizer_path is not None),
                           ("trust_request_chat_template", self.trust_request_chat_template)):
            if value and self.tokenizer != "hf":
                raise ConfigError(f'{key} is read only by tokenizer = "hf" (tokenizer is "{self.tokenizer}")')
        if self.base_model is not None and (not self.base_model or self.block_size is not None):
            raise ConfigError("base_model must name the adapter's base model, and an adapter has no block_size of "
                              "its own (its blocks are its base model's)")
        if self.models_url and not self.models_url.startswith(("http://", "https://")):
            raise ConfigError(f"models_url {self.models_url!r} is not an http(s):// URL of an engine")

    @property
    def adapters_url(self) -> str | None:
        """Where this table's engine lists its LoRA adapters (``GET <url>/v1/models``), if anywhere."""
        return (self.models_url if self.models_url is not None else self.tokenize_url) or None


def check_tokenizer_path(path: str | None) -> None:
    """``tokenizer = "hf"``'s folder holds both files (their content: ``adapters.hf_tokenizer``)."""
    missing = [n for n in ("tokenizer.json", "tokenizer_config.json") if not (Path(path or "").expanduser() / n).is_file()]
    if not path or missing:
        raise ConfigError(f'tokenizer = "hf": tokenizer_path {path!r} must be a folder with tokenizer.json and '
                          f'tokenizer_config.json (a model repository or Hugging Face snapshot){"" if not path else f"; no {missing[0]} there"}')


# a peer's /v1/state (or Dynamo /dump) at most: 179M precise entries of 24 bytes (e.g. 1,000 engines
# of 64k GPU and 115k CPU-tier blocks), which a replica holds in 16 GB or more of index
PEER_MAX_BYTES = 4 << 30
MAX_BLOCKS_PER_POD = 4 << 20  # blocks (copies) per pod: ~0.7 GB of index; engines hold far fewer
RECEIVE_BUFFER_BYTES = 128 << 20  # per engine: what kvindex received and has not applied yet, at most
# messages an engine's SUB socket queues (ZeroMQ RCVHWM; ZeroMQ's own default): kvindex reads no faster
# than it applies (ingest.receiver), so a backlog waits here, then in TCP, then in the engine's PUB (past
# its SNDHWM the PUB drops: a seq gap). ~2.5 MB of vLLM batches of 24 block operations per engine
RCVHWM = 1_000
MAX_LAG_SECONDS = 5.0  # an engine's oldest batch not applied this long after kvindex received it: lagging


@dataclass(frozen=True, slots=True)
class Config:
    host: str = "127.0.0.1"
    port: int = 8080
    engines: tuple[EngineConfig, ...] = ()
    models: dict[str, ModelConfig] = field(default_factory=dict)
    approx: ApproxConfig = field(default_factory=lambda: ApproxConfig(ApproxSettings(), {}))
    drift: DriftSettings = field(default_factory=DriftSettings)
    tiers: TierWeights = field(default_factory=TierWeights)  # [tiers]: /v1/score's tier_score weights
    max_body_bytes: int = 8 << 20
    max_token_ids: int = 1 << 20
    replay_timeout: float = 2.0  # seconds an engine has to deliver one whole replay answer (--replay-timeout)
    replay_max_bytes: int = 128 << 20  # bytes one replay answer may hold (--replay-max-bytes)
    receive_queue_messages: int = RCVHWM  # per engine: messages ZeroMQ queues for kvindex (ZeroMQ RCVHWM; [server])
    max_message_bytes: int = 64 << 20  # ZeroMQ MAXMSGSIZE of the SUB and replay sockets ([server] max_message_bytes)
    receive_buffer_bytes: int = RECEIVE_BUFFER_BYTES  # per engine: received, not yet applied ([server])
    max_lag_seconds: float = MAX_LAG_SECONDS  # an engine's lane this far behind is lagging: unsynced ([server])
    state_dir: Path | None = None  # snapshots + write-ahead log; None: state lives in memory only
    snapshot_seconds: float = 60.0
    orphan_grace_seconds: float = 60.0  # restored pods no engine publishes for: answered this long ([state])
    fsync: str = "interval"  # always | interval | never (the write-ahead log's fsync policy)
    peer: str | None = None  # base URL of a running kvindex (or Dynamo indexer) whose state is loaded before serving
    peer_max_bytes: int = PEER_MAX_BYTES  # the peer's answer at most (--peer-max-bytes; kvindex.persist.peer)
    peer_timeout: float = 300.0  # seconds the peer has for its whole answer (--peer-timeout)
    store: str = MEMORY  # where the indexes live: memory:// or a Redis URL shared by replicas
    store_buffer: int = 10_000  # batches per lane kept while the store is unreachable
    workers: int = 1  # ingest worker processes (1: everything in this process; kvindex.shard.supervisor)
    auth: str = "writes"  # with a token: writes (and bulk exports) need it, or all but the health checks
    max_connections: int = 0  # open HTTP connections at most; 0: derived from RLIMIT_NOFILE (kvindex.http.server)
    idle_timeout: float = 30.0  # seconds an HTTP connection may go without a complete request header
    body_timeout: float = 30.0  # seconds a request body may take to arrive
    http_fast_path: bool = True  # /query and /query_by_hash answered before aiohttp (kvindex.http.fastpath)
    max_blocks_per_pod: int = MAX_BLOCKS_PER_POD  # past it a pod's stores are refused (kvindex.ingest.capacity)
    engine_silent_seconds: float = 10.0  # an engine not connected / silent this long is warned about ([server])
    dynamo_dump: bool = False  # keep what Dynamo's /dump needs, so its indexer can recover from kvindex
    route: RouteSettings = field(default_factory=RouteSettings)  # [route]: the request path (kvindex.route)
    ext_proc_port: int | None = None  # Envoy ext_proc (gRPC) port; None: no request path served
    ext_proc_host: str | None = None  # None: ``host``
    grpc_port: int | None = None  # SGLang's kv_indexer.v1.KVIndexer (gRPC) port; None: not served
    grpc_host: str | None = None  # None: ``host``

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
        if type(self.dynamo_dump) is not bool:
            raise ConfigError("dynamo_dump must be true or false")
        if type(self.http_fast_path) is not bool:
            raise ConfigError("http_fast_path must be true or false")
        if type(self.max_blocks_per_pod) is not int or not 1 <= self.max_blocks_per_pod < 1 << 40:
            raise ConfigError("max_blocks_per_pod must be a positive integer (blocks held per pod)")
        if type(self.store_buffer) is not int or self.store_buffer < 1:
            raise ConfigError("store_buffer must be a positive integer (batches per engine lane)")
        if self.auth not in AUTH_MODES:
            raise ConfigError(f"auth {self.auth!r}: expected one of {', '.join(AUTH_MODES)}")
        if self.fsync not in FSYNC_POLICIES:
            raise ConfigError(f"fsync {self.fsync!r}: expected one of {', '.join(FSYNC_POLICIES)}")
        if type(self.max_message_bytes) is not int or self.max_message_bytes <= 0:
            raise ConfigError("max_message_bytes must be a positive integer (bytes)")
        if type(self.replay_max_bytes) is not int or self.replay_max_bytes <= 0:
            raise ConfigError("replay_max_bytes must be a positive integer (bytes)")
        if isinstance(self.replay_timeout, bool) or not isinstance(self.replay_timeout, (int, float)) \
                or not 0 < self.replay_timeout <= 3600:
            raise ConfigError("replay_timeout must be a number of seconds, > 0 and at most 3600")
        if type(self.receive_buffer_bytes) is not int or self.receive_buffer_bytes < 1 << 20:
            raise ConfigError("receive_buffer_bytes must be an integer of at least 1048576 (bytes per engine)")
        if self.receive_buffer_bytes < 2 * self.max_message_bytes:
            raise ConfigError(f"receive_buffer_bytes ({self.receive_buffer_bytes}) must be at least twice "
                              f"max_message_bytes ({self.max_message_bytes}): the largest batch must fit")
        if type(self.receive_queue_messages) is not int or not 1 <= self.receive_queue_messages <= 10_000_000:
            raise ConfigError("receive_queue_messages must be an integer from 1 to 10000000 (messages per engine)")
        if type(self.max_lag_seconds) not in (int, float) or not 0 < self.max_lag_seconds < 1e6:
            raise ConfigError("max_lag_seconds must be a positive number of seconds")
        if type(self.engine_silent_seconds) not in (int, float) or not 0 < self.engine_silent_seconds < 1e6:
            raise ConfigError("engine_silent_seconds must be a positive number of seconds")
        if type(self.orphan_grace_seconds) not in (int, float) or not 0 <= self.orphan_grace_seconds < 1e6:
            raise ConfigError("orphan_grace_seconds must be a number of seconds, >= 0")
        if not self.snapshot_seconds > 0:
            raise ConfigError("snapshot_seconds must be > 0")
        self._check_http()
        try:
            checked_adapters({m: mc.base_model for m, mc in self.models.items()}, [(e.name, e.model) for e in self.engines])
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        _check_tiers(self.tiers)
        check_route(self.route)
        if self.ext_proc_port is not None and (type(self.ext_proc_port) is not int or not 0 <= self.ext_proc_port < 65536):
            raise ConfigError("ext_proc_port must be a port number from 0 to 65535")
        if self.grpc_port is not None and (type(self.grpc_port) is not int or not 0 <= self.grpc_port < 65536):
            raise ConfigError("grpc_port must be a port number from 0 to 65535")
        if self.grpc_port is not None and (not is_memory(self.store) or self.workers > 1):
            why = f"--workers {self.workers}" if is_memory(self.store) else f"--store {describe(self.store)}"
            raise ConfigError(f"--grpc-port (SGLang's KV indexer API) needs the memory store in one process (it "
                              f"reads each engine's own block hashes there), not {why}")
        if self.peer is not None and not self.peer.startswith(("http://", "https://")):
            raise ConfigError(f"peer {self.peer!r} is not an http(s):// URL of a running kvindex or Dynamo indexer")
        if type(self.peer_max_bytes) is not int or self.peer_max_bytes <= 0:
            raise ConfigError("peer_max_bytes must be a positive integer (bytes)")
        if type(self.peer_timeout) not in (int, float) or not 0 < self.peer_timeout <= 86400:
            raise ConfigError("peer_timeout must be a number of seconds, > 0 and at most 86400")

    def _check_http(self) -> None:
        if type(self.max_connections) is not int or self.max_connections < 0:
            raise ConfigError("max_connections must be an integer >= 1 (0: derived from the open-file limit)")
        for name in ("idle_timeout", "body_timeout"):
            value = getattr(self, name)
            if type(value) not in (int, float) or not 0 < value < 1e6:
                raise ConfigError(f"{name} must be a positive number of seconds")

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


def _check_tiers(t: TierWeights) -> None:
    for name in ("device_weight", "host_weight", "disk_weight"):
        value = getattr(t, name)
        if type(value) not in (int, float) or not 0 <= value <= 1e6:
            raise ConfigError(f"[tiers] {name} must be a number from 0 to 1e6 (what a matched block on that tier is worth)")


def check_route(r: RouteSettings) -> None:
    for model, mode in [("", r.mode), *r.models.items()]:
        if mode not in ROUTE_MODES:
            where = f'[route.models."{model}"] mode' if model else "[route] mode"
            raise ConfigError(f"{where} {mode!r}: expected one of {', '.join(ROUTE_MODES)}")
    for name, weight in r.weights.items():
        if name not in SCORERS:
            raise ConfigError(f"[route.scorers] {name!r} is not a scorer: expected one of {', '.join(SCORERS)}")
        if type(weight) not in (int, float) or not 0 <= weight <= 1e6:
            raise ConfigError(f"[route.scorers] {name} must be a weight from 0 to 1e6")
    if r.prefix_index not in ("precise", "approx"):
        raise ConfigError("[route] prefix_index must be \"precise\" or \"approx\"")
    for name in ("gpu_weight", "cpu_weight", "disk_weight", "match_length_weight"):
        if type(getattr(r, name)) not in (int, float) or not 0 <= getattr(r, name) <= 1:
            raise ConfigError(f"[route] {name} must be a number from 0 to 1")
    for name in ("scrape_seconds", "staleness_seconds", "pending_seconds"):
        if type(getattr(r, name)) not in (int, float) or not 0.001 <= getattr(r, name) <= 86400:
            raise ConfigError(f"[route] {name} must be a number of seconds from 0.001 to 86400")
    for name in ("max_body_bytes", "max_pending", "match_length_scale_tokens"):
        if type(getattr(r, name)) is not int or getattr(r, name) < 1:
            raise ConfigError(f"[route] {name} must be a positive integer")
    if r.seed is not None and type(r.seed) is not int:
        raise ConfigError("[route] seed must be an integer")
