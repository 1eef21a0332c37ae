"""Reversing side effects (DESIGN.md "side effect", "reconciliation"): the
compensation job of an effect, its attempts, and the lookup that decides
whether an effect in flight at a stop is reversed at all.

What a stop reverses is the policy's (:mod:`turn.stop_policy`); how it is
recorded is this module's rule: only the calls to the external system are
bounded in time, never the writes that record their answers, and the writes
come in an order in which a crash or a cancellation between any two leaves
a row due again or a job to rerun (compensations are idempotent by key),
never an effect recorded ``done`` that the external system has reversed or
that nobody will reverse. A row is claimed before an attempt (a
compare-and-set that also makes it not due for a while), so of several
callers, stops and reconciliation workers on several instances, one
attempts it at a time.

Mixed into :class:`turn.ledger.Ledger`, whose store, clock, handlers and
record writes (``move``, ``_audit``, ``retry_later``, ``give_up``) it uses.
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, Protocol

from clock import Clock, timeout_after
from turn.intents import OPEN, Intent, IntentKind, IntentStatus, LookupAnswer, compensation_key
from turn.log_content import error_text
from turn.stop_policy import Reverses
from turn.store import TurnStore

log = logging.getLogger(__name__)


class EffectHandler(Protocol):
    """What the ledger needs of a tool (``voice.tools.Tool`` is one)."""

    @property
    def name(self) -> str:
        """The tool's name."""
        ...

    @property
    def effect(self) -> str:
        """Its kind of side effect (``voice.tools.Effect``)."""
        ...

    async def compensate_effect(self, key: str, args: dict[str, Any]) -> bool | None:
        """Undo the effect of ``key`` (idempotent; a no-op if it never
        happened). Returns False if the external system says ``key`` was
        never applied (nothing was reversed: the effect is then recorded
        abandoned, "not done"); True or None if it was reversed (now or
        before). Raises on failure (the compensation is retried)."""
        ...

    async def lookup_effect(self, key: str) -> LookupAnswer:
        """Ask the external system whether ``key`` was applied (UNKNOWN if
        it cannot say). May raise: taken as UNKNOWN."""
        ...

    async def retry_effect(self, key: str, args: dict[str, Any]) -> Any:
        """Apply the effect again with the same key (the system dedupes)."""
        ...


#: how long a stop's calls to the external system for one effect's
#: reversal (its lookup, if it was in flight, and its compensation) may take
#: before the terminal write, s; a slower one goes on as a durable job and
#: the turn is RECONCILE_REQUIRED (a voice barge-in's new turn is recorded
#: after the old turn's stop, so this bounds how much a slow external system
#: can delay it). The writes that record the answers are not bounded by it.
COMPENSATE_NOW_S = 0.5
#: the longest a compensation call of the reconciliation worker may take
#: before it is retried later, s (calls are idempotent by key)
CALL_LIMIT_S = 10.0
#: how much longer than its call's bound an attempt holds its row (not due
#: for anyone else), s: room for the writes that record the answer
CLAIM_MARGIN_S = 2.0


