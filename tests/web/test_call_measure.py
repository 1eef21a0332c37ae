"""How the call client measures the audible stop, on synthetic timelines."""

from __future__ import annotations

import numpy as np

from client.call import CallClient, sound_end_ms
from client.results import BargeInMeasure


def test_sound_end_ms() -> None:
    f = np.zeros(960, dtype="<i2")
    assert sound_end_ms(f.tobytes()) == 0.0
    f[:300] = 8000  # 6.25 ms of sound, ends inside the third 2.5 ms window
    assert sound_end_ms(f.tobytes()) == 7.5
    f[:] = 8000
    assert sound_end_ms(f.tobytes()) == 20.0


def timeline(sounds: list[tuple[float, float]]) -> list[tuple[float, float, float]]:
    """(dBFS, tail ms) per frame, arriving every 20 ms from t=10.0 s."""
    return [(10.0 + 0.02 * i, lv, tail) for i, (lv, tail) in enumerate(sounds)]


def measure(rx: list[tuple[float, float, float]], onset: float) -> BargeInMeasure:
    c = CallClient("http://127.0.0.1:1")
    c._received = rx
    c._onset_sent[2] = onset
    m = BargeInMeasure(label="b", at_s=1.0, sent_from=onset - 0.1, sent_until=onset + 0.5)
    c._event_times.append((onset + 0.05, {"type": "barge_in", "onset_to_fence_ms": 40.0}))
    c._event_times.append((onset + 5.0, {"type": "barge_in", "onset_to_fence_ms": 99.0}))  # another clip's
    c._measure([m])
    return m


def test_stop_counts_to_where_the_sound_ends() -> None:
    loud, quiet = (-20.0, 20.0), (-90.0, 0.0)
    rx = timeline([loud] * 10 + [(-35.0, 6.5)] + [quiet] * 40)
    m = measure(rx, onset=10.0 + 0.02 * 3)
    assert m.speaking_at_onset
    # last sound frame arrives at index 10 (10.2 s) and its sound ends 6.5 ms in
    assert m.stop_ms is not None and abs(m.stop_ms - (200 - 60 + 6.5)) < 1e-6
    assert m.server_onset_to_fence_ms == 40.0 and m.barged_in and m.resumed is None


def test_a_clip_that_only_paused_the_agent_is_scored_as_resumed() -> None:
    c = CallClient("http://127.0.0.1:1")
    m = BargeInMeasure(label="cough", at_s=1.0, kind="noise", sent_from=10.0, sent_until=10.4)
    c._event_times.append((10.9, {"type": "false_interruption", "paused_ms": 600.0}))
    c._measure([m])
    assert not m.barged_in and m.resumed == "false_interruption"


def test_pause_shorter_than_the_silent_run_is_not_a_stop() -> None:
    loud, quiet = (-20.0, 20.0), (-90.0, 0.0)
    rx = timeline([loud] * 5 + [quiet] * 10 + [loud] * 5 + [quiet] * 30)
    m = measure(rx, onset=10.0)
    assert m.stop_ms is not None and abs(m.stop_ms - 400) < 1e-6  # the 200 ms pause did not count


def test_agent_already_silent_at_onset() -> None:
    quiet = (-90.0, 0.0)
    m = measure(timeline([quiet] * 40), onset=10.1)
    assert not m.speaking_at_onset
    assert m.stop_ms == 0.0


def test_no_long_silence_means_unmeasured() -> None:
    m = measure(timeline([(-20.0, 20.0)] * 40), onset=10.1)
    assert m.stop_ms is None
