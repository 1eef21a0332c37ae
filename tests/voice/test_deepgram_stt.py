"""Deepgram live recognition (voice.deepgram_stt) against a local Deepgram
server (testkit.fake_deepgram: real WebSockets, Deepgram's messages and
quirks, transcripts by pocketsphinx with the test grammar, so they are
exact): what goes over the wire, the events that come back, every failure
kind, and the session's Transcription on top (reconnect with replay,
fallback to the embedded recogniser)."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import free_port, start_app

from clock import SystemClock
from media.frames import load_pcm
from testkit.fake_deepgram import FakeDeepgram, FakeDeepgramOptions
from testkit.stt_backend import Latency, SpeechDetector, SttBackend
from voice import deepgram_stt
from voice.deepgram_stt import DeepgramRecogniser, DeepgramStream, listen_url
from voice.pocketsphinx_stt import PocketsphinxConfig, PocketsphinxSTT
from voice.recognisers import SttConfig, build_recognisers
from voice.recognition import (
    EndOfUtterance,
    Final,
    Interim,
    RecognitionError,
    RecognitionEvent,
    RecognitionUsage,
    SpeechStarted,
    StreamOptions,
)
from voice.stt_failover import Failover
from voice.transcription import Transcription
from voice.whisper_stt import WhisperSTT

pytestmark = pytest.mark.asyncio(loop_scope="module")

FRAME = 640  # 20 ms at 16 kHz s16
#: fast answers for the tests (the defaults are 150/300 ms)
FAST = Latency(interim_s=0.05, final_s=0.1)


def silence(seconds: float) -> bytes:
    return bytes(int(seconds * 50) * FRAME)


def frames(pcm: bytes) -> list[bytes]:
    return [pcm[i:i + FRAME] for i in range(0, len(pcm), FRAME)]


def endpoint_cut(pcm: bytes, endpointing_s: float = 0.3) -> int:
    """Where Deepgram's (the fake's) endpointing ends the first utterance in
    ``pcm``: the byte after the frame that completes ``endpointing_s`` of
    silence after speech (the same webrtcvad over the same frames)."""
    vad = SpeechDetector(FakeDeepgramOptions().vad_aggressiveness)
    in_speech, quiet = False, 0.0
    for i, f in enumerate(frames(pcm)):
        ((voiced, _),) = vad.feed(f)
        if voiced:
            in_speech, quiet = True, 0.0
        elif in_speech:
            quiet += 0.02
            if quiet >= endpointing_s - 1e-6:
                return (i + 1) * FRAME
    raise AssertionError("no endpoint in the audio")


@pytest.fixture(scope="module")
def speech(say: Callable[..., Path]) -> Callable[[str], bytes]:
    """``speech(phrase)``: the phrase spoken by espeak-ng, 16 kHz s16 (whole frames)."""
    cache: dict[str, bytes] = {}

    def _get(phrase: str) -> bytes:
        if phrase not in cache:
            pcm = load_pcm(say(phrase), 16000)
            cache[phrase] = pcm[: len(pcm) // FRAME * FRAME]
        return cache[phrase]

    return _get


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(grammar_file: Path) -> AsyncIterator[SttBackend]:
    b = SttBackend(str(grammar_file), max_decoders=2)
    await b.start()
    yield b
    await b.aclose()


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def embedded(grammar_file: Path) -> AsyncIterator[PocketsphinxSTT]:
    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file, max_decoders=1))
    await stt.start()
    yield stt
    await stt.aclose()


@dataclass
class Rig:
    """One fake Deepgram on loopback and the recognisers made for it."""

    fake: FakeDeepgram
    url: str
    recognisers: list[DeepgramRecogniser] = field(default_factory=list)

    def recogniser(self, **settings: Any) -> DeepgramRecogniser:
        settings.setdefault("api_key", "sekrit")
        rec = DeepgramRecogniser(SttConfig(provider="deepgram", base_url=self.url, **settings))
        self.recognisers.append(rec)
        return rec


@pytest_asyncio.fixture(loop_scope="module")
async def rig(backend: SttBackend) -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []
    rigs: list[Rig] = []

    async def _start(**options: Any) -> Rig:
        options.setdefault("api_key", "sekrit")
        options.setdefault("latency", FAST)
        fake = FakeDeepgram(backend, FakeDeepgramOptions(**options))
        runner, url = await start_app(fake.app())
        runners.append(runner)
        rigs.append(Rig(fake, url))  # http://: the client maps it to ws://
        return rigs[-1]

    yield _start
    for r in rigs:
        for rec in r.recognisers:
            await rec.aclose()
    for runner in runners:
        await runner.cleanup()


class Events:
    """Reads a stream's events in the background."""

    def __init__(self, stream: DeepgramStream) -> None:
        self.items: list[RecognitionEvent] = []
        self.error: RecognitionError | None = None
        self.ended = asyncio.Event()
        self._task = asyncio.ensure_future(self._read(stream))

    async def _read(self, stream: DeepgramStream) -> None:
        try:
            async for ev in stream.events():
                self.items.append(ev)
        except RecognitionError as exc:
            self.error = exc
        finally:
            self.ended.set()

    async def until(self, check: Callable[[list[RecognitionEvent]], bool], timeout: float = 5.0) -> None:
        async with asyncio.timeout(timeout):
            while not check(self.items):
                if self.ended.is_set():
                    raise AssertionError(f"the stream ended first: {self.error!r}, {self.items}")
                await asyncio.sleep(0.01)

    async def failure(self, timeout: float = 5.0) -> RecognitionError:
        async with asyncio.timeout(timeout):
            await self.ended.wait()
        assert self.error is not None, f"no error; events: {self.items}"
        return self.error

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.items if isinstance(e, kind)]


