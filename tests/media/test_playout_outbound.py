"""Playout buffer, delivery gate and the paced outbound track on a virtual clock."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest
from aiortc.mediastreams import MediaStreamError

from clock import VirtualClock
from media.declick import Declicker
from media.frames import PLAYOUT_RATE, frame_bytes
from media.outbound import PacedAudioTrack
from media.playout import PlayoutBuffer, PlayoutFrame
from turn.generation import GenerationFence

FB = frame_bytes(PLAYOUT_RATE)


def tone(value: int = 1000) -> bytes:
    return np.full(FB // 2, value, dtype="<i2").tobytes()


def test_buffer_fifo_clear_and_validation() -> None:
    buf = PlayoutBuffer()
    for g in (1, 1, 2):
        buf.push(PlayoutFrame(tone(), g))
    assert len(buf) == 3 and buf.queued_ms == 60
    assert buf.pop().generation == 1  # type: ignore[union-attr]
    assert buf.clear() == 2 and len(buf) == 0 and buf.cleared_frames == 2
    assert buf.pop() is None
    with pytest.raises(ValueError):
        buf.push(PlayoutFrame(bytes(100), 1))


async def test_wait_empty() -> None:
    buf = PlayoutBuffer()
    await asyncio.wait_for(buf.wait_empty(), 1)  # empty: returns at once
    buf.push(PlayoutFrame(tone(), 1))
    waiter = asyncio.create_task(buf.wait_empty())
    await asyncio.sleep(0)
    assert not waiter.done()
    buf.pop()
    await asyncio.wait_for(waiter, 1)
    buf.push(PlayoutFrame(tone(), 1))
    waiter = asyncio.create_task(buf.wait_empty())
    await asyncio.sleep(0)
    buf.clear()
    await asyncio.wait_for(waiter, 1)


def make_track(clock: VirtualClock) -> tuple[PacedAudioTrack, PlayoutBuffer, GenerationFence]:
    fence = GenerationFence(clock)
    fence.advance()
    buf = PlayoutBuffer()
    return PacedAudioTrack(buf, fence.passes, clock), buf, fence


async def recv_at(track: PacedAudioTrack, clock: VirtualClock):
    """Advance the virtual clock until the next frame comes out."""
    task = asyncio.create_task(track.recv())
    for _ in range(10):
        await clock.advance(0.01)
        if task.done():
            return task.result()
    raise AssertionError("no frame after 100 ms")


async def test_paced_20ms_and_silence_when_empty(clock: VirtualClock) -> None:
    track, buf, _ = make_track(clock)
    t0 = clock.monotonic()
    stamps = []

    async def timed_recv():
        frame = await track.recv()
        stamps.append(clock.monotonic() - t0)  # the virtual clock stands at the wake-up time
        return frame

    for _ in range(5):
        task = asyncio.create_task(timed_recv())
        while not task.done():
            await clock.advance(0.007)
        f = task.result()
        assert f.sample_rate == PLAYOUT_RATE and f.samples == 960
        assert not np.any(f.to_ndarray())
    assert stamps == pytest.approx([0.0, 0.02, 0.04, 0.06, 0.08])  # first frame at once, then every 20 ms
    assert track.audit.silence_frames == 5


async def test_pts_monotonic(clock: VirtualClock) -> None:
    track, buf, _ = make_track(clock)
    pts = [(await recv_at(track, clock)).pts for _ in range(3)]
    assert pts == [0, 960, 1920]


async def test_gate_drops_stale_generation_however_late(clock: VirtualClock) -> None:
    track, buf, fence = make_track(clock)
    buf.push(PlayoutFrame(tone(), 1))
    f = await recv_at(track, clock)
    assert np.any(f.to_ndarray())
    fence.advance()  # barge-in: generation 2 is active now
    # late frames of generation 1 arrive after the fence, then one of generation 2
    buf.push(PlayoutFrame(tone(), 1))
    buf.push(PlayoutFrame(tone(), 1))
    buf.push(PlayoutFrame(tone(2000), 2))
    f = await recv_at(track, clock)
    assert int(f.to_ndarray()[0][0]) == 2000
    assert track.audit.fenced_frames == 2
    a1 = track.audit.per_generation[1]
    assert a1.frames == 1 and a1.last_sent_at is not None
    assert a1.last_sent_at <= fence.fenced_at(1)  # type: ignore[operator]


async def test_clear_is_silent_on_next_tick(clock: VirtualClock) -> None:
    track, buf, _ = make_track(clock)
    for _ in range(50):
        buf.push(PlayoutFrame(tone(), 1))
    last = (await recv_at(track, clock)).to_ndarray().reshape(-1)
    assert np.any(last)
    buf.clear()
    after = (await recv_at(track, clock)).to_ndarray().reshape(-1)
    ramp = Declicker(PLAYOUT_RATE).ramp  # the level already on the wire is let down over 5 ms
    assert not np.any(after[ramp:]) and np.abs(after).max() <= abs(int(last[-1]))


async def test_pause_holds_frames(clock: VirtualClock) -> None:
    track, buf, _ = make_track(clock)
    buf.push(PlayoutFrame(tone(), 1))
    assert buf.pause() and not buf.pause()  # a second pause reports it was paused already
    assert not np.any((await recv_at(track, clock)).to_ndarray())
    assert len(buf) == 1
    assert buf.resume() and not buf.resume()
    assert np.any((await recv_at(track, clock)).to_ndarray())


async def test_resync_after_stall(clock: VirtualClock) -> None:
    track, buf, _ = make_track(clock)
    await recv_at(track, clock)
    await clock.advance(1.0)  # the loop was stalled for a second
    task = asyncio.create_task(track.recv())
    await clock.advance(0)
    assert task.done()  # no burst of 50 catch-up frames: one frame, pacing restarted
    assert track.audit.resyncs == 1
    await task


async def test_stopped_track_raises(clock: VirtualClock) -> None:
    track, _, _ = make_track(clock)
    track.stop()
    with pytest.raises(MediaStreamError):
        await track.recv()


async def test_the_webrtc_track_hands_the_sender_opus_packets_it_coded(clock: VirtualClock) -> None:
    """OpusPacedTrack: the same pacing and gate, each tick one Opus packet
    on RTP's 48 kHz clock, which aiortc's sender packs as it is (no
    resampling, no thread); the frames queued come back at their level when
    decoded, and an empty buffer is silence."""
    from aiortc.codecs.opus import OpusEncoder as AiortcOpus
    from av.packet import Packet

    from media.frames import rms_dbfs
    from media.opus import OpusDecoder
    from media.outbound import OPUS_TIME_BASE, OpusPacedTrack

    fence = GenerationFence(clock)
    gen = fence.advance()
    buf = PlayoutBuffer()
    track = OpusPacedTrack(buf, fence.passes, clock)
    t = np.arange(FB // 2) / PLAYOUT_RATE
    loud = (8000 * np.sin(2 * np.pi * 300 * t)).astype("<i2").tobytes()  # 300 Hz: a whole number of periods
    for _ in range(10):
        buf.push(PlayoutFrame(loud, gen))
    packets = [await recv_at(track, clock) for _ in range(15)]
    assert all(isinstance(p, Packet) and p.time_base == OPUS_TIME_BASE for p in packets)
    assert [p.pts for p in packets] == [i * 960 for i in range(15)]
    sender = AiortcOpus()
    assert [sender.pack(p)[1] for p in packets[:3]] == [0, 960, 1920]  # the RTP timestamps
    dec = OpusDecoder(PLAYOUT_RATE)
    levels = [rms_dbfs(dec.decode(bytes(p))) for p in packets]
    assert all(abs(level - rms_dbfs(loud)) < 1.5 for level in levels[1:9])
    assert all(level < -60 for level in levels[11:])  # silent from the frame after the cut
    assert track.audit.per_generation[gen].frames == 10 and track.audit.silence_frames == 5
