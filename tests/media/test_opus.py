"""media/opus.py: the device socket's codec, through PyAV's libopus."""

from __future__ import annotations

import math

import numpy as np
import pytest

from media.frames import frame_bytes, rms_dbfs
from media.opus import MAX_PACKET_BYTES, OpusDecoder, OpusEncoder, OpusError


def tone(rate: int, seconds: float, hz: float = 440.0, level: float = 0.25) -> bytes:
    t = np.arange(int(rate * seconds)) / rate
    return (level * 32767 * np.sin(2 * math.pi * hz * t)).astype("<i2").tobytes()


def test_playout_frames_become_60_ms_packets_at_the_announced_rate() -> None:
    """One second of 20 ms playout frames at 48 kHz, coded at 24 kHz in
    60 ms packets: 16 whole packets (the 17th waits for its third frame),
    then flush pads it; decoded back, the tone keeps its level."""
    enc = OpusEncoder(24_000, 60, in_rate=48_000)
    pcm = tone(48_000, 1.0)
    step = frame_bytes(48_000)
    packets: list[bytes] = []
    counts = []
    for i in range(0, len(pcm), step):
        got = enc.encode(pcm[i : i + step])
        counts.append(len(got))
        packets += got
    assert len(packets) == 16 and set(counts) == {0, 1}
    packets += enc.flush()
    assert len(packets) == 17 and enc.flush() == []
    dec = OpusDecoder(16_000)
    back = b"".join(dec.decode(p) for p in packets)
    assert abs(len(back) - 17 * 60 * 16 * 2) <= 64  # 60 ms at 16 kHz each
    assert abs(rms_dbfs(back[3200:-3200]) - rms_dbfs(pcm)) < 1.5


def test_a_device_uplink_decodes_to_the_vad_rate() -> None:
    """The device's own format: 16 kHz mono, 60 ms packets."""
    enc = OpusEncoder(16_000, 60, in_rate=16_000)
    packets = enc.encode(tone(16_000, 0.6, hz=300))
    assert len(packets) == 10
    dec = OpusDecoder(16_000)
    assert all(abs(len(dec.decode(p)) - 1920) <= 64 for p in packets)


def test_bad_packets_are_refused_and_the_decoder_goes_on() -> None:
    good = OpusEncoder(16_000, 60, in_rate=16_000).encode(tone(16_000, 0.12))
    dec = OpusDecoder(16_000)
    with pytest.raises(OpusError, match="empty"):
        dec.decode(b"")
    with pytest.raises(OpusError, match="at most"):
        dec.decode(bytes(MAX_PACKET_BYTES + 1))
    with pytest.raises(OpusError, match="not an Opus packet"):
        dec.decode(b"\xff\xfe\x00garbage")
    assert len(dec.decode(good[0])) > 1000


def test_rates_and_durations_opus_does_not_have_are_refused() -> None:
    with pytest.raises(OpusError, match="44100 Hz"):
        OpusEncoder(44_100, 60, in_rate=48_000)
    with pytest.raises(OpusError, match="30 ms"):
        OpusEncoder(24_000, 30, in_rate=48_000)


def test_reset_starts_a_new_stream() -> None:
    enc = OpusEncoder(24_000, 60, in_rate=48_000)
    assert enc.encode(tone(48_000, 0.04)) == []  # two of three frames pending
    enc.reset()
    assert enc.flush() == []  # the partial frame was forgotten


def test_modes_and_complexities_opus_does_not_have_are_refused() -> None:
    with pytest.raises(OpusError, match="'music' mode"):
        OpusEncoder(48_000, 20, in_rate=48_000, application="music")
    with pytest.raises(OpusError, match="0-10, not 11"):
        OpusEncoder(48_000, 20, in_rate=48_000, complexity=11)


def webrtc_encoder() -> OpusEncoder:
    from media.outbound import OPUS_APPLICATION, OPUS_BITRATE, OPUS_COMPLEXITY

    return OpusEncoder(48_000, 20, in_rate=48_000, bitrate=OPUS_BITRATE, application=OPUS_APPLICATION,
                       complexity=OPUS_COMPLEXITY)


def test_a_run_of_silence_is_coded_once_and_decodes_the_same() -> None:
    """Speech-like audio, 2 s of digital silence, audio again, 20 ms frames
    at 48 kHz: once two silent frames gave the same packet, the rest of the
    run reuses it without the encoder; decoded, the run is silent and the
    audio after it is what an encoder that coded every frame gives."""
    step = frame_bytes(48_000)
    audio = tone(48_000, 0.6, hz=300)
    frames = [audio[i : i + step] for i in range(0, len(audio), step)]
    stream = frames + [bytes(step)] * 100 + frames
    reusing, coding = webrtc_encoder(), webrtc_encoder()
    coded = [p for f in stream for p in reusing.encode(f)]
    plain = []
    for f in stream:
        plain += coding.encode(f)
        coding._silence_packet = None  # this one codes every frame
    assert len(coded) == len(plain) == len(stream)
    assert reusing.reused_silence >= 80 and coding.reused_silence == 0
    assert len(set(coded[50:130])) == 1 and len(coded[50]) <= 8  # the one silence packet
    dec_a, dec_b = OpusDecoder(48_000), OpusDecoder(48_000)
    a = [dec_a.decode(p) for p in coded]
    b = [dec_b.decode(p) for p in plain]
    assert all(rms_dbfs(f) < -70 for f in a[50:130])  # silence stays silence
    assert all(abs(rms_dbfs(f) - rms_dbfs(audio)) < 1 for f in a[132:])  # the audio after it comes back whole
    x, y = (np.frombuffer(b"".join(v[130:]), dtype="<i2").astype(float) for v in (a, b))
    assert np.sqrt(np.mean((x - y) ** 2) / np.mean(y**2)) < 0.05  # within -26 dB of coding every frame


def test_audio_between_silences_is_coded_not_reused() -> None:
    """A frame that is not digital silence ends the run: coded afresh, and
    the run after it starts over (two equal packets again)."""
    step = frame_bytes(48_000)
    enc = webrtc_encoder()
    for _ in range(10):
        enc.encode(bytes(step))
    reused = enc.reused_silence
    blip = tone(48_000, 0.02, hz=1000)
    packet = enc.encode(blip)[0]
    assert enc.reused_silence == reused and len(packet) > 8
    enc.encode(bytes(step))
    assert enc.reused_silence == reused  # the first silent frame after audio is coded
