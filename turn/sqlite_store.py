"""SQLite store: the embedded default (one instance, durable across restarts).

The database is one file (default ``./var/turnkeeper.db``, created with its
folder on first use) in WAL mode. Every method runs as one transaction on a
single dedicated thread, so calls never interleave and never block the event
loop. With WAL and ``synchronous=NORMAL`` a committed transaction survives a
crash of the process (SQLite docs, "Write-Ahead Logging"); it may be lost
only on power loss of the host.

One process serves one file: waiting for new events uses an in-process
notification, and turns left open at startup belonged to a dead process.
"""

from __future__ import annotations

import asyncio
import fcntl
import json
import os
import sqlite3
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, Callable, TypeVar

from pydantic import BaseModel

from turn.intents import OPEN, AuditRow, Intent
from turn.models import (
    TERMINAL_STATUSES,
    Budget,
    EventRecord,
    Session,
    Spent,
    StopReason,
    StopReport,
    Turn,
    TurnStatus,
    Usage,
)
from turn.states import Outcome, TransitionResult, sources_of
from turn.store import (
    MUTABLE_FIELDS,
    DuplicateSession,
    StoreError,
    DuplicateTurn,
    IdempotencyConflict,
    StopAnswer,
    StopResult,
    StoreUnavailable,
    UnknownIntent,
    UnknownSession,
    UnknownTurn,
)

T = TypeVar("T")

