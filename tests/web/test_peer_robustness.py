"""Peer sessions under abuse: hostile data-channel messages, odd offers,
clients that never connect or go quiet, and startup checks."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection, RTCSessionDescription
from conftest import start_app

from clock import SystemClock
from media.outbound import PacedAudioTrack
from media.playout import PlayoutBuffer
from turn.generation import GenerationFence
from turn.models import Turn, TurnStatus
from turn.sqlite_store import SqliteStore
from web.app import PEERS, PROVIDERS, create_app
from web.settings import Settings


class RawClient:
    """A minimal aiortc peer: silent microphone, an events data channel."""

    def __init__(self) -> None:
        self.pc = RTCPeerConnection()
        self.mic = PacedAudioTrack(PlayoutBuffer(), GenerationFence(SystemClock()).passes, SystemClock())
        self.pc.addTrack(self.mic)
        self.channel = self.pc.createDataChannel("events")
        self.events: list[dict[str, Any]] = []
        self.channel.on("message", lambda m: self.events.append(json.loads(m)))
        self.opened = asyncio.Event()
        self.channel.on("open", self.opened.set)

    async def connect(self, url: str) -> str:
        await self.pc.setLocalDescription(await self.pc.createOffer())
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{url}/v1/webrtc/offer", json={"type": "offer", "sdp": self.pc.localDescription.sdp}) as r:
                body = await r.json()
        await self.pc.setRemoteDescription(RTCSessionDescription(sdp=body["sdp"], type="answer"))
        await asyncio.wait_for(self.opened.wait(), 15)
        return body["session_id"]

    async def wait_event(self, pred, timeout: float = 5) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                for e in self.events:
                    if pred(e):
                        return e
                await asyncio.sleep(0.02)

    async def close(self) -> None:
        await self.pc.close()


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    app = create_app(
        Settings(store=f"sqlite:///{tmp_path}/t.db", connect_timeout_s=2, media_timeout_s=1.5, max_pending_per_client=10)
    )
    runner, url = await start_app(app)
    yield app, url
    await runner.cleanup()


@pytest.mark.parametrize(
    "message, code",
    [
        ("[" * 1100, "bad_message"),  # deep nesting: RecursionError in json
        ('{"a":' * 2000, "bad_message"),
        (json.dumps({"type": "z" * 15000}), "unknown_type"),  # echoed name is shortened
        ("x" * 20000, "message_too_large"),
        (b"\x00\x01binary", "bad_message"),
        ("not json", "bad_message"),
        ("[1, 2]", "bad_message"),
        ('{"type": 5}', "bad_message"),
        ('{"type": "ptt.squeeze"}', "unknown_type"),
        # the catalogue (turn/client_messages.py) is the contract: no NaN or
        # infinity (not JSON, RFC 8259), no bool id, no undeclared field
        ('{"type": "ping", "id": NaN}', "bad_message"),
        ('{"type": "ping", "id": 1e999}', "bad_message"),
        ('{"type": "ping", "id": true}', "bad_message"),
        ('{"type": "ping", "id": 1, "extra": [1, 2]}', "bad_message"),
        ('{"type": "ptt.start", "at": 5}', "bad_message"),
    ],
)
async def test_hostile_client_messages_get_errors_and_session_lives(
    server: tuple[web.Application, str], message: str | bytes, code: str
) -> None:
    app, url = server
    client = RawClient()
    try:
        session_id = await client.connect(url)
        client.channel.send(message)
        err = await client.wait_event(lambda e: e.get("type") == "error")
        assert err["code"] == code
        assert len(json.dumps(err)) < 1000
        client.channel.send(json.dumps({"type": "ping", "id": 7}))
        pong = await client.wait_event(lambda e: e.get("type") == "pong")
        assert pong["id"] == 7
        assert session_id in app[PEERS] and client.pc.connectionState == "connected"
    finally:
        await client.close()


async def test_push_to_talk_out_of_order_gets_errors_and_loses_nothing(server: tuple[web.Application, str]) -> None:
    """ptt.end without ptt.start, and ptt.start twice: clear errors; the held
    push-to-talk still ends normally afterwards."""
    app, url = server
    client = RawClient()
    try:
        session_id = await client.connect(url)
        peer = app[PEERS][session_id]
        await client.wait_event(lambda e: e.get("type") == "session.ready")
        client.channel.send(json.dumps({"type": "ptt.end"}))
        err = await client.wait_event(lambda e: e.get("type") == "error")
        assert err["code"] == "ptt_not_active"
        client.channel.send(json.dumps({"type": "ptt.start"}))
        client.channel.send(json.dumps({"type": "ptt.start", "extra": [1, 2, 3]}))  # undeclared field: refused
        err = await client.wait_event(lambda e: e.get("type") == "error" and e.get("code") == "bad_message")
        assert "extra" in err["message"]
        client.channel.send(json.dumps({"type": "ptt.start"}))
        err = await client.wait_event(lambda e: e.get("type") == "error" and e.get("code") == "ptt_already_active")
        assert peer.agent.ptt_active
        client.channel.send(json.dumps({"type": "ptt.end"}))
        await client.wait_event(lambda e: e.get("type") == "vad" and e.get("event") == "end_of_turn")
        assert not peer.agent.ptt_active and client.pc.connectionState == "connected"
    finally:
        await client.close()


async def test_application_only_offer_with_dangling_bundle(server: tuple[web.Application, str]) -> None:
    """An offer whose BUNDLE group names a missing m-line trips aiortc on
    close; the client still gets a 4xx JSON error and nothing is left."""
    app, url = server
    pc = RTCPeerConnection()
    pc.addTransceiver("audio")
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    real = pc.localDescription.sdp
    await pc.close()
    sdp = real[: real.index("m=audio")] + real[real.index("m=application") :]
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            async with http.post(f"{url}/v1/webrtc/offer", json={"type": "offer", "sdp": sdp}) as r:
                assert r.status == 400 and (await r.json())["error"]["code"] in ("no_audio", "invalid_sdp")
    await asyncio.sleep(0.2)
    assert app[PEERS] == {}


async def test_deeply_nested_offer_body(server: tuple[web.Application, str]) -> None:
    _, url = server
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/webrtc/offer", data="[" * 30000 + "]" * 30000) as r:
            assert r.status == 400 and (await r.json())["error"]["code"] == "bad_json"


async def test_offers_that_never_connect_load_no_models(server: tuple[web.Application, str]) -> None:
    app, url = server
    before = len(app[PROVIDERS].stt.pool)
    pcs = []
    async with aiohttp.ClientSession() as http:
        for _ in range(5):
            pc = RTCPeerConnection()
            pc.addTransceiver("audio")
            await pc.setLocalDescription(await pc.createOffer())
            pcs.append(pc)
            async with http.post(f"{url}/v1/webrtc/offer", json={"type": "offer", "sdp": pc.localDescription.sdp}) as r:
                assert r.status == 200
    for pc in pcs:
        await pc.close()
    assert len(app[PROVIDERS].stt.pool) == before
    for _ in range(100):  # connect_timeout_s = 2
        if not app[PEERS]:
            break
        await asyncio.sleep(0.05)
    assert app[PEERS] == {}


async def test_client_that_goes_quiet_is_closed(server: tuple[web.Application, str]) -> None:
    """A client that dies without a goodbye stops sending audio; the server
    frees it after media_timeout_s instead of talking to nobody for 30 s."""
    app, url = server
    client = RawClient()
    try:
        session_id = await client.connect(url)
        await asyncio.sleep(0.5)
        assert session_id in app[PEERS]
        client.mic.stop()  # audio stops; the connection itself stays up
        for _ in range(100):
            if session_id not in app[PEERS]:
                break
            await asyncio.sleep(0.05)
        assert session_id not in app[PEERS]
    finally:
        await client.close()


async def test_startup_stops_turns_a_dead_process_left_open(tmp_path: Path) -> None:
    db = tmp_path / "var" / "t.db"
    store = SqliteStore(db)
    await store.open()
    now = SystemClock().now()
    running = Turn(session_id="s", generation=1, status=TurnStatus.RUNNING, created_at=now, updated_at=now)
    queued = Turn(session_id="s", generation=2, created_at=now, updated_at=now)
    for t in (running, queued):
        await store.create(t)
    await store.close()
    app = create_app(Settings(store=f"sqlite:///{db}"))
    runner, _ = await start_app(app)
    await runner.cleanup()
    store = SqliteStore(db)
    await store.open()
    got = {t.id: t for t in await store.list_session("s")}
    await store.close()
    for t in (running, queued):
        g = got[t.id]
        assert g.status is TurnStatus.CANCELLED
        assert g.stop_reason is not None and g.stop_reason.kind.value == "worker_shutdown"
        assert "recovered at startup" in (g.stop_reason.detail or "")


@pytest.mark.parametrize(
    "settings, match",
    [
        ({"stt": {"provider": "pocketsphinx", "grammar": "/nonexistent/test.gram"}}, "grammar not found"),
        ({"tts": {"executable": "/nonexistent/espeak-ng"}}, "not found"),
    ],
)
async def test_bad_provider_settings_stop_startup(tmp_path: Path, settings: dict, match: str) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", **settings))
    runner = web.AppRunner(app)
    with pytest.raises(RuntimeError, match=match):
        await runner.setup()
    await runner.cleanup()
