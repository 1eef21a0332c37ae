"""The OpenAI Realtime transcription client (voice.openai_realtime_stt)
against a real local server speaking the protocol (testkit.fake_openai_realtime:
OpenAI's GA and beta shapes and speaches' dialect, transcribing with the
embedded recogniser and a grammar, so transcripts are exact), and through
voice.transcription as the session uses it: what goes over the wire, the
exact transcripts and their stream seconds, usage, and every failure kind."""

from __future__ import annotations

import asyncio
import logging
import math
import signal
import sys
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from conftest import free_port, start_app

from clock import SystemClock
from media.frames import load_pcm
from testkit.fake_openai_realtime import FakeOpenAiRealtime
from testkit.stt_backend import Latency, SttBackend
from voice.openai_realtime_stt import (
    CLOSE_TIMEOUT_S,
    MAX_BUFFER_S,
    OpenAiRealtimeRecogniser,
    OpenAiRealtimeStream,
    guess_shape,
    realtime_url,
)
from voice.pocketsphinx_stt import PocketsphinxConfig, PocketsphinxSTT
from voice.recognisers import SttConfig
from voice.recognition import (
    EndOfUtterance,
    Final,
    Interim,
    RecognitionError,
    RecognitionEvent,
    RecognitionUsage,
    SpeechStarted,
    StreamOptions,
    language_code,
)
from voice.stt_failover import Failover
from voice.transcription import Transcription

pytestmark = pytest.mark.asyncio(loop_scope="module")

LOGGER = "voice.openai_realtime_stt"
FAST = Latency(0.05, 0.1)


# -- fixtures and helpers --------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(grammar_file: Path) -> AsyncIterator[SttBackend]:
    b = SttBackend(str(grammar_file), max_decoders=2)
    await b.start()
    yield b
    await b.aclose()


@pytest.fixture(scope="module")
def speech(say: Callable[..., Path]) -> Callable[[str], bytes]:
    """``speech(text)``: espeak-ng saying ``text`` as 16 kHz mono s16."""
    cache: dict[str, bytes] = {}

    def _speech(text: str) -> bytes:
        if text not in cache:
            cache[text] = load_pcm(say(text), 16_000)
        return cache[text]

    return _speech


Serve = Callable[..., Awaitable[tuple[FakeOpenAiRealtime, str]]]


@pytest_asyncio.fixture(loop_scope="module")
async def serve(backend: SttBackend) -> AsyncIterator[Serve]:
    """``await serve(**knobs) -> (fake, base_url up to /v1)``."""
    runners: list[web.AppRunner] = []

    async def _serve(**knobs: Any) -> tuple[FakeOpenAiRealtime, str]:
        knobs.setdefault("latency", FAST)
        fake = FakeOpenAiRealtime(backend, **knobs)
        runner, url = await start_app(fake.app())
        runners.append(runner)
        return fake, url + "/v1"

    yield _serve
    for r in runners:
        await r.cleanup()


class Reader:
    """Reads a stream's events in the background."""

    def __init__(self, stream: OpenAiRealtimeStream) -> None:
        self.stream = stream
        self.events: list[RecognitionEvent] = []
        self.error: RecognitionError | None = None
        self.ended = False
        self._changed = asyncio.Event()
        self.task = asyncio.get_running_loop().create_task(self._run())

    async def _run(self) -> None:
        try:
            async for ev in self.stream.events():
                self.events.append(ev)
                self._changed.set()
            self.ended = True
        except RecognitionError as exc:
            self.error = exc
        finally:
            self._changed.set()

    async def wait(self, cond: Callable[[Reader], bool], timeout: float = 10.0) -> None:
        async with asyncio.timeout(timeout):
            while not cond(self):
                if self.error is not None:
                    raise AssertionError(f"the stream failed: {self.error.kind}: {self.error}")
                if self.ended:
                    raise AssertionError("the stream ended")
                self._changed.clear()
                await self._changed.wait()

    async def failure(self, timeout: float = 10.0) -> RecognitionError:
        async with asyncio.timeout(timeout):
            while self.error is None and not self.ended:
                self._changed.clear()
                await self._changed.wait()
        assert self.error is not None, f"no failure; events: {self.events}"
        return self.error

    def of(self, kind: type) -> list[Any]:
        return [e for e in self.events if isinstance(e, kind)]

    @property
    def finals(self) -> list[Final]:
        return self.of(Final)


Make = Callable[..., tuple[OpenAiRealtimeRecogniser, Callable[[], tuple[OpenAiRealtimeStream, Reader]]]]


