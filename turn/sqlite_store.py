"""SQLite store: the embedded default (one instance, durable across restarts).

The database is one file (default ``./var/turnkeeper.db``, created with its
folder on first use) in WAL mode. Every method runs as one transaction on a
single dedicated thread, so calls never interleave and never block the event
loop. With WAL and ``synchronous=NORMAL`` a committed transition survives a
crash of the process (SQLite docs, "Write-Ahead Logging"); it may be lost only
on power loss of the host.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, TypeVar

from turn.models import TERMINAL_STATUSES, StopReason, Turn, TurnStatus
from turn.states import Outcome, TransitionResult, sources_of
from turn.store import MUTABLE_FIELDS, DuplicateTurn, StoreUnavailable, UnknownTurn

T = TypeVar("T")

_SCHEMA = """
CREATE TABLE IF NOT EXISTS turns (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    session_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    status TEXT NOT NULL,
    generation INTEGER NOT NULL,
    stop_reason TEXT,
    error TEXT,
    transcript TEXT,
    reply TEXT,
    created_at TEXT NOT NULL,
    updated_at TEXT NOT NULL,
    terminal_at TEXT
);
CREATE INDEX IF NOT EXISTS turns_by_session ON turns (session_id, created_at);
"""

_COLUMNS = (
    "id, tenant_id, session_id, kind, status, generation, stop_reason, error, "
    "transcript, reply, created_at, updated_at, terminal_at"
)


def path_from_url(url: str) -> Path:
    """Parse ``sqlite:///relative/path.db`` or ``sqlite:////abs/path.db``.

    Raises:
        ValueError: not a ``sqlite:///`` URL.
    """
    prefix = "sqlite:///"
    if not url.startswith(prefix) or len(url) == len(prefix):
        raise ValueError(f"not a sqlite URL (want sqlite:///path): {url!r}")
    return Path(url[len(prefix):])


class SqliteStore:
    """:class:`turn.store.TurnStore` on one SQLite file.

    Args:
        path: database file; its parent folder is created on :meth:`open`.
        busy_timeout_ms: how long a call waits for another writer's lock
            before it fails with :class:`turn.store.StoreUnavailable`.
    """

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path)
        self.busy_timeout_ms = busy_timeout_ms
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None

    async def open(self) -> None:
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        await self._run(self._open_sync)

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_ms)}")
        conn.executescript(_SCHEMA)
        self._conn = conn

    async def close(self) -> None:
        if self._executor is None:
            return
        try:
            await self._run(self._close_sync)
        finally:
            self._executor.shutdown(wait=True)
            self._executor = None

    def _close_sync(self) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise RuntimeError("store is not open")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.OperationalError as exc:  # locked, busy, I/O: nothing committed
            raise StoreUnavailable(f"sqlite: {exc}") from exc

    # -- reads ---------------------------------------------------------------

    async def get(self, turn_id: str) -> Turn:
        return await self._run(self._get_sync, turn_id)

    def _get_sync(self, turn_id: str) -> Turn:
        assert self._conn is not None
        row = self._conn.execute(f"SELECT {_COLUMNS} FROM turns WHERE id = ?", (turn_id,)).fetchone()
        if row is None:
            raise UnknownTurn(turn_id)
        return _row_to_turn(row)

    async def list_session(self, session_id: str) -> list[Turn]:
        return await self._run(self._list_session_sync, session_id)

    def _list_session_sync(self, session_id: str) -> list[Turn]:
        assert self._conn is not None
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM turns WHERE session_id = ? ORDER BY created_at, rowid",
            (session_id,),
        ).fetchall()
        return [_row_to_turn(r) for r in rows]

    async def list_open(self) -> list[Turn]:
        return await self._run(self._list_open_sync)

    def _list_open_sync(self) -> list[Turn]:
        assert self._conn is not None
        marks = ",".join("?" for _ in TERMINAL_STATUSES)
        rows = self._conn.execute(
            f"SELECT {_COLUMNS} FROM turns WHERE status NOT IN ({marks}) ORDER BY created_at, rowid",
            [s.value for s in TERMINAL_STATUSES],
        ).fetchall()
        return [_row_to_turn(r) for r in rows]

    # -- writes --------------------------------------------------------------

    async def create(self, turn: Turn) -> Turn:
        return await self._run(self._create_sync, turn)

    def _create_sync(self, turn: Turn) -> Turn:
        assert self._conn is not None
        try:
            self._conn.execute(
                f"INSERT INTO turns ({_COLUMNS}) VALUES (?,?,?,?,?,?,?,?,?,?,?,?,?)",
                _turn_to_row(turn),
            )
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
        return await self._run(self._transition_sync, turn_id, target, at, stop_reason, error)

    def _transition_sync(
        self,
        turn_id: str,
        target: TurnStatus,
        at: datetime,
        stop_reason: StopReason | None,
        error: str | None,
    ) -> TransitionResult:
        conn = self._conn
        assert conn is not None
        conn.execute("BEGIN IMMEDIATE")
        try:
            current = self._get_sync(turn_id)
            previous = current.status
            if previous not in sources_of(target):
                conn.execute("COMMIT")
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
            turn = self._get_sync(turn_id)
            conn.execute("COMMIT")
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise
        return TransitionResult(outcome=Outcome.APPLIED, turn=turn, previous=previous)

    async def update(self, turn_id: str, *, at: datetime, **fields: Any) -> Turn:
        bad = set(fields) - MUTABLE_FIELDS
        if bad:
            raise ValueError(f"not settable outside a transition: {sorted(bad)}")
        return await self._run(self._update_sync, turn_id, at, fields)

    def _update_sync(self, turn_id: str, at: datetime, fields: dict[str, Any]) -> Turn:
        assert self._conn is not None
        names = sorted(fields)
        sets = ", ".join(f"{n} = ?" for n in names)
        cur = self._conn.execute(
            f"UPDATE turns SET {sets}, updated_at = ? WHERE id = ?",
            (*[fields[n] for n in names], at.isoformat(), turn_id),
        )
        if cur.rowcount == 0:
            raise UnknownTurn(turn_id)
        return self._get_sync(turn_id)


def _turn_to_row(t: Turn) -> tuple[Any, ...]:
    return (
        t.id,
        t.tenant_id,
        t.session_id,
        t.kind.value,
        t.status.value,
        t.generation,
        t.stop_reason.model_dump_json() if t.stop_reason else None,
        t.error,
        t.transcript,
        t.reply,
        t.created_at.isoformat(),
        t.updated_at.isoformat(),
        t.terminal_at.isoformat() if t.terminal_at else None,
    )


def _row_to_turn(row: tuple[Any, ...]) -> Turn:
    (id_, tenant, session, kind, status, gen, reason, error, transcript, reply, created, updated, terminal) = row
    return Turn(
        id=id_,
        tenant_id=tenant,
        session_id=session,
        kind=kind,
        status=status,
        generation=gen,
        stop_reason=StopReason.model_validate(json.loads(reason)) if reason else None,
        error=error,
        transcript=transcript,
        reply=reply,
        created_at=datetime.fromisoformat(created),
        updated_at=datetime.fromisoformat(updated),
        terminal_at=datetime.fromisoformat(terminal) if terminal else None,
    )
