"""The Redis planner: what one batch changes in one worker, computed client-side.

Job: from a ``WorkerView`` (the worker's entries the batch can see, as the read script returned
them) and the batch, the ``Plan`` the apply script writes atomically: changed entries, holder
deltas, the worker's media, orphans and entry count, the block size to set, the batch's counts.

Invariants:
- The store/remove rule is not here. The batch is applied by a scratch ``ReferenceIndex`` (the
  rules, stated once) through its public API only: ``set_block_size``, ``load_entries`` (the
  view's entries), ``apply_batch``,
  then ``export_tables`` (what it holds afterwards, media in order, as snapshot rows) and
  ``block_size``; the plan is the difference between the view and what the scratch index holds
  afterwards. Every key, orphan, copy, media and block-size rule is the index's own.
- The view holds every entry of every hash the batch names (stored, removed, parents), in every
  medium, so the scratch index sees all the batch can read. Before the batch, each of the view's
  media also gets one *marker* entry, a hash the batch does not name: the scratch worker then has
  the worker's media in the same order (the order the index searches other media for a
  key). The markers stand for the entries the real worker holds outside the view
  (``view.held`` counts them all): while it holds any, the scratch worker is never freed and holds
  the model's block size, even when the batch removes every entry of the view. When the view is
  all the worker holds, the markers are removed again before the batch: the scratch worker then
  holds the size exactly while the real one does (a worker emptied mid-batch holds nothing, and a
  later store of another size is followed, as in reference.py), its emptied media kept in order.
- The worker's media after the batch are the scratch worker's (a medium emptied by the batch
  included), the view's when the batch left it empty (the scratch index freed it: the plan
  removes every entry of the view); a worker the batch left empty is freed by the store.
- The orphan count is the number of keyless entries (the index keeps it so): the view's
  count plus the change among the entries the batch could touch; after a clear, the scratch
  index's own count. A plan with ``reset`` (the batch cleared the worker) lists every entry held
  afterwards, against an empty worker.
- The model's block size follows the index's rule (reference.py): with ``view.others`` > 0 a
  scratch worker of an unknown model stands for the other workers (it holds the size); a plan
  that changes the size is re-checked by the apply script (no other worker then, else retry).
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvindex.events import GPU, BlockRemoved, BlockStored, KVEvent
from kvindex.index.protocol import tier_of
from kvindex.index.reference import ReferenceIndex
from kvindex.index.redis_keys import (
    KEYLESS,
    UNCHANGED,
    WorkerView,
    pack_changes,
    pack_holders,
    value_of,
)
from kvindex.index.rows import Table, unpack_rows
from kvindex.types import Applied, Entry

TIER_CHAR = {"gpu": "g", "cpu": "c", "disk": "d"}
OTHERS = "\0others"  # no pod's name: the scratch worker standing for the model's other workers

Change = tuple[int, int, bytes | None, int]  # (medium index, hash, stored value or None: gone, extra or UNCHANGED)


@dataclass(frozen=True, slots=True)
class Plan:
    """A batch's effect on one worker, as the apply script takes it."""

    done: Applied
    reset: bool
    media: tuple[str, ...]
    orphans: int
    changes: list[Change]
    holders: dict[tuple[str, int], int]  # (tier char, key) -> change of the copies held (non-zero)
    counted: int  # change of the number of entries (medium, hash) held
    new_block_size: int | None


def hashes_of(events: Sequence[KVEvent]) -> list[int]:
    """Every engine hash the batch can read or write (stored, removed, parents), once each."""
    seen: dict[int, None] = {}
    for ev in events:
        if type(ev) is BlockStored:
            if ev.parent_hash is not None:
                seen[ev.parent_hash] = None
            seen.update(dict.fromkeys(ev.block_hashes))
        elif type(ev) is BlockRemoved:
            seen.update(dict.fromkeys(ev.block_hashes))
    return list(seen)


def _marker(hashes: Sequence[int]) -> int:
    """A hash the batch does not name."""
    named, h = set(hashes), 1
    while h in named:
        h += 1
    return h


def _seed(pod: str, rank: int, view: WorkerView, marker: int) -> Iterator[Entry]:
    """One marker per medium first, in the worker's order (so the scratch worker opens its media in
    that order), then the view's entries."""
    for m in view.media:
        yield Entry(pod, rank, m, marker, marker, 1)
    for (m, h), (key, extra) in view.entries.items():
        yield Entry(pod, rank, m, h, key, 1 + extra)


