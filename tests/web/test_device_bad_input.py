"""A device socket under bad input, over the real endpoint (issue 14 item 6),
each case a test: binary before hello, a hello without audio_params or with
unsupported ones, an unknown type, malformed JSON, a corrupt Opus packet, a
version 2 header whose size lies (told with an ``alert`` or logged and
dropped: the device goes on and a wake word's text after it is answered);
a frame over 4 KiB (1009), 1,000 messages a second (1008), a socket closed
mid-frame, the same Device-Id connecting twice (the newer wins, 1001): the
socket closed or gone, the turn in flight settled transport_disconnected,
another device unaffected."""

from __future__ import annotations

import asyncio
import json
import struct
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from conftest import plain, requires_espeak, start_app
from device_client import FakeDevice, firmware_hello, headers
from telephony_provider import wait_until

from turn.models import StopReasonKind, Turn, TurnStatus
from web.app import PEERS, STORE, create_app
from web.devices.call import DeviceCall
from web.settings import Settings

pytestmark = requires_espeak
API = {"Authorization": "Bearer secret-a"}


class Env:
    def __init__(self, app: web.Application, url: str, http: aiohttp.ClientSession) -> None:
        self.app, self.url, self.http = app, url, http

    def calls(self) -> list[DeviceCall]:
        return [p for p in self.app[PEERS].values() if isinstance(p, DeviceCall)]

    async def connect(self, *, mac: str = "aa:bb:cc:dd:ee:01", version: int = 1) -> tuple[FakeDevice, DeviceCall]:
        async with self.http.post(self.url + "/v1/devices", headers=API) as r:
            token = (await r.json())["token"]
        before = {c.id for c in self.calls()}
        ws = await self.http.ws_connect(self.url.replace("http", "ws") + "/v1/devices/ws", headers=headers(token, version, mac))
        await wait_until(lambda: any(c.id not in before for c in self.calls()), 5, "connected")
        [call] = [c for c in self.calls() if c.id not in before]
        return FakeDevice(ws, version=version), call


@pytest.fixture
async def env(tmp_path: Path) -> AsyncIterator[Env]:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens="tenant_a:secret-a"))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            yield Env(app, url, http)
    finally:
        await runner.cleanup()


async def turns_of(app: web.Application, session_id: str, n: int, timeout: float = 40) -> list[Turn]:
    async with asyncio.timeout(timeout):
        while True:
            turns = await app[STORE].list_session(session_id)
            if len(turns) >= n and all(t.status.is_terminal for t in turns):
                return turns
            await asyncio.sleep(0.05)


async def still_answers(env: Env, dev: FakeDevice, call: DeviceCall, n: int = 1) -> None:
    """The device still works: a wake word's text becomes a completed turn
    (a short echoed reply: the reply is played at real time)."""
    await dev.listen("detect", text="good morning")
    turns = await turns_of(env.app, call.id, n)
    assert plain(turns[-1].transcript) == "good morning" and turns[-1].status is TurnStatus.COMPLETED


def alerts(dev: FakeDevice) -> list[str]:
    return [str(r.msg["message"]) for r in dev.of("alert") if r.msg]


async def test_binary_before_hello_is_told_and_dropped(env: Env) -> None:
    dev, call = await env.connect()
    dev._tasks.append(asyncio.ensure_future(dev._read()))
    await dev.ws.send_bytes(b"\xf8\xff\xfe")
    await wait_until(lambda: call.errors == ["before_hello"] and bool(dev.of("alert")), 5, "refused and told")
    assert "before hello" in alerts(dev)[0]
    dev._tasks.pop().cancel()
    await dev.start(mic=False)
    await still_answers(env, dev, call)
    await dev.aclose()


@pytest.mark.parametrize("audio_params, code", [
    (None, "no_audio_params"),
    ({"format": "pcm", "sample_rate": 16000, "channels": 1, "frame_duration": 60}, "bad_hello"),
    ({"format": "opus", "sample_rate": 44100, "channels": 1, "frame_duration": 60}, "bad_hello"),
    ({"format": "opus", "sample_rate": 16000, "channels": 2, "frame_duration": 60}, "bad_hello"),
])
async def test_a_hello_we_cannot_serve_is_told_and_closed(env: Env, audio_params: dict[str, object] | None, code: str) -> None:
    other, other_call = await env.connect(mac="aa:bb:cc:dd:ee:99")
    await other.start(mic=False)
    dev, call = await env.connect()
    hello = firmware_hello()
    if audio_params is None:
        del hello["audio_params"]
    else:
        hello["audio_params"] = audio_params
    dev._tasks.append(asyncio.ensure_future(dev._read()))
    await dev.ws.send_str(json.dumps(hello))
    assert await dev.closed() == 1003
    assert call.errors == [code] and alerts(dev) and not dev.of("hello")
    await still_answers(env, other, other_call)  # another device is unaffected
    await other.aclose()
    await dev.aclose()


