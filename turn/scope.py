"""Cancel scopes: the turn's cancellation tree (DESIGN.md "cancel scope").

A turn's work (STT finalization, retrieval, the model stream, tools, TTS,
playout) runs as *children* of the turn's :class:`TurnScope`, on an
``asyncio.TaskGroup``. A stop carries one structured reason to every child;
each child reports how it ended (:class:`turn.models.ChildOutcome`) within a
bounded grace, and the turn's terminal state is written from those
reports (:func:`turn.stop_path.terminal_status`). The scope never exits
before its last child has ended, so no child outlives its turn; a child
that ignores its cancellation is reported ``ignored_cancel`` when the grace
runs out, cancelled again, and still awaited. What a child raises to stop
the turn is :class:`turn.stopped.TurnStopped`.

Time limits: each child gets ``min(its own maximum, the turn's remaining
time minus a shutdown reserve)``; the turn's deadline cutting a child short
stops the whole turn with ``deadline_exceeded``. A child that declares an
expected duration longer than the time left is not started at all
(:class:`NotStarted`).
"""

from __future__ import annotations

import asyncio
import contextvars
import logging
import weakref
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime
from typing import Any, TypeVar

from clock import Clock, timeout_after
from turn.models import ChildOutcome, ChildReport, StopReason, StopReasonKind, StopReport
from turn.scope_observer import ChildRun, ScopeObservers
from turn.stopped import TurnStopped

log = logging.getLogger(__name__)

T = TypeVar("T")

#: default bound (s) on how long children may take to report after a stop
STOP_GRACE_S = 0.25
#: how long (s) a stop waits for the turn's own final write already under way
FINAL_WRITE_WAIT_S = 5.0

class NotStarted(TurnStopped):
    """A child was not started: the time left is shorter than the duration
    it declared (reason ``no_budget``); the turn ends ``deadline_exceeded``.

    Attributes:
        name: the child that was not started.
        expected_s / remaining_s: what it needed and what was left, s.
    """

    def __init__(self, turn_id: str, name: str, expected_s: float, remaining_s: float) -> None:
        super().__init__(
            turn_id,
            f"before {name}",
            StopReasonKind.DEADLINE_EXCEEDED,
            f"{name} expects {expected_s * 1000:.0f} ms, {max(0.0, remaining_s) * 1000:.0f} ms left",
        )
        self.name = name
        self.expected_s = expected_s
        self.remaining_s = remaining_s


@dataclass
class Child:
    """One child of a scope, while it runs and after."""

    name: str
    task: asyncio.Task[Any] | None = None
    outcome: ChildOutcome | None = None
    error: BaseException | None = None
    ended_at: float | None = None
    #: it ended after the scope was stopped
    ended_after_stop: bool = False
    #: inside a must-complete section now
    committing: bool = False
    #: a must-complete section of it ended after the stop request
    committed_after_stop: bool = False
    #: it was reported ignored_cancel (and cancelled again) once already
    reported_ignored: bool = False
    result: Any = None
    #: its coroutine returned (it was not cut short)
    returned: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)
    #: when it was started (UTC, the scope's clock)
    started_at: datetime | None = None
    #: moments it marked (:func:`mark`) on its scope's clock (None: not observed)
    marks: list[tuple[str, datetime]] = field(default_factory=list)
    now: Callable[[], datetime] | None = None


#: the child whose task is running (a weak reference: every timer a child
#: starts, e.g. an ``asyncio.sleep`` or its own time limit, copies the
#: context it was started in into its ``TimerHandle``, and asyncio keeps a
#: cancelled handle, context and all, until its time would have come; a
#: strong reference there kept each child, its task, its exception and every
#: frame of its turn (the whole voice session) alive for the turn's deadline,
#: 300 s by default)
_current_child: contextvars.ContextVar[weakref.ref[Child] | None] = contextvars.ContextVar(
    "turnkeeper_child", default=None
)


