#!/usr/bin/env python3
"""Store benchmark: how many turns per second, and how fast does a stop land?

Runs the Turn Manager (turn/manager.py, on the real ``SystemClock``) against
each store implementation: SQLite (a file in a temporary folder) and Redis (a
``redis-server`` started here on a free loopback port with
``--appendonly yes --save ''`` in a temporary folder and stopped at the end,
unless ``--redis-url`` names one; then the keys are put under a fresh prefix
and deleted afterwards). Every duration is measured with
``time.perf_counter``. Figures, per store:

1. Turn lifecycle throughput. One turn is ``open_turn`` (the session's
   generation INCR, the create, and QUEUED -> RUNNING), 10
   ``checkpoint`` calls, and ``complete``. N turns run one after another on
   one session ("sequential"), then spread over C concurrent workers, one
   session each ("C workers": the turns contend for the store). Each run is
   done twice: with ``flag_staleness_s=0``, so every checkpoint really reads
   the turn from the store ("uncached"), and with the default 0.1 s, so a
   checkpoint reads the store at most every 0.1 s per turn and otherwise
   answers from the manager's cached flag ("cached"). Reported: per-turn
   latency (from calling ``open_turn`` until ``complete`` returned) p50 and
   p95 in ms, and turns/s = N / wall time, where the wall time runs from the
   first ``open_turn`` until the last turn completed *and* the session event
   logs had written every "turn" event the lifecycle emitted (3 per turn;
   the manager logs them in the background, so they load the store too).
   A few unmeasured turns warm each store up first.

2. Stop request to CANCELLED latency, over M stops, one at a time. A turn is
   opened and RUNNING; its worker task waits for the stop, then calls
   ``confirm_stopped``. Measured: from calling ``request_stop`` until
   ``confirm_stopped`` returned (the CANCELLED row is written).

   a. one instance: one TurnManager requests the stop and runs the worker,
      which waits on ``manager.stop_event(turn_id)`` (the signal path the
      server uses). The manager has the signals the server would give it:
      in-process ``StopSignals`` for SQLite, ``RedisStopSignals`` for Redis
      (whose publish sets the local event first, then publishes).
   b. across instances: two TurnManagers share the store; the stop is
      requested on A while the worker runs on B.
      - Redis: each manager has its own ``RedisStore`` (own client) and a
        ``RedisStopSignals`` on that client (as web/app.py builds them), so B
        only hears of the stop through real Redis pub/sub. The worker waits
        on B's ``stop_event``; if nothing arrives within 2 s it falls back
        to reading the store, and such stops are counted as "fallback".
      - SQLite (one process per store by design, so no cross-instance
        signal exists): A and B share the store but have separate
        in-process ``StopSignals``, so B learns of the stop only from its
        checkpoints polling the store: the worker calls
        ``checkpoint(turn_id, 'poll')`` every 10 ms with
        ``flag_staleness_s=0.1`` until it raises ``TurnStopped``. The stop
        is requested after a random wait of 0-0.1 s so it lands at a random
        phase of the flag cache. Labelled "polling, no signal".

Usage: python bench/store.py [--turns N] [--concurrency C] [--stops M]
       [--redis-url URL] [--only sqlite|redis] [--seed S] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import shutil
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from local_server import free_port, stop_process  # noqa: E402  (bench/: the script's own folder)

from clock import SystemClock  # noqa: E402
from turn.manager import TurnManager  # noqa: E402
from turn.models import StopReason, StopReasonKind, TurnStatus  # noqa: E402
from turn.redis_store import RedisStore  # noqa: E402
from turn.signals import RedisStopSignals, StopSignals  # noqa: E402
from turn.sqlite_store import SqliteStore  # noqa: E402
from turn.stopped import TurnStopped  # noqa: E402
from turn.store import StopAnswer  # noqa: E402

#: checkpoints per turn in the lifecycle figure
CHECKPOINTS = 10
#: the manager's default cached-flag staleness (s)
DEFAULT_STALENESS_S = 0.1
#: the polling worker's period (s)
POLL_INTERVAL_S = 0.01
#: a signal-waiting worker falls back to reading the store after this (s)
SIGNAL_FALLBACK_S = 2.0
#: unmeasured turns run first on each store
WARMUP_TURNS = 10

Store = SqliteStore | RedisStore


# -- helpers -------------------------------------------------------------------


def latency_stats(seconds: list[float]) -> dict[str, float | int | None]:
    """n, min, p50, p95 and max (ms, 0.01 ms resolution) of durations in s."""
    if not seconds:
        return {"n": 0, "min_ms": None, "p50_ms": None, "p95_ms": None, "max_ms": None}
    a = np.asarray(seconds, dtype=float) * 1000
    return {
        "n": len(seconds),
        "min_ms": round(float(a.min()), 2),
        "p50_ms": round(float(np.percentile(a, 50)), 2),
        "p95_ms": round(float(np.percentile(a, 95)), 2),
        "max_ms": round(float(a.max()), 2),
    }


def progress(quiet: bool, message: str) -> None:
    """A progress line on stderr (none with ``--json``)."""
    if not quiet:
        print(f"  {message}", file=sys.stderr, flush=True)


@contextlib.contextmanager
def redis_server() -> Iterator[str]:
    """Start ``redis-server`` on a free loopback port, AOF on, RDB snapshots
    off, in a temporary folder; yield its URL; stop it (and remove the
    folder) on leaving, whatever happened.

    Raises:
        RuntimeError: redis-server is not installed or did not start.
    """
    exe = shutil.which("redis-server") or "/usr/bin/redis-server"
    if not Path(exe).exists():
        raise RuntimeError("redis-server is not installed (apt-get install redis-server), or pass --redis-url")
    with tempfile.TemporaryDirectory(prefix="tk-bench-redis-") as tmp:
        port = free_port()
        with open(Path(tmp) / "redis.log", "wb") as logf:
            proc = subprocess.Popen(
                [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", tmp,
                 "--appendonly", "yes", "--save", "", "--daemonize", "no"],
                stdout=logf,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches us, and we stop it
            )
        try:
            deadline = time.monotonic() + 10
            while True:
                if proc.poll() is not None:
                    raise RuntimeError(f"redis-server exited with {proc.returncode}: see {tmp}/redis.log")
                try:
                    socket.create_connection(("127.0.0.1", port), timeout=0.2).close()
                    break
                except OSError:
                    if time.monotonic() > deadline:
                        raise RuntimeError("redis-server did not start within 10 s") from None
                    time.sleep(0.05)
            yield f"redis://127.0.0.1:{port}/0"
        finally:
            stop_process(proc)


# -- backends ------------------------------------------------------------------


class Backend:
    """How to make the stores, managers and signals of one store kind.

    ``instance()`` gives what one server instance would hold: a store and
    the stop signals web/app.py would pair with it.
    """

    name = ""
    #: whether two instances can signal each other (else: polling only)
    cross_signals = False

    async def instance(self) -> tuple[Store, StopSignals]:
        """A store (opened) and unstarted signals for one instance."""
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close every store handed out, and clean up."""

    def config(self) -> dict[str, Any]:
        """What this backend ran on, for the JSON output."""
        return {}


