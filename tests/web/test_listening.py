"""The inserted-gap measure (tests/listening.py) on synthetic receptions:
silence inserted in mid-word, a natural pause made longer, no gap, a stop
that never resumes, and the cases that trip a naive alignment."""

from __future__ import annotations

from types import SimpleNamespace

import listening as L

from client.results import BargeInMeasure

T0 = 10.0


def rx(pattern: str, tails: dict[int, float] | None = None) -> list[L.Frame]:
    """A reception from a pattern: ``S`` a frame of sound (-20 dBFS, sound to
    its end), ``_`` a silent frame; frames arrive every 20 ms from T0.
    ``tails``: frame index -> where that sound frame's sound ends, ms."""
    out = []
    for i, c in enumerate(pattern.replace(" ", "")):
        at = T0 + 0.02 * i
        out.append((at, -20.0, (tails or {}).get(i, 20.0)) if c == "S" else (at, -90.0, 0.0))
    return out


def S(n: int) -> str:
    return "S" * n


def Q(n: int) -> str:
    return "_" * n


#: a reply with natural pauses of 100 ms (at 1 s of sound) and 160 ms (at 2 s)
REPLY = Q(10) + S(50) + Q(5) + S(50) + Q(8) + S(60)
REF = rx(REPLY)


def test_silent_runs_place_each_pause_by_the_sound_before_it() -> None:
    runs = L.silent_runs(rx(Q(3) + S(4) + Q(2) + S(1) + Q(3), tails={6: 5.0}))
    assert [(r.sound_ms, r.length_ms, r.open) for r in runs] == [(80.0, 55.0, False), (100.0, 60.0, True)]
    assert abs(runs[0].start_at - (T0 + 0.02 * 6 + 0.005)) < 1e-9 and abs(runs[0].end_at - (T0 + 0.02 * 9)) < 1e-9


def test_the_same_reply_again_has_no_gap() -> None:
    heard = L.listen(rx(Q(4) + REPLY[10:]), REF)  # leading silence differs: not a run
    assert [g.inserted_ms for g in heard.gaps] == [0.0, 0.0]
    assert heard.outcome() == L.KEPT and heard.max_gap_ms == 0.0 and heard.stopped_at is None


def test_a_gap_inserted_in_mid_word_counts_whole() -> None:
    got = Q(10) + S(20) + Q(12) + S(30) + Q(5) + S(50) + Q(8) + S(60)
    heard = L.listen(rx(got), REF)
    assert heard.inserted() == [240.0]
    assert [g.reference_ms for g in heard.gaps] == [0.0, 100.0, 160.0]
    assert heard.outcome() == L.RESUMED


def test_a_gap_at_a_natural_pause_counts_what_it_added() -> None:
    got = Q(10) + S(50) + Q(20) + S(50) + Q(8) + S(60)
    heard = L.listen(rx(got), REF)
    assert heard.inserted() == [300.0]  # 400 ms of silence where the reply pauses 100 ms
    assert heard.outcome() == L.RESUMED


def test_a_stop_that_never_resumes_is_stopped_not_a_gap() -> None:
    got = Q(10) + S(50) + Q(5) + S(20) + Q(40)
    heard = L.listen(rx(got), REF)
    assert heard.gaps[0].inserted_ms == 0.0 and heard.max_gap_ms == 0.0  # the natural pause before it
    assert heard.stopped_at is not None and abs(heard.stopped_at - (T0 + 0.02 * 85)) < 1e-9
    assert heard.outcome() == L.STOPPED


def test_ending_inside_a_natural_pause_is_no_stop() -> None:
    heard = L.listen(rx(Q(10) + S(50) + Q(4)), REF)
    assert heard.open_run is not None and heard.stopped_at is None and heard.outcome() == L.KEPT


def test_small_sound_time_shifts_do_not_add_up() -> None:
    # each inserted pause brings two extra frames of codec tail and fade
    # (+40 ms of sound time); uncorrected, the third natural pause would be
    # 120 ms off, past the tolerance
    ref = rx(S(50) + Q(5) + S(50) + Q(5) + S(50) + Q(5) + S(50))
    got = (S(20) + Q(10) + S(32) + Q(5)) * 3 + S(50)
    heard = L.listen(rx(got), ref)
    assert [g.inserted_ms for g in heard.gaps] == [200.0, 0.0] * 3
    assert [g.reference_ms for g in heard.gaps] == [0.0, 100.0] * 3


def test_a_gap_just_before_a_natural_pause_leaves_that_pause_matched() -> None:
    # cut 40 ms of sound before the 100 ms pause: two runs, both near it
    got = Q(10) + S(48) + Q(10) + S(2) + Q(5) + S(50) + Q(8) + S(60)
    heard = L.listen(rx(got), REF)
    assert [g.inserted_ms for g in heard.gaps] == [200.0, 0.0, 0.0]


def test_since_leaves_out_earlier_runs_and_reference_coverage_is_told() -> None:
    got = Q(10) + S(20) + Q(12) + S(30) + Q(5) + S(50) + Q(8) + S(60)
    since = T0 + 0.02 * 60  # after the inserted gap
    heard = L.listen(rx(got), REF, since=since)
    assert heard.inserted(1.0) == [] and len(heard.gaps) == 2
    short = L.listen(rx(got), rx(Q(10) + S(50) + Q(5) + S(20)))
    assert short.beyond_reference > 0 and len(short.gaps) == 2  # the 160 ms pause is past the reference: not judged
    assert short.unjudged == 1


