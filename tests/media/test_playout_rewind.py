"""A resume after a noise or a backchannel goes on from the start of the
word the reply paused in (DESIGN.md), not from the middle of it: the word
boundary rule on levels, and the playout buffer's rewind."""

from __future__ import annotations

import math

import numpy as np
import pytest

from clock import VirtualClock
from media.device_playout import DevicePlayout
from media.frames import PLAYOUT_RATE, frame_bytes
from media.playout import REWIND_MAX_MS, REWIND_MIN_PAUSE_MS, PlayoutBuffer, PlayoutFrame, word_start
from media.telephony_playout import TelephonyPlayout

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


class PhoneWire:
    def __init__(self) -> None:
        self.kinds: list[str] = []

    def send_media(self, payload: bytes, generation: int) -> None:
        self.kinds.append("media")

    def send_mark(self, name: str, generation: int) -> None:
        self.kinds.append("mark")

    def send_clear(self) -> None:
        self.kinds.append("clear")


class DeviceWire:
    def __init__(self) -> None:
        self.packets = 0

    def send_audio(self, packet: bytes, generation: int) -> None:
        self.packets += 1

    def send_cleared(self) -> None:
        pass


#: a word (0-4), a pause (5-7), the word the pause falls in (8-) and more
LEVELS = [-20] * 5 + [-70] * 3 + [-20] * 22


async def test_a_phone_resumes_from_the_start_of_the_word_the_caller_heard_part_of() -> None:
    """The phone's pause recalls what the provider had not played
    (``clear``); a resume then goes back over the frames the caller did
    hear of the word, so it is said whole, and the heard position holds at
    the word's start until it goes out again."""
    clock = VirtualClock()
    out = TelephonyPlayout(clock, lambda g: True, PhoneWire(), send_ahead_ms=60, mark_every_ms=200)  # type: ignore[arg-type]
    sent: list[int] = []
    for i, lv in enumerate(LEVELS):
        out.push(frame(i, lv))
    t0 = clock.monotonic()
    for k in range(15):  # frames 0-16 sent by t0+280 ms; 0-13 played, 14-16 at the provider
        await clock.advance(t0 + k * 0.02 - clock.monotonic())
        out.pump(clock.monotonic())
    out.pause()
    assert out.recalled_frames == 3
    await clock.advance(0.3)
    assert out.rewind_to_word(300) == 6 * 20  # frames 8-13: heard of the word the pause fell in
    assert out.played_samples(1) == 8 * N
    out.resume()
    while (f := out.next_deliverable()) is not None and len(sent) < 4:
        sent.append(f.sample // N)
    assert sent == [8, 9, 10, 11]
    assert out.replayed_frames == 6


async def test_a_device_rewinds_once_it_has_played_what_it_holds() -> None:
    """A device plays on what it was sent after a pause (no recall in its
    protocol): no rewind while it still holds audio not yet due; after
    that, the frames sent count as heard and the word goes out again from
    its start."""
    clock = VirtualClock()
    out = DevicePlayout(clock, lambda g: True, DeviceWire(), sample_rate=24_000, frame_ms=60, send_ahead_ms=40)  # type: ignore[arg-type]
    for i, lv in enumerate(LEVELS):
        out.push(frame(i, lv))
    t0 = clock.monotonic()
    for k in range(10):
        await clock.advance(t0 + k * 0.02 - clock.monotonic())
        out.pump(clock.monotonic())
    out.pause()
    assert out.far_end_until > clock.monotonic()
    assert out.rewind_to_word(300) == 0  # the device is still playing into the word
    await clock.advance(0.3)
    again = out.rewind_to_word(300)
    assert again > 0 and again % 20 == 0
    out.resume()
    first = out.next_deliverable()
    assert first is not None and first.sample == 8 * N


def test_a_plain_buffer_rewinds_only_what_left_it() -> None:
    """A recall (frames sent, then taken back before they played) is not
    played: a rewind goes on from the last frame that did play."""
    buf = PlayoutBuffer()
    for i, lv in enumerate(LEVELS):
        buf.push(frame(i, lv))
    sent = play(buf, 13)
    buf.requeue(sent[-2:])  # frames 11 and 12 recalled
    buf.pause()
    assert buf.rewind_to_word(300) == 3 * 20  # frames 8-10
    buf.resume()
    assert [f.sample // N for f in play(buf, 5)] == [8, 9, 10, 11, 12]
