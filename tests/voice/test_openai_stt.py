"""The ``/v1/audio/transcriptions`` recogniser (:mod:`voice.openai_stt`)
against a real local server speaking OpenAI's, speaches' and vLLM's
dialects (:mod:`testkit.fake_openai_transcriptions`), whose transcripts are
pocketsphinx's with the test grammar, so they are exact for TEST_PHRASES.

What went over the wire is asserted (headers, form fields, the WAV and its
audio), every bad answer is a test, and the session's own path is run:
:class:`voice.transcription.Transcription` with
:class:`voice.stt_failover.Failover`, a retry, and the fall back to the
embedded recogniser."""

from __future__ import annotations

import asyncio
import logging
import math
import subprocess
import sys
import time
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import free_port, requires_espeak, start_app

from clock import SystemClock
from media.frames import load_pcm
from testkit.fake_openai_transcriptions import FakeTranscriptions
from testkit.stt_backend import Latency, SttBackend
from voice import openai_stt
from voice.openai_stt import OpenAiTranscriptionRecogniser, OpenAiTranscriptionStream, wav_bytes
from voice.recognisers import SttConfig, build_recognisers
from voice.recognition import (
    EndOfUtterance,
    Final,
    Interim,
    RecognitionError,
    RecognitionEvent,
    RecognitionUsage,
    StreamOptions,
)
from voice.stt_failover import Failover
from voice.transcription import Transcription

pytestmark = [requires_espeak, pytest.mark.asyncio(loop_scope="module")]

#: short answer times, so the module stays quick
FAST = Latency(interim_s=0.04, final_s=0.08)
KEY = "sk-test-0123456789"
FRAME = 640  # 20 ms at 16 kHz s16


# -- fixtures ----------------------------------------------------------------------


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend(grammar_file: Path) -> AsyncIterator[SttBackend]:
    b = SttBackend(str(grammar_file), max_decoders=2)
    await b.start()
    yield b
    await b.aclose()


@pytest.fixture(scope="module")
def speech(say: Callable[..., Path]) -> Callable[[str], bytes]:
    """``speech(phrase)``: the phrase spoken, 16 kHz s16, with 0.25 s of silence either side."""
    cache: dict[str, bytes] = {}

    def _speech(text: str) -> bytes:
        if text not in cache:
            pad = b"\0" * 8000
            cache[text] = pad + load_pcm(say(text), 16_000) + pad
        return cache[text]

    return _speech


@pytest_asyncio.fixture(loop_scope="module")
async def servers(backend: SttBackend) -> AsyncIterator[Callable[..., FakeTranscriptions]]:
    """``await servers(**knobs)``: a started fake (closed after the test)."""
    started: list[FakeTranscriptions] = []

    async def _start(**knobs: object) -> FakeTranscriptions:
        knobs.setdefault("latency", FAST)
        fake = FakeTranscriptions(backend, **knobs)  # type: ignore[arg-type]
        await fake.start()
        started.append(fake)
        return fake

    yield _start  # type: ignore[misc]
    for fake in started:
        await fake.aclose()


@pytest_asyncio.fixture(loop_scope="module")
async def recognisers() -> AsyncIterator[Callable[..., OpenAiTranscriptionRecogniser]]:
    """``recognisers(base_url, **stt)``: a recogniser (closed after the test)."""
    made: list[OpenAiTranscriptionRecogniser] = []

    def _make(base_url: str, **stt: object) -> OpenAiTranscriptionRecogniser:
        stt.setdefault("api_key", KEY)
        r = OpenAiTranscriptionRecogniser(SttConfig(provider="openai", base_url=base_url, **stt))
        made.append(r)
        return r

    yield _make
    for r in made:
        await r.aclose()


class Reader:
    """Reads a stream's events in the background."""

    def __init__(self, stream: OpenAiTranscriptionStream) -> None:
        self.events: list[RecognitionEvent] = []
        self.error: RecognitionError | None = None
        self.ended = False
        self._changed = asyncio.Event()
        self.task = asyncio.ensure_future(self._run(stream))

    async def _run(self, stream: OpenAiTranscriptionStream) -> None:
        try:
            async for ev in stream.events():
                self.events.append(ev)
                self._changed.set()
        except RecognitionError as exc:
            self.error = exc
        finally:
            self.ended = True
            self._changed.set()

    async def until(self, done: Callable[[Reader], bool], timeout: float = 8.0) -> None:
        async with asyncio.timeout(timeout):
            while not done(self):
                self._changed.clear()
                await self._changed.wait()

    async def ends(self, n: int = 1) -> None:
        """Until ``n`` utterances ended (their usage too), or the stream failed."""
        await self.until(lambda r: r.error is not None or r.ended or len(r.of(RecognitionUsage)) >= n)

    async def failure(self) -> RecognitionError:
        await self.until(lambda r: r.ended)
        assert self.error is not None, f"the stream did not fail: {self.events}"
        return self.error

    def of(self, kind: type) -> list:
        return [e for e in self.events if isinstance(e, kind)]


