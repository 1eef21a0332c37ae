"""The synthesis interface's shared parts: the failover of a reply's
stream (reconnect once, then espeak-ng, or the error), espeak-ng as one
implementation, and the heard text from clause marks and word timings."""

from __future__ import annotations

import asyncio

import pytest

from voice.heard import SAMPLES_PER_CHAR, heard_text
from voice.synthesis import (
    Audio,
    BaseSynthesisStream,
    SegmentDone,
    SynthesisError,
    SynthesisEvent,
    TimedWord,
    Words,
    words_from_characters,
)
from voice.tts import EspeakConfig, EspeakSynthesiser
from voice.tts_failover import FailoverNotice, FailoverSynthesiser

RATE = 16_000
CLAUSE_S = 0.1  # audio per clause of the scripted provider


class ScriptedStream(BaseSynthesisStream):
    """A provider stream on a script: each clause is 0.1 s of audio (one
    word timing per clause), unless the synthesiser is told to fail at
    its n-th clause (before that clause's audio)."""

    def __init__(self, owner: Scripted) -> None:
        super().__init__(owner.name, RATE)
        self.owner = owner
        self.cancelled_on_wire = False

    def _send_text(self, text: str) -> None:
        self.owner.sent.append(text)
        self.owner.clauses += 1
        if self.owner.fail_at is not None and self.owner.clauses == self.owner.fail_at:
            self.owner.fail_at = None if self.owner.fail_once else self.owner.fail_at
            self.emit_error(SynthesisError(self.owner.kind, f"{self.owner.name}: scripted failure"))
            return
        start = self.seconds_yielded
        self.emit_audio(b"\x01\x00" * int(RATE * CLAUSE_S))
        self.emit_words([TimedWord(text.strip(), start, start + CLAUSE_S)])
        self.emit_segment_done()

    def _send_end(self) -> None:
        pass

    def _send_cancel(self) -> None:
        self.cancelled_on_wire = True
        self.told()


class Scripted:
    name = "scripted"

    def __init__(self, fail_at: int | None = None, kind: str = "dropped", fail_once: bool = True) -> None:
        self.fail_at, self.kind, self.fail_once = fail_at, kind, fail_once
        self.sent: list[str] = []
        self.clauses = 0
        self.opened = 0
        self.closed = False

    def open(self, context_id: str) -> ScriptedStream:
        self.opened += 1
        return ScriptedStream(self)

    async def warm(self) -> None:
        pass

    async def aclose(self) -> None:
        self.closed = True


class Fallback(Scripted):
    name = "fallback"


async def speak_all(synth: FailoverSynthesiser, clauses: list[str]) -> list[SynthesisEvent]:
    stream = synth.open("t1-1")
    for c in clauses:
        stream.push_text(c)
    stream.end_input()
    events = [e async for e in stream]
    await stream.aclose()
    return events


async def test_a_dropped_provider_is_reconnected_with_the_clauses_not_spoken_whole() -> None:
    primary, notices = Scripted(fail_at=2), []
    synth = FailoverSynthesiser(primary, Fallback(), tell=notices.append)
    events = await speak_all(synth, ["One. ", "Two. ", "Three. "])
    assert [e.text for e in events if isinstance(e, SegmentDone)] == ["One. ", "Two. ", "Three. "]
    # the failed clause and the one after it were sent again on the new stream
    assert primary.sent == ["One. ", "Two. ", "Two. ", "Three. "]  # nothing more went to the failed stream
    assert primary.opened == 2
    [notice] = notices
    assert (notice.provider, notice.error.kind, notice.action, notice.fallback) == ("scripted", "dropped", "reconnect", "scripted")
    # the consumer is told the clause that was arriving is said again (its marks restart)
    assert [type(e).__name__ for e in events].count("Restarted") == 1
    # word timings of the second stream follow the first's audio
    words = [w for e in events if isinstance(e, Words) for w in e.words]
    assert [(w.text, round(w.start_s, 3)) for w in words] == [("One.", 0.0), ("Two.", 0.1), ("Three.", 0.2)]


async def test_a_refused_key_goes_straight_to_the_fallback() -> None:
    primary, fallback, notices = Scripted(fail_at=1, kind="unauthorized"), Fallback(), []
    synth = FailoverSynthesiser(primary, fallback, tell=notices.append)
    events = await speak_all(synth, ["One. ", "Two. "])
    assert primary.opened == 1  # no reconnect: a wrong key stays wrong
    assert fallback.sent == ["One. ", "Two. "]
    assert [n.action for n in notices] == ["fallback"]
    assert sum(len(e.pcm) for e in events if isinstance(e, Audio)) == 2 * int(RATE * CLAUSE_S) * 2


async def test_a_provider_that_fails_again_after_its_reconnect_hands_over_to_the_fallback() -> None:
    primary, fallback, notices = Scripted(fail_at=1, fail_once=False), Fallback(), []
    primary.fail_at = 1
    synth = FailoverSynthesiser(primary, fallback, tell=notices.append)

    class Again(ScriptedStream):
        def _send_text(self, text: str) -> None:
            self.owner.sent.append(text)
            self.emit_error(SynthesisError("dropped", "again"))

    primary.open = lambda context_id: Again(primary)  # type: ignore[method-assign]
    await speak_all(synth, ["One. "])
    assert [n.action for n in notices] == ["reconnect", "fallback"]
    assert fallback.sent == ["One. "]
    stream = synth.open("t2-1")
    assert stream.provider == "scripted"  # each reply tries the provider again


