"""The demo shop's external system: an in-process service with its own
SQLite table that applies each idempotency key at most once and counts what
it applied, so tests, the fuzzer and a person trying the demo tools can see
exactly which effects happened, and how many times.

It stands for a shop, a payment processor and a messaging provider that
honour idempotency keys (as Stripe's API does with its ``Idempotency-Key``
header): a repeat of a key returns the first answer and applies nothing.

Faults can be injected per operation (:meth:`DemoService.inject`):
``fail_before`` (refused before any write: nothing applied),
``fail_after`` (applied, then the answer is lost: the caller cannot know),
``lookup_unknown`` (a lookup that cannot answer), ``slow`` (the call
waits ``slow_s`` before it writes anything) and ``slow_after`` (it writes
at once, then its answer takes ``slow_s``: the effect happened, its caller
does not know yet; a crash then is the hard case for the ledger).
Reads (:meth:`DemoService.read`, the weather) take the same faults, op
``weather``, and are counted in :attr:`DemoService.reads`.

Its SQLite calls run in worker threads (:func:`asyncio.to_thread`), never on
the event loop, which also paces the audio of every session: a slow disk
must not delay a 20 ms frame. The file is opened on the first call; every
query method is a coroutine; :meth:`DemoService.aclose` closes the file.
"""

from __future__ import annotations

import asyncio
import json
import sqlite3
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from pathlib import Path
from typing import Any, TypeVar

from clock import Clock
from turn.intents import LookupAnswer
from turn.ledger import EffectNotApplied

T = TypeVar("T")

