"""The side-effect ledger (DESIGN.md "side effect", "reconciliation").

Every external write a tool makes is an :class:`Intent` written *before* the
write, keyed by an idempotency key (the turn id plus the step index), that
then becomes ``done``, ``compensated``, ``abandoned`` or ``effect_unknown``
(and, for an unknown outcome nobody could settle, ``human_required``). A
compensation is a durable :class:`Intent` of its own (kind
``compensation``, its own idempotency key) that is retried with backoff
until it succeeds or a human must look; every attempt leaves an
:class:`AuditRow`.

What a stop does with each intent depends on the tool's declared effect and
on the stop's reason (:func:`policy_for`):

- ``none``: abandoned (safe to drop: reads, searches);
- ``complete``: finished, in a short shielded must-complete section;
- ``compensate``: reversed by its compensation job (when the policy says
  so), also when the call was cut off mid-flight: compensations are
  idempotent by key and undo nothing that did not happen;
- a write that was sent but whose outcome is unknown: ``effect_unknown``,
  for the reconciliation worker, which asks the external system by key
  (``lookup``) and never retries blindly.

A turn whose stop leaves no effect behind after the stop request is
CANCELLED; one with an effect confirmed after the stop request, or still
unresolved, is RECONCILE_REQUIRED (:func:`effect_remains`).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from datetime import datetime, timedelta
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Protocol

from pydantic import BaseModel, ConfigDict, Field

from turn.clock import timeout_after
from turn.models import StopReasonKind


class IntentStatus(StrEnum):
    """Where an intent (or a compensation job) stands."""

    #: written before the external call; the call may be running
    PENDING = "pending"
    #: the effect happened (confirmed by the call's answer or a lookup)
    DONE = "done"
    #: the effect was reversed by its compensation
    COMPENSATED = "compensated"
    #: never sent, or safe to drop (effect "none")
    ABANDONED = "abandoned"
    #: sent, outcome not known: reconciliation asks the external system
    EFFECT_UNKNOWN = "effect_unknown"
    #: a compensation job waiting for (another) attempt
    RETRYING = "retrying"
    #: reconciliation or compensation gave up: a person must decide
    HUMAN_REQUIRED = "human_required"


#: statuses that need no more work
RESOLVED = frozenset({IntentStatus.DONE, IntentStatus.COMPENSATED, IntentStatus.ABANDONED})
#: statuses a worker must still act on
OPEN = frozenset({IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.RETRYING})


class IntentKind(StrEnum):
    """A tool's effect, or a compensation of one."""

    EFFECT = "effect"
    COMPENSATION = "compensation"


class Intent(BaseModel):
    """One row of the ledger.

    Attributes:
        key: the idempotency key: ``"<turn_id>:<step>"`` for an effect,
            ``"<effect key>:compensate"`` for its compensation. The external
            system receives it and must apply each key at most once.
        turn_id: the turn.
        step: the step index within the turn (1, 2, ...).
        tool: the tool's name.
        args: the tool's arguments.
        effect: the tool's declared effect ("none", "complete", "compensate").
        kind: effect or compensation.
        status: see :class:`IntentStatus`.
        result: the call's answer (text), once done.
        error: the last error, for humans.
        attempts: calls or lookups made so far (compensation and
            reconciliation count their attempts here).
        next_attempt_at: when a worker should try again (UTC).
        created_at / updated_at / done_at: UTC; ``done_at`` is when the
            effect was confirmed.
        version: bumped by every change (compare-and-set).
    """

    model_config = ConfigDict(frozen=True)

    key: str
    turn_id: str
    step: int
    tool: str
    args: dict[str, Any] = Field(default_factory=dict)
    effect: str = "none"
    kind: IntentKind = IntentKind.EFFECT
    status: IntentStatus = IntentStatus.PENDING
    result: str | None = None
    error: str | None = None
    attempts: int = 0
    next_attempt_at: datetime | None = None
    created_at: datetime
    updated_at: datetime
    done_at: datetime | None = None
    version: int = 1


