"""The agent session: one per connected client.

It runs on one :class:`voice.transport.Transport` (WebRTC, a phone bridge, a
test's WAV) and uses that seam only, wiring the inbound audio (detector
events and 16 kHz frames) to the Turn Manager and the providers::

    speech_started   -> pause playout (stage 1), hold the candidate's audio
    speech_confirmed -> commit: advance generation, clear playout, stop the
                        old turn (barge_in), open a new turn fed the audio
    speech frames    -> the session's recognition stream (voice.transcription)
    end of utterance -> its final -> LLM stream -> sentences -> TTS -> playout

Who has the floor is decided by :class:`voice.turn_taking.TurnTaking` (pure;
this class feeds it and carries out its decisions); what a commit does to
the turn in flight by :mod:`voice.barge_in`; a turn's answer by
:mod:`voice.reply`; how a turn is stopped and settled by
:class:`voice.turn_handle.TurnHandle`; what was heard of a reply by
:mod:`voice.heard`; the model's history by :mod:`voice.history`.

Concurrency: everything runs in one TaskGroup owned by :meth:`AgentSession.run`.
A task takes the transport's controls. For each turn there is a *work* task
(the pipeline, cancelled on stop), an
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
from dataclasses import dataclass
from typing import Protocol

from clock import Clock
from media.echo_guard import after_echo
from media.frames import FRAME_MS
from media.inbound_frame import InboundFrame
from media.syllables import count_syllable_nuclei
from media.vad import VadConfig
from turn.event_catalogue import (
    Backchannel,
    EndOfTurn,
    Envelope,
    ErrorEvent,
    FalseInterruption,
    SessionReady,
    SttFailover,
    SttUsage,
    TtsFailover,
    Vad,
)
from turn.events import EventSink
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import Plan, StopReason, StopReasonKind, Turn
from turn.scope import TurnScope
from voice.backchannel import BackchannelConfig, judge
from voice.barge_in import BargeInRecord, barge_in, continues, interrupted_turn
from voice.controls import SessionControls
from voice.dtmf import DigitStream
from voice.end_of_turn import words_complete
from voice.endpointing import EndpointConfig
from voice.heard import Hearing
from voice.history import earlier_messages, earlier_turns_wait_s, history_after
from voice.providers import LanguageModel, Message
from voice.recognition import Recogniser, RecognitionError, StreamOptions, SttAdaptation
from voice.reply import answer
from voice.session_config import SessionConfig
from voice.stt_failover import Failover, FailoverAction
from voice.synthesis import Synthesiser
from voice.tools import Toolbox
from voice.transcription import Transcription, Utterance
from voice.transport import OutputSink, Transport
from voice.tts_failover import FailoverNotice, FailoverSynthesiser
from voice.turn_handle import TurnContext, TurnHandle
from voice.turn_taking import (
    AgentActivity,
    Announce,
    CancelClassification,
    ClassifyBackchannel,
    Commit,
    ConfirmEndOfTurn,
    Decision,
    DecodeSoFar,
    EndOfUtterance,
    JudgeEndOfTurn,
    Pause,
    PauseStands,
    PttTooLong,
    ResetDetector,
    Resume,
    SpeechWentOn,
    TurnTaking,
)

log = logging.getLogger(__name__)

#: the end-of-turn judge reads at most the latest this many seconds of the turn's audio
JUDGE_AUDIO_S = 8

@dataclass
class Providers:
    """The session's STT, LLM, TTS and the tools the model may call.

    Attributes:
        stt: the recogniser (``stt.provider``).
        stt_fallback: the one a failed recogniser falls back to
            (``stt.fallback = "embedded"``), or None (``"none"``).
        stt_final_timeout_s: a final the recogniser owes this long after
            an utterance's end counts as its failure, s.
        narrowband: the caller's audio is telephone audio (8 kHz): an
            embedded recogniser fills the empty band.
        tts: the session's speech synthesiser (``tts.provider``).
        tts_fallback: the one that says what a failed provider could not
            (``tts.fallback = "embedded"``: espeak-ng), or None.
        end_of_turn: the end-of-turn judge (``session.endpoint.mode =
            "model"``), or None (the fixed silence decides).
    """

    stt: Recogniser
    llm: LanguageModel
    tts: Synthesiser
    tools: Toolbox | None = None
    tts_fallback: Synthesiser | None = None
    stt_fallback: Recogniser | None = None
    stt_final_timeout_s: float = 4.0
    narrowband: bool = False
    end_of_turn: EndOfTurnJudge | None = None


class JudgedEnd(Protocol):
    """An end-of-turn judge's verdict (:class:`voice.end_of_turn.EndOfTurnVerdict`)."""

    @property
    def complete(self) -> bool: ...
    @property
    def probability(self) -> float: ...
    @property
    def inference_ms(self) -> float: ...


