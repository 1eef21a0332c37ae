"""Issue 17.2: spend after a stop is never reported as zero when it is
unknown. A real OpenAI-compatible server on a loopback socket that ignores
the hang-up (it bills the whole completion whatever the client does) is
stopped mid-stream at random moments, at several token rates; the turn's
usage must say "unconfirmed" with an upper bound that covers what the
server really generated after the stop, and the bound must be finite
(every request is capped with max_tokens). An in-process model, which is
known to stop, is "confirmed"."""

from __future__ import annotations

import asyncio
import random
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web

from clock import SystemClock
from testkit.openai_server import ChatCompletionsServer, ServerOptions
from turn.manager import TurnManager
from turn.models import Plan, StopReason, StopReasonKind, Turn, TurnStatus
from turn.sqlite_store import SqliteStore
from turn.usage import UsageMeter
from voice.llm import STORY_REPLY, LlmConfig, LocalAgent, tokenize
from voice.openai_llm import OpenAiChatModel
from voice.providers import LanguageModel, Message
from voice.text_turns import TextTurns

TRIALS = 5
CAP = 60  # tokens: below the story's length, so the provider's own end is the cap


async def serve(server: ChatCompletionsServer) -> tuple[web.AppRunner, str]:
    runner = web.AppRunner(server.app())
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    return runner, f"http://127.0.0.1:{runner.addresses[0][1]}/v1"


@pytest.fixture
async def manager(tmp_path: Path) -> AsyncIterator[TurnManager]:
    store = SqliteStore(tmp_path / "t.db")
    await store.open()
    yield TurnManager(store, SystemClock(), owner="me")
    await store.close()


async def stop_mid_stream(manager: TurnManager, model: LanguageModel, delay_s: float) -> Turn:
    clock = manager.clock
    turns = TextTurns(manager, lambda: model, clock, plans=lambda _t: Plan())
    try:
        turn = await turns.start(tenant_id="t", text="tell me a story")
        await asyncio.sleep(delay_s)
        await manager.request_stop(turn.id, StopReason(kind=StopReasonKind.USER_CANCEL, initiator="t", at=clock.now()))
        async with asyncio.timeout(20):
            while turn.id in turns.scopes:
                await asyncio.sleep(0.01)
        return await manager.get(turn.id)
    finally:
        await turns.aclose()


@pytest.mark.parametrize("tps", [20, 100, 400])
async def test_a_provider_that_ignores_the_hang_up_is_reported_unconfirmed_with_a_bound(manager: TurnManager, tps: int) -> None:
    server = ChatCompletionsServer(ServerOptions(tokens_per_second=tps, ignore_disconnect=True))
    runner, url = await serve(server)
    model = OpenAiChatModel(LlmConfig(provider="openai", base_url=url, model="m", max_tokens=CAP))
    rng = random.Random(tps)
    try:
        for _ in range(TRIALS):
            before = len(server.requests)
            done = await stop_mid_stream(manager, model, rng.uniform(3, CAP / 2) / tps)
            assert done.status is TurnStatus.CANCELLED
            [stats] = server.requests[before:]
            await asyncio.wait_for(stats.done.wait(), CAP / tps + 5)  # the provider went on to its end
            [rec] = done.usage.records
            assert rec.partial and rec.max_tokens == CAP
            assert rec.after_stop == "unconfirmed" and done.usage.after_stop == "unconfirmed"
            seen_before_stop = rec.completion_tokens - rec.completion_tokens_after_stop
            really_after_stop = stats.generated - seen_before_stop
            assert really_after_stop > 0 and stats.generated_after_disconnect > 0  # the waste is real
            bound = done.usage.completion_tokens_after_stop_bound
            assert bound is not None and really_after_stop <= bound <= CAP  # honest, and finite
            assert stats.generated <= CAP  # the cap was sent, and honoured
    finally:
        await model.aclose()
        await runner.cleanup()


