"""Barge-in quality in the agent session, with the real providers and real
audio frame by frame (no WebRTC): false interruptions resume, backchannels
cancel nothing, only what was heard is remembered, endpointing gives one
reply to one utterance, push-to-talk, the non-interruptible window of a
must-complete tool, and the echo guard against the agent's own voice."""

from __future__ import annotations

import asyncio
from collections import deque
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import corpus as C
import numpy as np
import pytest
from av.audio.frame import AudioFrame
from conftest import plain, requires_espeak
from test_agent_session import Harness, Mic, pcm48

from clock import Clock
from demo_shop.service import DemoService
from demo_shop.tools import demo_tools
from media.bargein_config import BargeInConfig
from media.echo_guard import EchoReference
from media.frames import PLAYOUT_RATE, VAD_RATE
from media.inbound import InboundAudio
from turn.models import StopReasonKind, TurnStatus
from turn.sqlite_store import SqliteStore
from turn.usage import RequestMeter
from voice.backchannel import BackchannelConfig
from voice.endpointing import EndpointConfig
from voice.heard import heard_text
from voice.llm import LocalAgent, LocalLlmConfig
from voice.providers import Message, ToolCall, ToolSpec

pytestmark = requires_espeak


def up(pcm16: bytes) -> bytes:
    """16 kHz corpus audio as 48 kHz microphone audio."""
    return C.resample(pcm16, VAD_RATE, PLAYOUT_RATE)


def trimmed(pcm: bytes) -> bytes:
    """48 kHz speech without espeak-ng's leading and trailing silence."""
    start, end = C.sound_extent(pcm, rate=PLAYOUT_RATE)  # type: ignore[misc]
    return pcm[int(start * PLAYOUT_RATE) * 2 : int(end * PLAYOUT_RATE) * 2]


def types(h: Harness) -> list[str]:
    return [e["type"] for e in h.events]


async def story_playing(h: Harness, say: Callable[..., Path], frames: int = 25) -> None:
    h.mic.say(pcm48(say("tell me a story")))
    await h.wait_for(lambda: 1 in h.track.audit.per_generation and h.track.audit.per_generation[1].frames > frames)


def paying_harness(store: SqliteStore, slow_s: float) -> tuple[Harness, DemoService]:
    """A harness whose agent has the demo tools, with payments that take
    ``slow_s`` seconds to commit."""
    h = Harness(store)
    service = DemoService(h.clock, latency_s=0.02)
    service.slow_s = slow_s
    service.inject("payment", "slow")
    tools = demo_tools(h.clock, service, store)
    h.manager.ledger.handlers = tools.get
    h.session.providers.tools = tools
    return h, service


@pytest.fixture
async def h(store: SqliteStore):  # type: ignore[no-untyped-def]
    harness = Harness(store)
    await harness.start()
    yield harness
    if not harness.run_task.done():
        await harness.stop()


# -- false interruptions ---------------------------------------------------------

NOT_SPEECH = {c.name: c for c in C.nonspeech_clips()} if C.have_espeak() else {}


def record_sent(h: Harness, also: Callable[..., None] | None = None) -> list[int | None]:
    """What the RTP sender is handed, 20 ms per entry: the generation of a
    reply frame, or None for a silence frame (nothing deliverable: paused,
    fenced or starved). ``also`` is still called with each frame."""
    sent: list[int | None] = []

    def on_sent(frame, at):  # type: ignore[no-untyped-def]
        sent.append(None if frame is None else frame.generation)
        if also is not None:
            also(frame, at)

    h.track.on_sent = on_sent
    return sent


def longest_hole_ms(sent: list[int | None]) -> int:
    """The longest run of silence frames between two reply frames (ms): a
    hole in the reply as the caller hears it. The reply's own pauses are
    audio frames, not holes."""
    longest = run = 0
    playing = False
    for g in sent:
        if g is None:
            run += playing
        else:
            longest, run, playing = max(longest, run), 0, True
    return longest * 20


