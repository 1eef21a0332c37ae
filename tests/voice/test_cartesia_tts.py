"""Cartesia synthesis (voice.cartesia_tts) against a local Cartesia server
(testkit.fake_cartesia: real WebSockets, Cartesia's messages and quirks,
espeak-ng word by word behind it, so the audio and word times a stream
yields can be compared with the rendering): what goes on the wire, audio,
word times and clause marks whatever the server's flush support and word
time origin, the stop, context expiry, the idle close, every failure kind,
bad answers, and no task left behind."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import pytest
import pytest_asyncio
from aiohttp import web
from conftest import free_port, requires_espeak, start_app

from testkit.fake_cartesia import FakeCartesia, FakeCartesiaOptions
from testkit.tts_backend import Rendering, TtsBackend
from voice.cartesia_tts import API_VERSION, CartesiaStream, CartesiaSynthesiser, websocket_url
from voice.synthesis import Audio, SegmentDone, SynthesisError, SynthesisEvent, TimedWord, Words
from voice.synthesisers import TtsConfig, build_synthesiser

pytestmark = [pytest.mark.asyncio(loop_scope="module"), requires_espeak]

C1 = "Hello there, "
C2 = "how are you today? "
LONG = "one two three four five six seven eight. "
#: fast answers for the tests (the defaults are 120 ms to first audio, 60 ms chunks every 5 ms)
FAST = {"first_audio_delay_s": 0.03, "request_delay_s": 0.005, "chunk_interval_s": 0.003}


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def backend() -> TtsBackend:
    b = TtsBackend()
    for text in (C1, C2, LONG, "Okay"):  # espeak-ng says each word once, here: no test waits for it
        await b.render(text, 24000)
    return b


def cartesia_tasks() -> list[asyncio.Task[Any]]:
    """Running tasks whose coroutine is voice.cartesia_tts's."""
    out = []
    for t in asyncio.all_tasks():
        code = getattr(t.get_coro(), "cr_code", None)
        if not t.done() and code is not None and code.co_filename.endswith("/voice/cartesia_tts.py"):
            out.append(t)
    return out


@dataclass
class Rig:
    """One fake Cartesia on loopback and the synthesisers made for it."""

    fake: FakeCartesia
    url: str
    synths: list[CartesiaSynthesiser] = field(default_factory=list)

    def synth(self, **settings: Any) -> CartesiaSynthesiser:
        settings.setdefault("api_key", "sekrit")
        settings.setdefault("base_url", self.url)
        settings.setdefault("connect_timeout_s", 2.0)
        settings.setdefault("first_audio_timeout_s", 2.0)
        s = CartesiaSynthesiser(TtsConfig(provider="cartesia", **settings))
        self.synths.append(s)
        return s

    @property
    def conn(self) -> Any:
        return self.fake.connections[-1]


@pytest_asyncio.fixture(loop_scope="module")
async def rig(backend: TtsBackend) -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []
    rigs: list[Rig] = []

    async def _start(**options: Any) -> Rig:
        options.setdefault("api_key", "sekrit")
        for k, v in FAST.items():
            options.setdefault(k, v)
        fake = FakeCartesia(backend, FakeCartesiaOptions(**options))
        runner, url = await start_app(fake.app())
        runners.append(runner)
        rigs.append(Rig(fake, url))  # http://: the client maps it to ws://
        return rigs[-1]

    yield _start
    for r in rigs:
        for s in r.synths:
            await s.aclose()
    assert not cartesia_tasks(), "a task of voice.cartesia_tts outlived aclose()"
    for runner in runners:
        await runner.cleanup()


async def collect(stream: CartesiaStream, timeout: float = 5.0) -> tuple[list[SynthesisEvent], SynthesisError | None]:
    events: list[SynthesisEvent] = []
    try:
        async with asyncio.timeout(timeout):
            async for ev in stream:
                events.append(ev)
    except SynthesisError as exc:
        return events, exc
    return events, None


