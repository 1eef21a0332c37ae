"""The one table of legal turn transitions (DESIGN.md "Turn states").

Stores apply a transition as an atomic compare-and-set: the row moves to
``target`` only if its current status is in :func:`sources_of` ``(target)``.
That single rule is what makes "exactly one terminal state" hold: no terminal
status appears as a source, so the first terminal write wins and every later
one is answered ``already_terminal`` with the winner.
"""

from __future__ import annotations

from enum import StrEnum

from pydantic import BaseModel

from turn.models import Turn, TurnStatus

S = TurnStatus

TRANSITIONS: dict[TurnStatus, frozenset[TurnStatus]] = {
    # A queued turn has started nothing, so a stop can end it at once.
    S.QUEUED: frozenset({S.RUNNING, S.CANCELLED, S.FAILED}),
    # Released (a drain, turn.resume): it waits, unleased, for another worker.
    S.RUNNING: frozenset({S.COMPLETED, S.FAILED, S.CANCEL_REQUESTED, S.QUEUED}),
    # The worker confirms a stop from what actually happened; a stop the
    # turn decided itself (deadline, budget, steps, loop) ends it FAILED.
    S.CANCEL_REQUESTED: frozenset({S.CANCELLED, S.RECONCILE_REQUIRED, S.COMPLETED, S.FAILED}),
    S.CANCELLED: frozenset(),
    S.COMPLETED: frozenset(),
    S.FAILED: frozenset(),
    S.RECONCILE_REQUIRED: frozenset(),
}


def sources_of(target: TurnStatus) -> frozenset[TurnStatus]:
    """Statuses from which ``target`` may be entered."""
    return _SOURCES[target]


_SOURCES: dict[TurnStatus, frozenset[TurnStatus]] = {
    t: frozenset(s for s, targets in TRANSITIONS.items() if t in targets) for t in TurnStatus
}


class Outcome(StrEnum):
    """How a transition attempt ended."""

    APPLIED = "applied"
    #: the turn had already reached a terminal state; ``turn`` shows the winner
    ALREADY_TERMINAL = "already_terminal"
    #: not terminal, but not in a state this transition may start from
    CONFLICT = "conflict"


class TransitionResult(BaseModel):
    """Answer of a compare-and-set transition.

    Attributes:
        outcome: applied, already_terminal or conflict.
        turn: the turn as stored after the attempt (the winner's state if not applied).
        previous: the status before the attempt.
    """

    outcome: Outcome
    turn: Turn
    previous: TurnStatus

    @property
    def applied(self) -> bool:
        return self.outcome is Outcome.APPLIED