@pytest.mark.parametrize(
    "name", ["alsa-noise", "white-noise--30", "tone-1k--12", "sweep", "knock-5", "clicks-5ms", "cough-250", "cough-loud", "dtmf-burst"]
)
async def test_a_noise_while_the_agent_speaks_leaves_no_hole(
    h: Harness, say: Callable[..., Path], store: SqliteStore, name: str
) -> None:
    """Not speech: nothing paused (no hole of even 20 ms in what is sent),
    nothing cancelled, nothing said about it. The sweep may pause on trial
    (its onset can score 0.5-0.72): taken back after the 40 ms verify
    window. This harness runs on real time beside other tests, so the hole
    counted in sent frames carries the loop's scheduling delay on top (an
    80 ms hole seen once in CI on a loaded 2-core machine); the bound here
    is a sanity bound, the measured gaps live in ``bench/soak.py``."""
    await story_playing(h, say)
    sent = record_sent(h)
    before_events = len(h.events)
    h.mic.say(up(NOT_SPEECH[name].pcm))
    await h.wait_for(h.mic.idle.is_set)
    await asyncio.sleep(0.8)  # past the confirmation timeout
    assert "barge_in" not in types(h)
    [turn] = await store.list_session("sess-1")
    assert turn.status is TurnStatus.RUNNING  # still telling the story
    assert h.playout.cleared_frames == 0 and h.track.audit.fenced_frames == 0
    assert sent.count(1) > 25 * 3  # the noise's 3 s: the reply went on
    assert not h.playout.paused
    if name == "sweep":
        assert longest_hole_ms(sent) <= 140, sent
        return
    assert longest_hole_ms(sent) == 0, sent
    later = [(e["type"], e.get("event")) for e in h.events[before_events:]]
    assert ("vad", "speech_started") not in later and ("false_interruption", None) not in later
    assert h.session.false_interruptions == 0


class QuietMic(Mic):
    """A microphone that can go quiet: once ``quiet`` is set and what was
    said is sent, no frame at all comes (a muted client, a dead uplink)."""

    def __init__(self) -> None:
        super().__init__()
        self.quiet = False

    async def recv(self) -> AudioFrame:
        while self.quiet and not self._queue and not self._closed:
            await asyncio.sleep(0.02)
        return await super().recv()


async def test_a_client_that_goes_quiet_during_a_pause_gets_the_reply_back(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    """A tone pauses the reply (stage 1 on the gate alone: the speech-onset
    check would not pause for a tone); the client's audio then stops
    altogether before the detector could reject it. The stretch without
    audio is filled with silence, so the rejection comes on time and the
    reply resumes; the turn goes on."""
    h = Harness(store)
    h.mic = QuietMic()
    await h.start(InboundAudio(h.mic, h.clock, bargein=BargeInConfig(pause_speech_threshold=0)))
    try:
        await story_playing(h, say)
        h.mic.say(up(C.tone((1000.0,), 0.4, -12.0)))
        h.mic.quiet = True
        await h.wait_for(lambda: "false_interruption" in types(h), timeout=10)
        assert not h.playout.paused and "barge_in" not in types(h)
        assert h.inbound.filled_frames > 0 and h.playout.cleared_frames == 0
        [turn] = await store.list_session("sess-1")
        assert turn.status is TurnStatus.RUNNING
    finally:
        h.mic.quiet = False
        await h.stop()


# -- backchannels ------------------------------------------------------------------


async def test_a_backchannel_cancels_nothing_and_is_not_the_next_turn(
    h: Harness, say: Callable[..., Path], store: SqliteStore
) -> None:
    await story_playing(h, say)
    h.mic.say(pcm48(say("uh-huh")))
    await h.wait_for(lambda: "backchannel" in types(h), timeout=10)
    [bc] = [e for e in h.events if e["type"] == "backchannel"]
    assert plain(bc["text"]) == "uh huh" and bc["paused_ms"] > 0  # heard as such
    assert "barge_in" not in types(h) and h.playout.cleared_frames == 0
    [turn] = await store.list_session("sess-1")
    assert turn.status is TurnStatus.RUNNING
    await asyncio.sleep(0.5)
    h.mic.say(pcm48(say("what is the weather like today")))
    await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=30)
    story, weather = await store.list_session("sess-1")
    assert story.stop_reason is not None and story.stop_reason.kind is StopReasonKind.BARGE_IN
    assert plain(weather.transcript) == "what is the weather like today"  # the "uh-huh" is not in it
    assert [plain(m.content) for m in (await h.session.history()) if m.role == "user"] == ["tell me a story", plain(weather.transcript)]


