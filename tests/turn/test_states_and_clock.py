"""The transition table and the virtual clock."""

from __future__ import annotations

import asyncio

import pytest

from clock import SystemClock, VirtualClock
from turn.generation import GenerationFence
from turn.models import TERMINAL_STATUSES, TurnStatus
from turn.states import TRANSITIONS, sources_of


def test_terminal_states_have_no_way_out() -> None:
    for status in TERMINAL_STATUSES:
        assert TRANSITIONS[status] == frozenset()
        assert status.is_terminal


def test_no_terminal_state_is_a_source() -> None:
    for target in TurnStatus:
        assert not (sources_of(target) & TERMINAL_STATUSES)


def test_cancel_requested_only_from_running() -> None:
    assert sources_of(TurnStatus.CANCEL_REQUESTED) == {TurnStatus.RUNNING}
    assert sources_of(TurnStatus.CANCELLED) == {TurnStatus.QUEUED, TurnStatus.CANCEL_REQUESTED}
    assert TurnStatus.CANCEL_REQUESTED in sources_of(TurnStatus.RECONCILE_REQUIRED)


def test_stopping_is_never_shown_as_cancelled() -> None:
    assert TurnStatus.CANCEL_REQUESTED.label == "stopping"
    assert TurnStatus.CANCELLED.label == "cancelled"


async def test_virtual_clock_wakes_sleepers_in_order(clock: VirtualClock) -> None:
    woke: list[tuple[str, float]] = []

    async def sleeper(name: str, s: float) -> None:
        await clock.sleep(s)
        woke.append((name, clock.monotonic()))

    t0 = clock.monotonic()
    tasks = [asyncio.create_task(sleeper(n, s)) for n, s in (("b", 0.04), ("a", 0.02), ("c", 1.0))]
    await clock.advance(0.05)
    assert [(n, round(t - t0, 3)) for n, t in woke] == [("a", 0.02), ("b", 0.04)]
    await clock.advance(1.0)
    assert [n for n, _ in woke] == ["a", "b", "c"]
    await asyncio.gather(*tasks)


async def test_virtual_clock_rejects_going_back(clock: VirtualClock) -> None:
    with pytest.raises(ValueError):
        await clock.advance(-1)


async def test_virtual_clock_wall_time_follows(clock: VirtualClock) -> None:
    w0 = clock.now()
    await clock.advance(2.5)
    assert (clock.now() - w0).total_seconds() == pytest.approx(2.5)


async def test_system_clock_sleep_and_tz() -> None:
    c = SystemClock()
    t0 = c.monotonic()
    await c.sleep(0.01)
    assert c.monotonic() > t0
    assert c.now().tzinfo is not None


def test_generation_fence(clock: VirtualClock) -> None:
    fence = GenerationFence(clock)
    assert fence.active == 0 and fence.passes(0)
    g1 = fence.advance()
    assert g1 == 1 and fence.passes(1) and not fence.passes(0)
    assert fence.fenced_at(0) == clock.monotonic()
    assert fence.fenced_at(1) is None
    fence.advance()
    assert not fence.passes(1) and fence.passes(2)