SCHEMA_VERSION = 5

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
CREATE TABLE IF NOT EXISTS sessions (
    id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    kind TEXT NOT NULL,
    generation INTEGER NOT NULL DEFAULT 0,
    event_seq INTEGER NOT NULL DEFAULT 0,
    created_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS events (
    session_id TEXT NOT NULL,
    seq INTEGER NOT NULL,
    turn_id TEXT,
    generation INTEGER NOT NULL,
    type TEXT NOT NULL,
    at TEXT NOT NULL,
    payload TEXT NOT NULL,
    fenced INTEGER NOT NULL DEFAULT 0,
    PRIMARY KEY (session_id, seq)
);
CREATE TABLE IF NOT EXISTS stop_requests (
    request_id TEXT PRIMARY KEY,
    turn_id TEXT NOT NULL,
    fingerprint TEXT NOT NULL,
    answer TEXT NOT NULL,
    at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS ledger (
    key TEXT PRIMARY KEY,
    turn_id TEXT NOT NULL,
    status TEXT NOT NULL,
    next_attempt_at TEXT,
    version INTEGER NOT NULL,
    data TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_by_turn ON ledger (turn_id);
CREATE INDEX IF NOT EXISTS ledger_open ON ledger (status, next_attempt_at);
CREATE TABLE IF NOT EXISTS ledger_audit (
    key TEXT NOT NULL,
    at TEXT NOT NULL,
    action TEXT NOT NULL,
    detail TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS ledger_audit_by_key ON ledger_audit (key);
CREATE TABLE IF NOT EXISTS work_queue (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    queue TEXT NOT NULL,
    item TEXT NOT NULL,
    claimed_by TEXT,
    acked INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS work_queue_open ON work_queue (queue, acked, claimed_by);
CREATE TABLE IF NOT EXISTS secrets (
    name TEXT PRIMARY KEY,
    value BLOB NOT NULL
);
"""

# Columns added after the first release (schema 1), in schemas 2, 3 and 5:
# name -> SQL type/default.
_TURN_COLUMNS_V2 = {
    "deadline_at": "TEXT",
    "budget": "TEXT NOT NULL DEFAULT '{}'",
    "spent": "TEXT NOT NULL DEFAULT '{}'",
    "step_count": "INTEGER NOT NULL DEFAULT 0",
    "usage": "TEXT NOT NULL DEFAULT '{}'",
    "lease_owner": "TEXT",
    "heartbeat_at": "TEXT",
    # schema 3
    "max_steps": "INTEGER NOT NULL DEFAULT 16",
    "stop_report": "TEXT",
    # schema 5: what was generated but not heard, and continuation merges
    "reply_unheard": "TEXT",
    "merged_into": "TEXT",
}

_COLUMNS = [
    "id", "tenant_id", "session_id", "kind", "status", "generation", "stop_reason", "error",
    "transcript", "reply", "created_at", "updated_at", "terminal_at", *_TURN_COLUMNS_V2,
]
_SELECT = f"SELECT {', '.join(_COLUMNS)} FROM turns"
_MODEL_FIELDS = {
    "stop_reason": StopReason, "budget": Budget, "spent": Spent, "usage": Usage, "stop_report": StopReport,
}


class StoreInUse(StoreError):
    """Another process serves this SQLite file (one process per file: it
    stops open turns at startup, which would cut another server's turns)."""


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

    #: a single process serves this store (see module doc)
    single_instance = True

    def __init__(self, path: str | Path, *, busy_timeout_ms: int = 5000) -> None:
        self.path = Path(path)
        self.busy_timeout_ms = busy_timeout_ms
        self._executor: ThreadPoolExecutor | None = None
        self._conn: sqlite3.Connection | None = None
        self._lock_fd: int | None = None
        self._event_waiters: dict[str, asyncio.Event] = {}

    async def open(self) -> None:
        if self._executor is not None:
            return
        self._executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="sqlite-store")
        try:
            await self._run(self._open_sync)
        except BaseException:
            self._executor.shutdown(wait=False)
            self._executor = None
            if self._lock_fd is not None:
                os.close(self._lock_fd)
                self._lock_fd = None
            raise

    def _open_sync(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # One process per file, enforced with an advisory lock (flock) on a
        # sibling file; the kernel drops it if the process dies.
        fd = os.open(f"{self.path}.lock", os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise StoreInUse(f"another turnkeeper process is using {self.path}") from None
        self._lock_fd = fd
        conn = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
        conn.execute("PRAGMA journal_mode=WAL")
        conn.execute("PRAGMA synchronous=NORMAL")
        conn.execute(f"PRAGMA busy_timeout={int(self.busy_timeout_ms)}")
        conn.executescript(_SCHEMA)
        have = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
        for name, decl in _TURN_COLUMNS_V2.items():
            if name not in have:  # a file from schema 1 or 2: add what is missing
                conn.execute(f"ALTER TABLE turns ADD COLUMN {name} {decl}")
        conn.execute("CREATE INDEX IF NOT EXISTS turns_open ON turns (status)")
        conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
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
        if self._lock_fd is not None:
            os.close(self._lock_fd)  # releases the lock
            self._lock_fd = None

    async def _run(self, fn: Callable[..., T], *args: Any) -> T:
        if self._executor is None:
            raise RuntimeError("store is not open")
        try:
            return await asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)
        except sqlite3.OperationalError as exc:  # locked, busy, I/O: nothing committed
            raise StoreUnavailable(f"sqlite: {exc}") from exc

    def _tx(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn`` in one write transaction (BEGIN IMMEDIATE)."""
        conn = self._conn
        assert conn is not None
        conn.execute("BEGIN IMMEDIATE")
        try:
            out = fn(conn)
            conn.execute("COMMIT")
            return out
        except BaseException:
            if conn.in_transaction:
                conn.execute("ROLLBACK")
            raise

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

    @staticmethod
    def _bump(conn: sqlite3.Connection, session_id: str, column: str) -> int:
        row = conn.execute(
            f"UPDATE sessions SET {column} = {column} + 1 WHERE id = ? RETURNING {column}", (session_id,)
        ).fetchone()
        if row is None:
            raise UnknownSession(session_id)
        return int(row[0])

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
        marks = ",".join("?" for _ in _COLUMNS)
        try:
            self._conn.execute(f"INSERT INTO turns ({', '.join(_COLUMNS)}) VALUES ({marks})", _turn_to_row(turn))
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

    async def update(self, turn_id: str, *, at: datetime, **fields: Any) -> Turn:
        bad = set(fields) - MUTABLE_FIELDS
        if bad:
            raise ValueError(f"not settable outside a transition: {sorted(bad)}")
        return await self._run(self._tx, lambda c: self._update_in(c, turn_id, at, fields))

    def _update_in(self, conn: sqlite3.Connection, turn_id: str, at: datetime, fields: dict[str, Any]) -> Turn:
        names = sorted(fields)
        sets = "".join(f"{n} = ?, " for n in names)
        cur = conn.execute(
            f"UPDATE turns SET {sets}updated_at = ? WHERE id = ?",
            (*[_to_db(fields[n]) for n in names], at.isoformat(), turn_id),
        )
        if cur.rowcount == 0:
            raise UnknownTurn(turn_id)
        return self._get_sync(turn_id)

    async def heartbeat(self, owner: str, turn_ids: list[str], *, at: datetime) -> int:
        if not turn_ids:
            return 0
        return await self._run(self._tx, lambda c: self._heartbeat_in(c, owner, turn_ids, at))

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

    # -- event log -------------------------------------------------------------

    async def append_event(self, event: EventRecord) -> EventRecord:
        stored = await self._run(self._tx, lambda c: self._append_in(c, event))
        waiter = self._event_waiters.pop(event.session_id, None)
        if waiter is not None:
            waiter.set()
        return stored

    def _append_in(self, conn: sqlite3.Connection, event: EventRecord) -> EventRecord:
        seq = self._bump(conn, event.session_id, "event_seq")
        conn.execute(
            "INSERT INTO events (session_id, seq, turn_id, generation, type, at, payload, fenced) VALUES (?,?,?,?,?,?,?,?)",
            (
                event.session_id,
                seq,
                event.turn_id,
                event.generation,
                event.type,
                event.at.isoformat(),
                json.dumps(event.payload, separators=(",", ":")),
                int(event.fenced),
            ),
        )
        return event.model_copy(update={"seq": seq})

    async def read_events(self, session_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRecord]:
        return await self._run(self._read_events_sync, session_id, after_seq, limit)

    def _read_events_sync(self, session_id: str, after_seq: int, limit: int) -> list[EventRecord]:
        assert self._conn is not None
        rows = self._conn.execute(
            "SELECT session_id, seq, turn_id, generation, type, at, payload, fenced FROM events"
            " WHERE session_id = ? AND seq > ? ORDER BY seq LIMIT ?",
            (session_id, after_seq, limit),
        ).fetchall()
        return [
            EventRecord(
                session_id=r[0], seq=r[1], turn_id=r[2], generation=r[3], type=r[4],
                at=datetime.fromisoformat(r[5]), payload=json.loads(r[6]), fenced=bool(r[7]),
            )
            for r in rows
        ]

    async def mark_fenced(self, session_id: str, seq: int) -> None:
        await self._run(self._mark_fenced_sync, session_id, seq)

    def _mark_fenced_sync(self, session_id: str, seq: int) -> None:
        assert self._conn is not None
        self._conn.execute("UPDATE events SET fenced = 1 WHERE session_id = ? AND seq = ?", (session_id, seq))

    async def wait_events(self, session_id: str, after_seq: int, timeout_s: float) -> bool:
        waiter = self._event_waiters.setdefault(session_id, asyncio.Event())
        if await self._run(self._last_seq_sync, session_id) > after_seq:
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await waiter.wait()
            return True
        except TimeoutError:
            return False

    def _last_seq_sync(self, session_id: str) -> int:
        assert self._conn is not None
        row = self._conn.execute("SELECT event_seq FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return int(row[0]) if row else 0

    # -- secrets ---------------------------------------------------------------

    # -- side-effect ledger ----------------------------------------------------

    async def ledger_add(self, intent: Intent) -> tuple[Intent, bool]:
        return await self._run(self._tx, lambda c: self._ledger_add_in(c, intent))

    @staticmethod
    def _ledger_add_in(conn: sqlite3.Connection, intent: Intent) -> tuple[Intent, bool]:
        row = conn.execute("SELECT data FROM ledger WHERE key = ?", (intent.key,)).fetchone()
        if row is not None:
            return Intent.model_validate_json(row[0]), False
        conn.execute(
            "INSERT INTO ledger (key, turn_id, status, next_attempt_at, version, data) VALUES (?,?,?,?,?,?)",
            (intent.key, intent.turn_id, intent.status.value, _to_db(intent.next_attempt_at), intent.version,
             intent.model_dump_json()),
        )
        return intent, True

    async def ledger_get(self, key: str) -> Intent:
        row = await self._run(lambda: self._read_one("SELECT data FROM ledger WHERE key = ?", (key,)))
        if row is None:
            raise UnknownIntent(key)
        return Intent.model_validate_json(row[0])

    def _read_one(self, sql: str, args: tuple[Any, ...]) -> Any:
        assert self._conn is not None
        return self._conn.execute(sql, args).fetchone()

    def _read_all(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        assert self._conn is not None
        return self._conn.execute(sql, args).fetchall()

    async def ledger_replace(self, intent: Intent) -> bool:
        return await self._run(self._tx, lambda c: self._ledger_replace_in(c, intent))

    @staticmethod
    def _ledger_replace_in(conn: sqlite3.Connection, intent: Intent) -> bool:
        cur = conn.execute(
            "UPDATE ledger SET status = ?, next_attempt_at = ?, version = ?, data = ? WHERE key = ? AND version = ?",
            (intent.status.value, _to_db(intent.next_attempt_at), intent.version, intent.model_dump_json(),
             intent.key, intent.version - 1),
        )
        if cur.rowcount == 0:
            if conn.execute("SELECT 1 FROM ledger WHERE key = ?", (intent.key,)).fetchone() is None:
                raise UnknownIntent(intent.key)
            return False
        return True

    async def ledger_list(self, turn_id: str) -> list[Intent]:
        rows = await self._run(lambda: self._read_all("SELECT data FROM ledger WHERE turn_id = ? ORDER BY rowid", (turn_id,)))
        return [Intent.model_validate_json(r[0]) for r in rows]

    async def ledger_due(self, now: datetime, limit: int = 100) -> list[Intent]:
        marks = ",".join("?" for _ in _OPEN_STATUSES)
        rows = await self._run(
            lambda: self._read_all(
                f"SELECT data FROM ledger WHERE status IN ({marks})"
                " AND (next_attempt_at IS NULL OR next_attempt_at <= ?) ORDER BY rowid LIMIT ?",
                (*_OPEN_STATUSES, now.isoformat(), limit),
            )
        )
        return [Intent.model_validate_json(r[0]) for r in rows]

    async def ledger_open_count(self) -> int:
        marks = ",".join("?" for _ in _OPEN_STATUSES)
        row = await self._run(lambda: self._read_one(f"SELECT COUNT(*) FROM ledger WHERE status IN ({marks})", _OPEN_STATUSES))
        return int(row[0])

    async def audit_add(self, row: AuditRow) -> None:
        await self._run(
            self._tx,
            lambda c: c.execute(
                "INSERT INTO ledger_audit (key, at, action, detail) VALUES (?,?,?,?)",
                (row.key, row.at.isoformat(), row.action, row.detail),
            ),
        )

    async def audit_list(self, key: str) -> list[AuditRow]:
        rows = await self._run(
            lambda: self._read_all("SELECT key, at, action, detail FROM ledger_audit WHERE key = ? ORDER BY rowid", (key,))
        )
        return [AuditRow(key=r[0], at=datetime.fromisoformat(r[1]), action=r[2], detail=r[3]) for r in rows]

    # -- downstream work queue ---------------------------------------------------

    async def queue_push(self, queue: str, item: dict[str, Any]) -> str:
        cur = await self._run(
            self._tx, lambda c: c.execute("INSERT INTO work_queue (queue, item) VALUES (?, ?)", (queue, json.dumps(item)))
        )
        return str(cur.lastrowid)

    async def queue_claim(self, queue: str, consumer: str, count: int = 10) -> list[tuple[str, dict[str, Any]]]:
        return await self._run(self._tx, lambda c: self._claim_in(c, queue, consumer, count))

    @staticmethod
    def _claim_in(conn: sqlite3.Connection, queue: str, consumer: str, count: int) -> list[tuple[str, dict[str, Any]]]:
        rows = conn.execute(
            "SELECT id, item FROM work_queue WHERE queue = ? AND acked = 0 AND claimed_by IS NULL ORDER BY id LIMIT ?",
            (queue, count),
        ).fetchall()
        for r in rows:
            conn.execute("UPDATE work_queue SET claimed_by = ? WHERE id = ?", (consumer, r[0]))
        return [(str(r[0]), json.loads(r[1])) for r in rows]

    async def queue_ack(self, queue: str, item_id: str) -> None:
        await self._run(
            self._tx, lambda c: c.execute("UPDATE work_queue SET acked = 1 WHERE queue = ? AND id = ?", (queue, int(item_id)))
        )

    async def queue_pending(self, queue: str) -> int:
        row = await self._run(lambda: self._read_one("SELECT COUNT(*) FROM work_queue WHERE queue = ? AND acked = 0", (queue,)))
        return int(row[0])

    async def secret(self, name: str) -> bytes:
        return await self._run(self._tx, lambda c: self._secret_in(c, name))

    @staticmethod
    def _secret_in(conn: sqlite3.Connection, name: str) -> bytes:
        conn.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)", (name, os.urandom(32)))
        return bytes(conn.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0])


_OPEN_STATUSES = tuple(s.value for s in OPEN)


def _to_db(value: Any) -> Any:
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if isinstance(value, datetime):
        return value.isoformat()
    return value


def _turn_to_row(t: Turn) -> tuple[Any, ...]:
    return tuple(_to_db(getattr(t, c)) for c in _COLUMNS)


def _row_to_turn(row: tuple[Any, ...]) -> Turn:
    data: dict[str, Any] = {}
    for name, value in zip(_COLUMNS, row):
        if value is None:
            continue
        if name in _MODEL_FIELDS:
            data[name] = _MODEL_FIELDS[name].model_validate_json(value)
        else:
            data[name] = value
    return Turn.model_validate(data)