@pytest.mark.parametrize("text, wpm", [("mm-hmm", 140), ("mm-hmm", 120), ("okay", 120)])
async def test_a_drawn_out_backchannel_is_still_one(
    h: Harness, say: Callable[..., Path], store: SqliteStore, text: str, wpm: int
) -> None:
    """A slow "mm-hmm" (0.7 s of speech at 140 wpm, 0.85 s at 120) is a
    backchannel like a quick one: it cancelled the reply and became a turn
    while ``max_ms`` was 700 (a newcomer's try, issue 32)."""
    await story_playing(h, say)
    h.mic.say(pcm48(say(text, wpm=wpm)))
    await h.wait_for(lambda: "backchannel" in types(h) or "barge_in" in types(h), timeout=10)
    assert "barge_in" not in types(h), [e for e in h.events if e["type"] in ("backchannel", "barge_in", "vad")]
    [turn] = await store.list_session("sess-1")
    assert turn.status is TurnStatus.RUNNING


async def test_the_reply_goes_on_from_the_start_of_the_word_it_paused_in(h: Harness, say: Callable[..., Path]) -> None:
    """After a backchannel the reply plays on from the start of the word the
    pause fell in (DESIGN.md): what the track sends steps back by the
    event's replayed_ms once, never more than a word (500 ms), and goes on
    from there; the heard position is not counted twice."""
    samples: list[int] = []
    record_sent(h, lambda frame, at: samples.append(frame.sample) if frame is not None and frame.generation == 1 else None)
    await story_playing(h, say, frames=40)
    h.mic.say(pcm48(say("uh-huh")))
    await h.wait_for(lambda: "backchannel" in types(h), timeout=10)
    [bc] = [e for e in h.events if e["type"] == "backchannel"]
    await asyncio.sleep(0.5)
    steps = [b - a for a, b in zip(samples, samples[1:], strict=False) if b - a != 960]
    if bc["replayed_ms"] == 0:
        assert steps == []  # paused between two words: on from the very frame
    else:
        assert 0 < bc["replayed_ms"] <= 500 and steps == [960 - bc["replayed_ms"] * 48], (bc, steps)
    assert h.playout.played_samples(1) == max(samples) + 960


@pytest.mark.parametrize(("first", "then", "barges_in"), [("uh", "huh", False), ("yeah", "but", True)])
async def test_a_backchannel_the_user_goes_on_after_is_judged_with_what_follows(
    h: Harness, say: Callable[..., Path], store: SqliteStore, first: str, then: str, barges_in: bool
) -> None:
    """ "uh ... huh" and "yeah ... but", 550 ms between the words, over the
    talking agent: the first word is a backchannel and the reply goes on
    (150 ms after it); the second comes within rejoin_ms (600) and is judged
    with it: "uh huh" goes on being one, "yeah but" barges in (issue 32,
    item 4). Before, speech within rejoin_ms of a backchannel barged in
    whatever it was: "uh ... huh" cancelled the reply. (On a loaded machine
    the first verdict may come after the second word began: then the two
    are one utterance, judged whole, with the same outcome.)"""
    await story_playing(h, say)
    h.mic.say(trimmed(pcm48(say(first))) + bytes(int(0.55 * PLAYOUT_RATE) * 2) + trimmed(pcm48(say(then))))
    if barges_in:
        await h.wait_for(lambda: "barge_in" in types(h), timeout=10)
        [barge] = [e for e in h.events if e["type"] == "barge_in"]
        assert barge["initiator"] == "vad"
    else:
        await h.wait_for(lambda: "backchannel" in types(h), timeout=10)
        await asyncio.sleep(1.5)  # the second word's verdict too
        last = [e for e in h.events if e["type"] == "backchannel"][-1]
        assert plain(last["text"]).startswith("uh"), last  # judged with the first word
        assert "barge_in" not in types(h) and h.playout.cleared_frames == 0
        [turn] = await store.list_session("sess-1")
        assert turn.status is TurnStatus.RUNNING


@pytest.mark.parametrize(("voice", "wpm"), [("en+m3", 270), ("en-gb", 300), ("en-us+f3", 300)])
async def test_fast_speech_the_recogniser_misses_is_no_backchannel(
    h: Harness, say: Callable[..., Path], voice: str, wpm: int
) -> None:
    """A fast "tell me a story" (about half a second) fits in a backchannel's
    length, and the grammar-bound recogniser hears no word or "uh" in it;
    its syllables make it speech all the same: it barges in, the agent does
    not resume. (Without the syllable count, these three resumed.)"""
    await story_playing(h, say)
    h.mic.say(pcm48(say("tell me a story", voice=voice, wpm=wpm)))
    await h.wait_for(lambda: "barge_in" in types(h), timeout=10)
    assert "backchannel" not in types(h)
    [barge] = [e for e in h.events if e["type"] == "barge_in"]
    assert barge["initiator"] == "vad"