class SqliteBackend(Backend):
    """One SQLite file in a temporary folder, shared by every manager (one
    process per store by design); each instance gets its own in-process
    ``StopSignals``, so instances cannot signal each other."""

    name = "sqlite"
    cross_signals = False

    def __init__(self) -> None:
        self._tmp = tempfile.TemporaryDirectory(prefix="tk-bench-sqlite-")
        self.path = Path(self._tmp.name) / "bench.db"
        self.store = SqliteStore(self.path)

    async def instance(self) -> tuple[Store, StopSignals]:
        await self.store.open()
        return self.store, StopSignals()

    async def aclose(self) -> None:
        try:
            await self.store.close()
        finally:
            self._tmp.cleanup()

    def config(self) -> dict[str, Any]:
        return {"path": "<tempdir>/bench.db", "journal_mode": "wal", "synchronous": "normal"}


class RedisBackend(Backend):
    """A Redis server; every instance has its own ``RedisStore`` (own
    client) and ``RedisStopSignals`` on that client, as web/app.py's
    ``open_store`` builds them. Keys go under a fresh prefix."""

    name = "redis"
    cross_signals = True

    def __init__(self, url: str, *, external: bool) -> None:
        self.url = url
        self.external = external
        self.prefix = f"tkbench{uuid.uuid4().hex[:8]}"
        self._stores: list[RedisStore] = []

    async def instance(self) -> tuple[Store, StopSignals]:
        store = RedisStore(self.url, prefix=self.prefix)
        await store.open()
        self._stores.append(store)
        return store, RedisStopSignals(store.client, f"{self.prefix}:stops")

    async def aclose(self) -> None:
        try:
            if self.external and self._stores:  # leave a shared server as we found it
                client = self._stores[0].client
                assert client is not None
                keys = [k async for k in client.scan_iter(match=f"{self.prefix}:*", count=1000)]
                for i in range(0, len(keys), 500):
                    await client.unlink(*keys[i:i + 500])
        finally:
            for store in self._stores:
                await store.close()
            self._stores.clear()

    def config(self) -> dict[str, Any]:
        return {
            "url": self.url if self.external else "redis-server started here (loopback)",
            "appendonly": None if self.external else "yes (appendfsync everysec)",
            "prefix": self.prefix,
        }