def interims_grow_to(texts: list[str], final: str) -> bool:
    """The deltas came as interims of the text so far: at least one, each a
    growing prefix of the final text (not one per delta: at most one every
    ``openai_stt.INTERIM_EVERY_S``; the fake sends a word every 40 ms)."""
    return bool(texts) and all(final.startswith(t) for t in texts) and all(len(a) < len(b) for a, b in zip(texts, texts[1:], strict=False))


def feed(stream: OpenAiTranscriptionStream, pcm: bytes) -> None:
    for i in range(0, len(pcm), FRAME):
        stream.send(pcm[i : i + FRAME])


async def transcribe_once(recogniser: OpenAiTranscriptionRecogniser, pcm: bytes) -> Reader:
    stream = recogniser.open(StreamOptions(session_id="s1"))
    reader = Reader(stream)
    feed(stream, pcm)
    stream.finalize()
    await reader.ends()
    await stream.aclose()
    await reader.until(lambda r: r.ended)
    return reader


# -- on the wire ---------------------------------------------------------------------


async def test_json_request_on_the_wire(servers, recognisers, speech) -> None:
    fake = await servers(api_key=KEY)
    rec = recognisers(fake.url, language="en-US", keyterms=["Acme", "Zorp Cola"])
    noise = b"\1\0" * 8000  # 0.5 s, discarded: never sent
    first, second = speech("tell me a story"), speech("charge my card")
    stream = rec.open(StreamOptions(session_id="s1"))
    reader = Reader(stream)
    stream.finalize()  # nothing sent yet: no request
    feed(stream, noise)
    stream.discard()
    feed(stream, first)
    stream.finalize()
    await reader.ends(1)
    feed(stream, second)
    stream.finalize()
    await reader.ends(2)
    await stream.aclose()
    await reader.until(lambda r: r.ended)

    assert reader.error is None
    assert len(fake.requests) == 2
    req = fake.requests[0]
    assert req.headers["Authorization"] == f"Bearer {KEY}"
    assert req.headers["Content-Type"].startswith("multipart/form-data; boundary=")
    assert req.fields == {"model": ["gpt-4o-transcribe"], "language": ["en"], "prompt": ["Acme, Zorp Cola"], "response_format": ["json"]}
    assert (req.file_name, req.file_type, req.wav_format) == ("audio.wav", "audio/wav", (16_000, 1, 2))
    assert req.pcm == first and fake.requests[1].pcm == second  # exactly the segment's audio, not the discarded noise
    a0 = 0.5
    a1, a2 = a0 + len(first) / 32000, a0 + (len(first) + len(second)) / 32000
    i0, o0 = FakeTranscriptions.token_usage(len(first) / 32000, "Acme, Zorp Cola", "tell me a story")
    i1, o1 = FakeTranscriptions.token_usage(len(second) / 32000, "Acme, Zorp Cola", "charge my card")
    assert reader.events == [
        Final("tell me a story", a0, a1, finalized=True),
        EndOfUtterance(a1),
        RecognitionUsage(input_tokens=i0, output_tokens=o0, start_s=a0, end_s=a1),
        Final("charge my card", a1, a2, finalized=True),
        EndOfUtterance(a2),
        RecognitionUsage(input_tokens=i1, output_tokens=o1, start_s=a1, end_s=a2),
    ]


async def test_no_key_means_no_authorization_header(servers, recognisers, speech) -> None:
    fake = await servers()  # a local server without a key
    reader = await transcribe_once(recognisers(fake.url, api_key="", language=""), speech("count to twenty"))
    assert [f.text for f in reader.of(Final)] == ["count to twenty"]
    assert "Authorization" not in fake.requests[0].headers
    assert "language" not in fake.requests[0].fields and "prompt" not in fake.requests[0].fields


