"""JSON errors for the HTTP API: ``{"error": {"code", "message"}}``."""

from __future__ import annotations

import json

from aiohttp import web


class ApiError(web.HTTPException):
    """An HTTP error with a JSON body ``{"error": {"code", "message"}}``.

    Args:
        status: HTTP status (4xx/5xx).
        code: machine-readable code, e.g. ``"bad_json"``.
        message: for humans; never echoes secrets.
        headers: extra response headers (e.g. ``WWW-Authenticate``).
    """

    def __init__(self, status: int, code: str, message: str, headers: dict[str, str] | None = None) -> None:
        self.status_code = status
        super().__init__(
            text=json.dumps({"error": {"code": code, "message": message}}),
            content_type="application/json",
            headers=headers,
        )
        self.code = code
        self.message = message


def openapi_error(description: str, retry_after: bool = False) -> dict[str, object]:
    """An error response of the OpenAPI document (``web.openapi.OPENAPI``): the
    JSON ``Error`` body; with ``retry_after``, a required ``Retry-After``
    header (whole seconds: 429 ``rate_limited``, 503)."""
    out: dict[str, object] = {"description": description,
                              "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}
    if retry_after:
        out["headers"] = {"Retry-After": {"required": True, "description": "seconds to wait before trying again",
                                          "schema": {"type": "string", "pattern": "^[0-9]+$"}}}
    return out