# -- figure 1: lifecycle -------------------------------------------------------


async def lifecycle(store: Store, *, turns: int, workers: int, staleness_s: float) -> dict[str, Any]:
    """Run ``turns`` turn lifecycles (open_turn, 10 checkpoints, complete)
    on ``workers`` concurrent workers, one session each, with a fresh
    manager whose cached stop flag may be ``staleness_s`` old.

    Returns:
        Per-turn latency stats, turns/s (wall time includes writing the
        event logs), the drain time of the event logs after the last
        turn, and the count of turns that did not end COMPLETED.
    """
    manager = TurnManager(store, SystemClock(), flag_staleness_s=staleness_s)
    run = uuid.uuid4().hex[:8]
    sessions = [f"bench-{run}-{w}" for w in range(workers)]
    for s in sessions:
        await manager.ensure_session(s)
    latencies: list[float] = []
    claimed = 0
    errors = 0

    async def worker(session_id: str) -> None:
        nonlocal claimed, errors
        while claimed < turns:
            claimed += 1
            t0 = time.perf_counter()
            turn = await manager.open_turn(session_id)
            for i in range(CHECKPOINTS):
                await manager.checkpoint(turn.id, f"step-{i}")
            res = await manager.complete(turn.id)
            latencies.append(time.perf_counter() - t0)
            if not (res.applied and res.turn.status is TurnStatus.COMPLETED):
                errors += 1

    start = time.perf_counter()
    await asyncio.gather(*(worker(s) for s in sessions))
    ops_done = time.perf_counter()
    await manager.events.aclose()  # every "turn" event written
    end = time.perf_counter()
    out: dict[str, Any] = {
        "workers": workers,
        "checkpoints_per_turn": CHECKPOINTS,
        "flag_staleness_s": staleness_s,
        **latency_stats(latencies),
        "turns_per_s": round(turns / (end - start), 1),
        "wall_s": round(end - start, 3),
        "event_drain_ms": round((end - ops_done) * 1000, 2),
        "errors": errors,
    }
    return out


# -- figure 2: stop latency ----------------------------------------------------


async def signal_worker(manager: TurnManager, turn_id: str, ready: asyncio.Event) -> tuple[float, Any, str]:
    """Wait on the turn's stop event (the signal path), then confirm the
    stop. Falls back to reading the store if no signal came within
    ``SIGNAL_FALLBACK_S``.

    Returns:
        (perf_counter when confirm_stopped returned, its result, "signal" or
        "fallback").
    """
    event = manager.stop_event(turn_id)
    ready.set()
    via = "signal"
    try:
        async with asyncio.timeout(SIGNAL_FALLBACK_S):
            await event.wait()
    except TimeoutError:
        via = "fallback"
        while not await manager.stop_requested(turn_id):
            await asyncio.sleep(POLL_INTERVAL_S)
    res = await manager.confirm_stopped(turn_id)
    return time.perf_counter(), res, via


async def polling_worker(manager: TurnManager, turn_id: str, ready: asyncio.Event) -> tuple[float, Any, str]:
    """Checkpoint every ``POLL_INTERVAL_S`` until a checkpoint raises
    ``TurnStopped`` (no signal can reach this manager), then confirm.

    Returns:
        (perf_counter when confirm_stopped returned, its result, "poll").
    """
    ready.set()
    try:
        while True:
            await manager.checkpoint(turn_id, "poll")
            await asyncio.sleep(POLL_INTERVAL_S)
    except TurnStopped:
        pass
    res = await manager.confirm_stopped(turn_id)
    return time.perf_counter(), res, "poll"