class EndOfTurnJudge(Protocol):
    """Reads the end of a user's utterance and says whether their turn is
    complete (:class:`voice.end_of_turn.SmartTurn`). Blocking: the session
    calls it in a worker thread."""

    def judge(self, pcm: bytes, rate: int = 16000) -> JudgedEnd:
        """``pcm``: the utterance's audio, s16le mono at ``rate`` Hz (the
        latest seconds of it are read).

        Raises:
            ValueError: audio it cannot read.
        """
        ...


class AgentSession(SessionControls):
    """One client's conversation.

    Args:
        session_id: the session's id (also the turns' session_id).
        manager: the Turn Manager (authority for turn states).
        providers: STT, LLM, TTS.
        transport: how the client is reached (:class:`voice.transport.Transport`):
            its frames, controls and output sink are this session's; the
            session's ``close_reason`` becomes the reason it closes for.
        fence: this session's generation fence (the delivery gate's rule).
        clock: time source.
        emit: where events go (:class:`turn.events.EventSink`, e.g.
            ``SessionEventLog.emit_event``: logged, then read by the
            client's follower); must not block.
        vad: VAD settings (for the pre-roll length).
        config: session settings.
        plan: the limits of every turn (deadline, budget, max steps).
        instructions: a system message put before the conversation in
            every model request (None: none).
    """

    def __init__(
        self,
        *,
        session_id: str,
        manager: TurnManager,
        providers: Providers,
        transport: Transport,
        fence: GenerationFence,
        clock: Clock,
        emit: EventSink,
        vad: VadConfig | None = None,
        config: SessionConfig | None = None,
        plan: Plan | None = None,
        instructions: str | None = None,
    ) -> None:
        self.session_id = session_id
        self.plan = plan or Plan()
        self.instructions = instructions
        self.manager = manager
        self.providers = providers
        #: speaks the replies: the provider, reconnected once, then its fallback
        self.tts = FailoverSynthesiser(providers.tts, providers.tts_fallback, tell=self._synthesis_failed)
        #: the recogniser's state for this session's voice (its requests only)
        self.stt_adaptation = SttAdaptation()
        #: the session's recognition stream (voice.transcription)
        self.transcription = Transcription(
            Failover(providers.stt, providers.stt_fallback),
            StreamOptions(adaptation=self.stt_adaptation, narrowband=providers.narrowband, session_id=session_id),
            clock=clock,
            final_timeout_s=providers.stt_final_timeout_s,
            on_heard=self._heard,
            on_failover=self._recognition_failed,
        )
        #: the candidate's utterance (what is sent to the recogniser for it)
        self._utterance: Utterance | None = None
        self.transport = transport
        #: the transport's output sink (the reply's audio, its played position)
        self.playout: OutputSink = transport.output
        self.hearing = Hearing(self.playout)
        self.fence = fence
        self.clock = clock
        self._emit = emit
        self.vad = vad or VadConfig()
        self.turn_taking = TurnTaking(BackchannelConfig(), EndpointConfig(), self.vad.offset_ms)
        self.config = config or SessionConfig()
        #: what the user would stop a turn for if the session ended now
        self.close_reason = StopReasonKind.TRANSPORT_DISCONNECTED
        self.barge_ins: deque[BargeInRecord] = deque(maxlen=64)  # the latest, for tests and audits
        #: the latest frames before any candidate: (pcm, the echo guard
        #: explained it as the agent's own voice)
        self._preroll: deque[tuple[bytes, bool]] = deque(maxlen=max(1, self.vad.preroll_frames))
        self._runs: list[TurnHandle] = []
        self._listening: TurnHandle | None = None
        #: the candidate's audio (16 kHz frames, pre-roll first) while there is one
        self._held: list[bytes] = []
        #: the recogniser deciding whether the candidate is a backchannel
        self._classifying: asyncio.Task[None] | None = None
        #: the user's audio of the current turn (16 kHz frames, from the
        #: pre-roll of its first speech on, a continuation included): what
        #: the end-of-turn judge reads (its latest JUDGE_AUDIO_S)
        self._turn_audio: deque[bytes] = deque(maxlen=JUDGE_AUDIO_S * 1000 // FRAME_MS)
        #: the turn whose utterance ended tentatively (its reply held), until confirmed or withdrawn
        self._speculating: TurnHandle | None = None
        #: the judge's answer for the latest tentative end: (utterance, probability, ms, words complete)
        self._judged: tuple[int, float, float, bool | None] | None = None
        #: DTMF keys pressed so far, in order (the latest 64)
        self.dtmf_digits = ""
        self.false_interruptions = 0
        self.backchannels = 0
        self._tg: asyncio.TaskGroup | None = None
        transport.on_close(self._on_close)

    def _on_close(self, reason: StopReasonKind) -> None:
        """The transport's call ended: open turns settle for ``reason``."""
        self.close_reason = reason

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

    async def run(self) -> None:
        """Consume the transport's frames until they end (client gone) or
        this task is cancelled, and its controls meanwhile; then stop every
        open turn with ``close_reason``.

        Raises:
            asyncio.CancelledError: when cancelled, after the turns are settled.
        """
        try:
            async with asyncio.TaskGroup() as tg:
                self._tg = tg
                controls: asyncio.Task[None] | None = None
                warming: asyncio.Task[None] | None = None
                try:
                    # the recognisers are started by their owner, once (web.app at
                    # startup): a provider's key check is not a session's wait
                    tg.create_task(self.transcription.run())
                    warming = tg.create_task(self.tts.warm())  # the first reply's connection, open before it is needed
                    self._send(SessionReady(generation=self.fence.active, session_id=self.session_id))
                    controls = tg.create_task(self._take_controls())
                    async for frame in self.transport.frames():
                        self._on_frame(frame)
                finally:
                    for side in (controls, warming):
                        if side is not None:
                            side.cancel()
                    self.transcription.close()  # its run ends once the provider's last usage is read
                    for run in self._runs:
                        for task in (run.work, run.watch_task):
                            if task is not None:
                                task.cancel()
        finally:
            self._tg = None
            self._tell_recognition_usage()
            # Settle even if cancelled again meanwhile: returning earlier would
            # let the caller close the store under the last writes.
            settle = asyncio.ensure_future(self._settle_all())
            interrupted = False
            while not settle.done():
                try:
                    await asyncio.shield(settle)
                except asyncio.CancelledError:
                    interrupted = True
            try:
                await self.tts.aclose()  # the provider's connections (the turns are settled: no reply speaks)
            finally:
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
            self._turn_audio.append(frame.pcm)
        elif tt.candidate is not None:
            self._held.append(frame.pcm)
            self._turn_audio.append(frame.pcm)
            if self._utterance is not None:
                self._utterance.feed(frame.pcm)
        else:
            self._preroll.append((frame.pcm, frame.echo))
        self._carry_out(tt.on_frame(frame.at, frame.gated, self._agent_state()))

    def _carry_out(self, decisions: list[Decision]) -> None:
        """Do what turn-taking decided, in its order (see :mod:`voice.turn_taking`)."""
        for d in decisions:
            if isinstance(d, Announce):
                self._send(Vad(generation=self.fence.active, event=d.event))
                if d.event in ("speech_stopped", "speech_rejected"):
                    self._pause_hint(paused=True)
                elif d.event == "speech_started":
                    self._pause_hint(paused=False)
            elif isinstance(d, DecodeSoFar | SpeechWentOn):
                self._pause_hint(paused=isinstance(d, DecodeSoFar))  # DecodeSoFar: the decode starts before speech_stopped
            elif isinstance(d, Pause):
                self.playout.pause(trial=d.trial)
                # the judge reads this speech on its own, a continuation too
                # (Smart Turn hears a pause inside its window as an end more
                # often: bench/end_of_turn.py); the words carry the context
                self._turn_audio.clear()
                self._held = after_echo(self._preroll)
                self._turn_audio.extend(self._held)
                self._preroll.clear()
                self._drop_utterance()
                self._utterance = self.transcription.begin()  # the recogniser hears it from the pre-roll on
                for pcm in self._held:
                    self._utterance.feed(pcm)
            elif isinstance(d, PauseStands):
                self.playout.pause()  # a far end's buffer goes now (media.telephony_playout)
            elif isinstance(d, Resume):
                self._resume(d)
            elif isinstance(d, ClassifyBackchannel):
                assert self._tg is not None
                self._classifying = self._tg.create_task(
                    self._classify_backchannel(d.candidate, self._held, self._utterance)
                )
            elif isinstance(d, CancelClassification):
                if self._classifying is not None:
                    self._classifying.cancel()
                    self._classifying = None
            elif isinstance(d, Commit):
                self._commit(d)
            elif isinstance(d, EndOfUtterance):
                run, self._listening = self._listening, None
                if run is not None:
                    run.end_utterance(d.speech_end_at, tentative=d.tentative)
                    self._speculating = run if d.tentative else None
            elif isinstance(d, JudgeEndOfTurn):
                assert self._tg is not None
                self._judged = None
                self._tg.create_task(self._judge_end(d.utterance, b"".join(self._turn_audio)))
            elif isinstance(d, ConfirmEndOfTurn):
                self._confirm_end(d)
            elif isinstance(d, PttTooLong):
                self._send(ErrorEvent(
                    generation=self.fence.active, code="ptt_too_long", message=f"push-to-talk held over {d.max_ms} ms"
                ))
            elif isinstance(d, ResetDetector):
                self.transport.reset_detector()

    def _agent_state(self) -> AgentActivity:
        """What turn-taking needs to know of the agent: is a reply on the way
        out (queued or being produced), is a turn thinking or speaking."""
        run = self._active_run()
        if run is None or not run.confirmed.is_set():
            return AgentActivity()  # a speculative reply is held: nothing is heard of it
        return AgentActivity(speaking=len(self.playout) > 0 or (run.phase == "speaking" and not run.tts_done), replying=True)

    def _resume(self, d: Resume) -> None:
        """Speech that was no barge-in: play on from the start of the word
        playout paused in (:meth:`voice.transport.OutputSink.rewind_to_word`);
        its audio goes back to the pre-roll."""
        replayed_ms = self.playout.rewind_to_word(d.paused_ms) if d.playout and d.held else 0
        if d.playout:
            self.playout.resume()
        self._drop_utterance()  # not a request: the recogniser hears no more of it
        for pcm in self._held[-self._preroll.maxlen :] if self._preroll.maxlen else []:
            self._preroll.append((pcm, False))
        if d.reason == "false_interruption":
            self.false_interruptions += d.held
        else:
            self.backchannels += 1
        if d.report and d.reason == "backchannel":
            self._send(Backchannel(generation=self.fence.active, paused_ms=d.paused_ms, replayed_ms=replayed_ms, **d.verdict))
        elif d.report:  # no verdict: it had none
            self._send(FalseInterruption(generation=self.fence.active, paused_ms=d.paused_ms, replayed_ms=replayed_ms))

    async def _classify_backchannel(self, candidate: int, held: list[bytes], utterance: Utterance | None) -> None:
        """Was candidate ``candidate`` (its audio: ``held``, its recognition:
        ``utterance``) a backchannel? What the recogniser heard (an interim
        that covers it, else its final; None if recognition failed) and the
        syllable count say (:mod:`voice.backchannel`). More syllables than a
        backchannel has is speech whatever the words: decided at once,
        without waiting for the recogniser (Whisper's decode takes about
        300 ms; a fast "tell me a story" would wait for it). The words come
        from the recogniser's short decode where it has one
        (:meth:`voice.transcription.Utterance.short_words`), which leaves the
        utterance open: a backchannel drops it undecoded, speech goes on
        into the turn and is decoded whole at its end."""
        cand = self.turn_taking.candidate
        if cand is None or cand.n != candidate:
            return
        # the user's speech only: the gate's run and what followed it, not
        # the older pre-roll (which can hold the agent's echo)
        syllables = count_syllable_nuclei(held[-(cand.lead_ms // FRAME_MS + cand.frames) :])
        if syllables > self.config.backchannel.max_syllables:
            text: str | None = ""  # not read: judge() calls it speech on the syllables alone
        else:
            text = None
            if utterance is not None:
                # the short decode where the recogniser has one (Whisper, about 80 ms), else
                # what it heard (a provider's interims, or the final: a whole decode)
                text = await utterance.short_words()
                if text is None:
                    text = await utterance.heard()
            cand = self.turn_taking.candidate
            if cand is None or cand.n != candidate:
                return  # decided meanwhile (the user went on)
            if text is not None and cand.joined:
                text = f"{cand.joined} {text}".strip()  # it went on after a backchannel: judged whole
        verdict = judge(self.config.backchannel, text, cand.speech_ms, syllables)
        self._carry_out(self.turn_taking.classified(candidate, self.clock.monotonic(), verdict, self._agent_state()))

    def _heard(self, utterance: Utterance) -> None:
        """The recogniser's text of ``utterance`` changed (an interim or a
        final): if it is the candidate's, turn-taking reads the words that
        stayed put across its last two updates (a real word among them
        commits a confirmed candidate at once,
        :meth:`voice.turn_taking.TurnTaking.heard`)."""
        cand = self.turn_taking.candidate
        if cand is None or utterance is not self._utterance or not utterance.settled_words:
            return  # a first guess is not acted on (Utterance.settled_words)
        self._carry_out(self.turn_taking.heard(cand.n, self.clock.monotonic(), utterance.settled_words))

    def _pause_hint(self, *, paused: bool) -> None:
        """Tell the recogniser of the utterance listened to that the user
        paused (it may decode what it has) or went on (that decode is stale)."""
        heard = self._listening.stt if self._listening is not None else None
        if isinstance(heard, Utterance):
            if paused:
                heard.speech_paused()
            else:
                heard.speech_resumed()

    def _drop_utterance(self) -> None:
        """The candidate's speech is no request (rejected, a backchannel,
        replaced): the recogniser hears no more of it."""
        utterance, self._utterance = self._utterance, None
        if utterance is not None:
            utterance.drop()

    def _tell_recognition_usage(self) -> None:
        """Tell the client what the session's recognition used, per
        recogniser (event ``stt.usage``), as the session ends."""
        totals = self.transcription.usage()
        for name in sorted(set(totals.audio_s) | set(totals.connection_s)):
            audio_s = totals.audio_s.get(name, 0.0)
            connection_s = totals.connection_s.get(name, 0.0)
            i, o = totals.input_tokens.get(name, 0), totals.output_tokens.get(name, 0)
            pricing = self.transcription.pricing_of(name)
            cents = pricing.session_cents(audio_s, connection_s, i, o) if pricing is not None else 0.0
            self._send(SttUsage(
                generation=self.fence.active, provider=name, audio_s=round(audio_s, 3), connection_s=round(connection_s, 3),
                reported_audio_s=round(totals.reported_audio_s.get(name, 0.0), 3), input_tokens=i, output_tokens=o,
                cents=round(cents, 4),
            ))

    def _synthesis_failed(self, notice: FailoverNotice) -> None:
        """Tell the client the synthesiser failed mid-reply and what follows (event ``tts.failover``)."""
        self._send(TtsFailover(
            generation=self.fence.active, provider=notice.provider, error=notice.error.kind, action=notice.action,
            fallback=notice.fallback, message=str(notice.error)[:500],
        ))

    def _recognition_failed(self, failed: str, error: RecognitionError, action: FailoverAction, now: str | None) -> None:
        """Tell the client the recogniser failed and what follows (event ``stt.failover``)."""
        self._send(SttFailover(
            generation=self.fence.active, provider=failed, error=error.kind, action=action, fallback=now,
            message=str(error),
        ))

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
        old = interrupted_turn(self._active_run(), self.playout)
        old_generation = self.fence.active
        generation = self.fence.advance()
        fenced_at = self.clock.monotonic()
        cleared = self.playout.clear()
        self.playout.resume()
        after: asyncio.Task[None] | None = None
        stream: Utterance | DigitStream
        if d.initiator in ("dtmf", "wake_word"):
            stream = DigitStream()
            self._drop_utterance()
        elif d.audio and self._utterance is not None:
            stream, self._utterance = self._utterance, None  # already heard from its pre-roll on
        else:
            self._drop_utterance()  # a press: what came before it is not the user's input
            stream = self.transcription.begin()
        run = TurnHandle(self._turn_context(), generation, stream)
        if old is not None and not old.confirmed.is_set():
            # the user went on before the end of their turn was confirmed:
            # the speculative reply is taken back (nothing of it was heard or
            # done) and the new turn answers both parts
            after = self._withdraw(old, d)
            run.continues, old.merged = old, True
        elif old is not None:
            rec, after = barge_in(
                old, d, old_generation=old_generation, new_generation=generation, fenced_at=fenced_at,
                cleared_frames=cleared, clock=self.clock, send=self._send,
            )
            if continues(old, d.onset_at, self.playout.played_samples(old.generation), self.config.endpoint.continue_window_ms):
                run.continues, old.merged = old, True
            self.barge_ins.append(rec)
        self._held = []
        self._preroll.clear()
        self._listening = run
        self._runs.append(run)
        run.open_task = self._tg.create_task(run.write(after, plan=self.plan, pricing=self.providers.llm.pricing))
        run.work = self._tg.create_task(run.work_on(self._answer))
        # forget runs whose terminal state is recorded; the rest settle again at the end
        self._runs = [r for r in self._runs if not (r.settled and r.finished)]

    # -- end of turn -----------------------------------------------------------

    async def _judge_end(self, utterance: int, pcm: bytes) -> None:
        """Ask the end-of-turn judge whether utterance ``utterance`` is
        complete and hand the verdict to turn-taking: the audio model (on
        ``pcm``, 16 kHz, in a worker thread) and, for a speculative turn, the
        words heard of the whole turn (:func:`voice.end_of_turn.words_complete`,
        once its recognition, already running, is in: its reply cannot start
        before that anyway): how long to wait on each verdict is turn-taking's
        rule (:meth:`voice.turn_taking.TurnTaking.judged`). A judge that is
        missing or fails leaves the fixed silence to decide; failed
        recognition leaves the audio to decide."""
        judge = self.providers.end_of_turn
        run = self._speculating
        complete: bool | None = None
        words: bool | None = None
        if judge is not None and pcm:
            try:
                verdict = await asyncio.to_thread(judge.judge, pcm, 16_000)
            except Exception:
                log.exception("the end-of-turn judge failed: the fixed silence decides")
            else:
                complete = verdict.complete
                if run is not None and run.stt_final is not None:
                    try:
                        heard = " ".join(t for t in (await run.earlier_words(), await run.final_transcript()) if t)
                    except Exception:
                        pass  # the recogniser failed: the turn fails on it; the audio decides the end
                    else:
                        words = words_complete(heard)
                self._judged = (utterance, round(verdict.probability, 3), round(verdict.inference_ms, 1), words)
        self._carry_out(self.turn_taking.judged(utterance, self.clock.monotonic(), complete, words))

    def _confirm_end(self, d: ConfirmEndOfTurn) -> None:
        """The end of the user's turn is confirmed: a speculative reply is
        let out (what it held, then the rest as it comes), and the client
        is told how the end was decided (event ``end_of_turn``)."""
        run = self._speculating if d.speculative else self._latest_ended()
        if d.speculative:
            self._speculating = None
            if run is not None:
                run.confirm(self.playout)
        judged = self._judged if self._judged is not None and self._judged[0] == d.utterance else None
        self._send(EndOfTurn(
            turn_id=run.turn_id if run is not None else None, generation=self.fence.active, outcome="confirmed",
            by=d.by, speculative=d.speculative, wait_ms=round((d.at - d.speech_end_at) * 1000, 1),
            probability=judged[1] if judged else None, judge_ms=judged[2] if judged else None,
            words_complete=judged[3] if judged else None,
        ))

    def _withdraw(self, old: TurnHandle, d: Commit) -> asyncio.Task[None]:
        """Take back the speculative turn ``old``: the user went on (commit
        ``d``) before its end of turn was confirmed. Stopped with its own
        reason (``speculation_withdrawn``, whose policy reverses anything
        it did, though it can have done nothing with an effect); its held
        output is logged withheld. Returns its stop task."""
        if self._speculating is old:
            self._speculating = None
        speech_end = old.speech_end_at if old.speech_end_at is not None else d.at
        self._send(EndOfTurn(
            turn_id=old.turn_id, generation=self.fence.active, outcome="withdrawn", by="user_went_on",
            speculative=True, wait_ms=round((d.at - speech_end) * 1000, 1),
        ))
        return old.stop(StopReason(kind=StopReasonKind.SPECULATION_WITHDRAWN, initiator="end_of_turn", at=self.clock.now()))

    def _latest_ended(self) -> TurnHandle | None:
        """The latest turn whose utterance ended."""
        for run in reversed(self._runs):
            if run.utterance_ended.is_set():
                return run
        return None

    # -- per-turn tasks --------------------------------------------------------

    async def _answer(self, run: TurnHandle, scope: TurnScope, turn: Turn) -> None:
        """What a turn's work does once its utterance ended (:func:`voice.reply.answer`)."""
        p = self.providers
        await answer(
            run, scope, turn, manager=self.manager, llm=p.llm, tts=self.tts, tools=p.tools, playout=self.playout,
            history=self.model_history,
        )

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
            fence=self.fence,
            report=self._send,
            shutdown_reserve_s=self.plan.shutdown_reserve_ms / 1000,
            heard_split=self.hearing.split,
            silence=self._silence_heard,
            on_stopping=self._silence,
            tell_interrupted=self._tell_interrupted,
        )

    async def _settle_all(self) -> None:
        """Session end: every turn this session began gets a terminal state
        (:meth:`voice.turn_handle.TurnHandle.settle`)."""
        closed_at = self.clock.now()
        for run in list(self._runs):
            await run.settle(self.close_reason, closed_at)
        self._runs.clear()

    # -- history and events ----------------------------------------------------

    def _tell_interrupted(self, run: TurnHandle) -> None:
        """Tell the client, once, how much of an interrupted reply was heard
        (:meth:`voice.heard.Hearing.interrupted`); nothing for a speculative
        turn taken back (nothing of it reached the client)."""
        if run.withdrawn:
            return
        event = self.hearing.interrupted(run)
        if event is not None:
            self._send(event)

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
        earlier = [t for r in self._runs if r.generation < run.generation for t in (r.work, r.stop_task) if t is not None]
        wait_s = earlier_turns_wait_s(self.config.stop_grace_ms)
        history = await history_after(self.manager, turn, earlier, wait_s=wait_s, max_messages=self.config.history_messages)
        return history if self.instructions is None else [Message(role="system", content=self.instructions), *history]

    def _send(self, event: Envelope, *, withheld: bool = False) -> None:
        """Hand ``event`` (its generation and turn set by its emitter) to the
        sink; a failing sink is logged, never raised into the session."""
        try:
            self._emit(event, withheld=withheld)
        except Exception:
            log.exception("event sink failed")

