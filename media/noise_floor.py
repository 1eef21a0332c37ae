"""The adaptive noise floor of one inbound stream.

An asymmetric exponential follower of the frame level in dB: it follows a
quieter background fast and a louder one slowly, so a steady noise is
learnt within seconds while a voice (short, loud) barely moves it. The
barge-in gate and stage-2 confirmation (:mod:`media.bargein`) ask for a
margin above it. The caller decides which frames it learns from (not those
of a run in progress, nor echo).

Units: levels in dBFS RMS (:func:`media.frames.rms_dbfs`; 0 dBFS is a
full-scale square wave), time constants in ms, one update per 20 ms frame
(``FRAME_MS``).
"""

from __future__ import annotations

import math

from media.frames import FRAME_MS

#: Level (dBFS) given to digital silence so the noise floor stays finite.
SILENCE_DBFS = -100.0


class NoiseFloor:
    """Asymmetric exponential follower in dB: fast down, slow up, clamped.

    A step of the background from ``f`` to ``f + gap`` dB is followed as
    ``gap * exp(-t / up_ms)`` (``down_ms`` for a step down), with one update
    per 20 ms frame: the per-frame coefficient is ``1 - exp(-20 / tau_ms)``.

    Args:
        init_dbfs: the floor (dBFS) before anything was heard.
        min_dbfs, max_dbfs: clamp of the floor (dBFS).
        down_ms: time constant (ms) following a quieter background.
        up_ms: time constant (ms) following a louder background.

    Attributes:
        dbfs: the current floor (dBFS).
    """

    def __init__(self, init_dbfs: float, min_dbfs: float, max_dbfs: float, down_ms: int, up_ms: int) -> None:
        self._a_down = 1 - math.exp(-FRAME_MS / down_ms)
        self._a_up = 1 - math.exp(-FRAME_MS / up_ms)
        self._min = min_dbfs
        self._max = max_dbfs
        self.dbfs = init_dbfs

    def update(self, level: float) -> None:
        """Follow one 20 ms frame of level ``level`` (dBFS)."""
        f = self.dbfs
        f += (self._a_down if level < f else self._a_up) * (level - f)
        self.dbfs = min(self._max, max(self._min, f))