async def send_paced(stream: DeepgramStream, pcm: bytes, speed: float = 4.0) -> None:
    """20 ms frames, ``speed`` times faster than real time."""
    for f in frames(pcm):
        stream.send(f)
        await asyncio.sleep(0.02 / speed)


# -- the wire ---------------------------------------------------------------------


async def test_probe_query_and_auth_on_the_wire(rig: Callable[..., Any]) -> None:
    r = await rig()
    rec = r.recogniser(keyterms=["coffee", "latte art"], language="en-GB", endpointing_ms=450, utterance_end_ms=1200)
    await rec.start()
    probe = r.fake.attempts[0]
    assert probe.path == "/v1/listen" and probe.status == 101
    assert probe.headers["Authorization"] == "Token sekrit"  # Token, not Bearer
    assert probe.query == [
        ("model", "nova-3"), ("language", "en-GB"), ("encoding", "linear16"), ("sample_rate", "16000"),
        ("channels", "1"), ("interim_results", "true"), ("endpointing", "450"), ("utterance_end_ms", "1200"),
        ("vad_events", "true"), ("punctuate", "true"), ("keyterm", "coffee"), ("keyterm", "latte art"),
    ]
    conn = r.fake.connections[0]
    await asyncio.wait_for(conn.ended.wait(), 2)
    assert conn.controls == ["CloseStream"] and conn.audio_bytes == 0  # nothing billed
    assert conn.sent_of("Metadata")[0]["duration"] == 0 and conn.closed_with == (1000, "")
    assert rec.refused is None

    # an older model takes keywords; no utterance_end_ms without interim results; no key, no header
    old = r.recogniser(model="nova-2-general", keyterms=["coffee"], interim_results=False, api_key="")
    r.fake.options.api_key = None
    await old.start()
    q = r.fake.attempts[-1]
    assert q.param("keywords") == "coffee" and q.param("keyterm") is None
    assert q.param("interim_results") == "false" and q.param("utterance_end_ms") is None
    assert "Authorization" not in q.headers


async def test_the_fake_refuses_as_deepgram_does(rig: Callable[..., Any]) -> None:
    """The fake's upgrade checks (what the client's tests rely on): raw audio
    needs encoding and sample_rate (400); a wrong key is 401 with dg-error."""
    r = await rig()
    ws_url = r.url.replace("http://", "ws://") + "/v1/listen"
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as bad:
            await http.ws_connect(ws_url + "?model=nova-3", headers={"Authorization": "Token sekrit"})
        assert bad.value.status == 400
        with pytest.raises(aiohttp.WSServerHandshakeError) as wrong:
            await http.ws_connect(ws_url + "?encoding=linear16&sample_rate=16000", headers={"Authorization": "Bearer sekrit"})
        assert wrong.value.status == 401 and wrong.value.headers is not None and wrong.value.headers["dg-error"]
    assert [a.status for a in r.fake.attempts] == [400, 401] and r.fake.connections == []


async def test_listen_url_maps_schemes_and_paths() -> None:
    def url(base: str) -> str:
        return str(listen_url(SttConfig(provider="deepgram", base_url=base)).with_query(None))

    assert url("") == "wss://api.deepgram.com/v1/listen"
    assert url("https://dg.example.com/") == "wss://dg.example.com/v1/listen"
    assert url("http://127.0.0.1:8098") == "ws://127.0.0.1:8098/v1/listen"
    assert url("ws://h:1/v1") == "ws://h:1/v1/listen"
    assert url("wss://h/v1/listen") == "wss://h/v1/listen"


