"""The ledger through real text turns, on a virtual clock: the embedded
agent's demo tools against the in-process external system, stops in the
middle of each kind of effect, downstream messages of a stopped turn, the
events a client sees, and the tool history the next model call gets."""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import AsyncIterator
from dataclasses import dataclass

import pytest

from clock import VirtualClock
from demo_shop.service import DemoService
from demo_shop.tools import MESSAGES_QUEUE, demo_tools, message_sender
from testkit.virtual_time import ThreadWork, step
from turn.downstream import DownstreamWorker
from turn.intents import IntentKind, IntentStatus
from turn.manager import TurnManager
from turn.models import Plan, StopReason, StopReasonKind, Turn, TurnStatus
from turn.sqlite_store import SqliteStore
from voice.llm import LlmConfig, LocalAgent
from voice.providers import Message
from voice.text_turns import TextTurns


class RecordingAgent(LocalAgent):
    """The embedded agent, keeping what each request was sent."""

    seen: list[list[Message]] = []

    async def stream(self, messages, *, tools=None, meter=None):  # type: ignore[no-untyped-def]
        RecordingAgent.seen.append(list(messages))
        async for item in super().stream(messages, tools=tools, meter=meter):
            yield item


@dataclass
class Flow:
    clock: VirtualClock
    manager: TurnManager
    turns: TextTurns
    store: SqliteStore
    service: DemoService
    work: ThreadWork

    async def until(self, pred, limit_s: float = 300) -> None:  # type: ignore[no-untyped-def]
        """Advance the clock until ``pred()`` (a bool, or an awaitable of one)
        holds, 10 ms at a time, each once the store's and the shop's threads
        are idle: their I/O takes no virtual time, so a bound never fires
        because the machine is loaded (the shop's 0.3 s answer leaves 0.2 s
        of a stop's 0.5 s bound)."""
        waited = 0.0
        while not await _holds(pred()):
            assert waited < limit_s, "condition not reached"
            await step(self.clock, self.work, 0.01)
            waited += 0.01

    async def settled(self, turn_id: str) -> Turn:
        await self.until(lambda: turn_id not in self.turns.scopes and not any(turn_id in s.running for s in self.turns._sessions.values()))
        return await self.manager.get(turn_id)

    async def start(self, text: str, session_id: str | None = None) -> Turn:
        return await self.turns.start(tenant_id="t", text=text, session_id=session_id)

    async def stop(self, turn_id: str, kind: StopReasonKind = StopReasonKind.USER_CANCEL) -> None:
        await self.manager.request_stop(turn_id, StopReason(kind=kind, initiator="test", at=self.clock.now()))

    async def event_types(self, session_id: str) -> list[str]:
        await self.manager.events.log(session_id).flush()
        return [e.type for e in await self.store.read_events(session_id)]


async def _holds(value: object) -> bool:
    return bool(await value) if inspect.isawaitable(value) else bool(value)


async def sent_after_tool(flow: Flow, turn_id: str, name: str) -> bool:
    """The tool ``name`` of ``turn_id`` has returned and the shop applied
    something of the turn."""
    return not in_tool(flow, turn_id, name) and bool(await flow.service.applied(f"{turn_id}:"))


@pytest.fixture
async def flow(store: SqliteStore, clock: VirtualClock) -> AsyncIterator[Flow]:
    service = DemoService(clock, latency_s=0.3)
    manager = TurnManager(store, clock, owner="me")
    tools = demo_tools(clock, service, store)
    manager.ledger.handlers = tools.get
    RecordingAgent.seen = []
    turns = TextTurns(
        manager, lambda: RecordingAgent(LlmConfig(tokens_per_second=50), clock), clock,
        plans=lambda _t: Plan(), tools=lambda: tools,
    )
    work = ThreadWork(asyncio.get_running_loop())
    yield Flow(clock, manager, turns, store, service, work)
    await turns.aclose()
    await service.aclose()
    work.close()


