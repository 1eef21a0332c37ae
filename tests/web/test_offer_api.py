"""Signaling: malformed offers get a 4xx JSON error and the server keeps serving."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection
from conftest import start_app

from web.app import PEERS, create_app
from web.settings import Settings
from web.state import PACING


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", max_offer_bytes=16 * 1024, max_sessions=2))
    runner, url = await start_app(app)
    yield app, url
    await runner.cleanup()


async def make_offer(kind: str = "audio") -> tuple[RTCPeerConnection, str]:
    pc = RTCPeerConnection()
    if kind == "audio":
        pc.addTransceiver("audio")
    else:
        pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    return pc, pc.localDescription.sdp


async def post(url: str, **kw) -> tuple[int, dict]:
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/webrtc/offer", **kw) as resp:
            assert resp.content_type == "application/json"
            return resp.status, await resp.json()


async def assert_still_serving(app: web.Application, url: str) -> None:
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/healthz") as resp:
            assert resp.status == 200 and (await resp.json())["status"] == "ok"
    for _ in range(50):
        if not app[PEERS]:
            break
        await asyncio.sleep(0.05)
    assert app[PEERS] == {}  # a rejected offer leaves nothing behind


@pytest.mark.parametrize(
    "kw, status, code",
    [
        ({"data": b"{not json"}, 400, "bad_json"),
        ({"data": b"\xff\xfe\x00"}, 400, "bad_json"),
        ({"json": ["offer"]}, 400, "invalid_offer"),
        ({"json": {"type": "offer"}}, 400, "invalid_offer"),
        ({"json": {"type": "offer", "sdp": ""}}, 400, "invalid_offer"),
        ({"json": {"type": "offer", "sdp": 42}}, 400, "invalid_offer"),
        ({"json": {"type": "answer", "sdp": "v=0\r\n"}}, 400, "invalid_offer"),
        ({"json": {"type": "offer", "sdp": "v=0\r\n", "echo_cancellation": "yes"}}, 400, "invalid_offer"),
        ({"json": {"type": "offer", "sdp": "v=0\r\n", "echo_cancellation": 1}}, 400, "invalid_offer"),
        ({"json": {"type": "offer", "sdp": "garbage"}}, 400, "invalid_sdp"),
        ({"json": {"type": "offer", "sdp": "v=0\r\nm=audio 9 UDP/TLS/RTP/SAVPF 111\r\nc=IN IP4 0.0.0.0\r\n"}}, 400, "invalid_sdp"),
        ({"json": {"type": "offer", "sdp": "v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n"}}, 400, "no_audio"),
        ({"json": {"type": "offer", "sdp": "v=0\r\n" + "a=x\r\n" * 10000}}, 413, "body_too_large"),
    ],
)
async def test_bad_offers(server: tuple[web.Application, str], kw: dict, status: int, code: str) -> None:
    app, url = server
    got_status, body = await post(url, **kw)
    assert (got_status, body["error"]["code"]) == (status, code), body
    assert body["error"]["message"]
    await assert_still_serving(app, url)


async def test_oversized_body_without_length(server: tuple[web.Application, str]) -> None:
    app, url = server

    async def chunks():
        for _ in range(40):
            yield b"x" * 1024

    got_status, body = await post(url, data=chunks())
    assert got_status == 413 and body["error"]["code"] == "body_too_large"
    await assert_still_serving(app, url)


async def test_offer_without_audio_is_rejected(server: tuple[web.Application, str]) -> None:
    app, url = server
    pc, sdp = await make_offer(kind="data")
    try:
        got_status, body = await post(url, json={"type": "offer", "sdp": sdp})
        assert (got_status, body["error"]["code"]) == (400, "no_audio")
    finally:
        await pc.close()
    await assert_still_serving(app, url)


async def test_good_offer_answers_then_limits(server: tuple[web.Application, str]) -> None:
    app, url = server
    pcs = []
    try:
        for _ in range(2):
            pc, sdp = await make_offer()
            pcs.append(pc)
            got_status, body = await post(url, json={"type": "offer", "sdp": sdp})
            assert got_status == 200 and body["type"] == "answer" and body["sdp"].startswith("v=0")
            assert body["session_id"] in app[PEERS]
        pc, sdp = await make_offer()
        pcs.append(pc)
        got_status, body = await post(url, json={"type": "offer", "sdp": sdp})
        assert (got_status, body["error"]["code"]) == (503, "too_many_sessions")
    finally:
        for pc in pcs:
            await pc.close()


async def test_unknown_api_path_and_method_are_json(server: tuple[web.Application, str]) -> None:
    _, url = server
    async with aiohttp.ClientSession() as http:
        async with http.get(f"{url}/v1/nope") as resp:
            assert resp.status == 404 and (await resp.json())["error"]["code"] == "not_found"
        async with http.get(f"{url}/v1/webrtc/offer") as resp:
            assert resp.status == 405 and (await resp.json())["error"]["code"] == "method_not_allowed"


async def test_unconnected_peer_is_closed_by_watchdog(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", connect_timeout_s=0.5))
    runner, url = await start_app(app)
    try:
        pc, sdp = await make_offer()
        await pc.close()  # the client goes away without ever connecting
        got_status, body = await post(url, json={"type": "offer", "sdp": sdp})
        assert got_status == 200 and body["session_id"] in app[PEERS]
        for _ in range(100):
            if not app[PEERS]:
                break
            await asyncio.sleep(0.05)
        assert app[PEERS] == {}
    finally:
        await runner.cleanup()


async def test_offers_that_never_connect_cannot_fill_the_server(tmp_path: Path) -> None:
    """A flood of offers that never connect is refused early (per client, then
    in all), so it cannot take every session slot."""
    app = create_app(
        Settings(store=f"sqlite:///{tmp_path}/t.db", max_sessions=20, max_pending_sessions=3, max_pending_per_client=2)
    )
    runner, url = await start_app(app)
    pcs = []
    try:
        codes = []
        for _ in range(4):
            pc, sdp = await make_offer()
            pcs.append(pc)
            status, body = await post(url, json={"type": "offer", "sdp": sdp})
            codes.append(status if status == 200 else (status, body["error"]["code"]))
        assert codes == [200, 200, (429, "too_many_pending"), (429, "too_many_pending")]
        assert len(app[PEERS]) == 2  # the refused ones left nothing behind
    finally:
        for pc in pcs:
            await pc.close()
        await runner.cleanup()


@pytest.mark.parametrize("declared, assumed_db", [(None, 6.0), (False, 6.0), (True, 20.0)])
async def test_the_offer_s_echo_canceller_sets_what_the_echo_guard_assumes(
    server: tuple[web.Application, str], declared: bool | None, assumed_db: float
) -> None:
    """``echo_cancellation`` (the microphone's ``MediaTrackSettings``, as
    the browser page sends it) sets the echo loss the session's barge-in
    detector assumes before playout shows it; absent or false, the default."""
    app, url = server
    pc, sdp = await make_offer()
    try:
        offer = {"type": "offer", "sdp": sdp} | ({} if declared is None else {"echo_cancellation": declared})
        got_status, body = await post(url, json=offer)
        assert got_status == 200, body
        peer = app[PEERS][body["session_id"]]
        assert peer.bargein.echo_assumed_loss_db == assumed_db
        assert peer.transport.outbound.monitor is app[PACING]  # its send lateness is exported
    finally:
        await pc.close()
