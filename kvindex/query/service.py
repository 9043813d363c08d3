"""Queries: a request in, both indexes' answers per pod out, side by side with their drift.

Invariants:
- The precise side matches token blocks: ``token_ids`` given by the caller win; otherwise the
  model's configured tokenizer renders and tokenizes the OpenAI body. The approximate side always
  renders the body (Kthena / GIE semantics), never tokens.
- A model that is a known LoRA adapter (``kvindex.lora``) is matched on the precise side as that
  adapter on its base model (``identity``), on every precise route; the approximate side hashes the
  model string as the router was given it (Kthena seeds with it: the adapter's name). An adapter
  is tokenized with its base model's tokenizer (its own table's when the base has none).
- A precise match never counts the block holding the last prompt token (vLLM never serves it from
  cache), nor, on a worker whose block hashes cover lookahead tokens (vLLM 0.34, EAGLE/MTP), a last
  matched block the prompt does not continue with those tokens (``LookaheadBook.served``), so
  ``tokens`` is what the engine would report as ``cached_tokens``.
- ``drift = approx fraction - precise fraction`` for the same pod: positive when the router believes
  more than the engine holds (stale), negative when the engine holds what the router never saw.
- An orphaned pod (``kvindex.pods.Orphans``: restored blocks no engine keeps up to date), once
  its grace period is over, is in no answer: never a precise match, never a candidate unless the caller names it (then it holds
  nothing). Every precise route (score, Dynamo and Mooncake queries, decisions, the request path)
  comes through ``precise`` / ``precise_by_local_hashes``.
- Pure with respect to both indexes: a query changes nothing.
- Both indexes are read through their stores (``kvindex.index.factory``): one await per index read. A
  model whose engine streams wait for the store (buffered batches, a resync after the store was
  lost) is answered 503 ``store resynchronising``, never with a partial precise answer; a store
  that cannot be reached raises ``StoreUnavailable`` (the HTTP layer answers 503).
"""

from __future__ import annotations

import asyncio
import time
from array import array
from collections.abc import Awaitable, Callable, Iterable, Sequence
from typing import Annotated, Any

import msgspec
import xxhash

from kvindex import keys as K
from kvindex.query.answers import ApproxAnswer, PreciseAnswer, QueryError, cacheable_tokens
from kvindex.approx.gojson import RenderError
from kvindex.approx.hashing import hash_request, render_request
from kvindex.budget import ByteLRU, str_bytes
from kvindex.index.approx import score_matches
from kvindex.index.lookahead import LookaheadBook
from kvindex.index.protocol import ApproxStore, BlockSizeChanged, PreciseStore
from kvindex.lora import AdapterConflict, LoraAdapters
from kvindex.tokenize import Tokenizer
from kvindex.types import PodMatch

_TOKEN_IDS = list[Annotated[int, msgspec.Meta(ge=0, lt=1 << 32)]]


SCORE_MEMORY_BYTES = 32 << 20  # what the score memory may retain, estimated (kvindex.budget)
_ENTRY_BYTES = 400  # an entry's own objects: key tuple, timestamp, frozenset and dict shells
_POD_BYTES = 64  # per pod asked about: a set slot and a hash
_MATCH_BYTES = 200  # per pod matched: a dict slot and its PodMatch