async def test_verbose_json_words_are_in_stream_seconds(servers, recognisers, speech) -> None:
    fake = await servers(api_key=KEY)
    rec = recognisers(fake.url, model="whisper-1", word_timestamps=True)
    first, second = speech("hello there"), speech("please order a coffee")
    stream = rec.open(StreamOptions())
    reader = Reader(stream)
    feed(stream, first)
    stream.finalize()
    feed(stream, second)
    stream.finalize()
    await reader.ends(2)
    await stream.aclose()

    assert all(r.fields["response_format"] == ["verbose_json"] for r in fake.requests)
    assert all(r.fields["timestamp_granularities[]"] == ["word"] for r in fake.requests)
    # one request per segment: they may finish out of order; each final says where it is
    finals = sorted(reader.of(Final), key=lambda f: f.start_s)
    assert [f.text for f in finals] == ["hello there", "please order a coffee"]
    start, end = len(first) / 32000, (len(first) + len(second)) / 32000
    words = finals[1].words
    assert [w.text for w in words] == ["please", "order", "a", "coffee"]
    assert start <= words[0].start_s and words[-1].end_s <= end
    assert all(a.start_s <= a.end_s <= b.start_s + 0.02 for a, b in zip(words, words[1:], strict=False))
    usage = max(reader.of(RecognitionUsage), key=lambda u: u.start_s or 0.0)
    assert (usage.audio_s, usage.source, usage.start_s, usage.end_s) == (math.ceil(len(second) / 32000), "provider", start, end)


@pytest.mark.parametrize("done_marker", [False, True], ids=["no-DONE", "DONE"])
async def test_openai_stream_gives_interims_then_the_final(servers, recognisers, speech, done_marker: bool) -> None:
    fake = await servers(api_key=KEY, done_marker=done_marker)
    pcm = speech("what is the weather like today")
    reader = await transcribe_once(recognisers(fake.url, stream=True), pcm)
    assert fake.requests[0].fields["stream"] == ["true"]
    assert fake.requests[0].content_type == "text/event-stream"
    end = len(pcm) / 32000
    interims = reader.of(Interim)
    assert interims_grow_to([i.text for i in interims], "what is the weather like today")
    assert all((i.start_s, i.end_s) == (0.0, end) for i in interims)
    i, o = FakeTranscriptions.token_usage(end, "", "what is the weather like today")
    assert reader.events[len(interims):] == [
        Final("what is the weather like today", 0.0, end, finalized=True),
        EndOfUtterance(end),
        RecognitionUsage(input_tokens=i, output_tokens=o, start_s=0.0, end_s=end),
    ]


async def test_whisper_1_ignores_stream_and_answers_json(servers, recognisers, speech) -> None:
    fake = await servers(api_key=KEY)
    pcm = speech("count to twenty")
    reader = await transcribe_once(recognisers(fake.url, model="whisper-1", stream=True), pcm)
    assert fake.requests[0].fields["stream"] == ["true"] and fake.requests[0].content_type == "application/json"
    assert reader.of(Interim) == []
    assert [f.text for f in reader.of(Final)] == ["count to twenty"]
    assert reader.of(RecognitionUsage)[0].audio_s == math.ceil(len(pcm) / 32000)


async def test_speaches_stream_one_delta_and_no_usage(servers, recognisers, speech) -> None:
    fake = await servers(dialect="speaches", api_key=KEY)
    pcm = speech("tell me a story")
    reader = await transcribe_once(recognisers(fake.url, stream=True), pcm)
    assert fake.requests[0].sent[0].startswith('{"type": "transcript.text.delta", "delta": " tell me a story"')
    assert '"text": " tell me a story"' in fake.requests[0].sent[-1] and '"usage": null' in fake.requests[0].sent[-1]
    end = len(pcm) / 32000
    assert reader.events == [
        Interim("tell me a story", 0.0, end),
        Final("tell me a story", 0.0, end, finalized=True),
        EndOfUtterance(end),
        RecognitionUsage(audio_s=round(end, 3), start_s=0.0, end_s=end, source="counted"),
    ]


@pytest.mark.parametrize("usage_chunk", [True, False], ids=["usage-chunk", "no-usage"])
async def test_vllm_stream_of_chat_chunks(servers, recognisers, speech, usage_chunk: bool) -> None:
    fake = await servers(dialect="vllm", api_key=KEY, usage_chunk=usage_chunk)
    pcm = speech("please order a coffee")
    reader = await transcribe_once(recognisers(fake.url, stream=True), pcm)
    assert fake.requests[0].sent[-1] == "[DONE]"
    assert '"object": "transcription.chunk"' in fake.requests[0].sent[0]
    end = len(pcm) / 32000
    assert interims_grow_to([i.text for i in reader.of(Interim)], "please order a coffee")
    assert reader.of(Final) == [Final("please order a coffee", 0.0, end, finalized=True)]
    (usage,) = reader.of(RecognitionUsage)
    if usage_chunk:
        i, o = FakeTranscriptions.token_usage(end, "", "please order a coffee")
        assert usage == RecognitionUsage(input_tokens=i, output_tokens=o, start_s=0.0, end_s=end)
    else:
        assert usage == RecognitionUsage(audio_s=round(end, 3), start_s=0.0, end_s=end, source="counted")


