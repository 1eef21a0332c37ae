"""Push-to-talk devices end to end over /v1/devices/ws: the real application
on loopback, a raw WebSocket client in a xiaozhi-esp32 board's role
(tests/device_client.py) sending espeak-ng speech as 60 ms Opus at 16 kHz.
Tokens issued and revoked through the API; a push-to-talk turn answered
(stt, tts start / sentence_start / stop around the reply's Opus at the
announced 24 kHz, paced at real time); push-to-talk while the agent
speaks is a committed barge-in (initiator ptt); abort stops the sending at
once with tts stop, and the turn's record says CANCEL_REQUESTED then
CANCELLED user_cancel by device; a wake word's text is a turn; auto mode
endpoints; protocol versions 2 and 3."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import plain, requires_espeak, start_app
from device_client import FakeDevice, headers
from telephony_provider import wait_until

from media.opus import OpusDecoder
from turn.events import EventFollower, event_json
from turn.models import Session, StopReasonKind, Turn, TurnStatus
from turn.store import UnknownSession
from web.app import PEERS, STORE, create_app
from web.devices.call import DeviceCall
from web.settings import Settings

pytestmark = requires_espeak
API = {"Authorization": "Bearer secret-a"}


@dataclass
class Server:
    app: web.Application
    url: str
    http: aiohttp.ClientSession

    @property
    def ws_url(self) -> str:
        return self.url.replace("http://", "ws://") + "/v1/devices/ws"

    def calls(self) -> list[DeviceCall]:
        return [p for p in self.app[PEERS].values() if isinstance(p, DeviceCall)]

    async def token(self) -> tuple[str, str]:
        async with self.http.post(self.url + "/v1/devices", headers=API) as r:
            assert r.status == 201
            body = await r.json()
        return body["device_id"], body["token"]

    async def device(self, token: str, *, version: int = 1, mode: str = "manual", mac: str = "aa:bb:cc:dd:ee:01",
                     mic: bool = True) -> tuple[FakeDevice, DeviceCall]:
        before = {c.id for c in self.calls()}
        ws = await self.http.ws_connect(self.ws_url, headers=headers(token, version, mac))
        dev = FakeDevice(ws, version=version, mode=mode)
        await dev.start(mic=mic)
        await wait_until(lambda: any(c.id not in before and c.agent for c in self.calls()), 30, "the device starts")
        [call] = [c for c in self.calls() if c.id not in before]
        return dev, call

    async def events(self, session_id: str) -> list[dict[str, Any]]:
        return [event_json(e) for e in await EventFollower(self.app[STORE], session_id).read_available()]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens="tenant_a:secret-a",
                              plans={"tenant_a": {"deadline_s": 45.0}}))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            yield Server(app, url, http)
    finally:
        await runner.cleanup()


async def settled(server: Server, session_id: str, n: int, timeout: float = 30) -> list[Turn]:
    async def done() -> list[Turn] | None:
        turns = await server.app[STORE].list_session(session_id)
        return turns if len(turns) >= n and all(t.status.is_terminal for t in turns) else None

    async with asyncio.timeout(timeout):
        while (turns := await done()) is None:
            await asyncio.sleep(0.05)
    return turns


async def push_to_talk(dev: FakeDevice, speech: Path) -> None:
    """Hold the button for the length of ``speech``, then let go."""
    await dev.listen("start", "manual")
    dev.speak(speech)
    await wait_until(lambda: dev.mic_idle, 20, "the utterance is sent")
    await asyncio.sleep(0.3)
    await dev.listen("stop")


async def stored_session(server: Server, session_id: str, timeout: float = 30) -> Session:
    """The session row, once the device's agent has written it (it is
    written by the agent's task, a moment after the call object exists)."""
    async with asyncio.timeout(timeout):
        while True:
            try:
                return await server.app[STORE].get_session(session_id)
            except UnknownSession:
                await asyncio.sleep(0.02)


