"""The playout buffer: server-side queue of 20 ms output frames (the output
jitter buffer), each tagged with the generation that made it.

It knows nothing of turns. The delivery gate (in :mod:`media.outbound`)
decides per frame whether it may go out; :meth:`PlayoutBuffer.clear` empties
the queue at once on barge-in.
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

    def push(self, frame: PlayoutFrame) -> None:
        """Queue a frame for playout.

        Raises:
            ValueError: the frame is not exactly 20 ms at ``rate``.
        """
        if len(frame.pcm) != self.frame_bytes:
            raise ValueError(f"playout frame must be {self.frame_bytes} bytes, got {len(frame.pcm)}")
        self._frames.append(frame)
        self._empty.clear()

    def pop(self) -> PlayoutFrame | None:
        """Take the oldest frame, or None when empty."""
        if not self._frames:
            return None
        frame = self._frames.popleft()
        if not self._frames:
            self._empty.set()
        return frame

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
