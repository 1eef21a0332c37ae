"""The output sink of a telephone call: the playout buffer, paced onto a
media stream's WebSocket as 20 ms mu-law messages with a small send-ahead,
with marks to learn what the caller heard and ``clear`` on a barge-in.

A telephony provider (Twilio Media Streams, Telnyx) buffers what the server
sends and plays it in order, so anything already sent keeps playing unless
the server sends ``clear`` (Twilio, "Media Streams - WebSocket Messages",
*Clear message*). Hence:

- **pacing with send-ahead** and the **delivery gate**:
  :class:`media.paced_playout.PacedPlayout` (shared with device sockets),
  so a ``clear`` throws away at most ``send_ahead_ms``;
- **recall on a stage-1 pause**: a pause on verified speech
  (:meth:`TelephonyPlayout.pause`, not on trial) sends ``clear`` at once,
  so the caller hears silence within a message instead of after the
  send-ahead, and puts the frames the provider had not yet played back at
  the head of the queue: a pause that is taken back (a backchannel, a
  false interruption) plays on from the first frame the caller did not
  hear (at most one 20 ms frame heard twice). A pause on trial (resumed
  within ``pause_verify_ms`` unless verified) only stops sending, so the
  provider's buffer covers it and a noise makes no hole;
- **clear**: :meth:`TelephonyPlayout.clear` (called by the session right
  after the fence moves, in the same step) empties the queue *and* sends
  ``clear`` at once, even when the queue was already empty (the provider may
  still be playing: openai/openai-agents-js #1173);
- **marks**: a mark after every ``mark_every_ms`` of audio and at the end
  of each stretch (the queue ran dry, paused, or the generation changed);
  :meth:`TelephonyPlayout.played_samples` is the marks' account
  (:class:`media.marks.MarkTracker`), not what left the server.

Protocol framing is the caller's (:class:`Wire`); this module sends bytes.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable
from typing import Protocol

from clock import Clock
from media.frames import FRAME_MS, PLAYOUT_RATE, samples_per_frame
from media.g711 import MULAW_FRAME_BYTES, MulawEncoder
from media.marks import MarkTracker
from media.outbound import Passes
from media.paced_playout import PacedPlayout
from media.playout import PlayoutFrame

log = logging.getLogger(__name__)

#: how long past the end of its audio a mark may take to be echoed before
#: :meth:`TelephonyPlayout.wait_empty` stops waiting for it, s
MARK_TIMEOUT_S = 2.0
#: (generation, sample, started): a stretch of audio started / stopped leaving
SegmentHook = Callable[[int, int, bool], None]
#: mu-law code of silence (zero): pads the last message of a stretch to 160 bytes
MULAW_SILENCE = b"\xff"


class Wire(Protocol):
    """Where the pacer's messages go, in the order given (the transport
    frames them in its provider's dialect). None of these may block."""

    def send_media(self, payload: bytes, generation: int) -> None:
        """One 20 ms message: 160 bytes of mu-law 8 kHz of ``generation``."""
        ...

    def send_mark(self, name: str, generation: int) -> None:
        """A mark after the audio sent so far."""
        ...

    def send_clear(self) -> None:
        """``clear``: the provider drops the audio it holds."""
        ...


