"""bench/latency.py's figures on made-up calls: what counts as a false
cut-off, a split request, a voice-to-voice time and a taken-back turn; its
session plan; its settings per mode; and the bad input it refuses. The
bench against a real server is tests/e2e/test_latency_bench.py."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import latency as L  # noqa: E402
import turn_corpus as T  # noqa: E402

from client.results import CallResult, RequestMeasure, TurnView  # noqa: E402

RATE = 48000
LOUD, QUIET = -20.0, -90.0


def rendered(kind: T.TurnKind = "mid_pause", speech_end_s: float = 2.0, pause: tuple[float, float] = (0.8, 1.4)) -> T.RenderedRequest:
    """A request as the corpus renders it (no audio needed here)."""
    parts = ("i'd like to order", "a large coffee") if kind == "mid_pause" else ("yes",)
    req = T.TurnRequest(f"{kind}-x-en-us-175", kind, "en-us", 175, parts, 600 if kind == "mid_pause" else 0)
    return T.RenderedRequest(req, bytes(int(speech_end_s * RATE) * 2), RATE, speech_end_s,
                             (pause,) if kind == "mid_pause" else ())


def sent_request(speech_end_s: float = 2.0, first_reply_at: float | None = None, before_end: bool = False) -> RequestMeasure:
    """Sent from 10.0 s, a frame every 20 ms."""
    n = int(speech_end_s * 50) + 1
    return RequestMeasure("r", frames_sent=[10.0 + 0.02 * i for i in range(n)], speech_end_sample=int(speech_end_s * RATE),
                          first_reply_at=first_reply_at, sound_before_end=before_end, waited_until=20.0)


def turn_events(turn_id: str, at: float, *, status: str = "COMPLETED", stop: str | None = None, delta: bool = True,
                audio: bool = True, effect_tool: bool = False) -> list[tuple[float, dict[str, Any]]]:
    out: list[tuple[float, dict[str, Any]]] = [(at, {"type": "turn", "turn_id": turn_id, "status": "RUNNING"})]
    if effect_tool:
        out.append((at + 0.1, {"type": "tool.started", "turn_id": turn_id, "effect": "complete"}))
    if delta:
        out.append((at + 0.2, {"type": "agent.delta", "turn_id": turn_id, "text": "You "}))
    if audio:
        out.append((at + 0.3, {"type": "audio.start", "turn_id": turn_id, "sample": 0}))
    out.append((at + 0.4, {"type": "turn", "turn_id": turn_id, "status": status,
                           "stop_reason": None if stop is None else {"kind": stop}}))
    return out


def call(events: list[tuple[float, dict[str, Any]]], received: list[tuple[float, float, float]],
         turns: dict[str, tuple[str, str | None, str | None]]) -> CallResult:
    """``turns``: id -> (status, stop reason kind, transcript)."""
    events = sorted(events, key=lambda e: e[0])
    views = [TurnView(id=t, generation=i, status=st, stop_reason=stop, transcript=tr)
             for i, (t, (st, stop, tr)) in enumerate(turns.items())]
    return CallResult(session_id="s", turns=views, barge_ins=[], events=[e for _, e in events], received_audio_ms=0,
                      timed_out=False, received=received, event_times=events)


def test_an_answer_after_the_end_is_voice_to_voice_and_no_cut_off() -> None:
    m = sent_request(first_reply_at=13.5)  # speech ends in the frame sent at 11.98
    result = call(turn_events("t1", 10.2), [(13.5, LOUD, 20.0)], {"t1": ("COMPLETED", None, "i'd like to order a large coffee")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["voice_to_voice_ms"] == pytest.approx(1520.0, abs=0.1)
    assert row["cut_off"] is False and not row["split"] and row["turns"] == 1 and row["replied"]


def test_sound_in_the_pause_is_a_cut_off_without_voice_to_voice() -> None:
    m = sent_request(first_reply_at=13.5, before_end=True)
    received = [(10.9, QUIET, 0.0), (11.2, LOUD, 20.0), (13.5, LOUD, 20.0)]  # the pause is sent from 10.8 to 11.4
    result = call(turn_events("t1", 10.2), received, {"t1": ("COMPLETED", None, "i'd like to order")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["cut_off"] and row["heard_in_pause"] and row["talked_over"]
    assert row["voice_to_voice_ms"] is None


def test_sound_before_the_pause_is_no_cut_off_in_the_pause() -> None:
    # the previous reply's tail at 10.1 (before the pause) is not the agent answering the first part
    m = sent_request(first_reply_at=13.5, before_end=True)
    result = call(turn_events("t1", 10.2), [(10.1, LOUD, 20.0), (13.5, LOUD, 20.0)], {"t1": ("COMPLETED", None, "x")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["heard_in_pause"] is False and row["cut_off"] is False and row["talked_over"]


def test_a_reply_to_the_first_part_heard_later_is_a_cut_off() -> None:
    m = sent_request(first_reply_at=12.5)
    events = turn_events("a", 10.2, effect_tool=True) + turn_events("b", 11.5)
    result = call(events, [(12.5, LOUD, 20.0)], {"a": ("COMPLETED", None, "i'd like to order"), "b": ("COMPLETED", None, "a large coffee")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["split"] and row["first_part_reply_heard"] and row["cut_off"] and not row["heard_in_pause"]
    assert row["effects_partial"] == 1 and row["voice_to_voice_ms"] is None and row["turns"] == 2


def test_a_first_part_acted_on_but_never_heard_is_a_split_not_a_cut_off() -> None:
    m = sent_request(first_reply_at=13.0)
    events = turn_events("a", 10.2, status="CANCELLED", stop="barge_in", audio=False) + turn_events("b", 11.5)
    result = call(events, [(13.0, LOUD, 20.0)],
                  {"a": ("CANCELLED", "barge_in", "i'd like to order"), "b": ("COMPLETED", None, "a large coffee")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["split"] and row["first_part_acted"] and not row["cut_off"]
    assert row["voice_to_voice_ms"] == pytest.approx(1020.0, abs=0.1)


def test_a_first_part_acted_on_then_merged_into_the_last_turn_is_no_split() -> None:
    m = sent_request(first_reply_at=13.0)
    events = turn_events("a", 10.2, status="CANCELLED", stop="barge_in", audio=False) + turn_events("b", 11.5)
    result = call(events, [(13.0, LOUD, 20.0)],
                  {"a": ("CANCELLED", "barge_in", "I'd like to order..."),
                   "b": ("COMPLETED", None, "I'd like to order... A large coffee.")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["first_part_acted"] and not row["split"] and not row["cut_off"]


def test_carried_words_are_compared_without_case_or_punctuation() -> None:
    assert L.carried_into("Can you tell me?", "can you tell me the weather in Paris.")
    assert L.carried_into(None, "anything") and L.carried_into("", "anything")
    assert not L.carried_into("I would like to pay with...", "My card.")
    assert not L.carried_into("my order number is", "my order")


def test_a_turn_merged_into_the_next_before_it_replied_is_no_split() -> None:
    m = sent_request(first_reply_at=13.0)
    events = turn_events("a", 10.2, status="CANCELLED", stop="barge_in", delta=False, audio=False) + turn_events("b", 11.5)
    result = call(events, [(13.0, LOUD, 20.0)],
                  {"a": ("CANCELLED", "barge_in", None), "b": ("COMPLETED", None, "i'd like to order a large coffee")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert not row["split"] and not row["first_part_acted"] and row["turns"] == 2
    assert row["transcripts"] == [None, "i'd like to order a large coffee"]


def test_a_taken_back_speculative_turn_is_counted_apart() -> None:
    m = sent_request(first_reply_at=13.0)
    events = turn_events("spec", 11.0, status="CANCELLED", stop=L.WITHDRAWN, delta=False, audio=False, effect_tool=True)
    events += turn_events("b", 11.5)
    result = call(events, [(13.0, LOUD, 20.0)], {"spec": ("CANCELLED", L.WITHDRAWN, None), "b": ("COMPLETED", None, "x")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["withdrawn"] == ["spec"] and row["turns"] == 1 and not row["split"] and not row["first_part_acted"]
    assert row["effects_withdrawn"] == 1 and row["effects_partial"] == 0


def test_turns_after_the_window_belong_to_the_next_request() -> None:
    m = sent_request(first_reply_at=13.0)
    events = turn_events("mine", 10.2) + turn_events("next", 20.5)
    result = call(events, [(13.0, LOUD, 20.0)], {"mine": ("COMPLETED", None, "x"), "next": ("COMPLETED", None, "y")})
    row = L.judge(rendered(), m, result, until=20.0)
    assert row["turns"] == 1 and row["transcripts"] == ["x"]


def test_no_sound_at_all_is_no_reply_and_other_kinds_have_no_cut_off_figure() -> None:
    m = sent_request(speech_end_s=0.5)
    result = call(turn_events("t", 10.2, delta=False, audio=False), [], {"t": ("FAILED", None, "")})
    row = L.judge(rendered("one_word", speech_end_s=0.5), m, result, until=20.0)
    assert not row["replied"] and row["voice_to_voice_ms"] is None and row["cut_off"] is None


def test_summary_counts_cut_offs_speculation_and_tokens() -> None:
    base = {"replied": True, "talked_over": False, "heard_in_pause": False, "first_part_reply_heard": False, "split": False,
            "first_part_acted": False,
            "withdrawn": [], "effects_partial": 0, "effects_withdrawn": 0, "no_turn": False, "reply_timed_out": False}
    rows = [
        {**base, "kind": "complete", "voice_to_voice_ms": 400.0, "cut_off": None},
        {**base, "kind": "mid_pause", "voice_to_voice_ms": None, "cut_off": True, "heard_in_pause": True, "talked_over": True,
         "first_part_acted": True, "split": True, "effects_partial": 1},
        {**base, "kind": "mid_pause", "voice_to_voice_ms": 600.0, "cut_off": False, "withdrawn": ["w1", "w2"], "first_part_acted": True},
        {**base, "kind": "one_word", "voice_to_voice_ms": None, "cut_off": None, "replied": False},
    ]
    usage = {"turns": 2, "prompt_tokens": 100, "completion_tokens": 6, "total": 106, "unread": []}
    s = L.summarise(rows, 1, {"confirmed": 3.0, "withdrawn": 2.0}, usage, [])
    assert s["false_cut_offs"] == {"k": 1, "n": 2, "share": 0.5, "heard_in_pause": 1, "first_part_reply_heard": 0}
    assert s["split_requests"] == {"k": 1, "n": 2, "first_part_acted": 2, "effects_started_by_partial_turns": 1}
    assert s["talked_over"] == 1
    assert s["voice_to_voice_ms"]["n"] == 2 and s["voice_to_voice_ms"]["p50"] == 500.0
    assert s["voice_to_voice_ms_by_kind"]["one_word"]["n"] == 0 and s["no_reply"] == 1 and s["no_reply_by_kind"]["one_word"] == 1
    spec = s["speculative"]
    assert spec["started"] == 5 and spec["started_per_turn"] == 1.25 and spec["withdrawn_per_turn"] == 0.5
    assert spec["counter_present"] and spec["withdrawn_seen_by_calls"] == 2
    assert s["withdrawn_tokens"]["total"] == 106 and s["withdrawn_tokens"]["per_turn"] == 26.5


def test_a_server_without_the_counter_reports_none_started() -> None:
    s = L.summarise([], 1, None, {"turns": 0, "prompt_tokens": 0, "completion_tokens": 0, "total": 0, "unread": []}, [])
    assert s["speculative"]["counter_present"] is False and s["speculative"]["started"] == 0
    assert s["false_cut_offs"]["share"] is None and s["voice_to_voice_ms"]["p50"] is None


def test_the_counter_is_read_by_outcome() -> None:
    text = "\n".join([
        "# HELP turnkeeper_speculative_turns_total Speculative turns",
        "# TYPE turnkeeper_speculative_turns_total counter",
        'turnkeeper_speculative_turns_total{outcome="confirmed"} 7.0',
        'turnkeeper_speculative_turns_total{outcome="withdrawn",transport="webrtc"} 2.0',
        'turnkeeper_speculative_turns_total{outcome="withdrawn",transport="twilio"} 1.0',
        'turnkeeper_speculative_turns_created{outcome="confirmed"} 1.7e9',
        'turnkeeper_speculative_turns_totalx{outcome="confirmed"} 99',
    ])
    assert L.metric_values(text, L.SPECULATIVE_COUNTER, "outcome") == {"confirmed": 7.0, "withdrawn": 3.0}
    assert L.metric_values("", L.SPECULATIVE_COUNTER, "outcome") == {}


def test_each_mode_has_its_settings() -> None:
    assert L.mode_env("silence") == {"TURNKEEPER_SESSION__ENDPOINT__MODE": "silence", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "false"}
    assert L.mode_env("model") == {"TURNKEEPER_SESSION__ENDPOINT__MODE": "model", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "true"}
    assert L.mode_env("speculative") == {
        "TURNKEEPER_SESSION__ENDPOINT__MODE": "silence", "TURNKEEPER_SESSION__ENDPOINT__SPECULATIVE": "true"
    }
    # the variants of the defaults differ from them in one setting each
    assert L.mode_env("model-one-bound") == {**L.mode_env("model"), "TURNKEEPER_SESSION__ENDPOINT__UNSURE_SILENCE_MS": "1500"}
    assert L.mode_env("model-decode-100") == {**L.mode_env("model"), "TURNKEEPER_SESSION__ENDPOINT__DECODE_AT_MS": "100"}
    for mode in L.MODES:  # and the server takes each of them
        L.EndpointConfig(**{k.removeprefix("TURNKEEPER_SESSION__ENDPOINT__").lower(): v for k, v in L.mode_env(mode).items()})
    with pytest.raises(ValueError, match="unknown endpointing mode 'vad'"):
        L.mode_env("vad")


def test_a_server_without_the_mode_setting_runs_only_silence(monkeypatch: pytest.MonkeyPatch) -> None:
    fields = {k: v for k, v in L.EndpointConfig.model_fields.items() if k not in ("mode", "speculative")}
    monkeypatch.setattr(L, "EndpointConfig", type("Old", (), {"model_fields": fields}))
    assert L.mode_env("silence") == {} and L.mode_env("model") is None


def test_the_plan_covers_the_corpus_once_with_kinds_mixed() -> None:
    corpus = T.corpus()
    sessions = L.plan(corpus, None, 6)
    said = [r for s in sessions for r in s]
    assert sorted(r.name for r in said) == sorted(r.name for r in corpus)
    assert len(sessions) == -(-len(corpus) // 6) and all(len(s) == 6 for s in sessions[:-1])
    assert [r.kind for r in sessions[0][:4]] == list(T.KINDS)


def test_a_plan_of_more_sessions_deals_the_corpus_again() -> None:
    quick = T.corpus(quick=True)
    sessions = L.plan(quick, 5, 4)
    assert len(sessions) == 5 and all(len(s) == 4 for s in sessions)
    assert [r.name for r in sessions[3]] == [r.name for r in L.interleave(quick)[:4]]  # 12 used, then again from the start
    assert [r.kind for r in L.plan(quick, 1, 2)[0]] == ["complete", "mid_pause"]


@pytest.mark.parametrize("sessions, per_session", [(0, 6), (2, 0), (-1, 3)])
def test_a_plan_refuses_no_sessions_or_no_requests(sessions: int, per_session: int) -> None:
    with pytest.raises(ValueError, match="at least 1"):
        L.plan(T.corpus(quick=True), sessions, per_session)
    with pytest.raises(ValueError, match="no requests"):
        L.plan([], 1, 1)


def test_the_client_is_given_the_corpus_at_its_own_rate() -> None:
    u = L.utterance(rendered())
    assert u.speech_end_s == 2.0 and u.kind == "mid_pause" and u.label == "mid_pause-x-en-us-175"
    r16 = T.RenderedRequest(rendered().request, bytes(3200), 16000, 0.1, ())
    with pytest.raises(ValueError, match="48000 Hz"):
        L.utterance(r16)


@pytest.mark.parametrize("argv, message", [
    (["--modes", "vad"], "unknown mode vad"),
    (["--modes", "silence,silence"], "a mode named twice"),
    (["--modes", ","], "name at least one mode"),
    (["--sessions", "0"], "must be at least 1, not 0"),
    (["--per-session", "two"], "not an integer: 'two'"),
])
def test_bad_arguments_are_refused_clearly(argv: list[str], message: str, capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exc:
        L.parser().parse_args(argv)
    assert exc.value.code == 2 and message in capsys.readouterr().err


def test_the_arguments_default_to_every_mode_over_the_whole_corpus() -> None:
    args = L.parser().parse_args([])
    assert args == argparse.Namespace(sessions=None, per_session=L.PER_SESSION, quick=False, modes=["silence", "speculative", "model"],
                                      logs=None, json=False)
    assert L.parser().parse_args(["--modes", " model , silence"]).modes == ["model", "silence"]


def test_the_table_shows_measured_modes_side_by_side_and_says_why_one_is_not() -> None:
    usage = {"turns": 0, "prompt_tokens": 0, "completion_tokens": 0, "total": 0, "unread": []}
    row = {"kind": "complete", "replied": True, "talked_over": False, "voice_to_voice_ms": 1450.0, "cut_off": None,
           "heard_in_pause": None, "first_part_reply_heard": None, "split": False, "first_part_acted": False,
           "withdrawn": [], "effects_partial": 0,
           "effects_withdrawn": 0, "no_turn": False, "reply_timed_out": False}
    silence = {**L.summarise([row], 1, None, usage, []), "load_avg_before": [1.0, 1.0, 1.0], "load_avg_after": [2.0, 1.0, 1.0]}
    text = L.table({"modes": {"silence": silence, "model": {"available": False, "error": "server exited with 1: bad setting"}},
                    "requests_said": 1, "sessions": 1, "corpus": {"requests": 12, "quick": True}})
    assert "1450 / 1450 / 1450 / 1450" in text and "0 of 0 (-)" in text and "(no counter)" in text
    assert "model: not measured: server exited with 1: bad setting" in text


async def test_a_mode_the_server_refuses_is_reported_not_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    # a server that does not know a setting exits at startup: the mode is reported with the server's reason
    monkeypatch.setattr(L, "mode_env", lambda mode: {"TURNKEEPER_SESSION__ENDPOINT__NO_SUCH_SETTING": "1"})
    out = await L.bench_mode("model", [], tmp_path, quiet=True)
    assert out["available"] is False
    assert "server exited" in out["error"] and "TURNKEEPER_SESSION__ENDPOINT__NO_SUCH_SETTING" in out["error"]
    assert "model" in L.table({"modes": {"model": out}, "requests_said": 0, "sessions": 0, "corpus": {"requests": 0, "quick": False}})