@pytest.mark.parametrize(
    ("dialect", "stt", "answer_as", "content_type", "words", "usage_s"),
    [
        ("vllm", {}, None, "application/json", [], "ceil"),  # " text", duration usage in whole seconds
        ("vllm", {"word_timestamps": True, "model": "openai/whisper-large-v3"}, None, "application/json", [],
         None),  # no words, duration as a string
        ("speaches", {"word_timestamps": True, "model": "Systran/faster-whisper-tiny.en"}, None, "application/json", ["okay"],
         None),  # " okay" words
        ("speaches", {}, "text", "text/plain", [], None),
        ("openai", {}, "text", "text/plain", [], None),  # "okay\n"
        ("vllm", {}, "text", "application/json", [], "ceil"),  # vLLM answers JSON to text
    ],
)
async def test_dialect_quirks_of_whole_answers(servers, recognisers, speech, dialect, stt, answer_as, content_type, words,
                                              usage_s) -> None:
    fake = await servers(dialect=dialect, api_key=KEY, answer_as=answer_as)
    pcm = speech("okay")
    reader = await transcribe_once(recognisers(fake.url, **stt), pcm)
    assert reader.error is None
    assert fake.requests[0].content_type == content_type
    (final,) = reader.of(Final)
    assert final.text == "okay" and [w.text for w in final.words] == words
    (usage,) = reader.of(RecognitionUsage)
    if usage_s == "ceil":
        assert (usage.audio_s, usage.source) == (math.ceil(len(pcm) / 32000), "provider")
    else:
        assert (usage.audio_s, usage.source) == (round(len(pcm) / 32000, 3), "counted")


async def test_requests_run_side_by_side_and_answer_out_of_order(servers, recognisers, speech) -> None:
    fake = await servers(api_key=KEY, extra_delay_s=[0.6, 0.0])
    first, second = speech("what is the weather"), speech("yeah")
    stream = recognisers(fake.url).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, first)
    stream.finalize()
    feed(stream, second)
    stream.finalize()  # a second request while the first is in flight
    await reader.ends(2)
    await stream.aclose()
    r0, r1 = fake.requests
    assert r1.answered_at is not None and r0.answered_at is not None and r1.answered_at < r0.answered_at  # both in flight at once
    t1, t2 = len(first) / 32000, (len(first) + len(second)) / 32000
    assert r1.received_at < r0.answered_at  # the second was sent while the first was in flight
    # the short one's answer comes first, each with its own span
    assert [(f.text, f.start_s, f.end_s) for f in reader.of(Final)] == [("yeah", t1, t2), ("what is the weather", 0.0, t1)]
    assert [type(e) for e in reader.events] == [Final, EndOfUtterance, RecognitionUsage] * 2
    assert [(u.start_s, u.end_s) for u in reader.of(RecognitionUsage)] == [(t1, t2), (0.0, t1)]


async def test_segment_keeps_at_most_max_segment_s(servers, recognisers, speech, monkeypatch) -> None:
    monkeypatch.setattr(openai_stt, "MAX_SEGMENT_S", 2.0)
    fake = await servers(api_key=KEY)
    pcm = b"\0" * 32000 * 2 + speech("okay")  # over 2 s: the leading silence goes
    stream = recognisers(fake.url).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, pcm)
    stream.finalize()
    await reader.ends()
    await stream.aclose()
    assert fake.requests[0].audio_s == 2.0 and fake.requests[0].pcm == pcm[-64000:]
    (final,) = reader.of(Final)
    total = len(pcm) / 32000
    assert (final.text, final.start_s, final.end_s) == ("okay", (len(pcm) - 64000) / 32000, total)
    assert stream.dropped_s == pytest.approx(total - 2.0)


# -- the key ---------------------------------------------------------------------------


@pytest.mark.parametrize(("dialect", "status", "said"), [
    ("openai", 401, "Incorrect API key provided"),
    ("speaches", 403, "Invalid API key"),
    ("vllm", 401, "Unauthorized"),
])
async def test_refused_key_fails_the_stream_and_later_ones_at_once(servers, recognisers, speech, caplog, dialect, status,
                                                                   said) -> None:
    fake = await servers(dialect=dialect, api_key="sk-right")
    rec = recognisers(fake.url, api_key="sk-wrong")
    caplog.set_level(logging.INFO, logger="voice.openai_stt")
    stream = rec.open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("hello there"))
    stream.finalize()
    error = await reader.failure()
    assert (error.kind, error.retryable) == ("unauthorized", False)
    assert "stt.api_key" in str(error) and str(status) in str(error) and said in str(error)
    assert fake.requests[0].status == status
    await stream.aclose()
    # the next utterances do not ask again, and the log says it once
    for _ in range(2):
        again = rec.open(StreamOptions())
        later = Reader(again)
        feed(again, speech("hello there"))
        again.finalize()
        assert (await later.failure()).kind == "unauthorized"
        await again.aclose()
    assert len(fake.requests) <= 1  # the one cancelled (maybe before it arrived), and none after the close
    warnings = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warnings) == 1 and "stt.api_key was refused by" in warnings[0].getMessage() and warnings[0].exc_info is None