class TelephonyPlayout(PacedPlayout):
    """One call's output sink (see the module doc). Not thread-safe.

    Args:
        clock: pacing and mark time source.
        passes: the delivery gate's rule (``GenerationFence.passes``).
        wire: where messages go.
        send_ahead_ms: audio the provider may hold beyond what is due, ms
            (a multiple of 20, at least 20).
        mark_every_ms: a mark after this much audio at most, ms.
        on_segment: told when a stretch of a generation's audio starts
            leaving (generation, its first frame's sample, True) and stops
            (generation, samples of it sent in all, False).

    Attributes:
        marks: the mark books (what the caller heard).
        fenced_frames: frames dropped by the gate.
        clears_at: clock seconds of every ``clear`` sent.
        sent_frames: 20 ms frames sent, per generation.

    Raises:
        ValueError: ``send_ahead_ms`` is not a positive multiple of 20.
    """

    def __init__(
        self, clock: Clock, passes: Passes, wire: Wire, *, send_ahead_ms: int = 60, mark_every_ms: int = 200,
        rate: int = PLAYOUT_RATE, on_segment: SegmentHook | None = None,
    ) -> None:
        super().__init__(clock, passes, send_ahead_ms=send_ahead_ms, rate=rate)
        self.wire = wire
        self.mark_every_ms = mark_every_ms
        self.on_segment = on_segment
        self.marks = MarkTracker(rate)
        self.clears_at: list[float] = []
        self.sent_frames: dict[int, int] = {}
        self._encoder = MulawEncoder(rate)
        self._samples = samples_per_frame(rate)
        self._mulaw = b""
        self._stretch: int | None = None  # generation of the stretch being sent
        self._since_mark_ms = 0
        self._audible_end: dict[int, int] = {}
        self._sent_since_clear = False
        #: frames sent and when the provider starts playing each (clock s), oldest first
        self._in_flight: deque[tuple[PlayoutFrame, float]] = deque()
        #: frames recalled from the provider by a pause, in all
        self.recalled_frames = 0

    # -- the pacer (media.paced_playout.PacedPlayout) --------------------------------

    def emit(self, frame: PlayoutFrame, now: float) -> None:
        """Send one frame as mu-law (and a mark every ``mark_every_ms``)."""
        self._send(frame, now)

    def idle(self, now: float) -> None:
        """Nothing more may go now: end the stretch (last bytes and a mark)."""
        if self._stretch is not None:
            self._end_stretch(now)

    def _send(self, frame: PlayoutFrame, now: float) -> None:
        gen = frame.generation
        if self._stretch is not None and self._stretch != gen:
            self._end_stretch(now)
        if self._stretch is None and self.on_segment is not None:
            self.on_segment(gen, frame.sample, True)
        self._stretch = gen
        self._sent_since_clear = True
        self._mulaw += self._encoder.encode(frame.pcm)
        while len(self._mulaw) >= MULAW_FRAME_BYTES:
            self.wire.send_media(self._mulaw[:MULAW_FRAME_BYTES], gen)
            self._mulaw = self._mulaw[MULAW_FRAME_BYTES:]
        starts_at = max(self.far_end_until, now)
        self.far_end_until = starts_at + FRAME_MS / 1000
        self._played_by(now)
        self._in_flight.append((frame, starts_at))
        end = frame.sample + len(frame.pcm) // 2
        self.marks.audio_sent(gen, frame.sample, end, now)
        self.sent_frames[gen] = self.sent_frames.get(gen, 0) + 1
        if frame.audible:
            self._audible_end[gen] = end
            if len(self._audible_end) > 64:
                del self._audible_end[min(self._audible_end)]
        self._since_mark_ms += FRAME_MS
        if self._since_mark_ms >= self.mark_every_ms:
            self._mark(gen, now)

    def _end_stretch(self, now: float) -> None:
        gen = self._stretch
        assert gen is not None
        if self._mulaw:
            self.wire.send_media(self._mulaw.ljust(MULAW_FRAME_BYTES, MULAW_SILENCE), gen)
            self._mulaw = b""
        if self._since_mark_ms:
            self._mark(gen, now)
        self._stretch = None
        self._segment_ended(gen)

    def _segment_ended(self, gen: int) -> None:
        if self.on_segment is not None:
            self.on_segment(gen, self.sent_frames.get(gen, 0) * self._samples, False)

    def _mark(self, generation: int, now: float) -> None:
        self.wire.send_mark(self.marks.mark_sent(generation, now), generation)
        self._since_mark_ms = 0

    # -- the provider's side -----------------------------------------------------------

    def on_mark(self, name: str) -> bool:
        """The provider echoed mark ``name`` (now). True if it counts as
        played (see :meth:`media.marks.MarkTracker.echoed`)."""
        return self.marks.echoed(name, self.clock.monotonic())

    def _played_by(self, now: float) -> None:
        """Forget in-flight frames the provider has played by ``now``."""
        while self._in_flight and self._in_flight[0][1] + FRAME_MS / 1000 <= now + 1e-9:
            self._in_flight.popleft()

    # -- the seam (voice.transport.OutputSink) --------------------------------------

    def pause(self, trial: bool = False) -> bool:
        """Stop sending (a stage-1 pause). Unless ``trial``, also recall
        what the provider holds: ``clear`` now, and the frames it had not
        started playing (and the one playing) go back to the head of the
        queue, to play on :meth:`resume`; their pending marks no longer
        count, and the heard position holds where the caller stopped
        hearing. Returns True if it was playing."""
        started = super().pause()
        if not trial:
            recalled = self._recall(self.clock.monotonic())
            log.debug("pause: clear, %d frames recalled from the provider", recalled)
        return started

    def _recall(self, now: float) -> int:
        self._played_by(now)
        if not self._in_flight:
            return 0
        frames = [f for f, _ in self._in_flight]
        self._in_flight.clear()
        rewind: dict[int, int] = {}
        for f in frames:
            self.sent_frames[f.generation] -= 1
            rewind[f.generation] = min(rewind.get(f.generation, f.sample), f.sample)
        self.marks.recalled(now, rewind)
        self._send_clear(now)
        self.recalled_frames += len(frames)
        self.requeue(frames)
        return len(frames)

    def rewind_to_word(self, paused_ms: float) -> int:
        """Go back to the start of the word the pause fell in (see
        :meth:`media.paced_playout.PacedPlayout.rewind_to_word`). The frames
        queued again are no longer counted as sent, and the heard position
        holds at the word's start until they go out again (the marks'
        ``recalled``). Returns the audio queued again, ms."""
        ms = super().rewind_to_word(paused_ms)
        if ms:
            first = self._frames[0]
            self.sent_frames[first.generation] -= ms // FRAME_MS
            self.marks.recalled(self.clock.monotonic(), {first.generation: first.sample})
        return ms

    def _send_clear(self, now: float) -> None:
        """``clear`` now: the stretch being sent ends where it is (its
        unsent bytes dropped), and the provider holds nothing of ours."""
        self._mulaw = b""
        self._encoder.reset()
        if self._stretch is not None:
            self._segment_ended(self._stretch)
        self._stretch = None
        self._since_mark_ms = 0
        self._in_flight.clear()
        self.far_end_until = now
        self.clears_at.append(now)
        self.wire.send_clear()

    def clear(self) -> int:
        """Drop everything queued and send ``clear`` at once, whether or
        not anything was queued here (the far end may still be playing);
        what the caller heard of each generation is frozen now. Only when
        nothing was sent since the last ``clear`` is there nothing to clear
        (none is sent). Returns the frames dropped here."""
        n = super().clear()
        now = self.clock.monotonic()
        if not self._sent_since_clear and self._stretch is None:
            return n  # nothing of ours is at the far end: there is nothing to clear
        self._sent_since_clear = False
        self.marks.cleared(now)  # what was heard freezes before the stretch's end is told
        self._send_clear(now)
        return n

    def played_samples(self, generation: int) -> int:
        """How far the caller heard into ``generation``'s audio, samples at
        ``rate``: the marks' account (:meth:`media.marks.MarkTracker.played_samples`)."""
        return self.marks.played_samples(generation, self.clock.monotonic())

    def audible_pending(self, generation: int) -> bool:
        """Sound of ``generation`` is queued here, or sent and not heard yet."""
        if super().audible_pending(generation):
            return True
        return self.played_samples(generation) < self._audible_end.get(generation, 0)

    async def wait_empty(self) -> None:
        """Return once every queued frame was sent and every mark echoed
        (or cleared); a mark not echoed ``MARK_TIMEOUT_S`` after its audio's
        end is given up on (logged: the provider may not echo marks)."""
        await super().wait_empty()
        deadline: float | None = None
        while len(self) or self._stretch is not None or self.marks.pending():
            now = self.clock.monotonic()
            if not len(self) and self._stretch is None:
                if deadline is None:
                    deadline = max(self.far_end_until, now) + MARK_TIMEOUT_S
                if now >= deadline:
                    log.warning("%d marks not echoed %.1f s after their audio", self.marks.pending(), MARK_TIMEOUT_S)
                    return
            await self.clock.sleep(FRAME_MS / 1000)
