"""The stop path: from a stop request to the turn's one terminal state
(DESIGN.md "Turn states").

1. :meth:`StopPath.request_stop`: the store moves RUNNING to
   CANCEL_REQUESTED (shown "stopping") or QUEUED to CANCELLED, idempotently
   by request id; only the first request signals the worker. A limit a
   checkpoint found (:meth:`StopPath.stop_for_limit`) is recorded the same
   way, with a reason of its kind.
2. :meth:`StopPath.settle_stop`: the worker collects its children's reports
   (:meth:`turn.scope.TurnScope.settle`), the ledger resolves the turn's
   intents (:meth:`turn.ledger.Ledger.resolve_on_stop`), and the turn is
   written CANCELLED, RECONCILE_REQUIRED or FAILED (:func:`terminal_status`).

:class:`StopPath` is a part of :class:`turn.manager.TurnManager`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, TypeVar

from clock import Clock
from turn.ledger import Ledger
from turn.models import ChildOutcome, StopReason, StopReasonKind, StopReport, Turn, TurnStatus
from turn.runtime import TurnRuntime
from turn.scope import TurnScope
from turn.signals import StopSignals
from turn.states import TransitionResult
from turn.stopped import LIMIT_KINDS, TurnStopped
from turn.store import StopResult, TurnStore

T = TypeVar("T")


class StopPath:
    """How :class:`turn.manager.TurnManager` stops a turn.

    It uses the manager's ``store_call``, ``get``, ``_notify``,
    ``_mark_stopping`` (:class:`turn.checkpoint.Checkpoints`) and its
    transitions (``confirm_stopped``, ``reconcile_required``, ``fail``).

    Attributes:
        store / clock / signals / ledger: the manager's.
        _runtime: the runtime of each turn run here.
    """

    store: TurnStore
    clock: Clock
    signals: StopSignals
    ledger: Ledger
    _runtime: dict[str, TurnRuntime]

    if TYPE_CHECKING:  # the manager's methods this part calls (turn.manager.TurnManager, turn.checkpoint.Checkpoints)

        async def store_call(self, fn: Callable[[], Awaitable[T]]) -> T: ...

        async def get(self, turn_id: str) -> Turn: ...

        def _notify(self, turn: Turn) -> None: ...

        def _mark_stopping(self, turn_id: str) -> None: ...

        async def confirm_stopped(self, turn_id: str) -> TransitionResult: ...

        async def reconcile_required(self, turn_id: str) -> TransitionResult: ...

        async def fail(self, turn_id: str, error: str, reason: StopReason | None = None) -> TransitionResult: ...

    async def request_stop(self, turn_id: str, reason: StopReason, *, request_id: str | None = None, fingerprint: str = "") -> StopResult:
        """Ask a turn to stop, idempotently. The first request moves RUNNING to
        CANCEL_REQUESTED (shown as "stopping") or QUEUED to CANCELLED; only
        that one signals the worker. A repeat of ``request_id`` gets the same
        answer and does nothing. The worker confirms with
        :meth:`confirm_stopped`.

        Args:
            request_id: defaults to ``reason.request_id``.
            fingerprint: the request's parameters, to refuse a reused id.

        Raises:
            turn.store.IdempotencyConflict: ``request_id`` was used with other
                parameters.
        """
        rid = request_id or reason.request_id
        # A turn this process runs must not start a step while its stop is
        # being written (the stop's time is already taken): its checkpoints
        # wait for the write, then see the stop.
        rt = self._runtime.get(turn_id)
        writing: asyncio.Future[None] | None = None
        if rt is not None:
            writing = asyncio.get_running_loop().create_future()
            rt.stop_writes.add(writing)
        try:
            res = await self.store_call(
                lambda: self.store.request_stop(turn_id, rid, reason, at=self.clock.now(), fingerprint=fingerprint)
            )
            if res.first:
                self._mark_stopping(turn_id)
        finally:
            if rt is not None and writing is not None:
                rt.stop_writes.discard(writing)
                writing.set_result(None)
        if res.first:
            self._notify(res.turn)
            await self.signals.publish(turn_id)
        return res

    async def stop_for_limit(self, turn_id: str, stop: TurnStopped) -> StopResult:
        """Record a stop the turn decided itself (``stop.kind`` is a limit):
        RUNNING moves to CANCEL_REQUESTED (shown "stopping") with a reason of
        that kind; the worker then writes FAILED once its children report.

        Raises:
            ValueError: ``stop`` carries no limit kind.
        """
        if stop.kind not in LIMIT_KINDS:
            raise ValueError(f"not a limit: {stop.kind}")
        reason = StopReason(kind=stop.kind, initiator="checkpoint", at=self.clock.now(), detail=stop.detail)
        return await self.request_stop(turn_id, reason, request_id=f"limit:{turn_id}")

    async def settle_stop(self, turn_id: str, scope: TurnScope) -> Turn:
        """Write the terminal state of a stopped turn from its children's
        reports: wait (bounded by the scope's grace) for every child to
        report, record the stop (the scope's own limit, or the stop asked
        from outside), store the reports and the usage, then move
        CANCEL_REQUESTED to CANCELLED, RECONCILE_REQUIRED or FAILED (see
        :func:`terminal_status`). A turn already terminal (it
        completed first) is left as it is: a no-op, not a rollback.

        Returns:
            The turn as stored afterwards.
        """
        report = await scope.settle()
        if scope.limit is not None:
            current = (await self.stop_for_limit(turn_id, scope.limit)).turn
        else:
            current = await self.get(turn_id)
            if current.status is TurnStatus.RUNNING:  # a signal without a request: never leave it half-stopped
                fallback = scope.reason or StopReason(kind=StopReasonKind.USER_CANCEL, initiator="signal", at=self.clock.now())
                current = (await self.request_stop(turn_id, fallback)).turn
        rt = self._runtime.get(turn_id)
        if rt is not None and current.stop_reason is not None:
            rt.meter.mark_stopped()
            rt.meter.reconcile_stop(current.stop_reason.at)
        if current.is_terminal:
            return current
        await self.store_call(lambda: self.store.update(turn_id, at=self.clock.now(), stop_report=report))
        limit = current.stop_reason is not None and current.stop_reason.kind in LIMIT_KINDS
        remains = False
        if current.stop_reason is not None:
            running = any(not c.done.is_set() for c in scope.children)
            remains = await self.ledger.resolve_on_stop(
                turn_id, current.stop_reason.kind, current.stop_reason.at, work_running=running
            )
        target = terminal_status(report, limit=limit, effect_remains=remains)
        if target is TurnStatus.FAILED:
            assert current.stop_reason is not None
            res = await self.fail(turn_id, f"{current.stop_reason.kind.value}: {current.stop_reason.detail or ''}".rstrip(": "))
        elif target is TurnStatus.RECONCILE_REQUIRED:
            res = await self.reconcile_required(turn_id)
        else:
            res = await self.confirm_stopped(turn_id)
        return res.turn


def terminal_status(report: StopReport, *, limit: bool, effect_remains: bool = False) -> TurnStatus:
    """The terminal state a stopped turn is written with, from its
    children's reports (DESIGN.md "Turn states"):

    - a child that committed an effect after the stop request (or is still
      committing), or an effect the ledger shows remaining after the stop
      (``effect_remains``): RECONCILE_REQUIRED, never CANCELLED;
    - otherwise FAILED for a stop the turn decided itself (``limit``:
      deadline, budget, steps, loop), else CANCELLED.

    A turn whose final step committed before the stop is completed by its
    worker instead (CANCEL_REQUESTED -> COMPLETED, a no-op, not a rollback).
    """
    if effect_remains or any(r.outcome is ChildOutcome.COMMITTING for r in report.children):
        return TurnStatus.RECONCILE_REQUIRED
    return TurnStatus.FAILED if limit else TurnStatus.CANCELLED
