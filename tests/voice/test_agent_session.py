"""AgentSession with the real providers, fed real speech frame by frame (no
WebRTC): turns, barge-in, fencing and shutdown."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError
from av.audio.frame import AudioFrame
from conftest import plain, requires_espeak

from clock import SystemClock
from demo_shop.service import DemoService
from demo_shop.tools import demo_tools, weather_tools
from media.frames import PLAYOUT_RATE, load_pcm
from media.inbound import InboundAudio
from media.inbound_frame import InboundFrame
from media.outbound import PacedAudioTrack
from media.playout import PlayoutBuffer, PlayoutFrame
from turn.delivery_gate import OUTPUT_TYPES
from turn.event_catalogue import AgentDelta
from turn.events import EventFollower, event_json
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import ChildOutcome, StopReasonKind, TurnStatus
from turn.sqlite_store import SqliteStore
from voice.llm import LocalAgent, LocalLlmConfig
from voice.session import AgentSession, Providers
from voice.transport import CloseNotice, Control, ControlInbox
from voice.tts import EspeakConfig, EspeakSynthesiser
from voice.whisper_stt import WhisperSTT

pytestmark = requires_espeak


class Mic:
    """A paced microphone track: 20 ms frames in real time, silence unless
    an utterance is queued."""

    def __init__(self) -> None:
        self._queue: list[np.ndarray] = []
        self._closed = False
        self._next: float | None = None
        self.idle = asyncio.Event()
        self.idle.set()

    def say(self, pcm48: bytes) -> None:
        x = np.frombuffer(pcm48, dtype="<i2")
        x = np.concatenate([x, np.zeros((-len(x)) % 960, dtype="<i2")])
        self._queue.extend(x[i : i + 960] for i in range(0, len(x), 960))
        self.idle.clear()

    def close(self) -> None:
        self._closed = True

    async def recv(self) -> AudioFrame:
        loop = asyncio.get_running_loop()
        self._next = (self._next or loop.time()) + 0.02
        await asyncio.sleep(max(0.0, self._next - loop.time()))
        if self._closed:
            raise MediaStreamError
        if self._queue:
            chunk = self._queue.pop(0)
        else:
            chunk = np.zeros(960, dtype="<i2")
            self.idle.set()
        frame = AudioFrame.from_ndarray(chunk.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = PLAYOUT_RATE
        return frame


class MicTransport:
    """The transport seam over a :class:`Mic` read by an
    :class:`media.inbound.InboundAudio` (the WebRTC inbound path without a
    peer) and a playout buffer drained by the harness's paced track."""

    kind = "test"

    def __init__(self, output: PlayoutBuffer) -> None:
        self.output = output
        self.inbound: InboundAudio | None = None
        self.inbox = ControlInbox()
        self.closed = CloseNotice()
        self.refused: list[tuple[Control, str]] = []

    def frames(self) -> AsyncIterator[InboundFrame]:
        assert self.inbound is not None
        return self.inbound.frames()

    def controls(self) -> AsyncIterator[Control]:
        return self.inbox.items()

    def refuse(self, control: Control, code: str) -> None:
        self.refused.append((control, code))

    def deliver(self, event: dict[str, Any]) -> None:
        raise AssertionError("the harness follows the log itself")

    def reset_detector(self) -> None:
        assert self.inbound is not None
        self.inbound.detector.reset()

    def on_close(self, callback: Callable[[StopReasonKind], None]) -> None:
        self.closed.subscribe(callback)