async def test_a_phrase_end_to_end(rig: Callable[..., Any], speech: Callable[[str], bytes], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.DEBUG, logger="voice.deepgram_stt")
    r = await rig()
    rec = r.recogniser()
    stream = rec.open(StreamOptions(session_id="s1"))
    ev = Events(stream)
    phrase = speech("tell me a story")
    pcm = silence(0.3) + phrase + silence(1.4)  # > utterance_end_ms of quiet after the last word
    await send_paced(stream, pcm)
    await ev.until(lambda items: any(isinstance(e, EndOfUtterance) for e in items) and len(ev.of(EndOfUtterance)) >= 2)
    stream.finalize()
    await ev.until(lambda items: any(isinstance(e, Final) and e.finalized for e in items))
    await stream.aclose()
    await asyncio.wait_for(ev.ended.wait(), 1)
    assert ev.error is None
    total_s = len(pcm) / 32000

    # SpeechStarted (Deepgram's VAD), interims, the endpointed final, its end, UtteranceEnd, the Finalize answer, usage
    kinds = [type(e).__name__ for e in ev.items]
    assert kinds[0] == "SpeechStarted" and 0.25 <= ev.items[0].at_s <= 0.6  # type: ignore[union-attr]
    interims = ev.of(Interim)
    assert interims and all(i.text for i in interims) and interims[-1].text == "Tell me a story"
    finals = ev.of(Final)
    spoken, answer = finals
    assert spoken.text == "Tell me a story." and not spoken.finalized
    assert [w.text for w in spoken.words] == ["Tell", "me", "a", "story."]  # punctuated_word
    assert 0.25 <= spoken.words[0].start_s < spoken.words[-1].end_s <= spoken.end_s
    assert all(w.confidence is not None and 0 <= w.confidence <= 1 for w in spoken.words)
    assert spoken.start_s == 0 and spoken.end_s == pytest.approx(endpoint_cut(pcm) / 32000, abs=0.002)
    speech_final, utterance_end = ev.of(EndOfUtterance)
    assert kinds.index("EndOfUtterance") == kinds.index("Final") + 1
    assert speech_final.at_s == spoken.end_s
    assert utterance_end.at_s == pytest.approx(spoken.words[-1].end_s, abs=0.002)  # last_word_end
    assert answer.text == "" and answer.finalized and answer.start_s == spoken.end_s
    assert answer.end_s == pytest.approx(total_s, abs=0.002)
    assert kinds[-1] == "RecognitionUsage"
    assert ev.items[-1] == RecognitionUsage(audio_s=pytest.approx(total_s, abs=0.002), source="provider")  # type: ignore[arg-type]

    conn = r.fake.connections[0]
    assert conn.audio_bytes == len(pcm)  # every byte, once
    assert conn.controls == ["Finalize", "CloseStream"]
    assert conn.sent[-1]["type"] == "Metadata" and conn.closed_with == (1000, "")  # Metadata before the close
    assert stream.request_id == conn.request_id
    assert any(conn.request_id in rec_.getMessage() for rec_ in caplog.records)  # dg-request-id logged at debug
    await stream.aclose()  # idempotent


async def test_finalize_and_discard_send_finalize_only_after_audio(rig: Callable[..., Any], speech: Callable[[str], bytes]) -> None:
    r = await rig()
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    stream.finalize()  # nothing sent yet: nothing owed
    stream.send(silence(0.2))
    stream.discard()  # not speech: Deepgram cannot drop it, so Finalize
    stream.discard()
    stream.finalize()  # nothing since: nothing sent
    stream.send(speech("hello there") + silence(0.1))
    stream.finalize()
    await ev.until(lambda items: len([e for e in items if isinstance(e, Final) and e.finalized]) == 2)
    await stream.aclose()
    conn = r.fake.connections[0]
    assert conn.controls == ["Finalize", "Finalize", "CloseStream"]
    discarded, *heard = ev.of(Final)
    assert discarded == Final("", 0.0, 0.2, confidence=0.0, finalized=True)
    # espeak's own trailing silence lets Deepgram's endpointing end it first; the Finalize answers the rest
    assert " ".join(f.text for f in heard if f.text) == "Hello there." and heard[0].start_s == pytest.approx(0.2)
    assert heard[-1].finalized and heard[-1].end_s == pytest.approx(conn.audio_s)
    # audio queued together goes out in as few frames as it fits (no pacing, no added delay)
    assert len([1 for _, kind, _ in conn.received if kind == "audio"]) <= 3