def by_segment(events: list[SynthesisEvent]) -> tuple[list[tuple[str, bytes]], bytes]:
    """(clause text, its audio) per SegmentDone, and the audio after the last."""
    out: list[tuple[str, bytes]] = []
    buf = bytearray()
    for ev in events:
        if isinstance(ev, Audio):
            buf += ev.pcm
        elif isinstance(ev, SegmentDone):
            out.append((ev.text, bytes(buf)))
            buf.clear()
    return out, bytes(buf)


def words_of(events: list[SynthesisEvent]) -> list[TimedWord]:
    return [w for ev in events if isinstance(ev, Words) for w in ev.words]


def expected_words(renderings: list[Rendering], rate: int) -> list[tuple[str, float, float]]:
    out, base = [], 0.0
    for r in renderings:
        out += [(w, base + s, base + e) for w, s, e in r.words]
        base += len(r.pcm) / 2 / rate
    return out


def assert_words(got: list[TimedWord], want: list[tuple[str, float, float]], tol: float) -> None:
    assert [w.text for w in got] == [w for w, _, _ in want]
    for g, (_, s, e) in zip(got, want, strict=True):
        assert abs(g.start_s - s) < tol and abs(g.end_s - e) < tol, (g, s, e)


async def speak(
    synth: CartesiaSynthesiser, context_id: str, *clauses: str
) -> tuple[CartesiaStream, list[SynthesisEvent], SynthesisError | None]:
    stream = synth.open(context_id)
    for c in clauses:
        stream.push_text(c)
    stream.end_input()
    events, error = await collect(stream)
    await stream.aclose()
    return stream, events, error


# -- the wire, audio, words, clause marks -----------------------------------------


