"""CPython's cyclic garbage collector, kept off the live audio (issue 33).

A full (generation 2) collection walks every container object the process
holds. After startup that is about 105,000 objects, nearly all of them the
modules, functions and classes of the libraries (aiohttp, aiortc, redis,
pydantic, numpy, ...), and one walk took 31-44 ms on this machine's cores:
an outbound tick 20-40 ms late and a 47-70 ms gap in what a caller
received, about once in 400 ticks with a single call (``bench/capacity.py``
counts them). The collector decides on its own when to run one; it cannot
be scheduled.

What it walks can be made small instead: :func:`gc.freeze` moves every
object alive into a permanent generation that no collection walks
(CPython's documented use: after a process's setup). :func:`settle` does
that with a full collection first, so nothing that is garbage already is
frozen. A frozen object that later becomes cyclic garbage would be kept,
so :func:`settle_when_idle` settles again whenever the server has gone
idle after serving: the objects frozen before are unfrozen, the garbage
among them collected, the survivors (the modules a first session imported,
for one) frozen again. That walk of everything takes its 30-40 ms while no
call is live.

Only ``turnkeeper serve`` does this (:mod:`web.serve`): a test process
building many apps keeps CPython's defaults.
"""

from __future__ import annotations

import gc
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

from clock import Clock

log = logging.getLogger(__name__)

#: how often :func:`settle_when_idle` looks for an idle server, s
IDLE_CHECK_S = 5.0


@dataclass(frozen=True)
class Settled:
    """What one :func:`settle` did.

    Attributes:
        collected: unreachable objects the full collection found.
        frozen: objects now in the permanent generation.
        ms: how long it took, ms (the event loop was blocked that long).
    """

    collected: int
    frozen: int
    ms: float


def settle() -> Settled:
    """Unfreeze what an earlier settle froze, collect every generation,
    freeze the survivors (:func:`gc.unfreeze`, :func:`gc.collect`,
    :func:`gc.freeze`). Blocks the calling thread for the full collection
    (tens of ms): call it at startup or while no call is live."""
    started = time.perf_counter()
    gc.unfreeze()
    collected = gc.collect()
    gc.freeze()
    return Settled(collected, gc.get_freeze_count(), (time.perf_counter() - started) * 1000)


async def settle_when_idle(live_sessions: Callable[[], int], clock: Clock, every_s: float = IDLE_CHECK_S) -> None:
    """Run until cancelled: every ``every_s`` seconds of ``clock``, if
    ``live_sessions()`` is 0 and some session was live since the last
    settle, :func:`settle` (a server that stays idle, or stays busy, is
    not walked again and again)."""
    served = False
    while True:
        await clock.sleep(every_s)
        if live_sessions():
            served = True
        elif served:
            served = False
            done = settle()
            log.debug("idle: collected %d, froze %d objects in %.1f ms", done.collected, done.frozen, done.ms)