@pytest.mark.parametrize("name", ["Front_Left", "Rear_Left", "Front_Center"])
async def test_the_reply_does_not_play_between_two_words(
    h: Harness, say: Callable[..., Path], alsa_wav: Callable[[str], Path], name: str
) -> None:
    """A human "Front ... Left" (a 300-360 ms pause between the words) over
    the talking agent: the first word alone could pass for a backchannel,
    but the reply is not let go inside the pause; the second word joins the
    first, and the whole barges in. The agent stays silent from the first
    pause on: the playout buffer is never resumed."""
    await story_playing(h, say)
    resumes = 0
    resume = h.playout.resume

    def counting_resume() -> None:
        nonlocal resumes
        resumes += h.playout.paused
        resume()

    h.playout.resume = counting_resume  # type: ignore[method-assign]
    h.mic.say(pcm48(alsa_wav(f"{name}.wav")))
    await h.wait_for(lambda: "barge_in" in types(h), timeout=10)
    assert "backchannel" not in types(h)
    barge_at = next(i for i, e in enumerate(h.events) if e["type"] == "barge_in")
    assert resumes <= 1  # only the commit's own resume, after the clear
    assert "false_interruption" not in types(h)[:barge_at]


async def test_with_backchannels_off_confirmed_speech_commits_at_once(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    h = Harness(store)
    h.session.config = h.session.config.model_copy(update={"backchannel": BackchannelConfig(enabled=False)})
    await h.start()
    try:
        await story_playing(h, say)
        h.mic.say(pcm48(say("uh-huh")))
        await h.wait_for(lambda: "barge_in" in types(h), timeout=10)
        [barge] = [e for e in h.events if e["type"] == "barge_in"]
        assert barge["onset_to_fence_ms"] < 500  # stage 2: about 200 ms of confirmed speech
    finally:
        await h.stop()


def test_backchannel_word_list() -> None:
    bc = BackchannelConfig()
    for text in ("uh-huh", "Mm-hmm.", "yeah yeah", "okay", "oh okay", "I see", "", "right, right"):
        assert bc.matches(text), text
    for text in ("stop", "wait a second", "yeah but no", "tell me a story"):
        assert not bc.matches(text), text
    assert BackchannelConfig(words=["sure thing"]).matches("Sure thing!")
    with pytest.raises(ValueError):
        BackchannelConfig(max_ms=10)


# -- only what was heard -----------------------------------------------------------


def test_heard_text_cuts_at_the_played_sample() -> None:
    spoken = [(0, 48_000, "Once upon a time."), (48_000, 144_000, "There was a tiny dragon who loved tea.")]
    assert heard_text(spoken, 0) == ""
    assert heard_text(spoken, 47_000) == "Once upon a"  # the last word was cut: it is left out
    assert heard_text(spoken, 48_000) == "Once upon a time."
    assert heard_text(spoken, 48_000 + 48_000) == "Once upon a time. There was a tiny"
    assert heard_text(spoken, 10**9) == "Once upon a time. There was a tiny dragon who loved tea."


async def test_the_next_model_call_sees_only_what_was_heard(
    h: Harness, say: Callable[..., Path], store: SqliteStore
) -> None:
    seen: list[list] = []
    llm = h.session.providers.llm
    original = llm.stream

    def recording(messages, **kw):  # type: ignore[no-untyped-def]
        seen.append(list(messages))
        return original(messages, **kw)

    llm.stream = recording  # type: ignore[method-assign]
    await story_playing(h, say, frames=100)
    h.mic.say(pcm48(say("what is the weather like today")))
    await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=30)
    story, _ = await store.list_session("sess-1")
    played = h.playout.played_samples(1)
    assert played > 0
    sent = [m for m in seen[-2] if m.role == "assistant"]  # the weather turn's first request
    [interrupted] = sent
    assert interrupted.interrupted
    # exactly the heard words: a prefix of the reply, cut where playout stopped
    [note] = [e for e in h.events if e["type"] == "agent.interrupted"]
    assert note["heard"] == interrupted.content and note["played_ms"] == round(played / 48)
    # the record keeps the same heard words as its reply, the rest apart
    assert story.reply == interrupted.content
    words = " ".join(filter(None, (story.reply, story.reply_unheard)))
    assert words.startswith(interrupted.content) and len(interrupted.content) < len(words)
    # about 12 characters a second of speech: the heard text matches the time played
    assert abs(len(interrupted.content) - played / PLAYOUT_RATE * 14) < 40


