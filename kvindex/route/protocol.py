"""The names the endpoint-picker protocol (Gateway API Inference Extension) and kvindex's own
request path agree on with Envoy: headers and metadata keys. Values only (no protobuf), so that
writing an Envoy configuration needs no ext_proc stubs; and how an engine's URL becomes the
``ip:port`` those headers carry.
"""

from urllib.parse import urlsplit

DESTINATION = "x-gateway-destination-endpoint"  # header and envoy.lb metadata key: where to send it
SUBSET_NAMESPACE, SUBSET_KEY = "envoy.lb.subset_hint", "x-gateway-destination-endpoint-subset"
SERVED_NAMESPACE, SERVED_KEY = "envoy.lb", "x-gateway-destination-endpoint-served"
REQUEST_ID = "x-kvindex-request"  # the picker's id of a request, read back by the observer
CHUNK_BYTES = 62_000  # the reference picker's body chunk (GIE pkg/common/envoy/chunking.go)


def host_port(url: str) -> tuple[str, int]:
    parts = urlsplit(url)
    return parts.hostname or "", parts.port or (443 if parts.scheme == "https" else 80)


def join(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