async def test_keepalive_only_while_no_audio_is_sent(rig: Callable[..., Any]) -> None:
    r = await rig(idle_close_s=0.8)
    stream = r.recogniser(keepalive_s=0.2).open(StreamOptions())
    ev = Events(stream)
    stream.send(silence(0.1))
    await asyncio.sleep(1.0)  # longer than the idle close: KeepAlive holds it open
    conn = r.fake.connections[0]
    quiet = conn.times("KeepAlive")
    assert len(quiet) >= 3 and conn.closed_with is None
    gaps = [b - a for a, b in zip(quiet, quiet[1:], strict=False)]
    assert all(0.15 <= g <= 0.6 for g in gaps), gaps
    before = len(quiet)
    t0 = time.monotonic()
    await send_paced(stream, silence(0.6), speed=1.0)  # audio flowing: no KeepAlive
    during = [t for t in conn.times("KeepAlive") if t > t0 + 0.25]
    assert len(conn.times("KeepAlive")) - before <= 1 and not during
    await stream.aclose()
    assert ev.error is None and conn.controls[-1] == "CloseStream"
    assert all(isinstance(m, str) or m.get("type") != "KeepAlive" for m in conn.sent)  # no reply to KeepAlive


async def test_idle_close_is_a_closed_error(rig: Callable[..., Any]) -> None:
    r = await rig(idle_close_s=0.3)
    stream = r.recogniser(keepalive_s=9).open(StreamOptions())
    ev = Events(stream)
    err = await ev.failure()
    assert err.kind == "closed" and err.retryable
    assert "1011" in str(err) and "NET-0001" in str(err)
    assert r.fake.connections[0].closed_with is not None and r.fake.connections[0].closed_with[0] == 1011
    stream.send(silence(0.1))  # a failed stream ignores everything, never raises
    stream.finalize()
    await stream.aclose()


# -- refusals and connection failures ------------------------------------------------


async def test_a_refused_key_is_one_warning_and_later_streams_fail_at_once(
    rig: Callable[..., Any], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="voice.deepgram_stt")
    r = await rig(api_key="right")
    rec = r.recogniser(api_key="wrong")
    await rec.start()
    await rec.start()  # idempotent: no second line
    warnings = [x for x in caplog.records if x.name == "voice.deepgram_stt" and x.levelno >= logging.WARNING]
    assert len(warnings) == 1 and warnings[0].exc_info is None
    line = warnings[0].getMessage()
    assert line.startswith("stt.api_key was refused by Deepgram (401 Unauthorized") and "fallback recogniser" in line
    assert [a.status for a in r.fake.attempts] == [401, 401]
    assert r.fake.attempts[0].headers["Authorization"] == "Token wrong"
    for _ in range(3):
        ev = Events(rec.open(StreamOptions()))
        err = await ev.failure(timeout=0.5)
        assert err.kind == "unauthorized" and not err.retryable and "stt.api_key" in str(err)
    assert len(r.fake.attempts) == 2  # no connection tried per stream
    assert len([x for x in caplog.records if x.levelno >= logging.WARNING]) == 1

    r.fake.options.api_key = "wrong"  # the key is now good: a successful start clears the refusal
    await rec.start()
    assert rec.refused is None
    stream = rec.open(StreamOptions())
    ev = Events(stream)
    stream.send(silence(0.1))
    await stream.aclose()
    assert ev.error is None and r.fake.connections[-1].audio_bytes == 3200


async def test_403_on_a_stream_is_unauthorized_and_logged_once(rig: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="voice.deepgram_stt")
    r = await rig(refuse_status=403)
    rec = r.recogniser(fallback="none")
    errors = [await Events(rec.open(StreamOptions())).failure() for _ in range(2)]
    assert [e.kind for e in errors] == ["unauthorized", "unauthorized"] and "403 Forbidden" in str(errors[0])
    warnings = [x.getMessage() for x in caplog.records if x.levelno >= logging.WARNING]
    assert len(warnings) == 1 and "stt.api_key" in warnings[0] and "stt.fallback is none" in warnings[0]
    assert len(r.fake.attempts) == 1


async def test_unreachable_deepgram(rig: Callable[..., Any], caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="voice.deepgram_stt")
    # nothing listening: start() logs one line and does not raise; streams fail "unreachable"
    rec = DeepgramRecogniser(SttConfig(provider="deepgram", base_url=f"ws://127.0.0.1:{free_port()}", api_key="k"))
    try:
        await rec.start()
        lines = [x for x in caplog.records if x.name == "voice.deepgram_stt"]
        assert len(lines) == 1 and lines[0].levelno == logging.INFO and "not reachable" in lines[0].getMessage()
        err = await Events(rec.open(StreamOptions())).failure()
        assert err.kind == "unreachable" and err.retryable
    finally:
        await rec.aclose()
    # an HTTP error other than 401/403 on the upgrade
    r = await rig(refuse_status=503)
    err = await Events(r.recogniser().open(StreamOptions())).failure()
    assert err.kind == "unreachable" and "503" in str(err)
    # an upgrade that does not come in time
    r = await rig(accept_delay_s=1.0)
    t0 = time.monotonic()
    err = await Events(r.recogniser(connect_timeout_s=0.3).open(StreamOptions())).failure()
    assert err.kind == "unreachable" and "0.3 s" in str(err) and time.monotonic() - t0 < 0.9


