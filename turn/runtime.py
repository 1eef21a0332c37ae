"""A turn's runtime: what the process running a turn keeps of it in
memory, so that a checkpoint (:mod:`turn.checkpoint`) costs no store round
trip most of the time. The store row stays the authority; this is a cache
of it plus the counters only the running process has (steps, recent tool
calls, the usage meter).
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field

from turn.models import Budget
from turn.usage import UsageMeter

#: how many identical tool calls in a row are a loop
LOOP_REPEATS = 3


@dataclass
class FlagCache:
    """The last stop-flag read of a turn this process holds the lease of
    but does not run (no :class:`TurnRuntime`).

    Attributes:
        stopping: the turn was not RUNNING (or a stop signal came).
        read_at: ``clock.monotonic()`` of that read, s.
    """

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
            :meth:`turn.checkpoint.Checkpoints.checkpoint`).
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
