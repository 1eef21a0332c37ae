"""The token bucket the sockets' floods and bad messages are held to, on
given time: a burst at once, the rate over any stretch, never twice the
limit across a second's edge (which a fixed window let through)."""

from __future__ import annotations

import pytest

from web.rate_limit import TokenBucket


def test_a_burst_then_the_rate() -> None:
    b = TokenBucket(50, 50)
    assert all(b.take(0.0) for _ in range(50))
    assert not b.take(0.0)  # the 51st at once
    assert b.take(0.02) and not b.take(0.02)  # one more every 20 ms
    assert 97 <= sum(b.take(1.0 + k * 0.001) for k in range(1000)) <= 101  # a burst, then 50 over the second


def test_no_double_burst_across_a_second_edge() -> None:
    b = TokenBucket(100, 100)
    passed = sum(b.take(0.99) for _ in range(100)) + sum(b.take(1.01) for _ in range(100))
    assert passed <= 103  # a fixed window would have let 200 through within 20 ms


def test_a_slow_trickle_is_never_refused() -> None:
    b = TokenBucket(1.0, 100)
    assert all(b.take(k * 1.5) for k in range(10_000))  # one bad message every 1.5 s over 4 hours


def test_time_going_back_adds_nothing() -> None:
    b = TokenBucket(10, 1)
    assert b.take(5.0)
    assert not b.take(4.0)


@pytest.mark.parametrize(("rate", "burst"), [(0, 1), (-1, 5), (1, 0.5)])
def test_bad_limits_are_refused(rate: float, burst: float) -> None:
    with pytest.raises(ValueError):
        TokenBucket(rate, burst)
