"""Client tokens (``POST /v1/sessions``) and who may start a voice session:
minted only with a tenant's API token, presented with the offer, single
use (also under concurrent offers), put back when the start is refused
before its session exists, expiring, bound to tenant, session id, plan and
options; development mode without tokens on loopback only."""

from __future__ import annotations

import asyncio
import subprocess
import sys
from collections.abc import AsyncIterator
from datetime import timedelta
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import requires_espeak, start_app
from test_offer_api import make_offer

from clock import VirtualClock
from turn.models import Plan, StopReasonKind
from turn.sqlite_store import SqliteStore
from web.app import PEERS, create_app
from web.auth import check_exposure, is_loopback
from web.client_tokens import ClientGrant, ClientTokens, PlanLimits, SessionOptions
from web.errors import ApiError
from web.settings import Settings
from web.state import AUTH

TOK_A, TOK_B = "tok-a-0123456789", "tok-b-0123456789"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"tenant_a:{TOK_A},tenant_b:{TOK_B}",
                              max_pending_per_client=2))
    runner, url = await start_app(app)
    yield app, url
    for peer in list(app[PEERS].values()):
        await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
    await runner.cleanup()


async def call(method: str, url: str, token: str | None = None, **kw: Any) -> tuple[int, dict[str, Any], Any]:
    headers = {**kw.pop("headers", {}), **({"Authorization": f"Bearer {token}"} if token else {})}
    async with aiohttp.ClientSession() as http:
        async with http.request(method, url, headers=headers, **kw) as resp:
            return resp.status, await resp.json(content_type=None), resp.headers


async def mint(url: str, token: str = TOK_A, **options: Any) -> dict[str, Any]:
    status, body, _ = await call("POST", f"{url}/v1/sessions", token, json=options)
    assert status == 201, body
    return body


async def offer(url: str, token: str | None) -> tuple[int, dict[str, Any]]:
    pc, sdp = await make_offer()
    try:
        status, body, _ = await call("POST", f"{url}/v1/webrtc/offer", token, json={"type": "offer", "sdp": sdp})
        return status, body
    finally:
        await pc.close()


async def test_only_a_tenant_api_token_mints(server: tuple[web.Application, str]) -> None:
    _, url = server
    status, body, headers = await call("POST", f"{url}/v1/sessions", None, json={})
    assert status == 401 and "Bearer" in headers["WWW-Authenticate"]
    minted = await mint(url, user_id="u-42")
    assert minted["client_token"].startswith("ck_") and minted["tenant_id"] == "tenant_a"
    assert minted["user_id"] == "u-42" and minted["expires_in_s"] == 60
    assert minted["events_url"] == f"/v1/sessions/{minted['session_id']}/events"
    # a client token cannot mint another (nor reach the REST API)
    status, body, _ = await call("POST", f"{url}/v1/sessions", minted["client_token"], json={})
    assert status == 401 and body["error"]["code"] == "unauthorized"
    status, body, _ = await call("POST", f"{url}/v1/turns", minted["client_token"], json={"text": "hi"})
    assert status == 401


@pytest.mark.parametrize(
    ("body", "code"),
    [
        (b"{not json", "bad_json"),
        (b'{"nope": 1}', "invalid_request"),
        (b'{"user_id": "has space"}', "invalid_request"),
        (b'{"user_id": 42}', "invalid_request"),
        (b'{"voice": "../../etc/passwd"}', "invalid_request"),
        (b'{"transports": []}', "invalid_request"),
        (b'{"transports": ["webrtc", "webrtc"]}', "invalid_request"),
        (b'{"transports": ["carrier-pigeon"]}', "invalid_request"),
        (b'{"plan": {"budget_cents": -1}}', "invalid_request"),
        (b'{"plan": {"max_steps": "3"}}', "invalid_request"),
        (b'{"instructions": ""}', "invalid_request"),
        (b'{"instructions": "' + b"x" * 9000 + b'"}', "invalid_request"),
    ],
)
async def test_bad_options_are_refused_and_mint_nothing(server: tuple[web.Application, str], body: bytes, code: str) -> None:
    _, url = server
    status, answer, _ = await call("POST", f"{url}/v1/sessions", TOK_A, data=body,
                                   headers={"Content-Type": "application/json"})
    assert (status, answer["error"]["code"]) == (400, code), answer


@requires_espeak
async def test_a_voice_the_tts_lacks_is_refused(server: tuple[web.Application, str]) -> None:
    _, url = server
    status, answer, _ = await call("POST", f"{url}/v1/sessions", TOK_A, json={"voice": "qqq"})
    assert (status, answer["error"]["code"]) == (400, "unknown_voice")
    assert (await mint(url, voice="en-gb"))["options"]["voice"] == "en-gb"


