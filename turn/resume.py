"""Releasing a running turn for another worker, and taking a released one
over (a deploy loses no turn).

When an instance drains and a text turn is still running at
``shutdown.turn_wait_s``, the turn is not stopped: its work halts at the
next checkpoint (never inside a must-complete commit), its in-flight
effects are settled by the ``worker_shutdown`` policy (the ledger), its
usage is written, and it goes RUNNING -> QUEUED with no lease owner: it is
*released* (:attr:`turn.models.Turn.released`). Its last checkpoint is what
the store holds: the steps counted, the usage billed (a model call cut off
is recorded, partial, its tokens after the release as waste) and the ledger.

Another instance's sweeper (Redis), or the restarted instance (SQLite),
*adopts* it: QUEUED -> RUNNING is a compare-and-set, so exactly one worker
wins; the winner leases it and runs it again from its ledger (tool steps
done are given to the model as done, never run again; the steps go on
numbered after the recorded ones, so no idempotency key is reused). The
turn keeps its id, generation and event log; its deadline and budget are
the stored ones, what was spent before counting against it.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from clock import Clock
from turn.intents import IntentKind, IntentStatus, effect_key
from turn.ledger import Ledger
from turn.models import StopReasonKind, Turn, TurnStatus
from turn.runtime import TurnRuntime
from turn.states import TransitionResult
from turn.store import TurnStore
from turn.usage import Pricing, UsageMeter

if TYPE_CHECKING:
    from turn.reconciliation import ReconciliationWorker

log = logging.getLogger(__name__)

T = TypeVar("T")


class Resumption:
    """The Turn Manager's part that releases and adopts turns (a mixin of
    :class:`turn.manager.TurnManager`)."""

    store: TurnStore
    clock: Clock
    ledger: Ledger
    owner: str
    _owned: set[str]
    _where: dict[str, tuple[str, int]]
    _runtime: dict[str, TurnRuntime]

    if TYPE_CHECKING:  # the manager's methods this part calls

        async def store_call(self, fn: Callable[[], Awaitable[T]]) -> T: ...

        async def flush(self, turn_id: str, meter: UsageMeter | None = None) -> Turn: ...

        def release(self, turn_id: str) -> None: ...

        def _notify(self, turn: Turn) -> None: ...

        def reconciliation_worker(self, interval_s: float = 1.0) -> ReconciliationWorker: ...

    async def release_for_resume(self, turn_id: str) -> TransitionResult:
        """The worker here halted ``turn_id`` at a checkpoint (a drain):
        write its usage and steps, then RUNNING -> QUEUED with the lease
        given up (see the module doc). Not applied (the result says why)
        if the turn was stopped or ended meanwhile."""
        await self.flush(turn_id)
        res = await self.store_call(lambda: self.store.transition(turn_id, TurnStatus.QUEUED, at=self.clock.now()))
        if res.applied:
            turn = await self.store_call(lambda: self.store.update(turn_id, at=self.clock.now(), lease_owner=None))
            self.release(turn_id)
            self._notify(turn)
            log.info("turn %s released for another worker at step %d", turn_id, turn.step_count)
            return TransitionResult(outcome=res.outcome, turn=turn, previous=res.previous)
        return res

    async def adopt(self, turn_id: str, pricing: Pricing | None = None) -> Turn | None:
        """Take the released turn ``turn_id`` over: QUEUED -> RUNNING (only
        one worker wins), leased here, with a runtime whose deadline, budget,
        steps and usage go on from the stored ones. None if it is not
        released (another worker took it, it was stopped, it never was)."""
        turn = await self.store_call(lambda: self.store.get(turn_id))
        if not turn.released:
            return None
        res = await self.store_call(lambda: self.store.transition(turn_id, TurnStatus.RUNNING, at=self.clock.now()))
        if not res.applied:
            return None
        now = self.clock.now()
        turn = await self.store_call(lambda: self.store.update(turn_id, at=now, lease_owner=self.owner, heartbeat_at=now))
        self._run_here(turn, pricing)
        log.info("turn %s adopted at step %d (released by another worker)", turn_id, turn.step_count)
        return turn

    async def take_over(self, seen: Turn, pricing: Pricing | None = None) -> Turn | None:
        """Take over the RUNNING turn ``seen`` whose worker is gone (its
        lease expired: killed, crashed), leasing it here by compare-and-set
        on the lease as seen (:meth:`turn.store.TurnStore.take_over`), with
        a runtime that goes on from the stored steps and usage, as
        :meth:`adopt`. What its worker had in flight is in the ledger,
        pending: the caller settles it before running on. None if another
        sweeper won, or its worker was only slow and beat meanwhile."""
        now = self.clock.now()
        taken = await self.store_call(lambda: self.store.take_over(
            seen.id, self.owner, expect_owner=seen.lease_owner, expect_heartbeat=seen.heartbeat_at, at=now
        ))
        if not taken:
            return None
        turn = await self.store_call(lambda: self.store.get(seen.id))
        self._run_here(turn, pricing)
        log.warning("turn %s taken over at step %d: its worker %s stopped renewing its lease", turn.id, turn.step_count,
                    seen.lease_owner or "nobody")
        return turn

    async def settle_cut_off(self, turn_id: str) -> bool:
        """Before a resumed turn runs on: settle the effects of its own steps
        that its first worker left open, by the ``worker_shutdown`` policy
        (:mod:`turn.stop_policy`: looked up; present is kept, absent is
        retried with the same key, so the step happens once even if the
        first call lands late), or by the policy of a stop recorded
        meanwhile (a user's cancel: absent is abandoned, never retried). A read left pending is abandoned (the model
        may read again). Its step count goes on after the last step in the
        ledger (a crash may have lost the count, never the intent), so no
        key is reused. Returns False if an effect stays unknown: the model
        must not go on guessing, the caller stops the turn.

        Raises:
            turn.store.StoreUnavailable: the store stays unreachable.
        """
        ledger = self.ledger
        intents = await self.store_call(lambda: self.store.ledger_list(turn_id))
        own = [i for i in intents if i.kind is IntentKind.EFFECT and i.key == effect_key(turn_id, i.step)]
        rt = self._runtime.get(turn_id)
        if rt is not None and own:
            rt.steps = max(rt.steps, max(i.step for i in own))
        reconciler = self.reconciliation_worker()
        # a stop that landed meanwhile (before this worker watched the turn's
        # signal) decides instead: a user's cancel retries nothing
        now_turn = await self.store_call(lambda: self.store.get(turn_id))
        kind = now_turn.stop_reason.kind if now_turn.stop_reason is not None else StopReasonKind.WORKER_SHUTDOWN
        stop_at = now_turn.stop_reason.at if now_turn.stop_reason is not None else None
        settled = True
        for i in own:
            if i.status is IntentStatus.PENDING:  # (a move that lost its compare-and-set: as it was; settled below)
                unsure = IntentStatus.ABANDONED if i.effect == "none" else IntentStatus.EFFECT_UNKNOWN
                i = await ledger.move(i.key, unsure, expect=frozenset({IntentStatus.PENDING}),
                                      detail="its worker ended mid-call") or i
            if i.status is IntentStatus.EFFECT_UNKNOWN:
                await reconciler.reconcile(i, kind, stop_at=stop_at)
            # as stored now: the background reconciliation may have settled it first
            i = await self.store_call(functools.partial(self.store.ledger_get, i.key))
            if i.status in (IntentStatus.PENDING, IntentStatus.EFFECT_UNKNOWN, IntentStatus.HUMAN_REQUIRED):
                log.warning("turn %s: step %d (%s) is still %s after its worker ended: not resumed", turn_id, i.step,
                            i.tool, i.status.value)
                settled = False
        return settled

    def _run_here(self, turn: Turn, pricing: Pricing | None) -> None:
        """Lease bookkeeping and a runtime for a turn this worker now runs."""
        now = self.clock.now()
        self._owned.add(turn.id)
        self._where[turn.id] = (turn.session_id, turn.generation)
        mono = self.clock.monotonic()
        left = (turn.deadline_at - now).total_seconds() if turn.deadline_at is not None else None
        self._runtime[turn.id] = TurnRuntime(
            turn_id=turn.id,
            deadline=mono + left if left is not None else None,
            budget=turn.budget,
            max_steps=turn.max_steps,
            meter=UsageMeter(pricing, now=self.clock.now, earlier=turn.usage.records),
            steps=turn.step_count,
            synced_at=mono,
        )
        self._notify(turn)
