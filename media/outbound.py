"""The paced outbound track and the delivery gate.

:class:`PacedAudioTrack` is an aiortc audio track that hands the RTP sender a
20 ms frame every 20 ms of the injected clock. Each tick it takes the next
playout frame whose generation passes the gate; frames of any other
generation are dropped there (counted as fenced), however late they were
queued. With nothing to send it sends silence, so the wire never stalls and a
cleared buffer is silent on the very next tick; the joins between audio and
silence are ramped over a few ms (:mod:`media.declick`), so a cut never
clicks.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

from aiortc.mediastreams import MediaStreamError, MediaStreamTrack
from av.audio.frame import AudioFrame

from clock import Clock
from media.declick import Declicker
from media.frames import FRAME_MS, PLAYOUT_RATE, pcm_to_frame, samples_per_frame
from media.pacing import PacingMonitor
from media.playout import PlayoutBuffer, PlayoutFrame
from media.timeline import PACING_MAX_LAG_S

#: the delivery gate's rule (DESIGN.md): may output of this generation reach the
#: client? e.g. ``turn.generation.GenerationFence.passes``. A plain predicate, so
#: media needs nothing of the domain core.
Passes = Callable[[int], bool]


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
        out = pcm_to_frame(pcm, PLAYOUT_RATE, pts=self._pts)
        self._pts += self._samples
        return out

    def _next_deliverable(self) -> PlayoutFrame | None:
        """The delivery gate: the next frame of the active generation, dropping
        (and counting) any of another generation on the way."""
        while (frame := self.buffer.pop()) is not None:  # None while the buffer is paused
            if self.passes(frame.generation):
                self.buffer.note_played(frame)
                return frame
            self.audit.fenced_frames += 1
        return None
