"""Capacity: may this server take one more call without any live call's
audio suffering? (issue 33; env ``TURNKEEPER_CAPACITY__*``, TOML
``[capacity]``.)

Every call's outbound audio is paced by the one event loop (20 ms ticks,
:mod:`media.pacing`). When the loop has more work than it can do, ticks go
out late, and past about 40 ms the caller's jitter buffer runs dry: a gap
in the agent's voice, for every caller at once. ``bench/capacity.py``
finds that point on this 2-core machine at 7-8 speaking WebRTC calls,
where the send lateness p99 climbs from 4-6 ms to 15-40 ms. So the server
is *full* (:meth:`Capacity.full`) while either holds:

- **send lateness**: with two calls or more live, the p99 of the last
  ``window_s`` of paced ticks (all sessions, at least ``min_ticks`` of
  them) is over ``lateness_p99_ms``: the loop already runs late, before
  any gap a caller could hear;
- **CPU**: the server process's CPU (its threads: the loop, aiortc's codec
  threads; from :func:`time.process_time`) over the last ``window_s``,
  divided among the live calls, leaves no room for one more within
  ``cpu_budget`` of a core (the loop's share before ticks go late). This
  one predicts: it refuses the call that would push the loop over, where
  the lateness only sees the push once it happened;
- **starting**: with two calls or more live and half the estimated
  capacity or more, another call started less than ``start_gap_s`` ago. A call's first seconds cost more than its share
  (the DTLS handshake, its first utterance recognised and judged, its
  first reply synthesised) and neither measure has seen them yet:
  callers that retried together were all let in at once, and the send
  lateness p99 went to 30-40 ms with received gaps of 95 ms for the calls
  already live (``bench/capacity.py --overload 1.5``). So calls are let
  in one at a time; a lightly loaded server takes a burst.

``max_sessions`` (top-level setting) stays the hard cap an operator sets.
A full server refuses new calls (:mod:`web.admission`: WebRTC 503
``at_capacity`` with Retry-After, phone streams closed 1013 with the
reason, devices an ``alert`` then 1013) and answers ``/readyz`` 503
``full``, so a load balancer sends the caller to another instance; live
calls go on. :meth:`Capacity.estimate` (the sessions the CPU budget holds
at the measured cost a call) and the load are in ``/metrics``.
"""

from __future__ import annotations

import math
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from pydantic import BaseModel, Field

from clock import Clock
from media.pacing import PacingMonitor, quantile_of_buckets

#: how often the CPU is sampled, s
SAMPLE_S = 1.0


class CapacitySettings(BaseModel):
    """When the server counts as full (see the module doc).

    Attributes:
        lateness_p99_ms: full while the send lateness p99 of the last
            ``window_s`` is over this, ms (0: not judged by lateness).
        min_ticks: paced ticks the window must hold before its p99 counts
            (50 a second per live call: two calls' worth over 10 s; with
            one call, five late ticks would make a p99, and one call
            alone never fills a server).
        cpu_budget: the share of one core the server process may use for
            its calls (0: not judged by CPU).
        window_s: how far back both look, s (the pacing monitor's window).
        start_gap_s: with two calls or more live and half the estimated
            capacity or more, the least time between two calls let in, s
            (0: no spacing).
    """

    lateness_p99_ms: float = Field(8.0, ge=0, le=1000)
    min_ticks: int = Field(1000, ge=1, le=1_000_000)
    cpu_budget: float = Field(0.7, ge=0, le=64)
    window_s: float = Field(10.0, ge=2, le=600)
    start_gap_s: float = Field(2.0, ge=0, le=60)


@dataclass(frozen=True)
class Load:
    """The load a decision was made on.

    Attributes:
        live: live sessions.
        cpu: the server process's CPU over the window, share of one core
            (None until a window's samples exist).
        lateness_p99_ms: send lateness p99 over the window, ms (None with
            too few ticks).
        estimate: sessions the CPU budget holds at the measured cost a
            session (None until measured with a session live).
    """

    live: int
    cpu: float | None
    lateness_p99_ms: float | None
    estimate: int | None


