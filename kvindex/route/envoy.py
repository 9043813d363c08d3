"""Envoy configurations that put kvindex in the request path (Envoy v3 API, as JSON, which is YAML).

Two shapes, one for each mode (``kvindex gateway --print-envoy-config`` writes either):
- **pick**: a listener whose requests pass, in order, a header-mutation filter that strips the
  routing headers a client could forge (``x-gateway-destination-endpoint``,
  ``x-kvindex-request``), kvindex's picker (ext_proc; the request body BUFFERED by default, or
  FULL_DUPLEX_STREAMED as GIE's endpoint-picker protocol states it: ``picker_filter``), kvindex's observer (ext_proc in ``observability_mode``: the answer's
  headers, upstream address and body, never waited for) and the router. A request that carries
  the picker's destination goes to an ORIGINAL_DST cluster that follows the header; any other
  (kvindex unreachable: ``failure_mode_allow``) to the engines' round-robin cluster: never a dropped
  request.
- **observe**: the observer alone in front of the engines' round-robin cluster; kvindex only reads.
  ``observer_snippet`` is the filter and cluster to add to an Envoy of one's own.

Invariants: pure (values in, a dict out); every cluster name starts ``kvindex_``; the engines'
cluster lists the configured engines' URLs (STRICT_DNS: names are resolved by Envoy).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from kvindex.route.protocol import DESTINATION, REQUEST_ID, host_port

EXT_PROC = "type.googleapis.com/envoy.extensions.filters.http.ext_proc.v3.ExternalProcessor"
PROCESS_CLUSTER, PICKED_CLUSTER, ENGINES_CLUSTER = "kvindex_ext_proc", "kvindex_picked", "kvindex_engines"


@dataclass(frozen=True, slots=True)
class EnvoyPlan:
    mode: str  # pick | observe
    listen_host: str
    listen_port: int
    ext_proc_host: str
    ext_proc_port: int
    engine_urls: Sequence[str]
    admin_port: int = 0  # 0: Envoy picks
    request_timeout: str = "3600s"  # LLM answers can take long
    picker_body: str = "buffered"  # buffered | full-duplex (see picker_filter)
    max_body_bytes: int = 32 << 20  # what Envoy may buffer of a request for the picker
    max_connections: int = 10_000  # downstream connections Envoy accepts at once


def _socket(host: str, port: int) -> dict[str, Any]:
    return {"socket_address": {"address": host, "port_value": port}}


def picker_filter(body: str = "buffered") -> dict[str, Any]:
    """The picker. ``buffered``: Envoy holds the body and sends it whole (the picker answers with
    the destination, nothing to send back); if kvindex cannot be reached the request goes on
    without it (``failure_mode_allow``). ``full-duplex``: FULL_DUPLEX_STREAMED, as GIE's protocol
    states it (the body streams to kvindex and back); Envoy 1.40 then cannot fail open once the
    body is on its way: kvindex unreachable is a 500."""
    duplex = body == "full-duplex"
    return {"name": "kvindex.picker", "typed_config": {
        "@type": EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": PROCESS_CLUSTER}, "timeout": "10s"},
        "failure_mode_allow": True,
        "message_timeout": "5s",
        "processing_mode": {"request_header_mode": "SEND",
                            "request_body_mode": "FULL_DUPLEX_STREAMED" if duplex else "BUFFERED",
                            "request_trailer_mode": "SEND" if duplex else "SKIP", "response_header_mode": "SKIP",
                            "response_body_mode": "NONE", "response_trailer_mode": "SKIP"}}}


def observer_filter(read_request_body: bool) -> dict[str, Any]:
    """``read_request_body``: without a picker in front, the observer reads the request itself."""
    return {"name": "kvindex.observer", "typed_config": {
        "@type": EXT_PROC,
        "grpc_service": {"envoy_grpc": {"cluster_name": PROCESS_CLUSTER}, "timeout": "10s"},
        "failure_mode_allow": True,
        "observability_mode": True,
        "response_attributes": ["upstream.address"],
        "processing_mode": {"request_header_mode": "SEND",
                            "request_body_mode": "STREAMED" if read_request_body else "NONE",
                            "request_trailer_mode": "SKIP", "response_header_mode": "SEND",
                            "response_body_mode": "STREAMED", "response_trailer_mode": "SKIP"}}}


def strip_filter() -> dict[str, Any]:
    return {"name": "kvindex.strip_routing_headers", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.header_mutation.v3.HeaderMutation",
        "mutations": {"request_mutations": [{"remove": DESTINATION}, {"remove": REQUEST_ID}]}}}


def process_cluster(host: str, port: int, streams: int = 10_000) -> dict[str, Any]:
    """kvindex's ext_proc port: one gRPC stream per request in flight, so the circuit breaker's
    request limit (Envoy's default is 1,024) follows the downstream connection limit."""
    limits = {"max_requests": streams, "max_pending_requests": streams, "max_connections": 64}
    return {"name": PROCESS_CLUSTER, "type": "STATIC", "connect_timeout": "0.25s",
            "circuit_breakers": {"thresholds": [limits]},
            "typed_extension_protocol_options": {"envoy.extensions.upstreams.http.v3.HttpProtocolOptions": {
                "@type": "type.googleapis.com/envoy.extensions.upstreams.http.v3.HttpProtocolOptions",
                "explicit_http_config": {"http2_protocol_options": {}}}},
            "load_assignment": {"cluster_name": PROCESS_CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _socket(host, port)}}]}]}}


