"""Where every HTTP body is checked and written: request bodies in, as typed msgspec Structs; answers out.

A request body is read once (``read_body``: JSON decoded as Go does, the plain fast decoder, or
msgpack), then the fields an endpoint reads are converted into its Struct (``parse``). The body
itself stays a dict as well: the approximate side renders the whole OpenAI request, and the
token ids (``array("I")`` from the C scanner) are checked by the query service.

Invariants:
- Every refusal is an ``ApiError``: a one-line message naming the field, the field, a 4xx status
  and a reason label (the ``kvindex_http_rejections`` metric). A field sent as ``null`` is a field
  not sent: required -> ``"<field> is required"`` (``missing_field``), optional -> absent.
- Unknown fields are ignored (OpenAI bodies carry many); strings that must name something are
  non-empty and at most their ``kvindex.limits`` length (400 ``too_long`` naming the field and
  the limit); integers are never booleans or floats.
- Hostile shapes are refused before anything walks them: arrays and objects nested deeper than
  ``MAX_DEPTH`` (400 ``too_deep``, whichever decoder read the body: msgspec, the Go-compatible
  one, msgpack, after the C token scanner); a decoder's own recursion limit is the same refusal.
- A token id is written as an unsigned integer: ``-0`` is refused (``bad_field``) on every
  endpoint that takes ``token_ids``, as Go's and serde's unsigned decoders refuse it.
- Pure: checking a body changes nothing.
"""

from __future__ import annotations

import re
from array import array
from collections.abc import Callable, Sequence
from typing import Annotated, Any, ClassVar, TypeVar

import msgpack
import msgspec
from aiohttp import web

from kvindex import native
from kvindex.approx.gojson import MAX_DEPTH, NestingTooDeep, RenderError, check_nesting, go_json_fast
from kvindex.query.decisions import MAX_BATCH, DecisionIn
from kvindex.events import MAX_BLOCK_SIZE
from kvindex.http.errors import ApiError
from kvindex.http.fields import (
    RANK_ERROR,
    BlockSize,
    Body,
    Count,
    DpRank,
    Endpoint,
    Id,
    Model,
    Pods,
    Salt,
)
from kvindex.http.server import body_bytes
from kvindex.limits import FIELD_LIMITS, MAX_MODEL_CHARS

MSGPACK = "application/msgpack"
MAX_PODS = 10_000

T = TypeVar("T", bound="Body")
_SIGNED_ZERO = re.compile(rb"-0(?![.0-9eE])")


def too_deep() -> ApiError:
    return ApiError(f"body nests arrays/objects deeper than {MAX_DEPTH}", field="body", reason="too_deep")


def check_depth(value: Any, text: bytes | None = None) -> Any:
    """``value`` if its arrays and objects nest at most ``MAX_DEPTH`` deep (``check_nesting``),
    else the ``too_deep`` refusal."""
    try:
        return check_nesting(value, text)
    except NestingTooDeep:
        raise too_deep() from None


def check_signed_zero(raw: bytes, u32_field: str) -> None:
    """Refuse ``-0`` among the JSON body's ``u32_field`` (token ids are unsigned: no sign)."""
    if b"-0" not in raw:
        return
    try:
        span = msgspec.json.decode(raw, type=dict[str, msgspec.Raw]).get(u32_field)
    except (msgspec.DecodeError, RecursionError):
        return  # not an object of members: refused by the whole decode
    if span is not None and _SIGNED_ZERO.search(bytes(span)):
        raise ApiError(f"{u32_field} must be an array of unsigned 32-bit integers (-0 has a sign)", field=u32_field,
                       reason="bad_field")


# -- reading -----------------------------------------------------------------------------------
def decode_json(raw: bytes, u32_field: str | None, loads: Callable[[bytes], Any] = msgspec.json.decode,
                split: Any = native.load("kvindex._jsontokens"), *, u64_field: str | None = None) -> Any:
    """``loads(raw)``, except that a top-level array of u32s named ``u32_field`` comes back as an
    ``array("I")``, or one of 64-bit integers named ``u64_field`` as an ``array("Q")`` of their low
    64 bits (what ``u64s`` makes of it): with the C scanner (``kvindex._jsontokens``) the digits go
    straight into integers, and only the rest of the body goes through ``loads`` (~50 us instead
    of ~300 us for 8k token ids with msgspec, ~1 ms with the Go-compatible decoder; 512 hashes
    ~13 us instead of ~40 us). Whatever the scanner declines is decoded whole, as before."""
    field, kind = (u32_field, "I") if u32_field is not None else (u64_field, "Q")
    lifted = None
    if field is not None and split is not None:
        lifted = split.split(raw, field) if kind == "I" else split.split_u64(raw, field)
    try:
        if lifted is None:
            if u32_field is not None:
                check_signed_zero(raw, u32_field)
            return check_depth(loads(raw), raw)
        values, rest = lifted
        body = check_depth(loads(rest), rest)  # the scanner's "{...}" with the array taken out: a dict
    except (RecursionError, NestingTooDeep):  # a decoder's own limit (msgspec's, json's): the same refusal
        raise too_deep() from None
    body[field] = array(kind, values)
    return body


