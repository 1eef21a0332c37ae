"""The event log: written in order, persisted before anyone reads it, fenced
output kept as evidence and never delivered."""

from __future__ import annotations

import asyncio
from datetime import UTC, datetime
from typing import Any

import pytest

from clock import SystemClock
from turn.events import EventFollower, EventLogs, SessionEventLog, event_json
from turn.generation import GenerationFence
from turn.models import EventRecord, Session, TurnStatus
from turn.store import StoreUnavailable

NOW = datetime(2026, 5, 1, 12, 0, tzinfo=UTC)


def turn_state(status: str) -> dict[str, Any]:
    """A "turn" event's fields (as turn.manager.turn_event gives them)."""
    return {"status": status, "label": TurnStatus(status).label, "stop_reason": None, "error": None, "transcript": None, "reply": None}


@pytest.fixture
async def session(any_store):
    await any_store.create_session(Session(id="s", created_at=NOW))
    return any_store


async def test_writer_keeps_order_and_assigns_seq(session) -> None:
    log = SessionEventLog(session, "s", SystemClock())
    for i in range(50):
        log.emit("agent.delta", generation=1, turn_id="t", text=str(i))
    assert await log.flush()
    events = await session.read_events("s")
    assert [e.seq for e in events] == list(range(1, 51))
    assert [e.payload["text"] for e in events] == [str(i) for i in range(50)]
    assert log.persisted == 50 and log.last_seq == 50
    await log.aclose()


async def test_obsolete_output_is_logged_fenced_not_delivered(session) -> None:
    clock = SystemClock()
    fence = GenerationFence(clock)
    fence.advance()
    log = SessionEventLog(session, "s", clock, fence)
    log.emit("agent.delta", generation=1, turn_id="t1", text="heard")
    await log.flush()  # logged (and deliverable) before the barge-in
    fence.advance()  # barge-in: generation 2
    log.emit("agent.delta", generation=1, turn_id="t1", text="late")  # fenced at once
    log.emit("turn", generation=1, turn_id="t1", **turn_state("CANCELLED"))  # state: never fenced
    log.emit("agent.delta", generation=2, turn_id="t2", text="new")
    await log.flush()
    logged = await session.read_events("s")
    assert [(e.payload.get("text"), e.fenced) for e in logged] == [("heard", False), ("late", True), (None, False), ("new", False)]
    got = await EventFollower(session, "s").read_available()
    assert [e.payload.get("text") or e.payload["status"] for e in got] == ["heard", "CANCELLED", "new"]
    assert log.fenced == 1


async def test_fence_moving_while_the_event_is_written(session) -> None:
    """Made while generation 1 was active, persisted after the barge-in: it
    is marked fenced after the write and not delivered."""
    clock = SystemClock()
    fence = GenerationFence(clock)
    fence.advance()
    log = SessionEventLog(session, "s", clock, fence)
    log.emit("agent.delta", generation=1, turn_id="t1", text="racing")
    fence.advance()  # before the writer task has run
    await log.flush()
    [ev] = await session.read_events("s")
    assert ev.fenced
    assert await EventFollower(session, "s").read_available() == []


async def test_follower_with_a_fence_withholds_obsolete_output(session) -> None:
    clock = SystemClock()
    await session.append_event(EventRecord(session_id="s", generation=1, type="agent.delta", at=NOW, payload={"text": "x"}))
    fence = GenerationFence(clock)
    fence.advance()
    fence.advance()
    assert await EventFollower(session, "s", gate=fence).read_available() == []
    assert len(await EventFollower(session, "s").read_available()) == 1


async def test_follower_live_and_from_cursor(session) -> None:
    logs = EventLogs(session, SystemClock())
    follower = EventFollower(session, "s", after_seq=0, poll_s=0.2)
    got: list[int] = []

    async def follow() -> None:
        async for batch in follower.follow():
            got.extend(e.seq for e in batch)
            if len(got) >= 5:
                return

    task = asyncio.create_task(follow())
    for _ in range(5):
        logs.log("s").emit("vad", generation=0, event="speech_started")
        await asyncio.sleep(0.02)
    await asyncio.wait_for(task, 5)
    assert got == [1, 2, 3, 4, 5]
    late = EventFollower(session, "s", after_seq=3)
    assert [e.seq for e in await late.read_available()] == [4, 5]
    await logs.aclose()


async def test_follower_waits_out_an_outage(session) -> None:
    class Outage:
        def __init__(self, inner) -> None:
            self.inner = inner
            self.down = 3

        async def read_events(self, *a, **k):
            if self.down > 0:
                self.down -= 1
                raise StoreUnavailable("redis: connection refused")
            return await self.inner.read_events(*a, **k)

        async def wait_events(self, *a, **k):
            return await self.inner.wait_events(*a, **k)

    log = SessionEventLog(session, "s", SystemClock())
    log.emit("vad", generation=0, event="speech_confirmed")
    await log.flush()
    follower = EventFollower(Outage(session), "s", poll_s=0.1)  # type: ignore[arg-type]
    batches = follower.follow()
    first = await asyncio.wait_for(batches.__anext__(), 5)
    assert [e.payload["event"] for e in first] == ["speech_confirmed"]
    await batches.aclose()


async def test_unloggable_events_are_not_sent(session) -> None:
    class Down:
        async def append_event(self, event):
            raise StoreUnavailable("sqlite: database is locked")

    log = SessionEventLog(Down(), "s", SystemClock())  # type: ignore[arg-type]
    log.emit("turn", generation=1, **turn_state("RUNNING"))
    await log.flush()
    assert (log.lost, log.persisted) == (1, 0)


def test_event_json_shape() -> None:
    ev = EventRecord(session_id="s", seq=7, turn_id="t", generation=2, type="turn", at=NOW, payload={"status": "RUNNING"})
    assert event_json(ev) == {"status": "RUNNING", "type": "turn", "seq": 7, "turn_id": "t", "generation": 2, "at": NOW.timestamp()}
