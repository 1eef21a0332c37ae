"""Cancel scopes on a virtual clock: every child gets the stop's reason and
reports how it ended within the grace; no child outlives its scope; limits
come from the turn's remaining time."""

from __future__ import annotations

import asyncio
import gc
import weakref

import pytest

from clock import SystemClock, VirtualClock, timeout_after
from turn.models import ChildOutcome, StopReason, StopReasonKind, TurnStatus
from turn.scope import NotStarted, TurnScope
from turn.stop_path import terminal_status
from turn.stopped import TurnStopped


def reason(clock: VirtualClock, kind: StopReasonKind = StopReasonKind.USER_CANCEL) -> StopReason:
    return StopReason(kind=kind, initiator="test", at=clock.now())


def others(before: set[asyncio.Task]) -> set[asyncio.Task]:
    return {t for t in asyncio.all_tasks() if t not in before and t is not asyncio.current_task() and not t.done()}


async def test_stop_reaches_every_child_with_its_reason(clock: VirtualClock) -> None:
    before = set(asyncio.all_tasks())
    seen: list[tuple[str, StopReasonKind | None]] = []

    async def child(name: str, scope: TurnScope) -> None:
        try:
            await clock.sleep(100)
        except asyncio.CancelledError:
            seen.append((name, scope.reason.kind if scope.reason else None))
            raise

    async with TurnScope("t1", clock) as scope:
        for name in ("model", "tool:search", "tts", "playout"):
            scope.spawn(name, child(name, scope))
        await clock.advance(1)
        assert scope.stop(reason(clock, StopReasonKind.BARGE_IN))
        assert not scope.stop(reason(clock))  # the first reason stands
        report = await scope.settle()
    assert sorted(seen) == sorted((n, StopReasonKind.BARGE_IN) for n in ("model", "tool:search", "tts", "playout"))
    assert [r.outcome for r in report.children] == [ChildOutcome.STOPPED] * 4
    assert all(r.ms == 0 for r in report.children)  # on the virtual clock they ended at once
    assert terminal_status(report, limit=False) is TurnStatus.CANCELLED
    await asyncio.sleep(0)
    assert not others(before)


async def test_a_child_that_finished_reports_completed(clock: VirtualClock) -> None:
    async def quick() -> int:
        return 42

    async with TurnScope("t1", clock) as scope:
        assert await scope.run("retrieval", quick()) == 42
        scope.stop(reason(clock))
        report = await scope.settle()
    assert report.children[0].outcome is ChildOutcome.COMPLETED and report.children[0].ms is None


async def test_a_child_that_ignores_cancel_is_reported_and_still_awaited(clock: VirtualClock) -> None:
    before = set(asyncio.all_tasks())
    ended = asyncio.Event()

    async def stubborn() -> None:
        # A misbehaving third-party child: swallows cancellation twice.
        for _ in range(3):
            try:
                await clock.sleep(1.0)
            except asyncio.CancelledError:
                continue
        ended.set()

    scope = TurnScope("t1", clock, grace_s=0.25)
    async with scope:
        scope.spawn("model", stubborn())
        await clock.advance(0.1)
        scope.stop(reason(clock))
        settle = asyncio.ensure_future(scope.settle())
        await clock.advance(0.25)
        report = await settle
        assert report.children[0].outcome is ChildOutcome.IGNORED_CANCEL
        assert report.settled_ms == 250 and report.grace_ms == 250
        assert not ended.is_set()
        exit_scope = asyncio.ensure_future(clock.advance(5))
    # leaving the scope waited for the stubborn child: nothing outlives the turn
    assert ended.is_set()
    await exit_scope
    await asyncio.sleep(0)
    assert not others(before)