async def read_body(request: web.Request, *, allow_msgpack: bool = False, go: bool = True,
                    u32_field: str | None = None, u64_field: str | None = None) -> dict[str, Any]:
    """The body as a dict. ``go``: decode JSON as Go does (for bodies whose text the approximate
    index renders); otherwise the plain fast decoder (token ids, hashes). Either way the
    top-level field ``u32_field`` (token ids, which nothing renders) comes back as an
    ``array("I")`` when it is a plain u32 array, ``u64_field`` (hashes) as an ``array("Q")``
    when it is a plain array of i64s or u64s."""
    return decode_body(await body_bytes(request), request.content_type, allow_msgpack=allow_msgpack, go=go,
                       u32_field=u32_field, u64_field=u64_field)


def decode_body(raw: bytes, content_type: str, *, allow_msgpack: bool = False, go: bool = True,
                u32_field: str | None = None, u64_field: str | None = None) -> dict[str, Any]:
    """``read_body`` of a body already read, sent as ``content_type`` (the mime type, no parameters)."""
    if allow_msgpack and content_type == MSGPACK:
        try:
            body = check_depth(msgpack.unpackb(raw, raw=False, strict_map_key=False))
        except (msgpack.StackError, RecursionError):
            raise too_deep() from None
        except ApiError:
            raise
        except Exception:
            raise ApiError("body is not valid msgpack", field="body", reason="malformed") from None
    else:
        try:
            body = decode_json(raw, u32_field, go_json_fast if go else msgspec.json.decode, u64_field=u64_field)
        except (RenderError, msgspec.DecodeError):
            raise ApiError("body is not valid JSON", field="body", reason="malformed") from None
    if not isinstance(body, dict):
        raise ApiError("body must be a JSON object", field="body", reason="malformed")
    return body


# -- the Structs -------------------------------------------------------------------------------
_PODS_BAD = "pods must be an array of pod ids (strings)"
_INSTANCE = "instance_id must be a non-negative integer or a non-empty string"


class ScoreBody(Body, frozen=True):
    """``POST /v1/score`` (the rest of the body is the OpenAI request, ``token_ids`` optional)."""

    bad: ClassVar[dict[str, str]] = {"pods": _PODS_BAD}
    model: Model
    pods: Pods | None = None
    lora_name: Any = None  # read (``optional_text``) only when the precise side is asked
    cache_salt: Any = None


class ModelBody(Body, frozen=True):
    """An OpenAI request as ``/v1/approx/explain`` reads it: a model, the rest rendered."""

    model: Model


class PodsBody(Body, frozen=True):
    bad: ClassVar[dict[str, str]] = {"pods": _PODS_BAD}
    pods: Pods | None = None


class RegisterBody(Body, frozen=True):
    """``POST /register`` (Dynamo's field names)."""

    bad: ClassVar[dict[str, str]] = {"instance_id": _INSTANCE, "block_size": f"block_size must be an integer from 1 to {MAX_BLOCK_SIZE}",
           "dp_rank": RANK_ERROR}
    missing: ClassVar[dict[str, str]] = {"instance_id": _INSTANCE}
    instance_id: Count | Id
    model_name: Model
    endpoint: Endpoint
    block_size: BlockSize
    routing_group: Id | None = None
    dp_rank: DpRank = 0
    replay_endpoint: Endpoint | None = None
    url: Endpoint | None = None  # kvindex's: the engine's OpenAI base URL (where the request path routes)


class UnregisterBody(Body, frozen=True):
    bad: ClassVar[dict[str, str]] = {"instance_id": _INSTANCE, "dp_rank": RANK_ERROR}
    missing: ClassVar[dict[str, str]] = {"instance_id": _INSTANCE}
    instance_id: Count | Id
    model_name: Model
    routing_group: Id | None = None
    dp_rank: DpRank | None = None


