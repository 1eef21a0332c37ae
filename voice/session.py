"""The agent session: one per connected client.

It wires the inbound audio (VAD events and 16 kHz frames) to the Turn Manager
and the providers, and runs each turn's pipeline::

    speech_started -> advance generation, clear playout, cancel the old turn's
                      work (barge_in), open a new turn
    speech frames  -> STT stream
    speech_stopped -> STT final -> LLM stream -> sentences -> TTS -> playout

Concurrency: everything runs in one TaskGroup owned by :meth:`AgentSession.run`.
For each turn there is a *work* task (the pipeline, cancelled on stop), an
*open* task (writes the turn; never cancelled by a barge-in, so a turn is
never half-written) and, once stopped, a *stop* task that writes
CANCEL_REQUESTED, waits a bounded grace for the work to end and then writes
the terminal state. When the session ends, every turn still open is stopped
with a structured reason before :meth:`run` returns, even if it was cancelled.
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any, Protocol


from media.frames import FRAME_MS, PLAYOUT_RATE, Reframer, rms_dbfs, samples_per_frame
from media.inbound import InboundFrame
from media.playout import PlayoutBuffer, PlayoutFrame
from media.syllables import count_syllable_nuclei
from media.vad import VadConfig
from turn.clock import Clock
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import Plan, StopReason, StopReasonKind, Turn
from turn.scope import TurnScope
from voice.backchannel import BackchannelConfig, judge, recognise
from voice.endpointing import EndpointConfig
from voice.providers import LanguageModel, Message, SpeechToText, SttAdaptation, TextToSpeech
from voice.session_config import SessionConfig
from voice.history import earlier_messages, session_history
from voice.respond import run_agent, sink_to
from voice.text import SentenceSplitter
from voice.errors import describe_error, stopped_by
from voice.tools import Toolbox
from voice.turn_handle import TurnContext, TurnHandle
from voice.turn_taking import (
    AgentState,
    Announce,
    CancelClassification,
    ClassifyBackchannel,
    Commit,
    Decision,
    EndOfUtterance,
    Pause,
    PttTooLong,
    ResetDetector,
    Resume,
    TurnTaking,
)

log = logging.getLogger(__name__)

#: a playout frame quieter than this (dBFS) is a pause, not speech
SILENCE_DBFS = -50.0

class EventSink(Protocol):
    """Where the session's events go (``turn.events.SessionEventLog.emit``):
    logged, then read by the client's follower."""

    def __call__(self, type: str, *, generation: int, turn_id: str | None = None, **payload: Any) -> None: ...


@dataclass
class Providers:
    """The session's STT, LLM, TTS and the tools the model may call."""

    stt: SpeechToText
    llm: LanguageModel
    tts: TextToSpeech
    tools: Toolbox | None = None


@dataclass
class BargeInRecord:
    """One barge-in as the server saw it (clock seconds)."""

    old_turn_id: str
    old_generation: int
    new_generation: int
    onset_at: float
    fenced_at: float

    @property
    def onset_to_fence_ms(self) -> float:
        """Milliseconds from the first voiced frame's arrival to the fence."""
        return (self.fenced_at - self.onset_at) * 1000


