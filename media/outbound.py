"""The paced outbound track and the delivery gate.

:class:`PacedAudioTrack` is an aiortc audio track that hands the RTP sender a
20 ms frame every 20 ms of the injected clock. Each tick it takes the next
playout frame whose generation passes the gate; frames of any other
generation are dropped there (counted as fenced), however late they were
queued. With nothing to send it sends silence, so the wire never stalls and a
cleared buffer is silent on the very next tick; the joins between audio and
silence are ramped over a few ms (:mod:`media.declick`), so a cut never
clicks. :class:`OpusPacedTrack` is the same track handing the sender Opus
packets it coded itself (the server's WebRTC downlink).
"""

from __future__ import annotations

import fractions
from collections.abc import Callable
from dataclasses import dataclass, field

from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av.audio.frame import AudioFrame
from av.packet import Packet

from clock import Clock
from media.declick import Declicker
from media.frames import FRAME_MS, PLAYOUT_RATE, pcm_to_frame, samples_per_frame
from media.opus import OpusEncoder
from media.pacing import PacingMonitor
from media.playout import PlayoutBuffer, PlayoutFrame
from media.timeline import PACING_MAX_LAG_S

#: the delivery gate's rule (DESIGN.md): may output of this generation reach the
#: client? e.g. ``turn.generation.GenerationFence.passes``. A plain predicate, so
#: media needs nothing of the domain core.
Passes = Callable[[int], bool]
#: RTP's Opus clock, always 48 kHz (RFC 7587 section 4.1)
OPUS_TIME_BASE = fractions.Fraction(1, 48_000)


@dataclass
class GenerationAudit:
    """What left the server for one generation.

    Attributes:
        frames: frames sent.
        samples: samples sent (48 kHz), i.e. how much of it was played.
        first_sent_at / last_sent_at: clock seconds of the first/last send.
    """

    frames: int = 0
    samples: int = 0
    first_sent_at: float | None = None
    last_sent_at: float | None = None


@dataclass
class DeliveryAudit:
    """Counters for the delivery gate, for tests, metrics and audits."""

    per_generation: dict[int, GenerationAudit] = field(default_factory=dict)
    fenced_frames: int = 0
    silence_frames: int = 0
    resyncs: int = 0


SentHook = Callable[[PlayoutFrame | None, float], None]


class PacedAudioTrack(MediaStreamTrack):
    """Outbound audio, 48 kHz mono s16, 20 ms per ``recv()``.

    Args:
        buffer: where frames wait.
        passes: the delivery gate's rule (True for the session's active
            generation only); frames of any other generation are dropped.
        clock: pacing time source.
        on_sent: optional hook called with (frame or None for silence, clock
            seconds) right before each frame is handed to the sender.

    Attributes:
        monitor: where each tick's lateness goes (the process's
            :class:`media.pacing.PacingMonitor`), or None.
    """

    kind = "audio"

    def __init__(self, buffer: PlayoutBuffer, passes: Passes, clock: Clock, on_sent: SentHook | None = None) -> None:
        super().__init__()
        self.buffer = buffer
        self.passes = passes
        self.clock = clock
        self.on_sent = on_sent
        self.monitor: PacingMonitor | None = None
        self.audit = DeliveryAudit()
        self._samples = samples_per_frame(PLAYOUT_RATE)
        self._declick = Declicker(PLAYOUT_RATE)
        self._start: float | None = None
        self._tick = 0
        self._pts = 0

    async def recv(self) -> AudioFrame:
        """Wait for the next 20 ms tick and return its frame.

        Raises:
            MediaStreamError: the track was stopped.
        """
        pcm = await self._next_pcm()
        out = pcm_to_frame(pcm, PLAYOUT_RATE, pts=self._pts)
        self._pts += self._samples
        return out

    async def _next_pcm(self) -> bytes:
        """Wait for the next 20 ms tick; its 48 kHz mono s16 PCM (960
        samples) through the delivery gate and the declicker.

        Raises:
            MediaStreamError: the track was stopped.
        """
        if self.readyState != "live":
            raise MediaStreamError
        now = self.clock.monotonic()
        due = now
        if self._start is None:
            self._start = now
        else:
            self._tick += 1
            due = self._start + self._tick * FRAME_MS / 1000
            if now - due > PACING_MAX_LAG_S:
                # The loop stalled: restart pacing rather than burst frames out.
                self._start, self._tick = now, 0
                self.audit.resyncs += 1
            else:
                await self.clock.sleep(due - now)
        if self.readyState != "live":
            raise MediaStreamError
        at = self.clock.monotonic()
        if self.monitor is not None:
            self.monitor.observe(at - due, at)
        frame = self._next_deliverable()
        if frame is None:
            self.audit.silence_frames += 1
            pcm = self._declick.silence(self._samples)
        else:
            pcm = self._declick.audio(frame.pcm)
            audit = self.audit.per_generation.setdefault(frame.generation, GenerationAudit())
            audit.frames += 1
            audit.samples += self._samples
            audit.last_sent_at = at
            if audit.first_sent_at is None:
                audit.first_sent_at = at
        if self.on_sent is not None:
            self.on_sent(frame, at)
        return pcm

    def _next_deliverable(self) -> PlayoutFrame | None:
        """The delivery gate: the next frame of the active generation, dropping
        (and counting) any of another generation on the way."""
        while (frame := self.buffer.pop()) is not None:  # None while the buffer is paused
            if self.passes(frame.generation):
                self.buffer.note_played(frame)
                return frame
            self.audit.fenced_frames += 1
        return None