async def test_start_logs_a_refused_key_once_and_a_later_start_clears_it(servers, recognisers, speech, caplog) -> None:
    fake = await servers(api_key="sk-right")
    rec = recognisers(fake.url, api_key="sk-wrong")
    caplog.set_level(logging.INFO, logger="voice.openai_stt")
    await rec.start()
    await rec.start()
    assert [r.headers.get("Authorization") for r in fake.model_requests] == ["Bearer sk-wrong"] * 2
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert [w.getMessage() for w in warnings] == [
        f"stt.api_key was refused by {fake.url} (401 Unauthorized): sessions will use the fallback recogniser"
    ]
    assert warnings[0].exc_info is None
    stream = rec.open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("hello there"))
    stream.finalize()
    assert (await reader.failure()).kind == "unauthorized"
    assert fake.requests == []  # failed at once, nothing sent
    await stream.aclose()

    fake.api_key = "sk-wrong"  # the provider now takes it
    await rec.start()
    assert rec.refused is None
    reader = await transcribe_once(rec, speech("hello there"))
    assert [f.text for f in reader.of(Final)] == ["hello there"]


async def test_start_never_fails_the_server(servers, recognisers, caplog) -> None:
    caplog.set_level(logging.INFO, logger="voice.openai_stt")
    gone = recognisers(f"http://127.0.0.1:{free_port()}/v1", connect_timeout_s=1.0)
    await gone.start()
    await gone.start()
    no_models = await servers(models=False)
    whisper_cpp_like = recognisers(no_models.url)
    await whisper_cpp_like.start()
    failing = await servers(status=503)
    broken = recognisers(failing.url)
    await broken.start()
    lines = [r.getMessage() for r in caplog.records]
    assert all(r.levelno == logging.INFO and r.exc_info is None for r in caplog.records)
    assert len([m for m in lines if "is not reachable now" in m]) == 1  # once, not per start
    assert any("404 Not Found" in m for m in lines) and any("503 Service Unavailable" in m for m in lines)
    assert gone.refused is None and whisper_cpp_like.refused is None and broken.refused is None


# -- failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(("status", "said"), [
    (429, "Rate limit reached"),
    (500, "The server had an error"),
    (503, "overloaded"),
])
async def test_provider_errors(servers, recognisers, speech, status, said) -> None:
    fake = await servers(api_key=KEY, status=status)
    stream = recognisers(fake.url).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("yeah"))
    stream.finalize()
    error = await reader.failure()
    assert (error.kind, error.retryable) == ("provider", True)
    assert str(status) in str(error) and said in str(error)
    await stream.aclose()


async def test_a_refused_request_is_a_provider_error(servers, recognisers, speech) -> None:
    """A model without verbose_json (as gpt-4o-transcribe, which the settings
    refuse with word_timestamps; a newer one they cannot know): OpenAI answers
    400, which is told as the provider's."""
    fake = await servers(api_key=KEY)
    stream = recognisers(fake.url, model="gpt-5-transcribe", word_timestamps=True).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("yeah"))
    stream.finalize()
    error = await reader.failure()
    assert error.kind == "provider" and "400" in str(error) and "not compatible with model" in str(error)
    await stream.aclose()


async def test_unreachable(recognisers, speech) -> None:
    stream = recognisers(f"http://127.0.0.1:{free_port()}/v1").open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("yeah"))
    stream.finalize()
    error = await reader.failure()
    assert error.kind == "unreachable" and "stt.base_url" in str(error)
    await stream.aclose()


@pytest.mark.parametrize("stream_on", [False, True], ids=["json", "sse"])
async def test_connection_dropped_mid_body(servers, recognisers, speech, stream_on: bool) -> None:
    fake = await servers(api_key=KEY, drop=True)
    stream = recognisers(fake.url, stream=stream_on).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("tell me a story"))
    stream.finalize()
    error = await reader.failure()
    assert error.kind == "dropped"
    assert fake.requests[0].status == 200 and len(fake.requests[0].sent) == 1
    assert reader.of(Final) == []
    await stream.aclose()