Worker = Callable[[TurnManager, str, asyncio.Event], Awaitable[tuple[float, Any, str]]]


async def stop_latency(
    requester: TurnManager,
    runner: TurnManager,
    *,
    stops: int,
    worker: Worker,
    max_delay_s: float,
    rng: random.Random,
) -> dict[str, Any]:
    """Measure ``stops`` stops one at a time: open a RUNNING turn on
    ``runner``, start ``worker`` on it, wait a random 0..``max_delay_s``,
    then time from ``requester.request_stop`` until the worker's
    ``confirm_stopped`` returned.

    Returns:
        Latency stats, the stats of ``request_stop`` alone, how the workers
        learned of the stop, and the count of stops that did not end
        ACCEPTED then CANCELLED.
    """
    session_id = f"bench-stop-{uuid.uuid4().hex[:8]}"
    await runner.ensure_session(session_id)
    latencies: list[float] = []
    request_times: list[float] = []
    via: dict[str, int] = {}
    errors = 0
    for _ in range(stops):
        turn = await runner.open_turn(session_id)
        ready = asyncio.Event()
        task = asyncio.get_running_loop().create_task(worker(runner, turn.id, ready))
        await ready.wait()
        await asyncio.sleep(rng.uniform(0, max_delay_s) if max_delay_s > 0 else 0)
        reason = StopReason(kind=StopReasonKind.USER_CANCEL, initiator="bench", at=requester.clock.now())
        t0 = time.perf_counter()
        answer = await requester.request_stop(turn.id, reason)
        request_times.append(time.perf_counter() - t0)
        t_end, res, how = await task
        latencies.append(t_end - t0)
        via[how] = via.get(how, 0) + 1
        if not (answer.answer is StopAnswer.ACCEPTED and answer.first and res.applied
                and res.turn.status is TurnStatus.CANCELLED):
            errors += 1
    for m in {id(requester): requester, id(runner): runner}.values():
        await m.events.aclose()
    return {**latency_stats(latencies), "request_stop_ms": latency_stats(request_times), "via": via, "errors": errors}


# -- per store -----------------------------------------------------------------


async def bench_store(backend: Backend, args: argparse.Namespace, rng: random.Random) -> dict[str, Any]:
    """Every figure for one store (see the module doc)."""
    quiet = args.json
    out: dict[str, Any] = {"config": {**backend.config(), "turns": args.turns, "concurrency": args.concurrency,
                                      "stops": args.stops}}
    signals: list[StopSignals] = []
    try:
        store, _ = await backend.instance()
        await lifecycle(store, turns=WARMUP_TURNS, workers=1, staleness_s=0.0)

        runs = out["lifecycle"] = {}
        for label, staleness in (("uncached", 0.0), ("cached", DEFAULT_STALENESS_S)):
            for shape, workers in (("sequential", 1), ("concurrent", args.concurrency)):
                key = f"{shape}_{label}"
                progress(quiet, f"{backend.name}: lifecycle {key} ({args.turns} turns, {workers} worker(s))")
                runs[key] = await lifecycle(store, turns=args.turns, workers=workers, staleness_s=staleness)

        stop_out = out["stop"] = {}
        # (a) one instance: one manager, its own (server-default) signals
        store_a, sig_a = await backend.instance()
        signals.append(sig_a)
        await sig_a.start()
        one = TurnManager(store_a, SystemClock(), signals=sig_a)
        progress(quiet, f"{backend.name}: stop latency, one instance ({args.stops} stops)")
        stop_out["one_instance"] = {
            "mode": "local signal",
            **await stop_latency(one, one, stops=args.stops, worker=signal_worker, max_delay_s=0.0, rng=rng),
        }
        # (b) across instances: A requests, B runs the worker
        store_b, sig_b = await backend.instance()
        signals.append(sig_b)
        await sig_b.start()
        if backend.cross_signals:
            a = one
            b = TurnManager(store_b, SystemClock(), signals=sig_b)
            worker, delay, mode = signal_worker, 0.0, "pub/sub signal"
        else:
            a = one
            b = TurnManager(store_b, SystemClock(), signals=sig_b, flag_staleness_s=DEFAULT_STALENESS_S)
            worker, delay, mode = polling_worker, DEFAULT_STALENESS_S, "polling, no signal"
        progress(quiet, f"{backend.name}: stop latency, across instances, {mode} ({args.stops} stops)")
        stop_out["across_instances"] = {
            "mode": mode,
            **await stop_latency(a, b, stops=args.stops, worker=worker, max_delay_s=delay, rng=rng),
        }
        # leftovers that would hint at a bug: open turns, per-turn state kept
        out["checks"] = {
            "open_turns_left": len(await store.list_open()),
            "requester_flag_cache_entries": len(a._flags),
            "runner_flag_cache_entries": len(b._flags),
            "requester_event_writers_left": len(a.events),
        }
    finally:
        for s in signals:
            await s.aclose()
        await backend.aclose()
    return out


