#!/usr/bin/env python3
"""Cancellation benchmark: with a model stream in flight, how fast does a
stop land, and how many tokens are billed after it?

Runs the real text-turn worker (voice/text_turns.py: the turn's cancel scope,
the agent loop with its checkpoints, ``settle_stop``) on the SQLite store in
a temporary folder, on the real ``SystemClock``, once per model:

- ``local``: the embedded local agent (voice/llm.py) at ``--tps`` tokens/s;
- ``sse``: the OpenAI-compatible client (voice/openai_llm.py) streaming over
  a real loopback HTTP connection from the local Chat Completions server
  (testkit/openai_server.py, in this process) at ``--tps`` tokens/s;
- ``sse_ignoring``: the same server acting as a provider that ignores the
  hang-up and generates (and bills) its whole completion anyway;
- ``ignoring``: a provider that ignores cancellation and keeps streaming
  (testkit/faults.py), to show the bound the stop grace puts on the terminal
  write and the waste such a provider causes.

Each of ``--stops`` rounds starts a turn ("tell me a story", a reply of about
300 tokens), waits a random 0.2-0.6 s so the stream is mid-flight, then calls
``TurnManager.request_stop`` as the REST stop handler does. Measured with
``time.perf_counter``:

- stop request to CANCELLED: from calling ``request_stop`` until the
  manager announced the CANCELLED row written (its listener runs right after
  the store write returned);
- tokens after the stop request, as the turn's usage records them
  (``completion_tokens_after_stop``: tokens received after the stop), and
  whether the provider is known to have stopped (``after_stop``:
  "confirmed", or "unconfirmed" with ``completion_tokens_after_stop_bound``,
  the most it can have spent unseen, from the request's ``max_tokens``);
  for ``sse`` also the tokens the server generated after the client had
  disconnected;
- model requests started after the stop request (must be 0).

Usage: python bench/cancel.py [--stops N] [--tps T] [--seed S] [--only local|sse|sse_ignoring|ignoring] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from aiohttp import web  # noqa: E402

from clock import SystemClock  # noqa: E402
from testkit.faults import CancellationIgnoringModel  # noqa: E402
from testkit.openai_server import ChatCompletionsServer, ServerOptions  # noqa: E402
from turn.manager import TurnManager  # noqa: E402
from turn.models import Plan, StopReason, StopReasonKind, Turn, TurnStatus  # noqa: E402
from turn.sqlite_store import SqliteStore  # noqa: E402
from voice.llm import LlmConfig, LocalAgent  # noqa: E402
from voice.openai_llm import OpenAiChatModel  # noqa: E402
from voice.providers import LanguageModel  # noqa: E402
from voice.text_turns import TextTurns  # noqa: E402

MODELS = ("local", "sse", "sse_ignoring", "ignoring")


async def run_model(kind: str, stops: int, tps: float, rng: random.Random, folder: Path) -> dict[str, Any]:
    clock = SystemClock()
    store = SqliteStore(folder / f"{kind}.db")
    await store.open()
    manager = TurnManager(store, clock, owner="bench")
    runner: web.AppRunner | None = None
    server: ChatCompletionsServer | None = None
    model: LanguageModel
    if kind in ("sse", "sse_ignoring"):
        server = ChatCompletionsServer(ServerOptions(tokens_per_second=tps, ignore_disconnect=kind == "sse_ignoring"))
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        port = runner.addresses[0][1]
        model = OpenAiChatModel(LlmConfig(provider="openai", base_url=f"http://127.0.0.1:{port}/v1", model="local"))
    elif kind == "local":
        model = LocalAgent(LlmConfig(tokens_per_second=tps), clock)
    else:
        model = CancellationIgnoringModel(LlmConfig(tokens_per_second=tps), clock)
    turns = TextTurns(manager, lambda: model, clock, plans=lambda _t: Plan())
    latencies: list[float] = []
    after_stop: list[int] = []
    bounds: list[int | None] = []
    unconfirmed = 0
    requests_after_stop = 0
    server_after_disconnect = 0
    streamed: list[int] = []
    try:
        for _ in range(stops):
            turn = await turns.start(tenant_id="bench", text="tell me a story")
            cancelled = asyncio.Event()
            t_cancelled = 0.0

            def on_change(t: Turn, turn_id: str = turn.id, cancelled: asyncio.Event = cancelled) -> None:
                nonlocal t_cancelled
                if t.id == turn_id and t.status is TurnStatus.CANCELLED and not cancelled.is_set():
                    t_cancelled = time.perf_counter()
                    cancelled.set()

            unsubscribe = manager.subscribe(turn.session_id, on_change)
            await asyncio.sleep(rng.uniform(0.2, 0.6))
            t0 = time.perf_counter()
            await manager.request_stop(turn.id, StopReason(kind=StopReasonKind.USER_CANCEL, initiator="bench", at=clock.now()))
            await asyncio.wait_for(cancelled.wait(), 10)
            latencies.append((t_cancelled - t0) * 1000)
            unsubscribe()
            while turn.id in turns.scopes:  # the worker has ended (a stubborn child is still awaited)
                await asyncio.sleep(0.01)
            done = await manager.get(turn.id)
            after_stop.append(done.usage.completion_tokens_after_stop)
            bounds.append(done.usage.completion_tokens_after_stop_bound)
            unconfirmed += done.usage.after_stop == "unconfirmed"
            requests_after_stop += done.usage.requests_after_stop
            streamed.append(done.usage.completion_tokens)
        if server is not None:
            for stats in server.requests:
                await asyncio.wait_for(stats.done.wait(), 5)
            server_after_disconnect = server.tokens_after_disconnect
    finally:
        await turns.aclose()
        if isinstance(model, OpenAiChatModel):
            await model.aclose()
        if runner is not None:
            await runner.cleanup()
        await store.close()
    lat = np.array(latencies)
    return {
        "stops": stops,
        "tokens_per_second": tps,
        "stop_to_cancelled_ms": {
            "min": round(float(lat.min()), 2),
            "p50": round(float(np.percentile(lat, 50)), 2),
            "p95": round(float(np.percentile(lat, 95)), 2),
            "max": round(float(lat.max()), 2),
        },
        "tokens_after_stop": {"total": int(sum(after_stop)), "mean": round(float(np.mean(after_stop)), 2), "max": int(max(after_stop))},
        "after_stop_unconfirmed": unconfirmed,
        "tokens_after_stop_bound": None if None in bounds else int(sum(b for b in bounds if b is not None)),
        "server_tokens_after_disconnect": server_after_disconnect if server is not None else None,
        "requests_after_stop": requests_after_stop,
        "tokens_streamed_before_stop_mean": round(float(np.mean(streamed)) - float(np.mean(after_stop)), 1),
    }


async def main_async(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    out: dict[str, Any] = {"stops": args.stops, "tps": args.tps, "models": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for kind in MODELS:
            if args.only and kind != args.only:
                continue
            out["models"][kind] = await run_model(kind, args.stops, args.tps, rng, Path(tmp))
    return out


def print_table(res: dict[str, Any]) -> None:
    print(f"stop request -> CANCELLED with a model stream in flight ({res['stops']} stops each, {res['tps']:g} tokens/s)")
    print(
        f"{'model':<13} {'min ms':>8} {'p50 ms':>8} {'p95 ms':>8} {'max ms':>8} {'tok after stop (mean/max)':>26} "
        f"{'unconfirmed':>12} {'bound (sum)':>12} {'server tok after disc.':>22} {'req after stop':>15}"
    )
    for kind, r in res["models"].items():
        s = r["stop_to_cancelled_ms"]
        t = r["tokens_after_stop"]
        srv = "-" if r["server_tokens_after_disconnect"] is None else str(r["server_tokens_after_disconnect"])
        bound = "none" if r["tokens_after_stop_bound"] is None else str(r["tokens_after_stop_bound"])
        print(
            f"{kind:<13} {s['min']:>8.2f} {s['p50']:>8.2f} {s['p95']:>8.2f} {s['max']:>8.2f} "
            f"{t['mean']:>17.2f} / {t['max']:<6} {r['after_stop_unconfirmed']:>5}/{r['stops']:<6} {bound:>12} "
            f"{srv:>22} {r['requests_after_stop']:>15}"
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--stops", type=int, default=30, help="stops per model (default 30)")
    parser.add_argument("--tps", type=float, default=50.0, help="model pace, tokens per second (default 50)")
    parser.add_argument("--seed", type=int, default=1)
    parser.add_argument("--only", choices=MODELS)
    parser.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = parser.parse_args()
    if args.stops < 1:
        parser.error("--stops must be at least 1")
    # the ignoring provider is expected to ignore its cancellation: no warning per stop
    logging.getLogger("turn.scope").setLevel(logging.ERROR)
    res = asyncio.run(main_async(args))
    if args.json:
        print(json.dumps(res))
    else:
        print_table(res)


if __name__ == "__main__":
    main()
