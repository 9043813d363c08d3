"""A stream's counters (kvindex.ingest.streams.StreamCounters): each batch's ``Applied`` is kept
and summed later; what the Prometheus children show after ``flush`` is the sum of every batch
added, however many batches came between scrapes (below, at and past ``PENDING_BATCHES``)."""

from __future__ import annotations

import random

import pytest
from prometheus_client import CollectorRegistry

from kvindex.ingest.streams import PENDING_BATCHES, StreamCounters
from kvindex.metrics import Metrics
from kvindex.types import Applied

FIELDS = ("stored_events", "removed_events", "cleared", "stored", "removed", "orphans", "unknown_removals",
          "reannounced")
SAMPLES = {"stored_events": ("kvindex_events_applied_total", {"pod": "p", "type": "BlockStored"}),
           "removed_events": ("kvindex_events_applied_total", {"pod": "p", "type": "BlockRemoved"}),
           "cleared": ("kvindex_events_applied_total", {"pod": "p", "type": "AllBlocksCleared"}),
           "stored": ("kvindex_blocks_stored_total", {"pod": "p"})}


@pytest.mark.parametrize("batches", [1, PENDING_BATCHES - 1, PENDING_BATCHES, 3 * PENDING_BATCHES + 7])
def test_flush_shows_the_sum_of_every_batch_added(batches: int) -> None:
    reg = CollectorRegistry()
    c = StreamCounters(Metrics(reg), "p")
    rng = random.Random(batches)
    want = dict.fromkeys(FIELDS, 0)
    for round_ in range(2):  # a scrape between: the second flush adds only what came after the first
        for _ in range(batches):
            done = Applied(**{f: rng.randrange(4) for f in FIELDS})
            for f in FIELDS:
                want[f] += getattr(done, f)
            c.add(done)
        c.flush()
        for f, (name, labels) in SAMPLES.items():
            assert (reg.get_sample_value(name, labels) or 0) == want[f], (round_, f)