async def test_an_offer_needs_credentials_once_tokens_are_configured(server: tuple[web.Application, str]) -> None:
    app, url = server
    for token, code in [(None, "unauthorized"), ("ck_forged", "invalid_client_token"), ("ck_" + "A" * 43, "invalid_client_token"),
                        ("not-a-tenant-token", "unauthorized")]:
        status, body = await offer(url, token)
        assert (status, body["error"]["code"]) == (401, code), (token, body)
    assert app[PEERS] == {}


async def test_a_client_token_starts_one_session_bound_to_its_grant(server: tuple[web.Application, str]) -> None:
    app, url = server
    minted = await mint(url, user_id="u-7", instructions="Answer in one sentence.",
                        plan={"deadline_s": 30, "budget_cents": 2.5, "max_steps": 3})
    status, body = await offer(url, minted["client_token"])
    assert status == 200, body
    assert body["session_id"] == minted["session_id"]
    peer = app[PEERS][body["session_id"]]
    assert (peer.tenant, peer.user_id) == ("tenant_a", "u-7")
    assert peer.agent.instructions == "Answer in one sentence."
    base = Settings().plan_for("tenant_a")
    assert peer.agent.plan.deadline_s == 30 and peer.agent.plan.budget_cents == 2.5 and peer.agent.plan.max_steps == 3
    assert peer.agent.plan.budget_tokens == base.budget_tokens  # not narrowed: the tenant's
    # used: a second offer with it is refused, and starts nothing
    status, again = await offer(url, minted["client_token"])
    assert (status, again["error"]["code"]) == (401, "invalid_client_token")
    assert list(app[PEERS]) == [minted["session_id"]]


async def test_concurrent_offers_with_one_token_start_one_session(server: tuple[web.Application, str]) -> None:
    app, url = server
    minted = await mint(url)
    results = await asyncio.gather(*(offer(url, minted["client_token"]) for _ in range(2)))
    assert sorted(status for status, _ in results) == [200, 401]
    assert list(app[PEERS]) == [minted["session_id"]]


async def test_an_offer_that_cannot_connect_uses_no_token(server: tuple[web.Application, str]) -> None:
    _, url = server
    minted = await mint(url)
    status, body, _ = await call("POST", f"{url}/v1/webrtc/offer", minted["client_token"],
                                 json={"type": "offer", "sdp": "v=0\r\nm=audio 0 RTP/AVP 0\r\n"})
    assert status == 400
    status, body = await offer(url, minted["client_token"])
    assert status == 200, body


async def test_a_start_refused_for_a_limit_gives_the_token_back(server: tuple[web.Application, str]) -> None:
    app, url = server
    for _ in range(2):  # max_pending_per_client: both slots taken (never connected)
        status, _body = await offer(url, TOK_A)
        assert status == 200
    minted = await mint(url)
    status, body = await offer(url, minted["client_token"])
    assert (status, body["error"]["code"]) == (429, "too_many_pending")
    for peer in list(app[PEERS].values()):
        await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
    status, body = await offer(url, minted["client_token"])
    assert status == 200 and body["session_id"] == minted["session_id"]


async def test_a_token_for_devices_only_does_not_start_a_browser_session(server: tuple[web.Application, str]) -> None:
    app, url = server
    minted = await mint(url, transports=["device"])
    status, body = await offer(url, minted["client_token"])
    assert (status, body["error"]["code"]) == (403, "transport_not_allowed")
    assert app[PEERS] == {}
    grant = await app[AUTH].client_tokens.claim(minted["client_token"])  # still usable where it is meant for
    assert grant.session_id == minted["session_id"]


async def test_a_tenant_api_token_starts_a_session_of_its_tenant(server: tuple[web.Application, str]) -> None:
    app, url = server
    status, body = await offer(url, TOK_B)
    assert status == 200
    assert app[PEERS][body["session_id"]].tenant == "tenant_b"


