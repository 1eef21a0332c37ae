"""Rate limits: a token bucket per thing limited (a socket's messages, its
bad messages).

A fixed one-second window lets twice the limit through across a window's
edge and forgets a flood the moment the window turns; a token bucket
(RFC 2697's single-rate meter, without colours) holds ``burst`` tokens,
refills at ``rate_per_s`` and lets a message through while a token is
left, so a sender is held to the rate over any stretch of time with at
most ``burst`` at once. Time is given by the caller (clock seconds), so
limits are tested on virtual time.
"""

from __future__ import annotations


class TokenBucket:
    """Up to ``burst`` at once, ``rate_per_s`` a second on average.

    Args:
        rate_per_s: tokens added a second (> 0).
        burst: tokens held at most, and at the start (>= 1).

    Raises:
        ValueError: a rate that is not positive, or a burst below 1.
    """

    def __init__(self, rate_per_s: float, burst: float) -> None:
        if rate_per_s <= 0 or burst < 1:
            raise ValueError(f"need rate_per_s > 0 and burst >= 1, got {rate_per_s} and {burst}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self._tokens = float(burst)
        self._at: float | None = None

    def take(self, now: float) -> bool:
        """Spend one token at clock seconds ``now``; False (nothing spent)
        when none is left: the sender is over the limit."""
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate_per_s)
        self._at = now
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True
