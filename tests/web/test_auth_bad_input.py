"""Credentials that are malformed at the byte level, and what a backend may
rely on around client tokens (from a newcomer's review): non-UTF-8 and
oversized ``Authorization`` headers answer 4xx without a 500 or a token in
the logs; an offer without credentials is 401 whatever its body; a minted
session can be followed at once; the mint answer shows the limits really
applied; a drain closes sessions that never connected at once."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from conftest import start_app
from test_client_tokens import TOK_A, call, mint, offer

from web.app import PEERS, create_app
from web.settings import Settings

pytestmark = pytest.mark.filterwarnings("ignore::ResourceWarning")


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"tenant_a:{TOK_A}",
                              plans={"tenant_a": {"deadline_s": 60, "budget_cents": 10, "max_steps": 5}},
                              shutdown={"lb_delay_s": 0.1, "drain_timeout_s": 5, "turn_wait_s": 1, "grace_s": 8}))
    runner, url = await start_app(app)
    yield app, url
    await runner.cleanup()


async def raw(url: str, request: bytes) -> tuple[int, bytes]:
    """Send ``request`` as is on a new connection; (status, body)."""
    host, port = url.removeprefix("http://").split(":")
    reader, writer = await asyncio.open_connection(host, int(port))
    try:
        writer.write(request)
        await writer.drain()
        data = await asyncio.wait_for(reader.read(), 10)
    finally:
        writer.close()
    head, _, body = data.partition(b"\r\n\r\n")
    return int(head.split(b" ")[1]), body


@pytest.mark.parametrize(("method", "path"), [
    ("POST", "/v1/sessions"), ("POST", "/v1/turns"), ("GET", "/v1/turns/abc"), ("GET", "/v1/sessions/abc/events"),
    ("POST", "/v1/devices"), ("POST", "/v1/webrtc/offer"), ("GET", "/v1/devices/ws"), ("POST", "/v1/turns/abc/stop"),
])
@pytest.mark.parametrize("token", [b"\xff", b"ck_\xe9\xff", b"tok\xc3"])
async def test_a_token_that_is_not_utf8_is_refused_not_a_500(
    server: tuple[web.Application, str], method: str, path: str, token: bytes
) -> None:
    _, url = server
    status, body = await raw(url, method.encode() + b" " + path.encode() + b" HTTP/1.1\r\nHost: x\r\n"
                             b"Authorization: Bearer " + token + b"\r\nIdempotency-Key: k1\r\n"
                             b"Content-Type: application/json\r\nContent-Length: 2\r\nConnection: close\r\n\r\n{}")
    # the offer reads its body before claiming a token: "{}" is refused first
    assert status == (400 if path == "/v1/webrtc/offer" else 401), body


async def test_an_oversized_authorization_header_puts_no_token_in_the_log(
    server: tuple[web.Application, str], caplog: pytest.LogCaptureFixture
) -> None:
    _, url = server
    caplog.set_level(logging.DEBUG)
    status, _ = await raw(url, b"POST /v1/sessions HTTP/1.1\r\nHost: x\r\nAuthorization: Bearer " + TOK_A.encode()
                          + b"a" * 9000 + b"\r\nContent-Length: 0\r\nConnection: close\r\n\r\n")
    assert 400 <= status < 500
    assert any("unparsable HTTP request" in r.getMessage() for r in caplog.records)
    assert all(TOK_A not in r.getMessage() and TOK_A not in (r.exc_text or "") for r in caplog.records)
    assert (await call("GET", f"{url}/healthz"))[0] == 200  # still serving


async def test_an_offer_without_credentials_is_401_whatever_its_body(server: tuple[web.Application, str]) -> None:
    _, url = server
    for body in (b"{}", b"{not json", b'{"type": "offer", "sdp": "v=0"}'):
        status, answer, _ = await call("POST", f"{url}/v1/webrtc/offer", None, data=body)
        assert (status, answer["error"]["code"]) == (401, "unauthorized")


async def test_the_mint_answer_shows_the_limits_really_applied(server: tuple[web.Application, str]) -> None:
    _, url = server
    minted = await mint(url, plan={"deadline_s": 80000, "budget_cents": 1000, "max_steps": 2, "budget_tokens": 300})
    assert minted["plan"] == {"deadline_s": 60, "budget_cents": 10, "max_steps": 2, "budget_tokens": 300}
    assert minted["options"]["plan"]["deadline_s"] == 80000  # what was asked, beside what is granted
    status, answer, _ = await call("POST", f"{url}/v1/sessions", TOK_A, data=b'{"plan": {"deadline_s": NaN}}')
    assert status == 400


async def test_a_minted_session_can_be_followed_before_the_browser_connects(server: tuple[web.Application, str]) -> None:
    _, url = server
    minted = await mint(url)
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}{minted['events_url']}", headers={"Authorization": f"Bearer {TOK_A}"}) as r:
            assert r.status == 200
            first = await asyncio.wait_for(r.content.readline(), 5)
            assert b"stream.start" in first


async def test_a_drain_closes_sessions_that_never_connected_at_once(server: tuple[web.Application, str]) -> None:
    app, url = server
    for _ in range(2):
        assert (await offer(url, (await mint(url))["client_token"]))[0] == 200
    assert len(app[PEERS]) == 2 and not any(p.connected for p in app[PEERS].values())
    status, _, _ = await call("POST", f"{url}/v1/admin/drain")
    assert status in (200, 202)
    async with asyncio.timeout(3):  # not connect_timeout_s (15 s)
        while app[PEERS]:
            await asyncio.sleep(0.05)


async def test_development_mode_says_why_nothing_is_minted(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db"))
    runner, url = await start_app(app)
    try:
        status, body, _ = await call("POST", f"{url}/v1/sessions", None, json={})
        assert status == 401 and "development mode" in body["error"]["message"]
    finally:
        await runner.cleanup()
