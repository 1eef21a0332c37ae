"""The phone simulator on its own: its provider-side playout buffer (pure,
tick by tick) and the whole simulator against a minimal fake agent server
in the test (an aiohttp WebSocket that records what the "provider" sends
and sends it media, marks and clears as a bridge would)."""

from __future__ import annotations

import asyncio
import base64
import json
import math
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiohttp import web
from conftest import start_app

from client.phone import PhoneSimulator
from client.phone_dialects import ProtocolViolation, ServerClear, ServerMark, ServerMedia, TelnyxDialect, TwilioDialect
from client.phone_playout import MULAW_SILENCE, ProviderPlayout
from client.results import CallError
from media.g711 import pcm_to_mulaw

# -- the playout buffer, tick by tick -------------------------------------------


def test_the_buffer_plays_160_bytes_a_tick_and_silence_when_dry() -> None:
    p = ProviderPlayout()
    p.push_media(b"\x01" * 100)
    p.push_media(b"\x02" * 100)  # payloads of any length join one stream
    t1 = p.tick()
    assert t1.real == 160 and t1.audio == b"\x01" * 100 + b"\x02" * 60 and t1.start == 0
    t2 = p.tick()
    assert t2.real == 40 and t2.audio == b"\x02" * 40 + bytes([MULAW_SILENCE]) * 120 and t2.start == 160
    t3 = p.tick()
    assert t3.real == 0 and t3.audio == bytes([MULAW_SILENCE]) * 160
    assert p.played == p.received == 200


def test_a_mark_is_echoed_only_after_its_audio_has_played() -> None:
    p = ProviderPlayout()
    p.push_media(b"\x01" * 320)  # 40 ms
    assert p.push_mark("m1") == []
    p.push_media(b"\x01" * 160)
    assert p.push_mark("m2") == []
    echoes = [p.tick().echoes for _ in range(5)]
    # frame 1 and 2 hold m1's audio: m1 goes when frame 3 begins; m2 when frame 4 begins
    assert echoes == [[], [], ["m1"], ["m2"], []]


def test_a_mark_with_nothing_buffered_or_playing_is_echoed_at_once() -> None:
    p = ProviderPlayout()
    assert p.push_mark("idle") == ["idle"]
    p.push_media(b"\x01" * 160)
    p.tick()  # that frame is playing now
    assert p.push_mark("after") == []
    assert p.tick().echoes == ["after"]


def test_clear_drops_the_unplayed_audio_and_returns_the_pending_marks() -> None:
    p = ProviderPlayout()
    p.push_media(b"\x01" * 800)
    p.push_mark("a")
    p.push_media(b"\x01" * 800)
    p.push_mark("b")
    p.tick()
    cleared = p.clear()
    assert cleared.at_offset == 160 and cleared.dropped == 1440 and cleared.echoes == ["a", "b"]
    assert p.buffered == 0 and p.pending_marks == []
    assert p.tick().real == 0  # nothing of the old audio plays after it
    assert p.push_media(b"\x03" * 160) == 1600  # new audio starts after the dropped bytes
    assert p.tick().audio == b"\x03" * 160


# -- the dialects ------------------------------------------------------------------


def test_twilio_messages_have_the_documented_shapes() -> None:
    d = TwilioDialect()
    assert d.connected() == {"event": "connected", "protocol": "Call", "version": "1.0.0"}
    start = d.start({"tenant": "t1"})
    assert start["sequenceNumber"] == "1" and start["streamSid"] == d.stream_id
    assert start["start"]["mediaFormat"] == {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1}
    assert start["start"]["customParameters"] == {"tenant": "t1"} and start["start"]["tracks"] == ["inbound"]
    m = d.media(1, 0, b"\xff" * 160)
    assert m["sequenceNumber"] == "2" and m["media"]["chunk"] == "1" and m["media"]["timestamp"] == "0"
    assert base64.b64decode(m["media"]["payload"]) == b"\xff" * 160 and m["media"]["track"] == "inbound"
    assert d.dtmf("5")["dtmf"] == {"track": "inbound_track", "digit": "5"}
    assert d.stop()["stop"] == {"accountSid": d.account_sid, "callSid": d.call_id}


