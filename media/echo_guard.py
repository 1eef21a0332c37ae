"""The echo guard: is inbound audio our own playout heard back?

On a speakerphone (or any client without a working echo canceller) the
agent's voice comes back in the microphone; the barge-in detector
(:mod:`media.bargein`) must not take it for a user. Two parts:

- :class:`EchoReference`, one per session, the outbound side: what the
  server recently played, kept as short-time log band energies (10 ms hop,
  20 ms Hann window, 16 bands 100..6000 Hz, roughly mel-spaced). For a
  voiced inbound frame, the last ``ECHO_WINDOW_MS`` of inbound audio is
  turned into the same features and compared, as a Pearson correlation
  after removing each band's mean (so attenuation and a fixed coloration do
  not matter), against the reference at every delay
  0..``echo_max_delay_ms``. The envelope survives Opus round trips and
  resampling where a waveform correlation does not (Opus does not preserve
  phase). Double talk is kept out in two ways: user speech on top
  of the echo decorrelates the envelope, and the newest 20 ms must not carry
  energy the best-matching echo cannot account for (``ECHO_EXCESS_DB`` in
  enough bands).
- :class:`EchoGuard`, one per inbound stream, the comparison: the
  similarity against ``echo_threshold`` with hysteresis after echo, and
  the echo return loss.

The window's envelope cannot tell a user's onset from the agent's: speech
rising from silence matches some rise in the agent's speech at some delay.
So the guard also learns the echo return loss (ERL, the attenuation of the
echo path from what is played to what the microphone hears back, the term
of ITU-T G.168), as a lower bound
(:meth:`EchoReference.return_loss_bound_db`): while the microphone stays
quiet under a loud agent, the bound is large, and a frame louder than any
echo could be (``ECHO_LOUDER_DB`` over the loss below the loudest playout
the matched delay can bring back now,
:meth:`EchoReference.loudest_near_dbfs`) opens the gate even if its
envelope matches. It earns stage 2 no credit, though: only frames unlike
the echo confirm a barge-in. Until playout has shown the loss (800 ms of
it), the guard assumes ``BargeInConfig.echo_assumed_loss_db``: a
loudspeaker does not play louder than it was sent.

The echo path's delay is not constant: when the far end's playout runs dry
(a late packet, a stall of our outbound track) it comes back 20-60 ms later.
Across such a jump no delay explains the 160 ms window, so for 200 ms after
a frame found to be echo the guard also looks at the newest 60 ms alone near
the delay it knew (:meth:`EchoReference.slipped_similarity`); and a stall
of the outbound track moves the reference's timeline at once
(``PACING_MAX_LAG_S``), since what was sent late was played late.

Units: inbound PCM 16 kHz mono s16, outbound 48 kHz mono s16, 20 ms frames;
levels dBFS (mean square, full scale 1); delays and durations ms; times
clock seconds, compared on each side's media timeline
(:class:`media.timeline.SteadyClock`).
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Iterable
from typing import NamedTuple

import numpy as np

from media.frames import FRAME_MS, PLAYOUT_RATE, VAD_RATE, frame_bytes
from media.noise_floor import SILENCE_DBFS
from media.timeline import PACING_MAX_LAG_S, SteadyClock

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
#: How long (ms) a room carries a played sound on at a level that matters:
#: the echo heard now may come from this much earlier than the path's delay
#: says (a reverberation time of 0.4 s decays 15 dB in 100 ms).
ECHO_REVERB_MS = 100
# The echo path's delay jumps when the far end's jitter buffer stretches or
# drops playout: across the jump, no delay explains the whole window.
#: how far (ms) the delay may have jumped
ECHO_SLIP_MS = 60
#: the newest inbound audio (ms) compared after a jump
ECHO_SLIP_WINDOW_MS = 60
#: for how long (ms) after a frame found to be echo a jump is looked for
ECHO_SLIP_HOLD_MS = 200
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



_FEAT16 = _Features(VAD_RATE)
_FEAT48 = _Features(PLAYOUT_RATE)


class EchoMatch(NamedTuple):
    """What one comparison of inbound audio with the reference found.

    Attributes:
        similarity: 0..1, the envelope correlation at the best delay (0 for
            double talk, too little audio, or nothing played).
        delay_ms: that delay (ms), None when no delay could be compared.
        path_offset: the echo path's per-band offset (log10 power, inbound
            minus reference; NaN for a band not known) used to judge double
            talk, None when the comparison did not get that far.
    """

    similarity: float
    delay_ms: int | None
    path_offset: np.ndarray | None


class EchoReference:
    """Ring of what the server recently played (the outbound signal), as
    10 ms log band energies.

    The band energies are computed only when a comparison needs them
    (:meth:`similarity`): :meth:`played` keeps the frames sent since the
    last one, as many as the ring's span, and the first comparison after
    turns them into features in one batch. While nobody talks over the
    agent (no voiced inbound frame), a tick costs only its energy.

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
        # what was sent late after a stall of the outbound track is played
        # late: its timeline jumps over the hole at once (a burst cannot
        # lag that far)
        self._steady = SteadyClock(max_drift_s=PACING_MAX_LAG_S)
        #: frames played since the features were last brought up to date
        #: (:meth:`_featurise`), oldest first: (48 kHz samples or None for
        #: silence, hops skipped just before it). Bounded by the ring: once
        #: it holds more frames than the ring has hops for, the oldest
        #: would be pushed out anyway and only its samples' tail is kept.
        self._pending: deque[tuple[np.ndarray | None, int]] = deque()
        self._pending_max = self._cap // (FRAME_MS // ECHO_HOP_MS) + 2
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
        x = None
        if pcm48 is not None:
            x = np.frombuffer(pcm48, dtype="<i2").astype(np.float64) / 32768.0
            ms = float(np.mean(x * x))
            if ms > 0 and 10 * math.log10(ms) > ECHO_AUDIBLE_DBFS:
                self._last_audible = at
        n = FRAME_MS // ECHO_HOP_MS  # hops a frame adds (after the first, the tail carries the window's overlap)
        key = round(at * 1000 / ECHO_HOP_MS) + n
        gap = 0
        if self._end_key is not None:
            gap = max(0, key - n - self._end_key)  # hops of ticks the track skipped (a stall): nothing was played
            if gap > 0:
                self._energy.extend([0.0] * min(gap * ECHO_HOP_MS // FRAME_MS, self._energy.maxlen or 0))
        if len(self._pending) >= self._pending_max:
            # the ring's every hop comes from newer frames: of the oldest
            # only the overlap it leaves the next window matters
            old, _ = self._pending.popleft()
            self._tail = self._zeros48[: len(self._tail)] if old is None else old[-len(self._tail) :]
        self._pending.append((x, gap))
        self._energy.append(ms)
        self._end_key = key

    def _featurise(self) -> None:
        """Bring the feature ring up to :attr:`_end_key`: the pending frames'
        band energies in one batch, with silence for the hops skipped
        between them (a gap of the ring's span or more clears it)."""
        if not self._pending:
            return
        frames = list(self._pending)
        self._pending.clear()
        buf = np.concatenate([self._tail, *(self._zeros48 if x is None else x for x, _ in frames)])
        hop, win = _FEAT48.hop, _FEAT48.win
        n = (len(buf) - win) // hop + 1
        if any(x is not None for x, _ in frames) or np.any(self._tail):
            feats = _FEAT48(np.lib.stride_tricks.sliding_window_view(buf, win)[::hop][:n])
        else:
            feats = np.tile(self._silent, (n, 1))
        self._tail = buf[-(win - hop) :]
        per = n // len(frames)
        parts: list[np.ndarray] = []
        for i, (_, gap) in enumerate(frames):
            if gap >= self._cap:
                parts.clear()
                self._feats[:] = self._silent
            elif gap > 0:
                parts.append(np.tile(self._silent, (gap, 1)))
            parts.append(feats[i * per : (i + 1) * per])
        seq = np.concatenate(parts)
        self._push(seq[-self._cap :])

    def _push(self, feats: np.ndarray) -> None:
        k = len(feats)
        self._feats[:-k] = self._feats[k:]
        self._feats[-k:] = feats

    def _path_offset(self, r: np.ndarray, inb: np.ndarray) -> np.ndarray:
        """The echo path's per-band offset (log10 power, inbound minus
        reference) over the window ``r``, ``inb`` (w, bands): the
        ``ECHO_OFFSET_PCT`` percentile of the hops where the reference
        carried sound; NaN for a band with fewer than
        ``ECHO_MIN_SOUNDING_HOPS`` such hops."""
        # Only hops where the reference carried sound: at the onset of the
        # agent's speech the window is mostly silence on both sides, and an
        # offset taken from silence would call the echo's first syllable
        # "unexplained". A band with too few such hops makes no claim of
        # double talk.
        sounding = r > self._silent + ECHO_SOUNDING_DB / 10
        n_all = sounding.sum(axis=0)
        offset = np.full(r.shape[1], np.nan)
        enough = n_all >= ECHO_MIN_SOUNDING_HOPS
        if not enough.any():
            return offset
        # the per-band percentile of the hops with sound (NaNs sort last)
        ordered = np.sort(np.where(sounding, inb - r, np.nan)[:, enough], axis=0)
        n = n_all[enough]
        pos = (n - 1) * (ECHO_OFFSET_PCT / 100)
        lo = np.floor(pos).astype(int)
        hi = np.minimum(lo + 1, n - 1)
        cols = np.arange(ordered.shape[1])
        offset[enough] = ordered[lo, cols] + (ordered[hi, cols] - ordered[lo, cols]) * (pos - lo)
        return offset

    @staticmethod
    def _excess_share(r: np.ndarray, inb: np.ndarray, offset: np.ndarray) -> float:
        """Share (0..1, weighted by inbound band energy) of the newest 20 ms
        that lies ``ECHO_EXCESS_DB`` above the echo predicted from the
        reference window ``r`` (w, bands) plus the path's per-band
        ``offset`` (NaN: that band makes no claim)."""
        enough = ~np.isnan(offset)
        if not enough.any():
            return 0.0
        excess = inb[-2:, enough] - (r[-2:, enough] + offset[enough])
        e_all = 10 ** inb[-2:]
        e = e_all[:, enough]
        return float(np.sum(e * (excess > ECHO_EXCESS_DB / 10)) / (np.sum(e_all) + 1e-30))

    def loudest_dbfs(self) -> float:
        """The loudest 20 ms played within the echo horizon (every delay and
        the ERL window), dBFS: no echo arriving now can be louder than it
        less the path's loss."""
        loudest = max(self._energy)
        return 10 * math.log10(loudest) if loudest > 0 else SILENCE_DBFS

    def loudest_near_dbfs(self, at: float, delay_ms: int) -> float:
        """The loudest 20 ms played that can be heard back in the inbound
        frame at ``at`` through a path of delay ``delay_ms``: the frames
        from ``ECHO_REVERB_MS`` before to ``ECHO_SLACK_MS`` after the one
        the delay points at (a room's reverberation carries a syllable on,
        and the delay found is only as exact as the window's envelope),
        dBFS. Tighter than :meth:`loudest_dbfs` where the reply's level
        changes, most of all at its start: echo of a reply's first
        syllables cannot be as loud as its loudest word.

        Args:
            at: media time (s) of the newest inbound frame, as given to
                :meth:`similarity`.
            delay_ms: the echo path's delay (ms), as :attr:`EchoMatch.delay_ms`
                found it.
        """
        if self._end_key is None:
            return SILENCE_DBFS
        frame_hops = FRAME_MS // ECHO_HOP_MS
        in_end = round(at * 1000 / ECHO_HOP_MS) + frame_hops
        back = (self._end_key - (in_end - delay_ms // ECHO_HOP_MS)) // frame_hops  # frames before the newest
        lo = max(0, back - ECHO_SLACK_MS // FRAME_MS)
        hi = min(len(self._energy) - 1, back + ECHO_REVERB_MS // FRAME_MS)
        if hi < lo:
            return SILENCE_DBFS
        n = len(self._energy)
        loudest = max(self._energy[n - 1 - i] for i in range(lo, hi + 1))
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

    def similarity(self, recent16: bytes, at: float) -> EchoMatch:
        """How well recent inbound audio is explained by a delayed copy of the
        outbound signal.

        Args:
            recent16: the most recent inbound audio, 16 kHz mono s16, at least
                ``ECHO_WINDOW_MS + 10`` ms (180 ms; 9 frames); only its tail
                is used. Its last sample was received at clock ``at``.
            at: clock seconds of the newest inbound frame.

        Returns:
            The best, over delays 0..max_delay_ms, of the envelope
            correlation (0..1), set to 0 when the newest 20 ms carries
            energy the echo cannot explain (double talk), 0 when too little
            audio was given or nothing was played; its delay and the path
            offset the window showed.
        """
        return self._match(recent16, at, self._window_hops, -self._slack, self.max_delay_ms // ECHO_HOP_MS + self._slack)

    def slipped_similarity(self, recent16: bytes, at: float, delay_ms: int, offset: np.ndarray) -> EchoMatch:
        """:meth:`similarity` of the newest ``ECHO_SLIP_WINDOW_MS`` only, at
        delays within ``ECHO_SLIP_MS`` of ``delay_ms``: the echo after its
        path's delay jumped (the far end's jitter buffer ran dry, or
        dropped playout). Across the jump no delay explains the whole
        window, and the newest frame, predicted at the old delay, carries
        "unexplained" energy; the short window after the jump matches the
        new delay. (A window split at the jump, its older part at the old
        delay, does not tell a user's onset from echo: the older part's
        match carries it.)

        Args:
            recent16: as for :meth:`similarity`.
            at: clock seconds of the newest inbound frame.
            delay_ms: the delay the echo had just before (ms).
            offset: the path's per-band offset then
                (:attr:`EchoMatch.path_offset`): double talk is judged with
                it, since one taken from so short a window would follow a
                user's voice in it.

        Returns:
            As for :meth:`similarity`.
        """
        d = delay_ms // ECHO_HOP_MS
        slip = ECHO_SLIP_MS // ECHO_HOP_MS
        return self._match(recent16, at, ECHO_SLIP_WINDOW_MS // ECHO_HOP_MS, d - slip, d + slip, offset)

    def _inbound(self, recent16: bytes, w: int) -> np.ndarray | None:
        """Log band energies (w, bands) of the newest ``w`` hops of inbound
        audio (16 kHz s16), or None if ``recent16`` is too short."""
        need = (w - 1) * _FEAT16.hop + _FEAT16.win
        x = np.frombuffer(recent16, dtype="<i2")
        if len(x) < need:
            return None
        x = x[-need:].astype(np.float64) / 32768.0
        return _FEAT16(np.lib.stride_tricks.sliding_window_view(x, _FEAT16.win)[:: _FEAT16.hop])

    def _match(
        self, recent16: bytes, at: float, w: int, d_lo: int, d_hi: int, offset: np.ndarray | None = None
    ) -> EchoMatch:
        """The envelope correlation of the newest ``w`` hops of inbound audio
        with the reference at delays ``d_lo..d_hi`` hops, and the best delay
        (ms). Zero for double talk, judged with the path's per-band
        ``offset`` (None: with the one the window shows)."""
        if self._end_key is None:
            return EchoMatch(0.0, None, None)
        self._featurise()
        inb = self._inbound(recent16, w)
        if inb is None:
            return EchoMatch(0.0, None, None)
        # Reference windows ending at hop keys in_end - d, d = d_lo .. d_hi.
        in_end = round(at * 1000 / ECHO_HOP_MS) + FRAME_MS // ECHO_HOP_MS
        d_lo = max(d_lo, -self._slack)
        d_hi = min(d_hi, self.max_delay_ms // ECHO_HOP_MS + self._slack)
        # Index in the ring of the hop with key k: cap - 1 - (end_key - k).
        last = self._cap - 1 - (self._end_key - (in_end - d_lo))  # window end for d_lo
        first = self._cap - 1 - (self._end_key - (in_end - d_hi))  # window end for d_hi
        first = max(first, w - 1)
        last = min(last, self._cap - 1)
        if last < first:
            return EchoMatch(0.0, None, None)
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
            return EchoMatch(0.0, None, None)
        # A flat reference window (silence) has no envelope to match; the
        # subtraction above leaves rounding noise there, so mask it out.
        corr = np.where(rss > ECHO_MIN_VAR, num / np.sqrt(np.maximum(rss, ECHO_MIN_VAR) * iss), 0.0)
        best = int(np.argmax(corr))
        sim = float(corr[best])
        # the window ending at ring index first + best ends at key in_end - delay
        delay_ms = (in_end - (self._end_key - (self._cap - 1 - (first + best)))) * ECHO_HOP_MS
        if sim <= 0:
            return EchoMatch(0.0, delay_ms, None)
        # Double talk: does the newest 20 ms carry energy the echo cannot explain?
        # Predict it from the best reference window plus the window's median
        # per-band offset (attenuation, coloration).
        r = ref[best].T
        if offset is None:
            offset = self._path_offset(r, inb)
        if self._excess_share(r, inb, offset) >= ECHO_EXCESS_SHARE:
            return EchoMatch(0.0, delay_ms, offset)
        return EchoMatch(min(1.0, sim), delay_ms, offset)


class EchoGuard:
    """The echo comparison of one inbound stream against its session's
    :class:`EchoReference`, and the echo return loss learnt on the way.

    Args:
        reference: the session's outbound reference (None: nothing is ever
            echo).
        threshold: similarity (0..1) at or above which a voiced frame is
            explained by the outbound signal (``BargeInConfig.echo_threshold``);
            ``ECHO_HYSTERESIS`` lower for ``ECHO_HOLD_MS`` after echo.
        assumed_loss_db: the echo path's loss (dB) believed until playout
            has shown it (``BargeInConfig.echo_assumed_loss_db``); dropped
            to 0 for the session once an echo louder than it matched
            ``ERL_RECHECK_FRAMES`` frames in a row.

    Attributes:
        return_loss_db: the echo path's loss as far as the evidence goes
            (dB, 0..``ERL_MAX_DB``; 0: assume the echo comes back at full
            level until shown otherwise).
        matched_delay_ms: the delay (ms) at which the newest frame compared
            was found echo (at the full bar, or slipped from the delay
            known just before), None if it was not found echo.
        relearnt: the newest frame compared made the guard drop the loss
            it believed (``ERL_RECHECK_FRAMES`` frames in a row matched the
            agent's voice louder than that loss lets it come back): the
            frames just before it were echo too.
    """

    def __init__(self, reference: EchoReference | None, threshold: float, assumed_loss_db: float = 0.0) -> None:
        self.reference = reference
        self.threshold = threshold
        #: the least loss believed without evidence: the assumption, until
        #: an echo louder than it shows the path has gain
        self._least_loss_db = assumed_loss_db
        self._until = -math.inf
        self._now = -math.inf  # media time of the newest frame compared
        self.matched_delay_ms: int | None = None
        #: the echo's delay (ms), the media time it was last found at, and
        #: the path's per-band offset then
        self._locked: tuple[int | None, float, np.ndarray] = (None, -math.inf, np.empty(0))
        self.return_loss_db = assumed_loss_db
        self._inbound_energy: deque[float] = deque(maxlen=ERL_WINDOW_MS // FRAME_MS)
        self._louder_run = 0
        self.relearnt = False

    @property
    def locked_delay_ms(self) -> int | None:
        """The delay (ms) the echo was last found at, at the full bar and
        not louder than the loss allows, if that was at most
        ``ECHO_SLIP_HOLD_MS`` before the newest frame compared (None
        otherwise)."""
        delay, found_at, _ = self._locked
        return delay if self._now - found_at <= ECHO_SLIP_HOLD_MS / 1000 else None

    def playing(self, at: float) -> bool:
        """Whether something audible was played recently enough (see
        :meth:`EchoReference.active`) that audio at clock ``at`` may be echo."""
        return self.reference is not None and self.reference.active(at)

    def compare(self, voiced: bool, level: float, recent: Iterable[bytes], at: float, media_at: float) -> tuple[bool, bool]:
        """Whether the newest inbound frame is echo.

        Args:
            voiced: webrtcvad's verdict on the frame (unvoiced frames are
                not compared).
            level: the frame's level (dBFS).
            recent: the stream's recent 20 ms frames (16 kHz mono s16),
                newest last, at least ``ECHO_WINDOW_MS + 10`` ms of them.
            at: clock seconds of the frame.
            media_at: its media time (the stream's :class:`SteadyClock`).

        Returns:
            (echo, echo_like): ``echo_like``: the envelope matches the
            reference; ``echo``: it does and the frame is not louder than
            the loss lets any echo be (``ECHO_LOUDER_DB``), unless that has
            held ``ERL_RECHECK_FRAMES`` frames in a row (then the loss is
            learnt anew).
        """
        echo = echo_like = False
        self.matched_delay_ms = None
        self.relearnt = False
        self._now = media_at
        if voiced and self.playing(at):
            assert self.reference is not None
            audio = b"".join(recent)
            found = self.reference.similarity(audio, media_at)
            delay = found.delay_ms  # the delay of the newest comparison that had one
            echo = echo_like = found.similarity >= self.threshold
            slipped = False
            matched: tuple[int | None, np.ndarray] | None = None
            if echo_like:
                assert found.path_offset is not None  # a match got as far as the double-talk check
                matched = (found.delay_ms, found.path_offset)
            elif media_at <= self._until:
                # Hysteresis: right after echo, a lower bar keeps the
                # agent's own syllable onsets (similarity dipping to 0.6-0.8)
                # echo; the user's voice on top drives similarity to 0 (the
                # excess rule). At any delay: held to the delay that echo
                # had (within 20 ms), the agent's own echo was let through
                # once in a real-time speakerphone test on a loaded machine
                # (tests/voice/test_bargein_session.py), whose delay wanders
                # more than that from frame to frame.
                echo = echo_like = found.similarity >= self.threshold - ECHO_HYSTERESIS
            if not echo_like and (locked := self._locked)[0] is not None and media_at - locked[1] <= ECHO_SLIP_HOLD_MS / 1000:
                # the echo a moment ago, and now nothing matches: did its
                # delay jump? (the newest 80 ms at a nearby delay, held to
                # the full bar: a short window matches more by chance)
                locked_delay, _, offset = locked
                assert locked_delay is not None
                jumped = self.reference.slipped_similarity(audio, media_at, locked_delay, offset)
                delay = jumped.delay_ms if jumped.delay_ms is not None else delay
                slipped = jumped.similarity >= self.threshold
                if slipped:
                    echo = echo_like = True
                    matched = (delay, offset)
            if echo_like and self._louder_than_echo(level, media_at, delay):
                # Louder than the path lets the agent come back: the user,
                # though the envelope matches (speech rising from silence
                # matches some rise in the agent's speech). It opens the gate
                # (stage 1, a pause), but earns stage 2 no credit. Matching
                # frame after frame, it is the path that changed (a
                # loudspeaker turned on): the loss is learnt anew.
                self._louder_run += 1
                if self._louder_run < ERL_RECHECK_FRAMES:
                    echo = False
                else:
                    self.return_loss_db = self._least_loss_db = 0.0
                    self._louder_run = 0
                    self.relearnt = True
            else:
                self._louder_run = 0
            if echo_like and not slipped:
                self._until = media_at + ECHO_HOLD_MS / 1000
            if echo and matched is not None:
                # the delay the echo is known at (a match the loss let stand)
                self._locked = (matched[0], media_at, matched[1])
                self.matched_delay_ms = matched[0]
        return echo, echo_like

    def heard(self, mean_square: float, at: float, received: bool) -> None:
        """Take the newest inbound frame as evidence of the echo path.

        Args:
            mean_square: the frame's mean square (full scale 1).
            at: clock seconds of the frame.
            received: False for silence put in for a stretch without audio:
                no evidence, nothing is learnt.
        """
        if received:
            self._inbound_energy.append(mean_square)
        # While nothing audible is played there is no evidence either way:
        # the loss learnt in this session's earlier replies is kept, so a
        # user who barges in right at the start of a reply is known to be
        # louder than any echo (a fresh estimate takes 800 ms of playout,
        # and until then the user's onset matches the reply's onset and
        # counted as echo: 180-220 ms lost). A loudspeaker turned on between
        # turns is caught by the re-check (ERL_RECHECK_FRAMES).
        if self.playing(at) and received:
            self._learn_return_loss(at)

    def _louder_than_echo(self, level: float, media_at: float, delay_ms: int | None) -> bool:
        """The frame (``level`` dBFS, at media time ``media_at``) is louder
        than any echo of what was played can be, given the loss seen so far
        and the delay (ms) its envelope matched at
        (:meth:`EchoReference.loudest_near_dbfs`): the user, not the agent.

        An envelope that rises from silence matches some rising stretch of
        the agent's speech, whoever speaks; without this, a user talking
        into a quiet headset was taken for echo for the first 150-250 ms."""
        assert self.reference is not None
        played = self.reference.loudest_dbfs() if delay_ms is None else self.reference.loudest_near_dbfs(media_at, delay_ms)
        return level > played - self.return_loss_db + ECHO_LOUDER_DB

    def _learn_return_loss(self, at: float) -> None:
        """While the agent is audible: fade by ``ERL_DECAY_DB``, then rise to
        what the last ``ERL_WINDOW_MS`` of inbound audio proves
        (:meth:`EchoReference.return_loss_bound_db`, at most ``ERL_MAX_DB``).
        Only a rise is taken from the bound: the user's own speech in the
        window lowers it, and would undo the estimate right at their onset."""
        assert self.reference is not None
        erl = max(self._least_loss_db, self.return_loss_db - ERL_DECAY_DB)
        if len(self._inbound_energy) == self._inbound_energy.maxlen:
            bound = self.reference.return_loss_bound_db(sum(self._inbound_energy) / len(self._inbound_energy), at)
            if bound is not None:
                erl = max(erl, min(bound, ERL_MAX_DB))
        self.return_loss_db = erl


#: frames of the pre-roll kept however recently the guard found echo in it:
#: its verdict lags the user's onset by a frame (hysteresis)
PREROLL_KEEP_FRAMES = 3


def after_echo(preroll: Iterable[tuple[bytes, bool]]) -> list[bytes]:
    """The pre-roll of a user's speech without the agent's echo before it.

    The pre-roll (``VadConfig.preroll_ms`` before the onset) is what the
    recogniser and the end-of-turn judge hear of the speech's start; on a
    speakerphone it holds the agent's own voice heard back, whose words the
    recogniser would put in front of the user's ("we more what is the
    weather like today"). A frame the guard explained as echo carries no
    user speech it could not explain (the double-talk rule), and a gated run
    ends at such a frame, so the user's speech starts after the last one:
    the frames up to it are dropped, but the newest
    ``PREROLL_KEEP_FRAMES`` are always kept (the guard's hysteresis can
    take the user's first frame for echo; 60 ms of echo make no word).

    Args:
        preroll: (pcm, echo) per 20 ms frame, oldest first: the frame
            (16 kHz mono s16) and :attr:`media.inbound_frame.InboundFrame.echo`.

    Returns:
        The pcm of the frames after the last echo frame (at least the newest
        ``PREROLL_KEEP_FRAMES``), oldest first; all of them when none was
        echo.
    """
    frames = list(preroll)
    last = max((i for i, (_, echo) in enumerate(frames) if echo), default=-1)
    start = min(last + 1, max(0, len(frames) - PREROLL_KEEP_FRAMES))
    return [pcm for pcm, _ in frames[start:]]
