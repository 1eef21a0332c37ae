"""ElevenLabs streaming synthesis (voice.elevenlabs_tts) against a local
ElevenLabs server (testkit.fake_elevenlabs: real WebSockets, the
multi-context protocol and its quirks, espeak-ng word by word behind it so
every character's time is known): what goes over the wire, the audio, word
timings and segment marks that come back under both alignment timebases and
both id spellings, the stop, the context limit, every failure kind and bad
answers."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import pytest_asyncio
from aiohttp import web
from conftest import free_port, start_app

from testkit.fake_elevenlabs import Connection, ContextRecord, FakeElevenLabs, FakeElevenLabsOptions
from testkit.tts_backend import TtsBackend
from voice import elevenlabs_tts
from voice.elevenlabs_tts import ElevenLabsStream, ElevenLabsSynthesiser, check_rate, stream_url
from voice.synthesis import Audio, SegmentDone, SynthesisError, SynthesisEvent, TimedWord, Words
from voice.synthesisers import TtsConfig, build_synthesiser

pytestmark = pytest.mark.asyncio(loop_scope="module")

#: the synthesiser's own knobs (the rest are TtsConfig settings)
SYNTH_KNOBS = {"max_contexts", "inactivity_timeout_s", "keepalive_s", "settle_s", "context_release_s", "voice_settings"}
#: a reply long enough to be stopped mid-way (about 3 s of audio)
LONG = "Once upon a time there was a small robot who liked to count the stars every night."


@pytest.fixture(scope="module")
def backend() -> TtsBackend:
    return TtsBackend()


def own_tasks() -> list[asyncio.Task[Any]]:
    """The client's tasks still running (they are all named elevenlabs-*)."""
    return [t for t in asyncio.all_tasks() if t.get_name().startswith("elevenlabs") and not t.done()]


@dataclass
class Rig:
    """One fake ElevenLabs on loopback and the synthesisers made for it."""

    fake: FakeElevenLabs
    url: str
    synths: list[ElevenLabsSynthesiser] = field(default_factory=list)

    def synth(self, **settings: Any) -> ElevenLabsSynthesiser:
        knobs = {k: settings.pop(k) for k in list(settings) if k in SYNTH_KNOBS}
        config: dict[str, Any] = {
            "provider": "elevenlabs", "base_url": self.url, "api_key": "sekrit",
            "connect_timeout_s": 2.0, "first_audio_timeout_s": 2.0,
        }
        config.update(settings)
        synth = ElevenLabsSynthesiser(TtsConfig(**config), **knobs)
        self.synths.append(synth)
        return synth

    @property
    def conn(self) -> Connection:
        return self.fake.connections[-1]

    def context(self, cid: str) -> ContextRecord:
        for c in self.fake.connections:
            if cid in c.contexts:
                return c.contexts[cid]
        raise AssertionError(f"no context {cid} at the fake")


@pytest_asyncio.fixture(loop_scope="module")
async def rig(backend: TtsBackend) -> AsyncIterator[Callable[..., Any]]:
    runners: list[web.AppRunner] = []
    rigs: list[Rig] = []

    async def _start(**options: Any) -> Rig:
        options.setdefault("api_key", "sekrit")
        options.setdefault("first_audio_delay_s", 0.03)
        fake = FakeElevenLabs(backend, FakeElevenLabsOptions(**options))
        runner, url = await start_app(fake.app())
        runners.append(runner)
        rigs.append(Rig(fake, url))  # http://: the client maps it to ws://
        return rigs[-1]

    yield _start
    for r in rigs:
        for s in r.synths:
            await s.aclose()
    assert not own_tasks(), own_tasks()
    for runner in runners:
        await runner.cleanup()


