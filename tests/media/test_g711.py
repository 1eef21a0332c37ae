"""media/g711.py against G.711 itself: every code's decoded value and every
16-bit sample's code, compared with the reference algorithm of ITU-T G.711
(the segment/quantisation procedure of the Sun/CCITT g711.c reference,
written out here as the test's oracle, not as product code)."""

from __future__ import annotations

import math

import numpy as np

from media.frames import frame_bytes, rms_dbfs
from media.g711 import MULAW_FRAME_BYTES, MulawDecoder, MulawEncoder, mulaw_to_pcm, pcm_to_mulaw

BIAS = 0x84
#: the segment end points of the 14-bit magnitude (Sun/CCITT g711.c)
SEG_END = (0x3F, 0x7F, 0xFF, 0x1FF, 0x3FF, 0x7FF, 0xFFF, 0x1FFF)


def reference_decode(code: int) -> int:
    u = ~code & 0xFF
    t = ((u & 0x0F) << 3) + BIAS
    t <<= (u & 0x70) >> 4
    return (BIAS - t) if u & 0x80 else (t - BIAS)


def reference_encode(sample: int) -> int:
    """linear2ulaw of the CCITT/Sun reference: 14-bit magnitude, segment
    by decision level (not by nearest reconstruction value)."""
    value = sample >> 2
    mask = 0xFF
    if value < 0:
        value, mask = -value, 0x7F
    value = min(value, 8159) + (BIAS >> 2)
    segment = next((i for i, end in enumerate(SEG_END) if value <= end), 8)
    if segment >= 8:
        return 0x7F ^ mask
    return ((segment << 4) | ((value >> (segment + 1)) & 0x0F)) ^ mask


def test_every_code_decodes_to_the_g711_value() -> None:
    codes = bytes(range(256))
    got = np.frombuffer(mulaw_to_pcm(codes), dtype="<i2").tolist()
    assert got == [reference_decode(c) for c in range(256)]
    assert got[0xFF] == 0 and got[0x00] == -32124 and got[0x80] == 32124


def test_every_sample_encodes_to_the_g711_code_but_at_segment_edges() -> None:
    """FFmpeg's encoder (a table of nearest reconstruction levels) agrees
    with the reference for 65,024 of the 65,536 16-bit samples; the other
    512 lie in the few values below each segment's decision level, where
    it picks the next code (one step, the magnitude just across the edge).
    Pinned here so a change in FFmpeg's table shows."""
    samples = np.arange(-32768, 32768, dtype="<i2")
    got = pcm_to_mulaw(samples.tobytes())
    want = bytes(reference_encode(int(s)) for s in samples)
    off = [(int(s), a, b) for s, a, b in zip(samples, got, want, strict=True) if a != b]
    assert len(off) == 512
    assert all(abs(a - b) == 1 and (a & 0x0F, b & 0x0F) == (0, 15) for _s, a, b in off)  # first vs last step of a segment


def test_a_tone_survives_the_call_path_both_ways() -> None:
    """48 kHz playout frames to mu-law and back to 16 kHz for the VAD: 20 ms
    in gives 160 bytes on the wire, and a 1 kHz tone keeps its level."""
    enc, dec = MulawEncoder(48_000), MulawDecoder(16_000)
    t = np.arange(48_000) / 48_000
    tone = (0.3 * 32767 * np.sin(2 * math.pi * 1000 * t)).astype("<i2").tobytes()
    wire, back = [], []
    step = frame_bytes(48_000)
    for i in range(0, len(tone), step):
        payload = enc.encode(tone[i : i + step])
        wire.append(len(payload))
        back.append(dec.decode(payload))
    assert sum(wire) >= 50 * MULAW_FRAME_BYTES - 32  # the resampler keeps a few samples
    assert all(abs(n - MULAW_FRAME_BYTES) <= 32 for n in wire[1:])
    pcm16 = b"".join(back)[frame_bytes(16_000) :]
    assert abs(rms_dbfs(pcm16) - rms_dbfs(tone)) < 0.5


def test_silence_and_empty_input() -> None:
    assert pcm_to_mulaw(b"") == b"" and mulaw_to_pcm(b"") == b""
    assert pcm_to_mulaw(bytes(320)) == b"\xff" * 160
