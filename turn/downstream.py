"""Downstream propagation: work a tool enqueues (a batch of outbound
messages, say) carries its turn's id, and the worker that carries it out
checks the turn before each item, skipping the items of a stopped turn.

The check and the send are tied together through the ledger, so a stop
that lands while an item is being sent is never missed: before sending an
item the worker writes an intent under the item's own key (pending, effect
"complete", tool = the queue's name), *then* reads the turn again. A stop
moves the turn RUNNING -> CANCEL_REQUESTED before its ledger is resolved
(:meth:`turn.ledger.Ledger.resolve_on_stop` lists the intents after that
write), so either

- the worker's second read sees the stop: the item's intent is abandoned
  and the item is skipped (nothing goes out), or
- the stop's resolution sees the item's intent (pending: effect_unknown, or
  already done after the stop): the turn is RECONCILE_REQUIRED, and the
  worker's own answer (done) is recorded, with its time.

The queue is the store's (``TurnStore.queue_*``): a Redis Stream with a
consumer group on Redis, a table on SQLite.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from clock import Clock
from turn.intents import AuditRow, IntentStatus
from turn.ledger import EffectNotApplied, Ledger
from turn.models import Turn, TurnStatus
from turn.shield import finish_anyway
from turn.stop_policy import policy_for
from turn.store import TurnStore, UnknownTurn

log = logging.getLogger(__name__)

#: a turn in one of these states, or with a stop reason, has its queued work skipped
STOPPED = frozenset({TurnStatus.CANCEL_REQUESTED, TurnStatus.CANCELLED})


def turn_stopped(turn: Turn) -> bool:
    """True if ``turn``'s queued work must not run: it was asked to stop,
    and its stop's policy does not finish queued work
    (:attr:`turn.stop_policy.EffectPolicy.finish_queued`: only
    ``worker_shutdown`` does; a server that went down was not asked to undo
    anything). Queued work not yet sent has not started, and nothing is
    started after a known stop. A stop that came after the turn had
    completed changes nothing."""
    if turn.status is TurnStatus.COMPLETED:
        return False
    if turn.stop_reason is None:
        return turn.status in STOPPED
    return not policy_for(turn.stop_reason.kind).finish_queued


def item_step(key: str) -> int:
    """The step of the call that queued an item, from the item's key
    ``"<turn_id>:<step>:<i>"`` (0 if the key has no step)."""
    parts = key.split(":")
    return int(parts[1]) if len(parts) >= 3 and parts[1].isdigit() else 0


class DownstreamWorker:
    """Carries out queued items, one by one, each through the ledger
    handshake of the module doc. A skipped item leaves an audit row on the
    intent that queued it (``downstream_skipped``), so the ledger shows what
    never went out. A failed item is logged and counted, not retried here:
    its intent is left effect_unknown (or abandoned if the external system
    said it applied nothing) for the reconciliation worker, which looks its
    key up (give the ledger a handler named after the queue).

    Args:
        store: where the queue, the turns and the ledger are.
        queue: the queue's name (the tool name of the items' intents).
        handle: ``async (item) -> None`` does the item's work (it gets the
            item's own idempotency key in ``item["key"]``); it may raise
            :class:`turn.ledger.EffectNotApplied`.
        clock: time source for the pause between polls and the ledger.
        consumer: this worker's name in the consumer group.
        on_skip: called with each item skipped because its turn stopped.
        ledger: where the items' intents are written (default: a ledger on
            ``store`` that tells no session: items are not the model's
            tool calls).

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
        ledger: Ledger | None = None,
    ) -> None:
        self.store = store
        self.queue = queue
        self.handle = handle
        self.clock = clock
        self.consumer = consumer
        self.on_skip = on_skip
        self.ledger = ledger or Ledger(store, clock)
        self.done = 0
        self.skipped = 0
        self.failed = 0

    async def _stopped(self, turn_id: str) -> bool:
        try:
            turn = await self.store.get(turn_id)
        except UnknownTurn:
            return True
        return turn_stopped(turn)

    async def _skip(self, item: dict[str, Any]) -> None:
        self.skipped += 1
        if self.on_skip is not None:
            self.on_skip(item)
        batch = str(item.get("key", "")).rsplit(":", 1)[0]
        await self.store.audit_add(
            AuditRow(key=batch, at=self.clock.now(), action="downstream_skipped", detail=f"{item.get('key')}: its turn was stopped")
        )

    async def carry_out(self, item: dict[str, Any]) -> bool:
        """One item through the handshake (module doc). Returns True if it
        was sent (now or before), False if it was skipped.

        Raises:
            Exception: its handler failed (the intent is left
                effect_unknown, or abandoned for EffectNotApplied).
        """
        turn_id, key = str(item["turn_id"]), str(item["key"])
        if await self._stopped(turn_id):  # the cheap look: no intent for an item never tried
            await self._skip(item)
            return False
        args = {k: v for k, v in item.items() if k not in ("turn_id", "key")}
        intent = await self.ledger.intent(turn_id, item_step(key), self.queue, args, "complete", key=key)
        if intent.status is IntentStatus.DONE:
            return True  # sent before (the item was handed out again)
        if intent.status is not IntentStatus.PENDING:
            return False  # settled before: abandoned, or left to reconciliation
        pending = frozenset({IntentStatus.PENDING})
        if await self._stopped(turn_id):  # after the intent: a stop from now on sees it
            await self.ledger.move(
                key, IntentStatus.ABANDONED, expect=pending | {IntentStatus.EFFECT_UNKNOWN}, detail="not sent: its turn was stopped"
            )
            await self._skip(item)
            return False
        try:
            await self.handle(item)
        except EffectNotApplied as exc:
            await self.ledger.move(key, IntentStatus.ABANDONED, expect=pending, detail=f"not applied: {exc}", error=str(exc))
            raise
        except Exception as exc:
            error = f"{type(exc).__name__}: {exc}"
            await self.ledger.move(key, IntentStatus.EFFECT_UNKNOWN, expect=pending, detail=f"the call failed: {error}", error=error)
            raise
        # sent: done as of now (a stop recorded after this finds it done),
        # and the record is written even if this worker is cancelled meanwhile
        sent_at = self.clock.now()
        await finish_anyway(self.ledger.settle_late(key, IntentStatus.DONE, result="sent", done_at=sent_at))
        return True

    async def run_once(self, count: int = 10) -> int:
        """Claim up to ``count`` items and carry them out (or skip them);
        returns how many were claimed."""
        items = await self.store.queue_claim(self.queue, self.consumer, count)
        for item_id, item in items:
            try:
                if await self.carry_out(item):
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
