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

import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from clock import Clock
from turn.models import Turn, TurnStatus
from turn.runtime import TurnRuntime
from turn.states import TransitionResult
from turn.store import TurnStore
from turn.usage import Pricing, UsageMeter

log = logging.getLogger(__name__)

T = TypeVar("T")


class Resumption:
    """The Turn Manager's part that releases and adopts turns (a mixin of
    :class:`turn.manager.TurnManager`)."""

    store: TurnStore
    clock: Clock
    owner: str
    _owned: set[str]
    _where: dict[str, tuple[str, int]]
    _runtime: dict[str, TurnRuntime]

    if TYPE_CHECKING:  # the manager's methods this part calls

        async def store_call(self, fn: Callable[[], Awaitable[T]]) -> T: ...

        async def flush(self, turn_id: str, meter: UsageMeter | None = None) -> Turn: ...

        def release(self, turn_id: str) -> None: ...

        def _notify(self, turn: Turn) -> None: ...

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
        log.info("turn %s adopted at step %d (released by another worker)", turn_id, turn.step_count)
        return turn
