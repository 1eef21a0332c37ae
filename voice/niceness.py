"""CPU priority: the paced audio first (issue 33).

On a machine whose cores are all busy, the kernel shares them by priority.
Every live call's 20 ms ticks are paced by the server's event loop; work
that is off that path (the end-of-turn judge's ONNX run, the recognisers'
worker processes, espeak-ng synthesising a reply) can wait a few ms
without anyone hearing it, while a tick that waits is a gap in every
caller's audio. So that work runs at a lower priority: its nice value
raised by :data:`BACKGROUND_NICE` (``setpriority(2)``; on Linux the nice
value belongs to each thread, sched(7), so a thread of the server's own
process can be lowered alone). Raising one's own nice value needs no
privilege; it is never lowered again.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

log = logging.getLogger(__name__)

#: how much lower than the event loop background work runs (nice value steps, of 40)
BACKGROUND_NICE = 5
#: the most a nice value can be (sched(7))
MAX_NICE = 19


def lower(who: int = 0, by: int = BACKGROUND_NICE) -> None:
    """Raise the nice value of process or thread ``who`` (0: the calling
    thread) by ``by``, at most to :data:`MAX_NICE`. A process that has
    exited meanwhile, or a system that refuses, is logged and left as it
    is (a priority is an optimisation, never a reason to fail)."""
    try:
        now = os.getpriority(os.PRIO_PROCESS, who)
        os.setpriority(os.PRIO_PROCESS, who, min(MAX_NICE, now + by))
    except OSError as exc:
        log.debug("could not lower the priority of %s: %s", who or "this thread", exc)


def background_initializer(initializer: Callable[..., None] | None = None, *initargs: Any) -> None:
    """A worker process's or thread's initializer: lower it (:func:`lower`),
    then run ``initializer(*initargs)`` if given. Module-level, so a
    ``spawn`` worker can unpickle it."""
    lower()
    if initializer is not None:
        initializer(*initargs)


def background_threads(name: str, workers: int) -> ThreadPoolExecutor:
    """A thread pool whose threads run lowered (:func:`lower`)."""
    return ThreadPoolExecutor(max_workers=workers, thread_name_prefix=name, initializer=background_initializer)
