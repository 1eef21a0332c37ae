"""The SQLite store's schema and its migrations.

One file holds every table: ``turns``, ``sessions`` (with the generation
and event-sequence counters), ``events``, ``stop_requests``, ``ledger``,
``ledger_audit``, ``work_queue``, ``secrets``, ``devices`` (schema 6:
device tokens, hashed), ``instances`` (schema 7: the instances'
registrations), ``client_tokens`` (schema 8: single-use session-start
grants, by token hash) and ``claims`` (schema 8: credentials used once). :func:`migrate` brings a
file of any earlier schema (1 to 7) up to ``SCHEMA_VERSION`` in place: the
tables are created if missing, the turn columns added since schema 1 are
added, and ``PRAGMA user_version`` is set.
"""

from __future__ import annotations

import sqlite3

#: the schema this code writes (``PRAGMA user_version``)
SCHEMA_VERSION = 8

SCHEMA = """
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
CREATE TABLE IF NOT EXISTS devices (
    device_id TEXT PRIMARY KEY,
    tenant_id TEXT NOT NULL,
    token_hash TEXT NOT NULL UNIQUE,
    created_at TEXT NOT NULL,
    revoked_at TEXT
);
CREATE TABLE IF NOT EXISTS instances (
    id TEXT PRIMARY KEY,
    info TEXT NOT NULL,
    expires_at TEXT NOT NULL
);
CREATE TABLE IF NOT EXISTS client_tokens (
    token_hash TEXT PRIMARY KEY,
    grant_json TEXT NOT NULL,
    expires_at TEXT NOT NULL
);
CREATE INDEX IF NOT EXISTS client_tokens_expiry ON client_tokens (expires_at);
CREATE TABLE IF NOT EXISTS claims (
    key TEXT PRIMARY KEY,
    expires_at TEXT NOT NULL
);
"""

# Columns added after the first release (schema 1), in schemas 2, 3 and 5:
# name -> SQL type/default.
TURN_COLUMNS_ADDED = {
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


def migrate(conn: sqlite3.Connection) -> None:
    """Create what is missing of the schema on ``conn`` (idempotent) and
    mark the file ``SCHEMA_VERSION``.

    Raises:
        sqlite3.OperationalError: the file is locked or unwritable.
    """
    conn.executescript(SCHEMA)
    have = {row[1] for row in conn.execute("PRAGMA table_info(turns)")}
    for name, decl in TURN_COLUMNS_ADDED.items():
        if name not in have:  # a file from schema 1 or 2: add what is missing
            conn.execute(f"ALTER TABLE turns ADD COLUMN {name} {decl}")
    conn.execute("CREATE INDEX IF NOT EXISTS turns_open ON turns (status)")
    conn.execute(f"PRAGMA user_version={SCHEMA_VERSION}")