async def run(args: argparse.Namespace, redis_url: str | None) -> dict[str, Any]:
    """Benchmark the chosen stores; ``redis_url`` is the server to use."""
    rng = random.Random(args.seed)
    out: dict[str, Any] = {}
    if args.only in (None, "sqlite"):
        out["sqlite"] = await bench_store(SqliteBackend(), args, rng)
    if args.only in (None, "redis"):
        assert redis_url is not None
        out["redis"] = await bench_store(RedisBackend(redis_url, external=args.redis_url is not None), args, rng)
    return out


# -- output --------------------------------------------------------------------


def print_table(out: dict[str, Any]) -> None:
    """The figures as a readable table."""
    rows: list[tuple[str, str, Any, Any, Any, str]] = []
    for store, figs in out.items():
        for key, r in figs["lifecycle"].items():
            shape, label = key.split("_")
            who = "sequential" if shape == "sequential" else f"{r['workers']} workers"
            what = "checkpoints read store" if label == "uncached" else f"checkpoints cached {r['flag_staleness_s']} s"
            rows.append((store, f"lifecycle, {who}, {what}", r["n"], r["p50_ms"], r["p95_ms"], f"{r['turns_per_s']:.0f}"))
        for key, title in (("one_instance", "stop->CANCELLED, one instance"), ("across_instances", "stop->CANCELLED, across instances")):
            r = figs["stop"][key]
            rows.append((store, f"{title} ({r['mode']})", r["n"], r["p50_ms"], r["p95_ms"], "-"))
    w = max(len(r[1]) for r in rows) + 2
    print(f"turn lifecycle = open_turn + {CHECKPOINTS} checkpoints + complete; "
          f"turns/s includes writing the event logs")
    print(f"{'store':<8}{'figure':<{w}}{'n':>5}{'p50 ms':>10}{'p95 ms':>10}{'turns/s':>9}")
    def cell(v: float | None) -> str:
        return "-" if v is None else f"{v:.2f}"

    for store, fig, n, p50, p95, tps in rows:
        print(f"{store:<8}{fig:<{w}}{n:>5}{cell(p50):>10}{cell(p95):>10}{tps:>9}")
    notes = []
    for store, figs in out.items():
        for key, r in figs["stop"].items():
            if r["errors"] or r["via"].get("fallback"):
                notes.append(f"{store} {key}: {r['errors']} stops not ACCEPTED->CANCELLED, via {r['via']}")
        for key, r in figs["lifecycle"].items():
            if r["errors"]:
                notes.append(f"{store} lifecycle {key}: {r['errors']} turns not COMPLETED")
        if figs["checks"]["open_turns_left"]:
            notes.append(f"{store}: {figs['checks']['open_turns_left']} turns left open")
    for note in notes:
        print(f"note: {note}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--turns", type=int, default=300, help="turns per lifecycle run (default 300)")
    p.add_argument("--concurrency", type=int, default=8, help="concurrent workers of the contended runs (default 8)")
    p.add_argument("--stops", type=int, default=200, help="stops per stop-latency figure (default 200)")
    p.add_argument("--redis-url", help="use this Redis (keys under a fresh prefix, deleted after) instead of starting one")
    p.add_argument("--only", choices=("sqlite", "redis"), help="benchmark one store only")
    p.add_argument("--seed", type=int, default=1, help="seed of the random stop delays (default 1)")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    if args.turns < 1 or args.concurrency < 1 or args.stops < 1:
        p.error("--turns, --concurrency and --stops must be at least 1")
    with contextlib.ExitStack() as stack:
        url = args.redis_url
        if url is None and args.only != "sqlite":
            url = stack.enter_context(redis_server())
        out = asyncio.run(run(args, url))
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