def plan_batch(pod: str, model: str, rank: int, events: Sequence[KVEvent], view: WorkerView,
               hashes: list[int]) -> Plan:
    """Apply ``events`` to a scratch index holding the view, and diff (see the module's docstring)."""
    scratch = ReferenceIndex()  # the rules themselves, on a small view
    if view.block_size is not None:
        scratch.set_block_size(model, view.block_size)
    marker = _marker(hashes)
    scratch.load_entries(_seed(pod, rank, view, marker))
    if view.entries and view.held == len(view.entries):  # nothing outside the view: the markers stand for nothing
        scratch.apply_batch(pod, model, rank, [BlockRemoved((marker,), m) for m in view.media])
    if view.others:  # the model's other workers hold its block size: one stands for them all
        scratch.load_entries([Entry(OTHERS, 0, GPU, marker, marker, 1)])
    done = scratch.apply_batch(pod, model, rank, events)
    reset = done.cleared > 0
    copy = [c for c in scratch.export_tables() if c[0] == pod]  # the one worker's media in order, empty ones included
    media = tuple(medium for _, _, medium, _ in copy) or view.media or (GPU,)  # freed: the entries it held go
    after = _held(copy)
    for m in media:
        after.pop((m, marker), None)
    before = {} if reset else view.entries
    keyless = _keyless(after)
    orphans = keyless if reset else view.orphans + keyless - _keyless(before)
    changes, holders, counted = _diff(media, before, after)
    new_bs = scratch.block_size(model) if scratch.block_size(model) != view.block_size else None
    return Plan(done, reset, media, orphans, changes, holders, counted, new_bs)


def _keyless(entries: dict[tuple[str, int], tuple[int | None, int]]) -> int:
    return [key for key, _ in entries.values()].count(None)


def _held(copy: Sequence[Table]) -> dict[tuple[str, int], tuple[int | None, int]]:
    """``(medium, hash) -> (key or None, extra copies)`` of ``export_tables``' rows."""
    return {(medium, h): (key, copies - 1) for _, _, medium, rows in copy for h, key, copies in unpack_rows(rows)}


def _diff(media: tuple[str, ...], before: dict[tuple[str, int], tuple[int | None, int]],
          after: dict[tuple[str, int], tuple[int | None, int]]) -> tuple[list[Change], dict[tuple[str, int], int], int]:
    """The changed entries, the holder deltas (copies per tier and key) and the change of the
    number of entries, from ``before`` to ``after``."""
    changes: list[Change] = []
    deltas: dict[tuple[str, int], int] = {}
    where = {m: (i, TIER_CHAR[tier_of(m)]) for i, m in enumerate(media, 1)}  # medium -> (index, tier char)
    get = deltas.get
    counted = 0
    for mh, old in before.items():  # held before: changed or gone
        now = after.get(mh)
        if now == old:
            continue
        (m, h), (key, extra) = mh, old
        idx, t = where[m]
        if key is not None:
            deltas[(t, key)] = get((t, key), 0) - 1 - extra
        if now is None:
            counted -= 1
            changes.append((idx, h, None, UNCHANGED if extra == 0 else 0))
        else:
            new, new_x = now
            changes.append((idx, h, value_of(new), UNCHANGED if new_x == extra else new_x))
            if new is not None:
                deltas[(t, new)] = get((t, new), 0) + 1 + new_x
    for mh, now in after.items():  # new
        if mh in before:
            continue
        (m, h), (new, new_x) = mh, now
        idx, t = where[m]
        counted += 1
        if new is None:
            changes.append((idx, h, KEYLESS, UNCHANGED if new_x == 0 else new_x))
        else:
            changes.append((idx, h, new.to_bytes(8, "big"), UNCHANGED if new_x == 0 else new_x))
            deltas[(t, new)] = get((t, new), 0) + 1 + new_x
    return changes, {k: d for k, d in deltas.items() if d}, counted


def apply_args(base: str, seq: int, epoch: int, force: str | None, cleared: bool, name: str, view: WorkerView,
                plan: Plan) -> list[str | bytes]:
    """The apply script's arguments (see apply_batch in redis_precise.lua); a view of version "*"
    was not read (nothing to check)."""
    if view.version == "*":
        read_bs = "*"
    else:
        read_bs = "" if view.block_size is None else str(view.block_size)
    sets, dels, extras = pack_changes(plan.changes)
    holders = pack_holders(base, plan.holders)
    return [str(seq), str(epoch), "-" if force is None else "+" + force, "1" if cleared else "0", name,
            view.version, read_bs, "" if plan.new_block_size is None else str(plan.new_block_size),
            "1" if plan.reset else "0", "\n".join(plan.media), str(plan.orphans), sets, dels, extras, holders,
            str(plan.counted), str(max(seq - 1, 0))]
