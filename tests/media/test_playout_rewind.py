"""A resume after a noise or a backchannel goes on from the start of the
word the reply paused in (DESIGN.md), not from the middle of it: the word
boundary rule on levels, and the playout buffer's rewind."""

from __future__ import annotations

import math

import numpy as np
import pytest

from media.frames import PLAYOUT_RATE, frame_bytes
from media.paced_playout import PacedPlayout
from media.playout import REWIND_MAX_MS, REWIND_MIN_PAUSE_MS, PlayoutBuffer, PlayoutFrame, word_start

N = frame_bytes(PLAYOUT_RATE) // 2  # samples per 20 ms frame


@pytest.mark.parametrize(
    ("levels", "start"),
    [
        ([-20, -20, -60, -20, -22, -18], 3),  # a pause between words: the word after it
        ([-20, -20, -40, -20, -22, -18], 3),  # a dip 15 dB or more below the word's loudest
        ([-20, -20, -30, -20, -22, -18], 3),  # no dip that deep: after the quietest frame
        ([-20, -20, -20, -60], 4),  # paused in a pause: nothing to play again
        ([-18, -19, -20, -21], 0),  # the last frame is the quietest: the whole window
        ([], 0),
    ],
)
def test_the_word_starts_after_the_last_pause_or_dip(levels: list[float], start: int) -> None:
    assert word_start(levels) == start


def frame(i: int, level_dbfs: float, generation: int = 1) -> PlayoutFrame:
    amp = 0 if level_dbfs == -math.inf else 32767 * 10 ** (level_dbfs / 20) * math.sqrt(2)
    pcm = (amp * np.sin(np.arange(N) * 2 * np.pi * 200 / PLAYOUT_RATE)).astype("<i2").tobytes()
    return PlayoutFrame(pcm, generation, sample=i * N, audible=level_dbfs != -math.inf)


def play(buf: PlayoutBuffer, n: int) -> list[PlayoutFrame]:
    out = []
    for _ in range(n):
        f = buf.pop()
        assert f is not None
        buf.note_played(f)
        out.append(f)
    return out


def test_a_pause_too_short_to_lose_a_word_resumes_where_it_stopped() -> None:
    """A pause taken back within a few frames (the echo guard finding the
    agent's own voice again) left a 40-80 ms gap; saying the word again
    after it would be the audible part."""
    buf = PlayoutBuffer()
    for i, lv in enumerate([-20] * 5 + [-70] * 3 + [-20] * 16):
        buf.push(frame(i, lv))
    play(buf, 11)
    buf.pause()
    assert buf.rewind_to_word(REWIND_MIN_PAUSE_MS - 20) == 0
    assert buf.rewind_to_word(REWIND_MIN_PAUSE_MS) == 3 * 20
    buf.resume()
    assert [f.sample // N for f in play(buf, 2)] == [8, 9]


def test_a_resume_goes_back_to_the_start_of_the_word_it_paused_in() -> None:
    buf = PlayoutBuffer()
    levels = [-20] * 5 + [-70] * 3 + [-20] * 6 + [-20] * 10  # word, pause, the word playing at the pause, more
    for i, lv in enumerate(levels):
        buf.push(frame(i, lv))
    play(buf, 11)  # three frames into the second word
    buf.pause()
    assert buf.rewind_to_word(300) == 3 * 20
    buf.resume()
    assert [f.sample // N for f in play(buf, 4)] == [8, 9, 10, 11]  # from the word's first frame on
    assert buf.replayed_frames == 3
    assert buf.played_samples(1) == 12 * N  # what was heard is not counted twice
    # a second rewind at once finds nothing new to play again
    buf.pause()
    assert buf.rewind_to_word(300) <= 4 * 20


def test_no_rewind_when_not_paused_in_a_word_or_across_generations() -> None:
    buf = PlayoutBuffer()
    for i in range(6):
        buf.push(frame(i, -20))
    play(buf, 3)
    assert buf.rewind_to_word(300) == 0  # not paused
    buf.pause()
    buf.clear()  # a barge-in: nothing queued follows on
    buf.push(frame(0, -20, generation=2))
    assert buf.rewind_to_word(300) == 0
    # paused between words: the word had not begun
    quiet = PlayoutBuffer()
    for i, lv in enumerate([-20, -20, -70, -70, -20]):
        quiet.push(frame(i, lv))
    play(quiet, 3)
    quiet.pause()
    assert quiet.rewind_to_word(300) == 0
    # never more than REWIND_MAX_MS, even with no word boundary in sight
    long = PlayoutBuffer()
    for i in range(60):
        long.push(frame(i, -20 - (i % 3)))
    play(long, 50)
    long.pause()
    assert 0 < long.rewind_to_word(300) <= REWIND_MAX_MS


def test_a_sink_whose_far_end_buffers_does_not_rewind() -> None:
    class Clock:
        def monotonic(self) -> float:
            return 0.0

    paced = PacedPlayout(Clock(), lambda g: True)  # type: ignore[arg-type]
    for i in range(6):
        paced.push(frame(i, -20))
    play(paced, 3)
    paced.pause()
    assert paced.rewind_to_word(300) == 0
