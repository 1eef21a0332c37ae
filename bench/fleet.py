#!/usr/bin/env python3
"""Fleet benchmark: a stop sent to one server process for a text turn that
runs on another, as an operator's fleet on one Redis does it.

Two real ``turnkeeper serve`` processes (A and B) share a Redis (started
here, AOF on, unless ``--redis-url``; a fresh key prefix either way). For
each of M stops, one at a time: a text turn ("tell me a story", the
embedded model streaming at 20 tokens/s) starts on A; an event stream on B
follows its session; after a random 0.2-1.0 s of the reply, a client sends
``POST /v1/turns/{id}/stop`` (reason user_cancel) to **B**. Measured:

1. stop request to CANCELLED written: ``terminal_at - stop_reason.at`` of
   the turn as stored. Both are written by the servers' clocks on this one
   host: B stamps the request, A (the worker) writes CANCELLED after it
   heard of the stop over Redis pub/sub and its child tasks ended. This is
   the "<= 50 ms across instances" target.
2. what the client sees: from sending the stop to B until B's event stream
   delivers the turn's CANCELLED event (the client's own clock).
3. B's answer to the stop request itself (202 or 200), client clock.
4. model requests started after the stop (``usage.requests_after_stop``,
   summed: must be 0) and completion tokens after the stop (summed; the
   stream's last tokens in flight are counted, never shown).

Usage: python bench/fleet.py [--stops M] [--redis-url URL] [--seed S] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import subprocess
import sys
import tempfile
import time
import uuid
from datetime import datetime
from pathlib import Path
from typing import Any

import aiohttp

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_server import ROOT, free_port, stop_process, wait_healthy  # noqa: E402
from store import latency_stats, progress, redis_server  # noqa: E402

TOKEN = "tok-bench-fleet-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def start(redis_url: str, prefix: str, folder: Path, name: str) -> tuple[str, subprocess.Popen[bytes]]:
    """One server process on ``redis_url`` under ``prefix``; (URL, process)."""
    port = free_port()
    env = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    env.update({
        "PYTHONPATH": str(ROOT), "TURNKEEPER_STORE": redis_url, "TURNKEEPER_REDIS_PREFIX": prefix,
        "TURNKEEPER_API_TOKENS": f"default:{TOKEN}", "TURNKEEPER_LOG_LEVEL": "WARNING",
        "TURNKEEPER_LLM__TOKENS_PER_SECOND": "20", "TURNKEEPER_DEMO_SERVICE_DB": str(folder / "shop.db"),
    })
    log = (folder / f"{name}.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "web.cli", "serve", "--port", str(port)], env=env, cwd=folder,
                            stdout=log, stderr=subprocess.STDOUT)
    return f"http://127.0.0.1:{port}", proc


async def follow_until_cancelled(http: aiohttp.ClientSession, url: str, session_id: str, turn_id: str,
                                 started: asyncio.Event, seen: list[float]) -> None:
    """B's event stream of the session; appends the client time at which
    the turn's terminal event arrives."""
    async with http.get(f"{url}/v1/sessions/{session_id}/events?after_seq=0", headers=AUTH) as r:
        assert r.status == 200, await r.text()
        async for raw in r.content:
            line = raw.decode()
            if not line.startswith("data: "):
                continue
            msg = json.loads(line[6:])
            if msg.get("type") == "agent.delta" and msg.get("turn_id") == turn_id:
                started.set()
            if msg.get("type") == "turn" and msg.get("turn_id") == turn_id and msg.get("status") in (
                "CANCELLED", "COMPLETED", "FAILED", "RECONCILE_REQUIRED"
            ):
                seen.append(time.perf_counter())
                return