class QueryBody(Body, frozen=True):
    """``POST /query``: token ids (checked by the query service), a model, a routing group."""

    model_name: Model
    routing_group: Id | None = None
    lora_name: Id | None = None
    cache_salt: Salt | None = None


class QueryByHashBody(Body, frozen=True):
    model_name: Model
    routing_group: Id | None = None
    cache_salt: Any = None  # refused whenever given: see query_by_hash
    block_hashes: Any = None  # checked by u64s (one C-level conversion)


_POD = "pod is required: the id of the pod that served the request"
_REQUEST = "request is required: the OpenAI body the router sent"


class DecisionBody(Body, frozen=True):
    """One routing decision (``POST /v1/decisions``); ``request`` is the OpenAI body, rendered whole."""

    bad: ClassVar[dict[str, str]] = {"pod": _POD, "request": _REQUEST, "cached_tokens": "cached_tokens must be a non-negative integer",
           "prompt_tokens": "prompt_tokens must be a non-negative integer"}
    missing: ClassVar[dict[str, str]] = {"pod": _POD, "request": _REQUEST}
    reasons: ClassVar[tuple[str, str]] = ("bad_request", "bad_request")
    pod: Id
    request: dict[str, Any]
    cached_tokens: Count | None = None
    prompt_tokens: Count | None = None


_AT = re.compile(r"`\$\.([A-Za-z_][A-Za-z0-9_]*)")
_MISSING = re.compile(r"missing required field `([^`]+)`")
_TOO_LONG = re.compile(r"Expected `str` of length <= (\d+)")


def parse(body: dict[str, Any], kind: type[T]) -> T:
    """``body``'s fields as ``kind``; the first field at fault refused by its one-line message."""
    try:
        return msgspec.convert(body, kind)
    except msgspec.ValidationError as exc:
        raise refusal(kind, str(exc)) from None


def refusal(kind: type[Body], detail: str) -> ApiError:
    """The ``ApiError`` for msgspec's ``detail`` about a ``kind`` body."""
    if (m := _MISSING.search(detail)) is not None:
        name, missing = m[1], True
    else:
        m = _AT.search(detail)
        name, missing = (m[1] if m else "body"), "got `null`" in detail
    if missing:
        return ApiError(kind.missing.get(name, f"{name} is required"), field=name, reason=kind.reasons[0])
    if (m := _TOO_LONG.search(detail)) is not None:
        return too_long(name, int(m[1]))
    return ApiError(kind.bad.get(name, f"{name} must be a non-empty string"), field=name, reason=kind.reasons[1])


def too_long(name: str, limit: int) -> ApiError:
    return ApiError(f"{name} is longer than {limit} characters (the limit)", field=name, reason="too_long")


def name_checked(value: str, name: str) -> str:
    """``value`` if within ``name``'s length limit (``kvindex.limits``), else the ``too_long`` refusal."""
    limit = FIELD_LIMITS[name]
    if len(value) > limit:
        raise too_long(name, limit)
    return value


def optional_text(value: Any, name: str) -> str | None:
    """``value`` if it is a non-empty string within ``name``'s length limit, None if absent; else
    the one-line 400 naming ``name``."""
    if value is None:
        return None
    if not isinstance(value, str) or not value:
        raise ApiError(f"{name} must be a non-empty string", field=name, reason="bad_field")
    return name_checked(value, name)


def instance_id(value: int | str) -> str:
    """A Dynamo instance id as kvindex's pod id."""
    return str(value)


def pods_limit(pods: list[str] | None, limit: int = MAX_PODS) -> list[str] | None:
    if pods is not None and len(pods) > limit:
        raise ApiError(f"pods has {len(pods)} entries; the limit is {limit}", field="pods", status=413, reason="too_large")
    return pods


def explain_request(body: dict[str, Any]) -> tuple[dict[str, Any], str, list[str] | None]:
    """``/v1/approx/explain``: the OpenAI request (``body["request"]`` or the body itself), its
    model, and the pods asked about."""
    req = body.get("request", body)
    if not isinstance(req, dict):
        raise ApiError("request must be an OpenAI request body (object)", field="request", reason="bad_field")
    model = parse(req, ModelBody).model
    return req, model, pods_limit(parse(body, PodsBody).pods)