@dataclass
class Result:
    events: list[SynthesisEvent]
    error: SynthesisError | None

    @property
    def pcm(self) -> bytes:
        return b"".join(e.pcm for e in self.events if isinstance(e, Audio))

    @property
    def words(self) -> list[TimedWord]:
        return [w for e in self.events if isinstance(e, Words) for w in e.words]

    @property
    def done(self) -> list[str]:
        return [e.text for e in self.events if isinstance(e, SegmentDone)]

    def audio_before_done(self, n: int) -> int:
        """Bytes of audio yielded before the n-th SegmentDone (0-based)."""
        total, seen = 0, 0
        for e in self.events:
            if isinstance(e, Audio):
                total += len(e.pcm)
            elif isinstance(e, SegmentDone):
                if seen == n:
                    return total
                seen += 1
        raise AssertionError(f"no SegmentDone #{n}")


async def collect(stream: ElevenLabsStream, timeout: float = 5.0) -> Result:
    events: list[SynthesisEvent] = []
    error = None
    async with asyncio.timeout(timeout):
        try:
            async for ev in stream:
                events.append(ev)
        except SynthesisError as exc:
            error = exc
    return Result(events, error)


async def speak(synth: ElevenLabsSynthesiser, cid: str, *clauses: str, timeout: float = 5.0) -> Result:
    stream = synth.open(cid)
    for c in clauses:
        stream.push_text(c)
    stream.end_input()
    return await collect(stream, timeout)


async def failure(synth: ElevenLabsSynthesiser, cid: str, *clauses: str) -> SynthesisError:
    result = await speak(synth, cid, *(clauses or ("Hello there.",)))
    assert result.error is not None, f"no error; {len(result.events)} events"
    return result.error


async def until(check: Callable[[], bool], timeout: float = 3.0) -> None:
    async with asyncio.timeout(timeout):
        while not check():
            await asyncio.sleep(0.01)


def assert_words(got: list[TimedWord], truth: list[tuple[str, float, float]], tol_s: float = 0.002) -> None:
    assert [w.text for w in got] == [w for w, _, _ in truth]
    for w, (_, start, end) in zip(got, truth, strict=True):
        assert abs(w.start_s - start) < tol_s and abs(w.end_s - end) < tol_s, (w, start, end)


# -- the wire ---------------------------------------------------------------------


async def test_query_headers_and_messages_on_the_wire(rig: Callable[..., Any]) -> None:
    r = await rig()
    synth = r.synth(language="en-US")
    result = await speak(synth, "r1", "Hello there.", "How are you? ")
    assert result.error is None
    a = r.fake.attempts[0]
    assert a.path == "/v1/text-to-speech/21m00Tcm4TlvDq8ikWAM/multi-stream-input" and a.status == 101
    assert a.headers["xi-api-key"] == "sekrit"
    assert a.query == [
        ("model_id", "eleven_flash_v2_5"), ("output_format", "pcm_24000"), ("sync_alignment", "true"),
        ("inactivity_timeout", "180"), ("language_code", "en"),
    ]
    await until(lambda: r.conn.received_at("r1", "close_context") != [])
    msgs = r.conn.messages("r1")
    assert list(msgs[0]) == ["text", "voice_settings", "context_id"]
    assert msgs[0]["text"] == " " and msgs[0]["voice_settings"] == {"stability": 0.5, "similarity_boost": 0.75}
    assert msgs[1:] == [
        {"text": "Hello there. ", "context_id": "r1", "flush": True},  # a space added at the end
        {"text": "How are you? ", "context_id": "r1", "flush": True},
        {"context_id": "r1", "close_context": True},  # only once all its audio came: it frees the slot
    ]
    last_audio = max(t for t, m in r.conn.sent if isinstance(m, dict) and m.get("audio"))
    assert r.conn.received_at("r1", "close_context")[0] > last_audio
    await until(lambda: synth.open_contexts == 0)  # isFinal after close_context frees the slot
    assert r.context("r1").final_sent
    assert result.done == ["Hello there.", "How are you? "]
    # other models take no language code; base URLs ending in /v1 and wss:// ones are completed
    other = TtsConfig(provider="elevenlabs", model="eleven_multilingual_v2", base_url="https://example.test/v1", voice="abc")
    assert str(stream_url(other)) == (
        "wss://example.test/v1/text-to-speech/abc/multi-stream-input?model_id=eleven_multilingual_v2"
        "&output_format=pcm_24000&sync_alignment=true&inactivity_timeout=180"
    )
    assert isinstance(build_synthesiser(TtsConfig(provider="elevenlabs", base_url=r.url)), ElevenLabsSynthesiser)


