"""Syllable nuclei: a recogniser-independent count of how much was said.

A backchannel ("uh-huh", "yeah", "okay") has one to three syllables; "can
you tell me a story", even said in 0.6 s, has five. Counting syllable nuclei
gives the barge-in logic a second opinion that does not depend on the speech
recogniser, which can force a fast phrase into a short grammar entry or hear
nothing at all in it.

The method follows de Jong & Wempe, "Praat script to detect syllable nuclei
and measure speech rate automatically" (Behavior Research Methods 41(2),
2009): a syllable nucleus is a peak of the intensity contour that stands
out from the loudest part of the utterance by no more than a range, and is
separated from the previous nucleus by a dip. Here the intensity is the
energy of the 300-3000 Hz band (where vowels carry their energy, and below
which hum and breath noise sit), over 25 ms Hann windows every 10 ms,
smoothed over 30 ms; the voicing check of the original is left out (the
utterance has already been confirmed as speech by the detector's Silero
stage).
"""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

from media.frames import VAD_RATE

WINDOW_MS = 25
HOP_MS = 10
BAND_HZ = (300.0, 3000.0)
#: a nucleus is at most this far below the loudest frame (dB)
RANGE_DB = 20.0
#: and rises at least this much over the dip since the previous nucleus (dB)
DIP_DB = 3.0
#: nuclei closer than this are one (ms); syllables are rarely shorter
MIN_GAP_MS = 100


def count_syllable_nuclei(pcm: bytes | bytearray | memoryview | Iterable[bytes], rate: int = VAD_RATE) -> int:
    """Number of syllable nuclei in ``pcm``.

    Args:
        pcm: mono s16 PCM at ``rate`` Hz, as bytes or as an iterable of
            frames (joined).
        rate: sample rate, Hz (16 kHz on the inbound path).

    Returns:
        The count; 0 for audio shorter than one 25 ms window or for digital
        silence. An estimate: glides can merge two syllables into one and a
        strong consonant burst can add one (about one in either direction).

    Raises:
        ValueError: ``rate`` is not a whole number of Hz from 8000 up.
    """
    if isinstance(rate, bool) or not isinstance(rate, int) or rate < 8000:
        raise ValueError(f"rate must be a whole number of Hz, at least 8000, got {rate!r}")
    data = bytes(pcm) if isinstance(pcm, (bytes, bytearray, memoryview)) else b"".join(pcm)
    x = np.frombuffer(data[: len(data) - len(data) % 2], dtype=np.int16).astype(np.float32) / 32768.0
    win = rate * WINDOW_MS // 1000
    hop = rate * HOP_MS // 1000
    if len(x) < win:
        return 0
    frames = np.lib.stride_tricks.sliding_window_view(x, win)[::hop] * np.hanning(win).astype(np.float32)
    spectrum = np.abs(np.fft.rfft(frames, axis=1)) ** 2
    freqs = np.fft.rfftfreq(win, 1.0 / rate)
    band = (freqs >= BAND_HZ[0]) & (freqs <= BAND_HZ[1])
    energy = spectrum[:, band].sum(axis=1)
    if not np.any(energy > 1e-9):
        return 0
    contour = 10.0 * np.log10(energy + 1e-10)
    contour = np.convolve(contour, np.ones(3) / 3.0, mode="same")
    floor = float(contour.max()) - RANGE_DB
    min_gap = MIN_GAP_MS // HOP_MS
    kept: list[int] = []
    for k in range(1, len(contour) - 1):
        c = contour[k]
        if not (c >= contour[k - 1] and c > contour[k + 1] and c >= floor):
            continue
        if not kept:
            kept.append(k)
            continue
        j = kept[-1]
        dip = float(contour[j : k + 1].min())
        if min(contour[j], c) - dip >= DIP_DB and k - j >= min_gap:
            kept.append(k)
        elif c > contour[j]:
            kept[-1] = k  # the same nucleus, its higher peak
    return len(kept)
