"""The Turn Manager: owns every turn from acceptance to one terminal state.

All state changes go through the store's atomic compare-and-set; the manager
adds timestamps from the injected clock, retries a busy store, holds the
leases of the turns this process runs, sends stop signals, and tells
listeners about each applied change so transports can show it (e.g.
"stopping", then "cancelled").
"""

from __future__ import annotations

import asyncio
import json
import logging
import os
import socket
import uuid
from collections import deque
from collections.abc import Awaitable
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any, Callable, TypeVar

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_attempt, wait_exponential

from turn.clock import Clock
from turn.events import EventLogs
from turn.ledger import Ledger
from turn.reconciliation import ReconciliationWorker
from turn.models import Budget, Plan, Session, StopReason, StopReasonKind, Turn, TurnKind, TurnStatus
from turn.scope import LIMIT_KINDS, NotStarted, TurnScope, TurnStopped, terminal_status
from turn.signals import StopSignals
from turn.states import TransitionResult
from turn.store import StopAnswer, StopResult, StoreUnavailable, TurnStore, UnknownSession
from turn.usage import Pricing, UsageMeter

log = logging.getLogger(__name__)

T = TypeVar("T")

#: attempts for a store call that failed with StoreUnavailable (nothing written)
STORE_ATTEMPTS = 4

TurnListener = Callable[[Turn], None]


__all__ = ["TurnManager", "TurnStopped", "NotStarted", "LIMIT_KINDS", "TurnRuntime", "turn_event"]

#: how many identical tool calls in a row are a loop
LOOP_REPEATS = 3
#: how long a checkpoint waits for a stop of its turn being written here, s
#: (a store write takes milliseconds; a store that hangs is not waited out)
STOP_WRITE_WAIT_S = 1.0


@dataclass
class _FlagCache:
    stopping: bool
    read_at: float


