"""The store protocol: the authority for every turn, session and event.

Two implementations pass one contract suite (tests/turn/test_store_contract.py):
:class:`turn.sqlite_store.SqliteStore` (embedded default, one instance) and
:class:`turn.redis_store.RedisStore` (many instances). Both apply every state
change atomically as a compare-and-set against
:func:`turn.states.sources_of`, so the exactly-one-terminal-state invariant
holds however callers race, and neither trusts callers to check first.
"""

from __future__ import annotations

from datetime import datetime
from enum import StrEnum
from typing import Any, Protocol

from pydantic import BaseModel

from turn.intents import AuditRow, Intent
from turn.models import EventRecord, InstanceInfo, Session, StopReason, Turn, TurnStatus
from turn.states import TransitionResult


class StoreError(Exception):
    """Base of store errors."""


class LeaseLost(StoreError):
    """A write fenced on the turn's lease found it leased to another worker
    (this one stalled past the lease TTL and was taken over): nothing was
    written."""

    def __init__(self, turn_id: str, holder: str | None) -> None:
        super().__init__(turn_id, holder)
        self.turn_id, self.holder = turn_id, holder

    def __str__(self) -> str:
        return f"turn {self.turn_id!r} was taken over from this worker (leased to {self.holder or 'another'} now)"


class UnknownTurn(StoreError, KeyError):
    """No turn has that id."""

    def __init__(self, turn_id: str) -> None:
        super().__init__(turn_id)
        self.turn_id = turn_id

    def __str__(self) -> str:
        return f"unknown turn {self.turn_id!r}"


class UnknownSession(StoreError, KeyError):
    """No session has that id."""

    def __init__(self, session_id: str) -> None:
        super().__init__(session_id)
        self.session_id = session_id

    def __str__(self) -> str:
        return f"unknown session {self.session_id!r}"


class DuplicateTurn(StoreError):
    """A turn with that id already exists."""


class DuplicateSession(StoreError):
    """A session with that id already exists."""


class WrongSessionKind(StoreError):
    """A session asked for as one kind (text) is of another (voice): a text
    turn cannot join a live voice session (its generation fence and
    delivery gate are the voice session's own)."""


class StoreUnavailable(StoreError):
    """The store could not be reached or was busy; nothing was written, so
    the call may be retried (e.g. SQLite "database is locked", Redis
    connection refused)."""


class UnknownIntent(StoreError, KeyError):
    """No ledger row has that idempotency key."""

    def __init__(self, key: str) -> None:
        super().__init__(key)
        self.key = key

    def __str__(self) -> str:
        return f"unknown intent {self.key!r}"


class IdempotencyConflict(StoreError):
    """A request id (idempotency key) was reused with different parameters."""


#: Fields a caller may set outside a state transition.
MUTABLE_FIELDS = frozenset(
    {
        "transcript", "reply", "reply_unheard", "merged_into", "spent", "usage", "step_count", "max_steps", "lease_owner", "heartbeat_at",
        "deadline_at", "budget", "stop_report",
    }
)


class StopAnswer(StrEnum):
    """The answer to a stop request, from the facts at the time it first
    arrived (a repeat with the same request id gets the same answer)."""

    #: this request stopped it: RUNNING -> CANCEL_REQUESTED (or QUEUED -> CANCELLED)
    ACCEPTED = "accepted"
    #: accepted, but a stop was already under way
    ALREADY_STOPPING = "already_stopping"
    #: it had ended (COMPLETED, FAILED, CANCELLED) before the request
    ALREADY_TERMINAL = "already_terminal"
    #: it ended in RECONCILE_REQUIRED: an external effect may have happened
    RECONCILE_REQUIRED = "reconcile_required"


class StopResult(BaseModel):
    """Result of :meth:`TurnStore.request_stop`.

    Attributes:
        answer: see :class:`StopAnswer`.
        first: True for exactly one request per turn: the one whose
            transition applied. The stop's effects (signal, cleanup) are done
            by that caller only.
        repeat: the request id had been seen; ``answer`` is the stored one.
        turn: the turn as stored now.
    """

    answer: StopAnswer
    first: bool
    repeat: bool
    turn: Turn


