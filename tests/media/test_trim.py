"""Silence trimming of streamed TTS audio."""

from __future__ import annotations

import numpy as np

from media.trim import SilenceTrimmer

RATE = 48_000


def tone(ms: int) -> bytes:
    n = RATE * ms // 1000
    return (np.sin(np.arange(n) * 2 * np.pi * 300 / RATE) * 8000).astype("<i2").tobytes()


def silence(ms: int) -> bytes:
    return bytes(RATE * ms // 1000 * 2)


def ms(pcm: bytes) -> float:
    return len(pcm) / 2 / RATE * 1000


def run(chunks: list[bytes], **kw) -> bytes:
    t = SilenceTrimmer(RATE, **kw)
    return b"".join(t.push(c) for c in chunks) + t.flush()


def test_lead_dropped_pause_kept_tail_cut() -> None:
    out = run([silence(200) + tone(300), silence(150) + tone(200) + silence(330)], keep_tail_ms=120)
    assert ms(out) == 300 + 150 + 200 + 120


def test_streaming_in_odd_chunks_gives_the_same() -> None:
    pcm = silence(100) + tone(250) + silence(400)
    whole = run([pcm])
    pieces = run([pcm[i : i + 1234] for i in range(0, len(pcm), 1234)])
    assert whole == pieces and ms(whole) == 250 + 120


def test_all_silence_gives_nothing() -> None:
    t = SilenceTrimmer(RATE)
    assert t.push(silence(500)) == b"" and t.flush() == b""
    assert t.dropped_bytes == len(silence(500))


def test_silence_is_held_back_not_delayed_sound() -> None:
    t = SilenceTrimmer(RATE)
    assert ms(t.push(tone(100))) == 100  # sound goes out at once
    assert t.push(silence(200)) == b""  # silence waits: is more sound coming?
    assert ms(t.push(tone(50))) == 250  # yes: the pause is kept whole
