"""The store protocol: the authority for every turn.

Implementations must apply :meth:`TurnStore.transition` atomically as a
compare-and-set against :func:`turn.states.sources_of`, so that the
exactly-one-terminal-state invariant holds however callers race.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any, Protocol

from turn.models import StopReason, Turn, TurnStatus
from turn.states import TransitionResult


class StoreError(Exception):
    """Base of store errors."""


class UnknownTurn(StoreError, KeyError):
    """No turn has that id."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(turn_id)
        self.turn_id = turn_id

    def __str__(self) -> str:
        return f"unknown turn {self.turn_id!r}"


class DuplicateTurn(StoreError):
    """A turn with that id already exists."""


class StoreUnavailable(StoreError):
    """The store could not be reached or was busy; nothing was written, so
    the call may be retried (e.g. SQLite "database is locked")."""


#: Fields a caller may set outside a state transition.
MUTABLE_FIELDS = frozenset({"transcript", "reply"})


class TurnStore(Protocol):
    """Where turns live. All methods are coroutines and safe to call
    concurrently from one event loop."""

    async def open(self) -> None:
        """Create files and schema as needed. Idempotent."""
        ...

    async def close(self) -> None:
        """Release connections. Idempotent."""
        ...

    async def create(self, turn: Turn) -> Turn:
        """Insert a new turn.

        Raises:
            DuplicateTurn: the id exists already.
        """
        ...

    async def get(self, turn_id: str) -> Turn:
        """Read one turn.

        Raises:
            UnknownTurn: no such id.
        """
        ...

    async def list_session(self, session_id: str) -> list[Turn]:
        """All turns of a session, oldest first."""
        ...

    async def list_open(self) -> list[Turn]:
        """All turns not yet in a terminal state, oldest first."""
        ...

    async def transition(
        self,
        turn_id: str,
        target: TurnStatus,
        *,
        at: datetime,
        stop_reason: StopReason | None = None,
        error: str | None = None,
    ) -> TransitionResult:
        """Move the turn to ``target`` if its status is a legal source.

        ``stop_reason`` is recorded only if the turn has none yet (the first
        stop wins); ``terminal_at`` is set when ``target`` is terminal.

        Raises:
            UnknownTurn: no such id.
        """
        ...

    async def update(self, turn_id: str, *, at: datetime, **fields: Any) -> Turn:
        """Set non-state fields (see ``MUTABLE_FIELDS``).

        Raises:
            UnknownTurn: no such id.
            ValueError: a field outside ``MUTABLE_FIELDS``.
        """
        ...