class AuditRow(BaseModel):
    """One thing done to an intent (an attempt, an answer, a decision).

    Attributes:
        key: the intent's key.
        at: when (UTC).
        action: e.g. "intent", "done", "compensate", "lookup", "retry".
        detail: what happened, for humans.
    """

    model_config = ConfigDict(frozen=True)

    key: str
    at: datetime
    action: str
    detail: str = ""


class LookupAnswer(StrEnum):
    """What the external system says about an idempotency key."""

    PRESENT = "present"
    ABSENT = "absent"
    UNKNOWN = "unknown"


class EffectPolicy(BaseModel):
    """What a stop of a given reason does with a turn's effects.

    Attributes:
        compensate: reverse the turn's compensable effects.
        retry_absent: an effect_unknown found absent may be retried (with
            the same key).
        new_effects: effects may still be started (a retry is one).
    """

    model_config = ConfigDict(frozen=True)

    compensate: bool
    retry_absent: bool
    new_effects: bool = True


#: The policy per stop reason. A user who cancels (or barges in) wants what
#: the turn did undone and nothing retried; a worker that shut down was not
#: asked to stop, so an effect found absent is retried and kept; a safety
#: abort reverses what it can and starts nothing new; a turn that hit its
#: own limits is abandoned like a cancel; a dropped call keeps what was done
#: but retries nothing (the user cannot be told).
POLICIES: dict[StopReasonKind | None, EffectPolicy] = {
    StopReasonKind.USER_CANCEL: EffectPolicy(compensate=True, retry_absent=False),
    StopReasonKind.BARGE_IN: EffectPolicy(compensate=True, retry_absent=False),
    StopReasonKind.SAFETY_ABORT: EffectPolicy(compensate=True, retry_absent=False, new_effects=False),
    StopReasonKind.WORKER_SHUTDOWN: EffectPolicy(compensate=False, retry_absent=True),
    StopReasonKind.TRANSPORT_DISCONNECTED: EffectPolicy(compensate=False, retry_absent=False),
    StopReasonKind.DEADLINE_EXCEEDED: EffectPolicy(compensate=True, retry_absent=False),
    StopReasonKind.BUDGET_EXCEEDED: EffectPolicy(compensate=True, retry_absent=False),
    StopReasonKind.MAX_STEPS: EffectPolicy(compensate=True, retry_absent=False),
    StopReasonKind.LOOP_DETECTED: EffectPolicy(compensate=True, retry_absent=False),
    #: no stop: the turn completed or failed on an error; keep what was done
    None: EffectPolicy(compensate=False, retry_absent=True),
}


def policy_for(kind: StopReasonKind | None) -> EffectPolicy:
    """The :class:`EffectPolicy` for a stop of ``kind`` (None: no stop)."""
    return POLICIES[kind]


def effect_key(turn_id: str, step: int) -> str:
    """The idempotency key of a turn's step: ``"<turn_id>:<step>"``."""
    return f"{turn_id}:{step}"


def compensation_key(key: str) -> str:
    """The compensation job's own idempotency key."""
    return f"{key}:compensate"


def effect_remains(intents: list[Intent], stop_at: datetime, policy: EffectPolicy) -> bool:
    """True if the ledger shows an external effect that stays after the stop
    requested at ``stop_at``: one confirmed after it, one the policy wanted
    reversed whose compensation has not succeeded (yet), or one still
    unresolved (pending, effect_unknown, or one a person must settle). The
    turn is then RECONCILE_REQUIRED, never CANCELLED (DESIGN.md)."""
    for i in intents:
        if i.kind is not IntentKind.EFFECT or i.effect == "none":
            continue
        if i.status in (IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.HUMAN_REQUIRED):
            return True
        if i.status is IntentStatus.DONE:
            if i.done_at is not None and i.done_at > stop_at:
                return True
            if i.effect == "compensate" and policy.compensate:
                return True  # its compensation has not succeeded (yet)
    return False


# -- the ledger service ----------------------------------------------------------


if TYPE_CHECKING:
    from turn.clock import Clock
    from turn.store import TurnStore

log = logging.getLogger(__name__)