async def test_unsupported_rate_is_refused() -> None:
    with pytest.raises(ValueError, match="tts.sample_rate 32000"):
        check_rate(32000)
    with pytest.raises(ValueError, match="tts.sample_rate"):
        ElevenLabsSynthesiser(TtsConfig.model_construct(provider="elevenlabs", sample_rate=32000))  # type: ignore[arg-type]
    for rate in (8000, 16000, 22050, 24000, 44100, 48000):
        check_rate(rate)


@pytest.mark.parametrize(("timebase", "id_key"), [("chunk", "contextId"), ("cumulative", "context_id"),
                                                  ("chunk", "context_id"), ("cumulative", "contextId")])
async def test_audio_words_and_segments(rig: Callable[..., Any], timebase: str, id_key: str) -> None:
    r = await rig(timebase=timebase, id_key=id_key, chunk_ms=40, chunk_interval_s=0.002)  # 40 ms chunks: words cut between chunks
    synth = r.synth()
    clauses = ("Hello there.", "How are you?", "Fine.")
    result = await speak(synth, "a1", *clauses)
    assert result.error is None
    ctx = r.context("a1")
    assert result.pcm == bytes(ctx.audio)  # every byte, in order
    assert all(isinstance(e, Audio) and e.sample_rate == 24000 for e in result.events if isinstance(e, Audio))
    assert result.done == list(clauses)
    for n in range(len(clauses)):  # each mark after the last audio of its clause
        assert result.audio_before_done(n) >= sum(ctx.flush_bytes[: n + 1])
    assert_words(result.words, ctx.words)  # stream seconds, whatever the timebase
    stream_s = len(result.pcm) / 2 / 24000
    assert result.words[-1].end_s <= stream_s + 0.01


async def test_rate_asked_is_the_rate_given(rig: Callable[..., Any], backend: TtsBackend) -> None:
    r = await rig()
    synth = r.synth(sample_rate=16000)
    stream = synth.open("s1")
    stream.push_text("Count to twenty.")
    stream.end_input()
    result = await collect(stream)
    assert r.fake.attempts[0].param("output_format") == "pcm_16000"
    assert result.pcm == bytes(r.context("s1").audio)
    assert len(result.pcm) == len((await backend.render(" Count to twenty. ", 16000)).pcm)
    assert {e.sample_rate for e in result.events if isinstance(e, Audio)} == {16000}
    assert stream.usage().audio_s == pytest.approx(len(result.pcm) / 2 / 16000, abs=0.002)
    assert stream.usage().characters == len("Count to twenty.")


async def test_whitespace_and_normalised_alignment(rig: Callable[..., Any]) -> None:
    """Alignment with whitespace stripped and merged still ends each clause;
    words come from the original text, never the normalised one ("2" stays "2")."""
    r = await rig(alignment_trim=True)
    synth = r.synth()
    result = await speak(synth, "w1", "I have 2 cats.", "Then  we   left.")
    assert result.error is None
    assert result.done == ["I have 2 cats.", "Then  we   left."]
    assert [w.text for w in result.words] == ["I", "have", "2", "cats.", "Then", "we", "left."]
    assert_words(result.words, r.context("w1").words)


@pytest.mark.parametrize("with_id", [True, False])
async def test_flush_done_marks_segments_without_alignment(rig: Callable[..., Any], with_id: bool) -> None:
    r = await rig(alignment=False, flush_done=True, flush_done_id=with_id)
    synth = r.synth()
    result = await speak(synth, "f1", "Hello there.", "Fine.")
    assert result.error is None
    ctx = r.context("f1")
    assert result.done == ["Hello there.", "Fine."] and result.words == []
    assert result.audio_before_done(0) == ctx.flush_bytes[0]  # marked at its flush_done, not at the end
    assert result.pcm == bytes(ctx.audio)


