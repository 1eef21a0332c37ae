"""The playout buffer: server-side queue of 20 ms output frames (the output
jitter buffer), each tagged with the generation that made it.

It knows nothing of turns. The delivery gate (in :mod:`media.outbound`)
decides per frame whether it may go out; :meth:`PlayoutBuffer.clear` empties
the queue at once on a committed barge-in, and :meth:`PlayoutBuffer.pause`
holds it (the track sends silence from its next 20 ms tick) while a possible
barge-in is being confirmed, so :meth:`PlayoutBuffer.resume` can go on from
the very frame where it stopped. :meth:`PlayoutBuffer.played_samples` says how
much of a generation's audio actually left, which is what "only what was
heard" is measured in.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass

from media.frames import PLAYOUT_RATE, frame_bytes


@dataclass(frozen=True)
class PlayoutFrame:
    """One 20 ms frame of agent audio.

    Attributes:
        pcm: 1920 bytes, 48 kHz mono s16.
        generation: the session generation that produced it.
        sample: position of its first sample within that generation's audio
            (samples at 48 kHz), so "how much was played" is exact.
        audible: it carries sound (not just a pause).
    """

    pcm: bytes
    generation: int
    sample: int = 0
    audible: bool = True


class PlayoutBuffer:
    """FIFO of :class:`PlayoutFrame`. Not thread-safe: one event loop.

    Args:
        rate: sample rate of the frames, Hz (48 kHz).
    """

    def __init__(self, rate: int = PLAYOUT_RATE) -> None:
        self.rate = rate
        self.frame_bytes = frame_bytes(rate)
        self._frames: deque[PlayoutFrame] = deque()
        self._empty = asyncio.Event()
        self._empty.set()
        self.cleared_frames = 0
        #: while True nothing is taken: the track sends silence (stage 1 of a barge-in)
        self.paused = False
        self._played: dict[int, int] = {}

    def push(self, frame: PlayoutFrame) -> None:
        """Queue a frame for playout.

        Raises:
            ValueError: the frame is not exactly 20 ms at ``rate``.
        """
        if len(frame.pcm) != self.frame_bytes:
            raise ValueError(f"playout frame must be {self.frame_bytes} bytes, got {len(frame.pcm)}")
        self._frames.append(frame)
        self._empty.clear()

    def pause(self, trial: bool = False) -> bool:
        """Hold playout where it is; queued frames stay. Returns True if it
        was playing (not already paused). ``trial`` changes nothing here
        (see :meth:`voice.transport.OutputSink.pause`)."""
        was, self.paused = self.paused, True
        return not was

    def resume(self) -> bool:
        """Go on from the frame where :meth:`pause` stopped. Returns True if
        it was paused."""
        was, self.paused = self.paused, False
        return was

    def note_played(self, frame: PlayoutFrame) -> None:
        """The delivery gate let ``frame`` out (called by the outbound track)."""
        end = frame.sample + len(frame.pcm) // 2
        if end > self._played.get(frame.generation, 0):
            self._played[frame.generation] = end
            if len(self._played) > 64:  # keep the recent generations only
                del self._played[min(self._played)]

    def played_samples(self, generation: int) -> int:
        """How far into ``generation``'s audio playout got, in samples at
        ``rate`` (the end of the last frame sent; 0 if none was)."""
        return self._played.get(generation, 0)

    def pop(self) -> PlayoutFrame | None:
        """Take the oldest frame, or None when empty or paused."""
        if self.paused or not self._frames:
            return None
        frame = self._frames.popleft()
        if not self._frames:
            self._empty.set()
        return frame

    def requeue(self, frames: list[PlayoutFrame]) -> None:
        """Put ``frames`` (sent, but recalled before they played) back at
        the head of the queue, in their order, ahead of what is queued."""
        self._frames.extendleft(reversed(frames))
        if self._frames:
            self._empty.clear()

    def clear(self) -> int:
        """Drop everything queued, at once. Returns how many frames went."""
        n = len(self._frames)
        self._frames.clear()
        self.cleared_frames += n
        self._empty.set()
        return n

    async def wait_empty(self) -> None:
        """Return once every queued frame has been taken (or cleared)."""
        while self._frames:
            self._empty.clear()
            await self._empty.wait()

    def audible_pending(self, generation: int) -> bool:
        """True if a frame of ``generation`` with sound is still queued (so a
        reply has not yet been heard in full)."""
        return any(f.audible and f.generation == generation for f in self._frames)

    def __len__(self) -> int:
        return len(self._frames)

    @property
    def queued_ms(self) -> int:
        """Audio waiting, in ms."""
        return len(self._frames) * 20
