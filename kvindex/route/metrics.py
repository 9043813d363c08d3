"""The request path's metrics, in the registry the composition root passes in.

Invariants: every label comes from a fixed vocabulary chosen in code (a source, an outcome or
refusal reason, a protocol error's reason), never from a request or an exception's text.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from kvindex.metrics import LATENCY_BUCKETS


class RouteMetrics:
    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        self.outcomes = Counter("kvindex_route_requests", "Requests on the request path (Envoy ext_proc), by source "
                                "(pick, observe) and outcome: routed (kvindex chose the engine), watched (a gateway did), "
                                "recorded (answered and recorded as a decision), error_status, unknown_upstream, "
                                "unknown_request, reset, expired, evicted, or why it was refused (malformed, "
                                "missing_model, too_large, no_endpoint, ...)", ["source", "outcome"], registry=r)
        self.pick_seconds = Histogram("kvindex_route_pick_seconds", "Time from a request's whole body to kvindex's "
                                      "answer (tokenize, both indexes, score), by source", ["source"],
                                      buckets=LATENCY_BUCKETS, registry=r)
        self.errors = Counter("kvindex_route_errors", "Protocol problems on the ext_proc port and the engines' load "
                              "scrapes, by reason (HTTP/2 and gRPC errors, bad ext_proc messages, scrape failures, "
                              "tokenizer_unavailable)", ["reason"], registry=r)
