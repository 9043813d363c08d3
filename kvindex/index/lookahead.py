"""What an engine serves from cache when its block hashes cover lookahead tokens (vLLM 0.34's
``lookahead_token_ids``: EAGLE/MTP speculative decoding with lookahead-aware prefix hashing).

The rule, once (``served_blocks``; sources and versions in docs/vllm-versions.md):
- vLLM without lookahead-aware hashing, EAGLE-style drafting on, drops the last matched block of
  every prefix hit and recomputes it (``FullAttentionManager.find_longest_cache_hit``: ``if
  use_eagle and computed_blocks[0]: computed.pop()``): the drafter's cache at a block boundary
  depends on the token after the block, which the block's hash does not cover.
- With lookahead-aware hashing (vLLM RFC #50438, PR #50897; in BlockStored events as
  ``lookahead_token_ids`` since 0.34) the engine hash of block i also covers the tokens after it,
  a block is published only once those exist, and the drop is skipped: block i is a hit iff the
  prompt holds its own tokens and, after them, its lookahead tokens. kvindex keys a block by its
  own tokens (kvindex.keys), so a match of ``depth`` keys is served in full iff the prompt goes on,
  past its last matched block, with the lookahead tokens of a copy of that block the worker holds;
  else one block less. Earlier blocks need no check: their lookahead tokens (at most a block's,
  ``vllm_fields.lookahead_of``) begin the next matched block, whose key covers them.
- A worker is *in lookahead mode* once it stored a GPU block whose event carried the field, until
  the engine restarts (``forget``). Only such workers' matches are judged; there, a last matched
  block whose lookahead kvindex does not know (stored with none, before this replica watched, or
  keyed through a parent it never saw) counts as not served: the conservative answer, the
  engine's own drop. Lower tiers are not judged (their depths are the index's).

Invariants: a block's key and its lookahead variant are the ones its hash was first stored with;
copies are counted as the index counts them (a GPU store of a held hash adds one, a parentless
store all of whose hashes are held adds none: a re-announcement; a removal takes one). Only
workers in lookahead mode are tracked, so a fleet without speculative decoding costs nothing.
The book is this process's: fed by the lanes of this process with every batch the store applied
or already held (kvindex.ingest.writer), read by kvindex.query.service.
"""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field

from kvindex import keys as K
from kvindex.events import GPU, AllBlocksCleared, BlockRemoved, BlockStored, KVEvent
from kvindex.types import PodMatch

Variant = bytes  # a block's lookahead tokens as u32 little-endian bytes (kvindex.keys.packed)


def lookahead_variant(tokens: Sequence[int]) -> Variant:
    return tokens.tobytes() if isinstance(tokens, array) else bytes(K.packed(tokens))


def served_blocks(depth: int, block_size: int, token_ids: Sequence[int], variants: Iterable[Variant]) -> int:
    """Blocks a lookahead-mode engine serves of a match of ``depth`` blocks of ``token_ids``:
    ``depth`` when the prompt continues past them with one of ``variants`` (the lookahead tokens of
    the copies of the last matched block its worker holds), else ``depth - 1``."""
    if depth <= 0:
        return 0
    start = depth * block_size
    for variant in variants:
        n = len(variant) // 4
        if start + n <= len(token_ids) and lookahead_variant(token_ids[start:start + n]) == variant:
            return depth
    return depth - 1