@pytest.mark.parametrize(("garbage", "stream_on", "kind", "said"), [
    ("json", False, "protocol", "not JSON"),
    ("shape", False, "protocol", "without a text"),
    ("shape", True, "protocol", "delta that is not text"),
    ("sse", True, "protocol", "ended its event stream before"),
    ("sse_json", True, "protocol", "not JSON"),
    ("huge", False, "protocol", "more than"),
    ("huge_sse", True, "protocol", "event line over"),
    ("content_type", False, "protocol", "text/html"),
    ("error_event", True, "provider", "error mid-stream"),
])
async def test_garbage_is_a_clear_error(servers, recognisers, speech, garbage, stream_on, kind, said) -> None:
    fake = await servers(api_key=KEY, garbage=garbage)
    stream = recognisers(fake.url, stream=stream_on).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("yeah"))
    stream.finalize()
    error = await reader.failure()
    assert error.kind == kind and said in str(error), str(error)
    assert reader.of(Final) == []
    await stream.aclose()


@pytest.mark.parametrize("dialect", ["vllm", "openai"])
async def test_error_event_shapes(servers, recognisers, speech, dialect) -> None:
    fake = await servers(dialect=dialect, api_key=KEY, garbage="error_event")
    stream = recognisers(fake.url, stream=True).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("yeah"))
    stream.finalize()
    error = await reader.failure()
    assert error.kind == "provider" and "The server had an error" in str(error)
    await stream.aclose()


async def test_closing_cancels_a_request_in_flight(servers, recognisers, speech) -> None:
    fake = await servers(api_key=KEY, hang=True)
    stream = recognisers(fake.url).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("tell me a story"))
    stream.finalize()
    async with asyncio.timeout(5):
        while not fake.requests or fake.requests[0].audio_s is None:
            await asyncio.sleep(0.01)
    await asyncio.sleep(0.2)
    assert reader.events == [] and not reader.ended
    t0 = time.monotonic()
    await stream.aclose()
    await stream.aclose()  # idempotent
    assert time.monotonic() - t0 < 0.5
    await reader.until(lambda r: r.ended, timeout=1)
    assert reader.error is None  # closed, not failed
    await asyncio.wait_for(fake.requests[0].done.wait(), 2)
    assert fake.requests[0].disconnected  # the server saw the client go


async def test_cancelled_aclose_still_ends_the_stream(servers, recognisers, speech) -> None:
    fake = await servers(api_key=KEY, hang=True)
    stream = recognisers(fake.url).open(StreamOptions())
    reader = Reader(stream)
    feed(stream, speech("yeah"))
    stream.finalize()
    closing = asyncio.ensure_future(stream.aclose())
    await asyncio.sleep(0)
    closing.cancel()
    await asyncio.wait({closing})
    await reader.until(lambda r: r.ended, timeout=1)
    stream.send(b"\0" * 640)  # ignored: never raises
    stream.finalize()
    assert reader.error is None
    await asyncio.sleep(0.05)
    assert len(fake.requests) <= 1  # the one cancelled (maybe before it arrived), and none after the close


async def test_recogniser_closes_its_http_session(servers, recognisers, speech) -> None:
    fake = await servers(api_key=KEY)
    rec = recognisers(fake.url)
    await transcribe_once(rec, speech("yeah"))
    session = rec.client()
    await rec.aclose()
    await rec.aclose()
    assert session.closed
    assert rec.name == "openai" and rec.pricing == rec.config.pricing


async def test_build_recognisers_makes_this_one(grammar_file: Path) -> None:
    primary, fallback = build_recognisers(SttConfig(provider="openai", embedded="pocketsphinx", grammar=grammar_file))
    assert isinstance(primary, OpenAiTranscriptionRecogniser) and fallback is not None and fallback.name == "pocketsphinx"


# -- the fake's own strictness ---------------------------------------------------------------


async def _post(url: str, fields: dict[str, str], file: bytes | None, key: str | None = KEY) -> tuple[int, object]:
    form = aiohttp.FormData(default_to_multipart=True)
    if file is not None:
        form.add_field("file", file, filename="a.wav", content_type="audio/wav")
    for name, value in fields.items():
        form.add_field(name, value)
    headers = {"Authorization": f"Bearer {key}"} if key else {}
    async with aiohttp.ClientSession() as s, s.post(f"{url}/audio/transcriptions", data=form, headers=headers) as resp:
        return resp.status, await resp.json(content_type=None)