async def test_with_no_fallback_the_reply_ends_with_the_error_and_every_stream_is_accounted() -> None:
    primary, notices = Scripted(fail_at=1, kind="unauthorized"), []
    synth = FailoverSynthesiser(primary, None, tell=notices.append)
    stream = synth.open("t1-1")
    stream.push_text("Hello there. ")
    stream.end_input()
    with pytest.raises(SynthesisError, match="scripted failure") as info:
        async for _ in stream:
            pass
    assert info.value.kind == "unauthorized"
    assert [n.action for n in notices] == ["failed"]
    [record] = stream.records()
    assert record.provider == "scripted" and record.characters == 0  # a refused key bills nothing
    await stream.aclose()


async def test_cancel_reaches_the_stream_in_use_and_nothing_follows() -> None:
    primary = Scripted()
    synth = FailoverSynthesiser(primary, Fallback())
    stream = synth.open("t1-1")
    stream.push_text("One. ")
    got = [await stream.__aiter__().__anext__()]
    stream.cancel()
    assert isinstance(got[0], Audio)
    assert stream.stop is not None
    stream.inner.emit_audio(b"\x00\x00" * 1600)  # a straggler of the cancelled context
    assert [e async for e in stream] == []
    assert stream.stop.late_audio_ms == pytest.approx(100.0)
    assert stream.stop.characters_unspoken == 0  # its one clause had been spoken whole
    with pytest.raises(RuntimeError):
        stream.push_text("Two. ")
    assert stream.records()[0].characters_after_stop == len("Two. ")


async def test_espeak_is_one_implementation_and_its_cancel_kills_the_process_at_once() -> None:
    synth = EspeakSynthesiser(EspeakConfig(words_per_minute=80))
    stream = synth.open("t1-1")
    stream.push_text("Hello there. ")
    stream.push_text("This is a long sentence that takes a while to say. ")
    stream.end_input()
    events: list[SynthesisEvent] = []
    async for event in stream:
        events.append(event)
        if isinstance(event, SegmentDone):
            stream.cancel()
    assert [e.text for e in events if isinstance(e, SegmentDone)] == ["Hello there. "]
    assert all(e.sample_rate == 48_000 for e in events if isinstance(e, Audio))
    assert stream.stop is not None and stream.stop.confirmed and stream.stop.tell_ms is not None
    assert stream.stop.characters_unspoken == len("This is a long sentence that takes a while to say. ")
    await stream.aclose()
    await asyncio.sleep(0)
    assert not synth.tts.running  # the process was killed and reaped
    usage = stream.usage()
    assert usage.after_stop == "confirmed" and usage.audio_s > 0.3


async def test_espeak_that_is_missing_fails_the_stream_with_a_provider_error() -> None:
    synth = EspeakSynthesiser(EspeakConfig(executable="/nonexistent/espeak-ng"))
    stream = synth.open("t1-1")
    stream.push_text("hi")
    stream.end_input()
    with pytest.raises(SynthesisError, match="not found"):
        async for _ in stream:
            pass
    await stream.aclose()


def test_the_heard_text_follows_the_providers_word_timings() -> None:
    spoken = [(0, 48_000, "Hello there friend.")]
    words = [(0, 10_000, "Hello"), (12_000, 20_000, "there"), (30_000, 47_000, "friend.")]
    assert heard_text(spoken, 19_999, words) == "Hello"
    assert heard_text(spoken, 20_000, words) == "Hello there"
    assert heard_text(spoken, 48_000, words) == "Hello there friend."
    # a later clause without timings (a fallback took over) is estimated as before
    spoken.append((48_000, 96_000, "Two words."))
    assert heard_text(spoken, 96_000, words) == "Hello there friend. Two words."
    assert heard_text(spoken, 48_000 + 10_000, words) == "Hello there friend."


def test_the_heard_text_of_a_clause_still_arriving() -> None:
    # timed words of the open clause decide
    words = [(0, 9_000, "Once"), (10_000, 19_000, "upon")]
    assert heard_text([], 19_000, words, open_segment=(0, 19_000, "Once upon a time.")) == "Once upon"
    # without timings: the longer of what arrived and the characters' estimate
    text = "Once upon a time."
    estimate = SAMPLES_PER_CHAR * len(text)
    assert heard_text([], estimate * 9 // 17 + SAMPLES_PER_CHAR // 2, None, open_segment=(0, 1_000, text)) == "Once upon"
    assert heard_text([], 10**9, None, open_segment=(0, 1_000, text)) == "Once upon a time."


def test_character_alignment_becomes_word_timings() -> None:
    chars = list("Hi you")
    starts = [0.0, 50.0, 100.0, 150.0, 200.0, 250.0]
    durs = [50.0] * 6
    words = words_from_characters(chars, starts, durs, offset_s=1.0)
    assert words == [TimedWord("Hi", 1.0, 1.1), TimedWord("you", 1.15, 1.3)]
    with pytest.raises(ValueError, match="differ in length"):
        words_from_characters(chars, starts[:-1], durs)


def test_a_notice_says_what_follows() -> None:
    notice = FailoverNotice("cartesia", SynthesisError("closed", "1008"), "fallback", "espeak-ng")
    assert notice.error.retryable and not SynthesisError("unauthorized", "401").retryable
