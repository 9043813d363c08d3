"""The precise store's Redis key layout and wire encoding (redis_precise.lua is the other side).

Job: name the keys, encode what the client sends (hashes, entries, holder changes) and decode what
the scripts reply (positions, a worker's entries). No I/O, no index rules.

Key layout:
- Every key of one model carries the hash tag ``{<model id>}``, so each script touches one slot
  (Redis Cluster). Global keys: ``<prefix>:gen`` (the store's generation), ``<prefix>:mid`` (HASH
  model -> its small id, allocated from ``<prefix>:mid:n`` by the first client needing it),
  ``<prefix>:pods`` (HASH pod -> model, for load_entries).
- Under ``B = <prefix>:{<model id>}:``: ``gen`` (copy of the generation), ``bs`` (block size: of the model's workers' engines; set while none exists), ``cbs`` (the
  block size every replica configured),
  ``off`` (set once a cpu/disk copy was held), ``s:<stream id>`` HASH q(last seq) e(epoch)
  y(synced) r(reason); workers: ``W`` HASH "rank|pod" -> slot (``N``: its inverse), ``slots``
  bitmap of slots in use (the lowest free slot is reused, as PreciseIndex reuses bits), ``v`` HASH
  "rank|pod" -> version (bumped by every write to the worker, never deleted: a recreated worker is
  a new version), ``w:<slot>`` HASH n(name) M(media in first-store order, "\\n"-joined)
  o(orphans) c(entries); ``b:<slot>:<i>:<bucket>`` HASH engine hash -> key or "o" of the i-th
  medium, in 128 buckets by the hash's low 7 bits (listpack hashes up to Redis's default
  hash-max-listpack-entries, 512: ~25 bytes per entry, listpack up to ~65k hashes per worker and
  medium; few buckets: a batch's hashes share them, and each bucket touched costs the scripts one
  call), ``k:<slot>:<i>`` bitmap of the buckets that may be in use (a superset: an emptied bucket
  keeps its bit until the worker goes), ``x:<slot>`` HASH "<i>:<hash>" -> copies beyond the first;
  holders per tier t in g|c|d: ``t:<key>`` bitmap of the slots holding the key (the memory
  index's holder set), and per worker ``D:<slot>`` HASH holder key name -> its copies beyond the first.

Encoding invariants:
- Engine hashes and keys are 8 big-endian bytes (binary strings: compact, and Lua never turns them
  into numbers); a keyless (orphan) entry's value is ``b"o"``. Seqs and epochs are decimal strings;
  Lua compares seqs as strings (exact over the whole u64 range), epochs as numbers (they grow by
  one per engine restart). kvindex sets no TTL on any key.
- A batch's bulk arguments (hashes per bucket, entries per bucket, holder changes) travel
  msgpack-encoded (str, not bin: cmsgpack reads str) and are unpacked in C by the scripts: they do
  no per-entry parsing, and a batch costs about one Redis call per bucket touched plus a few.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import chain
from typing import Any

import msgpack
import redis.asyncio as aioredis

from kvindex.sequence import Position
from kvindex.types import PodMatch, merged

pack = msgpack.Packer(use_bin_type=False).pack  # the scripts' cmsgpack reads str, not bin
BUCKET_MASK = 127  # a hash's bucket: its low 7 bits (bucket_of in the script)
DIGITS = tuple(str(b).encode() for b in range(BUCKET_MASK + 1))  # a bucket's number as its key names it
UNCHANGED = (1 << 32) - 1  # in a change: extra copies not changed
KEYLESS = b"o"  # an orphan's value


def text(v: Any) -> Any:
    return v.decode() if isinstance(v, bytes) else v


def position_of(q: Any, e: Any, y: Any, r: Any) -> Position | None:
    """A stream position from its q, e, y, r fields (None when never positioned)."""
    if e is None:
        return None
    return Position(None if q is None else int(q), int(e), text(y) == "1", text(r))


def u64(v: int) -> bytes:
    """An engine hash or key as the store holds it: 8 bytes, big-endian (never a Lua number)."""
    return v.to_bytes(8, "big")


def value_of(key: int | None) -> bytes:
    """An entry's stored value: its key, or ``KEYLESS``."""
    return KEYLESS if key is None else key.to_bytes(8, "big")


def key_of(v: bytes) -> int | None:
    """An entry's key from its stored value (None: keyless)."""
    return None if v == KEYLESS else int.from_bytes(v, "big")


def model_base(prefix: str, model_id: int) -> str:
    """The key prefix of one model: its short id is the hash tag (short key names: each distinct
    block key costs one top-level key per tier, and a long model name in it would cost more)."""
    return f"{prefix}:{{{model_id}}}:"


def client_url(client: aioredis.Redis) -> str:
    kw = client.connection_pool.connection_kwargs
    if "path" in kw:
        return f"unix://{kw['path']}?db={kw.get('db', 0)}"
    return f"redis://{kw.get('host', 'localhost')}:{kw.get('port', 6379)}/{kw.get('db', 0)}"