class Reversals:
    """The reversal half of :class:`turn.ledger.Ledger` (see the module doc)."""

    store: TurnStore
    clock: Clock
    handlers: Callable[[str], EffectHandler | None]
    _call: Callable[[Callable[[], Awaitable[Any]]], Awaitable[Any]]
    move: Callable[..., Awaitable[Intent | None]]
    _audit: Callable[[str, str, str], Awaitable[None]]
    retry_later: Callable[[Intent, str], Awaitable[Intent]]
    give_up: Callable[[Intent, str], Awaitable[Intent]]

    async def reverse_in_flight(self, effect: Intent, reverses: Reverses = lambda _row: True) -> Intent:
        """Reverse an effect that was in flight at a stop and never confirmed
        done (effect_unknown, as just written), recording what the external
        system confirms: its key is looked up first; absent, it is abandoned
        ("not done"), with no compensation; present, it is done, then
        compensated (:meth:`reverse_confirmed`); unknown, its compensation
        runs anyway (it says itself whether it reversed anything). A row
        that its call's own answer settled done meanwhile is reversed only
        if ``reverses(row)`` (the stop's policy, for the stage its answer
        time gives it). The lookup and the compensation's call share
        ``COMPENSATE_NOW_S``; what does not fit goes on as a durable job.
        Returns the effect's row afterwards.

        Raises:
            turn.store.StoreUnavailable: the store stays unreachable after
                the ledger's retries (what was written stays; what was not
                is left to the reconciliation worker, whose rows fall due).
        """
        start = self.clock.monotonic()
        limit = timeout_after(self.clock, COMPENSATE_NOW_S)
        try:
            async with limit:
                answer = await self._ask(effect)
        except TimeoutError:
            if not limit.expired:
                raise
            await self._audit(effect.key, "lookup", "no answer in time; its compensation is left to a job")
            await self.compensate(effect, now=False)
            return effect
        await self._audit(effect.key, "lookup", answer.value)
        left = COMPENSATE_NOW_S - (self.clock.monotonic() - start)
        if answer is LookupAnswer.PRESENT:
            return await self.reverse_confirmed(effect, within_s=left, reverses=reverses)
        if answer is LookupAnswer.ABSENT:  # only from the row looked up: one claimed meanwhile is the claimer's
            moved = await self.move(
                effect.key, IntentStatus.ABANDONED, expect=frozenset({IntentStatus.EFFECT_UNKNOWN}), version=effect.version,
                detail="not done: confirmed absent by lookup",
            )
            return moved or await self._call(lambda: self.store.ledger_get(effect.key))
        cur: Intent = await self._call(lambda: self.store.ledger_get(effect.key))
        if cur.status is IntentStatus.EFFECT_UNKNOWN or (cur.status is IntentStatus.DONE and reverses(cur)):
            await self.compensate(cur, now=left > 0, within_s=left, reverses=reverses)
            cur = await self._call(lambda: self.store.ledger_get(effect.key))
        return cur

    async def reverse_confirmed(
        self, effect: Intent, *, within_s: float = COMPENSATE_NOW_S, reverses: Reverses | None = None
    ) -> Intent:
        """``effect``, effect_unknown as read by the caller, was found
        present by lookup and the policy reverses effects in flight.

        First the row is claimed (a compare-and-set on the version read,
        which also makes it not due for a while), so of several callers
        (a stop, reconciliation workers on several instances) one goes on.
        Then its compensation job is written, then the effect is recorded
        done ("confirmed present by lookup"), then the job is tried now, its
        call bounded by ``within_s`` s (0 or less: left to the
        reconciliation worker). In this order a crash or a cancellation at
        any point leaves the row due again or a reversal to run, never a
        done effect that nobody reverses.

        A row that changed since it was read is left to whoever changed it,
        unless its call's own late answer made it done and ``reverses(row)``
        says the policy reverses it at that stage (None: it does not). A
        job this call wrote for a row settled elsewhere is abandoned
        unrun. Returns the effect's row afterwards.

        Raises:
            turn.store.StoreUnavailable: the store stays unreachable after
                the ledger's retries (what was written stays; what was not
                is left to the reconciliation worker, whose rows fall due).
        """
        hold = max(within_s, 0.0)
        claimed = await self._claim(effect, hold)
        cur: Intent = claimed or await self._call(lambda: self.store.ledger_get(effect.key))
        if claimed is None and not _late_done_to_reverse(cur, reverses):
            return cur
        job, created = await self._compensation_job(effect, held_s=hold)
        if cur.status is IntentStatus.EFFECT_UNKNOWN:
            moved = await self.move(
                effect.key, IntentStatus.DONE, expect=frozenset({IntentStatus.EFFECT_UNKNOWN}), detail="confirmed present by lookup"
            )
            cur = moved or await self._call(lambda: self.store.ledger_get(effect.key))
            if moved is None and not _late_done_to_reverse(cur, reverses):
                if created:
                    await self.move(job.key, IntentStatus.ABANDONED, expect=OPEN, detail=f"not run: its effect became {cur.status.value}")
                return cur
        if within_s > 0 and job.status in OPEN and (created or not self._held(job)):
            await self.run_compensation(job, within_s=within_s, reverses=reverses)
        cur = await self._call(lambda: self.store.ledger_get(effect.key))
        return cur

    async def _ask(self, intent: Intent) -> LookupAnswer:
        """The external system's answer about ``intent``'s key (UNKNOWN if
        there is no handler or the lookup fails); raises only
        CancelledError."""
        handler = self.handlers(intent.tool)
        if handler is None:
            return LookupAnswer.UNKNOWN
        try:
            return LookupAnswer(await handler.lookup_effect(intent.key))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("lookup of %s failed: %s", intent.key, error_text(exc))
            return LookupAnswer.UNKNOWN

    async def lookup(self, intent: Intent) -> LookupAnswer:
        """Ask the external system about ``intent``'s key (:meth:`_ask`) and
        leave an audit row of the answer.

        Raises:
            turn.store.StoreUnavailable: the store stays unreachable after
                the ledger's retries (what was written stays; what was not
                is left to the reconciliation worker, whose rows fall due).
        """
        answer = await self._ask(intent)
        await self._audit(intent.key, "lookup", answer.value)
        return answer

    async def compensate(
        self, effect: Intent, *, now: bool, within_s: float = COMPENSATE_NOW_S, reverses: Reverses | None = None
    ) -> Intent:
        """Create (once) the durable compensation job of ``effect``; with
        ``now``, try it at once, its call bounded by ``within_s`` s (a
        slower one is retried later), unless another caller wrote the job
        and holds it; ``reverses`` as :meth:`run_compensation`. Returns the
        job.

        Raises:
            turn.store.StoreUnavailable: the store stays unreachable after
                the ledger's retries (what was written stays; what was not
                is left to the reconciliation worker, whose rows fall due).
        """
        job, created = await self._compensation_job(effect, held_s=within_s if now else None)
        if now and job.status in OPEN and (created or not self._held(job)):
            job = await self.run_compensation(job, within_s=within_s, reverses=reverses)
        return job

    def _held(self, row: Intent) -> bool:
        """``row`` is not due yet: some caller holds it for an attempt (or its backoff runs)."""
        return row.next_attempt_at is not None and row.next_attempt_at > self.clock.now()

    async def _claim(self, row: Intent, hold_s: float) -> Intent | None:
        """Compare-and-set ``row``, as it was read, to itself with
        ``next_attempt_at`` ``hold_s`` + ``CLAIM_MARGIN_S`` s from now: of
        several callers that read it alike, one wins, and the reconciliation
        worker leaves it alone meanwhile (a lease on its next attempt).
        None if it changed since it was read."""
        now = self.clock.now()
        held = now + timedelta(seconds=hold_s + CLAIM_MARGIN_S)
        new = row.model_copy(update={"version": row.version + 1, "updated_at": now, "next_attempt_at": held})
        return new if await self._call(functools.partial(self.store.ledger_replace, new)) else None

    async def _compensation_job(self, effect: Intent, *, held_s: float | None) -> tuple[Intent, bool]:
        """Write (once, by key) the compensation job of ``effect``; one about
        to be tried at once is held (not due) for ``held_s`` +
        ``CLAIM_MARGIN_S`` s. Returns the job and whether this call wrote it."""
        at = self.clock.now()
        job = Intent(
            key=compensation_key(effect.key), turn_id=effect.turn_id, step=effect.step, tool=effect.tool,
            args=effect.args, effect=effect.effect, kind=IntentKind.COMPENSATION, created_at=at, updated_at=at,
            next_attempt_at=at + timedelta(seconds=held_s + CLAIM_MARGIN_S) if held_s is not None else None,
        )
        job, created = await self._call(lambda: self.store.ledger_add(job))
        if created:
            await self._audit(job.key, "intent", f"compensate {effect.key}")
        return job, created

    async def run_compensation(
        self, job: Intent, *, within_s: float | None = None, reverses: Reverses | None = None
    ) -> Intent:
        """One attempt of a compensation job, as read by the caller: on
        success the job is done and its effect compensated, or abandoned
        ("not done") if the external system says there was nothing to
        reverse; on failure, or when its call takes more than ``within_s``
        s (None: ``CALL_LIMIT_S``), it is retried with backoff, and after
        ``MAX_ATTEMPTS`` a person must decide (it never disappears).

        The job is claimed right before its call (:meth:`_claim`), so its
        hold counts from the call; one that changed since it was read is
        another caller's, and left alone. Only the external call is
        bounded, never the records of its answer: the effect is recorded
        before the job is closed, so an interruption between the two leaves
        the job open, and its rerun (idempotent by key) records the effect
        again. An effect whose own answer landed while nothing was found to
        reverse keeps its job open for a next attempt (:meth:`_found_nothing`).

        ``reverses`` is the stop's policy for the stage of the effect's row
        (:meth:`turn.stop_policy.TurnStop.reverses`; None: not known). When
        the effect's own answer recorded it done at a stage the policy keeps
        (stamped before the stop, it landed after the job was written: a
        barge-in keeps an order placed before it), a job never tried is
        abandoned unrun; one whose earlier attempts failed may have reversed
        it, so a person must decide (never a guess either way). One a
        lookup confirmed after the stop runs.
        Returns the job as stored afterwards.

        Raises:
            turn.store.StoreUnavailable: the store stays unreachable after
                the ledger's retries (what was written stays; what was not
                is left to the reconciliation worker, whose rows fall due).
        """
        bound = CALL_LIMIT_S if within_s is None else within_s
        handler = self.handlers(job.tool)
        effect_k = job.key.removesuffix(":compensate")
        if handler is None:
            return await self.give_up(job, f"no tool {job.tool!r} here to compensate with")
        claimed = await self._claim(job, bound)
        if claimed is None:
            cur: Intent = await self._call(lambda: self.store.ledger_get(job.key))
            return cur
        tried, job = job.version > 1, claimed  # written at version 1; every attempt claims it first
        before: Intent = await self._call(lambda: self.store.ledger_get(effect_k))
        if answered(before) and reverses is not None and not reverses(before):
            if tried:
                return await self.give_up(job, "its effect was done before the stop, whose policy keeps it, "
                                               "but an earlier attempt may have reversed it")
            kept = await self.move(
                job.key, IntentStatus.ABANDONED, expect=OPEN, version=job.version,
                detail="not run: its effect was done before the stop, whose policy keeps it",
            )
            return kept or await self._call(lambda: self.store.ledger_get(job.key))
        limit = timeout_after(self.clock, bound)
        try:
            async with limit:
                reversed_ = await handler.compensate_effect(effect_k, job.args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if isinstance(exc, TimeoutError) and limit.expired:
                return await self.retry_later(job, f"compensation took longer than {bound:.3g} s; retried later")
            return await self.retry_later(job, f"compensation failed: {type(exc).__name__}: {exc}")
        attempts = job.attempts + 1
        if reversed_ is False:  # the external system holds nothing under this key
            return await self._found_nothing(job, before, attempts)
        await self.move(
            effect_k, IntentStatus.COMPENSATED,
            expect=frozenset({IntentStatus.DONE, IntentStatus.EFFECT_UNKNOWN, IntentStatus.PENDING, IntentStatus.ABANDONED}),
            detail=f"reversed by {job.key}",
        )
        return await self.move(job.key, IntentStatus.DONE, expect=OPEN, detail="compensated", attempts=attempts) or job

    async def _found_nothing(self, job: Intent, before: Intent, attempts: int) -> Intent:
        """A compensation call found nothing to reverse: its effect, as read
        before the call (``before``), is recorded abandoned ("not done")
        and the job closed. An effect that changed during the call (its own
        late answer landed) or right after it was recorded abandoned is not
        "not done": the job stays open, or is opened again, for a next
        attempt (claimed and bounded like any other). Returns the job."""
        effect_k = before.key
        moved = await self.move(
            effect_k, IntentStatus.ABANDONED, expect=frozenset({IntentStatus.DONE, IntentStatus.EFFECT_UNKNOWN}),
            version=before.version, detail=f"not done: {job.key} found nothing to reverse",
        )
        if moved is None:
            cur: Intent = await self._call(lambda: self.store.ledger_get(effect_k))
            if cur.status in (IntentStatus.DONE, IntentStatus.EFFECT_UNKNOWN):
                return await self.retry_later(job, "its effect changed while the compensation looked; looked at again")
        closed = await self.move(job.key, IntentStatus.DONE, expect=OPEN, detail="nothing to reverse", attempts=attempts) or job
        cur = await self._call(lambda: self.store.ledger_get(effect_k))
        if cur.status is IntentStatus.DONE and closed.status is IntentStatus.DONE:  # it landed once it was called not done
            again = await self.move(
                job.key, IntentStatus.RETRYING, expect=frozenset({IntentStatus.DONE}), next_attempt_at=self.clock.now(),
                detail="its effect landed after it found nothing; reversing it next",
            )
            return again or closed
        return closed

    async def _reverse_late(self, cur: Intent) -> Intent | None:
        """``cur`` is done (or was compensated) but its effect landed after
        its compensation had run: reverse it again (compensations are
        idempotent by key). Returns the row if it moved."""
        key = cur.key
        await self._audit(key, "late_effect", "the effect landed after its compensation; reversing it again")
        handler = self.handlers(cur.tool)
        if handler is None:
            return None
        try:
            reversed_ = await handler.compensate_effect(key, cur.args)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            return await self.move(
                key, IntentStatus.HUMAN_REQUIRED, expect=frozenset({cur.status}), version=cur.version,
                detail=f"late effect could not be reversed: {exc}", error=str(exc),
            )
        if reversed_ is False:
            return None
        return await self.move(
            key, IntentStatus.COMPENSATED, expect=frozenset({IntentStatus.DONE}), detail="the late effect was reversed again"
        )


def answered(row: Intent) -> bool:
    """``row`` is done by its call's own answer, which carries the call's
    result and its time (``done_at``), not by a lookup after a stop (no
    result; ``done_at`` is when the lookup confirmed it)."""
    return row.status is IntentStatus.DONE and row.result is not None


def _late_done_to_reverse(cur: Intent, reverses: Reverses | None) -> bool:
    """A row changed by someone else since it was read is still this
    caller's to reverse only if its call's late answer made it done and the
    policy reverses it at that stage."""
    return cur.status is IntentStatus.DONE and reverses is not None and reverses(cur)
