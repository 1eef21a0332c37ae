"""The SQLite store's turn rows: sessions, turns, stop requests and
leases' heartbeats. Every state change is one ``BEGIN IMMEDIATE``
transaction that compares the stored status against
:func:`turn.states.sources_of` before it writes.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime
from typing import Any

from pydantic import BaseModel

from turn.models import (
    TERMINAL_STATUSES,
    Budget,
    Session,
    Spent,
    StopReason,
    StopReport,
    Turn,
    TurnStatus,
    Usage,
)
from turn.sqlite_connection import SqliteConnection, to_db
from turn.sqlite_schema import TURN_COLUMNS_ADDED
from turn.states import Outcome, TransitionResult, sources_of
from turn.store import (
    MUTABLE_FIELDS,
    DuplicateSession,
    DuplicateTurn,
    IdempotencyConflict,
    LeaseLost,
    StopAnswer,
    StopResult,
    UnknownSession,
    UnknownTurn,
)

#: the ``turns`` columns, in the order of every SELECT
COLUMNS = [
    "id", "tenant_id", "session_id", "kind", "status", "generation", "stop_reason", "error",
    "transcript", "reply", "created_at", "updated_at", "terminal_at", *TURN_COLUMNS_ADDED,
]
_SELECT = f"SELECT {', '.join(COLUMNS)} FROM turns"
_MODEL_FIELDS: dict[str, type[BaseModel]] = {
    "stop_reason": StopReason, "budget": Budget, "spent": Spent, "usage": Usage, "stop_report": StopReport,
}


class SqliteTurnRows(SqliteConnection):
    """The session and turn methods of :class:`turn.store.TurnStore` on SQLite."""

    # -- sessions --------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        return await self._run(self._create_session_sync, session)

    def _create_session_sync(self, s: Session) -> Session:
        assert self._conn is not None
        try:
            self._conn.execute(
                "INSERT INTO sessions (id, tenant_id, kind, generation, created_at) VALUES (?,?,?,?,?)",
                (s.id, s.tenant_id, s.kind.value, s.generation, s.created_at.isoformat()),
            )
        except sqlite3.IntegrityError as exc:
            raise DuplicateSession(s.id) from exc
        return s

    async def get_session(self, session_id: str) -> Session:
        return await self._run(self._get_session_sync, session_id)

    def _get_session_sync(self, session_id: str) -> Session:
        assert self._conn is not None
        row = self._conn.execute(
            "SELECT id, tenant_id, kind, generation, created_at FROM sessions WHERE id = ?", (session_id,)
        ).fetchone()
        if row is None:
            raise UnknownSession(session_id)
        return Session(id=row[0], tenant_id=row[1], kind=row[2], generation=row[3], created_at=datetime.fromisoformat(row[4]))

    async def next_generation(self, session_id: str) -> int:
        return await self._run(self._tx, lambda c: self._bump(c, session_id, "generation"))

    # -- turns: reads ----------------------------------------------------------

    async def get(self, turn_id: str) -> Turn:
        return await self._run(self._get_sync, turn_id)

    def _get_sync(self, turn_id: str) -> Turn:
        assert self._conn is not None
        row = self._conn.execute(f"{_SELECT} WHERE id = ?", (turn_id,)).fetchone()
        if row is None:
            raise UnknownTurn(turn_id)
        return _row_to_turn(row)

    async def list_session(self, session_id: str) -> list[Turn]:
        return await self._run(self._query, f"{_SELECT} WHERE session_id = ? ORDER BY created_at, rowid", (session_id,))

    async def list_open(self) -> list[Turn]:
        marks = ",".join("?" for _ in TERMINAL_STATUSES)
        return await self._run(
            self._query,
            f"{_SELECT} WHERE status NOT IN ({marks}) ORDER BY created_at, rowid",
            tuple(s.value for s in TERMINAL_STATUSES),
        )

    def _query(self, sql: str, args: tuple[Any, ...]) -> list[Turn]:
        assert self._conn is not None
        return [_row_to_turn(r) for r in self._conn.execute(sql, args).fetchall()]

    # -- turns: writes ---------------------------------------------------------

    async def create(self, turn: Turn) -> Turn:
        return await self._run(self._create_sync, turn)

    def _create_sync(self, turn: Turn) -> Turn:
        assert self._conn is not None
        marks = ",".join("?" for _ in COLUMNS)
        try:
            self._conn.execute(f"INSERT INTO turns ({', '.join(COLUMNS)}) VALUES ({marks})", _turn_to_row(turn))
        except sqlite3.IntegrityError as exc:
            raise DuplicateTurn(turn.id) from exc
        return turn

    async def transition(
        self,
        turn_id: str,
        target: TurnStatus,
        *,
        at: datetime,
        stop_reason: StopReason | None = None,
        error: str | None = None,
    ) -> TransitionResult:
        return await self._run(self._tx, lambda c: self._transition_in(c, turn_id, target, at, stop_reason, error))

    def _transition_in(
        self,
        conn: sqlite3.Connection,
        turn_id: str,
        target: TurnStatus,
        at: datetime,
        stop_reason: StopReason | None,
        error: str | None,
    ) -> TransitionResult:
        current = self._get_sync(turn_id)
        previous = current.status
        if previous not in sources_of(target):
            outcome = Outcome.ALREADY_TERMINAL if previous.is_terminal else Outcome.CONFLICT
            return TransitionResult(outcome=outcome, turn=current, previous=previous)
        stamp = at.isoformat()
        conn.execute(
            "UPDATE turns SET status = ?, updated_at = ?,"
            " terminal_at = CASE WHEN ? THEN ? ELSE terminal_at END,"
            " stop_reason = COALESCE(stop_reason, ?), error = COALESCE(error, ?)"
            " WHERE id = ? AND status = ?",
            (
                target.value,
                stamp,
                target.is_terminal,
                stamp,
                stop_reason.model_dump_json() if stop_reason else None,
                error,
                turn_id,
                previous.value,
            ),
        )
        return TransitionResult(outcome=Outcome.APPLIED, turn=self._get_sync(turn_id), previous=previous)

    async def request_stop(
        self, turn_id: str, request_id: str, reason: StopReason, *, at: datetime, fingerprint: str = ""
    ) -> StopResult:
        return await self._run(self._tx, lambda c: self._request_stop_in(c, turn_id, request_id, reason, at, fingerprint))

    def _request_stop_in(
        self, conn: sqlite3.Connection, turn_id: str, request_id: str, reason: StopReason, at: datetime, fingerprint: str
    ) -> StopResult:
        seen = conn.execute(
            "SELECT turn_id, fingerprint, answer FROM stop_requests WHERE request_id = ?", (request_id,)
        ).fetchone()
        if seen is not None:
            if seen[0] != turn_id or seen[1] != fingerprint:
                raise IdempotencyConflict(f"request id {request_id!r} was used with other parameters")
            return StopResult(answer=StopAnswer(seen[2]), first=False, repeat=True, turn=self._get_sync(turn_id))
        turn = self._get_sync(turn_id)
        first = False
        if turn.status in (TurnStatus.RUNNING, TurnStatus.QUEUED):
            target = TurnStatus.CANCEL_REQUESTED if turn.status is TurnStatus.RUNNING else TurnStatus.CANCELLED
            res = self._transition_in(conn, turn_id, target, at, reason, None)
            turn, first, answer = res.turn, True, StopAnswer.ACCEPTED
        elif turn.status is TurnStatus.CANCEL_REQUESTED:
            answer = StopAnswer.ALREADY_STOPPING
        elif turn.status is TurnStatus.RECONCILE_REQUIRED:
            answer = StopAnswer.RECONCILE_REQUIRED
        else:
            answer = StopAnswer.ALREADY_TERMINAL
        conn.execute(
            "INSERT INTO stop_requests (request_id, turn_id, fingerprint, answer, at) VALUES (?,?,?,?,?)",
            (request_id, turn_id, fingerprint, answer.value, at.isoformat()),
        )
        return StopResult(answer=answer, first=first, repeat=False, turn=turn)

    async def update(self, turn_id: str, *, at: datetime, fence_owner: str | None = None, **fields: Any) -> Turn:
        bad = set(fields) - MUTABLE_FIELDS
        if bad:
            raise ValueError(f"not settable outside a transition: {sorted(bad)}")
        return await self._run(self._tx, lambda c: self._update_in(c, turn_id, at, fields, fence_owner))

    def _update_in(
        self, conn: sqlite3.Connection, turn_id: str, at: datetime, fields: dict[str, Any], fence_owner: str | None = None
    ) -> Turn:
        if fence_owner is not None:  # in the same transaction as the write
            holder = self._get_sync(turn_id).lease_owner
            if holder != fence_owner:
                raise LeaseLost(turn_id, holder)
        names = sorted(fields)
        sets = "".join(f"{n} = ?, " for n in names)
        cur = conn.execute(
            f"UPDATE turns SET {sets}updated_at = ? WHERE id = ?",
            (*[to_db(fields[n]) for n in names], at.isoformat(), turn_id),
        )
        if cur.rowcount == 0:
            raise UnknownTurn(turn_id)
        return self._get_sync(turn_id)

    async def heartbeat(self, owner: str, turn_ids: list[str], *, at: datetime) -> int:
        if not turn_ids:
            return 0
        return await self._run(self._tx, lambda c: self._heartbeat_in(c, owner, turn_ids, at))

    async def take_over(
        self, turn_id: str, owner: str, *, expect_owner: str | None, expect_heartbeat: datetime | None, at: datetime
    ) -> bool:
        def run(conn: sqlite3.Connection) -> bool:
            self._get_sync(turn_id)  # UnknownTurn
            cur = conn.execute(
                "UPDATE turns SET lease_owner = ?, heartbeat_at = ?, updated_at = ?"
                " WHERE id = ? AND status = ? AND lease_owner IS ? AND heartbeat_at IS ?",
                (owner, at.isoformat(), at.isoformat(), turn_id, TurnStatus.RUNNING.value, expect_owner,
                 expect_heartbeat.isoformat() if expect_heartbeat is not None else None),
            )
            return cur.rowcount == 1

        return await self._run(self._tx, run)

    @staticmethod
    def _heartbeat_in(conn: sqlite3.Connection, owner: str, turn_ids: list[str], at: datetime) -> int:
        marks = ",".join("?" for _ in turn_ids)
        terminal = ",".join("?" for _ in TERMINAL_STATUSES)
        cur = conn.execute(
            f"UPDATE turns SET heartbeat_at = ? WHERE lease_owner = ? AND id IN ({marks})"
            f" AND status NOT IN ({terminal})",
            (at.isoformat(), owner, *turn_ids, *(s.value for s in TERMINAL_STATUSES)),
        )
        return cur.rowcount


def _turn_to_row(t: Turn) -> tuple[Any, ...]:
    return tuple(to_db(getattr(t, c)) for c in COLUMNS)


def _row_to_turn(row: tuple[Any, ...]) -> Turn:
    data: dict[str, Any] = {}
    for name, value in zip(COLUMNS, row, strict=True):
        if value is None:
            continue
        if name in _MODEL_FIELDS:
            data[name] = _MODEL_FIELDS[name].model_validate_json(value)
        else:
            data[name] = value
    return Turn.model_validate(data)