class TurnStore(Protocol):
    """Where turns, sessions and event logs live. All methods are coroutines,
    safe to call concurrently. Unless noted they raise
    :class:`StoreUnavailable` when the backend is busy or unreachable (nothing
    written) and ``RuntimeError`` when the store is not open.

    Attributes:
        single_instance: True if one process serves the store (SQLite: a
            file lock holds it to that), so every open turn found at startup
            was left by a process that ended; False if many instances may
            (Redis: only turns whose lease expired were left).
    """

    single_instance: bool

    async def open(self) -> None:
        """Connect, create schema as needed. Idempotent."""
        ...

    async def close(self) -> None:
        """Release connections. Idempotent."""
        ...

    # -- sessions --------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        """Insert a session.

        Raises:
            DuplicateSession: the id exists already.
        """
        ...

    async def get_session(self, session_id: str) -> Session:
        """Read a session.

        Raises:
            UnknownSession: no such id.
        """
        ...

    async def next_generation(self, session_id: str) -> int:
        """Atomically add 1 to the session's generation and return it.

        Raises:
            UnknownSession: no such id.
        """
        ...

    # -- turns -----------------------------------------------------------------

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

        ``stop_reason`` and ``error`` are recorded only if the turn has none
        yet (the first wins); ``terminal_at`` is set when ``target`` is
        terminal.

        Raises:
            UnknownTurn: no such id.
        """
        ...

    async def request_stop(
        self, turn_id: str, request_id: str, reason: StopReason, *, at: datetime, fingerprint: str = ""
    ) -> StopResult:
        """Idempotent stop request, in one atomic step: RUNNING moves to
        CANCEL_REQUESTED and QUEUED to CANCELLED (recording ``reason`` if the
        turn has no stop reason yet); the answer is stored under
        ``request_id`` so a repeat gets the same answer and changes nothing.

        Args:
            fingerprint: the request's parameters (e.g. a hash); reusing
                ``request_id`` with another turn or fingerprint is refused.

        Raises:
            UnknownTurn: no such id.
            IdempotencyConflict: ``request_id`` was used with other parameters.
        """
        ...

    async def update(self, turn_id: str, *, at: datetime, fence_owner: str | None = None, **fields: Any) -> Turn:
        """Set non-state fields (see ``MUTABLE_FIELDS``); ``updated_at`` = at.
        With ``fence_owner``, only while the turn is leased to it (one
        atomic check and write: a worker that was taken over writes nothing).

        Raises:
            UnknownTurn: no such id.
            LeaseLost: ``fence_owner`` given, and the turn is leased to another.
            ValueError: a field outside ``MUTABLE_FIELDS``.
        """
        ...

    async def heartbeat(self, owner: str, turn_ids: list[str], *, at: datetime) -> int:
        """Renew the lease of those turns that ``owner`` holds and that are not
        terminal; returns how many were renewed."""
        ...

    async def take_over(
        self, turn_id: str, owner: str, *, expect_owner: str | None, expect_heartbeat: datetime | None, at: datetime
    ) -> bool:
        """Lease a RUNNING turn whose worker is gone to ``owner`` (heartbeat
        ``at``), as one compare-and-set: only if it is still RUNNING, leased
        to ``expect_owner`` and its heartbeat is still ``expect_heartbeat``
        (what the sweeper saw expire). Of several sweepers that saw it, one
        wins; a worker that was only slow and beat meanwhile keeps it.
        Returns whether it was taken.

        Raises:
            UnknownTurn: no such id.
        """
        ...

    # -- event log -------------------------------------------------------------

    async def append_event(self, event: EventRecord) -> EventRecord:
        """Persist an event; the store assigns the next ``seq`` of the
        session's log (1, 2, 3, ... with no gaps).

        Raises:
            UnknownSession: no such session.
        """
        ...

    async def read_events(self, session_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRecord]:
        """Events with ``seq > after_seq``, in order, at most ``limit``."""
        ...

    async def mark_fenced(self, session_id: str, seq: int) -> None:
        """Mark a logged event as withheld by the delivery gate."""
        ...

    async def wait_events(self, session_id: str, after_seq: int, timeout_s: float) -> bool:
        """Wait up to ``timeout_s`` for an event after ``after_seq``; True if
        there may be one now (callers then read)."""
        ...

    # -- side-effect ledger ----------------------------------------------------

    async def ledger_add(self, intent: Intent) -> tuple[Intent, bool]:
        """Write an intent unless its key exists. Returns the stored row and
        whether this call created it (a repeat returns the first row)."""
        ...

    async def ledger_get(self, key: str) -> Intent:
        """The row with that idempotency key.

        Raises:
            UnknownIntent: no such key.
        """
        ...

    async def ledger_replace(self, intent: Intent) -> bool:
        """Compare-and-set: store ``intent`` if the stored row's version is
        ``intent.version - 1``. False if another writer got there first.

        Raises:
            UnknownIntent: no such key.
        """
        ...

    async def ledger_list(self, turn_id: str) -> list[Intent]:
        """A turn's rows (effects and compensations), oldest first."""
        ...

    async def ledger_due(self, now: datetime, limit: int = 100) -> list[Intent]:
        """Rows a worker must act on (pending, effect_unknown, retrying)
        whose ``next_attempt_at`` is unset or not after ``now``."""
        ...

    async def ledger_open_count(self) -> int:
        """How many rows are not resolved (pending, effect_unknown,
        retrying)."""
        ...

    async def audit_add(self, row: AuditRow) -> None:
        """Append an audit row."""
        ...

    async def audit_list(self, key: str) -> list[AuditRow]:
        """The audit rows of one key, oldest first."""
        ...

    # -- downstream work queue ---------------------------------------------------

    async def queue_push(self, queue: str, item: dict[str, Any]) -> str:
        """Append a work item (a JSON object); returns its id."""
        ...

    async def queue_claim(self, queue: str, consumer: str, count: int = 10) -> list[tuple[str, dict[str, Any]]]:
        """Take up to ``count`` items nobody has claimed, oldest first, for
        ``consumer`` (claimed items are not handed out again)."""
        ...

    async def queue_ack(self, queue: str, item_id: str) -> None:
        """The item is finished (sent or skipped)."""
        ...

    async def queue_pending(self, queue: str) -> int:
        """Items pushed and not yet acknowledged."""
        ...

    # -- shared secrets --------------------------------------------------------

    async def secret(self, name: str) -> bytes:
        """A 32-byte random secret created on first use and the same for
        every instance sharing this store afterwards."""
        ...

    # -- the fleet ------------------------------------------------------------------

    async def instance_heartbeat(self, info: InstanceInfo, ttl_s: float) -> None:
        """Register ``info`` (or renew it): listed until ``ttl_s`` seconds
        after its ``heartbeat_at`` unless renewed."""
        ...

    async def instance_list(self, now: datetime) -> list[InstanceInfo]:
        """The instances whose registration is current at ``now``, by id."""
        ...

    async def instance_remove(self, instance_id: str) -> None:
        """Unregister an instance (it exits)."""
        ...

    # -- device tokens (xiaozhi-esp32 device sockets) ------------------------------

    async def device_add(self, device_id: str, tenant_id: str, token_hash: str, created_at: datetime) -> None:
        """Register a device of ``tenant_id`` whose token hashes to
        ``token_hash`` (hex SHA-256; the token itself is never stored).

        Raises:
            ValueError: ``device_id`` or ``token_hash`` is taken.
        """
        ...

    async def device_by_token(self, token_hash: str) -> tuple[str, str] | None:
        """``(device_id, tenant_id)`` of the device whose token hashes to
        ``token_hash``; None if none does or it was revoked."""
        ...

    async def device_revoke(self, device_id: str, tenant_id: str) -> bool:
        """Revoke ``tenant_id``'s device ``device_id``: its token is refused
        from now on. Returns False if the tenant has no such device (or it
        was revoked already)."""
        ...

    # -- client tokens (single-use credentials to start a voice session) -----------

    async def client_token_put(self, token_hash: str, grant: str, expires_at: datetime, now: datetime) -> None:
        """Keep ``grant`` (JSON) under ``token_hash`` (hex SHA-256 of the
        token; the token itself is never stored) until ``expires_at`` (UTC;
        ``now`` is the clock's time, so a virtual clock works too),
        replacing what was there. Grants expired and never claimed are purged
        by a later claim.
        """
        ...

    async def client_token_claim(self, token_hash: str, now: datetime) -> str | None:
        """Take the grant kept under ``token_hash``, atomically: it is gone
        afterwards, so of two concurrent claims (on any instances) at most one
        gets it. None if there is none or it expired before ``now``."""
        ...

    async def claim_once(self, key: str, expires_at: datetime, now: datetime) -> bool:
        """True for the first claim of ``key`` (on any instance sharing the
        store) until ``expires_at`` (UTC), False for every later one: a
        credential that may be used once (a phone call's signed tenant).
        ``key`` should not itself be secret (store a hash of one)."""
        ...

