"""Configuration that refuses what it does not understand: unknown keys and tables, engine addresses
ZeroMQ cannot use; and every key docs/configuration.md documents still loads."""

from __future__ import annotations

import re
import subprocess
import sys
import tomllib
from pathlib import Path

import msgspec.inspect as mi
import pytest

from kvindex.config import ConfigError, EngineConfig, ModelConfig, check_zmq_endpoint
from kvindex.configfile import (
    ApproxModelTable,
    ApproxTable,
    ConfigFile,
    RouteTable,
    ServerTable,
    StateTable,
    config_from_toml,
    load_file,
    parse_engine_spec,
)
from kvindex.settings import KTHENA_KEYS, ApproxSettings, DriftSettings, TierWeights

ROOT = Path(__file__).parent.parent
KVINDEX = [sys.executable, "-m", "kvindex"]


def refusal(text: str) -> str:
    with pytest.raises(ConfigError) as info:
        config_from_toml(tomllib.loads(text), source="kvindex.toml")
    message = str(info.value)
    assert "\n" not in message
    return message


@pytest.mark.parametrize("text,message", [
    ("[servr]\nport = 1", "unknown table [servr] (did you mean [server]?)"),
    ("[Server]\nport = 1", "unknown table [Server] (did you mean [server]?)"),
    ('[[engine]]\nendpoint = "tcp://h:5557"', "unknown table [[engine]] (did you mean [[engines]]?)"),
    ('[engines]\nendpoint = "tcp://h:5557"', "[engines] must be an array of tables: write [[engines]] for each entry"),
    ("[modles.m]\ntokenizer = 'none'", "unknown table [modles] (did you mean [models]?)"),
    ("[drfit]\nthreshold = 0.3", "unknown table [drfit] (did you mean [drift]?)"),
    ("[stat]\ndir = '/tmp'", "unknown table [stat] (did you mean [state]?)"),
    ("port = 8080", "unknown key port at the top level (did you mean port in [server]?)"),
    ("[server]\nprot = 8080", "unknown key prot in [server] (did you mean port?)"),
    ("[server]\nworker = 2", "unknown key worker in [server] (did you mean workers?)"),
    ("[server]\ncolour = 1", "unknown key colour in [server] (known: host, port, max_message_bytes, receive_buffer_bytes, "
                             "receive_queue_messages, max_lag_seconds, store, "
                             "store_buffer, workers, auth, max_connections, idle_timeout, body_timeout, http_fast_path, max_blocks_per_pod, "
                             "engine_silent_seconds, dynamo_dump, ext_proc_port, ext_proc_host, grpc_port, grpc_host)"),
    ("[server.tls]\ncert = 'x'", "unknown table [server.tls] (known: host, port, max_message_bytes, receive_buffer_bytes, "
                             "receive_queue_messages, max_lag_seconds, store, "
                                 "store_buffer, workers, auth, max_connections, idle_timeout, body_timeout, http_fast_path, max_blocks_per_pod, "
                                 "engine_silent_seconds, dynamo_dump, ext_proc_port, ext_proc_host, grpc_port, grpc_host)"),
    ('[[engines]]\nendpoint = "tcp://h:1"\n[[engines]]\nendpiont = "tcp://h:2"',
     "unknown key endpiont in [[engines]] #2 (did you mean endpoint?)"),
    ('[[engines]]\nendpoint = "tcp://h:1"\nreplay_endpoint = "tcp://h:2"',
     "unknown key replay_endpoint in [[engines]] #1 (did you mean replay?)"),
    ('[[engines]]\nendpoint = "tcp://h:1"\nblocksize = 16',
     "unknown key blocksize in [[engines]] #1 (did you mean block_size?)"),
    ('[models."Qwen/Qwen3-8B"]\ntokeniser = "engine"',
     'unknown key tokeniser in [models."Qwen/Qwen3-8B"] (did you mean tokenizer?)'),
    ("[models.tiny]\nblocksize = 32", "unknown key blocksize in [models.tiny] (did you mean block_size?)"),
    ("[approx]\ntopKMatch = 3", "unknown key topKMatch in [approx] (did you mean topKMatches?)"),
    ("[approx]\nblock_size_to_hash = 64",
     "unknown key block_size_to_hash in [approx] (did you mean blockSizeToHash?)"),
    ('[approx.models."m"]\npersonalty = "gie-v1.5"',
     "unknown key personalty in [approx.models.m] (did you mean personality?)"),
    ('[approx.model."m"]\ntopKMatches = 1', "unknown table [approx.model] (did you mean [approx.models]?)"),
    ("[drift]\nsampel_size = 10", "unknown key sampel_size in [drift] (did you mean sample_size?)"),
    ("[drift]\nrecheck = 10", "unknown key recheck in [drift] (did you mean recheck_seconds?)"),
    ("[state]\ndirectory = '/tmp'", "unknown key directory in [state] (did you mean dir?)"),
    ("[state]\nsnapshot_secs = 5", "unknown key snapshot_secs in [state] (did you mean snapshot_seconds?)"),
])
def test_unknown_keys_and_tables_name_where_and_the_closest_name(text: str, message: str) -> None:
    assert refusal(text) == f"kvindex.toml: {message}"