class Harness:
    def __init__(self, store: SqliteStore) -> None:
        self.clock = SystemClock()
        self.manager = TurnManager(store, self.clock)
        self.fence = GenerationFence(self.clock)
        self.playout = PlayoutBuffer()
        self.track = PacedAudioTrack(self.playout, self.fence.passes, self.clock)
        self.tts = EspeakSynthesiser()
        self.events: list[dict[str, Any]] = []
        self.log = self.manager.events.log("sess-1", gate=self.fence)
        self.follower = EventFollower(store, "sess-1", gate=self.fence, poll_s=0.5)
        self.mic = Mic()
        self.transport = MicTransport(self.playout)
        self.session = AgentSession(
            session_id="sess-1",
            manager=self.manager,
            providers=Providers(
                stt=WhisperSTT(),
                llm=LocalAgent(LocalLlmConfig(tokens_per_second=20), self.clock),
                tts=self.tts,
                tools=weather_tools(self.clock),
            ),
            transport=self.transport,
            fence=self.fence,
            clock=self.clock,
            emit=self.log.emit_event,
        )
        self.sent_audio: list[tuple[int | None, float]] = []

    async def _drain(self) -> None:
        """Stands in for aiortc's RTP sender: pulls a frame every 20 ms."""
        while True:
            await self.track.recv()

    async def _follow(self) -> None:
        async for batch in self.follower.follow():
            self.events.extend(event_json(e) for e in batch)

    async def start(self, inbound: InboundAudio | None = None) -> None:
        await self.manager.ensure_session("sess-1")
        await self.session.providers.stt.start()
        self.inbound = self.transport.inbound = inbound or InboundAudio(self.mic, self.clock)
        self.run_task = asyncio.create_task(self.session.run())
        self.drain_task = asyncio.create_task(self._drain())
        self.follow_task = asyncio.create_task(self._follow())

    async def stop(self) -> None:
        self.mic.close()
        if not self.run_task.done():
            await asyncio.wait_for(self.run_task, 10)
        self.drain_task.cancel()
        await asyncio.gather(self.drain_task, return_exceptions=True)
        await self.manager.events.close("sess-1")
        self.follow_task.cancel()
        await asyncio.gather(self.follow_task, return_exceptions=True)
        try:
            self.events.extend(event_json(e) for e in await self.follower.read_available())
        except Exception:
            pass  # the store may be down in a test
        await self.session.providers.stt.aclose()

    async def wait_for(self, pred: Callable[[], bool], timeout: float = 20) -> None:
        try:
            async with asyncio.timeout(timeout):
                while not pred():
                    await asyncio.sleep(0.02)
        except TimeoutError:
            seen = [
                (e["type"], e.get("event") or e.get("status") or e.get("text") or e.get("phase"))
                for e in self.events if e["type"] not in ("agent.delta", "usage")
            ]
            raise AssertionError(f"not reached in {timeout} s; events: {seen}") from None

    def turn_events(self) -> list[dict[str, Any]]:
        return [e for e in self.events if e["type"] == "turn"]

    def statuses(self, turn_id: str) -> list[str]:
        return [e["status"] for e in self.turn_events() if e["turn_id"] == turn_id]

    def phase(self, phase: str) -> bool:
        return any(e["type"] == "agent.state" and e["phase"] == phase for e in self.events)


@pytest.fixture
async def harness(store: SqliteStore) -> AsyncIterator[Harness]:
    h = Harness(store)
    await h.start()
    yield h
    if not h.run_task.done():
        await h.stop()


def pcm48(path: Path) -> bytes:
    return load_pcm(path, PLAYOUT_RATE)


async def test_one_turn_answers_and_completes(harness: Harness, say: Callable[..., Path], store: SqliteStore) -> None:
    h = harness
    h.mic.say(pcm48(say("please count to twenty")))
    await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=30)
    [turn] = await store.list_session("sess-1")
    assert turn.status is TurnStatus.COMPLETED and turn.generation == 1
    assert plain(turn.transcript) == "please count to twenty"
    assert turn.reply and turn.reply.startswith("One, two, three")
    assert h.statuses(turn.id) == ["QUEUED", "RUNNING", "COMPLETED"]
    sent = h.track.audit.per_generation[1]
    assert sent.frames > 50  # several seconds of speech went out
    assert [m.role for m in (await h.session.history())] == ["user", "assistant"]
    await h.stop()


