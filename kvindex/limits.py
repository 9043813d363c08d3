"""How long a name kvindex accepts from outside may be: the one table of these limits.

A name is a string that identifies something and is kept, logged and used as a label: an engine
instance or pod id, a model, a LoRA adapter, a cache salt, a routing group, an endpoint. Every
entry point refuses a longer one: an HTTP body with a 400 naming the field and the limit
(``kvindex.http.bodies``), an engine topic as a decode error (``name_too_long``).

Invariant: the limits count characters (``len`` of the decoded string), and each is far above
any real name (vLLM model ids, Kubernetes pod names (253) and host:port ids are well inside).
"""

from __future__ import annotations

MAX_ID_CHARS = 256  # instance_id, pod ids (also in /v1/pods/{pod}), routing_group, lora_name
MAX_MODEL_CHARS = 512  # model, model_name (Hugging Face ids, local paths)
MAX_SALT_CHARS = 1024  # cache_salt
MAX_ENDPOINT_CHARS = 1024  # endpoint, replay_endpoint (ZeroMQ addresses)
MAX_TOPIC_BYTES = MAX_ID_CHARS + MAX_MODEL_CHARS + 16  # an engine's kv@<pod>@<model> topic frame

# the field each limit applies to, as the HTTP bodies name them
FIELD_LIMITS = {
    "instance_id": MAX_ID_CHARS, "pod": MAX_ID_CHARS, "pods": MAX_ID_CHARS, "routing_group": MAX_ID_CHARS,
    "lora_name": MAX_ID_CHARS, "model": MAX_MODEL_CHARS, "model_name": MAX_MODEL_CHARS,
    "cache_salt": MAX_SALT_CHARS, "endpoint": MAX_ENDPOINT_CHARS, "replay_endpoint": MAX_ENDPOINT_CHARS,
}
