"""The one error every HTTP handler answers with: a status, one line naming the field, a reason label.

Invariants: the body is ``{"error": message, "field": field}`` (JSON); ``reason_label`` is chosen
in code from a fixed vocabulary (it labels ``kvindex_http_rejections``), never from exception text.
"""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(web.HTTPException):
    """A refused request: one line, the field at fault, a reason label for the metric."""

    def __init__(self, message: str, *, field: str | None = None, status: int = 400, reason: str = "bad_request") -> None:
        self.status_code = status
        super().__init__(text=json.dumps({"error": message, "field": field}), content_type="application/json")
        self.reason_label = reason
