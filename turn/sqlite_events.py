"""The SQLite store's event rows: each session's log, numbered by the
session's ``event_seq`` counter in the same transaction that inserts the
event. Waiting for new events uses an in-process notification (one
process serves the file).
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
from datetime import datetime

from turn.models import EventRecord
from turn.sqlite_connection import SqliteConnection


class SqliteEventRows(SqliteConnection):
    """The event-log methods of :class:`turn.store.TurnStore` on SQLite."""

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
        self._event_waiting[waiter] = self._event_waiting.get(waiter, 0) + 1
        try:
            if await self._run(self._last_seq_sync, session_id) > after_seq:
                return True
            async with asyncio.timeout(timeout_s):
                await waiter.wait()
            return True
        except TimeoutError:
            return False
        finally:
            # however the wait ended (an event, a timeout, a cancel), the
            # session's entry goes with its last waiter: an ended session
            # leaves nothing behind
            left = self._event_waiting.pop(waiter, 1) - 1
            if left > 0:
                self._event_waiting[waiter] = left
            elif self._event_waiters.get(session_id) is waiter:
                del self._event_waiters[session_id]

    def _last_seq_sync(self, session_id: str) -> int:
        assert self._conn is not None
        row = self._conn.execute("SELECT event_seq FROM sessions WHERE id = ?", (session_id,)).fetchone()
        return int(row[0]) if row else 0
