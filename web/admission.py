"""Admission of a new voice client (a WebRTC offer, a phone stream, a device
socket): the session limits every transport shares, checked in one place,
with the per-tenant and per-address quotas and start rates of
:mod:`web.limits`, and the server's capacity (:mod:`web.capacity`).

A server that is full (``max_sessions`` running, or :mod:`web.capacity`'s
measure) refuses the new call in the caller's own terms, live calls going
on: a WebRTC offer gets 503 (``too_many_sessions`` or ``at_capacity``)
with Retry-After; a phone stream or a device socket has its WebSocket
accepted and closed at once with 1013 "try again later" (RFC 6455 section
7.4.1 via IANA's registry) and the reason, which Twilio's and Telnyx's
debuggers log with the stream's end; a device is sent an ``alert`` first,
which its screen shows (:func:`refuse_socket`).

The check and the caller's registration of its session in ``app[PEERS]``
must happen with no ``await`` between them, or concurrent requests each
pass the check and overrun the limit (from review: 60 concurrent phone
upgrades passed a limit of 32).
"""

from __future__ import annotations

import json
from typing import Any

from aiohttp import WSCloseCode, web

from web.errors import ApiError
from web.state import CAPACITY, LIMITS, PEERS, SETTINGS, ClientSession

#: Retry-After of a refusal of a full server, s (a call lasts minutes; another instance may have room now)
FULL_RETRY_AFTER_S = 5
#: what a capacity refusal says, per web.capacity reason
FULL_REASONS = {
    "send_lateness": "its calls' audio is already being sent late",
    "cpu": "one more call would take more CPU than it has",
    "starting": "a call is starting already: one at a time",
}
#: the codes of a full server's refusals
FULL_CODES = ("too_many_sessions", "at_capacity")


def require_room(app: web.Application, *, replacing: int = 0, count: bool = True) -> None:
    """Refuse a new session of a full server: 503 ``too_many_sessions`` at
    ``max_sessions`` (``replacing``: sessions this one replaces, not
    counted), 503 ``at_capacity`` when :meth:`web.capacity.Capacity.full`
    says so (not for a replacement: it adds no load). ``count``: count a
    capacity refusal in the metrics (once per refused call).

    Raises:
        ApiError: as above, with Retry-After.
    """
    settings = app[SETTINGS]
    if len(app[PEERS]) - replacing >= settings.max_sessions:
        raise ApiError(503, "too_many_sessions", f"{settings.max_sessions} sessions are running; try later",
                       headers={"Retry-After": str(FULL_RETRY_AFTER_S)})
    if replacing:
        return
    capacity = app[CAPACITY]
    reason = capacity.refuse() if count else capacity.full()
    if reason is not None:
        raise ApiError(503, "at_capacity", f"this server is at capacity: {FULL_REASONS[reason]}; try another instance "
                       "or later", headers={"Retry-After": str(FULL_RETRY_AFTER_S)})


async def refuse_socket(request: web.Request, refusal: ApiError, first: dict[str, Any] | None = None
                        ) -> web.WebSocketResponse:
    """Accept a phone stream's or a device's WebSocket only to close it
    with 1013 (``WSCloseCode.TRY_AGAIN_LATER``) and ``refusal``'s code and message as the reason (at most
    123 bytes, RFC 6455 section 5.5), after sending ``first`` (a device's
    ``alert``) if given."""
    ws = web.WebSocketResponse(heartbeat=None)
    await ws.prepare(request)
    if first is not None:
        await ws.send_str(json.dumps(first))
    reason = f"{refusal.code}: {refusal.message}".encode()[:123].decode(errors="ignore")
    await ws.close(code=WSCloseCode.TRY_AGAIN_LATER, message=reason.encode())
    return ws


def admit(app: web.Application, client: str, tenant: str | None = None, *, start: bool = False) -> None:
    """Refuse a new session from ``client`` (its address) of ``tenant``
    (None: not known yet) if the server is full (:func:`require_room`:
    503 ``too_many_sessions`` or ``at_capacity``), the client's ``max_pending_per_client``
    sessions still connecting (429 ``too_many_pending``),
    ``max_pending_sessions`` connecting in all (503 ``too_many_pending``),
    the tenant's or the address's quota of concurrent sessions (429
    ``rate_limited``); with ``start``, also over the session starts a
    minute (429 ``rate_limited``; only then is a start counted). Each answer
    carries Retry-After (s). Nothing is counted when it refuses.

    Raises:
        ApiError: as above.
    """
    settings = app[SETTINGS]
    peers = app[PEERS]
    if len(peers) >= settings.max_sessions:
        require_room(app)  # raises too_many_sessions
    pending = [p for p in peers.values() if not p.connected]
    if sum(1 for p in pending if p.client == client) >= settings.max_pending_per_client:
        raise ApiError(429, "too_many_pending", "too many sessions from you are still connecting; connect or wait",
                       headers={"Retry-After": str(int(settings.connect_timeout_s))})
    if len(pending) >= settings.max_pending_sessions:
        raise ApiError(503, "too_many_pending", "too many sessions are still connecting; try again shortly",
                       headers={"Retry-After": "2"})
    limits = app[LIMITS]
    limits.check_sessions(peers.values(), tenant, client)
    require_room(app)  # the load last: a client's own flood is told as such
    if start:
        limits.require("session_start", tenant=tenant, client=client)
        app[CAPACITY].started()


def admit_tenant(app: web.Application, session: ClientSession, tenant: str) -> None:
    """A session admitted before its tenant was known (a phone stream, at
    its ``start``) counted against ``tenant``'s quota of concurrent
    sessions and its session starts a minute (the address's were at
    :func:`admit`).

    Raises:
        ApiError: 429 ``rate_limited`` (nothing counted).
    """
    limits = app[LIMITS]
    limits.check_sessions((p for p in app[PEERS].values() if p is not session), tenant, None)
    limits.require("session_start", tenant=tenant)
