"""``GET /metrics`` over the real endpoint: a text turn stopped through the
API shows in the stop-latency histogram under its reason, in the ended
turns, and starts no model request after its stop; the gauges read the
app's state at the scrape (sessions, running turns, the drain); no label
carries a tenant or an id."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from datetime import UTC, datetime, timedelta
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from conftest import start_app
from prometheus_client.parser import text_string_to_metric_families

from turn.event_catalogue import MODEL_OF
from turn.intents import Intent, IntentStatus
from turn.models import EventRecord
from web.app import create_app
from web.drain import DRAIN, drain_app
from web.metrics import METRICS, Metrics
from web.settings import Settings
from web.state import MANAGER, PACING

TOKEN = "tok-metrics-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    app = create_app(Settings(
        store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"default:{TOKEN}", llm={"tokens_per_second": 10},
        shutdown={"lb_delay_s": 0, "drain_timeout_s": 1, "turn_wait_s": 1, "grace_s": 5},
    ))
    runner, url = await start_app(app)
    try:
        yield app, url
    finally:
        await runner.cleanup()


async def scrape(http: aiohttp.ClientSession, url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    async with http.get(f"{url}/metrics") as r:
        assert r.status == 200 and r.headers["Content-Type"].startswith("text/plain")
        text = await r.text()
    return {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text) for s in family.samples
    }


async def test_a_stopped_turn_is_measured_and_the_gauges_read_the_state(server: tuple[web.Application, str]) -> None:
    app, url = server
    async with aiohttp.ClientSession() as http:
        before = await scrape(http, url)
        assert before[("turnkeeper_draining", ())] == 0
        assert before[("turnkeeper_voice_sessions", (("transport", "webrtc"),))] == 0
        async with http.post(f"{url}/v1/turns", json={"text": "tell me a story"}, headers=AUTH) as r:
            turn_id = (await r.json())["turn"]["id"]
        await asyncio.sleep(0.5)  # it streams its reply
        assert (await scrape(http, url))[("turnkeeper_text_turns_running", ())] == 1
        headers = {**AUTH, "Idempotency-Key": "stop-1"}
        async with http.post(f"{url}/v1/turns/{turn_id}/stop", json={"reason": "user_cancel"}, headers=headers) as r:
            assert r.status in (200, 202), await r.text()
        for _ in range(100):
            after = await scrape(http, url)
            if after.get(("turnkeeper_turns_ended_total", (("reason", "user_cancel"), ("status", "CANCELLED")))):
                break
            await asyncio.sleep(0.05)
        stopped = (("reason", "user_cancel"), ("status", "CANCELLED"))
        assert after[("turnkeeper_turns_ended_total", stopped)] == 1
        assert after[("turnkeeper_stop_to_terminal_seconds_count", stopped)] == 1
        assert 0 <= after[("turnkeeper_stop_to_terminal_seconds_sum", stopped)] < 2  # a sanity bound
        assert after[("turnkeeper_model_requests_after_stop_total", ())] == 0
        assert after[("turnkeeper_text_turns_running", ())] == 0
        labels = {k for (_, labels) in after for k, _ in labels}
        # no tenant, no ids; "type" shows only once the stop fenced a late event
        assert labels <= {"reason", "status", "initiator", "transport", "le", "kind", "outcome", "how", "type"}
        fenced = {v for (name, labels) in after if name == "turnkeeper_late_events_fenced_total" for k, v in labels if k == "type"}
        assert fenced <= set(MODEL_OF)  # an event type of the catalogue, never anything of the turn's own
        assert after[("turnkeeper_tokens_streamed_total", (("kind", "completion"),))] > 0
        assert after[("turnkeeper_tokens_streamed_total", (("kind", "prompt"),))] > 0
        app[DRAIN].begin("test", lambda d: drain_app(d, app))
        draining = await scrape(http, url)
        assert draining[("turnkeeper_draining", ())] == 1
        async with http.get(f"{url}/metrics") as r:
            assert r.status == 200  # an operator still sees a draining instance
        await asyncio.wait_for(app[DRAIN].done.wait(), 5)


async def test_an_order_counts_its_effect_done(server: tuple[web.Application, str]) -> None:
    app, url = server
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/turns", json={"text": "please order a coffee"}, headers=AUTH) as r:
            turn_id = (await r.json())["turn"]["id"]
        for _ in range(200):
            after = await scrape(http, url)
            if after.get(("turnkeeper_turns_ended_total", (("reason", ""), ("status", "COMPLETED")))):
                break
            await asyncio.sleep(0.05)
        assert after[("turnkeeper_effects_total", (("outcome", "done"),))] == 1, turn_id


def test_voice_events_are_counted_by_transport() -> None:
    """The detector's events, as a voice session logs them, counted under
    the session's transport; a resumed turn counted by how."""
    metrics = Metrics()
    metrics.transport_of = lambda sid: {"s-phone": "phone"}.get(sid, "")
    at = datetime.now(UTC)

    def ev(type_: str, **payload: object) -> EventRecord:
        return EventRecord(session_id="s-phone", seq=1, type=type_, turn_id=None, generation=1, at=at, payload=payload)

    metrics.observe(ev("barge_in", initiator="vad", onset_to_fence_ms=640.0, paused_ms=600.0, cleared_ms=200,
                       old_turn_id="t", old_generation=1))
    metrics.observe(ev("false_interruption", paused_ms=0.0))
    metrics.observe(ev("backchannel", paused_ms=120.0, text="uh-huh", syllables=2))
    metrics.observe(ev("agent.restart", reason="taken_over"))
    metrics.observe(ev("tool.compensated", key="k", step=1, name="create_order"))
    late = ev("agent.delta", text="late")
    metrics.observe(late.model_copy(update={"fenced": True}))
    recovered = {"kind": "worker_shutdown", "initiator": "server", "at": at.isoformat(), "request_id": "recover:t2"}
    metrics.observe(ev("turn", status="CANCELLED", stop_reason=recovered))
    got = {(s.name, tuple(sorted(s.labels.items()))): s.value
           for family in metrics.registry.collect() for s in family.samples}
    phone = (("transport", "phone"),)
    assert got[("turnkeeper_barge_ins_total", (("initiator", "vad"),))] == 1
    assert got[("turnkeeper_barge_in_onset_to_fence_seconds_sum", phone)] == pytest.approx(0.64)
    assert got[("turnkeeper_false_interruptions_total", phone)] == 1
    assert got[("turnkeeper_backchannels_total", phone)] == 1
    assert got[("turnkeeper_noise_pause_seconds_sum", (("kind", "backchannel"), *phone))] == pytest.approx(0.12)
    assert got[("turnkeeper_noise_pause_seconds_bucket", (("kind", "false_interruption"), ("le", "0.0"), *phone))] == 1
    assert got[("turnkeeper_turns_resumed_total", (("how", "taken_over"),))] == 1
    assert got[("turnkeeper_effects_total", (("outcome", "compensated"),))] == 1
    # the pause 600 ms before the fence is what the caller heard stop: 40 ms after the onset
    assert got[("turnkeeper_audible_stop_seconds_sum", phone)] == pytest.approx(0.04)
    assert got[("turnkeeper_late_events_fenced_total", (("type", "agent.delta"),))] == 1
    assert got[("turnkeeper_abandoned_leases_total", (("action", "taken_over"),))] == 1
    assert got[("turnkeeper_abandoned_leases_total", (("action", "stopped"),))] == 1