async def test_barge_in_stops_old_generation(harness: Harness, say: Callable[..., Path], store: SqliteStore) -> None:
    h = harness
    h.mic.say(pcm48(say("tell me a story")))
    await h.wait_for(lambda: 1 in h.track.audit.per_generation and h.track.audit.per_generation[1].frames > 25)
    tts_running_before = set(h.tts.tts.running)
    h.mic.say(pcm48(say("what is the weather like today")))
    await h.wait_for(lambda: any(e["type"] == "barge_in" for e in h.events))
    # the barge-in cleared the buffer and fenced generation 1 at once
    fenced_at = h.fence.fenced_at(1)
    assert fenced_at is not None
    await h.wait_for(lambda: sum(e.get("status") == "COMPLETED" for e in h.turn_events()) == 1, timeout=30)
    old, new = await store.list_session("sess-1")
    assert old.status is TurnStatus.CANCELLED
    assert old.stop_reason is not None and old.stop_reason.kind is StopReasonKind.BARGE_IN
    assert h.statuses(old.id) == ["QUEUED", "RUNNING", "CANCEL_REQUESTED", "CANCELLED"]
    assert new.status is TurnStatus.COMPLETED and new.generation == 2
    assert plain(new.transcript) == "what is the weather like today" and "sunny" in (new.reply or "")
    assert new.usage.model_requests == 2 and new.step_count == 3  # model, lookup_weather, model
    # every child of the old turn reported to its cancel scope
    assert old.stop_report is not None
    outcomes = {c.name: c.outcome for c in old.stop_report.children}
    assert outcomes["stt"] is ChildOutcome.COMPLETED
    assert outcomes["tts"] is ChildOutcome.STOPPED
    assert outcomes.get("model", ChildOutcome.STOPPED) is ChildOutcome.STOPPED
    assert old.usage.requests_after_stop == 0 and old.usage.model_requests == 1
    # nothing of generation 1 left the server after the fence
    last_old = h.track.audit.per_generation[1].last_sent_at
    assert last_old is not None and last_old <= fenced_at
    # the old turn's TTS subprocess is gone
    assert all(p.returncode is not None for p in tts_running_before)
    # the old reply is in the history, marked interrupted, and is only a prefix
    assistant = [m for m in (await h.session.history()) if m.role == "assistant"]
    assert assistant[0].interrupted and not assistant[1].interrupted
    assert len(old.reply or "") < 300
    # the client was told "stopping" before "cancelled", and that came before the new turn ran
    order = [(e["turn_id"], e["status"]) for e in h.turn_events()]
    assert order.index((old.id, "CANCELLED")) < order.index((new.id, "RUNNING"))
    [barge] = [e for e in h.events if e["type"] == "barge_in"]
    # stage 2 commits once the speech is longer than a backchannel can be
    limit_ms = h.session.config.backchannel.max_ms + 400
    assert barge["old_turn_id"] == old.id and 0 <= barge["onset_to_fence_ms"] < limit_ms
    # ... but the agent went silent at stage 1, long before: playout paused
    onset = h.session.barge_ins[0].onset_at
    assert barge["paused_ms"] > 0 and last_old - onset < 0.3
    # the history keeps exactly what was heard, and it is a prefix of the reply
    heard = assistant[0].content
    assert heard and (old.reply or "").startswith(heard.split()[0]) and heard in " ".join((old.reply or "").split())
    # output made for generation 1 after the fence is logged fenced (kept as
    # evidence) and never sent. The old turn stopped at once, so it made none:
    # emit one as a model that ignored its cancellation would, into the
    # session's own log, and read the raw log, not through the gate under test
    log = h.manager.events.log("sess-1")
    log.emit_event(AgentDelta(generation=1, turn_id=old.id, text=" and then"))
    await log.flush()
    await asyncio.sleep(0.5)  # the client's follower had its chance to send it
    logged = await store.read_events("sess-1", 0, 100_000)
    assert any(e.type == "agent.delta" and e.generation == 1 and not e.fenced for e in logged)  # it did speak before
    late = [e for e in logged if e.type in OUTPUT_TYPES and e.generation == 1 and e.seq > barge["seq"]]
    assert late and late[-1].payload["text"] == " and then"
    assert all(e.fenced for e in late), [(e.seq, e.type, e.payload) for e in late if not e.fenced]
    assert not {e.seq for e in late} & {e["seq"] for e in h.events}
    await h.stop()