# -- endpointing -----------------------------------------------------------------


async def test_a_short_pause_inside_an_utterance_gives_one_turn(
    h: Harness, say: Callable[..., Path], store: SqliteStore
) -> None:
    first, second = trimmed(pcm48(say("what is the weather"))), trimmed(pcm48(say("like today")))
    h.mic.say(first + bytes(1920 * 15) + second)  # 300 ms pause < 500 ms endpoint silence
    await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=30)
    # one answer: a speculative reply started at the pause (its tentative end,
    # 200 ms) is taken back when the user goes on, its words merged
    *taken_back, turn = await store.list_session("sess-1")
    assert plain(turn.transcript) == "what is the weather like today" and turn.status is TurnStatus.COMPLETED
    for t in taken_back:
        assert t.stop_reason is not None and t.stop_reason.kind is StopReasonKind.SPECULATION_WITHDRAWN
        assert t.merged_into == turn.id
    assert [e.get("event") for e in h.events if e["type"] == "vad"].count("end_of_turn") == 1


class HeldFirstReply(LocalAgent):
    """The local agent whose first request yields nothing until
    ``release`` is set: a model too slow for its reply to be heard before
    the user goes on."""

    def __init__(self, clock: Clock) -> None:
        super().__init__(LocalLlmConfig(), clock)
        self.release = asyncio.Event()
        self.requests = 0

    async def stream(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, meter: RequestMeter | None = None
    ) -> AsyncIterator[str | ToolCall]:
        self.requests += 1
        if self.requests == 1:
            await self.release.wait()
        async for item in super().stream(messages, tools=tools, meter=meter):
            yield item


async def test_going_on_after_the_endpoint_cancels_the_unheard_reply_and_answers_the_whole(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    h = Harness(store)
    # a slow model: the reply to the first part cannot start playing in time
    # (held until the second part is confirmed; a pace of 3 tokens/s was
    # not slow enough where the endpoint fires fast: 120 ms of it played)
    h.session.providers.llm = llm = HeldFirstReply(h.clock)
    await h.start()
    try:
        h.mic.say(pcm48(say("hello again")) + bytes(1920 * 40) + pcm48(say("what is the weather like today")))
        await h.wait_for(lambda: sum(e.get("event") == "speech_confirmed" for e in h.events) >= 2, timeout=30)
        llm.release.set()
        await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=60)
        first, whole = await store.list_session("sess-1")
        assert first.status is TurnStatus.CANCELLED and first.stop_reason.kind is StopReasonKind.BARGE_IN  # type: ignore[union-attr]
        assert plain(whole.transcript) == "hello again what is the weather like today"
        assert 1 not in h.track.audit.per_generation  # the first reply never played
        assert [m.content for m in (await h.session.history()) if m.role == "user"] == [whole.transcript]
        replies = [m for m in await h.session.history() if m.role == "assistant" and not m.tool_calls]
        assert len(replies) == 1  # one reply
    finally:
        await h.stop()


def test_endpoint_settings_are_checked() -> None:
    with pytest.raises(ValueError):
        EndpointConfig(min_delay_ms=900, max_delay_ms=500)
    with pytest.raises(ValueError):
        EndpointConfig(silence_ms=-1)


# -- push-to-talk ------------------------------------------------------------------


