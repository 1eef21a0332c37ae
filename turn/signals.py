"""Stop signals: fast, and never the authority.

The store row decides whether a turn is stopping; a signal only wakes the
worker that runs it sooner. In one process the worker's ``asyncio.Event`` is
set at once. Across instances, :class:`RedisStopSignals` publishes the turn id
on a Redis pub/sub channel and every instance sets its local event. A worker
that misses a message (it was reconnecting, say) still sees the flag at its
next checkpoint, which reads the store (see ``TurnManager.stop_requested``).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


class StopSignals:
    """In-process stop signals: one ``asyncio.Event`` per watched turn."""

    def __init__(self) -> None:
        self._events: dict[str, asyncio.Event] = {}
        #: called with the turn id, synchronously, when a watched turn's
        #: signal fires (the Turn Manager closes its gate there)
        self.on_fire: Callable[[str], None] | None = None

    def watch(self, turn_id: str) -> asyncio.Event:
        """The event that is set when ``turn_id`` is asked to stop."""
        return self._events.setdefault(turn_id, asyncio.Event())

    def forget(self, turn_id: str) -> None:
        """Stop watching ``turn_id`` (its worker ended)."""
        self._events.pop(turn_id, None)

    def fire(self, turn_id: str) -> None:
        """Set the local event of ``turn_id``, if watched here (a signal for a
        turn nobody here runs is dropped), after calling :attr:`on_fire`
        synchronously: the owner closes the turn's delivery gate in the same
        step as it hears of the stop, before any waiter wakes."""
        ev = self._events.get(turn_id)
        if ev is None:
            return
        if self.on_fire is not None:
            try:
                self.on_fire(turn_id)
            except Exception:  # a broken hook must not lose the signal
                log.exception("stop hook of %s failed", turn_id)
        ev.set()

    async def publish(self, turn_id: str) -> None:
        """Tell every worker (here: this process) that ``turn_id`` must stop."""
        self.fire(turn_id)

    async def start(self) -> None:
        """Begin listening for remote signals (none in-process)."""

    async def aclose(self) -> None:
        """Stop listening."""


class RedisStopSignals(StopSignals):
    """Stop signals shared by every instance through Redis pub/sub.

    Args:
        client: a ``redis.asyncio`` client (``decode_responses=True``).
        channel: the pub/sub channel, e.g. ``"tk:stops"``.
    """

    def __init__(self, client: Any, channel: str) -> None:
        super().__init__()
        self.client = client
        self.channel = channel
        self._task: asyncio.Task[None] | None = None
        self._ready = asyncio.Event()

    async def publish(self, turn_id: str) -> None:
        """Set the local event at once, then publish to the other instances.
        A failed publish is logged, not raised: the flag in the store still
        reaches them at their next checkpoint."""
        self.fire(turn_id)
        try:
            await self.client.publish(self.channel, turn_id)
        except Exception:
            log.exception("could not publish the stop of %s; workers will see it at their next checkpoint", turn_id)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._listen(), name="stop-signals")
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(5):
                    await self._ready.wait()

    async def _listen(self) -> None:
        """Keep a subscription; on loss, resubscribe with a short backoff."""
        delay = 0.05
        while True:
            pubsub = self.client.pubsub(ignore_subscribe_messages=True)
            try:
                await pubsub.subscribe(self.channel)
                self._ready.set()
                delay = 0.05
                async for message in pubsub.listen():
                    if message.get("type") == "message":
                        self.fire(str(message["data"]))
            except asyncio.CancelledError:
                raise
            except Exception:
                log.warning("stop-signal subscription lost; resubscribing in %.2f s", delay, exc_info=True)
            finally:
                with contextlib.suppress(Exception):
                    await pubsub.aclose()
            await asyncio.sleep(delay)
            delay = min(delay * 2, 2.0)

    async def aclose(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None