async def test_a_dropped_connection_is_dropped(rig: Callable[..., Any], speech: Callable[[str], bytes]) -> None:
    r = await rig(drop_after_s=0.5)
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    await send_paced(stream, silence(0.2) + speech("count to twenty"), speed=8)
    err = await ev.failure()
    assert err.kind == "dropped" and err.retryable
    assert r.fake.connections[0].closed_with == (0, "aborted")
    await stream.aclose()


async def test_an_error_message_is_a_provider_error(rig: Callable[..., Any]) -> None:
    r = await rig(error_message="Failed to process audio: DATA-0000")
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    stream.send(silence(0.1))
    err = await ev.failure()
    assert err.kind == "provider" and "DATA-0000" in str(err)
    await stream.aclose()


SPEECH_STARTED = json.dumps({"type": "SpeechStarted", "channel": [0, 1], "timestamp": 0.5})


def results(**fields: Any) -> str:
    msg: dict[str, Any] = {"type": "Results", "start": 0.0, "duration": 1.0, "is_final": True,
                           "channel": {"alternatives": [{"transcript": "hi", "words": []}]}}
    msg.update(fields)
    return json.dumps(msg)


@pytest.mark.parametrize(("frame", "says"), [
    ("<html><body>502 Bad Gateway</body></html>", "not JSON"),
    ("[1, 2, 3]", "not an object"),
    ('{"channel": {"alternatives": []}}', "without a type"),
    (results(channel={"alternatives": "hi"}), "alternatives is not a list"),
    (results(channel="hi"), "channel is not an object"),
    (results(start="0.5"), "start="),
    (results(duration=-1), "duration="),
    (results(is_final="yes"), "is_final="),
    (results(channel={"alternatives": [{"transcript": 7}]}), "transcript is not a string"),
    (results(channel={"alternatives": [{"transcript": "hi", "words": [{"word": "hi", "start": "x", "end": 1}]}]}), "start="),
    (json.dumps({"type": "SpeechStarted", "channel": [0, 1]}), "timestamp="),
    (json.dumps({"type": "UtteranceEnd", "channel": [0, 1], "last_word_end": "late"}), "last_word_end="),
    (b"\x00\x01binary", "binary frame"),
    (json.dumps({"type": "Results", "padding": "x" * (2 * 1024 * 1024)}), "bad WebSocket message"),
    ("[" * 200_000, "not JSON"),  # nested beyond Python's recursion limit (a reviewer's find: it ended the stream silently)
], ids=["not-json", "array", "no-type", "alternatives-not-list", "channel-string", "start-string", "negative-duration",
        "is-final-string", "transcript-number", "word-start-string", "speech-started-no-timestamp",
        "utterance-end-string", "binary-frame", "2-MB-message", "deeply-nested"])
async def test_answers_that_are_not_the_protocol(rig: Callable[..., Any], frame: str | bytes, says: str) -> None:
    r = await rig(inject=[(0.0, SPEECH_STARTED), (0.0, frame)])
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    err = await ev.failure()
    assert err.kind == "protocol" and says in str(err), str(err)
    assert ev.items == [SpeechStarted(0.5)]  # what came before the bad answer is kept
    stream.send(silence(0.1))  # ignored, never raises
    await stream.aclose()


async def test_garbage_mid_stream_knob(rig: Callable[..., Any]) -> None:
    r = await rig(garbage_after_s=0.2)
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    await send_paced(stream, silence(0.4), speed=8)
    err = await ev.failure()
    assert err.kind == "protocol" and "502 Bad Gateway" in str(err)
    await stream.aclose()