def in_tool(flow: Flow, turn_id: str, name: str) -> bool:
    scope = flow.turns.scopes.get(turn_id)
    return scope is not None and any(c.name == f"tool:{name}" and not c.done.is_set() for c in scope.children)


async def test_an_order_completes_and_the_ledger_shows_it(flow: Flow) -> None:
    turn = await flow.start("please order a coffee")
    done = await flow.settled(turn.id)
    assert done.status is TurnStatus.COMPLETED and "order for a coffee is placed" in (done.reply or "")
    [intent] = await flow.store.ledger_list(turn.id)
    assert intent.key == f"{turn.id}:2" and intent.status is IntentStatus.DONE and intent.effect == "compensate"
    applied = await flow.service.applied(turn.id)
    assert list(applied) == [intent.key]  # applied once, under the intent's own key
    assert applied[intent.key]["payload"] == {"item": "a coffee"} and not applied[intent.key]["reversed"]
    types = await flow.event_types(turn.session_id)
    assert types.index("tool.intent") < types.index("tool.done")


async def test_a_stop_before_the_order_was_sent_abandons_it(flow: Flow, monkeypatch: pytest.MonkeyPatch) -> None:
    original = flow.store.ledger_add

    async def slow_add(intent):  # type: ignore[no-untyped-def]
        await flow.clock.sleep(0.5)  # a slow store: the stop lands while the intent is written
        return await original(intent)

    monkeypatch.setattr(flow.store, "ledger_add", slow_add)
    turn = await flow.start("please order a coffee")
    await flow.until(lambda: in_tool(flow, turn.id, "create_order"))
    await flow.clock.advance(0.1)
    await flow.stop(turn.id)
    done = await flow.settled(turn.id)
    assert done.status is TurnStatus.CANCELLED
    rows = await flow.store.ledger_list(turn.id)
    assert all(i.status is IntentStatus.ABANDONED for i in rows)
    assert await flow.service.applied(turn.id) == {}


async def test_a_stop_mid_order_the_shop_never_wrote_is_not_done(flow: Flow) -> None:
    """Issue 10.5: the order was sent, the stop cut the call off before the
    shop wrote anything. The reversal looks the key up first: absent, so
    the order is recorded "not done" (abandoned), no compensation runs, and
    nobody is told it was done, then reversed."""
    turn = await flow.start("please order a coffee")
    await flow.until(lambda: f"{turn.id}:2" in flow.service.received)  # sent; the shop takes 0.3 s to answer
    await flow.stop(turn.id)
    done = await flow.settled(turn.id)
    assert done.status is TurnStatus.CANCELLED
    [row] = await flow.store.ledger_list(turn.id)
    assert row.kind is IntentKind.EFFECT and row.status is IntentStatus.ABANDONED  # no compensation job either
    assert [a.detail for a in await flow.store.audit_list(row.key)][-2:] == ["absent", "not done: confirmed absent by lookup"]
    assert await flow.service.applied(turn.id) == {}
    types = await flow.event_types(turn.session_id)
    assert "tool.effect_unknown" in types and "tool.abandoned" in types and "tool.compensated" not in types


async def test_a_stop_after_the_order_keeps_it_and_a_safety_abort_reverses_it(flow: Flow) -> None:
    """A user's stop while the agent talks about the placed order is a
    no-op for that committed step (issue 10's seed: not a rollback); a
    safety abort at the same moment reverses it."""
    for kind, reversed_ in ((StopReasonKind.USER_CANCEL, False), (StopReasonKind.SAFETY_ABORT, True)):
        turn = await flow.start("please order a coffee")
        await flow.until(lambda t=turn.id: flow.service.applied(t))
        await flow.until(lambda t=turn.id: not in_tool(flow, t, "create_order"))
        await flow.stop(turn.id, kind)
        done = await flow.settled(turn.id)
        assert done.status is TurnStatus.CANCELLED  # nothing happened after the stop
        [(key, effect)] = (await flow.service.applied(turn.id)).items()
        assert effect["reversed"] is reversed_
        status = (await flow.store.ledger_get(key)).status
        assert status is (IntentStatus.COMPENSATED if reversed_ else IntentStatus.DONE)


