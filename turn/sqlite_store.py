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

    # -- shared secrets --------------------------------------------------------

    async def secret(self, name: str) -> bytes:
        return await self._run(self._tx, lambda c: self._secret_in(c, name))

    @staticmethod
    def _secret_in(conn: sqlite3.Connection, name: str) -> bytes:
        conn.execute("INSERT OR IGNORE INTO secrets (name, value) VALUES (?, ?)", (name, os.urandom(32)))
        return bytes(conn.execute("SELECT value FROM secrets WHERE name = ?", (name,)).fetchone()[0])