@pytest.mark.parametrize("send, code, told", [
    ("text:" + json.dumps({"type": "iot", "descriptors": []}), "unknown_type", False),
    ("text:{not json", "bad_message", True),
    ("text:" + json.dumps({"type": "listen", "state": "sing"}), "bad_message", True),
    ("bin:" + "0300", "bad_opus", False),
    ("bin:", "bad_opus", False),
])
async def test_a_bad_message_is_dropped_and_the_device_goes_on(env: Env, send: str, code: str, told: bool) -> None:
    dev, call = await env.connect()
    await dev.start(mic=False)
    kind, _, body = send.partition(":")
    if kind == "text":
        await dev.ws.send_str(body)
    else:
        await dev.ws.send_bytes(bytes.fromhex(body) if body else b"")
    await wait_until(lambda: call.errors == [code], 5, f"{code} logged")
    await asyncio.sleep(0.1)
    assert bool(alerts(dev)) is told and not dev.ws.closed
    await dev.ws.send_str(json.dumps({"type": "mcp", "payload": {"jsonrpc": "2.0", "id": 1, "result": {}}}))  # ignored politely
    await still_answers(env, dev, call)
    assert call.errors == [code]
    await dev.aclose()


async def test_a_v2_header_whose_size_lies_is_dropped(env: Env) -> None:
    dev, call = await env.connect(version=2)
    await dev.start(mic=False)
    good = dev.packet(bytes(1920))
    await dev.ws.send_bytes(good[:12] + struct.pack(">I", len(good) - 16 + 5) + good[16:])  # says 5 more bytes
    await dev.ws.send_bytes(good[:4])  # cut inside the header
    await wait_until(lambda: call.errors == ["bad_frame", "bad_frame"], 5, "both dropped")
    await dev.ws.send_bytes(dev.packet(bytes(1920)))  # a good one after them decodes
    await still_answers(env, dev, call)
    await dev.aclose()


async def test_a_frame_over_4_kib_closes_that_device(env: Env) -> None:
    dev, call = await env.connect()
    await dev.start(mic=False)
    await dev.listen("start", "manual")  # a push-to-talk turn is open: it must settle
    await wait_until(lambda: bool(call.agent and call.agent.ptt_active), 5)
    await dev.ws.send_bytes(bytes(4097))
    assert await dev.closed() == 1009
    [turn] = await turns_of(env.app, call.id, 1)
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED
    await dev.aclose()


async def test_a_flood_closes_that_device_only_and_settles_its_turn(env: Env) -> None:
    other, other_call = await env.connect(mac="aa:bb:cc:dd:ee:99")
    await other.start(mic=False)
    dev, call = await env.connect()
    await dev.start(mic=False)
    await dev.listen("start", "manual")
    await wait_until(lambda: bool(call.agent and call.agent.ptt_active), 5)
    packet = dev.packet(bytes(1920))
    try:
        for _ in range(1000):
            await dev.ws.send_bytes(packet)
    except ConnectionResetError:
        pass
    assert await dev.closed() == 1008 and "flood" in call.errors
    [turn] = await turns_of(env.app, call.id, 1)
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED
    await still_answers(env, other, other_call)
    await other.aclose()
    await dev.aclose()


async def test_a_socket_closed_mid_frame_settles_the_turn(env: Env) -> None:
    dev, call = await env.connect()
    await dev.start(mic=False)
    await dev.listen("start", "manual")
    await wait_until(lambda: bool(call.agent and call.agent.ptt_active), 5)
    # a binary frame header announcing 1000 bytes, then the TCP connection goes
    transport = dev.ws._response.connection.transport  # type: ignore[union-attr]
    assert transport is not None
    transport.write(bytes([0x82, 0xFE, 0x03, 0xE8, 1, 2, 3, 4]) + b"\x00" * 100)
    transport.close()
    [turn] = await turns_of(env.app, call.id, 1)
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED
    await wait_until(lambda: call.closed.is_set(), 5, "freed")
    await dev.aclose()


async def test_the_same_device_id_twice_the_newer_wins(env: Env) -> None:
    old, old_call = await env.connect()
    await old.start(mic=False)
    await old.listen("start", "manual")
    await wait_until(lambda: bool(old_call.agent and old_call.agent.ptt_active), 5)
    new, new_call = await env.connect()  # the same Device-Id
    assert await old.closed() == 1001
    [turn] = await turns_of(env.app, old_call.id, 1)
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED
    await new.start(mic=False)
    await still_answers(env, new, new_call)
    await old.aclose()
    await new.aclose()
