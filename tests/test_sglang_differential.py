"""Differential: kvindex's SGLang KV indexer API (gRPC, ``--grpc-port``) answers what its HTTP API
answers of the same state, on random workloads, through a real grpcio client and real HTTP.

- ZeroMQ-fed SGLang engines (two engines, three pods, one without a URL; random stores of prompt
  chains, DRAM copies, removals on both tiers, clears): after every ten batches, for random
  prompts, MatchExternalKvPrefix (whole, and cut by ``max_blocks``) equals ``/v1/score``'s device
  + host blocks per addressed pod for the same tokens, and MatchExternalKv equals the keyed
  entries ``GET /v1/state`` lists per pod and tier.
- Batches applied over gRPC (three workers, one without an address; random REPORT, REVOKE and
  CLEAR_ALL_AT_TIER on HBM, DRAM and SSD): after every batch, ``/v1/pods/{pod}`` counts per tier
  and ``/v1/state``'s entries equal MatchExternalKv, which equals SGLang's set rules (a plain model
  here); MatchExternalKvPrefix equals that model's longest HBM + DRAM run, and cut to its first
  block, ``/v1/score``'s answer for that block's tokens.

Each test prints how many answers it compared (``-s``).
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

from kvindex.config import Config
from kvindex.sglang.placements import EXTERNAL_MODEL
from tests.conftest import engine_config, ipc_endpoint
from tests.sglang_client import (
    CLEAR, DRAM, HBM, REPORT, REVOKE, SSD, URL_A, URL_B, Client, action, generate_stubs, http_prefix, http_tiers,
    sgl_frame, signed, unsigned,
)

BS = 4


@pytest.fixture(scope="module")
def pb(tmp_path_factory: pytest.TempPathFactory) -> Any:
    return generate_stubs(tmp_path_factory.mktemp("stubs"))


@dataclass(frozen=True)
class Block:
    hash: int  # signed, as SGLang sends it
    parent: int | None  # the index of the parent block, None at the root
    tokens: tuple[int, ...]


def prompt_tree(rng: random.Random, n: int) -> list[Block]:
    """``n`` blocks in a tree of prompts (each block's tokens its own), as an engine would hash them."""
    blocks: list[Block] = []
    for i in range(n):
        parent = None if i < 3 or rng.random() < 0.1 else rng.randrange(max(0, i - 8), i)
        blocks.append(Block(signed(rng.getrandbits(64)), parent, tuple(range(10_000 + i * BS, 10_000 + (i + 1) * BS))))
    return blocks


def chain(blocks: list[Block], i: int) -> list[Block]:
    out = [blocks[i]]
    while (p := out[-1].parent) is not None:
        out.append(blocks[p])
    return out[::-1]


@dataclass
class Engine:
    """What one pod's engine holds: the workload's bookkeeping (so that its events are ones an
    engine sends), never the oracle of a comparison."""

    gpu: set[int]
    cpu: set[int]

    def event(self, rng: random.Random, blocks: list[Block]) -> list[Any] | None:
        """A random event on a random prompt of the tree: the device stores what it lacks of it
        (its parent held), copies device blocks to DRAM, evicts from either tier, or clears."""
        run = chain(blocks, rng.randrange(len(blocks)))
        start = rng.randrange(len(run))
        part = [b.hash for b in run[start:start + rng.randint(1, 4)]]
        roll = rng.random()
        if roll < 0.4:
            j = next((i for i, b in enumerate(run) if b.hash not in self.gpu), None)
            if j is None:
                return None
            new = run[j:]
            self.gpu.update(b.hash for b in new)
            return ["BlockStored", [b.hash for b in new], run[j - 1].hash if j else None,
                    [t for b in new for t in b.tokens], BS, None, "GPU"]
        if roll < 0.6:  # a copy to DRAM of what the device holds
            part = [x for x in part if x in self.gpu and x not in self.cpu]
            self.cpu.update(part)
            return ["BlockStored", part, None, [], 0, None, "CPU"] if part else None
        if roll < 0.97:  # an eviction
            tier, medium = (self.gpu, "GPU") if roll < 0.85 else (self.cpu, "CPU")
            part = [x for x in part if x in tier]
            tier.difference_update(part)
            return ["BlockRemoved", part, medium] if part else None
        self.gpu.clear()
        self.cpu.clear()
        return ["AllBlocksCleared"]


async def test_zeromq_engines_grpc_equals_http_on_random_workloads(make_harness: Any, make_engine: Any,
                                                                    tmp_path: Path, pb: Any) -> None:
    rng = random.Random(3903)
    one, two = await make_engine(ipc_endpoint(tmp_path, "one")), await make_engine(ipc_endpoint(tmp_path, "two"))
    cfg = Config(engines=(engine_config(one, dialect="sglang", url=URL_A), engine_config(two, dialect="sglang")),
                 grpc_port=0)
    h = await make_harness(cfg)
    await h.wait_connected()
    client = Client(h.daemon.indexer.port, pb)
    blocks = prompt_tree(rng, 48)
    pods = {"a": one, "b": one, "c": two}  # c: an engine with no URL, so no router-facing address
    seqs, engines = dict.fromkeys(pods, -1), {pod: Engine(set(), set()) for pod in pods}
    compared = 0
    for batch in range(80):
        pod = rng.choice(sorted(pods))
        events = [ev for _ in range(rng.randint(1, 3)) if (ev := engines[pod].event(rng, blocks)) is not None]
        seqs[pod] += 1
        await pods[pod].publish(sgl_frame(pod, seqs[pod], *events))
        if batch % 10 == 9:
            for p, seq in seqs.items():
                if seq >= 0:
                    await h.wait_seq(p, seq)
            compared += await compare_prompts(h, client, rng, blocks)
    status, listed = await h.get("/v1/pods")
    assert sorted(p["pod"] for p in listed["pods"] if p["synced"]) == ["a", "b", "c"], listed  # every event applied
    assert "kvindex_decode_errors_total{" not in (await h.get("/metrics"))[1].decode()
    print(f"\nZeroMQ-fed: {compared} gRPC answers compared with the HTTP API's, all equal")
    assert compared == 8 * 16 * 3
    await client.channel.close()


async def compare_prompts(h: Any, client: Client, rng: random.Random, blocks: list[Block]) -> int:
    """16 random prompts (half of them running past the tree into a block no pod holds), each
    compared three ways; answers how many gRPC answers were compared."""
    probes = []
    for _ in range(16):
        run = chain(blocks, rng.randrange(len(blocks)))
        if rng.random() < 0.5:
            run = [*run, Block(signed(rng.getrandbits(64)), None, (1, 2, 3, 4))]
        probes.append(run)
    n = 0
    for run in probes:
        hashes, tokens = [b.hash for b in run], [t for b in run for t in b.tokens] + [7]  # 7: a partial last block
        assert await client.prefix(hashes) == await http_prefix(h, "m", tokens, {"a", "b"}), run
        cut = rng.randint(1, len(run))
        assert await client.prefix(hashes, max_blocks=cut) == \
            await http_prefix(h, "m", tokens[:cut * BS] + [7], {"a", "b"}), (run, cut)
        assert await client.tiers(hashes) == await http_tiers(h, hashes), run
        n += 3
    return n


class SetModel:
    """SGLang's placement rules, stated plainly: per worker, per tier, a set of hashes."""

    def __init__(self) -> None:
        self.held: dict[str, dict[int, set[int]]] = {}

    def apply(self, worker: str, actions: list[tuple[int, int, list[int]]]) -> None:
        tiers = self.held.setdefault(worker, {HBM: set(), DRAM: set(), SSD: set()})
        for kind, tier, hashes in actions:
            if kind == REPORT:
                tiers[tier].update(hashes)
            elif kind == REVOKE:
                tiers[tier].difference_update(hashes)
            else:
                tiers[tier].clear()

    def tiers(self, hashes: list[int]) -> dict[str, dict[int, list[int]]]:
        out = {}
        for worker, tiers in self.held.items():
            row = {t: [x for x in dict.fromkeys(hashes) if x in s] for t, s in tiers.items()}
            if row := {t: hs for t, hs in row.items() if hs}:
                out[worker] = row
        return out

    def prefix(self, hashes: list[int], addressed: set[str]) -> dict[str, int]:
        out = {}
        for worker in addressed & set(self.held):
            servable = self.held[worker][HBM] | self.held[worker][DRAM]
            n = next((i for i, x in enumerate(hashes) if x not in servable), len(hashes))
            if n:
                out[worker] = n
        return out


def random_actions(rng: random.Random, pool: list[int]) -> list[tuple[int, int, list[int]]]:
    out = []
    for _ in range(rng.randint(1, 4)):
        kind, tier = rng.choices((REPORT, REVOKE, CLEAR), (5, 3, 1))[0], rng.choice((HBM, HBM, DRAM, SSD))
        out.append((kind, tier, [] if kind == CLEAR else rng.sample(pool, rng.randint(1, 8))))
    return out


async def test_applied_batches_grpc_equals_http_and_sglangs_rules(make_harness: Any, pb: Any) -> None:
    rng = random.Random(3904)
    h = await make_harness(Config(grpc_port=0))
    client = Client(h.daemon.indexer.port, pb)
    pool = [signed(rng.getrandbits(64)) for _ in range(24)]
    addresses = {"w1": URL_A, "w2": URL_B, "w3": ""}  # w3: no address, so in no prefix answer
    model, with_http, with_model = SetModel(), 0, 0
    for seq in range(80):
        worker, actions = rng.choice(sorted(addresses)), random_actions(rng, pool)
        await client.apply(worker, *(action(pb, k, t, hs) for k, t, hs in actions), seq=seq, address=addresses[worker])
        model.apply(worker, actions)
        http, rules = await compare_applied(h, client, rng, model, pool, {w for w, a in addresses.items() if a})
        with_http, with_model = with_http + http, with_model + rules
    print(f"\ngRPC-applied: {with_http} gRPC answers compared with the HTTP API's, {with_model} with SGLang's "
          "rules, all equal")
    assert with_model == 80 * 2 and with_http >= 80 * 3
    await client.channel.close()


async def compare_applied(h: Any, client: Client, rng: random.Random, model: SetModel, pool: list[int],
                          addressed: set[str]) -> tuple[int, int]:
    """After one batch: answers how many comparisons were made with the HTTP API and with the rules."""
    probe = rng.sample(pool, len(pool))
    tiers = await client.tiers(probe)
    assert tiers == model.tiers(probe)
    assert tiers == await http_tiers(h, probe)
    for worker in model.held:
        status, view = await h.get(f"/v1/pods/{worker}")
        held = tiers.get(worker, {})
        if status == 404:  # an external worker holding nothing is no pod of the index's
            assert not held and view["field"] == "pod", view
            continue
        assert status == 200, view
        assert {t: view["blocks"][t] for t in ("gpu", "cpu", "disk")} == \
            {"gpu": len(held.get(HBM, ())), "cpu": len(held.get(DRAM, ())), "disk": len(held.get(SSD, ()))}, worker
    by_prefix = sorted(pool, key=lambda x: (x not in model.held.get("w1", {}).get(HBM, ()), rng.random()))
    assert await client.prefix(by_prefix) == model.prefix(by_prefix, addressed)  # long runs, not only 0 or 1
    first = unsigned(by_prefix[0])  # the block a hash is indexed as: its two u32 halves
    assert await client.prefix(by_prefix, max_blocks=1) == \
        await http_prefix(h, EXTERNAL_MODEL, [first & 0xFFFFFFFF, first >> 32, 0], addressed)
    return 2 + len(model.held), 2
