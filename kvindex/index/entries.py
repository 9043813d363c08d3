"""Exported entries (``Entry`` or plain ``EntryRow`` tuples) grouped by the table they belong to:
one (pod, dp_rank, medium). Pure functions, no index: a thread can group a big snapshot's entries
while the event loop serves, and ``PreciseIndex`` sizes each table once from the counts."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import groupby
from operator import itemgetter

from kvindex.types import EntryRow

Where = tuple[str, int, str]  # (pod, dp_rank, medium)
TABLE_OF = itemgetter(0, 1, 2)  # an entry's Where


def table_sizes(entries: Iterable[EntryRow]) -> dict[Where, int]:
    """How many of ``entries`` go to each table."""
    sizes: dict[Where, int] = {}
    for where, run in groupby(entries, TABLE_OF):
        sizes[where] = sizes.get(where, 0) + len(list(run))
    return sizes


def runs_by_table(entries: Iterable[EntryRow]) -> dict[Where, list[list[EntryRow]]]:
    """The entries of each table, as the runs they come in (an export's: one run per table)."""
    runs: dict[Where, list[list[EntryRow]]] = {}
    for where, run in groupby(entries, TABLE_OF):
        runs.setdefault(where, []).append(list(run))
    return runs
