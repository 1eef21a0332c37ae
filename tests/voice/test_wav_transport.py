"""A second transport through the seam alone: the agent session on a
:class:`testkit.wav_transport.WavTransport` (speech from WAVs through the
real barge-in detector, the output recorded as played), with the real
providers. A turn answered, a barge-in (the recording goes silent, the old
turn ends CANCELLED barge_in, the new one answers), push-to-talk and abort
as controls."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import pytest
from conftest import plain, requires_espeak

from clock import SystemClock
from demo_shop.tools import weather_tools
from testkit.wav_transport import WavTransport
from turn.events import EventFollower, event_json
from turn.generation import GenerationFence
from turn.log_content import set_log_content
from turn.manager import TurnManager
from turn.models import StopReasonKind, TurnStatus
from turn.sqlite_store import SqliteStore
from voice.llm import LocalAgent, LocalLlmConfig
from voice.session import AgentSession, Providers
from voice.transport import ControlKind
from voice.tts import EspeakSynthesiser
from voice.whisper_stt import WhisperSTT

pytestmark = requires_espeak

#: a sanity bound (s) from the barge-in speech's first frame to the last sound
#: of the old reply in the recording (stage 1 pauses it at speech_started)
SILENT_WITHIN_S = 1.0


class Call:
    """One call on a WavTransport: the session, its log followed and
    delivered to the transport (the seam's event output)."""

    def __init__(self, store: SqliteStore) -> None:
        self.clock = SystemClock()
        self.manager = TurnManager(store, self.clock)
        self.fence = GenerationFence(self.clock)
        self.transport = WavTransport(self.clock, self.fence.passes)
        self.follower = EventFollower(store, "wav-1", gate=self.fence, poll_s=0.2)
        self.session = AgentSession(
            session_id="wav-1",
            manager=self.manager,
            providers=Providers(
                stt=WhisperSTT(),
                llm=LocalAgent(LocalLlmConfig(tokens_per_second=20), self.clock),
                tts=EspeakSynthesiser(),
                tools=weather_tools(self.clock),
            ),
            transport=self.transport,
            fence=self.fence,
            clock=self.clock,
            emit=self.manager.events.log("wav-1", gate=self.fence).emit_event,
        )

    @property
    def events(self) -> list[dict[str, Any]]:
        return self.transport.delivered

    async def _follow(self) -> None:
        async for batch in self.follower.follow():
            for ev in batch:
                self.transport.deliver(event_json(ev))

    async def start(self) -> None:
        await self.manager.ensure_session("wav-1")
        await self.session.providers.stt.start()
        self.run_task = asyncio.create_task(self.session.run())
        self.follow_task = asyncio.create_task(self._follow())
        await self.wait_for(lambda: any(e["type"] == "session.ready" for e in self.events))

    async def hang_up(self) -> None:
        self.transport.close()
        await asyncio.wait_for(self.run_task, 10)
        await self.manager.events.close("wav-1")
        self.follow_task.cancel()
        await asyncio.gather(self.follow_task, return_exceptions=True)
        for ev in await self.follower.read_available():
            self.transport.deliver(event_json(ev))
        await self.session.providers.stt.aclose()

    async def wait_for(self, pred: Callable[[], bool], timeout: float = 20) -> None:
        try:
            async with asyncio.timeout(timeout):
                while not pred():
                    await asyncio.sleep(0.02)
        except TimeoutError:
            seen = [(e["type"], e.get("event") or e.get("status") or e.get("phase")) for e in self.events
                    if e["type"] not in ("agent.delta", "usage")]
            raise AssertionError(f"not reached in {timeout} s; events: {seen}") from None

    def completed(self) -> int:
        return sum(e["type"] == "turn" and e["status"] == "COMPLETED" for e in self.events)


@pytest.fixture
async def call(store: SqliteStore) -> AsyncIterator[Call]:
    c = Call(store)
    await c.start()
    yield c
    if not c.run_task.done():
        await c.hang_up()


async def test_a_turn_is_answered_and_its_audio_recorded(call: Call, say: Callable[..., Path], store: SqliteStore) -> None:
    call.transport.play(say("please count to twenty"))
    await call.wait_for(lambda: call.completed() == 1, timeout=30)
    [turn] = await store.list_session("wav-1")
    assert turn.status is TurnStatus.COMPLETED and plain(turn.transcript) == "please count to twenty"
    assert turn.reply and turn.reply.startswith("One, two, three")
    # the reply's audio is in the recording, as played (seconds of speech),
    # and the played position the session cut "heard" at is the recording's
    audible = call.transport.audible(turn.generation)
    assert len(audible) > 50
    played = [t for t in call.transport.played if t.generation == turn.generation]
    assert call.transport.output.played_samples(turn.generation) == len(played) * 960
    assert any(max(t.pcm) > 0 for t in audible)
    await call.hang_up()
    assert call.transport.utterances_at and not call.transport.refused


async def test_a_barge_in_silences_the_recording_and_the_new_turn_answers(
    call: Call, say: Callable[..., Path], store: SqliteStore
) -> None:
    t = call.transport
    t.play(say("tell me a story"))
    await call.wait_for(lambda: len(t.audible(1)) > 25, timeout=30)
    t.play(say("what is the weather like today"))
    await call.wait_for(lambda: any(e["type"] == "barge_in" for e in call.events))
    onset = t.utterances_at[-1]
    await call.wait_for(lambda: call.completed() == 1, timeout=30)
    old, new = await store.list_session("wav-1")
    assert old.status is TurnStatus.CANCELLED
    assert old.stop_reason is not None and old.stop_reason.kind is StopReasonKind.BARGE_IN
    assert new.status is TurnStatus.COMPLETED and new.generation == 2
    assert plain(new.transcript) == "what is the weather like today" and "sunny" in (new.reply or "")
    # in what was played: the story went silent soon after the speech began,
    # nothing of it after the fence, and the new answer was heard
    fenced_at = call.fence.fenced_at(1)
    assert fenced_at is not None
    last_story = t.audible(1)[-1].at
    assert last_story - onset < SILENT_WITHIN_S
    assert not t.audible(1, since=fenced_at + 0.001)
    assert len(t.audible(2, since=fenced_at)) > 25
    await call.hang_up()


async def test_push_to_talk_and_abort_arrive_as_controls(call: Call, say: Callable[..., Path], store: SqliteStore) -> None:
    t = call.transport
    assert t.press(ControlKind.PTT_END)
    await call.wait_for(lambda: len(t.refused) == 1)
    assert t.refused[0][0].kind is ControlKind.PTT_END and t.refused[0][1] == "ptt_not_active"
    assert t.press(ControlKind.PTT_START)  # nothing playing: opens a turn, no VAD
    await call.wait_for(lambda: call.session.ptt_active)
    t.play(say("tell me a story"))
    await call.wait_for(t.idle.is_set)
    assert t.press(ControlKind.PTT_END)
    await call.wait_for(lambda: len(t.audible(1)) > 25, timeout=30)
    [story] = await store.list_session("wav-1")
    assert plain(story.transcript) == "tell me a story"
    # abort: the reply stops at once (user_cancel) and the recording goes silent
    assert t.press(ControlKind.ABORT)
    pressed = call.clock.monotonic()
    await call.wait_for(lambda: any(e["type"] == "turn" and e["status"] == "CANCELLED" for e in call.events))
    [story] = await store.list_session("wav-1")
    assert story.stop_reason is not None and story.stop_reason.kind is StopReasonKind.USER_CANCEL
    assert story.stop_reason.initiator == "user"
    assert not t.audible(1, since=pressed + 0.1)
    assert len(t.refused) == 1
    await call.hang_up()
    assert not t.press(ControlKind.PTT_START)  # the call is over: no session takes it
    assert t.refused[-1][1] == "session_not_ready"


@pytest.mark.parametrize("on", [False, True])
async def test_a_voice_turn_logs_what_was_said_only_with_log_content(
    on: bool, call: Call, say: Callable[..., Path], store: SqliteStore, caplog: pytest.LogCaptureFixture
) -> None:
    """Issue 16: every logger at DEBUG, a spoken turn answered: neither the
    transcript nor the reply is in any record, unless ``log_content``."""
    caplog.set_level(logging.DEBUG)
    set_log_content(on)
    try:
        call.transport.play(say("please count to twenty"))
        await call.wait_for(lambda: call.completed() == 1, timeout=30)
        await call.hang_up()
    finally:
        set_log_content(False)
    [turn] = await store.list_session("wav-1")
    assert plain(turn.transcript) == "please count to twenty" and turn.reply
    logs = "\n".join(caplog.handler.format(r) + repr(r.args) for r in caplog.records)
    assert any(r.name.startswith("turn.") and r.levelno == logging.DEBUG for r in caplog.records)
    assert (turn.transcript in logs) is on
    assert (turn.reply[:20] in logs) is on