@pytest_asyncio.fixture(loop_scope="module")
async def make() -> AsyncIterator[Make]:
    """``rec, open = make(base_url, **stt_settings)``; ``stream, reader = open()``."""
    recs: list[OpenAiRealtimeRecogniser] = []
    streams: list[OpenAiRealtimeStream] = []

    def _make(url: str, **settings: Any) -> tuple[OpenAiRealtimeRecogniser, Callable[[], tuple[OpenAiRealtimeStream, Reader]]]:
        settings.setdefault("model", "m")
        settings.setdefault("connect_timeout_s", 3.0)
        rec = OpenAiRealtimeRecogniser(SttConfig(provider="openai_realtime", base_url=url, **settings))
        recs.append(rec)

        def _open() -> tuple[OpenAiRealtimeStream, Reader]:
            stream = rec.open(StreamOptions(session_id="t"))
            streams.append(stream)
            return stream, Reader(stream)

        return rec, _open

    yield _make
    for s in streams:
        await s.aclose()
    for r in recs:
        await r.aclose()


def segment(pcm: bytes, lead_s: float = 0.3, tail_s: float = 0.3) -> bytes:
    """Speech with silence before and after it."""
    return bytes(int(lead_s * 16_000) * 2) + pcm + bytes(int(tail_s * 16_000) * 2)


def frames(pcm: bytes) -> list[bytes]:
    """20 ms frames (the last may be shorter)."""
    return [pcm[i : i + 640] for i in range(0, len(pcm), 640)]


def send(stream: OpenAiRealtimeStream, pcm: bytes) -> float:
    """Send ``pcm`` in 20 ms frames; returns its length, s."""
    for f in frames(pcm):
        stream.send(f)
    return len(pcm) / 32_000


def without_id(event: dict[str, Any]) -> dict[str, Any]:
    out = dict(event)
    assert isinstance(out.pop("event_id", None), str), f"no event_id in {event}"
    return out


def close(a: float, b: float, tol: float = 1e-6) -> bool:
    return abs(a - b) <= tol


# -- pure helpers ------------------------------------------------------------------


async def test_url_and_language() -> None:
    assert realtime_url("https://api.openai.com/v1", "gpt-4o-transcribe") == "wss://api.openai.com/v1/realtime?intent=transcription"
    assert realtime_url("https://api.openai.com/v1/", "x") == "wss://api.openai.com/v1/realtime?intent=transcription"
    assert realtime_url("http://127.0.0.1:8000/v1", "Systran/faster-whisper-small") == (
        "ws://127.0.0.1:8000/v1/realtime?intent=transcription&model=Systran/faster-whisper-small"
    )
    assert realtime_url("https://gw.example.com/openai/v1", "gpt-4o-mini-transcribe") == (
        "wss://gw.example.com/openai/v1/realtime?intent=transcription&model=gpt-4o-mini-transcribe"
    )
    with pytest.raises(ValueError):
        realtime_url("ftp://x/v1", "m")
    assert [language_code(x) for x in ("en-US", "en_GB", "fr", "")] == ["en", "en", "fr", ""]
    assert guess_shape({"type": "transcription_session.created", "session": {}}) == "beta"
    assert guess_shape({"type": "session.created", "session": {"type": "transcription", "audio": {}}}) == "ga"
    assert guess_shape({"type": "session.created", "session": {"input_audio_transcription": {}, "modalities": []}}) == "legacy"
    assert guess_shape(None) is None and guess_shape({"type": "error"}) is None


# -- the GA session ------------------------------------------------------------------


async def test_ga_wire_and_exact_transcripts(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", api_key="sk-test")
    rec, open_ = make(url, api_key="sk-test", model="gpt-4o-transcribe", language="en-US", keyterms=["coffee", "Paris"])
    stream, r = open_()
    a, b = segment(speech("tell me a story")), segment(speech("hello there"))
    a_s = send(stream, a)
    stream.finalize()
    stream.finalize()  # nothing since the last: nothing
    await r.wait(lambda r: len(r.of(RecognitionUsage)) == 1)
    b_s = send(stream, b)
    stream.finalize()
    await r.wait(lambda r: len(r.of(RecognitionUsage)) == 2)
    await stream.aclose()
    await asyncio.wait_for(r.task, 1)
    assert r.ended and r.error is None

    (conn,) = fake.connections
    assert conn.query == {"intent": "transcription", "model": "gpt-4o-transcribe"}  # not api.openai.com: model= goes
    assert conn.headers["Authorization"] == "Bearer sk-test"
    assert "OpenAI-Beta" not in conn.headers
    assert without_id(conn.control[0]) == {"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
        "format": {"type": "audio/pcm", "rate": 24_000},
        "transcription": {"model": "gpt-4o-transcribe", "language": "en", "prompt": "coffee, Paris"},
        "turn_detection": None,
    }}}}
    assert conn.control_types()[1:] == ["input_audio_buffer.commit", "input_audio_buffer.commit"]
    assert conn.session["audio"]["input"]["turn_detection"] is None
    assert abs(conn.audio_s - (a_s + b_s)) < 0.003  # 24 kHz, all of it (the resampler holds 1 ms)
    assert max(conn.append_bytes) <= 4800  # 100 ms at 24 kHz

    # per item: its interims, then final, end and usage, in commit order, in stream seconds
    answer = ["Final", "EndOfUtterance", "RecognitionUsage"]
    assert [type(e).__name__ for e in r.events] == ["Interim"] * 4 + answer + ["Interim"] * 2 + answer
    assert [i.text for i in r.of(Interim)] == ["tell", "tell me", "tell me a", "tell me a story", "hello", "hello there"]
    fa, fb = r.finals
    assert (fa.text, fa.start_s, fa.finalized) == ("tell me a story", 0.0, True) and close(fa.end_s, a_s)
    assert fb.text == "hello there" and close(fb.start_s, a_s) and close(fb.end_s, a_s + b_s) and fb.finalized
    assert [e.at_s for e in r.of(EndOfUtterance)] == [fa.end_s, fb.end_s]
    ua, ub = r.of(RecognitionUsage)
    assert (ua.output_tokens, ub.output_tokens) == (4, 2) and ua.audio_s == 0.0 and ua.source == "provider"
    assert ua.input_tokens == math.ceil(a_s * 10) or abs(ua.input_tokens - a_s * 10) <= 1  # the fake bills tenths of a second
    assert (ua.start_s, ua.end_s, ub.start_s, ub.end_s) == (fa.start_s, fa.end_s, fb.start_s, fb.end_s)
    assert rec.shape == "ga"


