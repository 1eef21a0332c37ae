"""The Turn Manager: owns every turn from acceptance to one terminal state.

All state changes go through the store's atomic compare-and-set; the manager
adds timestamps from the injected clock, retries a busy store, holds the
leases of the turns this process runs, sends stop signals, and tells
listeners about each applied change so transports can show it (e.g.
"stopping", then "cancelled").
"""

from __future__ import annotations

import asyncio
import logging
import os
import socket
import uuid
from collections.abc import Awaitable
from dataclasses import dataclass
from datetime import timedelta
from typing import Any, Callable, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from turn.clock import Clock
from turn.events import EventLogs
from turn.models import Budget, Session, StopReason, Turn, TurnKind, TurnStatus
from turn.signals import StopSignals
from turn.states import TransitionResult
from turn.store import StopAnswer, StopResult, StoreUnavailable, TurnStore, UnknownSession

log = logging.getLogger(__name__)

T = TypeVar("T")

#: attempts for a store call that failed with StoreUnavailable (nothing written)
STORE_ATTEMPTS = 4

TurnListener = Callable[[Turn], None]


class TurnStopped(Exception):
    """Raised by :meth:`TurnManager.checkpoint` when the turn must not go on.

    Attributes:
        turn_id: the turn.
        phase: where the checkpoint was (e.g. "before_model").
    """

    def __init__(self, turn_id: str, phase: str) -> None:
        super().__init__(f"turn {turn_id} was asked to stop (at {phase})")
        self.turn_id = turn_id
        self.phase = phase


@dataclass
class _FlagCache:
    stopping: bool
    read_at: float


def turn_event(turn: Turn) -> dict[str, Any]:
    """The fields of a "turn" event: a turn's state as clients see it
    (CANCEL_REQUESTED is labelled "stopping", never "cancelled")."""
    return {
        "turn_id": turn.id,
        "generation": turn.generation,
        "status": turn.status.value,
        "label": turn.status.label,
        "stop_reason": turn.stop_reason.model_dump(mode="json") if turn.stop_reason else None,
        "error": turn.error,
        "transcript": turn.transcript,
        "reply": turn.reply,
    }


def default_owner() -> str:
    """This process's lease-owner id: host, pid and a random part (a
    restarted process never reuses one)."""
    return f"{socket.gethostname()}:{os.getpid()}:{uuid.uuid4().hex[:8]}"


