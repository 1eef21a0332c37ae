"""The per-turn handle of a voice session: one turn's in-memory state while
the session works on it, its work's lifecycle (:meth:`TurnHandle.work_on`),
and the one way it is stopped and settled.

Every stop goes through :meth:`TurnHandle.stop` (a barge-in, a stop asked
from outside, a stop a checkpoint found) and every session end through
:meth:`TurnHandle.settle`; between them, a turn reaches exactly one terminal
state and its stop is recorded once:

- ``stop(reason)`` gives every child of the turn's cancel scope the reason,
  cancels its work (unless called from the work itself) and starts the one
  *stop task* that writes CANCEL_REQUESTED, waits a bounded grace for the
  work to end and writes the terminal state. A later call changes nothing
  and returns the same task. While a must-complete commit is under way the
  stop waits for it, and is timed when it takes effect.
- ``settle(kind, at)``: the session is ending; the turn gets a terminal
  state now, with the stop decided earlier or else ``kind``, even if it was
  never written (it is then recorded, and cancelled before start).

CancelledError is never swallowed: the stop task's bounded waits shield only
the turn's record being written.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Awaitable, Callable, Coroutine
from dataclasses import dataclass, field
from datetime import datetime, timedelta
from typing import Any, Literal

from tenacity import AsyncRetrying, retry_if_exception_type, stop_after_delay, wait_exponential

from clock import Clock
from media.playout import PlayoutFrame
from turn.event_catalogue import AgentPhase, AgentState, Envelope, ErrorCode, ErrorEvent
from turn.events import EventSink
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import Plan, StopReason, StopReasonKind, Turn, TurnStatus
from turn.runtime import TurnRuntime
from turn.scope import TurnScope
from turn.stopped import TurnStopped
from turn.store import StoreUnavailable, UnknownTurn
from turn.usage import Pricing
from voice.dtmf import DigitStream
from voice.errors import describe_error, first_error, stopped_by
from voice.synthesis import SynthesisStream
from voice.transcription import Utterance
from voice.transport import OutputSink
from voice.turn_lifecycle import fail, open_scope, record_late_usage

log = logging.getLogger(__name__)

#: how long a stop that the store would not take is retried, s
STOP_RETRY_S = 300.0
#: how long a stopped turn's final usage waits for its synthesiser's acknowledgement of the stop, s
CONFIRM_WAIT_S = 1.0


@dataclass(frozen=True)
class TurnContext:
    """What every turn of one session shares to work, stop and settle.

    Attributes:
        session_id: the session (for a turn written only at its end).
        manager: the Turn Manager (authority for turn states).
        clock: time source (stop times, retry backoff).
        grace_ms: how long a stopped turn's work may take to wind down
            before its terminal state is written anyway, ms.
        shutdown_reserve_s: time kept back from every child of a turn for
            its own wind-down, s (``turn.models.Plan.shutdown_reserve_ms``).
        spawn: starts a task in the session's task group.
        fence: the session's generation fence (a turn's ``error`` is told
            in its active generation).
        report: sends a session event (a catalogue model, its generation
            and turn set).
        heard_split: a turn's reply as (heard, unheard) text
            (:meth:`voice.heard.Hearing.split`).
        silence: a stop from outside, or found by a checkpoint: silences the
            turn's audio at once if it is the reply being heard.
        on_stopping: the store took the turn's stop (here, or heard from
            another instance): silences its audio if it is still playing.
        tell_interrupted: tells the client, once, how much of the turn's
            interrupted reply was heard.
    """

    session_id: str
    manager: TurnManager
    clock: Clock
    grace_ms: int
    shutdown_reserve_s: float
    spawn: Callable[[Coroutine[Any, Any, None]], asyncio.Task[None]]
    fence: GenerationFence
    report: EventSink
    heard_split: Callable[[TurnHandle], tuple[str, str]]
    silence: Callable[[TurnHandle], None]
    on_stopping: Callable[[TurnHandle], None]
    tell_interrupted: Callable[[TurnHandle], None]


#: what a turn's work does once its utterance ended (see :meth:`TurnHandle.work_on`)
Answer = Callable[["TurnHandle", TurnScope, Turn], Awaitable[None]]


@dataclass(eq=False)
class TurnHandle:
    """In-memory handle of one turn while its session works on it.

    ``turn_id`` is chosen before the record is written so that a stop can
    always find the turn, whatever moment it arrives at.
    """

    ctx: TurnContext
    generation: int
    #: the user's input: their utterance as the recogniser hears it, or keys
    stt: Utterance | DigitStream
    turn_id: str = field(default_factory=lambda: uuid.uuid4().hex)
    utterance_ended: asyncio.Event = field(default_factory=asyncio.Event)
    #: the STT final, started the moment the utterance ends
    stt_final: asyncio.Future[str] | None = None
    #: writes the turn; None as result if the store refused it
    open_task: asyncio.Task[Turn | None] | None = None
    #: waits for a stop asked from outside (REST, another instance)
    watch_task: asyncio.Task[None] | None = None
    #: the stop decided for it (kept until it is recorded)
    stop_reason: StopReason | None = None
    #: every frame of its reply is queued for playout
    tts_done: bool = False
    work: asyncio.Task[None] | None = None
    #: the turn's cancel scope, once its work has started
    scope: TurnScope | None = None
    #: its runtime here (deadline, budget, usage meter), kept past the
    #: terminal write for :func:`voice.turn_lifecycle.record_late_usage`
    runtime: TurnRuntime | None = None
    #: records its stop (see :meth:`stop`)
    stop_task: asyncio.Task[None] | None = None
    transcript: str | None = None
    reply: list[str] = field(default_factory=list)
    #: each clause spoken whole: (first sample, end sample, text); samples
    #: at 48 kHz from the start of this generation's audio
    spoken: list[tuple[int, int, str]] = field(default_factory=list)
    #: the reply's synthesis streams, once ended (their usage and stops)
    synthesis_streams: list[SynthesisStream] = field(default_factory=list)
    #: the synthesiser's word timings, where it gives them: (first sample, end sample, word)
    spoken_words: list[tuple[int, int, str]] = field(default_factory=list)
    #: the clause whose audio was still arriving: (first sample, last sample received, text)
    spoken_open: tuple[int, int, str] | None = None
    #: an earlier turn whose reply was never heard: this one answers both
    #: utterances as one (the user paused, the endpoint fired, they went on)
    continues: TurnHandle | None = None
    #: its words went into a later turn (see ``continues``)
    merged: bool = False
    #: it started a tool with an external effect ("complete" or
    #: "compensate"): it acted on the words, so they are not merged away (a
    #: read is abandoned on the merge, as if it had never run)
    acted: bool = False
    #: clock seconds when the user's speech in it ended (None: not yet)
    speech_end_at: float | None = None
    #: clock seconds when its STT final started (the endpoint fired)
    stt_started_at: float | None = None
    phase: AgentPhase | Literal["listening"] = "listening"
    finished: bool = False
    #: the client was told how much of its interrupted reply was heard
    told_interrupted: bool = False
    #: its terminal state is in the store (or it was never written)
    settled: bool = False
    #: what recognising its words cost is on its meter
    recognition_noted: bool = False
    #: the end of its utterance is confirmed: its output may be delivered
    #: and its audio played, and its side effects may run (set when the
    #: utterance ends, unless it ended tentatively: then by :meth:`confirm`)
    confirmed: asyncio.Event = field(default_factory=asyncio.Event)
    #: its reply started at a tentative end of turn (DESIGN.md "speculative turn")
    speculative: bool = False
    #: stopped before its end of turn was confirmed: its output is logged
    #: fenced, never delivered, and its audio dropped
    withdrawn: bool = False
    #: output and playout frames held until the end of turn is confirmed
    _held_output: list[tuple[Envelope, bool]] = field(default_factory=list)
    _held_frames: list[PlayoutFrame] = field(default_factory=list)

    # -- its record and its work ---------------------------------------------------

    async def write(self, after: asyncio.Task[None] | None, *, plan: Plan, pricing: Pricing) -> Turn | None:
        """The session's *open* task: write the turn once ``after`` (the stop
        task of the turn it barged in on) is done, so the log reads: old
        stopping, old cancelled, new running. Returns None (after telling
        the client: event ``error``, code ``store_error``) if the store
        refused it: one turn's failure must not end the session."""
        if after is not None:
            await asyncio.wait({after})
        try:
            return await self.ctx.manager.open_turn(
                self.ctx.session_id, self.generation, turn_id=self.turn_id, plan=plan, pricing=pricing
            )
        except Exception as exc:
            log.exception("turn %s could not be written", self.turn_id)
            self._tell_error("store_error", describe_error(exc))
            return None


    async def work_on(self, answer: Answer) -> None:
        """The turn's work (the session's *work* task, cancelled on a stop):
        once its record is written, watch for a stop from outside; once its
        utterance ended, ``answer`` it inside the turn's cancel scope.

        However it ends, it ends once: a stop (cancelled, or a checkpoint
        found it in the store) tells the client what was heard and leaves
        the record to the stop task; an error fails the turn with its
        description (event ``error``, code ``turn_failed``). The recogniser
        stream is closed in every case.

        Raises:
            asyncio.CancelledError: when cancelled (never swallowed).
        """
        manager = self.ctx.manager
        turn: Turn | None = None
        try:
            assert self.open_task is not None
            turn = await asyncio.shield(self.open_task)
            if turn is None:
                self.settled = True
                return  # not recorded; the client was told
            self.watch_task = self.ctx.spawn(self.watch())
            manager.on_stopping(turn.id, lambda: self.ctx.on_stopping(self))
            await self.utterance_ended.wait()
            self.enter("thinking")
            self.runtime = manager.runtime(turn.id)
            self.scope = open_scope(
                manager,
                turn.id,
                self.ctx.clock,
                grace_s=self.ctx.grace_ms / 1000,
                shutdown_reserve_s=self.ctx.shutdown_reserve_s,
            )
            if manager.scope_observers:  # voice-to-voice and STT start before the scope does
                clock = self.ctx.clock
                for name, at in (("speech_end", self.speech_end_at), ("stt_start", self.stt_started_at)):
                    if at is not None:
                        wall = clock.now() - timedelta(seconds=max(0.0, clock.monotonic() - at))
                        manager.scope_observers.turn_noted(turn.id, name, wall)
            async with self.scope as scope:
                await answer(self, scope, turn)
        except asyncio.CancelledError:
            self.ctx.tell_interrupted(self)
            raise
        except Exception as exc:
            if stopped_by(exc):
                # A checkpoint found the stop in the store (its signal was
                # missed), or a limit (deadline, budget, steps, loop) the
                # turn hit itself: stop here as a signal would have, with
                # the limit as the reason (it was told as user_cancel).
                self.ctx.tell_interrupted(self)
                limit = first_error(exc)
                if self.scope is not None and isinstance(limit, TurnStopped) and limit.kind is not None:
                    self.scope.stop_self(limit)
                if self.stop_task is None:
                    self.ctx.silence(self)
                    self.stop(None)
                return
            if turn is not None:
                self.note_recognition()
                if self.reply:
                    await self._keep_heard(turn.id)
                self.settled = await fail(manager, turn.id, self.ctx.fence.active, exc, self.ctx.report)
            else:
                log.exception("turn %s failed", self.turn_id)
                self._tell_error("turn_failed", describe_error(exc))
        finally:
            self.finished = True
            self._withdraw()  # ended (failed) before its end of turn was confirmed: nothing of it goes out
            if self.watch_task is not None:
                self.watch_task.cancel()  # a stop from now on is handled by the stop task or the settle
            self.enter("idle")
            await self.stt.aclose()

    # -- what it says and hears ---------------------------------------------------

    def output(self, event: Envelope, *, withheld: bool = False) -> None:
        """Send an event of this turn (``event``: a catalogue model, its
        ``turn_id`` and ``generation`` this turn's); the delivery gate
        withholds its output (``turn.delivery_gate.OUTPUT_TYPES``) once its
        generation is obsolete (still logged, fenced), and so does
        ``withheld`` (output of a turn already stopped). A speculative
        turn's events wait until its end of turn is confirmed (then they
        go, in order) or it is withdrawn (then they are logged withheld)."""
        if self.withdrawn:
            self.ctx.report(event, withheld=True)
        elif self.speculative and not self.confirmed.is_set():
            self._held_output.append((event, withheld))
        else:
            self.ctx.report(event, withheld=withheld)

    def play(self, playout: OutputSink, frame: PlayoutFrame) -> None:
        """Queue ``frame`` of its reply for playout; held while its end of
        turn is tentative, dropped once it is withdrawn."""
        if self.withdrawn:
            return
        if self.speculative and not self.confirmed.is_set():
            self._held_frames.append(frame)
        else:
            playout.push(frame)

    def confirm(self, playout: OutputSink) -> bool:
        """The end of its utterance is confirmed: what it held is delivered
        and queued for playout now, in order, and what follows goes straight
        out. Returns False (nothing changes) if it was confirmed already or
        withdrawn."""
        if self.confirmed.is_set() or self.withdrawn:
            return False
        self._release_output()
        frames, self._held_frames = self._held_frames, []
        for frame in frames:
            playout.push(frame)
        return True

    def _release_output(self) -> None:
        """Confirmed: the events held so far go out, in order."""
        self.confirmed.set()
        held, self._held_output = self._held_output, []
        for event, withheld in held:
            self.ctx.report(event, withheld=withheld)

    def _withdraw(self) -> None:
        """Stopped before its end of turn was confirmed: nothing it held is
        delivered (its events are logged withheld: the audit trail) or
        played, and nothing it produces from now on is."""
        if not self.speculative or self.confirmed.is_set() or self.withdrawn:
            return
        self.withdrawn = True
        held, self._held_output = self._held_output, []
        for event, _ in held:
            self.ctx.report(event, withheld=True)
        self._held_frames = []

    def _tell_error(self, code: ErrorCode, message: str) -> None:
        """Tell the client this turn's ``error`` (in the session's active generation)."""
        self.ctx.report(ErrorEvent(turn_id=self.turn_id, generation=self.ctx.fence.active, code=code, message=message))

    def enter(self, phase: AgentPhase) -> None:
        """Move to ``phase`` ("thinking", "speaking", "idle"), telling the
        client (``agent.state``) if it changed."""
        if self.phase == phase:
            return
        self.phase = phase
        self.output(AgentState(turn_id=self.turn_id, generation=self.generation, phase=phase))

    def end_utterance(self, speech_end_at: float, *, tentative: bool = False) -> None:
        """The user's utterance is complete (their speech ended at clock
        seconds ``speech_end_at``): start its STT final at once, so the
        recogniser is free for the next utterance whatever the turn's
        bookkeeping is doing. ``tentative``: only tentatively, so its reply
        is speculative (held until :meth:`confirm`). Only the first call counts."""
        if self.utterance_ended.is_set():
            return
        if tentative:
            self.speculative = True
        else:
            self._release_output()
        self.speech_end_at = speech_end_at
        self.stt_started_at = self.ctx.clock.monotonic()
        self.utterance_ended.set()
        self.stt_final = asyncio.ensure_future(self.stt.finish())
        # its failure is read by the turn's work; don't also log it as lost
        self.stt_final.add_done_callback(lambda f: f.cancelled() or f.exception())

    async def _keep_heard(self, turn_id: str) -> None:
        """A reply that failed part-way (its synthesiser gone, no fallback):
        its audio stops now, the client is told what was heard
        (``agent.interrupted``) and the record keeps that part as the reply,
        the rest as unheard, before the turn is FAILED. A store that refuses
        the write is logged: the failure still goes on."""
        self.ctx.silence(self)
        self.ctx.tell_interrupted(self)
        heard, unheard = self.ctx.heard_split(self)
        try:
            await self.ctx.manager.record(turn_id, reply=heard or None, reply_unheard=unheard or None)
        except Exception:
            log.exception("turn %s: could not record what was heard of its failed reply", turn_id)

    def note_synthesis(self, stream: SynthesisStream) -> None:
        """Put what speaking the reply on ``stream`` cost on the turn's
        meter (:meth:`turn.usage.UsageMeter.add_synthesis`: its cents count
        against the budget), as the reply's synthesis ends, however it ends;
        a stop the provider acknowledges later is awaited by
        :meth:`await_synthesis_confirmed`."""
        self.synthesis_streams.append(stream)
        runtime = self.runtime or self.ctx.manager.runtime(self.turn_id)
        if runtime is not None:
            runtime.meter.add_synthesis(stream.records)

    async def await_synthesis_confirmed(self, timeout_s: float = CONFIRM_WAIT_S) -> None:
        """Wait (at most ``timeout_s``) until every synthesiser stop whose
        provider acknowledges stops (:attr:`voice.synthesis.StopRecord.confirmable`:
        Deepgram's ``Cleared``) is acknowledged; called after the terminal
        write, so it delays no state, only the final usage record."""
        deadline = self.ctx.clock.monotonic() + timeout_s
        while any(
            s.stop is not None and s.stop.confirmable and not s.stop.confirmed for s in self.synthesis_streams
        ) and self.ctx.clock.monotonic() < deadline:
            await self.ctx.clock.sleep(0.01)

    def note_recognition(self) -> None:
        """Put what recognising the user's words cost on the turn's meter
        (:meth:`turn.usage.UsageMeter.add_recognition`: its cents count
        against the budget), once, when the transcript is in or the turn
        is stopped without it (the audio was sent either way)."""
        if self.recognition_noted:
            return
        runtime = self.runtime or self.ctx.manager.runtime(self.turn_id)
        if runtime is None:
            return
        self.recognition_noted = True
        runtime.meter.add_recognition(self.stt.usage())

    async def final_transcript(self) -> str:
        """The utterance's transcript (the STT final started when it ended).

        Raises:
            Exception: what the recogniser raised.
        """
        assert self.stt_final is not None
        return await asyncio.shield(self.stt_final)

    async def earlier_words(self) -> str:
        """The words of the turn this one continues (its reply was never
        heard), or "" if it continues none or they could not be recognised."""
        old = self.continues
        if old is None:
            return ""
        if old.transcript is not None:
            return old.transcript
        if old.stt_final is None:
            return ""
        try:
            return await asyncio.shield(old.stt_final)
        except asyncio.CancelledError:
            if old.stt_final.cancelled():
                return ""
            raise
        except Exception:
            return ""

    # -- the one stop ------------------------------------------------------------

    @property
    def committing(self) -> bool:
        """A must-complete tool of it is committing an external effect now."""
        return self.scope is not None and self.scope.committing

    def stop(self, reason: StopReason | None) -> asyncio.Task[None]:
        """Stop the turn and record it, once.

        Args:
            reason: why; None if the stop was asked from outside (the stored
                reason stands) or found by a checkpoint (the scope's limit
                or the stored reason stands). A reason given while a
                must-complete commit is under way takes effect when the
                commit ends, re-timed then; the audio is the caller's to
                silence at once.

        Returns:
            The stop task (the same one for every call after the first);
            the next turn of the session is written once it is done.
        """
        if self.stop_task is not None:
            return self.stop_task
        self._withdraw()  # a speculative turn stopped before its end was confirmed: nothing of it goes out
        if reason is not None and self.committing:
            self.stop_task = self.ctx.spawn(self._stop_after_commit(reason))
            return self.stop_task
        self._mark_waste()
        if self.scope is not None:
            self.scope.stop(reason)  # every child gets the reason: model stream, tools, TTS, playout
        self._cancel_work()
        self.stop_task = self.ctx.spawn(self._record(reason))
        return self.stop_task

    async def watch(self) -> None:
        """Wait for a stop asked from outside this session (the REST API,
        another instance): it silences the turn like a barge-in does and
        stops it (the generation stays: nothing of the turn is produced any
        more). Nothing happens if the turn was stopped or ended meanwhile."""
        await self.ctx.manager.stop_event(self.turn_id).wait()
        if self.stop_task is not None or self.finished:
            return
        self.ctx.silence(self)
        self.stop(None)

    def _mark_waste(self) -> None:
        """The turn is stopped here, before the store records it: what its
        model streams from now on is waste, and a request cut off now tells
        its usage as stopped (turn.usage.UsageMeter.mark_stopped)."""
        if self.runtime is not None:
            self.runtime.meter.mark_stopped()

    def _cancel_work(self) -> None:
        if self.work is not None and self.work is not asyncio.current_task():
            self.work.cancel()

    async def _stop_after_commit(self, reason: StopReason) -> None:
        """A stop during a must-complete commit: the scope is stopped the
        moment the commit ends (its reason timed then), then recorded."""
        scope = self.scope
        assert scope is not None
        stopped: list[StopReason] = []

        def timed() -> StopReason:
            self._mark_waste()
            stopped.append(reason.model_copy(update={"at": self.ctx.clock.now()}))
            return stopped[0]

        scope.stop_after_commits(timed)
        await scope.commits_done()
        if not stopped:  # the scope had been stopped otherwise meanwhile
            timed()
        self._cancel_work()
        await self._record(stopped[0])

    async def _record(self, reason: StopReason | None) -> None:
        """Record the stop: CANCEL_REQUESTED, bounded wait for the work to
        end, then CANCELLED (or whatever the store says already happened). If
        the store is unavailable for longer than the manager's own retries,
        the client is told and the same stop (same reason, same time) is
        retried with backoff for up to ``STOP_RETRY_S``; a failure never
        ends the session (its settle tries once more, with this reason)."""
        if reason is not None:
            self.stop_reason = reason
        assert self.open_task is not None
        turn = await asyncio.shield(self.open_task)
        if turn is None:
            return  # never written: nothing was started for it
        told = False
        try:
            async for attempt in AsyncRetrying(
                stop=stop_after_delay(STOP_RETRY_S),
                wait=wait_exponential(multiplier=0.5, max=5.0),
                retry=retry_if_exception_type(StoreUnavailable),
                sleep=self.ctx.clock.sleep,
                reraise=True,
            ):
                with attempt:
                    try:
                        await self._write_stop(turn.id, reason)
                    except StoreUnavailable as exc:
                        if not told:
                            told = True
                            log.warning("turn %s: stop not recorded yet (%s); retrying", turn.id, exc)
                            self._tell_error("store_error", describe_error(exc))
                        raise
        except Exception as exc:
            log.exception("turn %s: could not record its stop", turn.id)
            if not told:
                self._tell_error("store_error", describe_error(exc))

    async def _write_stop(self, turn_id: str, reason: StopReason | None) -> None:
        """Stop ``turn_id`` with ``reason`` (None: the stored reason or the
        scope's limit stands) and write its terminal state from its
        children's reports, with what the user said and heard."""
        manager = self.ctx.manager
        if reason is not None:
            current = (await manager.request_stop(turn_id, reason)).turn
            if current.is_terminal:  # it had ended, or was only queued
                self.settled = True
                return
        scope = self.scope
        if scope is not None:
            scope.stop(reason)
        if self.work is not None and not self.work.done():
            self.work.cancel()  # the stop task's or the settle's, never the work's own
            if scope is None:
                done, _ = await asyncio.wait({self.work}, timeout=self.ctx.grace_ms / 1000)
                if not done:
                    log.warning("turn %s: work still running %d ms after stop", turn_id, self.ctx.grace_ms)
        if scope is not None:
            await scope.settle()  # bounded by the grace
        transcript = self.transcript
        final = self.stt_final
        if transcript is None and final is not None and final.done() and not final.cancelled() and not final.exception():
            transcript = final.result()  # heard, though the turn was stopped before using it
        self.note_recognition()
        heard, unheard = self.ctx.heard_split(self)
        if transcript is not None or heard or unheard:
            await manager.record(turn_id, transcript=transcript, reply=heard or None, reply_unheard=unheard or None)
        if scope is not None:
            await manager.settle_stop(turn_id, scope)
            await self.await_synthesis_confirmed()
            await record_late_usage(manager, turn_id, self.runtime)
        else:
            current = await manager.get(turn_id)
            if current.status is TurnStatus.RUNNING:  # a signal without a request: never leave it half-stopped
                fallback = StopReason(kind=StopReasonKind.USER_CANCEL, initiator="signal", at=self.ctx.clock.now())
                current = (await manager.request_stop(turn_id, fallback)).turn
            if not current.is_terminal:
                await manager.confirm_stopped(turn_id)
        self.settled = True

    # -- the one settle ----------------------------------------------------------

    async def settle(self, kind: StopReasonKind, at: datetime) -> None:
        """Session end: the turn gets a terminal state, including one whose
        record was never written (the user spoke, so it is recorded, then
        cancelled before start). A stop decided earlier (a barge-in whose
        record failed) keeps its own reason and time; otherwise it is
        stopped for ``kind`` (initiator ``server``, at ``at``), with a
        request id of its own (a stop request id is an idempotency key: one
        id for two turns is a conflict). A failure is logged, not raised."""
        if self.work is not None and not self.work.done():
            self.work.cancel()
        self._withdraw()
        reason = self.stop_reason or StopReason(kind=kind, initiator="server", at=at)
        manager = self.ctx.manager
        try:
            try:
                turn = await manager.get(self.turn_id)
            except UnknownTurn:
                turn = await manager.open_turn(self.ctx.session_id, self.generation, turn_id=self.turn_id, start=False)
            if not turn.is_terminal:
                await self._write_stop(turn.id, reason)
        except Exception:
            log.exception("turn %s: could not settle it at session end", self.turn_id)
