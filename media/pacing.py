"""Send lateness: how late the paced outbound frames leave, across sessions.

Every paced sender (:class:`media.outbound.PacedAudioTrack` for WebRTC,
:class:`media.paced_playout.PacedPlayout` for phone and device streams) is
due to hand a 20 ms frame on every 20 ms tick of the clock. When the event
loop is busy (too many sessions for the CPU, a blocking call) the tick runs
late; past a frame's worth of lateness the far end's jitter buffer runs dry
and the caller hears a gap. The lateness of each tick (clock seconds it ran
after it was due, 0 when on time) is the server's own view of whether its
audio still goes out on time, before any client reports a gap: the figure
admission and capacity are judged by (issue 33: p99 <= 10 ms).

:class:`PacingMonitor` is one per process (one app), shared by its
sessions: cumulative bucket counts for Prometheus, and a sliding window of
the last seconds for a current p99.

Units: lateness and quantiles in seconds; times clock seconds.
"""

from __future__ import annotations

import bisect
from collections import deque

#: bucket upper bounds of the lateness histogram, s: fine below the 10 ms
#: target, a frame (20 ms) and two (40 ms: a gap a caller hears) on edges
LATENESS_BUCKETS_S = (0.001, 0.002, 0.004, 0.006, 0.008, 0.010, 0.015, 0.020, 0.030, 0.040, 0.060, 0.100, 0.250)
#: the sliding window is kept in slots of this many seconds
SLOT_S = 1.0


class PacingMonitor:
    """Lateness of paced outbound ticks, all sessions of a process together.

    Args:
        window_s: how far back (s) :meth:`recent_quantile_s` looks.

    Attributes:
        counts: ticks per bucket of ``LATENESS_BUCKETS_S`` (and one more
            for later than the last bound), since the start: cumulative,
            as a Prometheus histogram exports them.
        total_s: summed lateness, s.
    """

    def __init__(self, window_s: float = 10.0) -> None:
        if window_s < SLOT_S:
            raise ValueError(f"window_s must be at least {SLOT_S} s, got {window_s}")
        self.counts = [0] * (len(LATENESS_BUCKETS_S) + 1)
        self.total_s = 0.0
        self._slots: deque[tuple[int, list[int]]] = deque(maxlen=int(window_s / SLOT_S))

    def observe(self, lateness_s: float, at: float) -> None:
        """One tick, ``lateness_s`` (s, negative counts as 0) after it was
        due, at clock seconds ``at``. About 1 us: called 50 times a second
        per session."""
        late = max(0.0, lateness_s)
        i = bisect.bisect_left(LATENESS_BUCKETS_S, late)
        self.counts[i] += 1
        self.total_s += late
        slot = int(at // SLOT_S)
        if not self._slots or self._slots[-1][0] != slot:
            self._slots.append((slot, [0] * len(self.counts)))
        self._slots[-1][1][i] += 1

    @property
    def ticks(self) -> int:
        """Ticks observed since the start."""
        return sum(self.counts)

    def recent_quantile_s(self, q: float, now: float) -> float | None:
        """The ``q`` quantile (0..1) of the lateness of the ticks of the
        last ``window_s`` before clock seconds ``now``, s: the upper bound
        of the bucket it falls in (``inf`` past the last bound), or None
        with no tick in the window.

        Raises:
            ValueError: ``q`` outside 0..1.
        """
        if not 0.0 <= q <= 1.0:
            raise ValueError(f"q must be within 0..1, got {q}")
        return quantile_of_buckets(self.recent_counts(now), q)

    def recent_counts(self, now: float) -> list[int]:
        """Ticks per bucket (as :attr:`counts`) of the last ``window_s``
        before clock seconds ``now``."""
        oldest = int(now // SLOT_S) - (self._slots.maxlen or 1) + 1
        merged = [0] * len(self.counts)
        for slot, counts in self._slots:
            if slot >= oldest:
                merged = [a + b for a, b in zip(merged, counts, strict=True)]
        return merged


def quantile_of_buckets(counts: list[int], q: float) -> float | None:
    """The ``q`` quantile (0..1) of ticks counted per bucket of
    ``LATENESS_BUCKETS_S`` (plus the overflow bucket), s: the upper bound
    of the bucket it falls in, ``inf`` in the overflow; None if no tick."""
    n = sum(counts)
    if not n:
        return None
    rank = q * n
    seen = 0
    for i, c in enumerate(counts):
        seen += c
        if seen >= rank and c:
            return LATENESS_BUCKETS_S[i] if i < len(LATENESS_BUCKETS_S) else float("inf")
    return float("inf")