async def test_audio_queued_before_the_connection_goes_in_100ms_appends(
    serve: Serve, make: Make, speech: Callable[[str], bytes]
) -> None:
    fake, url = await serve(mode="ga")
    _rec, open_ = make(url)
    stream, r = open_()
    pcm = segment(speech("count to twenty"))
    sent_s = send(stream, pcm)  # all queued before the socket is up
    assert stream.buffered_s > 0
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 1)
    (conn,) = fake.accepted
    assert "Authorization" not in conn.headers  # no key: no header
    total = sum(conn.append_bytes)
    assert conn.append_bytes[:-1] == [4800] * (len(conn.append_bytes) - 1) and 0 < conn.append_bytes[-1] <= 4800
    assert abs(total / 48_000 - sent_s) < 0.003
    assert r.finals[0].text == "count to twenty"


# -- the beta shape, auto, speaches -------------------------------------------------------


async def test_beta_shape_on_a_beta_server(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="beta", api_key="k")
    rec, open_ = make(url, api_key="k", realtime_shape="beta", language="en")
    stream, r = open_()
    send(stream, segment(speech("please order a coffee")))
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 1)
    (conn,) = fake.connections
    assert conn.headers["OpenAI-Beta"] == "realtime=v1" and conn.headers["Authorization"] == "Bearer k"
    assert without_id(conn.control[0]) == {"type": "transcription_session.update", "session": {
        "input_audio_format": "pcm16", "input_audio_transcription": {"model": "m", "language": "en"}, "turn_detection": None,
    }}
    assert conn.control_types()[1:] == ["input_audio_buffer.commit"]
    assert r.finals[0].text == "please order a coffee"
    assert r.of(Interim)[-1].text == "please order a coffee"
    assert rec.shape == "beta"


@pytest.mark.parametrize("created", [True, False], ids=["guessed-from-created", "after-an-error"])
async def test_auto_finds_the_beta_shape_and_remembers_it(
    serve: Serve, make: Make, speech: Callable[[str], bytes], created: bool
) -> None:
    fake, url = await serve(mode="beta", send_created=created)
    rec, open_ = make(url, realtime_shape="auto")
    stream, r = open_()
    send(stream, segment(speech("charge my card")))
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 1)
    assert r.finals[0].text == "charge my card"
    first = fake.connections[0]
    assert "OpenAI-Beta" not in first.headers  # auto starts as GA
    if created:  # transcription_session.created says beta: no GA update is tried
        assert first.control_types() == ["transcription_session.update", "input_audio_buffer.commit"]
    else:  # no first event (after the 1 s bound): GA, refused with an error, then beta
        assert first.control_types() == ["session.update", "transcription_session.update", "input_audio_buffer.commit"]
        refusal = first.sent[0]
        assert refusal["type"] == "error" and refusal["error"]["code"] == "unknown_event"
        assert refusal["error"]["event_id"] == first.control[0]["event_id"]
    assert rec.shape == "beta"
    stream2, r2 = open_()  # the recogniser's next stream starts with beta
    send(stream2, segment(speech("yeah")))
    stream2.finalize()
    await r2.wait(lambda r: len(r.finals) == 1)
    second = fake.connections[1]
    assert second.headers["OpenAI-Beta"] == "realtime=v1"
    assert second.control_types() == ["transcription_session.update", "input_audio_buffer.commit"]
    assert r2.finals[0].text == "yeah"


@pytest.mark.parametrize(("shape", "created"), [("auto", True), ("beta", False), ("auto", False)],
                         ids=["auto-guessed", "beta-refused-then-legacy", "auto-ga-ignored-beta-refused-then-legacy"])
