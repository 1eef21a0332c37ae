"""The session's side of recognition (voice.transcription): which events
belong to which utterance, when an utterance's transcript is complete, and
what happens when the recogniser fails, on virtual time.

The recogniser here is a scripted one: it records what the transcription
sends it and the test says what it answers, so every ordering a provider
can produce (late finals, answers for discarded audio, silence after a
finalize, a drop mid-utterance) is played exactly. The providers' own
clients are tested against fakes of their servers (test_deepgram_stt,
test_openai_realtime_stt, test_openai_stt).
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from clock import VirtualClock
from turn.models import RecognitionRecord
from voice.recognition import (
    STREAM_BYTES_PER_S,
    EndOfUtterance,
    Final,
    Interim,
    RecognitionError,
    RecognitionEvent,
    RecognitionUsage,
    SpeechPricing,
    StreamOptions,
    SttError,
    Word,
)
from voice.stt_failover import Failover
from voice.transcription import Transcription, Utterance

FRAME = bytes(640)  # 20 ms at 16 kHz


class ScriptedStream:
    """A recognition stream that records what it is sent; the test answers."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.sent = bytearray()
        self.calls: list[str] = []
        self.queue: asyncio.Queue[RecognitionEvent | RecognitionError | None] = asyncio.Queue()
        self.closed = False

    @property
    def sent_s(self) -> float:
        return len(self.sent) / STREAM_BYTES_PER_S

    def send(self, pcm: bytes) -> None:
        self.sent += pcm

    def finalize(self) -> None:
        self.calls.append(f"finalize@{self.sent_s:.2f}")

    def discard(self) -> None:
        self.calls.append(f"discard@{self.sent_s:.2f}")

    def answer(self, *events: RecognitionEvent | RecognitionError) -> None:
        for ev in events:
            self.queue.put_nowait(ev)

    async def events(self) -> AsyncIterator[RecognitionEvent]:
        while (item := await self.queue.get()) is not None:
            if isinstance(item, RecognitionError):
                raise item
            yield item

    async def aclose(self) -> None:
        if not self.closed:
            self.closed = True
            self.queue.put_nowait(None)


class ScriptedRecogniser:
    """Opens scripted streams and keeps them for the test."""

    def __init__(self, name: str, cents_per_minute: float = 0.0, final_timeout_s: float | None = None,
                 stream_type: type[ScriptedStream] = ScriptedStream) -> None:
        self.name = name
        self.stream_type = stream_type
        self.pricing = SpeechPricing(cents_per_minute=cents_per_minute)
        self.final_timeout_s = final_timeout_s
        self.streams: list[ScriptedStream] = []

    async def start(self) -> None:
        pass

    def open(self, options: StreamOptions) -> ScriptedStream:
        stream = self.stream_type(self.name)
        self.streams.append(stream)
        return stream

    async def aclose(self) -> None:
        pass


class Rig:
    """A transcription running on a virtual clock over scripted recognisers."""

    def __init__(self, clock: VirtualClock, primary: ScriptedRecogniser, fallback: ScriptedRecogniser | None = None,
                 timeout_s: float = 2.0) -> None:
        self.clock = clock
        self.heard: list[str] = []
        self.failovers: list[tuple[str, str, str, str | None]] = []
        self.t = Transcription(
            Failover(primary, fallback), StreamOptions(), clock=clock, final_timeout_s=timeout_s,
            on_heard=lambda u: self.heard.append(u.text),
            on_failover=lambda failed, err, action, nxt: self.failovers.append((failed, err.kind, action, nxt)),
        )
        self.task: asyncio.Task[None] | None = None

    async def __aenter__(self) -> Rig:
        self.task = asyncio.create_task(self.t.run())
        await settle()
        return self

    async def __aexit__(self, *exc: Any) -> None:
        self.t.close()
        assert self.task is not None
        await asyncio.wait_for(self.task, 5)

    def say(self, utt: Utterance, seconds: float) -> None:
        for _ in range(round(seconds / 0.02)):
            utt.feed(FRAME)


async def settle() -> None:
    for _ in range(20):
        await asyncio.sleep(0)


async def finished(utt: Utterance) -> asyncio.Task[str]:
    task = asyncio.ensure_future(utt.finish())
    await settle()
    return task


