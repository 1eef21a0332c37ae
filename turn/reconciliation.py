"""The reconciliation worker (DESIGN.md "reconciliation"): in the
background, it settles what stops and crashes left open in the ledger, by
asking the external system by idempotency key, never by a blind retry.
A compensation job is run by the :class:`turn.ledger.Ledger`
(:meth:`~turn.ledger.Ledger.run_compensation`); an effect_unknown row is
reconciled here (:meth:`ReconciliationWorker.reconcile`), under the turn's
stop policy (:mod:`turn.stop_policy`).
"""

from __future__ import annotations

import asyncio
import logging
from datetime import datetime

from turn.intents import OPEN, Intent, IntentKind, IntentStatus, LookupAnswer
from turn.ledger import EffectNotApplied, Ledger
from turn.models import StopReasonKind
from turn.reversal import CALL_LIMIT_S
from turn.stop_policy import TurnStop, TurnStopOf, policy_for, reverses_at

log = logging.getLogger(__name__)


class ReconciliationWorker:
    """Settles what stops and crashes left open, in the background: runs
    compensation jobs, reconciles effect_unknown intents by lookup, and
    resolves intents of turns whose worker is gone. Safe on several
    instances at once: every change is a compare-and-set.

    Args:
        ledger: the ledger.
        turn_stop: the stop in force for a turn (its kind and time, and
            whether the turn is terminal): ``async (turn_id) -> TurnStop``.
            A compensation job or a reversal is judged by the stop's policy
            for the stage of its effect (a call's answer may land after the
            stop was resolved).
        interval_s: pause between passes, s.
        pending_grace_s: a pending row of an ended turn is taken over only
            when it has not changed for this long, s (its call may still be
            running: a must-complete section outlives the stop's grace).
    """

    def __init__(
        self,
        ledger: Ledger,
        turn_stop: TurnStopOf,
        *,
        interval_s: float = 1.0,
        pending_grace_s: float = 30.0,
    ) -> None:
        self.ledger = ledger
        self.turn_stop = turn_stop
        self.interval_s = interval_s
        self.pending_grace_s = pending_grace_s

    async def run_once(self, limit: int = 100) -> int:
        """One pass over the rows that are due; returns how many it acted on."""
        ledger = self.ledger
        acted = 0
        for row in await ledger._call(lambda: ledger.store.ledger_due(ledger.clock.now(), limit)):
            try:
                stop: TurnStop = await self.turn_stop(row.turn_id)
                if row.kind is IntentKind.COMPENSATION:
                    await ledger.run_compensation(row, reverses=stop.reverses())
                elif row.status is IntentStatus.EFFECT_UNKNOWN:
                    await self.reconcile(row, stop.kind, stop_at=stop.at)
                elif (
                    row.status is IntentStatus.PENDING
                    and stop.terminal
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

    async def reconcile(self, intent: Intent, kind: StopReasonKind | None, *, stop_at: datetime | None = None) -> Intent:
        """One reconciliation attempt of an effect_unknown intent: ask the
        external system by key (never a blind retry) and act on the answer
        under the policy of the turn's stop reason ``kind``. An
        effect_unknown found present was in flight at the stop: it is
        reversed if the policy reverses effects in flight. One found absent
        is applied again with the same key only if the policy allows new
        effects and retries; a failed retry or an answer nobody can give is
        retried with backoff, up to ``turn.ledger.MAX_ATTEMPTS``. A row
        whose call's own answer lands meanwhile is judged by the policy for
        the stage that answer gives it at the stop requested at ``stop_at``
        (UTC; None: not known, such a row is left as it landed). Before a
        retry the turn's stop is read again (one may have come since the
        caller read it), and a retry's answer is recorded like the call's
        own (:meth:`turn.ledger.Ledger.settle_late`): a stop resolved while
        it was on its way has it judged, not lost. Returns the row as
        stored afterwards."""
        ledger = self.ledger
        policy = policy_for(kind)
        handler = ledger.handlers(intent.tool)
        if handler is None:
            return await ledger.give_up(intent, f"no tool {intent.tool!r} here to look the effect up")
        answer = await ledger.lookup(intent)
        if answer is LookupAnswer.PRESENT:
            if intent.effect == "compensate" and policy.compensate_in_flight:
                return await ledger.reverse_confirmed(  # its job is written before it is called done
                    intent, within_s=CALL_LIMIT_S, reverses=reverses_at(kind, stop_at)
                )
            done = await ledger.move(
                intent.key, IntentStatus.DONE, expect=frozenset({IntentStatus.EFFECT_UNKNOWN}), detail="confirmed present by lookup"
            )
            return done or intent
        if answer is LookupAnswer.ABSENT:
            if policy.retry_absent and policy.new_effects:  # a stop may have come since the caller read the turn
                now_stop = await self.turn_stop(intent.turn_id)
                if now_stop.kind is not None and now_stop.kind != kind:
                    policy = policy_for(now_stop.kind)
            if policy.retry_absent and policy.new_effects:
                try:
                    result = await handler.retry_effect(intent.key, intent.args)
                except asyncio.CancelledError:
                    raise
                except EffectNotApplied as exc:
                    return await ledger.move(intent.key, IntentStatus.ABANDONED, expect=OPEN, detail=f"retry refused: {exc}") or intent
                except Exception as exc:
                    return await ledger.retry_later(intent, f"retry failed: {type(exc).__name__}: {exc}")
                # recorded as the call's own answer, judged by the turn's stop
                # as it is now: a stop that called the row "not done" while
                # the retry was on its way has it reversed, never left standing
                await ledger.settle_late(
                    intent.key, IntentStatus.DONE, detail="confirmed absent, retried with the same key",
                    result=str(result), done_at=ledger.clock.now(),
                )
                cur: Intent = await ledger._call(lambda: ledger.store.ledger_get(intent.key))
                return cur
            given_up = await ledger.move(  # only the row looked up: one claimed meanwhile is its claimer's
                intent.key, IntentStatus.ABANDONED, expect=OPEN, version=intent.version,
                detail="confirmed absent; the policy allows no retry",
            )
            return given_up or intent
        return await ledger.retry_later(intent, "the external system could not say")

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
