"""Finishing work through a cancellation: :func:`finish_anyway`.

A record of something that already happened (a tool's answer, a sent
item's ledger row) must not be lost because the coroutine writing it was
cancelled by a stop; the cancellation is delivered once the record is
written, never swallowed (DESIGN.md: asyncio structured concurrency). A
cancel scope's must-complete section (:meth:`turn.scope.TurnScope.commit`)
is the same rule inside a turn's cancellation tree.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable
from typing import TypeVar

T = TypeVar("T")


async def finish_anyway(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile
    (a record of something that already happened must not be lost to a
    stop); the cancellation is re-raised once ``work`` has finished, never
    swallowed.

    Raises:
        asyncio.CancelledError: the caller was cancelled while waiting.
        Exception: what ``work`` raised.
    """
    task = asyncio.ensure_future(work)
    cancelled = False
    while True:
        try:
            result = await asyncio.shield(task)
            break
        except asyncio.CancelledError:
            if task.done():
                raise
            cancelled = True
    if cancelled:
        raise asyncio.CancelledError
    return result
