"""Downstream propagation: work a tool enqueues (a batch of outbound
messages, say) carries its turn's id, and the worker that carries it out
checks the turn before each item, skipping the items of a stopped turn.

The queue is the store's (``TurnStore.queue_*``): a Redis Stream with a
consumer group on Redis, a table on SQLite.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from turn.clock import Clock
from turn.ledger import AuditRow
from turn.models import StopReasonKind, Turn, TurnStatus
from turn.store import TurnStore, UnknownTurn

log = logging.getLogger(__name__)

#: a turn in one of these states, or with a stop reason, has its queued work skipped
STOPPED = frozenset({TurnStatus.CANCEL_REQUESTED, TurnStatus.CANCELLED})


def turn_stopped(turn: Turn) -> bool:
    """True if ``turn``'s queued work must not run: it was asked to stop,
    for any reason but ``worker_shutdown`` (a server that went down was not
    asked to undo anything: what the turn queued is kept and carried out,
    as the ledger's policy for that reason says). A stop that came after the
    turn had completed changes nothing."""
    if turn.status is TurnStatus.COMPLETED:
        return False
    stopped = turn.status in STOPPED or turn.stop_reason is not None
    return stopped and (turn.stop_reason is None or turn.stop_reason.kind is not StopReasonKind.WORKER_SHUTDOWN)


class DownstreamWorker:
    """Carries out queued items, one by one, checking each item's turn first.
    A skipped item leaves an audit row on the intent that queued it
    (``downstream_skipped``), so the ledger shows what never went out. A
    failed item is logged and counted, not retried (its handler should
    retry what it can).

    Args:
        store: where the queue and the turns are.
        queue: the queue's name.
        handle: ``async (item) -> None`` does the item's work (it gets the
            item's own idempotency key in ``item["key"]``).
        clock: time source for the pause between polls.
        consumer: this worker's name in the consumer group.
        on_skip: called with each item skipped because its turn stopped.

    Every item must carry ``turn_id`` and ``key``.
    """

    def __init__(
        self,
        store: TurnStore,
        queue: str,
        handle: Callable[[dict[str, Any]], Awaitable[None]],
        clock: Clock,
        *,
        consumer: str = "worker-1",
        on_skip: Callable[[dict[str, Any]], None] | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.handle = handle
        self.clock = clock
        self.consumer = consumer
        self.on_skip = on_skip
        self.done = 0
        self.skipped = 0
        self.failed = 0

    async def run_once(self, count: int = 10) -> int:
        """Claim up to ``count`` items and carry them out (or skip them);
        returns how many were claimed."""
        items = await self.store.queue_claim(self.queue, self.consumer, count)
        for item_id, item in items:
            try:
                try:
                    turn = await self.store.get(item["turn_id"])
                except UnknownTurn:
                    turn = None
                if turn is None or turn_stopped(turn):
                    self.skipped += 1
                    if self.on_skip is not None:
                        self.on_skip(item)
                    batch = str(item.get("key", "")).rsplit(":", 1)[0]
                    await self.store.audit_add(
                        AuditRow(key=batch, at=self.clock.now(), action="downstream_skipped", detail=f"{item.get('key')}: its turn was stopped")
                    )
                else:
                    await self.handle(item)
                    self.done += 1
            except asyncio.CancelledError:
                raise
            except Exception:
                self.failed += 1
                log.exception("downstream item %s of turn %s failed", item.get("key"), item.get("turn_id"))
            await self.store.queue_ack(self.queue, item_id)
        return len(items)

    async def run(self, poll_s: float = 0.05) -> None:
        """Work forever, polling every ``poll_s`` when the queue is empty."""
        while True:
            try:
                claimed = await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("downstream worker pass failed")
                claimed = 0
            if not claimed:
                await self.clock.sleep(poll_s)
