"""Capacity and admission (web/capacity.py, web/admission.py): the server
counts as full on its measured send lateness or CPU, refuses new calls in
each transport's own terms while full, says so on /readyz and /metrics, and
takes calls again once the load is gone.

The rule on virtual time with an injected CPU clock; the refusals on a
real server whose pacing monitor is fed the late ticks a loaded loop
would record (the monitor every paced track feeds)."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from types import SimpleNamespace

import aiohttp
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection
from conftest import start_app
from device_client import headers

from clock import VirtualClock
from media.pacing import PacingMonitor
from web.app import create_app
from web.capacity import Capacity, CapacitySettings
from web.settings import Settings
from web.state import CAPACITY, PACING, PEERS

API = {"Authorization": "Bearer secret-a"}


def capacity(clock: VirtualClock, live: list[int], cpu: list[float], **settings: float) -> tuple[Capacity, PacingMonitor]:
    pacing = PacingMonitor(window_s=10)
    return Capacity(CapacitySettings(**settings), pacing, clock, lambda: live[0], lambda: cpu[0]), pacing


def ticks(pacing: PacingMonitor, clock: VirtualClock, n: int, late_s: float) -> None:
    for _ in range(n):
        pacing.observe(late_s, clock.monotonic())


async def test_full_once_the_ticks_run_late_and_not_before_enough_are_seen() -> None:
    clock = VirtualClock()
    live = [3]
    cap, pacing = capacity(clock, live, [0.0], min_ticks=250)
    ticks(pacing, clock, 100, 0.05)
    assert cap.full() is None and cap.load().lateness_p99_ms is None  # 100 ticks: too few to judge
    ticks(pacing, clock, 400, 0.001)
    assert cap.full() == "send_lateness" and cap.load().lateness_p99_ms == 60.0  # 20% of 500 ticks late
    live[0] = 1
    assert cap.full() is None  # one call alone never fills a server
    live[0] = 3
    await clock.advance(11)  # the late ticks leave the window
    ticks(pacing, clock, 495, 0.003)
    ticks(pacing, clock, 5, 0.05)  # 1%: the p99 is still in time
    assert cap.full() is None and cap.load().lateness_p99_ms == 4.0


async def test_full_when_one_more_call_would_pass_the_cpu_budget() -> None:
    """Four calls cost 0.4 of a core over the window: 0.1 each; a budget of
    0.7 holds 7, so the 8th is refused and the 7th is not."""
    clock = VirtualClock()
    live, cpu = [4], [0.0]
    cap, _ = capacity(clock, live, cpu, cpu_budget=0.7)
    for _ in range(11):
        cap.sample()
        await clock.advance(1)
        cpu[0] += 0.4
    load = cap.load()
    assert load.cpu == pytest.approx(0.4) and load.estimate == 7
    live[0] = 6
    assert cap.full() is None
    live[0] = 7
    assert cap.refuse() == "cpu" and cap.refusals == {"send_lateness": 0, "cpu": 1, "starting": 0}
    assert Capacity(CapacitySettings(cpu_budget=0), PacingMonitor(), clock, lambda: 7, lambda: cpu[0]).full() is None


async def test_calls_are_let_in_one_at_a_time_once_half_the_capacity_is_live() -> None:
    """Calls cost 0.1 of a core each: a budget of 0.7 holds 7. From half of
    that live, a call within start_gap_s of the last start is refused
    ("starting"), and let in after the gap; below it a burst is let in."""
    clock = VirtualClock()
    live, cpu = [2], [0.0]
    cap, _ = capacity(clock, live, cpu, cpu_budget=0.7, start_gap_s=2)
    assert cap.full() is None and cap.load().estimate is None
    for _ in range(11):
        cap.sample()
        await clock.advance(1)
        cpu[0] += 0.2
    cap.started()
    assert cap.load().estimate == 7 and cap.full() is None  # 2 of 7: a burst is fine
    live[0] = 4
    assert cap.refuse() == "starting" and cap.refusals["starting"] == 1
    await clock.advance(2.1)
    assert cap.full() is None
    cap.started()
    gapless, _ = capacity(clock, live, cpu, cpu_budget=0.7, start_gap_s=0)
    gapless._samples = cap._samples
    gapless.started()
    assert gapless.full() is None  # 0: no spacing


async def test_no_estimate_until_a_call_has_been_live_a_whole_window() -> None:
    clock = VirtualClock()
    live, cpu = [0], [0.0]
    cap, _ = capacity(clock, live, cpu)
    for i in range(11):
        live[0] = 1 if i >= 5 else 0
        cap.sample()
        await clock.advance(1)
        cpu[0] += 0.3
    assert cap.load().estimate is None and cap.full() is None  # an idle start does not make a call look free


# -- a real server ------------------------------------------------------------


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    settings = Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens="tenant_a:secret-a",
                        capacity=CapacitySettings(window_s=2, min_ticks=100, cpu_budget=0))
    app = create_app(settings)
    runner, url = await start_app(app)
    yield app, url
    await runner.cleanup()


def overload(app: web.Application) -> None:
    """Two calls live (stand-ins: the rule needs two), and what a loop that
    can no longer pace records: 200 ticks 60 ms late."""
    for name in ("live-1", "live-2"):
        app[PEERS][name] = SimpleNamespace(id=name, client="10.0.0.9", tenant="tenant_b", connected=True)  # type: ignore[assignment]
    pacing, clock = app[PACING], app[CAPACITY].clock
    for _ in range(200):
        pacing.observe(0.06, clock.monotonic())


async def offer() -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection()
    pc.addTransceiver("audio")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def test_a_full_server_refuses_every_transport_says_so_and_recovers(
    server: tuple[web.Application, str],
) -> None:
    app, url = server
    ws_url = url.replace("http://", "ws://")
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 200
        async with http.post(f"{url}/v1/devices", headers=API) as r:
            device_token = (await r.json())["token"]
        overload(app)
        async with http.get(f"{url}/readyz") as r:
            body = await r.json()
            assert r.status == 503 and body["status"] == "full" and body["reason"] == "at_capacity"
            assert r.headers["Retry-After"] == "5"
        pc, sdp = await offer()
        try:
            async with http.post(f"{url}/v1/webrtc/offer", json={"type": "offer", "sdp": sdp}, headers=API) as r:
                body = await r.json()
                assert r.status == 503 and body["error"]["code"] == "at_capacity" and r.headers["Retry-After"] == "5"
                assert "sent late" in body["error"]["message"]
        finally:
            await pc.close()
        # a phone stream: accepted, then closed 1013 with the reason the provider logs
        ws = await http.ws_connect(f"{ws_url}/v1/telephony/twilio")
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1013 and msg.extra.startswith("at_capacity: ")
        # a device: an alert its screen shows, then the same close
        ws = await http.ws_connect(f"{ws_url}/v1/devices/ws", headers=headers(device_token))
        msg = await ws.receive(timeout=5)
        alert = json.loads(msg.data)
        assert alert["type"] == "alert" and alert["status"] == "busy" and "capacity" in alert["message"]
        msg = await ws.receive(timeout=5)
        assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1013
        assert set(app[PEERS]) == {"live-1", "live-2"}  # nothing was made for the refused calls
        async with http.get(f"{url}/metrics") as r:
            text = await r.text()
        assert "turnkeeper_full 1.0" in text
        assert 'turnkeeper_capacity_refusals_total{reason="send_lateness"} 3.0' in text
        # the late ticks leave the window: ready, and a call is taken again
        await asyncio.sleep(2.2)
        async with http.get(f"{url}/readyz") as r:
            assert r.status == 200
        async with http.get(f"{url}/metrics") as r:
            assert "turnkeeper_full 0.0" in await r.text()
        app[PEERS].clear()  # the stand-ins go before a real call comes
        pc, sdp = await offer()
        try:
            async with http.post(f"{url}/v1/webrtc/offer", json={"type": "offer", "sdp": sdp}, headers=API) as r:
                assert r.status == 200
        finally:
            await pc.close()


async def test_max_sessions_refuses_a_phone_stream_with_a_close_not_an_http_error(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", max_sessions=1))
    runner, url = await start_app(app)
    try:
        app[PEERS]["held"] = object()  # type: ignore[assignment]  # one session holds the only place
        async with aiohttp.ClientSession() as http:
            ws = await http.ws_connect(url.replace("http://", "ws://") + "/v1/telephony/twilio")
            msg = await ws.receive(timeout=5)
            assert msg.type == aiohttp.WSMsgType.CLOSE and msg.data == 1013
            assert msg.extra.startswith("too_many_sessions: ")
            async with http.get(f"{url}/readyz") as r:
                assert r.status == 503 and (await r.json())["reason"] == "too_many_sessions"
        del app[PEERS]["held"]
    finally:
        await runner.cleanup()
