"""Envoy's ext_proc dialect (``envoy.service.ext_proc.v3``): a ``ProcessingRequest`` in, typed
events out; typed answers in, ``ProcessingResponse`` bytes out. The only module that knows the
protobuf (stubs from ``xds-protos``); nothing past it sees one.

Invariants:
- ``decode`` turns one message into exactly one ``Headers``, ``Body`` or ``Trailers`` event (plus
  the stream's ``Modes`` when Envoy states them, in its first message) or raises ``BadMessage``
  (the stream then ends with INVALID_ARGUMENT, counted). Header names are lower-case; values are
  ``raw_value`` (or ``value``) decoded as UTF-8 with replacement; at most ``MAX_HEADERS`` headers
  are kept.
- What Envoy says of routing is read here: the subset hint (``envoy.lb.subset_hint`` /
  ``x-gateway-destination-endpoint-subset``), the served endpoint (``envoy.lb`` /
  ``x-gateway-destination-endpoint-served``, or the ``upstream.address`` attribute), the
  response's ``:status``.
- The answers are the GIE endpoint-picker protocol's: the destination as the header
  ``x-gateway-destination-endpoint`` and as dynamic metadata ``envoy.lb`` ->
  ``x-gateway-destination-endpoint``, with ``clear_route_cache``; a body streamed back in chunks of
  at most ``CHUNK_BYTES``; an immediate response with a one-line JSON body.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from envoy.config.core.v3 import base_pb2
from envoy.service.ext_proc.v3 import external_processor_pb2 as pb
from google.protobuf import struct_pb2
from google.protobuf.message import DecodeError

from kvindex.route.protocol import (
    CHUNK_BYTES,
    DESTINATION,
    SERVED_KEY,
    SERVED_NAMESPACE,
    SUBSET_KEY,
    SUBSET_NAMESPACE,
)

PROCESS = b"/envoy.service.ext_proc.v3.ExternalProcessor/Process"
NONE, STREAMED, BUFFERED, BUFFERED_PARTIAL, FULL_DUPLEX_STREAMED = 0, 1, 2, 3, 4
MAX_HEADERS = 256
ATTRIBUTES = "envoy.filters.http.ext_proc"


class BadMessage(ValueError):
    """A message that is not a ProcessingRequest kvindex can act on."""


@dataclass(frozen=True, slots=True)
class Modes:
    """How Envoy sends bodies on this stream (its filter's processing mode)."""

    request_body: int = NONE
    response_body: int = NONE


@dataclass(frozen=True, slots=True)
class Headers:
    response: bool
    headers: dict[str, str]
    end_of_stream: bool
    served: str | None = None  # the endpoint that served the request (response headers)


@dataclass(frozen=True, slots=True)
class Body:
    response: bool
    data: bytes
    end_of_stream: bool


@dataclass(frozen=True, slots=True)
class Trailers:
    response: bool


Event = Headers | Body | Trailers


@dataclass(frozen=True, slots=True)
class Message:
    event: Event
    observability: bool = False
    modes: Modes | None = None  # in the stream's first message (Envoy >= 1.33 outside observability mode)
    attributes: dict[str, str] = field(default_factory=dict)
    subset: tuple[str, ...] | None = None  # addresses Envoy allows (the subset hint in metadata_context)


def decode(data: bytes) -> Message:
    try:
        req = pb.ProcessingRequest.FromString(data)
    except DecodeError as exc:
        raise BadMessage(f"not a ProcessingRequest: {exc}") from None
    kind = req.WhichOneof("request")
    if kind is None:
        raise BadMessage("a ProcessingRequest with nothing in it")
    modes = Modes(req.protocol_config.request_body_mode, req.protocol_config.response_body_mode) \
        if req.HasField("protocol_config") else None
    attrs = _attributes(req)
    response = kind.startswith("response")
    event: Event
    if kind.endswith("headers"):
        h = req.request_headers if not response else req.response_headers
        headers = _headers(h.headers.headers)
        served = _metadata_string(req, SERVED_NAMESPACE, SERVED_KEY) or attrs.get("upstream.address")
        event = Headers(response, headers, h.end_of_stream, served if response else None)
    elif kind.endswith("body"):
        b = req.request_body if not response else req.response_body
        event = Body(response, b.body, b.end_of_stream)
    else:
        event = Trailers(response)
    return Message(event, req.observability_mode, modes, attrs, _subset(req))


def _headers(values: Sequence[base_pb2.HeaderValue]) -> dict[str, str]:
    out: dict[str, str] = {}
    for hv in values[:MAX_HEADERS]:
        value = hv.raw_value.decode("utf-8", "replace") if hv.raw_value else hv.value
        out[hv.key.lower()] = value
    return out


def _attributes(req: pb.ProcessingRequest) -> dict[str, str]:
    if ATTRIBUTES not in req.attributes:
        return {}
    out = {}
    for key, value in req.attributes[ATTRIBUTES].fields.items():
        kind = value.WhichOneof("kind")
        if kind == "string_value":
            out[key] = value.string_value
        elif kind == "number_value":
            out[key] = str(int(value.number_value)) if value.number_value.is_integer() else str(value.number_value)
    return out


def _metadata_string(req: pb.ProcessingRequest, namespace: str, key: str) -> str | None:
    meta = req.metadata_context.filter_metadata
    if namespace not in meta or key not in meta[namespace].fields:
        return None
    value = meta[namespace].fields[key]
    return value.string_value if value.WhichOneof("kind") == "string_value" else None


def _subset(req: pb.ProcessingRequest) -> tuple[str, ...] | None:
    meta = req.metadata_context.filter_metadata
    if SUBSET_NAMESPACE not in meta or SUBSET_KEY not in meta[SUBSET_NAMESPACE].fields:
        return None
    value = meta[SUBSET_NAMESPACE].fields[SUBSET_KEY]
    if value.WhichOneof("kind") == "list_value":
        return tuple(v.string_value for v in value.list_value.values if v.WhichOneof("kind") == "string_value")
    if value.WhichOneof("kind") == "string_value":
        return tuple(a.strip() for a in value.string_value.split(",") if a.strip())
    return ()


# -- answers -----------------------------------------------------------------------------------
def _common(set_headers: Sequence[tuple[str, str]] = (), clear_route_cache: bool = False) -> pb.CommonResponse:
    common = pb.CommonResponse(clear_route_cache=clear_route_cache)
    if set_headers:
        common.header_mutation.set_headers.extend(
            base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key=k, raw_value=v.encode())) for k, v in set_headers)
    return common


