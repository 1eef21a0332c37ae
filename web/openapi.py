"""The OpenAPI 3.1 document of the whole HTTP API, and the event catalogue's
JSON Schema:

    GET  /v1/openapi.json              every /v1 operation described (OpenAPI 3.1)
    GET  /v1/events.schema.json        every event a client may receive or send
                                       (turn.catalogue_schema)

Each module that owns routes documents them in its own ``OPENAPI_PATHS``
(and ``OPENAPI_SCHEMAS``), merged here; tests/web/test_openapi_routes.py
fails for any /v1 route left out, and tests/web/test_fuzz_api.py fuzzes
every operation from this document.
"""

from __future__ import annotations

from typing import Any

from aiohttp import web

from turn.catalogue_schema import catalogue_schema
from turn.models import Turn
from turn.store import StopAnswer
from web.api import IDEMPOTENCY_KEY, StartTurn, StopTurn
from web.client_tokens import OPENAPI_PATHS as CLIENT_TOKEN_PATHS
from web.client_tokens import OPENAPI_SCHEMAS as CLIENT_TOKEN_SCHEMAS
from web.devices.routes import OPENAPI_PATHS as DEVICE_PATHS
from web.drain import OPENAPI_PATHS as DRAIN_PATHS
from web.instances import OPENAPI_PATHS as INSTANCE_PATHS
from web.instances import OPENAPI_SCHEMAS as INSTANCE_SCHEMAS
from web.signaling import OPENAPI_PATHS as SIGNALING_PATHS
from web.telephony.routes import OPENAPI_PATHS as TELEPHONY_PATHS


async def openapi(request: web.Request) -> web.Response:
    """``GET /v1/openapi.json``: the OpenAPI 3.1 document of this API."""
    return web.json_response(OPENAPI)


async def events_schema(request: web.Request) -> web.Response:
    """The event catalogue's JSON Schema (no credentials needed: it says
    nothing about any tenant)."""
    return web.json_response(EVENTS_SCHEMA, content_type="application/schema+json")


def add_routes(app: web.Application) -> None:
    """Register ``GET /v1/openapi.json`` and ``GET /v1/events.schema.json`` on ``app``."""
    app.router.add_get("/v1/openapi.json", openapi)
    app.router.add_get("/v1/events.schema.json", events_schema)


def _schemas() -> dict[str, Any]:
    schemas: dict[str, Any] = {}
    for model in (StartTurn, StopTurn, Turn):
        schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(schema.pop("$defs", {}))
        schemas[model.__name__] = schema
    schemas.update(CLIENT_TOKEN_SCHEMAS)
    schemas.update(INSTANCE_SCHEMAS)
    schemas["Error"] = {
        "type": "object",
        "required": ["error"],
        "properties": {"error": {"type": "object", "required": ["code", "message"],
                                 "properties": {"code": {"type": "string"}, "message": {"type": "string"}}}},
    }
    schemas["TurnView"] = {"allOf": [{"$ref": "#/components/schemas/Turn"}, {"type": "object", "properties": {
        "label": {"type": "string", "description": "the state as shown to users; CANCEL_REQUESTED is 'stopping'"},
        "owner_lost": {"type": "boolean", "description": "open, and its worker stopped heartbeating"}}}]}
    return schemas