#: the WebRTC downlink's Opus: mono, ``voip``, 64 kbit/s, complexity 10. At
#: that rate libopus codes speech in its CELT mode (about half the CPU of its
#: SILK and hybrid modes at 32 kbit/s: 0.10 against 0.20 ms a frame here),
#: a cut to silence is silent on the next frame (CELT's ``lowdelay`` mode
#: lets the level down 3 dB a frame: -56 to -66 dBFS for 80 ms), and a run
#: of silence settles on one 3-byte packet at once. Browsers decode any
#: mode a packet's TOC byte names (RFC 6716 section 3.1), mono or stereo,
#: whatever ``opus/48000/2`` the SDP said (RFC 7587 section 7).
OPUS_BITRATE = 64_000
OPUS_APPLICATION = "voip"
OPUS_COMPLEXITY = 10


class OpusPacedTrack(PacedAudioTrack):
    """:class:`PacedAudioTrack` that encodes its own frames: each ``recv()``
    returns one Opus packet of 20 ms (``av.Packet``, time base 1/48000),
    which aiortc's RTP sender sends as it is (its ``Encoder.pack``) instead
    of resampling the frame to 48 kHz stereo and coding it at 96 kbit/s in
    its thread pool. The packet is coded on the event loop, right after the
    delivery gate: about 0.1 ms a frame, less than
    handing the frame to a thread and back; a run of silence is coded once
    (:class:`media.opus.OpusEncoder`).

    Args and attributes: as :class:`PacedAudioTrack`; ``encoder`` is the
    track's :class:`media.opus.OpusEncoder` (48 kHz mono in and out).
    """

    def __init__(self, buffer: PlayoutBuffer, passes: Passes, clock: Clock, on_sent: SentHook | None = None) -> None:
        super().__init__(buffer, passes, clock, on_sent=on_sent)
        self.encoder = OpusEncoder(PLAYOUT_RATE, FRAME_MS, in_rate=PLAYOUT_RATE, bitrate=OPUS_BITRATE,
                                   application=OPUS_APPLICATION, complexity=OPUS_COMPLEXITY)

    async def recv(self) -> Packet:  # type: ignore[override]  # aiortc's sender takes a Frame or a Packet
        """Wait for the next 20 ms tick and return its Opus packet.

        Raises:
            MediaStreamError: the track was stopped.
        """
        pcm = await self._next_pcm()
        packets = self.encoder.encode(pcm)
        # one 20 ms frame in, one packet out: FFmpeg's libopus holds no frame back
        packet = Packet(packets[0] if packets else b"")
        packet.pts = self._pts
        packet.time_base = OPUS_TIME_BASE
        self._pts += self._samples
        return packet