@dataclass(frozen=True, slots=True)
class WorkerView:
    """What the read script saw of one worker: the basis of one batch's computation. ``version``
    "*" means not read (a batch of clears only: nothing to check)."""

    position: Position | None
    block_size: int | None
    version: str
    media: tuple[str, ...]  # in first-store order; () when the worker does not exist
    orphans: int  # the worker's keyless entries, all of them (not only those in ``entries``)
    entries: dict[tuple[str, int], tuple[int | None, int]]  # (medium, hash) -> (key or None, extra copies)
    others: int = 0  # the model's other workers (while any exists, they hold its block size)
    held: int = 0  # the worker's entries, all of them: more than ``entries`` when it holds hashes outside the view


def view_of(reply: list[Any], hashes: list[int]) -> WorkerView:
    """The read script's reply (see read_worker) for ``hashes`` in the order they were sent."""
    pos = position_of(*reply[1:5])
    bs = None if reply[5] is None else int(reply[5])
    media = tuple(text(reply[7]).split("\n")) if reply[7] is not None else ()
    entries: dict[tuple[str, int], tuple[int | None, int]] = {}
    for i, medium in enumerate(media):
        if 11 + 2 * i >= len(reply):
            break
        values, extras = chain.from_iterable(reply[11 + 2 * i]), reply[12 + 2 * i]  # per bucket group
        for j, v in enumerate(values):
            if v is not None:
                x = extras[j] if extras else None
                entries[(medium, hashes[j])] = (key_of(v), 0 if x is None else int(x))
    return WorkerView(pos, bs, text(reply[6]), media, int(reply[8] or 0), entries, int(reply[9]), int(reply[10]))


def read_groups(hashes: list[int]) -> tuple[bytes, list[int]]:
    """The read script's hashes grouped per bucket (msgpack, see read_worker), and the hashes in
    that order."""
    groups: dict[int, list[int]] = {}
    for h in hashes:
        group = groups.get(h & BUCKET_MASK)
        if group is None:
            groups[h & BUCKET_MASK] = [h]
        else:
            group.append(h)
    order = [h for hs in groups.values() for h in hs]
    return pack([[DIGITS[b] for b in groups], [len(hs) for hs in groups.values()],
                 [h.to_bytes(8, "big") for h in order]]), order


def pack_changes(changes: list[tuple[int, int, bytes | None, int]]) -> tuple[bytes, bytes, bytes]:
    """The apply script's entry sections (see write_entries) from changes ``(medium index, hash,
    value or None: gone, extra copies or UNCHANGED)``: writes and deletions grouped per (medium,
    bucket), and the changed extra copies."""
    sets: dict[tuple[int, int], list[bytes]] = {}
    dels: dict[tuple[int, int], list[bytes]] = {}
    xdel: list[bytes] = []
    xset: list[bytes] = []
    for idx, h, value, extra in changes:
        group, hb = (idx, h & BUCKET_MASK), h.to_bytes(8, "big")
        if value is None:
            fields = dels.get(group)
            if fields is None:
                dels[group] = [hb]
            else:
                fields.append(hb)
        else:
            fields = sets.get(group)
            if fields is None:
                sets[group] = [hb, value]
            else:
                fields += (hb, value)
        if extra != UNCHANGED:
            field = b"%d:%s" % (idx, hb)
            if extra:
                xset += (field, b"%d" % extra)
            else:
                xdel.append(field)
    return (pack(_columns(sets, with_bucket=True)) if sets else b"",
            pack(_columns(dels, with_bucket=False)) if dels else b"",
            pack([xdel, xset]) if xdel or xset else b"")


def _columns(groups: dict[tuple[int, int], list[bytes]], *, with_bucket: bool) -> list[list[Any]]:
    """Groups as write_entries takes them: medium indexes, bucket digits, (buckets,) sizes, items."""
    keys = list(groups)
    out: list[list[Any]] = [[i for i, _ in keys], [DIGITS[b] for _, b in keys]]
    if with_bucket:
        out.append([b for _, b in keys])
    out.append([len(f) for f in groups.values()])
    out.append([x for f in groups.values() for x in f])
    return out


def pack_holders(base: str, holders: dict[tuple[str, int], int]) -> bytes:
    """Holder changes ``(tier char, key) -> change of copies`` as write_holders takes them (b"": none)."""
    if not holders:
        return b""
    prefixes = {t: f"{base}{t}:".encode() for t in "gcd"}
    names = [prefixes[t] + k.to_bytes(8, "big") for t, k in holders]
    offload = any(t != "g" and d > 0 for (t, _), d in holders.items())
    return pack([names, list(holders.values()), 1 if offload else 0])


def per_pod(replies: list[list[Any]]) -> dict[str, PodMatch]:
    """Per-worker depths (name, gpu, cpu, disk) into per-pod matches (``kvindex.types.merged``)."""
    out: dict[str, PodMatch] = {}
    for flat in replies:
        for i in range(0, len(flat), 4):
            rank, _, pod = text(flat[i]).partition("|")
            g = int(flat[i + 1])
            out[pod] = merged(out.get(pod), PodMatch(g, int(flat[i + 2]), int(flat[i + 3]), {int(rank): g}))
    return out
