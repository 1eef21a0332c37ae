"""The Turn Manager: owns every turn from acceptance to one terminal state.

All state changes go through the store's atomic compare-and-set; the manager
adds timestamps from the injected clock, retries a busy store, holds the
leases of the turns this process runs, sends stop signals, and tells
listeners about each applied change so transports can show it (e.g.
"stopping", then "cancelled").
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable
from datetime import timedelta
from typing import Any, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from clock import Clock
from turn.checkpoint import Checkpoints
from turn.event_catalogue import LedgerEvent, StopReasonView, TurnEvent
from turn.events import EventLogs
from turn.lease import Leases, default_owner
from turn.ledger import Ledger
from turn.log_content import content
from turn.models import Budget, Plan, Session, StopReason, Turn, TurnKind, TurnStatus
from turn.reconciliation import ReconciliationWorker
from turn.resume import Resumption
from turn.runtime import FlagCache, TurnRuntime
from turn.scope_observer import ScopeObservers
from turn.signals import StopSignals
from turn.states import TransitionResult
from turn.stop_path import StopPath
from turn.stop_policy import TurnStop
from turn.store import DuplicateSession, StoreUnavailable, TurnStore, UnknownSession, WrongSessionKind
from turn.usage import Pricing, UsageMeter

log = logging.getLogger(__name__)

T = TypeVar("T")

#: attempts for a store call that failed with StoreUnavailable (nothing written)
STORE_ATTEMPTS = 4

TurnListener = Callable[[Turn], None]


def turn_fields(turn: Turn) -> dict[str, Any]:
    """A turn's state as clients see it, as :class:`turn.event_catalogue.TurnFields`
    declares it (CANCEL_REQUESTED is labelled "stopping", never "cancelled")."""
    return {
        "status": turn.status.value,
        "label": turn.status.label,
        "stop_reason": StopReasonView.model_validate(turn.stop_reason.model_dump(mode="json")) if turn.stop_reason else None,
        "error": turn.error,
        "transcript": turn.transcript,
        "reply": turn.reply,
    }


def turn_event(turn: Turn) -> TurnEvent:
    """The "turn" event of a turn's state change (:class:`turn.event_catalogue.TurnEvent`)."""
    return TurnEvent(turn_id=turn.id, generation=turn.generation, **turn_fields(turn))


