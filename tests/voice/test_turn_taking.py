"""Turn-taking as tables of timelines on virtual time: detector events and
20 ms frames at given milliseconds in, decisions out. No audio, no clock, no
sleeps (times are plain numbers handed to the state machine)."""

from __future__ import annotations

import dataclasses
from typing import Any

import pytest

from media.bargein import DetectorEvent, DetectorEventKind
from voice.backchannel import BackchannelConfig, judge
from voice.endpointing import EndpointConfig, end_at
from voice.turn_taking import (
    AgentActivity,
    Announce,
    CancelClassification,
    ClassifyBackchannel,
    Commit,
    ConfirmEndOfTurn,
    DecodeSoFar,
    EndOfUtterance,
    JudgeEndOfTurn,
    Pause,
    PauseStands,
    PttTooLong,
    ResetDetector,
    Resume,
    SpeechWentOn,
    TurnTaking,
)

SPEAKING = AgentActivity(speaking=True, replying=True)
SILENT = AgentActivity()
OFFSET_MS = 200  # media.vad.VadConfig's default
KINDS = {k.value.removeprefix("speech_"): k for k in DetectorEventKind}
UH_HUH = {"text": "uh huh", "syllables": 2}

Row = tuple[Any, ...]


def frames(start_ms: int, end_ms: int, *, gated: bool) -> list[Row]:
    """A frame every 20 ms from ``start_ms`` to ``end_ms`` inclusive."""
    return [(t, "gated" if gated else "frame") for t in range(start_ms, end_ms + 1, 20)]


def timeline(*parts: Row | list[Row]) -> list[Row]:
    """Rows in time order; at the same ms, inputs come before the frame that
    carries them (as a frame's events come before its timers)."""
    rows = [r for p in parts for r in (p if isinstance(p, list) else [p])]
    return sorted(rows, key=lambda r: (r[0], r[1] in ("frame", "gated")))


def play(tt: TurnTaking, rows: list[Row], agent: AgentActivity = SPEAKING, *, announce: bool = False) -> list[tuple[int, Any]]:
    """Feed ``rows`` to ``tt``; (ms, decision) for every decision taken."""
    out: list[tuple[int, Any]] = []
    for t, what, *args in rows:
        at = t / 1000
        if what in KINDS:
            onset = args[0] / 1000 if args else at
            got = tt.on_event(DetectorEvent(KINDS[what], at, onset), agent)
        elif what in ("frame", "gated"):
            got = tt.on_frame(at, what == "gated", agent)
        elif what == "verdict":
            got = tt.classified(args[0], at, args[1], agent)
        elif what == "heard":
            got = tt.heard(args[0], at, args[1])
        elif what == "ptt_start":
            got = tt.ptt_start(at)
        elif what == "ptt_end":
            got = tt.ptt_end(at)
        elif what == "judged":
            got = tt.judged(args[0], at, *args[1:])
        else:
            raise ValueError(what)
        out += [(t, d) for d in got if announce or not isinstance(d, Announce)]
    return out


def norm(rows: list[tuple[int, Any]]) -> list[tuple[int, str, dict[str, Any]]]:
    """Decisions as comparable rows, times rounded to a microsecond (the
    machine adds and subtracts seconds in floating point)."""

    def r(v: Any) -> Any:
        return round(v, 6) if isinstance(v, float) else v

    return [(t, type(d).__name__, {k: r(v) for k, v in dataclasses.asdict(d).items()}) for t, d in rows]


def machine(**bc: Any) -> TurnTaking:
    # the fixed silence in one step (the two-step end of turn is tested at the end)
    return TurnTaking(BackchannelConfig(**bc), EndpointConfig(mode="silence", speculative=False), OFFSET_MS)


def committed(tt: TurnTaking, at_ms: int = 1010) -> None:
    """Put ``tt`` in the state of listening to an utterance (agent silent)."""
    play(tt, [(at_ms, "started"), (at_ms, "confirmed")], SILENT)
    assert tt.listening


# -- candidate speech, pause, resume ------------------------------------------------


