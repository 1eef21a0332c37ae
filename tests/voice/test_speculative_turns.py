"""Speculative turns (issue 31 item 2, DESIGN.md "speculative turn"), in a
real voice session: espeak-ng speech into the session's microphone, Whisper
hearing it, the local agent answering, the paced track pulling the audio.

At the tentative end of the user's turn the reply starts (recognition
finalised, the model asked, the first clause to TTS) but nothing of it is
played or delivered, and no side effect runs, until the end is confirmed.
If the user goes on first, the speculative turn is taken back: CANCELLED
with stop reason ``speculation_withdrawn``, its words joined to the next
turn, its tokens on its own record. The store's event log and the ledger
prove what did and did not happen.

The end-of-turn judge here is scripted (:class:`ScriptedJudge`: it answers
what the test says, and records what audio it was given), so the session's
part is tested apart from the model's accuracy (tests/voice/test_end_of_turn.py,
bench/end_of_turn.py); one test runs the real Smart Turn model.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import plain, requires_espeak
from test_agent_session import Harness, pcm48
from test_honest_outcomes import RecordingModel, frames_of

from demo_shop.service import DemoService
from demo_shop.tools import demo_tools, weather_tools
from turn.delivery_gate import OUTPUT_TYPES
from turn.intents import IntentStatus
from turn.models import StopReasonKind, TurnStatus
from turn.sqlite_store import SqliteStore
from voice.endpointing import EndpointConfig
from voice.whisper_stt import WhisperStream

pytestmark = requires_espeak

#: 48 kHz s16 mono silence, per ms
MS48 = 96


@dataclass(frozen=True)
class Verdict:
    complete: bool
    probability: float
    inference_ms: float = 1.0


class ScriptedJudge:
    """An end-of-turn judge that answers from a script: ``answers`` in
    order (the last repeats); records the audio it was given (16 kHz
    bytes) and can be made slow or failing."""

    def __init__(self, *answers: bool, delay_s: float = 0.0, fail: bool = False) -> None:
        self.answers = list(answers) or [True]
        self.delay_s = delay_s
        self.fail = fail
        self.heard: list[bytes] = []

    def judge(self, pcm: bytes, rate: int = 16000) -> Verdict:
        import time

        self.heard.append(pcm)
        if self.delay_s:
            time.sleep(self.delay_s)  # it runs in a worker thread, as the real one
        if self.fail:
            raise RuntimeError("the judge broke")
        complete = self.answers[min(len(self.heard), len(self.answers)) - 1]
        return Verdict(complete, 0.9 if complete else 0.1)


def speculative(h: Harness, judge: ScriptedJudge | None, **endpoint: object) -> None:
    h.session.providers.end_of_turn = judge
    h.session.config.endpoint = EndpointConfig(mode="model", speculative=True, **endpoint)  # type: ignore[arg-type]
    h.session.config = h.session.config  # the turn-taking machine reads the new thresholds


@contextlib.asynccontextmanager
async def session(
    store: SqliteStore, judge: ScriptedJudge | None, *, shop: bool = False, **endpoint: object
) -> AsyncIterator[tuple[Harness, RecordingModel, DemoService | None]]:
    h = Harness(store)
    service = DemoService(h.clock) if shop else None
    tools = demo_tools(h.clock, service, store) if service is not None else weather_tools(h.clock, weather_latency_ms=300)
    h.manager.ledger.handlers = tools.get
    h.session.providers.tools = tools
    model = RecordingModel(h.session.providers.llm)
    h.session.providers.llm = model
    speculative(h, judge, **endpoint)
    await h.start()
    try:
        yield h, model, service
    finally:
        await h.stop()
        if service is not None:
            await service.aclose()


def completed(h: Harness, n: int = 1) -> Callable[[], bool]:
    return lambda: sum(e.get("status") == "COMPLETED" for e in h.turn_events()) >= n


async def test_a_user_who_goes_on_takes_the_speculative_reply_back(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    """ "what is the weather" + 1.4 s + "like in paris today", the judge
    calling the first half incomplete: the first half's reply starts at
    its tentative end (its model request and read-only lookup run), then
    is taken back when the user goes on: CANCELLED, speculation_withdrawn,
    merged into the whole; nothing of it was played or delivered; its
    output is in the log, fenced; its tokens are on its own record."""
    judge = ScriptedJudge(False, True)
    # "what is the weather" sounds finished: the default bound for that would end the pause; and
    # the pause is long enough for its words to be in (its reply asks the model) on a loaded machine
    async with session(store, judge, unsure_silence_ms=3000, incomplete_silence_ms=3000) as (h, model, _):
        h.mic.say(pcm48(say("what is the weather")) + bytes(MS48 * 1400) + pcm48(say("like in paris today")))
        await h.wait_for(completed(h), timeout=40)
        first, whole = await store.list_session("sess-1")
        assert first.status is TurnStatus.CANCELLED and first.stop_reason is not None
        assert first.stop_reason.kind is StopReasonKind.SPECULATION_WITHDRAWN
        assert first.merged_into == whole.id and plain(whole.transcript) == "what is the weather like in paris today"
        # it did start: its model request was made (and billed to it)
        assert model.requests_for(first.transcript or "-"), "the speculative reply never asked the model"
        assert first.usage.prompt_tokens + first.usage.completion_tokens > 0 and first.usage.model_requests >= 1
        # ... and nothing of it reached the client: no output, no audio
        delivered = [e for e in h.events if e.get("turn_id") == first.id]
        assert not [e for e in delivered if e["type"] in OUTPUT_TYPES or e["type"] in ("agent.state", "tool.started")]
        assert frames_of(h, first.generation) == 0
        logged = await store.read_events("sess-1", 0, 100_000)
        held = [e for e in logged if e.turn_id == first.id and e.type in OUTPUT_TYPES]
        assert held and all(e.fenced for e in held)  # the audit trail: made, logged, withheld
        # the client was told how the end was decided, both times
        ends = [e for e in h.events if e["type"] == "end_of_turn"]
        assert [(e["turn_id"], e["outcome"], e["by"]) for e in ends] == [
            (first.id, "withdrawn", "user_went_on"), (whole.id, "confirmed", "model")
        ]
        # a read may run before the end is confirmed (it changes nothing
        # outside): done or abandoned, whichever the withdrawal found; the
        # history holds the whole request once
        [read] = await store.ledger_list(first.id)
        assert read.tool == "lookup_weather" and read.effect == "none"
        assert read.status in (IntentStatus.DONE, IntentStatus.ABANDONED)
        assert [m.content for m in await h.session.history() if m.role == "user"] == [whole.transcript]
        # the judge read the user's audio (16 kHz, at least half a second of each part)
        assert len(judge.heard) == 2 and min(map(len, judge.heard)) > 16_000


async def test_a_side_effect_waits_for_the_end_of_turn_and_never_runs_if_taken_back(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    """ "please order a coffee" + pause + "make it a large one": the first
    half's model asks for create_order at once, but a side effect waits for
    the confirmed end; the user goes on, so it never runs: no ledger row,
    no order in the shop. The whole request places exactly one order."""
    judge = ScriptedJudge(False, True)
    # "please order a coffee" sounds finished: the bound for that (800 ms) would end the pause
    async with session(store, judge, shop=True, unsure_silence_ms=1500) as (h, model, service):
        assert service is not None
        h.mic.say(pcm48(say("please order a coffee")) + bytes(MS48 * 800) + pcm48(say("make it a large one")))
        await h.wait_for(completed(h), timeout=40)
        first, whole = await store.list_session("sess-1")
        assert first.stop_reason is not None and first.stop_reason.kind is StopReasonKind.SPECULATION_WITHDRAWN
        assert await store.ledger_list(first.id) == []  # nothing was even written: it never began
        assert not (await service.applied(first.id))
        placed = await service.applied()
        assert len(placed) == 1 and all(k.startswith(whole.id) for k in placed)


async def test_a_confirmed_speculative_reply_plays_with_everything_it_held(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    """The judge says complete: the speculative reply is confirmed and
    plays; what it held (transcript, state, deltas) is delivered in order
    before what follows, and its audio plays from its first frame."""
    judge = ScriptedJudge(True)
    # the judge waits for the words: on a loaded machine they may take longer than the bounds
    async with session(store, judge, unsure_silence_ms=10_000, incomplete_silence_ms=10_000) as (h, _, _):
        h.mic.say(pcm48(say("please count to twenty")))
        await h.wait_for(completed(h), timeout=40)
        [turn] = await store.list_session("sess-1")
        assert turn.status is TurnStatus.COMPLETED and (turn.reply or "").startswith("One, two, three")
        [end] = [e for e in h.events if e["type"] == "end_of_turn"]
        assert end["outcome"] == "confirmed" and end["by"] == "model" and end["speculative"] is True, end
        assert end["probability"] == 0.9 and end["wait_ms"] < 10_000  # a sanity bound
        mine = [e for e in h.events if e.get("turn_id") == turn.id and e["type"] in ("transcript", "agent.delta", "agent.done")]
        assert mine[0]["type"] == "transcript" and mine[-1]["type"] == "agent.done"
        assert "".join(e["text"] for e in mine if e["type"] == "agent.delta").startswith("One, two, three")
        assert frames_of(h, turn.generation) > 50


@pytest.mark.parametrize(("said", "bound_ms"), [("please count to twenty", 800), ("what is the weather in", 1200)])
async def test_an_incomplete_verdict_waits_for_a_longer_silence(
    store: SqliteStore, say: Callable[..., Path], said: str, bound_ms: int
) -> None:
    """The audio judge says incomplete and the user says no more: the end
    is confirmed by a longer silence after the end of speech, and the reply
    plays then, not before: unsure_silence_ms when the words heard sound
    finished, incomplete_silence_ms when they end on "in"."""
    judge = ScriptedJudge(False)
    async with session(store, judge, unsure_silence_ms=800, incomplete_silence_ms=1200) as (h, _, _):
        h.mic.say(pcm48(say(said)))
        await h.wait_for(completed(h), timeout=40)
        [end] = [e for e in h.events if e["type"] == "end_of_turn"]
        assert end["by"] == "incomplete_bound" and end["words_complete"] is (bound_ms == 800)
        assert bound_ms - 50 <= end["wait_ms"] < bound_ms + 1000, end


async def test_a_judge_that_fails_leaves_the_fixed_silence_to_decide(store: SqliteStore, say: Callable[..., Path]) -> None:
    async with session(store, ScriptedJudge(fail=True)) as (h, _, _):
        h.mic.say(pcm48(say("please count to twenty")))
        await h.wait_for(completed(h), timeout=40)
        [end] = [e for e in h.events if e["type"] == "end_of_turn"]
        assert end["by"] == "silence" and end["probability"] is None
        assert 450 <= end["wait_ms"] < 1500


async def test_with_no_judge_the_fixed_silence_decides(store: SqliteStore, say: Callable[..., Path]) -> None:
    async with session(store, None) as (h, _, _):
        h.mic.say(pcm48(say("please count to twenty")))
        await h.wait_for(completed(h), timeout=40)
        [end] = [e for e in h.events if e["type"] == "end_of_turn"]
        assert end["by"] == "silence" and end["speculative"] is True


async def test_speculation_starts_the_reply_at_the_tentative_end(store: SqliteStore, say: Callable[..., Path]) -> None:
    """Server side: a speculative reply starts (its utterance ends, the
    model is asked) at the tentative end, about 200 ms after the end of
    speech, where the fixed silence waits 500 ms; its first frame is played
    no later. Generous sanity bounds: the figures are bench/latency.py's
    (how much sooner the audio comes depends on how long recognition takes,
    which the fixed silence overlaps too)."""
    starts: dict[str, float] = {}
    firsts: dict[str, float] = {}
    for name, endpoint in (
        ("silence", EndpointConfig(mode="silence", speculative=False)), ("speculative", EndpointConfig(mode="model", speculative=True))
    ):
        h = Harness(store)
        h.session.providers.end_of_turn = ScriptedJudge(True)
        h.session.config.endpoint = endpoint
        h.session.config = h.session.config
        await h.start()
        try:
            h.mic.say(pcm48(say("please count to twenty")))
            await h.wait_for(lambda h=h: bool(h.track.audit.per_generation), timeout=40)  # type: ignore[misc]
            first_frame = min(a.first_sent_at for a in h.track.audit.per_generation.values() if a.first_sent_at is not None)
            [run] = [r for r in h.session._runs if r.speech_end_at is not None]
            assert run.stt_started_at is not None and run.speech_end_at is not None
            starts[name] = run.stt_started_at - run.speech_end_at
            firsts[name] = first_frame - run.speech_end_at
            await h.wait_for(completed(h), timeout=40)
        finally:
            await h.stop()
    assert starts["speculative"] < 0.3 <= 0.45 <= starts["silence"], starts
    assert firsts["speculative"] <= firsts["silence"] + 0.2, firsts


async def test_the_decode_starts_at_decode_at_ms_before_speech_stopped(
    store: SqliteStore, say: Callable[..., Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    """decode_at_ms = 100: the recogniser starts decoding the utterance
    after 100 ms of quiet, about 100 ms before the VAD's speech_stopped
    (offset 200 ms), and the turn is heard whole from that decode."""
    started: list[float] = []
    real = WhisperStream.decode_so_far

    async def spy(self: WhisperStream) -> str:
        started.append(time.time())
        return await real(self)

    monkeypatch.setattr(WhisperStream, "decode_so_far", spy)
    async with session(store, ScriptedJudge(True), decode_at_ms=100) as (h, _, _):
        h.mic.say(pcm48(say("please count to twenty")))
        await h.wait_for(completed(h), timeout=40)
        stopped = [e["at"] for e in h.events if e["type"] == "vad" and e["event"] == "speech_stopped"]
        [heard] = [e["text"] for e in h.events if e["type"] == "transcript"]
    assert started and stopped, (started, stopped)
    # the last decode began well before the last speech_stopped (a generous bound: frames come in bursts)
    assert 0.03 <= stopped[-1] - started[-1] <= 0.3, (started, stopped)
    assert "count to" in plain(heard), heard


async def test_real_smart_turn_judges_in_a_session(store: SqliteStore, say: Callable[..., Path]) -> None:
    """The packaged Smart Turn model, in a session: it answers (a
    probability and its time on the end_of_turn event) and the turn
    completes either way."""
    from voice.end_of_turn import shared_judge

    async with session(store, None) as (h, _, _):
        h.session.providers.end_of_turn = shared_judge()
        h.mic.say(pcm48(say("can you repeat that please")))
        await h.wait_for(completed(h), timeout=40)
        [end] = [e for e in h.events if e["type"] == "end_of_turn"]
        assert end["probability"] is not None and 0 <= end["probability"] <= 1
        assert end["judge_ms"] is not None and end["judge_ms"] < 2000


@pytest.mark.parametrize("mode", ["silence", "model"])
def test_the_tentative_end_comes_first(mode: str) -> None:
    with pytest.raises(ValueError):
        EndpointConfig(mode=mode, tentative_ms=600, silence_ms=500)  # type: ignore[arg-type]


async def test_concurrent_turns_do_not_leak_speculation(store: SqliteStore, say: Callable[..., Path]) -> None:
    """Two requests one after the other, the first taken back and the
    second confirmed: after them the session holds nothing speculative."""
    judge = ScriptedJudge(False, True)
    async with session(store, judge) as (h, _, _):
        h.mic.say(pcm48(say("what is the weather")) + bytes(MS48 * 700) + pcm48(say("like in paris today")))
        await h.wait_for(completed(h), timeout=40)
        await asyncio.sleep(0.3)
        assert h.session._speculating is None and h.session.turn_taking.waiting is None
        assert all(r.confirmed.is_set() or r.withdrawn for r in h.session._runs if r.utterance_ended.is_set())
