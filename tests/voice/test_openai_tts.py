"""OpenAI-compatible speech synthesis (voice.openai_tts) against a local
``/v1/audio/speech`` server (testkit.fake_openai_speech: real HTTP on
loopback, the dialects of OpenAI, speaches and Kokoro-FastAPI, espeak-ng
word by word as the voice, so the audio can be compared byte for byte):
what goes on the wire, the audio and its rate, segment order, the stop,
the quirks, every failure kind and what is left after aclose."""

from __future__ import annotations

import asyncio
import shutil
import struct
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import free_port, start_app

from testkit.fake_openai_speech import FakeOpenAiSpeech, FakeSpeechOptions
from testkit.tts_backend import TtsBackend
from voice.openai_tts import (
    OpenAiSynthesiser,
    OpenAiSynthesisStream,
    answer_rate,
    error_message,
    parse_content_type,
    parse_wav_header,
    request_body,
    sends_sample_rate,
)
from voice.synthesis import Audio, SegmentDone, SynthesisError, SynthesisEvent, Words
from voice.synthesisers import TtsConfig, build_synthesiser

pytestmark = [
    pytest.mark.asyncio(loop_scope="module"),
    pytest.mark.skipif(shutil.which("espeak-ng") is None, reason="espeak-ng is not installed"),
]

KEY = "sk-test"
#: a bound on "at once" that a loaded 2-core machine keeps (a sanity bound, not a latency claim)
PROMPTLY_S = 1.0


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend() -> TtsBackend:
    return TtsBackend()


@dataclass
class Rig:
    """One fake server on loopback and the synthesisers made for it."""

    fake: FakeOpenAiSpeech
    url: str  # up to /v1
    synthesisers: list[OpenAiSynthesiser] = field(default_factory=list)

    def synthesiser(self, http: aiohttp.ClientSession | None = None, stream_format: str = "audio", **settings: Any) -> OpenAiSynthesiser:
        settings.setdefault("api_key", KEY)
        settings.setdefault("base_url", self.url)
        syn = OpenAiSynthesiser(TtsConfig(provider="openai", **settings), http, stream_format=stream_format)  # type: ignore[arg-type]
        self.synthesisers.append(syn)
        return syn


@pytest_asyncio.fixture(loop_scope="module")
async def rig(backend: TtsBackend) -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []
    rigs: list[Rig] = []

    async def _start(**options: Any) -> Rig:
        options.setdefault("api_key", KEY)
        options.setdefault("first_audio_delay_s", 0.03)
        fake = FakeOpenAiSpeech(backend, FakeSpeechOptions(**options))
        runner, url = await start_app(fake.app())
        runners.append(runner)
        rigs.append(Rig(fake, url + "/v1"))
        return rigs[-1]

    yield _start
    for r in rigs:
        for syn in r.synthesisers:
            await syn.aclose()
    for runner in runners:
        await runner.cleanup()


async def collect(stream: OpenAiSynthesisStream, timeout: float = 10.0) -> tuple[list[SynthesisEvent], SynthesisError | None]:
    """Every event until the iteration ends, and the error it ended with."""
    events: list[SynthesisEvent] = []
    try:
        async with asyncio.timeout(timeout):
            async for ev in stream:
                events.append(ev)
    except SynthesisError as exc:
        return events, exc
    return events, None


def pcm_of(events: list[SynthesisEvent]) -> bytes:
    return b"".join(e.pcm for e in events if isinstance(e, Audio))


async def speak(syn: OpenAiSynthesiser, *clauses: str) -> tuple[OpenAiSynthesisStream, list[SynthesisEvent], SynthesisError | None]:
    stream = syn.open("reply-1")
    for c in clauses:
        stream.push_text(c)
    stream.end_input()
    events, error = await collect(stream)
    return stream, events, error


async def failure(syn: OpenAiSynthesiser, text: str = "hello there") -> tuple[SynthesisError, list[SynthesisEvent]]:
    _, events, error = await speak(syn, text)
    assert error is not None, f"no error; events: {[type(e).__name__ for e in events]}"
    return error, events


# -- the wire ---------------------------------------------------------------------------


