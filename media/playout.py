"""The playout buffer: server-side queue of 20 ms output frames (the output
jitter buffer), each tagged with the generation that made it.

It knows nothing of turns. The delivery gate (in :mod:`media.outbound`)
decides per frame whether it may go out; :meth:`PlayoutBuffer.clear` empties
the queue at once on a committed barge-in, and :meth:`PlayoutBuffer.pause`
holds it (the track sends silence from its next 20 ms tick) while a possible
barge-in is being confirmed, so :meth:`PlayoutBuffer.resume` can go on from
the very frame where it stopped, or, after :meth:`PlayoutBuffer.rewind_to_word`,
from the start of the word it stopped in (DESIGN.md: noise, echo or a
backchannel resume from the word the reply paused in; a word cut in two is
a word the caller lost). :meth:`PlayoutBuffer.played_samples` says how
much of a generation's audio actually left, which is what "only what was
heard" is measured in.
"""

from __future__ import annotations

import asyncio
import math
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

from media.frames import FRAME_MS, PLAYOUT_RATE, frame_bytes, rms_dbfs

#: the most a resume plays again to start at the word it paused in, ms
REWIND_MAX_MS = 500
#: a pause shorter than this (ms) resumes where it stopped: it cut off too
#: little for a word said again to sound better than a gap (an echo onset
#: the guard took back after 40-80 ms)
REWIND_MIN_PAUSE_MS = 120
#: a frame at or below this level (dBFS) is a pause between words
WORD_GAP_DBFS = -45.0
#: ... and so is one this far (dB) below the loudest frame after it in the word
WORD_DIP_DB = 15.0


def word_start(levels: Sequence[float]) -> int:
    """Where the word the last frame is in began: the index of its first
    frame in ``levels`` (dBFS per 20 ms frame, oldest first; ``len(levels)``
    if the last frame is itself a pause between words).

    Going back from the last frame, the word began after the newest frame
    that is a pause (at or below :data:`WORD_GAP_DBFS`) or a dip
    :data:`WORD_DIP_DB` below the loudest frame after it. Without either in
    ``levels`` (fluent speech runs words together), after its quietest
    frame; with no frame quieter than the last, at index 0.
    """
    n = len(levels)
    if n == 0 or levels[-1] <= WORD_GAP_DBFS:
        return n
    peak = -math.inf
    for i in range(n - 1, -1, -1):
        if levels[i] <= WORD_GAP_DBFS or levels[i] <= peak - WORD_DIP_DB:
            return i + 1
        peak = max(peak, levels[i])
    quietest = min(range(n), key=lambda i: levels[i])
    return quietest + 1 if quietest < n - 1 else 0


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
        #: the latest frames played, one generation's, in order (what a rewind can play again)
        self._recent: deque[PlayoutFrame] = deque(maxlen=REWIND_MAX_MS // FRAME_MS)
        #: frames queued again by rewind_to_word
        self.replayed_frames = 0

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

    def rewind_to_word(self, paused_ms: float) -> int:
        """While paused: queue again, ahead of the rest, the frames played
        since the start of the word the pause fell in (:func:`word_start`,
        at most :data:`REWIND_MAX_MS`), so that :meth:`resume` goes on from
        there. Nothing if not paused, if the pause (``paused_ms``, ms) was
        under :data:`REWIND_MIN_PAUSE_MS`, if it fell between words, or if
        what is queued does not follow on from what was played (a newer
        generation, a clear). Returns the audio queued again, ms."""
        if not (self.paused and self._recent) or paused_ms < REWIND_MIN_PAUSE_MS:
            return 0
        last = self._recent[-1]
        head = self._frames[0] if self._frames else None
        if head is not None and (head.generation != last.generation or head.sample != last.sample + len(last.pcm) // 2):
            return 0
        tail = list(self._recent)
        again = tail[word_start([rms_dbfs(f.pcm) if f.audible else -math.inf for f in tail]) :]
        if not again:
            return 0
        self._recent.clear()
        self.requeue(again)
        self.replayed_frames += len(again)
        return len(again) * FRAME_MS

    def note_played(self, frame: PlayoutFrame) -> None:
        """The delivery gate let ``frame`` out (called by the outbound track)."""
        if self._recent and (self._recent[-1].generation != frame.generation
                             or self._recent[-1].sample + len(self._recent[-1].pcm) // 2 != frame.sample):
            self._recent.clear()  # another reply, or not the next frame: a rewind starts from this one
        self._recent.append(frame)
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
        the head of the queue, in their order, ahead of what is queued.
        Those that :meth:`note_played` took as the latest played are no
        longer counted so (a far end's buffer recalled by a ``clear``), and
        a rewind goes on from the last frame heard."""
        recalled = {id(f) for f in frames}
        while self._recent and id(self._recent[-1]) in recalled:
            self._recent.pop()
        self._frames.extendleft(reversed(frames))
        if self._frames:
            self._empty.clear()

    def clear(self) -> int:
        """Drop everything queued, at once. Returns how many frames went."""
        n = len(self._frames)
        self._frames.clear()
        self._recent.clear()
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