class TurnManager:
    """Creates turns and moves them through DESIGN.md's states.

    Every method may raise :class:`turn.store.StoreUnavailable` once the store
    stayed unavailable through ``store_attempts`` tries, ``RuntimeError`` if
    the store is not open, and those taking a ``turn_id`` raise
    :class:`turn.store.UnknownTurn` for an id that does not exist.

    Args:
        store: the authority (SQLite or Redis store), opened.
        clock: time source for every timestamp (and for retry backoff).
        signals: stop signals (in-process by default; Redis pub/sub across
            instances).
        owner: this process's lease-owner id.
        lease_ttl_s: a turn whose heartbeat is older than this (s) has lost
            its owner.
        flag_staleness_s: how old (s) a cached stop-flag read may be at a
            checkpoint before the store is read again.
        store_attempts: tries of a store call that found the store unavailable.
    """

    def __init__(
        self,
        store: TurnStore,
        clock: Clock,
        *,
        signals: StopSignals | None = None,
        owner: str | None = None,
        lease_ttl_s: float = 10.0,
        flag_staleness_s: float = 0.1,
        store_attempts: int = STORE_ATTEMPTS,
    ) -> None:
        self.store = store
        self.clock = clock
        self.signals = signals or StopSignals()
        self.owner = owner or default_owner()
        self.lease_ttl_s = lease_ttl_s
        self.flag_staleness_s = flag_staleness_s
        self.store_attempts = store_attempts
        #: the session event logs this process writes; every applied change
        #: of a turn is logged there as a "turn" event
        self.events = EventLogs(store, clock, self.store_call)
        self._listeners: dict[str, list[TurnListener]] = {}
        self._owned: set[str] = set()
        self._flags: dict[str, _FlagCache] = {}

    async def store_call(self, fn: Callable[[], Awaitable[T]]) -> T:
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
        ``session_id`` made through this manager. Returns a function that
        unsubscribes."""
        self._listeners.setdefault(session_id, []).append(listener)

        def unsubscribe() -> None:
            lst = self._listeners.get(session_id, [])
            if listener in lst:
                lst.remove(listener)
            if not lst:
                self._listeners.pop(session_id, None)

        return unsubscribe

    def _notify(self, turn: Turn) -> None:
        if turn.is_terminal:
            self.release(turn.id)
        self.events.log(turn.session_id).emit("turn", **turn_event(turn))
        for listener in list(self._listeners.get(turn.session_id, ())):
            try:
                listener(turn)
            except Exception:  # a broken listener must not break the turn
                log.exception("turn listener failed")

    # -- sessions --------------------------------------------------------------

    async def ensure_session(self, session_id: str, *, tenant_id: str = "default", kind: TurnKind = TurnKind.VOICE) -> Session:
        """The session, created if new.

        Raises:
            PermissionError: it exists and belongs to another tenant.
        """
        try:
            session = await self.store_call(lambda: self.store.get_session(session_id))
        except UnknownSession:
            from turn.store import DuplicateSession

            try:
                return await self.store_call(
                    lambda: self.store.create_session(
                        Session(id=session_id, tenant_id=tenant_id, kind=kind, created_at=self.clock.now())
                    )
                )
            except DuplicateSession:  # created meanwhile by a concurrent request
                session = await self.store_call(lambda: self.store.get_session(session_id))
        if session.tenant_id != tenant_id:
            raise PermissionError(f"session {session_id!r} belongs to another tenant")
        return session

    # -- lifecycle -------------------------------------------------------------

    async def open_turn(
        self,
        session_id: str,
        generation: int | None = None,
        *,
        kind: TurnKind = TurnKind.VOICE,
        tenant_id: str = "default",
        transcript: str | None = None,
        turn_id: str | None = None,
        deadline_s: float | None = None,
        budget: Budget | None = None,
        start: bool = True,
    ) -> Turn:
        """Accept a new turn and start it: QUEUED, then RUNNING, leased to
        this process.

        Args:
            session_id: an existing session (see :meth:`ensure_session`).
            generation: the generation its output carries. None takes the
                session's next one from the store (INCR); a voice session
                passes the value its in-memory fence already advanced to,
                and the store's counter is advanced to match.
            turn_id: the id to use (a uuid4 hex is made if None); callers that
                must refer to the turn before it is written choose it first.
            deadline_s: seconds from now until its absolute deadline.
            budget: spending limits.
            start: False leaves it QUEUED (and unleased).

        Returns:
            The RUNNING (or QUEUED) turn.

        Raises:
            turn.store.DuplicateTurn: ``turn_id`` exists already.
            turn.store.UnknownSession: no such session.
        """
        stored_gen = await self.store_call(lambda: self.store.next_generation(session_id))
        if generation is None:
            generation = stored_gen
        else:
            # The fence advanced in memory; a turn that could not be written
            # (store down) left the store's counter behind: catch up.
            for _ in range(min(1000, max(0, generation - stored_gen))):
                stored_gen = await self.store_call(lambda: self.store.next_generation(session_id))
            if stored_gen != generation:
                log.warning("session %s: generation %d in memory, %d in the store", session_id, generation, stored_gen)
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
            deadline_at=now + timedelta(seconds=deadline_s) if deadline_s is not None else None,
            budget=budget or Budget(),
            lease_owner=self.owner if start else None,
            heartbeat_at=now if start else None,
        )
        await self.store_call(lambda: self.store.create(turn))
        self._notify(turn)
        if not start:
            return turn
        self._owned.add(turn.id)
        result = await self.store_call(lambda: self.store.transition(turn.id, TurnStatus.RUNNING, at=self.clock.now()))
        if result.applied:
            self._notify(result.turn)
        return result.turn

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
        res = await self.store_call(
            lambda: self.store.request_stop(turn_id, rid, reason, at=self.clock.now(), fingerprint=fingerprint)
        )
        if res.first:
            if turn_id in self._owned:  # a turn run elsewhere is not cached here
                self._flags[turn_id] = _FlagCache(True, self.clock.monotonic())
            self._notify(res.turn)
            await self.signals.publish(turn_id)
        return res

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
        res = await self.store_call(
            lambda: self.store.transition(turn_id, target, at=self.clock.now(), error=error, stop_reason=stop_reason)
        )
        if res.applied:
            self._notify(res.turn)
        else:
            log.debug("turn %s: %s -> %s not applied (%s)", turn_id, res.previous, target, res.outcome)
        return res

    # -- the worker's side -----------------------------------------------------

    def stop_event(self, turn_id: str) -> asyncio.Event:
        """An event set when ``turn_id`` is asked to stop (fast path only; see
        :meth:`stop_requested` for the authority)."""
        return self.signals.watch(turn_id)

    def release(self, turn_id: str) -> None:
        """The worker of ``turn_id`` ended here: stop watching and leasing it."""
        self.signals.forget(turn_id)
        self._owned.discard(turn_id)
        self._flags.pop(turn_id, None)

    async def stop_requested(self, turn_id: str) -> bool:
        """Whether a stop was requested: at once if a signal arrived, else
        from a store read no older than ``flag_staleness_s``."""
        if self.signals.watch(turn_id).is_set():
            return True
        now = self.clock.monotonic()
        cached = self._flags.get(turn_id)
        if cached is not None and (cached.stopping or now - cached.read_at <= self.flag_staleness_s):
            return cached.stopping
        turn = await self.store_call(lambda: self.store.get(turn_id))
        stopping = turn.status is not TurnStatus.RUNNING
        self._flags[turn_id] = _FlagCache(stopping, now)
        if stopping:
            self.signals.fire(turn_id)
        return stopping

    async def checkpoint(self, turn_id: str, phase: str) -> None:
        """The cheap check before and after every model and tool call: raise
        :class:`TurnStopped` if a stop was requested (signal at once, store
        read at most ``flag_staleness_s`` old).

        Raises:
            TurnStopped: the turn must not go on.
        """
        if await self.stop_requested(turn_id):
            raise TurnStopped(turn_id, phase)

    async def renew_leases(self) -> int:
        """Heartbeat every turn this process runs; returns how many."""
        owned = sorted(self._owned)
        if not owned:
            return 0
        return await self.store_call(lambda: self.store.heartbeat(self.owner, owned, at=self.clock.now()))

    async def keep_leases(self) -> None:
        """Run forever: renew this process's leases every third of the TTL, so
        a live worker never looks dead however long a turn runs."""
        while True:
            await self.clock.sleep(self.lease_ttl_s / 3)
            try:
                await self.renew_leases()
            except Exception:
                log.exception("lease renewal failed")

    def lease_expired(self, turn: Turn) -> bool:
        """True if ``turn`` is open and nobody has shown it is alive for
        ``lease_ttl_s``: its owner's last heartbeat, or for a turn never
        leased, its last update."""
        if turn.is_terminal:
            return False
        last = turn.heartbeat_at or turn.updated_at
        return (self.clock.now() - last).total_seconds() > self.lease_ttl_s

    async def recover_abandoned(self, reason: StopReason, *, all_open: bool) -> list[Turn]:
        """Stop the turns whose worker is gone (killed mid-turn), so none
        stays open forever: QUEUED ones are cancelled at once, the others go
        through CANCEL_REQUESTED to CANCELLED with ``reason``.

        Args:
            all_open: every open turn not run by this process is abandoned
                (true when one process serves the store, e.g. SQLite);
                otherwise only those whose lease expired.

        Returns:
            The turns as stopped.
        """
        stopped = []
        for turn in await self.store_call(self.store.list_open):
            if turn.id in self._owned or not (all_open or self.lease_expired(turn)):
                continue
            res = await self.request_stop(turn.id, reason, request_id=f"recover:{turn.id}")
            if res.answer in (StopAnswer.ACCEPTED, StopAnswer.ALREADY_STOPPING) and not res.turn.is_terminal:
                res = StopResult(answer=res.answer, first=res.first, repeat=res.repeat, turn=(await self.confirm_stopped(turn.id)).turn)
            stopped.append(res.turn)
            log.warning("recovered turn %s left %s by %s", turn.id, turn.status, turn.lease_owner or "nobody")
        return stopped

    async def record(self, turn_id: str, *, transcript: str | None = None, reply: str | None = None) -> Turn:
        """Store the transcript and/or reply text of a turn."""
        fields = {k: v for k, v in (("transcript", transcript), ("reply", reply)) if v is not None}
        return await self.store_call(lambda: self.store.update(turn_id, at=self.clock.now(), **fields))

    async def get(self, turn_id: str) -> Turn:
        """The stored turn."""
        return await self.store_call(lambda: self.store.get(turn_id))
