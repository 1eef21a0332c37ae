"""A stop at every seam of a turn's work, on a virtual clock, through the
real text-turn worker, agent loop, local model, tools and SQLite store:
the terminal state is written from what actually happened, usage is
honest, no model request starts after the stop, and no task leaks."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import pytest

from clock import VirtualClock
from demo_shop.tools import weather_tools
from testkit.faults import CancellationIgnoringModel
from testkit.virtual_time import ThreadWork
from testkit.virtual_time import step as step_when_idle
from turn.manager import TurnManager
from turn.models import ChildOutcome, EventRecord, Plan, StopReason, StopReasonKind, Turn, TurnStatus
from turn.scope import Child
from turn.sqlite_store import SqliteStore
from turn.store import StopAnswer
from voice.llm import COUNT_REPLY, STORY_REPLY, WEATHER_REPLY, LlmConfig, LocalAgent, tokenize
from voice.text_turns import TextTurns
from voice.tools import Toolbox, tool


@dataclass
class Rig:
    clock: VirtualClock
    manager: TurnManager
    turns: TextTurns
    store: SqliteStore
    effects: list[str]
    work: ThreadWork

    async def until(self, predicate: Callable[[], bool], *, step: float = 0.05, limit_s: float = 600) -> None:
        """Advance virtual time in steps, each once the store's thread is
        idle (its I/O takes no virtual time), until ``predicate()``."""
        waited = 0.0
        while not predicate():
            if waited > limit_s:
                raise AssertionError("condition not reached")
            await step_when_idle(self.clock, self.work, step)
            waited += step

    async def settled(self, turn_id: str) -> Turn:
        """Advance until the turn's worker is done; the stored turn."""
        await self.until(lambda: not any(turn_id in s.running for s in self.turns._sessions.values()))
        return await self.manager.get(turn_id)

    async def events(self, session_id: str) -> list[EventRecord]:
        await self.manager.events.log(session_id).flush()
        return await self.store.read_events(session_id)

    def stop(self, kind: StopReasonKind = StopReasonKind.USER_CANCEL) -> StopReason:
        return StopReason(kind=kind, initiator="test", at=self.clock.now())


def make_tools(clock: VirtualClock, effects: list[str]) -> Toolbox:
    box = weather_tools(clock)

    @tool(effect="complete", expected_duration_ms=500, max_duration_ms=5000)
    async def charge_card() -> str:
        """Charge the card on file (must complete once started)."""
        await clock.sleep(0.5)
        effects.append("charged")
        return "charged 5 dollars"

    @tool(effect="none", expected_duration_ms=500)
    async def search_web() -> str:
        """Search the web (safe to abandon)."""
        await clock.sleep(0.5)
        effects.append("searched")
        return "three results"

    @tool(effect="none", expected_duration_ms=5000)
    async def build_report() -> str:
        """Build a long report."""
        await clock.sleep(5)
        effects.append("report")
        return "the report"

    for t in (charge_card, search_web, build_report):
        box.add(t)
    return box


@pytest.fixture
async def rig(store: SqliteStore, clock: VirtualClock) -> AsyncIterator[Rig]:
    before = set(asyncio.all_tasks())
    manager = TurnManager(store, clock, owner="me")
    effects: list[str] = []
    plan = Plan(deadline_s=600)
    r = Rig(clock, manager, None, store, effects, ThreadWork(asyncio.get_running_loop()))  # type: ignore[arg-type]
    r.turns = TextTurns(
        manager,
        lambda: r.model(),
        clock,
        plans=lambda _t: r.plan,
        tools=lambda: make_tools(clock, effects),
    )
    r.plan = plan  # type: ignore[attr-defined]
    r.model = lambda: LocalAgent(LlmConfig(tokens_per_second=20), clock)  # type: ignore[attr-defined]
    yield r
    # close with virtual time still moving: a model that ignores its
    # cancellation ends only when its clock lets it (a failed assertion
    # above must not leave it asleep on a clock nobody advances)
    closing = asyncio.ensure_future(r.turns.aclose())
    for _ in range(20_000):
        if closing.done():
            break
        await clock.advance(0.05)
        await asyncio.sleep(0.001)
    await closing
    r.work.close()
    await asyncio.sleep(0.01)
    leaked = [t for t in asyncio.all_tasks() if t not in before and t is not asyncio.current_task() and not t.done()]
    assert not leaked, f"tasks outlived their turns: {leaked}"