async def test_disconnect_mid_answer_is_recorded(harness: Harness, say: Callable[..., Path], store: SqliteStore) -> None:
    h = harness
    h.mic.say(pcm48(say("tell me a story")))
    await h.wait_for(lambda: h.phase("speaking"))
    await h.stop()
    [turn] = await store.list_session("sess-1")
    assert turn.status is TurnStatus.CANCELLED
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.TRANSPORT_DISCONNECTED
    assert not h.tts.tts.running


async def test_cancelled_session_still_settles(harness: Harness, say: Callable[..., Path], store: SqliteStore) -> None:
    h = harness
    h.session.close_reason = StopReasonKind.WORKER_SHUTDOWN
    h.mic.say(pcm48(say("tell me a story")))
    await h.wait_for(lambda: h.phase("thinking") or h.phase("speaking"))
    h.run_task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await h.run_task
    [turn] = await store.list_session("sess-1")
    assert turn.status is TurnStatus.CANCELLED
    assert turn.stop_reason is not None and turn.stop_reason.kind is StopReasonKind.WORKER_SHUTDOWN
    await h.stop()


async def test_noise_opens_no_turn_and_speech_after_it_does(
    harness: Harness, say: Callable[..., Path], store: SqliteStore
) -> None:
    """Broadband noise passes webrtcvad's gate, but the second stage (Silero,
    energy over the noise floor) never confirms it: no turn is written, no
    reply; speech right after it is heard as usual."""
    h = harness
    rng = np.random.default_rng(7)
    noise = (rng.normal(0, 6000, PLAYOUT_RATE).clip(-32000, 32000)).astype("<i2").tobytes()
    h.mic.say(noise)
    await h.wait_for(h.mic.idle.is_set)
    await asyncio.sleep(1.0)  # past the confirmation timeout
    assert await store.list_session("sess-1") == []
    h.mic.say(pcm48(say("hello again")))
    await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=30)
    [turn] = await store.list_session("sess-1")
    assert plain(turn.transcript) == "hello again"
    await h.stop()


