"""Traces: each turn run here is one span with its stop's figures, each
tool call a child span; what an exporter receives, through the real app."""

from __future__ import annotations

import asyncio
from pathlib import Path

import aiohttp
from conftest import start_app
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from web.app import create_app
from web.settings import Settings
from web.tracing import TRACING

TOKEN = "tok-trace-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def ended_spans(exporter: InMemorySpanExporter, turn_id: str) -> list[ReadableSpan]:
    async with asyncio.timeout(10):
        while not any(s.name == "turn" and s.attributes and s.attributes.get("turnkeeper.turn.id") == turn_id
                      for s in exporter.get_finished_spans()):
            await asyncio.sleep(0.05)
    return list(exporter.get_finished_spans())


async def test_a_stopped_turn_and_a_tool_call_as_spans(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"default:{TOKEN}",
                              llm={"tokens_per_second": 20}))
    exporter = InMemorySpanExporter()
    app[TRACING].provider.add_span_processor(SimpleSpanProcessor(exporter))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/turns", json={"text": "tell me a story"}, headers=AUTH) as r:
                story = (await r.json())["turn"]["id"]
            await asyncio.sleep(0.5)
            headers = {**AUTH, "Idempotency-Key": "trace-stop-1"}
            async with http.post(f"{url}/v1/turns/{story}/stop", json={"reason": "user_cancel"}, headers=headers) as r:
                assert r.status in (200, 202)
            spans = await ended_spans(exporter, story)
            (turn,) = [s for s in spans if s.name == "turn" and s.attributes["turnkeeper.turn.id"] == story]
            a = turn.attributes
            assert a["turnkeeper.turn.status"] == "CANCELLED" and a["turnkeeper.stop.reason"] == "user_cancel"
            assert 0 < a["turnkeeper.stop.to_terminal_ms"] < 2000  # a sanity bound; the figure is the bench's
            assert a["turnkeeper.requests_after_stop"] == 0
            assert [e.name for e in turn.events if e.name == "stop requested"] == ["stop requested"]
            assert any(e.name == "model request" for e in turn.events)
            assert turn.start_time < turn.end_time

            async with http.post(f"{url}/v1/turns", json={"text": "please order a coffee"}, headers=AUTH) as r:
                order = (await r.json())["turn"]["id"]
            spans = await ended_spans(exporter, order)
            (turn,) = [s for s in spans if s.name == "turn" and s.attributes["turnkeeper.turn.id"] == order]
            assert turn.attributes["turnkeeper.turn.status"] == "COMPLETED" and "turnkeeper.stop.reason" not in turn.attributes
            (tool,) = [s for s in spans if s.name == "tool create_order"]
            assert tool.parent is not None and tool.parent.span_id == turn.context.span_id
            assert tool.attributes["turnkeeper.tool.outcome"] == "done"
            assert turn.start_time <= tool.start_time <= tool.end_time <= turn.end_time
    finally:
        await runner.cleanup()
    assert app[TRACING]._turns == {}  # nothing left open
