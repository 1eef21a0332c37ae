"""Deepgram Aura synthesis (voice.deepgram_tts) against a local Deepgram
``/v1/speak`` server (testkit.fake_deepgram_speak: real WebSockets,
Deepgram's messages and quirks, espeak-ng audio): what goes over the wire,
the audio and segments that come back, the stop (Clear / Cleared), the
Flush budget, audio quirks, every failure kind, and no task left behind."""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import free_port, requires_espeak, start_app

from testkit.fake_deepgram_speak import FakeDeepgramSpeak, FakeSpeakOptions, SpeakConnection
from testkit.tts_backend import TtsBackend
from voice.deepgram_tts import DeepgramStream, DeepgramSynthesiser, speak_url, warning_text
from voice.synthesis import Audio, SegmentDone, SynthesisError, SynthesisEvent, Words
from voice.synthesisers import TtsConfig, build_synthesiser

pytestmark = [pytest.mark.asyncio(loop_scope="module"), requires_espeak]

ONE = "Hello there. "
TWO = "How are you today?"
LONG = "One two three four five six seven eight nine ten eleven twelve."


@pytest.fixture(scope="module")
def backend() -> TtsBackend:
    return TtsBackend()


@dataclass
class Rig:
    """One fake Deepgram on loopback and the synthesisers made for it."""

    fake: FakeDeepgramSpeak
    url: str
    synths: list[DeepgramSynthesiser] = field(default_factory=list)

    def synth(self, **settings: Any) -> DeepgramSynthesiser:
        settings.setdefault("api_key", "sekrit")
        settings.setdefault("first_audio_timeout_s", 2.0)
        settings.setdefault("connect_timeout_s", 2.0)
        s = DeepgramSynthesiser(TtsConfig(provider="deepgram", base_url=self.url, **settings))
        self.synths.append(s)
        return s

    @property
    def conn(self) -> SpeakConnection:
        return self.fake.connections[-1]


@pytest_asyncio.fixture(loop_scope="module")
async def rig(backend: TtsBackend) -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []
    rigs: list[Rig] = []

    async def _start(**options: Any) -> Rig:
        options.setdefault("api_key", "sekrit")
        options.setdefault("first_audio_delay_s", 0.05)
        options.setdefault("chunk_interval_s", 0.002)
        fake = FakeDeepgramSpeak(backend, FakeSpeakOptions(**options))
        runner, url = await start_app(fake.app())
        runners.append(runner)
        rigs.append(Rig(fake, url))
        return rigs[-1]

    yield _start
    for r in rigs:
        for s in r.synths:
            await s.aclose()
    assert not our_tasks(), "tasks left after aclose"
    for runner in runners:
        await runner.cleanup()


def our_tasks() -> list[asyncio.Task[Any]]:
    """Running tasks made by the synthesiser (its socket, reader, writer, watchdog)."""
    return [t for t in asyncio.all_tasks() if not t.done() and getattr(t.get_coro(), "__qualname__", "").startswith("DeepgramSynthesiser.")]


async def collect(stream: DeepgramStream, timeout: float = 10.0) -> list[SynthesisEvent]:
    out: list[SynthesisEvent] = []
    async with asyncio.timeout(timeout):
        async for event in stream:
            out.append(event)
    return out


async def failure(stream: DeepgramStream, timeout: float = 10.0) -> SynthesisError:
    with pytest.raises(SynthesisError) as info:
        await collect(stream, timeout)
    return info.value


def audio(events: list[SynthesisEvent]) -> bytes:
    return b"".join(e.pcm for e in events if isinstance(e, Audio))


def segments(events: list[SynthesisEvent]) -> list[str]:
    return [e.text for e in events if isinstance(e, SegmentDone)]