async def test_push_to_talk_barges_in_at_once_and_ends_the_turn_on_release(
    h: Harness, say: Callable[..., Path], store: SqliteStore
) -> None:
    assert h.session.ptt_end() == "ptt_not_active"
    await story_playing(h, say)
    assert h.session.ptt_start() is None
    assert h.session.ptt_start() == "ptt_already_active"
    # committed at once, with no VAD: generation advanced, playout cleared
    assert h.fence.active == 2 and len(h.playout) == 0
    [barge] = [e for e in h.session.barge_ins]
    assert barge.onset_to_fence_ms < 50
    h.mic.say(pcm48(say("what is the weather like today")))
    await h.wait_for(h.mic.idle.is_set)
    released = asyncio.get_running_loop().time()
    assert h.session.ptt_end() is None
    await h.wait_for(lambda: h.phase("thinking") and any(e.get("event") == "end_of_turn" for e in h.events), timeout=5)
    assert asyncio.get_running_loop().time() - released < 0.4  # no endpointing wait
    await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=30)
    story, weather = await store.list_session("sess-1")
    assert story.stop_reason.kind is StopReasonKind.BARGE_IN and story.stop_reason.initiator == "ptt"  # type: ignore[union-attr]
    assert plain(weather.transcript) == "what is the weather like today"
    [ev] = [e for e in h.events if e["type"] == "barge_in"]
    assert ev["initiator"] == "ptt"


async def test_push_to_talk_ignores_the_detector_while_held(
    h: Harness, say: Callable[..., Path], store: SqliteStore
) -> None:
    await h.wait_for(lambda: h.session.ptt_start() != "session_not_ready")  # nothing playing: opens a turn
    h.mic.say(pcm48(say("hello again")) + bytes(1920 * 50) + pcm48(say("what is the weather like today")))
    await h.wait_for(h.mic.idle.is_set, timeout=15)
    # a 1 s pause did not end it: only the release does
    [turn] = await store.list_session("sess-1")
    assert turn.status is TurnStatus.RUNNING and not h.phase("thinking")
    assert h.session.ptt_end() is None
    await h.wait_for(lambda: any(e.get("status") in ("COMPLETED", "FAILED") for e in h.turn_events()), timeout=60)


# -- non-interruptible window ------------------------------------------------------


