"""Syllable nuclei counting (media/syllables.py): backchannels are short in
syllables, fast speech is not, whatever a recogniser makes of it."""

from __future__ import annotations

import corpus as C
import numpy as np
import pytest
from conftest import requires_espeak

from media.frames import VAD_RATE
from media.syllables import count_syllable_nuclei

pytestmark = requires_espeak


def opus(raw16: bytes) -> bytes:
    """Through one Opus round trip at 48 kHz, as a WebRTC caller's audio is."""
    return C.resample(C.opus_round_trip(C.resample(raw16, VAD_RATE, 48_000)), 48_000, VAD_RATE)


@pytest.mark.parametrize("clip", C.backchannel_clips(), ids=lambda c: c.name)
def test_backchannels_have_at_most_three(clip: C.Clip) -> None:
    assert 1 <= count_syllable_nuclei(clip.pcm) <= 3
    assert 1 <= count_syllable_nuclei(opus(clip.pcm)) <= 3


@pytest.mark.parametrize("voice", C.VOICES)
@pytest.mark.parametrize("wpm", [175, 240])
def test_fast_phrases_have_more(voice: str, wpm: int) -> None:
    """"tell me a story" at 240 wpm lasts about 0.63 s, within a
    backchannel's length; a grammar-bound pocketsphinx hears nothing in it."""
    raw = C.espeak("tell me a story", voice, wpm)
    assert count_syllable_nuclei(raw) >= 4
    assert count_syllable_nuclei(opus(raw)) >= 4
    assert count_syllable_nuclei(C.espeak("can you tell me a story", voice, wpm)) >= 5


def test_level_and_framing_do_not_change_the_count() -> None:
    raw = C.espeak("what is the weather like today", "en-us", 175)
    n = count_syllable_nuclei(raw)
    assert n >= 6
    quiet = C.to_pcm(C.to_array(raw) * 0.05)  # -26 dB
    assert count_syllable_nuclei(quiet) == n
    assert count_syllable_nuclei(C.frames16(raw)) == n  # 20 ms frames, joined
    assert count_syllable_nuclei(raw + b"\x01") == n  # a stray odd byte is ignored


def test_nothing_to_count() -> None:
    assert count_syllable_nuclei(b"") == 0
    assert count_syllable_nuclei(b"\x00\x00" * 200) == 0  # shorter than a window
    assert count_syllable_nuclei(b"\x00\x00" * VAD_RATE) == 0  # a second of digital silence
    assert count_syllable_nuclei([]) == 0


def test_a_steady_tone_is_at_most_one() -> None:
    t = np.arange(VAD_RATE) / VAD_RATE
    tone = C.to_pcm(0.3 * np.sin(2 * np.pi * 440 * t))
    assert count_syllable_nuclei(tone) <= 1


def test_any_bytes_like_input_and_a_checked_rate() -> None:
    raw = C.espeak("what is the weather like today", "en-us", 175)
    n = count_syllable_nuclei(raw)
    assert count_syllable_nuclei(memoryview(raw)) == count_syllable_nuclei(bytearray(raw)) == n
    for rate in (0, -16000, 16000.0, True, 4000):
        with pytest.raises(ValueError, match="rate"):
            count_syllable_nuclei(raw, rate)  # type: ignore[arg-type]