async def test_wire_audio_words_and_clauses(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig()
    synth = r.synth(model="sonic-2", voice="voice-1", language="en-GB", sample_rate=16000, cents_per_1k_characters=3.0)
    await synth.warm()
    stream, events, error = await speak(synth, "r1", C1, C2)
    assert error is None

    attempt = r.fake.attempts[0]
    assert attempt.path == "/tts/websocket" and attempt.status == 101
    assert attempt.query == {"cartesia_version": API_VERSION}
    assert attempt.headers["X-API-Key"] == "sekrit" and attempt.headers["Cartesia-Version"] == API_VERSION
    inputs = r.conn.inputs("r1")
    fixed = [{k: v for k, v in m.items() if k not in ("transcript", "continue", "flush")} for m in inputs]
    assert all(f == fixed[0] for f in fixed)
    assert fixed[0] == {
        "model_id": "sonic-2",
        "voice": {"mode": "id", "id": "voice-1"},
        "context_id": "r1",
        "language": "en",
        "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 16000},
        "add_timestamps": True,
        "use_normalized_timestamps": False,
    }
    assert [(m["transcript"], m["continue"], m.get("flush", False)) for m in inputs] == [
        (C1, True, False),
        ("", True, True),
        (C2, True, False),
        ("", True, True),
        ("", False, False),
    ]

    r1, r2 = await backend.render(C1, 16000), await backend.render(C2, 16000)
    segments, tail = by_segment(events)
    assert segments == [(C1, r1.pcm), (C2, r2.pcm)] and tail == b""
    assert all(ev.sample_rate == 16000 for ev in events if isinstance(ev, Audio))
    assert_words(words_of(events), expected_words([r1, r2], 16000), 2e-3)
    usage = stream.usage()
    assert usage.characters == len(C1) + len(C2) == r.fake.billed_chars
    assert usage.audio_s == pytest.approx((len(r1.pcm) + len(r2.pcm)) / 2 / 16000, abs=1e-3)
    assert usage.cents == pytest.approx(usage.characters * 3.0 / 1000) and usage.after_stop is None
    assert r.conn.sent_of("done", "r1") and synth.connections == 1
    # a clause without its trailing space gets one (transcripts are concatenated verbatim)
    _, events, error = await speak(synth, "r2", "Okay")
    assert error is None and r.conn.inputs("r2")[0]["transcript"] == "Okay "
    assert by_segment(events)[0] == [("Okay", (await backend.render("Okay", 16000)).pcm)]


@pytest.mark.parametrize(
    ("flush_mode", "timebase", "order"),
    [
        ("flush_done", "request", "after"),
        ("flush_done_no_id", "context", "before"),
        ("full", "request", "before"),
        ("none", "context", "after"),
        ("none", "request", "before"),
    ],
)
async def test_clauses_and_words_whatever_the_server_does(
    rig: Callable[..., Any],
    backend: TtsBackend,
    flush_mode: str,
    timebase: str,
    order: str,
) -> None:
    """Flush support (chunk flush ids, flush_done with or without an id, none)
    and the word times' origin (context or transcript: reference VERIFY):
    the same clause marks and stream seconds."""
    r = await rig(flush_mode=flush_mode, timebase=timebase, timestamps=order)
    synth = r.synth(sample_rate=24000)
    _, events, error = await speak(synth, "r1", C1, C2, C1)
    assert error is None
    rs = [await backend.render(c, 24000) for c in (C1, C2, C1)]
    segments, tail = by_segment(events)
    assert [t for t, _ in segments] == [C1, C2, C1]
    if flush_mode == "none":  # by the words: a clause ends where its last word's audio does (within 5 ms)
        assert b"".join(p for _, p in segments) + tail == b"".join(x.pcm for x in rs)
        for (_, pcm), x in zip(segments, rs, strict=True):
            assert abs(len(pcm) - len(x.pcm)) / 2 / 24000 < 0.006
        tol = 0.012
    else:
        assert [p for _, p in segments] == [x.pcm for x in rs] and tail == b""
        tol = 2e-3
    assert_words(words_of(events), expected_words(rs, 24000), tol)
    assert synth.request_timebase is (timebase == "request")


async def test_odd_chunks_are_joined(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(bad_audio="odd_split")
    _, events, error = await speak(r.synth(), "r1", C1)
    assert error is None
    assert by_segment(events)[0] == [(C1, (await backend.render(C1, 24000)).pcm)]
    assert all(len(ev.pcm) % 2 == 0 for ev in events if isinstance(ev, Audio))


# -- the stop -------------------------------------------------------------------------


@pytest.mark.parametrize("done_after_cancel", [False, True])
async def test_cancel_mid_reply(rig: Callable[..., Any], backend: TtsBackend, done_after_cancel: bool) -> None:
    r = await rig(chunk_interval_s=0.01, done_after_cancel=done_after_cancel)  # 6x real time: the cancel lands mid-clause
    synth = r.synth()
    await synth.warm()
    stream = synth.open("r1")
    stream.push_text(LONG)
    stream.push_text(C2)
    first = b""
    async with asyncio.timeout(5):
        async for ev in stream:
            if isinstance(ev, Audio) and not first:
                first = ev.pcm
                stream.cancel()
                yielded = stream.audio_bytes
    stop = stream.stop
    assert stop is not None
    async with asyncio.timeout(1):  # told as soon as the writer runs (a generous bound)
        while stop.told_at is None:
            await asyncio.sleep(0.001)
    assert stop.tell_ms is not None and stop.tell_ms < 1000
    # the fake heard the cancel; the clause it was saying goes on (stragglers), the next is never said
    ctx = r.conn.contexts["r1"]
    async with asyncio.timeout(5):
        while not (ctx.cancelled_at and not ctx.busy):
            await asyncio.sleep(0.01)
    assert r.conn.times("cancel", "r1") and ctx.generated == [LONG] and ctx.audio_after_cancel_s > 0.1
    # meanwhile another reply on the same socket gets its own audio only
    _, events, error = await speak(synth, "r2", C1)
    assert error is None and by_segment(events)[0] == [(C1, (await backend.render(C1, 24000)).pcm)]
    await asyncio.sleep(0.05)
    assert stream.audio_bytes == yielded  # nothing of r1 was emitted after the cancel
    assert stop.late_audio_ms > 100  # stragglers dropped and counted
    assert stop.late_audio_ms / 1000 + yielded / 2 / 24000 <= len(ctx.audio) / 2 / 24000 + 1e-6
    usage = stream.usage()
    assert usage.characters == len(LONG) + len(C2) and usage.characters_unspoken_at_stop == len(LONG) + len(C2)
    assert usage.characters_after_stop == 0 and r.fake.billed_chars == len(LONG) + len(C1)
    assert usage.after_stop == ("confirmed" if done_after_cancel else "unconfirmed")
    with pytest.raises(RuntimeError):
        stream.push_text("more ")
    assert stream.usage().characters_after_stop == len("more ")
    await stream.aclose()


async def test_cancel_before_anything_was_written(rig: Callable[..., Any]) -> None:
    """The socket is still opening: the clause never leaves, nothing is billed, the stop is confirmed."""
    r = await rig(accept_delay_s=0.1)
    synth = r.synth()
    stream = synth.open("r1")
    stream.push_text(C1)
    stream.cancel()
    await stream.aclose()
    usage = stream.usage()
    assert stream.stop is not None and stream.stop.told_at is None and stream.stop.confirmed
    assert usage.characters == 0 and usage.characters_unspoken_at_stop == 0
    # a later reply uses the socket once it is open; the cancelled clause never went
    _, _, error = await speak(synth, "r2", C1)
    assert error is None and r.conn.inputs("r1") == [] and r.fake.billed_chars == len(C1)


async def test_aclose_tells_the_stop_and_leaves_no_task(rig: Callable[..., Any]) -> None:
    r = await rig(chunk_interval_s=0.02)
    synth = r.synth()
    stream = synth.open("r1")
    stream.push_text(LONG)
    async with asyncio.timeout(5):
        async for ev in stream:
            if isinstance(ev, Audio):
                break
    await stream.aclose()  # cancels, waits for the cancel to be written
    assert stream.stop is not None and stream.stop.told_at is not None and not stream.stop.confirmed
    assert cartesia_tasks()  # the socket's reader and writer
    await synth.aclose()
    assert not cartesia_tasks()
    await synth.aclose()  # idempotent
    with pytest.raises(RuntimeError):
        synth.open("r2")
    assert r.conn.times("cancel", "r1")


# -- contexts and the socket's life ------------------------------------------------------


async def test_a_clause_after_the_context_expired_goes_on_a_new_context(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(context_expiry_s=0.15)
    synth = r.synth()
    synth.context_reuse_s = 0.05
    stream = synth.open("r1")
    stream.push_text(C1)
    events: list[SynthesisEvent] = []
    async with asyncio.timeout(5):
        async for ev in stream:
            events.append(ev)
            if isinstance(ev, SegmentDone):
                break
    await asyncio.sleep(0.2)  # past Cartesia's expiry of r1
    stream.push_text(C2)
    stream.end_input()
    more, error = await collect(stream)
    assert error is None and stream.wire_contexts == ["r1", "r1-k1"]
    assert [m["transcript"] for m in r.conn.inputs("r1-k1")] == [C2, "", ""]
    rs = [await backend.render(c, 24000) for c in (C1, C2)]
    assert [p for _, p in by_segment(events + more)[0]] == [x.pcm for x in rs]
    assert_words(words_of(events + more), expected_words(rs, 24000), 2e-3)
    assert not r.conn.contexts["r1"].errors

    # the quirk itself: a clause sent on the expired context is refused
    synth.context_reuse_s = 30.0
    stream = synth.open("r2")
    stream.push_text(C1)
    async with asyncio.timeout(5):
        async for ev in stream:
            if isinstance(ev, SegmentDone):
                break
    await asyncio.sleep(0.2)
    stream.push_text(C2)
    _, error = await collect(stream)
    assert error is not None and error.kind == "provider" and "expired" in str(error)
    await stream.aclose()


async def test_idle_close_is_not_a_failure(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig(idle_close_s=0.3)
    synth = r.synth()
    await synth.warm()
    async with asyncio.timeout(5):
        await r.fake.connections[0].ended.wait()
        while synth.connected:  # the close frame read
            await asyncio.sleep(0.005)
    assert r.fake.connections[0].closed_with == (1000, "idle timeout")
    # a reply after it: a new socket
    _, events, error = await speak(synth, "r1", C1)
    assert error is None and len(r.fake.connections) == 2 and synth.connections == 2
    # a reply whose clauses are all spoken when the socket idles out goes on on a new one
    stream = synth.open("r2")
    stream.push_text(C1)
    async with asyncio.timeout(5):
        async for ev in stream:
            if isinstance(ev, SegmentDone):
                break
        await r.fake.connections[1].ended.wait()
        while synth.connected:
            await asyncio.sleep(0.005)
    stream.push_text(C2)
    stream.end_input()
    more, error = await collect(stream)
    assert error is None and stream.wire_contexts == ["r2", "r2-k1"] and len(r.fake.connections) == 3
    assert by_segment(more)[0] == [(C2, (await backend.render(C2, 24000)).pcm)]
    await stream.aclose()


async def test_a_stream_opened_while_warming_uses_that_socket(rig: Callable[..., Any]) -> None:
    r = await rig(accept_delay_s=0.2)
    synth = r.synth()
    warming = asyncio.ensure_future(synth.warm())
    await asyncio.sleep(0.01)
    _, events, error = await speak(synth, "r1", C1)
    await warming
    assert error is None and by_segment(events)[0][0][0] == C1
    assert len(r.fake.attempts) == 1 and synth.connections == 1


async def test_unknown_contexts_are_dropped(rig: Callable[..., Any]) -> None:
    stray = json.dumps({"type": "chunk", "data": "AAAA", "done": False, "status_code": 206, "context_id": "nobody"})
    r = await rig(inject=[(1, stray)])
    synth = r.synth()
    _, events, error = await speak(synth, "r1", C1)
    assert error is None and synth.unrouted == 1 and len(by_segment(events)[0]) == 1


# -- failures ---------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("options", "kind", "says"),
    [
        ({"refuse_status": 401}, "unauthorized", "401"),
        ({"refuse_status": 403}, "unauthorized", "403"),
        ({"refuse_status": 429}, "provider", "429"),
        ({"refuse_status": 503}, "unreachable", "503"),
        ({"accept_delay_s": 0.6}, "unreachable", "within"),
        ({"drop_after_chunks": 3}, "dropped", ""),
        ({"close_after_chunks": 3, "close_code": 1008}, "closed", "1008"),
        ({"garbage_after_chunks": 2}, "protocol", "not JSON"),
        ({"error_after_chunks": 2, "error_message": "voice not found", "error_status": 404}, "provider", "voice not found"),
        ({"inject": [(1, json.dumps({"type": "error", "error": "rate limited"}))]}, "provider", "rate limited"),
        (
            {"inject": [(1, json.dumps({"type": "timestamps", "context_id": "r1", "word_timestamps": {"words": ["a"], "start": []}}))]},
            "protocol",
            "word_timestamps",
        ),
        ({"hang": True}, "provider", "no audio"),
        ({"bad_audio": "base64"}, "protocol", "base64"),
        ({"bad_audio": "odd_total"}, "protocol", "odd number"),
        ({"render_rate": 8000}, "protocol", "24000 Hz"),
    ],
)
async def test_failures(rig: Callable[..., Any], backend: TtsBackend, options: dict[str, Any], kind: str, says: str) -> None:
    r = await rig(**options)
    synth = r.synth(connect_timeout_s=0.3, first_audio_timeout_s=0.3 if options.get("hang") else 2.0)
    stream, events, error = await speak(synth, "r1", C1, C2)
    assert error is not None and error.kind == kind and says in str(error), error
    assert error.provider == "cartesia" and error.retryable == (kind != "unauthorized")
    assert not any(isinstance(ev, SegmentDone) and ev.text == C2 for ev in events)
    if kind == "unauthorized":
        return  # every upgrade is refused until one is accepted
    # only the first connection is faulty: the caller's reconnect (a new stream) works
    _, events, error = await speak(synth, "r2", C1)
    assert error is None and by_segment(events)[0] == [(C1, (await backend.render(C1, 24000)).pcm)]


async def test_unreachable_and_warm_never_raises(rig: Callable[..., Any]) -> None:
    nobody = CartesiaSynthesiser(TtsConfig(provider="cartesia", base_url=f"http://127.0.0.1:{free_port()}", connect_timeout_s=1.0))
    await nobody.warm()  # logged, not raised
    _, _, error = await speak(nobody, "r1", C1)
    assert error is not None and error.kind == "unreachable"
    await nobody.aclose()

    r = await rig(refuse_status=401, faulty_connections=None)
    synth = r.synth()
    await synth.warm()
    _, _, error = await speak(synth, "r1", C1)
    assert error is not None and error.kind == "unauthorized" and "tts.api_key" in str(error)
    assert len(r.fake.attempts) == 2  # warm's, then the stream's own


async def test_a_timeout_cancels_the_context(rig: Callable[..., Any]) -> None:
    """A clause that has no first audio in time fails the reply, and its context is cancelled on the wire."""
    r = await rig(first_audio_delay_s=1.0)
    synth = r.synth(first_audio_timeout_s=0.15)
    t0 = time.monotonic()
    _, events, error = await speak(synth, "r1", C1)
    assert error is not None and error.kind == "provider" and 0.1 < time.monotonic() - t0 < 2.0
    assert not events
    async with asyncio.timeout(5):
        while not r.conn.times("cancel", "r1"):
            await asyncio.sleep(0.01)


# -- the fake itself ----------------------------------------------------------------------


async def test_the_fake_checks_as_cartesia_does(rig: Callable[..., Any]) -> None:
    r = await rig()
    config = TtsConfig(provider="cartesia", base_url=r.url)
    url = websocket_url(config)
    async with aiohttp.ClientSession() as http:
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(url.with_query({"cartesia_version": API_VERSION}), headers={"X-API-Key": "wrong"})
        assert refused.value.status == 401
        with pytest.raises(aiohttp.WSServerHandshakeError) as refused:
            await http.ws_connect(url.with_query({"api_key": "sekrit"}))
        assert refused.value.status == 400  # no version
        # ?api_key= and the Cartesia-Version header are accepted; a field changed on a context is an error
        ws = await http.ws_connect(url.with_query({"api_key": "sekrit"}), headers={"Cartesia-Version": API_VERSION})
        base = {
            "model_id": "sonic-2",
            "voice": {"mode": "id", "id": "v"},
            "context_id": "c",
            "language": "en",
            "output_format": {"container": "raw", "encoding": "pcm_s16le", "sample_rate": 8000},
        }
        await ws.send_json({**base, "transcript": "Hello there, ", "continue": True})
        await ws.send_json({**base, "language": "fr", "transcript": "how are you today? ", "continue": True})
        async with asyncio.timeout(5):
            while True:
                msg = json.loads((await ws.receive()).data)
                if msg["type"] == "error":
                    break
        assert msg["context_id"] == "c" and "language" in msg["error"] and msg["done"] is True
        # the client goes away with text queued: the fake still says (and bills) it
        await ws.send_json({**base, "context_id": "d", "transcript": "one two three ", "continue": True})
        await ws.send_json({**base, "context_id": "d", "transcript": "four five six ", "continue": True})
        await ws.close()
    conn = r.fake.connections[0]
    async with asyncio.timeout(5):
        await conn.ended.wait()
    d = conn.contexts["d"]
    assert d.generated == ["one two three ", "four five six "] and d.billed_chars == 28 and d.chars_after_disconnect > 0
    assert conn.billed_chars == len("Hello there, ") + 28


async def test_build_synthesiser_makes_it() -> None:
    synth = build_synthesiser(TtsConfig(provider="cartesia", api_key="k"))
    assert isinstance(synth, CartesiaSynthesiser) and synth.name == "cartesia"
    assert str(synth.url) == f"wss://api.cartesia.ai/tts/websocket?cartesia_version={API_VERSION}"
    assert synth.headers() == {"Cartesia-Version": API_VERSION, "X-API-Key": "k"}
    assert str(websocket_url(TtsConfig(provider="cartesia", base_url="https://example.test/tts/websocket"))) == (
        f"wss://example.test/tts/websocket?cartesia_version={API_VERSION}"
    )
    await synth.aclose()