async def test_the_reconciliation_backlog_is_read_from_the_ledger(server: tuple[web.Application, str]) -> None:
    """An effect nobody could confirm, waiting for its next lookup: the
    backlog counts it and its age; calls in flight are open rows, not
    backlog."""
    app, url = server
    store, now = app[MANAGER].store, datetime.now(UTC)
    async with aiohttp.ClientSession() as http:
        before = await scrape(http, url)
        assert before[("turnkeeper_reconciliation_backlog", ())] == 0
        assert before[("turnkeeper_reconciliation_oldest_seconds", ())] == 0
        waiting = Intent(key="t-old:1", turn_id="t-old", step=1, tool="create_order", effect="compensate",
                         status=IntentStatus.RETRYING, next_attempt_at=now + timedelta(hours=1),
                         created_at=now - timedelta(seconds=90), updated_at=now)
        in_flight = Intent(key="t-new:1", turn_id="t-new", step=1, tool="get_weather", created_at=now, updated_at=now,
                           next_attempt_at=now + timedelta(hours=1))
        await store.ledger_add(waiting)
        await store.ledger_add(in_flight)
        cached = await scrape(http, url)  # within LEDGER_EVERY_S: the last figures, no store read
        assert cached[("turnkeeper_ledger_open_rows", ())] == 0
        app[METRICS].ledger_read_at = None  # as if LEDGER_EVERY_S had passed
        after = await scrape(http, url)
    assert after[("turnkeeper_ledger_open_rows", ())] == 2
    assert after[("turnkeeper_reconciliation_backlog", ())] == 1
    assert 90 <= after[("turnkeeper_reconciliation_oldest_seconds", ())] < 150


async def test_the_send_lateness_of_every_session_is_a_histogram(server: tuple[web.Application, str]) -> None:
    """``turnkeeper_send_lateness_seconds``: the app's pacing monitor as
    a Prometheus histogram (cumulative buckets, count and sum)."""
    app, url = server
    async with aiohttp.ClientSession() as http:
        before = await scrape(http, url)
        assert before[("turnkeeper_send_lateness_seconds_count", ())] == 0
        for late in (0.0, 0.003, 0.012, 0.05):
            app[PACING].observe(late, 1.0)
        after = await scrape(http, url)
    bucket = "turnkeeper_send_lateness_seconds_bucket"
    assert after[(bucket, (("le", "0.001"),))] == 1
    assert after[(bucket, (("le", "0.004"),))] == 2
    assert after[(bucket, (("le", "0.015"),))] == 3
    assert after[(bucket, (("le", "0.04"),))] == 3
    assert after[(bucket, (("le", "+Inf"),))] == 4 == after[("turnkeeper_send_lateness_seconds_count", ())]
    assert after[("turnkeeper_send_lateness_seconds_sum", ())] == pytest.approx(0.065)
