"""Telephone-band speech for a wideband recogniser.

A phone call's audio is G.711 at 8 kHz: nothing above 4 kHz. Upsampled to
the 16 kHz pipeline, the upper half of the spectrum is digital silence, and
the recogniser's filterbank (pocketsphinx en-us: 25 mel filters up to
6800 Hz, trained on wideband speech) sees log energies far below anything
it was trained on in those channels, so its cepstra are off and grammar
decoding of clear speech fails (tests/voice/test_narrowband.py: of 8 test
phrases as telephone audio, one session's utterances in turn, 1 recognised
without the fill and 7 with it on this machine; the count moves with the
cepstral mean the utterances start from, ``stt.cmn_start``).
:class:`NarrowbandSpeech` fills that band with a low, steady noise floor
(white noise differenced once: +6 dB per octave, so it lies mostly above
4 kHz; about -58 dBFS) on the recogniser's path only: the barge-in
detector and the turn's audio are untouched.
"""

from __future__ import annotations

import numpy as np

from voice.recognition import (
    ShortDecode,
    SttAdaptation,
    SttError,
    TentativeStream,
    UtteranceRecogniser,
    UtteranceStream,
    Word,
)

#: standard deviation of the white noise before differencing (s16 units): about -58 dBFS after
FILL_LEVEL = 30.0


class _FilledStream:
    """One utterance: every chunk fed gets the band fill added."""

    def __init__(self, inner: UtteranceStream, rng: np.random.Generator, level: float) -> None:
        self._inner = inner
        self._rng = rng
        self._level = level
        self._last = 0.0

    def feed(self, pcm: bytes) -> None:
        """Add ``pcm`` (16 kHz mono s16) with the fill."""
        if not pcm:
            return
        audio = np.frombuffer(pcm, dtype=np.int16).astype(np.float64)
        noise = self._rng.normal(0.0, self._level, len(audio) + 1)
        noise[0] = self._last
        self._last = noise[-1]
        filled = np.clip(audio + np.diff(noise), -32768, 32767).astype(np.int16)
        self._inner.feed(filled.tobytes())

    @property
    def words(self) -> list[Word]:
        """The inner stream's words."""
        return self._inner.words

    @property
    def confidence(self) -> float | None:
        """The inner stream's confidence."""
        return self._inner.confidence

    async def finish(self) -> str:
        """The inner stream's transcript."""
        return await self._inner.finish()

    async def aclose(self) -> None:
        """Close the inner stream."""
        await self._inner.aclose()


class _FilledTentativeStream(_FilledStream):
    """A filled utterance whose inner stream decodes at a pause
    (:class:`voice.recognition.TentativeStream`: Whisper's): so can it."""

    _inner: TentativeStream

    async def decode_so_far(self) -> str:
        """The inner stream's transcript so far."""
        return await self._inner.decode_so_far()

    async def decode_short(self) -> str:
        """The inner stream's short decode so far (:class:`voice.recognition.ShortDecode`).

        Raises:
            voice.recognition.SttError: the inner stream has none, or it failed.
        """
        if not isinstance(self._inner, ShortDecode):
            raise SttError("this recogniser has no short decode")
        return await self._inner.decode_short()


class NarrowbandSpeech:
    """A recogniser (:class:`voice.providers.UtteranceRecogniser`) for telephone
    audio: ``inner``'s, with the empty band above 4 kHz filled (see the
    module doc). The fill is seeded per stream, so a test is repeatable.

    Args:
        inner: the wideband recogniser (shared; not closed by this one).
        level: the fill's level (s16 units, before differencing).
    """

    def __init__(self, inner: UtteranceRecogniser, level: float = FILL_LEVEL) -> None:
        self.inner = inner
        self.level = level
        self._streams = 0

    async def start(self) -> None:
        """Start the inner recogniser."""
        await self.inner.start()

    def open_stream(self, adaptation: SttAdaptation | None = None) -> UtteranceStream:
        """An utterance on the inner recogniser, filled."""
        self._streams += 1
        inner = self.inner.open_stream(adaptation)
        kind = _FilledTentativeStream if isinstance(inner, TentativeStream) else _FilledStream
        return kind(inner, np.random.default_rng(self._streams), self.level)

    async def aclose(self) -> None:
        """Nothing of its own: the inner recogniser is shared and closed by its owner."""
