"""Is the onset of a gated run speech? The speech-specific first stage of barge-in.

webrtcvad opens the barge-in gate for broadband noise, tones, clicks and
coughs as readily as for a voice (see :mod:`media.vad`). Pausing the agent on
the gate alone cost the listener a hole in the reply (about 0.6 s, until
stage 2 rejected it) for every such sound. So the pause needs a second
opinion that is fast and speech-specific: Silero VAD scored on the newest
32 ms of the run, from a fresh model state warmed with the 64 ms before it
(:data:`ONSET_WINDOW_CHUNKS` chunks of 512 samples, the last one scored).

Why a fresh state per frame, not the streaming one: the stage-2 model is
streamed in non-overlapping 32 ms chunks, so it has a new opinion only every
32 ms and lags a syllable's start; scoring a sliding window every 20 ms frame
from a known state answers on the frame the vowel starts, and the same audio
always gets the same score (no history from earlier in the session).
Because each score starts from a reset, one model serves every stream of
the process (:func:`shared_scorer`): the event loop runs one frame at a time.

Measured on the labelled corpus (tests/corpus.py; the score of the frame,
20 ms frames after the first gated one):

- speech ("tell me a story", "hey wait stop ...", 4 voices x 3 speeds, the
  alsa-utils human recordings): >= 0.8 by the 3rd or 4th frame for most
  clips, by the 5th for an aspirated onset at 120 wpm ("h..ey": the gate
  opens on the /h/, the vowel comes 80 ms later);
- not speech (alsa Noise.wav, white and brown noise, 440 Hz / 1 kHz tones
  at -40..-10 dBFS, DTMF, clicks, knocks, coughs at -20..-10 dBFS): at most
  0.49, nearly all below 0.35; a 200-6000 Hz sweep 0.57 from its start, 0.72
  for a run that starts mid-sweep.

Cost: about 2 ms of CPU per 512-sample chunk, 3 chunks per scored frame;
every gated frame of a run is scored until it pauses (a few frames for
speech) or, for a run that never scores as speech (noise), until
``confirm_timeout_ms`` (up to 27 frames, some 60-160 ms of CPU per noise).

Units: 16 kHz mono s16 PCM; probabilities 0..1.
"""

from __future__ import annotations

from functools import lru_cache

import numpy as np

from media.silero import SILERO_CHUNK, SileroModel

#: Silero VAD's chunk: 512 samples at 16 kHz (32 ms).
CHUNK_SAMPLES = SILERO_CHUNK
CHUNK_BYTES = CHUNK_SAMPLES * 2
#: chunks per scored window: two warm the state, the last one is scored (96 ms)
ONSET_WINDOW_CHUNKS = 3
#: bytes of audio a score needs (zero-padded when less is known)
WINDOW_BYTES = ONSET_WINDOW_CHUNKS * CHUNK_BYTES


class OnsetScorer:
    """Silero VAD speech probability of the newest 32 ms of a stream.

    Stateless from the caller's view: every :meth:`score` starts from a
    reset model, so one instance may serve any number of streams (one call at
    a time: it is not thread-safe).

    Attributes:
        calls: windows scored so far (cost accounting).
    """

    def __init__(self) -> None:
        self._model = SileroModel()
        self.calls = 0

    def score(self, pcm: bytes) -> float:
        """Speech probability (0..1) of the last 512 samples of ``pcm``.

        Args:
            pcm: 16 kHz mono s16, the newest audio last; only its last
                ``WINDOW_BYTES`` (96 ms) are used, and less is padded with
                silence in front.

        Raises:
            ValueError: ``pcm`` has an odd number of bytes.
        """
        if len(pcm) % 2:
            raise ValueError(f"s16 PCM must have an even number of bytes, got {len(pcm)}")
        window = bytes(pcm[-WINDOW_BYTES:])
        if len(window) < WINDOW_BYTES:
            window = bytes(WINDOW_BYTES - len(window)) + window
        self._model.reset()
        prob = 0.0
        for i in range(ONSET_WINDOW_CHUNKS):
            prob = float(self._model(window[i * CHUNK_BYTES : (i + 1) * CHUNK_BYTES]))
        self.calls += 1
        return prob


#: a sibilant frame has this much more energy (dB) in 4-7.8 kHz than in 0.1-3 kHz
SIBILANT_TILT_DB = 8.0
#: ...spread like noise over the high band (spectral flatness 0..1 of its
#: power bins): a tone or a sweep there is no /s/
SIBILANT_FLATNESS = 0.1
_FREQS = np.fft.rfftfreq(320, 1 / 16000)
_HIGH = (_FREQS >= 4000) & (_FREQS < 7800)
_LOW = (_FREQS >= 100) & (_FREQS < 3000)
_HANN = np.hanning(320)


def is_sibilant(pcm: bytes) -> bool:
    """Whether a 20 ms frame (16 kHz mono s16, 640 bytes) sounds like /s/:
    noise-like energy tilted 8 dB or more towards 4-7.8 kHz.

    A word starting with /s/ ("stop", "so", "sorry") opens the gate 80-150
    ms before its vowel, and Silero scores the /s/ itself low: a sibilant
    onset pauses on trial and is given until its vowel to score as speech.
    On the corpus, /s/ frames tilt 10-19 dB; noise, coughs, clicks and
    knocks at most 3.4 dB, and tones are not noise-like.

    Raises:
        ValueError: ``pcm`` is not 640 bytes.
    """
    if len(pcm) != 640:
        raise ValueError(f"a sibilance frame must be 640 bytes (20 ms at 16 kHz), got {len(pcm)}")
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    power = np.abs(np.fft.rfft(x * _HANN)) ** 2 + 1e-3
    high, low = float(power[_HIGH].sum()), float(power[_LOW].sum())
    if 10 * np.log10(high / low) < SIBILANT_TILT_DB:
        return False
    band = power[_HIGH]
    flatness = float(np.exp(np.mean(np.log(band))) / np.mean(band))
    return flatness >= SIBILANT_FLATNESS


@lru_cache(maxsize=1)
def shared_scorer() -> OnsetScorer:
    """The process's one :class:`OnsetScorer` (loaded on first use, ~2 ms)."""
    return OnsetScorer()
