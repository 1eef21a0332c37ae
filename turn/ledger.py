"""The side-effect ledger (DESIGN.md "side effect", "reconciliation").

Every external write a tool makes is an :class:`Intent` (its rows live in
:mod:`turn.intents`) written *before* the write, keyed by an idempotency
key (the turn id plus the step index), that then becomes ``done``,
``compensated``, ``abandoned`` or ``effect_unknown`` (and, for an unknown
outcome nobody could settle, ``human_required``). A compensation is a
durable :class:`Intent` of its own (kind ``compensation``, its own
idempotency key) that is retried with backoff until it succeeds or a human
must look; every attempt leaves an :class:`AuditRow`.

What a stop does with each intent depends on the stop's reason, the tool's
declared effect and the effect's stage at the stop (:mod:`turn.stop_policy`):

- ``none``: abandoned when cut off (safe to drop: reads, searches);
- ``complete``: finished, in a short shielded must-complete section;
- ``compensate``: reversed by its compensation job when the policy says so
  for its stage. One that was in flight (never confirmed done) is looked up
  by key first: absent, it is abandoned (nothing to reverse); present, it
  is done, then reversed; unknown, the compensation runs anyway, and a
  compensation that finds nothing to reverse leaves it abandoned. The
  ledger records what the external system confirms;
- a write that was sent but whose outcome is unknown: ``effect_unknown``,
  for the reconciliation worker (:mod:`turn.reconciliation`), which asks
  the external system by key (``lookup``) and never retries blindly.

How a reversal is attempted and recorded (claims, compensation jobs, the
lookup of an effect in flight) is :mod:`turn.reversal`'s, mixed in here.

A turn whose stop leaves no effect behind after the stop request is
CANCELLED; one with an effect confirmed after the stop request, or still
unresolved, is RECONCILE_REQUIRED (:func:`effect_remains`).
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from typing import Any

from clock import Clock
from turn.event_catalogue import (
    LedgerEvent,
    ToolAbandoned,
    ToolCompensated,
    ToolDone,
    ToolEffectUnknown,
    ToolHumanRequired,
    ToolIntent,
)
from turn.intents import (
    OPEN,
    AuditRow,
    Intent,
    IntentKind,
    IntentStatus,
    compensation_key,
    effect_key,
)
from turn.models import StopReasonKind
from turn.reversal import COMPENSATE_NOW_S, EffectHandler, Reversals, answered
from turn.stop_policy import TurnStopOf, effect_remains, policy_for
from turn.store import TurnStore

log = logging.getLogger(__name__)

#: attempts of a lookup or compensation before a person must decide
MAX_ATTEMPTS = 6
#: first retry delay of a lookup or compensation, s (doubling, at most BACKOFF_MAX_S)
BACKOFF_S = 1.0
BACKOFF_MAX_S = 300.0


class EffectNotApplied(Exception):
    """Raised by a tool (or its external system) when it knows for certain
    that its effect did not happen (e.g. a validation error answered before
    any write). The intent is then abandoned, not effect_unknown."""


#: (turn_id, the change as its catalogue event) -> None or an awaitable (awaited)
LedgerEvents = Callable[[str, LedgerEvent], Awaitable[None] | None]


#: a row's event by its new status (a status with none, e.g. retrying, tells nothing)
LEDGER_EVENTS: dict[str, type[LedgerEvent]] = {
    "pending": ToolIntent, "done": ToolDone, "compensated": ToolCompensated, "abandoned": ToolAbandoned,
    "effect_unknown": ToolEffectUnknown, "human_required": ToolHumanRequired,
}


def backoff_s(attempts: int) -> float:
    """Delay before attempt ``attempts + 1``, s: BACKOFF_S doubling, capped."""
    return min(BACKOFF_MAX_S, BACKOFF_S * (2 ** max(0, attempts - 1)))


class Ledger(Reversals):
    """Writes and resolves intents (see the module doc).

    Args:
        store: the turn store (it holds the ledger).
        clock: time source for every timestamp and backoff.
        handlers: the tool of a name, for compensations, lookups and retries
            (None if unknown).
        emit: tells the turn's session about ledger changes (events
            ``tool.intent``, ``tool.done``, ``tool.compensated``,
            ``tool.effect_unknown``, ``tool.abandoned``, ``tool.human_required``).
        store_call: wraps each store call (the manager's retrying one).
        turn_stop: the stop in force for a turn (the manager's reads the
            turn): a call's answer that lands after its stop was resolved
            is judged by that stop's policy (:meth:`settle_late`). None:
            such an answer is reversed only if a compensation had run.
    """

    def __init__(
        self,
        store: TurnStore,
        clock: Clock,
        *,
        handlers: Callable[[str], EffectHandler | None] | None = None,
        emit: LedgerEvents | None = None,
        store_call: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]] | None = None,
        turn_stop: TurnStopOf | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.handlers = handlers or (lambda _name: None)
        self.emit: LedgerEvents = emit or (lambda _t, _e: None)
        self._call = store_call or (lambda fn: fn())
        self.turn_stop = turn_stop

    async def _tell(self, turn_id: str, row: Intent) -> None:
        """Tell the turn's session about ``row``'s new status (its catalogue
        event, :data:`LEDGER_EVENTS`); a failure to tell
        is logged, never raised: the ledger row is what counts."""
        model = LEDGER_EVENTS.get(row.status.value)
        if model is None:
            return  # e.g. a compensation job retrying: nothing a client is told
        try:
            res = self.emit(turn_id, model(**_payload(row)))
            if res is not None:
                await res
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("could not tell the session about %s %s", row.key, row.status.value)

    async def _audit(self, key: str, action: str, detail: str = "") -> None:
        await self._call(lambda: self.store.audit_add(AuditRow(key=key, at=self.clock.now(), action=action, detail=detail)))

    async def intent(
        self, turn_id: str, step: int, tool: str, args: dict[str, Any], effect: str, *, key: str | None = None
    ) -> Intent:
        """Write the intent of step ``step`` before its call (status
        pending), under ``key`` (default: the step's :func:`effect_key`; a
        queued item has its own). A repeat of the same key returns the
        stored row."""
        now = self.clock.now()
        intent = Intent(
            key=key or effect_key(turn_id, step), turn_id=turn_id, step=step, tool=tool, args=args, effect=effect,
            created_at=now, updated_at=now,
        )
        stored, created = await self._call(lambda: self.store.ledger_add(intent))
        if created:
            await self._audit(stored.key, "intent", f"{tool} {json_args(args)}")
            await self._tell(turn_id, stored)
        return stored

    async def move(
        self,
        key: str,
        status: IntentStatus,
        *,
        expect: frozenset[IntentStatus] | None = None,
        version: int | None = None,
        detail: str = "",
        **fields: Any,
    ) -> Intent | None:
        """Compare-and-set a row to ``status`` (from one of ``expect``, any
        if None; only from ``version``, the row as the caller read it, if
        given), with ``fields``; writes an audit row and tells the session.
        Returns the new row, or None if its status was not one of
        ``expect`` or it was no longer at ``version``."""
        while True:
            cur: Intent = await self._call(lambda: self.store.ledger_get(key))
            if (expect is not None and cur.status not in expect) or (version is not None and cur.version != version):
                return None
            now = self.clock.now()
            update: dict[str, Any] = {"status": status, "updated_at": now, "version": cur.version + 1, **fields}
            if status is IntentStatus.DONE and cur.kind is IntentKind.EFFECT and "done_at" not in fields:
                update["done_at"] = now
            new = cur.model_copy(update=update)
            if await self._call(functools.partial(self.store.ledger_replace, new)):
                await self._audit(key, status.value, detail)
                if new.kind is IntentKind.EFFECT:
                    await self._tell(new.turn_id, new)
                return new

    async def settle_late(self, key: str, status: IntentStatus, *, detail: str | None = None, **fields: Any) -> Intent | None:
        """The call itself answered (``status``, normally DONE): its answer
        is authoritative, also when it came after a stop's resolution or a
        reconciliation had already called the row effect_unknown or
        abandoned.

        A compensable effect this answer made done (or whose lookup had
        confirmed it done: the answer then records its result and time) is
        judged by its turn's stop (``turn_stop``) at the stage the answer
        gives it (``done_at``): one the stop's policy keeps (done before a
        barge-in) stays done; one it reverses (in flight at the stop) is
        reversed: again if its compensation had already run (one that
        reversed it, or found nothing to reverse yet; compensations are
        idempotent by key), else by its compensation job, written (or
        opened again) now. Once the turn is terminal the job is tried at
        once (its call bounded by ``COMPENSATE_NOW_S``); while it is still
        stopping it is left due, for the stop (which finds the row done) or
        the reconciliation worker: the stop may be waiting for this call's
        task. With no stop to judge by, an effect that landed after its
        compensation had run is reversed again. ``detail`` is the audit
        row's text (default: "answered"). Returns the row if this call
        moved it.

        Raises:
            turn.store.StoreUnavailable: the store stays unreachable (the
                answer may be recorded and its reversal not yet written:
                the reconciliation worker does not see it; a caller logs).
        """
        moved = await self.move(
            key, status,
            expect=frozenset({IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.ABANDONED}),
            detail=detail or ("answered" if status is IntentStatus.DONE else "the call answered late"), **fields,
        )
        if status is not IntentStatus.DONE:
            return moved
        cur: Intent = moved or await self._call(lambda: self.store.ledger_get(key))
        if moved is None and cur.status is IntentStatus.DONE and cur.kind is IntentKind.EFFECT and not answered(cur):
            moved = await self.move(  # a lookup confirmed it: the answer says when it was done
                key, IntentStatus.DONE, expect=frozenset({IntentStatus.DONE}), version=cur.version,
                detail="answered, after a lookup had confirmed it", **fields,
            )
            cur = moved or await self._call(lambda: self.store.ledger_get(key))
        if cur.status is IntentStatus.COMPENSATED:  # it landed after its compensation had reversed nothing yet
            return await self._reverse_late(cur) or moved
        if cur.status is not IntentStatus.DONE or cur.effect != "compensate":
            return moved
        reverses, terminal = None, True
        if moved is not None and self.turn_stop is not None:  # (a row someone else made done is theirs to judge)
            stop = await self.turn_stop(cur.turn_id)
            reverses, terminal = stop.reverses(), stop.terminal
            if reverses is not None and not reverses(cur):
                return moved  # the stop keeps what was answered before it
        rows = await self._call(lambda: self.store.ledger_list(cur.turn_id))
        job = next((r for r in rows if r.key == compensation_key(key)), None)
        if job is not None and job.status is IntentStatus.DONE:
            return await self._reverse_late(cur) or moved
        if reverses is None:
            return moved  # no compensation has run before it landed, and no stop to judge it by
        await self._audit(key, "late_effect", "its answer landed after its stop was resolved; the stop's policy reverses it")
        # a turn still stopping: its stop (or the worker) runs the job, never
        # this call's task, which the stop is waiting for
        if job is not None and job.status is IntentStatus.ABANDONED:  # written, then left unrun: open it again
            job = await self.move(
                job.key, IntentStatus.RETRYING, expect=frozenset({IntentStatus.ABANDONED}), version=job.version,
                next_attempt_at=self.clock.now(), detail="its effect landed after the stop; reversing it",
            )
            if job is not None and terminal:
                await self.run_compensation(job, within_s=COMPENSATE_NOW_S, reverses=reverses)
        elif job is None or job.status in OPEN:
            await self.compensate(cur, now=terminal, reverses=reverses)
        return moved

    # -- a stop --------------------------------------------------------------------

    async def resolve_on_stop(
        self, turn_id: str, kind: StopReasonKind | None, stop_at: datetime, *, work_running: bool = False
    ) -> bool:
        """Resolve every intent of a stopped turn whose work has ended:
        a pending one becomes abandoned (effect "none") or effect_unknown;
        what the policy wants reversed for its stage
        (:meth:`EffectPolicy.compensates`) gets a durable compensation job,
        tried once now (bounded by ``COMPENSATE_NOW_S``), after a lookup if
        it was never confirmed done (:meth:`reverse_in_flight`); the rest
        waits for the reconciliation worker. A failing compensation never
        blocks: its job stays, retried with backoff.

        Args:
            kind: the stop's reason (None: no stop).
            stop_at: the stop request's time (UTC): an effect confirmed at
                or before it was done before the stop.
            work_running: some of the turn's work is still running (a
                must-complete section, or a child that ignored its
                cancellation): its pending intents are left to it (and to
                the reconciliation worker), and the turn needs
                reconciliation.

        Returns:
            Whether an effect remains after the stop (RECONCILE_REQUIRED).
        """
        policy = policy_for(kind)
        for intent in await self._call(lambda: self.store.ledger_list(turn_id)):
            if intent.kind is not IntentKind.EFFECT:
                continue
            if intent.status is IntentStatus.PENDING and not work_running:
                if intent.effect == "none":
                    intent = await self.move(
                        intent.key, IntentStatus.ABANDONED, expect=frozenset({IntentStatus.PENDING}), detail="stopped before it answered"
                    ) or intent
                else:
                    intent = await self.move(
                        intent.key, IntentStatus.EFFECT_UNKNOWN, expect=frozenset({IntentStatus.PENDING}),
                        detail="stopped mid-call: it may have been applied",
                    ) or intent
            if not policy.compensates(intent, stop_at):
                continue
            if intent.status is IntentStatus.DONE:
                await self.compensate(intent, now=True)
            elif intent.status is IntentStatus.EFFECT_UNKNOWN:
                await self.reverse_in_flight(intent, functools.partial(policy.compensates, stop_at=stop_at))
        intents = await self._call(lambda: self.store.ledger_list(turn_id))
        return effect_remains(intents, stop_at, policy)

    async def retry_later(self, row: Intent, why: str) -> Intent:
        """Count a failed attempt of ``row`` (a compensation job, or an
        effect being reconciled) and schedule the next one after
        :func:`backoff_s` (a job becomes ``retrying``); after
        ``MAX_ATTEMPTS`` a person must decide (:meth:`give_up`). Returns the
        row as stored afterwards."""
        attempts = row.attempts + 1
        if attempts >= MAX_ATTEMPTS:
            return await self.give_up(row.model_copy(update={"attempts": attempts}), f"{why}; gave up after {attempts} attempts")
        nxt = self.clock.now() + timedelta(seconds=backoff_s(attempts))
        status = IntentStatus.RETRYING if row.kind is IntentKind.COMPENSATION else row.status
        moved = await self.move(row.key, status, expect=OPEN, detail=why, attempts=attempts, next_attempt_at=nxt, error=why)
        return moved or row

    async def give_up(self, row: Intent, why: str) -> Intent:
        """Move an open ``row`` to ``human_required`` (``why`` recorded as
        its error), telling the session when it is a compensation job.
        Returns the row as stored afterwards."""
        moved = await self.move(
            row.key, IntentStatus.HUMAN_REQUIRED, expect=OPEN, detail=why, error=why, attempts=row.attempts, next_attempt_at=None
        )
        if moved is not None and moved.kind is IntentKind.COMPENSATION:
            await self._tell(moved.turn_id, moved)
        return moved or row


def json_args(args: dict[str, Any]) -> str:
    """Arguments as compact JSON, for audit rows."""
    return json.dumps(args, sort_keys=True, default=str)


def _payload(intent: Intent) -> dict[str, Any]:
    return {
        "key": intent.key, "step": intent.step, "name": intent.tool, "arguments": intent.args,
        "effect": intent.effect, "status": intent.status.value, "kind": intent.kind.value,
        "output": intent.result, "error": intent.error,
    }
