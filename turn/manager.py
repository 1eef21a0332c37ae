"""The Turn Manager: owns every turn from acceptance to one terminal state.

All state changes go through the store's compare-and-set; the manager adds
timestamps from the injected clock and tells listeners about each applied
change so transports can show it (e.g. "stopping", then "cancelled").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable
from enum import StrEnum
from typing import Callable, TypeVar

from pydantic import BaseModel
from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from turn.clock import Clock
from turn.models import StopReason, Turn, TurnKind, TurnStatus
from turn.states import TransitionResult
from turn.store import StoreUnavailable, TurnStore

log = logging.getLogger(__name__)

T = TypeVar("T")

#: attempts for a store call that failed with StoreUnavailable (nothing written)
STORE_ATTEMPTS = 4

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

    Every method may raise :class:`turn.store.StoreUnavailable` once the store
    stayed unavailable through ``store_attempts`` tries, ``RuntimeError`` if
    the store is not open, and those taking a ``turn_id`` raise
    :class:`turn.store.UnknownTurn` for an id that does not exist.

    Args:
        store: the authority (e.g. :class:`turn.sqlite_store.SqliteStore`), opened.
        clock: time source for every timestamp (and for retry backoff).
        store_attempts: tries of a store call that found the store unavailable.
    """

    def __init__(self, store: TurnStore, clock: Clock, *, store_attempts: int = STORE_ATTEMPTS) -> None:
        self.store = store
        self.clock = clock
        self.store_attempts = store_attempts
        self._listeners: dict[str, list[TurnListener]] = {}

    async def _call(self, fn: Callable[[], Awaitable[T]]) -> T:
        """Run a store call, retrying with exponential backoff (50 ms doubling,
        at most 1 s apart) while the store says it is unavailable; a retry is
        safe because an unavailable store wrote nothing.

        Raises:
            turn.store.StoreUnavailable: still unavailable after the last attempt.
        """
        async for attempt in AsyncRetrying(
            stop=stop_after_attempt(self.store_attempts),
            wait=wait_exponential(multiplier=0.05, max=1.0),
            retry=retry_if_exception_type(StoreUnavailable),
            sleep=self.clock.sleep,
            reraise=True,
        ):
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover

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
        start: bool = True,
    ) -> Turn:
        """Accept a new turn and start it: QUEUED, then RUNNING.

        Args:
            turn_id: the id to use (a uuid4 hex is made if None); callers that
                must refer to the turn before it is written choose it first.
            start: False leaves it QUEUED.

        Returns:
            The RUNNING (or QUEUED) turn.

        Raises:
            turn.store.DuplicateTurn: ``turn_id`` exists already.
            turn.store.StoreUnavailable: the store stayed unavailable.
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
        await self._call(lambda: self.store.create(turn))
        self._notify(turn)
        if not start:
            return turn
        result = await self._call(lambda: self.store.transition(turn.id, TurnStatus.RUNNING, at=self.clock.now()))
        if result.applied:
            self._notify(result.turn)
        return result.turn

    async def request_stop(self, turn_id: str, reason: StopReason) -> StopAnswer:
        """Ask a turn to stop. RUNNING moves to CANCEL_REQUESTED (shown as
        "stopping"); the worker confirms with :meth:`confirm_stopped`.

        Raises:
            turn.store.UnknownTurn: no such turn.
        """
        res = await self._call(
            lambda: self.store.transition(turn_id, TurnStatus.CANCEL_REQUESTED, at=self.clock.now(), stop_reason=reason)
        )
        if res.applied:
            self._notify(res.turn)
            return StopAnswer(outcome=StopOutcome.ACCEPTED, turn=res.turn)
        if res.turn.status is TurnStatus.CANCEL_REQUESTED:
            return StopAnswer(outcome=StopOutcome.ALREADY_STOPPING, turn=res.turn)
        if res.turn.status is TurnStatus.QUEUED:
            res = await self._call(
                lambda: self.store.transition(turn_id, TurnStatus.CANCELLED, at=self.clock.now(), stop_reason=reason)
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
        res = await self._call(
            lambda: self.store.transition(turn_id, target, at=self.clock.now(), error=error, stop_reason=stop_reason)
        )
        if res.applied:
            self._notify(res.turn)
        else:
            log.debug("turn %s: %s -> %s not applied (%s)", turn_id, res.previous, target, res.outcome)
        return res

    async def recover_abandoned(self, reason: StopReason) -> list[Turn]:
        """Stop every turn left open by a process that is gone (e.g. killed
        mid-turn), so none stays RUNNING forever: QUEUED ones are cancelled at
        once, the others go through CANCEL_REQUESTED to CANCELLED with
        ``reason``. Only for a store that this process alone serves (the
        embedded SQLite default); with many instances, leases decide.

        Returns:
            The turns as stopped.
        """
        stopped = []
        for turn in await self._call(self.store.list_open):
            answer = await self.request_stop(turn.id, reason)
            if answer.outcome in (StopOutcome.ACCEPTED, StopOutcome.ALREADY_STOPPING):
                answer = StopAnswer(outcome=answer.outcome, turn=(await self.confirm_stopped(turn.id)).turn)
            stopped.append(answer.turn)
            log.warning("recovered turn %s left %s by a previous process", turn.id, turn.status)
        return stopped

    async def record(self, turn_id: str, *, transcript: str | None = None, reply: str | None = None) -> Turn:
        """Store the transcript and/or reply text of a turn."""
        fields = {k: v for k, v in (("transcript", transcript), ("reply", reply)) if v is not None}
        return await self._call(lambda: self.store.update(turn_id, at=self.clock.now(), **fields))

    async def get(self, turn_id: str) -> Turn:
        """The stored turn.

        Raises:
            turn.store.UnknownTurn: no such turn.
        """
        return await self._call(lambda: self.store.get(turn_id))