async def test_the_fake_refuses_what_the_real_servers_refuse(servers) -> None:
    wav = wav_bytes(b"\0" * 3200)
    openai = await servers(api_key=KEY)
    assert await _post(openai.url, {"model": "whisper-1"}, None) == (
        400, {"error": {"message": "Could not parse multipart form: 'file' is required", "type": "invalid_request_error",
                        "param": "file", "code": None}})
    status, body = await _post(openai.url, {}, wav)
    assert status == 400 and body["error"]["param"] == "model"  # type: ignore[index]
    status, body = await _post(openai.url, {"model": "whisper-1"}, b"ID3 not a wav")
    assert status == 400 and "Invalid file format" in body["error"]["message"]  # type: ignore[index]
    status, body = await _post(openai.url, {"model": "gpt-4o-transcribe", "response_format": "verbose_json"}, wav)
    assert status == 400 and "not compatible" in body["error"]["message"]  # type: ignore[index]
    status, body = await _post(openai.url, {"model": "whisper-1", "timestamp_granularities[]": "word"}, wav)
    assert status == 400
    status, body = await _post(openai.url, {"model": "whisper-1", "language": "en-US"}, wav)
    assert status == 400 and body["error"]["param"] == "language"  # type: ignore[index]
    status, body = await _post(openai.url, {"model": "whisper-1"}, wav, key=None)
    assert status == 401 and body["error"]["code"] == "invalid_api_key"  # type: ignore[index]
    speaches = await servers(dialect="speaches")
    status, body = await _post(speaches.url, {}, wav, key=None)
    assert status == 422 and body["detail"][0]["loc"] == ["body", "model"]  # type: ignore[index]
    vllm = await servers(dialect="vllm")
    status, body = await _post(vllm.url, {"model": "m", "response_format": "verbose_json", "stream": "true"}, wav, key=None)
    assert status == 400 and body["error"]["code"] == 400  # type: ignore[index]
    async with aiohttp.ClientSession() as s, s.get(f"{openai.url}/models") as resp:
        assert resp.status == 401
    assert len(openai.requests) == 7 and openai.requests[2].pcm is None


# -- as the session uses it ---------------------------------------------------------------------


def frames(pcm: bytes) -> list[bytes]:
    return [pcm[i : i + FRAME] for i in range(0, len(pcm), FRAME)]


async def run_utterance(transcription: Transcription, pcm: bytes, split_at: int | None = None) -> str:
    """As the session does: begin, 20 ms frames (silence before and after
    are in ``pcm``), then finish; ``split_at``: a frame index where the
    utterance is ended once and goes on (a backchannel candidate judged)."""
    utt = transcription.begin()
    for k, frame in enumerate(frames(pcm)):
        if k == split_at:
            utt.end()
        utt.feed(frame)
        await asyncio.sleep(0)
    async with asyncio.timeout(15):
        return await utt.finish()


@pytest_asyncio.fixture(loop_scope="module")
async def session_of() -> AsyncIterator[Callable[..., tuple[Transcription, list[tuple[str, str, str]]]]]:
    running: list[tuple[Transcription, asyncio.Task[None]]] = []

    def _make(primary, fallback=None) -> tuple[Transcription, list[tuple[str, str, str]]]:
        notices: list[tuple[str, str, str]] = []
        t = Transcription(Failover(primary, fallback), StreamOptions(session_id="s1"), clock=SystemClock(), final_timeout_s=4.0,
                          on_failover=lambda name, err, action, nxt: notices.append((name, err.kind, action)))
        running.append((t, asyncio.ensure_future(t.run())))
        return t, notices

    yield _make
    for t, task in running:
        t.close()
        await asyncio.wait_for(task, 5)


async def test_session_transcribes_an_utterance(servers, recognisers, speech, session_of) -> None:
    fake = await servers(api_key=KEY, latency=Latency())  # a realistic 150/300 ms
    transcription, notices = session_of(recognisers(fake.url, stream=True))
    pcm = b"\0" * 16000 + speech("what is the weather like today") + b"\0" * 12800
    assert await run_utterance(transcription, pcm) == "what is the weather like today"
    assert notices == [] and len(fake.requests) == 1 and fake.requests[0].pcm == pcm
    usage = transcription.usage()
    assert usage.audio_s["openai"] == pytest.approx(len(pcm) / 32000)
    assert usage.input_tokens["openai"] > 0


