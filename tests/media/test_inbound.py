"""InboundAudio on decoded frames like aiortc's, and the jitter prefetch setting."""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
from aiortc import RTCPeerConnection
from aiortc.mediastreams import MediaStreamError
from aiortc.rtp import RtpPacket
from av.audio.frame import AudioFrame

from clock import SystemClock, VirtualClock
from media.bargein import DetectorEventKind
from media.frames import PLAYOUT_RATE, load_pcm
from media.inbound import AudioJitterBuffer, InboundAudio, jitter_prefetch, set_jitter_prefetch


class FakeOpusTrack:
    """Yields what aiortc's Opus decoder yields: 48 kHz stereo s16, 960 samples."""

    def __init__(self, mono48k: bytes) -> None:
        x = np.frombuffer(mono48k, dtype="<i2")
        x = x[: len(x) // 960 * 960]
        self._chunks = [x[i : i + 960] for i in range(0, len(x), 960)]

    async def recv(self) -> AudioFrame:
        if not self._chunks:
            raise MediaStreamError
        mono = self._chunks.pop(0)
        stereo = np.repeat(mono, 2).reshape(1, -1)
        frame = AudioFrame.from_ndarray(stereo, format="s16", layout="stereo")
        frame.sample_rate = PLAYOUT_RATE
        return frame


async def test_inbound_resamples_and_detects_speech(say: Callable[..., Path], clock: VirtualClock) -> None:
    speech = load_pcm(say("what is the weather like today"), PLAYOUT_RATE)
    pcm = bytes(1920 * 20) + speech + bytes(1920 * 40)
    inbound = InboundAudio(FakeOpusTrack(pcm), clock)
    frames = [f async for f in inbound.frames()]
    assert all(len(f.pcm) == 640 for f in frames)
    # 48 kHz in -> 16 kHz out, same duration (within resampler delay)
    assert abs(len(frames) - len(pcm) // 1920) <= 2
    kinds = [e.kind for f in frames for e in f.events if e.kind is not DetectorEventKind.SPEECH_VERIFIED]
    assert kinds == [
        DetectorEventKind.SPEECH_STARTED, DetectorEventKind.SPEECH_CONFIRMED, DetectorEventKind.SPEECH_STOPPED
    ]
    assert not any(f.voiced for f in frames[:15])


async def test_jitter_prefetch_is_set_on_a_real_receiver() -> None:
    pc = RTCPeerConnection()
    try:
        t = pc.addTransceiver("audio")
        assert jitter_prefetch(t.receiver) == 4  # aiortc's default
        set_jitter_prefetch(t.receiver, 1)
        assert jitter_prefetch(t.receiver) == 1
        with pytest.raises(ValueError):
            set_jitter_prefetch(t.receiver, 9)
        with pytest.raises(RuntimeError):
            set_jitter_prefetch(object(), 1)
    finally:
        await pc.close()


async def test_each_packet_completes_its_own_vad_frame(clock: VirtualClock) -> None:
    """No extra 20 ms wait: the loud packet k shows up in the frame yielded for
    packet k, not k + 1 (resampler delay is absorbed at the start)."""
    frames48 = [np.zeros(960, dtype="<i2") for _ in range(6)]
    frames48[2][:] = 10000
    inbound = InboundAudio(FakeOpusTrack(np.concatenate(frames48).tobytes()), clock)
    out = [f async for f in inbound.frames()]
    assert len(out) == 6
    loud = [int((np.abs(np.frombuffer(f.pcm, dtype="<i2")) > 5000).sum()) for f in out]
    assert loud[2] > 300 and loud[3] < 20


def _rtp(seq: int) -> RtpPacket:
    packet = RtpPacket(payload_type=111, sequence_number=seq % 65536, timestamp=seq * 960, payload=bytes([seq % 256]))
    packet._data = packet.payload  # type: ignore[attr-defined]  # the receiver's depayloaded data
    return packet


def test_audio_jitter_buffer_releases_each_packet_on_arrival() -> None:
    buf = AudioJitterBuffer(capacity=16)
    for seq in (65534, 65535, 0, 1):  # across the sequence-number wrap
        _, frame = buf.add(_rtp(seq))
        assert frame is not None and frame.timestamp == seq * 960  # no wait for the next packet


def test_audio_jitter_buffer_gives_a_lost_packet_up_and_leaves_no_latency() -> None:
    buf = AudioJitterBuffer(capacity=16)
    assert buf.add(_rtp(10))[1] is not None
    # 11 is lost; 12 waits for it, 13 arrives: 11 is given up, playout goes on from 13
    assert buf.add(_rtp(12))[1] is None
    _, frame = buf.add(_rtp(13))
    assert frame is not None and frame.timestamp == 13 * 960 and buf.skipped == 2
    # the next packet comes out at once: nothing is left queued behind
    assert buf.add(_rtp(14))[1].timestamp == 14 * 960  # type: ignore[union-attr]
    # a packet that arrives after its time is dropped, not played out of order
    assert buf.add(_rtp(11))[1] is None
    assert buf.add(_rtp(15))[1].timestamp == 15 * 960  # type: ignore[union-attr]


async def test_prefetch_zero_installs_the_audio_buffer() -> None:
    pc = RTCPeerConnection()
    try:
        t = pc.addTransceiver("audio")
        set_jitter_prefetch(t.receiver, 0)
        assert isinstance(t.receiver._RTCRtpReceiver__jitter_buffer, AudioJitterBuffer)
    finally:
        await pc.close()


class StallingTrack(FakeOpusTrack):
    """Gives its frames, except that frame ``stall_at`` comes only after
    ``stall_s``; then stays silent (no frame at all) until closed."""

    def __init__(self, mono48k: bytes, stall_at: int, stall_s: float) -> None:
        super().__init__(mono48k)
        self.stall_at, self.stall_s, self.given = stall_at, stall_s, 0
        self.closed = asyncio.Event()

    async def recv(self) -> AudioFrame:
        if self.given == self.stall_at:
            await asyncio.sleep(self.stall_s)
        if not self._chunks:
            await self.closed.wait()
            raise MediaStreamError
        self.given += 1
        return await super().recv()


async def test_a_stall_is_filled_with_silence_and_loses_no_frame(say: Callable[..., Path]) -> None:
    """A track that gives nothing for a while: silence is put in every
    ``stall_ms`` so the detector runs on (the speech it was hearing stops),
    the frames that come late all come, and filled frames are marked and do
    not count as received audio."""
    speech = load_pcm(say("hello there"), PLAYOUT_RATE)
    x = np.abs(np.frombuffer(speech, dtype="<i2"))
    last_loud = int(np.nonzero(x > 3000)[0][-1])  # the track stops right as the speech does
    pcm = bytes(1920 * 10) + speech[: (last_loud // 960 + 1) * 1920]
    real = len(pcm) // 1920
    track = StallingTrack(pcm, stall_at=5, stall_s=0.35)
    inbound = InboundAudio(track, SystemClock(), stall_ms=100)
    out = []
    async with asyncio.timeout(10):
        async for f in inbound.frames():
            out.append(f)
            if sum(f.filled for f in out[-30:]) == 30:  # 0.6 s after the last frame
                track.closed.set()
    received = [f for f in out if not f.filled]
    filled = [f for f in out if f.filled]
    assert abs(len(received) - real) <= 1  # every frame, the late ones too
    assert all(f.pcm == bytes(640) for f in filled)
    assert not any(f.gated for f in filled)  # (webrtcvad may still say "voiced": its own hangover)
    assert inbound.filled_frames == len(filled) >= 30 + 5  # the mid-stream stall (0.35 s) and the end
    first_stall = next(i for i, f in enumerate(out) if f.filled)
    run = next(i for i in range(first_stall, len(out)) if not out[i].filled) - first_stall
    assert first_stall == 5 and run in (5, 10, 15)  # 100 ms at a time until the late frame (0.35 s)
    kinds = [e.kind for f in out for e in f.events]
    assert kinds[-1] is DetectorEventKind.SPEECH_STOPPED  # heard only thanks to the filled silence
    assert not any(e.kind is DetectorEventKind.SPEECH_STOPPED for f in received for e in f.events)
    assert inbound.last_frame_at == received[-1].at
    assert [f.at for f in out] == sorted(f.at for f in out)


async def test_no_fill_when_turned_off(clock: VirtualClock) -> None:
    track = StallingTrack(bytes(1920 * 5), stall_at=99, stall_s=0)
    inbound = InboundAudio(track, clock, stall_ms=0)
    gen = inbound.frames()
    got = [await anext(gen) for _ in range(5)]
    nxt = asyncio.ensure_future(anext(gen))
    await clock.advance(5.0)
    assert not nxt.done() and inbound.filled_frames == 0
    track.closed.set()
    with pytest.raises(StopAsyncIteration):
        await nxt
    assert len(got) == 5


@pytest.mark.parametrize("stall_ms", [-20, 20, 50, 90, 110])
def test_a_stall_shorter_than_jitter_allows_is_refused(stall_ms: int, clock: VirtualClock) -> None:
    """Ordinary jitter of 20 ms packets would be taken for stalls, and
    silence put between healthy frames."""
    with pytest.raises(ValueError, match="stall_ms"):
        InboundAudio(FakeOpusTrack(b""), clock, stall_ms=stall_ms)


class SulkingTrack:
    """A track whose recv, cancelled, raises something else instead."""

    async def recv(self) -> AudioFrame:
        try:
            await asyncio.Event().wait()
        except asyncio.CancelledError:
            raise MediaStreamError("closed while waiting") from None
        raise AssertionError


async def test_closing_mid_stall_leaves_no_unretrieved_error() -> None:
    loop = asyncio.get_running_loop()
    seen: list[dict] = []
    old = loop.get_exception_handler()
    loop.set_exception_handler(lambda _loop, ctx: seen.append(ctx))
    try:
        inbound = InboundAudio(SulkingTrack(), SystemClock(), stall_ms=100)
        gen = inbound.frames()
        first = await anext(gen)  # a filled frame: the track gave nothing
        assert first.filled
        await gen.aclose()
        for _ in range(5):
            await asyncio.sleep(0)
        import gc

        gc.collect()
        await asyncio.sleep(0)
    finally:
        loop.set_exception_handler(old)
    assert not seen, seen