async def test_speaches_dialect(serve: Serve, make: Make, speech: Callable[[str], bytes], shape: str, created: bool) -> None:
    fake, url = await serve(mode="speaches", api_key="sk-local", send_created=created)
    rec, open_ = make(url, api_key="sk-local", model="Systran/faster-whisper-small", realtime_shape=shape)
    stream, r = open_()
    pcm = segment(speech("what is the weather like today"))
    sent_s = send(stream, pcm)
    stream.finalize()
    await r.wait(lambda r: len(r.of(RecognitionUsage)) == 1)
    (conn,) = fake.connections
    assert conn.query["model"] == "Systran/faster-whisper-small" and conn.query["intent"] == "transcription"
    legacy = {"type": "session.update", "session": {
        "input_audio_transcription": {"model": "Systran/faster-whisper-small", "language": "en"}, "turn_detection": None,
    }}
    errors = [e["error"] for e in conn.sent if e["type"] == "error"]
    if created:  # speaches' session.created (flat, no "audio") says legacy: only that update
        assert [without_id(e) for e in conn.control[:1]] == [legacy]
        assert not errors
    else:
        if shape == "auto":  # GA first: speaches answers session.updated, but without the GA fields
            assert conn.control_types()[0] == "session.update" and conn.control[0]["session"]["type"] == "transcription"
            assert conn.sent[0]["type"] == "session.updated" and "audio" not in conn.sent[0]["session"]
        # transcription_session.update is "Invalid client event" on speaches (no code, no event_id); then legacy
        assert conn.control_types()[-3:-1] == ["transcription_session.update", "session.update"]
        assert without_id(conn.control[-2]) == legacy
        assert errors == [{"type": "invalid_request_error", "code": None, "message": "Invalid client event: 1 validation error(s)",
                           "param": None, "event_id": None}]
    assert conn.session["turn_detection"] is None  # speaches' default server_vad is off
    assert not r.of(Interim)  # speaches sends no deltas
    (final,) = r.finals
    assert final.text == "what is the weather like today" and close(final.end_s, sent_s)
    (usage,) = r.of(RecognitionUsage)  # speaches' realtime usage is {"type": "duration"}
    assert abs(usage.audio_s - sent_s) < 0.01 and usage.input_tokens == usage.output_tokens == 0
    assert rec.shape == "legacy"


async def test_ga_setting_on_speaches_warns_and_survives_its_own_vad(
    serve: Serve, make: Make, speech: Callable[[str], bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    fake, url = await serve(mode="speaches")
    _rec, open_ = make(url, realtime_shape="ga")
    stream, r = open_()
    # speaches silently drops the GA fields: its server_vad (550 ms) stays on and commits on its own
    send(stream, segment(speech("tell me a story"), tail_s=1.0))
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 2)
    assert any("ignored the GA session fields" in m and "stt.realtime_shape" in m for m in caplog.messages)
    (conn,) = fake.connections
    assert conn.session["turn_detection"] is not None
    assert {"input_audio_buffer.speech_started", "input_audio_buffer.speech_stopped"} <= set(conn.sent_types())
    assert r.of(SpeechStarted)
    assert " ".join(f.text for f in r.finals if f.text) == "tell me a story"


# -- item ids: out of order, before committed -------------------------------------------------


async def test_completions_out_of_order_keep_their_own_spans(
    serve: Serve, make: Make, speech: Callable[[str], bytes]
) -> None:
    fake, url = await serve(mode="ga", out_of_order=True, latency=Latency(0.05, 0.4))
    _rec, open_ = make(url)
    stream, r = open_()
    a_s = send(stream, segment(speech("charge my card")))
    stream.finalize()
    b_s = send(stream, segment(speech("count to twenty")))
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 2)
    (conn,) = fake.connections
    committed = [e["item_id"] for e in conn.sent if e["type"] == "input_audio_buffer.committed"]
    completed = [e["item_id"] for e in conn.sent if e["type"].endswith("transcription.completed")]
    assert completed == committed[::-1]  # the server completed the later item first
    later, earlier = r.finals  # in the server's order, each with its own commit's stream seconds
    assert (earlier.text, earlier.start_s, earlier.finalized) == ("charge my card", 0.0, True) and close(earlier.end_s, a_s)
    assert later.text == "count to twenty" and close(later.start_s, a_s) and close(later.end_s, a_s + b_s) and later.finalized
    usages = r.of(RecognitionUsage)
    assert [(u.start_s, u.end_s, u.output_tokens) for u in usages] == [(later.start_s, later.end_s, 3), (0.0, earlier.end_s, 3)]


async def test_answers_before_their_committed_are_held(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", late_committed=True)
    _rec, open_ = make(url)
    stream, r = open_()
    a_s = send(stream, segment(speech("hello there")))
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 1)
    (conn,) = fake.connections
    types = conn.sent_types()
    assert types.index("conversation.item.input_audio_transcription.completed") < types.index("input_audio_buffer.committed")
    (final,) = r.finals
    assert (final.text, final.start_s) == ("hello there", 0.0) and close(final.end_s, a_s)
    assert len(r.of(RecognitionUsage)) == 1


# -- finalize, discard and commits refused ------------------------------------------------------


