"""The Turn Manager: owns every turn from acceptance to one terminal state.

All state changes go through the store's compare-and-set; the manager adds
timestamps from the injected clock and tells listeners about each applied
change so transports can show it (e.g. "stopping", then "cancelled").
"""

from __future__ import annotations

import logging
from enum import StrEnum
from typing import Callable

from pydantic import BaseModel

from turn.clock import Clock
from turn.models import StopReason, Turn, TurnKind, TurnStatus
from turn.states import TransitionResult
from turn.store import TurnStore

log = logging.getLogger(__name__)

TurnListener = Callable[[Turn], None]


class StopOutcome(StrEnum):
    """Answer to a stop request."""

    #: RUNNING moved to CANCEL_REQUESTED by this request
    ACCEPTED = "accepted"
    #: a stop was already requested; the turn is stopping
    ALREADY_STOPPING = "already_stopping"
    #: nothing was running yet; the turn went straight to CANCELLED
    CANCELLED_BEFORE_START = "cancelled_before_start"
    #: the turn had already ended; ``turn`` shows how
    ALREADY_TERMINAL = "already_terminal"


class StopAnswer(BaseModel):
    """Outcome of :meth:`TurnManager.request_stop` and the turn as stored after it."""

    outcome: StopOutcome
    turn: Turn


class TurnManager:
    """Creates turns and moves them through DESIGN.md's states.

    Args:
        store: the authority (e.g. :class:`turn.sqlite_store.SqliteStore`), opened.
        clock: time source for every timestamp.
    """

    def __init__(self, store: TurnStore, clock: Clock) -> None:
        self.store = store
        self.clock = clock
        self._listeners: dict[str, list[TurnListener]] = {}

    # -- listeners -------------------------------------------------------------

    def subscribe(self, session_id: str, listener: TurnListener) -> Callable[[], None]:
        """Call ``listener(turn)`` after every applied change of a turn of
        ``session_id``. Returns a function that unsubscribes."""
        self._listeners.setdefault(session_id, []).append(listener)

        def unsubscribe() -> None:
            lst = self._listeners.get(session_id, [])
            if listener in lst:
                lst.remove(listener)
            if not lst:
                self._listeners.pop(session_id, None)

        return unsubscribe

    def _notify(self, turn: Turn) -> None:
        for listener in list(self._listeners.get(turn.session_id, ())):
            try:
                listener(turn)
            except Exception:  # a broken listener must not break the turn
                log.exception("turn listener failed")

    # -- lifecycle -------------------------------------------------------------

    async def open_turn(
        self,
        session_id: str,
        generation: int,
        *,
        kind: TurnKind = TurnKind.VOICE,
        tenant_id: str = "default",
        transcript: str | None = None,
        turn_id: str | None = None,
    ) -> Turn:
        """Accept a new turn and start it: QUEUED, then RUNNING.

        Args:
            turn_id: the id to use (a uuid4 hex is made if None); callers that
                must refer to the turn before it is written choose it first.

        Returns:
            The RUNNING turn.

        Raises:
            turn.store.DuplicateTurn: ``turn_id`` exists already.
        """
        now = self.clock.now()
        turn = Turn(
            **({"id": turn_id} if turn_id else {}),
            session_id=session_id,
            generation=generation,
            kind=kind,
            tenant_id=tenant_id,
            transcript=transcript,
            created_at=now,
            updated_at=now,
        )
        await self.store.create(turn)
        self._notify(turn)
        result = await self.store.transition(turn.id, TurnStatus.RUNNING, at=self.clock.now())
        if result.applied:
            self._notify(result.turn)
        return result.turn

    async def request_stop(self, turn_id: str, reason: StopReason) -> StopAnswer:
        """Ask a turn to stop. RUNNING moves to CANCEL_REQUESTED (shown as
        "stopping"); the worker confirms with :meth:`confirm_stopped`.

        Raises:
            turn.store.UnknownTurn: no such turn.
        """
        res = await self.store.transition(
            turn_id, TurnStatus.CANCEL_REQUESTED, at=self.clock.now(), stop_reason=reason
        )
        if res.applied:
            self._notify(res.turn)
            return StopAnswer(outcome=StopOutcome.ACCEPTED, turn=res.turn)
        if res.turn.status is TurnStatus.CANCEL_REQUESTED:
            return StopAnswer(outcome=StopOutcome.ALREADY_STOPPING, turn=res.turn)
        if res.turn.status is TurnStatus.QUEUED:
            res = await self.store.transition(
                turn_id, TurnStatus.CANCELLED, at=self.clock.now(), stop_reason=reason
            )
            if res.applied:
                self._notify(res.turn)
                return StopAnswer(outcome=StopOutcome.CANCELLED_BEFORE_START, turn=res.turn)
            return await self.request_stop(turn_id, reason)
        return StopAnswer(outcome=StopOutcome.ALREADY_TERMINAL, turn=res.turn)

    async def confirm_stopped(self, turn_id: str) -> TransitionResult:
        """The worker confirms every child stopped with no external effect:
        CANCEL_REQUESTED moves to CANCELLED."""
        return await self._move(turn_id, TurnStatus.CANCELLED)

    async def complete(self, turn_id: str) -> TransitionResult:
        """The turn did all its work. From RUNNING, or from CANCEL_REQUESTED
        when the final step had already committed."""
        return await self._move(turn_id, TurnStatus.COMPLETED)

    async def fail(self, turn_id: str, error: str, reason: StopReason | None = None) -> TransitionResult:
        """The turn cannot go on (``error`` says why, for humans)."""
        return await self._move(turn_id, TurnStatus.FAILED, error=error, stop_reason=reason)

    async def _move(
        self,
        turn_id: str,
        target: TurnStatus,
        *,
        error: str | None = None,
        stop_reason: StopReason | None = None,
    ) -> TransitionResult:
        res = await self.store.transition(
            turn_id, target, at=self.clock.now(), error=error, stop_reason=stop_reason
        )
        if res.applied:
            self._notify(res.turn)
        else:
            log.debug("turn %s: %s -> %s not applied (%s)", turn_id, res.previous, target, res.outcome)
        return res

    async def record(self, turn_id: str, *, transcript: str | None = None, reply: str | None = None) -> Turn:
        """Store the transcript and/or reply text of a turn."""
        fields = {k: v for k, v in (("transcript", transcript), ("reply", reply)) if v is not None}
        return await self.store.update(turn_id, at=self.clock.now(), **fields)

    async def get(self, turn_id: str) -> Turn:
        """The stored turn.

        Raises:
            turn.store.UnknownTurn: no such turn.
        """
        return await self.store.get(turn_id)