async def test_session_keeps_both_segments_when_answers_come_out_of_order(servers, recognisers, speech, session_of) -> None:
    fake = await servers(api_key=KEY, extra_delay_s=[0.5, 0.0])
    transcription, _ = session_of(recognisers(fake.url))
    first, second = speech("what is the weather"), speech("like in paris today")
    text = await run_utterance(transcription, first + second, split_at=len(first) // FRAME)
    assert text == "what is the weather like in paris today"
    assert fake.requests[1].answered_at < fake.requests[0].answered_at


@pytest.mark.parametrize("fault", ["drop", "503"])
async def test_session_retries_a_failed_request_once(servers, recognisers, speech, session_of, fault) -> None:
    knobs = {"drop": True} if fault == "drop" else {"status": 503}
    fake = await servers(api_key=KEY, faults=1, **knobs)
    transcription, notices = session_of(recognisers(fake.url, stream=fault == "drop"))
    pcm = b"\0" * 9600 + speech("please order a coffee") + b"\0" * 9600
    assert await run_utterance(transcription, pcm) == "please order a coffee"
    assert notices == [("openai", "dropped" if fault == "drop" else "provider", "reconnect")]
    assert [r.pcm == pcm for r in fake.requests] == [True, True]  # the same audio, replayed
    assert transcription.usage().audio_s["openai"] == pytest.approx(2 * len(pcm) / 32000)


async def test_session_falls_back_to_the_embedded_recogniser_when_the_key_is_refused(
        servers, recognisers, speech, session_of, backend, caplog) -> None:
    fake = await servers(api_key="sk-right")
    rec = recognisers(fake.url, api_key="sk-wrong")
    caplog.set_level(logging.INFO, logger="voice.openai_stt")
    await rec.start()
    transcription, notices = session_of(rec, backend.stt)  # PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file))
    for phrase in ("charge my card", "make it a large one"):
        pcm = b"\0" * 9600 + speech(phrase) + b"\0" * 9600
        assert await run_utterance(transcription, pcm) == phrase
    assert notices == [("openai", "unauthorized", "fallback")]
    assert fake.requests == []  # the refused key was never sent audio
    assert len([r for r in caplog.records if r.levelno == logging.WARNING and r.name == "voice.openai_stt"]) == 1


async def test_session_falls_back_when_the_key_is_refused_mid_session(servers, recognisers, speech, session_of, backend) -> None:
    fake = await servers(dialect="speaches", api_key="sk-right")
    transcription, notices = session_of(recognisers(fake.url, api_key="sk-wrong"), backend.stt)
    pcm = b"\0" * 9600 + speech("right") + b"\0" * 9600
    assert await run_utterance(transcription, pcm) == "right"
    assert notices == [("openai", "unauthorized", "fallback")]
    assert [r.status for r in fake.requests] == [403]


# -- standalone --------------------------------------------------------------------------------------


async def test_the_fake_runs_standalone(grammar_file, recognisers, speech) -> None:
    port = free_port()
    proc = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "testkit.fake_openai_transcriptions", "--port", str(port), "--grammar", str(grammar_file),
        "--dialect", "vllm", "--api-key", KEY, "--final-ms", "50", stdout=subprocess.PIPE, stderr=subprocess.PIPE,
        cwd=Path(__file__).resolve().parents[2],
    )
    try:
        assert proc.stdout is not None
        async with asyncio.timeout(30):
            line = (await proc.stdout.readline()).decode()
        assert f"http://127.0.0.1:{port}/v1" in line, line
        reader = await transcribe_once(recognisers(f"http://127.0.0.1:{port}/v1"), speech("okay"))
        assert [f.text for f in reader.of(Final)] == ["okay"]
    finally:
        proc.terminate()
        async with asyncio.timeout(10):
            await proc.wait()
    assert proc.returncode == 0


async def _flood(n_deltas: int, delta: str) -> tuple[web.AppRunner, str]:
    """A server that streams ``n_deltas`` tiny deltas, then done (a
    reviewer's find: 4 MB of one-character deltas froze the event loop for
    32 s, the client making an interim of the whole text for each)."""

    async def transcriptions(request: web.Request) -> web.StreamResponse:
        await request.read()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        chunk = "".join(f'data: {{"type":"transcript.text.delta","delta":"{delta}"}}\n\n' for _ in range(1000))
        for _ in range(n_deltas // 1000):
            await resp.write(chunk.encode())
        text = delta * n_deltas
        await resp.write(f'data: {{"type":"transcript.text.done","text":"{text[:100]}"}}\n\n'.encode())
        return resp

    app = web.Application()
    app.router.add_post("/v1/audio/transcriptions", transcriptions)
    return await start_app(app)


async def test_a_flood_of_deltas_makes_few_interims_and_too_much_text_is_refused(recognisers, speech) -> None:
    runner, url = await _flood(3000, "a ")  # 6,000 characters: answered, its interims at most every 0.1 s
    try:
        stream = recognisers(f"{url}/v1", stream=True).open(StreamOptions())
        reader = Reader(stream)
        feed(stream, speech("yeah"))
        t0 = asyncio.get_running_loop().time()
        stream.finalize()
        await reader.ends()
        took = asyncio.get_running_loop().time() - t0
        assert reader.error is None and len(reader.of(Final)) == 1
        assert len(reader.of(Interim)) <= took / 0.1 + 1
        await stream.aclose()
    finally:
        await runner.cleanup()
    runner, url = await _flood(11_000, "a ")  # 22,000 characters: no transcription
    try:
        stream = recognisers(f"{url}/v1", stream=True).open(StreamOptions())
        reader = Reader(stream)
        feed(stream, speech("yeah"))
        stream.finalize()
        error = await reader.failure()
        assert error.kind == "protocol" and "20000 characters" in str(error)
        await stream.aclose()
    finally:
        await runner.cleanup()
