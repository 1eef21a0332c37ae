"""Telephone-band speech and the wideband recogniser: espeak-ng phrases
through G.711 (8 kHz) and back to 16 kHz are recognised with the band above
4 kHz filled (voice.narrowband), and mostly not without it."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import corpus as C
from conftest import requires_espeak

from media.frames import load_pcm
from voice.narrowband import NarrowbandSpeech
from voice.pocketsphinx_stt import PocketsphinxConfig, PocketsphinxSTT
from voice.recognition import SttAdaptation, UtteranceRecogniser

pytestmark = requires_espeak

PHRASES = [
    "count to twenty", "tell me a story", "what is the weather like today", "front left", "please order a coffee",
    "hello there", "charge my card", "rear center",
]


def telephone(path: Path) -> bytes:
    """``path`` as a phone call delivers it: mu-law 8 kHz in 20 ms frames, decoded to 16 kHz."""
    return C.mulaw_round_trip(load_pcm(path, 8000))


async def recognised(stt: UtteranceRecogniser, pcm: bytes, adaptation: SttAdaptation) -> str:
    stream = stt.open_stream(adaptation)  # one session's utterances in turn, as AgentSession does
    stream.feed(bytes(16000) + pcm + bytes(16000))
    return await stream.finish()


async def test_telephone_speech_is_recognised_with_the_band_filled(say: Callable[..., Path], grammar_file: Path) -> None:
    wideband = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file, max_decoders=1))
    await wideband.start()
    try:
        filled, a, b = NarrowbandSpeech(wideband), SttAdaptation(), SttAdaptation()
        with_fill = [await recognised(filled, telephone(say(p)), a) for p in PHRASES]
        without = [await recognised(wideband, telephone(say(p)), b) for p in PHRASES]
    finally:
        await wideband.aclose()
    hits, misses = (sum(h == p for h, p in zip(heard, PHRASES, strict=True)) for heard in (with_fill, without))
    print(f"telephone speech recognised: {hits}/{len(PHRASES)} with the band filled, {misses} without")
    assert hits >= 5, with_fill
    assert hits > misses, (with_fill, without)  # why the fill exists
