"""Checkpoints (DESIGN.md "checkpoint"): the cheap check before and after
every model and tool call, and how the process running a turn learns that
it is stopping.

A checkpoint raises :class:`turn.stopped.TurnStopped`, never returns a
flag: a stop was requested (the in-process signal at once, the store at
most ``flag_staleness_s`` old), the deadline passed, the budget is spent,
the steps ran out, or the same tool call came three times in a row. The
store round trip that reads the stop flag also writes the turn's
heartbeat, step count and usage (:meth:`Checkpoints.sync`), so a turn
that reaches its checkpoints keeps its lease (:mod:`turn.lease`) fresh.

:class:`Checkpoints` is a part of :class:`turn.manager.TurnManager`, which
holds the state it reads (see the class's attributes).
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable, Callable
from typing import TYPE_CHECKING, Any, TypeVar

from clock import Clock
from turn.events import EventLogs
from turn.models import StopReasonKind, Turn, TurnStatus
from turn.runtime import LOOP_REPEATS, FlagCache, TurnRuntime
from turn.signals import StopSignals
from turn.stopped import TurnStopped
from turn.store import LeaseLost, TurnStore
from turn.usage import UsageMeter

log = logging.getLogger(__name__)

T = TypeVar("T")

#: how long a checkpoint waits for a stop of its turn being written here, s
#: (a store write takes milliseconds; a store that hangs is not waited out)
STOP_WRITE_WAIT_S = 1.0


class Checkpoints:
    """The worker's side of :class:`turn.manager.TurnManager`: checkpoints,
    the stop flag and the runtime state of the turns this process runs.

    It uses the manager's ``store_call`` and ``get``; the state below is
    the manager's (made in its ``__init__``).

    Attributes:
        store / clock / signals / events: the manager's.
        flag_staleness_s: how old (s) a cached stop-flag read may be.
        _runtime: the runtime of each turn run here.
        _owned: the turns leased to this process.
        _flags: stop-flag reads of owned turns without a runtime.
        _where: ``(session id, generation)`` of each turn run here.
        _stop_hooks: called once when a turn run here is found stopping.
    """

    store: TurnStore
    clock: Clock
    signals: StopSignals
    events: EventLogs
    flag_staleness_s: float
    _runtime: dict[str, TurnRuntime]
    _owned: set[str]
    _flags: dict[str, FlagCache]
    _where: dict[str, tuple[str, int]]
    _stop_hooks: dict[str, list[Callable[[], None]]]
    owner: str
    #: turns taken over from this worker (it stalled): nothing more is written from here
    _lost_leases: set[str]
    #: called with a turn's id when a sync finds it leased to another worker
    #: (this one stalled past the lease TTL and was taken over): the work
    #: here must end without writing anything more (None: only logged)
    on_lease_lost: Callable[[str], None] | None = None

    if TYPE_CHECKING:  # the manager's methods this part calls (turn.manager.TurnManager)

        async def store_call(self, fn: Callable[[], Awaitable[T]]) -> T: ...

        async def get(self, turn_id: str) -> Turn: ...

    def stop_event(self, turn_id: str) -> asyncio.Event:
        """An event set when ``turn_id`` is asked to stop (fast path only; see
        :meth:`stop_requested` for the authority)."""
        return self.signals.watch(turn_id)

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
            self._flags[turn_id] = FlagCache(True, self.clock.monotonic())
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
        self._flags[turn_id] = FlagCache(stopping, now)
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
        try:
            fence = self.lease_fence(turn_id)
            turn = await self.store_call(
                lambda: self.store.update(
                    turn_id,
                    at=now,
                    fence_owner=fence,
                    heartbeat_at=now,
                    step_count=rt.steps,
                    spent=rt.meter.spent(),
                    usage=rt.meter.usage(),
                )
            )
        except LeaseLost as exc:
            self._lease_lost(turn_id, exc.holder)
            raise TurnStopped(turn_id, "lease_lost") from exc
        if turn.status is not TurnStatus.RUNNING and not rt.stopping:
            self._mark_stopping(turn_id)
            self.signals.fire(turn_id)
        return turn

    def lease_fence(self, turn_id: str) -> str | None:
        """The owner a write of ``turn_id``'s row is fenced on: this
        worker's id while it holds the lease (None for a turn it does not
        run: a stop asked here for another worker's turn).

        Raises:
            LeaseLost: the turn was taken over from this worker: nothing
                more is written from here.
        """
        if turn_id in self._lost_leases:
            raise LeaseLost(turn_id, None)
        return self.owner if turn_id in self._owned else None

    def _lease_lost(self, turn_id: str, holder: str | None) -> None:
        """A fenced write found ``turn_id`` leased to ``holder``: this worker
        stalled past the TTL and was taken over. Its output is fenced at
        once, it beats no more, every later write of the turn's row from
        here raises, and its work is told to end (``on_lease_lost``)."""
        if turn_id in self._lost_leases:
            return
        log.warning("turn %s: its lease was taken over by %s (this worker stalled past the lease TTL): "
                    "its work here ends, writing nothing more", turn_id, holder or "nobody")
        self._mark_stopping(turn_id)  # its output gate closes
        self._owned.discard(turn_id)
        self._lost_leases.add(turn_id)
        if self.on_lease_lost is not None:
            self.on_lease_lost(turn_id)

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
        fence = self.lease_fence(turn_id)
        return await self.store_call(
            lambda: self.store.update(turn_id, at=self.clock.now(), fence_owner=fence, spent=meter.spent(), usage=meter.usage())
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