async def test_a_provider_that_stops_at_the_hang_up_is_still_unconfirmed(manager: TurnManager) -> None:
    """Closing the connection proves nothing to the client, even when this
    server does stop: the record stays unconfirmed, with a bound that covers
    the (here small) real waste."""
    server = ChatCompletionsServer(ServerOptions(tokens_per_second=100))
    runner, url = await serve(server)
    model = OpenAiChatModel(LlmConfig(provider="openai", base_url=url, model="m", max_tokens=CAP))
    try:
        done = await stop_mid_stream(manager, model, 0.2)
        [stats] = server.requests
        await asyncio.wait_for(stats.done.wait(), 5)
        [rec] = done.usage.records
        assert rec.after_stop == "unconfirmed"
        assert rec.completion_tokens_after_stop_bound == rec.completion_tokens_after_stop + CAP - rec.completion_tokens
        assert stats.generated - (rec.completion_tokens - rec.completion_tokens_after_stop) <= rec.completion_tokens_after_stop_bound
    finally:
        await model.aclose()
        await runner.cleanup()


async def test_an_in_process_model_is_confirmed_stopped(manager: TurnManager) -> None:
    model = LocalAgent(LlmConfig(tokens_per_second=100), manager.clock)
    done = await stop_mid_stream(manager, model, 0.2)
    [rec] = done.usage.records
    assert rec.partial and rec.after_stop == "confirmed"
    assert done.usage.after_stop == "confirmed"
    assert done.usage.completion_tokens_after_stop_bound == done.usage.completion_tokens_after_stop
    assert model.tokens_streamed == rec.completion_tokens  # it really generated nothing more


async def test_a_turn_no_stop_touched_has_no_after_stop_status(manager: TurnManager) -> None:
    model = LocalAgent(LlmConfig(tokens_per_second=1000), manager.clock)
    turns = TextTurns(manager, lambda: model, manager.clock, plans=lambda _t: Plan())
    try:
        turn = await turns.start(tenant_id="t", text="what is the weather")
        async with asyncio.timeout(20):
            while not (await manager.get(turn.id)).is_terminal:
                await asyncio.sleep(0.01)
    finally:
        await turns.aclose()
    done = await manager.get(turn.id)
    assert done.status is TurnStatus.COMPLETED
    assert done.usage.after_stop is None and done.usage.completion_tokens_after_stop_bound == 0


def test_meter_rules() -> None:
    """The record's status and bound, request by request."""
    meter = UsageMeter()
    done_before = meter.start_request(5)
    done_before.max_tokens = 50
    done_before.chunk(10)
    done_before.finish(partial=False)
    aborted = meter.start_request(5)
    aborted.max_tokens = 50
    aborted.chunk(20)
    meter.mark_stopped()
    aborted.chunk(2)
    aborted.finish(partial=True)
    uncapped = meter.start_request(5)
    uncapped.chunk(1)
    r1, r2, r3 = (r.record() for r in meter.requests)
    assert r1.after_stop is None and r1.completion_tokens_after_stop_bound == 0
    assert r2.after_stop == "unconfirmed" and r2.completion_tokens_after_stop == 2
    assert r2.completion_tokens_after_stop_bound == 2 + 50 - 22
    assert r3.after_stop == "unconfirmed" and r3.completion_tokens_after_stop_bound is None  # no cap: no bound
    usage = meter.usage()
    assert usage.after_stop == "unconfirmed" and usage.completion_tokens_after_stop_bound is None


async def test_the_request_carries_the_cap_and_the_server_honours_it() -> None:
    server = ChatCompletionsServer(ServerOptions(tokens_per_second=2000))
    runner, url = await serve(server)
    for field in ("max_tokens", "max_completion_tokens"):
        model = OpenAiChatModel(LlmConfig(provider="openai", base_url=url, model="m", max_tokens=7, max_tokens_field=field))
        try:
            assert model.request_body([Message(role="user", content="hi")], None)[field] == 7
            meter = UsageMeter().start_request(1)
            text = [t async for t in model.stream([Message(role="user", content="tell me a story")], meter=meter)]
            assert len(text) == 7 < len(tokenize(STORY_REPLY))
            rec = meter.record()
            assert not rec.partial and rec.completion_tokens == 7 and rec.after_stop is None
        finally:
            await model.aclose()
    await runner.cleanup()