#: attempts of a lookup or compensation before a person must decide
MAX_ATTEMPTS = 6
#: first retry delay of a lookup or compensation, s (doubling, at most BACKOFF_MAX_S)
BACKOFF_S = 1.0
BACKOFF_MAX_S = 300.0
#: how long a stop may spend on one compensation before the terminal write,
#: s; a slower one goes on as a durable job and the turn is RECONCILE_REQUIRED
#: (a voice barge-in's new turn is recorded after the old turn's stop, so
#: this bounds how much a slow external system can delay it)
COMPENSATE_NOW_S = 0.5


class EffectNotApplied(Exception):
    """Raised by a tool (or its external system) when it knows for certain
    that its effect did not happen (e.g. a validation error answered before
    any write). The intent is then abandoned, not effect_unknown."""


class EffectHandler(Protocol):
    """What the ledger needs of a tool (``voice.tools.Tool`` is one)."""

    name: str
    effect: str

    async def compensate_effect(self, key: str, args: dict[str, Any]) -> None:
        """Undo the effect of ``key`` (idempotent; a no-op if it never
        happened). Raises on failure."""
        ...

    async def lookup_effect(self, key: str) -> LookupAnswer:
        """Ask the external system whether ``key`` was applied."""
        ...

    async def retry_effect(self, key: str, args: dict[str, Any]) -> Any:
        """Apply the effect again with the same key (the system dedupes)."""
        ...


#: (turn_id, event type, payload) -> None or an awaitable (awaited)
LedgerEvents = Callable[[str, str, dict[str, Any]], Awaitable[None] | None]


def backoff_s(attempts: int) -> float:
    """Delay before attempt ``attempts + 1``, s: BACKOFF_S doubling, capped."""
    return min(BACKOFF_MAX_S, BACKOFF_S * (2 ** max(0, attempts - 1)))