@pytest.mark.parametrize("text,message", [
    ('[server]\nport = "x"', "[server] port must be an integer, got 'x'"),
    ("server = 5", "[server] must be a table, got an integer"),
    ('[[engines]]\nendpoint = "tcp://h:1"\n[[engines]]\nendpoint = "tcp://h:2"\nblock_size = "x"',
     "[[engines]] #2 block_size must be an integer, got 'x'"),
    ("[[engines]]\npod = 'p'", "[[engines]] #1 needs endpoint"),
    ('[[engines]]\nendpoint = "tcp://h:1"\ndialect = "trt"',
     "[[engines]] #1: engine dialect 'trt': expected one of vllm, sglang, llmd-sim"),
    ('[models.a]\n[models.b]\nblock_size = "q"', "[models.b] block_size must be an integer, got 'q'"),
    ('[models]\ntokenizer = "engine"', "[models.tokenizer] must be a table, got a string"),
    ('[models.m]\ntokenizer = "engine"',
     "[models.m]: tokenizer = \"engine\" needs tokenize_url (the engine's base URL)"),
    ("[approx]\ntopKMatches = 1.5", "[approx]: approx.topKMatches must be an integer, got 1.5"),
    ('[models.m]\nblock_size = 18446744073709551616', "[models.m]: model block_size must be an integer from 1 to 65536"),
    ('[models.m]\nblock_size = 0', "[models.m]: model block_size must be an integer from 1 to 65536"),
    ('[[engines]]\nendpoint = "tcp://h:1"\nblock_size = 65537',
     "[[engines]] #1: engine block_size must be an integer from 1 to 65536"),
    ('[[engines]]\nendpoint = "tcp://h:1"\ndp_rank = 65536',
     "[[engines]] #1: engine dp_rank must be an integer from 0 to 65535"),
    ("[state]\npeer_max_bytes = 0", "peer_max_bytes must be a positive integer (bytes)"),
    ("[server]\nreceive_queue_messages = 0",
     "receive_queue_messages must be an integer from 1 to 10000000 (messages per engine)"),
    ("[state]\npeer_timeout = 0", "peer_timeout must be a number of seconds, > 0 and at most 86400"),
])
def test_bad_values_say_where(text: str, message: str) -> None:
    assert refusal(text) == f"kvindex.toml: {message}"


def test_the_receive_queue_reaches_each_engines_socket_settings() -> None:
    """``receive_queue_messages`` (file) and ``--receive-queue-messages`` (flag) set every lane's SUB
    RCVHWM (``LaneSettings.rcvhwm``, what ``ingest.lane`` opens its socket with)."""
    from kvindex.cli import build_parser, load_config
    from kvindex.ingest.streams import LaneSettings

    cfg = config_from_toml({"server": {"receive_queue_messages": 50}})
    assert LaneSettings.of(cfg).rcvhwm == 50
    assert LaneSettings.of(config_from_toml({})).rcvhwm == 1000  # ZeroMQ's own default
    args = build_parser().parse_args(["serve", "--receive-queue-messages", "7"])
    assert LaneSettings.of(load_config(args)).rcvhwm == 7