async def test_short_segments_are_cleared_and_discards_clear(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga")
    _rec, open_ = make(url)
    stream, r = open_()
    stream.discard()  # nothing yet: nothing
    send(stream, bytes(1920))  # 60 ms: under the servers' 100 ms minimum
    stream.finalize()
    send(stream, bytes(16_000))  # 0.5 s judged no speech
    stream.discard()
    pcm = segment(speech("hello there"))
    sent_s = send(stream, pcm)
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 2)
    (conn,) = fake.connections
    assert conn.control_types() == [
        "session.update", "input_audio_buffer.clear", "input_audio_buffer.clear", "input_audio_buffer.commit",
    ]
    assert conn.sent_types().count("input_audio_buffer.cleared") == 2
    empty, heard = r.finals
    assert (empty.text, empty.start_s, empty.finalized) == ("", 0.0, True) and close(empty.end_s, 0.06)
    assert heard.text == "hello there" and close(heard.start_s, 0.56) and close(heard.end_s, 0.56 + sent_s)


@pytest.mark.parametrize("mode", ["ga", "speaches"])
async def test_a_commit_refused_as_empty_gives_an_empty_final(
    serve: Serve, make: Make, speech: Callable[[str], bytes], mode: str
) -> None:
    fake, url = await serve(mode=mode, min_commit_s=1.0)  # a stricter server
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, bytes(9600))  # 0.3 s
    stream.finalize()
    pcm = segment(speech("what is the weather like today"))
    sent_s = send(stream, pcm)
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 2)
    (conn,) = fake.connections
    (refusal,) = [e["error"] for e in conn.sent if e["type"] == "error"]
    if mode == "ga":  # OpenAI: a code, and our commit's event_id
        assert refusal["code"] == "input_audio_buffer_commit_empty" and refusal["event_id"] == conn.control[1]["event_id"]
    else:  # speaches: no code, no event_id, only the message
        assert refusal["code"] is None and refusal["event_id"] is None and "buffer too small" in refusal["message"]
    empty, heard = r.finals
    assert (empty.text, empty.start_s) == ("", 0.0) and close(empty.end_s, 0.3)
    assert heard.text == "what is the weather like today" and close(heard.start_s, 0.3) and close(heard.end_s, 0.3 + sent_s)


# -- refusals and the one warning line --------------------------------------------------------


@pytest.mark.parametrize("status", [401, 403])
async def test_a_refused_key_is_unauthorized_remembered_and_logged_once(
    serve: Serve, make: Make, speech: Callable[[str], bytes], caplog: pytest.LogCaptureFixture, status: int
) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    if status == 401:
        fake, url = await serve(mode="ga", api_key="right")
    else:
        fake, url = await serve(mode="ga", refuse_status=403)
    rec, open_ = make(url, api_key="wrong")
    await rec.start()  # never raises
    reason = "401 Unauthorized" if status == 401 else "403 Forbidden"
    assert rec.refused is not None and reason in rec.refused
    assert len(fake.connections) == 1 and fake.connections[0].status == status
    _stream, r = open_()  # streams fail at once, without connecting again
    error = await r.failure(timeout=0.5)
    assert error.kind == "unauthorized" and not error.retryable and "stt.api_key" in str(error)
    _stream2, r2 = open_()
    assert (await r2.failure(timeout=0.5)).kind == "unauthorized"
    assert len(fake.connections) == 1
    await rec.start()  # probed again, still refused: no second line
    assert len(fake.connections) == 2
    lines = [rec_ for rec_ in caplog.records if "stt.api_key" in rec_.getMessage()]
    assert len(lines) == 1, [x.getMessage() for x in lines]
    (line,) = lines
    assert line.levelno == logging.WARNING and line.exc_info is None
    assert line.getMessage() == (
        f"stt.api_key was refused by the server at 127.0.0.1 ({reason}): sessions will use the fallback recogniser"
    )
    # the key is fixed: a later start clears the refusal, and streams work again
    fake.api_key, fake.refuse_status = "wrong", None
    await rec.start()
    assert rec.refused is None
    stream3, r3 = open_()
    send(stream3, segment(speech("okay")))
    stream3.finalize()
    await r3.wait(lambda r: len(r.finals) == 1)
    assert r3.finals[0].text == "okay"