async def test_tokens_are_issued_revoked_and_checked_before_the_upgrade(server: Server) -> None:
    async with server.http.post(server.url + "/v1/devices") as r:
        assert r.status == 401  # issuing needs the tenant's bearer token
    device_id, token = await server.token()
    for bad in ("", "Bearer nope", "Basic abc"):
        with pytest.raises(aiohttp.WSServerHandshakeError) as err:
            await server.http.ws_connect(server.ws_url, headers={"Authorization": bad} if bad else {})
        assert err.value.status == 401
    dev, call = await server.device(token)
    session = await stored_session(server, call.id)
    assert session.tenant_id == "tenant_a" and call.device_id == device_id
    assert call.agent is not None and call.agent.plan.deadline_s == 45.0  # the tenant's plan
    async with server.http.delete(server.url + f"/v1/devices/{device_id}", headers=API) as r:
        assert r.status == 204
    assert await dev.closed() == 1008  # a revoked device's open connection ends
    async with server.http.delete(server.url + f"/v1/devices/{device_id}", headers=API) as r:
        assert r.status == 404
    with pytest.raises(aiohttp.WSServerHandshakeError) as err:
        await server.http.ws_connect(server.ws_url, headers=headers(token))
    assert err.value.status == 401
    await dev.aclose()


