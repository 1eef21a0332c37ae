"""Paced playout with send-ahead: the playout buffer sent onto a WebSocket
whose far end buffers what it gets and plays it in order at real time (a
telephony media stream, a xiaozhi-esp32 device).

Such a far end keeps playing whatever it already holds, so the server must
not send much ahead of real time: every 20 ms tick of the injected clock the
pacer (:meth:`PacedPlayout.run`) takes frames through the delivery gate
until the far end holds ``send_ahead_ms`` of audio not yet due (it is
assumed to play at real time from receipt). A barge-in or an abort then
throws away at most that much, and a stage-1 pause (the buffer paused)
silences the far end within it.

Subclasses say how a frame goes on the wire (:meth:`PacedPlayout.emit`:
one mu-law message per frame for a phone, one Opus packet per three frames
for a device) and move :attr:`PacedPlayout.far_end_until` as the far end's
buffer grows; :meth:`PacedPlayout.idle` is called on a tick where nothing
more may go (a stretch ends). Shared by :mod:`media.telephony_playout` and
:mod:`media.device_playout`.
"""

from __future__ import annotations

from clock import Clock
from media.frames import FRAME_MS, PLAYOUT_RATE
from media.outbound import Passes
from media.pacing import PacingMonitor
from media.playout import PlayoutBuffer, PlayoutFrame
from media.timeline import PACING_MAX_LAG_S


class PacedPlayout(PlayoutBuffer):
    """A playout buffer with a real-time pacer and send-ahead (see the
    module doc). Not thread-safe.

    Args:
        clock: pacing time source.
        passes: the delivery gate's rule (``GenerationFence.passes``).
        send_ahead_ms: audio the far end may hold beyond what is due, ms
            (a positive multiple of 20).
        rate: the frames' rate, Hz (48 kHz).

    Attributes:
        far_end_until: clock seconds when the far end will have played all
            audio sent (subclasses move it as they send).
        fenced_frames: frames dropped by the gate.

    Raises:
        ValueError: ``send_ahead_ms`` is not a positive multiple of 20.
    """

    def __init__(self, clock: Clock, passes: Passes, *, send_ahead_ms: int = 60, rate: int = PLAYOUT_RATE) -> None:
        if send_ahead_ms < FRAME_MS or send_ahead_ms % FRAME_MS:
            raise ValueError(f"send_ahead_ms must be a positive multiple of {FRAME_MS}, got {send_ahead_ms}")
        super().__init__(rate)
        self.clock = clock
        self.passes = passes
        self.send_ahead_s = send_ahead_ms / 1000
        self.far_end_until = 0.0
        self.fenced_frames = 0
        #: where each tick's lateness goes (the process's PacingMonitor), or None
        self.monitor: PacingMonitor | None = None

    async def run(self) -> None:
        """Pace the queue out, one tick every 20 ms of the clock, until
        cancelled (:meth:`pump` each tick)."""
        start: float | None = None
        tick = 0
        while True:
            now = due = self.clock.monotonic()
            if start is None:
                start = now
            else:
                tick += 1
                due = start + tick * FRAME_MS / 1000
                if now - due > PACING_MAX_LAG_S:
                    start, tick = now, 0  # the loop stalled: restart rather than burst
                else:
                    await self.clock.sleep(due - now)
            at = self.clock.monotonic()
            if self.monitor is not None:
                self.monitor.observe(at - due, at)
            self.pump(at)

    def pump(self, now: float) -> int:
        """One tick at clock seconds ``now``: emit frames until the far end
        holds ``send_ahead_ms`` not yet due; :meth:`idle` if none went
        because nothing is left to send (or playout is paused). A tick that
        finds the send-ahead window still full is not idle: a tick a few ms
        late sends nothing, and ending a stretch there would cut a reply
        (a mark and a padded last packet mid-sentence; from review: 99
        false ends in a 2 s reply). Returns the frames emitted."""
        sent = 0
        dry = False
        while self.far_end_until - now < self.send_ahead_s - 1e-9:
            frame = self.next_deliverable()
            if frame is None:
                dry = True
                break
            self.emit(frame, now)
            sent += 1
        if dry and not sent:
            self.idle(now)
        return sent

    def next_deliverable(self) -> PlayoutFrame | None:
        """The delivery gate: the next frame of a generation that passes,
        dropping (and counting) others on the way; None while paused or empty."""
        while (frame := self.pop()) is not None:
            if self.passes(frame.generation):
                self.note_played(frame)  # sent: the far end plays it unless a clear recalls it (requeue)
                return frame
            self.fenced_frames += 1
        return None

    def rewind_to_word(self, paused_ms: float) -> int:
        """:meth:`media.playout.PlayoutBuffer.rewind_to_word` for a far end
        that buffers: the frames sent count as played (a ``clear`` that
        recalls some puts them back with :meth:`requeue`), and nothing is
        rewound while the far end still holds audio not yet due (it would
        play on into the word and then say it again). Returns the audio
        queued again, ms."""
        if self.far_end_until > self.clock.monotonic() + 1e-9:
            return 0
        return super().rewind_to_word(paused_ms)

    def emit(self, frame: PlayoutFrame, now: float) -> None:
        """Put one frame that passed the gate on the wire (subclasses)."""
        raise NotImplementedError

    def idle(self, now: float) -> None:
        """A tick on which nothing was left to emit (subclasses may end a stretch)."""