class ScoreMemory:
    """The precise answers of recent ``/v1/score`` calls, so a decision reported after the request
    was served is judged by what kvindex predicted *before* it (by then the engine has usually
    published the request's own blocks, and a fresh lookup would predict a full hit).

    Bounded: at most ``size`` answers and ``budget`` bytes (estimated from the lengths of the ids
    an answer keeps; least recently remembered first out), each forgotten after ``ttl`` seconds;
    keyed by model, key root and an XXH3 of the prompt's token ids; only per-pod depths are kept,
    never the keys. The HTTP layer remembers only the answers of callers who may write decisions.
    """

    def __init__(self, size: int = 4096, ttl: float = 30.0, clock: Callable[[], float] = time.monotonic,
                 budget: int = SCORE_MEMORY_BYTES) -> None:
        self._ttl, self._clock = ttl, clock
        self._entries: ByteLRU[tuple[str, int, int], tuple[float, frozenset[str] | None, dict[str, PodMatch]]] = \
            ByteLRU(budget, size)

    @property
    def bytes(self) -> int:
        """The estimated bytes the remembered answers retain."""
        return self._entries.bytes

    def __len__(self) -> int:
        return len(self._entries)

    @staticmethod
    def _key(model: str, root: int, token_ids: Sequence[int]) -> tuple[str, int, int]:
        return model, root, xxhash.xxh3_64_intdigest(K.packed(token_ids))

    def remember(self, model: str, token_ids: Sequence[int], pods: Iterable[str] | None, answer: PreciseAnswer) -> None:
        asked = None if pods is None else frozenset(pods)
        size = _ENTRY_BYTES + str_bytes(model) + sum(str_bytes(p) + _POD_BYTES for p in asked or ()) + \
            sum(str_bytes(p) + _MATCH_BYTES for p in answer.matches)
        self._entries.put(self._key(model, answer.root, token_ids), (self._clock(), asked, dict(answer.matches)), size)

    def _fresh(self, model: str, token_ids: Sequence[int], answer: PreciseAnswer
               ) -> tuple[float, frozenset[str] | None, dict[str, PodMatch]] | None:
        """The last score of this prompt, while it is at most ``ttl`` old."""
        entry = self._entries.get(self._key(model, answer.root, token_ids))
        return None if entry is None or self._clock() - entry[0] > self._ttl else entry

    def recall(self, model: str, token_ids: Sequence[int], pod: str, answer: PreciseAnswer) -> PreciseAnswer | None:
        """``answer`` with ``pod``'s match as the last score saw it, or None if none did."""
        entry = self._fresh(model, token_ids, answer)
        if entry is None or (entry[1] is not None and pod not in entry[1]):
            return None
        then = entry[2].get(pod)
        return PreciseAnswer(answer.block_size, answer.prompt_tokens, answer.keys, {pod: then} if then else {}, answer.root)

    def recall_all(self, model: str, token_ids: Sequence[int], answer: PreciseAnswer
                   ) -> tuple[PreciseAnswer, frozenset[str] | None] | None:
        """``answer`` with every pod's match as the last score saw it, and the pods it asked
        about (None: every pod), or None if no score did."""
        entry = self._fresh(model, token_ids, answer)
        if entry is None:
            return None
        return PreciseAnswer(answer.block_size, answer.prompt_tokens, answer.keys, dict(entry[2]), answer.root), entry[1]


def _changing(model: str) -> QueryError:
    return QueryError(f"model {model!r}: its block size keeps changing (engines restarting with another): ask again",
                      field=None, status=503, reason="block_size_changing")


def _never_behind(model: str) -> bool:
    return False


def _no_orphans(pods: Iterable[str]) -> set[str]:
    return set()