def decision_list(body: dict[str, Any]) -> tuple[list[DecisionIn], bool]:
    """``POST /v1/decisions``: one decision, or ``{"decisions": [...]}`` (True: a batch) of
    1..``MAX_BATCH``; every one checked before any is used."""
    if "decisions" not in body:
        return [decision(body)], False
    items = body["decisions"]
    if not isinstance(items, list) or not items or len(items) > MAX_BATCH:
        raise ApiError(f"decisions must be an array of 1..{MAX_BATCH} decisions", field="decisions")
    return [decision(item) for item in items], True


def decision(item: Any) -> DecisionIn:
    if not isinstance(item, dict):
        raise ApiError("a decision must be a JSON object", field="decision")
    d = parse(item, DecisionBody)
    model = d.request.get("model")
    if not isinstance(model, str) or not model:
        raise ApiError("request.model is required", field="request.model")
    if len(model) > MAX_MODEL_CHARS:
        raise too_long("request.model", MAX_MODEL_CHARS)
    for name in ("lora_name", "cache_salt"):  # read by the precise side when they are strings
        if isinstance(text := d.request.get(name), str) and len(text) > FIELD_LIMITS[name]:
            raise too_long(f"request.{name}", FIELD_LIMITS[name])
    return DecisionIn(d.pod, model, d.request, d.cached_tokens, d.prompt_tokens, "token_ids" in item,
                      item.get("token_ids"))


_HASHES = list[Annotated[int, msgspec.Meta(ge=-(1 << 63))]]  # ints (no bools), none below i64


def u64s(value: Any) -> Sequence[int] | None:
    """Dynamo's block hashes (i64, its form, or u64 for the same bits) as u64s; None unless every
    one is. The common cases are C-level conversions: no Python loop over 512 hashes (and from
    a JSON body, ``read_body``'s scanner has made them u64s already)."""
    if type(value) is array and value.typecode == "Q":
        return value
    try:
        ints = msgspec.convert(value, _HASHES)
    except msgspec.ValidationError:
        return None
    for kind in ("q", "Q"):  # all i64: the same bits as u64s; all non-negative: u64s already
        try:
            return array("Q", array(kind, ints).tobytes())
        except OverflowError:
            pass
    if all(h < 1 << 64 for h in ints):  # both forms in one request
        return [h & (1 << 64) - 1 for h in ints]
    return None


def block_hashes(body: QueryByHashBody, max_hashes: int) -> Sequence[int]:
    """``/query_by_hash``'s hashes as u64s; a salt is refused (Dynamo's hashes carry none)."""
    if body.cache_salt is not None:
        raise ApiError("cache_salt is not supported by /query_by_hash: use /query with token_ids", field="cache_salt")
    hashes = u64s(body.block_hashes)
    if hashes is None:
        raise ApiError("block_hashes must be an array of 64-bit integers", field="block_hashes", reason="bad_field")
    if len(hashes) > max_hashes:
        raise ApiError("block_hashes is too long", field="block_hashes", status=413, reason="too_large")
    return hashes


def window_seconds(window: str | None) -> float | None:
    """``GET /v1/drift?window=``: a positive number of seconds, or None (the whole sample)."""
    try:
        seconds = float(window) if window is not None else None
    except ValueError:
        raise ApiError("window must be a number of seconds", field="window", reason="bad_field") from None
    if seconds is not None and not 0 < seconds < 1e9:
        raise ApiError("window must be a positive number of seconds", field="window", reason="bad_field")
    return seconds


def limit_count(limit: str | None, default: int = 100, most: int = 10_000) -> int:
    """``GET /v1/decisions?limit=``: how many, from 1 to ``most`` (default ``default``)."""
    if limit is None:
        return default
    if not limit.isdigit() or not 1 <= int(limit) <= most:
        raise ApiError(f"limit must be an integer from 1 to {most}", field="limit", reason="bad_field")
    return int(limit)


# -- writing -----------------------------------------------------------------------------------
def json_response(data: Any, status: int = 200) -> web.Response:
    """``data`` as JSON, encoded by msgspec (in C: an 8k-token answer costs microseconds, not the
    ~0.1 ms of the standard library's encoder)."""
    return web.Response(body=json_body(data), status=status, content_type="application/json")


def json_body(data: Any) -> bytes:
    """``data`` as the JSON bytes of every JSON answer (``json_response``; the fast path's)."""
    return msgspec.json.encode(data)


def reply(request: web.Request, data: Any, status: int = 200) -> web.Response:
    """``data`` in the request's encoding: msgpack for a msgpack request, else JSON."""
    if request.content_type == MSGPACK:
        return web.Response(body=msgpack.packb(data), status=status, content_type=MSGPACK)
    return json_response(data, status=status)
