"""Traces: each turn run here is one span with its stop's figures, its
model requests (GenAI conventions), tool calls and the stop's propagation
as child spans; no content unless a setting says so; export as the
standard OTEL_* variables say. What an exporter receives, through the real
app. (A barge-in's trace: tests/voice/test_turn_telemetry.py.)"""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import start_app
from opentelemetry.proto.collector.trace.v1.trace_service_pb2 import ExportTraceServiceRequest
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter

from web.app import create_app
from web.settings import Settings
from web.tracing import TRACING, _exporter

TOKEN = "tok-trace-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


async def ended_spans(exporter: InMemorySpanExporter, turn_id: str) -> list[ReadableSpan]:
    async with asyncio.timeout(10):
        while not any(s.name == "turn" and s.attributes and s.attributes.get("turnkeeper.turn.id") == turn_id
                      for s in exporter.get_finished_spans()):
            await asyncio.sleep(0.05)
    return list(exporter.get_finished_spans())


async def traced_app(tmp_path: Path, **settings: Any) -> tuple[web.Application, InMemorySpanExporter, web.AppRunner, str]:
    """The real app on a free port, its spans kept in memory: (app, exporter, runner, URL)."""
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"default:{TOKEN}", **settings))
    exporter = InMemorySpanExporter()
    app[TRACING].provider.add_span_processor(SimpleSpanProcessor(exporter))
    runner, url = await start_app(app)
    return app, exporter, runner, url


async def test_a_stopped_turn_and_a_tool_call_as_spans(tmp_path: Path) -> None:
    app, exporter, runner, url = await traced_app(tmp_path, llm={"tokens_per_second": 20})
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
            assert 0 < a["turnkeeper.turn.deadline_ms"] <= 300_000  # the plan's deadline as the turn began
            kids = {k.name: k for k in spans if k.parent is not None and k.parent.span_id == turn.context.span_id}
            model = kids["chat local-agent"].attributes
            assert model["gen_ai.operation.name"] == "chat" and model["gen_ai.provider.name"] == "turnkeeper.local"
            assert model["gen_ai.usage.input_tokens"] > 0 and model["gen_ai.usage.output_tokens"] > 0
            assert model["gen_ai.request.max_tokens"] == 1024
            assert model["turnkeeper.child.outcome"] == "stopped" and model["turnkeeper.model.partial"] is True
            assert model["turnkeeper.model.started_after_stop"] is False
            assert a["gen_ai.usage.output_tokens"] == model["gen_ai.usage.output_tokens"]  # one request: the sums agree
            cancel = kids["cancel"]
            reported = {e.attributes["child"]: e.attributes["outcome"] for e in cancel.events}
            assert reported == {"agent": "stopped", "model": "stopped"}
            assert cancel.attributes["turnkeeper.stop.settled_ms"] >= 0
            assert cancel.attributes["turnkeeper.stop.reason"] == "user_cancel"  # asked over the API: from the store
            assert turn.start_time <= cancel.start_time <= cancel.end_time <= turn.end_time
            assert not any(k in ("turnkeeper.transcript", "turnkeeper.reply", "turnkeeper.tool.arguments")
                           for sp in spans for k in sp.attributes)  # no content by default

            async with http.post(f"{url}/v1/turns", json={"text": "please order a coffee"}, headers=AUTH) as r:
                order = (await r.json())["turn"]["id"]
            spans = await ended_spans(exporter, order)
            (turn,) = [s for s in spans if s.name == "turn" and s.attributes["turnkeeper.turn.id"] == order]
            assert turn.attributes["turnkeeper.turn.status"] == "COMPLETED" and "turnkeeper.stop.reason" not in turn.attributes
            (tool,) = [s for s in spans if s.name == "tool create_order"]
            assert tool.parent is not None and tool.parent.span_id == turn.context.span_id
            assert tool.attributes["turnkeeper.tool.outcome"] == "done"
            assert tool.attributes["turnkeeper.tool.idempotency_key"] == f"{order}:2"  # the ledger's key
            assert turn.start_time <= tool.start_time <= tool.end_time <= turn.end_time
            # two model requests (the tool call, then the answer): each span its own request's usage
            models = sorted((s for s in spans if s.name.startswith("chat ") and s.parent is not None
                             and s.parent.span_id == turn.context.span_id), key=lambda s: s.start_time)
            assert [m.attributes.get("turnkeeper.model.request") for m in models] == [1, 2]
            assert all(m.attributes["gen_ai.usage.input_tokens"] > 0 for m in models)
            assert sum(m.attributes["gen_ai.usage.output_tokens"] for m in models) == turn.attributes["gen_ai.usage.output_tokens"]
    finally:
        await runner.cleanup()
    assert app[TRACING]._turns == {}  # nothing left open


