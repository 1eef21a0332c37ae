"""Rate limits and quotas on sockets (web.limits): a phone stream's and a
device's tenant or address over its messages a second together is closed
1008 (a device told with an ``alert`` first), a tenant over its concurrent
sessions or session starts is refused (a device with 429 before the
upgrade, a phone stream closed 1008 at ``start``, as its tenant is known
only then; the provider's address with 429 at the upgrade); a data channel
over its rate gets one ``error`` ``rate_limited`` and its messages dropped.
Other tenants and addresses go on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import requires_espeak, start_app
from device_client import FakeDevice, headers
from telephony_provider import FakeProvider, wait_until

from clock import VirtualClock
from turn.generation import GenerationFence
from web.app import PEERS, create_app
from web.devices.call import DeviceCall
from web.limits import Limits, LimitSettings
from web.settings import Settings
from web.telephony.call import PhoneCall
from web.telephony.routes import tenant_signer
from web.webrtc_transport import WebRtcTransport

TOKENS = "tenant_a:secret-a,tenant_b:secret-b"

Server = Callable[..., Any]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    """``await server(**limits)`` -> (app, base URL)."""
    held: list[web.AppRunner] = []

    async def make(**limits: Any) -> tuple[web.Application, str]:
        app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens=TOKENS, limits=limits,
                                  session={"dtmf": {"timeout_ms": 60_000}}))
        runner, url = await start_app(app)
        held.append(runner)
        return app, url

    yield make
    for runner in held:
        await runner.cleanup()


def phone_calls(app: web.Application) -> list[PhoneCall]:
    return [p for p in app[PEERS].values() if isinstance(p, PhoneCall)]


async def phone(app: web.Application, http: aiohttp.ClientSession, url: str, tenant: str, n: int,
                *, lines: bool = True) -> tuple[FakeProvider, PhoneCall]:
    """A Twilio stream of ``tenant`` (signed as our webhook would), started."""
    before = {c.id for c in phone_calls(app)}
    call_id = f"CA{n:032d}"
    provider = FakeProvider(await http.ws_connect(url.replace("http", "ws") + "/v1/telephony/twilio"),
                            stream_id=f"MZ{n:032d}", call_id=call_id)
    await wait_until(lambda: any(c.id not in before for c in phone_calls(app)), 5, "upgraded")
    [call] = [c for c in phone_calls(app) if c.id not in before]
    params = (await tenant_signer(app)).parameters(tenant, call_id, time.time())
    await provider.start(params, lines=lines)
    await wait_until(lambda: bool(call.agent or call.close_code), 10, "the call starts or is refused")
    return provider, call


async def test_a_phone_tenant_over_its_sessions_is_closed_at_start(server: Server) -> None:
    app, url = await server(sessions_per_tenant=1)
    async with aiohttp.ClientSession() as http:
        first, first_call = await phone(app, http, url, "acme", 1)
        second, second_call = await phone(app, http, url, "acme", 2)
        assert await second.closed() == 1008 and "rate_limited" in second_call.errors
        assert second_call.agent is None and second_call.tenant is None  # nothing of the session made
        other, other_call = await phone(app, http, url, "globex", 3)  # another tenant
        assert other_call.agent is not None and first_call.agent is not None and first_call.close_code is None
        for p in (first, other):
            await p.aclose()


async def test_a_providers_address_over_its_starts_gets_429_at_the_upgrade(server: Server) -> None:
    app, url = await server(session_starts_per_min_per_client=1)
    async with aiohttp.ClientSession() as http:
        first, _ = await phone(app, http, url, "acme", 1)
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await http.ws_connect(url.replace("http", "ws") + "/v1/telephony/twilio")
        assert err.value.status == 429 and err.value.headers is not None and err.value.headers["Retry-After"] == "60"
        assert len(phone_calls(app)) == 1
        await first.aclose()


async def test_a_phone_tenants_messages_together_over_the_rate_close_the_stream(server: Server) -> None:
    # 100 a second for all of a tenant's streams; each stream may send 500 on its own
    app, url = await server(messages_per_s_per_tenant=100)
    async with aiohttp.ClientSession() as http:
        other, other_call = await phone(app, http, url, "globex", 1)  # its line: 50 a second
        flood, call = await phone(app, http, url, "acme", 2, lines=False)
        media = json.dumps(flood.media_message(bytes(160)))
        try:
            for _ in range(300):
                await flood.ws.send_str(media)
        except ConnectionResetError:
            pass
        assert await flood.closed() == 1008
        assert "rate_limited" in call.errors and "flood" not in call.errors
        await asyncio.sleep(0.5)
        assert other_call.close_code is None and "rate_limited" not in other_call.errors
        await other.aclose()


# -- devices -----------------------------------------------------------------------


class Devices:
    def __init__(self, app: web.Application, url: str, http: aiohttp.ClientSession) -> None:
        self.app, self.url, self.http = app, url, http

    def calls(self) -> list[DeviceCall]:
        return [p for p in self.app[PEERS].values() if isinstance(p, DeviceCall)]

    async def token(self, tenant_secret: str) -> str:
        async with self.http.post(self.url + "/v1/devices", headers={"Authorization": f"Bearer {tenant_secret}"}) as r:
            return str((await r.json())["token"])

    async def connect(self, token: str, mac: str, http: aiohttp.ClientSession | None = None) -> tuple[FakeDevice, DeviceCall]:
        before = {c.id for c in self.calls()}
        ws = await (http or self.http).ws_connect(self.url.replace("http", "ws") + "/v1/devices/ws",
                                                  headers=headers(token, 1, mac))
        await wait_until(lambda: any(c.id not in before for c in self.calls()), 5, "connected")
        [call] = [c for c in self.calls() if c.id not in before]
        return FakeDevice(ws), call


@requires_espeak
async def test_a_device_tenant_over_its_sessions_or_starts_gets_429_before_the_upgrade(server: Server) -> None:
    app, url = await server(sessions_per_tenant=1, session_starts_per_min_per_tenant=3)
    async with aiohttp.ClientSession() as http:
        d = Devices(app, url, http)
        a, b = await d.token("secret-a"), await d.token("secret-b")
        held = [await d.connect(a, "aa:00:00:00:00:01")]  # held: a dropped client socket is closed
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await d.connect(a, "aa:00:00:00:00:02")  # a second board of tenant_a
        assert err.value.status == 429 and err.value.headers is not None and err.value.headers["Retry-After"] == "5"
        held.append(await d.connect(a, "aa:00:00:00:00:01"))  # the same board again replaces its connection
        held.append(await d.connect(b, "bb:00:00:00:00:01"))  # another tenant
        await wait_until(lambda: len(d.calls()) == 2, 5, "the older connection of the board ends")
        # tenant_a has started 2 of its 3 a minute; the third is taken, the fourth refused
        held.append(await d.connect(a, "aa:00:00:00:00:01"))
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await d.connect(a, "aa:00:00:00:00:01")
        assert err.value.status == 429 and err.value.headers is not None
        assert int(err.value.headers["Retry-After"]) in range(1, 21)  # 3 a minute: one every 20 s
        for dev, _ in held:
            await dev.aclose()


@requires_espeak
async def test_an_addresss_devices_together_over_the_rate_are_closed(server: Server) -> None:
    # 40 a second from one address, all its devices together; each may send 200 on its own
    app, url = await server(messages_per_s_per_client=40)
    async with aiohttp.ClientSession() as http, aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0))) as elsewhere:
        d = Devices(app, url, http)
        token = await d.token("secret-a")
        other, other_call = await d.connect(token, "aa:00:00:00:00:02", http=elsewhere)
        await other.start(mic=False)
        dev, call = await d.connect(token, "aa:00:00:00:00:01")
        await dev.start(mic=False)
        packet = dev.packet(bytes(1920))
        try:
            for _ in range(150):
                await dev.ws.send_bytes(packet)
        except ConnectionResetError:
            pass
        assert await dev.closed() == 1008 and "rate_limited" in call.errors
        assert any("too many messages" in str(r.msg["message"]) for r in dev.of("alert") if r.msg)
        assert other_call.close_code is None  # another address (same tenant, under its own rate)
        await other.aclose()


# -- data channels -------------------------------------------------------------------


async def test_a_data_channel_over_the_rate_is_told_once_and_dropped() -> None:
    clock = VirtualClock()
    limits = Limits(LimitSettings(messages_per_s_per_client=3), clock)
    told: list[dict[str, Any]] = []
    t = WebRtcTransport(clock, GenerationFence(clock).passes, name="s1",
                        admit_message=lambda: limits.allows("message", tenant="default", client="a"))
    t.events.send = told.append  # type: ignore[method-assign]
    ping = json.dumps({"type": "ping", "id": 1})
    for _ in range(10):
        t._on_client_message(ping)
    assert [e["type"] for e in told] == ["pong"] * 3 + ["error"]  # one error for the whole run
    assert told[3]["code"] == "rate_limited"
    await clock.advance(1.0)
    t._on_client_message(ping)  # the rate again: answered
    assert told[-1]["type"] == "pong"
    other = WebRtcTransport(clock, GenerationFence(clock).passes, name="s2",
                            admit_message=lambda: limits.allows("message", tenant="default", client="b"))
    other.events.send = told.append  # type: ignore[method-assign]
    other._on_client_message(ping)  # another address: its own bucket
    assert told[-1]["type"] == "pong"
