"""A drain at the awkward moments of a text turn, in process, each moment
held exactly (a slow model, a slow read, a checkpoint write held at a
gate): the turn is released with what it had done, and the next instance
on the same store runs it on to COMPLETED. Exact checks after: the turn's
status events, its steps, what the model was sent again, and the demo
shop's own table (every effect applied once, nothing lost).

The same moments as real processes signalled with SIGTERM:
``tests/e2e/test_chaos.py``.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
from conftest import start_app

from clock import SystemClock
from demo_shop.service import DemoService
from turn.models import EventRecord as Event
from turn.models import Turn, TurnStatus
from voice.llm import WEATHER_REPLY
from web.app import PROVIDERS, STORE, create_app
from web.drain import DRAIN, drain_app
from web.settings import Settings

TOKEN = "tok-moments-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def settings(tmp_path: Path, tokens_per_second: float, faults: str = "", **extra: Any) -> Settings:
    return Settings(**extra,
        store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"default:{TOKEN}", llm={"tokens_per_second": tokens_per_second},
        shutdown={"lb_delay_s": 0, "drain_timeout_s": 0.5, "turn_wait_s": 0.3, "grace_s": 5}, demo_faults=faults,
    )


async def until(check: Callable[[], Awaitable[bool]], timeout_s: float = 10) -> None:
    async with asyncio.timeout(timeout_s):
        while not await check():
            await asyncio.sleep(0.02)


async def first_instance(
    tmp_path: Path, text: str, moment: Callable[[Any, str, str], Awaitable[None]], *,
    tokens_per_second: float = 200, faults: str = "", slow_s: float = 5.0, **extra: Any,
) -> tuple[Turn, str, dict[str, int]]:
    """Start a turn on a first instance, wait for ``moment(app, turn id,
    session id)``, drain. Returns (the turn as released, its session id,
    the reads its shop saw)."""
    app = create_app(settings(tmp_path, tokens_per_second, faults, **extra))
    app[PROVIDERS].shop.service.slow_s = slow_s
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/turns", json={"text": text}, headers=AUTH) as r:
                assert r.status == 202, await r.text()
                started = await r.json()
        turn_id, session_id = started["turn"]["id"], started["session_id"]
        await moment(app, turn_id, session_id)
        app[DRAIN].begin("test", lambda d: drain_app(d, app))
        await asyncio.wait_for(app[DRAIN].done.wait(), 10)
        released = await app[STORE].get(turn_id)
        reads = dict(app[PROVIDERS].shop.service.reads)
    finally:
        await runner.cleanup()
    assert released.status is TurnStatus.QUEUED and released.released and released.lease_owner is None, released
    return released, session_id, reads


async def next_instance(tmp_path: Path, turn_id: str, session_id: str) -> tuple[Turn, list[Event], dict[str, int]]:
    """Start the next instance on the same store; wait for it to adopt the
    turn and end it. Returns (the turn, its session's events, the reads
    its shop saw)."""
    app = create_app(settings(tmp_path, tokens_per_second=200))
    runner, _ = await start_app(app)
    try:
        store = app[STORE]

        async def ended() -> bool:
            return (await store.get(turn_id)).is_terminal

        await until(ended)
        turn = await store.get(turn_id)
        events = await store.read_events(session_id)
        reads = dict(app[PROVIDERS].shop.service.reads)
    finally:
        await runner.cleanup()
    return turn, events, reads


async def shop_applied(tmp_path: Path, turn_id: str) -> dict[str, Any]:
    service = DemoService(SystemClock(), tmp_path / "t.db.demo-service.db")  # next to the store (web.app)
    try:
        applied = await service.applied(turn_id)
        for key in applied:
            applied[key]["repeats"] = await service.repeats(key)
        return applied
    finally:
        await service.aclose()


def statuses(events: list[Event], turn_id: str) -> list[str]:
    return [e.payload["status"] for e in events if e.type == "turn" and e.turn_id == turn_id]


def tool_events(events: list[Event], turn_id: str) -> list[str]:
    return [f"{e.type}:{e.payload.get('name')}" for e in events
            if e.turn_id == turn_id and e.type in ("tool.started", "tool.done", "tool.cancelled")]


async def test_a_drain_while_the_model_decides_on_a_tool_call_sends_nothing_and_the_next_instance_places_it_once(
    tmp_path: Path,
) -> None:
    """SIGTERM before a tool call: the model's request that would call
    ``create_order`` is in flight (0.5 tokens/s: the call comes after 2 s)
    when the drain halts the turn. Nothing was sent to the shop; the next
    instance asks the model again, places the order once and completes."""

    async def model_in_flight(app: Any, turn_id: str, session_id: str) -> None:
        async def running() -> bool:
            return (await app[STORE].get(turn_id)).status is TurnStatus.RUNNING

        await until(running)
        await asyncio.sleep(0.3)

    released, session_id, _ = await first_instance(tmp_path, "please order a coffee", model_in_flight, tokens_per_second=0.5)
    turn_id = released.id
    assert await shop_applied(tmp_path, turn_id) == {}  # nothing was sent
    assert await_ledger_empty(released)
    assert released.usage.model_requests == 1 and released.usage.records[0].partial  # cut off, billed
    turn, events, _ = await next_instance(tmp_path, turn_id, session_id)
    assert turn.status is TurnStatus.COMPLETED, turn
    assert statuses(events, turn_id) == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "COMPLETED"]
    applied = await shop_applied(tmp_path, turn_id)
    assert len(applied) == 1 and next(iter(applied.values()))["repeats"] == 0, applied
    assert tool_events(events, turn_id).count("tool.started:create_order") == 1
    # re-issued: the cut-off request, then the one that called the tool, then the reply
    assert turn.usage.model_requests == 3 and turn.generation == released.generation


def await_ledger_empty(turn: Turn) -> bool:
    return turn.step_count <= 1  # the model request only: no tool step was numbered


async def test_a_drain_during_a_read_tool_abandons_the_read_and_the_next_instance_reads_again(tmp_path: Path) -> None:
    """SIGTERM during a read: ``lookup_weather`` waits 5 s on the weather
    service when the drain halts the turn. A read is safe to abandon: it
    is cancelled, and the next instance reads again (once) and answers with
    what it read."""

    async def reading(app: Any, turn_id: str, session_id: str) -> None:
        async def started() -> bool:
            return app[PROVIDERS].shop.service.reads["weather"] == 1

        await until(started)

    released, session_id, reads = await first_instance(
        tmp_path, "what is the weather like", reading, faults="weather:slow")
    turn_id = released.id
    assert reads == {"weather": 1}
    turn, events, reads = await next_instance(tmp_path, turn_id, session_id)
    assert turn.status is TurnStatus.COMPLETED, turn
    assert reads == {"weather": 1}  # read again, once
    assert turn.reply == WEATHER_REPLY
    tools = tool_events(events, turn_id)
    assert tools.count("tool.started:lookup_weather") == 2 and tools.count("tool.done:lookup_weather") == 1, tools
    assert statuses(events, turn_id) == ["QUEUED", "RUNNING", "QUEUED", "RUNNING", "COMPLETED"]
    assert await shop_applied(tmp_path, turn_id) == {}


async def test_a_drain_while_a_checkpoint_write_is_held_releases_the_turn_with_the_done_step(tmp_path: Path) -> None:
    """SIGTERM before a checkpoint write: the order is placed and its row
    is done; the next checkpoint's write of the turn's row (heartbeat,
    steps, usage; every checkpoint writes, the stop flag cache is off) is held at a gate for 1 s, longer than the drain's
    ``turn_wait_s`` (0.3 s), so the release is asked for while it waits.
    The write lands, the turn is released with the done step, and the next
    instance gives the model the step as done: the order is never placed
    again."""
    held = asyncio.Event()
    gate_open = asyncio.Event()

    async def order_done_then_hold(app: Any, turn_id: str, session_id: str) -> None:
        store = app[STORE]
        update = store.update

        async def gated(tid: str, *a: Any, **kw: Any) -> Any:
            if tid == turn_id and "heartbeat_at" in kw and not gate_open.is_set() and any(
                i.tool == "create_order" and i.status.value == "done" for i in await store.ledger_list(tid)
            ):
                held.set()
                await gate_open.wait()
            return await update(tid, *a, **kw)

        store.update = gated
        await asyncio.wait_for(held.wait(), 10)
        asyncio.get_running_loop().call_later(1.0, gate_open.set)

    released, session_id, _ = await first_instance(tmp_path, "please order a coffee", order_done_then_hold,
                                                 stop_flag_staleness_ms=0)
    turn_id = released.id
    assert gate_open.is_set()
    assert released.step_count >= 2, released  # the model request and the order, written
    turn, events, _ = await next_instance(tmp_path, turn_id, session_id)
    assert turn.status is TurnStatus.COMPLETED, turn
    assert tool_events(events, turn_id).count("tool.started:create_order") == 1
    applied = await shop_applied(tmp_path, turn_id)
    assert len(applied) == 1 and next(iter(applied.values()))["repeats"] == 0, applied
    assert turn.reply and "order" in turn.reply.lower()
