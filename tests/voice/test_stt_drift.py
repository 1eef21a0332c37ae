"""Issue 11.1 (shared/cases/recognition-drift.md): the same audio is heard
the same way in a server's first utterance and its two-hundredth, and no
utterance (another session's speech, noise, a tone) changes how a later one
is heard. Through the real decoder pool (worker processes): Whisper (the
default), and pocketsphinx free-form and with a grammar."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from conftest import TEST_PHRASES, plain, requires_espeak

from media.frames import VAD_RATE, load_pcm
from voice.pocketsphinx_stt import PocketsphinxConfig, PocketsphinxSTT
from voice.recognition import UtteranceRecogniser
from voice.whisper_stt import WhisperConfig, WhisperSTT

pytestmark = requires_espeak

#: clips heard before and after the others; the first is the case's request
PROBES = ["can you tell me a story", "tell me a story", "what is the weather like today", "please order a coffee"]
OTHERS = ["count to twenty", "hey wait stop i have a question", "hello there", "uh huh", "okay"]


def speech(path: Path, dbfs: float = -20.0, *, padded: bool = True) -> bytes:
    """16 kHz s16 audio of ``path`` at ``dbfs`` RMS, with 0.3 s of silence
    before and 1.2 s after (as the case's recording) if ``padded``."""
    x = np.frombuffer(load_pcm(path, VAD_RATE), dtype="<i2").astype(np.float64)
    x *= 10 ** (dbfs / 20) * 32767 / (np.sqrt(np.mean(x**2)) + 1e-9)
    if padded:
        x = np.concatenate([np.zeros(int(0.3 * VAD_RATE)), x, np.zeros(int(1.2 * VAD_RATE))])
    return np.clip(x, -32768, 32767).astype("<i2").tobytes()


def stimuli(say: Callable[..., Path], n: int) -> list[bytes]:
    """``n`` utterances of other voices, noise and tones, louder and
    quieter than the probes."""
    rng = np.random.default_rng(11)
    t = np.arange(int(0.3 * VAD_RATE)) / VAD_RATE
    out: list[bytes] = []
    voices = ["en-us", "en-gb", "en-us+f3", "en-us+m3"]
    for i in range(n):
        kind = i % 4
        if kind == 0:
            out.append(speech(say(OTHERS[i % len(OTHERS)], voice=voices[i % len(voices)]), dbfs=rng.uniform(-35, -10), padded=False))
        elif kind == 1:
            out.append((rng.normal(0, rng.uniform(300, 8000), t.size)).clip(-32768, 32767).astype("<i2").tobytes())
        elif kind == 2:
            f = rng.choice([300.0, 1000.0, 3000.0])
            out.append((rng.uniform(1000, 16000) * np.sin(2 * np.pi * f * t)).astype("<i2").tobytes())
        else:  # brown noise, like a rumble
            out.append((np.cumsum(rng.normal(0, 300, t.size)) % 20000 - 10000).astype("<i2").tobytes())
    return out


async def recognise(stt: UtteranceRecogniser, pcm: bytes) -> str:
    stream = stt.open_stream()
    for i in range(0, len(pcm), 640):  # 20 ms frames, as a session feeds them
        stream.feed(pcm[i : i + 640])
    return await stream.finish()


@pytest.mark.parametrize("grammar", [False, True], ids=["free-form", "grammar"])
async def test_the_same_clips_are_heard_the_same_after_200_other_utterances(
    say: Callable[..., Path], grammar_file: Path, grammar: bool
) -> None:
    stt = PocketsphinxSTT(PocketsphinxConfig(grammar=grammar_file if grammar else None, max_decoders=2))
    await stt.start()
    try:
        probes = [speech(say(p)) for p in PROBES]
        before = [await recognise(stt, p) for p in probes for _ in range(2)]  # on both decoders
        assert before[0::2] == before[1::2]
        for pcm in stimuli(say, 200):
            await recognise(stt, pcm)
        after = [await recognise(stt, p) for p in probes for _ in range(2)]
        assert after == before
        if grammar:  # and what is heard is right, for the phrases the grammar has
            assert [h for h, p in zip(before[0::2], PROBES, strict=True) if p in TEST_PHRASES] == [p for p in PROBES if p in TEST_PHRASES]
    finally:
        await stt.aclose()


async def test_whisper_hears_the_same_clips_the_same_after_100_other_utterances(say: Callable[..., Path]) -> None:
    """Whisper is stateless per utterance (no earlier text as its prompt,
    the same fixed prompt for all): the probes are heard the same before
    and after 100 other utterances, noise and tones, on both workers; and
    heard right."""
    stt = WhisperSTT(WhisperConfig(workers=2))
    await stt.start()
    try:
        probes = [speech(say(p)) for p in PROBES]
        before = [await recognise(stt, p) for p in probes for _ in range(2)]  # on both workers
        assert before[0::2] == before[1::2]
        for pcm in stimuli(say, 100):
            await recognise(stt, pcm)
        after = [await recognise(stt, p) for p in probes for _ in range(2)]
        assert after == before
        assert [plain(h) for h in before[0::2]] == PROBES
    finally:
        await stt.aclose()


async def test_the_cmn_start_is_a_setting_and_bad_values_are_refused() -> None:
    assert PocketsphinxConfig(cmn_start="model").cmn_start == "model"
    assert PocketsphinxConfig(cmn_start=",".join(["1"] * 13)).cmn_start
    for bad in ("", "loud", "1,2,3", ",".join(["nan"] * 13), ",".join(["1e9"] * 13)):
        with pytest.raises(ValueError, match="cmn_start"):
            PocketsphinxConfig(cmn_start=bad)


async def test_a_session_adapts_to_its_own_voice_and_no_other_session_sees_it(say: Callable[..., Path]) -> None:
    """Per-session state, reset to a fixed starting point: what one session
    said (here noise and loud speech, the worst case) only moves its own
    adaptation; a new session's first utterance is heard exactly as on a
    fresh server, on whichever decoder it lands."""
    from voice.recognition import SttAdaptation

    async def heard(stt: PocketsphinxSTT, pcm: bytes, adaptation: SttAdaptation | None) -> str:
        stream = stt.open_stream(adaptation)
        for i in range(0, len(pcm), 640):
            stream.feed(pcm[i : i + 640])
        return await stream.finish()

    probe = speech(say(PROBES[0]))
    fresh = PocketsphinxSTT(PocketsphinxConfig(max_decoders=1))
    await fresh.start()
    try:
        first_on_a_fresh_server = await heard(fresh, probe, SttAdaptation())
    finally:
        await fresh.aclose()
    stt = PocketsphinxSTT(PocketsphinxConfig(max_decoders=2))
    await stt.start()
    try:
        noisy = SttAdaptation()
        for pcm in stimuli(say, 12):
            await heard(stt, pcm, noisy)
        assert noisy.state is not None  # it did adapt, to its own audio
        for _ in range(3):  # new sessions, on both decoders
            assert await heard(stt, probe, SttAdaptation()) == first_on_a_fresh_server
        again = SttAdaptation()
        await heard(stt, probe, again)
        assert again.state is not None and again.state != noisy.state
    finally:
        await stt.aclose()