def engines_cluster(urls: Sequence[str]) -> dict[str, Any]:
    hosts = [host_port(u) for u in urls]
    return {"name": ENGINES_CLUSTER, "type": "STRICT_DNS", "connect_timeout": "1s", "lb_policy": "ROUND_ROBIN",
            "load_assignment": {"cluster_name": ENGINES_CLUSTER, "endpoints": [{"lb_endpoints": [
                {"endpoint": {"address": _socket(h, p)}} for h, p in hosts]}]}}


def picked_cluster() -> dict[str, Any]:
    return {"name": PICKED_CLUSTER, "type": "ORIGINAL_DST", "lb_policy": "CLUSTER_PROVIDED", "connect_timeout": "1s",
            "original_dst_lb_config": {"use_http_header": True, "http_header_name": DESTINATION}}


def _routes(plan: EnvoyPlan) -> list[dict[str, Any]]:
    retry = {"retry_on": "connect-failure,refused-stream", "num_retries": 2}
    fallback = {"match": {"prefix": "/"}, "route": {"cluster": ENGINES_CLUSTER, "timeout": plan.request_timeout,
                                                     "retry_policy": retry}}
    if plan.mode != "pick":
        return [fallback]
    picked = {"match": {"prefix": "/", "headers": [{"name": DESTINATION, "present_match": True}]},
              "route": {"cluster": PICKED_CLUSTER, "timeout": plan.request_timeout, "retry_policy": retry}}
    return [picked, fallback]


def envoy_config(plan: EnvoyPlan) -> dict[str, Any]:
    """The whole bootstrap: admin on loopback, one listener, kvindex's filters, the clusters."""
    picking = plan.mode == "pick"
    filters = ([strip_filter(), picker_filter(plan.picker_body)] if picking else []) + [observer_filter(not picking)]
    filters.append({"name": "envoy.filters.http.router", "typed_config": {
        "@type": "type.googleapis.com/envoy.extensions.filters.http.router.v3.Router"}})
    manager = {"@type": "type.googleapis.com/envoy.extensions.filters.network.http_connection_manager.v3."
                        "HttpConnectionManager",
               "stat_prefix": "kvindex_gateway", "http_filters": filters,
               "route_config": {"virtual_hosts": [{"name": "engines", "domains": ["*"], "routes": _routes(plan)}]}}
    clusters = [process_cluster(plan.ext_proc_host, plan.ext_proc_port, plan.max_connections), engines_cluster(plan.engine_urls)]
    if picking:
        clusters.append(picked_cluster())
    return {"admin": {"address": _socket("127.0.0.1", plan.admin_port)},
            "overload_manager": {"resource_monitors": [{
                "name": "envoy.resource_monitors.global_downstream_max_connections",
                "typed_config": {"@type": "type.googleapis.com/envoy.extensions.resource_monitors."
                                          "downstream_connections.v3.DownstreamConnectionsConfig",
                                 "max_active_downstream_connections": plan.max_connections}}]},
            "static_resources": {
                "listeners": [{"name": "kvindex_gateway", "address": _socket(plan.listen_host, plan.listen_port),
                               "per_connection_buffer_limit_bytes": plan.max_body_bytes + (64 << 10),
                               "filter_chains": [{"filters": [{"name": "envoy.filters.network.http_connection_manager",
                                                               "typed_config": manager}]}]}],
                "clusters": clusters}}


def observer_snippet(ext_proc_host: str, ext_proc_port: int) -> dict[str, Any]:
    """What to add to one's own Envoy to let kvindex watch it: the filter (before the router) and its cluster."""
    return {"http_filters": [observer_filter(True)], "clusters": [process_cluster(ext_proc_host, ext_proc_port)]}
