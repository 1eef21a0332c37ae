"""bench/backchannels.py: the phrases it says (each phrase the asked number
of times, over three voices) and how it tells a backchannel that became a
turn from one said over silence."""

from __future__ import annotations

import random
import sys
from collections import Counter
from pathlib import Path

from conftest import requires_espeak

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "bench"))
import backchannels as B  # noqa: E402

from client.results import BargeInMeasure, CallResult  # noqa: E402


@requires_espeak
def test_each_phrase_is_said_the_asked_times_over_three_voices() -> None:
    items = B.script(4, random.Random(1))
    labels = Counter(u.label for u in items)
    assert len(items) == 4 * len(B.PHRASES)
    assert {label.split("|")[0] for label in labels} == set(B.PHRASES)
    assert {label.split("|")[1] for label in labels} == set(B.VOICES)
    for u in items:
        assert u.kind == "backchannel" and u.speech_end_s is not None
        assert 0 < u.speech_end_s < len(u.pcm) / 2 / 48_000  # the speech ends before the trailing silence


def measure(label: str, sent_from: float, *, speaking: bool, barged_in: bool = False) -> BargeInMeasure:
    return BargeInMeasure(label=label, at_s=0.5, kind="backchannel", sent_from=sent_from,
                          speaking_at_onset=speaking, barged_in=barged_in)


def test_a_turn_is_put_on_the_backchannel_said_last_before_it() -> None:
    over_agent = measure("okay|en-us", 10.0, speaking=True)
    over_silence = measure("yeah|en-us", 20.0, speaking=False)
    result = CallResult(session_id="s", turns=[], barge_ins=[over_agent, over_silence], events=[],
                        received_audio_ms=0, timed_out=False,
                        event_times=[
                            (1.0, {"type": "transcript", "role": "user", "text": "Tell me a story."}),
                            (11.0, {"type": "transcript", "role": "user", "text": "Okay."}),
                            (21.0, {"type": "transcript", "role": "user", "text": "Yeah."}),
                            (22.0, {"type": "agent.delta", "text": "yeah"}),
                        ])
    assert B.turns_after(result) == [(over_agent, "Okay."), (over_silence, "Yeah.")]