class TurnScope:
    """The root of one turn's cancellation tree.

    Use as ``async with TurnScope(...) as scope:``; start children with
    :meth:`spawn` or :meth:`run`; stop them all with :meth:`stop`; collect
    their reports with :meth:`settle`. Leaving the ``async with`` waits for
    every child (cancelling again any that is still running).

    Args:
        turn_id: the turn (for messages and :class:`TurnStopped`).
        clock: time source for limits and the grace.
        grace_s: how long children may take to report after a stop, s.
        deadline: the turn's absolute deadline on ``clock.monotonic()``
            (None: no deadline).
        shutdown_reserve_s: time kept back from every child for the turn's
            own wind-down (writing its terminal state), s.
        observer: told of each child's start and end, the stop and its
            report (:mod:`turn.scope_observer`; traces and metrics). None:
            nobody.
    """

    def __init__(
        self,
        turn_id: str,
        clock: Clock,
        *,
        grace_s: float = STOP_GRACE_S,
        deadline: float | None = None,
        shutdown_reserve_s: float = 0.25,
        observer: ScopeObservers | None = None,
    ) -> None:
        self.turn_id = turn_id
        self.observer = observer if observer else None
        self._observed_settle = False
        self.clock = clock
        self.grace_s = grace_s
        self.deadline = deadline
        self.shutdown_reserve_s = shutdown_reserve_s
        #: the stop every child was given (the first one wins)
        self.reason: StopReason | None = None
        #: the kind when the turn stopped itself (a limit), else None
        self.limit: TurnStopped | None = None
        self.stop_requested_at: float | None = None
        self.stopped = asyncio.Event()
        self.children: list[Child] = []
        self._final: asyncio.Future[Any] | None = None
        #: a stop waiting for the must-complete sections under way to end
        self._deferred: Callable[[], StopReason] | None = None
        self._commits_done = asyncio.Event()
        self._commits_done.set()
        self._tg = asyncio.TaskGroup()
        self._entered = False

    async def __aenter__(self) -> TurnScope:
        await self._tg.__aenter__()
        self._entered = True
        return self

    async def __aexit__(self, et: Any, exc: Any, tb: Any) -> None:
        if et is not None:
            # The owner failed or was cancelled: nothing of the turn goes on.
            for child in self.children:
                if child.task is not None and not child.task.done():
                    child.task.cancel()
        try:
            await self._tg.__aexit__(et, exc, tb)  # it raises or returns None: never suppresses
        finally:
            self._entered = False

    # -- time ------------------------------------------------------------------

    def remaining_s(self) -> float | None:
        """Time a child may still use, s: until the deadline, less the
        shutdown reserve (None: no deadline; may be negative)."""
        if self.deadline is None:
            return None
        return self.deadline - self.shutdown_reserve_s - self.clock.monotonic()

    def limit_for(self, max_s: float | None) -> tuple[float | None, bool]:
        """A child's time limit, s: ``min(max_s, remaining_s())``, and
        whether the turn's deadline is what binds it."""
        remaining = self.remaining_s()
        if remaining is None:
            return max_s, False
        if max_s is None or remaining < max_s:
            return remaining, True
        return max_s, False

    # -- children --------------------------------------------------------------

    def spawn(self, name: str, coro: Coroutine[Any, Any, T], *, max_s: float | None = None) -> Child:
        """Start ``coro`` as a child named ``name``, limited to
        ``limit_for(max_s)`` seconds. Its exception is kept in its report
        (and raised by :meth:`wait`), never thrown into the scope's other
        children; a :class:`TurnStopped` it raises stops the whole scope
        with that reason.

        Raises:
            RuntimeError: the scope is not entered.
            TurnStopped: the turn was already stopped (``coro`` is closed
                unstarted), or its deadline has passed.
        """
        if not self._entered:
            coro.close()
            raise RuntimeError("the scope is not entered")
        if self.stopped.is_set():
            coro.close()
            raise self.limit or TurnStopped(self.turn_id, f"before {name}")
        limit, bound_by_deadline = self.limit_for(max_s)
        if limit is not None and limit <= 0 and bound_by_deadline:
            coro.close()
            exc = TurnStopped(self.turn_id, f"before {name}", StopReasonKind.DEADLINE_EXCEEDED, "no time left")
            self.stop_self(exc)
            raise exc
        child = Child(name)
        self.children.append(child)
        if self.observer is not None:
            child.started_at, child.now = self.clock.now(), self.clock.now
            self.observer.child_started(ChildRun(self.turn_id, name, child.started_at))
        child.task = self._tg.create_task(self._run_child(child, coro, limit, bound_by_deadline), name=f"{self.turn_id[:8]}:{name}")
        child.task.add_done_callback(lambda _t: self._child_done(child, coro))
        return child

    def _child_done(self, child: Child, coro: Coroutine[Any, Any, Any]) -> None:
        """The child's task ended, even if it was cancelled before it ever
        ran (then ``coro`` is closed unstarted and it reports ``stopped``)."""
        if child.outcome is None:
            child.outcome = ChildOutcome.STOPPED
        if child.ended_at is None:
            child.ended_at = self.clock.monotonic()
            child.ended_after_stop = self.stopped.is_set()
        coro.close()
        child.done.set()
        if self.observer is not None and child.started_at is not None:
            self.observer.child_ended(ChildRun(
                self.turn_id, child.name, child.started_at, self.clock.now(), child.outcome, child.ended_after_stop,
                tuple(child.marks), _detail(child.error),
            ))

    async def run(
        self,
        name: str,
        coro: Coroutine[Any, Any, T],
        *,
        max_s: float | None = None,
        expected_s: float | None = None,
    ) -> T:
        """Run ``coro`` as a child and wait for its result.

        Args:
            expected_s: how long it declares it takes, s; it is not started
                if less time is left.

        Raises:
            NotStarted: less than ``expected_s`` is left (the turn is
                stopped with ``deadline_exceeded``).
            TurnStopped: the turn was stopped (before or while it ran).
            Exception: whatever ``coro`` raised.
        """
        if expected_s is not None:
            remaining = self.remaining_s()
            if remaining is not None and remaining < expected_s:
                coro.close()
                exc = NotStarted(self.turn_id, name, expected_s, remaining)
                self.stop_self(exc)
                raise exc
        return await self.wait(self.spawn(name, coro, max_s=max_s))

    async def wait(self, child: Child) -> Any:
        """Wait for ``child`` and return its result.

        Raises:
            TurnStopped: it ended because of a stop.
            Exception: what it raised.
        """
        await child.done.wait()
        if child.error is not None:
            raise child.error
        if not child.returned:
            raise self.limit or TurnStopped(self.turn_id, child.name)
        return child.result

    async def _run_child(self, child: Child, coro: Coroutine[Any, Any, Any], limit: float | None, bound: bool) -> None:
        token = _current_child.set(weakref.ref(child))
        time_limit = timeout_after(self.clock, limit)
        try:
            async with time_limit:
                child.result = await coro
            child.returned = True
            child.outcome = ChildOutcome.COMMITTING if child.committed_after_stop else ChildOutcome.COMPLETED
        except asyncio.CancelledError:
            child.outcome = ChildOutcome.COMMITTING if child.committed_after_stop else ChildOutcome.STOPPED
            raise
        except TimeoutError as exc:
            if not time_limit.expired:  # raised by the child's own work (a socket timeout, say): a failure
                child.outcome = ChildOutcome.FAILED
                child.error = exc
            elif bound:
                stop = TurnStopped(self.turn_id, child.name, StopReasonKind.DEADLINE_EXCEEDED, "the turn's deadline")
                child.outcome = ChildOutcome.STOPPED
                self.stop_self(stop)
            else:
                child.outcome = ChildOutcome.FAILED
                child.error = TimeoutError(f"{child.name} ran longer than its limit of {limit:.3f} s")
                child.error.__cause__ = exc
        except TurnStopped as exc:
            child.outcome = ChildOutcome.COMMITTING if child.committed_after_stop else ChildOutcome.STOPPED
            if exc.kind is not None:
                self.stop_self(exc)
            elif not self.stopped.is_set():
                self._stop(None)
        except Exception as exc:
            child.outcome = ChildOutcome.FAILED
            child.error = exc
        finally:
            _current_child.reset(token)
            child.ended_at = self.clock.monotonic()
            child.ended_after_stop = self.stopped.is_set()

    async def commit(self, work: Awaitable[T], *, effect: bool = True) -> T:
        """Run ``work`` as a must-complete section of the calling child: a
        stop (or any cancellation) waits until it has finished, then takes
        effect. Keep it short: it is what a stop cannot interrupt.

        Args:
            effect: the section changes the outside world (a tool's write);
                finishing it after a stop makes the child report
                ``committing``. False for the turn's own bookkeeping (its
                final record and COMPLETED write).

        Returns:
            ``work``'s result.

        Raises:
            asyncio.CancelledError: the child was cancelled meanwhile
                (raised after ``work`` finished, never swallowed).
            TurnStopped: the turn was stopped meanwhile (after ``work``
                finished; the child reports ``committing``).
            Exception: what ``work`` raised.
        """
        ref = _current_child.get()
        child = ref() if ref is not None else None
        inner = asyncio.ensure_future(work)
        if child is not None and effect:
            child.committing = True
            self._commits_done.clear()
        if not effect:
            self._final = inner  # a stop's settle waits for it: the turn may be completing
        cancelled = False
        try:
            while not inner.done():
                try:
                    await asyncio.shield(inner)
                except asyncio.CancelledError:
                    if not inner.done():
                        cancelled = True  # delivered below, once the section is done
        finally:
            if child is not None and effect:
                child.committing = False
                if self.stopped.is_set():
                    child.committed_after_stop = True
                if not self.committing:
                    self._commits_done.set()
                    deferred, self._deferred = self._deferred, None
                    if deferred is not None:
                        # Synchronously, before this child takes another step.
                        self.stop(deferred())
        result = inner.result()
        if cancelled:
            raise asyncio.CancelledError
        if self.stopped.is_set():
            raise self.limit or TurnStopped(self.turn_id, "after commit")
        return result

    # -- stopping --------------------------------------------------------------

    def stop(self, reason: StopReason | None) -> bool:
        """Stop every child with ``reason`` (None: it was asked from
        outside and is recorded in the store). Returns False if the scope
        was already stopped (the first reason stands)."""
        if self.stopped.is_set():
            return False
        self._stop(reason)
        return True

    @property
    def committing(self) -> bool:
        """A child is inside a must-complete section with an effect now."""
        return any(c.committing for c in self.children)

    def stop_after_commits(self, reason: Callable[[], StopReason]) -> bool:
        """Stop once no must-complete section is under way: now if none is,
        else the moment the last one ends (synchronously, before its child
        takes another step). ``reason`` is called then, so the stop's time is
        the time it took effect. This is the non-interruptible window of a
        voice barge-in: the audio is silenced at once, the turn stopped after
        the commit. Returns True if the stop happened now."""
        if self.stopped.is_set():
            return True
        if not self.committing:
            self.stop(reason())
            return True
        if self._deferred is None:
            self._deferred = reason
        return False

    async def commits_done(self) -> None:
        """Return once no must-complete section is under way."""
        while self.committing:
            self._commits_done.clear()
            await self._commits_done.wait()

    def stop_self(self, exc: TurnStopped) -> None:
        """The turn stops itself (a limit, see ``exc.kind``)."""
        if self.stopped.is_set():
            return
        assert exc.kind is not None
        self.limit = exc
        self._stop(StopReason(kind=exc.kind, initiator="checkpoint", at=self.clock.now(), detail=exc.detail))

    def _stop(self, reason: StopReason | None) -> None:
        self.reason = reason
        self.stop_requested_at = self.clock.monotonic()
        self.stopped.set()
        if self.observer is not None:
            self.observer.scope_stopped(self.turn_id, reason, self.clock.now())
        current = asyncio.current_task()
        for child in self.children:
            if child.task is not None and not child.task.done() and child.task is not current:
                child.task.cancel(msg=f"turn stopped: {reason.kind.value if reason else 'asked'}")

    async def settle(self) -> StopReport:
        """Wait up to ``grace_s`` for every child to end, then report. A
        child still running then is reported ``ignored_cancel`` (or
        ``committing`` while in a must-complete section with an effect) and
        cancelled again; the scope still waits for it when it exits. The
        turn's own final write (a ``commit(..., effect=False)``) under way is
        waited for, up to ``FINAL_WRITE_WAIT_S``: the turn may be completing.
        Safe to call again (later calls report what is true then)."""
        started = self.stop_requested_at if self.stop_requested_at is not None else self.clock.monotonic()
        pending = [c for c in self.children if not c.done.is_set()]
        if pending:
            waiters = [asyncio.ensure_future(c.done.wait()) for c in pending]
            grace = asyncio.ensure_future(self.clock.sleep(max(0.0, started + self.grace_s - self.clock.monotonic())))
            all_done = asyncio.ensure_future(asyncio.wait(waiters))
            try:
                await asyncio.wait({all_done, grace}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                grace.cancel()
                for w in waiters:
                    w.cancel()
                all_done.cancel()
        if self._final is not None and not self._final.done():
            await asyncio.wait({self._final}, timeout=FINAL_WRITE_WAIT_S)
            await asyncio.sleep(0)  # let the child that wrote it end
        reports = []
        for c in self.children:
            if c.done.is_set():
                ms = None if c.ended_at is None or not c.ended_after_stop else round((c.ended_at - started) * 1000, 3)
                reports.append(ChildReport(name=c.name, outcome=c.outcome or ChildOutcome.STOPPED, ms=ms, detail=_detail(c.error)))
            else:
                outcome = ChildOutcome.COMMITTING if c.committing else ChildOutcome.IGNORED_CANCEL
                reports.append(ChildReport(name=c.name, outcome=outcome, detail="still running after the grace"))
                if c.task is not None and not c.committing and not c.reported_ignored:
                    c.reported_ignored = True
                    c.task.cancel()
                    log.warning("turn %s: child %s ignored its cancellation", self.turn_id, c.name)
        report = StopReport(
            children=reports,
            settled_ms=round((self.clock.monotonic() - started) * 1000, 3),
            grace_ms=self.grace_s * 1000,
        )
        if self.observer is not None and not self._observed_settle:  # the first report: a repeat would count twice
            self._observed_settle = True
            self.observer.scope_settled(self.turn_id, report, self.clock.now())
        return report


def mark(name: str) -> None:
    """Mark a moment of the calling child's work (``first_token``,
    ``first_audio``...) for its scope's observers: the first mark of each
    name counts. Nothing happens outside a child or when nobody observes."""
    ref = _current_child.get()
    child = ref() if ref is not None else None
    if child is not None and child.now is not None and all(n != name for n, _ in child.marks):
        child.marks.append((name, child.now()))


def _detail(error: BaseException | None) -> str | None:
    return None if error is None else f"{type(error).__name__}: {error}"
