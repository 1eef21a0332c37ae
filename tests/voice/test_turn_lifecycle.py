"""Issue 12.3: one turn lifecycle for voice and text. The same request
answered, failed by the model, or cancelled by the user mid-reply ends the
same way whichever transport it came in on: the same sequence of turn
states in the event log, the same closing event (``agent.done``, or
``error`` turn_failed), the same stored record (reply as received, error,
stop reason, usage). Voice goes through the WAV transport (real speech,
real detector, played audio recorded); text through TextTurns on the same
kind of store."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import requires_espeak
from test_wav_transport import Call

from clock import SystemClock
from turn.events import EventFollower, EventRecord, event_json
from turn.manager import TurnManager
from turn.models import StopReason, StopReasonKind, Turn, TurnStatus
from turn.sqlite_store import SqliteStore
from turn.usage import RequestMeter
from voice.llm import STORY_REPLY, LocalAgent, LocalLlmConfig
from voice.providers import LanguageModel, Message, ToolCall, ToolSpec
from voice.text_turns import TextTurns
from voice.tools import Toolbox

pytestmark = requires_espeak


class BrokenModel:
    """The embedded agent until its ``after``-th token, then the provider
    fails (a 5xx mid-stream)."""

    name = "broken"

    def __init__(self, inner: LanguageModel, after: int = 3) -> None:
        self.inner = inner
        self.pricing = inner.pricing
        self.after = after

    async def stream(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, meter: RequestMeter | None = None
    ) -> AsyncIterator[str | ToolCall]:
        n = 0
        async for item in self.inner.stream(messages, tools=tools, meter=meter):
            if n == self.after:
                raise RuntimeError("provider error 503: overloaded")
            n += 1
            yield item


def statuses(events: list[dict[str, Any]], turn_id: str) -> list[str]:
    """The turn's states as its ``turn`` events told them, in order."""
    return [e["status"] for e in events if e["type"] == "turn" and e.get("turn_id") == turn_id]


def closing(events: list[dict[str, Any]], turn_id: str) -> list[tuple[str, str]]:
    """The turn's ``agent.done`` and ``error`` events: (type, text or code)."""
    return [
        (e["type"], e.get("text") or e.get("code") or "")
        for e in events
        if e.get("turn_id") == turn_id and e["type"] in ("agent.done", "error")
    ]


def record(turn: Turn) -> dict[str, Any]:
    """What the store says of a turn, as far as it must not depend on the transport."""
    return {
        "status": turn.status,
        "error": turn.error,
        "stop": turn.stop_reason.kind if turn.stop_reason else None,
        "initiator": turn.stop_reason.initiator if turn.stop_reason else None,
        "spent_tokens": (turn.spent.tokens or 0) > 0,
        "stop_report": turn.stop_report is not None,
    }


async def by_voice(
    store: SqliteStore, say: Callable[..., Path], text: str, *, model: Callable[[LanguageModel], LanguageModel],
    cancel_after_frames: int | None = None,
) -> tuple[Turn, list[dict[str, Any]]]:
    """``text`` spoken into a WAV-transport call; returns its turn once
    terminal and the events the client was delivered."""
    call = Call(store)
    call.session.providers.llm = model(call.session.providers.llm)
    await call.start()
    try:
        call.transport.play(say(text))
        if cancel_after_frames is not None:
            await call.wait_for(lambda: len(call.transport.audible(1)) > cancel_after_frames, timeout=30)
            [turn] = await store.list_session("wav-1")
            reason = StopReason(kind=StopReasonKind.USER_CANCEL, initiator="user", at=call.clock.now())
            await call.manager.request_stop(turn.id, reason)

        async def ended() -> bool:
            turns = await store.list_session("wav-1")
            return bool(turns) and turns[0].is_terminal

        async with asyncio.timeout(40):
            while not await ended():
                await asyncio.sleep(0.05)
        await asyncio.sleep(0.3)  # its closing events reach the client
    finally:
        await call.hang_up()
    [turn] = await store.list_session("wav-1")
    return turn, call.events