async def until(check: Callable[[], bool], timeout: float = 5.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def speak(synth: DeepgramSynthesiser, *texts: str, name: str = "r") -> DeepgramStream:
    stream = synth.open(name)
    for t in texts:
        stream.push_text(t)
    stream.end_input()
    return stream


# -- the wire and the audio ---------------------------------------------------------


async def test_url_and_build() -> None:
    config = TtsConfig(provider="deepgram", base_url="https://example.test/v1", sample_rate=16000)
    url = speak_url(config)
    assert str(url.with_query(None)) == "wss://example.test/v1/speak"
    assert dict(url.query) == {"model": "aura-2-thalia-en", "encoding": "linear16", "sample_rate": "16000"}
    assert str(speak_url(TtsConfig(provider="deepgram")).with_query(None)) == "wss://api.deepgram.com/v1/speak"
    assert isinstance(build_synthesiser(TtsConfig(provider="deepgram")), DeepgramSynthesiser)


async def test_warning_fields_are_read_under_both_names() -> None:
    assert "flush" in warning_text({"type": "Warning", "description": "Flush limit"}).lower()
    assert "flush" in warning_text({"type": "Warning", "warn_msg": "Flush limit"}).lower()
    assert warning_text({"warn_code": "X", "warn_msg": "same", "description": "same"}) == "X: same"


@pytest.mark.parametrize("rate", [24000, 16000])
async def test_speaks_clause_by_clause(rig: Callable[..., Any], backend: TtsBackend, rate: int) -> None:
    r = await rig()
    synth = r.synth(sample_rate=rate, cents_per_1k_characters=3.0)
    stream = speak(synth, ONE, TWO)
    events = await collect(stream)
    one, two = (await backend.render(ONE, rate)).pcm, (await backend.render(TWO, rate)).pcm
    assert audio(events) == one + two
    assert all(e.sample_rate == rate for e in events if isinstance(e, Audio))
    assert not [e for e in events if isinstance(e, Words)]  # Aura gives no word timings
    assert segments(events) == [ONE, TWO]
    first_done = next(i for i, e in enumerate(events) if isinstance(e, SegmentDone))
    assert audio(events[:first_done]) == one  # the clause's audio, all of it, before its segment is done
    conn = r.conn
    assert conn.types() == ["Speak", "Flush", "Speak", "Flush"]
    assert [m["text"] for _, m in conn.received if m.get("type") == "Speak"] == [ONE, TWO]
    assert conn.attempt.headers["Authorization"] == "Token sekrit"
    assert (conn.attempt.param("model"), conn.attempt.param("encoding"), conn.attempt.param("sample_rate")) == (
        "aura-2-thalia-en",
        "linear16",
        str(rate),
    )
    assert [m["type"] for m in (m for _, k, m in conn.sent if k == "text")][0] == "Metadata"
    usage = stream.usage()
    assert usage.characters == len(ONE) + len(TWO) and usage.after_stop is None
    assert usage.audio_s == pytest.approx((len(one) + len(two)) / 2 / rate, abs=0.002)
    assert usage.cents == pytest.approx(usage.characters * 3.0 / 1000)
    assert our_tasks()  # the socket stays up for the next reply
    await synth.aclose()
    assert not our_tasks()


async def test_one_reply_at_a_time_on_the_socket(rig: Callable[..., Any], backend: TtsBackend) -> None:
    """Deepgram has no contexts: a second reply's text waits for the first's last Flushed."""
    r = await rig()
    synth = r.synth()
    await synth.warm()
    a = speak(synth, ONE, name="a")
    b = speak(synth, TWO, name="b")
    ea, eb = await asyncio.gather(collect(a), collect(b))
    assert audio(ea) == (await backend.render(ONE, 24000)).pcm
    assert audio(eb) == (await backend.render(TWO, 24000)).pcm
    conn = r.conn
    speak_b = next(t for t, m in conn.received if m.get("text") == TWO)
    assert speak_b >= conn.sent_times("Flushed")[0]
    assert len(r.fake.connections) == 1 and synth.connections == 1


async def test_warm_is_idempotent_and_a_stream_opened_while_warming_works(rig: Callable[..., Any]) -> None:
    r = await rig(accept_delay_s=0.2)
    synth = r.synth()
    warming = asyncio.ensure_future(synth.warm())
    await asyncio.sleep(0.05)
    stream = speak(synth, ONE)  # before the socket is up
    await warming
    await synth.warm()
    assert segments(await collect(stream)) == [ONE]
    assert len(r.fake.attempts) == 1


# -- the stop ------------------------------------------------------------------------


async def test_cancel_mid_reply_clears_and_is_confirmed(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(chunk_interval_s=0.01, trailing_frames=2)
    synth = r.synth()
    stream = speak(synth, LONG, name="old")
    got: list[SynthesisEvent] = []
    async with asyncio.timeout(5):
        async for event in stream:
            got.append(event)
            if isinstance(event, Audio):
                cancelled_at = time.monotonic()
                stream.cancel()
    assert len(got) == 1  # nothing yielded after the stop
    await until(lambda: stream.stop is not None and stream.stop.confirmed)
    stop = stream.stop
    assert stop is not None and stop.tell_ms is not None and stop.tell_ms < 1000
    conn = r.conn
    assert conn.types() == ["Speak", "Flush", "Clear"]
    assert conn.times("Clear")[0] - cancelled_at < 1.0  # barge-in to provider told (the bench's measure)
    assert conn.sent_of("Cleared") and stream.cleared_ms is not None
    assert synth.clears[0].cleared_ms == stream.cleared_ms
    assert stop.late_audio_ms > 0  # the frames in flight before Cleared, dropped and counted
    assert len(conn.audio) < len((await backend.render(LONG, 24000)).pcm)  # it stopped sending
    usage = stream.usage()
    assert usage.after_stop == "confirmed" and usage.characters_unspoken_at_stop == len(LONG)
    assert usage.audio_s * 1000 == pytest.approx(len(audio(got)) / 48, abs=1)
    # the next reply on the same socket gets its own audio only
    nxt = speak(synth, TWO, name="new")
    assert audio(await collect(nxt)) == (await backend.render(TWO, 24000)).pcm
    assert len(r.fake.connections) == 1


async def test_a_new_reply_waits_for_cleared(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(chunk_interval_s=0.01, trailing_frames=3, cleared_delay_s=0.15)
    synth = r.synth()
    old = speak(synth, LONG, name="old")
    async with asyncio.timeout(5):
        async for event in old:
            if isinstance(event, Audio):
                old.cancel()
    new = speak(synth, TWO, name="new")  # at once, while Deepgram still sends old audio
    assert audio(await collect(new)) == (await backend.render(TWO, 24000)).pcm
    conn = r.conn
    speak_new = next(t for t, m in conn.received if m.get("text") == TWO)
    assert speak_new >= conn.sent_times("Cleared")[0]
    assert old.stop is not None and old.stop.confirmed and old.stop.late_audio_ms > 0


async def test_no_cleared_leaves_the_stop_unconfirmed_and_replaces_the_socket(
    rig: Callable[..., Any],
    backend: TtsBackend,
) -> None:
    r = await rig(chunk_interval_s=0.01, answer_clear=False)
    synth = r.synth()
    synth.clear_wait_s = 0.25
    old = speak(synth, LONG, name="old")
    async with asyncio.timeout(5):
        async for event in old:
            if isinstance(event, Audio):
                old.cancel()
    await until(lambda: old.stop is not None and old.stop.told_at is not None)
    new = speak(synth, TWO, name="new")
    assert audio(await collect(new)) == (await backend.render(TWO, 24000)).pcm
    assert len(r.fake.connections) == 2
    assert old.usage().after_stop == "unconfirmed" and old.cleared_ms is None
    assert synth.clears[0].cleared_ms is None


async def test_cancel_before_anything_was_sent_tells_nothing(rig: Callable[..., Any]) -> None:
    r = await rig()
    synth = r.synth()
    await synth.warm()
    stream = synth.open("r")
    stream.push_text(ONE)
    stream.cancel()  # before the writer ran
    assert await collect(stream) == []
    assert stream.stop is not None and stream.stop.confirmed and stream.stop.told_at is None
    await asyncio.sleep(0.1)
    assert r.conn.types() == []
    with pytest.raises(RuntimeError):
        stream.push_text(TWO)
    assert stream.usage().characters_after_stop == len(TWO)


async def test_text_flushed_is_billed_after_the_client_went_away(rig: Callable[..., Any]) -> None:
    r = await rig(chunk_interval_s=0.01, speak_generates=True)
    synth = r.synth()
    stream = synth.open("r")
    stream.push_text(LONG)
    stream.push_text(TWO)
    async with asyncio.timeout(5):
        async for event in stream:
            if isinstance(event, Audio):
                break
    await until(lambda: len(r.conn.times("Speak")) == 2)
    await synth.aclose()
    with pytest.raises(SynthesisError) as info:
        await collect(stream)
    assert info.value.kind == "closed"
    conn = r.conn
    async with asyncio.timeout(5):
        await conn.ended.wait()
    assert conn.billed_characters == len(LONG) + len(TWO)
    assert conn.billed_after_gone == len(TWO)  # rendered after the client left, billed all the same
    assert not our_tasks()


# -- the Flush budget -------------------------------------------------------------------


@pytest.mark.parametrize("speak_generates", [False, True])
async def test_flush_budget_groups_clauses(rig: Callable[..., Any], backend: TtsBackend, speak_generates: bool) -> None:
    """Whether or not Deepgram makes audio before a Flush (not documented), the
    clauses past the budget's reserve share one Flush and complete together."""
    r = await rig(flush_limit=3, flush_window_s=5.0, speak_generates=speak_generates)
    synth = r.synth()
    synth.flush_limit, synth.flush_window_s, synth.flush_reserve = 3, 5.0, 1
    await synth.warm()
    clauses = ["One. ", "Two. ", "Three. ", "Four. ", "Five."]
    stream = speak(synth, *clauses)
    events = await collect(stream)
    assert segments(events) == clauses
    conn = r.conn
    assert conn.types().count("Flush") == 3 and not conn.sent_of("Warning")
    assert conn.types()[-1] == "Flush"
    # the last three clauses completed together, after all their audio
    dones = [i for i, e in enumerate(events) if isinstance(e, SegmentDone)]
    assert dones[2:] == [dones[2], dones[2] + 1, dones[2] + 2]
    singles = sum([len((await backend.render(c, 24000)).pcm) for c in clauses])
    assert len(audio(events)) >= singles


@pytest.mark.parametrize(("warn_in_order", "fields"), [(False, ("description",)), (True, ("warn_code", "warn_msg"))])
async def test_a_refused_flush_joins_the_next(rig: Callable[..., Any], warn_in_order: bool, fields: tuple[str, ...]) -> None:
    """Deepgram refuses a Flush past its limit with a Warning (at once or in
    order: both; its words under ``description`` or ``warn_msg``: both); the
    refused clauses complete with the next Flush, in order."""
    r = await rig(flush_limit=2, flush_window_s=0.4, warn_in_order=warn_in_order, warning_fields=fields)
    synth = r.synth()
    synth.flush_window_s = 0.4  # the client does not know the limit: it learns it from the Warning
    await synth.warm()
    clauses = ["One. ", "Two. ", "Three. ", "Four."]
    stream = speak(synth, *clauses)
    events = await collect(stream)
    assert segments(events) == clauses
    conn = r.conn
    assert conn.sent_of("Warning")
    assert len(conn.sent_of("Flushed")) == conn.types().count("Flush") - len(conn.sent_of("Warning"))
    assert conn.types()[-1] == "Flush"


# -- audio quirks -------------------------------------------------------------------------


async def test_wav_header_is_stripped(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(wav_header=True)
    events = await collect(speak(r.synth(), ONE, TWO))
    assert audio(events) == (await backend.render(ONE, 24000)).pcm + (await backend.render(TWO, 24000)).pcm


async def test_wav_header_at_another_rate_is_resampled(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(wav_header=True, wav_rate=16000)
    events = await collect(speak(r.synth(), ONE))
    assert all(e.sample_rate == 24000 for e in events if isinstance(e, Audio))
    sent_s = len((await backend.render(ONE, 16000)).pcm) / 2 / 16000
    assert len(audio(events)) / 2 / 24000 == pytest.approx(sent_s, abs=0.01)
    assert segments(events) == [ONE]


async def test_wav_header_not_pcm16_is_a_protocol_error(rig: Callable[..., Any]) -> None:
    r = await rig(wav_header=True, wav_format=3)
    assert (await failure(speak(r.synth(), ONE))).kind == "protocol"


async def test_odd_frames_are_carried(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(odd_chunks=True)
    events = await collect(speak(r.synth(), ONE, TWO))
    assert audio(events) == (await backend.render(ONE, 24000)).pcm + (await backend.render(TWO, 24000)).pcm
    assert all(len(e.pcm) % 2 == 0 for e in events if isinstance(e, Audio))
    assert any(n % 2 for _, k, n in r.conn.sent if k == "audio")


async def test_an_odd_clause_is_a_protocol_error(rig: Callable[..., Any]) -> None:
    r = await rig(odd_total=True)
    assert (await failure(speak(r.synth(), ONE))).kind == "protocol"


# -- failures -------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "kind", "words"),
    [
        ({"refuse_status": 401}, "unauthorized", "401"),
        ({"refuse_status": 403}, "unauthorized", "403"),
        ({"refuse_status": 500}, "unreachable", "500"),
        ({"refuse_status": 400}, "provider", "400"),
        ({"accept_delay_s": 0.8}, "unreachable", "within"),
        ({"drop_after_frames": 2}, "dropped", ""),
        ({"garbage_after_frames": 1}, "protocol", "not JSON"),
        ({"inject": [(0, "[1, 2]")]}, "protocol", "type"),
        ({"inject": [(1, '{"sequence_id": 3}')]}, "protocol", "type"),
        ({"error_after_frames": 1}, "provider", "failed to synthesise"),
        ({"close_after_frames": 1, "close_code": 1008}, "closed", "1008"),
        ({"hang_after_frames": 1}, "provider", "tts.first_audio_timeout_s"),
        ({"hang_after_frames": 0}, "provider", "no audio"),
    ],
)
async def test_failures(rig: Callable[..., Any], backend: TtsBackend, options: dict[str, Any], kind: str, words: str) -> None:
    r = await rig(**options)
    hang = "hang_after_frames" in options
    synth = r.synth(connect_timeout_s=0.5 if "accept_delay_s" in options else 2.0, first_audio_timeout_s=0.3 if hang else 2.0)
    error = await failure(speak(synth, ONE))
    assert error.kind == kind and words in str(error) and error.provider == "deepgram"
    assert error.retryable == (kind != "unauthorized")
    # the caller reconnects once: a new reply gets a new socket (the fault was the first's only)
    again = await collect(speak(synth, TWO, name="again"))
    assert audio(again) == (await backend.render(TWO, 24000)).pcm


async def test_wrong_key_and_nobody_listening(rig: Callable[..., Any]) -> None:
    r = await rig()
    assert (await failure(speak(r.synth(api_key="wrong"), ONE))).kind == "unauthorized"
    nobody = DeepgramSynthesiser(TtsConfig(provider="deepgram", base_url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=1))
    try:
        await nobody.warm()  # never raises
        assert (await failure(speak(nobody, ONE))).kind == "unreachable"
    finally:
        await nobody.aclose()


async def test_warm_failure_surfaces_on_the_first_stream(rig: Callable[..., Any]) -> None:
    r = await rig(refuse_status=401, faulty_connections=2)
    synth = r.synth()
    await synth.warm()  # refused: not raised
    error = await failure(speak(synth, ONE))
    assert error.kind == "unauthorized" and not error.retryable


async def test_an_idle_socket_that_ends_fails_no_one(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig()
    synth = r.synth()
    assert segments(await collect(speak(synth, ONE))) == [ONE]
    ws_closed = r.conn
    stream = synth.open("later")
    # the idle socket ends (as if Deepgram closed it)
    await until(lambda: synth._conn is not None and synth._conn.ws is not None)
    conn = synth._conn
    assert conn is not None and conn.ws is not None
    await conn.ws.close()
    await until(lambda: synth._conn is None)
    stream.push_text(TWO)
    stream.end_input()
    assert audio(await collect(stream)) == (await backend.render(TWO, 24000)).pcm
    assert ws_closed is not r.conn and len(r.fake.connections) == 2


async def test_the_fake_answers_close_after_the_audio(rig: Callable[..., Any], backend: TtsBackend) -> None:
    """``{"type":"Close"}``: what was flushed is sent, then the close (1000)."""
    r = await rig()
    got = bytearray()
    texts: list[str] = []
    async with (
        aiohttp.ClientSession() as http,
        http.ws_connect(
            f"{r.url}/v1/speak?model=aura-2-thalia-en&encoding=linear16&sample_rate=16000",
            headers={"Authorization": "Token sekrit"},
        ) as ws,
    ):
        await ws.send_json({"type": "Speak", "text": ONE})
        await ws.send_json({"type": "Flush"})
        await ws.send_json({"type": "Close"})
        async for msg in ws:
            if msg.type is aiohttp.WSMsgType.BINARY:
                got += msg.data
            elif msg.type is aiohttp.WSMsgType.TEXT:
                texts.append(msg.json()["type"])
        assert ws.close_code == 1000
    assert bytes(got) == (await backend.render(ONE, 16000)).pcm
    assert texts == ["Metadata", "Flushed"]
    assert r.conn.closed_with == (1000, "") and r.conn.billed_characters == len(ONE)
