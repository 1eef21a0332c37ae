"""The phone call's output sink on virtual time: send-ahead pacing, a
stage-1 pause, ``clear`` (in the same step, even with an empty queue, and
nothing old after it), and the marks' account of what the caller heard
(last echoed mark + real time, capped at the next unechoed mark; marks
returned because of a clear are not counted)."""

from __future__ import annotations

import asyncio

import pytest

from clock import VirtualClock
from media.frames import PLAYOUT_RATE
from media.marks import MarkTracker
from media.playout import PlayoutFrame
from media.telephony_playout import MARK_TIMEOUT_S, TelephonyPlayout

RATE = PLAYOUT_RATE
FRAME = RATE // 50  # 960 samples, 20 ms
LOUD = (b"\x00\x40" * FRAME)  # a square-ish tone, 1920 bytes


class Wire:
    """Records what the pacer sends, in order."""

    def __init__(self) -> None:
        self.sent: list[tuple[str, object, int | None]] = []

    def send_media(self, payload: bytes, generation: int) -> None:
        assert len(payload) == 160
        self.sent.append(("media", payload, generation))

    def send_mark(self, name: str, generation: int) -> None:
        self.sent.append(("mark", name, generation))

    def send_clear(self) -> None:
        self.sent.append(("clear", None, None))

    def kinds(self) -> list[str]:
        return [k for k, _, _ in self.sent]

    def marks(self) -> list[str]:
        return [str(v) for k, v, _ in self.sent if k == "mark"]


def frames(gen: int, n: int, start: int = 0) -> list[PlayoutFrame]:
    return [PlayoutFrame(LOUD, gen, start + i * FRAME) for i in range(n)]


# -- the marks' arithmetic ------------------------------------------------------------


def test_heard_is_the_last_echoed_mark_plus_real_time_capped_at_the_next_mark() -> None:
    m = MarkTracker(RATE)
    m.audio_sent(1, 0, 10 * FRAME, at=0.0)  # 200 ms sent at once
    first = m.mark_sent(1, at=0.0)  # after 200 ms
    m.audio_sent(1, 10 * FRAME, 20 * FRAME, at=0.0)
    second = m.mark_sent(1, at=0.0)  # after 400 ms
    # no echo yet: real time since the first send, capped at the first mark
    assert m.played_samples(1, 0.1) == round(0.1 * RATE)
    assert m.played_samples(1, 0.35) == 10 * FRAME  # capped: the first mark is not echoed
    # the first echo arrives late (at 0.3 s): from there, real time again
    assert m.echoed(first, at=0.3)
    assert m.played_samples(1, 0.3) == 10 * FRAME
    assert m.played_samples(1, 0.4) == 10 * FRAME + round(0.1 * RATE)
    assert m.played_samples(1, 9.0) == 20 * FRAME  # capped at the second mark
    assert m.echoed(second, at=9.0) and m.played_samples(1, 99.0) == 20 * FRAME  # all sent: capped there
    assert m.pending() == 0


def test_marks_returned_by_a_clear_are_not_counted_as_played() -> None:
    m = MarkTracker(RATE)
    m.audio_sent(1, 0, 10 * FRAME, at=0.0)
    a = m.mark_sent(1, at=0.0)
    m.audio_sent(1, 10 * FRAME, 20 * FRAME, at=0.0)
    b = m.mark_sent(1, at=0.0)
    assert m.echoed(a, at=0.2)
    m.cleared(at=0.25)  # the caller heard 200 ms + 50 ms
    frozen = m.played_samples(1, 0.25)
    assert frozen == 10 * FRAME + round(0.05 * RATE)
    # Twilio returns the cleared mark: it says nothing was played after all
    assert not m.echoed(b, at=0.26)
    assert m.discarded_echoes == 1 and m.unknown_echoes == 0
    assert m.played_samples(1, 5.0) == frozen  # frozen: time does not add to it
    assert not m.echoed("g1.99", at=1.0) and m.unknown_echoes == 1


def test_an_echo_acknowledges_the_marks_before_it() -> None:
    m = MarkTracker(RATE)
    names = []
    for i in range(3):
        m.audio_sent(1, i * 5 * FRAME, (i + 1) * 5 * FRAME, at=i * 0.1)
        names.append(m.mark_sent(1, at=i * 0.1))
    assert m.echoed(names[2], at=0.3)  # the provider skipped echoing the first two
    assert m.pending() == 0 and m.played_samples(1, 0.3) == 15 * FRAME


