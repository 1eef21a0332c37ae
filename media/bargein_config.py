"""The two-stage barge-in detector's settings (:class:`BargeInConfig`;
env ``TURNKEEPER_BARGEIN__*``), apart from the detector
(:mod:`media.bargein`) so the settings can be read without it.
"""

from __future__ import annotations

from pydantic import BaseModel, Field, model_validator

from media.frames import FRAME_MS


class BargeInConfig(BaseModel):
    """Barge-in detection settings (env ``TURNKEEPER_BARGEIN__*``).

    Attributes:
        pause_after_ms: stage 1: consecutive gated frames (ms, multiple of 20)
            before SPEECH_STARTED (the caller pauses playout) can be given.
        pause_speech_threshold: stage 1 also needs the speech-onset score
            (:mod:`media.speech_onset`, 0..1) of a gated frame at least this
            high; 0 pauses on the gate alone. 0.8: on the corpus (speech
            clean and through a 48 kHz round trip), with the trial pauses
            below, speech pauses 60-100 ms (p50 60, p95 100) after its first
            sample; noise, tones, clicks
            and coughs peak at 0.57, and a 200-6000 Hz sweep at 0.72 when a
            run starts mid-sweep (0.7 would let it pause and confirm).
        pause_tentative_threshold: a gated frame scoring at least this
            (but under ``pause_speech_threshold``) pauses at once, once per
            run, on trial: unless the run reaches ``pause_speech_threshold``
            within ``pause_verify_ms``, SPEECH_REJECTED (reason
            "not_speech") resumes playout before the hole is audible. Set
            it to 1 to pause only on ``pause_speech_threshold``. 0.5: most
            onsets of "tell ..." score 0.57-0.92 on the frame where the gate
            has been open 60 ms and >= 0.8 a frame later (20 ms sooner
            heard); noise, clicks and coughs stay under 0.5.
        pause_verify_ms: how long (ms, multiple of 20) a tentative pause
            waits for the onset to score as speech.
        pause_sibilant_verify_ms: a run whose gated frames sound like /s/
            (:func:`media.speech_onset.is_sibilant`, ``SIBILANT_FRAMES`` of
            them) pauses on trial too and waits this long (ms, multiple of
            20) for its vowel: "stop" at 120 wpm pauses at 60 ms instead of
            180-200. A sibilant frame above the gate's margin is gated even
            when webrtcvad calls it unvoiced (a softly said "side": 80 ms
            instead of 180). 0 turns both off.
        confirm_speech_ms: stage 2: ms of audio with Silero probability
            ``>= silero_threshold`` and energy ``>= floor + energy_margin_db``
            (and not echo) before SPEECH_CONFIRMED (multiple of 20).
        silero_threshold: Silero speech probability (0..1) a chunk needs.
        confirm_timeout_ms: SPEECH_STARTED not confirmed this long (ms,
            multiple of 20) -> SPEECH_REJECTED.
        energy_margin_db: confirmation needs chunk energy this far (dB) above
            the adaptive noise floor.
        gate_margin_db: the stage-1 gate needs frame energy this far (dB)
            above the noise floor, so a steady noise stops gating once the
            floor has learnt it.
        rearm_ms: after SPEECH_REJECTED the gate must be closed this long
            (ms, multiple of 20) before a new SPEECH_STARTED.
        gate_dropout_frames: non-gated frames (0..2) tolerated inside a stage-1
            run without breaking it (a weak frame inside a syllable); they do
            not count towards ``pause_after_ms``. A frame explained as echo is
            never tolerated: it ends the run.
        echo_guard: run the echo guard when an
            :class:`media.echo_guard.EchoReference` is given.
        echo_max_delay_ms: longest round trip (ms: outbound sent -> heard back
            inbound) the echo guard searches.
        echo_threshold: similarity (0..1) above which inbound audio counts as
            explained by the outbound signal. 0.8: on the corpus, echo frames
            (two Opus trips, 40..400 ms, -6..-20 dB) score p5 0.89 / median
            0.97, double-talk frames median 0.49 (0 when the newest frame has
            unexplained energy).
        echo_assumed_loss_db: the echo path's loss (dB) the echo guard
            assumes before the session's playout has shown it (learning it
            takes 800 ms of audible playout): a frame
            ``media.echo_guard.ECHO_LOUDER_DB`` louder than the loudest
            recent playout less this loss is not echo. 6: a passive
            acoustic path (loudspeaker to microphone) does not amplify, and
            the loud speakerphone of issue 32 (-6 dB) still has 6 dB of
            margin; a user louder than the agent is heard at once at a
            session's first reply. 0 for clients whose echo path has gain
            (automatic gain control on a speakerphone): until the loss is
            learnt, their echo would pause the first reply. An echo louder
            than the assumption, matching frame after frame, drops it for
            the session.
        echo_cancelled_loss_db: the loss (dB) assumed instead, until
            playout has shown it, for a client that declares its
            microphone runs an echo canceller (a browser's
            ``MediaTrackSettings.echoCancellation``, W3C Media Capture and
            Streams): the acoustic path's loss plus the canceller's echo
            return loss enhancement, which WebRTC's AEC3 puts at 20 dB and
            more from its first second (it starts in a conservative
            suppression phase). 20: a user 14 dB below the agent's level
            is heard at once at a session's first reply, where with 6 dB
            a user whose first syllable matched the reply's own first
            syllable (the same envelope at a steady delay) was taken for
            echo for up to 300 ms. A canceller that lets the agent back
            louder than that costs one short pause: the re-check drops the
            assumption as above.
        floor_init_dbfs: noise floor (dBFS) before anything was heard.
        floor_min_dbfs / floor_max_dbfs: clamp of the noise floor (dBFS).
        floor_down_ms: time constant (ms) of the floor following a quieter
            background (fast).
        floor_up_ms: time constant (ms) of the floor following a louder
            background (slow: a steady noise is learnt in about
            ``floor_up_ms * ln(gap / gate_margin_db)``, ~2 s for a 40 dB step).
    """

    pause_after_ms: int = Field(60, ge=FRAME_MS, le=1000)
    pause_speech_threshold: float = Field(0.8, ge=0.0, lt=1.0)
    pause_tentative_threshold: float = Field(0.5, ge=0.0, le=1.0)
    pause_verify_ms: int = Field(40, ge=FRAME_MS, le=200)
    pause_sibilant_verify_ms: int = Field(160, ge=0, le=400)
    confirm_speech_ms: int = Field(160, ge=FRAME_MS, le=2000)
    silero_threshold: float = Field(0.5, gt=0.0, lt=1.0)
    confirm_timeout_ms: int = Field(600, ge=FRAME_MS, le=5000)
    energy_margin_db: float = Field(10.0, ge=0.0, le=60.0)
    gate_margin_db: float = Field(6.0, ge=0.0, le=60.0)
    rearm_ms: int = Field(200, ge=0, le=5000)
    gate_dropout_frames: int = Field(1, ge=0, le=2)
    echo_guard: bool = True
    echo_max_delay_ms: int = Field(500, ge=FRAME_MS, le=2000)
    echo_threshold: float = Field(0.8, gt=0.0, lt=1.0)
    echo_assumed_loss_db: float = Field(6.0, ge=0.0, le=40.0)
    echo_cancelled_loss_db: float = Field(20.0, ge=0.0, le=40.0)
    floor_init_dbfs: float = Field(-60.0, ge=-100.0, le=0.0)
    floor_min_dbfs: float = Field(-70.0, ge=-100.0, le=0.0)
    floor_max_dbfs: float = Field(-20.0, ge=-100.0, le=0.0)
    floor_down_ms: int = Field(100, ge=FRAME_MS, le=60_000)
    floor_up_ms: int = Field(1000, ge=FRAME_MS, le=60_000)

    @model_validator(mode="after")
    def _consistent(self) -> BargeInConfig:
        for name in (
            "pause_after_ms", "confirm_speech_ms", "confirm_timeout_ms", "rearm_ms", "echo_max_delay_ms",
            "pause_verify_ms", "pause_sibilant_verify_ms",
        ):
            if getattr(self, name) % FRAME_MS:
                raise ValueError(f"{name} must be a multiple of {FRAME_MS} ms")
        if self.confirm_timeout_ms < self.confirm_speech_ms:
            raise ValueError("confirm_timeout_ms must be at least confirm_speech_ms")
        if not self.floor_min_dbfs <= self.floor_init_dbfs <= self.floor_max_dbfs:
            raise ValueError("need floor_min_dbfs <= floor_init_dbfs <= floor_max_dbfs")
        return self

    @property
    def pause_frames(self) -> int:
        return self.pause_after_ms // FRAME_MS

    @property
    def rearm_frames(self) -> int:
        return self.rearm_ms // FRAME_MS

    def for_client(self, echo_cancellation: bool | None) -> BargeInConfig:
        """This configuration for one client's session.

        Args:
            echo_cancellation: what the client declared of its microphone:
                True, it runs an echo canceller (the browser's
                ``MediaTrackSettings.echoCancellation``, W3C Media Capture
                and Streams); False or None (not declared), nothing is
                assumed of it.

        Returns:
            self, or a copy whose ``echo_assumed_loss_db`` is at least
            ``echo_cancelled_loss_db`` when the client declared a canceller.
        """
        if not echo_cancellation or self.echo_cancelled_loss_db <= self.echo_assumed_loss_db:
            return self
        return self.model_copy(update={"echo_assumed_loss_db": self.echo_cancelled_loss_db})
