"""A deploy loses no turn: a text turn still running when its instance
drains is halted at a checkpoint and released (QUEUED, no lease owner,
its steps and usage written), and the next instance on the same store
adopts it and runs it on to COMPLETED: same id and generation, one event
log, the order it placed before the drain placed once (the ledger gives
the model the done step; it is never run again), the model call cut off
counted and re-issued."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
from conftest import start_app

from clock import SystemClock
from demo_shop.service import DemoService
from turn.models import TurnStatus
from web.app import PROVIDERS, STORE, TEXT_TURNS, create_app
from web.drain import DRAIN, drain_app
from web.settings import Settings

TOKEN = "tok-resume-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def settings(tmp_path: Path, tokens_per_second: float) -> Settings:
    return Settings(
        store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"default:{TOKEN}", llm={"tokens_per_second": tokens_per_second},
        shutdown={"lb_delay_s": 0, "drain_timeout_s": 0.5, "turn_wait_s": 0.3, "grace_s": 5},
    )


async def test_a_turn_released_by_a_drain_is_resumed_by_the_next_instance(tmp_path: Path) -> None:
    first = create_app(settings(tmp_path, tokens_per_second=3))
    runner, url = await start_app(first)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/turns", json={"text": "please order a coffee"}, headers=AUTH) as r:
                started = await r.json()
            turn_id, session_id = started["turn"]["id"], started["session_id"]
            store = first[STORE]
            for _ in range(100):  # the order is placed, and the reply about it streams (slowly)
                events = await store.read_events(session_id)
                if any(e.type == "tool.done" for e in events) and any(e.type == "agent.delta" for e in events):
                    break
                await asyncio.sleep(0.05)
            first[DRAIN].begin("test", lambda d: drain_app(d, first))
            await asyncio.wait_for(first[DRAIN].done.wait(), 5)
            released = await store.get(turn_id)
    finally:
        await runner.cleanup()
    assert released.status is TurnStatus.QUEUED and released.released and released.lease_owner is None
    assert released.step_count >= 3 and released.usage.model_requests == 2  # model, tool, the cut-off model call

    second = create_app(settings(tmp_path, tokens_per_second=200))
    runner, url = await start_app(second)
    try:
        store = second[STORE]
        for _ in range(200):
            turn = await store.get(turn_id)
            if turn.is_terminal:
                break
            await asyncio.sleep(0.05)
        events = await store.read_events(session_id)
    finally:
        await runner.cleanup()
    assert turn.status is TurnStatus.COMPLETED, turn
    assert turn.generation == released.generation and turn.session_id == session_id
    assert turn.reply and "order" in turn.reply.lower()
    statuses = [e.payload["status"] for e in events if e.type == "turn" and e.turn_id == turn_id]
    assert statuses == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "COMPLETED"], statuses
    # clients are told the reply streams again from its start, before its new deltas
    restarts = [e for e in events if e.type == "agent.restart" and e.turn_id == turn_id]
    assert [e.payload["reason"] for e in restarts] == ["adopted"]
    later = [e.type for e in events if e.seq > restarts[0].seq and e.turn_id == turn_id]
    assert "agent.delta" in later
    # the order was placed once: the resumed model saw the done step
    assert [e.type for e in events if e.type.startswith("tool.") and e.type != "tool.intent"].count("tool.started") == 1
    service = DemoService(SystemClock(), tmp_path / "t.db.demo-service.db")  # next to the store (web.app)
    try:
        applied: dict[str, Any] = await service.applied(turn_id)
    finally:
        await service.aclose()
    assert len(applied) == 1 and next(iter(applied.values()))["op"] == "order"
    # the cut-off model call is billed, and the re-issued one too
    assert turn.usage.model_requests == 3 and turn.usage.records[1].partial
    assert turn.spent.tokens >= released.spent.tokens


async def test_a_worker_that_stalled_and_was_taken_over_ends_its_turn_without_writing(tmp_path: Path) -> None:
    """The order call hangs 5 s; meanwhile another worker takes the turn
    over (as if this one had stalled past the lease TTL). When the call
    answers, this worker's next checkpoint finds the lease gone: its work
    ends, and the turn's row is exactly as the other worker left it (no
    terminal state, reply, steps or usage from here), its output fenced."""
    s = settings(tmp_path, tokens_per_second=200)
    s = s.model_copy(update={"demo_faults": "order:slow"})
    app = create_app(s)
    app[PROVIDERS].shop.service.slow_s = 1.0
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/turns", json={"text": "please order a coffee"}, headers=AUTH) as r:
                started = await r.json()
            turn_id, session_id = started["turn"]["id"], started["session_id"]
            store = app[STORE]
            for _ in range(100):  # the order call is on its way
                events = await store.read_events(session_id)
                if any(e.type == "tool.started" for e in events):
                    break
                await asyncio.sleep(0.02)
            seen = await store.get(turn_id)
            assert await store.take_over(turn_id, "other-worker", expect_owner=seen.lease_owner,
                                         expect_heartbeat=seen.heartbeat_at, at=seen.heartbeat_at)
            taken = await store.get(turn_id)
            taken_seq = max(e.seq for e in await store.read_events(session_id))
            for _ in range(100):  # the call answers, the next checkpoint finds the lease gone
                if not app[TEXT_TURNS].running_count():
                    break
                await asyncio.sleep(0.05)
            assert app[TEXT_TURNS].running_count() == 0
            await asyncio.sleep(0.3)
            after = await store.get(turn_id)
            later = [e for e in await store.read_events(session_id) if e.seq > taken_seq]
    finally:
        await runner.cleanup()
    assert after == taken, (after, taken)  # not a field written from here
    assert after.status is TurnStatus.RUNNING and after.lease_owner == "other-worker"
    assert not [e for e in later if e.type in ("agent.delta", "agent.done", "turn")], [e.type for e in later]