async def test_an_auth_error_event_is_unauthorized(serve: Serve, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    fake, url = await serve(mode="ga", auth_error_event=True)  # accepts the upgrade, then says invalid_api_key
    rec, open_ = make(url, api_key="wrong", fallback="none")
    _stream, r = open_()
    error = await r.failure()
    assert error.kind == "unauthorized" and "invalid_api_key" in str(error)
    assert rec.refused is not None and fake.connections[0].closed == "auth"
    rec2, _open2 = make(url, api_key="wrong")
    await rec2.start()  # the probe reads the first event too
    assert rec2.refused is not None and "invalid_api_key" in rec2.refused
    lines = [m for m in caplog.messages if "stt.api_key" in m]
    assert len(lines) == 2 and "turns will fail until it is fixed (stt.fallback is none)" in lines[0]


async def test_unreachable_and_http_errors(serve: Serve, make: Make, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    rec, open_ = make(f"http://127.0.0.1:{free_port()}/v1")  # nothing listens
    await rec.start()
    await rec.start()
    assert rec.refused is None
    assert len([m for m in caplog.messages if "not reachable" in m]) == 1
    _s, r = open_()
    assert (await r.failure()).kind == "unreachable"
    fake, url = await serve(mode="ga", refuse_status=500)
    _rec2, open2 = make(url)
    _s2, r2 = open2()
    error = await r2.failure()
    assert error.kind == "unreachable" and "500" in str(error) and "stt.base_url" in str(error)
    _rec3, open3 = make(url.removesuffix("/v1"))  # the base URL without /v1: 404
    fake.refuse_status = None
    _s3, r3 = open3()
    error = await r3.failure()
    assert error.kind == "unreachable" and "404" in str(error)


# -- the connection failing mid-stream ------------------------------------------------------------


async def test_a_connection_dropped_mid_utterance(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", drop_after_s=0.5)
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, segment(speech("tell me a story")))
    stream.finalize()
    error = await r.failure()
    assert error.kind == "dropped" and error.retryable
    assert not r.finals and fake.connections[0].closed == "dropped"
    stream.send(bytes(640))  # a failed stream ignores everything, never raises
    stream.finalize()
    stream.discard()


async def test_ga_only_on_a_beta_server_is_a_provider_error(serve: Serve, make: Make) -> None:
    fake, url = await serve(mode="beta")
    rec, open_ = make(url, realtime_shape="ga")
    _stream, r = open_()
    error = await r.failure()
    assert error.kind == "provider" and error.retryable
    assert "stt.realtime_shape = 'ga'" in str(error) and "unknown_event" not in str(error) and "Unknown event type" in str(error)
    assert fake.connections[0].control_types() == ["session.update"] and rec.shape is None


@pytest.mark.parametrize("mode", ["ga", "speaches"])
async def test_the_session_maximum_duration_is_closed(serve: Serve, make: Make, mode: str) -> None:
    fake, url = await serve(mode=mode, max_session_s=0.5)
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, bytes(3200))
    error = await r.failure()
    assert error.kind == "closed" and error.retryable
    if mode == "ga":  # OpenAI: error session_expired, then a 1001 close
        assert "maximum duration" in str(error)
    else:  # speaches: its session timeout ends the socket with 1011
        assert "1011" in str(error)
    assert fake.connections[0].closed == "expired"


@pytest.mark.parametrize("garbage", [
    "text", "binary", "array", "no_type", "bad_delta", "bad_completed", "bad_usage", "huge", "unknown_item",
    "bad_committed", "bad_speech",
])
async def test_garbage_is_a_protocol_error(serve: Serve, make: Make, speech: Callable[[str], bytes], garbage: str) -> None:
    _fake, url = await serve(mode="ga", garbage=garbage)
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, segment(speech("yeah"), 0.1, 0.1))
    stream.finalize()
    error = await r.failure()
    assert error.kind == "protocol", f"{error.kind}: {error}"
    assert not r.finals  # nothing half-read is given: the session replays the audio elsewhere
    expected = {"text": "not JSON", "binary": "binary", "array": "not an event", "no_type": "not an event",
                "bad_delta": "string item_id", "bad_completed": "string transcript", "bad_usage": "token usage",
                "huge": "larger than", "unknown_item": "never said were committed",
                "bad_committed": "string item_id", "bad_speech": "number audio_start_ms"}[garbage]
    assert expected in str(error)


async def test_a_stray_error_is_logged_and_ignored(
    serve: Serve, make: Make, speech: Callable[[str], bytes], caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.WARNING, logger=LOGGER)
    _fake, url = await serve(mode="ga", garbage="stray_error")
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, segment(speech("right")))
    stream.finalize()
    await r.wait(lambda r: len(r.finals) == 1)
    assert r.finals[0].text == "right"
    assert any("rate_limit_exceeded" in m and "going on" in m for m in caplog.messages)


async def test_a_failed_item_is_a_provider_error(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", fail_item=True)
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, segment(speech("count to twenty")))
    stream.finalize()
    error = await r.failure()
    (item_id,) = [e["item_id"] for e in fake.connections[0].sent if e["type"] == "input_audio_buffer.committed"]
    assert error.kind == "provider" and item_id in str(error) and "could not be transcribed" in str(error)


# -- closing ----------------------------------------------------------------------------------------


async def test_aclose_waits_for_the_answers_owed(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", latency=Latency(0.1, 0.3))
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, segment(speech("make it a large one")))
    for _ in range(100):
        if stream.shape is not None and stream.buffered_s == 0:
            break
        await asyncio.sleep(0.01)
    stream.finalize()
    await stream.aclose()  # at once: the commit's final and usage still come, then the end
    await asyncio.wait_for(r.task, 1)
    assert r.ended and r.error is None
    assert [f.text for f in r.finals] == ["make it a large one"] and len(r.of(RecognitionUsage)) == 1
    await stream.aclose()  # idempotent
    await asyncio.sleep(0.05)
    assert fake.connections[0].closed == "client"


