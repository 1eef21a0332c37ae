"""Admission of a new voice client (a WebRTC offer, a phone stream, a device
socket): the session limits every transport shares, checked in one place,
with the per-tenant and per-address quotas and start rates of
:mod:`web.limits`.

The check and the caller's registration of its session in ``app[PEERS]``
must happen with no ``await`` between them, or concurrent requests each
pass the check and overrun the limit (from review: 60 concurrent phone
upgrades passed a limit of 32).
"""

from __future__ import annotations

from aiohttp import web

from web.errors import ApiError
from web.state import LIMITS, PEERS, SETTINGS, ClientSession


def admit(app: web.Application, client: str, tenant: str | None = None, *, start: bool = False) -> None:
    """Refuse a new session from ``client`` (its address) of ``tenant``
    (None: not known yet) if the server is full: ``max_sessions`` running
    (503 ``too_many_sessions``), the client's ``max_pending_per_client``
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
        raise ApiError(503, "too_many_sessions", f"{settings.max_sessions} sessions are running; try later",
                       headers={"Retry-After": "5"})
    pending = [p for p in peers.values() if not p.connected]
    if sum(1 for p in pending if p.client == client) >= settings.max_pending_per_client:
        raise ApiError(429, "too_many_pending", "too many sessions from you are still connecting; connect or wait",
                       headers={"Retry-After": str(int(settings.connect_timeout_s))})
    if len(pending) >= settings.max_pending_sessions:
        raise ApiError(503, "too_many_pending", "too many sessions are still connecting; try again shortly",
                       headers={"Retry-After": "2"})
    limits = app[LIMITS]
    limits.check_sessions(peers.values(), tenant, client)
    if start:
        limits.require("session_start", tenant=tenant, client=client)


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
