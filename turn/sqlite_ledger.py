"""The SQLite store's ledger rows: one row per intent (its JSON, with the
status, next attempt and version as columns for the compare-and-set and
the due query) and the audit rows of each key.
"""

from __future__ import annotations

import sqlite3
from datetime import datetime

from turn.intents import OPEN, AuditRow, Intent
from turn.sqlite_connection import SqliteConnection, to_db
from turn.store import UnknownIntent

_OPEN_STATUSES = tuple(s.value for s in OPEN)


class SqliteLedgerRows(SqliteConnection):
    """The side-effect ledger methods of :class:`turn.store.TurnStore` on SQLite."""

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
            (intent.key, intent.turn_id, intent.status.value, to_db(intent.next_attempt_at), intent.version,
             intent.model_dump_json()),
        )
        return intent, True

    async def ledger_get(self, key: str) -> Intent:
        row = await self._run(lambda: self._read_one("SELECT data FROM ledger WHERE key = ?", (key,)))
        if row is None:
            raise UnknownIntent(key)
        return Intent.model_validate_json(row[0])

    async def ledger_replace(self, intent: Intent) -> bool:
        return await self._run(self._tx, lambda c: self._ledger_replace_in(c, intent))

    @staticmethod
    def _ledger_replace_in(conn: sqlite3.Connection, intent: Intent) -> bool:
        cur = conn.execute(
            "UPDATE ledger SET status = ?, next_attempt_at = ?, version = ?, data = ? WHERE key = ? AND version = ?",
            (intent.status.value, to_db(intent.next_attempt_at), intent.version, intent.model_dump_json(),
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
