"""The SQLite store's downstream work queue (``TurnStore.queue_*``): a
table of JSON items, claimed by one consumer each, acknowledged when done.
"""

from __future__ import annotations

import json
import sqlite3
from typing import Any

from turn.sqlite_connection import SqliteConnection


class SqliteWorkQueue(SqliteConnection):
    """The work-queue methods of :class:`turn.store.TurnStore` on SQLite."""

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