async def test_a_must_complete_section_finishes_then_the_stop_takes_effect(clock: VirtualClock) -> None:
    writes: list[str] = []

    async def charge() -> str:
        await clock.sleep(0.5)
        writes.append("charged")
        return "ok"

    async def tool(scope: TurnScope) -> None:
        await scope.commit(charge())
        writes.append("after")  # never reached: the stop takes effect after the commit

    async with TurnScope("t1", clock) as scope:
        child = scope.spawn("tool:charge", tool(scope))
        await clock.advance(0.1)
        scope.stop(reason(clock))
        settle = asyncio.ensure_future(scope.settle())
        await clock.advance(0.5)
        report = await settle
        with pytest.raises(TurnStopped):
            await scope.wait(child)
    assert writes == ["charged"]
    assert report.children[0].outcome is ChildOutcome.COMMITTING
    assert terminal_status(report, limit=False) is TurnStatus.RECONCILE_REQUIRED


async def test_commit_never_swallows_cancelled_error(clock: VirtualClock) -> None:
    done: list[str] = []

    async def write() -> None:
        await clock.sleep(0.2)
        done.append("written")

    async def owner(scope: TurnScope) -> None:
        await scope.commit(write(), effect=False)

    async with TurnScope("t1", clock) as scope:
        task = asyncio.ensure_future(owner(scope))
        await clock.advance(0.05)
        task.cancel()
        await clock.advance(0.2)
        with pytest.raises(asyncio.CancelledError):
            await task
    assert done == ["written"]


async def test_child_limit_is_its_own_max_or_the_turns_remaining_time(clock: VirtualClock) -> None:
    deadline = clock.monotonic() + 10
    async with TurnScope("t1", clock, deadline=deadline, shutdown_reserve_s=1.0) as scope:
        assert scope.limit_for(2.0) == (2.0, False)
        assert scope.limit_for(30.0) == (9.0, True)
        assert scope.limit_for(None) == (9.0, True)

        async def slow() -> None:
            await clock.sleep(5)

        child = scope.spawn("tool:slow", slow(), max_s=2.0)
        await clock.advance(2.0)
        with pytest.raises(TimeoutError):
            await scope.wait(child)  # its own limit: the tool failed, the turn goes on
        assert not scope.stopped.is_set()

        child = scope.spawn("model", slow(), max_s=60)  # 7 s left before the reserve
        await clock.advance(5)
        assert child.outcome is ChildOutcome.COMPLETED  # 5 s fit

        child = scope.spawn("model", slow(), max_s=60)  # 2 s left
        await clock.advance(2)
        with pytest.raises(TurnStopped) as info:
            await scope.wait(child)
    assert info.value.kind is StopReasonKind.DEADLINE_EXCEEDED
    assert scope.reason is not None and scope.reason.kind is StopReasonKind.DEADLINE_EXCEEDED


async def test_a_child_that_expects_more_time_than_is_left_does_not_start(clock: VirtualClock) -> None:
    started: list[str] = []

    async def tool() -> None:
        started.append("tool")

    async with TurnScope("t1", clock, deadline=clock.monotonic() + 3, shutdown_reserve_s=0.25) as scope:
        with pytest.raises(NotStarted) as info:
            await scope.run("tool:report", tool(), expected_s=5.0)
    assert started == []
    assert info.value.kind is StopReasonKind.DEADLINE_EXCEEDED
    assert scope.limit is info.value
    assert "5000 ms" in (info.value.detail or "")


async def test_a_child_stopped_before_it_ran_reports_stopped(clock: VirtualClock) -> None:
    async def never() -> None:
        raise AssertionError("ran after the stop")

    async with TurnScope("t1", clock) as scope:
        child = scope.spawn("model", never())
        scope.stop(reason(clock))
        report = await scope.settle()
        with pytest.raises(TurnStopped):
            await scope.wait(child)
    assert report.children[0].outcome is ChildOutcome.STOPPED


