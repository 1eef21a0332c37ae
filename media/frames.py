"""PCM frame helpers: 20 ms framing, resampling with PyAV, levels.

Conventions used throughout ``media/``: PCM is signed 16-bit little-endian
("s16"), mono, as ``bytes``; a frame is 20 ms (``FRAME_MS``). Inbound audio
is analysed at 16 kHz (``VAD_RATE``: 320 samples, 640 bytes a frame);
outbound audio is produced at 48 kHz (``PLAYOUT_RATE``: 960 samples, 1920
bytes a frame), Opus' native rate (RFC 7587), so the encoder only upmixes.
"""

from __future__ import annotations

import fractions
import math
from pathlib import Path

import av
import numpy as np
from av.audio.frame import AudioFrame
from av.audio.resampler import AudioResampler

FRAME_MS = 20
VAD_RATE = 16_000
PLAYOUT_RATE = 48_000
BYTES_PER_SAMPLE = 2


def samples_per_frame(rate: int) -> int:
    """Samples in one 20 ms frame at ``rate`` Hz (320 at 16 kHz, 960 at 48 kHz)."""
    return rate * FRAME_MS // 1000


def frame_bytes(rate: int) -> int:
    """Bytes in one 20 ms mono s16 frame at ``rate`` Hz."""
    return samples_per_frame(rate) * BYTES_PER_SAMPLE


class Reframer:
    """Cuts a stream of mono s16 PCM into exact 20 ms frames.

    Args:
        rate: sample rate in Hz of the PCM pushed in.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self.size = frame_bytes(rate)
        self._buf = bytearray()

    def push(self, pcm: bytes) -> list[bytes]:
        """Add PCM; return every complete frame now available (maybe none).

        Raises:
            ValueError: ``pcm`` has an odd number of bytes (not s16).
        """
        if len(pcm) % BYTES_PER_SAMPLE:
            raise ValueError("s16 PCM must have an even number of bytes")
        self._buf += pcm
        n = len(self._buf) // self.size
        out = [bytes(self._buf[i * self.size : (i + 1) * self.size]) for i in range(n)]
        del self._buf[: n * self.size]
        return out

    def flush(self) -> bytes | None:
        """The remaining partial frame padded with silence, or None if empty."""
        if not self._buf:
            return None
        out = bytes(self._buf) + bytes(self.size - len(self._buf))
        self._buf.clear()
        return out

    @property
    def pending_bytes(self) -> int:
        return len(self._buf)


class PcmResampler:
    """Converts any audio to mono s16 at ``rate`` Hz with PyAV's
    ``AudioResampler`` (libswresample).

    Args:
        rate: output sample rate in Hz.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler = AudioResampler(format="s16", layout="mono", rate=rate)
        self._in_rate: int | None = None

    def frame(self, frame: AudioFrame) -> bytes:
        """Resample one decoded ``av.AudioFrame`` (any format, layout, rate).

        The resampler keeps a few samples of filter delay; call :meth:`flush`
        at the end of a stream to get them.
        """
        return b"".join(_plane_bytes(o) for o in self._resampler.resample(frame))

    def pcm(self, pcm: bytes, rate: int) -> bytes:
        """Resample mono s16 PCM at ``rate`` Hz.

        Raises:
            ValueError: odd byte count, or the input rate changed mid-stream.
        """
        if len(pcm) % BYTES_PER_SAMPLE:
            raise ValueError("s16 PCM must have an even number of bytes")
        if self._in_rate is not None and rate != self._in_rate:
            raise ValueError(f"input rate changed from {self._in_rate} to {rate} Hz; use a new resampler")
        self._in_rate = rate
        if not pcm:
            return b""
        return self.frame(pcm_to_frame(pcm, rate))

    def flush(self) -> bytes:
        """Drain the filter delay at end of stream."""
        return b"".join(_plane_bytes(o) for o in self._resampler.resample(None))


def _plane_bytes(frame: AudioFrame) -> bytes:
    return bytes(frame.planes[0])[: frame.samples * BYTES_PER_SAMPLE]


def pcm_to_frame(pcm: bytes, rate: int, pts: int | None = None) -> AudioFrame:
    """Wrap mono s16 PCM as an ``av.AudioFrame`` (time base 1/rate)."""
    samples = len(pcm) // BYTES_PER_SAMPLE
    frame = AudioFrame(format="s16", layout="mono", samples=samples)
    frame.planes[0].update(pcm)
    frame.sample_rate = rate
    frame.time_base = fractions.Fraction(1, rate)
    if pts is not None:
        frame.pts = pts
    return frame


def rms_dbfs(pcm: bytes) -> float:
    """RMS level of s16 PCM in dBFS (0 dBFS is a full-scale square wave;
    digital silence gives -inf)."""
    if not pcm:
        return -math.inf
    x = np.frombuffer(pcm, dtype="<i2").astype(np.float64)
    rms = math.sqrt(float(np.mean(x * x)))
    return 20 * math.log10(rms / 32768.0) if rms > 0 else -math.inf


def load_pcm(path: str | Path, rate: int) -> bytes:
    """Decode an audio file (WAV or anything FFmpeg reads) to mono s16 at ``rate``.

    Raises:
        FileNotFoundError: no such file.
        ValueError: the file has no audio stream or cannot be decoded.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(str(p))
    try:
        with av.open(str(p)) as container:
            if not container.streams.audio:
                raise ValueError(f"{p}: no audio stream")
            res = PcmResampler(rate)
            chunks = [res.frame(f) for f in container.decode(audio=0)]
            chunks.append(res.flush())
    except av.FFmpegError as exc:
        raise ValueError(f"{p}: cannot decode audio: {exc}") from exc
    return b"".join(chunks)


def last_sound_sample(pcm: bytes, threshold_dbfs: float = -40.0, window: int = 160) -> int | None:
    """Index (in samples) just past the last window louder than
    ``threshold_dbfs``, or None if the PCM never gets that loud: where
    speech ends in a recording (as :func:`first_sound_sample` finds where
    it begins)."""
    n = len(pcm) // BYTES_PER_SAMPLE
    for start in range((max(0, n - 1) // window) * window, -1, -window):
        if rms_dbfs(pcm[start * 2 : (start + window) * 2]) > threshold_dbfs:
            return min(n, start + window)
    return None


def first_sound_sample(pcm: bytes, threshold_dbfs: float = -40.0, window: int = 160) -> int | None:
    """Index (in samples) of the first window louder than ``threshold_dbfs``,
    or None if the PCM never gets that loud. Used to find where speech begins
    in a recording."""
    n = len(pcm) // BYTES_PER_SAMPLE
    for start in range(0, n, window):
        if rms_dbfs(pcm[start * 2 : (start + window) * 2]) > threshold_dbfs:
            return start
    return None
