"""The device routes: push-to-talk boards on the xiaozhi-esp32 protocol.

Routes:
    POST   /v1/devices         issue a device token (tenant bearer token):
                               ``{"device_id", "token", "tenant_id"}``; no
                               body is read
    DELETE /v1/devices/{id}    revoke it (tenant bearer token): 204, 404
    GET    /v1/devices/ws      WebSocket: a device (``Authorization: Bearer
                               <device token>``, ``Protocol-Version``,
                               ``Device-Id``, ``Client-Id``)
    GET    /xiaozhi/v1/        the same WebSocket at the path the firmware's
                               default configuration and OTA answers use

A device token is 32 random bytes (URL-safe base64); the store keeps only
its SHA-256 (a random 256-bit token needs no slow hash), so a leaked store
issues no tokens. The token is checked before the upgrade: an unknown or
revoked one gets 401 and no audio is read. The device's turns run under
its tenant's plan. The same ``Device-Id`` of one tenant connecting again
ends the older connection (its turns settled ``transport_disconnected``,
close 1001): the newer wins, as a rebooted board reconnects before the old
socket times out. A device counts against ``max_sessions`` and its tenant's
and address's limits (:mod:`web.limits`: 429 ``rate_limited`` before the
upgrade; its messages with the others' of its tenant and address).
"""

from __future__ import annotations

import base64
import logging
import os
import uuid
from typing import Any

from aiohttp import WSCloseCode, web

from turn.models import StopReasonKind
from web.admission import FULL_RETRY_AFTER_S, refuse_socket, require_room
from web.credentials import token_hash
from web.devices.call import DeviceCall
from web.devices.framing import VERSIONS
from web.devices.messages import MAX_TEXT_BYTES, alert
from web.errors import ApiError, openapi_error
from web.state import AUTH, CAPACITY, CLOCK, LIMITS, MANAGER, PACING, PEERS, PROVIDERS, SETTINGS, STORE

log = logging.getLogger(__name__)

DEVICES_PATH = "/v1/devices"
DEVICE_WS_PATH = "/v1/devices/ws"
#: where xiaozhi-esp32 firmware and its OTA answers point by default (``ws://host:port/xiaozhi/v1/``)
XIAOZHI_WS_PATH = "/xiaozhi/v1/"
#: the connection of each (tenant, Device-Id), for "the newer wins"
DEVICE_CONNECTIONS: web.AppKey[dict[tuple[str, str], DeviceCall]] = web.AppKey("device_connections")


#: the OpenAPI paths of this module (merged into web.openapi's document)
OPENAPI_PATHS: dict[str, Any] = {
    DEVICES_PATH: {"post": {
        "summary": "Issue a device token for the caller's tenant (shown once)", "operationId": "issueDevice",
        "responses": {
            "201": {"description": "the device's id and token", "content": {"application/json": {"schema": {
                "type": "object", "required": ["device_id", "token", "tenant_id"], "properties": {
                    "device_id": {"type": "string", "pattern": "^dev_[0-9a-f]{32}$"}, "token": {"type": "string"},
                    "tenant_id": {"type": "string"}}}}},
                    "links": {"RevokeDevice": {"operationId": "revokeDevice",
                                               "parameters": {"device_id": "$response.body#/device_id"}}}},
            "401": openapi_error("no or unknown tenant API token"),
            "503": openapi_error("the store is unavailable (store_unavailable)", retry_after=True)}}},
    DEVICES_PATH + "/{device_id}": {"delete": {
        "summary": "Revoke one of the caller's devices (an open connection of it is closed 1008)",
        "operationId": "revokeDevice",
        "parameters": [{"name": "device_id", "in": "path", "required": True, "schema": {"type": "string"}}],
        "responses": {
            "204": {"description": "revoked"},
            "401": openapi_error("no or unknown tenant API token"),
            "404": openapi_error("no such device of this tenant, or revoked already (unknown_device)"),
            "503": openapi_error("the store is unavailable (store_unavailable)", retry_after=True)}}},
    DEVICE_WS_PATH: {"get": {
        "summary": "WebSocket: a push-to-talk device (xiaozhi-esp32 protocol; also at /xiaozhi/v1/)",
        "operationId": "deviceSocket",
        "description": "Authorization: Bearer <device token> (from POST /v1/devices) or a client token minted "
                       "for the device transport.",
        "parameters": [
            {"name": "Protocol-Version", "in": "header", "schema": {"enum": [str(v) for v in VERSIONS]}},
            {"name": "Device-Id", "in": "header", "schema": {"type": "string"},
             "description": "the board's MAC: one connection per (tenant, Device-Id), the newer wins"},
            {"name": "Client-Id", "in": "header", "schema": {"type": "string"}}],
        "responses": {
            "101": {"description": "switching protocols (a full server then sends an alert, status busy, and "
                                   "closes 1013 with too_many_sessions or at_capacity)"},
            "400": openapi_error("a Protocol-Version other than 1, 2, 3 (bad_protocol_version), or not a WebSocket "
                                 "handshake"),
            "401": openapi_error("no bearer token, or an unknown or revoked one (or an unknown, used or expired "
                                 "client token)"),
            "403": openapi_error("a client token not for devices (transport_not_allowed)"),
            "429": openapi_error("rate_limited: the tenant's or the address's session starts a minute or concurrent "
                                 "sessions", retry_after=True),
            "503": openapi_error("too_many_sessions (the client token's session runs already), shutting_down "
                                 "(draining) or store_unavailable",
                                 retry_after=True)}}},
}