async def test_a_safety_abort_during_a_payment_lets_it_finish_and_needs_reconciliation(flow: Flow) -> None:
    turn = await flow.start("please pay")
    # the payment is committing (sent, not yet answered) when the stop lands
    await flow.until(lambda: in_tool(flow, turn.id, "charge_payment") and any(
        c.committing for c in flow.turns.scopes[turn.id].children))
    await flow.stop(turn.id, StopReasonKind.SAFETY_ABORT)
    done = await flow.settled(turn.id)
    assert done.status is TurnStatus.RECONCILE_REQUIRED
    [intent] = await flow.store.ledger_list(turn.id)
    assert intent.status is IntentStatus.DONE and await flow.service.times_applied(intent.key) == 1
    assert done.usage.model_requests == 1  # no model call after the stop


async def test_queued_messages_of_a_stopped_turn_are_skipped(flow: Flow) -> None:
    sender = message_sender(flow.service, flow.store, flow.clock, consumer="t")
    turn = await flow.start("please send five messages")
    await flow.until(lambda: sent_after_tool(flow, turn.id, "send_messages"))
    await flow.stop(turn.id)  # the batch is queued; none is sent yet
    stopped = await flow.settled(turn.id)
    assert stopped.status is TurnStatus.CANCELLED  # the batch was recorded before the stop, and nothing went out after it
    await _run(flow, sender.run_once(10))
    assert sender.skipped == 5 and sender.done == 0
    assert [e["op"] for e in (await flow.service.applied(turn.id)).values()] == ["batch"]
    # a turn that completes has all its messages sent
    other = await flow.start("please send three messages")
    assert (await flow.settled(other.id)).status is TurnStatus.COMPLETED
    await _run(flow, sender.run_once(10))
    assert sender.done == 3 and await flow.store.queue_pending(MESSAGES_QUEUE) == 0


async def test_the_next_model_call_sees_a_consistent_tool_history(flow: Flow) -> None:
    first = await flow.start("please order a coffee")
    await flow.until(lambda: f"{first.id}:2" in flow.service.received)  # the order is on its way to the shop
    await flow.stop(first.id)
    await flow.settled(first.id)
    second = await flow.start("what is the weather", session_id=first.session_id)
    done = await flow.settled(second.id)
    assert done.status is TurnStatus.COMPLETED
    sent = RecordingAgent.seen[-2]  # the second turn's first request
    tool_messages = [m for m in sent if m.role == "tool"]
    assert tool_messages and tool_messages[0].status == "abandoned"
    [effect] = [i for i in await flow.store.ledger_list(first.id) if i.kind is IntentKind.EFFECT]
    assert effect.status is IntentStatus.ABANDONED  # the history says what the ledger says
    assert tool_messages[0].content == "cancelled: it was not done"  # and what the shop confirms
    # the finished weather lookup of this turn is used, not run again
    assert len([i for i in await flow.store.ledger_list(second.id) if i.tool == "lookup_weather"]) == 1


async def _run(flow: Flow, coro):  # type: ignore[no-untyped-def]
    task = asyncio.ensure_future(coro)
    await flow.until(task.done)
    return task.result()


async def test_a_shutdown_during_a_payment_records_the_stop_first_and_resolves_the_ledger(flow: Flow) -> None:
    flow.service.slow_s = 2.0
    flow.service.inject("payment", "slow")
    turn = await flow.start("please pay")
    await flow.until(lambda: in_tool(flow, turn.id, "charge_payment") and any(
        c.committing for c in flow.turns.scopes[turn.id].children))
    closing = asyncio.ensure_future(flow.turns.aclose())  # the server shuts down mid-payment
    await flow.until(closing.done)
    done = await flow.manager.get(turn.id)
    assert done.stop_reason is not None and done.stop_reason.kind is StopReasonKind.WORKER_SHUTDOWN
    [row] = await flow.store.ledger_list(turn.id)
    assert row.status is IntentStatus.DONE and row.done_at is not None and row.done_at > done.stop_reason.at
    assert done.status is TurnStatus.RECONCILE_REQUIRED  # the payment committed after the stop
    assert await flow.service.times_applied(row.key) == 1 and done.stop_report is not None


