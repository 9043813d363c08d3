"""What the request path answers about a request (``Routed``, ``Refused``), and what an ext_proc
stream needs of it (``RoutePath``, which ``kvindex.route.path.RequestPath`` is): the seam between
the protocol (``exchange``, ``server``) and the decisions (``path``).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from kvindex.route.usage import Usage


@dataclass(frozen=True, slots=True)
class Routed:
    """Where to send the request (None: Envoy's own choice), and its id (the decision's)."""

    id: str
    destination: str | None
    pod: str | None = None


@dataclass(frozen=True, slots=True)
class Refused:
    """An immediate answer: a status and a one-line reason (``reason``: its metric label)."""

    status: int
    message: str
    reason: str

    def body(self) -> bytes:
        return json.dumps({"error": self.message}).encode()


class RoutePath(Protocol):
    max_body_bytes: int

    async def route(self, body: bytes, subset: tuple[str, ...] | None, source: str) -> Routed | Refused: ...

    async def finish(self, request_id: str, served: str | None, status: int | None, usage: Usage | None,
                     extra: Mapping[str, Any] | None = None) -> dict[str, Any] | None: ...

    def forget(self, request_id: str, why: str) -> None: ...

    def count(self, source: str, outcome: str) -> None: ...

    async def refresh(self) -> None:
        """The engines and their load current again (the server calls it on a timer)."""
        ...

    async def close(self) -> None: ...
