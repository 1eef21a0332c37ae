"""Inbound audio: decoded track frames -> 16 kHz mono 20 ms frames ->
two-stage barge-in detector.

aiortc decodes Opus/PCMU to ``av.AudioFrame`` (Opus: 48 kHz stereo s16, 960
samples). :class:`InboundAudio` resamples each to 16 kHz mono with PyAV,
reframes to exact 20 ms and runs the stream's own
:class:`media.bargein.BargeInDetector` (webrtcvad gate, Silero confirmation,
echo guard, :func:`media.inbound_frame.analyse_frame`), yielding
:class:`media.inbound_frame.InboundFrame` items stamped with the injected
clock.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any, Protocol

from aiortc.jitterbuffer import JitterBuffer, JitterFrame
from aiortc.mediastreams import MediaStreamError

from clock import Clock
from media.bargein import BargeInDetector
from media.bargein_config import BargeInConfig
from media.echo_guard import EchoReference
from media.frames import FRAME_MS, VAD_RATE, PcmResampler, Reframer, frame_bytes
from media.inbound_frame import InboundFrame, analyse_frame
from media.vad import VadConfig

#: shortest stall (ms) filled with silence: well above the jitter of 20 ms packets
MIN_STALL_MS = 100


class AudioSource(Protocol):
    """What :class:`InboundAudio` reads: an aiortc ``MediaStreamTrack`` of
    kind audio, or anything with the same ``recv``."""

    async def recv(self) -> Any: ...


class InboundAudio:
    """Reads a track until it ends and yields analysed 20 ms frames.

    Args:
        track: the remote audio track.
        clock: time source for frame stamps.
        vad: VAD settings (one webrtcvad instance per InboundAudio).
        bargein: the detector's two-stage settings.
        echo: what the server is playing to this client (the echo guard's
            reference); None: no echo guard.
        stall_ms: when the track gives no frame for this long (ms), that
            stretch is filled with silent frames (``InboundFrame.filled``),
            as a receiver conceals lost packets, so the detector's and the
            session's timers run on: a client that goes quiet (muted, its
            packets lost) while a reply is paused for a noise sees it
            resume. 0: wait for the track however long it takes; otherwise
            at least ``MIN_STALL_MS`` and a multiple of 20 ms (ordinary
            jitter must not be taken for a stall).

    Raises:
        ValueError: a ``stall_ms`` other than 0 below ``MIN_STALL_MS``, or not
            a multiple of 20 ms.
    """

    def __init__(
        self,
        track: AudioSource,
        clock: Clock,
        vad: VadConfig | None = None,
        bargein: BargeInConfig | None = None,
        echo: EchoReference | None = None,
        stall_ms: int = 240,
    ) -> None:
        if stall_ms != 0 and (stall_ms < MIN_STALL_MS or stall_ms % FRAME_MS):
            raise ValueError(f"stall_ms must be 0 or a multiple of {FRAME_MS} of at least {MIN_STALL_MS}, got {stall_ms}")
        self.track = track
        self.clock = clock
        self.stall_ms = stall_ms
        self.detector = BargeInDetector(vad, bargein, echo)
        self._resampler = PcmResampler(VAD_RATE)
        self._reframer = Reframer(VAD_RATE)
        self._aligned = False
        #: clock seconds when the last frame came off the track (None: none
        #: yet); filled silence does not count
        self.last_frame_at: float | None = None
        #: silent frames put in for stalls so far
        self.filled_frames = 0

    def _align(self, frame: Any, first_output: bytes) -> None:
        """Pad the reframer by the resampler's filter delay, once.

        libswresample holds back a few samples (16 at 48 -> 16 kHz), so the
        first 20 ms in gives a little less than 20 ms out. Left alone, every
        later frame would be completed only by the next packet: 20 ms of extra
        latency before the VAD sees the audio. Padding the stream's start by
        the shortfall makes each packet complete exactly one frame.
        """
        self._aligned = True
        expected = frame.samples * VAD_RATE // frame.sample_rate
        shortfall = expected - len(first_output) // 2
        if 0 < shortfall < expected:
            self._reframer.push(bytes(shortfall * 2))

    async def frames(self) -> AsyncIterator[InboundFrame]:
        """Yield frames until the track ends (``MediaStreamError``); a stall
        of ``stall_ms`` without a frame yields that much silence (the track's
        pending ``recv`` is kept, so no frame is lost to it)."""
        pending: asyncio.Future[Any] | None = None
        silence = bytes(frame_bytes(VAD_RATE))
        try:
            while True:
                if pending is None:
                    pending = asyncio.ensure_future(self.track.recv())
                if self.stall_ms > 0 and not pending.done():
                    sleeper = asyncio.ensure_future(self.clock.sleep(self.stall_ms / 1000))
                    try:
                        await asyncio.wait((pending, sleeper), return_when=asyncio.FIRST_COMPLETED)
                    finally:
                        sleeper.cancel()
                    if not pending.done():
                        now = self.clock.monotonic()
                        n = self.stall_ms // FRAME_MS
                        self.filled_frames += n
                        for i in range(n):
                            yield self._analyse(silence, now - (n - 1 - i) * FRAME_MS / 1000, filled=True)
                        continue
                done, pending = pending, None
                try:
                    frame = await done
                except MediaStreamError:
                    return
                at = self.last_frame_at = self.clock.monotonic()
                pcm16 = self._resampler.frame(frame)
                if not self._aligned:
                    self._align(frame, pcm16)
                for pcm in self._reframer.push(pcm16):
                    yield self._analyse(pcm, at)
        finally:
            if pending is not None:
                # the track's recv holds nothing of ours; whatever it ends
                # with (a frame, an error raised while cancelled) is dropped
                pending.add_done_callback(_drop_outcome)
                pending.cancel()

    def close(self) -> None:
        """The stream is over: free what the detector borrowed (its Silero
        model goes back to the pool). Idempotent."""
        self.detector.close()

    def _analyse(self, pcm: bytes, at: float, filled: bool = False) -> InboundFrame:
        return analyse_frame(self.detector, pcm, at, filled=filled)


def _drop_outcome(fut: asyncio.Future[Any]) -> None:
    if not fut.cancelled():
        fut.exception()


class AudioJitterBuffer(JitterBuffer):
    """aiortc's jitter buffer with no prefetch, for audio.

    aiortc's buffer knows a frame is complete only when a packet of the next
    frame arrives (it is written for video, where a frame spans packets), so
    even with prefetch 0 or 1 every audio frame waits 20 ms for the next
    packet. An Opus or G.711 packet is a whole frame (RFC 7587 section 4.2,
    RFC 3551): this buffer releases each packet the moment it is the next in
    sequence. A packet still missing when ``skip_after`` later ones have
    arrived is taken as lost; the buffer then jumps to the newest packet
    (the ones in between are dropped, a few ms of audio) so a loss never
    leaves latency behind.
    """

    def __init__(self, capacity: int, skip_after: int = 2) -> None:
        super().__init__(capacity=capacity, prefetch=0, is_video=False)
        self.skip_after = skip_after
        #: packets given up as lost or dropped to catch up
        self.skipped = 0

    def _remove_frame(self, sequence_number: int) -> JitterFrame | None:
        assert self._origin is not None
        pos = self._origin % self._capacity
        packet = self._packets[pos]
        if packet is None:
            waiting = [p for p in self._packets if p is not None]
            if len(waiting) < self.skip_after:
                return None
            # the origin packet is lost: go on from the newest one
            while self._origin != sequence_number:
                self.skipped += 1
                self.remove(1)
            packet = self._packets[self._origin % self._capacity]
            if packet is None:
                return None
        self.remove(1)
        return JitterFrame(data=packet._data, timestamp=packet.timestamp)  # type: ignore[attr-defined]


def set_jitter_prefetch(receiver: Any, packets: int) -> None:
    """Set how many 20 ms packets aiortc's inbound jitter buffer holds back
    before releasing audio (aiortc's default is 4, i.e. 80 ms of latency).

    Trade-off: each packet of prefetch adds 20 ms between the user's speech and
    our VAD (so to the barge-in), but rides out that much network jitter
    without gaps. 0 (an :class:`AudioJitterBuffer`: each packet is released
    on arrival) is right on a LAN or loopback; on lossy, jittery links
    (mobile, long-haul) use 2 to 5. aiortc's own buffer always waits for the
    next packet to know a frame is complete, so with it 1 means 20 ms more
    than 0, and 2 means 40 ms.

    aiortc (1.x) offers no public setting for this; the receiver's buffer is
    replaced before any packet arrives, so call this right after
    ``setRemoteDescription``. The capacity (16 packets) is aiortc's.

    Raises:
        ValueError: ``packets`` outside 0..8.
        RuntimeError: this aiortc keeps its jitter buffer elsewhere (an
            upgrade changed it; a test catches this).
    """
    if not 0 <= packets <= 8:
        raise ValueError("jitter prefetch must be 0..8 packets")
    attr = "_RTCRtpReceiver__jitter_buffer"
    current = getattr(receiver, attr, None)
    if not isinstance(current, JitterBuffer):
        raise RuntimeError("aiortc's RTCRtpReceiver no longer has the expected jitter buffer")
    if packets == 0:
        setattr(receiver, attr, AudioJitterBuffer(capacity=current.capacity))
    else:
        setattr(receiver, attr, JitterBuffer(capacity=current.capacity, prefetch=packets))


def jitter_prefetch(receiver: Any) -> int:
    """The receiver's current jitter-buffer prefetch, in packets."""
    return receiver._RTCRtpReceiver__jitter_buffer._prefetch