async def test_stop_before_the_first_model_call_starts_no_request(rig: Rig) -> None:
    turn = await rig.turns.start(tenant_id="t", text="tell me a story")
    res = await rig.manager.request_stop(turn.id, rig.stop())  # before its worker ran at all
    assert res.answer is StopAnswer.ACCEPTED
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.CANCELLED
    assert done.usage.model_requests == 0 and done.usage.requests_after_stop == 0
    events = await rig.events(turn.session_id)
    assert not [e for e in events if e.type == "agent.delta"]


async def test_stop_mid_stream_records_partial_usage_and_nothing_after(rig: Rig) -> None:
    turn = await rig.turns.start(tenant_id="t", text="tell me a story")
    await rig.until(
        lambda: (rt := rig.manager.runtime(turn.id)) is not None
        and rt.meter.requests != []
        and rt.meter.requests[0].completion_tokens >= 20
    )
    await rig.manager.request_stop(turn.id, rig.stop())
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.CANCELLED and done.stop_reason.kind is StopReasonKind.USER_CANCEL  # type: ignore[union-attr]
    u = done.usage
    assert u.model_requests == 1 and u.requests_after_stop == 0
    rec = u.records[0]
    assert rec.partial and rec.source == "counted"
    assert 20 <= rec.completion_tokens < len(tokenize(STORY_REPLY)) and rec.completion_tokens_after_stop == 0
    assert rec.prompt_tokens > 0 and done.spent.tokens == rec.prompt_tokens + rec.completion_tokens
    assert done.reply and STORY_REPLY.startswith(done.reply)
    report = {c.name: c.outcome for c in done.stop_report.children}  # type: ignore[union-attr]
    assert report == {"agent": ChildOutcome.STOPPED, "model": ChildOutcome.STOPPED}
    events = await rig.events(turn.session_id)
    deltas = [e for e in events if e.type == "agent.delta"]
    assert len(deltas) == rec.completion_tokens and not any(e.fenced for e in deltas)
    # the turn's event trail: running, stopping, cancelled
    labels = [e.payload["label"] for e in events if e.type == "turn"]
    assert labels[-2:] == ["stopping", "cancelled"]


async def test_stop_while_a_must_complete_tool_commits(rig: Rig) -> None:
    """Between the tool call and its completion write: the write happens,
    the model is not called again, and the turn needs reconciliation."""
    turn = await rig.turns.start(tenant_id="t", text="please call charge_card")
    await rig.until(lambda: any(c.name == "tool:charge_card" and c.committing for c in _children(rig, turn.id)))
    await rig.clock.advance(0.2)  # inside the tool's must-complete section
    await rig.manager.request_stop(turn.id, rig.stop())
    done = await rig.settled(turn.id)
    assert rig.effects == ["charged"]
    assert done.status is TurnStatus.RECONCILE_REQUIRED
    assert done.usage.model_requests == 1 and done.usage.requests_after_stop == 0
    report = {c.name: c.outcome for c in done.stop_report.children}  # type: ignore[union-attr]
    assert report["tool:charge_card"] is ChildOutcome.COMMITTING
    types = [e.type for e in await rig.events(turn.session_id)]
    assert "tool.done" in types, " ".join(types)  # the completion was written


async def test_stop_during_an_abandonable_tool_cancels_it(rig: Rig) -> None:
    turn = await rig.turns.start(tenant_id="t", text="please call search_web")
    await rig.until(lambda: any(c.name == "tool:search_web" for c in _children(rig, turn.id)))
    await rig.manager.request_stop(turn.id, rig.stop())
    done = await rig.settled(turn.id)
    assert rig.effects == [] and done.status is TurnStatus.CANCELLED
    types = [e.type for e in await rig.events(turn.session_id)]
    assert "tool.cancelled" in types and "tool.done" not in types


async def test_stop_after_the_final_step_committed_is_a_no_op(rig: Rig) -> None:
    turn = await rig.turns.start(tenant_id="t", text="count to twenty")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.COMPLETED and done.reply == COUNT_REPLY
    res = await rig.manager.request_stop(turn.id, rig.stop())
    assert res.answer is StopAnswer.ALREADY_TERMINAL
    after = await rig.manager.get(turn.id)
    assert after.status is TurnStatus.COMPLETED and after.reply == COUNT_REPLY and after.stop_reason is None


