"""The device socket's output sink, driven tick by tick on virtual time:
60 ms Opus packets at the announced rate, send-ahead pacing, the heard
position (sent minus the send-ahead in flight: the protocol has no
acknowledgements), a clear that freezes it and tells the wire, a mute
(abort) that drops the same generation's late frames, and the delivery
gate."""

from __future__ import annotations

import pytest

from clock import VirtualClock
from media.device_playout import DevicePlayout
from media.frames import PLAYOUT_RATE
from media.opus import OpusDecoder
from media.playout import PlayoutFrame

RATE = PLAYOUT_RATE
FRAME = RATE // 50  # 960 samples, 20 ms
LOUD = b"\x00\x20" * FRAME


class Wire:
    def __init__(self) -> None:
        self.sent: list[tuple[str, bytes, int | None]] = []

    def send_audio(self, packet: bytes, generation: int) -> None:
        self.sent.append(("audio", packet, generation))

    def send_cleared(self) -> None:
        self.sent.append(("cleared", b"", None))

    def audio(self) -> list[tuple[str, bytes, int | None]]:
        return [s for s in self.sent if s[0] == "audio"]


def make(clock: VirtualClock, active: list[int] | None = None, send_ahead_ms: int = 60) -> tuple[DevicePlayout, Wire]:
    wire = Wire()
    gens = active if active is not None else [1]
    return DevicePlayout(clock, lambda g: g == gens[0], wire, sample_rate=24_000, frame_ms=60,
                         send_ahead_ms=send_ahead_ms), wire


def push(out: DevicePlayout, gen: int, n: int, start: int = 0) -> None:
    for i in range(n):
        out.push(PlayoutFrame(LOUD, gen, start + i * FRAME))


def test_packets_are_60_ms_at_the_announced_rate_and_paced_with_send_ahead() -> None:
    clock = VirtualClock()
    out, wire = make(clock)
    push(out, 1, 30)  # 600 ms
    t0 = clock.monotonic()
    out.pump(t0)
    assert len(wire.audio()) == 1  # one packet: the device holds 60 ms ahead
    pcm = OpusDecoder(24_000).decode(wire.audio()[0][1])
    assert abs(len(pcm) // 2 - 1440) <= 60
    for k in range(1, 10):  # 9 more ticks of 20 ms: one packet per 60 ms of real time
        out.pump(t0 + k * 0.02)
    assert 3 <= len(wire.audio()) <= 5
    assert out.far_end_until - (t0 + 0.18) <= 0.06 + 0.06 + 1e-9  # never more than send-ahead plus a packet


async def test_heard_is_sent_minus_what_is_in_flight() -> None:
    clock = VirtualClock()
    out, wire = make(clock)
    push(out, 1, 9)  # 180 ms
    t0 = clock.monotonic()
    out.pump(t0)
    # 60 ms sent just now: all of it in flight, nothing heard yet
    assert out.played_samples(1) == 0
    await clock.advance(t0 + 0.03 - clock.monotonic())
    assert out.played_samples(1) == pytest.approx(0.03 * RATE, abs=2)
    await clock.advance(t0 + 0.2 - clock.monotonic())
    assert out.played_samples(1) == 3 * FRAME  # all sent was played; the rest was never sent


async def test_a_clear_freezes_what_was_heard_and_tells_the_wire() -> None:
    clock = VirtualClock()
    out, wire = make(clock)
    push(out, 1, 30)
    t0 = clock.monotonic()
    out.pump(t0)
    await clock.advance(t0 + 0.04 - clock.monotonic())
    out.pump(clock.monotonic())
    heard = out.played_samples(1)
    assert out.clear() > 0 and wire.sent[-1][0] == "cleared"
    await clock.advance(t0 + 5 - clock.monotonic())
    assert out.played_samples(1) == heard  # what was in flight was not heard
    assert out.far_end_until == 0.0 and not out.audible_pending(1)
    assert out.clear() == 0 and [k for k, _, _ in wire.sent].count("cleared") == 1  # nothing sent since: no second


def test_mute_drops_the_aborted_generations_late_frames() -> None:
    clock = VirtualClock()
    out, wire = make(clock)
    push(out, 1, 6)
    out.pump(clock.monotonic())
    before = len(wire.audio())
    out.mute(1)
    push(out, 1, 6, start=6 * FRAME)  # TTS still pushing before its cancel lands
    for k in range(1, 10):
        out.pump(clock.monotonic() + k * 0.02)
    assert len(wire.audio()) == before and out.fenced_frames == 6


def test_the_gate_drops_an_old_generation() -> None:
    clock = VirtualClock()
    active = [2]
    out, wire = make(clock, active)
    push(out, 1, 6)
    push(out, 2, 3)
    out.pump(clock.monotonic())
    out.pump(clock.monotonic() + 0.02)  # the stretch ends: its last packet goes
    assert {g for _, _, g in wire.audio()} == {2} and out.fenced_frames == 6
