"""The reconciliation worker (DESIGN.md "reconciliation"): in the
background, it settles what stops and crashes left open in the ledger, by
asking the external system by idempotency key, never by a blind retry.
The rules for one row are the :class:`turn.ledger.Ledger`'s
(:meth:`~turn.ledger.Ledger.reconcile`,
:meth:`~turn.ledger.Ledger.run_compensation`), under the turn's stop policy
(:mod:`turn.stop_policy`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from turn.intents import IntentKind, IntentStatus
from turn.ledger import Ledger
from turn.models import StopReasonKind

log = logging.getLogger(__name__)


class ReconciliationWorker:
    """Settles what stops and crashes left open, in the background: runs
    compensation jobs, reconciles effect_unknown intents by lookup, and
    resolves intents of turns whose worker is gone. Safe on several
    instances at once: every change is a compare-and-set.

    Args:
        ledger: the ledger.
        turn_stop_kind: the stop kind of a turn (None if it was not stopped)
            and whether it is terminal: ``async (turn_id) -> (kind, terminal)``.
        interval_s: pause between passes, s.
        pending_grace_s: a pending row of an ended turn is taken over only
            when it has not changed for this long, s (its call may still be
            running: a must-complete section outlives the stop's grace).
    """

    def __init__(
        self,
        ledger: Ledger,
        turn_stop_kind: Callable[[str], Awaitable[tuple[StopReasonKind | None, bool]]],
        *,
        interval_s: float = 1.0,
        pending_grace_s: float = 30.0,
    ) -> None:
        self.ledger = ledger
        self.turn_stop_kind = turn_stop_kind
        self.interval_s = interval_s
        self.pending_grace_s = pending_grace_s

    async def run_once(self, limit: int = 100) -> int:
        """One pass over the rows that are due; returns how many it acted on."""
        ledger = self.ledger
        acted = 0
        for row in await ledger._call(lambda: ledger.store.ledger_due(ledger.clock.now(), limit)):
            try:
                kind, terminal = await self.turn_stop_kind(row.turn_id)
                if row.kind is IntentKind.COMPENSATION:
                    await ledger.run_compensation(row)
                elif row.status is IntentStatus.EFFECT_UNKNOWN:
                    await ledger.reconcile(row, kind)
                elif (
                    row.status is IntentStatus.PENDING
                    and terminal
                    and (ledger.clock.now() - row.updated_at).total_seconds() >= self.pending_grace_s
                ):
                    # its worker is gone (the turn ended without resolving it)
                    status = IntentStatus.ABANDONED if row.effect == "none" else IntentStatus.EFFECT_UNKNOWN
                    await ledger.move(row.key, status, expect=frozenset({IntentStatus.PENDING}), detail="its turn ended without an answer")
                else:
                    continue
                acted += 1
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("could not settle ledger row %s", row.key)
        return acted

    async def run(self) -> None:
        """Run passes forever, ``interval_s`` apart."""
        while True:
            try:
                await self.run_once()
            except asyncio.CancelledError:
                raise
            except Exception:
                log.exception("reconciliation pass failed")
            await self.ledger.clock.sleep(self.interval_s)