async def test_nothing_starts_in_a_stopped_scope(clock: VirtualClock) -> None:
    async def never() -> None:
        raise AssertionError("started after the stop")

    async with TurnScope("t1", clock) as scope:
        scope.stop(reason(clock))
        with pytest.raises(TurnStopped):
            scope.spawn("model", never())


async def test_a_checkpoint_stop_in_one_child_stops_its_siblings(clock: VirtualClock) -> None:
    async def over_budget() -> None:
        await clock.sleep(0.1)
        raise TurnStopped("t1", "model_stream", StopReasonKind.BUDGET_EXCEEDED, "100 of 100 tokens")

    async def speaking() -> None:
        await clock.sleep(100)

    async with TurnScope("t1", clock) as scope:
        scope.spawn("model", over_budget())
        tts = scope.spawn("tts", speaking())
        await clock.advance(0.1)
        report = await scope.settle()
    assert scope.limit is not None and scope.limit.kind is StopReasonKind.BUDGET_EXCEEDED
    assert tts.outcome is ChildOutcome.STOPPED
    assert terminal_status(report, limit=True) is TurnStatus.FAILED


async def test_cancelling_the_owner_cancels_the_children_and_propagates(clock: VirtualClock) -> None:
    before = set(asyncio.all_tasks())
    entered = asyncio.Event()

    async def owner() -> None:
        async with TurnScope("t1", clock) as scope:
            scope.spawn("model", clock.sleep(100))
            entered.set()
            await clock.sleep(100)

    task = asyncio.ensure_future(owner())
    await entered.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    await asyncio.sleep(0)
    assert not others(before)


async def test_timeout_after_converts_only_its_own_cancel(clock: VirtualClock) -> None:
    async def body() -> None:
        async with timeout_after(clock, 1.0):
            await clock.sleep(5)

    task = asyncio.ensure_future(body())
    await clock.advance(1.0)
    with pytest.raises(TimeoutError):
        await task

    task = asyncio.ensure_future(body())
    await clock.advance(0.5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task


async def test_finish_anyway_completes_the_work_and_then_raises_the_cancel() -> None:
    from turn.shield import finish_anyway

    finished = asyncio.Event()

    async def record() -> str:
        await asyncio.sleep(0.05)
        finished.set()
        return "written"

    task = asyncio.ensure_future(finish_anyway(record()))
    await asyncio.sleep(0.01)
    task.cancel()
    await asyncio.sleep(0.01)
    task.cancel()  # a second cancel (a grace running out) changes nothing
    with pytest.raises(asyncio.CancelledError):
        await task
    assert finished.is_set()
    assert await finish_anyway(record()) == "written"  # uncancelled: its result


async def test_a_stopped_turn_is_not_kept_alive_by_the_timers_its_children_started() -> None:
    """asyncio keeps a cancelled timer (an ``asyncio.sleep``, a child's own
    time limit) in its heap, with the context it was started in, until its
    time would have come; that context must not hold the child (and so its
    task, its exception, every frame of its turn) for the turn's deadline."""
    clock = SystemClock()  # real asyncio timers: the virtual clock makes none

    class Session:  # stands in for what a turn's frames hold (a voice session)
        pass

    session = Session()
    kept = weakref.ref(session)

    async def speak(owner: Session) -> None:
        await asyncio.sleep(300)

    async with TurnScope("t1", clock, deadline=clock.monotonic() + 300) as scope:
        scope.spawn("tts", speak(session))  # limited by the deadline: a 300 s alarm too
        await asyncio.sleep(0.01)
        scope.stop(StopReason(kind=StopReasonKind.BARGE_IN, initiator="test", at=clock.now()))
        report = await scope.settle()
    assert report.children[0].outcome is ChildOutcome.STOPPED
    loop = asyncio.get_running_loop()
    assert sum(1 for h in loop._scheduled if h.cancelled() and h.when() > loop.time() + 200) >= 2  # type: ignore[attr-defined]
    del session, scope, report
    gc.collect()
    assert kept() is None