async def test_a_push_to_talk_turn_is_answered(server: Server, say: Callable[..., Path]) -> None:
    _, token = await server.token()
    dev, call = await server.device(token)
    [hello] = dev.of("hello")
    assert hello.msg == {"type": "hello", "transport": "websocket", "session_id": call.id,
                         "audio_params": {"format": "opus", "sample_rate": 24000, "channels": 1, "frame_duration": 20}}
    await push_to_talk(dev, say("please count to twenty"))
    [turn] = await settled(server, call.id, 1)
    assert turn.status is TurnStatus.COMPLETED and plain(turn.transcript) == "please count to twenty"
    assert turn.reply and turn.reply.startswith("One, two, three")
    assert [r.msg and plain(r.msg["text"]) for r in dev.of("stt")] == ["please count to twenty"]
    await wait_until(lambda: bool(dev.of("tts", "stop")), 10, "tts stop")
    kinds = [(r.msg or {}).get("state", "audio") for r in dev.received if r.msg is None or r.msg["type"] == "tts"]
    assert kinds[0] == "start" and kinds[-1] == "stop" and "sentence_start" in kinds
    assert kinds.count("start") == 1 and kinds.count("stop") == 1  # audio only between them
    sentences = [r.msg["text"] for r in dev.of("tts", "sentence_start") if r.msg]
    assert sentences[0].startswith("One, two, three")
    # 20 ms packets at 24 kHz, paced at real time: seconds of sound over as many seconds
    packets = dev.packets()
    assert dev.audible_ms() > 1200
    pcm = OpusDecoder(24000).decode(packets[0].packet or b"")
    assert abs(len(pcm) // 2 - 480) <= 20  # 20 ms at 24 kHz
    span = packets[-1].at - packets[0].at
    assert span >= 0.02 * (len(packets) - 1) - 0.2 - call.settings.devices.send_ahead_ms / 1000
    await dev.aclose()


async def test_push_to_talk_while_the_agent_speaks_is_a_committed_barge_in(server: Server, say: Callable[..., Path]) -> None:
    _, token = await server.token()
    dev, call = await server.device(token)
    await push_to_talk(dev, say("tell me a story"))
    await wait_until(lambda: dev.audible_ms() > 600, 30, "the story is heard")
    await dev.listen("start", "manual")  # pressed while it speaks
    pressed = asyncio.get_running_loop().time()
    await wait_until(lambda: bool(call.agent and call.agent.barge_ins), 5, "a barge-in")
    await wait_until(lambda: dev.stops >= 1, 5, "tts stop")
    stop_at = dev.of("tts", "stop")[0].at
    print(f"press to tts stop: {(stop_at - pressed) * 1000:.1f} ms; to the last story packet: "
          f"{(dev.packets(before_stops=0)[-1].at - pressed) * 1000:.1f} ms")
    assert stop_at - pressed < 0.5  # sanity bound
    dev.speak(say("what is the weather like today"))
    await wait_until(lambda: dev.mic_idle, 20)
    await asyncio.sleep(0.3)
    await dev.listen("stop")
    old, new = (await settled(server, call.id, 2))[:2]
    assert old.status is TurnStatus.CANCELLED and old.stop_reason is not None
    assert old.stop_reason.kind is StopReasonKind.BARGE_IN and old.stop_reason.initiator == "ptt"
    assert plain(new.transcript) == "what is the weather like today" and new.status is TurnStatus.COMPLETED
    # the story's audio ended with its tts stop; the new reply came after a new tts start
    assert len(dev.of("tts", "start")) == 2 and dev.of("tts", "start")[1].tts_stops == 1
    await dev.aclose()


async def test_abort_stops_sending_at_once_and_records_the_stop(server: Server, say: Callable[..., Path]) -> None:
    _, token = await server.token()
    dev, call = await server.device(token)
    await push_to_talk(dev, say("tell me a story"))
    await wait_until(lambda: dev.audible_ms() > 600, 30, "the story is heard")
    await dev.abort()
    aborted = asyncio.get_running_loop().time()
    await wait_until(lambda: dev.stops >= 1, 5, "tts stop")
    [turn] = await settled(server, call.id, 1)
    assert turn.status is TurnStatus.CANCELLED and turn.stop_reason is not None
    assert turn.stop_reason.kind is StopReasonKind.USER_CANCEL and turn.stop_reason.initiator == "device"
    await asyncio.sleep(0.5)
    # the last audio came within one 20 ms packet of the abort (plus scheduling), and none after tts stop
    last_packet = dev.packets(before_stops=0)[-1].at
    print(f"abort to the last packet received: {(last_packet - aborted) * 1000:.1f} ms, "
          f"to tts stop: {(dev.of('tts', 'stop')[0].at - aborted) * 1000:.1f} ms")
    assert last_packet - aborted < 0.25  # a sanity bound for a loaded machine; none after tts stop is the rule
    assert not dev.packets(before_stops=1)
    statuses = [e["status"] for e in await server.events(call.id) if e["type"] == "turn"]
    assert statuses[-2:] == ["CANCEL_REQUESTED", "CANCELLED"]
    # the record keeps what was heard (sent minus the send-ahead in flight): a part of the story
    assert turn.reply and call.agent is not None
    await dev.aclose()


async def test_a_wake_word_is_a_turn_of_its_text(server: Server) -> None:
    _, token = await server.token()
    dev, call = await server.device(token, mic=False)
    await dev.listen("detect", text="please count to twenty")
    [turn] = await settled(server, call.id, 1)
    assert plain(turn.transcript) == "please count to twenty" and turn.status is TurnStatus.COMPLETED
    await wait_until(lambda: bool(dev.of("tts", "stop")), 10, "tts stop")
    await dev.aclose()


@pytest.mark.parametrize("version", [2, 3])
async def test_auto_mode_endpoints_on_protocol_versions_2_and_3(server: Server, say: Callable[..., Path], version: int) -> None:
    _, token = await server.token()
    dev, call = await server.device(token, version=version, mode="auto")
    await dev.listen("start", "auto")
    dev.speak(say("please count to twenty"))
    [turn] = await settled(server, call.id, 1)
    assert plain(turn.transcript) == "please count to twenty" and turn.status is TurnStatus.COMPLETED
    await wait_until(lambda: bool(dev.of("tts", "stop")), 10, "tts stop")
    assert dev.audible_ms() > 1200
    await dev.aclose()


async def test_realtime_mode_barges_in_by_voice(server: Server, say: Callable[..., Path]) -> None:
    _, token = await server.token()
    dev, call = await server.device(token, mode="realtime")
    await dev.listen("start", "realtime")
    dev.speak(say("tell me a story"))
    await wait_until(lambda: dev.audible_ms() > 900, 30, "the story is heard")
    dev.speak(say("what is the weather like today"))  # the mic stays open while it speaks
    await wait_until(lambda: dev.stops >= 1, 10, "tts stop: the story is cut")
    old, new = (await settled(server, call.id, 2, timeout=45))[:2]
    assert old.status is TurnStatus.CANCELLED and old.stop_reason is not None
    assert old.stop_reason.kind is StopReasonKind.BARGE_IN and old.stop_reason.initiator == "vad"
    # its first word is clipped now and then on a loaded machine ("its the weather like today",
    # once in CI): noted for the barge-in work; here, the rest must be heard
    assert plain(new.transcript).endswith("the weather like today"), new.transcript
    await dev.aclose()