async def test_no_alignment_no_flush_done_ends_at_is_final(rig: Callable[..., Any]) -> None:
    r = await rig(alignment=False)
    synth = r.synth(settle_s=0.2)
    result = await speak(synth, "n1", "Hello there.", "Fine.")
    assert result.error is None
    assert result.done == ["Hello there.", "Fine."]
    assert result.pcm == bytes(r.context("n1").audio)
    assert result.audio_before_done(0) == len(result.pcm)  # both at isFinal
    assert r.context("n1").final_sent


async def test_no_is_final_after_close_frees_the_slot_in_time(rig: Callable[..., Any]) -> None:
    r = await rig(final_after_close=False)
    synth = r.synth(context_release_s=0.2)
    result = await speak(synth, "nf1", "Hello there.")
    assert result.error is None and result.done == ["Hello there."]
    assert synth.open_contexts == 1  # closed, no isFinal yet
    await until(lambda: synth.open_contexts == 0)
    assert not r.context("nf1").final_sent


async def test_both_alignment_spellings() -> None:
    times = {"chars": ["h", "i"], "durations": [10, 20]}
    for starts, durations in (("charStartTimesMs", "charDurationsMs"), ("charsStartTimesMs", "charsDurationsMs")):
        msg = {"alignment": {"chars": times["chars"], starts: [0, 10], durations: times["durations"]}}
        al = elevenlabs_tts._alignment(msg, "alignment")
        assert al is not None and al.starts_ms == [0.0, 10.0] and al.durations_ms == [10.0, 20.0]
    assert elevenlabs_tts._alignment({"alignment": None}, "alignment") is None
    with pytest.raises(SynthesisError, match="milliseconds"):
        elevenlabs_tts._alignment({"alignment": {"chars": ["a"], "charStartTimesMs": [-1], "charDurationsMs": [1]}}, "alignment")


# -- the stop ---------------------------------------------------------------------


async def test_cancel_mid_reply(rig: Callable[..., Any]) -> None:
    r = await rig(chunk_interval_s=0.02)  # 60 ms every 20 ms: 3x real time
    synth = r.synth()
    await synth.warm()
    stream = synth.open("c1")
    stream.push_text(LONG)
    got: list[SynthesisEvent] = []
    async with asyncio.timeout(5):
        async for ev in stream:
            got.append(ev)
            if isinstance(ev, Audio):
                stream.cancel()
    assert len(got) == 1  # nothing after the stop
    stop = stream.stop
    assert stop is not None
    await until(lambda: stop.told_at is not None)  # when the writer has put close_context on the wire
    assert stop.tell_ms is not None and stop.tell_ms < 1000
    await until(lambda: r.conn.received_at("c1", "close_context") != [])
    at_provider = r.conn.received_at("c1", "close_context")[0]
    assert at_provider - stop.requested_at < 1.0  # barge-in to provider told (the bench's measure)
    await until(lambda: r.context("c1").final_sent and synth.open_contexts == 0)
    ctx = r.context("c1")
    assert ctx.chunks_after_close >= 1 and ctx.characters_after_close > 0  # it went on
    assert stop.late_audio_ms > 0  # the trailing audio arrived, dropped and counted
    usage = stream.usage()
    assert usage.characters == len(LONG) and usage.characters_unspoken_at_stop == len(LONG)
    assert usage.after_stop == "unconfirmed" and not stop.confirmed and usage.characters_after_stop == 0
    with pytest.raises(RuntimeError):
        stream.push_text("more")
    # the next reply is a new context on the same socket
    result = await speak(synth, "c2", "Okay.")
    assert result.error is None and result.pcm == bytes(r.context("c2").audio)
    assert len(r.fake.connections) == 1