def test_a_pause_on_trial_stands_once_verified_and_is_not_announced() -> None:
    tt = machine()
    got = tt.on_event(DetectorEvent(DetectorEventKind.SPEECH_STARTED, 1.01, 0.97, reason="trial"), SPEAKING)
    assert got == [Announce("speech_started"), Pause(1, trial=True)]
    assert tt.on_event(DetectorEvent(DetectorEventKind.SPEECH_VERIFIED, 1.03, 0.97), SPEAKING) == [PauseStands(1)]
    # a pause on speech at once is no trial
    other = machine()
    assert other.on_event(DetectorEvent(DetectorEventKind.SPEECH_STARTED, 1.01, 0.97), SPEAKING)[1] == Pause(1)
    # nothing paused (no candidate): a verification changes nothing
    assert machine().on_event(DetectorEvent(DetectorEventKind.SPEECH_VERIFIED, 1.03, 0.97), SPEAKING) == []



@pytest.mark.parametrize(
    ("agent", "held"), [(SPEAKING, True), (SILENT, False)], ids=["while-speaking", "while-silent"]
)
def test_a_false_interruption_pauses_then_resumes(agent: AgentActivity, held: bool) -> None:
    tt = machine()
    rows = timeline((1010, "started", 970), frames(1010, 1090, gated=True), (1110, "rejected"), frames(1110, 1200, gated=False))
    assert norm(play(tt, rows, agent, announce=True)) == norm([
        (1010, Announce("speech_started")),
        (1010, Pause(1)),
        (1110, Announce("speech_rejected")),
        # told only if the agent was held by it; playout resumes either way
        (1110, Resume("false_interruption", playout=True, held=held, report=held, paused_ms=100.0)),
    ])
    assert tt.candidate is None and not tt.paused and not tt.listening


def test_a_candidate_that_started_while_paused_does_not_resume() -> None:
    """Playout already paused by an earlier candidate: this one did not
    pause it, so its rejection leaves it as it is, and says nothing."""
    tt = machine()
    got = play(tt, [(1010, "started"), (1030, "started"), (1130, "rejected")])
    assert norm(got) == norm([(1010, Pause(1)), (1030, Pause(2)), (1130, Resume("false_interruption", False, False, False, 0))])
    assert tt.paused


# -- commit and barge-in ---------------------------------------------------------------


def test_confirmed_speech_while_the_agent_is_silent_commits_at_once() -> None:
    tt = machine()
    got = play(tt, timeline((1010, "started", 970), frames(1010, 1190, gated=True), (1210, "confirmed", 970)), SILENT)
    assert norm(got) == norm([(1010, Pause(1)), (1210, Commit(1.21, "vad", 0.97, 200.0))])
    assert tt.listening and not tt.listening_ptt and tt.candidate is None


def test_while_the_agent_speaks_speech_commits_once_longer_than_a_backchannel() -> None:
    tt = machine()
    rows = timeline((1010, "started", 970), (1210, "confirmed", 970), frames(1010, 2000, gated=True))
    got = play(tt, rows, SPEAKING)
    # 60 ms before speech_started + 47 frames > max_ms (1000 ms): the 47th frame commits
    assert norm(got) == norm([(1010, Pause(1)), (1930, Commit(1.93, "vad", 0.97, 920.0))])


