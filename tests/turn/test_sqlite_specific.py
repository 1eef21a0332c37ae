"""What only the SQLite store does: files, locking, schema upgrade."""

from __future__ import annotations

import asyncio
import sqlite3
from datetime import UTC, datetime
from pathlib import Path

import pytest

from turn.models import EventRecord, Session, StopReason, StopReasonKind, Turn, TurnStatus
from turn.sqlite_connection import path_from_url
from turn.sqlite_store import SqliteStore
from turn.store import StoreUnavailable

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def new_turn() -> Turn:
    return Turn(session_id="s1", generation=1, created_at=NOW, updated_at=NOW)


async def test_survives_reopen(tmp_path: Path) -> None:
    path = tmp_path / "var" / "t.db"
    s1 = SqliteStore(path)
    await s1.open()
    t = await s1.create(new_turn())
    await s1.transition(t.id, TurnStatus.RUNNING, at=NOW)
    reason = StopReason(kind=StopReasonKind.BARGE_IN, initiator="t", at=NOW, request_id="r")
    await s1.request_stop(t.id, "r", reason, at=NOW)
    await s1.close()
    s2 = SqliteStore(path)
    await s2.open()
    got = await s2.get(t.id)
    assert got.status is TurnStatus.CANCEL_REQUESTED and got.stop_reason == reason
    assert (await s2.request_stop(t.id, "r", reason, at=NOW)).repeat  # the stop ledger survived too
    await s2.close()


async def test_upgrades_a_schema_1_file(tmp_path: Path) -> None:
    """A database made by the walking skeleton (no limits, no leases) opens
    and keeps its turns."""
    path = tmp_path / "old.db"
    conn = sqlite3.connect(path)
    conn.executescript(
        """
        CREATE TABLE turns (id TEXT PRIMARY KEY, tenant_id TEXT NOT NULL, session_id TEXT NOT NULL,
          kind TEXT NOT NULL, status TEXT NOT NULL, generation INTEGER NOT NULL, stop_reason TEXT,
          error TEXT, transcript TEXT, reply TEXT, created_at TEXT NOT NULL, updated_at TEXT NOT NULL,
          terminal_at TEXT);
        INSERT INTO turns VALUES ('old', 'default', 's', 'voice', 'COMPLETED', 1, NULL, NULL, 'hi',
          'hello', '2026-01-01T00:00:00+00:00', '2026-01-01T00:00:01+00:00', '2026-01-01T00:00:01+00:00');
        """
    )
    conn.close()
    s = SqliteStore(path)
    await s.open()
    got = await s.get("old")
    assert got.status is TurnStatus.COMPLETED and got.reply == "hello" and got.step_count == 0
    await s.close()


async def test_locked_database_is_unavailable_not_corrupt(tmp_path: Path) -> None:
    path = tmp_path / "locked.db"
    s = SqliteStore(path, busy_timeout_ms=50)
    await s.open()
    t = await s.create(new_turn())
    other = sqlite3.connect(path, isolation_level=None)
    other.execute("BEGIN EXCLUSIVE")  # another writer holds the lock
    try:
        with pytest.raises(StoreUnavailable):
            await s.transition(t.id, TurnStatus.RUNNING, at=NOW)
        with pytest.raises(StoreUnavailable):
            await s.create(new_turn())
    finally:
        other.execute("ROLLBACK")
        other.close()
    assert (await s.transition(t.id, TurnStatus.RUNNING, at=NOW)).applied
    await s.close()


async def test_unopenable_path(tmp_path: Path) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("not a folder")
    s = SqliteStore(blocker / "t.db")
    with pytest.raises(OSError):
        await s.open()


def test_path_from_url() -> None:
    assert path_from_url("sqlite:///var/turnkeeper.db") == Path("var/turnkeeper.db")
    assert path_from_url("sqlite:////tmp/x.db") == Path("/tmp/x.db")
    for bad in ("redis://x", "sqlite://", "sqlite:///", "var/x.db"):
        with pytest.raises(ValueError):
            path_from_url(bad)


async def test_one_process_per_file(tmp_path: Path) -> None:
    """A second server on the same file would stop the first one's turns as
    'abandoned' at its startup: it is refused instead."""
    from turn.sqlite_connection import StoreInUse

    path = tmp_path / "var" / "shared.db"
    first = SqliteStore(path)
    await first.open()
    second = SqliteStore(path)
    with pytest.raises(StoreInUse, match="another turnkeeper process"):
        await second.open()
    await first.close()
    await second.open()  # free again once the first is closed
    await second.close()


async def test_an_ended_wait_for_events_leaves_nothing_behind(tmp_path: Path) -> None:
    """However a follower's wait ends (a timeout, a cancel, an event), the
    session's waiter goes with its last waiter: a server that has followed
    a thousand sessions holds none of theirs (from review: one per session
    was kept, found by tests/e2e/test_session_release.py)."""
    store = SqliteStore(tmp_path / "w.db")
    await store.open()
    try:
        await store.create_session(Session(id="w", created_at=datetime.now(UTC)))
        assert not await store.wait_events("w", 0, 0.01)  # timed out
        cancelled = asyncio.create_task(store.wait_events("w", 0, 5))
        await asyncio.sleep(0.02)
        cancelled.cancel()
        await asyncio.gather(cancelled, return_exceptions=True)
        a = asyncio.create_task(store.wait_events("w", 0, 5))
        b = asyncio.create_task(store.wait_events("w", 0, 0.05))
        assert not await asyncio.wait_for(b, 5)  # b timed out; a still waits, and must still be woken
        assert not a.done()
        await store.append_event(EventRecord(session_id="w", type="x", at=datetime.now(UTC)))
        assert await asyncio.wait_for(a, 3)
        assert store._event_waiters == {} and store._event_waiting == {}
    finally:
        await store.close()