async def by_text(
    store: SqliteStore, text: str, *, model: Callable[[LanguageModel], LanguageModel], cancel_after_chars: int | None = None
) -> tuple[Turn, list[dict[str, Any]]]:
    """``text`` posted as a text turn; returns its turn once terminal and
    the session's events as a client following its log reads them."""
    clock = SystemClock()
    manager = TurnManager(store, clock)
    llm = model(LocalAgent(LocalLlmConfig(tokens_per_second=20), clock))
    turns = TextTurns(manager, llm=lambda: llm, clock=clock, tools=lambda: Toolbox([]))
    try:
        turn = await turns.start(tenant_id="default", text=text, session_id="text-1")
        if cancel_after_chars is not None:
            async with asyncio.timeout(20):
                while sum(len(e.payload.get("text", "")) for e in await log(store) if e.type == "agent.delta") < cancel_after_chars:
                    await asyncio.sleep(0.05)
            reason = StopReason(kind=StopReasonKind.USER_CANCEL, initiator="user", at=clock.now())
            await manager.request_stop(turn.id, reason)
        async with asyncio.timeout(40):
            while not (await store.get(turn.id)).is_terminal or turn.id in turns.scopes:
                await asyncio.sleep(0.05)
    finally:
        await turns.aclose()
    return await store.get(turn.id), [event_json(e) for e in await log(store)]


async def log(store: SqliteStore) -> list[EventRecord]:
    """The text session's log as a client following it from the start reads it."""
    return await EventFollower(store, "text-1").read_available()


def same(model: LanguageModel) -> LanguageModel:
    return model


@pytest.fixture
async def store2(tmp_path: Path) -> AsyncIterator[SqliteStore]:
    s = SqliteStore(tmp_path / "text" / "turns.db")
    await s.open()
    yield s
    await s.close()


async def test_a_completed_turn_ends_the_same_way_by_voice_and_by_text(
    store: SqliteStore, store2: SqliteStore, say: Callable[..., Path]
) -> None:
    spoken, heard = await by_voice(store, say, "what is the weather like today", model=same)
    typed, shown = await by_text(store2, "what is the weather like today", model=same)
    assert statuses(heard, spoken.id) == statuses(shown, typed.id) == ["QUEUED", "RUNNING", "COMPLETED"]
    assert record(spoken) == record(typed) == {
        "status": TurnStatus.COMPLETED, "error": None, "stop": None, "initiator": None, "spent_tokens": True, "stop_report": False,
    }
    assert spoken.reply == typed.reply and spoken.reply
    assert closing(heard, spoken.id) == closing(shown, typed.id) == [("agent.done", spoken.reply)]


async def test_a_model_failure_fails_the_turn_the_same_way_by_voice_and_by_text(
    store: SqliteStore, store2: SqliteStore, say: Callable[..., Path]
) -> None:
    """The provider fails mid-reply: FAILED with its description, and the
    client is told (``error`` turn_failed) on both transports; before issue
    12.3 a text client only saw the state change."""
    spoken, heard = await by_voice(store, say, "tell me a story", model=BrokenModel)
    typed, shown = await by_text(store2, "tell me a story", model=BrokenModel)
    assert statuses(heard, spoken.id) == statuses(shown, typed.id) == ["QUEUED", "RUNNING", "FAILED"]
    assert record(spoken) == record(typed)
    assert spoken.error is not None and "overloaded" in spoken.error
    assert closing(heard, spoken.id) == closing(shown, typed.id) == [("error", "turn_failed")]


async def test_a_user_cancel_mid_reply_ends_the_same_way_by_voice_and_by_text(
    store: SqliteStore, store2: SqliteStore, say: Callable[..., Path]
) -> None:
    """A stop from the REST API while the reply is going out: CANCEL_REQUESTED
    then CANCELLED, reason user_cancel, a stop report, and the reply stored
    is a true beginning of what was generated (what was received), the rest
    kept apart (voice: the synthesised audio not yet played)."""
    spoken, heard = await by_voice(store, say, "tell me a story", model=same, cancel_after_frames=40)
    typed, shown = await by_text(store2, "tell me a story", model=same, cancel_after_chars=30)
    assert statuses(heard, spoken.id) == statuses(shown, typed.id) == ["QUEUED", "RUNNING", "CANCEL_REQUESTED", "CANCELLED"]
    assert record(spoken) == record(typed) == {
        "status": TurnStatus.CANCELLED, "error": None, "stop": StopReasonKind.USER_CANCEL, "initiator": "user",
        "spent_tokens": True, "stop_report": True,
    }
    for turn in (spoken, typed):  # what was received: a true beginning of the story, well short of its end
        assert turn.reply and STORY_REPLY.startswith(turn.reply) and len(turn.reply) < len(STORY_REPLY) // 2
    # voice: what was synthesised but not yet played is kept apart (text
    # deltas are delivered as they come: nothing of them waits unseen)
    assert spoken.reply_unheard and STORY_REPLY.startswith(f"{spoken.reply} {spoken.reply_unheard}")
    assert not [c for c in closing(heard, spoken.id) if c[0] == "agent.done"]
    assert not [c for c in closing(shown, typed.id) if c[0] == "agent.done"]
