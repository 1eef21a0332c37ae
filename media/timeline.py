"""Media time of a 20 ms frame stream: the timeline the echo guard compares on.

A frame's media time is the first frame's clock time plus 20 ms
(``FRAME_MS``) per frame since, re-based when the stream drifts from the
clock. Both sides of the echo guard (:mod:`media.echo_guard`: the outbound
reference, the inbound detector) stamp their frames with it, so the delay
between them stays the acoustic round trip whatever the event loop did.

Units: clock seconds (the injected clock's ``monotonic``), 20 ms frames.
"""

from __future__ import annotations

import math
from collections import deque

from media.frames import FRAME_MS

#: A paced sender (:class:`media.outbound.PacedAudioTrack`,
#: :class:`media.paced_playout.PacedPlayout`) that falls this far (s) behind
#: its ticks restarts pacing instead of bursting frames out to catch up: a
#: lag beyond it is a hole in what it sent, never a burst.
PACING_MAX_LAG_S = 0.1


class SteadyClock:
    """Media time of a 20 ms frame stream: the first frame's clock time plus
    20 ms per frame, re-based when it drifts from the clock.

    The two sides of the echo guard are compared on this timeline, not on
    arrival times: after an event-loop stall the inbound side delivers
    several frames at once, and the outbound track skips ticks; stamping
    those with the clock would warp the delay between them.

    Two kinds of drift are told apart by what follows them:

    - a burst (frames held up, then delivered at once) catches up by itself:
      the lag shrinks by 20 ms a frame, and media time is left alone;
    - a hole (frames lost, or ticks skipped) leaves a lag that stays put as
      frames come at their normal pace again: after ``SETTLE_FRAMES`` frames
      whose lag stays within ``SETTLE_SPREAD_S`` of each other and above
      ``MIN_HOLE_S``, media time jumps over the hole.

    Any drift over ``max_drift_s`` re-bases at once.

    Args:
        max_drift_s: drift (s) that re-bases media time at once
            (``MAX_DRIFT_S``; a paced sender's own stream, which cannot
            burst beyond it, passes ``PACING_MAX_LAG_S``).

    Attributes:
        MAX_DRIFT_S: the default ``max_drift_s`` (0.2).
        MIN_HOLE_S: least steady lag (s) taken for a hole (0.04: two frames).
        SETTLE_FRAMES: frames (20 ms each) whose lag must agree before a
            hole is jumped over (4).
        SETTLE_SPREAD_S: how far (s) those lags may differ (0.015).
    """

    MAX_DRIFT_S = 0.2
    MIN_HOLE_S = 0.04
    SETTLE_FRAMES = 4
    SETTLE_SPREAD_S = 0.015

    def __init__(self, max_drift_s: float = MAX_DRIFT_S) -> None:
        self.max_drift_s = max_drift_s
        self._t: float | None = None
        self._lags: deque[float] = deque(maxlen=self.SETTLE_FRAMES)

    def tick(self, at: float) -> float:
        """The media time of the frame that came at clock seconds ``at``.

        Raises:
            ValueError: ``at`` is not a finite number.
        """
        if not math.isfinite(at):
            raise ValueError(f"clock time must be finite, got {at!r}")
        t = at if self._t is None else self._t + FRAME_MS / 1000
        lag = at - t
        self._lags.append(lag)
        if abs(lag) > self.max_drift_s:
            t = at
            self._lags.clear()
        elif len(self._lags) == self.SETTLE_FRAMES:
            lo, hi = min(self._lags), max(self._lags)
            if hi - lo <= self.SETTLE_SPREAD_S and (lo > self.MIN_HOLE_S or hi < -self.MIN_HOLE_S):
                t += lo if lo > 0 else hi  # the steady part of the lag: the hole
                self._lags.clear()
        self._t = t
        return t
