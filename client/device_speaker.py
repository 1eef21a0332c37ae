"""The simulated device's speaker: the decoded downlink played at real time.

It follows the xiaozhi-esp32 firmware (main/audio/audio_service.cc and
main/application.cc of 78/xiaozhi-esp32): each Opus packet the device
accepts (only while it is *speaking*) is decoded and queued behind what is
still playing; playback starts as soon as a packet is there (no prebuffer)
and runs at real time; when the queue runs dry the speaker is silent. The
queue is bounded (the firmware's decode queue holds 2,400 ms of packets and
refuses more: ``PushPacketToDecodeQueue`` without waiting), and entering the
speaking state resets it (``ResetDecoder``). An ``abort`` changes nothing
here: the device keeps playing what it still receives until ``tts stop``.

Times are the simulator clock's seconds; PCM is mono s16 at the downlink
rate the server's ``hello`` announced. Nothing here has a clock or a socket:
:class:`client.device.DeviceSimulator` pushes packets as they arrive and
renders what was heard afterwards.
"""

from __future__ import annotations

from dataclasses import dataclass

from client.phone import SILENCE_DBFS, HeardFrame
from media.frames import rms_dbfs

#: the firmware's decode queue, ms of audio (MAX_DECODE_PACKETS_IN_QUEUE = 2400 / frame ms)
QUEUE_CAPACITY_MS = 2400.0
FRAME_MS = 20


def sound_end_s(pcm: bytes, rate: int) -> float:
    """Where the sound of mono s16 ``pcm`` at ``rate`` Hz ends, seconds from
    its start: the end of its last 5 ms window louder than ``SILENCE_DBFS``
    (0 if none)."""
    window = max(1, rate // 200)
    n = len(pcm) // 2
    for start in range((n - 1) // window * window, -1, -window):
        if rms_dbfs(pcm[start * 2 : (start + window) * 2]) > SILENCE_DBFS:
            return min(n, start + window) / rate
    return 0.0


@dataclass
class Segment:
    """One accepted packet's audio on the speaker's timeline.

    Attributes:
        start / end: when it begins and ends playing (clock s); ``end`` is
            moved earlier when a reset cuts it short.
        pcm: its decoded samples.
        offset: samples pushed before it (its position in the downlink).
        sound_end: where its sound ends, s from ``start`` (0 if silent).
    """

    start: float
    end: float
    pcm: bytes
    offset: int
    sound_end: float

    @property
    def loud(self) -> bool:
        return self.sound_end > 0

    @property
    def sound_until(self) -> float:
        """When its audible sound ends (clock s), cut by a reset."""
        return min(self.start + self.sound_end, self.end)


class DeviceSpeaker:
    """The speaker of one simulated device.

    Args:
        rate: the downlink rate, Hz.
        capacity_ms: audio the queue holds before refusing packets, ms.
    """

    def __init__(self, rate: int, *, capacity_ms: float = QUEUE_CAPACITY_MS) -> None:
        self.rate = rate
        self.capacity_s = capacity_ms / 1000
        self.segments: list[Segment] = []
        self._end = 0.0  # when the queue runs dry (clock s)
        self._pushed = 0  # samples pushed
        #: packets refused because the queue was full
        self.overflows = 0
        #: ms of queued audio a reset threw away unplayed
        self.reset_ms = 0.0
        #: (clock s, ms) of each time the queue ran dry between two packets
        #: of one stretch of speaking (from a reset on): the silence heard
        #: before the late packet played
        self.underruns: list[tuple[float, float]] = []
        self._since_reset = False  # a packet was pushed since the last reset

    def queued_s(self, now: float) -> float:
        """Audio queued and not yet played at ``now``, s."""
        return max(0.0, self._end - now)

    def push(self, pcm: bytes, at: float) -> Segment | None:
        """Queue one packet's PCM arriving at ``at``; returns where it plays,
        or None when the queue is full (the packet is dropped, as the
        firmware drops it)."""
        start = max(at, self._end)
        if start - at > self.capacity_s:
            self.overflows += 1
            return None
        if self._since_reset and at > self._end + 1e-6:
            self.underruns.append((self._end, (at - self._end) * 1000))
        self._since_reset = True
        n = len(pcm) // 2
        seg = Segment(start, start + n / self.rate, pcm[: n * 2], self._pushed, sound_end_s(pcm, self.rate))
        self._pushed += n
        self._end = seg.end
        self.segments.append(seg)
        return seg

    def reset(self, at: float) -> None:
        """Throw away everything not yet played at ``at`` (the firmware's
        ``ResetDecoder`` on entering the speaking state)."""
        for seg in self.segments:
            if seg.end > at:
                cut = max(seg.start, at)
                self.reset_ms += (seg.end - cut) * 1000
                seg.end = cut
        self._end = min(self._end, at)
        self._since_reset = False

    def render(self, t0: float, t1: float) -> bytes:
        """What the speaker played from ``t0`` to ``t1``: mono s16 at
        ``rate``, silence where nothing played."""
        total = max(0, round((t1 - t0) * self.rate))
        out = bytearray(total * 2)
        for seg in self.segments:
            n = max(0, round((seg.end - seg.start) * self.rate))
            i = round((seg.start - t0) * self.rate)
            if n == 0 or i >= total or i + n <= 0:
                continue
            lo, hi = max(0, -i), min(n, total - i)
            out[(i + lo) * 2 : (i + hi) * 2] = seg.pcm[lo * 2 : hi * 2]
        return bytes(out)

    def frames(self, t0: float, t1: float) -> list[HeardFrame]:
        """What played, 20 ms at a time from ``t0`` to ``t1``: each frame's
        start (clock s), downlink sample offset of its first received
        sample and received samples in it (``start``/``real``, 0 when
        nothing played), level and where its sound ends (ms into the frame)."""
        pcm = self.render(t0, t1)
        step = self.rate * FRAME_MS // 1000
        out: list[HeardFrame] = []
        segs = [s for s in self.segments if s.end > s.start]
        j = 0
        for k in range(len(pcm) // 2 // step):
            a, b = t0 + k * FRAME_MS / 1000, t0 + (k + 1) * FRAME_MS / 1000
            while j < len(segs) and segs[j].end <= a:
                j += 1
            start = real = 0
            for seg in segs[j:]:
                if seg.start >= b:
                    break
                lo, hi = max(a, seg.start), min(b, seg.end)
                if hi > lo:
                    if not real:
                        start = seg.offset + round((lo - seg.start) * self.rate)
                    real += round((hi - lo) * self.rate)
            chunk = pcm[k * step * 2 : (k + 1) * step * 2]
            out.append(HeardFrame(a, start, real, rms_dbfs(chunk), sound_end_s(chunk, self.rate) * 1000))
        return out
