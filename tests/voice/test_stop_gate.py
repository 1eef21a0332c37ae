"""Issue 17.1: the stop closes the delivery gate at once. Text turns are
stopped at random moments, at several token rates and with a provider that
ignores its cancellation, in one process and with the stop sent from
another instance over Redis; in the session's log (what every follower
reads) no output of the turn is deliverable after its CANCEL_REQUESTED
event, and a follower delivers none."""

from __future__ import annotations

import asyncio
import random
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import requires_espeak
from test_agent_session import Harness, pcm48

from clock import SystemClock
from testkit.faults import CancellationIgnoringModel
from turn.delivery_gate import OUTPUT_TYPES
from turn.events import EventFollower
from turn.manager import TurnManager
from turn.models import EventRecord, StopReason, StopReasonKind
from turn.redis_store import RedisStore
from turn.signals import RedisStopSignals
from turn.sqlite_store import SqliteStore
from voice.llm import LlmConfig, LocalAgent, LocalLlmConfig
from voice.providers import LanguageModel
from voice.text_turns import TextTurns

TRIALS = 12


@dataclass
class Pair:
    """The instance that runs the turns and the one the stop is sent to
    (the same one in one process)."""

    runner: TurnManager
    stopper: TurnManager


def models(clock: SystemClock) -> dict[str, Callable[[], LanguageModel]]:
    return {
        "20tps": lambda: LocalAgent(LocalLlmConfig(tokens_per_second=20), clock),
        "200tps": lambda: LocalAgent(LocalLlmConfig(tokens_per_second=200), clock),
        "ignores-cancel": lambda: CancellationIgnoringModel(LlmConfig(tokens_per_second=200), clock),
    }


def late_output(events: list[EventRecord], turn_id: str) -> list[EventRecord]:
    """Output of ``turn_id`` logged deliverable (not fenced) after its stop."""
    stop = next(e.seq for e in events if e.type == "turn" and e.turn_id == turn_id and e.payload.get("status") == "CANCEL_REQUESTED")
    return [e for e in events if e.seq > stop and e.turn_id == turn_id and e.type in OUTPUT_TYPES and not e.fenced]


async def stop_trials(pair: Pair, model: Callable[[], LanguageModel], seed: int) -> tuple[int, int]:
    """Stop ``TRIALS`` story turns at random moments; returns (output logged
    deliverable after the stop, output a follower delivered after it)."""
    rng = random.Random(seed)
    clock = pair.runner.clock
    turns = TextTurns(pair.runner, model, clock)
    logged = delivered = 0
    try:
        for _ in range(TRIALS):
            turn = await turns.start(tenant_id="t", text="tell me a story")
            await asyncio.sleep(rng.uniform(0.05, 0.5))
            reason = StopReason(kind=StopReasonKind.USER_CANCEL, initiator="api", at=clock.now())
            await pair.stopper.request_stop(turn.id, reason)
            async with asyncio.timeout(10):
                while not (await pair.runner.store.get(turn.id)).is_terminal:
                    await asyncio.sleep(0.01)
            await asyncio.sleep(0.3)  # a provider that ignores its cancellation goes on a while
            for m in (pair.runner, pair.stopper):
                await m.events.log(turn.session_id).flush()
            events = await pair.runner.store.read_events(turn.session_id, 0, 10_000)
            logged += len(late_output(events, turn.id))
            follower = EventFollower(pair.runner.store, turn.session_id)
            seen = await follower.read_available()
            stop_at = next(
                e.seq for e in events if e.type == "turn" and e.turn_id == turn.id and e.payload.get("status") == "CANCEL_REQUESTED"
            )
            delivered += sum(1 for e in seen if e.seq > stop_at and e.turn_id == turn.id and e.type in OUTPUT_TYPES)
    finally:
        await turns.aclose()
    return logged, delivered


@pytest.fixture
async def one_process(store: SqliteStore) -> AsyncIterator[Pair]:
    manager = TurnManager(store, SystemClock())
    yield Pair(manager, manager)


@pytest.fixture
async def two_instances(redis_url: str) -> AsyncIterator[Pair]:
    prefix = f"t{uuid.uuid4().hex[:10]}"
    managers = []
    stores = []
    for _ in range(2):
        store = RedisStore(redis_url, prefix=prefix)
        await store.open()
        signals = RedisStopSignals(store.client, f"{prefix}:stops")
        await signals.start()
        stores.append((store, signals))
        managers.append(TurnManager(store, SystemClock(), signals=signals))
    try:
        yield Pair(managers[0], managers[1])
    finally:
        for m in managers:
            await m.events.aclose()
        for store, signals in stores:
            await signals.aclose()
            await store.close()


@pytest.mark.parametrize("rate", ["20tps", "200tps", "ignores-cancel"])
async def test_nothing_is_delivered_after_the_stop_in_one_process(one_process: Pair, rate: str) -> None:
    logged, delivered = await stop_trials(one_process, models(SystemClock())[rate], seed=17)
    assert (logged, delivered) == (0, 0)


@pytest.mark.parametrize("rate", ["200tps", "ignores-cancel"])
async def test_nothing_is_delivered_after_a_stop_from_another_instance(two_instances: Pair, rate: str) -> None:
    # The owner fences its own writes from the moment the signal reaches it;
    # what it wrote in the milliseconds before may sit after the stop in the
    # log unfenced, but no follower delivers it.
    _logged, delivered = await stop_trials(two_instances, models(SystemClock())[rate], seed=71)
    assert delivered == 0


@requires_espeak
async def test_a_voice_turn_stopped_from_outside_sends_nothing_after_its_stop(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    """The same rule for voice: a stop request (the REST API's path) while
    the story plays. From the moment the stop is recorded no audio frame of
    the turn leaves the track and no output of it is deliverable."""
    h = Harness(store)
    await h.start()
    try:
        h.mic.say(pcm48(say("tell me a story")))
        await h.wait_for(lambda: 1 in h.track.audit.per_generation and h.track.audit.per_generation[1].frames > 40)
        [turn] = await store.list_session("sess-1")
        reason = StopReason(kind=StopReasonKind.USER_CANCEL, initiator="api", at=h.clock.now())
        await h.manager.request_stop(turn.id, reason)
        recorded = h.clock.monotonic()
        await h.wait_for(lambda: "CANCELLED" in h.statuses(turn.id), timeout=10)
        await asyncio.sleep(0.3)
        last = h.track.audit.per_generation[1].last_sent_at
        assert last is not None and last <= recorded
        await h.log.flush()
        assert late_output(await store.read_events("sess-1", 0, 10_000), turn.id) == []
    finally:
        await h.stop()
