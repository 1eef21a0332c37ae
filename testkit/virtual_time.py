"""Driving a :class:`clock.VirtualClock` through code whose real I/O runs
in threads (the SQLite store's executor, the demo shop's database through
:func:`asyncio.to_thread`), so that such I/O takes no virtual time.

A test that moves virtual time in fixed steps while the code under test
waits on a thread makes a loaded machine look like a slow external
system: a bound (``clock.timeout_after``) fires because a store write took
20 ms of real time, not because a call was slow. :class:`ThreadWork` counts
the event loop's executor jobs in flight, and :func:`step` moves the clock
only once none is, so virtual time passes for what waits on the clock (a
slow shop, a backoff, token pacing) and for nothing else.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from clock import VirtualClock


class ThreadWork:
    """Counts the executor jobs of ``loop`` in flight, from construction
    to :meth:`close` (``loop.run_in_executor`` is wrapped on the instance;
    :func:`asyncio.to_thread` goes through it too).

    Args:
        loop: the running event loop.
    """

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.pending = 0
        self._loop = loop
        self._wrapped = loop.run_in_executor
        loop.run_in_executor = self._run  # type: ignore[method-assign,assignment]

    def _run(self, executor: Any, func: Callable[..., Any], *args: Any) -> asyncio.Future[Any]:
        fut = self._wrapped(executor, func, *args)
        self.pending += 1
        fut.add_done_callback(self._finished)
        return fut

    def _finished(self, _fut: asyncio.Future[Any]) -> None:
        self.pending -= 1

    async def idle(self, limit_s: float = 30.0) -> None:
        """Wait (real time) until no executor job is in flight and what
        they woke has run on to its next wait.

        Raises:
            TimeoutError: a job is still in flight after ``limit_s`` real s.
        """
        async with asyncio.timeout(limit_s):
            while True:
                for _ in range(20):
                    await asyncio.sleep(0)
                if not self.pending:
                    return
                await asyncio.sleep(0.001)

    def close(self) -> None:
        """Stop counting (the loop's own ``run_in_executor`` again)."""
        if self._loop.run_in_executor == self._run:
            del self._loop.run_in_executor


async def step(clock: VirtualClock, work: ThreadWork, seconds: float) -> None:
    """Move ``clock`` ``seconds`` on once no executor job is in flight
    (:meth:`ThreadWork.idle`), then let what it woke run.

    Raises:
        TimeoutError: a job stayed in flight (:meth:`ThreadWork.idle`).
    """
    await work.idle()
    await clock.advance(seconds)
    await asyncio.sleep(0.001)
