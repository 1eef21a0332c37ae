"""Rate limits: a token bucket per thing limited (a socket's messages, its
bad messages; per tenant and per client address in :mod:`web.limits`).

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

    def _refill(self, now: float) -> None:
        if self._at is not None:
            self._tokens = min(self.burst, self._tokens + max(0.0, now - self._at) * self.rate_per_s)
            self._at = max(self._at, now)  # time going back adds nothing, later or now
        else:
            self._at = now

    def take(self, now: float) -> bool:
        """Spend one token at clock seconds ``now``; False (nothing spent)
        when none is left: the sender is over the limit."""
        self._refill(now)
        if self._tokens < 1:
            return False
        self._tokens -= 1
        return True

    def wait_s(self, now: float) -> float:
        """Seconds from clock seconds ``now`` until a token is there (0.0:
        one is now); nothing is spent."""
        self._refill(now)
        return 0.0 if self._tokens >= 1 else (1 - self._tokens) / self.rate_per_s

    def full(self, now: float) -> bool:
        """All ``burst`` tokens are there at ``now``: forgetting this bucket
        and starting a new one later loses nothing."""
        self._refill(now)
        return self._tokens >= self.burst