async def test_a_message_on_its_way_when_the_stop_lands_is_recorded_and_the_turn_is_honest(flow: Flow) -> None:
    """Issue 10.6: the stop is recorded while the worker is sending the
    second message. That one was on its way (its intent written first): it
    lands, the ledger records it done after the stop, and the turn is
    RECONCILE_REQUIRED, never CANCELLED "no effect after the stop". The
    messages after it are never sent."""
    stop_at: list = []  # type: ignore[type-arg]

    async def send(item):  # type: ignore[no-untyped-def]
        if item["key"].endswith(":1") and not stop_at:
            stop_at.append(flow.clock.now())
            await flow.stop(item["turn_id"])  # lands mid-send
            await flow.clock.sleep(0.01)  # the provider takes 10 ms to accept it
        await flow.service.apply("message", item["key"], {"text": item.get("text", "")})

    flow.service.latency_s = 0.0  # messages go out while the reply still streams
    sender = DownstreamWorker(flow.store, MESSAGES_QUEUE, send, flow.clock, consumer="t")
    sending = asyncio.ensure_future(sender.run(poll_s=0.01))
    try:
        turn = await flow.start("please send five messages")
        stopped = await flow.settled(turn.id)
        await flow.until(lambda: sender.done + sender.skipped == 5)
    finally:
        sending.cancel()
        await asyncio.wait([sending])
    assert stopped.status is TurnStatus.RECONCILE_REQUIRED
    messages = {k: v for k, v in (await flow.service.applied(turn.id)).items() if v["op"] == "message"}
    assert sorted(k.rsplit(":", 1)[1] for k in messages) == ["0", "1"] and sender.skipped == 3
    rows = {i.key: i for i in await flow.store.ledger_list(turn.id)}
    late = rows[next(k for k in messages if k.endswith(":1"))]
    assert late.status is IntentStatus.DONE and late.done_at is not None and late.done_at > stop_at[0]
    assert all(k not in rows or rows[k].status is IntentStatus.ABANDONED for k in (f"{turn.id}:2:{i}" for i in (2, 3, 4)))


async def test_a_stop_between_the_intent_and_the_send_skips_the_message(flow: Flow, monkeypatch: pytest.MonkeyPatch) -> None:
    """The other side of the handshake: the stop lands right after the
    worker wrote the item's intent, before it sends. The worker reads the
    turn again, abandons the intent and sends nothing; the turn is
    CANCELLED, the ledger says "not sent"."""
    sender = message_sender(flow.service, flow.store, flow.clock, consumer="t")
    turn = await flow.start("please send five messages")
    await flow.until(lambda: sent_after_tool(flow, turn.id, "send_messages"))
    original = sender.ledger.intent

    async def intent_then_stop(*args, **kw):  # type: ignore[no-untyped-def]
        row = await original(*args, **kw)
        await flow.stop(turn.id)
        return row

    monkeypatch.setattr(sender.ledger, "intent", intent_then_stop)
    await _run(flow, sender.run_once(1))
    stopped = await flow.settled(turn.id)
    assert sender.done == 0 and sender.skipped == 1
    assert [e["op"] for e in (await flow.service.applied(turn.id)).values()] == ["batch"]
    [row] = [i for i in await flow.store.ledger_list(turn.id) if i.tool == MESSAGES_QUEUE]
    assert row.status is IntentStatus.ABANDONED
    assert stopped.status is TurnStatus.CANCELLED