def test_serve_with_a_misspelled_table_exits_2_with_one_line_before_starting(tmp_path: Path) -> None:
    bad = tmp_path / "kvindex.toml"
    bad.write_text("[servr]\nport = 0\n")
    r = subprocess.run(KVINDEX + ["serve", "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2
    assert r.stderr == f"kvindex: {bad}: unknown table [servr] (did you mean [server]?)\n"


@pytest.mark.parametrize("text,needle", [
    ('[[engine]]\nendpoint = "tcp://127.0.0.1:5557"\n', "unknown table [[engine]] (did you mean [[engines]]?)"),
    ("[server]\nport = 0\nhots = '0.0.0.0'\n", "unknown key hots in [server] (did you mean host?)"),
    ('[[engines]]\nendpoint = "http://127.0.0.1:8000"\n', "http:// is not a ZeroMQ transport"),
])
def test_serve_refuses_each_bad_file_in_one_line(tmp_path: Path, text: str, needle: str) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text(text)
    r = subprocess.run(KVINDEX + ["serve", "--config", str(bad)], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert r.stderr.startswith(f"kvindex: {bad}: ") and needle in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("spec", ["http://127.0.0.1:8000", "https://vllm-0:8000",
                                  "endpoint=http://127.0.0.1:8000,pod=vllm-0",
                                  "endpoint=tcp://127.0.0.1:5557,replay=http://127.0.0.1:8000"])
def test_engine_with_an_http_scheme_is_refused_at_parse_time(spec: str) -> None:
    r = subprocess.run(KVINDEX + ["serve", "--engine", spec], capture_output=True, text=True, timeout=30)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and len(r.stderr.strip().splitlines()) == 1
    assert r.stderr.startswith("kvindex: ") and "is not a ZeroMQ transport" in r.stderr
    assert "not to its HTTP API" in r.stderr


@pytest.mark.parametrize("endpoint,needle", [
    ("http://h:8000", "http:// is not a ZeroMQ transport"),
    ("udp://h:5557", "udp:// is not a ZeroMQ transport"),
    ("tcp://h", "tcp:// needs host:port"),
    ("tcp://h:port", "tcp:// needs host:port"),
    ("ipc://", "ipc:// needs an address"),
    ("h:5557", "is not a ZeroMQ address like tcp://host:5557"),
])
def test_zmq_endpoint_check(endpoint: str, needle: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(needle)):
        check_zmq_endpoint(endpoint, "engine endpoint")
    with pytest.raises(ConfigError, match=re.escape(needle)):
        parse_engine_spec(f"endpoint={endpoint}")


@pytest.mark.parametrize("endpoint", ["tcp://10.0.0.5:5557", "tcp://*:5557", "tcp://[::1]:5557", "tcp://eth0;h:1",
                                      "ipc:///run/kv.sock", "inproc://engine"])
def test_zmq_endpoints_accepted(endpoint: str) -> None:
    check_zmq_endpoint(endpoint, "engine endpoint")
    assert parse_engine_spec(endpoint).endpoint == endpoint


def test_engine_spec_keys_are_checked_like_the_file() -> None:
    with pytest.raises(ConfigError, match=r"unknown key blocksize in --engine .* \(did you mean block_size\?\)"):
        parse_engine_spec("endpoint=tcp://h:1,blocksize=16")
    with pytest.raises(ConfigError, match="block_size must be an integer, got 'x'"):
        parse_engine_spec("endpoint=tcp://h:1,block_size=x")
    with pytest.raises(ConfigError, match="pod is given twice"):
        parse_engine_spec("endpoint=tcp://h:1,pod=a,pod=b")
    for word, value in (("true", True), ("yes", True), ("1", True), ("false", False), ("no", False), ("0", False)):
        assert parse_engine_spec(f"endpoint=tcp://h:1,bind={word}").bind is value
        toml = {"engines": [{"endpoint": "tcp://h:1", "bind": word}]}
        assert config_from_toml(toml).engines[0].bind is value, word  # the file accepts the same words


def documented_toml() -> str:
    """The configuration example of docs/configuration.md (the README links to it)."""
    text = (ROOT / "docs" / "configuration.md").read_text()
    m = re.search(r"`kvindex serve --config kvindex.toml` reads:\n\n```toml\n(.*?)```", text, re.S)
    assert m, "docs/configuration.md's configuration example moved"
    return m.group(1)


def test_every_key_the_configuration_page_documents_loads(tmp_path: Path) -> None:
    path = tmp_path / "kvindex.toml"
    path.write_text(documented_toml().replace("# grpc_", "grpc_") + '\n[approx.models."gie-model"]\npersonality = "gie-v1.5"\n'
                    '\n[state]\ndir = "/var/lib/kvindex"\nsnapshot_seconds = 30\nfsync = "always"\n')
    cfg = load_file(path)
    assert (cfg.host, cfg.port, cfg.store, cfg.store_buffer, cfg.workers) == ("127.0.0.1", 8080, "memory://", 10000, 1)
    assert (cfg.grpc_port, cfg.grpc_host) == (50051, "0.0.0.0")  # commented out on the page: the port is opt-in
    (e,) = cfg.engines
    assert (e.endpoint, e.replay, e.pod, e.model, e.dialect, e.block_size, e.bind) == (
        "tcp://10.0.0.5:5557", "tcp://10.0.0.5:5558", "default/vllm-0", "Qwen/Qwen3-8B", "vllm", 16, False)
    m = cfg.model("Qwen/Qwen3-8B")
    assert (m.tokenizer, m.tokenize_url) == ("engine", "http://10.0.0.5:8000")
    assert cfg.approx.default == ApproxSettings("kthena", 64, 128, 50000, 5)
    assert cfg.approx.for_model("gie-model") == ApproxSettings("gie-v1.5", 64, 128, 50000, 5)
    assert cfg.drift == DriftSettings(2048, 5.0, 300.0, 0.5)
    assert (cfg.state_dir, cfg.snapshot_seconds, cfg.fsync) == (Path("/var/lib/kvindex"), 30.0, "always")
    assert config_from_toml({"state": {"peer": "http://kvindex-0:8080"}}).peer == "http://kvindex-0:8080"
    bounds = config_from_toml({"state": {"peer_max_bytes": 1 << 20, "peer_timeout": 5}})
    assert (bounds.peer_max_bytes, bounds.peer_timeout) == (1 << 20, 5)


def test_every_key_accepted_before_is_still_known() -> None:
    """The schema is the list of keys kvindex reads; none was lost (and none is ignored)."""
    def keys(kind: type) -> set[str]:
        return {f.encode_name for f in mi.type_info(kind).fields}  # type: ignore[attr-defined]

    assert keys(ConfigFile) == {"server", "engines", "models", "approx", "drift", "tiers", "state", "route"}
    assert keys(TierWeights) == {"device_weight", "host_weight", "disk_weight"}
    assert {k: keys(t) for k, t in (("server", ServerTable), ("approx", ApproxTable), ("drift", DriftSettings),
                                    ("state", StateTable), ("engines", EngineConfig), ("models", ModelConfig),
                                    ("route", RouteTable))} == {
        "server": {"host", "port", "max_message_bytes", "receive_buffer_bytes", "receive_queue_messages", "max_lag_seconds", "store", "store_buffer", "workers", "auth",
                   "max_connections", "idle_timeout", "body_timeout", "http_fast_path", "max_blocks_per_pod",
                   "engine_silent_seconds", "dynamo_dump", "ext_proc_port", "ext_proc_host", "grpc_port",
                   "grpc_host"},
        "approx": {"personality", "blockSizeToHash", "maxBlocksToMatch", "maxHashCacheSize", "topKMatches", "models"},
        "drift": {"sample_size", "recheck_seconds", "window_seconds", "threshold", "history"},
        "state": {"dir", "snapshot_seconds", "orphan_grace_seconds", "fsync", "peer", "peer_max_bytes",
                  "peer_timeout"},
        "engines": {"endpoint", "pod", "model", "replay", "bind", "dialect", "block_size", "dp_rank", "url"},
        "models": {"tokenizer", "tokenize_url", "tokenizer_path", "trust_request_chat_template", "block_size",
                   "base_model", "models_url"},
        "route": {"mode", "prefix_index", "gpu_weight", "cpu_weight", "disk_weight", "match_length_weight",
                  "match_length_scale_tokens", "scrape_seconds", "staleness_seconds", "max_body_bytes",
                  "pending_seconds", "max_pending", "seed", "scorers", "models"},
    }
    assert keys(ApproxModelTable) == {"personality", *(k for k, _ in KTHENA_KEYS)}
    cfg = config_from_toml({
        "server": {"max_message_bytes": 1 << 20, "workers": 2, "store_buffer": 5, "host": "0.0.0.0", "port": 1},
        "engines": [{"endpoint": "tcp://h:1", "pod": "p", "model": "m", "replay": "tcp://h:2", "bind": True,
                     "dialect": "sglang", "block_size": 32, "dp_rank": 1}],
        "models": {"*": {"tokenizer": "llmd-sim", "block_size": 16}},
        "approx": {"maxHashCacheSize": 10, "models": {"m": {"topKMatches": 2}}},
        "drift": {"history": 10, "window_seconds": 60, "recheck_seconds": 1, "sample_size": 5, "threshold": 0.2},
        "state": {"dir": ""},
    })
    assert (cfg.max_message_bytes, cfg.workers, cfg.store_buffer, cfg.state_dir) == (1 << 20, 2, 5, None)
    assert cfg.engines[0].dp_rank == 1 and cfg.model("anything").block_size == 16
    assert cfg.approx.for_model("m").top_k_matches == 2 and cfg.drift.history == 10


@pytest.mark.parametrize("name", ["kvindex-redis.toml", "kvindex-sim.toml", "kvindex-vllm.toml"])
def test_deploy_files_load(name: str) -> None:
    load_file(ROOT / "deploy" / name)


def test_tier_weights_default_to_dynamos_and_are_checked() -> None:
    assert config_from_toml({}).tiers == TierWeights(1.0, 0.75, 0.25)
    assert config_from_toml({"tiers": {"host_weight": 0.5, "disk_weight": 0}}).tiers == TierWeights(1.0, 0.5, 0)
    for table, message in (({"host_weight": -1}, "[tiers] host_weight must be a number from 0 to 1e6"),
                           ({"disk_weight": float("nan")}, "[tiers] disk_weight must be a number from 0 to 1e6"),
                           ({"device_weight": float("inf")}, "[tiers] device_weight must be a number"),
                           ({"device_weight": True}, "device_weight"),
                           ({"host": 1.0}, "unknown key host in [tiers] (did you mean host_weight?)")):
        with pytest.raises(ConfigError, match=re.escape(message)):
            config_from_toml({"tiers": table})
