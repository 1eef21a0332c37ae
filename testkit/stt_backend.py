"""What hears the audio inside testkit's speech-provider fakes
(:mod:`testkit.fake_deepgram`, :mod:`testkit.fake_openai_realtime`,
:mod:`testkit.fake_openai_transcriptions`): the embedded recogniser, so the
transcripts the fakes send are real recognition of the audio they got, not
canned text; and a voice activity detector, for the fakes whose real server
runs its own (Deepgram's endpointing, ``SpeechStarted``, ``UtteranceEnd``).

The fakes add the providers' own latencies on top (``interim_latency_s``,
``final_latency_s``: by default 150 ms and 300 ms after the audio, as
issue 28 asks the benches to assume), so a test or bench sees a provider's
timing, not pocketsphinx's.
"""

from __future__ import annotations

import asyncio
import io
import wave
from dataclasses import dataclass

import webrtcvad

from media.frames import PcmResampler
from voice.pocketsphinx_stt import PocketsphinxConfig, PocketsphinxStream, PocketsphinxSTT
from voice.recognition import STREAM_RATE, Word

#: 20 ms at 16 kHz s16, the VAD's frame
VAD_FRAME_BYTES = STREAM_RATE * 2 // 50


@dataclass
class Latency:
    """A fake provider's answer times, s after the audio they are for.

    Attributes:
        interim_s: an interim result's delay.
        final_s: a final result's delay.
    """

    interim_s: float = 0.15
    final_s: float = 0.3


class BackendUtterance:
    """One utterance being recognised for a fake (a pocketsphinx stream).

    Args:
        stream: the embedded recogniser's utterance stream.
    """

    def __init__(self, stream: PocketsphinxStream) -> None:
        self._stream = stream
        self.fed_bytes = 0

    @property
    def fed_s(self) -> float:
        """Seconds of audio fed so far (16 kHz)."""
        return self.fed_bytes / (STREAM_RATE * 2)

    def feed(self, pcm16k: bytes) -> None:
        """Add 16 kHz mono s16 audio."""
        self.fed_bytes += len(pcm16k)
        self._stream.feed(pcm16k)

    async def partial(self) -> str:
        """The hypothesis so far (an interim's text)."""
        return await self._stream.partial()

    async def finish(self) -> tuple[str, list[Word]]:
        """The final text and its words (seconds from this utterance's start)."""
        text = await self._stream.finish()
        return text, list(self._stream.words)

    async def aclose(self) -> None:
        """Abandon it."""
        await self._stream.aclose()


class SttBackend:
    """The embedded recogniser behind the fakes (one pool of pocketsphinx
    workers, shared by every connection of every fake that uses it).

    Args:
        grammar: a JSGF grammar (tests use one so transcripts are exact);
            None: free-form.
        max_decoders: worker processes.
    """

    def __init__(self, grammar: str | None = None, max_decoders: int = 2) -> None:
        from pathlib import Path

        self.stt = PocketsphinxSTT(PocketsphinxConfig(
            grammar=Path(grammar) if grammar is not None else None, max_decoders=max_decoders
        ))

    async def start(self) -> None:
        """Load the decoders."""
        await self.stt.start()

    def utterance(self) -> BackendUtterance:
        """A new utterance."""
        return BackendUtterance(self.stt.open_stream())

    async def aclose(self) -> None:
        """Stop the workers."""
        await self.stt.aclose()


class SpeechDetector:
    """webrtcvad over 20 ms frames of 16 kHz audio, as a provider's own
    voice activity detector: :meth:`feed` returns, per whole frame, whether
    it is voiced, with its end time (s from the first audio).

    Args:
        aggressiveness: webrtcvad's mode, 0-3.
    """

    def __init__(self, aggressiveness: int = 2) -> None:
        self._vad = webrtcvad.Vad(aggressiveness)
        self._pending = bytearray()
        self._frames = 0

    def feed(self, pcm16k: bytes) -> list[tuple[bool, float]]:
        """``(voiced, end_s)`` for each whole 20 ms frame completed by ``pcm16k``."""
        self._pending += pcm16k
        out = []
        while len(self._pending) >= VAD_FRAME_BYTES:
            frame = bytes(self._pending[:VAD_FRAME_BYTES])
            del self._pending[:VAD_FRAME_BYTES]
            self._frames += 1
            out.append((self._vad.is_speech(frame, STREAM_RATE), self._frames * 0.02))
        return out


def resample(pcm: bytes, from_rate: int, to_rate: int) -> bytes:
    """Mono s16 ``pcm`` at ``from_rate`` Hz as ``to_rate`` Hz (a fresh
    resampler: for a whole clip, not a stream)."""
    if from_rate == to_rate:
        return pcm
    r = PcmResampler(to_rate)
    return r.pcm(pcm, from_rate) + r.flush()


def wav_pcm16k(data: bytes) -> bytes:
    """The audio of a WAV file (any rate, mono or stereo, 16-bit) as 16 kHz mono s16.

    Raises:
        ValueError: not a 16-bit PCM WAV file.
    """
    try:
        with wave.open(io.BytesIO(data)) as w:
            if w.getsampwidth() != 2:
                raise ValueError("only 16-bit PCM WAV is read")
            rate, channels = w.getframerate(), w.getnchannels()
            frames = w.readframes(w.getnframes())
    except (wave.Error, EOFError) as exc:
        raise ValueError(f"not a WAV file: {exc}") from exc
    if channels == 2:
        import numpy as np

        frames = np.frombuffer(frames, dtype="<i2").reshape(-1, 2).mean(axis=1).astype("<i2").tobytes()
    elif channels != 1:
        raise ValueError(f"{channels} channels")
    return resample(frames, rate, STREAM_RATE)


async def after(delay_s: float) -> None:
    """Sleep ``delay_s`` (a provider's latency; 0: yield once)."""
    await asyncio.sleep(max(0.0, delay_s))
