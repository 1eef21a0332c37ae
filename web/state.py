"""Typed keys of the application's shared state (aiohttp ``AppKey``)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING, Any

from aiohttp import web

from turn.clock import Clock
from turn.manager import TurnManager
from voice.text_turns import TextTurns
from web.settings import Settings

if TYPE_CHECKING:
    pass

SETTINGS = web.AppKey("settings", Settings)
CLOCK = web.AppKey("clock", Clock)  # type: ignore[type-abstract]
STORE = web.AppKey("store", object)  # SqliteStore | RedisStore
MANAGER = web.AppKey("manager", TurnManager)
PEERS = web.AppKey("peers", dict)  # session id -> web.peer.PeerSession
PROVIDERS = web.AppKey("providers", object)  # web.app.EmbeddedProviders
TEXT_TURNS = web.AppKey("text_turns", TextTurns)
AUTH = web.AppKey("auth", object)  # web.auth.Auth
LEASES = web.AppKey("lease_keeper", asyncio.Task)
STREAMS = web.AppKey("event_streams", set)  # running SSE handler tasks
WORKERS = web.AppKey("workers", list)  # background tasks: reconciliation, message sender

__all__ = ["SETTINGS", "CLOCK", "STORE", "MANAGER", "PEERS", "PROVIDERS", "TEXT_TURNS", "AUTH", "LEASES", "STREAMS", "WORKERS", "Any"]