def add_routes(app: web.Application) -> None:
    """Add the device routes to ``app``."""
    app[DEVICE_CONNECTIONS] = {}
    app.router.add_post(DEVICES_PATH, issue)
    app.router.add_delete(DEVICES_PATH + "/{device_id}", revoke)
    app.router.add_get(DEVICE_WS_PATH, device_socket)
    app.router.add_get(XIAOZHI_WS_PATH, device_socket)


async def issue(request: web.Request) -> web.Response:
    """Issue a device token for the caller's tenant: 201
    ``{"device_id": "dev_...", "token": "..."}`` (the token is shown once).

    Raises:
        ApiError: 401 without a valid tenant bearer token.
    """
    app = request.app
    tenant = app[AUTH].require_tenant(request)
    device_id = "dev_" + uuid.uuid4().hex
    token = base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()
    store = app[STORE]
    now = app[CLOCK].now()
    await app[MANAGER].store_call(lambda: store.device_add(device_id, tenant, token_hash(token), now))
    log.info("device %s issued for tenant %s", device_id, tenant)
    return web.json_response({"device_id": device_id, "token": token, "tenant_id": tenant}, status=201)


async def revoke(request: web.Request) -> web.Response:
    """Revoke one of the caller's devices: 204; its token is refused from
    now on and a connection it has open is closed (1008).

    Raises:
        ApiError: 401 without a valid tenant bearer token; 404 no such
            device of this tenant (or revoked already).
    """
    app = request.app
    tenant = app[AUTH].require_tenant(request)
    device_id = request.match_info["device_id"]
    store = app[STORE]
    if not await app[MANAGER].store_call(lambda: store.device_revoke(device_id, tenant)):
        raise ApiError(404, "unknown_device", f"no device {device_id[:80]!r} of this tenant")
    for call in list(app[DEVICE_CONNECTIONS].values()):
        if call.device_id == device_id:
            call.close(StopReasonKind.TRANSPORT_DISCONNECTED, int(WSCloseCode.POLICY_VIOLATION))
    log.info("device %s of tenant %s revoked", device_id, tenant)
    return web.Response(status=204)


async def device_socket(request: web.Request) -> web.StreamResponse:
    """A device's WebSocket (see the module doc).

    Raises:
        ApiError: 401 bad token (before the upgrade); 400 a
            ``Protocol-Version`` other than 1, 2, 3; 503 too many sessions;
            429 ``rate_limited``: the tenant's or the address's session
            starts a minute or concurrent sessions (:mod:`web.limits`).
    """
    app = request.app
    settings = app[SETTINGS]
    raw_version = request.headers.get("Protocol-Version")
    version: int | None = None
    if raw_version is not None:
        if raw_version.strip() not in {str(v) for v in VERSIONS}:
            raise ApiError(400, "bad_protocol_version", f"Protocol-Version must be one of {VERSIONS}")
        version = int(raw_version)
    caller = await app[AUTH].device_caller(request)
    device_id, tenant, grant = caller.device_id, caller.tenant_id, caller.grant
    peers = app[PEERS]
    mac = request.headers.get("Device-Id", "").strip()[:64] or device_id
    key = (tenant, mac.lower())
    older = app[DEVICE_CONNECTIONS].get(key)
    client = request.remote or "?"
    limits = app[LIMITS]
    try:
        # the connection it replaces does not count (nor adds load); nothing is made yet
        require_room(app, replacing=int(older is not None))
    except ApiError as exc:
        await app[AUTH].refused(caller)  # nothing started: a client token may be used again
        log.warning("refused device %s (%s): %s", device_id, mac, exc.code)
        # the device shows the alert; its socket closes 1013
        return await refuse_socket(request, exc, alert("", exc.message[:200], status="busy", emotion="sad"))
    try:
        if grant is not None and grant.session_id in peers:
            raise ApiError(503, "too_many_sessions", "this client token's session is running already; try later",
                           headers={"Retry-After": str(FULL_RETRY_AFTER_S)})
        limits.check_sessions((p for p in peers.values() if p is not older), tenant, client)
        limits.require("session_start", tenant=tenant, client=client)
    except ApiError:
        await app[AUTH].refused(caller)  # nothing started: a client token may be used again
        raise
    if older is None:
        app[CAPACITY].started()
    ws = web.WebSocketResponse(max_msg_size=max(settings.devices.max_frame_bytes, MAX_TEXT_BYTES) + 1024, heartbeat=None)
    await ws.prepare(request)
    if older is not None:
        log.info("device %s (%s) connected again: the older connection %s ends", device_id, mac, older.id)
        older.close(StopReasonKind.TRANSPORT_DISCONNECTED, int(WSCloseCode.GOING_AWAY))

    def forget(call: DeviceCall) -> None:
        peers.pop(call.id, None)
        if app[DEVICE_CONNECTIONS].get(key) is call:
            del app[DEVICE_CONNECTIONS][key]

    call = DeviceCall(
        settings=settings, manager=app[MANAGER], clock=app[CLOCK], ws=ws,
        providers=app[PROVIDERS].for_session(grant.options.voice if grant else None),
        device_id=device_id, tenant=tenant, header_version=version, on_closed=forget, client=client,
        mac=mac, limits=limits, grant=grant,
    )
    call.pacing = app[PACING]
    peers[call.id] = call
    app[DEVICE_CONNECTIONS][key] = call
    await call.run()
    return ws