async def test_provider_failure_fails_the_turn_with_its_reason(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    h = Harness(store)
    h.session.tts.primary = EspeakSynthesiser(EspeakConfig(executable="/nonexistent/espeak-ng"))
    await h.start()
    try:
        h.mic.say(pcm48(say("please count to twenty")))
        await h.wait_for(lambda: any(e.get("status") == "FAILED" for e in h.turn_events()), timeout=30)
        [turn] = await store.list_session("sess-1")
        assert turn.status is TurnStatus.FAILED
        assert turn.error is not None and turn.error.startswith("SynthesisError:") and "not found" in turn.error
        await h.wait_for(lambda: any(e["type"] == "error" for e in h.events), timeout=5)  # a poll of the log later
        [err] = [e for e in h.events if e["type"] == "error"]
        assert err["code"] == "turn_failed" and err["turn_id"] == turn.id
        # the session goes on: the next utterance is heard and answered (and fails the same way)
        h.mic.say(pcm48(say("tell me a story")))
        await h.wait_for(lambda: sum(e.get("status") == "FAILED" for e in h.turn_events()) == 2, timeout=30)
    finally:
        await h.stop()


def test_describe_error_unwraps_groups() -> None:
    from voice.errors import describe_error

    eg = ExceptionGroup("outer", [ExceptionGroup("inner", [ValueError("bad pcm")])])
    assert describe_error(eg) == "ValueError: bad pcm"
    assert describe_error(RuntimeError("x")) == "RuntimeError: x"


class SlowStore:
    """Wraps the store: while ``delay`` > 0 every call waits that long first;
    while ``down`` every call finds the store unavailable."""

    def __init__(self, inner: SqliteStore) -> None:
        self.inner = inner
        self.delay = 0.0
        self.down = False

    def __getattr__(self, name: str):
        target = getattr(self.inner, name)

        async def call(*args, **kwargs):
            if self.delay:
                await asyncio.sleep(self.delay)
            if self.down:
                from turn.store import StoreUnavailable

                raise StoreUnavailable("sqlite: database is locked")
            return await target(*args, **kwargs)

        return call


async def test_barge_in_while_turn_write_is_slow(store: SqliteStore, say: Callable[..., Path]) -> None:
    """The reviewer's crash: the first turn's record is slow to write, the user
    speaks again before it is; both utterances are recognised and recorded."""
    slow = SlowStore(store)
    h = Harness(slow)  # type: ignore[arg-type]
    await h.start()
    try:
        slow.delay = 1.5
        h.mic.say(pcm48(say("tell me a story")) + bytes(1920 * 35) + pcm48(say("what is the weather like today")))
        await asyncio.sleep(4)
        slow.delay = 0
        await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=40)
        turns = await store.list_session("sess-1")
        # the user paused 0.7 s and went on before hearing any reply: the
        # endpoint had fired, but one reply answers the whole utterance
        assert [plain(t.transcript) for t in turns] == ["tell me a story", "tell me a story what is the weather like today"]
        assert turns[0].status is TurnStatus.CANCELLED and turns[1].status is TurnStatus.COMPLETED
        assert [m.content for m in (await h.session.history()) if m.role == "user"] == [turns[1].transcript]
    finally:
        await h.stop()


async def test_store_outage_does_not_end_the_session(store: SqliteStore, say: Callable[..., Path]) -> None:
    flaky = SlowStore(store)
    h = Harness(flaky)  # type: ignore[arg-type]
    h.manager.store_attempts = 2
    await h.start()
    try:
        h.mic.say(pcm48(say("tell me a story")))
        await h.wait_for(lambda: h.phase("speaking"))
        commit = h.session._commit

        def commit_in_outage(*args, **kwargs):  # type: ignore[no-untyped-def]
            # the barge-in's writes fail (and no event can be logged, so none is sent)
            flaky.down = True
            h.session._commit = commit  # type: ignore[method-assign]
            return commit(*args, **kwargs)

        h.session._commit = commit_in_outage  # type: ignore[method-assign]
        h.mic.say(pcm48(say("please count to twenty")))
        await h.wait_for(lambda: h.mic.idle.is_set() and h.session._listening is None)
        await asyncio.sleep(2)  # its writes are retried, then given up
        assert not h.run_task.done()  # the session goes on
        flaky.down = False
        h.mic.say(bytes(1920 * 40) + pcm48(say("what is the weather like today")))
        await h.wait_for(
            lambda: any(e.get("status") == "COMPLETED" and "weather" in (e.get("transcript") or "") for e in h.turn_events()),
            timeout=40,
        )
    finally:
        await h.stop()
    # after the session, no turn is left open, and the barge-in's stop was
    # recorded once the store was back: with its own reason, not the hang-up's
    turns = await store.list_session("sess-1")
    assert all(t.is_terminal for t in turns)
    story = next(t for t in turns if plain(t.transcript) == "tell me a story")
    assert story.status is TurnStatus.CANCELLED
    assert story.stop_reason is not None and story.stop_reason.kind is StopReasonKind.BARGE_IN