# -- pacing ---------------------------------------------------------------------------


async def test_send_ahead_then_one_message_per_tick() -> None:
    clock = VirtualClock()
    wire = Wire()
    out = TelephonyPlayout(clock, lambda g: g == 1, wire, send_ahead_ms=60, mark_every_ms=1000)
    for f in frames(1, 10):
        out.push(f)
    now = clock.monotonic()
    assert out.pump(now) == 3  # 60 ms ahead at once
    assert out.pump(now) == 0  # nothing more until it is due
    assert out.pump(now + 0.02) == 1
    assert out.pump(now + 0.04) == 1
    assert out.pump(now + 0.2) == 3  # the far end drained: up to 60 ms again
    # 8 frames in, 7 messages out: the resampler holds a few samples of the
    # 8th until the stretch ends (a tick that finds the window full is no end)
    assert wire.kinds().count("media") == 7
    assert out.pump(now + 0.4) == 2  # the last two frames ...
    out.pump(now + 0.6)  # ... then the queue is dry: the stretch ends, its last bytes go
    assert wire.kinds().count("media") == 10 and wire.kinds()[-1] == "mark"


async def test_a_pause_on_trial_stops_sending_and_a_mark_closes_the_stretch() -> None:
    clock = VirtualClock()
    wire = Wire()
    out = TelephonyPlayout(clock, lambda g: True, wire, send_ahead_ms=60, mark_every_ms=1000)
    for f in frames(1, 20):
        out.push(f)
    now = clock.monotonic()
    out.pump(now)
    out.pause(trial=True)  # the provider's 60 ms play on: a trial taken back makes no hole
    assert out.pump(now + 0.1) == 0
    assert wire.kinds() == ["media"] * 3 + ["mark"]  # the stretch ends: a mark after what was sent
    assert out.marks.pending(1) == 1
    out.resume()
    assert out.pump(now + 0.12) == 3


async def test_a_pause_on_speech_recalls_what_the_provider_holds_and_resume_plays_on_from_there() -> None:
    clock = VirtualClock()
    wire = Wire()
    out = TelephonyPlayout(clock, lambda g: True, wire, send_ahead_ms=60, mark_every_ms=40)
    for f in frames(1, 20):
        out.push(f)
    t0 = clock.monotonic()
    out.pump(t0)  # frames 0-2, playing from t0, t0+20 ms, t0+40 ms
    out.pump(t0 + 0.02)  # frame 3, from t0+60 ms
    first_mark = wire.marks()[0]  # after frames 0-1
    await clock.advance(0.03)  # frame 0 played, frame 1 playing
    out.pause()
    assert wire.kinds()[-1] == "clear" and out.clears_at == [t0 + 0.03]  # at once, in the same step
    assert out.recalled_frames == 3 and len(out) == 16 + 3  # frames 1-3 back at the head of the queue
    assert out.played_samples(1) == FRAME  # the caller heard frame 0 (and a part of 1)
    assert not out.on_mark(first_mark)  # returned because of the clear: not counted
    assert out.pump(t0 + 0.05) == 0  # paused: nothing goes
    await clock.advance(0.5)
    assert out.played_samples(1) == FRAME  # nothing plays while held
    out.resume()  # taken back (a backchannel): on from the first frame not heard
    assert out.pump(clock.monotonic()) == 3
    assert out.sent_frames[1] == 4  # frames 0-3, each counted once (1-3 recalled, then sent again)
    await clock.advance(0.02)
    assert FRAME < out.played_samples(1) <= 2 * FRAME  # plays again from frame 1, at real time
    # a commit now still sends clear (the provider holds the resent frames)
    assert out.clear() == 16 and wire.kinds()[-1] == "clear"


async def test_a_pause_with_nothing_at_the_provider_sends_no_clear() -> None:
    clock = VirtualClock()
    wire = Wire()
    out = TelephonyPlayout(clock, lambda g: True, wire, send_ahead_ms=60)
    for f in frames(1, 2):
        out.push(f)
    out.pump(clock.monotonic())
    out.pause(trial=True)
    assert "clear" not in wire.kinds()
    out.pause()  # the trial is verified while paused: what the provider still holds is recalled
    assert wire.kinds().count("clear") == 1
    out.resume()
    out.pump(clock.monotonic())  # the two frames again
    await clock.advance(1.0)  # all played long ago
    n = len(wire.sent)
    out.pause()
    assert len(wire.sent) == n  # nothing to recall: nothing sent