def _err(desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


def _json(ref: str, desc: str) -> dict[str, Any]:
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def _links(turn_id: str) -> dict[str, Any]:
    """OpenAPI links from a response that names a turn (``turn_id``, a JSON
    pointer into its body) to reading and stopping that turn."""
    to = f"$response.body#{turn_id}"
    return {"GetTurn": {"operationId": "getTurn", "parameters": {"turn_id": to}},
            "StopTurn": {"operationId": "stopTurn", "parameters": {"turn_id": to}}}


_STOP_RESULT = {"type": "object", "properties": {"answer": {"enum": [a.value for a in StopAnswer]},
                                                 "turn": {"$ref": "#/components/schemas/TurnView"}}}

OPENAPI: dict[str, Any] = {
    "openapi": "3.1.0",
    "info": {"title": "turnkeeper", "version": "1", "description": "Turns that stop when asked: text turns over REST, events over SSE."},
    "components": {
        "securitySchemes": {"bearer": {"type": "http", "scheme": "bearer",
                                       "description": "a tenant API token (WebRTC offers: also a client token ck_...; "
                                                      "device sockets: a device token)"},
                            "admin": {"type": "http", "scheme": "bearer", "description": "the admin_token setting"}},
        "schemas": _schemas(),
    },
    "security": [{"bearer": []}],
    "paths": {
        "/v1/turns": {"post": {
            "summary": "Start a text turn", "operationId": "startTurn",
            "requestBody": {"required": True, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/StartTurn"}}}},
            "responses": {
                "202": {"description": "accepted and running", "content": {"application/json": {"schema": {"type": "object", "properties": {
                    "turn": {"$ref": "#/components/schemas/TurnView"}, "session_id": {"type": "string"},
                    "events_url": {"type": "string"}, "resume_token": {"type": "string"}}}}},
                    "links": {**_links("/turn/id"), "SessionEvents": {"operationId": "sessionEvents", "parameters": {
                        "session_id": "$response.body#/session_id", "resume_token": "$response.body#/resume_token"}}}},
                "400": _err("bad JSON or invalid request"), "401": _err("no or unknown token"),
                "404": _err("the session belongs to nobody you know"),
                "409": _err("the session is a voice session (wrong_session_kind)"), "413": _err("body too large (body_too_large)"),
                "429": _err("rate_limited: the tenant's or the address's turns a minute; see Retry-After (s)"),
                "503": _err("shutting down")}}},
        "/v1/turns/{turn_id}": {"get": {
            "summary": "The turn record, with its stop reason, usage, stop report and side-effect ledger", "operationId": "getTurn",
            "parameters": [{"name": "turn_id", "in": "path", "required": True, "schema": {"type": "string"}}],
            "responses": {"200": {**_json("TurnView", "the turn"), "links": _links("/id")},
                          "401": _err("no or unknown token"), "404": _err("unknown turn")}}},
        "/v1/turns/{turn_id}/stop": {"post": {
            "summary": "Stop a turn, idempotently", "operationId": "stopTurn",
            "parameters": [
                {"name": "turn_id", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "Idempotency-Key", "in": "header", "required": True,
                 "schema": {"type": "string", "pattern": IDEMPOTENCY_KEY.pattern},
                 "description": "repeats with the same key get the same answer and cause nothing more"}],
            "requestBody": {"required": False, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/StopTurn"}}}},
            "responses": {
                "202": {"description": "accepted (or already stopping); the turn shows 'stopping' until its worker confirms",
                        "content": {"application/json": {"schema": _STOP_RESULT}}, "links": _links("/turn/id")},
                "200": {"description": "it had already ended", "content": {"application/json": {"schema": _STOP_RESULT}},
                        "links": _links("/turn/id")},
                "409": {"description": "it ended in RECONCILE_REQUIRED", "content": {"application/json": {"schema": _STOP_RESULT}}},
                "400": _err("missing or invalid Idempotency-Key, bad body"), "401": _err("no or unknown token"),
                "404": _err("unknown turn"), "413": _err("body too large (body_too_large)"),
                "422": _err("Idempotency-Key reused with other parameters"),
                "429": _err("rate_limited: stops a second over the limit (never the first stop of your open turn); "
                            "see Retry-After (s)")}}},
        "/v1/sessions/{session_id}/events": {"get": {
            "summary": "The session's events as Server-Sent Events, live and resumable", "operationId": "sessionEvents",
            "security": [{"bearer": []}, {}],
            "parameters": [
                {"name": "session_id", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "after_seq", "in": "query", "schema": {"type": "integer", "minimum": 0}},
                {"name": "resume_token", "in": "query", "schema": {"type": "string"}},
                {"name": "Last-Event-ID", "in": "header", "schema": {"type": "string"}}],
            "responses": {
                "200": {"description": "text/event-stream: stream.start, then (on resume) snapshot, then events with id = seq",
                        "content": {"text/event-stream": {"schema": {"type": "string"}}}},
                "400": _err("bad cursor"), "401": _err("no, forged or expired credentials"),
                "403": _err("resume token of another session or tenant"), "404": _err("unknown session")}}},
        "/v1/openapi.json": {"get": {"summary": "This document", "security": [],
                                     "responses": {"200": {"description": "OpenAPI 3.1"}}}},
        "/v1/events.schema.json": {"get": {
            "summary": "The event catalogue: every event a client receives (data channel, SSE) or sends",
            "security": [],
            "responses": {"200": {"description": "JSON Schema (draft 2020-12) of one event, a union on 'type'",
                                  "content": {"application/schema+json": {"schema": {"type": "object"}}}}}}},
        **CLIENT_TOKEN_PATHS,
        **TELEPHONY_PATHS,
        **SIGNALING_PATHS,
        **DRAIN_PATHS,
        **INSTANCE_PATHS,
        **DEVICE_PATHS,
    },
}

#: served at /v1/events.schema.json
EVENTS_SCHEMA: dict[str, Any] = catalogue_schema()