async def test_a_tool_result_feeds_the_next_model_call(rig: Rig) -> None:
    turn = await rig.turns.start(tenant_id="t", text="what is the weather like")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.COMPLETED and done.reply == WEATHER_REPLY
    assert done.usage.model_requests == 2 and done.step_count == 3  # model, tool, model
    assert all(r.source == "usage_chunk" and not r.partial for r in done.usage.records)
    types = [e.type for e in await rig.events(turn.session_id)]
    assert types.index("tool.started") < types.index("tool.done") < types.index("agent.done")


async def test_deadline_exhaustion_fails_the_turn(rig: Rig) -> None:
    rig.plan = Plan(deadline_s=3, shutdown_reserve_ms=250)  # type: ignore[attr-defined]
    turn = await rig.turns.start(tenant_id="t", text="tell me a story")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.FAILED
    assert done.stop_reason is not None and done.stop_reason.kind is StopReasonKind.DEADLINE_EXCEEDED
    # the model child was cut at deadline minus the reserve: 2.75 s of 20 tokens/s
    assert 50 <= done.usage.completion_tokens <= 56 and done.usage.records[0].partial


async def test_a_tool_that_does_not_fit_the_time_left_is_not_started(rig: Rig) -> None:
    rig.plan = Plan(deadline_s=3)  # type: ignore[attr-defined]
    turn = await rig.turns.start(tenant_id="t", text="please run build_report")
    done = await rig.settled(turn.id)
    assert rig.effects == []
    assert done.status is TurnStatus.FAILED and done.stop_reason.kind is StopReasonKind.DEADLINE_EXCEEDED  # type: ignore[union-attr]
    events = await rig.events(turn.session_id)
    not_started = [e for e in events if e.type == "tool.not_started"]
    assert len(not_started) == 1 and not_started[0].payload["reason"] == "no_budget"
    assert not [e for e in events if e.type == "tool.started"]  # never announced as started
    assert not_started[0].payload["name"] == "build_report"


async def test_budget_exhaustion_fails_the_turn_mid_stream(rig: Rig) -> None:
    rig.plan = Plan(budget_tokens=260, budget_cents=None)  # type: ignore[attr-defined]
    turn = await rig.turns.start(tenant_id="t", text="tell me a story")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.FAILED and done.stop_reason.kind is StopReasonKind.BUDGET_EXCEEDED  # type: ignore[union-attr]
    assert done.spent.tokens == 260 and done.usage.requests_after_stop == 0, done.stop_reason
    rec = done.usage.records[0]
    assert rec.partial and rec.completion_tokens > 0 and rec.completion_tokens_after_stop == 0


async def test_a_model_call_the_budget_cannot_pay_for_is_not_started(rig: Rig) -> None:
    rig.plan = Plan(budget_tokens=3, budget_cents=None)  # type: ignore[attr-defined]  # the prompt alone is more
    turn = await rig.turns.start(tenant_id="t", text="tell me a story")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.FAILED and done.stop_reason.kind is StopReasonKind.BUDGET_EXCEEDED  # type: ignore[union-attr]
    assert done.usage.model_requests == 0 and done.spent.tokens == 0
    assert "left" in (done.stop_reason.detail or "")  # type: ignore[union-attr]


async def test_a_deadline_shorter_than_the_reserve_fails_at_once(rig: Rig) -> None:
    turn = await rig.turns.start(tenant_id="t", text="what is the weather", deadline_s=0.1)
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.FAILED and done.stop_reason.kind is StopReasonKind.DEADLINE_EXCEEDED  # type: ignore[union-attr]
    assert done.usage.model_requests == 0


async def test_a_model_timeout_is_a_failure_not_the_turns_deadline(rig: Rig) -> None:
    class Hangs:
        """A model whose connection times out on its own after 3 s."""

        name = "hangs"
        pricing = LlmConfig().pricing

        async def stream(self, messages, *, tools=None, meter=None):  # type: ignore[no-untyped-def]
            await rig.clock.sleep(3)
            raise TimeoutError("socket read timed out")
            yield ""  # pragma: no cover

    rig.model = lambda: Hangs()  # type: ignore[attr-defined]
    turn = await rig.turns.start(tenant_id="t", text="hello")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.FAILED and done.stop_reason is None
    assert "socket read timed out" in (done.error or "")


