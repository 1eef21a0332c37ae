"""shared/cases/click-at-the-cut.md: where a barge-in (or a pause) cuts the
reply, the audio the client receives ramps down over a few ms instead of
stepping to digital zero; a resume ramps up. Measured on what the paced
track hands the RTP sender."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

from clock import VirtualClock
from media.declick import Declicker
from media.frames import PLAYOUT_RATE, samples_per_frame
from media.outbound import PacedAudioTrack
from media.playout import PlayoutBuffer, PlayoutFrame
from turn.generation import GenerationFence

N = samples_per_frame(PLAYOUT_RATE)


def voice_like(frames: int, dbfs: float = -32.0) -> list[bytes]:
    """A 220 Hz tone at ``dbfs`` RMS, cut into 20 ms frames at an arbitrary
    phase (the cut lands mid-waveform, as a barge-in does)."""
    t = np.arange(frames * N) / PLAYOUT_RATE
    x = np.sqrt(2) * 10 ** (dbfs / 20) * 32767 * np.sin(2 * np.pi * 220 * t + 1.0)
    pcm = x.astype("<i2")
    return [pcm[i * N : (i + 1) * N].tobytes() for i in range(frames)]


async def received(track: PacedAudioTrack, clock: VirtualClock, ticks: int) -> np.ndarray:
    out = []
    for _ in range(ticks):
        frame, _ = await asyncio.gather(track.recv(), clock.advance(0.02))
        out.append(frame.to_ndarray().reshape(-1))
    return np.concatenate(out).astype(np.int32)


async def test_a_barge_in_cut_ramps_down_instead_of_clicking() -> None:
    clock = VirtualClock()
    fence = GenerationFence(clock)
    buffer = PlayoutBuffer()
    track = PacedAudioTrack(buffer, fence.passes, clock)
    frames = voice_like(10)
    for pcm in frames:
        buffer.push(PlayoutFrame(pcm, fence.active, audible=True))
    heard = await received(track, clock, 5)
    buffer.clear()  # the barge-in: the rest of the reply is gone
    heard = np.concatenate([heard, await received(track, clock, 3)])
    cut = 5 * N
    natural = int(np.abs(np.diff(heard[: cut])).max())  # the reply's own largest step
    steps = np.abs(np.diff(heard[cut - 1 : cut + N]))
    assert int(heard[cut - 1]) != 0  # the cut came mid-waveform
    assert steps.max() <= natural  # no click larger than the voice itself makes
    ramp = Declicker(PLAYOUT_RATE).ramp
    assert np.all(heard[cut + ramp :] == 0)  # silent within the ramp (5 ms)
    track.stop()


async def test_a_resume_after_a_pause_ramps_up() -> None:
    clock = VirtualClock()
    fence = GenerationFence(clock)
    buffer = PlayoutBuffer()
    track = PacedAudioTrack(buffer, fence.passes, clock)
    for pcm in voice_like(10):
        buffer.push(PlayoutFrame(pcm, fence.active, audible=True))
    first = await received(track, clock, 3)
    natural = int(np.abs(np.diff(first)).max())
    buffer.pause()
    paused = await received(track, clock, 2)
    buffer.resume()
    resumed = await received(track, clock, 2)
    heard = np.concatenate([first, paused, resumed])
    assert int(np.abs(np.diff(heard)).max()) <= natural
    track.stop()


def test_declicker_rules() -> None:
    d = Declicker(48_000)
    loud = (np.full(N, 8000, dtype="<i2")).tobytes()
    up = np.frombuffer(d.audio(loud), dtype="<i2")
    assert up[0] == 0 and up[-1] == 8000 and np.all(np.diff(up.astype(int)) >= 0)
    down = np.frombuffer(d.silence(N), dtype="<i2")
    assert down[0] < 8000 and down[d.ramp - 1] == 0 and not down[d.ramp :].any()
    assert not np.frombuffer(d.silence(N), dtype="<i2").any()  # silence after silence stays silent
    for bad in (dict(rate=0), dict(rate=48_000, ramp_ms=0), dict(rate=48_000, ramp_ms=11)):
        with pytest.raises(ValueError):
            Declicker(**bad)