async def test_an_order_answered_before_the_stop_is_kept_however_late_its_record(flow: Flow, monkeypatch: pytest.MonkeyPatch) -> None:
    """The shop answered before the barge-in was recorded, but the ledger's
    write of that answer is slow (queued behind the stop's own writes, a
    busy store). The step committed when the call answered: it is kept,
    never looked up and reversed as if it had been in flight."""
    ledger = flow.manager.ledger
    original = ledger.settle_late
    answered: list = []  # type: ignore[type-arg]

    async def slow_settle(key, status, **fields):  # type: ignore[no-untyped-def]
        if not answered:
            answered.append(flow.clock.now())
            await flow.clock.sleep(0.2)  # the store is busy: the write waits its turn
        return await original(key, status, **fields)

    monkeypatch.setattr(ledger, "settle_late", slow_settle)
    turn = await flow.start("please order a coffee")
    await flow.until(lambda: bool(answered))
    await flow.clock.advance(0.05)
    await flow.stop(turn.id, StopReasonKind.BARGE_IN)  # after the answer, before its record
    done = await flow.settled(turn.id)
    [row] = await flow.store.ledger_list(turn.id)
    assert row.status is IntentStatus.DONE and row.done_at == answered[0]  # when the shop answered
    assert done.stop_reason is not None and row.done_at < done.stop_reason.at
    assert not any(e["reversed"] for e in (await flow.service.applied(turn.id)).values())
    assert done.status is TurnStatus.CANCELLED  # nothing happened after the stop


async def test_a_newer_message_is_told_what_the_turn_it_superseded_did(flow: Flow) -> None:
    """A second message in the same session while the first is still
    answering supersedes it (a barge-in). The second turn's model request is
    built once the first has ended: it holds the first reply as far as it
    was delivered, marked interrupted, and each tool call as the ledger
    finally has it, never a snapshot from mid-stop."""
    story = await flow.start("tell me a story")
    t0 = flow.clock.monotonic()
    await flow.until(lambda: flow.clock.monotonic() - t0 >= 0.5)  # mid-reply
    weather = await flow.start("what is the weather", session_id=story.session_id)
    await flow.settled(weather.id)
    old = await flow.manager.get(story.id)
    assert old.status is TurnStatus.CANCELLED and old.reply
    first = next(r for r in RecordingAgent.seen if r[-1].content == "what is the weather")
    assert [(m.role, m.content) for m in first] == [
        ("user", "tell me a story"), ("assistant", old.reply), ("user", "what is the weather"),
    ]
    assert first[1].interrupted

    order = await flow.start("please order a coffee", session_id=story.session_id)
    await flow.until(lambda: f"{order.id}:2" in flow.service.received)  # the order is on its way
    hello = await flow.start("hello there", session_id=story.session_id)
    await flow.settled(hello.id)
    [row] = [i for i in await flow.store.ledger_list(order.id) if i.kind is IntentKind.EFFECT]
    request = next(r for r in RecordingAgent.seen if r[-1].content == "hello there")
    [told] = [m for m in request if m.role == "tool" and m.tool_call_id == row.key]
    assert told.status == row.status.value == "abandoned"  # as it ended, not "being checked"


async def test_no_model_request_starts_while_the_stop_is_being_written(flow: Flow, monkeypatch: pytest.MonkeyPatch) -> None:
    """The stop's time is taken, its write is slow (a busy store), and the
    turn reaches its next model call meanwhile: that call is not started
    (requests_after_stop stays 0, as the README promises)."""
    original = flow.store.request_stop

    async def slow_stop(*args, **kw):  # type: ignore[no-untyped-def]
        await flow.clock.sleep(0.6)  # longer than the order's 0.3 s
        return await original(*args, **kw)

    monkeypatch.setattr(flow.store, "request_stop", slow_stop)
    turn = await flow.start("please order a coffee")
    await flow.until(lambda: in_tool(flow, turn.id, "create_order"))
    stopping = asyncio.ensure_future(flow.stop(turn.id))  # the order answers while this is written
    done = await flow.settled(turn.id)
    await stopping
    assert done.usage.requests_after_stop == 0 and done.usage.model_requests == 1
    assert not any(r.started_after_stop for r in done.usage.records)