class Capacity:
    """Whether one more call fits; see the module doc.

    Args:
        settings: the thresholds.
        pacing: the process's :class:`media.pacing.PacingMonitor`, whose
            window (``window_s``) the lateness is judged over.
        clock: time for the windows (the pacing monitor's clock too).
        live: the live sessions now (``len(app[PEERS])``).
        cpu_time: process CPU seconds (:func:`time.process_time`; injected
            in tests).

    Attributes:
        refusals: calls refused, per reason (``send_lateness``, ``cpu``,
            ``starting``).
    """

    def __init__(self, settings: CapacitySettings, pacing: PacingMonitor, clock: Clock, live: Callable[[], int],
                 cpu_time: Callable[[], float] = time.process_time) -> None:
        self.settings = settings
        self.pacing = pacing
        self.clock = clock
        self.live = live
        self.cpu_time = cpu_time
        self.refusals: dict[str, int] = {"send_lateness": 0, "cpu": 0, "starting": 0}
        self._last_start: float | None = None
        n = max(2, math.ceil(settings.window_s / SAMPLE_S) + 1)
        #: (clock s, CPU s, live sessions) every SAMPLE_S
        self._samples: deque[tuple[float, float, int]] = deque(maxlen=n)

    def sample(self) -> None:
        """Record the process CPU now (call every :data:`SAMPLE_S`)."""
        self._samples.append((self.clock.monotonic(), self.cpu_time(), self.live()))

    async def run(self) -> None:
        """Sample every :data:`SAMPLE_S` until cancelled."""
        while True:
            self.sample()
            await self.clock.sleep(SAMPLE_S)

    def load(self) -> Load:
        """The load now (see :class:`Load`)."""
        live = self.live()
        cpu = None
        if len(self._samples) >= 2:
            (t0, c0, _), (t1, c1, _) = self._samples[0], self._samples[-1]
            if t1 > t0:
                cpu = max(0.0, (c1 - c0) / (t1 - t0))
        counts = self.pacing.recent_counts(self.clock.monotonic())
        p99 = None
        if sum(counts) >= self.settings.min_ticks:
            q = quantile_of_buckets(counts, 0.99)
            p99 = None if q is None else q * 1000
        return Load(live, cpu, p99, self._estimate(cpu))

    def _estimate(self, cpu: float | None) -> int | None:
        """Sessions the budget holds: the budget over the CPU a session,
        the window's CPU shared among its mean live sessions; None unless
        a session was live at every sample of the window."""
        live = [n for _, _, n in self._samples]
        if cpu is None or not live or min(live) < 1 or cpu <= 0 or not self.settings.cpu_budget:
            return None
        mean = sum(live) / len(live)
        return max(1, math.floor(self.settings.cpu_budget * mean / cpu))

    def started(self) -> None:
        """A call was let in now (for ``start_gap_s``)."""
        self._last_start = self.clock.monotonic()

    def full(self) -> str | None:
        """Why one more call does not fit now: ``"send_lateness"``,
        ``"cpu"`` or ``"starting"``, or None when it does."""
        load = self.load()
        bound = self.settings.lateness_p99_ms
        if bound and load.live >= 2 and load.lateness_p99_ms is not None and load.lateness_p99_ms > bound:
            return "send_lateness"
        if load.estimate is not None and load.live + 1 > load.estimate:
            return "cpu"
        gap = self.settings.start_gap_s
        busy = load.live >= 2 and load.estimate is not None and load.live >= load.estimate / 2
        if gap and busy and self._last_start is not None and self.clock.monotonic() - self._last_start < gap:
            return "starting"
        return None

    def refuse(self) -> str | None:
        """:meth:`full`, counting a refusal in :attr:`refusals`."""
        reason = self.full()
        if reason is not None:
            self.refusals[reason] += 1
        return reason