async def test_development_mode_needs_no_token(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db"))
    runner, url = await start_app(app)
    try:
        status, body = await offer(url, None)
        assert status == 200
        assert app[PEERS][body["session_id"]].tenant == "default"
        status, body, _ = await call("POST", f"{url}/v1/sessions", None, json={})
        assert status == 401  # nothing to mint with: the REST API is off
    finally:
        for peer in list(app[PEERS].values()):
            await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
        await runner.cleanup()


async def test_tokens_expire_and_are_kept_only_as_hashes(tmp_path: Path) -> None:
    store = SqliteStore(tmp_path / "t.db")
    await store.open()
    try:
        clock = VirtualClock()
        tokens = ClientTokens(store, clock, ttl_s=60)
        token, grant = await tokens.mint("tenant_a", SessionOptions())
        late, _ = await tokens.mint("tenant_a", SessionOptions())
        raw = (tmp_path / "t.db").read_bytes() + b"".join(p.read_bytes() for p in tmp_path.glob("t.db-*"))
        assert token.encode() not in raw and late.encode() not in raw
        await clock.advance(59)
        assert (await tokens.claim(token)).session_id == grant.session_id
        await clock.advance(1)
        with pytest.raises(ApiError) as refused:
            await tokens.claim(late)
        assert (refused.value.status, refused.value.code) == (401, "invalid_client_token")
    finally:
        await store.close()


def test_a_grant_only_narrows_the_tenant_plan() -> None:
    base = Plan(deadline_s=60, budget_cents=10, budget_tokens=None, max_steps=8, shutdown_reserve_ms=250)
    now = VirtualClock().now()

    def narrowed(**limits: Any) -> Plan:
        grant = ClientGrant(tenant_id="t", session_id="s", expires_at=now + timedelta(seconds=60),
                            options=SessionOptions(plan=PlanLimits(**limits)))
        return grant.plan(base)

    assert narrowed() == base
    wider = narrowed(deadline_s=600, budget_cents=1000, max_steps=100)
    assert (wider.deadline_s, wider.budget_cents, wider.max_steps) == (60, 10, 8)
    tighter = narrowed(deadline_s=0.2, budget_cents=1, budget_tokens=500, max_steps=2)
    assert (tighter.deadline_s, tighter.budget_cents, tighter.budget_tokens, tighter.max_steps) == (0.2, 1, 500, 2)
    assert tighter.shutdown_reserve_ms == 100  # kept shorter than the deadline


def test_loopback_only_without_tokens() -> None:
    for host in ("127.0.0.1", "127.0.0.2", "::1", "[::1]", "localhost"):
        assert is_loopback(host)
        check_exposure(host, has_api_tokens=False, insecure=False)
    for host in ("0.0.0.0", "::", "10.0.0.5", "example.com"):
        assert not is_loopback(host)
        with pytest.raises(ValueError, match="TURNKEEPER_API_TOKENS"):
            check_exposure(host, has_api_tokens=False, insecure=False)
        check_exposure(host, has_api_tokens=True, insecure=False)
        check_exposure(host, has_api_tokens=False, insecure=True)


def test_serve_refuses_an_open_address_without_tokens_in_one_line(tmp_path: Path) -> None:
    env = {"PATH": "/usr/bin:/bin", "HOME": str(tmp_path)}
    proc = subprocess.run([sys.executable, "-m", "web.cli", "serve", "--host", "0.0.0.0", "--port", "0"],
                          cwd=tmp_path, env={**env, "PYTHONPATH": str(Path(__file__).parents[2])},
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2
    [line] = proc.stderr.strip().splitlines()
    assert "TURNKEEPER_API_TOKENS" in line and "--insecure" in line
    assert not (tmp_path / "var").exists()  # refused before opening anything


async def test_a_device_token_of_the_device_transport_opens_one_device_socket(server: tuple[web.Application, str]) -> None:
    """A client token minted for ``device`` opens a device socket as its
    tenant and session (instead of a device token), once; a WebRTC-only
    one is refused there and stays usable."""
    app, url = server
    ws_url = url.replace("http://", "ws://") + "/v1/devices/ws"
    browser_only = await mint(url)
    minted = await mint(url, transports=["device"], plan={"max_steps": 2})
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(ws_url, headers={"Authorization": f"Bearer {browser_only['client_token']}"})
        assert refused.value.status == 403
        ws = await http.ws_connect(ws_url, headers={"Authorization": f"Bearer {minted['client_token']}",
                                                    "Protocol-Version": "1"})
        try:
            peer = app[PEERS][minted["session_id"]]
            assert (peer.tenant, peer.device_id, peer.grant.plan(Settings().plan_for("tenant_a")).max_steps) == (
                "tenant_a", f"client-{minted['session_id']}", 2)
            with pytest.raises(aiohttp.WSServerHandshakeError) as again:
                await http.ws_connect(ws_url, headers={"Authorization": f"Bearer {minted['client_token']}"})
            assert again.value.status == 401
        finally:
            await ws.close()
    assert (await offer(url, browser_only["client_token"]))[0] == 200  # the refusal left it usable
