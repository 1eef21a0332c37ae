"""The embedded agent's external system: an in-process service with its own
SQLite table that applies each idempotency key at most once and counts what
it applied, so tests, the fuzzer and a person trying the demo tools can see
exactly which effects happened, and how many times.

It stands for a shop, a payment processor and a messaging provider that
honour idempotency keys (as Stripe's API does with its ``Idempotency-Key``
header): a repeat of a key returns the first answer and applies nothing.

Faults can be injected per operation (:meth:`DemoService.inject`):
``fail_before`` (refused before any write: nothing applied),
``fail_after`` (applied, then the answer is lost: the caller cannot know),
``lookup_unknown`` (a lookup that cannot answer) and ``slow`` (the answer
takes ``slow_s``).
"""

from __future__ import annotations

import json
import sqlite3
import threading
from collections import defaultdict, deque
from pathlib import Path
from typing import Any

from turn.clock import Clock
from turn.intents import LookupAnswer
from turn.ledger import EffectNotApplied


class ServiceError(Exception):
    """The service failed; whether the effect was applied is not known to
    the caller."""


class DemoService:
    """The in-process external system.

    Args:
        clock: time source for its latency.
        path: its SQLite file; it outlives restarts, so a lookup after a
            crash still knows what was applied (":memory:": this process
            only, for tests).
        latency_s: time each call takes, s.
    """

    OPS = ("order", "payment", "batch", "message")

    def __init__(self, clock: Clock, path: str | Path = ":memory:", *, latency_s: float = 0.02) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.slow_s = 5.0
        #: keys of the apply calls that have arrived (answered or not), in order
        self.received: list[str] = []
        if str(path) != ":memory:":
            Path(path).parent.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(str(path), check_same_thread=False, isolation_level=None, timeout=5.0)
        self._lock = threading.Lock()
        self._db.executescript(
            """
            CREATE TABLE IF NOT EXISTS effects (
                key TEXT PRIMARY KEY,
                op TEXT NOT NULL,
                payload TEXT NOT NULL,
                applied INTEGER NOT NULL DEFAULT 1,
                reversed INTEGER NOT NULL DEFAULT 0,
                applied_at TEXT NOT NULL DEFAULT ''
            );
            CREATE TABLE IF NOT EXISTS repeats (key TEXT NOT NULL);
            """
        )
        self._faults: dict[str, deque[str]] = defaultdict(deque)

    def inject(self, op: str, *faults: str) -> None:
        """Queue faults for the next calls of ``op`` ("order", "payment",
        "batch", "message", "lookup", "reverse"), one per call."""
        self._faults[op].extend(faults)

    def clear_faults(self) -> None:
        """Forget every queued fault."""
        self._faults.clear()

    def _fault(self, op: str) -> str | None:
        q = self._faults.get(op)
        return q.popleft() if q else None

    def _sql(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        with self._lock:
            return self._db.execute(sql, args).fetchall()

    async def _wait(self, fault: str | None) -> None:
        await self.clock.sleep(self.slow_s if fault == "slow" else self.latency_s)

    async def apply(self, op: str, key: str, payload: dict[str, Any]) -> dict[str, Any]:
        """Apply ``op`` once per ``key``; a repeat returns the first answer.

        Raises:
            EffectNotApplied: a ``fail_before`` fault (nothing was applied).
            ServiceError: a ``fail_after`` fault (it *was* applied).
            ValueError: an unknown op or an empty key.
        """
        if op not in self.OPS:
            raise ValueError(f"unknown operation {op!r}")
        if not key:
            raise ValueError("an idempotency key is required")
        self.received.append(key)
        fault = self._fault(op)
        await self._wait(fault)
        if fault == "fail_before":
            raise EffectNotApplied(f"{op} refused before any write")
        with self._lock:
            row = self._db.execute("SELECT op, payload FROM effects WHERE key = ?", (key,)).fetchone()
            if row is None:
                self._db.execute(
                    "INSERT INTO effects (key, op, payload, applied_at) VALUES (?,?,?,?)",
                    (key, op, json.dumps(payload), self.clock.now().isoformat()),
                )
            else:
                self._db.execute("INSERT INTO repeats (key) VALUES (?)", (key,))
        if fault == "fail_after":
            raise ServiceError(f"{op} applied, but the answer was lost")
        return {"key": key, "op": op, **payload}

    async def reverse(self, key: str) -> bool:
        """Undo the effect of ``key`` (idempotent). Returns True if there was
        one to undo (now or before), False if ``key`` was never applied.

        Raises:
            ServiceError: a ``fail_before`` or ``fail_after`` fault.
        """
        fault = self._fault("reverse")
        await self._wait(fault)
        if fault == "fail_before":
            raise ServiceError("reverse refused")
        rows = self._sql("UPDATE effects SET reversed = 1 WHERE key = ? RETURNING key", (key,))
        if fault == "fail_after":
            raise ServiceError("reversed, but the answer was lost")
        return bool(rows)

    async def lookup(self, key: str) -> LookupAnswer:
        """Whether ``key`` was applied (``lookup_unknown`` fault: UNKNOWN)."""
        fault = self._fault("lookup")
        await self._wait(fault)
        if fault in ("lookup_unknown", "fail_before", "fail_after"):
            return LookupAnswer.UNKNOWN
        rows = self._sql("SELECT 1 FROM effects WHERE key = ?", (key,))
        return LookupAnswer.PRESENT if rows else LookupAnswer.ABSENT

    # -- what happened ---------------------------------------------------------------

    def applied(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Every applied key starting with ``prefix``: op, payload, reversed,
        applied_at (ISO time on the service's clock)."""
        rows = self._sql(
            "SELECT key, op, payload, reversed, applied_at FROM effects WHERE key LIKE ? ORDER BY rowid", (prefix + "%",)
        )
        return {r[0]: {"op": r[1], "payload": json.loads(r[2]), "reversed": bool(r[3]), "applied_at": r[4]} for r in rows}

    def times_applied(self, key: str) -> int:
        """How many times ``key`` was applied: 0 or 1 (the table's primary
        key makes a second application impossible; repeats are counted
        apart in :meth:`repeats`)."""
        return len(self._sql("SELECT 1 FROM effects WHERE key = ?", (key,)))

    def repeats(self, key: str) -> int:
        """How many repeated calls of ``key`` were answered from the first."""
        return len(self._sql("SELECT 1 FROM repeats WHERE key = ?", (key,)))

    def close(self) -> None:
        """Close its database."""
        self._db.close()
