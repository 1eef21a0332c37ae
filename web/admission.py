"""Admission of a new voice client (a WebRTC offer, a phone stream, a device
socket): the session limits every transport shares, checked in one place.

The check and the caller's registration of its session in ``app[PEERS]``
must happen with no ``await`` between them, or concurrent requests each
pass the check and overrun the limit (from review: 60 concurrent phone
upgrades passed a limit of 32).
"""

from __future__ import annotations

from aiohttp import web

from web.errors import ApiError
from web.state import PEERS, SETTINGS


def admit(app: web.Application, client: str) -> None:
    """Refuse a new session from ``client`` (its address) if the server is
    full: ``max_sessions`` running (503 ``too_many_sessions``), the
    client's ``max_pending_per_client`` sessions still connecting (429
    ``too_many_pending``), or ``max_pending_sessions`` connecting in all
    (503 ``too_many_pending``). Each answer carries Retry-After (s).

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