async def test_content_goes_into_spans_only_when_asked(tmp_path: Path) -> None:
    _, exporter, runner, url = await traced_app(tmp_path, traces={"include_content": True})
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/turns", json={"text": "please order a coffee"}, headers=AUTH) as r:
                order = (await r.json())["turn"]["id"]
            spans = await ended_spans(exporter, order)
    finally:
        await runner.cleanup()
    (turn,) = [s for s in spans if s.name == "turn"]
    assert turn.attributes["turnkeeper.transcript"] == "please order a coffee"
    assert "coffee" in turn.attributes["turnkeeper.reply"]
    (tool,) = [s for s in spans if s.name == "tool create_order"]
    assert "coffee" in tool.attributes["turnkeeper.tool.arguments"]


async def test_the_standard_otel_variables_export_over_otlp(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    received: list[ExportTraceServiceRequest] = []

    async def collect(request: web.Request) -> web.Response:
        assert request.content_type == "application/x-protobuf"
        msg = ExportTraceServiceRequest()
        msg.ParseFromString(await request.read())
        received.append(msg)
        return web.Response(body=b"", content_type="application/x-protobuf")

    collector = web.Application()
    collector.router.add_post("/v1/traces", collect)
    collector_runner, collector_url = await start_app(collector)
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", collector_url)  # the exporter adds /v1/traces
    monkeypatch.setenv("OTEL_SERVICE_NAME", "turnkeeper-under-test")
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"default:{TOKEN}"))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/turns", json={"text": "hello there"}, headers=AUTH) as r:
                turn_id = (await r.json())["turn"]["id"]
            async with asyncio.timeout(10):
                while True:
                    async with http.get(f"{url}/v1/turns/{turn_id}", headers=AUTH) as r:
                        if (await r.json())["status"] == "COMPLETED":
                            break
                    await asyncio.sleep(0.05)
    finally:
        await runner.cleanup()  # flushes the batch
        await collector_runner.cleanup()
    spans = [(rs.resource, sp) for msg in received for rs in msg.resource_spans
             for ss in rs.scope_spans for sp in ss.spans]
    names = {sp.name for _, sp in spans}
    assert {"turn", "chat local-agent"} <= names
    services = {a.value.string_value for resource, _ in spans for a in resource.attributes if a.key == "service.name"}
    assert services == {"turnkeeper-under-test"}


def test_no_export_unless_configured(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("OTEL_EXPORTER_OTLP_ENDPOINT", "OTEL_EXPORTER_OTLP_TRACES_ENDPOINT", "OTEL_TRACES_EXPORTER",
                 "OTEL_SDK_DISABLED", "OTEL_EXPORTER_OTLP_PROTOCOL", "OTEL_EXPORTER_OTLP_TRACES_PROTOCOL"):
        monkeypatch.delenv(name, raising=False)
    assert _exporter(Settings(store="sqlite:///:memory:")) is None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_ENDPOINT", "http://127.0.0.1:9")
    assert _exporter(Settings(store="sqlite:///:memory:")) is not None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "")  # empty counts as unset: otlp
    assert _exporter(Settings(store="sqlite:///:memory:")) is not None
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "console, otlp")
    assert _exporter(Settings(store="sqlite:///:memory:")) is not None
    monkeypatch.setenv("OTEL_EXPORTER_OTLP_PROTOCOL", "grpc")  # not spoken here: refused, not posted to :4317
    assert _exporter(Settings(store="sqlite:///:memory:")) is None
    monkeypatch.delenv("OTEL_EXPORTER_OTLP_PROTOCOL")
    monkeypatch.setenv("OTEL_SDK_DISABLED", "true")
    assert _exporter(Settings(store="sqlite:///:memory:")) is None
    monkeypatch.delenv("OTEL_SDK_DISABLED")
    monkeypatch.setenv("OTEL_TRACES_EXPORTER", "none")  # the standard switch off
    assert _exporter(Settings(store="sqlite:///:memory:")) is None
    assert _exporter(Settings(store="sqlite:///:memory:", traces={"otlp_endpoint": "http://127.0.0.1:9/v1/traces"})) is not None