async def test_late_audio_goes_to_its_own_stream_only(rig: Callable[..., Any]) -> None:
    r = await rig(chunk_interval_s=0.02, id_key="context_id")
    synth = r.synth()
    a = synth.open("x1")
    b = synth.open("x2")
    a.push_text(LONG)
    b.push_text("Hello there, how are you?")
    b.end_input()
    read_b = asyncio.ensure_future(collect(b))
    async with asyncio.timeout(5):
        async for ev in a:
            if isinstance(ev, Audio):
                a.cancel()
    result = await read_b
    assert result.error is None
    assert result.pcm == bytes(r.context("x2").audio)  # none of x1's trailing audio
    await until(lambda: r.context("x1").final_sent)
    assert a.stop is not None and a.stop.late_audio_ms > 0


async def test_cancel_before_anything_was_sent(rig: Callable[..., Any]) -> None:
    r = await rig()
    synth = r.synth()
    stream = synth.open("q1")
    stream.push_text("Hello there.")
    stream.cancel()  # same tick: the socket is not even open
    assert stream.stop is not None and stream.stop.confirmed and stream.stop.told_at is None
    assert stream.usage().after_stop == "confirmed"
    await synth.warm()
    result = await speak(synth, "q2", "Fine.")
    assert result.error is None
    assert "q1" not in r.conn.contexts and r.conn.messages("q1") == []
    await until(lambda: synth.open_contexts == 0)


async def test_aclose_without_cancel_closes_the_context(rig: Callable[..., Any]) -> None:
    r = await rig()
    synth = r.synth()
    stream = synth.open("z1")
    stream.push_text("Hello there.")
    async with asyncio.timeout(5):
        async for ev in stream:
            if isinstance(ev, SegmentDone):
                break
    await stream.aclose()  # not ended, nothing pending: the context is closed all the same
    await until(lambda: r.conn.received_at("z1", "close_context") != [])
    await until(lambda: synth.open_contexts == 0)


# -- contexts per socket ----------------------------------------------------------


async def test_past_the_context_limit_a_second_socket(rig: Callable[..., Any]) -> None:
    r = await rig(max_contexts=2)
    synth = r.synth(max_contexts=2)
    streams = [synth.open(f"m{i}") for i in range(3)]
    for s in streams:
        s.push_text("Hello there.")
        s.end_input()
    results = await asyncio.gather(*(collect(s) for s in streams))
    assert all(res.error is None for res in results)
    assert len(r.fake.connections) == 2 and all(c.closed_with is None or c.closed_with[0] == 1000 for c in r.fake.connections)
    for i, res in enumerate(results):
        assert res.pcm == bytes(r.context(f"m{i}").audio)
    # once its context is freed, the extra socket is closed
    await until(lambda: synth.connections == 1 and synth.open_contexts == 0)
    assert any(m.get("close_socket") for m in r.fake.connections[1].messages())


async def test_server_closing_past_its_limit_fails_the_streams_closed(rig: Callable[..., Any]) -> None:
    r = await rig(max_contexts=1, chunk_interval_s=0.02)
    synth = r.synth()  # thinks 5 are allowed
    a = synth.open("l1")
    a.push_text(LONG)
    a.end_input()
    first = asyncio.Event()
    events: list[SynthesisEvent] = []

    async def read_a() -> SynthesisError | None:
        try:
            async for ev in a:
                events.append(ev)
                first.set()
        except SynthesisError as exc:
            return exc
        return None

    task = asyncio.ensure_future(read_a())
    async with asyncio.timeout(5):
        await first.wait()
    error_b = await failure(synth, "l2")
    error_a = await asyncio.wait_for(task, 5)
    assert error_b.kind == "closed" and error_a is not None and error_a.kind == "closed"
    assert "1008" in str(error_b) and "max_active_conversations" in str(error_b)
    assert r.conn.closed_with == (1008, "max_active_conversations")


# -- keep-alive -------------------------------------------------------------------


