"""The event log's writer: persist first, then deliver, in order.

Every event a client sees goes through :class:`SessionEventLog`: it is
appended to the session's log in the store (which assigns ``seq``), and only
then delivered (data channel, SSE followers). Output of a generation that is
no longer active is still logged, marked fenced, as audit evidence, and is
never delivered: the delivery gate is checked when the event is made and
again after it was persisted, however late it arrives.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from turn.clock import Clock
from turn.models import EventRecord
from turn.store import TurnStore

log = logging.getLogger(__name__)

T = TypeVar("T")


class Gate(Protocol):
    """The delivery gate's rule (e.g. :class:`turn.generation.GenerationFence`)."""

    def passes(self, generation: int) -> bool: ...


Deliver = Callable[[EventRecord], None]
Retry = Callable[[Callable[[], Awaitable[T]]], Awaitable[T]]


async def _no_retry(fn: Callable[[], Awaitable[T]]) -> T:
    return await fn()


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
    """One session's ordered event pipeline.

    Args:
        store: where the log lives.
        session_id: whose log (the session must exist in the store).
        clock: stamps ``at``.
        gate: the session's delivery gate.
        deliver: called with each persisted, unfenced event, in seq order;
            must not block.
        retry: wraps each store call (e.g. ``TurnManager._call`` for backoff).
        max_queue: events waiting to be written at most; beyond that the
            oldest waiting output events are dropped (and counted).
    """

    def __init__(
        self,
        store: TurnStore,
        session_id: str,
        clock: Clock,
        gate: Gate,
        deliver: Deliver | None = None,
        *,
        retry: Retry[Any] = _no_retry,
        max_queue: int = 10_000,
    ) -> None:
        self.store = store
        self.session_id = session_id
        self.clock = clock
        self.gate = gate
        self.deliver = deliver
        self.retry = retry
        self.max_queue = max_queue
        self._queue: asyncio.Queue[tuple[EventRecord, bool] | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        self.persisted = 0
        self.fenced = 0
        self.lost = 0

    def emit(
        self,
        type: str,
        *,
        generation: int,
        turn_id: str | None = None,
        output: bool = False,
        **payload: Any,
    ) -> None:
        """Queue an event; never blocks. ``output=True`` marks a turn's output
        (model deltas, transcripts, audio segments), which the delivery gate
        withholds once its generation is obsolete; state changes are not
        output and always reach the client."""
        fenced = output and not self.gate.passes(generation)
        event = EventRecord(
            session_id=self.session_id,
            turn_id=turn_id,
            generation=generation,
            type=type,
            at=self.clock.now(),
            payload=payload,
            fenced=fenced,
        )
        if self._queue.qsize() >= self.max_queue:
            self.lost += 1
            log.warning("session %s: event queue full, dropping %s", self.session_id, type)
            return
        self._queue.put_nowait((event, output))
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._write(), name=f"events-{self.session_id}")

    async def _write(self) -> None:
        while True:
            item = await self._queue.get()
            if item is None:
                return
            event, output = item
            try:
                stored = await self.retry(lambda: self.store.append_event(event))
            except asyncio.CancelledError:
                raise
            except Exception:
                # Not persisted, so not sent: the log is what clients replay.
                self.lost += 1
                log.exception("session %s: could not log a %s event", self.session_id, event.type)
                continue
            self.persisted += 1
            if output and not stored.fenced and not self.gate.passes(stored.generation):
                stored = stored.model_copy(update={"fenced": True})
                try:
                    await self.retry(lambda: self.store.mark_fenced(self.session_id, stored.seq))
                except Exception:
                    log.exception("session %s: could not mark event %d fenced", self.session_id, stored.seq)
            if stored.fenced:
                self.fenced += 1
                continue
            if self.deliver is not None:
                try:
                    self.deliver(stored)
                except Exception:
                    log.exception("session %s: delivering event %d failed", self.session_id, stored.seq)

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Write what is queued (at most ``timeout_s``), then stop."""
        if self._task is None:
            return
        self._queue.put_nowait(None)
        done, _ = await asyncio.wait({self._task}, timeout=timeout_s)
        if not done:
            self._task.cancel()
            await asyncio.wait({self._task})
            log.warning("session %s: %d events not logged at close", self.session_id, self._queue.qsize())
        self._task = None