class QueryService:
    def __init__(self, store: PreciseStore, approx: ApproxStore,
                 tokenizer_for: Callable[[str], Tokenizer | None], max_token_ids: int,
                 behind: Callable[[str], bool] = _never_behind, adapters: LoraAdapters | None = None,
                 orphans: Callable[[Iterable[str]], set[str]] = _no_orphans) -> None:
        self.store = store
        self._orphans = orphans  # of these pods, those left out of answers
        self.lookahead = LookaheadBook()  # fed by this process's lanes (kvindex.index.lookahead)
        self.adapters = adapters if adapters is not None else LoraAdapters()
        self.approx = approx
        self.scores = ScoreMemory()
        self._tokenizer_for = tokenizer_for
        self._max_token_ids = max_token_ids
        self._behind = behind  # a model whose streams wait for the store (buffer, resync)

    def check_current(self, model: str) -> None:
        """503 while the store may lack batches of ``model`` this replica has received."""
        if self._behind(model):
            raise QueryError(f"store resynchronising: model {model!r} has engine batches not in the store yet",
                             field=None, status=503, reason="store_resynchronising")

    def identity(self, model: str, lora_name: str | None = None) -> tuple[str, str | None]:
        """The (model, lora_name) the precise index keys a query by: an adapter named as the model
        is that adapter on its base; an adapter as model with another ``lora_name``: 400."""
        try:
            return self.adapters.resolve(model, lora_name)
        except AdapterConflict as exc:
            raise QueryError(str(exc), field="lora_name", reason="adapter_conflict") from None

    async def precise(self, model: str, token_ids: Sequence[int], pods: Iterable[str] | None,
                      lora_name: str | None = None, cache_salt: str | None = None,
                      whole: bool = False) -> PreciseAnswer:
        """``whole``: count the block holding the last token too (Dynamo's rule, its compatible API);
        by default not (the engine never serves it from cache: its ``cached_tokens``)."""
        model, lora_name = self.identity(model, lora_name)
        root = K.root_key(model, lora_name, cache_salt)
        for attempt in (0, 1):  # the model's block size moved on under the first (an engine restarted)
            bs = await self.store.block_size(model)  # the store unreachable says so first
            self.check_current(model)
            if bs is None:  # no engine has published a block of this model: nobody holds any
                return PreciseAnswer(0, len(token_ids), (), {}, root)
            keys = K.prompt_keys(root, token_ids if whole else token_ids[:cacheable_tokens(token_ids)], bs)
            try:
                matches = await self._match(keys, pods, model)
                if not whole:  # what the engines serve: lookahead-aware hashing judged (vLLM 0.34)
                    matches = self.lookahead.served(matches, keys, token_ids, bs)
                return PreciseAnswer(bs, len(token_ids), keys, matches, root)
            except BlockSizeChanged:
                if attempt:
                    raise _changing(model) from None
        raise AssertionError("unreachable")

    async def _match(self, keys: Sequence[int], pods: Iterable[str] | None, model: str) -> dict[str, PodMatch]:
        """The store's matches, orphaned pods left out."""
        matches = await self.store.match(keys, pods, model=model)
        orphans = self._orphans(matches) if matches else ()
        return {p: m for p, m in matches.items() if p not in orphans} if orphans else matches

    async def precise_by_local_hashes(self, model: str, local_hashes: Sequence[int],
                                      pods: Iterable[str] | None) -> PreciseAnswer:
        model, lora_name = self.identity(model)
        for attempt in (0, 1):
            bs = await self.store.block_size(model)
            self.check_current(model)
            if bs is None:
                return PreciseAnswer(0, 0, (), {})
            keys = K.chain_keys(K.root_key(model, lora_name), local_hashes)
            try:
                return PreciseAnswer(bs, len(keys) * bs, keys, await self._match(keys, pods, model))
            except BlockSizeChanged:
                if attempt:
                    raise _changing(model) from None
        raise AssertionError("unreachable")

    async def token_ids_for(self, model: str, body: dict[str, Any]) -> Sequence[int] | None:
        """Token ids from the body, or from the model's tokenizer; None when neither exists."""
        if "token_ids" in body:
            return self.check_token_ids(body["token_ids"])
        base = self.adapters.base_of(model)
        tokenizer = self._tokenizer_for(base) if base is not None else None
        if tokenizer is None:  # (not ``or``: a tokenizer with an empty cache has len 0)
            tokenizer = self._tokenizer_for(model)
        if tokenizer is None:
            return None
        try:
            tokens = await tokenizer.tokenize(model, body)
        except ValueError as exc:
            raise QueryError(str(exc), field="request", reason=getattr(exc, "reason", "untokenizable")) from None
        except Exception as exc:  # an engine's /tokenize may be down: say so, don't crash
            raise QueryError(f"tokenizer for {model!r} failed: {exc}", field="request", status=503,
                             reason="tokenizer_unavailable") from None
        try:  # an engine's answer is input too: same limits as a caller's token_ids
            return self.check_token_ids(tokens if isinstance(tokens, array) else list(tokens))
        except QueryError as exc:
            if exc.reason == "too_large":  # the caller's prompt is too long: its error, not kvindex's
                raise QueryError(f"the prompt is {len(tokens)} tokens; the limit is {self._max_token_ids} "
                                 "(max_token_ids)", field="request", status=413, reason="too_large") from None
            raise QueryError(f"tokenizer for {model!r} answered badly: {exc}", field="request", status=503,
                             reason="tokenizer_unavailable") from None

    @staticmethod
    def no_precise_reason(model: str) -> str:
        """Why a body without ``token_ids`` gets no precise answer (``token_ids_for`` gave None)."""
        return (f"no tokenizer configured for model {model}: give token_ids, or set [models.\"{model}\"] "
                "tokenizer (\"hf\" with tokenizer_path, \"engine\" or \"render\" with tokenize_url, or \"llmd-sim\")")

    def check_token_ids(self, value: Any) -> array:
        """Token ids as a packed ``array("I")``; validated in C (no bools, floats, negatives).
        An ``array("I")`` (the body decoder's fast path) is already valid: only its length counts."""
        if isinstance(value, (list, array)) and len(value) > self._max_token_ids:
            raise QueryError(f"token_ids has {len(value)} entries; the limit is {self._max_token_ids}",
                             field="token_ids", status=413, reason="too_large")
        if isinstance(value, array) and value.typecode == "I":
            return value
        try:
            return array("I", msgspec.convert(value, _TOKEN_IDS))
        except msgspec.ValidationError:
            raise QueryError("token_ids must be an array of unsigned 32-bit integers", field="token_ids") from None

    def approx_hashes(self, model: str, body: dict[str, Any]) -> tuple[int, ...] | None:
        """What the router hashes for this body; None when it has nothing the router would hash."""
        if not any(k in body for k in ("prompt", "messages", "input")):
            return None
        try:
            return tuple(hash_request(self.approx.config, model, body))
        except RenderError as exc:
            raise QueryError(str(exc), field="request", reason="unrenderable") from None

    def personality(self, model: str) -> str:
        """The approximate personality ``model`` is hashed and scored with."""
        return self.approx.config.for_model(model).personality

    def render(self, model: str, body: dict[str, Any]) -> str:
        """The prompt text the router hashes for ``body`` (GIE's bytes shown as UTF-8 text)."""
        try:
            return render_request(self.approx.config.for_model(model), body)
        except RenderError as exc:
            raise QueryError(str(exc), field="request", reason="unrenderable") from None

    def recall(self, model: str, token_ids: Sequence[int], pod: str, answer: PreciseAnswer) -> PreciseAnswer | None:
        """``answer`` with ``pod``'s match as the last ``/v1/score`` of this prompt saw it (or None)."""
        return self.scores.recall(model, token_ids, pod, answer)

    def recall_all(self, model: str, token_ids: Sequence[int], answer: PreciseAnswer
                   ) -> tuple[PreciseAnswer, frozenset[str] | None] | None:
        return self.scores.recall_all(model, token_ids, answer)

    async def record_approx(self, pod: str, model: str, hashes: Sequence[int]) -> None:
        """Record a routing decision's hashes into the approximate index (as the router does)."""
        await self.approx.record(pod, model, hashes)

    async def approx_match(self, model: str, hashes: tuple[int, ...], pods: Iterable[str]) -> ApproxAnswer:
        matches = await self.approx.match(model, hashes, list(pods))  # one walk: scores follow from it
        return ApproxAnswer(hashes, matches, score_matches(self.approx.config.for_model(model), matches, len(hashes)))

    async def approx_answer(self, model: str, body: dict[str, Any], pods: Iterable[str]) -> ApproxAnswer | None:
        hashes = self.approx_hashes(model, body)
        return None if hashes is None else await self.approx_match(model, hashes, pods)

    async def candidates(self, requested: Iterable[str] | None, precise: PreciseAnswer | None) -> list[str]:
        if requested is not None:
            return sorted(set(requested))
        return self._with_matched(await self._known_pods(), precise)

    async def precise_and_candidates(self, requested: Iterable[str] | None,
                                     precise: Awaitable[PreciseAnswer | None]) -> tuple[PreciseAnswer | None, list[str]]:
        """``precise`` awaited, and ``candidates`` for it. With no pods requested, the stores are
        asked for every pod they know while ``precise`` runs: a store in other processes (workers,
        Redis) then costs one round trip, not two."""
        if requested is not None:
            return await precise, await self.candidates(requested, None)
        known = asyncio.ensure_future(self._known_pods())
        try:
            answer = await precise
        except BaseException:
            known.cancel()
            await asyncio.gather(known, return_exceptions=True)
            raise
        return answer, self._with_matched(await known, answer)

    async def _known_pods(self) -> set[str]:
        known = set(await self.store.pods()) | set(await self.approx.pods())
        return known - self._orphans(known)

    @staticmethod
    def _with_matched(pods: set[str], precise: PreciseAnswer | None) -> list[str]:
        return sorted(pods | set(precise.matches) if precise is not None else pods)