async def test_finals_go_to_the_utterance_whose_audio_they_are(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 1.0)
        done_a = await finished(a)
        b = rig.t.begin()
        rig.say(b, 0.6)
        done_b = await finished(b)
        s = p.streams[0]
        assert s.calls == ["finalize@1.00", "finalize@1.60"]
        # the second utterance is answered first; each goes to its own audio
        s.answer(Final("front left", 1.05, 1.6, finalized=True))
        await settle()
        assert done_b.done() and done_b.result() == "front left" and not done_a.done()
        s.answer(Final("tell me", 0.1, 0.5, words=(Word("tell", 0.1, 0.3), Word("me", 0.3, 0.5))),
                 Final("a story", 0.5, 1.0, finalized=True))
        await settle()
        assert done_a.result() == "tell me a story"
        assert [w.text for w in a.words] == ["tell", "me"]


async def test_what_comes_for_discarded_audio_is_dropped(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        noise = rig.t.begin()
        rig.say(noise, 0.4)
        noise.drop()
        speech = rig.t.begin()
        rig.say(speech, 1.0)
        done = await finished(speech)
        s = p.streams[0]
        assert s.calls == ["discard@0.40", "finalize@1.40"]
        # a provider that cannot drop audio still answers for it (Deepgram): not the next utterance's words
        s.answer(Interim("uh", 0.0, 0.4), Final("uh", 0.0, 0.4, finalized=True), Final("hello there", 0.4, 1.4, finalized=True))
        await settle()
        assert done.result() == "hello there"
        assert rig.heard == ["hello there"]


async def test_an_empty_answer_to_a_finalize_completes_what_earlier_finals_heard(clock: VirtualClock) -> None:
    """A provider that had finalized everything itself answers a finalize
    with an empty final: the utterance is its earlier finals."""
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 1.0)
        s = p.streams[0]
        s.answer(Final("right", 0.2, 0.7), EndOfUtterance(0.7))  # its own endpointing, before our finalize
        await settle()
        done_a = await finished(a)
        b = rig.t.begin()
        rig.say(b, 0.5)
        s.answer(Interim("count", 1.0, 1.4))
        await settle()
        assert not done_a.done()  # later words prove nothing: answers may come out of order
        s.answer(Final("", 1.0, 1.0, finalized=True))
        await settle()
        assert done_a.result() == "right"
        assert b.text == "count"


async def test_a_final_reaching_the_end_completes_it(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 1.0)
        done = await finished(a)
        p.streams[0].answer(Final("okay", 0.3, 1.0))
        await settle()
        assert done.result() == "okay"


async def test_a_final_owed_too_long_falls_back_and_sends_only_what_was_not_heard(clock: VirtualClock) -> None:
    """A provider too slow for a conversation is not waited for twice: the
    fallback gets the audio after the last final at once."""
    p, e = ScriptedRecogniser("p"), ScriptedRecogniser("e")
    async with Rig(clock, p, e, timeout_s=2.0) as rig:
        a = rig.t.begin()
        rig.say(a, 1.0)
        first = p.streams[0]
        first.answer(Final("what is", 0.0, 0.4))
        await settle()
        done = await finished(a)
        await clock.advance(2.1)  # 2 s, and a quarter of the 0.6 s it owes a final for
        assert len(p.streams) == 1 and not done.done()
        await clock.advance(0.1)
        assert rig.failovers == [("p", "timeout", "fallback", "e")]
        second = e.streams[0]
        assert second.sent_s == pytest.approx(0.6)  # only the audio after the last final
        assert second.calls == ["finalize@0.60"]
        second.answer(Final("the weather", 0.0, 0.6, finalized=True))
        await settle()
        assert done.result() == "what is the weather"
        assert first.closed


async def test_a_recogniser_s_own_bound_on_a_final_wins(clock: VirtualClock) -> None:
    """The embedded pool queues utterances when busy: it is given its own,
    longer bound, so a busy pool is not taken for a broken one."""
    p = ScriptedRecogniser("embedded", final_timeout_s=30.0)
    async with Rig(clock, p, timeout_s=2.0) as rig:
        a = rig.t.begin()
        rig.say(a, 1.0)
        done = await finished(a)
        await clock.advance(29.0)
        assert len(p.streams) == 1 and not done.done()
        await clock.advance(1.5)
        assert rig.failovers == [("embedded", "timeout", "failed", None)]  # nothing to fall back to


