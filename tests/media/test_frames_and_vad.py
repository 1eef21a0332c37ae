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
from media.vad import VadConfig, VadEventKind, VoiceActivityDetector


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
        VadConfig(onset_ms=50)
    with pytest.raises(ValueError):
        VadConfig(aggressiveness=4)
    cfg = VadConfig(onset_ms=100, offset_ms=300)
    assert (cfg.onset_frames, cfg.offset_frames) == (5, 15)


def test_vad_rejects_wrong_frame_size() -> None:
    with pytest.raises(ValueError):
        VoiceActivityDetector().feed(bytes(320), 0.0)


def test_silence_never_starts_speech() -> None:
    vad = VoiceActivityDetector()
    events = [vad.feed(f, i * 0.02)[1] for i, f in enumerate(frames_of(bytes(640 * 100)))]
    assert not any(events)


def test_hysteresis_on_speech(say: Callable[..., Path]) -> None:
    """speech_started exactly onset_frames after the voiced run begins; one
    utterance with short pauses between words gives one start and one stop."""
    speech = load_pcm(say("what is the weather like today"), VAD_RATE)
    pcm = bytes(640 * 25) + speech + bytes(640 * 40)
    cfg = VadConfig(onset_ms=60, offset_ms=500)
    vad = VoiceActivityDetector(cfg)
    results = [(i, *vad.feed(f, i * 0.02)) for i, f in enumerate(frames_of(pcm))]
    events = [(i, e) for i, _, e in results if e is not None]
    assert [e.kind for _, e in events] == [VadEventKind.SPEECH_STARTED, VadEventKind.SPEECH_STOPPED]
    (i_start, start), (i_stop, stop) = events
    first_voiced = next(i for i, v, _ in results if v)
    assert start.onset_at == pytest.approx(first_voiced * 0.02)
    assert i_start - first_voiced == cfg.onset_frames - 1
    assert stop.at - stop.onset_at == pytest.approx((cfg.offset_frames - 1) * 0.02)
    assert 25 <= i_start < 40


class ScriptedVad(VoiceActivityDetector):
    """Hysteresis under test with webrtcvad's verdicts replaced by a script."""

    def __init__(self, script: str, config: VadConfig) -> None:
        super().__init__(config)
        self._script = iter(script)

    def is_voiced(self, frame: bytes) -> bool:
        return next(self._script) == "1"


def run_script(script: str, config: VadConfig) -> list[tuple[int, VadEventKind, int]]:
    vad = ScriptedVad(script, config)
    out = []
    for i in range(len(script)):
        _, ev = vad.feed(bytes(640), i * 0.02)
        if ev is not None:
            out.append((i, ev.kind, round(ev.onset_at / 0.02)))
    return out


def test_hysteresis_thresholds_exact() -> None:
    cfg = VadConfig(onset_ms=60, offset_ms=100)
    S, E = VadEventKind.SPEECH_STARTED, VadEventKind.SPEECH_STOPPED
    # blips of 1 and 2 voiced frames are not speech; 3 in a row are
    assert run_script("0110100111", cfg) == [(9, S, 7)]
    # gaps shorter than 5 frames do not end speech; 5 do
    assert run_script("111" + "0000" + "1" + "00000" + "0", cfg) == [(2, S, 0), (12, E, 8)]
    # a voiced frame inside the offset run restarts it
    assert run_script("111" + "0001" + "00000", cfg) == [(2, S, 0), (11, E, 7)]
