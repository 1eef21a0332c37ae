"""The event log: written in order, read by followers.

Every event a client sees is first appended to its session's log in the
store (which assigns ``seq``: 1, 2, 3, ... per session); clients only ever
receive events read back from the log, by a :class:`EventFollower` (the
WebRTC data channel, an SSE stream). So each event is persisted before it is
sent, a reconnecting client can replay exactly what it missed, and events
written by any instance (a stop accepted elsewhere) reach every follower.

The delivery gate (:mod:`turn.delivery_gate`) is applied to a turn's
output when the event is made, again once it is persisted, and by a
follower that holds the session's fence, however late the event arrives:
output it withholds is logged marked ``fenced`` (audit evidence) and never
delivered. A stopped turn's gate closes in the same step that records its
stop: a writer and a follower see its "turn" event pass
(:class:`turn.delivery_gate.StoppedTurns`), and the writer also closes it on
a stop signal from another instance (:meth:`SessionEventLog.close_turn`).
"""

from __future__ import annotations

import asyncio
import functools
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Protocol, TypeVar

from tenacity import AsyncRetrying, before_sleep_log, retry_if_exception_type, wait_exponential

from clock import Clock
from turn.conformance import CONFORMANCE
from turn.delivery_gate import OUTPUT_TYPES, Gate, OpenGate, StoppedTurns
from turn.event_catalogue import Envelope, payload_of
from turn.models import EventRecord
from turn.store import StoreUnavailable, TurnStore

log = logging.getLogger(__name__)

T = TypeVar("T")

Retry = Callable[[Callable[[], Awaitable[T]]], Awaitable[T]]