def _destination_metadata(address: str) -> struct_pb2.Struct:
    md = struct_pb2.Struct()
    md.update({"envoy.lb": {DESTINATION: address}})
    return md


def headers_response(response: bool, set_headers: Sequence[tuple[str, str]] = (), destination: str | None = None) -> bytes:
    """Continue with ``set_headers`` (and, for a request, the destination: header, metadata, route cache cleared)."""
    headers = list(set_headers) + ([(DESTINATION, destination)] if destination else [])
    out = pb.ProcessingResponse()
    field_ = out.response_headers if response else out.request_headers
    field_.response.CopyFrom(_common(headers, clear_route_cache=destination is not None))
    if destination:
        out.dynamic_metadata.CopyFrom(_destination_metadata(destination))
    return out.SerializeToString()


def buffered_body_response(set_headers: Sequence[tuple[str, str]] = (), destination: str | None = None) -> bytes:
    """A BUFFERED request body's answer: the headers (not sent on yet) mutated here."""
    headers = list(set_headers) + ([(DESTINATION, destination)] if destination else [])
    out = pb.ProcessingResponse()
    out.request_body.response.CopyFrom(_common(headers, clear_route_cache=destination is not None))
    if destination:
        out.dynamic_metadata.CopyFrom(_destination_metadata(destination))
    return out.SerializeToString()


def streamed_body(response: bool, chunk: bytes, end_of_stream: bool) -> bytes:
    """One chunk of a FULL_DUPLEX_STREAMED body sent back unchanged."""
    out = pb.ProcessingResponse()
    body = out.response_body if response else out.request_body
    body.response.body_mutation.streamed_response.body = chunk
    body.response.body_mutation.streamed_response.end_of_stream = end_of_stream
    return out.SerializeToString()


def body_chunks(response: bool, body: bytes) -> list[bytes]:
    """``body`` streamed back in chunks of at most ``CHUNK_BYTES`` (one empty chunk for no body)."""
    if not body:
        return [streamed_body(response, b"", True)]
    starts = range(0, len(body), CHUNK_BYTES)
    return [streamed_body(response, body[i:i + CHUNK_BYTES], i + CHUNK_BYTES >= len(body)) for i in starts]


def continue_body(response: bool) -> bytes:
    out = pb.ProcessingResponse()
    (out.response_body if response else out.request_body).response.SetInParent()
    return out.SerializeToString()


def continue_trailers(response: bool) -> bytes:
    out = pb.ProcessingResponse()
    (out.response_trailers if response else out.request_trailers).SetInParent()
    return out.SerializeToString()


def immediate(status: int, body: bytes, content_type: str = "application/json") -> bytes:
    out = pb.ProcessingResponse()
    out.immediate_response.status.code = status  # envoy.type.v3.StatusCode's numbers are the HTTP codes
    out.immediate_response.body = body
    out.immediate_response.headers.set_headers.append(
        base_pb2.HeaderValueOption(header=base_pb2.HeaderValue(key="content-type", raw_value=content_type.encode())))
    out.immediate_response.details = "kvindex"
    return out.SerializeToString()
