"""Draining in process, over the real endpoints: readiness against
liveness, the admin endpoint's credentials and idempotence, new phone and
device connections refused with 503 while a call in progress is told
(``session.draining``), goes on until ``drain_timeout_s``, and then ends
``worker_shutdown`` with its turn settled."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from conftest import start_app
from telephony_provider import FakeProvider, wait_until

from turn.models import StopReasonKind, TurnStatus
from web.app import PEERS, STORE, create_app
from web.drain import DRAIN, drain_app
from web.settings import Settings
from web.telephony.call import PhoneCall

SHUTDOWN = {"lb_delay_s": 0, "drain_timeout_s": 1.0, "turn_wait_s": 0.5, "grace_s": 5}


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    app = create_app(Settings(
        store=f"sqlite:///{tmp_path}/t.db", shutdown=SHUTDOWN, admin_token="adm-0123456789",
        session={"dtmf": {"timeout_ms": 60_000}},
    ))
    runner, url = await start_app(app)
    try:
        yield app, url
    finally:
        await runner.cleanup()


async def test_readiness_fails_on_drain_while_liveness_holds_and_the_admin_needs_its_token(
    server: tuple[web.Application, str],
) -> None:
    app, url = server
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 200 and await r.json() == {"status": "ready"}
        for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": "adm-0123456789"}):
            async with http.post(f"{url}/v1/admin/drain", headers=headers) as r:
                assert r.status == 401 and (await r.json())["error"]["code"] == "unauthorized"
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 200  # a refused drain changes nothing
        good = {"Authorization": "Bearer adm-0123456789"}
        async with http.post(f"{url}/v1/admin/drain", headers=good) as r:
            assert r.status == 202 and (await r.json())["already"] is False
        async with http.post(f"{url}/v1/admin/drain", headers=good) as r:
            assert r.status == 202 and (await r.json())["already"] is True
        async with http.get(f"{url}/readyz") as r:
            body = await r.json()
            assert r.status == 503 and body["status"] == "draining" and body["reason"] == "admin"
        async with http.get(f"{url}/healthz") as r:
            assert r.status == 200
        await asyncio.wait_for(app[DRAIN].done.wait(), 5)  # nothing was open: done after the steps


async def test_a_call_in_progress_is_told_goes_on_then_ends_and_new_ones_are_refused(
    server: tuple[web.Application, str],
) -> None:
    app, url = server
    ws_url = url.replace("http://", "ws://")
    async with aiohttp.ClientSession() as http:
        provider = FakeProvider(await http.ws_connect(f"{ws_url}/v1/telephony/twilio"))
        await provider.start()
        await wait_until(lambda: any(isinstance(p, PhoneCall) and p.agent for p in app[PEERS].values()), 10, "a call")
        [call] = [p for p in app[PEERS].values() if isinstance(p, PhoneCall)]
        await provider.dtmf("4")  # a keypad turn is open
        await wait_until(lambda: bool(call.agent and call.agent.ptt_active), 5, "keys open a turn")
        drain = app[DRAIN]
        assert drain.begin("test", lambda d: drain_app(d, app))
        for path in ("/v1/telephony/twilio", "/v1/telephony/telnyx", "/v1/devices/ws"):
            with pytest.raises(aiohttp.WSServerHandshakeError) as err:
                await http.ws_connect(f"{ws_url}{path}")
            assert err.value.status == 503, path
        async with http.post(f"{url}/v1/telephony/twilio/voice", data={"CallSid": "CA2"}) as r:
            assert r.status == 503 and r.headers["Retry-After"]  # Twilio tries the fallback URL
        await asyncio.sleep(0.5)
        assert not provider.ws.closed and call in app[PEERS].values()  # it goes on within drain_timeout_s
        await asyncio.wait_for(drain.done.wait(), 5)
        assert await provider.closed() is not None
        [turn] = await app[STORE].list_session(call.id)
        assert turn.status is TurnStatus.CANCELLED
        assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.WORKER_SHUTDOWN
        events = await app[STORE].read_events(call.id)
        [told] = [e for e in events if e.type == "session.draining"]
        assert told.payload["reason"] == "test" and 0.5 <= told.payload["left_s"] <= 1.0
        assert drain.elapsed_s() >= SHUTDOWN["drain_timeout_s"]
        await provider.aclose()


async def test_the_instance_lists_itself_and_shows_its_drain(server: tuple[web.Application, str]) -> None:
    app, url = server
    good = {"Authorization": "Bearer adm-0123456789"}
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/admin/instances") as r:
            assert r.status == 401  # the admin token is set: loopback alone is not enough
        async with http.get(f"{url}/v1/admin/instances", headers=good) as r:
            [me] = (await r.json())["instances"]
        assert me["state"] == "serving" and me["url"].startswith("http://127.0.0.1:") and me["voice_sessions"] == 0
        app[DRAIN].begin("test", lambda d: drain_app(d, app))
        for _ in range(40):
            async with http.get(f"{url}/v1/admin/instances", headers=good) as r:
                [me] = (await r.json())["instances"]
            if me["state"] == "draining":
                break
            await asyncio.sleep(0.05)
        assert me["state"] == "draining"  # written at once, not at the next heartbeat
        await asyncio.wait_for(app[DRAIN].done.wait(), 5)


@pytest.mark.parametrize("store_kind", ["sqlite", "redis"])
async def test_an_event_stream_gets_stream_end_on_drain_on_either_store(
    store_kind: str, tmp_path: Path, redis_url: str
) -> None:
    """A stream blocked in a store read (Redis: a blocking XREAD) still sees
    the drain within CLOSING_POLL_S, sends what is logged, ``stream.end`` and
    ends cleanly (it once hung until the drain cut it, on Redis)."""
    import json
    import uuid

    store = f"sqlite:///{tmp_path}/t.db" if store_kind == "sqlite" else redis_url
    app = create_app(Settings(
        store=store, redis_prefix=f"dr{uuid.uuid4().hex[:10]}", api_tokens="default:tok-drain-stream-0123",
        llm={"tokens_per_second": 5}, shutdown={"lb_delay_s": 0, "drain_timeout_s": 1, "turn_wait_s": 0.3, "grace_s": 5},
    ))
    runner, url = await start_app(app)
    auth = {"Authorization": "Bearer tok-drain-stream-0123"}
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/turns", json={"text": "tell me a story"}, headers=auth) as r:
                session_id = (await r.json())["session_id"]
            got: list[dict[str, object]] = []

            async def read() -> None:
                async with http.get(f"{url}/v1/sessions/{session_id}/events", headers=auth) as r:
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            got.append(json.loads(line[6:]))

            reader = asyncio.ensure_future(read())
            await asyncio.sleep(0.5)
            app[DRAIN].begin("test", lambda d: drain_app(d, app))
            await asyncio.wait_for(reader, 4)  # ends cleanly (a cut stream raises here)
            await asyncio.wait_for(app[DRAIN].done.wait(), 5)
        assert got[-1]["type"] == "stream.end", got[-3:]
        assert any(m.get("type") == "turn" and m.get("status") == "QUEUED" for m in got)  # released, and told
    finally:
        await runner.cleanup()
