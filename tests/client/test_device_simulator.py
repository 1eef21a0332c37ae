"""The device simulator (client/device.py) and its scripted calls
(client/device_call.py) against a minimal fake device server: the
firmware's headers and hello, push-to-talk, abort, realtime mode, both
framings, what the speaker played, and the stop time measured at the device."""

from __future__ import annotations

import asyncio
import itertools
import json
import struct
import subprocess
import sys
import wave
from collections.abc import AsyncIterator
from pathlib import Path

import pytest
from aiohttp import web
from fake_device_server import FakeDeviceServer, tone

from client.device import DeviceSimulator
from client.device_call import DeviceCallClient
from client.device_log import ReceivedPacket
from client.device_speaker import DeviceSpeaker
from client.results import BargeInMeasure, CallError, Utterance
from media.frames import PLAYOUT_RATE, rms_dbfs
from web.devices import framing


async def serve(fake: FakeDeviceServer) -> AsyncIterator[str]:
    runner = web.AppRunner(fake.app(), access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield f"ws://127.0.0.1:{port}/v1/devices/ws"
    finally:
        await runner.cleanup()


def speech(ms: int) -> bytes:
    """48 kHz 'speech' (a loud tone) with 100 ms of silence before it."""
    return bytes(PLAYOUT_RATE // 10 * 2) + tone(ms, PLAYOUT_RATE, hz=300.0, amplitude=0.5)


def outgoing(fake: FakeDeviceServer) -> list[dict]:
    return [m for _, m in fake.texts]


# -- the speaker, pure ---------------------------------------------------------------------


def test_the_speaker_plays_packets_back_to_back_at_real_time_and_refuses_more_than_its_queue() -> None:
    sp = DeviceSpeaker(16_000, capacity_ms=200)
    pcm = tone(60, 16_000)
    a = sp.push(pcm, 10.0)
    b = sp.push(pcm, 10.01)  # arrives while the first plays: queued behind it
    assert a is not None and b is not None
    assert (a.start, a.end) == (10.0, pytest.approx(10.06))
    assert b.start == pytest.approx(10.06) and b.offset == 960
    for _ in range(2):
        assert sp.push(pcm, 10.02) is not None  # 100 and 160 ms queued ahead of it
    assert sp.push(pcm, 10.02) is None and sp.overflows == 1  # 220 ms queued ahead of it > 200
    late = sp.push(pcm, 11.0)  # after a gap: plays on arrival
    assert late is not None and late.start == 11.0
    pcm_out = sp.render(10.0, 11.06)
    assert len(pcm_out) == 2 * 16_000 * 106 // 100
    gap = pcm_out[2 * 16_000 * 40 // 100 : 2 * 16_000 * 99 // 100]
    assert rms_dbfs(gap) == float("-inf")
    frames = sp.frames(10.0, 11.06)
    assert frames[0].real == 320 and frames[0].dbfs > -20
    assert frames[-1].real == 320 and frames[-1].start == 4 * 960 + 640  # its last 20 ms


def test_a_reset_cuts_what_is_still_queued() -> None:
    sp = DeviceSpeaker(16_000)
    segs = [sp.push(tone(60, 16_000), 0.0) for _ in range(3)]
    sp.reset(0.09)
    assert [s.end for s in segs if s] == [pytest.approx(0.06), pytest.approx(0.09), pytest.approx(0.12)]
    assert segs[2] is not None and segs[2].end == segs[2].start  # never played
    assert sp.reset_ms == pytest.approx(90.0)
    nxt = sp.push(tone(60, 16_000), 0.1)
    assert nxt is not None and nxt.start == 0.1


def test_the_speaker_records_where_its_queue_ran_dry_mid_reply() -> None:
    sp = DeviceSpeaker(16_000)
    pcm = tone(60, 16_000)
    sp.push(pcm, 1.0)  # the reply's first packet: nothing ran dry before it
    sp.push(pcm, 1.05)  # in time
    sp.push(pcm, 1.15)  # 30 ms after the queue ran dry at 1.12
    assert sp.underruns == [(pytest.approx(1.12), pytest.approx(30.0))]
    sp.reset(2.0)  # the next reply (tts start)
    sp.push(pcm, 2.5)
    assert len(sp.underruns) == 1


def test_a_wifi_link_delays_the_servers_messages_in_order() -> None:
    """The jitter model: every message is late by a random amount (p95 as
    asked, about), and never overtakes the one before it (one TCP stream)."""
    sim = DeviceSimulator("ws://127.0.0.1:1/v1/devices/ws", wifi_jitter_ms=30.0, seed=7)
    clock_now = sim.clock.monotonic()
    arrivals = [sim._arrival() for _ in range(2000)]
    assert all(b >= a for a, b in itertools.pairwise(arrivals))
    assert arrivals[0] >= clock_now
    # each delay alone (the in-order rule only adds to it)
    alone = DeviceSimulator("ws://127.0.0.1:1/v1/devices/ws", wifi_jitter_ms=30.0, seed=7)
    delays = sorted(alone._rng.expovariate(1 / alone._jitter_mean_s) * 1000 for _ in range(4000))
    assert 24 <= delays[int(0.95 * len(delays))] <= 36
    with pytest.raises(ValueError, match="jitter"):
        DeviceSimulator("ws://127.0.0.1:1/v1/devices/ws", wifi_jitter_ms=-1)
    plain = DeviceSimulator("ws://127.0.0.1:1/v1/devices/ws")
    before = plain.clock.monotonic()
    assert before <= plain._arrival() <= plain.clock.monotonic()


# -- against the fake server -----------------------------------------------------------------------


@pytest.fixture
async def fake() -> FakeDeviceServer:
    return FakeDeviceServer()


@pytest.mark.parametrize("version", [1, 3])
async def test_push_to_talk_sends_the_firmwares_headers_hello_and_60ms_opus_while_the_button_is_held(
    version: int, tmp_path: Path
) -> None:
    fake = FakeDeviceServer(reply_ms=1200)
    async for url in serve(fake):
        client = DeviceCallClient(url, mode="manual", device_token="dev-tok", version=version, device_id="aa:bb:cc:dd:ee:ff")
        result = await client.run(Utterance(speech(900), label="hi.wav"), out_wav=tmp_path / "heard.wav", timeout_s=20)
    assert result.ok, result
    h = fake.headers
    assert h["Authorization"] == "Bearer dev-tok" and h["Protocol-Version"] == str(version)
    assert h["Device-Id"] == "aa:bb:cc:dd:ee:ff" and len(h["Client-Id"]) == 36
    msgs = outgoing(fake)
    assert msgs[0] == {"type": "hello", "version": version, "features": {"mcp": True}, "transport": "websocket",
                       "audio_params": {"format": "opus", "sample_rate": 16000, "channels": 1, "frame_duration": 60}}
    assert msgs[1] == {"session_id": "s-1", "type": "listen", "state": "start", "mode": "manual"}
    assert msgs[2] == {"session_id": "s-1", "type": "listen", "state": "stop"}
    start, stop = fake.texts[1][0], fake.texts[2][0]
    # the button held for the utterance (1.0 s at 48 kHz): 17 packets of 60 ms, all between press and release
    assert 16 <= len(fake.frames) <= 18
    assert all(start < at < stop + 0.01 for at, _ in fake.frames)
    assert all(len(pcm) // 2 == pytest.approx(960, abs=20) for _, pcm in fake.frames)
    assert stop - start == pytest.approx(1.0, abs=0.15)
    loud = [rms_dbfs(pcm) > -20 for _, pcm in fake.frames]
    assert not loud[0] and sum(loud) >= 13  # the 100 ms lead-in, then the tone
    if version == 3:  # the 4-byte header, big-endian size
        assert all(framing.parse(raw, 3).payload == raw[4:] and raw[0] == 0 for raw in fake.raw)
    # the downlink: decoded at the announced 24 kHz and played at real time
    assert result.transport == "device" and result.transport_info["downlink_rate"] == 24_000
    assert result.received_audio_ms == pytest.approx(1200, abs=80)
    with wave.open(str(tmp_path / "heard.wav")) as w:
        assert w.getframerate() == 24_000
        assert w.getnframes() / 24_000 >= 1.2
    # the turn as the device was told it (no event log without a tenant token)
    assert [(t.transcript, t.reply) for t in result.turns] == [("turn 1", "a tone")]
    assert result.protocol_errors == []


async def test_the_microphone_is_off_while_the_agent_speaks_in_manual_mode(fake: FakeDeviceServer) -> None:
    fake.reply_ms = 1500
    async for url in serve(fake):
        async with DeviceSimulator(url, "tok") as sim:
            await sim.press()
            sim.say(tone(600, 16_000), 1)
            await sim.said()
            await sim.release()
            _, m = await sim.wait_message(lambda m: m.get("type") == "tts" and m.get("state") == "start", 5)
            sent_before = len(sim.log.sent)
            await sim.wait_message(lambda m: m.get("type") == "tts" and m.get("state") == "stop", 5)
            assert len(sim.log.sent) == sent_before  # nothing sent while speaking
            assert sim.state == "idle"  # manual mode goes back to idle after tts stop
            assert [s for _, s in sim.log.states] == ["idle", "listening", "idle", "speaking", "idle"]


async def test_abort_measures_silence_at_the_device_against_a_server_that_stops_at_once(fake: FakeDeviceServer) -> None:
    async for url in serve(fake):
        client = DeviceCallClient(url, mode="manual")
        result = await client.run(Utterance(speech(500)), [Utterance(b"", at_s=0.5, abort=True, label="abort")], timeout_s=20)
    assert result.ok
    (m,) = result.barge_ins
    assert m.initiator == "abort" and m.barged_in and m.speaking_at_onset
    assert [x for x in outgoing(fake) if x["type"] == "abort"] == [{"session_id": "s-1", "type": "abort"}]
    # a 60 ms packet playing plus 60 ms sent ahead are at most what is left to
    # play (120 ms); the bounds are sanity bounds for a loaded machine (the
    # fake server sees the abort at its next 60 ms packet wake), well below
    # what a server that keeps sending shows (>= 330 ms, the next test)
    assert m.stop_ms is not None and 0 <= m.stop_ms <= 250
    assert m.tts_stop_ms is not None and m.tts_stop_ms < 250
    assert m.received_stop_ms is not None and m.received_stop_ms < 250
    assert m.old_audio_after_tts_stop_ms == 0
    assert m.played_ms_at_ear == pytest.approx(500, abs=150)  # the reply played until the abort
    d = m.as_dict()
    assert d["initiator"] == "abort" and d["tts_stop_ms"] == m.tts_stop_ms


async def test_a_server_that_keeps_sending_after_abort_is_caught_at_the_device(fake: FakeDeviceServer) -> None:
    fake.late_ms = 400  # the device keeps playing whatever it still receives
    async for url in serve(fake):
        result = await DeviceCallClient(url).run(Utterance(speech(500)), [Utterance(b"", at_s=0.5, abort=True)], timeout_s=20)
    (m,) = result.barge_ins
    assert m.stop_ms is not None and m.stop_ms >= 400
    assert m.received_stop_ms is not None and m.received_stop_ms >= 330
    assert m.tts_stop_ms is not None and m.tts_stop_ms >= 400


async def test_a_push_to_talk_press_while_speaking_aborts_listens_and_drops_what_still_arrives(fake: FakeDeviceServer) -> None:
    fake.late_ms = 300  # so some old audio arrives after the press
    async for url in serve(fake):
        client = DeviceCallClient(url, mode="manual")
        result = await client.run(Utterance(speech(500)), [Utterance(speech(500), at_s=0.6, label="again")], timeout_s=25)
    assert result.ok
    (m,) = result.barge_ins
    assert m.initiator == "ptt"
    msgs = [x for x in outgoing(fake) if x["type"] != "hello"]
    kinds = [(x["type"], x.get("state")) for x in msgs]
    # firmware order: listen start, stop; then on the press abort, listen start (manual), the audio, listen stop
    assert kinds == [("listen", "start"), ("listen", "stop"), ("abort", None), ("listen", "start"), ("listen", "stop")]
    assert client.sim is not None
    late = [p for p in client.sim.log.received if p.at > m.onset_sent_at]  # type: ignore[operator]
    assert late and all(p.segment is None for p in late if p.state == "listening")
    # only what was queued at the press played: at most a packet and the
    # send-ahead (120 ms; a sanity bound for a loaded machine)
    assert m.stop_ms is not None and m.stop_ms <= 250
    # the server's lateness is still seen: the fake sends whole packets, so
    # its last old one leaves at most one packet before late_ms after the press
    # (give or take its sleep's timer jitter: 239.9 ms against 240 once in CI)
    assert m.received_stop_ms is not None and m.received_stop_ms >= fake.late_ms - fake.frame_ms - 5
    assert fake.replies == 2 and [t.transcript for t in result.turns] == ["turn 1", "turn 2"]


async def test_realtime_mode_keeps_the_microphone_open_and_measures_a_voice_barge_in(fake: FakeDeviceServer) -> None:
    fake.reply_ms = 4000
    async for url in serve(fake):
        client = DeviceCallClient(url, mode="realtime", version=3)
        result = await client.run(Utterance(speech(800)), [Utterance(speech(600), at_s=0.8, label="voice")], timeout_s=25)
    assert result.ok
    assert outgoing(fake)[1] == {"session_id": "s-1", "type": "listen", "state": "start", "mode": "realtime"}
    assert client.sim is not None
    log = client.sim.log
    first_start = log.tts("start")[0]
    first_stop = log.tts("stop")[0]
    assert any(first_start < p.at < first_stop for p in log.sent)  # the microphone stayed open while speaking
    (m,) = result.barge_ins
    assert m.initiator == "voice" and m.barged_in
    # onset: the packet with the first loud sample (100 ms into the utterance: the second packet) left
    assert client.sim is not None
    second = [p for p in client.sim.log.sent if p.utterance == 2][1]
    assert m.onset_sent_at == second.at
    assert m.stop_ms is not None and 0 < m.stop_ms < 250


async def test_no_server_hello_in_time_is_a_clear_error(fake: FakeDeviceServer) -> None:
    fake.answer_hello = False
    async for url in serve(fake):
        with pytest.raises(CallError, match="no hello with transport 'websocket' within 0.3 s"):
            await DeviceSimulator(url, hello_timeout_s=0.3).connect()


async def test_a_server_hello_with_another_transport_is_refused_as_the_firmware_does(fake: FakeDeviceServer) -> None:
    fake.hello_transport = "udp"
    async for url in serve(fake):
        with pytest.raises(CallError, match="transport 'udp'"):
            await DeviceSimulator(url, hello_timeout_s=0.3).connect()


async def test_bad_downlink_frames_are_reported_and_the_call_goes_on(fake: FakeDeviceServer) -> None:
    fake.bad_frames = [b"\x00\x00\x00\x09abc", b"\x00\x00\x00\x03\xff\xff\xff", b"\x01\x00\x00\x02{}"]
    fake.reply_ms = 600
    async for url in serve(fake):
        result = await DeviceCallClient(url, version=3).run(Utterance(speech(400)), timeout_s=20)
    assert result.ok
    errs = result.protocol_errors
    assert any("payload size 9 in the header, 3 bytes follow" in e for e in errs)
    assert any("undecodable downlink audio" in e for e in errs)
    assert any("type 1" in e for e in errs)
    assert result.received_audio_ms == pytest.approx(600, abs=80)  # the good audio still played


async def test_a_refused_upgrade_and_a_bad_version_are_clear_errors() -> None:
    with pytest.raises(ValueError, match="protocol version 4"):
        DeviceSimulator("ws://127.0.0.1:1/v1/devices/ws", version=4)
    with pytest.raises(ValueError, match="mode 'auto'"):
        DeviceCallClient("ws://127.0.0.1:1/v1/devices/ws", mode="auto")
    app = web.Application()
    async def refuse(_: web.Request) -> web.Response:
        return web.Response(status=401, text=json.dumps({"error": "bad token"}))

    app.router.add_get("/v1/devices/ws", refuse)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        with pytest.raises(CallError, match="refused the device \\(HTTP 401\\)"):
            await DeviceSimulator(f"ws://127.0.0.1:{port}/v1/devices/ws", "nope").connect()
    finally:
        await runner.cleanup()


async def test_turnkeeper_call_device_prints_a_push_to_talk_timeline_with_stop_times(tmp_path: Path) -> None:
    wav = tmp_path / "hi.wav"
    with wave.open(str(wav), "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(PLAYOUT_RATE)
        w.writeframes(speech(500))
    fake = FakeDeviceServer(reply_ms=2000)
    async for url in serve(fake):
        proc = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "web.cli", "call", "--device", url, "--ptt", "--wav", str(wav), "--barge-in", str(wav),
            "--at", "0.5", "--device-token", "t0k", "--protocol-version", "3", "--out", str(tmp_path / "heard.wav"),
            stdout=asyncio.subprocess.PIPE, stderr=asyncio.subprocess.PIPE,
        )
        out, err = await asyncio.wait_for(proc.communicate(), 60)
    text = out.decode()
    assert proc.returncode == 0, err.decode()
    assert text.startswith("device call (xiaozhi-esp32 protocol v3, push-to-talk, downlink Opus 24000 Hz, 60 ms packets)")
    assert "push-to-talk pressed hi.wav at +0.50 s: silent at the device after " in text
    assert "tts stop after" in text and "the device played" in text
    assert fake.headers["Authorization"] == "Bearer t0k"


@pytest.mark.parametrize(("argv", "message"), [
    (["--local", "--ptt"], "--ptt, --realtime and --abort-at go with --device"),
    (["--device", "ws://h/v1/devices/ws", "--phone", "twilio"], "two different transports"),
    (["--device", "ws://h/v1/devices/ws", "--server", "http://h"], "leave out --server"),
    (["--device"], "one of --server, --local or --device WS_URL"),
    (["--device", "ws://h", "--ptt", "--realtime"], "not allowed with argument"),
])
def test_device_arguments_that_do_not_go_together_are_refused(argv: list[str], message: str) -> None:
    proc = subprocess.run([sys.executable, "-m", "web.cli", "call", "--wav", "x.wav", *argv],
                          capture_output=True, text=True, timeout=60)
    assert proc.returncode == 2 and message in proc.stderr


async def test_version_2_frames_carry_the_firmwares_16_byte_header_with_a_timestamp(fake: FakeDeviceServer) -> None:
    async for url in serve(fake):
        async with DeviceSimulator(url, "tok", version=2) as sim:
            await sim.press()
            sim.say(tone(300, 16_000), 1)
            await sim.said()
            await sim.release()
    assert len(fake.raw) >= 5
    stamps = []
    for raw in fake.raw:
        version, kind, reserved, ts, size = struct.unpack(">HHIII", raw[:16])
        assert (version, kind, reserved, size) == (2, 0, 0, len(raw) - 16)
        stamps.append(ts)
    # The stamps count the device's captured audio, 60 ms per packet, however
    # late the event loop sends them (a CI run saw 80, 129: a send-time stamp).
    assert [b - a for a, b in itertools.pairwise(stamps)] == [60] * (len(stamps) - 1)


async def test_auto_mode_listens_again_after_the_reply_and_a_wake_word_is_sent_as_detect(fake: FakeDeviceServer) -> None:
    fake.reply_ms = 400
    async for url in serve(fake):
        async with DeviceSimulator(url, "tok") as sim:
            await sim.detect("hello turnkeeper")
            assert sim.state == "listening"
            await sim.send_json({"session_id": sim.session_id, "type": "listen", "state": "stop"})  # the server ends the turn
            await sim.wait_message(lambda m: m.get("type") == "tts" and m.get("state") == "start", 5)
            await sim.wait_message(lambda m: m.get("type") == "tts" and m.get("state") == "stop", 5)
            await asyncio.sleep(0.1)
            assert sim.state == "listening"
            sent = [m for _, m in sim.log.messages_out]
    assert sent[1] == {"session_id": "s-1", "type": "listen", "state": "detect", "text": "hello turnkeeper"}
    assert sent[-1] == {"session_id": "s-1", "type": "listen", "state": "start", "mode": "auto"}


async def test_audio_that_arrives_while_the_device_is_not_speaking_is_dropped_as_the_firmware_drops_it(
    fake: FakeDeviceServer,
) -> None:
    fake.reply_ms = 1500
    async for url in serve(fake):
        async with DeviceSimulator(url, "tok") as sim:
            await sim.press()
            sim.say(tone(300, 16_000), 1)
            await sim.said()
            await sim.release()
            await sim.wait_audible(0.0, 5)
            await asyncio.sleep(0.3)
            await sim.press()  # abort + listen: the rest of the reply is not played
            await sim.wait_message(lambda m: m.get("type") == "tts" and m.get("state") == "stop", 5)
            await asyncio.sleep(0.2)
    listening = [p for p in sim.log.received if p.state == "listening"]
    assert all(p.segment is None for p in listening)
    assert all(p.segment is not None for p in sim.log.received if p.state == "speaking")


def made_up_call(stop_at: float | None, late: list[float], after_stop: list[float]) -> tuple[DeviceCallClient, DeviceSimulator]:
    """A device call put together by hand: the reply starts at 10.0 s, one
    60 ms packet of tone per 60 ms."""
    client = DeviceCallClient("ws://127.0.0.1:1/v1/devices/ws")
    sim = DeviceSimulator("ws://127.0.0.1:1/v1/devices/ws")
    sim.started_at, sim.downlink_rate = 9.0, 24_000
    sim.speaker = DeviceSpeaker(24_000)
    sim.log.messages_in.append((10.0, {"type": "tts", "state": "start"}))
    pkt = tone(60, 24_000)
    for k in range(17):  # arrivals 10.00 .. 10.96, played back to back 10.00 .. 11.02
        at = 10.0 + 0.06 * k
        sim.log.received.append(ReceivedPacket(at, 100, "speaking", sim.speaker.push(pkt, at), 1440, 0.06))
    for at in late:  # old audio the server sent after the press
        sim.log.received.append(ReceivedPacket(at, 100, "speaking", sim.speaker.push(pkt, at), 1440, 0.06))
    if stop_at is not None:
        sim.log.messages_in.append((stop_at, {"type": "tts", "state": "stop"}))
    for at in after_stop:  # and after tts stop: the device is idle and drops it
        sim.log.received.append(ReceivedPacket(at, 100, "idle", None, 1440, 0.06))
    client.sim = sim
    return client, sim


def test_the_stop_is_the_end_of_the_last_old_sound_the_speaker_played() -> None:
    client, sim = made_up_call(stop_at=11.02, late=[11.0], after_stop=[11.05, 11.11])
    m = BargeInMeasure(label="abort", at_s=0.5, initiator="abort", sent_from=10.99, onset_sent_at=10.99, sent_until=11.1)
    client._measure(sim, [m])
    last = sim.log.received[17].segment  # the late packet, queued behind the reply
    assert last is not None and m.silent_at == pytest.approx(last.start + 0.06)
    assert m.stop_ms == pytest.approx((last.start + 0.06 - 10.99) * 1000)
    assert m.received_stop_ms == pytest.approx(10.0)  # the late packet came 10 ms after the press
    assert m.tts_stop_ms == pytest.approx(30.0)
    assert m.old_audio_after_tts_stop_ms == pytest.approx(120.0)  # two 60 ms packets after tts stop
    assert m.barged_in and m.speaking_at_onset
    assert m.played_ms_at_ear == pytest.approx(990, abs=1)  # 10.00 .. 10.99 played before the press


def test_without_tts_stop_the_stop_is_where_a_silent_run_begins_or_not_measured() -> None:
    client, sim = made_up_call(stop_at=None, late=[], after_stop=[])
    m = BargeInMeasure(label="voice", at_s=0.5, initiator="abort", sent_from=10.5, onset_sent_at=10.5, sent_until=10.6)
    client._measure(sim, [m])
    assert m.tts_stop_ms is None and not m.barged_in
    assert m.silent_at is None  # nothing heard after the reply's end: no silent run to tell it by
    sim.log.messages_in.append((11.9, {"type": "tts", "state": "start"}))  # a later reply, after 800 ms of silence
    sim.log.received.append(ReceivedPacket(11.9, 100, "speaking", sim.speaker.push(tone(60, 24_000), 11.9), 1440, 0.06))
    m = BargeInMeasure(label="voice", at_s=0.5, initiator="abort", sent_from=10.5, onset_sent_at=10.5, sent_until=10.6)
    client._measure(sim, [m])
    # the queue ran dry at 11.02 (17 packets of 60 ms from 10.00): the sound ended there, silence followed
    assert m.silent_at == pytest.approx(11.02, abs=0.002) and m.stop_ms == pytest.approx(520, abs=2)