async def test_shapes_deepgram_may_send_are_tolerated(rig: Callable[..., Any]) -> None:
    tolerated = [
        json.dumps({"type": "SpeechStarted", "channel": [0, 1], "timestamp": 0.25}),
        json.dumps({"type": "SpeechStarted", "channel": {"index": 0}, "timestamp": 0.5}),  # channel as an object
        json.dumps({"type": "SomethingNew", "channel": [0, 1]}),  # unknown: skipped
        json.dumps({"type": "Warning", "description": "slow down", "warn_msg": "slow down"}),
        # an interim with an empty transcript is no event; Results without optional fields
        json.dumps({"type": "Results", "start": 0.0, "duration": 0.5, "is_final": False,
                    "channel": {"alternatives": [{"transcript": ""}]}}),
        json.dumps({"type": "Results", "start": 0.0, "duration": 0.7, "channel": {"alternatives": [{"transcript": "front"}]}}),
        json.dumps({"type": "Results", "start": 0.0, "duration": 1.0, "is_final": True,
                    "channel": [{"alternatives": [{"transcript": "front left", "confidence": 0.97,
                                                   "words": [{"word": "front", "start": 0.1, "end": 0.4},
                                                             {"word": "left", "start": 0.4, "end": 0.8,
                                                              "punctuated_word": "left.", "confidence": 0.9}]}]}]}),
        json.dumps({"type": "Results", "start": 1.0, "duration": 0.2, "is_final": True, "speech_final": True,
                    "from_finalize": True, "channel": {"alternatives": []}}),
        json.dumps({"type": "UtteranceEnd", "channel": [0, 1], "last_word_end": 0.8}),
        json.dumps({"type": "Metadata", "request_id": "x"}),  # no duration: no usage
    ]
    r = await rig(inject=[(0.0, f) for f in tolerated])
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    await ev.until(lambda items: any(isinstance(e, EndOfUtterance) and e.at_s == 0.8 for e in items))
    await stream.aclose()
    assert ev.error is None
    words = ev.items[3].words  # type: ignore[union-attr]
    assert ev.items == [
        SpeechStarted(0.25),
        SpeechStarted(0.5),
        Interim("front", 0.0, 0.7),
        Final("front left", 0.0, 1.0, words=words, confidence=0.97),
        Final("", 1.0, 1.2, finalized=True),
        EndOfUtterance(1.2),
        EndOfUtterance(0.8),
        RecognitionUsage(audio_s=0.0),  # the real closing Metadata (no audio was sent)
    ]
    assert [(w.text, w.start_s, w.end_s, w.confidence) for w in words] == [("front", 0.1, 0.4, None), ("left.", 0.4, 0.8, 0.9)]


EMPTY_FINALIZE = pytest.mark.parametrize("answered", [True, False], ids=["empty-finalize-answered", "empty-finalize-unanswered"])
TIMING = pytest.mark.parametrize("after_final", [False, True], ids=["finalize-at-once", "finalize-after-the-final"])


@EMPTY_FINALIZE
@TIMING
async def test_finalize_with_nothing_left_verify_both(
    rig: Callable[..., Any], speech: Callable[[str], bytes], answered: bool, after_final: bool
) -> None:
    """VERIFY (reference 1.1): whether Deepgram answers a Finalize that has
    no audio left to finalize (its endpointing already ended it all). Both
    are taken: sent before the final came, the endpointed final itself
    answers it (and an empty from_finalize final may follow); once the
    final has come, no Finalize is sent and the client gives the empty
    finalized final itself."""
    r = await rig(answer_empty_finalize=answered)
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    pcm = silence(0.2) + speech("please order a coffee") + silence(0.6)
    cut = endpoint_cut(pcm)
    end_s = cut / 32000
    stream.send(pcm[:cut])  # up to where Deepgram's endpointing ends it
    if after_final:
        await ev.until(lambda items: any(isinstance(e, Final) for e in items))
    stream.finalize()
    await ev.until(lambda items: any(isinstance(e, Final) and e.text for e in items))
    await asyncio.sleep(0.3)
    spoken, *rest = ev.of(Final)
    assert spoken.text == "Please order a coffee." and spoken.end_s == pytest.approx(end_s)
    if after_final:
        assert rest == [Final("", end_s, end_s, finalized=True)]  # made by the client at once
        assert r.fake.connections[0].controls == []
    else:
        assert rest == ([Final("", end_s, end_s, confidence=0.0, finalized=True)] if answered else [])
        assert r.fake.connections[0].controls == ["Finalize"]
    await stream.aclose()