async def test_a_drop_mid_utterance_replays_it_and_it_goes_on(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 0.5)
        p.streams[0].answer(RecognitionError("dropped", "connection reset"))
        await settle()
        rig.say(a, 0.5)  # the user goes on while it reconnects
        done = await finished(a)
        second = p.streams[1]
        assert second.sent_s == pytest.approx(1.0) and second.calls == ["finalize@1.00"]
        second.answer(Final("count to twenty", 0.0, 1.0, finalized=True))
        await settle()
        assert done.result() == "count to twenty"
        records = a.usage()
        assert records == [RecognitionRecord(provider="p", audio_s=1.5)]  # the replayed 0.5 s was sent twice


async def test_a_second_failure_falls_back_then_a_third_gives_up_and_the_next_utterance_tries_again(clock: VirtualClock) -> None:
    p, e = ScriptedRecogniser("p", cents_per_minute=60.0), ScriptedRecogniser("embedded")
    async with Rig(clock, p, e) as rig:
        a = rig.t.begin()
        rig.say(a, 1.0)
        done = await finished(a)
        p.streams[0].answer(RecognitionError("dropped", "reset"))
        await settle()
        p.streams[1].answer(RecognitionError("protocol", "garbage"))
        await settle()
        assert e.streams and e.streams[0].calls == ["finalize@1.00"]
        e.streams[0].answer(RecognitionError("provider", "worker died"))
        await settle()
        e.streams[1].answer(RecognitionError("provider", "worker died again"))
        await settle()
        assert [f[2] for f in rig.failovers] == ["reconnect", "fallback", "reconnect", "failed"]
        with pytest.raises(SttError, match="embedded: worker died again"):
            await done
        b = rig.t.begin()
        rig.say(b, 0.3)
        assert len(p.streams) == 3  # the configured recogniser, afresh
        done_b = await finished(b)
        p.streams[2].answer(Final("yeah", 0.0, 0.3, finalized=True))
        await settle()
        assert done_b.result() == "yeah"
        # a's audio went to p twice (1 cent a second) and to the fallback twice
        assert a.usage() == [RecognitionRecord(provider="embedded", audio_s=2.0),
                             RecognitionRecord(provider="p", audio_s=2.0, cents=2.0)]


@pytest.mark.parametrize("kind", ["unauthorized", "unreachable"])
async def test_a_refused_key_or_an_unreachable_provider_goes_straight_to_the_fallback(clock: VirtualClock, kind: str) -> None:
    p, e = ScriptedRecogniser("p"), ScriptedRecogniser("embedded")
    async with Rig(clock, p, e) as rig:
        a = rig.t.begin()
        rig.say(a, 0.4)
        p.streams[0].answer(RecognitionError(kind, "401" if kind == "unauthorized" else "connection refused"))
        await settle()
        assert rig.failovers == [("p", kind, "fallback", "embedded")]
        assert len(p.streams) == 1 and e.streams[0].sent_s == pytest.approx(0.4)
        assert a.usage() == [RecognitionRecord(provider="embedded", audio_s=0.4)]  # nothing reached p: nothing billed


async def test_a_judge_reads_a_settled_interim_that_covers_the_speech_without_waiting(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 0.6)
        p.streams[0].answer(Interim("Charge", 0.05, 0.3))  # a first guess, taken back
        await settle()
        assert a.settled_text is None
        p.streams[0].answer(Interim("Uh huh", 0.05, 0.4), Interim("uh-huh.", 0.05, 0.5))
        await settle()
        assert rig.heard == ["Charge", "Uh huh", "uh-huh."] and a.settled_text == "uh-huh."  # said twice
        assert a.settled_words == "uh huh"
        heard = asyncio.ensure_future(a.heard())
        await settle()
        assert heard.done() and heard.result() == "uh-huh."  # no final waited for
        b = rig.t.begin()
        rig.say(b, 1.0)
        p.streams[0].answer(Interim("wait", 0.6, 0.9), Interim("wait", 0.6, 1.0))  # settled, but covers 0.4 s of 1 s
        await settle()
        heard_b = asyncio.ensure_future(b.heard())
        await settle()
        assert not heard_b.done()
        p.streams[0].answer(Final("wait a moment", 0.6, 1.6, finalized=True))
        await settle()
        assert heard_b.result() == "wait a moment" and b.settled_text == "wait a moment"  # a final is settled