def test_until_cuts_the_reception() -> None:
    heard = L.listen(rx(REPLY), REF, until=T0 + 0.02 * 90)  # cut in mid-sound: no open run
    assert heard.stopped_at is None and heard.open_run is None


def test_judge_call_fills_gap_and_outcome_and_stops_at_a_newer_turn() -> None:
    got = rx(Q(10) + S(20) + Q(12) + S(30) + Q(5) + S(50) + Q(8) + S(20) + Q(30) + S(30))
    m = BargeInMeasure(label="cough", at_s=0.3, kind="noise", sent_from=T0 + 0.02 * 25)
    call = SimpleNamespace(received=got, event_times=[], barge_ins=[m], turns=[])
    [heard] = L.judge_call(call, REF)
    assert heard is not None and heard.inserted() == [240.0, 600.0] and heard.stopped_at is None
    assert m.gap_ms == 600.0 and m.outcome == L.RESUMED
    # the same reception, but a newer turn's transcript came during the final silence
    m2 = BargeInMeasure(label="speech", at_s=0.3, sent_from=T0 + 0.02 * 25)
    events = [
        (T0, {"type": "turn", "generation": 1, "transcript": "tell me a story"}),
        (T0 + 0.02 * 160, {"type": "turn", "generation": 2, "transcript": None}),
        (T0 + 0.02 * 165, {"type": "transcript", "generation": 2, "text": "hey"}),
    ]
    assert L.newer_turn_at(events) == T0 + 0.02 * 165
    [heard2] = L.judge_call(SimpleNamespace(received=got, event_times=events, barge_ins=[m2], turns=[]), REF)
    assert m2.outcome == L.STOPPED and heard2 is not None and heard2.stopped_at is not None
    # a clip sent after the newer turn began is about another reply: not judged
    late = BargeInMeasure(label="late", at_s=0.3, kind="noise", sent_from=T0 + 0.02 * 170)
    unsent = BargeInMeasure(label="unsent", at_s=0.3, kind="noise")
    m3 = BargeInMeasure(label="speech", at_s=0.3, sent_from=T0 + 0.02 * 25)
    turns = [SimpleNamespace(transcript="tell me a story")]
    call3 = SimpleNamespace(received=got, event_times=events, barge_ins=[m3, late, unsent], turns=turns)
    judged = L.judge_call(call3, REF)
    assert judged[1:] == [None, None] and late.gap_ms is None and late.outcome is None and m3.outcome == L.STOPPED


def test_judge_call_judges_a_clip_over_the_same_reply_begun_again() -> None:
    # the story, stopped by speech asking for it again; a clip over the second
    # telling inserts 200 ms in mid-word there (sound time counts from its start)
    first = Q(10) + S(50) + Q(5) + S(20) + Q(40)
    second = Q(10) + S(30) + Q(10) + S(20) + Q(5) + S(50) + Q(8) + S(30)
    got = rx(first + second)
    t_new = T0 + 0.02 * (len(first) + 2)
    events = [
        (T0, {"type": "turn", "generation": 1, "transcript": "tell me a story"}),
        (t_new, {"type": "transcript", "generation": 2, "text": "tell me a story"}),
    ]
    speech = BargeInMeasure(label="speech", at_s=0.3, sent_from=T0 + 0.02 * 70)
    cough = BargeInMeasure(label="cough", at_s=0.3, kind="noise", sent_from=T0 + 0.02 * (len(first) + 35))
    turns = [SimpleNamespace(transcript="tell me a story")]
    judged = L.judge_call(SimpleNamespace(received=got, event_times=events, barge_ins=[speech, cough], turns=turns), REF)
    assert speech.outcome == L.STOPPED
    assert cough.gap_ms == 200.0 and cough.outcome == L.RESUMED and judged[1] is not None
    # over another reply ("You said: ...") it is not judged
    events[1] = (t_new, {"type": "transcript", "generation": 2, "text": "hello there"})
    speech.gap_ms = cough.gap_ms = cough.outcome = None
    judged = L.judge_call(SimpleNamespace(received=got, event_times=events, barge_ins=[speech, cough], turns=turns), REF)
    assert judged[1] is None and cough.gap_ms is None


def test_a_replayed_word_is_taken_out_and_the_pauses_after_it_still_align() -> None:
    """A cough paused the reply 200 ms mid-word at 0.6 s of sound; it went on
    from the start of that word (120 ms back, the event says): the caller
    heard 200 ms of inserted silence, and the natural pauses after it are
    still the reference's, not gaps."""
    got = Q(10) + S(30) + Q(10) + S(6) + S(50 - 30) + Q(5) + S(50) + Q(8) + S(60)
    event_at = T0 + 0.02 * 50  # the resume's event, as the replayed sound arrives
    heard = L.listen(L.without_replays(rx(got), [(event_at, 120.0)]), REF)
    assert [round(g) for g in heard.inserted(40.0)] == [200] and heard.outcome() == L.RESUMED
    # not taken out, the replay shifts sound time by 120 ms: the natural pauses after it read as gaps
    assert len(L.listen(rx(got), REF).inserted(40.0)) > 1
    # the events that carry it
    assert L.replays_of([(1.0, {"type": "backchannel", "replayed_ms": 80}), (2.0, {"type": "false_interruption",
                         "replayed_ms": 0}), (3.0, {"type": "barge_in"})]) == [(1.0, 80.0)]
