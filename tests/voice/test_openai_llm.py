"""The OpenAI-compatible streaming client against a real local Chat
Completions server (aiohttp, real sockets): text and tool-call streams,
usage from the usage chunk or counted, and aborts that tear the connection
down so the server stops generating."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator, Awaitable, Callable

import aiohttp
import pytest
from aiohttp import web

from clock import SystemClock
from demo_shop.tools import weather_tools
from testkit.openai_server import ChatCompletionsServer, ServerOptions
from turn.manager import TurnManager
from turn.models import Plan, StopReason, StopReasonKind, TurnStatus
from turn.sqlite_store import SqliteStore
from turn.usage import UsageMeter
from voice.llm import COUNT_REPLY, STORY_REPLY, WEATHER_REPLY, LlmConfig, tokenize
from voice.openai_llm import ModelApiError, OpenAiChatModel, sse_data
from voice.providers import Message, ToolCall
from voice.text_turns import TextTurns

Start = Callable[..., Awaitable[tuple[ChatCompletionsServer, OpenAiChatModel]]]


@pytest.fixture
async def start() -> AsyncIterator[Start]:
    runners: list[web.AppRunner] = []
    models: list[OpenAiChatModel] = []

    async def _start(api_key: str | None = None, client_key: str = "", **options: object) -> tuple[ChatCompletionsServer, OpenAiChatModel]:
        server = ChatCompletionsServer(ServerOptions(api_key=api_key, **options))  # type: ignore[arg-type]
        runner = web.AppRunner(server.app())
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        runners.append(runner)
        port = runner.addresses[0][1]
        model = OpenAiChatModel(LlmConfig(provider="openai", base_url=f"http://127.0.0.1:{port}/v1", model="m", api_key=client_key))
        models.append(model)
        return server, model

    yield _start
    for m in models:
        await m.aclose()
    for r in runners:
        await r.cleanup()


def ask(text: str) -> list[Message]:
    return [Message(role="system", content="be brief"), Message(role="user", content=text)]


async def test_streams_text_with_usage_from_the_usage_chunk(start: Start) -> None:
    server, model = await start(tokens_per_second=500)
    meter = UsageMeter()
    req = meter.start_request(1)
    out = [item async for item in model.stream(ask("count to twenty"), meter=req)]
    assert "".join(out) == COUNT_REPLY  # type: ignore[arg-type]
    rec = req.record()
    assert rec.source == "usage_chunk" and not rec.partial
    assert rec.completion_tokens == len(tokenize(COUNT_REPLY)) == server.requests[0].generated
    assert rec.prompt_tokens == 2 + 3  # the server's own count
    assert server.requests[0].completed


async def test_tool_calls_are_assembled_from_their_pieces(start: Start) -> None:
    _, model = await start(tokens_per_second=500)
    tools = weather_tools(SystemClock()).specs()
    out = [item async for item in model.stream(ask("what is the weather"), tools=tools)]
    assert out == [ToolCall(id="call_1", name="lookup_weather", arguments={"city": "here"})]
    history = [
        *ask("what is the weather"),
        Message(role="assistant", content="", tool_calls=out),  # type: ignore[arg-type]
        Message(role="tool", content=WEATHER_REPLY, tool_call_id="call_1"),
    ]
    text = "".join([t async for t in model.stream(history, tools=tools)])  # type: ignore[misc]
    assert text == WEATHER_REPLY


@pytest.mark.parametrize("how", ["aclose", "cancel"])
async def test_abort_tears_the_connection_down(start: Start, how: str) -> None:
    server, model = await start(tokens_per_second=100)
    meter = UsageMeter()
    req = meter.start_request(7)
    got: list[str] = []

    async def read() -> None:
        async with contextlib.aclosing(model.stream(ask("tell me a story"), meter=req)) as stream:
            async for item in stream:
                got.append(item)  # type: ignore[arg-type]
                if how == "aclose" and len(got) == 10:
                    return

    task = asyncio.ensure_future(read())
    if how == "cancel":
        while len(got) < 10:
            await asyncio.sleep(0.005)
        task.cancel()
    with contextlib.suppress(asyncio.CancelledError):
        await task
    stats = server.requests[0]
    await asyncio.wait_for(stats.done.wait(), 2)  # the server noticed within a token or two
    assert stats.disconnected_after_s is not None and not stats.completed
    assert stats.generated_after_disconnect == 0
    assert stats.generated < len(tokenize(STORY_REPLY)) // 2
    rec = req.record()
    assert rec.partial and rec.source == "counted"
    assert rec.prompt_tokens == 7 and len(got) <= rec.completion_tokens <= len(got) + 1


async def test_aborted_request_keeps_the_servers_figures_when_it_sends_usage_every_chunk(start: Start) -> None:
    server, model = await start(tokens_per_second=200, usage_every_chunk=True)
    req = UsageMeter().start_request(1)
    n = 0
    async with contextlib.aclosing(model.stream(ask("tell me a story"), meter=req)) as stream:
        async for _ in stream:
            n += 1
            if n == 8:
                break
    rec = req.record()
    assert rec.partial and rec.source == "usage_chunk"
    assert rec.prompt_tokens == 2 + 4 and rec.completion_tokens == 8


async def test_a_provider_that_ignores_disconnects_is_counted(start: Start) -> None:
    server, model = await start(tokens_per_second=400, ignore_disconnect=True)
    async with contextlib.aclosing(model.stream(ask("count to twenty"))) as stream:
        async for _ in stream:
            break
    stats = server.requests[0]
    await asyncio.wait_for(stats.done.wait(), 2)
    assert stats.generated == len(tokenize(COUNT_REPLY))
    assert stats.generated_after_disconnect > 0 and server.tokens_after_disconnect == stats.generated_after_disconnect


async def test_api_errors_are_clear(start: Start) -> None:
    _, model = await start(api_key="sk-right", client_key="sk-wrong")
    req = UsageMeter().start_request(50)
    with pytest.raises(ModelApiError) as info:
        [x async for x in model.stream(ask("hi"), meter=req)]
    assert info.value.status == 401 and "Incorrect API key" in str(info.value) and "llm.base_url" in str(info.value)
    assert req.record().source == "not_billed"
    _, good = await start(api_key="sk-right", client_key="sk-right", tokens_per_second=1000)
    assert "".join([x async for x in good.stream(ask("hi"))]) == "You said: hi."  # type: ignore[misc]


async def test_connection_refused_is_an_error_not_a_hang() -> None:
    model = OpenAiChatModel(LlmConfig(provider="openai", base_url="http://127.0.0.1:9/v1", connect_timeout_s=2))
    req = UsageMeter().start_request(50)
    try:
        with pytest.raises(aiohttp.ClientError):
            [x async for x in model.stream(ask("hi"), meter=req)]
        rec = req.record()
        assert rec.source == "not_billed" and rec.prompt_tokens == 0 and not rec.partial
    finally:
        await model.aclose()


class _Lines:
    def __init__(self, lines: list[bytes]) -> None:
        self.lines = lines

    def __aiter__(self) -> AsyncIterator[bytes]:
        async def gen() -> AsyncIterator[bytes]:
            for line in self.lines:
                yield line

        return gen()


async def test_sse_parsing_follows_the_event_stream_rules() -> None:
    lines = [b": comment\n", b"data: {\"a\":\n", b"data: 1}\r\n", b"\n", b"event: x\n", b"data:[DONE]\n", b"\n"]
    assert [d async for d in sse_data(_Lines(lines))] == ['{"a":\n1}', "[DONE]"]  # type: ignore[arg-type]
    with pytest.raises(ModelApiError):
        [d async for d in sse_data(_Lines([b"data: \xff\n"]))]  # type: ignore[arg-type]


async def test_garbage_chunks_are_refused() -> None:
    async def handler(request: web.Request) -> web.StreamResponse:
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        await resp.write(b"data: not json\n\n")
        return resp

    app = web.Application()
    app.router.add_post("/v1/chat/completions", handler)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    model = OpenAiChatModel(LlmConfig(provider="openai", base_url=f"http://127.0.0.1:{runner.addresses[0][1]}/v1"))
    req = UsageMeter().start_request(3)
    try:
        with pytest.raises(ModelApiError, match="not JSON"):
            [x async for x in model.stream(ask("hi"), meter=req)]
        assert req.record().partial
    finally:
        await model.aclose()
        await runner.cleanup()


async def test_a_text_turn_on_a_real_model_stream_stops_at_the_socket(start: Start, tmp_path) -> None:  # type: ignore[no-untyped-def]
    """End to end: REST-style text turn, OpenAI client, local server; a stop
    mid-stream ends the turn CANCELLED with a partial usage record, the
    server sees the disconnect, and no request starts after the stop."""
    server, model = await start(tokens_per_second=50)
    store = SqliteStore(tmp_path / "t.db")
    await store.open()
    clock = SystemClock()
    manager = TurnManager(store, clock, owner="me")
    turns = TextTurns(manager, lambda: model, clock, plans=lambda _t: Plan(), tools=lambda: weather_tools(clock))
    try:
        turn = await turns.start(tenant_id="t", text="tell me a story")
        while not server.requests or server.requests[0].generated < 10:
            await asyncio.sleep(0.01)
        await manager.request_stop(turn.id, StopReason(kind=StopReasonKind.USER_CANCEL, initiator="t", at=clock.now()))
        while turn.id in turns.scopes:
            await asyncio.sleep(0.01)
        done = await manager.get(turn.id)
        assert done.status is TurnStatus.CANCELLED
        u = done.usage
        assert u.model_requests == 1 and u.requests_after_stop == 0 and u.records[0].partial
        assert u.prompt_tokens > 0 and 10 <= u.completion_tokens < len(tokenize(STORY_REPLY))
        assert u.completion_tokens_after_stop <= 1
        stats = server.requests[0]
        await asyncio.wait_for(stats.done.wait(), 2)
        assert stats.disconnected_after_s is not None and stats.generated_after_disconnect == 0
        assert len(server.requests) == 1
    finally:
        await turns.aclose()
        await store.close()
