"""checkpoint(): raises (never returns a flag) on a stop, a passed deadline,
a spent budget, too many steps or a tool loop; writes heartbeat, step count
and usage from cached state, at most once per staleness window."""

from __future__ import annotations

from datetime import timedelta

import pytest

from clock import VirtualClock
from turn.manager import TurnManager
from turn.models import Budget, Plan, StopReason, StopReasonKind, TurnStatus
from turn.scope import TurnScope
from turn.sqlite_store import SqliteStore
from turn.stopped import TurnStopped
from turn.usage import Pricing


class CountingStore(SqliteStore):
    """The real SQLite store, counting round trips."""

    reads = 0
    writes = 0

    async def get(self, turn_id):  # type: ignore[no-untyped-def]
        self.reads += 1
        return await super().get(turn_id)

    async def update(self, turn_id, *, at, **fields):  # type: ignore[no-untyped-def]
        self.writes += 1
        return await super().update(turn_id, at=at, **fields)


@pytest.fixture
async def counting(tmp_path) -> CountingStore:  # type: ignore[no-untyped-def]
    s = CountingStore(tmp_path / "var" / "t.db")
    await s.open()
    yield s
    await s.close()


@pytest.fixture
async def manager(counting: CountingStore, clock: VirtualClock) -> TurnManager:
    m = TurnManager(counting, clock, owner="me", flag_staleness_s=0.1)
    await m.ensure_session("s")
    return m


async def test_limits_come_from_the_plan(manager: TurnManager, clock: VirtualClock) -> None:
    plan = Plan(deadline_s=30, budget_cents=5, budget_tokens=1000, max_steps=4)
    turn = await manager.open_turn("s", plan=plan)
    assert turn.deadline_at == clock.now() + timedelta(seconds=30)
    assert turn.budget == Budget(cents=5, tokens=1000) and turn.max_steps == 4
    rt = manager.runtime(turn.id)
    assert rt is not None and rt.deadline == clock.monotonic() + 30


