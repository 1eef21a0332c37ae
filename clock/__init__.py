"""Injected time, for every layer.

It lives outside the four layers (DESIGN.md: "the injected clock it needs
lives where every layer may import it, not inside the domain core"): turn,
media, voice and web all import it, and it imports none of them.

Every component that waits or stamps time takes a :class:`Clock`, so races and
pacing can be tested deterministically with :class:`VirtualClock`.

Units: ``monotonic()`` is seconds (float) on an arbitrary origin, only
differences are meaningful; ``now()`` is a timezone-aware UTC ``datetime`` for
records that humans and other processes read.
"""

from __future__ import annotations

import asyncio
import heapq
import itertools
import time
from datetime import UTC, datetime, timedelta
from typing import Any, Protocol


class Clock(Protocol):
    """The time source every component is given."""

    def monotonic(self) -> float:
        """Seconds on a monotonic scale (never goes back)."""
        ...

    def now(self) -> datetime:
        """Wall-clock time, timezone-aware UTC."""
        ...

    async def sleep(self, seconds: float) -> None:
        """Suspend for ``seconds`` (<= 0 yields once). Cancellable."""
        ...


class SystemClock:
    """The real clock: ``time.monotonic`` and ``asyncio.sleep``."""

    def monotonic(self) -> float:
        """Seconds on the process's monotonic clock (only differences mean anything)."""
        return time.monotonic()

    def now(self) -> datetime:
        """The wall-clock time, timezone-aware UTC."""
        return datetime.now(UTC)

    async def sleep(self, seconds: float) -> None:
        """Wait ``seconds`` (a negative wait returns at once)."""
        await asyncio.sleep(max(0.0, seconds))


class VirtualClock:
    """A clock that only moves when a test calls :meth:`advance`.

    Sleepers wake in deadline order; ``advance`` lets each woken task run before
    moving time further, so "what happens at t=0.04 s" is exact and repeatable.
    """

    def __init__(self, start: float = 1000.0, wall: datetime | None = None) -> None:
        self._t = start
        self._origin = start
        self._wall0 = wall or datetime(2026, 1, 1, tzinfo=UTC)
        #: (due, order, future, whether a timeout_after alarm waits on it)
        self._sleepers: list[tuple[float, int, asyncio.Future[None], bool]] = []
        self._seq = itertools.count()

    def monotonic(self) -> float:
        """Virtual seconds: ``start`` plus every :meth:`advance` so far."""
        return self._t

    def now(self) -> datetime:
        """``wall`` moved on by the virtual seconds since ``start`` (UTC)."""
        return self._wall0 + timedelta(seconds=self._t - self._origin)

    async def sleep(self, seconds: float) -> None:
        """Wait until :meth:`advance` has moved virtual time ``seconds`` on
        (``seconds <= 0``: one loop step)."""
        if seconds <= 0:
            await asyncio.sleep(0)
            return
        fut: asyncio.Future[None] = asyncio.get_running_loop().create_future()
        task = asyncio.current_task()
        alarm = task is not None and task.get_name() == ALARM_TASK
        heapq.heappush(self._sleepers, (self._t + seconds, next(self._seq), fut, alarm))
        await fut

    async def advance(self, seconds: float) -> None:
        """Move time forward by ``seconds``, waking every sleeper due on the way.

        Raises:
            ValueError: if ``seconds`` is negative.
        """
        if seconds < 0:
            raise ValueError("a clock never goes back")
        target = self._t + seconds
        await _settle()
        while self._sleepers and self._sleepers[0][0] <= target:
            due, _, fut, _alarm = heapq.heappop(self._sleepers)
            self._t = max(self._t, due)
            if not fut.done():
                fut.set_result(None)
            await _settle()
        self._t = target
        await _settle()

    @property
    def pending_sleepers(self) -> int:
        """How many sleeps are waiting (cancelled ones included until due)."""
        return sum(1 for _, _, f, _a in self._sleepers if not f.done())

    def next_wake(self, *, besides_alarms: bool = False) -> float | None:
        """When the earliest pending sleep is due (virtual s; None: none is
        pending). With ``besides_alarms``, alarms of :class:`timeout_after`
        (a bound waiting on its body) do not count: what is left is the code
        waiting on time itself (a slow call, a backoff, a pacing loop)."""
        due = [d for d, _, f, alarm in self._sleepers if not f.done() and not (besides_alarms and alarm)]
        return min(due, default=None)


#: the task name of a :class:`timeout_after` alarm (:meth:`VirtualClock.next_wake` tells them apart)
ALARM_TASK = "timeout_after alarm"


class timeout_after:  # noqa: N801 - used like asyncio.timeout
    """Like ``asyncio.timeout``, but on the injected ``clock``: cancel the
    body after ``seconds`` (None: never) and raise ``TimeoutError`` instead.
    Use as ``async with timeout_after(clock, 2.0) as limit:``; afterwards
    ``limit.expired`` tells whether this limit fired (a ``TimeoutError``
    raised by the body itself leaves it False).

    A cancellation from anywhere else still propagates as
    ``CancelledError`` (the timeout only converts its own cancel, counted
    with ``Task.uncancel`` as ``asyncio.timeout`` does).

    Raises:
        TimeoutError: the body ran ``seconds`` or longer.
        RuntimeError: not inside a task.
    """

    def __init__(self, clock: Clock, seconds: float | None) -> None:
        self.clock = clock
        self.seconds = seconds
        self.expired = False
        self._task: asyncio.Task[Any] | None = None
        self._timer: asyncio.Task[None] | None = None

    async def __aenter__(self) -> timeout_after:
        if self.seconds is None:
            return self
        self._task = asyncio.current_task()
        if self._task is None:
            raise RuntimeError("timeout_after needs a running task")
        self._timer = asyncio.get_running_loop().create_task(self._alarm(self.seconds), name=ALARM_TASK)
        return self

    async def _alarm(self, seconds: float) -> None:
        await self.clock.sleep(seconds)
        self.expired = True
        assert self._task is not None
        self._task.cancel(msg="timeout")

    async def __aexit__(self, et: Any, exc: Any, tb: Any) -> bool | None:
        if self._timer is not None:
            self._timer.cancel()
        if et is asyncio.CancelledError and self.expired and self._task is not None and self._task.uncancel() == 0:
            raise TimeoutError(f"timed out after {self.seconds:.3f} s") from None
        return None


async def _settle(rounds: int = 20) -> None:
    """Let ready callbacks run a few loop iterations."""
    for _ in range(rounds):
        await asyncio.sleep(0)
