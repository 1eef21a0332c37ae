"""The voice behind the fake TTS servers: espeak-ng, word by word, so
every word's place in the audio is exact (the fakes' word and character
timings are then the truth a test can check the heard text against).

:meth:`TtsBackend.render` says a text at any rate: each word is synthesised
on its own by espeak-ng (leading and trailing silence trimmed), the words
joined by ``gap_ms`` of silence, and the whole resampled to the rate asked
for. Renderings of a word are cached per process.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from media.frames import PLAYOUT_RATE, PcmResampler
from voice.tts import EspeakConfig, EspeakTTS


@dataclass
class Rendering:
    """A text said.

    Attributes:
        pcm: mono s16 LE at ``rate``.
        rate: Hz.
        words: (word as in the text, start s, end s) per word.
        chars: (character, start ms, duration ms) per character of the
            text (spaces included: they take the gap), as ElevenLabs'
            ``alignment``.
    """

    pcm: bytes
    rate: int
    words: list[tuple[str, float, float]] = field(default_factory=list)
    chars: list[tuple[str, float, float]] = field(default_factory=list)

    @property
    def seconds(self) -> float:
        """Its length, s."""
        return len(self.pcm) / 2 / self.rate


class TtsBackend:
    """espeak-ng word by word (see the module doc).

    Args:
        voice: espeak-ng voice.
        words_per_minute: its speed.
        gap_ms: silence between words, ms.
    """

    def __init__(self, voice: str = "en-us", words_per_minute: int = 175, gap_ms: int = 40) -> None:
        self.tts = EspeakTTS(EspeakConfig(voice=voice, words_per_minute=words_per_minute, pause_ms=0))
        self.gap_ms = gap_ms
        self._cache: dict[str, bytes] = {}
        self._lock = asyncio.Lock()

    async def _word(self, word: str) -> bytes:
        """``word`` at 48 kHz, trimmed."""
        if word not in self._cache:
            chunks: list[bytes] = []
            await self.tts.synthesize(word, chunks.append)
            if len(self._cache) > 4096:
                self._cache.clear()
            self._cache[word] = b"".join(chunks)
        return self._cache[word]

    async def render(self, text: str, rate: int) -> Rendering:
        """``text`` said at ``rate`` Hz (see the module doc); "" for a
        text with no words."""
        words = text.split()
        gap = b"\0\0" * (PLAYOUT_RATE * self.gap_ms // 1000)
        pieces: list[bytes] = []
        timed: list[tuple[str, float, float]] = []
        pos = 0  # samples at 48 kHz
        async with self._lock:
            for i, w in enumerate(words):
                if i:
                    pieces.append(gap)
                    pos += len(gap) // 2
                pcm = await self._word(w)
                timed.append((w, pos / PLAYOUT_RATE, (pos + len(pcm) // 2) / PLAYOUT_RATE))
                pieces.append(pcm)
                pos += len(pcm) // 2
        whole = b"".join(pieces)
        if rate != PLAYOUT_RATE and whole:
            r = PcmResampler(rate)
            whole = r.pcm(whole, PLAYOUT_RATE) + r.flush()
        return Rendering(whole, rate, timed, _chars(text, timed))


def _chars(text: str, words: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Character timings of ``text`` from its word timings: a word's
    characters share its time evenly; spaces before a word take the gap
    before it (0 ms at the start)."""
    out: list[tuple[str, float, float]] = []
    i = 0
    prev_end = 0.0
    for word, start, end in words:
        j = text.index(word, i)
        spaces = text[i:j]
        for k, c in enumerate(spaces):
            share = (start - prev_end) * 1000 / len(spaces)
            out.append((c, prev_end * 1000 + k * share, share))
        dur = (end - start) * 1000 / len(word)
        for k, c in enumerate(word):
            out.append((c, start * 1000 + k * dur, dur))
        i = j + len(word)
        prev_end = end
    for c in text[i:]:
        out.append((c, prev_end * 1000, 0.0))
    return out
