"""Framing, resampling, levels, and VAD hysteresis on real speech."""

from __future__ import annotations

import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest

from media.frames import (
    PLAYOUT_RATE,
    VAD_RATE,
    PcmResampler,
    Reframer,
    first_sound_sample,
    frame_bytes,
    load_pcm,
    rms_dbfs,
    samples_per_frame,
)
from media.vad import VadConfig, VoiceActivityDetector


def test_frame_sizes() -> None:
    assert samples_per_frame(VAD_RATE) == 320 and frame_bytes(VAD_RATE) == 640
    assert samples_per_frame(PLAYOUT_RATE) == 960 and frame_bytes(PLAYOUT_RATE) == 1920


def test_reframer_exact_frames_and_flush() -> None:
    r = Reframer(VAD_RATE)
    assert r.push(bytes(600)) == []
    out = r.push(bytes(700))
    assert [len(f) for f in out] == [640, 640]
    assert r.pending_bytes == 20
    tail = r.flush()
    assert tail is not None and len(tail) == 640
    assert r.flush() is None
    with pytest.raises(ValueError):
        r.push(b"\x00")


def test_resampler_keeps_duration() -> None:
    one_second = np.zeros(22050, dtype="<i2").tobytes()
    res = PcmResampler(PLAYOUT_RATE)
    out = res.pcm(one_second, 22050) + res.flush()
    assert abs(len(out) // 2 - PLAYOUT_RATE) < 100
    with pytest.raises(ValueError):
        res.pcm(bytes(4), 16000)
    with pytest.raises(ValueError):
        res.pcm(b"\x00", 22050)


def test_rms_dbfs() -> None:
    assert rms_dbfs(b"") == -math.inf
    assert rms_dbfs(bytes(640)) == -math.inf
    full = np.full(320, 32767, dtype="<i2").tobytes()
    assert rms_dbfs(full) == pytest.approx(0.0, abs=0.01)
    half = np.full(320, 16384, dtype="<i2").tobytes()
    assert rms_dbfs(half) == pytest.approx(-6.02, abs=0.05)


def test_load_pcm_and_errors(say: Callable[..., Path], tmp_path: Path) -> None:
    pcm = load_pcm(say("hello there"), VAD_RATE)
    assert 0.5 < len(pcm) / 2 / VAD_RATE < 3
    onset = first_sound_sample(pcm)
    assert onset is not None and onset < VAD_RATE  # speech starts within 1 s
    assert first_sound_sample(bytes(3200)) is None
    with pytest.raises(FileNotFoundError):
        load_pcm(tmp_path / "missing.wav", VAD_RATE)
    junk = tmp_path / "junk.wav"
    junk.write_bytes(b"RIFF this is not audio at all" * 10)
    with pytest.raises(ValueError):
        load_pcm(junk, VAD_RATE)


def frames_of(pcm: bytes) -> list[bytes]:
    return Reframer(VAD_RATE).push(pcm)


def test_vad_config_validation() -> None:
    with pytest.raises(ValueError):
        VadConfig(offset_ms=50)
    with pytest.raises(ValueError):
        VadConfig(aggressiveness=4)
    cfg = VadConfig(offset_ms=300, preroll_ms=200)
    assert (cfg.offset_frames, cfg.preroll_frames) == (15, 10)


def test_vad_rejects_wrong_frame_size() -> None:
    with pytest.raises(ValueError):
        VoiceActivityDetector().is_voiced(bytes(320))


def test_silence_is_never_voiced() -> None:
    vad = VoiceActivityDetector()
    assert not any(vad.is_voiced(f) for f in frames_of(bytes(640 * 100)))


def test_speech_is_voiced(say: Callable[..., Path]) -> None:
    """webrtcvad's verdicts on an utterance between silences: the silence
    before it is not voiced, most of the utterance is."""
    speech = load_pcm(say("what is the weather like today"), VAD_RATE)
    vad = VoiceActivityDetector()
    lead = [vad.is_voiced(f) for f in frames_of(bytes(640 * 25))]
    words = [vad.is_voiced(f) for f in frames_of(speech)]
    assert not any(lead)
    assert sum(words) > len(words) / 2
