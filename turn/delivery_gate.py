"""The delivery gate (DESIGN.md "delivery gate"): the last check before
anything reaches a client.

Two rules close it, and the event log (:mod:`turn.events`) applies both
when an event is made, once it is persisted, and in every follower:

- generation: a turn's output (``OUTPUT_TYPES``) whose generation is no
  longer the session's active one does not pass the session's
  :class:`Gate` (:class:`turn.generation.GenerationFence` is the one a
  voice session installs; :class:`OpenGate` passes everything);
- stop: once a "turn" event saying CANCEL_REQUESTED (or a later stop
  state, ``STOPPED_STATUSES``) has been seen, no output of that turn
  passes (:class:`StoppedTurns`), however late it arrives.

Output a gate withholds is logged marked ``fenced`` (audit evidence),
never delivered.
"""

from __future__ import annotations

from collections import OrderedDict
from typing import Any, Protocol

#: event types that are a turn's output (gated by generation)
OUTPUT_TYPES = frozenset({"transcript", "agent.delta", "agent.done", "audio.start", "audio.end", "tool.output"})


#: "turn" event statuses after which a turn delivers no more output
STOPPED_STATUSES = frozenset({"CANCEL_REQUESTED", "CANCELLED", "RECONCILE_REQUIRED", "FAILED"})


class StoppedTurns:
    """Which turns of a session have stopped, as seen in the order of its
    log: a "turn" event with a stopped status (``STOPPED_STATUSES``) closes
    the turn's output, COMPLETED reopens it (a stop that came after the final
    step changed nothing, and the final answer follows its COMPLETED).

    Args:
        keep: how many stopped turns are remembered at most (oldest first
            forgotten; a session's late output comes from its last few).
    """

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._stopped: OrderedDict[str, None] = OrderedDict()

    def close(self, turn_id: str) -> None:
        """No output of ``turn_id`` is delivered from now on."""
        self._stopped[turn_id] = None
        self._stopped.move_to_end(turn_id)
        while len(self._stopped) > self.keep:
            self._stopped.popitem(last=False)

    def see(self, type: str, turn_id: str | None, payload: dict[str, Any]) -> None:
        """Note an event in log order (only "turn" events matter)."""
        if type != "turn" or turn_id is None:
            return
        status = payload.get("status")
        if status in STOPPED_STATUSES:
            self.close(turn_id)
        elif status == "COMPLETED":
            self._stopped.pop(turn_id, None)

    def withholds(self, type: str, turn_id: str | None) -> bool:
        """True if an event of ``type`` of ``turn_id`` is output of a
        stopped turn (never to be delivered)."""
        return turn_id is not None and type in OUTPUT_TYPES and turn_id in self._stopped


class Gate(Protocol):
    """The delivery gate's generation rule: may output of ``generation``
    (a session's generation number, see DESIGN.md "generation") reach the
    client? (:class:`turn.generation.GenerationFence` is one.)"""

    def passes(self, generation: int) -> bool: ...


class OpenGate:
    """A gate that passes everything (a session nobody fences here)."""

    def passes(self, generation: int) -> bool:
        return True
