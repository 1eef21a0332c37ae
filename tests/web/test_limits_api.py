"""Rate limits and quotas over HTTP (web.limits), on the real endpoints:
text turns a minute, stop requests a second (a flood never blocks the
first stop of the tenant's own running turn), WebRTC session starts a
minute and concurrent sessions, each per tenant and per client address:
429 ``rate_limited`` with an accurate Retry-After, nothing made, other
tenants and other addresses unaffected. Other addresses are other loopback
addresses (127.0.0.2 reaches 127.0.0.1 on Linux)."""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection
from conftest import start_app

from turn.models import StopReasonKind
from web.app import PEERS, create_app
from web.settings import Settings

TOKENS = "acme:tok-acme-0123456789,globex:tok-globex-0123456789"
ACME = {"Authorization": "Bearer tok-acme-0123456789"}
GLOBEX = {"Authorization": "Bearer tok-globex-0123456789"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "RECONCILE_REQUIRED"}


class Client:
    """HTTP from one loopback address."""

    def __init__(self, url: str, http: aiohttp.ClientSession) -> None:
        self.url, self.http = url, http

    async def call(self, method: str, path: str, *, headers: dict[str, str] | None = None,
                   **kw: Any) -> tuple[int, Any, Any]:
        async with self.http.request(method, self.url + path, headers=headers, **kw) as r:
            return r.status, await r.json(content_type=None), r.headers

    async def start(self, text: str, headers: dict[str, str] = ACME) -> tuple[int, Any, Any]:
        return await self.call("POST", "/v1/turns", headers=headers, json={"text": text})

    async def stop(self, turn_id: str, key: str, headers: dict[str, str] = ACME) -> tuple[int, Any, Any]:
        return await self.call("POST", f"/v1/turns/{turn_id}/stop", headers={**headers, "Idempotency-Key": key})

    async def offer(self, headers: dict[str, str] = ACME) -> tuple[int, Any, Any]:
        """A WebRTC offer with a tenant's API token (a backend connecting
        itself; the tenant is the token's, as with a client token)."""
        pc = RTCPeerConnection()
        pc.addTransceiver("audio")
        await pc.setLocalDescription(await pc.createOffer())
        try:
            return await self.call("POST", "/v1/webrtc/offer", headers=headers,
                                   json={"type": "offer", "sdp": pc.localDescription.sdp})
        finally:
            await pc.close()


Server = Callable[..., Any]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    """``await server(**limits)`` -> (app, client from 127.0.0.1, client from 127.0.0.2)."""
    held: list[Any] = []

    async def make(**limits: Any) -> tuple[web.Application, Client, Client]:
        settings = Settings(
            store=f"sqlite:///{tmp_path}/t.db", api_tokens=TOKENS, llm={"tokens_per_second": 20},
            stt={"max_decoders": 1}, limits=limits, max_pending_per_client=10,
        )
        app = create_app(settings)
        runner, url = await start_app(app)
        one = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.1", 0)))
        two = aiohttp.ClientSession(connector=aiohttp.TCPConnector(local_addr=("127.0.0.2", 0)))
        held.extend([one, two, runner])
        return app, Client(url, one), Client(url, two)

    yield make
    for item in held:
        await (item.close() if isinstance(item, aiohttp.ClientSession) else item.cleanup())


def assert_limited(status: int, body: Any, headers: Any, retry_after: str | range) -> None:
    """429 ``rate_limited`` with ``Retry-After`` as given (a range: whole
    seconds in it, where the test's own time has run down the wait)."""
    assert status == 429, body
    assert body["error"]["code"] == "rate_limited" and body["error"]["message"]
    if isinstance(retry_after, range):
        assert int(headers["Retry-After"]) in retry_after, headers["Retry-After"]
    else:
        assert headers["Retry-After"] == retry_after


async def wait_terminal(c: Client, turn_id: str, headers: dict[str, str] = ACME) -> dict[str, Any]:
    async with asyncio.timeout(20):
        while True:
            status, body, _ = await c.call("GET", f"/v1/turns/{turn_id}", headers=headers)
            assert status == 200, body
            if body["status"] in TERMINAL:
                return body
            await asyncio.sleep(0.05)


# -- text turns ------------------------------------------------------------------


async def test_turns_a_minute_per_tenant(server: Server) -> None:
    _, one, two = await server(turns_per_min_per_tenant=2)
    for _ in range(2):
        assert (await one.start("hi"))[0] == 202
    assert_limited(*await two.start("hi"), retry_after="30")  # 2 a minute: the next in 30 s, from any address
    assert_limited(*await one.start("hi"), retry_after="30")
    assert (await one.start("hi", headers=GLOBEX))[0] == 202  # another tenant, same address


async def test_turns_a_minute_per_address(server: Server) -> None:
    _, one, two = await server(turns_per_min_per_client=1, turns_per_min_per_tenant=0)
    assert (await one.start("hi"))[0] == 202
    assert_limited(*await one.start("hi", headers=GLOBEX), retry_after="60")  # the address, whatever the tenant
    assert (await two.start("hi", headers=GLOBEX))[0] == 202  # another address


