"""Declicking the cuts of outbound audio (shared/cases/click-at-the-cut.md).

When a barge-in clears the playout buffer, or a pause silences it, the
agent's voice used to drop from its last sample to digital zero between
two samples: a step of over a thousand (of 32,767) at -32 dBFS, an audible
click on headphones and phones. A reply that ends by itself ends near zero.

:class:`Declicker` sits where 20 ms frames are handed to a transport. At a
cut (a silent tick right after audio) it sends, instead of plain silence,
a frame whose first ``ramp_ms`` decay linearly from the last sample sent
to zero: no content of the cut-off audio, only the level already on the
wire let down. At a resume (audio right after silence) the first
``ramp_ms`` of the frame fade in from zero. So no step at a cut or a resume
exceeds the level divided by the ramp's length, and the audible stop moves
by at most ``ramp_ms`` (5 ms by default, the issue allows 10).
"""

from __future__ import annotations

import numpy as np

#: length of the fade at a cut or a resume, ms
RAMP_MS = 5.0


class Declicker:
    """Ramps at the joins between audio and silence of one outbound stream.

    Args:
        rate: sample rate of the frames, Hz.
        ramp_ms: fade length, ms (0 < ramp_ms <= 10).

    Raises:
        ValueError: a rate below 1 Hz or a ramp outside (0, 10] ms.
    """

    def __init__(self, rate: int, ramp_ms: float = RAMP_MS) -> None:
        if rate < 1:
            raise ValueError(f"rate must be at least 1 Hz, not {rate}")
        if not 0 < ramp_ms <= 10:
            raise ValueError(f"ramp_ms must be in (0, 10] ms, not {ramp_ms}")
        self.ramp = max(1, round(rate * ramp_ms / 1000))
        self._last = 0  # the last sample sent
        self._silent = True  # the last frame sent was silence

    def audio(self, pcm: bytes) -> bytes:
        """A frame of audio (s16 little-endian mono) about to be sent; faded
        in if it follows silence. Returns the frame to send."""
        x = np.frombuffer(pcm, dtype="<i2")
        if x.size == 0:
            return pcm
        if self._silent and x[0] != 0:
            n = min(self.ramp, x.size)
            y = x.astype(np.float64)
            y[:n] *= np.arange(n) / n
            x = y.astype("<i2")
            pcm = x.tobytes()
        self._last = int(x[-1])
        self._silent = False
        return pcm

    def silence(self, samples: int) -> bytes:
        """A silent frame of ``samples`` samples about to be sent; right after
        audio, its start lets the last level down to zero instead."""
        out = np.zeros(samples, dtype="<i2")
        if not self._silent and self._last != 0 and samples > 0:
            n = min(self.ramp, samples)
            out[:n] = np.round(self._last * (1 - (np.arange(1, n + 1) / n))).astype("<i2")
        self._last = 0
        self._silent = True
        return out.tobytes()
