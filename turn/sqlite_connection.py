"""The SQLite store's connection: one file, one process, one thread.

The database file is opened in WAL mode with ``synchronous=NORMAL`` (a
committed transaction survives a crash of the process; SQLite docs,
"Write-Ahead Logging") and served by one dedicated thread, so calls never
interleave and never block the event loop. One process serves one file,
enforced with an advisory lock (:class:`StoreInUse`).

:class:`SqliteConnection` is the base of every part of
:class:`turn.sqlite_store.SqliteStore` (turn rows, event rows, ledger rows,
the work queue): they run their SQL through :meth:`SqliteConnection._run`
and :meth:`SqliteConnection._tx`.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import sqlite3
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from datetime import datetime
from pathlib import Path
from typing import Any, TypeVar

from pydantic import BaseModel

from turn.sqlite_schema import migrate
from turn.store import StoreError, StoreUnavailable, UnknownSession

T = TypeVar("T")


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


class SqliteConnection:
    """The connection to one SQLite file and its writer thread.

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
        self._lock_fd: int | None = None
        #: a session's waiters for new events (:mod:`turn.sqlite_events`)
        self._event_waiters: dict[str, asyncio.Event] = {}
        #: how many wait on each of those events (its entry goes with the last)
        self._event_waiting: dict[asyncio.Event, int] = {}

    async def open(self) -> None:
        """Lock the file, connect, and migrate it
        (:func:`turn.sqlite_schema.migrate`). Idempotent.

        Raises:
            StoreInUse: another process serves the file.
            turn.store.StoreUnavailable: the file is locked or busy.
        """
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
        migrate(conn)
        self._conn = conn

    async def close(self) -> None:
        """Close the connection and release the file's lock. Idempotent."""
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

    def _read_one(self, sql: str, args: tuple[Any, ...]) -> Any:
        assert self._conn is not None
        return self._conn.execute(sql, args).fetchone()

    def _read_all(self, sql: str, args: tuple[Any, ...]) -> list[Any]:
        assert self._conn is not None
        return self._conn.execute(sql, args).fetchall()

    @staticmethod
    def _bump(conn: sqlite3.Connection, session_id: str, column: str) -> int:
        """Add 1 to a session's counter (``generation`` or ``event_seq``)
        inside the caller's transaction; returns the new value.

        Raises:
            UnknownSession: no such session.
        """
        row = conn.execute(
            f"UPDATE sessions SET {column} = {column} + 1 WHERE id = ? RETURNING {column}", (session_id,)
        ).fetchone()
        if row is None:
            raise UnknownSession(session_id)
        return int(row[0])


def to_db(value: Any) -> Any:
    """A field value as a column holds it: a pydantic model as JSON, a
    datetime as ISO 8601 text, anything else as it is."""
    if isinstance(value, BaseModel):
        return value.model_dump_json()
    if isinstance(value, datetime):
        return value.isoformat()
    return value