def test_twilio_reads_server_messages_and_refuses_broken_ones() -> None:
    d = TwilioDialect()
    sid = d.stream_id
    payload = base64.b64encode(b"\x01\x02").decode()
    assert d.parse({"event": "media", "streamSid": sid, "media": {"payload": payload}}) == ServerMedia(b"\x01\x02")
    assert d.parse({"event": "mark", "streamSid": sid, "mark": {"name": "s1"}}) == ServerMark("s1")
    assert d.parse({"event": "clear", "streamSid": sid}) == ServerClear()
    for bad in (
        [1, 2],
        {"event": "playAudio", "streamSid": sid},
        {"event": "clear"},  # Twilio needs the streamSid
        {"event": "clear", "streamSid": "MZother"},
        {"event": "media", "streamSid": sid, "media": {"payload": "not base64!"}},
        {"event": "media", "streamSid": sid},
        {"event": "mark", "streamSid": sid, "mark": {}},
    ):
        with pytest.raises(ProtocolViolation):
            d.parse(bad)


def test_telnyx_messages_have_the_documented_shapes() -> None:
    d = TelnyxDialect()
    start = d.start({})
    assert start["sequence_number"] == "1" and start["stream_id"] == d.stream_id
    assert start["start"]["media_format"] == {"encoding": "PCMU", "sample_rate": 8000, "channels": 1}
    assert start["start"]["call_control_id"] == d.call_id
    assert d.parse({"event": "clear"}) == ServerClear()  # stream_id is optional on what Telnyx receives
    with pytest.raises(ProtocolViolation):
        d.parse({"event": "clear", "stream_id": "another"})


# -- the simulator against a fake server ---------------------------------------------


@dataclass
class FakeBridge:
    """The server side, as small as a test can make it."""

    url: str = ""
    received: list[dict[str, Any]] = field(default_factory=list)
    arrivals: list[float] = field(default_factory=list)
    ws: web.WebSocketResponse | None = None
    connected: asyncio.Event = field(default_factory=asyncio.Event)
    closed: asyncio.Event = field(default_factory=asyncio.Event)

    async def send(self, message: dict[str, Any]) -> None:
        assert self.ws is not None
        await self.ws.send_str(json.dumps(message))

    def of(self, event: str) -> list[dict[str, Any]]:
        return [m for m in self.received if m.get("event") == event]


@pytest.fixture
async def bridge() -> AsyncIterator[FakeBridge]:
    fake = FakeBridge()

    async def handler(request: web.Request) -> web.WebSocketResponse:
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        fake.ws = ws
        fake.connected.set()
        loop = asyncio.get_running_loop()
        async for msg in ws:
            fake.received.append(json.loads(msg.data))
            fake.arrivals.append(loop.time())
        fake.closed.set()
        return ws

    app = web.Application()
    app.router.add_get("/v1/telephony/twilio", handler)
    app.router.add_get("/v1/telephony/telnyx", handler)
    runner, base = await start_app(app)
    fake.url = base
    try:
        yield fake
    finally:
        await runner.cleanup()


def tone(ms: int, hz: float = 440.0, amp: float = 0.3) -> bytes:
    """``ms`` of a sine at 8 kHz as mu-law."""
    t = np.arange(ms * 8) / 8000
    pcm = (np.sin(2 * math.pi * hz * t) * amp * 32767).astype("<i2").tobytes()
    return pcm_to_mulaw(pcm)


def media(sid: str, payload: bytes) -> dict[str, Any]:
    return {"event": "media", "streamSid": sid, "media": {"payload": base64.b64encode(payload).decode()}}