async def test_usage_per_turn_and_per_session(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p", cents_per_minute=6.0)
    p.pricing = SpeechPricing(cents_per_minute=6.0, input_cents_per_1k=10.0, billed_by="connection")
    async with Rig(clock, p) as rig:
        await clock.advance(5.0)
        a = rig.t.begin()
        rig.say(a, 2.0)
        done = await finished(a)
        p.streams[0].answer(Final("hello there", 0.0, 2.0, finalized=True), RecognitionUsage(input_tokens=50, start_s=0.0, end_s=2.0))
        await settle()
        assert await done == "hello there"
        await clock.advance(3.0)
        (record,) = a.usage()
        assert record == RecognitionRecord(provider="p", audio_s=2.0, input_tokens=50, cents=0.7)  # 0.2 for audio, 0.5 for tokens
    totals = rig.t.usage()
    assert totals.audio_s == {"p": pytest.approx(2.0)} and totals.input_tokens == {"p": 50}
    assert totals.connection_s["p"] == pytest.approx(3.0)  # opened with the first speech, not at the session's start


async def test_a_stream_is_opened_for_speech_and_closed_when_idle(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        await clock.advance(30.0)
        assert p.streams == []  # a silent session holds no connection
        a = rig.t.begin()
        rig.say(a, 0.5)
        done = await finished(a)
        p.streams[0].answer(Final("okay", 0.0, 0.5, finalized=True))
        await settle()
        assert done.result() == "okay" and not p.streams[0].closed
        await clock.advance(19.0)
        assert not p.streams[0].closed
        await clock.advance(1.5)
        assert p.streams[0].closed  # 20 s with nothing sent or waited for
        b = rig.t.begin()
        rig.say(b, 0.4)
        assert len(p.streams) == 2 and p.streams[1].sent_s == pytest.approx(0.4)
        p.streams[1].answer(RecognitionError("closed", "NET-0001"))  # waited on: a failure
        await settle()
        assert [f[2] for f in rig.failovers] == ["reconnect"]
    assert rig.t.usage().connection_s["p"] == pytest.approx(20.0)  # the first stream's 20 s; the others lived no time


async def test_a_stream_the_provider_ends_while_idle_is_no_failure(clock: VirtualClock) -> None:
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 0.5)
        done = await finished(a)
        p.streams[0].answer(Final("yeah", 0.0, 0.5, finalized=True))
        await settle()
        assert await done == "yeah"
        await clock.advance(10.0)
        p.streams[0].answer(RecognitionError("closed", "NET-0001: no audio within the timeout window"))
        await settle()
        assert rig.failovers == []  # nothing waited on it: the next utterance opens another
        b = rig.t.begin()
        rig.say(b, 0.3)
        assert len(p.streams) == 2


async def test_a_session_ended_at_once_still_reads_the_providers_closing_usage(clock: VirtualClock) -> None:
    """A WebRTC session's agent is cancelled when the caller hangs up: the
    stream is still closed gracefully and read to its end, so the usage the
    provider sends as it closes (Deepgram's Metadata) is counted."""
    p = ScriptedRecogniser("p")
    rig = Rig(clock, p)
    await rig.__aenter__()
    a = rig.t.begin()
    rig.say(a, 0.5)
    stream = p.streams[0]

    goodbye = asyncio.Event()

    async def closing() -> None:  # the provider's last word comes as it closes, a moment later
        if not stream.closed:
            stream.closed = True
            await goodbye.wait()
            stream.answer(RecognitionUsage(audio_s=0.5))
            stream.queue.put_nowait(None)

    stream.aclose = closing  # type: ignore[method-assign]
    assert rig.task is not None
    rig.task.cancel()
    await settle()
    rig.task.cancel()  # and again while it closes (a task group aborting twice)
    await settle()
    goodbye.set()
    with pytest.raises(asyncio.CancelledError):
        await rig.task
    assert stream.closed and rig.t.usage().reported_audio_s == {"p": 0.5}


async def test_speech_while_an_idle_stream_closes_goes_to_a_new_stream(clock: VirtualClock) -> None:
    """The provider takes a moment to close an idle stream (its Metadata,
    its close frame): speech that starts meanwhile opens another stream at
    once and is heard (it went into the closing one, and its turn waited
    until the session ended: a reviewer's find)."""
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 0.5)
        done = await finished(a)
        p.streams[0].answer(Final("okay", 0.0, 0.5, finalized=True))
        await settle()
        assert done.result() == "okay"
        first = p.streams[0]
        goodbye = asyncio.Event()

        async def slow_close() -> None:
            if not first.closed:
                first.closed = True
                await goodbye.wait()
                first.answer(RecognitionUsage(audio_s=0.5))
                first.queue.put_nowait(None)

        first.aclose = slow_close  # type: ignore[method-assign]
        await clock.advance(20.5)
        assert first.closed  # being retired
        b = rig.t.begin()
        rig.say(b, 0.4)  # the user speaks while the provider says goodbye
        assert len(p.streams) == 2 and p.streams[1].sent_s == pytest.approx(0.4) and first.sent_s == pytest.approx(0.5)
        done_b = await finished(b)
        p.streams[1].answer(Final("count to twenty", 0.0, 0.4, finalized=True))
        await settle()
        assert done_b.result() == "count to twenty"
        goodbye.set()
        await settle()
    assert rig.t.usage().reported_audio_s == {"p": 0.5}  # the retired stream's goodbye, counted


