"""The per-tenant and per-address limiter (web.limits) on virtual time: the
allowance at once then the rate, an accurate time to the next token, one
key's flood leaving the others alone, nothing spent by a refusal, 0 as
unlimited, and a table that forgets idle keys and never grows past its cap."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from clock import VirtualClock
from web.errors import ApiError
from web.limits import BucketTable, Limits, LimitSettings, rate_limited, retry_after
from web.rate_limit import TokenBucket


def make(clock: VirtualClock, **fields: float) -> Limits:
    return Limits(LimitSettings(**fields), clock)  # type: ignore[arg-type]


def test_token_bucket_tells_the_time_to_its_next_token() -> None:
    b = TokenBucket(2, 2)
    assert b.wait_s(0.0) == 0.0 and b.full(0.0)
    assert b.take(0.0) and b.take(0.0) and not b.take(0.0)
    assert b.wait_s(0.0) == pytest.approx(0.5)
    assert b.wait_s(0.2) == pytest.approx(0.3) and not b.full(0.2)
    assert b.take(0.5) and b.full(1.5)


async def test_a_minutes_allowance_at_once_then_one_token_every_rate() -> None:
    clock = VirtualClock()
    limits = make(clock, turns_per_min_per_tenant=3, turns_per_min_per_client=0)
    assert [limits.take("turn", tenant="acme") for _ in range(3)] == [0.0] * 3
    assert limits.take("turn", tenant="acme") == pytest.approx(20.0)  # 3 a minute: one every 20 s
    await clock.advance(15)
    assert limits.take("turn", tenant="acme") == pytest.approx(5.0)
    await clock.advance(5)
    assert limits.take("turn", tenant="acme") == 0.0
    assert limits.take("turn", tenant="acme") == pytest.approx(20.0)


def test_one_tenants_flood_leaves_other_tenants_and_addresses_alone() -> None:
    clock = VirtualClock()
    limits = make(clock, stops_per_s_per_tenant=2, stops_per_s_per_client=5)
    assert limits.allows("stop", tenant="acme", client="10.0.0.1")
    assert limits.allows("stop", tenant="acme", client="10.0.0.1")
    assert not limits.allows("stop", tenant="acme", client="10.0.0.2")  # the tenant's bucket is empty
    assert limits.allows("stop", tenant="globex", client="10.0.0.1")  # another tenant, same address
    for _ in range(2):
        assert limits.allows("stop", tenant=f"t{_}", client="10.0.0.1")
    # the address has spent 5 (2 acme, 1 globex, 2 others): any tenant from it waits
    assert limits.take("stop", tenant="initech", client="10.0.0.1") == pytest.approx(0.2)
    assert limits.allows("stop", tenant="initech", client="10.0.0.3")


def test_a_refusal_spends_nothing_in_any_scope() -> None:
    clock = VirtualClock()
    limits = make(clock, session_starts_per_min_per_tenant=1, session_starts_per_min_per_client=2)
    assert limits.allows("session_start", tenant="acme", client="a")
    assert not limits.allows("session_start", tenant="acme", client="a")  # acme is out
    # the address's second token was not spent by acme's refusal
    assert limits.allows("session_start", tenant="globex", client="a")
    assert not limits.allows("session_start", tenant="initech", client="a")


def test_spend_counts_without_refusing() -> None:
    clock = VirtualClock()
    limits = make(clock, stops_per_s_per_tenant=1, stops_per_s_per_client=0)
    limits.spend("stop", tenant="acme")
    limits.spend("stop", tenant="acme")  # nothing left: nothing more spent, nothing raised
    assert limits.wait_s("stop", tenant="acme") == pytest.approx(1.0)


def test_zero_is_unlimited_and_none_is_not_counted() -> None:
    clock = VirtualClock()
    limits = make(clock, turns_per_min_per_tenant=0, turns_per_min_per_client=1)
    assert all(limits.allows("turn", tenant="acme") for _ in range(10_000))
    assert limits.allows("turn", tenant="acme", client="a") and not limits.allows("turn", client="a")
    assert ("turn", "tenant") not in limits.tables


async def test_require_answers_429_with_retry_after_rounded_up() -> None:
    clock = VirtualClock()
    limits = make(clock, turns_per_min_per_tenant=2)
    limits.require("turn", tenant="acme")
    limits.require("turn", tenant="acme")
    await clock.advance(0.5)
    with pytest.raises(ApiError) as err:
        limits.require("turn", tenant="acme")
    assert err.value.status == 429 and err.value.code == "rate_limited"
    assert err.value.headers["Retry-After"] == "30"  # 29.5 s to the next token
    assert retry_after(0.01) == "1" and retry_after(2.0000000001) == "2" and retry_after(2.01) == "3"
    assert rate_limited("x", 0).headers["Retry-After"] == "1"


def test_concurrent_sessions_per_tenant_and_per_address() -> None:
    clock = VirtualClock()
    limits = make(clock, sessions_per_tenant=2, sessions_per_client=3)
    running = [SimpleNamespace(tenant="acme", client="a"), SimpleNamespace(tenant="acme", client="b"),
               SimpleNamespace(tenant=None, client="c"), SimpleNamespace(tenant="globex", client="c"),
               SimpleNamespace(tenant="globex", client="c")]
    with pytest.raises(ApiError) as err:
        limits.check_sessions(running, "acme", "d")  # type: ignore[arg-type]
    assert err.value.status == 429 and err.value.headers["Retry-After"] == "5"
    limits.check_sessions(running, "initech", "d")  # type: ignore[arg-type]
    limits.check_sessions(running, None, "b")  # type: ignore[arg-type]
    with pytest.raises(ApiError):
        limits.check_sessions(running, "initech", "c")  # type: ignore[arg-type]
    make(clock).check_sessions(running * 100, "acme", "c")  # type: ignore[arg-type]  # 0: no quota


def test_idle_full_buckets_are_forgotten() -> None:
    table = BucketTable(rate_per_s=1, burst=2, max_keys=1000)
    for k in range(100):
        assert table.take(f"10.0.{k}.1", 0.0)
    assert len(table) == 100
    for k in range(60):  # two seconds on every bucket is full again: each use forgets two of them
        table.take("busy", 2.0 + k * 0.001)
    assert len(table) == 1  # only "busy"


def test_a_flood_of_addresses_cannot_grow_the_table_past_its_cap() -> None:
    table = BucketTable(rate_per_s=1, burst=1, max_keys=500)
    for k in range(100_000):
        table.take(f"addr-{k}", 0.0)  # all at once: none full again, the least recently used goes
        assert len(table) <= 500
    assert len(table) == 500
    assert not table.take("addr-99999", 0.0)  # a recent one is still held to its limit
    limits = make(VirtualClock(), session_starts_per_min_per_client=1, max_keys=3)
    for k in range(50):
        limits.take("session_start", client=f"a{k}")
    assert len(limits.tables[("session_start", "client")]) == 3


def test_a_refused_unknown_key_creates_nothing() -> None:
    clock = VirtualClock()
    limits = make(clock, session_starts_per_min_per_tenant=1, session_starts_per_min_per_client=5)
    limits.take("session_start", tenant="acme", client="a")
    limits.take("session_start", tenant="acme", client="new")  # refused by acme's bucket
    assert len(limits.tables[("session_start", "client")]) == 1


@pytest.mark.parametrize("bad", [{"rate_per_s": 0, "burst": 1, "max_keys": 1}, {"rate_per_s": 1, "burst": 1, "max_keys": 0}])
def test_bad_tables_are_refused(bad: dict[str, float]) -> None:
    with pytest.raises(ValueError):
        BucketTable(**bad)  # type: ignore[arg-type]


def test_settings_read_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    from web.settings import load_settings

    monkeypatch.setenv("TURNKEEPER_LIMITS__STOPS_PER_S_PER_TENANT", "7.5")
    monkeypatch.setenv("TURNKEEPER_LIMITS__SESSIONS_PER_TENANT", "4")
    s = load_settings()
    assert s.limits.stops_per_s_per_tenant == 7.5 and s.limits.sessions_per_tenant == 4
    monkeypatch.setenv("TURNKEEPER_LIMITS__TURNS_PER_MIN_PER_TENANT", "-1")
    with pytest.raises(ValueError):
        load_settings()