async def test_a_stop_during_the_final_write_leaves_the_turn_completed(rig: Rig) -> None:
    """The turn's own bookkeeping is no external effect: a stop landing
    while the reply and COMPLETED are written never makes it
    RECONCILE_REQUIRED."""
    original = rig.manager.record
    entered = asyncio.Event()

    async def slow_record(turn_id, **fields):  # type: ignore[no-untyped-def]
        if fields.get("reply"):
            entered.set()
            await rig.clock.sleep(0.4)
        return await original(turn_id, **fields)

    rig.manager.record = slow_record  # type: ignore[method-assign]
    turn = await rig.turns.start(tenant_id="t", text="count to twenty")
    await rig.until(entered.is_set)
    await rig.manager.request_stop(turn.id, rig.stop())
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.COMPLETED and done.reply == COUNT_REPLY


async def test_loop_detection(rig: Rig) -> None:
    turn = await rig.turns.start(tenant_id="t", text="keep checking the weather")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.FAILED and done.stop_reason.kind is StopReasonKind.LOOP_DETECTED  # type: ignore[union-attr]
    events = await rig.events(turn.session_id)
    assert len([e for e in events if e.type == "tool.done"]) == 2  # the third identical call never ran
    assert done.usage.model_requests == 3


async def test_max_steps(rig: Rig) -> None:
    rig.plan = Plan(max_steps=2)  # type: ignore[attr-defined]
    turn = await rig.turns.start(tenant_id="t", text="keep checking the weather")
    done = await rig.settled(turn.id)
    assert done.status is TurnStatus.FAILED and done.stop_reason.kind is StopReasonKind.MAX_STEPS  # type: ignore[union-attr]
    assert done.usage.model_requests == 1 and done.step_count == 3


async def test_a_provider_that_ignores_cancellation(rig: Rig) -> None:
    """The terminal state is written within the grace anyway, its late
    output never passes the delivery gate, and the waste is recorded."""
    model = CancellationIgnoringModel(LlmConfig(tokens_per_second=10), rig.clock)
    rig.model = lambda: model  # type: ignore[attr-defined]
    turn = await rig.turns.start(tenant_id="t", text="count to twenty")
    await rig.until(
        lambda: (rt := rig.manager.runtime(turn.id)) is not None and rt.meter.requests != [] and rt.meter.requests[0].completion_tokens >= 5
    )
    statuses: list[TurnStatus] = []
    generated_by_then: list[int] = []

    def seen(t: Turn) -> None:
        statuses.append(t.status)
        if t.status is TurnStatus.CANCELLED:
            generated_by_then.append(model.tokens_after_cancel)

    rig.manager.subscribe(turn.session_id, seen)
    stop_at = rig.clock.monotonic()
    await rig.manager.request_stop(turn.id, rig.stop())
    # the terminal write does not wait for the stubborn model: it comes after
    # the grace (0.25 s), while the model is still generating (the bound is
    # a sanity bound: virtual time moves on while the store's thread works)
    await rig.until(lambda: TurnStatus.CANCELLED in statuses, step=0.01)
    assert rig.clock.monotonic() - stop_at <= 0.25 + 1.0  # (the model going on after it, below, is the proof)
    assert model.ignored >= 1
    done = await rig.settled(turn.id)  # the scope still waited for it to end
    assert model.tokens_after_cancel > generated_by_then[0]  # it went on after CANCELLED was written
    assert done.status is TurnStatus.CANCELLED
    report = {c.name: c.outcome for c in done.stop_report.children}  # type: ignore[union-attr]
    assert report["model"] is ChildOutcome.IGNORED_CANCEL
    assert done.usage.completion_tokens_after_stop == model.tokens_after_cancel > 0
    assert done.usage.requests_after_stop == 0
    events = await rig.events(turn.session_id)
    late = [e for e in events if e.type == "agent.delta" and e.at > done.stop_reason.at]  # type: ignore[union-attr]
    assert late and all(e.fenced for e in late)  # logged as evidence, never delivered


def _children(rig: Rig, turn_id: str) -> list[Child]:
    scope = rig.turns.scopes.get(turn_id)
    return scope.children if scope is not None else []
