"""Typed keys of the application's shared state (aiohttp ``AppKey``).

Each key names the type of its value, so ``app[KEY]`` is typed wherever it
is read (mypy checks it); the annotations are not evaluated at run time, so
naming ``web.app``'s and ``web.peer``'s classes here makes no import cycle.
"""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any, Protocol

from aiohttp import web

if TYPE_CHECKING:
    from clock import Clock
    from media.pacing import PacingMonitor
    from turn.events import SessionEventLog
    from turn.generation import GenerationFence
    from turn.manager import TurnManager
    from turn.models import StopReasonKind
    from turn.store import TurnStore
    from voice.text_turns import TextTurns
    from web.app import EmbeddedProviders
    from web.auth import Auth
    from web.capacity import Capacity
    from web.limits import Limits
    from web.settings import Settings


class ClientSession(Protocol):
    """A connected voice client as the application tracks it: a WebRTC peer
    (``web.peer.PeerSession``), a phone call (``web.telephony.call.PhoneCall``)
    or a device (``web.devices.call.DeviceCall``)."""

    id: str
    #: the client's address (per-client limits)
    client: str
    @property
    def tenant(self) -> str | None:
        """Its tenant (per-tenant limits); None: not known yet (a phone
        stream before ``start``)."""
        ...
    #: it is connected (a WebRTC offer may still be connecting)
    connected: bool
    #: its session's event log
    log: SessionEventLog
    #: its session's generation fence
    fence: GenerationFence

    def close(self, reason: StopReasonKind) -> asyncio.Task[None]:
        """End it and free everything, once; returns the closing task."""
        ...


SETTINGS: web.AppKey[Settings] = web.AppKey("settings")
#: the rate limits and quotas per tenant and per client address (web.limits)
LIMITS: web.AppKey[Limits] = web.AppKey("limits")
CLOCK: web.AppKey[Clock] = web.AppKey("clock")
#: the turn store (turn.sqlite_store.SqliteStore or turn.redis_store.RedisStore)
STORE: web.AppKey[TurnStore] = web.AppKey("store")
MANAGER: web.AppKey[TurnManager] = web.AppKey("manager")
#: session id -> its WebRTC peer or phone call
PEERS: web.AppKey[dict[str, ClientSession]] = web.AppKey("peers")
PROVIDERS: web.AppKey[EmbeddedProviders] = web.AppKey("providers")
TEXT_TURNS: web.AppKey[TextTurns] = web.AppKey("text_turns")
#: made at startup (it needs the store's secret)
AUTH: web.AppKey[Auth] = web.AppKey("auth")
#: the lease keeper (turn.lease.Leases.keep_leases), started at startup
LEASES: web.AppKey[asyncio.Task[None]] = web.AppKey("lease_keeper")
#: the running SSE handlers' tasks (cancelled at shutdown)
STREAMS: web.AppKey[set[asyncio.Task[Any]]] = web.AppKey("event_streams")
#: the lateness of every session's paced outbound ticks (media.pacing)
PACING: web.AppKey[PacingMonitor] = web.AppKey("pacing")
#: whether one more call fits (web.capacity)
CAPACITY: web.AppKey[Capacity] = web.AppKey("capacity")
#: background tasks started at startup: reconciliation, the lease sweeper, the providers' workers
WORKERS: web.AppKey[list[asyncio.Task[None]]] = web.AppKey("workers")

__all__ = [
    "ClientSession", "SETTINGS", "LIMITS",
    "CLOCK", "STORE", "MANAGER", "PEERS", "PROVIDERS", "TEXT_TURNS", "AUTH", "LEASES", "STREAMS", "WORKERS", "PACING",
    "CAPACITY",
]