async def _no_retry(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


class EventSink(Protocol):
    """Where an emitter's catalogue events go: :meth:`SessionEventLog.emit_event`,
    or anything shaped like it (the agent session's sink, a test's list).

    ``event`` is a :mod:`turn.event_catalogue` model whose ``generation``
    and ``turn_id`` the emitter set; ``withheld``: output of a turn already
    stopped (logged fenced, never delivered).
    """

    def __call__(self, event: Envelope, *, withheld: bool = False) -> None: ...


def event_json(event: EventRecord) -> dict[str, Any]:
    """What a client receives: the payload's fields beside ``type``, ``seq``,
    ``turn_id``, ``generation`` and ``at`` (Unix seconds, 3 decimals)."""
    out: dict[str, Any] = dict(event.payload)
    out.update(
        type=event.type,
        seq=event.seq,
        turn_id=event.turn_id if event.turn_id is not None else out.get("turn_id"),
        generation=event.generation,
        at=round(event.at.timestamp(), 3),
    )
    return out


class SessionEventLog:
    """One session's ordered writer: events are appended in the order they
    were emitted, one at a time.

    Args:
        store: where the log lives.
        session_id: whose log (the session must exist in the store).
        clock: stamps ``at``.
        gate: the session's delivery gate (an open gate if None).
        retry: wraps each store call (e.g. ``TurnManager.store_call``).
        max_queue: events waiting to be written at most; more are dropped
            (and counted in ``lost``).
        on_idle: called when everything emitted is written.
        taps: called with each event as it is emitted (shared with
            :class:`EventLogs`: metrics); a failing tap is logged.
    """

    def __init__(
        self,
        store: TurnStore,
        session_id: str,
        clock: Clock,
        gate: Gate | None = None,
        *,
        retry: Retry[Any] = _no_retry,
        max_queue: int = 10_000,
        on_idle: Callable[[SessionEventLog], None] | None = None,
        taps: list[Callable[[EventRecord], None]] | None = None,
    ) -> None:
        self.store = store
        self.taps = taps if taps is not None else []
        self.session_id = session_id
        self.clock = clock
        self.gate: Gate = gate or OpenGate()
        self.retry = retry
        self.max_queue = max_queue
        self.on_idle = on_idle
        self._queue: asyncio.Queue[EventRecord | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self._idle = asyncio.Event()
        self._idle.set()
        #: turns whose output is closed (their stop passed through here)
        self.stopped = StoppedTurns()
        self.persisted = 0
        self.fenced = 0
        self.lost = 0
        self.last_seq = 0
        #: text of ``agent.delta`` events logged deliverable, for the turns
        #: that asked (:meth:`track_delivery`)
        self._delivered: dict[str, list[str]] = {}

    def track_delivery(self, turn_id: str) -> None:
        """Keep the text of ``turn_id``'s ``agent.delta`` events that are
        logged deliverable (what a client following the log can have
        received), until :meth:`take_delivered`."""
        self._delivered.setdefault(turn_id, [])

    def take_delivered(self, turn_id: str) -> str:
        """The text of ``turn_id``'s ``agent.delta`` events logged
        deliverable so far, in order ("" if none, or not tracked); stops
        tracking it. Call :meth:`flush` first to count everything emitted."""
        return "".join(self._delivered.pop(turn_id, []))

    def emit(
        self, type: str, *, generation: int, turn_id: str | None = None, withheld: bool = False, **payload: Any
    ) -> None:
        """Queue an event; never blocks. Output types are fenced at once if
        their generation is already obsolete or their turn has stopped (its
        stop passed through this log, or :meth:`close_turn`), and so is any
        event passed ``withheld=True`` (output of a turn already stopped, e.g.
        from a provider that ignored its cancellation).

        The event is checked against the catalogue first
        (:mod:`turn.conformance`: logged anyway in production).

        Raises:
            turn.event_catalogue.EventMismatch: it does not match, and the
                check is strict (tests).
        """
        CONFORMANCE.check(type, {**payload, "generation": generation, "turn_id": turn_id})
        self._append(type, generation, turn_id, withheld, payload)

    def emit_event(self, event: Envelope, *, withheld: bool = False) -> None:
        """Queue a catalogue event (:mod:`turn.event_catalogue`), as
        :meth:`emit` does; its ``generation`` and ``turn_id`` say where it
        belongs, its other fields are the payload (those it was given).

        Raises:
            ValueError: ``event`` has no generation.
        """
        if event.generation is None:
            raise ValueError(f"a {event.type} event needs its generation to be logged")
        self._append(event.type, event.generation, event.turn_id, withheld, payload_of(event))

    def _append(self, type: str, generation: int, turn_id: str | None, withheld: bool, payload: dict[str, Any]) -> None:
        self.stopped.see(type, turn_id, payload)
        withheld = withheld or self.stopped.withholds(type, turn_id)
        event = EventRecord(
            session_id=self.session_id,
            turn_id=turn_id,
            generation=generation,
            type=type,
            at=self.clock.now(),
            payload=payload,
            fenced=withheld or (type in OUTPUT_TYPES and not self.gate.passes(generation)),
        )
        for tap in self.taps:
            try:
                tap(event)
            except Exception:  # a broken observer (metrics) must not break the log
                log.exception("event tap failed")
        if self._queue.qsize() >= self.max_queue:
            self.lost += 1
            log.warning("session %s: event queue full, dropping %s", self.session_id, type)
            return
        self._idle.clear()
        self._queue.put_nowait(event)
        if self._task is None or self._task.done():
            self._task = asyncio.get_running_loop().create_task(self._write(), name=f"events-{self.session_id}")

    def close_turn(self, turn_id: str) -> None:
        """Close ``turn_id``'s output at once (its stop was recorded, here or
        on another instance): whatever it emits from now on is fenced."""
        self.stopped.close(turn_id)

    async def _write(self) -> None:
        """Write until the queue is empty, then end (``emit`` starts a new
        writer): no task lingers for a session that has gone quiet."""
        while True:
            if self._queue.empty():
                self._idle.set()
                if self.on_idle is not None:
                    self.on_idle(self)
                return
            event = self._queue.get_nowait()
            if event is None:
                self._idle.set()
                return
            if event.type in OUTPUT_TYPES and not event.fenced and not self.gate.passes(event.generation):
                # the gate closed while it waited: it is never stored deliverable
                event = event.model_copy(update={"fenced": True})
            try:
                stored = await self.retry(functools.partial(self.store.append_event, event))
            except asyncio.CancelledError:
                raise
            except Exception:
                # Not persisted, so never sent: the log is what clients read.
                self.lost += 1
                log.exception("session %s: could not log a %s event", self.session_id, event.type)
                continue
            self.persisted += 1
            self.last_seq = max(self.last_seq, stored.seq)
            if stored.type in OUTPUT_TYPES and not stored.fenced and not self.gate.passes(stored.generation):
                try:
                    await self.retry(functools.partial(self.store.mark_fenced, self.session_id, stored.seq))
                    stored = stored.model_copy(update={"fenced": True})
                except Exception:
                    log.exception("session %s: could not mark event %d fenced", self.session_id, stored.seq)
            if stored.fenced:
                self.fenced += 1
            elif stored.type == "agent.delta" and stored.turn_id in self._delivered:
                self._delivered[stored.turn_id].append(str(stored.payload.get("text", "")))

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until everything emitted so far is written; False on timeout."""
        try:
            async with asyncio.timeout(timeout_s):
                await self._idle.wait()
            return True
        except TimeoutError:
            return False

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (at most ``timeout_s``), then stop."""
        if self._task is None or self._task.done():
            return
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
        if not done:
            self._task.cancel()
            await asyncio.wait({self._task})
            log.warning("session %s: %d events not logged at close", self.session_id, self._queue.qsize())


class EventLogs:
    """The writers of this process, one per session.

    Args:
        store / clock / retry: as for :class:`SessionEventLog`.
    """

    def __init__(self, store: TurnStore, clock: Clock, retry: Retry[Any] = _no_retry) -> None:
        self.store = store
        self.clock = clock
        self.retry = retry
        self._logs: dict[str, SessionEventLog] = {}
        #: called with every event this process logs, in every session (metrics)
        self.taps: list[Callable[[EventRecord], None]] = []

    def log(self, session_id: str, gate: Gate | None = None) -> SessionEventLog:
        """The session's writer (made on first use); ``gate`` installs the
        session's delivery gate. A writer made without a gate (e.g. for a
        stop accepted here for a turn another instance runs) is forgotten
        once it has written everything."""
        lg = self._logs.get(session_id)
        if lg is None:
            lg = SessionEventLog(
                self.store, session_id, self.clock, gate, retry=self.retry,
                on_idle=None if gate is not None else self._forget_idle, taps=self.taps,
            )
            self._logs[session_id] = lg
        elif gate is not None:
            lg.gate = gate
            lg.on_idle = None  # a session served here: kept until closed
        return lg

    def _forget_idle(self, lg: SessionEventLog) -> None:
        if self._logs.get(lg.session_id) is lg:
            del self._logs[lg.session_id]

    def __len__(self) -> int:
        return len(self._logs)

    async def close(self, session_id: str) -> None:
        """Flush and forget the session's writer."""
        lg = self._logs.pop(session_id, None)
        if lg is not None:
            await lg.aclose()

    async def flush(self, timeout_s: float = 5.0) -> bool:
        """Wait until every writer has written what was emitted so far
        (at most ``timeout_s`` each); False if one timed out."""
        results = await asyncio.gather(*(lg.flush(timeout_s) for lg in list(self._logs.values())))
        return all(results)

    async def aclose(self) -> None:
        """Flush and forget every writer."""
        for session_id in list(self._logs):
            await self.close(session_id)


class EventFollower:
    """Reads a session's log from a cursor onward, live.

    Args:
        store: the log.
        session_id: whose.
        after_seq: the cursor (events with a greater seq are read).
        gate: a follower holding the session's fence also withholds output
            it finds obsolete (the writer may not have known yet).
        poll_s: longest wait for new events before yielding control (the
            caller can send a keep-alive).
    """

    def __init__(
        self,
        store: TurnStore,
        session_id: str,
        after_seq: int = 0,
        *,
        gate: Gate | None = None,
        poll_s: float = 15.0,
        batch: int = 500,
    ) -> None:
        self.store = store
        self.session_id = session_id
        self.cursor = after_seq
        self.gate = gate
        self.poll_s = poll_s
        self.batch = batch
        #: turns whose stop this follower has read (their later output is withheld)
        self.stopped = StoppedTurns()

    async def _patiently(self, fn: Callable[[], Awaitable[T]]) -> T:
        """A store read, retried with backoff (50 ms doubling, at most 2 s
        apart) for as long as the store is unavailable: a follower outlives
        an outage and resumes from its cursor."""
        async for attempt in AsyncRetrying(
            wait=wait_exponential(multiplier=0.05, max=2.0),
            retry=retry_if_exception_type(StoreUnavailable),
            before_sleep=before_sleep_log(log, logging.WARNING),
            reraise=True,
        ):
            with attempt:
                return await fn()
        raise AssertionError("unreachable")  # pragma: no cover

    async def read_batch(self) -> tuple[list[EventRecord], bool]:
        """The deliverable events of the next batch after the cursor, and
        whether more may follow at once. The cursor moves only once a batch
        was read whole, so a failed read loses nothing.

        Raises:
            turn.store.StoreUnavailable: the store is unavailable (only
                :meth:`follow` waits that out).
        """
        events = await self.store.read_events(self.session_id, self.cursor, self.batch)
        if events:
            self.cursor = events[-1].seq
        return [ev for ev in events if self._deliverable(ev)], len(events) == self.batch

    async def read_available(self) -> list[EventRecord]:
        """Every deliverable event after the cursor that is in the log now.

        Raises:
            turn.store.StoreUnavailable: the store is unavailable.
        """
        out: list[EventRecord] = []
        more = True
        while more:
            got, more = await self.read_batch()
            out += got
        return out

    def _deliverable(self, ev: EventRecord) -> bool:
        self.stopped.see(ev.type, ev.turn_id, ev.payload)
        if ev.fenced or self.stopped.withholds(ev.type, ev.turn_id):
            return False
        if self.gate is not None and ev.type in OUTPUT_TYPES and not self.gate.passes(ev.generation):
            return False
        return True

    async def follow(self) -> AsyncIterator[list[EventRecord]]:
        """Yield batches of new deliverable events as they are logged; an
        empty batch means ``poll_s`` passed with nothing new."""
        while True:
            got, more = await self._patiently(self.read_batch)
            if got:
                yield got
            if got or more:
                continue
            if not await self._patiently(lambda: self.store.wait_events(self.session_id, self.cursor, self.poll_s)):
                yield []
