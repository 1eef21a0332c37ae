"""Send lateness (media.pacing): the monitor's histogram and window, and the
paced senders reporting each tick to it, on virtual time."""

from __future__ import annotations

import asyncio
import math

import pytest

from clock import VirtualClock
from media.outbound import PacedAudioTrack
from media.paced_playout import PacedPlayout
from media.pacing import LATENESS_BUCKETS_S, PacingMonitor, quantile_of_buckets
from media.playout import PlayoutBuffer, PlayoutFrame


def test_the_histogram_counts_each_tick_in_its_bucket() -> None:
    m = PacingMonitor()
    for late in (-0.003, 0.0, 0.0005, 0.003, 0.012, 0.05, 1.0):
        m.observe(late, 100.0)
    assert m.ticks == 7
    # an early tick counts as on time; 1 s is past the last bound
    assert m.counts[0] == 3 and m.counts[LATENESS_BUCKETS_S.index(0.004)] == 1
    assert m.counts[LATENESS_BUCKETS_S.index(0.015)] == 1 and m.counts[LATENESS_BUCKETS_S.index(0.06)] == 1
    assert m.counts[-1] == 1
    assert m.total_s == pytest.approx(0.0005 + 0.003 + 0.012 + 0.05 + 1.0)


def test_the_recent_p99_forgets_what_left_the_window() -> None:
    m = PacingMonitor(window_s=5.0)
    assert m.recent_quantile_s(0.99, 0.0) is None
    for i in range(500):  # 10 s of one session: on time...
        m.observe(0.0005, 10.0 + i * 0.02)
    for i in range(10):  # ...then a stall of 10 ticks 35 ms late
        m.observe(0.035, 20.0 + i * 0.02)
    assert m.recent_quantile_s(0.99, 20.2) == 0.04  # 10 of 260 in the window: past p99
    assert m.recent_quantile_s(0.5, 20.2) == 0.001
    assert m.recent_quantile_s(0.99, 30.0) is None  # all of it older than 5 s
    with pytest.raises(ValueError):
        m.recent_quantile_s(1.5, 20.0)
    with pytest.raises(ValueError):
        PacingMonitor(window_s=0.5)


def test_quantile_of_buckets() -> None:
    counts = [0] * (len(LATENESS_BUCKETS_S) + 1)
    assert quantile_of_buckets(counts, 0.99) is None
    counts[0], counts[-1] = 99, 1
    assert quantile_of_buckets(counts, 0.99) == LATENESS_BUCKETS_S[0]
    assert math.isinf(quantile_of_buckets(counts, 1.0) or 0)


async def test_the_webrtc_track_reports_each_tick_s_lateness(clock: VirtualClock) -> None:
    """A tick the loop ran 7 ms late is 7 ms late in the monitor; one on
    time is 0 (the first tick is due when it runs)."""
    track = PacedAudioTrack(PlayoutBuffer(), lambda g: True, clock)
    track.monitor = m = PacingMonitor()
    await track.recv()  # the first: due now
    task = asyncio.create_task(track.recv())
    await clock.advance(0.02)
    await task
    assert m.ticks == 2 and m.total_s == pytest.approx(0.0, abs=1e-9)
    await clock.advance(0.027)  # the loop was busy: the next tick comes 7 ms late
    await track.recv()
    assert m.ticks == 3 and m.total_s == pytest.approx(0.007)


async def test_the_phone_and_device_pacer_reports_each_tick_s_lateness(clock: VirtualClock) -> None:
    class Pacer(PacedPlayout):
        def emit(self, frame: PlayoutFrame, now: float) -> None:
            self.far_end_until = max(self.far_end_until, now) + 0.02

        def idle(self, now: float) -> None:
            pass

    pacer = Pacer(clock, lambda g: True, send_ahead_ms=40)
    pacer.monitor = m = PacingMonitor()
    task = asyncio.create_task(pacer.run())
    try:
        await clock.advance(0.2)
        assert m.ticks >= 10 and m.total_s == pytest.approx(0.0, abs=1e-9)
    finally:
        task.cancel()
        await asyncio.gather(task, return_exceptions=True)