async def test_aclose_is_bounded_when_the_server_hangs(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", hang=True)
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, segment(speech("yeah")))
    stream.finalize()
    await asyncio.sleep(0.5)
    assert not r.finals
    started = time.monotonic()
    await stream.aclose()
    assert time.monotonic() - started < CLOSE_TIMEOUT_S + 0.5
    await asyncio.wait_for(r.task, 1)
    assert r.ended and r.error is None
    assert fake.connections[0].control_types() == ["session.update", "input_audio_buffer.commit"]


async def test_cancelling_aclose_closes_at_once(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", hang=True)
    _rec, open_ = make(url)
    stream, r = open_()
    send(stream, segment(speech("yeah")))
    stream.finalize()
    await asyncio.sleep(0.3)
    closing = asyncio.ensure_future(stream.aclose())
    await asyncio.sleep(0.1)
    started = time.monotonic()
    closing.cancel()
    with pytest.raises(asyncio.CancelledError):
        await closing
    await asyncio.wait_for(r.task, 1)
    assert time.monotonic() - started < 0.5 and r.ended
    for _ in range(50):
        if fake.connections[0].closed is not None:
            break
        await asyncio.sleep(0.02)
    assert fake.connections[0].closed == "client"


async def test_audio_waits_bounded_while_connecting_and_aclose_is_immediate(make: Make) -> None:
    accepted: list[asyncio.StreamWriter] = []

    async def silent(_reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        accepted.append(writer)  # accepts the TCP connection, never answers the upgrade

    server = await asyncio.start_server(silent, "127.0.0.1", 0)
    port = server.sockets[0].getsockname()[1]
    try:
        _rec, open_ = make(f"http://127.0.0.1:{port}/v1", connect_timeout_s=30)
        stream, r = open_()
        second = bytes(32_000)
        for _ in range(35):
            send(stream, second)
        assert MAX_BUFFER_S - 0.05 <= stream.buffered_s <= MAX_BUFFER_S  # the oldest 5 s went
        assert stream.position_s == 35.0  # stream seconds still count everything sent
        for _ in range(100):
            if accepted:
                break
            await asyncio.sleep(0.01)
        started = time.monotonic()  # the upgrade is under way
        await stream.aclose()
        assert time.monotonic() - started < 0.3
        await asyncio.wait_for(r.task, 1)
        assert r.ended and r.error is None and accepted
    finally:
        for w in accepted:
            w.close()
        server.close()
        await server.wait_closed()


# -- through voice.transcription, as the session uses it ---------------------------------------------


FailoverNote = tuple[str, str, str, str | None]


async def transcribe(failover: Failover, pcm: bytes, notes: list[FailoverNote]) -> tuple[str, Transcription, Any]:
    """One utterance through a Transcription: begin, 20 ms frames, finish."""
    transcription = Transcription(
        failover, StreamOptions(session_id="s1"), clock=SystemClock(), final_timeout_s=3.0,
        on_failover=lambda name, err, action, nxt: notes.append((name, err.kind, action, nxt)),
    )
    runner = asyncio.ensure_future(transcription.run())
    try:
        utterance = transcription.begin()
        for i, f in enumerate(frames(pcm)):
            utterance.feed(f)
            if i % 5 == 4:
                await asyncio.sleep(0.001)
        text = await asyncio.wait_for(utterance.finish(), 15)
        return text, transcription, utterance
    finally:
        transcription.close()
        await asyncio.wait_for(runner, 5)


async def test_through_transcription(serve: Serve, make: Make, speech: Callable[[str], bytes]) -> None:
    fake, url = await serve(mode="ga", latency=Latency(0.15, 0.3))
    rec, _open = make(url)
    notes: list[FailoverNote] = []
    pcm = segment(speech("what is the weather like today"))
    text, transcription, utterance = await transcribe(Failover(rec, None), pcm, notes)
    assert text == "what is the weather like today" and notes == []
    (record,) = utterance.usage()
    assert record.provider == "openai_realtime" and abs(record.audio_s - len(pcm) / 32_000) < 0.002
    assert record.output_tokens == 6 and record.input_tokens > 0
    totals = transcription.usage()
    assert totals.connection_s["openai_realtime"] > 0 and totals.output_tokens["openai_realtime"] == 6
    (conn,) = fake.connections
    assert conn.control_types() == ["session.update", "input_audio_buffer.commit"]


async def test_through_transcription_two_segments_completed_out_of_order(
    serve: Serve, make: Make, speech: Callable[[str], bytes]
) -> None:
    fake, url = await serve(mode="ga", out_of_order=True, latency=Latency(0.05, 0.4))
    rec, _open = make(url)
    transcription = Transcription(Failover(rec, None), StreamOptions(), clock=SystemClock(), final_timeout_s=3.0)
    runner = asyncio.ensure_future(transcription.run())
    try:
        utterance = transcription.begin()
        for f in frames(segment(speech("hello there"))):
            utterance.feed(f)
        utterance.end()  # a first segment (a backchannel candidate judged), then the user goes on
        for f in frames(segment(speech("count to twenty"))):
            utterance.feed(f)
        text = await asyncio.wait_for(utterance.finish(), 10)
    finally:
        transcription.close()
        await asyncio.wait_for(runner, 5)
    assert text == "hello there count to twenty"
    (conn,) = fake.connections
    completed = [e["transcript"] for e in conn.sent if e["type"].endswith("transcription.completed")]
    assert completed == ["count to twenty", "hello there"]


async def test_through_transcription_a_drop_reconnects_and_replays(
    serve: Serve, make: Make, speech: Callable[[str], bytes]
) -> None:
    fake, url = await serve(mode="ga", drop_after_s=0.8)
    rec, _open = make(url)
    notes: list[FailoverNote] = []
    pcm = segment(speech("please order a coffee"))
    text, _t, _u = await transcribe(Failover(rec, None), pcm, notes)
    assert text == "please order a coffee"
    assert notes == [("openai_realtime", "dropped", "reconnect", "openai_realtime")]
    first, second = fake.accepted
    assert first.closed == "dropped" and 0.8 <= first.audio_s < len(pcm) / 32_000
    assert abs(second.audio_s - len(pcm) / 32_000) < 0.003  # the whole utterance again: no final had come
    assert second.control_types() == ["session.update", "input_audio_buffer.commit"]


async def test_through_transcription_garbage_reconnects_and_loses_nothing(
    serve: Serve, make: Make, speech: Callable[[str], bytes]
) -> None:
    fake, url = await serve(mode="ga", garbage="huge")  # on the first connection only
    rec, _open = make(url)
    notes: list[FailoverNote] = []
    text, _t, _u = await transcribe(Failover(rec, None), segment(speech("charge my card")), notes)
    assert text == "charge my card"
    assert notes == [("openai_realtime", "protocol", "reconnect", "openai_realtime")]
    assert len(fake.accepted) == 2 and list(fake.accepted[1].items.values()) == ["charge my card"]


async def test_through_transcription_a_refused_key_falls_back_to_pocketsphinx(
    serve: Serve, make: Make, speech: Callable[[str], bytes], grammar_file: Path
) -> None:
    fake, url = await serve(mode="ga", api_key="right")
    rec, _open = make(url, api_key="wrong")
    fallback = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file, max_decoders=1))
    await fallback.start()
    try:
        notes: list[FailoverNote] = []
        text, _t, utterance = await transcribe(Failover(rec, fallback), segment(speech("tell me a story")), notes)
        assert text == "tell me a story"
        assert notes == [("openai_realtime", "unauthorized", "fallback", "pocketsphinx")]
        records = {r.provider: r for r in utterance.usage()}
        assert records["pocketsphinx"].audio_s > 0
        assert [c.status for c in fake.connections] == [401]  # the refused upgrade; nothing reached the provider
    finally:
        await fallback.aclose()