class Ledger:
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
    """

    def __init__(
        self,
        store: TurnStore,
        clock: Clock,
        *,
        handlers: Callable[[str], EffectHandler | None] | None = None,
        emit: LedgerEvents | None = None,
        store_call: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]] | None = None,
    ) -> None:
        self.store = store
        self.clock = clock
        self.handlers = handlers or (lambda _name: None)
        self.emit: LedgerEvents = emit or (lambda _t, _e, _p: None)
        self._call = store_call or (lambda fn: fn())

    async def _tell(self, turn_id: str, type: str, payload: dict[str, Any]) -> None:
        try:
            res = self.emit(turn_id, type, payload)
            if res is not None:
                await res
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("could not tell the session about %s", type)

    async def _audit(self, key: str, action: str, detail: str = "") -> None:
        await self._call(lambda: self.store.audit_add(AuditRow(key=key, at=self.clock.now(), action=action, detail=detail)))

    async def intent(self, turn_id: str, step: int, tool: str, args: dict[str, Any], effect: str) -> Intent:
        """Write the intent of step ``step`` before its call (status
        pending). A repeat of the same step returns the stored row."""
        now = self.clock.now()
        intent = Intent(
            key=effect_key(turn_id, step), turn_id=turn_id, step=step, tool=tool, args=args, effect=effect,
            created_at=now, updated_at=now,
        )
        stored, created = await self._call(lambda: self.store.ledger_add(intent))
        if created:
            await self._audit(stored.key, "intent", f"{tool} {json_args(args)}")
            await self._tell(turn_id, "tool.intent", _payload(stored))
        return stored

    async def move(
        self,
        key: str,
        status: IntentStatus,
        *,
        expect: frozenset[IntentStatus] | None = None,
        detail: str = "",
        **fields: Any,
    ) -> Intent | None:
        """Compare-and-set a row to ``status`` (from one of ``expect``, any
        if None), with ``fields``; writes an audit row and tells the
        session. Returns the new row, or None if its status was not one of
        ``expect``."""
        while True:
            cur: Intent = await self._call(lambda: self.store.ledger_get(key))
            if expect is not None and cur.status not in expect:
                return None
            now = self.clock.now()
            update: dict[str, Any] = {"status": status, "updated_at": now, "version": cur.version + 1, **fields}
            if status is IntentStatus.DONE and cur.kind is IntentKind.EFFECT and "done_at" not in fields:
                update["done_at"] = now
            new = cur.model_copy(update=update)
            if await self._call(lambda: self.store.ledger_replace(new)):
                await self._audit(key, status.value, detail)
                if new.kind is IntentKind.EFFECT:
                    await self._tell(new.turn_id, f"tool.{status.value}", _payload(new))
                return new

    async def settle_late(self, key: str, status: IntentStatus, **fields: Any) -> Intent | None:
        """The call itself answered (``status``, normally DONE): its answer
        is authoritative, also when it came after a stop's resolution or a
        reconciliation had already called the row effect_unknown or
        abandoned. An effect that landed after its compensation had run is
        reversed again (compensations are idempotent by key)."""
        moved = await self.move(
            key, status,
            expect=frozenset({IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.ABANDONED}),
            detail="answered" if status is IntentStatus.DONE else "the call answered late", **fields,
        )
        if moved is not None or status is not IntentStatus.DONE:
            return moved
        cur: Intent = await self._call(lambda: self.store.ledger_get(key))
        if cur.status is IntentStatus.COMPENSATED:
            handler = self.handlers(cur.tool)
            await self._audit(key, "late_effect", "the effect landed after its compensation; reversing it again")
            if handler is not None:
                try:
                    await handler.compensate_effect(key, cur.args)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    await self.move(key, IntentStatus.HUMAN_REQUIRED, detail=f"late effect could not be reversed: {exc}", error=str(exc))
        return None

    # -- a stop --------------------------------------------------------------------

    async def resolve_on_stop(
        self, turn_id: str, kind: StopReasonKind | None, stop_at: datetime, *, work_running: bool = False
    ) -> bool:
        """Resolve every intent of a stopped turn whose work has ended:
        a pending one becomes abandoned (effect "none") or effect_unknown;
        what the policy wants reversed gets a durable compensation job,
        tried once now (bounded by ``COMPENSATE_NOW_S``); the rest waits for
        the reconciliation worker. A failing compensation never blocks:
        its job stays, retried with backoff.

        Args:
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
                    intent = await self.move(intent.key, IntentStatus.ABANDONED, expect=frozenset({IntentStatus.PENDING}), detail="stopped before it answered") or intent
                else:
                    intent = await self.move(intent.key, IntentStatus.EFFECT_UNKNOWN, expect=frozenset({IntentStatus.PENDING}), detail="stopped mid-call: it may have been applied") or intent
            if intent.effect == "compensate" and policy.compensate and intent.status in (IntentStatus.DONE, IntentStatus.EFFECT_UNKNOWN):
                await self.compensate(intent, now=True)
        intents = await self._call(lambda: self.store.ledger_list(turn_id))
        return effect_remains(intents, stop_at, policy)

    async def compensate(self, effect: Intent, *, now: bool) -> Intent:
        """Create (once) the durable compensation job of ``effect``; with
        ``now``, try it at once. Returns the job."""
        at = self.clock.now()
        job = Intent(
            key=compensation_key(effect.key), turn_id=effect.turn_id, step=effect.step, tool=effect.tool,
            args=effect.args, effect=effect.effect, kind=IntentKind.COMPENSATION, created_at=at, updated_at=at,
        )
        job, created = await self._call(lambda: self.store.ledger_add(job))
        if created:
            await self._audit(job.key, "intent", f"compensate {effect.key}")
        if now and job.status in OPEN:
            limit = timeout_after(self.clock, COMPENSATE_NOW_S)
            try:
                async with limit:
                    job = await self.run_compensation(job)
            except TimeoutError:
                if not limit.expired:
                    raise
                job = await self._retry_later(job, "compensation took too long; retried later")
        return job

    async def run_compensation(self, job: Intent) -> Intent:
        """One attempt of a compensation job: on success the job is done and
        its effect compensated; on failure it is retried with backoff, and
        after ``MAX_ATTEMPTS`` a person must decide (it never disappears)."""
        handler = self.handlers(job.tool)
        effect_k = job.key.removesuffix(":compensate")
        if handler is None:
            return await self._give_up(job, f"no tool {job.tool!r} here to compensate with")
        try:
            await handler.compensate_effect(effect_k, job.args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return await self._retry_later(job, f"compensation failed: {type(exc).__name__}: {exc}")
        done = await self.move(job.key, IntentStatus.DONE, expect=OPEN, detail="compensated", attempts=job.attempts + 1) or job
        await self.move(
            effect_k, IntentStatus.COMPENSATED,
            expect=frozenset({IntentStatus.DONE, IntentStatus.EFFECT_UNKNOWN, IntentStatus.PENDING}),
            detail=f"reversed by {job.key}",
        )
        return done

    async def _retry_later(self, row: Intent, why: str) -> Intent:
        attempts = row.attempts + 1
        if attempts >= MAX_ATTEMPTS:
            return await self._give_up(row.model_copy(update={"attempts": attempts}), f"{why}; gave up after {attempts} attempts")
        nxt = self.clock.now() + timedelta(seconds=backoff_s(attempts))
        status = IntentStatus.RETRYING if row.kind is IntentKind.COMPENSATION else row.status
        moved = await self.move(row.key, status, expect=OPEN, detail=why, attempts=attempts, next_attempt_at=nxt, error=why)
        return moved or row

    async def _give_up(self, row: Intent, why: str) -> Intent:
        moved = await self.move(row.key, IntentStatus.HUMAN_REQUIRED, expect=OPEN, detail=why, error=why, attempts=row.attempts, next_attempt_at=None)
        if moved is not None and moved.kind is IntentKind.COMPENSATION:
            await self._tell(moved.turn_id, "tool.human_required", _payload(moved))
        return moved or row

    # -- reconciliation ----------------------------------------------------------------

    async def reconcile(self, intent: Intent, kind: StopReasonKind | None) -> Intent:
        """One reconciliation attempt of an effect_unknown intent: ask the
        external system by key (never a blind retry) and act on the answer
        under the policy of the turn's stop reason ``kind``."""
        policy = policy_for(kind)
        handler = self.handlers(intent.tool)
        if handler is None:
            return await self._give_up(intent, f"no tool {intent.tool!r} here to look the effect up")
        try:
            answer = await handler.lookup_effect(intent.key)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            answer = LookupAnswer.UNKNOWN
            log.warning("lookup of %s failed: %s", intent.key, exc)
        await self._audit(intent.key, "lookup", answer.value)
        if answer is LookupAnswer.PRESENT:
            done = await self.move(intent.key, IntentStatus.DONE, expect=frozenset({IntentStatus.EFFECT_UNKNOWN}), detail="confirmed present by lookup")
            if done is not None and done.effect == "compensate" and policy.compensate:
                await self.compensate(done, now=True)
            return done or intent
        if answer is LookupAnswer.ABSENT:
            if policy.retry_absent and policy.new_effects:
                try:
                    result = await handler.retry_effect(intent.key, intent.args)
                except asyncio.CancelledError:
                    raise
                except EffectNotApplied as exc:
                    return await self.move(intent.key, IntentStatus.ABANDONED, expect=OPEN, detail=f"retry refused: {exc}") or intent
                except Exception as exc:
                    return await self._retry_later(intent, f"retry failed: {type(exc).__name__}: {exc}")
                return await self.move(intent.key, IntentStatus.DONE, expect=OPEN, detail="confirmed absent, retried with the same key", result=str(result)) or intent
            return await self.move(intent.key, IntentStatus.ABANDONED, expect=OPEN, detail="confirmed absent; the policy allows no retry") or intent
        return await self._retry_later(intent, "the external system could not say")


def json_args(args: dict[str, Any]) -> str:
    """Arguments as compact JSON, for audit rows."""
    return json.dumps(args, sort_keys=True, default=str)


def _payload(intent: Intent) -> dict[str, Any]:
    return {
        "key": intent.key, "step": intent.step, "name": intent.tool, "arguments": intent.args,
        "effect": intent.effect, "status": intent.status.value, "kind": intent.kind.value,
        "output": intent.result, "error": intent.error,
    }


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