@pytest.mark.parametrize("max_ms", [300, 1000])
def test_the_barge_in_moment_follows_max_ms(max_ms: int) -> None:
    tt = machine(max_ms=max_ms)
    got = play(tt, timeline((1010, "started", 970), (1210, "confirmed", 970), frames(1010, 3000, gated=True)))
    [(t, commit)] = [(t, d) for t, d in got if isinstance(d, Commit)]
    # the first frame at which 60 ms + its frames count exceed max_ms
    assert t == 1010 + ((max_ms - 60) // 20 - 1) * 20


def test_with_backchannels_off_confirmed_speech_commits_while_the_agent_speaks() -> None:
    tt = machine(enabled=False)
    got = play(tt, [(1010, "started", 970), (1210, "confirmed", 970)], SPEAKING)
    assert norm(got) == norm([(1010, Pause(1)), (1210, Commit(1.21, "vad", 0.97, 200.0))])


def test_confirmation_without_a_candidate_does_nothing() -> None:
    tt = machine()
    assert play(tt, [(1010, "confirmed"), *frames(1010, 1200, gated=True)]) == []


# -- backchannels ----------------------------------------------------------------------

SHORT = timeline(
    (1010, "started", 970), (1210, "confirmed", 970), frames(1010, 1290, gated=True),
    frames(1310, 1470, gated=False), (1490, "stopped"),
)


def test_a_short_utterance_is_classified_and_a_backchannel_resumes_after_the_wait() -> None:
    tt = machine()
    got = play(tt, timeline(SHORT, frames(1490, 2000, gated=False), (1400, "verdict", 1, UH_HUH)))
    assert norm(got) == norm([
        (1010, Pause(1)),
        # judged after 60 ms of quiet frames (decide_after_ms), before the VAD's speech_stopped at 1490
        (1350, ClassifyBackchannel(1)),
        # speech ended at 1290 (where the quiet run began): resumes 150 ms later
        (1450, Resume("backchannel", playout=True, held=True, report=True, paused_ms=440.0, verdict=UH_HUH)),
    ])
    assert tt.candidate is None and tt.backchannel_at == 1.45


def test_with_decide_after_at_the_vad_offset_it_is_judged_at_speech_stopped() -> None:
    tt = machine(decide_after_ms=OFFSET_MS, resume_after_ms=450)
    got = play(tt, timeline(SHORT, frames(1490, 2000, gated=False), (1500, "verdict", 1, UH_HUH)))
    assert norm(got) == norm([
        (1010, Pause(1)),
        (1490, ClassifyBackchannel(1)),
        # speech ended at 1290 (speech_stopped minus the VAD's 200 ms offset): resumes 450 ms later
        (1750, Resume("backchannel", playout=True, held=True, report=True, paused_ms=740.0, verdict=UH_HUH)),
    ])


@pytest.mark.parametrize("decide_after_ms", [100, OFFSET_MS])
def test_the_backchannel_length_given_to_the_classifier(decide_after_ms: int) -> None:
    tt = machine(decide_after_ms=decide_after_ms)
    play(tt, SHORT)
    assert tt.candidate is not None
    # 60 ms before speech_started, 25 frames to speech_stopped, minus the offset (early: 20 frames minus 100 ms)
    assert tt.candidate.speech_ms == 60 + 25 * 20 - OFFSET_MS and tt.candidate.ended_at == pytest.approx(1.29)


def test_a_late_verdict_resumes_at_once_and_not_inside_a_gated_frame() -> None:
    tt = machine()
    rows = timeline(SHORT, (1800, "verdict", 1, UH_HUH), frames(1810, 1850, gated=True), frames(1870, 1900, gated=False))
    got = play(tt, rows)
    assert norm(got)[-1] == norm([(1800, Resume("backchannel", True, True, True, 790.0, UH_HUH))])[0]
    tt = machine(decide_after_ms=OFFSET_MS, resume_after_ms=450)  # at speech_stopped: gated frames hold the release
    rows = timeline(SHORT, (1500, "verdict", 1, UH_HUH), frames(1490, 1850, gated=True), frames(1870, 1900, gated=False))
    [(t, _)] = [(t, d) for t, d in play(tt, rows) if isinstance(d, Resume)]
    assert t == 1870  # due at 1740, but the gate was open until then


def test_speech_after_an_early_judgement_drops_it_and_the_whole_is_judged() -> None:
    """ "uh ... huh" with a 120 ms gap: judged after 60 ms of it, then the
    gate opens again before the VAD said stopped: the judgement (and a
    verdict waiting for its release) is dropped; the whole is judged once
    it ends, from its real end."""
    tt = machine()
    rows = timeline(
        (1010, "started", 970), (1210, "confirmed", 970), frames(1010, 1290, gated=True),
        frames(1310, 1410, gated=False), (1400, "verdict", 1, UH_HUH), frames(1430, 1530, gated=True),
        frames(1550, 2000, gated=False), (1700, "verdict", 1, UH_HUH),
    )
    got = play(tt, rows)
    assert norm(got) == norm([
        (1010, Pause(1)),
        (1350, ClassifyBackchannel(1)),
        # the verdict came at 1400, due at 1440: the gate opened at 1430 first
        (1590, ClassifyBackchannel(1)),
        (1700, Resume("backchannel", playout=True, held=True, report=True, paused_ms=690.0, verdict=UH_HUH)),
    ])
    # speech ended at 1530: 60 ms lead and the 27 frames from 1010 to 1530, the gap in it included
    tt = machine()
    play(tt, rows[: next(i for i, r in enumerate(rows) if r[0] == 1630) + 1])
    assert tt.candidate is not None and tt.candidate.ended_at == pytest.approx(1.53)
    assert tt.candidate.speech_ms == 60 + 27 * 20
    # a running judgement is cancelled when the gate opens
    tt = machine()
    got = play(tt, timeline(SHORT[:-1], frames(1310, 1410, gated=False), (1430, "gated")))
    assert [type(d).__name__ for _, d in got] == ["Pause", "ClassifyBackchannel", "CancelClassification"]


def test_speech_is_no_backchannel_and_commits_on_its_verdict() -> None:
    tt = machine()
    got = play(tt, timeline(SHORT, (1500, "verdict", 1, None)))
    assert norm(got)[-1] == norm([(1500, Commit(1.5, "vad", 0.97, 490.0))])[0]
    assert tt.listening
    # the endpoint counts from the end of its speech (1290 ms): 500 ms of silence
    assert tt.endpoint_at == pytest.approx(end_at(EndpointConfig(), 1.5, 1.29)) == pytest.approx(1.79)


def test_a_real_word_heard_in_confirmed_speech_commits_at_once() -> None:
    """Interim text (issue 28, item 5): a word that is no backchannel, in a
    candidate the detector confirmed while the agent speaks, commits it then
    and there: not at max_ms (1630 ms here), not after its final."""
    tt = machine()
    rows = timeline((1010, "started", 970), (1210, "confirmed", 970), frames(1010, 2000, gated=True), (1300, "heard", 1, "Wait,"))
    assert norm(play(tt, rows)) == norm([(1010, Pause(1)), (1300, Commit(1.3, "vad", 0.97, 290.0))])


@pytest.mark.parametrize("rows", [
    # backchannel words only: the judge decides when the speech ends
    [(1300, "heard", 1, "Uh-huh.")],
    # before the detector confirmed it (its second stage, with the echo guard, still decides whether it is speech)
    [(1100, "heard", 1, "charge")],
    # another candidate's text
    [(1300, "heard", 2, "stop")],
    # nothing heard
    [(1300, "heard", 1, "")],
])
def test_text_that_commits_nothing(rows: list[Row]) -> None:
    tt = machine()
    got = play(tt, timeline((1010, "started", 970), (1210, "confirmed", 970), frames(1010, 1500, gated=True), *rows))
    assert norm(got) == norm([(1010, Pause(1))])


def test_speech_right_after_a_backchannel_is_judged_with_its_words() -> None:
    """ "yeah ... but" or "uh ... huh": speech confirmed within rejoin_ms
    of a backchannel let go is judged with that backchannel's words (the
    session joins them); it is not committed for coming soon."""
    tt = machine()
    rows = timeline(
        SHORT, frames(1490, 1760, gated=False), (1500, "verdict", 1, UH_HUH), (2010, "started", 1990), (2210, "confirmed", 1990)
    )
    got = play(tt, rows)
    assert norm(got)[-2:] == norm([
        (1500, Resume("backchannel", playout=True, held=True, report=True, paused_ms=490.0, verdict=UH_HUH)),
        (2010, Pause(2)),
    ])
    assert tt.candidate is not None and tt.candidate.joined == "uh huh"
    tt = machine(rejoin_ms=100)  # later than rejoin_ms: judged on its own
    play(tt, rows)
    assert tt.candidate is not None and tt.candidate.joined == ""
    # the agent silent: it is a turn, as any speech
    tt = machine()
    got = play(tt, rows[:-1]) + play(tt, rows[-1:], SILENT)
    assert isinstance(got[-1][1], Commit)


def test_going_on_after_a_pause_joins_the_first_word_and_cancels_its_classification() -> None:
    """ "Front ... left": the first word ended and is being classified; the
    second starts: one utterance, the classification is dropped, a late
    verdict for it changes nothing, and the whole barges in once too long."""
    tt = machine()
    rows = timeline(
        SHORT, (1590, "started", 1570), (1600, "verdict", 1, UH_HUH), (1650, "confirmed", 1570),
        frames(1490, 1570, gated=False), frames(1590, 2000, gated=True),
    )
    got = play(tt, rows)
    assert norm(got) == norm([
        (1010, Pause(1)),
        (1350, ClassifyBackchannel(1)),
        (1590, CancelClassification(1)),
        (1930, Commit(1.93, "vad", 0.97, 920.0)),  # 60 ms + 47 frames > max_ms, the pause included
    ])


def test_no_speech_after_a_short_utterance_judges_it_from_where_it_ended() -> None:
    tt = machine()
    rows = timeline(SHORT, (1590, "started", 1570), frames(1490, 1690, gated=False), (1710, "rejected"))
    got = play(tt, rows)
    assert [type(d).__name__ for _, d in got] == ["Pause", "ClassifyBackchannel", "CancelClassification", "ClassifyBackchannel"]
    assert tt.candidate is not None and tt.candidate.ended_at == pytest.approx(1.29)


@pytest.mark.parametrize(
    ("text", "speech_ms", "syllables", "verdict"),
    [
        ("uh-huh", 400, 2, {"text": "uh-huh", "syllables": 2}),
        ("", 500, 1, {"text": "", "syllables": 1}),  # heard no word: short enough
        ("", 600, 1, None),  # ... too long to be one (unrecognised_max_ms 550)
        ("okay", 600, 4, None),  # more syllables than a backchannel has
        ("tell me", 400, 2, None),
        (None, 300, 1, None),  # recognition failed: a barge-in
    ],
)
def test_the_backchannel_verdict(text: str | None, speech_ms: int, syllables: int, verdict: dict[str, Any] | None) -> None:
    assert judge(BackchannelConfig(), text, speech_ms, syllables) == verdict


# -- endpointing -----------------------------------------------------------------------


def test_the_utterance_ends_after_the_configured_silence() -> None:
    tt = machine()
    committed(tt)
    rows = timeline(frames(1030, 1990, gated=True), (2010, "stopped"), frames(2010, 3000, gated=False))
    got = play(tt, rows, SILENT, announce=True)
    # speech ended at 1810 (200 ms before speech_stopped): 500 ms of silence
    assert norm(got) == norm([(2010, Announce("speech_stopped")), (2310, Announce("end_of_turn")), (2310, EndOfUtterance(1.81))])
    assert not tt.listening


def test_speech_inside_the_wait_continues_the_same_utterance() -> None:
    tt = machine()
    committed(tt)
    rows = timeline(
        frames(1030, 1990, gated=True), (2010, "stopped"), frames(2010, 2150, gated=False),
        (2170, "started", 2150), (2230, "confirmed", 2150), frames(2170, 2990, gated=True),
        (3010, "stopped"), frames(3010, 4000, gated=False),
    )
    got = play(tt, rows, SILENT)
    assert norm(got) == norm([(3310, EndOfUtterance(2.81))])


def test_a_rejection_while_listening_keeps_counting_from_the_end_of_speech() -> None:
    tt = machine()
    committed(tt)
    rows = timeline(
        (2010, "stopped"), (2170, "started", 2150), (2250, "rejected"),
        frames(1030, 1990, gated=True), frames(2010, 3000, gated=False),
    )
    assert norm(play(tt, rows, SILENT)) == norm([(2310, EndOfUtterance(1.81))])


@pytest.mark.parametrize(
    ("ep", "stopped_at", "speech_end", "expected"),
    [
        (EndpointConfig(), 2.0, 1.8, 2.3),
        (EndpointConfig(min_delay_ms=400), 2.0, 1.8, 2.4),  # the wait after speech_stopped is at least 400 ms
        (EndpointConfig(silence_ms=4000, max_delay_ms=1000), 2.0, 1.8, 3.0),  # ... and at most 1000 ms
    ],
)
def test_the_endpoint_time(ep: EndpointConfig, stopped_at: float, speech_end: float, expected: float) -> None:
    assert end_at(ep, stopped_at, speech_end) == pytest.approx(expected)


def test_a_noisy_room_ends_the_utterance_after_max_delay_and_silence() -> None:
    tt = machine()
    committed(tt)
    got = play(tt, frames(1030, 6000, gated=True), SILENT)
    assert norm(got) == norm([(4530, EndOfUtterance(4.53))])  # 3000 + 500 ms after the last confirmed speech


def test_an_utterance_that_never_ends_is_cut_at_max_utterance_ms() -> None:
    tt = TurnTaking(BackchannelConfig(), EndpointConfig(mode="silence", speculative=False, max_utterance_ms=2000), OFFSET_MS)
    committed(tt)
    rows = timeline([(t, "confirmed") for t in range(1010, 4000, 500)], frames(1030, 4000, gated=True))
    assert norm(play(tt, rows, SILENT)) == norm([(3030, EndOfUtterance(3.03))])


# -- push-to-talk ----------------------------------------------------------------------


@pytest.mark.parametrize(("agent", "paused_ms"), [(SPEAKING, 0.0), (SILENT, 0.0)])
def test_push_to_talk_commits_at_once_ignores_the_detector_and_ends_on_release(agent: AgentActivity, paused_ms: float) -> None:
    tt = machine()
    rows = timeline(
        (1000, "ptt_start"), (1010, "started"), (1210, "confirmed"), (2010, "stopped"),
        frames(1010, 1990, gated=True), frames(2010, 4000, gated=False), (4010, "ptt_end"), (4030, "ptt_end"),
    )
    got = play(tt, rows, agent, announce=True)
    assert norm(got) == norm([
        (1000, ResetDetector()),
        (1000, Pause(1)),
        (1000, Commit(1.0, "ptt", 1.0, paused_ms, audio=False)),
        # a 2 s silence did not end it; only the release does, without a wait
        (4010, ResetDetector()),
        (4010, Announce("end_of_turn")),
        (4010, EndOfUtterance(4.01)),
    ])
    assert not tt.ptt_active and tt.ptt_start(5.0) != [] and tt.ptt_start(5.1) == []


def test_push_to_talk_takes_over_the_utterance_listened_to_and_drops_a_candidate() -> None:
    tt = machine()
    committed(tt)
    assert play(tt, [(1500, "stopped"), (1600, "ptt_start"), *frames(1610, 3000, gated=False)]) == [(1600, ResetDetector())]
    assert tt.listening and tt.endpoint_at is None
    tt = machine()
    got = play(tt, timeline(SHORT, (1500, "ptt_start")))
    assert norm(got)[-4:] == norm([
        (1500, ResetDetector()), (1500, CancelClassification(1)), (1500, Pause(2)), (1500, Commit(1.5, "ptt", 1.5, 0, audio=False)),
    ])  # playout was already paused by the dropped candidate: 0 ms, not 0.0


def test_push_to_talk_held_too_long_is_let_go() -> None:
    tt = TurnTaking(BackchannelConfig(), EndpointConfig(mode="silence", speculative=False, max_utterance_ms=1000), OFFSET_MS)
    got = play(tt, [(1000, "ptt_start"), *frames(1010, 2200, gated=True)], SILENT)
    assert norm(got)[3:] == norm([
        (2010, PttTooLong(1000)), (2010, ResetDetector()), (2010, EndOfUtterance(2.01)),
    ])
    assert not tt.ptt_active and not tt.listening


def test_a_telephone_key_commits_like_push_to_talk_with_its_own_initiator() -> None:
    tt = machine()
    got = tt.ptt_start(2.0, initiator="dtmf")
    assert got[1:] == [Pause(1), Commit(2.0, "dtmf", 2.0, 0, audio=False)]  # no audio: the keys are the input
    assert tt.ptt_active and tt.listening_ptt
    # speech meanwhile does not end it; the terminator (ptt_end) does, at once
    assert play(tt, [(2100, "started"), (2300, "confirmed"), (3000, "stopped"), *frames(3010, 5000, gated=False)]) == []
    assert tt.ptt_end(5.0)[-1] == EndOfUtterance(5.0)


# -- the end of turn in two steps: tentative, then confirmed (issue 31) ---------------


def two_step(**endpoint: Any) -> TurnTaking:
    return TurnTaking(BackchannelConfig(), EndpointConfig(**endpoint), OFFSET_MS)


#: an utterance committed at 1010 ms whose speech stops at 2000 (speech_stopped at 2200)
SPOKEN = [(1010, "started"), (1010, "confirmed"), *frames(1020, 1990, gated=True), (2200, "stopped")]


def test_the_judge_says_complete_and_the_speculative_reply_plays_then() -> None:
    tt = two_step(mode="model", speculative=True)
    got = play(tt, timeline(SPOKEN, frames(2000, 2400, gated=False), (2300, "judged", 1, True)), SILENT)
    assert norm(got)[2:] == norm([
        (2200, EndOfUtterance(2.0, tentative=True)),
        (2200, JudgeEndOfTurn(1)),
        (2300, ConfirmEndOfTurn(1, 2.3, 2.0, "model", True)),
    ])
    assert tt.waiting is None and not tt.listening


def test_incomplete_waits_for_the_longer_silence_and_a_failed_judge_for_the_fixed_one() -> None:
    tt = two_step(mode="model", speculative=True, incomplete_silence_ms=1200)
    got = play(tt, timeline(SPOKEN, frames(2000, 3400, gated=False), (2300, "judged", 1, False)), SILENT)
    assert norm(got)[-1] == norm([(3200, ConfirmEndOfTurn(1, 3.2, 2.0, "incomplete_bound", True))])[0]
    tt = two_step(mode="model", speculative=True)
    got = play(tt, timeline(SPOKEN, frames(2000, 3400, gated=False), (2300, "judged", 1, None)), SILENT)
    # failed: the fixed 500 ms from the end of speech (2000 ms) decides
    assert norm(got)[-1] == norm([(2500, ConfirmEndOfTurn(1, 2.5, 2.0, "silence", True))])[0]
    # a judge that never answers: the longer bound
    tt = two_step(mode="model", speculative=True)
    got = play(tt, timeline(SPOKEN, frames(2000, 3600, gated=False)), SILENT)
    assert norm(got)[-1] == norm([(3500, ConfirmEndOfTurn(1, 3.5, 2.0, "incomplete_bound", True))])[0]


def test_the_wait_follows_how_sure_the_two_halves_of_the_judge_are() -> None:
    """Audio and words complete: now; the audio incomplete but the words
    finished: the shorter bound (unsure_silence_ms); the words unfinished,
    whatever the audio says: the longer one (incomplete_silence_ms); words
    not known: the audio alone, as before."""
    def confirmed(*verdict: bool | None) -> tuple[int, str]:
        tt = two_step(mode="model", speculative=True, unsure_silence_ms=800, incomplete_silence_ms=1500)
        got = play(tt, timeline(SPOKEN, frames(2000, 3600, gated=False), (2300, "judged", 1, *verdict)), SILENT)
        last = got[-1][1]
        assert isinstance(last, ConfirmEndOfTurn), got
        return got[-1][0], last.by

    assert confirmed(True, True) == (2300, "model")
    assert confirmed(True, None) == (2300, "model")
    assert confirmed(False, True) == (2800, "incomplete_bound")  # 800 ms after the end of speech (2000)
    assert confirmed(True, False) == (3500, "incomplete_bound")  # "can I get a": the audio cannot overrule
    assert confirmed(False, False) == (3500, "incomplete_bound")
    assert confirmed(False, None) == (3500, "incomplete_bound")


def test_the_bounds_must_grow_with_doubt() -> None:
    with pytest.raises(ValueError, match="unsure_silence_ms"):
        EndpointConfig(unsure_silence_ms=1600, incomplete_silence_ms=1500)
    with pytest.raises(ValueError, match="unsure_silence_ms"):
        EndpointConfig(tentative_ms=300, unsure_silence_ms=250)


def test_the_decode_starts_before_speech_stopped_and_goes_stale_if_the_user_goes_on() -> None:
    """decode_at_ms (100) of quiet frames in the utterance listened to start
    its decode, before the VAD's speech_stopped (offset 200 ms); a gated
    frame after it makes it stale; a second quiet run starts another; none
    after speech_stopped (that one is the VAD's) or with it at the offset."""
    tt = two_step(mode="model", speculative=True, decode_at_ms=100)
    rows = timeline((1010, "started"), (1010, "confirmed"), frames(1020, 1990, gated=True),
                    frames(2000, 2100, gated=False), frames(2120, 2500, gated=True),  # 120 ms quiet, then more speech
                    frames(2520, 2700, gated=False), (2700, "stopped"), frames(2720, 2800, gated=False))
    got = [(t, d) for t, d in play(tt, rows, SILENT) if isinstance(d, DecodeSoFar | SpeechWentOn)]
    assert got == [(2080, DecodeSoFar(1)), (2120, SpeechWentOn(1)), (2600, DecodeSoFar(1))]
    tt = two_step(mode="model", speculative=True)  # decode_at_ms 200: the VAD's speech_stopped starts it
    got = [(t, d) for t, d in play(tt, rows, SILENT) if isinstance(d, DecodeSoFar | SpeechWentOn)]
    assert got == []


def test_going_on_before_the_end_is_confirmed_takes_it_back() -> None:
    """The user speaks again while the judge said incomplete: the new speech
    commits, the wait is forgotten, and a late verdict changes nothing."""
    tt = two_step(mode="model", speculative=True)
    rows = timeline(SPOKEN, frames(2000, 2580, gated=False), (2300, "judged", 1, False),
                    (2600, "started", 2560), (2700, "confirmed", 2560), frames(2600, 3000, gated=True),
                    (2800, "judged", 1, True))
    got = play(tt, rows, SILENT)
    kinds = [type(d).__name__ for _, d in got]
    assert kinds == ["Pause", "Commit", "EndOfUtterance", "JudgeEndOfTurn", "Pause", "Commit"]
    assert tt.waiting is None and tt.listening


def test_a_complete_verdict_waits_while_new_speech_is_a_candidate() -> None:
    """The verdict comes while a sound is a candidate: the end is confirmed
    only once it proves to be no speech (rejected)."""
    tt = two_step(mode="model", speculative=True)
    rows = timeline(SPOKEN, frames(2000, 2700, gated=False), (2250, "started", 2240), (2300, "judged", 1, True),
                    (2400, "rejected"))
    got = play(tt, rows, SILENT)
    [(t, confirm)] = [(t, d) for t, d in got if isinstance(d, ConfirmEndOfTurn)]
    assert t == 2400 and confirm.by == "model"


def test_speculation_with_the_fixed_silence() -> None:
    tt = two_step(mode="silence", speculative=True)
    got = play(tt, timeline(SPOKEN, frames(2000, 2600, gated=False)), SILENT)
    assert norm(got)[2:] == norm([
        (2200, EndOfUtterance(2.0, tentative=True)),
        (2500, ConfirmEndOfTurn(1, 2.5, 2.0, "silence", True)),
    ])


def test_the_judge_without_speculation_keeps_listening_until_it_decides() -> None:
    tt = two_step(mode="model", speculative=False)
    got = play(tt, timeline(SPOKEN, frames(2000, 2400, gated=False), (2300, "judged", 1, True)), SILENT)
    assert norm(got)[2:] == norm([
        (2200, JudgeEndOfTurn(1)),
        (2300, EndOfUtterance(2.0)),
        (2300, ConfirmEndOfTurn(1, 2.3, 2.0, "model", False)),
    ])
    # going on while it judges: the same utterance goes on; the verdict is ignored
    tt = two_step(mode="model", speculative=False)
    rows = timeline(SPOKEN, frames(2000, 2280, gated=False), (2290, "started"), (2300, "judged", 1, True),
                    frames(2300, 2400, gated=True))
    got = play(tt, rows, SILENT)
    assert [type(d).__name__ for _, d in got] == ["Pause", "Commit", "JudgeEndOfTurn"] and tt.listening


def test_push_to_talk_during_the_wait_takes_the_speculative_reply_back() -> None:
    tt = two_step(mode="model", speculative=True)
    got = play(tt, timeline(SPOKEN, frames(2000, 2280, gated=False), (2300, "ptt_start")), SILENT)
    assert [type(d).__name__ for _, d in got][-2:] == ["Pause", "Commit"] and tt.waiting is None