async def test_a_barge_in_during_a_payment_silences_at_once_and_stops_after_the_commit(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    h, service = paying_harness(store, slow_s=2.5)
    await h.start()
    try:
        h.mic.say(pcm48(say("charge my card")))
        await h.wait_for(lambda: any(r.scope is not None and r.scope.committing for r in h.session._runs), timeout=30)
        h.mic.say(pcm48(say("hello again")))
        await h.wait_for(lambda: "stop_deferred" in types(h), timeout=10)
        # the audio is silent now, but the turn is not stopped yet
        paying = h.session._runs[0]
        assert paying.scope is not None and not paying.scope.stopped.is_set()
        await h.wait_for(lambda: sum(e.get("status") == "COMPLETED" for e in h.turn_events()) == 1, timeout=40)
        old, new = await store.list_session("sess-1")
        [row] = await store.ledger_list(old.id)
        assert row.tool == "charge_payment" and row.status.value == "done"
        assert await service.times_applied(row.key) == 1
        # stopped only after the commit: the payment is not an effect after the stop
        assert old.stop_reason is not None and old.stop_reason.kind is StopReasonKind.BARGE_IN
        assert row.done_at is not None and row.done_at <= old.stop_reason.at
        assert old.status is TurnStatus.CANCELLED
        assert old.usage.requests_after_stop == 0
        # then the new turn started; it answers "hello again" alone (the paying turn acted: no merge)
        assert plain(new.transcript) == "hello again"
        order = [(e["turn_id"], e["status"]) for e in h.turn_events()]
        assert order.index((old.id, "CANCELLED")) < order.index((new.id, "RUNNING"))
    finally:
        await h.stop()
        await service.aclose()


# -- echo guard --------------------------------------------------------------------


class SpeakerphoneMic(Mic):
    """A microphone that also hears the agent's audio from the loudspeaker,
    attenuated and delayed, as a speakerphone does."""

    def __init__(self, gain_db: float, delay_frames: int) -> None:
        super().__init__()
        self.gain = 10 ** (gain_db / 20)
        self.echo: deque[np.ndarray] = deque(np.zeros(960) for _ in range(delay_frames))

    def played(self, pcm48: bytes | None) -> None:
        x = np.zeros(960) if pcm48 is None else np.frombuffer(pcm48, dtype="<i2") * self.gain
        self.echo.append(x)

    async def recv(self) -> AudioFrame:
        frame = await super().recv()
        if self.echo:
            mixed = frame.to_ndarray().reshape(-1).astype(np.float64) + self.echo.popleft()
            out = AudioFrame.from_ndarray(mixed.clip(-32768, 32767).astype("<i2").reshape(1, -1), format="s16", layout="mono")
            out.sample_rate = PLAYOUT_RATE
            return out
        return frame


@pytest.mark.serial  # the echo path is aligned in real time: a loaded CPU skews it
async def test_the_agent_does_not_interrupt_itself_on_a_speakerphone(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    h = Harness(store)
    h.mic = mic = SpeakerphoneMic(gain_db=-6, delay_frames=6)
    echo = EchoReference(500)

    def sent_to_echo(frame, at):  # type: ignore[no-untyped-def]
        echo.played(frame.pcm if frame is not None else None, at)
        mic.played(frame.pcm if frame is not None else None)

    h.track.on_sent = sent_to_echo
    await h.start(InboundAudio(mic, h.clock, echo=echo))
    try:
        h.mic.say(pcm48(say("tell me a story")))
        await h.wait_for(lambda: 1 in h.track.audit.per_generation and h.track.audit.per_generation[1].frames > 25, timeout=30)
        sent = record_sent(h, also=sent_to_echo)
        await h.wait_for(lambda: h.track.audit.per_generation[1].frames > 300, timeout=30)
        # six seconds of its own voice in the microphone: no barge-in, no false
        # interruption, nothing cleared, no hole in the reply. (Once in CI, after
        # the whole suite, an echo onset was considered and rejected: allowed,
        # as long as it made no audible hole; the bound is a real-time sanity
        # bound, see bench/soak.py for the measured gaps.)
        vad = [e.get("event") for e in h.events if e["type"] == "vad"]
        assert vad.count("speech_started") - vad.count("speech_rejected") == 1 and "barge_in" not in types(h), vad
        assert "false_interruption" not in types(h) and h.playout.cleared_frames == 0
        assert longest_hole_ms(sent) <= 60, sent
        # the user speaking over it (double talk) still barges in, and is
        # heard without the agent's words from before their onset (the
        # pre-roll's echo once made it "the smoke is the weather like today")
        h.mic.say(pcm48(say("what is the weather like today")))
        await h.wait_for(lambda: "barge_in" in types(h), timeout=10)
        await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=30)
        story, weather = await store.list_session("sess-1")
        assert story.stop_reason is not None and story.stop_reason.kind is StopReasonKind.BARGE_IN
        assert plain(weather.transcript) == "what is the weather like today"
    finally:
        await h.stop()


async def test_a_disconnect_during_a_deferred_stop_leaves_no_turn_open(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    """The reviewer's case: push-to-talk during a payment's commit, then the
    client goes away. Every turn ends, each with its own stop request."""
    h, service = paying_harness(store, slow_s=2.0)
    await h.start()
    try:
        h.mic.say(pcm48(say("charge my card")))
        await h.wait_for(lambda: any(r.scope is not None and r.scope.committing for r in h.session._runs), timeout=30)
        assert h.session.ptt_start() is None
        await h.wait_for(lambda: "stop_deferred" in types(h), timeout=5)
    finally:
        await h.stop()  # the client hangs up while the stop waits for the commit
    try:
        turns = await store.list_session("sess-1")
        assert len(turns) == 2 and all(t.is_terminal for t in turns), [(t.status, t.stop_reason) for t in turns]
        paying, held = turns
        assert held.stop_reason is not None and held.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED
        [row] = await store.ledger_list(paying.id)
        assert await service.times_applied(row.key) == 1
    finally:
        await service.aclose()


async def test_push_to_talk_held_too_long_ends_the_utterance(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    h = Harness(store)
    h.session.config = h.session.config.model_copy(update={"endpoint": EndpointConfig(max_utterance_ms=1000)})
    await h.start()
    try:
        await h.wait_for(lambda: h.session.ptt_start() != "session_not_ready")
        h.mic.say(pcm48(say("hello again")))
        await h.wait_for(lambda: not h.session.ptt_active, timeout=5)
        # the event reaches the test through the store's event log, a poll later
        await h.wait_for(lambda: any(e["type"] == "error" for e in h.events), timeout=5)
        [err] = [e for e in h.events if e["type"] == "error"]
        assert err["code"] == "ptt_too_long"
        assert h.session.ptt_end() == "ptt_not_active"  # the late release is told, nothing breaks
        await h.wait_for(lambda: any(e.get("event") == "end_of_turn" for e in h.events), timeout=5)
    finally:
        await h.stop()