async def test_answer_heard_in_full_is_not_cancelled(harness: Harness, say: Callable[..., Path], store: SqliteStore) -> None:
    """The user speaks during the short pause after the agent's last word:
    the reply was heard in full, so it completes; the new words start a new
    turn rather than a barge-in."""
    h = harness
    h.mic.say(pcm48(say("please count to twenty")))
    await h.wait_for(lambda: any(r.tts_done for r in h.session._runs), timeout=30)
    h.drain_task.cancel()  # hold playout still, as if at the very end of the reply
    await asyncio.gather(h.drain_task, return_exceptions=True)
    [run] = [r for r in h.session._runs if r.tts_done]
    while h.playout.audible_pending(run.generation):
        h.playout.pop()  # everything with sound has been played
    assert len(h.playout) > 0  # only the trailing pause is left
    h.drain_task = asyncio.create_task(h._drain())
    h.mic.say(pcm48(say("what is the weather like today")))
    await h.wait_for(lambda: sum(e.get("status") == "COMPLETED" for e in h.turn_events()) == 2, timeout=40)
    first, second = await store.list_session("sess-1")
    assert first.status is TurnStatus.COMPLETED and first.stop_reason is None
    assert second.status is TurnStatus.COMPLETED
    assert not [e for e in h.events if e["type"] == "barge_in"]
    await h.stop()


def test_audible_pending() -> None:
    buf = PlayoutBuffer()
    buf.push(PlayoutFrame(bytes(1920), 1, audible=False))
    assert not buf.audible_pending(1)
    buf.push(PlayoutFrame(bytes(1920), 1, audible=True))
    assert buf.audible_pending(1) and not buf.audible_pending(2)


async def test_barge_in_during_a_tool_call_follows_the_ledger_rules(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    """A voice barge-in while create_order is in flight (the shop has not
    written it): the order follows its class, a reversal, which first looks
    the key up and finds nothing to reverse, so it is recorded "not done"
    (abandoned, no compensation run), never "done, then reversed"; the turn
    ends CANCELLED, and the new turn is answered; the same rules as a REST
    stop (issue 10.5)."""
    h = Harness(store)
    service = DemoService(h.clock, latency_s=0.02)
    service.slow_s = 3.0
    service.inject("order", "slow")  # a slow shop: the barge-in lands mid-call
    tools = demo_tools(h.clock, service, store)
    h.manager.ledger.handlers = tools.get
    h.session.providers.tools = tools
    await h.start()
    try:
        h.mic.say(pcm48(say("please order a coffee")))
        await h.wait_for(lambda: any(e["type"] == "tool.intent" for e in h.events), timeout=30)
        # later than a pause inside one utterance: this is a new turn
        await asyncio.sleep(h.session.config.endpoint.continue_window_ms / 1000)
        h.mic.say(pcm48(say("hello again")))
        await h.wait_for(lambda: sum(e.get("status") == "COMPLETED" for e in h.turn_events()) == 1, timeout=40)
        old, new = await store.list_session("sess-1")
        assert plain(old.transcript) == "please order a coffee" and old.stop_reason.kind is StopReasonKind.BARGE_IN  # type: ignore[union-attr]
        assert old.status is TurnStatus.CANCELLED
        rows = {i.kind.value: i for i in await store.ledger_list(old.id)}
        assert rows["effect"].tool == "create_order" and rows["effect"].status.value == "abandoned"
        assert "compensation" not in rows  # looked up first: absent, nothing to reverse
        assert await service.applied(old.id) == {}  # the shop never wrote it
        assert "confirmed absent by lookup" in (await store.audit_list(rows["effect"].key))[-1].detail
        assert new.status is TurnStatus.COMPLETED and plain(new.transcript) == "hello again"
        assert any(e["type"] == "tool.abandoned" for e in h.events)
        assert not any(e["type"] == "tool.compensated" for e in h.events)
        # nothing of the old reply was played, so the history holds none of it
        history = [(m.role, m.tool_calls[0].name if m.tool_calls else plain(m.content or "") if m.role == "user" else m.content)
                   for m in await h.session.history()]
        assert history[:2] == [("user", "please order a coffee"), ("assistant", "create_order")]
        assert history[2] == ("tool", "cancelled: it was not done") and history[3] == ("user", "hello again")
    finally:
        await h.stop()
        await service.aclose()
