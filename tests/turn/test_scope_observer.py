"""What a cancel scope tells its observers, on a virtual clock: each
child's start, end, outcome and marks; the stop and its report, a child
that ignored its cancellation included; a failing observer changes
nothing; and the metrics count a forced termination from it."""

from __future__ import annotations

import asyncio
from datetime import datetime, timedelta

from clock import VirtualClock
from turn.models import ChildOutcome, StopReason, StopReasonKind, StopReport
from turn.scope import TurnScope, mark
from turn.scope_observer import ChildRun, ScopeObservers
from web.metrics import Metrics


class Recorder:
    """Everything a scope says, in order."""

    def __init__(self) -> None:
        self.seen: list[tuple[str, object]] = []

    def child_started(self, child: ChildRun) -> None:
        self.seen.append(("started", child))

    def child_ended(self, child: ChildRun) -> None:
        self.seen.append(("ended", child))

    def scope_stopped(self, turn_id: str, reason: StopReason | None, at: datetime) -> None:
        self.seen.append(("stopped", (turn_id, reason, at)))

    def scope_settled(self, turn_id: str, report: StopReport, at: datetime) -> None:
        self.seen.append(("settled", report))

    def turn_noted(self, turn_id: str, name: str, at: datetime) -> None:
        self.seen.append(("noted", name))


class Broken(Recorder):
    def child_started(self, child: ChildRun) -> None:
        raise RuntimeError("telemetry is down")

    def child_ended(self, child: ChildRun) -> None:
        raise RuntimeError("telemetry is down")


async def test_children_marks_stop_and_report_reach_the_observers(clock: VirtualClock) -> None:
    recorder, observers, metrics = Recorder(), ScopeObservers(), Metrics()
    observers.append(Broken())  # raises on every call: logged, never raised into the turn
    observers.append(recorder)
    observers.append(metrics)
    start = clock.now()

    async def model() -> str:
        await clock.sleep(0.2)
        mark("first_token")
        mark("first_token")  # only the first counts
        await clock.sleep(0.3)
        return "done"

    async def stubborn() -> None:
        for _ in range(3):  # swallows its cancellation twice
            try:
                await clock.sleep(1.0)
            except asyncio.CancelledError:
                continue

    async with TurnScope("t1", clock, grace_s=0.25, observer=observers) as scope:
        first = scope.spawn("model", model())
        await clock.advance(0.5)
        assert await scope.wait(first) == "done"
        scope.spawn("tool:lookup", stubborn())
        await clock.advance(0.1)
        stop = StopReason(kind=StopReasonKind.USER_CANCEL, initiator="test", at=clock.now())
        scope.stop(stop)
        settle = asyncio.ensure_future(scope.settle())
        await clock.advance(0.25)
        report = await settle
        again = await scope.settle()  # a stop path that settles twice (voice does): told once
        assert again.children[1].outcome is ChildOutcome.IGNORED_CANCEL
        exit_scope = asyncio.ensure_future(clock.advance(5))
    await exit_scope

    kinds = [k for k, _ in recorder.seen]
    assert kinds == ["started", "ended", "started", "stopped", "settled", "ended"]
    ended_model = recorder.seen[1][1]
    assert isinstance(ended_model, ChildRun) and ended_model.name == "model"
    assert ended_model.outcome is ChildOutcome.COMPLETED and not ended_model.after_stop
    assert ended_model.started_at == start and ended_model.ended_at == start + timedelta(seconds=0.5)
    assert ended_model.marks == (("first_token", start + timedelta(seconds=0.2)),)
    assert recorder.seen[3][1] == ("t1", stop, start + timedelta(seconds=0.6))
    assert recorder.seen[4][1] is report
    assert report.children[1].outcome is ChildOutcome.IGNORED_CANCEL
    tool = recorder.seen[5][1]
    assert isinstance(tool, ChildRun) and tool.name == "tool:lookup" and tool.after_stop

    got = {(s.name, tuple(sorted(s.labels.items()))): s.value for f in metrics.registry.collect() for s in f.samples}
    assert got[("turnkeeper_forced_terminations_total", (("child", "tool"),))] == 1
    assert got[("turnkeeper_model_time_to_first_token_seconds_sum", ())] == 0.2


async def test_no_observer_no_marks(clock: VirtualClock) -> None:
    """Unobserved, a scope keeps no times and a mark is a no-op."""

    async def child() -> None:
        mark("first_token")

    async with TurnScope("t1", clock, observer=ScopeObservers()) as scope:
        c = scope.spawn("model", child())
        await scope.wait(c)
    assert scope.observer is None and c.marks == [] and c.started_at is None