async def one_stop(http: aiohttp.ClientSession, a: str, b: str, rng: random.Random) -> dict[str, Any]:
    async with http.post(f"{a}/v1/turns", json={"text": "tell me a story"}, headers=AUTH) as r:
        assert r.status == 202, await r.text()
        body = await r.json()
    turn_id, session_id = body["turn"]["id"], body["session_id"]
    started, seen = asyncio.Event(), []
    follower = asyncio.ensure_future(follow_until_cancelled(http, b, session_id, turn_id, started, seen))
    try:
        await asyncio.wait_for(started.wait(), 10)  # the reply streams, seen on B
        await asyncio.sleep(rng.uniform(0.2, 1.0))
        sent = time.perf_counter()
        headers = {**AUTH, "Idempotency-Key": uuid.uuid4().hex}
        async with http.post(f"{b}/v1/turns/{turn_id}/stop", json={"reason": "user_cancel"}, headers=headers) as r:
            answered = time.perf_counter()
            assert r.status in (200, 202), await r.text()
        await asyncio.wait_for(follower, 10)
    finally:
        follower.cancel()
    async with http.get(f"{b}/v1/turns/{turn_id}", headers=AUTH) as r:
        turn = await r.json()
    assert turn["status"] == "CANCELLED", turn
    written = datetime.fromisoformat(turn["terminal_at"]) - datetime.fromisoformat(turn["stop_reason"]["at"])
    return {
        "written_s": written.total_seconds(), "client_s": seen[0] - sent, "answer_s": answered - sent,
        "requests_after_stop": turn["usage"]["requests_after_stop"],
        "tokens_after_stop": turn["usage"]["completion_tokens_after_stop"],
    }


async def run(args: argparse.Namespace, redis_url: str) -> dict[str, Any]:
    rng = random.Random(args.seed)
    prefix = f"tkbenchfleet{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory(prefix="tk-bench-fleet-") as tmp:
        folder = Path(tmp)
        (a, pa), (b, pb) = start(redis_url, prefix, folder, "a"), start(redis_url, prefix, folder, "b")
        try:
            await wait_healthy(a, pa)
            await wait_healthy(b, pb)
            results = []
            async with aiohttp.ClientSession() as http:
                for _ in range(2):  # warm-up, not measured
                    await one_stop(http, a, b, rng)
                for i in range(args.stops):
                    results.append(await one_stop(http, a, b, rng))
                    progress(args.json, f"stop {i + 1}/{args.stops}: {results[-1]['written_s'] * 1000:.1f} ms")
        finally:
            stop_process(pa)
            stop_process(pb)
    return {
        "stops": args.stops,
        "stop_to_cancelled_written": latency_stats([r["written_s"] for r in results]),
        "stop_to_client_sees_cancelled": latency_stats([r["client_s"] for r in results]),
        "stop_request_answered": latency_stats([r["answer_s"] for r in results]),
        "model_requests_after_stop": sum(r["requests_after_stop"] for r in results),
        "completion_tokens_after_stop": sum(r["tokens_after_stop"] for r in results),
    }


def print_table(out: dict[str, Any]) -> None:
    print(f"stop on B for a text turn running on A (two processes, one Redis), {out['stops']} stops")
    print(f"{'measure':<44} {'min':>7} {'p50':>7} {'p95':>7} {'max':>7}  ms")
    for key, label in (("stop_to_cancelled_written", "stop request -> CANCELLED written (A)"),
                       ("stop_to_client_sees_cancelled", "stop sent -> CANCELLED on B's stream"),
                       ("stop_request_answered", "stop sent -> B answers")):
        s = out[key]
        print(f"{label:<44} {s['min_ms']:>7} {s['p50_ms']:>7} {s['p95_ms']:>7} {s['max_ms']:>7}")
    print(f"model requests started after a stop: {out['model_requests_after_stop']}")
    print(f"completion tokens after a stop (in flight, never shown): {out['completion_tokens_after_stop']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stops", type=int, default=40, help="measured stops (default 40)")
    p.add_argument("--redis-url", help="use this Redis (a fresh key prefix) instead of starting one")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()

    async def go() -> dict[str, Any]:
        if args.redis_url:
            return await run(args, args.redis_url)
        with redis_server() as url:
            return await run(args, url)

    out = asyncio.run(go())
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