async def test_one_request_per_clause_in_order_on_the_wire(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(dialect="speaches")
    syn = r.synthesiser(model="speaches-ai/piper-en_US-amy-low", voice="amy", sample_rate=16000)
    clauses = ["Hello there. ", "Tell me a story, ", "please"]
    stream, events, error = await speak(syn, *clauses)
    assert error is None
    reqs = r.fake.requests
    assert [q.path for q in reqs] == ["/v1/audio/speech"] * 3
    assert [q.body for q in reqs] == [
        {
            "model": "speaches-ai/piper-en_US-amy-low",
            "input": c,
            "voice": "amy",
            "response_format": "pcm",
            "stream_format": "audio",
            "sample_rate": 16000,
        }
        for c in clauses
    ]  # no speed: the provider's 1.0
    assert all(q.headers["Authorization"] == f"Bearer {KEY}" for q in reqs)
    # one at a time: each request after the previous answer ended
    for a, b in zip(reqs, reqs[1:], strict=False):
        assert a.finished_at is not None and b.received_at >= a.finished_at - 0.01
    # the audio is the server's rendering at the rate asked for, clause after clause, each clause's SegmentDone after its audio
    expected = [(await backend.render(c, 16000)).pcm for c in clauses]
    assert pcm_of(events) == b"".join(expected)
    assert all(isinstance(e, Audio) and e.sample_rate == 16000 for e in events if not isinstance(e, SegmentDone))
    done_at = [i for i, e in enumerate(events) if isinstance(e, SegmentDone)]
    assert [events[i].text for i in done_at] == clauses  # type: ignore[union-attr]
    for k, i in enumerate(done_at):
        before = events[(done_at[k - 1] + 1) if k else 0 : i]
        assert pcm_of(before) == expected[k]
        assert len(before) > 1  # streamed in chunks, not in one piece
    assert not any(isinstance(e, Words) for e in events)  # the protocol has no word timings
    usage = stream.usage()
    assert usage.characters == sum(len(c) for c in clauses) and usage.after_stop is None
    assert usage.audio_s == pytest.approx(sum(len(p) for p in expected) / 32000, abs=0.002)


async def test_no_key_no_authorization_header(rig: Callable[..., Any]) -> None:
    r = await rig(api_key=None)
    _, _, error = await speak(r.synthesiser(api_key=""), "hello")
    assert error is None and "Authorization" not in r.fake.requests[0].headers


async def test_sample_rate_is_not_sent_to_openai_hosts() -> None:
    """OpenAI's pcm is 24 kHz whatever is asked; its own hosts are not sent
    speaches' field (unknown-field handling undocumented), others are."""
    openai = TtsConfig(provider="openai", sample_rate=16000)
    assert openai.url == "https://api.openai.com/v1" and not sends_sample_rate(openai)
    assert not sends_sample_rate(TtsConfig(provider="openai", base_url="https://eu.api.openai.com/v1"))
    body = request_body(openai, "Hi.")
    assert body == {"model": "gpt-4o-mini-tts", "input": "Hi.", "voice": "alloy", "response_format": "pcm", "stream_format": "audio"}
    local = TtsConfig(provider="openai", base_url="http://127.0.0.1:8880/v1", sample_rate=22050)
    assert request_body(local, "Hi.", "sse")["sample_rate"] == 22050 and request_body(local, "Hi.", "sse")["stream_format"] == "sse"
    # the rate of a raw answer: declared, else the header, else what was sent, else 24 kHz
    assert answer_rate("audio/pcm;rate=16000", "8000", {"sample_rate": 22050}) == 16000
    assert answer_rate("audio/pcm", "8000", {"sample_rate": 22050}) == 8000
    assert answer_rate("application/octet-stream", None, {"sample_rate": 22050}) == 22050
    assert answer_rate("audio/pcm", None, body) == 24000
    assert answer_rate("text/event-stream", None, {"sample_rate": 22050}) == 24000  # speaches' events ignore it
    with pytest.raises(SynthesisError) as bad:
        answer_rate("audio/pcm; rate=fast", None, {})
    assert bad.value.kind == "protocol"


async def test_build_synthesiser_gives_this_class() -> None:
    syn = build_synthesiser(TtsConfig(provider="openai"))
    assert isinstance(syn, OpenAiSynthesiser) and syn.name == "openai"
    await syn.aclose()


# -- audio formats and rates ---------------------------------------------------------


async def test_openai_pcm_at_24k(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(dialect="openai")
    _, events, error = await speak(r.synthesiser(model="tts-1"), "hello there")
    assert error is None and r.fake.requests[0].rate == 24000
    assert pcm_of(events) == (await backend.render("hello there", 24000)).pcm


async def test_openai_ignores_sample_rate_a_declared_rate_is_resampled(rig: Callable[..., Any], backend: TtsBackend) -> None:
    """OpenAI answers 24 kHz whatever sample_rate says; when the answer says
    its rate (``rate=`` or X-Sample-Rate) the client resamples to its own."""
    for knob in ("declare_rate", "rate_header"):
        r = await rig(dialect="openai", **{knob: True})
        _, events, error = await speak(r.synthesiser(model="tts-1", sample_rate=16000), "hello there")
        assert error is None and r.fake.requests[0].rate == 24000
        source = (await backend.render("hello there", 24000)).pcm
        got = pcm_of(events)
        assert {e.sample_rate for e in events if isinstance(e, Audio)} == {16000}
        assert len(got) % 2 == 0 and abs(len(got) / 2 - len(source) / 2 * 2 / 3) < 64, knob


async def test_speaches_without_sample_rate_answers_its_native_rate(rig: Callable[..., Any]) -> None:
    """The quirk (reference 2.1): speaches' pcm is at the model's native rate
    unless sample_rate is sent; the client always sends it to such servers."""
    r = await rig(dialect="speaches", native_rate=22050)
    async with aiohttp.ClientSession() as http:
        body: dict[str, Any] = {"model": "piper", "input": "hello", "voice": "amy", "response_format": "pcm"}
        async with http.post(f"{r.url}/audio/speech", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
            await resp.read()
        body["sample_rate"] = 16000
        async with http.post(f"{r.url}/audio/speech", json=body, headers={"Authorization": f"Bearer {KEY}"}) as resp:
            await resp.read()
    assert [q.rate for q in r.fake.requests] == [22050, 16000]


async def test_wav_answer_header_decides(rig: Callable[..., Any], backend: TtsBackend) -> None:
    # speaches honours sample_rate: the header says 16000, nothing to resample
    r = await rig(dialect="speaches", answer_as="wav")
    _, events, error = await speak(r.synthesiser(sample_rate=16000), "hello there")
    assert error is None and r.fake.requests[0].content_type == "audio/wav"
    assert pcm_of(events) == (await backend.render("hello there", 16000)).pcm
    # Kokoro answers 24 kHz whatever is asked: the WAV header says so and the client resamples
    r = await rig(dialect="kokoro", answer_as="wav")
    _, events, error = await speak(r.synthesiser(sample_rate=16000), "hello there")
    assert error is None and r.fake.requests[0].rate == 24000
    source = (await backend.render("hello there", 24000)).pcm
    assert abs(len(pcm_of(events)) / 2 - len(source) / 3) < 64


async def test_octet_stream_is_raw_pcm(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(dialect="openai", answer_as="octet")
    _, events, error = await speak(r.synthesiser(model="tts-1"), "hello")
    assert error is None and r.fake.requests[0].content_type == "application/octet-stream"
    assert pcm_of(events) == (await backend.render("hello", 24000)).pcm


async def test_odd_chunks_are_joined_into_whole_samples(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(dialect="speaches", odd_chunks=True)
    _, events, error = await speak(r.synthesiser(sample_rate=16000), "hello there")
    assert error is None
    assert all(len(e.pcm) % 2 == 0 for e in events if isinstance(e, Audio))
    assert pcm_of(events) == (await backend.render("hello there", 16000)).pcm


async def test_openai_event_stream_with_usage(rig: Callable[..., Any], backend: TtsBackend) -> None:
    for key in ("audio", "delta"):  # LK reads either field
        r = await rig(dialect="openai", delta_key=key)
        stream, events, error = await speak(r.synthesiser(model="gpt-4o-mini-tts", stream_format="sse"), "hello", "there")
        assert error is None and r.fake.requests[0].content_type == "text/event-stream"
        assert r.fake.requests[0].body["stream_format"] == "sse"
        assert pcm_of(events) == (await backend.render("hello", 24000)).pcm + (await backend.render("there", 24000)).pcm
        assert [e.text for e in events if isinstance(e, SegmentDone)] == ["hello", "there"]
        assert stream.tokens["total_tokens"] == stream.tokens["input_tokens"] + stream.tokens["output_tokens"] > 0


async def test_speaches_event_stream_done_carries_token_usage(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(dialect="speaches", native_rate=24000)
    stream, events, error = await speak(r.synthesiser(stream_format="sse"), "hello")
    assert error is None and r.fake.requests[0].content_type == "text/event-stream"
    assert pcm_of(events) == (await backend.render("hello", 24000)).pcm
    assert stream.tokens == {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}  # from token_usage, not usage


async def test_tts1_refuses_sse(rig: Callable[..., Any]) -> None:
    r = await rig(dialect="openai")
    error, _ = await failure(r.synthesiser(model="tts-1", stream_format="sse"))
    assert error.kind == "provider" and "400" in str(error) and "sse" in str(error)


async def test_kokoro_ignores_stream_format(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(dialect="kokoro")
    stream, events, error = await speak(r.synthesiser(model="kokoro", voice="af_heart", stream_format="sse"), "hello")
    assert error is None and r.fake.requests[0].content_type == "audio/pcm" and stream.tokens == {}
    assert pcm_of(events) == (await backend.render("hello", 24000)).pcm


# -- the stop ---------------------------------------------------------------------------------


async def test_cancel_mid_clause_closes_the_response(rig: Callable[..., Any]) -> None:
    r = await rig(dialect="openai", chunk_interval_s=0.02, chunk_ms=40)
    syn = r.synthesiser(model="tts-1")
    stream = syn.open("reply-2")
    first = "one two three four five six seven eight"
    stream.push_text(first)
    stream.push_text("and this clause is never sent")
    after: list[SynthesisEvent] = []
    async with asyncio.timeout(5):
        async for ev in stream:
            if stream.stop is not None:
                after.append(ev)
            elif isinstance(ev, Audio):
                stream.cancel()
    assert after == []  # nothing of the reply after the stop
    stop = stream.stop
    assert stop is not None and stop.told_at is not None and stop.tell_ms is not None and stop.tell_ms < PROMPTLY_S * 1000
    assert stop.confirmed
    usage = stream.usage()
    # only the clause in flight was sent, so only it is billed and may still be
    assert usage.characters == len(first) and usage.characters_unspoken_at_stop == len(first)
    assert usage.after_stop == "confirmed" and usage.characters_after_stop == 0
    await r.fake.wait_ended()
    (req,) = r.fake.requests  # the second clause never went out
    assert req.disconnected_at is not None and req.disconnected_at - stop.requested_at < PROMPTLY_S
    assert req.audio_bytes_sent < len(req.audio)  # the server still had audio to send
    assert req.characters_billed < len(first) and req.characters_after_disconnect == 0  # it stopped generating
    # audio of the stopped reply that still reaches the stream is dropped and counted
    stream.emit_audio(b"\0" * 480)
    assert stop.late_audio_ms == pytest.approx(10.0) and stream.usage().audio_s == usage.audio_s
    with pytest.raises(RuntimeError):
        stream.push_text("more")
    await stream.aclose()
    assert stream._task is not None and stream._task.done()


async def test_a_server_that_keeps_generating_bills_the_rest(rig: Callable[..., Any]) -> None:
    r = await rig(dialect="openai", chunk_interval_s=0.015, chunk_ms=40, keep_generating=True)
    stream = r.synthesiser(model="tts-1").open("reply-3")
    text = "one two three four five six"
    stream.push_text(text)
    async with asyncio.timeout(5):
        async for ev in stream:
            if isinstance(ev, Audio):
                stream.cancel()
    await r.fake.wait_ended()
    (req,) = r.fake.requests
    assert req.characters_billed == len(text) and req.characters_after_disconnect > 0
    assert req.audio_bytes_after_disconnect > 0 and req.audio_bytes_sent + req.audio_bytes_after_disconnect <= len(req.audio) + 2
    assert stream.usage().characters_unspoken_at_stop == len(text)  # the client's bound covers it


async def test_cancel_before_the_answer_is_told_when_the_connection_is_torn_down(rig: Callable[..., Any]) -> None:
    r = await rig(hang="headers")
    stream = r.synthesiser().open("reply-4")
    stream.push_text("hello there")
    async with asyncio.timeout(5):
        while not r.fake.requests:
            await asyncio.sleep(0.005)
    await asyncio.sleep(0.02)
    stream.cancel()
    events, error = await collect(stream)
    assert events == [] and error is None
    async with asyncio.timeout(PROMPTLY_S):
        while stream.stop is not None and stream.stop.told_at is None:
            await asyncio.sleep(0.005)
    assert stream.stop is not None and stream.stop.told_at is not None and stream.stop.confirmed
    assert stream.usage().after_stop == "confirmed"
    await r.fake.wait_ended()
    assert r.fake.requests[0].disconnected_at is not None


async def test_cancel_with_nothing_in_flight(rig: Callable[..., Any]) -> None:
    r = await rig()
    stream = r.synthesiser().open("reply-5")
    stream.push_text("hello")
    async with asyncio.timeout(5):
        async for ev in stream:
            if isinstance(ev, SegmentDone):
                break
    stream.cancel()
    assert stream.stop is not None and stream.stop.told_at is None and stream.usage().after_stop is None
    assert stream.usage().characters == len("hello")


# -- failures -----------------------------------------------------------------------------


async def test_unreachable() -> None:
    syn = OpenAiSynthesiser(TtsConfig(provider="openai", base_url=f"http://127.0.0.1:{free_port()}/v1", connect_timeout_s=2))
    await syn.warm()  # does not raise
    error, _ = await failure(syn)
    assert error.kind == "unreachable" and error.retryable and error.provider == "openai"
    await syn.aclose()


async def test_wrong_key_is_unauthorized(rig: Callable[..., Any]) -> None:
    r = await rig(dialect="openai")
    error, _ = await failure(r.synthesiser(api_key="sk-wrong"))
    assert error.kind == "unauthorized" and not error.retryable and "Incorrect API key" in str(error)
    r = await rig(dialect="speaches")
    error, _ = await failure(r.synthesiser(api_key="sk-wrong"))
    assert error.kind == "unauthorized" and "403" in str(error) and "Invalid API key" in str(error)
    r = await rig(status=401)  # the fault: an OpenAI-style 401 for the first request only
    syn = r.synthesiser()
    error, _ = await failure(syn)
    assert error.kind == "unauthorized" and "incorrect api key" in str(error).lower()
    _, _, ok = await speak(syn, "hello")
    assert ok is None


@pytest.mark.parametrize(("status", "words"), [(500, "failed"), (429, "rate-limited"), (503, "failed")])
async def test_server_errors_are_the_providers(rig: Callable[..., Any], status: int, words: str) -> None:
    r = await rig(status=status)
    error, _ = await failure(r.synthesiser())
    assert error.kind == "provider" and str(status) in str(error) and words in str(error) and error.retryable


async def test_a_dropped_connection_mid_clause(rig: Callable[..., Any]) -> None:
    r = await rig(drop_after_bytes=4800, chunk_ms=40)
    error, events = await failure(r.synthesiser(), "one two three four five")
    assert error.kind == "dropped"
    assert 0 < len(pcm_of(events)) <= r.fake.requests[0].audio_bytes_sent  # the audio before the drop was played
    assert not any(isinstance(e, SegmentDone) for e in events)


@pytest.mark.parametrize(
    ("options", "stream_format", "words"),
    [
        ({"answer_as": "mpeg"}, "audio", "audio/mpeg"),
        ({"garbage": "http"}, "audio", "not HTTP"),
        ({"garbage": "event"}, "sse", "not JSON"),
        ({"garbage": "base64"}, "sse", "base64"),
        ({"odd_total": True}, "audio", "odd number of bytes"),
    ],
)
async def test_answers_that_are_not_the_protocol(rig: Callable[..., Any], options: dict[str, Any], stream_format: str, words: str) -> None:
    r = await rig(dialect="openai", **options)
    error, _ = await failure(r.synthesiser(model="gpt-4o-mini-tts", stream_format=stream_format))
    assert error.kind == "protocol" and words in str(error), str(error)


async def test_no_first_audio_in_time(rig: Callable[..., Any]) -> None:
    for hang in ("headers", "body"):
        r = await rig(hang=hang)
        error, _ = await failure(r.synthesiser(first_audio_timeout_s=0.3))
        assert error.kind == "provider" and "tts.first_audio_timeout_s" in str(error), hang
        await r.fake.wait_ended()
        assert r.fake.requests[0].disconnected_at is not None  # the client hung up


async def test_a_strict_server_refusing_sample_rate(rig: Callable[..., Any]) -> None:
    """If a server refused unknown fields (not documented for OpenAI), the
    error names the field: the provider's message is kept."""
    r = await rig(dialect="openai", strict_fields=True, faulty_requests=None)
    error, _ = await failure(r.synthesiser(model="tts-1"))
    assert error.kind == "provider" and "sample_rate" in str(error)


async def test_a_closed_synthesiser(rig: Callable[..., Any]) -> None:
    r = await rig()
    syn = r.synthesiser()
    await syn.aclose()
    error, _ = await failure(syn)
    assert error.kind == "closed" and r.fake.requests == []
    assert error_message('{"detail": {"error": "x", "message": "Voice not found"}}') == "Voice not found"
    assert error_message('{"detail": [{"msg": "field required"}]}') == "field required"


# -- warm, sessions, tasks --------------------------------------------------------------------


async def test_warm_opens_the_connection_the_first_reply_uses(rig: Callable[..., Any]) -> None:
    r = await rig()
    syn = r.synthesiser()
    await syn.warm()
    await syn.warm()  # idempotent
    assert len(r.fake.model_requests) == 1 and r.fake.model_requests[0].headers["Authorization"] == f"Bearer {KEY}"
    _, _, error = await speak(syn, "hello", "there")
    assert error is None
    assert {q.peer for q in r.fake.requests} == {r.fake.model_requests[0].peer}  # one kept-alive connection


async def test_warm_never_raises_and_a_stream_does_not_wait_for_it(rig: Callable[..., Any]) -> None:
    r = await rig(models=False, api_key="other")
    syn = r.synthesiser()
    await syn.warm()  # 401, then a 404 below: ignored
    r.fake.options.api_key = KEY
    syn = r.synthesiser()
    warming = asyncio.ensure_future(syn.warm())
    _, _, error = await speak(syn, "hello")  # opened before warm() finished
    await warming
    assert error is None and [q.status for q in r.fake.model_requests] == [401, 404]


async def test_a_shared_session_is_used_and_not_closed(rig: Callable[..., Any]) -> None:
    r = await rig()
    async with aiohttp.ClientSession() as http:
        syn = r.synthesiser(http)
        _, _, error = await speak(syn, "hello")
        assert error is None and syn._own is None
        await syn.aclose()
        assert not http.closed
    own = r.synthesiser()
    await speak(own, "hello")
    session = own._own
    await own.aclose()
    assert session is not None and session.closed


async def test_no_task_left_after_aclose(rig: Callable[..., Any]) -> None:
    r = await rig(chunk_interval_s=0.05)
    syn = r.synthesiser()
    busy = syn.open("busy")  # mid-clause
    busy.push_text("one two three four five six")
    queued = syn.open("queued")
    queued.push_text("hello")
    queued.push_text("there")
    idle = syn.open("idle")  # nothing pushed
    async with asyncio.timeout(5):
        while busy.seconds_yielded == 0 or queued._response is None:
            await asyncio.sleep(0.005)
    tasks = [s._task for s in (busy, queued)]
    await syn.aclose()
    assert all(t is not None and t.done() for t in tasks) and idle._task is None
    assert busy.stop is not None and busy.stop.confirmed and queued.usage().characters == len("hello")
    assert not [t for t in asyncio.all_tasks() if t.get_name().startswith("openai-tts-") and not t.done()]
    await r.fake.wait_ended()
    assert all(q.disconnected_at is not None for q in r.fake.requests)


# -- parsing, without a server ---------------------------------------------------------------


def _wav(fmt: int = 1, channels: int = 1, rate: int = 16000, bits: int = 16, extensible: bool = False) -> bytes:
    if extensible:
        body = struct.pack("<HHIIHHHHI", 0xFFFE, channels, rate, rate * 2, 2, bits, 22, bits, 4) + struct.pack("<H", fmt) + bytes(14)
    else:
        body = struct.pack("<HHIIHH", fmt, channels, rate, rate * 2, 2, bits)
    return (
        b"RIFF"
        + struct.pack("<I", 0)
        + b"WAVE"
        + b"LIST"
        + struct.pack("<I", 3)
        + b"abc\0"
        + b"fmt "
        + struct.pack("<I", len(body))
        + body
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


async def test_wav_headers() -> None:
    head = _wav()
    for cut in range(len(head)):  # arriving in pieces: not whole until the data chunk
        assert parse_wav_header(head[:cut]) is None
    assert parse_wav_header(head) == (16000, 0xFFFFFFFF, len(head))
    assert parse_wav_header(_wav(rate=22050, extensible=True)) == (22050, 0xFFFFFFFF, len(_wav(extensible=True)))
    for bad in (_wav(channels=2), _wav(bits=8), _wav(fmt=3), _wav(rate=1), b"ID3\x04" + bytes(20)):
        with pytest.raises(SynthesisError) as exc:
            parse_wav_header(bad)
        assert exc.value.kind == "protocol"
    assert parse_content_type('Audio/PCM; rate="16000"; channels=1') == ("audio/pcm", {"rate": "16000", "channels": "1"})