async def test_audio_before_the_connection_is_buffered_and_bounded(
    rig: Callable[..., Any], speech: Callable[[str], bytes], monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(deepgram_stt, "MAX_BUFFER_S", 2.5)  # 30 s in production
    r = await rig(accept_delay_s=0.3)
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    lead = silence(3.0)
    said = speech("charge my card") + silence(0.1)
    for f in frames(lead + said):  # all of it before the connection is up
        stream.send(f)
    stream.finalize()
    await ev.until(lambda items: any(isinstance(e, Final) and e.finalized for e in items))
    await stream.aclose()
    conn = r.fake.connections[0]
    dropped_s = (len(lead + said) - 2.5 * 32000) / 32000
    assert conn.audio_s == pytest.approx(2.5)  # the oldest audio was dropped
    final = [e for e in ev.of(Final) if e.finalized][-1]
    heard = " ".join(f.text for f in ev.of(Final) if f.text)
    assert heard == "Charge my card."
    wire = [w for m in conn.sent_of("Results") if m["is_final"] for w in m["channel"]["alternatives"][0]["words"]]
    # stream seconds: Deepgram's times shifted back by what was dropped before they were sent
    assert final.end_s == pytest.approx(len(lead + said) / 32000, abs=0.002)
    words = [w for f in ev.of(Final) for w in f.words]
    assert words[0].start_s == pytest.approx(wire[0]["start"] + dropped_s, abs=0.002)
    assert words[0].start_s >= 3.0
    assert any("dropped" in x.getMessage() for x in caplog.records if x.levelno == logging.WARNING)


async def test_close_is_bounded_when_deepgram_hangs_and_cancel_closes_at_once(rig: Callable[..., Any]) -> None:
    r = await rig(hang_after_s=0.0)
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    stream.send(silence(0.2))
    await asyncio.sleep(0.2)
    t0 = time.monotonic()
    await stream.aclose()
    took = time.monotonic() - t0
    assert deepgram_stt.CLOSE_TIMEOUT_S - 0.1 <= took <= deepgram_stt.CLOSE_TIMEOUT_S + 0.8
    await asyncio.wait_for(ev.ended.wait(), 0.5)
    assert ev.error is None  # a close we asked for: events end normally
    assert r.fake.connections[0].controls == ["CloseStream"]

    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    stream.send(silence(0.2))
    await asyncio.sleep(0.2)
    closing = asyncio.ensure_future(stream.aclose())
    await asyncio.sleep(0.1)
    t0 = time.monotonic()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.wait_for(r.fake.connections[1].ended.wait(), 1.0)  # the socket is gone
    assert time.monotonic() - t0 < 0.6
    await asyncio.wait_for(ev.ended.wait(), 0.5)


# -- the session's transcription on top ------------------------------------------------


class Notices:
    def __init__(self) -> None:
        self.items: list[tuple[str, str, str, str | None]] = []

    def __call__(self, failed: str, error: RecognitionError, action: str, nxt: str | None) -> None:
        self.items.append((failed, error.kind, action, nxt))


async def transcribe(
    failover: Failover, pcm_before: bytes, pcm: bytes, pcm_after: bytes, *, final_timeout_s: float = 4.0,
    speed: float = 1.0, until: Callable[[Transcription], bool] | None = None,
) -> tuple[str, Transcription, Notices, float]:
    """Run ``pcm`` through a Transcription as the session does: begin an
    utterance, feed 20 ms frames (silence before and after), finish.
    Returns the text, the transcription (closed), the failover notices and
    how long finish() took, s."""
    notices = Notices()
    t = Transcription(failover, StreamOptions(session_id="t"), clock=SystemClock(), final_timeout_s=final_timeout_s,
                      on_failover=notices)
    run = asyncio.ensure_future(t.run())
    try:
        await asyncio.sleep(0)
        utt = t.begin()
        for f in frames(pcm_before + pcm + pcm_after):
            utt.feed(f)
            await asyncio.sleep(0.02 / speed)
        if until is not None:
            async with asyncio.timeout(5):
                while not until(t):
                    await asyncio.sleep(0.01)
        t0 = time.monotonic()
        async with asyncio.timeout(10):
            text = await utt.finish()
        took = time.monotonic() - t0
        assert utt.usage()[0].audio_s > 0
    finally:
        t.close()
        await asyncio.wait_for(run, 5)
    return text, t, notices, took


async def test_transcription_hears_a_phrase_through_deepgram(rig: Callable[..., Any], speech: Callable[[str], bytes]) -> None:
    r = await rig(latency=Latency())  # Deepgram-like timing: interim 150 ms, final 300 ms
    rec = r.recogniser()
    await rec.start()
    phrase = speech("tell me a story")
    text, t, notices, took = await transcribe(Failover(rec), silence(0.4), phrase, silence(0.7))
    assert text == "Tell me a story." and notices.items == []
    assert took < 1.0  # Finalize answered at once (300 ms latency), no timeout
    conn = r.fake.connections[-1]
    sent_s = (len(phrase) + 1.1 * 32000) / 32000
    assert conn.audio_s == pytest.approx(sent_s) and conn.controls == ["Finalize", "CloseStream"]
    usage = t.usage()
    assert usage.audio_s["deepgram"] == pytest.approx(sent_s)
    assert usage.reported_audio_s["deepgram"] == pytest.approx(sent_s, abs=0.002)  # the closing Metadata was read


@pytest.mark.parametrize(("fault", "kind"), [
    ({"drop_after_s": 0.9}, "dropped"),
    ({"garbage_after_s": 0.9}, "protocol"),
    ({"error_message": "Internal server error, please retry", "error_after_s": 0.9}, "provider"),
], ids=["drop", "garbage", "error-message"])
async def test_transcription_reconnects_and_replays_after_a_failure(
    rig: Callable[..., Any], speech: Callable[[str], bytes], fault: dict[str, Any], kind: str
) -> None:
    r = await rig(**fault)  # the first connection fails mid-utterance, the next one is fine
    rec = r.recogniser()
    phrase = speech("what is the weather like today")
    text, _, notices, _ = await transcribe(Failover(rec), silence(0.3), phrase, silence(0.6), speed=2.0)
    assert text == "What is the weather like today."
    assert notices.items == [("deepgram", kind, "reconnect", "deepgram")]
    first, second = r.fake.connections
    assert 0.9 <= first.audio_s < 1.3
    if kind == "dropped":
        assert first.closed_with == (0, "aborted")
    total_s = (len(phrase) + 0.9 * 32000) / 32000
    assert second.audio_s == pytest.approx(total_s)  # the whole utterance again: nothing was final yet
    assert second.controls == ["Finalize", "CloseStream"]


async def test_transcription_falls_back_when_the_key_is_refused(
    rig: Callable[..., Any], speech: Callable[[str], bytes], embedded: PocketsphinxSTT, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="voice.deepgram_stt")
    r = await rig(api_key="right")
    rec = r.recogniser(api_key="wrong")
    await rec.start()  # the server's start: one line
    text, _, notices, _ = await transcribe(Failover(rec, embedded), silence(0.3), speech("tell me a story"), silence(0.5), speed=4.0)
    assert text == "tell me a story"  # pocketsphinx's
    assert notices.items == [("deepgram", "unauthorized", "fallback", "pocketsphinx")]
    assert len(r.fake.attempts) == 1 and r.fake.connections == []  # the refusal was remembered: no retry
    mine = [x for x in caplog.records if x.name == "voice.deepgram_stt" and x.levelno >= logging.WARNING]
    assert len(mine) == 1 and "stt.api_key" in mine[0].getMessage()


@EMPTY_FINALIZE
@TIMING
async def test_transcription_when_finalize_has_nothing_left(
    rig: Callable[..., Any], speech: Callable[[str], bytes], answered: bool, after_final: bool
) -> None:
    """VERIFY both ways with the session's side: the endpointed final
    already covers all the audio when our endpointing finalizes; the
    utterance completes at once, whether Deepgram answers an empty
    Finalize or not, and whether its final came before our finalize or not."""
    r = await rig(answer_empty_finalize=answered)
    rec = r.recogniser()
    pcm = silence(0.2) + speech("count to twenty") + silence(0.6)
    cut = endpoint_cut(pcm)
    text, _, notices, took = await transcribe(
        Failover(rec), b"", pcm[:cut], b"", final_timeout_s=1.0, speed=4.0,
        until=(lambda t: t.provider_end_at is not None) if after_final else None,  # the speech_final final has come
    )
    assert text == "Count to twenty."
    assert notices.items == [] and took < 0.5


async def test_build_recognisers_makes_this_one() -> None:
    primary, fallback = build_recognisers(SttConfig(provider="deepgram", api_key="k"))
    assert isinstance(primary, DeepgramRecogniser) and primary.name == "deepgram"
    assert isinstance(fallback, WhisperSTT)  # the embedded default
    assert primary.pricing == SttConfig(provider="deepgram").pricing
    _, light = build_recognisers(SttConfig(provider="deepgram", api_key="k", embedded="pocketsphinx"))
    assert isinstance(light, PocketsphinxSTT)


async def test_aclose_while_connecting_still_sends_what_was_queued(rig: Callable[..., Any]) -> None:
    """aclose() before the connection is up: the audio queued and CloseStream
    go once it is (nothing lost, its usage read), within the close bound."""
    r = await rig(accept_delay_s=0.4)
    stream = r.recogniser().open(StreamOptions())
    ev = Events(stream)
    stream.send(silence(0.1))
    t0 = time.monotonic()
    await stream.aclose()
    assert time.monotonic() - t0 < 1.0
    await asyncio.wait_for(ev.ended.wait(), 0.5)
    # its last final, then its usage
    assert ev.error is None and ev.items == [Final("", 0.0, 0.1, confidence=0.0), RecognitionUsage(audio_s=0.1)]
    assert r.fake.connections[0].controls == ["CloseStream"] and r.fake.connections[0].audio_bytes == 3200

    # a connection that cannot be made: aclose ends at once, events end without an error
    rec = DeepgramRecogniser(SttConfig(provider="deepgram", base_url=f"ws://127.0.0.1:{free_port()}"))
    try:
        stream = rec.open(StreamOptions())
        ev = Events(stream)
        stream.send(silence(0.1))
        t0 = time.monotonic()
        await stream.aclose()
        assert time.monotonic() - t0 < 0.5
        await asyncio.wait_for(ev.ended.wait(), 0.5)
        assert ev.error is None and ev.items == []
    finally:
        await rec.aclose()