@dataclass
class _Worker:
    """One (pod, dp_rank) in lookahead mode: GPU hash -> [key, variant, copies], key -> variants."""

    held: dict[int, list] = field(default_factory=dict)
    variants: dict[int, dict[Variant, int]] = field(default_factory=dict)  # key -> variant -> hashes

    def store(self, model: str, ev: BlockStored) -> None:
        parent = K.root_key(model, ev.lora_name, ev.cache_salt) if ev.parent_hash is None else self.key_of(ev.parent_hash)
        keys = [] if parent is None else K.prompt_keys(parent, ev.token_ids, ev.block_size, limit=len(ev.block_hashes))
        again = ev.parent_hash is None and all(h in self.held for h in ev.block_hashes)
        lookahead = ev.lookahead_token_ids
        for i, h in enumerate(ev.block_hashes):
            entry = self.held.get(h)
            if entry is not None:
                entry[2] += 0 if again else 1
                if entry[0] is not None:
                    continue
                self.held.pop(h)  # a keyless hash learns its key (and variant) from this store
            key = keys[i] if i < len(keys) else None
            tokens = lookahead[i] if lookahead is not None else None
            variant = None if tokens is None or key is None else lookahead_variant(tokens)
            self.held[h] = [key, variant, entry[2] if entry is not None else 1]
            if variant is not None:
                counts = self.variants.setdefault(key, {})  # type: ignore[arg-type]
                counts[variant] = counts.get(variant, 0) + 1

    def remove(self, hashes: Sequence[int]) -> None:
        for h in hashes:
            entry = self.held.get(h)
            if entry is None:
                continue
            entry[2] -= 1
            if entry[2] == 0:
                del self.held[h]
                key, variant = entry[0], entry[1]
                if variant is not None:
                    counts = self.variants[key]
                    if counts[variant] == 1:
                        del counts[variant]
                    else:
                        counts[variant] -= 1
                    if not counts:
                        del self.variants[key]

    def key_of(self, h: int) -> int | None:
        entry = self.held.get(h)
        return None if entry is None else entry[0]


class LookaheadBook:
    """Per worker in lookahead mode, the lookahead variants of the GPU blocks it holds."""

    def __init__(self) -> None:
        self._workers: dict[tuple[str, int], _Worker] = {}

    def watching(self, pod: str, dp_rank: int) -> bool:
        """Whether (pod, dp_rank) is in lookahead mode: ``apply`` of a batch whose stores carry no
        ``lookahead_token_ids`` changes nothing otherwise (a caller that knows may skip it)."""
        return (pod, dp_rank) in self._workers

    def apply(self, pod: str, model: str, dp_rank: int, events: Iterable[KVEvent]) -> None:
        """One batch of (pod, dp_rank), as the store applied it."""
        w = self._workers.get((pod, dp_rank))
        if w is None:  # the common case, no speculative decoding: one pass, nothing kept
            events = tuple(events)
            if all(type(ev) is not BlockStored or ev.lookahead_token_ids is None for ev in events):
                return
        for ev in events:
            if isinstance(ev, BlockStored):
                if ev.medium != GPU:
                    continue
                if w is None:
                    if ev.lookahead_token_ids is None:
                        continue  # not in lookahead mode: nothing to judge
                    w = self._workers[(pod, dp_rank)] = _Worker()
                w.store(model, ev)
            elif w is not None and isinstance(ev, BlockRemoved) and ev.medium == GPU:
                w.remove(ev.block_hashes)
            elif w is not None and isinstance(ev, AllBlocksCleared):
                w.held.clear()
                w.variants.clear()  # the same process: still in lookahead mode

    def forget(self, pod: str, ranks: Iterable[int] | None = None) -> None:
        """The engine restarted (a new process may hash without lookahead): ``ranks``, or all."""
        wanted = None if ranks is None else set(ranks)
        for wid in [wid for wid in self._workers if wid[0] == pod and (wanted is None or wid[1] in wanted)]:
            del self._workers[wid]

    def in_mode(self, pod: str, dp_rank: int) -> bool:
        return (pod, dp_rank) in self._workers

    def served(self, matches: dict[str, PodMatch], keys: Sequence[int], token_ids: Sequence[int],
               block_size: int) -> dict[str, PodMatch]:
        """``matches`` (the index's, over ``keys``: the prompt's cacheable blocks) as the engines
        serve them: each rank in lookahead mode judged by ``served_blocks``, the pod's GPU depth
        its deepest rank's; lower tiers as matched."""
        if not self._workers:
            return matches
        out = dict(matches)
        for pod, m in matches.items():
            dp = {rank: self._served(pod, rank, depth, keys, token_ids, block_size) for rank, depth in m.dp.items()}
            if dp != m.dp:
                out[pod] = PodMatch(max(dp.values(), default=0), m.cpu, m.disk, dp)
        return out

    def _served(self, pod: str, rank: int, depth: int, keys: Sequence[int], token_ids: Sequence[int],
                block_size: int) -> int:
        w = self._workers.get((pod, rank))
        if w is None or depth <= 0:
            return depth
        return served_blocks(depth, block_size, token_ids, w.variants.get(keys[depth - 1], ()))