@dataclass
class TurnRuntime:
    """What this process keeps of a turn it runs, so that a checkpoint
    costs no store round trip most of the time.

    Attributes:
        deadline: the absolute deadline on ``clock.monotonic()`` (None: none).
        budget: spending limits.
        max_steps: model and tool calls allowed.
        steps: model and tool calls started.
        meter: the turn's model usage.
        recent_tools: the last tool calls, as ``(name, canonical JSON args)``.
        stopping: a stop was seen (signal or store).
        synced_at: monotonic time of the last store round trip.
        stop_writes: stop requests for it being recorded by this process
            right now; a checkpoint waits for them (see
            :meth:`TurnManager.checkpoint`).
    """

    turn_id: str
    deadline: float | None
    budget: Budget
    max_steps: int
    meter: UsageMeter
    steps: int = 0
    recent_tools: deque[tuple[str, str]] = field(default_factory=lambda: deque(maxlen=LOOP_REPEATS))
    stopping: bool = False
    synced_at: float = 0.0
    stop_writes: set[asyncio.Future[None]] = field(default_factory=set)

    def over_budget(self, expected_tokens: int = 0) -> str | None:
        """Why the budget is spent, or cannot pay for ``expected_tokens``
        more prompt tokens (None if it can)."""
        spent = self.meter.spent()
        if self.budget.tokens is not None and spent.tokens >= self.budget.tokens:
            return f"{spent.tokens} of {self.budget.tokens} tokens used"
        if self.budget.tokens is not None and expected_tokens and spent.tokens + expected_tokens > self.budget.tokens:
            return f"the next step needs about {expected_tokens} tokens, {self.budget.tokens - spent.tokens} left"
        cents = spent.cents + self.meter.pricing.cents(expected_tokens, 0)
        if self.budget.cents is not None and cents > 0 and cents >= self.budget.cents:
            return f"{cents:.4f} of {self.budget.cents} cents spent or needed"
        return None


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
        #: the side-effect ledger of every turn; ``ledger.handlers`` is set
        #: by whoever knows the tools (the app)
        self.ledger = Ledger(store, clock, emit=self._ledger_event, store_call=self.store_call)
        self._where: dict[str, tuple[str, int]] = {}
        self._listeners: dict[str, list[TurnListener]] = {}
        self._owned: set[str] = set()
        self._flags: dict[str, _FlagCache] = {}
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

    async def _ledger_event(self, turn_id: str, type: str, payload: dict[str, Any]) -> None:
        """A ledger change, logged in the turn's session as an event."""
        where = self._where.get(turn_id)
        if where is None:
            turn = await self.get(turn_id)
            where = (turn.session_id, turn.generation)
        self.events.log(where[0]).emit(type, generation=where[1], turn_id=turn_id, **payload)

    def reconciliation_worker(self, interval_s: float = 1.0) -> ReconciliationWorker:
        """A worker that settles the ledger rows stops and crashes left open."""

        async def stop_kind(turn_id: str) -> tuple[StopReasonKind | None, bool]:
            turn = await self.get(turn_id)
            if turn.stop_reason is None or turn.status is TurnStatus.COMPLETED:
                return None, turn.is_terminal  # a stop that came after the final step changed nothing
            return turn.stop_reason.kind, turn.is_terminal

        return ReconciliationWorker(self.ledger, stop_kind, interval_s=interval_s)

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

    def stop_event(self, turn_id: str) -> asyncio.Event:
        """An event set when ``turn_id`` is asked to stop (fast path only; see
        :meth:`stop_requested` for the authority)."""
        return self.signals.watch(turn_id)

    def release(self, turn_id: str) -> None:
        """The worker of ``turn_id`` ended here: stop watching and leasing it."""
        self.signals.forget(turn_id)
        self._owned.discard(turn_id)
        self._flags.pop(turn_id, None)
        self._runtime.pop(turn_id, None)
        self._where.pop(turn_id, None)
        self._stop_hooks.pop(turn_id, None)

    def runtime(self, turn_id: str) -> TurnRuntime | None:
        """This process's runtime state of a turn it runs (None otherwise)."""
        return self._runtime.get(turn_id)

    def on_stopping(self, turn_id: str, hook: Callable[[], None]) -> None:
        """Call ``hook()`` synchronously, once, in the step in which this
        process learns that ``turn_id`` (a turn it runs) is stopping: the
        stop's compare-and-set here, or its signal from another instance.
        A voice session silences the turn's audio there. Hooks are dropped
        when the turn is released; a failing hook is logged."""
        self._stop_hooks.setdefault(turn_id, []).append(hook)

    def stopping_now(self, turn_id: str) -> bool:
        """Whether this process already knows that ``turn_id`` is stopping
        (no I/O: the flag set in the step that recorded or heard the stop).
        The delivery gate of its output is closed from that step on."""
        rt = self._runtime.get(turn_id)
        return rt is not None and rt.stopping

    def _mark_stopping(self, turn_id: str) -> None:
        """This process learns that ``turn_id`` is stopping: in the same
        step, its output gate closes (the session's event log fences its
        output from now on), its meter counts waste, and its stop hooks run
        (see :meth:`on_stopping`); waiters wake only after."""
        rt = self._runtime.get(turn_id)
        if rt is not None:
            first = not rt.stopping
            rt.stopping = True
            rt.meter.mark_stopped()
        elif turn_id in self._owned:
            first = not (turn_id in self._flags and self._flags[turn_id].stopping)
            self._flags[turn_id] = _FlagCache(True, self.clock.monotonic())
        else:
            return
        where = self._where.get(turn_id)
        if where is not None:
            self.events.log(where[0]).close_turn(turn_id)
        if not first:
            return
        for hook in self._stop_hooks.pop(turn_id, []):
            try:
                hook()
            except Exception:
                log.exception("stop hook of turn %s failed", turn_id)

    async def stop_requested(self, turn_id: str) -> bool:
        """Whether a stop was requested: at once if a signal arrived, else
        from a store read no older than ``flag_staleness_s``."""
        if self.signals.watch(turn_id).is_set():
            self._mark_stopping(turn_id)
            return True
        rt = self._runtime.get(turn_id)
        if rt is not None:
            if not rt.stopping and self.clock.monotonic() - rt.synced_at > self.flag_staleness_s:
                await self.sync(turn_id)
            return rt.stopping
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

    async def sync(self, turn_id: str) -> Turn:
        """One store round trip for a turn this process runs: write its
        heartbeat, step count, spending and usage, and read back whether it
        is still RUNNING (a stop asked elsewhere shows here)."""
        rt = self._runtime[turn_id]
        now = self.clock.now()
        rt.synced_at = self.clock.monotonic()
        turn = await self.store_call(
            lambda: self.store.update(
                turn_id,
                at=now,
                heartbeat_at=now,
                step_count=rt.steps,
                spent=rt.meter.spent(),
                usage=rt.meter.usage(),
            )
        )
        if turn.status is not TurnStatus.RUNNING and not rt.stopping:
            self._mark_stopping(turn_id)
            self.signals.fire(turn_id)
        return turn

    async def flush(self, turn_id: str, meter: UsageMeter | None = None) -> Turn:
        """Write a turn's usage, spending and step count now (before its
        terminal write, and again if a provider that ignored its
        cancellation produced more afterwards: pass that ``meter`` once the
        turn is released)."""
        rt = self._runtime.get(turn_id)
        if rt is not None:
            return await self.sync(turn_id)
        if meter is None:
            return await self.get(turn_id)
        return await self.store_call(
            lambda: self.store.update(turn_id, at=self.clock.now(), spent=meter.spent(), usage=meter.usage())
        )

    async def checkpoint(
        self, turn_id: str, phase: str, *, tool_call: tuple[str, Any] | None = None, expected_tokens: int = 0
    ) -> None:
        """The cheap check before and after every model and tool call (and
        during a model stream). It raises, never returns a flag.

        A phase starting with ``before_`` starts a step (a model or tool
        call) and counts it. The checks, in order: a stop was requested
        (signal at once; the store at most ``flag_staleness_s`` old), the
        deadline has passed, the budget is spent, more than ``max_steps``
        steps, and (with ``tool_call``, a ``(name, arguments)`` pair) the
        last three tool calls were the same call. Every ``flag_staleness_s``
        it writes the heartbeat, step count and usage, in the same store
        round trip that reads the stop flag. ``expected_tokens``: what the
        step about to start will use at least (a model call's prompt), so a
        call the budget cannot pay for is not started.

        Raises:
            TurnStopped: the turn must not go on; ``kind`` is set (deadline,
                budget, max steps, loop) when the turn stopped itself, None
                when a stop was asked.
        """
        rt = self._runtime.get(turn_id)
        if rt is not None and rt.stop_writes:
            # a stop is being recorded here: decide once it is (bounded)
            await asyncio.wait(set(rt.stop_writes), timeout=STOP_WRITE_WAIT_S)
        if rt is not None:
            if phase.startswith("before_"):
                rt.steps += 1
            if tool_call is not None:
                name, args = tool_call
                rt.recent_tools.append((name, json.dumps(args, sort_keys=True, default=str)))
        if await self.stop_requested(turn_id):
            raise TurnStopped(turn_id, phase)
        if rt is None:
            return
        stop: TurnStopped | None = None
        if rt.deadline is not None and self.clock.monotonic() >= rt.deadline:
            stop = TurnStopped(turn_id, phase, StopReasonKind.DEADLINE_EXCEEDED, "the turn's deadline passed")
        elif (why := rt.over_budget(expected_tokens)) is not None:
            stop = TurnStopped(turn_id, phase, StopReasonKind.BUDGET_EXCEEDED, why)
        elif rt.steps > rt.max_steps:
            stop = TurnStopped(turn_id, phase, StopReasonKind.MAX_STEPS, f"step {rt.steps} of at most {rt.max_steps}")
        elif tool_call is not None and len(rt.recent_tools) == LOOP_REPEATS and len(set(rt.recent_tools)) == 1:
            name = rt.recent_tools[-1][0]
            stop = TurnStopped(turn_id, phase, StopReasonKind.LOOP_DETECTED, f"{name} called {LOOP_REPEATS} times with the same arguments")
        if stop is not None:
            rt.meter.mark_stopped()  # whatever streams from now on is waste
            raise stop

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
        :func:`turn.scope.terminal_status`). A turn already terminal (it
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
                stop = res.turn.stop_reason or reason
                remains = await self.ledger.resolve_on_stop(turn.id, stop.kind, stop.at)
                moved = await (self.reconcile_required(turn.id) if remains else self.confirm_stopped(turn.id))
                res = StopResult(answer=res.answer, first=res.first, repeat=res.repeat, turn=moved.turn)
            stopped.append(res.turn)
            log.warning("recovered turn %s left %s by %s", turn.id, turn.status, turn.lease_owner or "nobody")
        return stopped

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
        """
        given = (("transcript", transcript), ("reply", reply), ("reply_unheard", reply_unheard), ("merged_into", merged_into))
        fields = {k: v for k, v in given if v is not None}
        return await self.store_call(lambda: self.store.update(turn_id, at=self.clock.now(), **fields))

    async def get(self, turn_id: str) -> Turn:
        """The stored turn."""
        return await self.store_call(lambda: self.store.get(turn_id))