# -- stops -----------------------------------------------------------------------


async def test_a_stop_flood_is_refused_but_never_the_first_stop_of_an_own_running_turn(server: Server) -> None:
    # one stop every 20 s per tenant: the flood below empties it at once
    _, one, two = await server(stops_per_s_per_tenant=0.05, stops_per_s_per_client=0)
    a = (await one.start("tell me a story"))[1]["turn"]["id"]
    b = (await one.start("tell me a story"))[1]["turn"]["id"]
    assert (await one.stop("turn_nope", "k0"))[0] == 404  # spends the tenant's token
    assert_limited(*await one.stop("turn_nope", "k1"), retry_after="20")
    # mid-flood (other ids, from both addresses), the first stop of a running turn gets through
    flood = [one.stop(f"turn_{uuid.uuid4().hex}", f"f{i}") for i in range(20)]
    flood += [two.stop(b, f"f{i}") for i in range(20, 25)]  # b's own id is not refused... once
    results = await asyncio.gather(one.stop(a, "stop-a"), *flood)
    status, body, _ = results[0]
    assert status == 202 and body["answer"] == "accepted", body
    assert all(r[0] == 429 for r in results[1:21])  # other ids beyond the rate
    b_answers = [r[0] for r in results[21:]]
    assert b_answers.count(202) >= 1 and set(b_answers) <= {202, 429}  # b's first stop passed, repeats may not
    # a repeat of a's stop (it is stopping or stopped now), and a stop of an ended turn, are refused
    assert_limited(*await one.stop(a, "stop-a"), retry_after=range(1, 21))
    assert (await wait_terminal(one, a))["stop_reason"]["kind"] == StopReasonKind.USER_CANCEL.value
    assert_limited(*await one.stop(a, "stop-a-again"), retry_after=range(1, 21))
    # another tenant's stops are its own
    assert (await one.stop("turn_nope", "g0", headers=GLOBEX))[0] == 404
    c = (await one.start("tell me a story", headers=GLOBEX))[1]["turn"]["id"]
    assert (await one.stop(c, "g1", headers=GLOBEX))[0] == 202


async def test_stops_a_second_per_address(server: Server) -> None:
    _, one, two = await server(stops_per_s_per_client=0.1, stops_per_s_per_tenant=0)
    assert (await one.stop("turn_nope", "k0"))[0] == 404
    assert_limited(*await one.stop("turn_nope", "k1", headers=GLOBEX), retry_after="10")
    assert (await two.stop("turn_nope", "k2", headers=GLOBEX))[0] == 404  # another address
    t = (await one.start("tell me a story"))[1]["turn"]["id"]
    assert (await one.stop(t, "mine"))[0] == 202  # the address is out, but it is the tenant's running turn


# -- WebRTC offers ---------------------------------------------------------------


async def peers_gone(app: web.Application) -> None:
    for peer in list(app[PEERS].values()):
        await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)


async def test_offers_a_minute_per_address(server: Server) -> None:
    app, one, two = await server(session_starts_per_min_per_client=1)
    status, body, _ = await one.offer()
    assert status == 200 and body["type"] == "answer", body
    assert_limited(*await one.offer(), retry_after="60")
    assert len(app[PEERS]) == 1  # nothing made by the refusal
    assert (await two.offer())[0] == 200  # another address
    await peers_gone(app)


async def test_offers_a_minute_per_tenant(server: Server) -> None:
    app, one, two = await server(session_starts_per_min_per_tenant=2)
    assert (await one.offer())[0] == 200 and (await two.offer())[0] == 200
    assert_limited(*await two.offer(), retry_after="30")  # acme's third, from either address
    assert len(app[PEERS]) == 2
    assert (await two.offer(GLOBEX))[0] == 200  # another tenant
    await peers_gone(app)


async def test_concurrent_sessions_per_tenant(server: Server) -> None:
    app, one, two = await server(sessions_per_tenant=2)
    assert (await one.offer())[0] == 200 and (await two.offer())[0] == 200
    assert_limited(*await one.offer(), retry_after="5")  # acme has two running (connecting counts)
    assert len(app[PEERS]) == 2
    assert (await one.offer(GLOBEX))[0] == 200  # another tenant
    await app[PEERS].popitem()[1].close(StopReasonKind.TRANSPORT_DISCONNECTED)
    await next(iter(app[PEERS].values())).close(StopReasonKind.TRANSPORT_DISCONNECTED)
    assert (await two.offer())[0] == 200  # one ended: room again
    await peers_gone(app)


async def test_concurrent_sessions_per_address(server: Server) -> None:
    app, one, two = await server(sessions_per_client=1)
    assert (await one.offer())[0] == 200
    assert_limited(*await one.offer(), retry_after="5")
    assert (await two.offer())[0] == 200  # another address
    assert len(app[PEERS]) == 2
    await peers_gone(app)
