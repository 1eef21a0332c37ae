"""Turn-taking: who has the floor, decided from the barge-in detector's
events, the frames' times and whether the agent is speaking.

A pure state machine: no awaits, no store, no providers, no clock reads.
Every time is clock seconds (a float on the session's monotonic clock, the
unit of :class:`media.bargein.DetectorEvent` and
:class:`media.inbound.InboundFrame`) and comes in with the call that needs
it. Each call returns the decisions it took, in order; the caller (the agent
session) carries them out in that order and owns everything they touch:
playout, audio, the recogniser, turns.

The rules (see :mod:`media.bargein` for the detector's two stages):

- speech_started opens a *candidate*: playout pauses (stage 1) and its audio
  is held from the pre-roll on (:class:`Pause`);
- speech_rejected before confirmation is a false interruption: playout
  resumes (:class:`Resume` ``"false_interruption"``);
- speech_confirmed commits (:class:`Commit`: the user takes the turn, a
  barge-in if the agent was replying) unless backchannels are enabled and
  the agent is speaking; then the candidate commits once it is longer than
  ``BackchannelConfig.max_ms`` (counted in frames), or, if it ends sooner,
  the recogniser is asked whether it was a backchannel
  (:class:`ClassifyBackchannel`; the answer comes back through
  :meth:`TurnTaking.classified`): a backchannel resumes playout no sooner
  than ``resume_after_ms`` after its speech ended, and only in a frame the
  gate did not pass; speech commits;
- a word that is no backchannel, heard by the recogniser in a confirmed
  candidate's speech (an interim will do), commits it at once
  (:meth:`TurnTaking.heard`);
- more speech right after a short one continues it ("front ... left"); speech
  confirmed within ``rejoin_ms`` of a backchannel commits at once;
- while a committed utterance is listened to, speech_stopped and
  speech_rejected arm the endpoint (:mod:`voice.endpointing`), speech
  disarms it, and :meth:`TurnTaking.on_frame` ends the utterance when it is
  over (:class:`EndOfUtterance`);
- with an end-of-turn judge or speculative replies (``EndpointConfig.mode``
  ``"model"``, ``speculative``), the end comes in two steps: at the
  *tentative* end (``tentative_ms`` of silence) the judge is asked
  (:class:`JudgeEndOfTurn`, answered through :meth:`TurnTaking.judged`)
  and, if speculative, the utterance ends tentatively (:class:`EndOfUtterance`
  ``tentative``: its reply starts, held); the end is *confirmed*
  (:class:`ConfirmEndOfTurn`) when the judge says complete, or at the
  silence its verdict allows, but never while new speech is a candidate;
  speech that commits first takes the speculative reply back (the session
  stops it, ``speculation_withdrawn``, and the new turn continues it);
- while an utterance is listened to, ``decode_at_ms`` of frames the gate
  did not pass (before the VAD's speech_stopped, which needs ``offset_ms``)
  start the recogniser decoding it so far (:class:`DecodeSoFar`), so its
  words are in sooner at the end of turn; a gated frame after that makes
  the decode stale (:class:`SpeechWentOn`);
- push-to-talk commits at once and ignores the detector until released,
  which ends the utterance without waiting; held over ``max_utterance_ms``
  it is let go (:class:`PttTooLong`).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

from media.bargein import DetectorEvent, DetectorEventKind
from media.frames import FRAME_MS
from turn.event_catalogue import BargeInInitiator, VadEventName
from voice.backchannel import BackchannelConfig
from voice.endpointing import EndpointConfig, end_at, utterance_over

# -- inputs -------------------------------------------------------------------


@dataclass(frozen=True)
class AgentActivity:
    """What the agent is doing when an event arrives.

    Attributes:
        speaking: a reply is on its way out (frames queued for playout, or
            being synthesised).
        replying: a turn is thinking or speaking for the user (its utterance
            ended and it has not finished).
    """

    speaking: bool = False
    replying: bool = False


# -- decisions ------------------------------------------------------------------


@dataclass(frozen=True)
class Announce:
    """Tell the client: event ``vad`` with ``event`` (a detector decision's
    name, or ``"end_of_turn"``)."""

    event: VadEventName


#: the ``vad`` event that announces each detector decision
ANNOUNCED: dict[DetectorEventKind, VadEventName] = {
    DetectorEventKind.SPEECH_STARTED: "speech_started",
    DetectorEventKind.SPEECH_CONFIRMED: "speech_confirmed",
    DetectorEventKind.SPEECH_REJECTED: "speech_rejected",
    DetectorEventKind.SPEECH_STOPPED: "speech_stopped",
}


@dataclass(frozen=True)
class Pause:
    """Stage 1: pause playout (if it plays) and hold candidate ``candidate``'s
    audio from now on, the pre-roll first. ``trial``: the onset is not yet
    verified as speech (a pause on trial, resumed within ``pause_verify_ms``
    unless it is), so a far end's buffer is left to play (the sink's
    :meth:`voice.transport.OutputSink.pause`)."""

    candidate: int
    trial: bool = False


@dataclass(frozen=True)
class PauseStands:
    """A pause on trial for candidate ``candidate`` scored as speech: it
    stands, and a sink whose far end buffers may now recall that buffer."""

    candidate: int


@dataclass(frozen=True)
class Resume:
    """The candidate took no turn: let playout go on.

    Attributes:
        reason: ``"false_interruption"`` or ``"backchannel"`` (the event's type).
        playout: resume playout (this candidate paused it).
        held: the agent was replying and was held by it (what counts as a
            false interruption).
        report: send event ``reason`` with ``paused_ms`` and ``verdict``.
        paused_ms: how long playout was paused, ms (int 0 if not paused by it).
        verdict: the backchannel's verdict (``text``, ``syllables``), or empty.
    """

    reason: Literal["false_interruption", "backchannel"]
    playout: bool
    held: bool
    report: bool
    paused_ms: float
    verdict: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class ClassifyBackchannel:
    """Ask the recogniser whether candidate ``candidate`` (ended, short) was
    a backchannel; hand the verdict to :meth:`TurnTaking.classified`."""

    candidate: int


@dataclass(frozen=True)
class CancelClassification:
    """The classification of candidate ``candidate`` is no longer wanted."""

    candidate: int


@dataclass(frozen=True)
class Commit:
    """Stage 2: the user takes the turn (a barge-in if the agent is replying).

    Attributes:
        at: clock seconds of the decision.
        initiator: ``"vad"``, ``"ptt"`` or ``"dtmf"``.
        onset_at: clock seconds of the speech's first gated frame.
        paused_ms: how long playout was paused for it, ms (int 0 if not).
        audio: feed the candidate's held audio to the new turn's recogniser
            (push-to-talk and keys have none).
    """

    at: float
    initiator: BargeInInitiator
    onset_at: float
    paused_ms: float
    audio: bool = True


@dataclass(frozen=True)
class EndOfUtterance:
    """The utterance listened to is complete; its speech ended at
    ``speech_end_at`` (clock seconds). ``tentative``: only tentatively (a
    speculative reply starts; :class:`ConfirmEndOfTurn` or a commit follows)."""

    speech_end_at: float
    tentative: bool = False


@dataclass(frozen=True)
class JudgeEndOfTurn:
    """Ask the end-of-turn judge whether utterance ``utterance`` is complete
    (its audio up to now); hand the verdict to :meth:`TurnTaking.judged`."""

    utterance: int


@dataclass(frozen=True)
class DecodeSoFar:
    """The user listened to (utterance ``utterance``) has been quiet
    ``EndpointConfig.decode_at_ms``: decode the utterance so far,
    tentatively (the recogniser's final takes it if no speech follows)."""

    utterance: int


@dataclass(frozen=True)
class SpeechWentOn:
    """Speech after a :class:`DecodeSoFar` of utterance ``utterance``: that
    decode no longer covers the utterance."""

    utterance: int


EndBy = Literal["model", "silence", "incomplete_bound"]


@dataclass(frozen=True)
class ConfirmEndOfTurn:
    """The end of utterance ``utterance`` (its speech ended at
    ``speech_end_at``, clock seconds) is confirmed at ``at`` by ``by``: the
    judge said complete (``"model"``), the fixed silence passed
    (``"silence"``: mode silence, or the judge failed or was late), or the
    longer silence after an "incomplete" verdict passed
    (``"incomplete_bound"``). ``speculative``: its reply was started at the
    tentative end and may play now."""

    utterance: int
    at: float
    speech_end_at: float
    by: EndBy
    speculative: bool


@dataclass(frozen=True)
class PttTooLong:
    """Push-to-talk was held over ``max_ms`` (tell the client; the hold is
    let go by the decisions that follow)."""

    max_ms: int


@dataclass(frozen=True)
class ResetDetector:
    """Forget the detector's current run (push-to-talk pressed or released)."""


Decision = (
    Announce | Pause | PauseStands | Resume | ClassifyBackchannel | CancelClassification | Commit | EndOfUtterance
    | JudgeEndOfTurn | ConfirmEndOfTurn | PttTooLong | ResetDetector | DecodeSoFar | SpeechWentOn
)


# -- state ----------------------------------------------------------------------


@dataclass
class Candidate:
    """Speech that the detector's first stage heard and that has taken no
    turn yet (the second stage has not decided, or it may be a backchannel).
    Read it; only :class:`TurnTaking` changes it.

    Attributes:
        n: its serial number (decisions name it).
        onset_at: clock seconds of its first gated frame.
        paused: playout was paused for it (so a rejection resumes it).
        paused_at: clock seconds when it paused playout.
        confirmed_at: when the second stage confirmed it, if it did.
        ended_at: when its speech ended, if it did.
        resumed_from: where it had ended before the user went on after a pause.
        lead_ms: ms of it before speech_started (the gate's run).
        frames: frames received since speech_started; counted in frames,
            not clock time: on a loaded machine frames arrive in bursts.
        speech_ms: its speech's length once it ended, ms.
        classification: None, ``"running"`` (asked) or ``"done"`` (answered).
        release_at: judged a backchannel: playout goes on at this clock time.
        verdict: the backchannel's verdict (the event's payload).
        quiet: frames in a row the gate did not pass, up to now.
        early: it was classified after ``BackchannelConfig.decide_after_ms``
            of quiet frames, before the VAD's speech_stopped (a gated frame
            then means the user went on).
        joined: the words of the backchannel let go just before it, when it
            came within ``rejoin_ms`` ("yeah ... but"): it is judged with them.
    """

    n: int
    onset_at: float
    paused: bool
    paused_at: float
    confirmed_at: float | None = None
    ended_at: float | None = None
    resumed_from: float | None = None
    lead_ms: int = 0
    frames: int = 0
    speech_ms: int = 0
    classification: Literal["running", "done"] | None = None
    release_at: float | None = None
    verdict: dict[str, Any] = field(default_factory=dict)
    quiet: int = 0
    early: bool = False
    joined: str = ""


@dataclass
class EndOfTurnWait:
    """The end of the utterance ``n`` is tentative: waiting for the judge or
    the silence to confirm it. Read it; only :class:`TurnTaking` changes it.

    Attributes:
        n: the utterance's serial number (decisions name it).
        speech_end_at: clock seconds when its speech ended.
        confirm_at: clock seconds when silence alone confirms it (the
            fixed silence until the judge answers; after "incomplete" one
            of the longer bounds, see :meth:`TurnTaking.judged`).
        speculative: its utterance ended at the tentative end (the reply
            is running, held): turn-taking no longer listens to it.
        judge: None (not asked), ``"running"``, or its verdict:
            ``"complete"`` (kept only while new speech is a candidate: it
            confirms once that speech proves to be none), ``"incomplete"``
            or ``"failed"``.
    """

    n: int
    speech_end_at: float
    confirm_at: float
    speculative: bool
    judge: Literal["running", "complete", "incomplete", "failed"] | None = None


class TurnTaking:
    """The turn-taking state machine of one session (see the module doc).

    It assumes it is the only one pausing and resuming playout (it tracks
    whether playout is paused from its own decisions).

    Args:
        backchannel: backchannel thresholds (may be replaced between calls).
        endpoint: endpointing thresholds (may be replaced between calls).
        offset_ms: the VAD's unvoiced run before speech_stopped, ms
            (``media.vad.VadConfig.offset_ms``): speech ended that long
            before speech_stopped.
    """

    def __init__(self, backchannel: BackchannelConfig, endpoint: EndpointConfig, offset_ms: int) -> None:
        self.backchannel = backchannel
        self.endpoint = endpoint
        self.offset_ms = offset_ms
        self.candidate: Candidate | None = None
        #: a committed utterance is being listened to
        self.listening = False
        #: ... and push-to-talk holds it (only the release ends it)
        self.listening_ptt = False
        #: push-to-talk is held: the detector's decisions are not used
        self.ptt_active = False
        #: playout is paused by a Pause of ours
        self.paused = False
        #: clock seconds when the last backchannel was let go, and its words
        self.backchannel_at: float | None = None
        self.backchannel_text = ""
        #: endpointing of the utterance listened to (clock seconds)
        self.endpoint_at: float | None = None
        self.speech_end_at: float | None = None
        self.last_speech_at = 0.0
        self.utterance_at = 0.0
        #: the tentative end of the latest utterance, until confirmed or taken back
        self.waiting: EndOfTurnWait | None = None
        #: clock seconds of the tentative end of the utterance listened to (armed)
        self.tentative_at: float | None = None
        self._serial = 0
        self._utterances = 0
        #: frames in a row the gate did not pass, in the utterance listened to
        self._quiet_frames = 0
        #: a DecodeSoFar went out for the current quiet run
        self._decoding_so_far = False

    # -- inputs ---------------------------------------------------------------

    def on_event(self, ev: DetectorEvent, agent: AgentActivity) -> list[Decision]:
        """One detector decision (ignored while push-to-talk is held)."""
        if self.ptt_active:
            return []
        if ev.kind is DetectorEventKind.SPEECH_VERIFIED:
            # a pause on trial stands: the far end's buffer may go too (not announced)
            cand = self.candidate
            return [PauseStands(cand.n)] if cand is not None and cand.paused and self.paused else []
        out: list[Decision] = [Announce(ANNOUNCED[ev.kind])]
        cand = self.candidate
        bc = self.backchannel
        kind = ev.kind
        if kind is DetectorEventKind.SPEECH_STARTED:
            if self.listening:
                self._disarm()  # the user goes on: hold the endpoint
                return out
            if cand is not None and cand.ended_at is not None:
                # More speech right after a short one ("uh ... huh", "front
                # ... right"): one utterance with a pause; it is judged whole
                # when it ends (or commits once longer than a backchannel).
                if cand.classification == "running":
                    out.append(CancelClassification(cand.n))
                cand.classification = None
                cand.resumed_from, cand.ended_at, cand.release_at = cand.ended_at, None, None
                return out
            out.append(self._open(
                ev.onset_at, ev.at, lead_ms=round((ev.at - ev.onset_at) * 1000) + FRAME_MS, trial=ev.reason == "trial"
            ))
        elif kind is DetectorEventKind.SPEECH_CONFIRMED:
            self.last_speech_at = ev.at
            if self.listening:
                self._disarm()
                return out
            if cand is None:
                return out
            cand.confirmed_at = ev.at
            rejoin = self.backchannel_at
            if not (bc.enabled and agent.speaking):
                out += self._commit(ev.at)
            elif rejoin is not None and ev.onset_at - rejoin <= bc.rejoin_ms / 1000:
                # Speech right after a backchannel: "uh ... huh", or "yeah
                # ... but" (the user was pausing inside an utterance). It is
                # judged with the backchannel's words: more backchannel
                # words go on being one, any other word commits.
                self.backchannel_at = None
                cand.joined = self.backchannel_text
        elif kind is DetectorEventKind.SPEECH_REJECTED:
            if self.listening:
                # not speech after all: the silence still counts from the end of speech
                if not self.listening_ptt:
                    self._arm(ev.at, self.speech_end_at if self.speech_end_at is not None else ev.at)
                return out
            if cand is not None and cand.confirmed_at is None:
                self.candidate = None
                out += self._resume(cand, ev.at, "false_interruption", agent)
            elif cand is not None and cand.ended_at is None and cand.classification is None:
                # what followed a short utterance was no speech: judge that one
                cand.ended_at = cand.resumed_from if cand.resumed_from is not None else ev.at
                out += self._classify(cand)
        elif kind is DetectorEventKind.SPEECH_STOPPED:
            speech_end = ev.at - self.offset_ms / 1000
            if self.listening:
                if not self.listening_ptt:
                    self._arm(ev.at, speech_end)
                return out
            if cand is not None and cand.confirmed_at is not None and cand.classification is None:
                cand.ended_at = speech_end
                cand.speech_ms = cand.lead_ms + (cand.frames + 1) * FRAME_MS - self.offset_ms
                out += self._classify(cand)
        return out

    def on_frame(self, at: float, gated: bool, agent: AgentActivity) -> list[Decision]:
        """Once per 20 ms frame, after its events (``at``: its clock seconds;
        ``gated``: it passed the detector's gate): counts the candidate's
        frames and checks the timers: a backchannel grown too long, a
        backchannel's release, the endpoint, an utterance that never ends."""
        out: list[Decision] = []
        cand = self.candidate
        if cand is not None and not self.listening:
            cand.frames += 1
            cand.quiet = 0 if gated else cand.quiet + 1
            if cand.early and gated and cand.ended_at is not None:
                out += self._went_on(cand)  # speech again before the VAD said it stopped: one utterance
        if cand is not None and cand.confirmed_at is not None and cand.ended_at is None and gated:
            if cand.lead_ms + (cand.frames + 1) * FRAME_MS > self.backchannel.max_ms:
                out += self._commit(at)  # still speaking: too long for a backchannel
        elif cand is not None and cand.confirmed_at is not None and cand.ended_at is None and not self.listening:
            out += self._decide_early(cand, at)
        elif cand is not None and cand.release_at is not None and at >= cand.release_at and not gated:
            out += self._let_go(cand, at, agent)
        if not self.listening:
            self._quiet_frames, self._decoding_so_far = 0, False
            return out + self._end_wait(at)
        ep = self.endpoint
        if self.listening_ptt:
            self._quiet_frames, self._decoding_so_far = 0, False
            if at - self.utterance_at > ep.max_utterance_ms / 1000:
                # push-to-talk held too long: the utterance ends, the hold is let go
                out.append(PttTooLong(ep.max_utterance_ms))
                out += self.ptt_end(at)
            return out
        out += self._decode_early(gated)
        wait = self.waiting
        if utterance_over(ep, at, end=None, last_speech_at=self.last_speech_at, utterance_at=self.utterance_at):
            # a noisy room or an utterance that never stops: over, whatever the judge says
            return out + self._end(at, self.speech_end_at if self.speech_end_at is not None else at, "silence")
        if not ep.tentative:
            if self.endpoint_at is not None and at >= self.endpoint_at:
                out += self._end(at, self.speech_end_at if self.speech_end_at is not None else at, "silence")
            return out
        if self.tentative_at is not None and at >= self.tentative_at and wait is None:
            out += self._tentative(at)
            wait = self.waiting
        if wait is not None and not wait.speculative and at >= wait.confirm_at:
            out += self._confirm(at)
        return out

    def _decode_early(self, gated: bool) -> list[Decision]:
        """Count the quiet frames of the utterance listened to: at
        ``decode_at_ms`` of them (sooner than the VAD's speech_stopped) its
        decode starts; a gated frame after that makes it stale."""
        if gated:
            went_on = self._decoding_so_far
            self._quiet_frames, self._decoding_so_far = 0, False
            return [SpeechWentOn(self._utterances)] if went_on else []
        self._quiet_frames += 1
        due = self.endpoint.decode_at_ms
        if (not self._decoding_so_far and due < self.offset_ms and self.speech_end_at is None
                and self._quiet_frames * FRAME_MS >= due):
            self._decoding_so_far = True
            return [DecodeSoFar(self._utterances)]
        return []

    def _end_wait(self, at: float) -> list[Decision]:
        """A speculative utterance's end waits on no new speech: confirmed
        once its silence (``confirm_at``) passed and nobody is talking."""
        wait = self.waiting
        if wait is None or not wait.speculative or self.candidate is not None or self.listening or at < wait.confirm_at:
            return []
        return self._confirm(at)

    def classified(self, candidate: int, at: float, verdict: dict[str, Any] | None, agent: AgentActivity) -> list[Decision]:
        """The answer to :class:`ClassifyBackchannel` for ``candidate``, at
        ``at`` (clock seconds): ``verdict`` (:func:`voice.backchannel.judge`)
        if it was a backchannel, else None (it commits). An answer for a
        candidate that is gone or no longer asked about changes nothing."""
        cand = self.candidate
        if cand is None or cand.n != candidate or cand.classification != "running":
            return []
        cand.classification = "done"
        if verdict is None:
            return self._commit(at)
        cand.verdict = dict(verdict)
        ended = cand.ended_at if cand.ended_at is not None else at
        cand.release_at = ended + self.backchannel.resume_after_ms / 1000
        if at >= cand.release_at:
            return self._let_go(cand, at, agent)
        return []

    def judged(self, utterance: int, at: float, complete: bool | None, words: bool | None = None) -> list[Decision]:
        """The end-of-turn judge's answer to :class:`JudgeEndOfTurn` for
        ``utterance``, at ``at`` (clock seconds): ``complete`` is the audio
        model's verdict (None: it failed, the fixed silence decides) and
        ``words`` whether the words heard sound finished
        (:func:`voice.end_of_turn.words_complete`; None: not known).

        - the audio complete and the words not unfinished: the turn ends
          now (if nobody is talking);
        - the audio incomplete but the words finished (the two halves
          disagree): it waits up to ``unsure_silence_ms`` of silence;
        - the words unfinished, or the audio incomplete with no words
          known: up to ``incomplete_silence_ms``.

        An answer for an utterance that is no longer waiting (the user
        went on) changes nothing."""
        wait = self.waiting
        if wait is None or wait.n != utterance or wait.judge != "running":
            return []
        if complete is None:
            wait.judge = "failed"
            wait.confirm_at = min(wait.confirm_at, end_at(self.endpoint, wait.speech_end_at, wait.speech_end_at))
        elif complete and words is not False:
            if wait.speculative and (self.candidate is not None or self.listening):
                wait.judge = "complete"  # new speech is a candidate: it decides first
                wait.confirm_at = at
                return []
            return self._confirm(at, by="model")
        else:
            wait.judge = "incomplete"
            bound_ms = self.endpoint.unsure_silence_ms if words else self.endpoint.incomplete_silence_ms
            wait.confirm_at = wait.speech_end_at + bound_ms / 1000
        return self._end_wait(at) if wait.speculative else []

    def heard(self, candidate: int, at: float, text: str) -> list[Decision]:
        """The recogniser's text so far (an interim or a final) of candidate
        ``candidate``'s speech, at ``at`` (clock seconds). A word that is
        no backchannel in a candidate the detector confirmed commits it at
        once: it is a request, not "uh-huh", so neither ``max_ms`` nor the
        final is waited for (issue 28, item 5). Text of a candidate not yet
        confirmed changes nothing (the detector's second stage, with the
        echo guard, still decides whether it is speech at all); nor does
        text made only of backchannel words (the judge decides those when
        the speech ends)."""
        cand = self.candidate
        if cand is None or cand.n != candidate or cand.confirmed_at is None or self.listening or not text.strip():
            return []
        if self.backchannel.matches(text):
            return []
        return self._commit(at)

    def ptt_start(self, at: float, initiator: BargeInInitiator = "ptt") -> list[Decision]:
        """Push-to-talk pressed at ``at``: an immediate, committed barge-in
        with no VAD involved (or, if an utterance is already listened to,
        push-to-talk takes it over). Changes nothing if already held.
        ``initiator`` ``"dtmf"``: a telephone key opens keypad input the
        same way (held until :meth:`ptt_end`)."""
        if self.ptt_active:
            return []
        self.ptt_active = True
        out: list[Decision] = [ResetDetector()]
        cand, self.candidate = self.candidate, None
        if cand is not None and cand.classification == "running":
            out.append(CancelClassification(cand.n))
        if self.listening:
            self.listening_ptt = True
            self._disarm()
            return out
        out.append(self._open(at, at))
        out += self._commit(at, initiator=initiator)
        return out

    def ptt_end(self, at: float) -> list[Decision]:
        """Push-to-talk released at ``at``: the utterance ends at once (no
        endpointing wait). Changes nothing if not held."""
        if not self.ptt_active:
            return []
        self.ptt_active = False
        out: list[Decision] = [ResetDetector()]
        was, self.listening = self.listening, False
        self._disarm()
        if was:
            out += [Announce("end_of_turn"), EndOfUtterance(at)]
        return out

    # -- steps ----------------------------------------------------------------

    def _open(self, onset_at: float, at: float, lead_ms: int = 0, trial: bool = False) -> Pause:
        self._serial += 1
        paused, self.paused = not self.paused, True
        self.candidate = Candidate(self._serial, onset_at, paused, at, lead_ms=lead_ms)
        return Pause(self._serial, trial)

    def _commit(self, at: float, initiator: BargeInInitiator = "vad") -> list[Decision]:
        cand = self.candidate
        assert cand is not None
        out: list[Decision] = []
        if cand.classification == "running":
            out.append(CancelClassification(cand.n))
        self.candidate = None
        if self.listening:
            # Never two utterances at once; should it happen, the unfinished
            # one ends here and is stopped like any other turn in flight.
            out.append(EndOfUtterance(at))
        paused_ms = round((at - cand.paused_at) * 1000, 1) if cand.paused else 0
        out.append(Commit(at, initiator, cand.onset_at, paused_ms, audio=initiator == "vad"))
        self.paused = False  # the commit clears and resumes playout
        # a tentative end is taken back: the user went on (the session stops its reply)
        self.waiting = None
        self.listening, self.listening_ptt = True, initiator != "vad"
        self._utterances += 1
        self._disarm()
        self.speech_end_at = None
        self.last_speech_at = self.utterance_at = at
        if cand.ended_at is not None and not self.listening_ptt:
            self._arm(at, cand.ended_at)
        return out

    def _arm(self, stopped_at: float, speech_end: float) -> None:
        ep = self.endpoint
        self.speech_end_at = speech_end
        self.endpoint_at = end_at(ep, stopped_at, speech_end)
        self.tentative_at = max(stopped_at, speech_end + ep.tentative_ms / 1000) if ep.tentative else None

    def _disarm(self) -> None:
        """The user goes on: the endpoint of the utterance listened to is
        held, and a tentative end of it that did not end it is forgotten."""
        self.endpoint_at = self.tentative_at = None
        if self.waiting is not None and not self.waiting.speculative:
            self.waiting = None

    def _tentative(self, at: float) -> list[Decision]:
        """The tentative end of the utterance listened to: ask the judge
        (mode ``"model"``) and, if speculative, end the utterance
        tentatively (its reply starts, held)."""
        ep = self.endpoint
        speech_end = self.speech_end_at if self.speech_end_at is not None else at
        assert self.endpoint_at is not None
        wait = EndOfTurnWait(self._utterances, speech_end, self.endpoint_at, ep.speculative)
        self.waiting = wait
        out: list[Decision] = []
        if ep.speculative:
            self.listening = False
            self.endpoint_at = self.tentative_at = None
            out.append(EndOfUtterance(speech_end, tentative=True))
        if ep.mode == "model":
            # the judge has up to the longer bound to answer (it reads the
            # recogniser's words too); if it fails, the fixed silence decides
            wait.judge = "running"
            wait.confirm_at = speech_end + ep.incomplete_silence_ms / 1000
            out.append(JudgeEndOfTurn(wait.n))
        return out

    def _confirm(self, at: float, by: EndBy | None = None) -> list[Decision]:
        """Confirm the tentative end: a speculative reply may play now; an
        utterance still listened to ends now."""
        wait = self.waiting
        assert wait is not None
        self.waiting = None
        if by is None:
            # the longer bound also ends the wait for a judge that never answered
            by = "model" if wait.judge == "complete" else "incomplete_bound" if wait.judge in ("incomplete", "running") else "silence"
        out: list[Decision] = [Announce("end_of_turn")]
        if not wait.speculative:
            self.listening = False
            self.endpoint_at = self.tentative_at = None
            out.append(EndOfUtterance(wait.speech_end_at))
        out.append(ConfirmEndOfTurn(wait.n, at, wait.speech_end_at, by, wait.speculative))
        return out

    def _end(self, at: float, speech_end: float, by: EndBy) -> list[Decision]:
        """The utterance listened to is over now, without a tentative step
        (mode silence without speculation, or a hard limit)."""
        self.listening = False
        self.endpoint_at = self.tentative_at = None
        self.waiting = None
        out: list[Decision] = [Announce("end_of_turn"), EndOfUtterance(speech_end)]
        if self.endpoint.tentative:
            out.append(ConfirmEndOfTurn(self._utterances, at, speech_end, by, False))
        return out

    def _classify(self, cand: Candidate) -> list[Decision]:
        cand.classification = "running"
        return [ClassifyBackchannel(cand.n)]

    def _decide_early(self, cand: Candidate, at: float) -> list[Decision]:
        """A confirmed candidate quiet for ``decide_after_ms`` (sooner than
        the VAD's speech_stopped, which needs ``offset_ms``): its speech
        ended where the quiet run began; it is classified now."""
        quiet_ms = cand.quiet * FRAME_MS
        due = self.backchannel.decide_after_ms
        if cand.classification is not None or due >= self.offset_ms or quiet_ms < due:
            return []
        cand.early = True
        cand.ended_at = at - quiet_ms / 1000
        cand.speech_ms = cand.lead_ms + cand.frames * FRAME_MS - quiet_ms
        return self._classify(cand)

    def _went_on(self, cand: Candidate) -> list[Decision]:
        """Speech again after an early classification of ``cand``: it did
        not end; the classification (or a verdict waiting for its release)
        is dropped, and it is judged whole when it ends."""
        out: list[Decision] = [CancelClassification(cand.n)] if cand.classification == "running" else []
        cand.early, cand.classification, cand.ended_at, cand.release_at, cand.verdict = False, None, None, None, {}
        return out

    def _let_go(self, cand: Candidate, at: float, agent: AgentActivity) -> list[Decision]:
        """A backchannel: the paused reply goes on, the words are dropped."""
        self.candidate = None
        self.backchannel_at = at
        self.backchannel_text = str(cand.verdict.get("text") or "")
        return self._resume(cand, at, "backchannel", agent, cand.verdict)

    def _resume(
        self, cand: Candidate, at: float, why: Literal["false_interruption", "backchannel"], agent: AgentActivity,
        verdict: dict[str, Any] | None = None,
    ) -> list[Decision]:
        if cand.paused:
            self.paused = False
        held = cand.paused and agent.replying
        paused_ms = round((at - cand.paused_at) * 1000, 1) if cand.paused else 0
        report = held or why != "false_interruption"
        return [Resume(why, cand.paused, held, report, paused_ms, dict(verdict or {}))]
