"""SQLite store: the embedded default (one instance, durable across restarts).

The database is one file (default ``./var/turnkeeper.db``, created with its
folder on first use) in WAL mode. Every method runs as one transaction on a
single dedicated thread, so calls never interleave and never block the event
loop. With WAL and ``synchronous=NORMAL`` a committed transaction survives a
crash of the process (SQLite docs, "Write-Ahead Logging"); it may be lost
only on power loss of the host.

One process serves one file: waiting for new events uses an in-process
notification, and turns left open at startup belonged to a dead process.

The store's parts: the connection (:mod:`turn.sqlite_connection`), the
schema and its migrations (:mod:`turn.sqlite_schema`), turn rows
(:mod:`turn.sqlite_turns`), event rows (:mod:`turn.sqlite_events`), ledger
rows (:mod:`turn.sqlite_ledger`) and the work queue
(:mod:`turn.sqlite_queue`).
"""

from __future__ import annotations

import os
import sqlite3
from datetime import datetime, timedelta

from turn.models import InstanceInfo
from turn.sqlite_events import SqliteEventRows
from turn.sqlite_ledger import SqliteLedgerRows
from turn.sqlite_queue import SqliteWorkQueue
from turn.sqlite_turns import SqliteTurnRows


class SqliteStore(SqliteTurnRows, SqliteEventRows, SqliteLedgerRows, SqliteWorkQueue):
    """:class:`turn.store.TurnStore` on one SQLite file.

    Args:
        path: database file; its parent folder is created on :meth:`open`.
        busy_timeout_ms: how long a call waits for another writer's lock
            before it fails with :class:`turn.store.StoreUnavailable`.
    """

    #: a single process serves this store (see module doc)
    single_instance = True

    # -- the fleet ------------------------------------------------------------------

    async def instance_heartbeat(self, info: InstanceInfo, ttl_s: float) -> None:
        expires = (info.heartbeat_at + timedelta(seconds=ttl_s)).isoformat()
        await self._run(self._tx, lambda c: c.execute(
            "INSERT INTO instances (id, info, expires_at) VALUES (?, ?, ?) "
            "ON CONFLICT (id) DO UPDATE SET info = excluded.info, expires_at = excluded.expires_at",
            (info.id, info.model_dump_json(), expires),
        ))

    async def instance_list(self, now: datetime) -> list[InstanceInfo]:
        rows = await self._run(
            self._read_all, "SELECT info FROM instances WHERE expires_at > ? ORDER BY id", (now.isoformat(),)
        )
        return [InstanceInfo.model_validate_json(r[0]) for r in rows]

    async def instance_remove(self, instance_id: str) -> None:
        await self._run(self._tx, lambda c: c.execute("DELETE FROM instances WHERE id = ?", (instance_id,)))

    # -- shared secrets --------------------------------------------------------

    async def secret(self, name: str) -> bytes:
        return await self._run(self._tx, lambda c: self._secret_in(c, name))

    @staticmethod
    def _secret_in(conn: sqlite3.Connection, name: str) -> bytes:
        conn.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)", (name, os.urandom(32)))
        return bytes(conn.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0])

    # -- device tokens ------------------------------------------------------------

    async def device_add(self, device_id: str, tenant_id: str, token_hash: str, created_at: datetime) -> None:
        def add(conn: sqlite3.Connection) -> None:
            try:
                conn.execute(
                    "INSERT INTO devices (device_id, tenant_id, token_hash, created_at) VALUES (?, ?, ?, ?)",
                    (device_id, tenant_id, token_hash, created_at.isoformat()),
                )
            except sqlite3.IntegrityError as exc:
                raise ValueError(f"device {device_id!r} or its token exists already") from exc

        await self._run(self._tx, add)

    async def device_by_token(self, token_hash: str) -> tuple[str, str] | None:
        row = await self._run(
            self._read_one, "SELECT device_id, tenant_id FROM devices WHERE token_hash = ? AND revoked_at IS NULL",
            (token_hash,),
        )
        return (row[0], row[1]) if row is not None else None

    async def device_revoke(self, device_id: str, tenant_id: str) -> bool:
        def revoke(conn: sqlite3.Connection) -> bool:
            cur = conn.execute(
                "UPDATE devices SET revoked_at = datetime('now') WHERE device_id = ? AND tenant_id = ? "
                "AND revoked_at IS NULL", (device_id, tenant_id),
            )
            return cur.rowcount == 1

        return await self._run(self._tx, revoke)

    # -- client tokens ---------------------------------------------------------------

    async def client_token_put(self, token_hash: str, grant: str, expires_at: datetime, now: datetime) -> None:
        def put(conn: sqlite3.Connection) -> None:
            conn.execute(
                "INSERT INTO client_tokens (token_hash, grant_json, expires_at) VALUES (?, ?, ?) "
                "ON CONFLICT (token_hash) DO UPDATE SET grant_json = excluded.grant_json, expires_at = excluded.expires_at",
                (token_hash, grant, expires_at.isoformat()),
            )

        await self._run(self._tx, put)

    async def client_token_claim(self, token_hash: str, now: datetime) -> str | None:
        def claim(conn: sqlite3.Connection) -> str | None:
            row = conn.execute(
                "DELETE FROM client_tokens WHERE token_hash = ? RETURNING grant_json, expires_at", (token_hash,)
            ).fetchone()
            # grants never claimed go with the next claim after they expire
            conn.execute("DELETE FROM client_tokens WHERE expires_at <= ?", (now.isoformat(),))
            if row is None or datetime.fromisoformat(row[1]) <= now:
                return None
            return str(row[0])

        return await self._run(self._tx, claim)

    async def claim_once(self, key: str, expires_at: datetime, now: datetime) -> bool:
        def claim(conn: sqlite3.Connection) -> bool:
            conn.execute("DELETE FROM claims WHERE expires_at <= ?", (now.isoformat(),))
            cur = conn.execute("INSERT OR IGNORE INTO claims (key, expires_at) VALUES (?, ?)", (key, expires_at.isoformat()))
            return cur.rowcount == 1

        return await self._run(self._tx, claim)