async def test_keepalive_keeps_the_socket(rig: Callable[..., Any]) -> None:
    r = await rig(inactivity_timeout_s=0.25)
    synth = r.synth(keepalive_s=0.05)
    await synth.warm()
    await asyncio.sleep(0.5)
    assert r.conn.closed_with is None
    assert {"text": ""} in r.conn.messages()  # bare: no context is open
    result = await speak(synth, "k1", "Okay.")
    assert result.error is None and len(r.fake.connections) == 1


async def test_idle_socket_closed_by_the_server_is_replaced(rig: Callable[..., Any]) -> None:
    r = await rig(inactivity_timeout_s=0.3)
    synth = r.synth(keepalive_s=30)
    await synth.warm()
    await until(lambda: r.conn.closed_with is not None)
    assert r.conn.closed_with == (1008, "input_timeout_exceeded")
    await until(lambda: synth.connections == 0)
    result = await speak(synth, "i1", "Okay.")
    assert result.error is None and len(r.fake.connections) == 2


# -- failures ---------------------------------------------------------------------


@pytest.mark.parametrize(("status", "kind"), [(401, "unauthorized"), (403, "unauthorized"), (422, "provider"), (500, "unreachable")])
async def test_upgrade_refused(rig: Callable[..., Any], status: int, kind: str) -> None:
    r = await rig(refuse_status=status)
    synth = r.synth()
    await synth.warm()  # never raises: the next stream meets its failure
    error = await failure(synth, "u1")
    assert len(r.fake.attempts) == 1
    assert error.kind == kind and error.provider == "elevenlabs"
    assert error.retryable == (kind != "unauthorized")
    # the fault was for the first connection: the next stream connects anew and works
    result = await speak(synth, "u2", "Okay.")
    assert result.error is None


@pytest.mark.parametrize("how", ["http", "close"])
async def test_wrong_key(rig: Callable[..., Any], how: str) -> None:
    r = await rig(auth_failure=how)
    synth = r.synth(api_key="wrong")
    error = await failure(synth, "k1")
    assert error.kind == "unauthorized" and not error.retryable


async def test_unreachable(rig: Callable[..., Any]) -> None:
    r = await rig()
    synth = r.synth(base_url=f"http://127.0.0.1:{free_port()}")
    await synth.warm()
    error = await failure(synth, "e1")
    assert error.kind == "unreachable"
    slow = await rig(accept_delay_s=0.3)
    synth = slow.synth(connect_timeout_s=0.1)
    assert (await failure(synth, "e2")).kind == "unreachable"


async def test_dropped_mid_reply(rig: Callable[..., Any]) -> None:
    r = await rig(drop_after_chunks=2)
    synth = r.synth()
    result = await speak(synth, "d1", LONG)
    assert result.error is not None and result.error.kind == "dropped"
    assert any(isinstance(e, Audio) for e in result.events)  # what came first was yielded


@pytest.mark.parametrize(
    ("options", "what"),
    [
        ({"garbage_after_chunks": 1}, "not JSON"),
        ({"inject": [(1, b"\x00\x01")]}, "binary"),
        ({"inject": [(1, json.dumps({"audio": "%%%", "contextId": "p1"}))]}, "base64"),
        ({"inject": [(1, json.dumps({"audio": "", "contextId": "p1", "alignment": {
            "chars": ["a"], "charStartTimesMs": [], "charDurationsMs": []}}))]}, "differ in length"),
        ({"inject": [(0, json.dumps(["not", "an", "object"]))]}, "not an object"),
        ({"audio_format": "mp3"}, "MP3"),
        ({"odd_total": True}, "odd number"),
    ],
)
async def test_bad_answers_are_protocol_errors(rig: Callable[..., Any], options: dict[str, Any], what: str) -> None:
    r = await rig(**options)
    synth = r.synth()
    error = await failure(synth, "p1", "Hello there.")
    assert error.kind == "protocol" and what in str(error), error


