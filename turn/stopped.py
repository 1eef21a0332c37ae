"""The turn must not go on: :class:`TurnStopped`, and the stops a turn
decides for itself (``LIMIT_KINDS``).

Checkpoints (:mod:`turn.checkpoint`) raise it, never return a flag; so do
a cancel scope's child cut short by the turn's deadline and a
must-complete section that finished after a stop (:mod:`turn.scope`). A
stop of a kind in ``LIMIT_KINDS`` ends the turn FAILED, any other kind
CANCELLED or RECONCILE_REQUIRED (:func:`turn.stop_path.terminal_status`).
"""

from __future__ import annotations

from turn.models import StopReasonKind

#: stops the turn decides for itself; they end it FAILED, not CANCELLED
LIMIT_KINDS = frozenset(
    {
        StopReasonKind.DEADLINE_EXCEEDED,
        StopReasonKind.BUDGET_EXCEEDED,
        StopReasonKind.MAX_STEPS,
        StopReasonKind.LOOP_DETECTED,
    }
)


class TurnStopped(Exception):
    """The turn must not go on: raised by checkpoints (never a returned
    flag), by a child cut short by the turn's deadline, and by a
    must-complete section that finished after a stop.

    Attributes:
        turn_id: the turn.
        phase: where it was noticed (e.g. "before_model").
        kind: the stop's kind when the turn decided it itself (a limit:
            deadline, budget, steps, loop); None when it was asked from
            outside (the reason is in the store).
        detail: for humans.
    """

    def __init__(self, turn_id: str, phase: str, kind: StopReasonKind | None = None, detail: str | None = None) -> None:
        what = f"{kind.value}" if kind else "asked to stop"
        super().__init__(f"turn {turn_id} {what} (at {phase})" + (f": {detail}" if detail else ""))
        self.turn_id = turn_id
        self.phase = phase
        self.kind = kind
        self.detail = detail