async def test_a_passed_deadline_raises(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s", plan=Plan(deadline_s=2))
    await manager.checkpoint(turn.id, "before_model")
    await clock.advance(2)
    with pytest.raises(TurnStopped) as info:
        await manager.checkpoint(turn.id, "after_model")
    assert info.value.kind is StopReasonKind.DEADLINE_EXCEEDED and info.value.phase == "after_model"


async def test_a_spent_budget_raises(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", plan=Plan(budget_tokens=50, budget_cents=None))
    meter = manager.runtime(turn.id).meter  # type: ignore[union-attr]
    req = meter.start_request(40)
    await manager.checkpoint(turn.id, "model_stream")
    req.chunk(9)
    await manager.checkpoint(turn.id, "model_stream")
    req.chunk(1)
    with pytest.raises(TurnStopped) as info:
        await manager.checkpoint(turn.id, "model_stream")
    assert info.value.kind is StopReasonKind.BUDGET_EXCEEDED and "50 of 50 tokens" in (info.value.detail or "")


async def test_a_spent_money_budget_raises(manager: TurnManager) -> None:
    pricing = Pricing(prompt_cents_per_1k=10, completion_cents_per_1k=30)
    turn = await manager.open_turn("s", plan=Plan(budget_tokens=None, budget_cents=1.0), pricing=pricing)
    req = manager.runtime(turn.id).meter.start_request(10)  # type: ignore[union-attr]
    req.chunk(29)  # 0.1 + 0.87 cents
    await manager.checkpoint(turn.id, "model_stream")
    req.chunk(1)  # 1.0 cent
    with pytest.raises(TurnStopped) as info:
        await manager.checkpoint(turn.id, "model_stream")
    assert info.value.kind is StopReasonKind.BUDGET_EXCEEDED


async def test_max_steps(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", plan=Plan(max_steps=3))
    for phase in ("before_model", "after_model", "before_tool", "after_tool", "before_model", "model_stream"):
        await manager.checkpoint(turn.id, phase)
    with pytest.raises(TurnStopped) as info:
        await manager.checkpoint(turn.id, "before_tool", tool_call=("x", {}))
    assert info.value.kind is StopReasonKind.MAX_STEPS


async def test_three_identical_tool_calls_are_a_loop(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", plan=Plan(max_steps=100))
    await manager.checkpoint(turn.id, "before_tool", tool_call=("search", {"q": "a", "n": 1}))
    await manager.checkpoint(turn.id, "before_tool", tool_call=("search", {"n": 1, "q": "a"}))
    await manager.checkpoint(turn.id, "before_tool", tool_call=("search", {"q": "b", "n": 1}))  # other arguments
    await manager.checkpoint(turn.id, "before_tool", tool_call=("search", {"q": "b", "n": 1}))
    with pytest.raises(TurnStopped) as info:
        await manager.checkpoint(turn.id, "before_tool", tool_call=("search", {"n": 1, "q": "b"}))
    assert info.value.kind is StopReasonKind.LOOP_DETECTED and "search" in (info.value.detail or "")


async def test_a_stop_raises_without_a_kind(manager: TurnManager, clock: VirtualClock) -> None:
    turn = await manager.open_turn("s")
    await manager.request_stop(turn.id, StopReason(kind=StopReasonKind.USER_CANCEL, initiator="t", at=clock.now()))
    with pytest.raises(TurnStopped) as info:
        await manager.checkpoint(turn.id, "before_model")
    assert info.value.kind is None


async def test_heartbeat_steps_and_usage_are_written_once_per_staleness_window(
    manager: TurnManager, counting: CountingStore, clock: VirtualClock
) -> None:
    turn = await manager.open_turn("s", plan=Plan())
    req = manager.runtime(turn.id).meter.start_request(12)  # type: ignore[union-attr]
    reads, writes = counting.reads, counting.writes
    for _ in range(50):  # within the window: no store round trip at all
        req.chunk()
        await manager.checkpoint(turn.id, "model_stream")
    await manager.checkpoint(turn.id, "before_tool", tool_call=("t", {}))
    assert (counting.reads, counting.writes) == (reads, writes)
    await clock.advance(0.2)
    await manager.checkpoint(turn.id, "after_tool")
    assert counting.writes == writes + 1  # one round trip writes and reads
    stored = await manager.get(turn.id)
    assert stored.step_count == 1 and stored.heartbeat_at == clock.now()
    assert stored.usage.prompt_tokens == 12 and stored.usage.completion_tokens == 50
    assert stored.spent.tokens == 62


async def test_a_stop_written_elsewhere_is_seen_within_the_staleness_bound(
    manager: TurnManager, counting: CountingStore, clock: VirtualClock
) -> None:
    other = TurnManager(counting, clock, owner="api")  # another instance: no signal reaches `manager`
    turn = await manager.open_turn("s")
    await other.request_stop(turn.id, StopReason(kind=StopReasonKind.USER_CANCEL, initiator="t", at=clock.now()))
    await manager.checkpoint(turn.id, "model_stream")  # cached: not seen yet
    await clock.advance(0.11)
    with pytest.raises(TurnStopped):
        await manager.checkpoint(turn.id, "model_stream")


async def test_limit_stop_is_shown_stopping_then_failed(manager: TurnManager) -> None:
    turn = await manager.open_turn("s", plan=Plan(max_steps=1))
    await manager.checkpoint(turn.id, "before_model")
    with pytest.raises(TurnStopped) as info:
        await manager.checkpoint(turn.id, "before_model")
    res = await manager.stop_for_limit(turn.id, info.value)
    assert res.turn.status is TurnStatus.CANCEL_REQUESTED and res.turn.status.label == "stopping"
    assert res.turn.stop_reason is not None and res.turn.stop_reason.kind is StopReasonKind.MAX_STEPS
    failed = await manager.fail(turn.id, "max_steps")
    assert failed.applied and failed.turn.status is TurnStatus.FAILED
    assert failed.turn.step_count == 2


async def test_a_request_started_before_the_worker_heard_of_a_stop_is_counted(
    manager: TurnManager, counting: CountingStore, clock: VirtualClock
) -> None:
    """requests_after_stop is measured against the stop's stored time, not
    against this process's flag: another instance's stop that the worker had
    not heard of yet still shows."""
    other = TurnManager(counting, clock, owner="api")  # no signal reaches `manager`
    turn = await manager.open_turn("s")
    await other.request_stop(turn.id, StopReason(kind=StopReasonKind.USER_CANCEL, initiator="t", at=clock.now()))
    await clock.advance(0.01)
    await manager.checkpoint(turn.id, "before_model")  # cached flag: the stop is not seen yet
    manager.runtime(turn.id).meter.start_request(10)  # type: ignore[union-attr]
    async with TurnScope(turn.id, clock) as scope:
        scope.stop(None)
        done = await manager.settle_stop(turn.id, scope)
    assert done.status is TurnStatus.CANCELLED
    assert done.usage.requests_after_stop == 1 and done.usage.records[0].started_after_stop