async def test_odd_chunks_are_joined(rig: Callable[..., Any]) -> None:
    r = await rig(odd_chunks=True, chunk_ms=40)
    synth = r.synth()
    result = await speak(synth, "o1", "Hello there.", "Fine.")
    assert result.error is None
    assert all(len(e.pcm) % 2 == 0 for e in result.events if isinstance(e, Audio))
    assert result.pcm == bytes(r.context("o1").audio)
    assert_words(result.words, r.context("o1").words)


async def test_wav_at_another_rate_is_resampled(rig: Callable[..., Any]) -> None:
    r = await rig(audio_format="wav", answer_rate=16000)
    synth = r.synth()  # asks for 24 kHz
    result = await speak(synth, "v1", "Hello there.", "Fine.")
    assert result.error is None
    got = len(result.pcm) / 2 / 24000
    sent = len(r.context("v1").audio) / 2 / 16000
    assert got == pytest.approx(sent, abs=0.01)
    assert {e.sample_rate for e in result.events if isinstance(e, Audio)} == {24000}
    assert_words(result.words, r.context("v1").words)  # times in seconds, from the 16 kHz audio
    assert result.done == ["Hello there.", "Fine."]


async def test_provider_error_on_a_context_fails_that_stream_only(rig: Callable[..., Any]) -> None:
    r = await rig(error_after_chunks=1, error_message="quota_exceeded for this voice")
    synth = r.synth()
    error = await failure(synth, "pe1", LONG)
    assert error.kind == "provider" and "quota_exceeded" in str(error)
    await until(lambda: r.conn.received_at("pe1", "close_context") != [])  # its context is closed
    result = await speak(synth, "pe2", "Okay.")  # same socket, still fine
    assert result.error is None and len(r.fake.connections) == 1


@pytest.mark.parametrize(("close", "kind"), [(None, "provider"), (1011, "closed")])
async def test_socket_error(rig: Callable[..., Any], close: int | None, kind: str) -> None:
    r = await rig(error_after_chunks=1, error_on_context=False, error_close=close)
    synth = r.synth()
    error = await failure(synth, "se1", LONG)
    assert error.kind == kind and "The fake was told to fail here" in str(error)


async def test_hang_is_a_provider_failure(rig: Callable[..., Any]) -> None:
    r = await rig(hang_after_chunks=2)
    synth = r.synth(first_audio_timeout_s=0.3)
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    error = await failure(synth, "h1", LONG)
    assert error.kind == "provider" and "no audio" in str(error)
    assert loop.time() - t0 < 3.0


async def test_no_first_audio_is_a_provider_failure(rig: Callable[..., Any]) -> None:
    r = await rig(first_audio_delay_s=2.0)
    synth = r.synth(first_audio_timeout_s=0.3)
    error = await failure(synth, "h2")
    assert error.kind == "provider"


# -- the synthesiser's life -------------------------------------------------------


async def test_lazy_connect_warm_and_aclose(rig: Callable[..., Any]) -> None:
    r = await rig()
    synth = r.synth()
    stream = synth.open("w1")
    stream.push_text("Hello there.")  # before warm: connects lazily
    stream.end_input()
    await synth.warm()
    await synth.warm()  # idempotent
    result = await collect(stream)
    assert result.error is None and len(r.fake.connections) == 1
    with pytest.raises(ValueError):
        synth.open("w1")  # ids are unique per session
    # aclose mid-reply: the stream fails "closed", nothing is left running
    live = synth.open("w2")
    live.push_text(LONG)
    async with asyncio.timeout(5):
        async for ev in live:
            if isinstance(ev, Audio):
                break
    await synth.aclose()
    assert not own_tasks()
    rest = await collect(live)
    assert rest.error is not None and rest.error.kind == "closed"
    # the client went away mid-reply: the fake generated (and bills) the text anyway
    await until(lambda: r.conn.ended.is_set())
    assert r.conn.client_gone_at is not None
    assert r.context("w2").characters_after_close >= len(LONG)
    assert r.fake.characters == len(" Hello there. ") + len(" " + LONG + " ")
    with pytest.raises(RuntimeError):
        synth.open("w3")
