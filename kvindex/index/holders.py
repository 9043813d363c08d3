"""The precise index's inverted view: per tier, which worker slots hold each key.

Job: ``Holders`` keeps ``tiers[tier][key]`` = the bitmask of the worker slots holding ``key`` in
``tier`` (what a match walks: one dict probe per prompt block, whatever the number of pods), and
nothing else; ``kvindex.index.precise.PreciseIndex`` says when a worker holds or lets go.

Invariants:
- A key is in ``tiers[tier]`` exactly while some worker holds it there; its mask is never 0.
- A worker's holdings of one key in one tier beyond the first (several hashes or copies with
  that key) are counted in ``dups[(tier, key, slot)]``; a release takes a duplicate first, and
  clears the worker's bit only with its last holding.
- Masks of several holders are interned (``masks``, a bounded cache of MASKS_CAP, then it starts
  over): the same few holder sets recur across millions of keys, so each is one shared int. A
  lone holder's mask is its worker's own ``bit`` object.
- The C store/remove loops (kvindex/_apply.c) update ``tiers[tier]``, ``masks`` and read ``dups``
  by these same rules, for the cases they take (a first holding; a release without duplicates).
"""

from __future__ import annotations

from collections.abc import Iterable

MASKS_CAP = 1 << 16  # interned holder masks kept at most (then the cache starts over)


class Holders:
    __slots__ = ("tiers", "dups", "masks")

    def __init__(self, tiers: Iterable[str]) -> None:
        self.tiers: dict[str, dict[int, int]] = {t: {} for t in tiers}
        self.dups: dict[tuple[str, int, int], int] = {}  # (tier, key, slot): holdings beyond the first
        self.masks: dict[int, int] = {}  # interned masks of several holders

    def intern(self, mask: int) -> int:
        """One shared int object per distinct holder set."""
        masks = self.masks
        got = masks.get(mask)
        if got is None:
            if len(masks) >= MASKS_CAP:
                masks.clear()
            masks[mask] = got = mask
        return got

    def hold(self, tier: str, key: int, bit: int, slot: int) -> None:
        """The worker of ``slot`` (its ``bit``) holds ``key`` in ``tier`` once more."""
        holders = self.tiers[tier]
        mask = holders.get(key, 0)
        if mask & bit:
            d = (tier, key, slot)
            self.dups[d] = self.dups.get(d, 0) + 1
        else:
            holders[key] = self.intern(mask | bit) if mask else bit  # a lone holder shares its bit

    def release(self, tier: str, key: int, bit: int, slot: int) -> None:
        """The worker of ``slot`` holds ``key`` in ``tier`` once less."""
        dups = self.dups
        if dups:
            d = (tier, key, slot)
            n = dups.get(d)
            if n:
                if n == 1:
                    del dups[d]
                else:
                    dups[d] = n - 1
                return
        self._clear_bit(self.tiers[tier], key, ~bit)

    def forget(self, bit: int, slot: int, held: Iterable[tuple[str, Iterable[int]]]) -> None:
        """The worker of ``slot`` holds nothing any more: ``held`` is (tier, keys) per medium."""
        keep = ~bit
        for tier, keys in held:
            holders = self.tiers[tier]
            for key in keys:
                self._clear_bit(holders, key, keep)
        if self.dups:
            for d in [d for d in self.dups if d[2] == slot]:
                del self.dups[d]

    def _clear_bit(self, holders: dict[int, int], key: int, keep: int) -> None:
        mask = holders.get(key, 0) & keep
        if mask:
            holders[key] = self.intern(mask)
        else:
            holders.pop(key, None)
