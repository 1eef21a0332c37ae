"""The per-turn handle alone (no audio, no providers): one stop recorded
once, a stop deferred past a must-complete commit, CancelledError never
swallowed, and the session-end settle of a turn never written."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import pytest

from clock import VirtualClock
from turn.event_catalogue import Envelope
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import Plan, RecognitionRecord, StopReason, StopReasonKind, TurnStatus
from turn.scope import TurnScope
from turn.sqlite_store import SqliteStore
from turn.usage import Pricing, RequestMeter
from voice.providers import Message, ToolCall
from voice.respond import run_agent
from voice.tools import Toolbox, tool
from voice.turn_handle import TurnContext, TurnHandle


class Stt:
    """A recogniser stream that heard ``text``."""

    def __init__(self, text: str = "hello there") -> None:
        self.text = text
        self.closed = False

    def feed(self, pcm: bytes) -> None:
        pass

    async def finish(self) -> str:
        return self.text

    async def aclose(self) -> None:
        self.closed = True

    def usage(self) -> list[RecognitionRecord]:
        return [RecognitionRecord(provider="test", audio_s=1.5, cents=0.25)]


class Session:
    """What a voice session gives its turns, recorded."""

    def __init__(self, manager: TurnManager, clock: VirtualClock, tg: asyncio.TaskGroup) -> None:
        self.events: list[tuple[str, dict[str, Any]]] = []
        self.silenced: list[TurnHandle] = []
        self.told: list[TurnHandle] = []
        self.ctx = TurnContext(
            session_id="s1", manager=manager, clock=clock, grace_ms=250, shutdown_reserve_s=0.0,
            spawn=tg.create_task, fence=GenerationFence(clock), report=self.report,
            heard_split=lambda run: ("", ""), silence=self.silenced.append, on_stopping=lambda run: None,
            tell_interrupted=self.told.append,
        )

    def report(self, event: Envelope, *, withheld: bool = False) -> None:
        self.events.append((event.type, event.model_dump(exclude_unset=True, exclude={"type"})))

    def turn(self, generation: int = 1) -> TurnHandle:
        return TurnHandle(self.ctx, generation, Stt())


@pytest.fixture
async def manager(store: SqliteStore) -> AsyncIterator[TurnManager]:
    m = TurnManager(store, VirtualClock())
    await m.ensure_session("s1")
    yield m


def start(run: TurnHandle, tg: asyncio.TaskGroup, answer: Any, plan: Plan | None = None) -> None:
    run.open_task = tg.create_task(run.write(None, plan=plan or Plan(), pricing=Pricing()))
    run.work = tg.create_task(run.work_on(answer))
    run.end_utterance(1.0)


async def test_the_first_stop_is_the_one_recorded(manager: TurnManager) -> None:
    clock = manager.clock
    speaking = asyncio.Event()

    async def answer(run: TurnHandle, scope: TurnScope, turn: Any) -> None:
        async def model() -> None:
            speaking.set()
            await asyncio.Event().wait()

        await scope.run("model", model())

    async with asyncio.TaskGroup() as tg:
        s = Session(manager, clock, tg)  # type: ignore[arg-type]
        run = s.turn()
        start(run, tg, answer)
        await speaking.wait()
        barge = StopReason(kind=StopReasonKind.BARGE_IN, initiator="vad", at=clock.now())
        task = run.stop(barge)
        assert run.stop(StopReason(kind=StopReasonKind.USER_CANCEL, initiator="user", at=clock.now())) is task
        await task
    turn = await manager.get(run.turn_id)
    assert turn.status is TurnStatus.CANCELLED
    assert turn.stop_reason is not None and turn.stop_reason.request_id == barge.request_id
    assert turn.transcript == "hello there"  # heard, though stopped before the reply
    # its words were recognised (and billed) before the stop: on its record, counted in its spending
    assert turn.usage.recognition == [RecognitionRecord(provider="test", audio_s=1.5, cents=0.25)]
    assert turn.spent.cents == 0.25
    assert run.settled and run.finished and run.stt.closed  # type: ignore[attr-defined]
    assert s.told == [run] and s.events[-1][0] == "agent.state"  # the interrupted reply was reported, once
    assert [(c.name, c.outcome.value) for c in turn.stop_report.children] == [("model", "stopped")]  # type: ignore[union-attr]


async def test_a_stop_during_a_commit_takes_effect_when_it_ends(manager: TurnManager) -> None:
    clock = manager.clock
    paying, paid = asyncio.Event(), asyncio.Event()

    async def answer(run: TurnHandle, scope: TurnScope, turn: Any) -> None:
        async def pay() -> None:
            paying.set()
            await paid.wait()

        async def tool() -> None:
            await scope.commit(pay())

        await scope.run("tool", tool())

    async with asyncio.TaskGroup() as tg:
        s = Session(manager, clock, tg)  # type: ignore[arg-type]
        run = s.turn()
        start(run, tg, answer)
        await paying.wait()
        asked = clock.now()
        assert run.committing
        task = run.stop(StopReason(kind=StopReasonKind.BARGE_IN, initiator="vad", at=asked))
        await asyncio.sleep(0.01)
        assert run.scope is not None and not run.scope.stopped.is_set() and not run.work.done()  # type: ignore[union-attr]
        await clock.advance(2.0)
        paid.set()
        await task
    turn = await manager.get(run.turn_id)
    assert turn.status is TurnStatus.CANCELLED
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.BARGE_IN
    assert (turn.stop_reason.at - asked).total_seconds() == pytest.approx(2.0)  # timed when it took effect


async def test_a_cancelled_work_raises_and_a_checkpoint_stop_is_recorded(manager: TurnManager) -> None:
    clock = manager.clock
    async with asyncio.TaskGroup() as tg:
        s = Session(manager, clock, tg)  # type: ignore[arg-type]
        run = s.turn()
        waiting = asyncio.Event()

        async def answer(run: TurnHandle, scope: TurnScope, turn: Any) -> None:
            waiting.set()
            await asyncio.Event().wait()

        start(run, tg, answer)
        await waiting.wait()
        run.work.cancel()  # type: ignore[union-attr]
        with pytest.raises(asyncio.CancelledError):
            await run.work  # type: ignore[misc]
        assert run.finished and run.stop_task is None and s.told == [run]
        # the session's end settles it, with the reason it closes for
        await run.settle(StopReasonKind.TRANSPORT_DISCONNECTED, clock.now())
    turn = await manager.get(run.turn_id)
    assert turn.status is TurnStatus.CANCELLED and turn.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED  # type: ignore[union-attr]


async def test_a_turn_never_written_is_recorded_and_cancelled_at_session_end(manager: TurnManager) -> None:
    async with asyncio.TaskGroup() as tg:
        run = Session(manager, manager.clock, tg).turn(generation=3)  # type: ignore[arg-type]
    await run.settle(StopReasonKind.WORKER_SHUTDOWN, manager.clock.now())
    turn = await manager.get(run.turn_id)
    assert turn.is_terminal and turn.generation == 3
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.WORKER_SHUTDOWN


class Waiting:
    """A model that says one word (or calls ``tool``) and then waits; once
    stopped it records that it stopped generating, then takes
    ``teardown_s`` real seconds to close, as a connection does."""

    name = "waiting"

    def __init__(self, tool: str | None = None, teardown_s: float = 0.02) -> None:
        self.pricing = Pricing()
        self.tool, self.teardown_s = tool, teardown_s
        self.started = asyncio.Event()

    async def stream(self, messages: list[Message], *, tools: Any = None, meter: RequestMeter | None = None) -> AsyncIterator[Any]:
        assert meter is not None
        if self.tool is not None and not any(m.role == "tool" for m in messages):
            meter.chunk()
            yield ToolCall(id="c1", name=self.tool)
            meter.finish(partial=False)
            return
        try:
            meter.chunk()
            yield "Once "
            self.started.set()
            await asyncio.Event().wait()
        finally:
            meter.finish(partial=True, provider_stopped=True)  # it knows it stopped generating
            await asyncio.sleep(self.teardown_s)  # and then closes its connection


def agent_with_a_waiting_tool(manager: TurnManager, llm: Waiting) -> tuple[Callable[..., Awaitable[None]], asyncio.Event]:
    """A turn's work that runs the agent loop on ``llm`` with one tool,
    ``wait``, that never answers; and the event set once it is called."""
    calling = asyncio.Event()

    @tool(name="wait")
    async def wait(*, idempotency_key: str, turn_id: str) -> str:
        calling.set()
        await asyncio.Event().wait()
        return "never"

    async def answer(run: TurnHandle, scope: TurnScope, turn: Any) -> None:
        await run_agent(
            scope=scope, manager=manager, turn_id=turn.id, generation=run.generation, llm=llm,
            messages=[Message(role="user", content="hi")], toolbox=Toolbox([wait]),
            on_token=lambda token, withheld=False: None, on_event=run.output,
        )

    return answer, calling


@pytest.mark.parametrize("what", ["model", "tool"])
async def test_what_a_stopped_turn_tells_comes_before_its_terminal_state(manager: TurnManager, what: str) -> None:
    """A model request's usage and a cancelled tool call are told by the
    call itself as it ends, so they come before the turn's CANCELLED
    however late the turn's own task unwinds (CI once saw a barge-in's usage
    arrive after the terminal state, lost to its trace)."""
    clock = manager.clock
    told: list[tuple[str, dict[str, Any]]] = []  # what the turn told its session, and its states, in order

    def tap(ev: Any) -> None:
        if ev.type == "turn":
            told.append((f"turn {ev.payload.get('status')}", ev.payload))

    manager.events.taps.append(tap)
    llm = Waiting(tool="wait" if what == "tool" else None)
    answer, calling = agent_with_a_waiting_tool(manager, llm)

    async with asyncio.TaskGroup() as tg:
        s = Session(manager, clock, tg)  # type: ignore[arg-type]
        s.events = told
        run = s.turn()
        start(run, tg, answer)
        await (calling.wait() if what == "tool" else llm.started.wait())
        await run.stop(StopReason(kind=StopReasonKind.BARGE_IN, initiator="vad", at=clock.now()))
        await asyncio.sleep(0.1)  # whatever the turn's task still tells as it unwinds
    turn = await manager.get(run.turn_id)
    assert turn.status is TurnStatus.CANCELLED
    order = [name for name, _ in told]
    last = "tool.cancelled" if what == "tool" else "usage"
    assert last in order and order.index(last) < order.index("turn CANCELLED"), order
    if what == "model":
        [usage] = [payload for name, payload in told if name == "usage"]
        assert usage["partial"] and usage["after_stop"] == "confirmed", (usage, order)  # as the provider recorded it


async def test_a_tool_call_cut_off_by_the_deadline_is_cancelled_not_an_error(manager: TurnManager) -> None:
    """A limit that stops the scope while a tool runs (the turn's task is
    not cancelled: it is no child of the scope) tells ``tool.cancelled``
    and never a ``tool.error`` carrying the stop."""
    clock = manager.clock
    answer, calling = agent_with_a_waiting_tool(manager, Waiting(tool="wait"))

    async with asyncio.TaskGroup() as tg:
        s = Session(manager, clock, tg)  # type: ignore[arg-type]
        run = s.turn()
        run.open_task = tg.create_task(run.write(None, plan=Plan(deadline_s=5), pricing=Pricing()))
        run.work = tg.create_task(run.work_on(answer))
        run.end_utterance(1.0)
        await calling.wait()
        await clock.advance(10)
        async with asyncio.timeout(10):
            while not run.settled:
                await asyncio.sleep(0.01)
    tools = [name for name, _ in s.events if name.startswith("tool.")]
    assert tools == ["tool.started", "tool.cancelled"], tools
    assert (await manager.get(run.turn_id)).is_terminal


async def test_a_limit_the_turn_hits_is_its_stop_reason(manager: TurnManager) -> None:
    """What recognising the words cost (0.25 cents) is over the plan's
    budget (0.1): the first model request's checkpoint stops the turn, and
    it ends FAILED budget_exceeded, as a text turn does (a voice turn told
    it as a user_cancel from a "signal": a reviewer's find)."""
    model_called = False

    async def answer(run: TurnHandle, scope: TurnScope, turn: Any) -> None:
        nonlocal model_called
        await run.final_transcript()
        run.note_recognition()
        await manager.checkpoint(turn.id, "before_model", expected_tokens=10)
        model_called = True

    async with asyncio.TaskGroup() as tg:
        s = Session(manager, manager.clock, tg)  # type: ignore[arg-type]
        run = s.turn()
        start(run, tg, answer, Plan(budget_cents=0.1))
        await run.work
        assert run.stop_task is not None
        await run.stop_task
    turn = await manager.get(run.turn_id)
    assert not model_called
    assert turn.status is TurnStatus.FAILED and turn.stop_reason is not None
    assert turn.stop_reason.kind is StopReasonKind.BUDGET_EXCEEDED and turn.stop_reason.initiator == "checkpoint"
    assert turn.spent.cents == 0.25
