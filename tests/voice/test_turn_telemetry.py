"""The trace and the latency metrics of a barge-in, as a voice session
makes them: the agent session on a WAV transport (real recogniser, agent,
TTS and barge-in detector), its Turn Manager's event tap and scope
observers feeding web.tracing and web.metrics, spans read back from an
in-memory exporter."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path

import pytest
from conftest import requires_espeak
from opentelemetry.sdk.trace import ReadableSpan
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from test_wav_transport import Call

from turn.models import TurnStatus
from turn.sqlite_store import SqliteStore
from web.metrics import Metrics
from web.settings import Settings
from web.tracing import Tracing

pytestmark = requires_espeak


@pytest.fixture
async def traced(store: SqliteStore) -> AsyncIterator[tuple[Call, InMemorySpanExporter, Metrics]]:
    c = Call(store)
    tracing = Tracing(Settings(store="sqlite:///:memory:"), c.clock, c.manager)
    exporter = InMemorySpanExporter()
    tracing.provider.add_span_processor(SimpleSpanProcessor(exporter))
    metrics = Metrics()
    for observer in (tracing, metrics):
        c.manager.events.taps.append(observer.observe)
        c.manager.scope_observers.append(observer)
    await c.start()
    yield c, exporter, metrics
    if not c.run_task.done():
        await c.hang_up()
    tracing.shutdown()


def children(spans: list[ReadableSpan], parent: ReadableSpan) -> dict[str, ReadableSpan]:
    assert parent.context is not None
    return {s.name: s for s in spans if s.parent is not None and s.parent.span_id == parent.context.span_id}


def sample_count(metrics: Metrics, name: str) -> float:
    return sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name == f"{name}_count")


async def test_the_trace_of_a_barge_in(
    traced: tuple[Call, InMemorySpanExporter, Metrics], say: Callable[..., Path], store: SqliteStore
) -> None:
    call, exporter, metrics = traced
    t = call.transport
    t.play(say("tell me a story"))
    await call.wait_for(lambda: len(t.audible(1)) > 25, timeout=30)
    t.play(say("what is the weather like today"))
    await call.wait_for(lambda: call.completed() == 1, timeout=30)
    await call.hang_up()
    old, new = await store.list_session("wav-1")
    assert old.status is TurnStatus.CANCELLED and new.status is TurnStatus.COMPLETED

    spans = list(exporter.get_finished_spans())
    turns = {s.attributes["turnkeeper.turn.id"]: s for s in spans if s.name == "turn" and s.attributes}
    story, answer = turns[old.id], turns[new.id]

    # the interrupted turn: its stop, the barge-in, and each piece of its work
    a = story.attributes or {}
    assert a["turnkeeper.stop.reason"] == "barge_in" and a["turnkeeper.turn.generation"] == 1
    assert a["turnkeeper.requests_after_stop"] == 0
    assert {"barge-in", "stop requested", "end of speech"} <= {e.name for e in story.events}
    kids = children(spans, story)
    assert {"stt", "chat local-agent", "tts", "cancel"} <= set(kids)
    stt = kids["stt"].attributes or {}
    assert stt["turnkeeper.child.outcome"] == "completed" and stt["turnkeeper.child.after_stop"] is False
    model = kids["chat local-agent"].attributes or {}
    assert model["gen_ai.operation.name"] == "chat" and model["gen_ai.request.model"] == "local-agent"
    assert model["gen_ai.usage.input_tokens"] > 0 and model["gen_ai.usage.output_tokens"] > 0
    assert model["turnkeeper.child.outcome"] == "stopped" and model["turnkeeper.model.partial"] is True
    assert 0 <= model["turnkeeper.model.time_to_first_token_ms"] < 5000
    tts = kids["tts"].attributes or {}
    assert tts["turnkeeper.child.outcome"] == "stopped" and tts["turnkeeper.child.after_stop"] is True
    assert 0 < tts["turnkeeper.tts.time_to_first_audio_ms"] < 5000
    cancel = kids["cancel"]
    assert (cancel.attributes or {})["turnkeeper.stop.reason"] == "barge_in"
    reported = {e.attributes["child"]: e.attributes["outcome"] for e in cancel.events if e.attributes}
    assert reported["model"] == "stopped" and reported["tts"] == "stopped" and reported["stt"] == "completed"
    for kid in kids.values():  # every child inside its turn
        assert story.start_time <= kid.start_time <= kid.end_time <= story.end_time  # type: ignore[operator]

    # the answer: nothing stopped, its reply played out; no content in spans
    a = answer.attributes or {}
    assert a["turnkeeper.turn.status"] == "COMPLETED" and "turnkeeper.stop.reason" not in a
    kids = children(spans, answer)
    assert {"stt", "chat local-agent", "tts", "playout"} <= set(kids) and "cancel" not in kids
    assert all((k.attributes or {})["turnkeeper.child.outcome"] == "completed" for k in kids.values() if not k.name.startswith("tool "))
    [tool] = [(k.attributes or {}) for k in kids.values() if k.name.startswith("tool ")]  # the weather read, by its ledger key
    assert tool["turnkeeper.tool.outcome"] == "done" and tool["turnkeeper.tool.idempotency_key"] == f"{new.id}:2"
    assert not any(k.startswith("turnkeeper.transcript") or k == "turnkeeper.reply"
                   for s in spans for k in (s.attributes or {}))

    # the same moments as latency metrics
    assert sample_count(metrics, "turnkeeper_stt_seconds") == 2
    assert sample_count(metrics, "turnkeeper_model_time_to_first_token_seconds") >= 2
    assert sample_count(metrics, "turnkeeper_tts_time_to_first_audio_seconds") == 2
    assert sample_count(metrics, "turnkeeper_voice_to_voice_seconds") == 2
    assert sample_count(metrics, "turnkeeper_audible_stop_seconds") == 1
