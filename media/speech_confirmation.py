"""Stage 2 of barge-in: a run's audio streamed through Silero VAD.

From the first gated frame of a run (:mod:`media.bargein`) until it is
confirmed or rejected, the inbound audio is cut into 512-sample chunks
(32 ms at 16 kHz, :data:`media.silero.SILERO_CHUNK`) and scored by one
Silero model (:mod:`media.silero`) carrying its state across them. A chunk
counts as speech when its probability is ``>= threshold`` and its energy is
``energy_margin_db`` above the noise floor (:mod:`media.noise_floor`); it
counts for the samples in it that earned credit: audio the echo guard took
for the agent's own voice, and the pre-roll, earn none.

Cost: about 2 ms of CPU per chunk, too much for every frame of every
stream; it runs only while a run is in progress. Far more selective than
webrtcvad, yet not enough alone: a 200-6000 Hz sweep scores 0.5-0.65 chunk
after chunk and could confirm on it, so a run confirms only after stage 1
scored its onset as speech (:mod:`media.speech_onset`).

Units: 16 kHz mono s16 PCM; probabilities 0..1; levels dBFS; speech in ms.
"""

from __future__ import annotations

import math

import numpy as np

from media.frames import VAD_RATE, frame_bytes
from media.noise_floor import SILENCE_DBFS
from media.silero import SILERO_CHUNK, SILERO_POOL, SileroModel, SileroPool

#: Silero chunks of pre-roll (audio from before the first gated frame) fed to
#: warm the model's state at the start of a run; they earn no credit.
SILERO_WARM_CHUNKS = 3
#: samples of recent audio a stream keeps for the pre-roll (96 ms)
PREROLL_SAMPLES = SILERO_WARM_CHUNKS * SILERO_CHUNK


class SpeechConfirmation:
    """One stream's stage-2 scorer: a Silero model lent from ``pool`` from
    the first run on, a chunk buffer with per-sample credit, the run's best
    probability.

    Args:
        threshold: Silero speech probability (0..1) a chunk needs
            (``BargeInConfig.silero_threshold``).
        energy_margin_db: a chunk also needs its level (dBFS RMS) this far
            (dB) above the noise floor (``BargeInConfig.energy_margin_db``).
        pool: where the model is borrowed from (:data:`media.silero.SILERO_POOL`).

    Attributes:
        model: the lent model, from the first :meth:`start` to :meth:`close`
            (None otherwise).
        calls: chunks scored so far (cost accounting).
        max_prob: highest probability (0..1) seen in the current run.
    """

    def __init__(self, threshold: float, energy_margin_db: float, pool: SileroPool = SILERO_POOL) -> None:
        self.threshold = threshold
        self.energy_margin_db = energy_margin_db
        self._pool = pool
        self.model: SileroModel | None = None
        self.calls = 0
        self.max_prob = 0.0
        self._buf = bytearray()
        self._credit = bytearray()  # per sample: 1 = counts towards confirmation

    def start(self, before: bytes) -> None:
        """A run starts with the frame to be fed next: borrow a model (once),
        reset it, and put the last ``SILERO_WARM_CHUNKS`` chunks' worth of
        ``before`` (16 kHz mono s16, the audio preceding that frame,
        zero-padded in front when shorter) in the buffer without credit,
        so that the buffer ends on a chunk boundary right after that frame.
        """
        if self.model is None:
            self.model = self._pool.take()
        self.model.reset()
        frame_samples = frame_bytes(VAD_RATE) // 2
        pre_samples = SILERO_WARM_CHUNKS * SILERO_CHUNK - frame_samples
        pre = before[-pre_samples * 2 :] if pre_samples > 0 else b""
        pre = bytes(pre_samples * 2 - len(pre)) + pre if pre_samples > 0 else b""
        self._buf = bytearray(pre)
        self._credit = bytearray(len(pre) // 2)

    def feed(self, pcm: bytes, countable: bool, floor_dbfs: float) -> float:
        """Buffer one frame (16 kHz mono s16) and score every full chunk.

        Args:
            pcm: the frame.
            countable: whether its samples earn credit (False for audio that
                looked like echo).
            floor_dbfs: the noise floor (dBFS) the chunk level is compared to.

        Returns:
            ms of speech the scored chunks earned: per chunk, its credited
            samples * 1000 / 16000 when it counts as speech (a multiple of
            1/16 ms, so sums of them are exact in any order).

        Raises:
            AssertionError: no run was started (:meth:`start`).
        """
        assert self.model is not None
        earned = 0.0
        self._buf += pcm
        self._credit += (b"\x01" if countable else b"\x00") * (len(pcm) // 2)
        cb = SILERO_CHUNK * 2
        while len(self._buf) >= cb:
            chunk = bytes(self._buf[:cb])
            credit = sum(self._credit[:SILERO_CHUNK])
            del self._buf[:cb]
            del self._credit[:SILERO_CHUNK]
            prob = self.model(chunk)
            self.calls += 1
            self.max_prob = max(self.max_prob, prob)
            if credit and prob >= self.threshold:
                x = np.frombuffer(chunk, dtype="<i2").astype(np.float64)
                ms = float(np.dot(x, x)) / len(x)
                lvl = 10 * math.log10(ms / 32768.0**2) if ms > 0 else SILENCE_DBFS
                if lvl >= floor_dbfs + self.energy_margin_db:
                    earned += credit * 1000 / VAD_RATE
        return earned

    def stop(self) -> None:
        """Silero is done for this run: drop the buffered audio."""
        self._buf = bytearray()
        self._credit = bytearray()

    def clear(self) -> None:
        """Forget the run: the buffered audio and its best probability."""
        self.max_prob = 0.0
        self.stop()

    def close(self) -> None:
        """Give the model back to the pool (a later :meth:`start` takes one
        again). Idempotent."""
        model, self.model = self.model, None
        if model is not None:
            self._pool.give(model)
