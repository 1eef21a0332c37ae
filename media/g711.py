"""G.711 mu-law, the audio of telephone media streams (Twilio Media Streams,
Telnyx): 8 kHz mono, one byte a sample, 20 ms = 160 bytes.

Encoding and decoding are PyAV's ``pcm_mulaw`` codec (FFmpeg's
table-driven G.711, ITU-T Recommendation G.711 (11/88), the same codec
aiortc uses for PCMU), asked once at import for every code (256, decoding)
and every 16-bit sample (65,536, encoding): a frame is then one table
look-up with NumPy, not a codec context opened per 20 ms (44-50 us a
frame -> 2-3 us). Nothing here computes the companding curve itself, and
nothing depends on the ``audioop`` module Python 3.13 removed.
Decoding is bit-exact for all 256 codes. FFmpeg encodes by nearest
reconstruction level, which differs from the reference encoder's decision
levels for 512 of the 65,536 16-bit inputs (those just below a segment's
edge get the neighbouring code, one step); tests/media/test_g711.py pins
both facts.

:class:`MulawDecoder` and :class:`MulawEncoder` keep their codec and
resampler across frames (libswresample's filter state: resampling frame by
frame with a fresh resampler would click at every frame edge), so one of
each belongs to one call and is dropped with it.
"""

from __future__ import annotations

import fractions
from typing import Literal

import numpy as np
from av.audio.codeccontext import AudioCodecContext
from av.codec.context import CodecContext
from av.packet import Packet

from media.frames import BYTES_PER_SAMPLE, PcmResampler, pcm_to_frame

#: the telephone rate, Hz
MULAW_RATE = 8_000
#: bytes (= samples) of one 20 ms mu-law frame
MULAW_FRAME_BYTES = 160
_TIME_BASE = fractions.Fraction(1, MULAW_RATE)


def _codec(mode: Literal["r", "w"]) -> AudioCodecContext:
    codec = CodecContext.create("pcm_mulaw", mode)
    codec.format = "s16"
    codec.layout = "mono"
    codec.sample_rate = MULAW_RATE
    if mode == "w":
        codec.time_base = _TIME_BASE
    return codec


def _decode_with_codec(payload: bytes) -> bytes:
    frames = _codec("r").decode(Packet(payload))
    return b"".join(bytes(f.planes[0])[: f.samples * BYTES_PER_SAMPLE] for f in frames)


def _encode_with_codec(pcm: bytes) -> bytes:
    packets = _codec("w").encode(pcm_to_frame(pcm, MULAW_RATE, pts=0))
    return b"".join(bytes(p) for p in packets)


#: code (0..255) -> s16 sample, as FFmpeg decodes it
_DECODE = np.frombuffer(_decode_with_codec(bytes(range(256))), dtype="<i2").copy()
#: s16 sample, as an unsigned 16-bit index -> code, as FFmpeg encodes it
_ENCODE = np.frombuffer(_encode_with_codec(np.arange(65536, dtype="<u2").tobytes()), dtype=np.uint8).copy()
if len(_DECODE) != 256 or len(_ENCODE) != 65536:  # pragma: no cover - FFmpeg answered short
    raise ImportError("PyAV's pcm_mulaw codec did not code every value")


def mulaw_to_pcm(payload: bytes) -> bytes:
    """Decode mu-law bytes to 8 kHz mono s16 PCM (two bytes per input byte);
    stateless (G.711 is sample by sample)."""
    if not payload:
        return b""
    return _DECODE[np.frombuffer(payload, dtype=np.uint8)].tobytes()


def pcm_to_mulaw(pcm: bytes) -> bytes:
    """Encode 8 kHz mono s16 PCM to mu-law (one byte per sample); stateless.

    Raises:
        ValueError: an odd number of bytes (not s16).
    """
    if len(pcm) % BYTES_PER_SAMPLE:
        raise ValueError("s16 PCM must have an even number of bytes")
    if not pcm:
        return b""
    return _ENCODE[np.frombuffer(pcm, dtype="<u2")].tobytes()


class MulawDecoder:
    """One call's inbound audio: mu-law 8 kHz to s16 mono at ``rate`` Hz
    (16 kHz for the VAD pipeline).

    Args:
        rate: output sample rate, Hz.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler = PcmResampler(rate)

    def decode(self, payload: bytes) -> bytes:
        """Decode one payload (any length; 160 bytes for 20 ms) into PCM at
        ``rate``; the resampler's filter delay (a few samples) comes out with
        the next payload."""
        pcm = mulaw_to_pcm(payload)
        if self.rate == MULAW_RATE:
            return pcm
        return self._resampler.pcm(pcm, MULAW_RATE)


class MulawEncoder:
    """One call's outbound audio: s16 mono at ``rate`` Hz (48 kHz playout
    frames) to mu-law 8 kHz.

    Args:
        rate: input sample rate, Hz.
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._resampler = PcmResampler(MULAW_RATE)

    def encode(self, pcm: bytes) -> bytes:
        """Encode PCM at ``rate``; 20 ms in gives about 160 bytes out (the
        resampler's delay shifts a few samples to the next call).

        Raises:
            ValueError: an odd number of bytes (not s16).
        """
        if self.rate != MULAW_RATE:
            pcm = self._resampler.pcm(pcm, self.rate)
        return pcm_to_mulaw(pcm)

    def reset(self) -> None:
        """Forget the filter state (after a ``clear``: the next audio is a
        new generation's, not a continuation of the dropped one)."""
        self._resampler = PcmResampler(MULAW_RATE)