async def test_clear_is_sent_at_once_even_with_an_empty_queue_and_nothing_old_follows() -> None:
    clock = VirtualClock()
    wire = Wire()
    active = {"gen": 1}
    out = TelephonyPlayout(clock, lambda g: g == active["gen"], wire, send_ahead_ms=60, mark_every_ms=40)
    for f in frames(1, 3):
        out.push(f)
    now = clock.monotonic()
    out.pump(now)
    assert not len(out)  # our queue is empty; the far end still holds 60 ms
    late_old = frames(1, 5, start=3 * FRAME)
    active["gen"] = 2  # the fence moves ...
    assert out.clear() == 0  # ... and clear goes out in the same step, with nothing queued here
    assert wire.kinds()[-1] == "clear" and out.clears_at == [now]
    for f in late_old + frames(2, 3):  # old frames arriving late are fenced
        out.push(f)
    out.pump(now + 0.02)
    after = wire.sent[wire.kinds().index("clear") + 1 :]
    assert after and all(g == 2 for _, _, g in after)
    assert out.fenced_frames == 5
    # a second clear with nothing sent since the first would clear nothing: none is sent
    out2 = TelephonyPlayout(clock, lambda g: True, Wire(), send_ahead_ms=60)
    out2.clear()
    assert out2.clears_at == []


async def test_marks_every_n_ms_and_wait_empty_waits_for_the_last_echo() -> None:
    clock = VirtualClock()
    wire = Wire()
    out = TelephonyPlayout(clock, lambda g: True, wire, send_ahead_ms=60, mark_every_ms=100)
    for f in frames(1, 12):
        out.push(f)
    t = clock.monotonic()
    for i in range(20):
        out.pump(t + i * 0.02)
    names = wire.marks()
    assert len(names) == 3  # after 100 ms, 200 ms, and the stretch's end at 240 ms
    assert out.marks.pending(1) == 3
    waiter = asyncio.ensure_future(out.wait_empty())
    await clock.advance(0.1)
    assert not waiter.done()  # marks not echoed yet
    for name in names:
        assert out.on_mark(name)
    await clock.advance(0.05)
    assert waiter.done()
    assert out.played_samples(1) == 12 * FRAME


async def test_wait_empty_gives_up_on_marks_never_echoed() -> None:
    clock = VirtualClock()
    out = TelephonyPlayout(clock, lambda g: True, Wire(), send_ahead_ms=20)
    out.push(frames(1, 1)[0])
    out.pump(clock.monotonic())
    out.pump(clock.monotonic() + 0.02)
    assert out.marks.pending() == 1
    waiter = asyncio.ensure_future(out.wait_empty())
    await clock.advance(MARK_TIMEOUT_S + 0.2)
    assert waiter.done()


def test_send_ahead_must_be_whole_frames() -> None:
    with pytest.raises(ValueError):
        TelephonyPlayout(VirtualClock(), lambda g: True, Wire(), send_ahead_ms=50)


def test_late_ticks_do_not_end_a_stretch_mid_reply() -> None:
    """Every other tick 5 ms late (a loaded loop): a tick that finds the
    send-ahead window still full sends nothing, and that is not the end of
    the audio; one stretch, one closing mark (from review: 99 stretch ends
    and 99 marks in a 2 s reply)."""
    clock = VirtualClock()
    wire = Wire()
    segments: list[tuple[int, int, bool]] = []
    out = TelephonyPlayout(
        clock, lambda g: True, wire, send_ahead_ms=60, mark_every_ms=10_000,
        on_segment=lambda g, s, started: segments.append((g, s, started)),
    )
    for f in frames(1, 100):
        out.push(f)
    t = clock.monotonic()
    for tick in range(140):
        out.pump(t + tick * 0.020 + (0.005 if tick % 2 else 0.0))
    assert sum(k == "media" for k in wire.kinds()) == 100
    assert [s[2] for s in segments] == [True, False]  # one start, one end: when the queue ran dry
    assert len(wire.marks()) == 1