_SCHEMA = """
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
    #: what :meth:`inject` accepts: the ops above, and these two
    FAULT_OPS = (*OPS, "lookup", "reverse", "weather")
    FAULTS = ("fail_before", "fail_after", "lookup_unknown", "slow", "slow_after")

    def __init__(self, clock: Clock, path: str | Path = ":memory:", *, latency_s: float = 0.02) -> None:
        self.clock = clock
        self.latency_s = latency_s
        self.slow_s = 5.0
        #: keys of the apply calls that have arrived (answered or not), in order
        self.received: list[str] = []
        #: reads that have arrived (answered or not), by op
        self.reads: dict[str, int] = defaultdict(int)
        self.path = str(path)
        self._db: sqlite3.Connection | None = None
        self._closed = False
        self._lock = threading.Lock()  # one connection, used from worker threads one call at a time
        self._faults: dict[str, deque[str]] = defaultdict(deque)

    def inject(self, op: str, *faults: str) -> None:
        """Queue faults for the next calls of ``op`` ("order", "payment",
        "batch", "message", "lookup", "reverse", "weather"), one per call.

        Raises:
            ValueError: an unknown op or fault.
        """
        if op not in self.FAULT_OPS or any(f not in self.FAULTS for f in faults):
            raise ValueError(f"unknown fault {op}:{','.join(faults)} (ops {self.FAULT_OPS}, faults {self.FAULTS})")
        self._faults[op].extend(faults)

    def clear_faults(self) -> None:
        """Forget every queued fault."""
        self._faults.clear()

    def _fault(self, op: str) -> str | None:
        q = self._faults.get(op)
        return q.popleft() if q else None

    async def _in_thread(self, fn: Callable[[sqlite3.Connection], T]) -> T:
        """Run ``fn(connection)`` in a worker thread, one call at a time,
        opening the file (and its tables) on the first call.

        Raises:
            RuntimeError: the service was closed.
            sqlite3.Error: as ``fn``.
        """

        def call() -> T:
            with self._lock:
                if self._closed:
                    raise RuntimeError("the demo service is closed")
                if self._db is None:
                    if self.path != ":memory:":
                        Path(self.path).parent.mkdir(parents=True, exist_ok=True)
                    db = sqlite3.connect(self.path, check_same_thread=False, isolation_level=None, timeout=5.0)
                    db.executescript(_SCHEMA)
                    self._db = db
                return fn(self._db)

        return await asyncio.to_thread(call)

    async def _sql(self, sql: str, args: tuple[Any, ...] = ()) -> list[Any]:
        return await self._in_thread(lambda db: db.execute(sql, args).fetchall())

    async def _wait(self, fault: str | None) -> None:
        await self.clock.sleep(self.slow_s if fault == "slow" else self.latency_s)

    def inject_spec(self, spec: str) -> None:
        """:meth:`inject` from text, ``op:fault`` pairs separated by commas
        (the ``demo_faults`` setting), e.g. ``order:slow_after,lookup:slow``.

        Raises:
            ValueError: a pair that is not ``op:fault``, or an unknown one.
        """
        for pair in filter(None, (p.strip() for p in spec.split(","))):
            op, sep, fault = pair.partition(":")
            if not sep:
                raise ValueError(f"a demo fault is op:fault, not {pair!r}")
            self.inject(op.strip(), fault.strip())

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
        applied_at = self.clock.now().isoformat()

        def write(db: sqlite3.Connection) -> None:
            row = db.execute("SELECT op, payload FROM effects WHERE key = ?", (key,)).fetchone()
            if row is None:
                db.execute(
                    "INSERT INTO effects (key, op, payload, applied_at) VALUES (?,?,?,?)",
                    (key, op, json.dumps(payload), applied_at),
                )
            else:
                db.execute("INSERT INTO repeats (key) VALUES (?)", (key,))

        await self._in_thread(write)
        if fault == "slow_after":
            await self.clock.sleep(self.slow_s)
        if fault == "fail_after":
            raise ServiceError(f"{op} applied, but the answer was lost")
        return {"key": key, "op": op, **payload}

    async def read(self, op: str) -> None:
        """A read of the external system (``op`` "weather"): it changes
        nothing, takes ``latency_s`` (``slow``: ``slow_s``) and is counted
        in :attr:`reads`.

        Raises:
            ServiceError: a ``fail_before`` or ``fail_after`` fault.
            ValueError: an op that is not a read.
        """
        if op != "weather":
            raise ValueError(f"unknown read {op!r}")
        self.reads[op] += 1
        fault = self._fault(op)
        await self._wait(fault)
        if fault in ("fail_before", "fail_after"):
            raise ServiceError(f"{op} read failed")

    async def reverse(self, key: str) -> bool:
        """Undo the effect of ``key`` (idempotent: each call that finds it
        applied is counted, :meth:`times_reversed`). Returns True if there
        was one to undo (now or before), False if ``key`` was never applied.

        Raises:
            ServiceError: a ``fail_before`` or ``fail_after`` fault.
        """
        fault = self._fault("reverse")
        await self._wait(fault)
        if fault == "fail_before":
            raise ServiceError("reverse refused")
        rows = await self._sql("UPDATE effects SET reversed = reversed + 1 WHERE key = ? RETURNING key", (key,))
        if fault == "fail_after":
            raise ServiceError("reversed, but the answer was lost")
        return bool(rows)

    async def lookup(self, key: str) -> LookupAnswer:
        """Whether ``key`` was applied (``lookup_unknown`` fault: UNKNOWN)."""
        fault = self._fault("lookup")
        await self._wait(fault)
        if fault in ("lookup_unknown", "fail_before", "fail_after"):
            return LookupAnswer.UNKNOWN
        rows = await self._sql("SELECT 1 FROM effects WHERE key = ?", (key,))
        return LookupAnswer.PRESENT if rows else LookupAnswer.ABSENT

    # -- what happened ---------------------------------------------------------------

    async def applied(self, prefix: str = "") -> dict[str, dict[str, Any]]:
        """Every applied key starting with ``prefix``: op, payload, reversed,
        applied_at (ISO time on the service's clock)."""
        rows = await self._sql(
            "SELECT key, op, payload, reversed, applied_at FROM effects WHERE key LIKE ? ORDER BY rowid", (prefix + "%",)
        )
        return {r[0]: {"op": r[1], "payload": json.loads(r[2]), "reversed": bool(r[3]), "applied_at": r[4]} for r in rows}

    async def times_applied(self, key: str) -> int:
        """How many times ``key`` was applied: 0 or 1 (the table's primary
        key makes a second application impossible; repeats are counted
        apart in :meth:`repeats`)."""
        return len(await self._sql("SELECT 1 FROM effects WHERE key = ?", (key,)))

    async def times_reversed(self, key: str) -> int:
        """How many reverse calls of ``key`` found it applied (one undid it;
        any more were answered from the first)."""
        rows = await self._sql("SELECT reversed FROM effects WHERE key = ?", (key,))
        return int(rows[0][0]) if rows else 0

    async def repeats(self, key: str) -> int:
        """How many repeated calls of ``key`` were answered from the first."""
        return len(await self._sql("SELECT 1 FROM repeats WHERE key = ?", (key,)))

    async def aclose(self) -> None:
        """Close its database (in a worker thread; a call in progress
        finishes first). Idempotent; any call after it raises RuntimeError."""

        def close() -> None:
            with self._lock:
                self._closed = True
                if self._db is not None:
                    self._db.close()
                    self._db = None

        await asyncio.to_thread(close)