async def test_words_that_stay_put_as_interims_grow_are_settled(clock: VirtualClock) -> None:
    """Interims grow as the user speaks: the words the last two agree on
    from the start are settled (what a barge-in acts on); a first guess
    taken back is not."""
    p = ScriptedRecogniser("p")
    async with Rig(clock, p) as rig:
        a = rig.t.begin()
        rig.say(a, 1.0)
        s = p.streams[0]
        seen = []
        for text in ("Charge", "Wait", "Wait a", "Wait, a moment"):
            s.answer(Interim(text, 0.0, 0.5))
            await settle()
            seen.append(a.settled_words)
        assert seen == ["", "", "wait", "wait a"] and a.settled_text is None


class HintedStream(ScriptedStream):
    """A scripted stream that takes pause hints (as the embedded Whisper's does)."""

    def speech_paused(self) -> None:
        self.calls.append(f"paused@{self.sent_s:.2f}")

    def speech_resumed(self) -> None:
        self.calls.append(f"resumed@{self.sent_s:.2f}")


async def test_pause_hints_reach_a_stream_that_takes_them_for_the_utterance_being_sent(clock: VirtualClock) -> None:
    """The session's pause hints go to the stream while the utterance's
    audio is being sent, and never for an utterance already finalized or
    dropped; a stream without hints (a provider's) is simply not told."""
    primary = ScriptedRecogniser("whisper", stream_type=HintedStream)
    async with Rig(clock, primary) as rig:
        utt = rig.t.begin()
        rig.say(utt, 1.0)
        utt.speech_paused()
        rig.say(utt, 0.2)
        utt.speech_resumed()
        rig.say(utt, 0.4)
        utt.speech_paused()
        task = await finished(utt)
        utt.speech_paused()  # finalized: not passed on
        [stream] = primary.streams
        assert stream.calls == ["paused@1.00", "resumed@1.20", "paused@1.60", "finalize@1.60"]
        stream.answer(Final("what is the weather", 0.0, 1.6, finalized=True))
        assert await asyncio.wait_for(task, 1) == "what is the weather"
        other = rig.t.begin()
        rig.say(other, 0.3)
        other.drop()
        other.speech_paused()
        assert stream.calls[-1] == "discard@1.90"
    plain_recogniser = ScriptedRecogniser("deepgram")
    async with Rig(clock, plain_recogniser) as rig:
        utt = rig.t.begin()
        rig.say(utt, 0.5)
        utt.speech_paused()  # no such method on its stream: nothing happens
        utt.speech_resumed()
        task = await finished(utt)
        assert plain_recogniser.streams[0].calls == ["finalize@0.50"]
        plain_recogniser.streams[0].answer(Final("okay", 0.0, 0.5, finalized=True))
        assert await asyncio.wait_for(task, 1) == "okay"