class TurnManager(Checkpoints, StopPath, Leases, Resumption):
    """Creates turns and moves them through DESIGN.md's states.

    Its parts live with their concepts: the checkpoints and the stop flag
    (:class:`turn.checkpoint.Checkpoints`), the stop path
    (:class:`turn.stop_path.StopPath`: ``request_stop``, ``stop_for_limit``,
    ``settle_stop``) and the leases with their sweeper
    (:class:`turn.lease.Leases`); this class holds their state, the
    sessions, opening turns and their transitions.

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
        #: the side-effect ledger of every turn; ``ledger.handlers`` is set
        #: by whoever knows the tools (the app)
        self.ledger = Ledger(store, clock, emit=self._ledger_event, store_call=self.store_call, turn_stop=self.turn_stop)
        #: told of every cancel scope's children, stop and report (traces,
        #: metrics: :mod:`turn.scope_observer`); scopes get it at their start
        self.scope_observers = ScopeObservers()
        self._where: dict[str, tuple[str, int]] = {}
        self._listeners: dict[str, list[TurnListener]] = {}
        self._owned: set[str] = set()
        self._lost_leases: set[str] = set()
        self._flags: dict[str, FlagCache] = {}
        self._runtime: dict[str, TurnRuntime] = {}
        #: called synchronously when a turn run here is found stopping
        self._stop_hooks: dict[str, list[Callable[[], None]]] = {}
        self.signals.on_fire = self._mark_stopping

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

    async def _ledger_event(self, turn_id: str, event: LedgerEvent) -> None:
        """A ledger change, logged in the turn's session as its catalogue event."""
        where = self._where.get(turn_id)
        if where is None:
            turn = await self.get(turn_id)
            where = (turn.session_id, turn.generation)
        self.events.log(where[0]).emit_event(event.model_copy(update={"generation": where[1], "turn_id": turn_id}))

    def reconciliation_worker(self, interval_s: float = 1.0) -> ReconciliationWorker:
        """A worker that settles the ledger rows stops and crashes left open."""

        return ReconciliationWorker(self.ledger, self.turn_stop, interval_s=interval_s)

    async def turn_stop(self, turn_id: str) -> TurnStop:
        """The stop in force for ``turn_id`` (:class:`turn.stop_policy.TurnStop`):
        none if it was not stopped or completed before its stop (a stop that
        came after the final step changed nothing).

        Raises:
            turn.store.UnknownTurn: no such turn.
            turn.store.StoreUnavailable: the store stays unreachable.
        """
        turn = await self.get(turn_id)
        if turn.stop_reason is None or turn.status is TurnStatus.COMPLETED:
            return TurnStop(None, None, turn.is_terminal)
        return TurnStop(turn.stop_reason.kind, turn.stop_reason.at, turn.is_terminal)

    def _notify(self, turn: Turn) -> None:
        if turn.is_terminal:
            self.release(turn.id)
        self.events.log(turn.session_id).emit_event(turn_event(turn))
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
            turn.store.WrongSessionKind: it exists and is of another kind
                (checked after the tenant: another tenant's session answers
                as unknown, whatever its kind).
        """
        try:
            session = await self.store_call(lambda: self.store.get_session(session_id))
        except UnknownSession:
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
        if session.kind is not kind:
            raise WrongSessionKind(f"session {session_id!r} is a {session.kind.value} session, not a {kind.value} one")
        return session

    # -- lifecycle -------------------------------------------------------------

    async def open_turn(
        self,
        session_id: str,
        generation: int | None = None,
        *,
        kind: TurnKind = TurnKind.VOICE,
        tenant_id: str | None = None,
        transcript: str | None = None,
        turn_id: str | None = None,
        deadline_s: float | None = None,
        budget: Budget | None = None,
        plan: Plan | None = None,
        pricing: Pricing | None = None,
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
            tenant_id: whose turn it is; None: the session's tenant (read
                from the store: a turn always belongs to its session's tenant,
                so a voice session's turns are its tenant's).
            turn_id: the id to use (a uuid4 hex is made if None); callers that
                must refer to the turn before it is written choose it first.
            deadline_s: seconds from now until its absolute deadline
                (default: the plan's).
            budget: spending limits (default: the plan's).
            plan: the tenant's limits (deadline, budget, max steps); None
                means no deadline and no budget, 16 steps.
            pricing: the model's token prices, for ``spent.cents``.
            start: False leaves it QUEUED (and unleased).

        Returns:
            The RUNNING (or QUEUED) turn.

        Raises:
            turn.store.DuplicateTurn: ``turn_id`` exists already.
            turn.store.UnknownSession: no such session.
        """
        if tenant_id is None:
            tenant_id = (await self.store_call(lambda: self.store.get_session(session_id))).tenant_id
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
        if plan is not None:
            deadline_s = plan.deadline_s if deadline_s is None else deadline_s
            budget = plan.budget if budget is None else budget
        max_steps = plan.max_steps if plan is not None else Plan().max_steps
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
            max_steps=max_steps,
            lease_owner=self.owner if start else None,
            heartbeat_at=now if start else None,
        )
        await self.store_call(lambda: self.store.create(turn))
        log.debug("turn %s opened in session %s (generation %d): %s", turn.id, session_id, generation,
                  content(transcript) if transcript is not None else "no transcript yet")
        self._notify(turn)
        if not start:
            return turn
        self._owned.add(turn.id)
        self._where[turn.id] = (turn.session_id, turn.generation)
        mono = self.clock.monotonic()
        self._runtime[turn.id] = TurnRuntime(
            turn_id=turn.id,
            deadline=mono + deadline_s if deadline_s is not None else None,
            budget=turn.budget,
            max_steps=max_steps,
            meter=UsageMeter(pricing, now=self.clock.now),
            synced_at=mono,
        )
        result = await self.store_call(lambda: self.store.transition(turn.id, TurnStatus.RUNNING, at=self.clock.now()))
        if result.applied:
            self._notify(result.turn)
        return result.turn

    async def confirm_stopped(self, turn_id: str) -> TransitionResult:
        """The worker confirms every child stopped with no external effect:
        CANCEL_REQUESTED moves to CANCELLED."""
        return await self._move(turn_id, TurnStatus.CANCELLED)

    async def complete(self, turn_id: str) -> TransitionResult:
        """The turn did all its work. From RUNNING, or from CANCEL_REQUESTED
        when the final step had already committed."""
        return await self._move(turn_id, TurnStatus.COMPLETED)

    async def fail(self, turn_id: str, error: str, reason: StopReason | None = None) -> TransitionResult:
        """The turn cannot go on (``error`` says why, for humans); from
        RUNNING, or from CANCEL_REQUESTED for a stop the turn decided itself
        (a limit)."""
        return await self._move(turn_id, TurnStatus.FAILED, error=error, stop_reason=reason)

    async def reconcile_required(self, turn_id: str) -> TransitionResult:
        """A stopped turn's work committed an external effect after the stop
        request: CANCEL_REQUESTED moves to RECONCILE_REQUIRED, never
        CANCELLED."""
        return await self._move(turn_id, TurnStatus.RECONCILE_REQUIRED)

    async def _move(
        self,
        turn_id: str,
        target: TurnStatus,
        *,
        error: str | None = None,
        stop_reason: StopReason | None = None,
    ) -> TransitionResult:
        if turn_id in self._runtime:
            await self.flush(turn_id)  # the usage and steps it ends with
        res = await self.store_call(
            lambda: self.store.transition(turn_id, target, at=self.clock.now(), error=error, stop_reason=stop_reason)
        )
        if res.applied:
            self._notify(res.turn)
        else:
            log.debug("turn %s: %s -> %s not applied (%s)", turn_id, res.previous, target, res.outcome)
        return res

    # -- the worker's side -----------------------------------------------------

    def release(self, turn_id: str) -> None:
        """The worker of ``turn_id`` ended here: stop watching and leasing it."""
        self.signals.forget(turn_id)
        self._owned.discard(turn_id)
        self._flags.pop(turn_id, None)
        self._runtime.pop(turn_id, None)
        self._where.pop(turn_id, None)
        self._stop_hooks.pop(turn_id, None)
        self._lost_leases.discard(turn_id)

    async def record(
        self,
        turn_id: str,
        *,
        transcript: str | None = None,
        reply: str | None = None,
        reply_unheard: str | None = None,
        merged_into: str | None = None,
    ) -> Turn:
        """Store the transcript, the reply as far as it was heard, the part
        generated but not heard (audit only) and/or the later turn this one
        was merged into (see :class:`turn.models.Turn`); None leaves a field
        as it is.

        Raises:
            turn.store.UnknownTurn: no such turn.
            turn.store.LeaseLost: it was taken over from this worker.
        """
        given = (("transcript", transcript), ("reply", reply), ("reply_unheard", reply_unheard), ("merged_into", merged_into))
        fields = {k: v for k, v in given if v is not None}
        log.debug("turn %s: recorded %s", turn_id, ", ".join(f"{k} {v if k == 'merged_into' else content(v)}" for k, v in fields.items()))
        fence = self.lease_fence(turn_id)
        return await self.store_call(lambda: self.store.update(turn_id, at=self.clock.now(), fence_owner=fence, **fields))

    async def get(self, turn_id: str) -> Turn:
        """The stored turn."""
        return await self.store_call(lambda: self.store.get(turn_id))