def audible_ms(pcm8k: bytes) -> int:
    """ms of 20 ms frames louder than -40 dBFS."""
    a = np.frombuffer(pcm8k, dtype="<i2").astype(float)
    frames = a[: len(a) // 160 * 160].reshape(-1, 160)
    rms = np.sqrt((frames**2).mean(axis=1))
    return int((rms > 32768 * 10 ** (-40 / 20)).sum()) * 20


async def test_the_simulator_speaks_twilio_plays_at_real_time_and_echoes_marks_after_play(bridge: FakeBridge, tmp_path: Path) -> None:
    d = TwilioDialect()
    sim = PhoneSimulator(bridge.url + d.path, d, custom_parameters={"tenant": "t1"})
    await sim.connect()
    try:
        await asyncio.wait_for(bridge.connected.wait(), 5)
        sid = d.stream_id
        # a second of audio at once, then a mark: it must come back after about 1 s of play
        await bridge.send(media(sid, tone(1000)))
        await bridge.send({"event": "mark", "streamSid": sid, "mark": {"name": "one-second"}})
        sent_at = asyncio.get_running_loop().time()
        sim.say(np.zeros(8000, dtype="<i2").tobytes(), 0)  # 1 s of the caller's speech (silent here)
        await sim.press("7")
        for _ in range(300):
            if bridge.of("mark"):
                break
            await asyncio.sleep(0.01)
        [echo] = bridge.of("mark")
        echoed_after = bridge.arrivals[bridge.received.index(echo)] - sent_at
        assert echo == {"event": "mark", "sequenceNumber": echo["sequenceNumber"], "streamSid": sid, "mark": {"name": "one-second"}}
        assert 0.95 <= echoed_after <= 1.3, echoed_after  # not before its audio has played; real time
        await sim.said()
    finally:
        await sim.hangup()
    await asyncio.wait_for(bridge.closed.wait(), 5)
    events = [m["event"] for m in bridge.received]
    assert events[:2] == ["connected", "start"] and events[-1] == "stop"
    assert bridge.received[1]["start"]["customParameters"] == {"tenant": "t1"}
    chunks = [int(m["media"]["chunk"]) for m in bridge.of("media")]
    assert chunks == list(range(1, len(chunks) + 1))  # every 20 ms, in order, from 1
    stamps = [int(m["media"]["timestamp"]) for m in bridge.of("media")]
    assert stamps == [20 * (c - 1) for c in chunks]
    assert all(len(base64.b64decode(m["media"]["payload"])) == 160 for m in bridge.of("media"))
    assert bridge.of("dtmf") and bridge.of("dtmf")[0]["dtmf"] == {"track": "inbound_track", "digit": "7"}
    seqs = [int(m["sequenceNumber"]) for m in bridge.received[1:]]
    assert seqs == list(range(1, len(seqs) + 1))
    # media went out at real time: about 50 messages a second
    span = bridge.arrivals[-2] - bridge.arrivals[2]
    assert 0.9 * span * 50 <= len(chunks) <= 1.1 * span * 50 + 2
    # the caller heard the second of tone, then silence
    pcm = sim.heard_pcm()
    assert 940 <= audible_ms(pcm) <= 1020
    sim.write_heard(tmp_path / "heard.wav")
    with wave.open(str(tmp_path / "heard.wav")) as w:
        assert w.getframerate() == 8000 and w.getnframes() == len(pcm) // 2
    assert sim.log.errors == []


async def test_clear_stops_the_audio_at_the_ear_and_returns_pending_marks_at_once(bridge: FakeBridge) -> None:
    d = TwilioDialect()
    sim = PhoneSimulator(bridge.url + d.path, d)
    await sim.connect()
    try:
        await asyncio.wait_for(bridge.connected.wait(), 5)
        sid = d.stream_id
        await bridge.send(media(sid, tone(1500)))
        await bridge.send({"event": "mark", "streamSid": sid, "mark": {"name": "s1"}})
        await bridge.send(media(sid, tone(1500)))
        await bridge.send({"event": "mark", "streamSid": sid, "mark": {"name": "s2"}})
        await asyncio.sleep(0.5)
        cleared_at = asyncio.get_running_loop().time()
        await bridge.send({"event": "clear", "streamSid": sid})
        for _ in range(100):
            if len(bridge.of("mark")) == 2:
                break
            await asyncio.sleep(0.01)
        names = [m["mark"]["name"] for m in bridge.of("mark")]
        marks_back = bridge.arrivals[bridge.received.index(bridge.of("mark")[-1])] - cleared_at
        assert names == ["s1", "s2"] and marks_back < 0.1  # at once, not after 3 s of audio
        await asyncio.sleep(0.5)
        # new audio after the clear plays at once (nothing old is left in front of it)
        await bridge.send(media(sid, tone(200, hz=1000)))
        await asyncio.sleep(0.4)
    finally:
        await sim.hangup()
    [(_, cleared)] = sim.log.clears
    assert cleared.echoes == ["s1", "s2"] and 2300 * 8 <= cleared.dropped <= 2600 * 8
    played_old = [f for f in sim.log.heard if f.real and f.start < cleared.at_offset + 1]
    assert 440 <= len(played_old) * 20 <= 560  # half a second of the old audio, no more
    assert 620 <= audible_ms(sim.heard_pcm()) <= 740  # 500 ms old + 200 ms new
    assert [how for _, _, how in sim.log.echoes] == ["cleared", "cleared"]


async def test_the_simulator_reports_what_breaks_the_protocol(bridge: FakeBridge) -> None:
    d = TwilioDialect()
    sim = PhoneSimulator(bridge.url + d.path, d)
    await sim.connect()
    try:
        await asyncio.wait_for(bridge.connected.wait(), 5)
        await bridge.send({"event": "clear", "streamSid": "MZsomeoneelse"})
        await bridge.send({"event": "media", "streamSid": d.stream_id, "media": {"payload": "%%%"}})
        assert bridge.ws is not None
        await bridge.ws.send_str("not json")
        await asyncio.sleep(0.2)
    finally:
        await sim.hangup()
    assert len(sim.log.errors) == 3 and "MZsomeoneelse" in sim.log.errors[0]
    assert sim.log.clears == []  # a clear for another stream is not obeyed


async def test_telnyx_frames_can_arrive_out_of_order_with_their_original_numbers(bridge: FakeBridge) -> None:
    d = TelnyxDialect()
    sim = PhoneSimulator(bridge.url + d.path, d, reorder=0.3, seed=3)
    await sim.connect()
    try:
        await asyncio.wait_for(bridge.connected.wait(), 5)
        await asyncio.sleep(1.0)
    finally:
        await sim.hangup()
    assert [m["event"] for m in bridge.received[:2]] == ["connected", "start"]
    chunks = [int(m["media"]["chunk"]) for m in bridge.of("media")]
    assert chunks != sorted(chunks)  # some came late
    assert sorted(chunks)[: len(chunks) - 1] == list(range(1, len(chunks)))  # none lost (one may still be held)
    for m in bridge.of("media"):
        assert int(m["media"]["timestamp"]) == 20 * (int(m["media"]["chunk"]) - 1)
        assert m["stream_id"] == d.stream_id
    assert bridge.received[-1]["event"] == "stop", [m["event"] for m in bridge.received[-3:]]
    assert bridge.received[-1]["stop"]["call_control_id"] == d.call_id


async def test_a_refused_upgrade_is_a_clear_call_error(bridge: FakeBridge) -> None:
    d = TwilioDialect()
    with pytest.raises(CallError, match="refused the media stream"):
        await PhoneSimulator(bridge.url + "/nowhere", d).connect()