class AgentSession:
    """One client's conversation.

    Args:
        session_id: the session's id (also the turns' session_id).
        manager: the Turn Manager (authority for turn states).
        providers: STT, LLM, TTS.
        playout: the outbound playout buffer of this session.
        fence: this session's generation fence (the delivery gate's rule).
        clock: time source.
        emit: where events go (see :class:`EventSink`); must not block.
        vad: VAD settings (for the pre-roll length).
        config: session settings.
        plan: the limits of every turn (deadline, budget, max steps).
    """

    def __init__(
        self,
        *,
        session_id: str,
        manager: TurnManager,
        providers: Providers,
        playout: PlayoutBuffer,
        fence: GenerationFence,
        clock: Clock,
        emit: EventSink,
        vad: VadConfig | None = None,
        config: SessionConfig | None = None,
        plan: Plan | None = None,
    ) -> None:
        self.session_id = session_id
        self.plan = plan or Plan()
        self.manager = manager
        self.providers = providers
        #: the recogniser's state for this session's voice (its requests only)
        self.stt_adaptation = SttAdaptation()
        self.playout = playout
        self.fence = fence
        self.clock = clock
        self._emit = emit
        self.vad = vad or VadConfig()
        self.turn_taking = TurnTaking(BackchannelConfig(), EndpointConfig(), self.vad.offset_ms)
        self.config = config or SessionConfig()
        #: what the user would stop a turn for if the session ended now
        self.close_reason = StopReasonKind.TRANSPORT_DISCONNECTED
        self.barge_ins: list[BargeInRecord] = []
        self._preroll: deque[bytes] = deque(maxlen=max(1, self.vad.preroll_frames))
        self._runs: list[TurnHandle] = []
        self._listening: TurnHandle | None = None
        #: the candidate's audio (16 kHz frames, pre-roll first) while there is one
        self._held: list[bytes] = []
        #: the recogniser deciding whether the candidate is a backchannel
        self._classifying: asyncio.Task[None] | None = None
        #: forgets the detector's current run (set by whoever owns it)
        self.reset_detector: Callable[[], None] | None = None
        self.false_interruptions = 0
        self.backchannels = 0
        self._tg: asyncio.TaskGroup | None = None

    @property
    def config(self) -> SessionConfig:
        """The session's settings (replacing them applies to the next event)."""
        return self._config

    @config.setter
    def config(self, config: SessionConfig) -> None:
        self._config = config
        self.turn_taking.backchannel = config.backchannel
        self.turn_taking.endpoint = config.endpoint

    @property
    def ptt_active(self) -> bool:
        """Push-to-talk is held: the detector's decisions are not used."""
        return self.turn_taking.ptt_active

    # -- main loop -------------------------------------------------------------

    async def run(self, frames: AsyncIterator[InboundFrame]) -> None:
        """Consume inbound frames until they end (client gone) or this task
        is cancelled; then stop every open turn with ``close_reason``.

        Raises:
            asyncio.CancelledError: when cancelled, after the turns are settled.
        """
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                try:
                    await self.providers.stt.start()
                    self._send("session.ready", session_id=self.session_id)
                    async for frame in frames:
                        self._on_frame(frame)
                finally:
                    for run in self._runs:
                        for task in (run.work, run.watch_task):
                            if task is not None:
                                task.cancel()
        finally:
            self._tg = None
            # Settle even if cancelled again meanwhile: returning earlier would
            # let the caller close the store under the last writes.
            settle = asyncio.ensure_future(self._settle_all())
            interrupted = False
            while not settle.done():
                try:
                    await asyncio.shield(settle)
                except asyncio.CancelledError:
                    interrupted = True
            if interrupted:
                raise asyncio.CancelledError

    def _on_frame(self, frame: InboundFrame) -> None:
        """Per 20 ms frame, on the hot path: no awaits, no I/O.

        The detector's decisions (see :mod:`media.bargein`) and the frame's
        time go to :class:`voice.turn_taking.TurnTaking`, whose decisions
        are carried out here; the frame's audio goes to the utterance being
        listened to, else to the candidate, else to the pre-roll.
        """
        tt = self.turn_taking
        for ev in frame.events:
            self._carry_out(tt.on_event(ev, self._agent_state()))
        if self._listening is not None:
            self._listening.stt.feed(frame.pcm)
        elif tt.candidate is not None:
            self._held.append(frame.pcm)
        else:
            self._preroll.append(frame.pcm)
        self._carry_out(tt.on_frame(frame.at, frame.gated, self._agent_state()))

    def _carry_out(self, decisions: list[Decision]) -> None:
        """Do what turn-taking decided, in its order (see :mod:`voice.turn_taking`)."""
        for d in decisions:
            if isinstance(d, Announce):
                self._send("vad", event=d.event)
            elif isinstance(d, Pause):
                self.playout.pause()
                self._held = [*self._preroll]
                self._preroll.clear()
            elif isinstance(d, Resume):
                self._resume(d)
            elif isinstance(d, ClassifyBackchannel):
                assert self._tg is not None
                self._classifying = self._tg.create_task(self._classify_backchannel(d.candidate, self._held))
            elif isinstance(d, CancelClassification):
                if self._classifying is not None:
                    self._classifying.cancel()
                    self._classifying = None
            elif isinstance(d, Commit):
                self._commit(d)
            elif isinstance(d, EndOfUtterance):
                run, self._listening = self._listening, None
                if run is not None:
                    self._end_utterance(run, d.speech_end_at)
            elif isinstance(d, PttTooLong):
                self._send("error", code="ptt_too_long", message=f"push-to-talk held over {d.max_ms} ms")
            elif isinstance(d, ResetDetector):
                if self.reset_detector is not None:
                    self.reset_detector()

    def _agent_state(self) -> AgentState:
        """What turn-taking needs to know of the agent: is a reply on the way
        out (queued or being produced), is a turn thinking or speaking."""
        run = self._active_run()
        if run is None:
            return AgentState()
        return AgentState(speaking=len(self.playout) > 0 or (run.phase == "speaking" and not run.tts_done), replying=True)

    def _resume(self, d: Resume) -> None:
        """Speech that was no barge-in: play on from where playout paused;
        its audio goes back to the pre-roll."""
        if d.playout:
            self.playout.resume()
        for pcm in self._held[-self._preroll.maxlen :] if self._preroll.maxlen else []:
            self._preroll.append(pcm)
        if d.reason == "false_interruption":
            self.false_interruptions += d.held
        else:
            self.backchannels += 1
        if d.report:
            self._send(d.reason, paused_ms=d.paused_ms, **d.verdict)

    async def _classify_backchannel(self, candidate: int, held: list[bytes]) -> None:
        """Was candidate ``candidate`` (its audio: ``held``) a backchannel?
        The recogniser and the syllable count say (:mod:`voice.backchannel`)."""
        text = await recognise(self.providers.stt, held)
        cand = self.turn_taking.candidate
        if cand is None or cand.n != candidate:
            return  # decided meanwhile (the user went on)
        # the user's speech only: the gate's run and what followed it, not
        # the older pre-roll (which can hold the agent's echo)
        spoken = held[-(cand.lead_ms // FRAME_MS + cand.frames) :]
        verdict = judge(self.config.backchannel, text, cand.speech_ms, count_syllable_nuclei(spoken))
        self._carry_out(self.turn_taking.classified(candidate, self.clock.monotonic(), verdict, self._agent_state()))

    # -- push-to-talk ----------------------------------------------------------

    def ptt_start(self) -> str | None:
        """Push-to-talk pressed: an immediate, committed barge-in with no VAD
        involved; everything heard until :meth:`ptt_end` is the user's turn.

        Returns:
            None, or an error code (``ptt_already_active``,
            ``session_not_ready``) for the client.
        """
        if self.turn_taking.ptt_active:
            return "ptt_already_active"
        if self._tg is None:
            return "session_not_ready"
        self._carry_out(self.turn_taking.ptt_start(self.clock.monotonic()))
        return None

    def ptt_end(self) -> str | None:
        """Push-to-talk released: the user's turn ends at once (no endpointing
        wait).

        Returns:
            None, or an error code (``ptt_not_active``) for the client.
        """
        if not self.turn_taking.ptt_active:
            return "ptt_not_active"
        self._carry_out(self.turn_taking.ptt_end(self.clock.monotonic()))
        return None

    def _end_utterance(self, run: TurnHandle, speech_end_at: float) -> None:
        """The user's utterance is complete (their speech ended at clock
        seconds ``speech_end_at``): start its STT final at once, so the
        recogniser is free for the next utterance whatever the turn's
        bookkeeping is doing."""
        if run.utterance_ended.is_set():
            return
        run.speech_end_at = speech_end_at
        run.utterance_ended.set()
        run.stt_final = asyncio.ensure_future(run.stt.finish())
        # its failure is read by the turn's work; don't also log it as lost
        run.stt_final.add_done_callback(lambda f: f.cancelled() or f.exception())

    # -- barge-in --------------------------------------------------------------

    def turn_id_of(self, generation: int) -> str | None:
        """The id of this session's turn of ``generation``, if still known."""
        for run in reversed(self._runs):
            if run.generation == generation:
                return run.turn_id
        return None

    def _active_run(self) -> TurnHandle | None:
        """The turn the agent is thinking or speaking for, if any."""
        for run in reversed(self._runs):
            if not run.finished and run.utterance_ended.is_set():
                return run
        return None

    def _commit(self, d: Commit) -> None:
        """Stage 2: the user is taking the turn (``d``). Fence, clear, cancel
        the turn in flight (barge_in), open a new one fed with the speech so far.

        The fence and the clear happen before anything else, synchronously, so
        the very next outbound tick is silent (it already is if stage 1 paused
        it). A turn whose reply was never heard merges into the new one: the
        user paused, the endpoint fired, they went on; one reply answers both.
        """
        assert self._tg is not None
        initiator = d.initiator
        old = self._active_run()
        if old is not None and old.tts_done and not self.playout.audible_pending(old.generation):
            # Only the pause after its last word is left: the user heard the
            # reply in full, so it completes; this is a new turn, not a barge-in.
            old = None
        old_generation = self.fence.active
        generation = self.fence.advance()
        fenced_at = self.clock.monotonic()
        cleared = self.playout.clear()
        self.playout.resume()
        after: asyncio.Task[None] | None = None
        run = TurnHandle(self._turn_context(), generation, self.providers.stt.open_stream(self.stt_adaptation))
        if old is not None:
            if old.committing:
                # A must-complete tool is committing: its audio is silenced
                # (fenced, cleared) now; the turn is stopped when the commit
                # ends, and only then does the new turn start.
                self._send("stop_deferred", turn_id=old.turn_id, generation=old_generation, why="must_complete")
            after = old.stop(StopReason(kind=StopReasonKind.BARGE_IN, initiator=initiator, at=self.clock.now()))
            window = self.config.endpoint.continue_window_ms / 1000
            if (
                self.playout.played_samples(old.generation) == 0
                and not old.merged
                and not old.acted
                and old.speech_end_at is not None
                and d.onset_at - old.speech_end_at <= window
            ):
                run.continues, old.merged = old, True
            rec = BargeInRecord(old.turn_id, old_generation, generation, d.onset_at, fenced_at)
            self.barge_ins.append(rec)
            self._send(
                "barge_in",
                old_turn_id=old.turn_id,
                old_generation=old_generation,
                initiator=initiator,
                onset_to_fence_ms=round(rec.onset_to_fence_ms, 2),
                paused_ms=d.paused_ms,
                cleared_ms=cleared * 20,
            )
        for pcm in self._held if d.audio else ():
            run.stt.feed(pcm)
        self._held = []
        self._preroll.clear()
        self._listening = run
        self._runs.append(run)
        run.open_task = self._tg.create_task(self._open(run, after))
        run.work = self._tg.create_task(self._work(run))
        self._forget_finished()

    def _forget_finished(self) -> None:
        """Drop runs whose terminal state is recorded; the rest are settled
        again when the session ends."""
        self._runs = [r for r in self._runs if not (r.settled and r.finished)]

    # -- per-turn tasks --------------------------------------------------------

    async def _open(self, run: TurnHandle, after: asyncio.Task[None] | None) -> Turn | None:
        """Write the new turn once the old one's stop is recorded, so the log
        reads: old stopping, old cancelled, new running. Returns None (after
        telling the client) if the store refused it: one turn's failure must
        not end the session."""
        if after is not None:
            await asyncio.wait({after})
        try:
            return await self.manager.open_turn(
                self.session_id, run.generation, turn_id=run.turn_id, plan=self.plan, pricing=self.providers.llm.pricing
            )
        except Exception as exc:
            log.exception("turn %s could not be written", run.turn_id)
            self._send("error", turn_id=run.turn_id, code="store_error", message=describe_error(exc))
            return None

    async def _work(self, run: TurnHandle) -> None:
        """The turn's pipeline: STT final -> LLM -> TTS -> playout -> COMPLETED."""
        turn: Turn | None = None
        try:
            assert run.open_task is not None
            turn = await asyncio.shield(run.open_task)
            if turn is None:
                run.settled = True
                return  # not recorded; the client was told
            assert self._tg is not None
            run.watch_task = self._tg.create_task(run.watch())
            self.manager.on_stopping(turn.id, lambda: self._silence(run))
            await run.utterance_ended.wait()
            self._phase(run, "thinking")
            rt = self.manager.runtime(turn.id)
            run.scope = TurnScope(
                turn.id,
                self.clock,
                grace_s=self.config.stop_grace_ms / 1000,
                deadline=rt.deadline if rt is not None else None,
                shutdown_reserve_s=self.plan.shutdown_reserve_ms / 1000,
            )
            async with run.scope as scope:
                transcript = await scope.run("stt", self._stt_final(run))
                earlier = await self._earlier_words(run)
                run.transcript = transcript = " ".join(t for t in (earlier, transcript) if t)
                turn = await self.manager.record(turn.id, transcript=transcript)
                if run.continues is not None and earlier:
                    # its words are this turn's now: no history shows it again
                    await self.manager.record(run.continues.turn_id, merged_into=turn.id)
                self._output(run, "transcript", role="user", text=transcript)
                if not transcript:
                    await self.manager.fail(turn.id, "no_speech_recognized")
                    run.settled = True
                    return
                messages = await self.model_history(run, turn)
                await self._reply(run, scope, messages)
                await scope.run("playout", self.playout.wait_empty())
                reply = "".join(run.reply).strip()

                async def finish() -> None:
                    await self.manager.record(turn.id, reply=reply)  # every frame of it was played
                    completed = (await self.manager.complete(turn.id)).applied
                    run.settled = True  # completed now, or already terminal
                    if completed:
                        self._output(run, "agent.done", text=reply)

                await scope.commit(finish(), effect=False)  # the final step commits whole, or not at all
        except asyncio.CancelledError:
            self._tell_interrupted(run)
            raise
        except Exception as exc:
            if stopped_by(exc):
                # A checkpoint found the stop in the store (its signal was
                # missed): stop here as a signal would have.
                self._tell_interrupted(run)
                if run.stop_task is None and self._tg is not None:
                    self._silence_heard(run)
                    run.stop(None)
                return
            log.exception("turn %s failed", run.turn_id)
            error = describe_error(exc)
            if turn is not None:
                try:
                    await self.manager.fail(turn.id, error)
                    run.settled = True
                except Exception:
                    log.exception("turn %s: could not record its failure", run.turn_id)
            self._send("error", turn_id=run.turn_id, code="turn_failed", message=error)
        finally:
            run.finished = True
            if run.watch_task is not None:
                run.watch_task.cancel()  # a stop from now on is handled by the stop task or the settle
            self._phase(run, "idle")
            await run.stt.aclose()

    async def _earlier_words(self, run: TurnHandle) -> str:
        """The words of the turn this one continues (its reply was never
        heard), or "" if it continues none or they could not be recognised."""
        old = run.continues
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

    async def _stt_final(self, run: TurnHandle) -> str:
        """The utterance's transcript (the STT final started when it ended)."""
        assert run.stt_final is not None
        return await asyncio.shield(run.stt_final)

    async def _reply(self, run: TurnHandle, scope: TurnScope, messages: list[Message]) -> None:
        """Run the agent loop (model and tool calls) and speak its answer
        sentence by sentence in a TTS child; returns when every frame is
        queued for playout."""
        sentences: asyncio.Queue[str | None] = asyncio.Queue()
        splitter = SentenceSplitter()
        tts = scope.spawn("tts", self._speak(run, sentences))

        def delivered(token: str) -> None:
            run.reply.append(token)
            self._output(run, "agent.delta", text=token)
            for piece in splitter.feed(token):
                sentences.put_nowait(piece)

        def withheld(token: str) -> None:
            self._output(run, "agent.delta", text=token, withheld=True)

        def on_event(type: str, **payload: Any) -> None:
            if type == "tool.started" and payload.get("effect", "none") != "none":
                run.acted = True  # a read whose result nobody heard does not count
            self._send(type, turn_id=run.turn_id, generation=run.generation, **payload)

        try:
            await run_agent(
                scope=scope,
                manager=self.manager,
                turn_id=run.turn_id,
                llm=self.providers.llm,
                messages=messages,
                toolbox=self.providers.tools,
                on_token=sink_to(delivered, withheld),
                on_event=on_event,
            )
            rest = splitter.flush()
            if rest:
                sentences.put_nowait(rest)
        finally:
            sentences.put_nowait(None)
        await scope.wait(tts)

    async def _speak(self, run: TurnHandle, sentences: asyncio.Queue[str | None]) -> None:
        """TTS each sentence into 20 ms playout frames tagged with the turn's
        generation."""
        reframer = Reframer(PLAYOUT_RATE)
        per_frame = samples_per_frame(PLAYOUT_RATE)
        position = 0

        def sink(pcm: bytes) -> None:
            nonlocal position
            for f in reframer.push(pcm):
                self.playout.push(PlayoutFrame(f, run.generation, position, audible=rms_dbfs(f) > SILENCE_DBFS))
                position += per_frame

        while (sentence := await sentences.get()) is not None:
            self._phase(run, "speaking")
            start = position + reframer.pending_bytes // 2
            await self.providers.tts.synthesize(sentence, sink)
            run.spoken.append((start, position + reframer.pending_bytes // 2, sentence))
        tail = reframer.flush()
        if tail is not None:
            self.playout.push(PlayoutFrame(tail, run.generation, position, audible=rms_dbfs(tail) > SILENCE_DBFS))
        run.tts_done = True

    def _silence(self, run: TurnHandle) -> None:
        """The step in which the stop of ``run``'s turn is recorded here, or
        heard from another instance: its audio leaves no more, at once (the
        watcher that cancels its work wakes a moment later). A barge-in has
        already moved the fence on, so only a stop from outside acts here."""
        if run.stop_task is None and not run.finished and self.fence.active == run.generation:
            self.playout.clear()

    def _silence_heard(self, run: TurnHandle) -> None:
        """A stop from outside (or found by a checkpoint) silences ``run``'s
        audio at once if it is the reply being heard."""
        if self._active_run() is run:
            self.playout.clear()

    def _turn_context(self) -> TurnContext:
        """What a new turn's handle needs to stop and settle."""
        assert self._tg is not None
        return TurnContext(
            session_id=self.session_id,
            manager=self.manager,
            clock=self.clock,
            grace_ms=self.config.stop_grace_ms,
            spawn=self._tg.create_task,
            report=self._send,
            heard_split=self._heard_split,
            silence=self._silence_heard,
        )

    async def _settle_all(self) -> None:
        """Session end: every turn this session began gets a terminal state
        (:meth:`voice.turn_handle.TurnHandle.settle`)."""
        closed_at = self.clock.now()
        for run in list(self._runs):
            await run.settle(self.close_reason, closed_at)
        self._runs.clear()

    # -- history and events ----------------------------------------------------

    def heard(self, run: TurnHandle) -> str:
        """The part of ``run``'s reply whose audio actually left the playout
        buffer (see :func:`heard_text`)."""
        return heard_text(run.spoken, self.playout.played_samples(run.generation))

    def _heard_split(self, run: TurnHandle) -> tuple[str, str]:
        """``run``'s generated reply split into what was heard (its audio
        left the playout buffer, :meth:`heard`) and the rest, which nobody
        heard: (heard, unheard), each "" if empty. The heard part is a
        whole-word prefix of the reply."""
        words = "".join(run.reply).split()
        heard = self.heard(run)
        n = len(heard.split())
        return heard, " ".join(words[n:])

    def _tell_interrupted(self, run: TurnHandle) -> None:
        """Tell the client, once, how much of an interrupted reply was heard
        (event ``agent.interrupted``); that part, and only that, is what the
        store keeps as the reply and every later history shows."""
        if not run.transcript or run.told_interrupted or run.merged:
            return
        run.told_interrupted = True
        played = self.playout.played_samples(run.generation)
        self._send(
            "agent.interrupted", turn_id=run.turn_id, generation=run.generation, heard=self.heard(run),
            played_ms=round(played * 1000 / self.playout.rate), reply_chars=len("".join(run.reply).strip()),
        )

    async def history(self) -> list[Message]:
        """The session's history as the next turn's model would be given it
        (:func:`voice.history.earlier_messages`), from the store.

        Raises:
            turn.store.StoreUnavailable: the store could not be read.
        """
        return await earlier_messages(self.manager, self.session_id, max_messages=self.config.history_messages)

    async def model_history(self, run: TurnHandle, turn: Turn) -> list[Message]:
        """What ``turn``'s model calls are given: the session's history as
        the store holds it (:func:`voice.history.session_history`: heard
        replies only, tool calls with their ledger outcomes), once every
        earlier turn of this session has recorded how it ended.

        Args:
            run: the turn's handle.
            turn: the turn as recorded, with its transcript.
        """
        pending = {
            task
            for r in self._runs
            if r.generation < run.generation
            for task in (r.work, r.stop_task)
            if task is not None and not task.done()
        }
        if pending:  # bounded: a stuck earlier turn costs this one a second at most
            await asyncio.wait(pending, timeout=max(1.0, 4 * self.config.stop_grace_ms / 1000))
        return await session_history(self.manager, turn, max_messages=self.config.history_messages)

    def _phase(self, run: TurnHandle, phase: str) -> None:
        if run.phase == phase:
            return
        run.phase = phase
        self._send("agent.state", turn_id=run.turn_id, generation=run.generation, phase=phase)

    def _output(self, run: TurnHandle, type: str, **payload: Any) -> None:
        """A turn's output (``turn.events.OUTPUT_TYPES``): the delivery gate
        withholds it once its generation is obsolete (still logged, fenced)."""
        self._send(type, turn_id=run.turn_id, generation=run.generation, **payload)

    def _send(self, type: str, *, generation: int | None = None, **payload: Any) -> None:
        try:
            self._emit(type, generation=self.fence.active if generation is None else generation, **payload)
        except Exception:
            log.exception("event sink failed")


def heard_text(spoken: list[tuple[int, int, str]], played: int) -> str:
    """The text of the sentences in ``spoken`` whose audio had been played
    up to sample ``played``, cut to whole words.

    Each sentence's first and end sample are exact (each is synthesised on
    its own, so they are sentence marks). Inside the sentence being played,
    word boundaries are estimated: a word counts as heard when the share of
    the sentence's samples played reaches the share of its characters up to
    that word's end (speech time is close to proportional to letters; a half
    heard word is left out).

    Args:
        spoken: (first sample, end sample, text) per sentence, in order.
        played: samples of this generation's audio that left the buffer.
    """
    out: list[str] = []
    for start, end, text in spoken:
        if played >= end:
            out.append(text.strip())
            continue
        if played > start and end > start:
            share = (played - start) / (end - start)
            words = text.split()
            total = len(" ".join(words))
            kept, upto = [], 0
            for w in words:
                upto += len(w) + (1 if kept else 0)
                if upto / total > share:
                    break
                kept.append(w)
            if kept:
                out.append(" ".join(kept))
        break
    return " ".join(t for t in out if t)
