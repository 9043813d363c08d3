"""What the dashboard reads from the drift audit besides the sample: the count of every decision
in the window (not capped by ``sample_size``, memory bounded by the window) and a pod's prefixes
(``DriftAudit.prefixes``, served as ``GET /v1/drift/pods/{pod}``), on real in-memory stores."""

from __future__ import annotations

from array import array

from kvindex.query.drift import Decision, DriftAudit
from kvindex.index.approx import ApproxIndex
from kvindex.index.memory import MemoryApproxStore, MemoryPreciseStore
from kvindex.index.precise import PreciseIndex
from kvindex.settings import ApproxConfig, ApproxSettings, DriftSettings
from kvindex.types import Entry


def audit(clock: list[float], sample_size: int = 8) -> tuple[PreciseIndex, ApproxIndex, DriftAudit]:
    precise = PreciseIndex()
    precise.set_block_size("m", 16)
    approx = ApproxIndex(ApproxConfig(ApproxSettings(), {}))
    return precise, approx, DriftAudit(MemoryPreciseStore(precise), MemoryApproxStore(approx),
                                       DriftSettings(sample_size=sample_size, window_seconds=60), clock=lambda: clock[0])


def decision(t: float, pod: str, tenant: int, turn: int, label: str) -> Decision:
    """A prompt of 4 blocks: the tenant's 2-block system prompt, then 2 blocks of its own turn."""
    keys = [1000 * tenant + k for k in range(2)] + [1000 * tenant + 100 * turn + k for k in range(10, 12)]
    hashes = [2000 * tenant + k for k in range(2)] + [2000 * tenant + 100 * turn + k for k in range(10, 12)]
    return Decision(t=t, pod=pod, model="m", hashes=array("Q", hashes), keys=array("Q", keys), block_size=16,
                    prompt_tokens=4 * 16, approx=0.0, precise=0.0, actual=None, label=label)


def test_recorded_counts_every_decision_of_the_window_not_the_sample() -> None:
    clock = [1000.0]
    _, _, drift = audit(clock, sample_size=8)
    for i in range(50):  # 50 decisions over 25 s
        clock[0] = 1000.0 + i / 2
        drift.add(decision(clock[0], "a", i % 3, i, ""))
    assert len(drift.decisions()) == 8  # the sample is capped
    assert drift.recorded(60) == 50 and drift.summary()["overall"]["recorded"] == 50
    assert drift.summary()["overall"]["decisions"] == 8 and drift.summary()["sample_size"] == 8
    assert drift.recorded(5) == 12  # to the second: now is 1024.5, so the seconds 1019..1024 (2 a second)
    clock[0] = 1000.0 + 24.5 + 61
    drift.add(decision(clock[0], "a", 0, 99, ""))
    assert drift.recorded(60) == 1  # the window moved on; the old counts are gone
    assert len(drift._counts) == 1  # memory is bounded by the window


async def test_prefixes_say_what_a_pod_holds_and_what_the_router_believes() -> None:
    clock = [1000.0]
    precise, approx, drift = audit(clock, sample_size=64)
    # tenant 1's prompts are routed to "a" (recorded), tenant 2's went to "b" past the router
    for turn in range(3):
        d = decision(clock[0], "a", 1, turn, "tenant one says")
        approx.record("a", "m", list(d.hashes))
        precise.load_entries(Entry("a", 0, "GPU", 100 * turn + k, key, 1) for k, key in enumerate(d.keys))
        drift.add(d)
    d2 = decision(clock[0], "a", 2, 0, "cache_salt two")  # recorded on "a", but "b" holds it, "a" does not
    approx.record("a", "m", list(d2.hashes))
    precise.load_entries(Entry("b", 0, "GPU", 900 + k, key, 1) for k, key in enumerate(d2.keys))
    drift.add(d2)

    a = await drift.prefixes("a")
    assert [(g["label"], g["requests"], g["routed_here"], g["tokens_held"], g["held"], g["believed"]) for g in a] == [
        ("tenant one says", 3, 3, 64, 1.0, 1.0),
        ("cache_salt two", 1, 1, 0, 0.0, 1.0),  # believed, not held: stale
    ]
    assert a[0]["prefix"] == f"{1000:016x}"  # the first block's key
    b = await drift.prefixes("b")
    assert [(g["label"], g["routed_here"], g["tokens_held"], g["held"], g["believed"]) for g in b] == [
        ("cache_salt two", 0, 64, 1.0, 0.0),  # held, not believed: unseen
    ]
    assert await drift.prefixes("nobody") == []