# -- the fake alone ---------------------------------------------------------------------------------


async def test_fake_speaches_auth_and_model(serve: Serve) -> None:
    import aiohttp

    _fake, url = await serve(mode="speaches", api_key="k")
    ws_url = url.replace("http", "ws") + "/realtime"
    async with aiohttp.ClientSession() as http:
        for query, headers in [("?intent=transcription&model=m&api_key=k", {}), ("?model=m", {"X-API-Key": "k"})]:
            async with http.ws_connect(ws_url + query, headers=headers) as ws:
                assert (await ws.receive_json())["type"] == "session.created"
        for query, headers in [("?intent=transcription", {"Authorization": "Bearer k"}), ("?model=m", {})]:
            with pytest.raises(aiohttp.WSServerHandshakeError) as info:
                await http.ws_connect(ws_url + query, headers=headers)
            assert info.value.status == 403


async def test_fake_runs_standalone(grammar_file: Path, make: Make, speech: Callable[[str], bytes]) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "testkit.fake_openai_realtime", "--port", str(port), "--grammar", str(grammar_file),
        "--mode", "speaches", "--final-ms", "100", "--max-decoders", "1",
        stdout=asyncio.subprocess.PIPE, cwd=str(Path(__file__).resolve().parents[2]),
    )
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), 30)
        assert f"ws://127.0.0.1:{port}/v1/realtime" in line.decode()
        _rec, open_ = make(f"http://127.0.0.1:{port}/v1")
        stream, r = open_()
        send(stream, segment(speech("hello there")))
        stream.finalize()
        await r.wait(lambda r: len(r.finals) == 1)
        assert r.finals[0].text == "hello there"
        await stream.aclose()
    finally:
        if proc.returncode is None:
            proc.send_signal(signal.SIGINT)
            try:
                await asyncio.wait_for(proc.wait(), 10)
            except TimeoutError:
                proc.kill()
                await proc.wait()
