"""What happens when an emitted event does not match the catalogue
(:mod:`turn.event_catalogue`).

Every event is checked where it is made: :meth:`turn.events.SessionEventLog.emit`
for logged events, :mod:`web.peer` for the few sent directly. The policy:

- in production (``strict`` off) the event is still logged and sent as it
  is: a client that reads it is no worse off than before the catalogue
  existed, and a voice turn never fails because of its telemetry. The
  mismatch is logged as an error once per event type (with what is wrong)
  and counted per type in :attr:`Conformance.mismatches`;
- under pytest ``strict`` is on (``tests/conftest.py``): the check raises
  :class:`turn.event_catalogue.EventMismatch` at the emitter, and the
  mismatch is also kept in :attr:`Conformance.seen`, which the suite's
  autouse fixture asserts empty after every test, so an emitter whose
  caller swallows the exception (the agent session's event sink logs and
  goes on) still fails the test that made the event.

Emitters that construct catalogue models (``SessionEventLog.emit_event``)
are checked by pydantic as the model is made: a wrong field raises
``pydantic.ValidationError`` at that line, in every mode, as any wrong
argument would.
"""

from __future__ import annotations

import logging
from collections import Counter
from typing import Any

from turn.event_catalogue import EventMismatch, validate_event

log = logging.getLogger(__name__)


class Conformance:
    """Checks events against the catalogue and keeps score.

    Args:
        strict: raise on a mismatch (tests) instead of logging it.

    Attributes:
        mismatches: mismatching events seen, per type.
        seen: the mismatches' messages, in order, while ``strict`` (cleared
            by whoever asserts on them).
    """

    def __init__(self, strict: bool = False) -> None:
        self.strict = strict
        self.mismatches: Counter[str] = Counter()
        self.seen: list[str] = []

    def check(self, type: str, fields: dict[str, Any]) -> bool:
        """True if the event ``type`` with ``fields`` (its payload, and
        ``generation`` / ``turn_id`` if known) is as the catalogue declares.

        Raises:
            EventMismatch: it is not, and ``strict`` is on.
        """
        try:
            validate_event(type, fields)
            return True
        except EventMismatch as exc:
            self.mismatches[type] += 1
            if self.strict:
                self.seen.append(str(exc))
                raise
            if self.mismatches[type] == 1:
                log.error("%s (not in the event catalogue; logged and sent anyway, reported once per type)", exc)
            return False


#: the process's check, used by every emitter
CONFORMANCE = Conformance()
