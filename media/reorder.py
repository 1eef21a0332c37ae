"""A reorder buffer (a small jitter buffer by sequence number) for media
that may arrive out of order: Telnyx's media streaming WebSocket says
"Media frame order is not guaranteed. Use media.chunk, media.timestamp, and
sequence_number to order frames" (Telnyx, "Stream call media over
WebSocket").

Items go in with their sequence number and come out in order. A gap is
waited for while at most ``depth`` later items are held (``depth`` x 20 ms
of latency at worst); then it is given up on (counted ``lost``) and playing
goes on from the earliest held. An item older than what already came out is
``late`` and dropped, a repeat is a ``duplicate`` and dropped.
"""

from __future__ import annotations

from typing import Generic, TypeVar

T = TypeVar("T")


class ReorderBuffer(Generic[T]):
    """Puts items back in sequence order (see the module doc).

    Args:
        depth: later items held while waiting for a gap, at most (>= 1).
        first: the sequence number expected first (Telnyx's ``media.chunk``
            starts at 1).

    Raises:
        ValueError: ``depth`` < 1.
    """

    def __init__(self, depth: int = 4, first: int = 1) -> None:
        if depth < 1:
            raise ValueError("depth must be at least 1")
        self.depth = depth
        self.next = first
        self._held: dict[int, T] = {}
        self.late = 0
        self.duplicates = 0
        self.lost = 0
        self.reordered = 0
        #: times the numbering restarted or jumped and was followed
        self.resyncs = 0
        self._late_run = 0

    def push(self, seq: int, item: T) -> list[T]:
        """Add ``item`` numbered ``seq``; returns the items that are now in
        order (possibly none, possibly several)."""
        out: list[T] = []
        if seq < self.next:
            self.late += 1
            self._late_run += 1
            if self._late_run <= self.depth:
                return []
            # more late items in a row than a reorder can explain: the
            # numbering restarted (or an earlier jump was bogus); follow it
            out = self.flush()
            self.next = seq
            self.resyncs += 1
        self._late_run = 0
        if seq in self._held:
            self.duplicates += 1
            return []
        if seq != self.next:
            self.reordered += 1
        self._held[seq] = item
        out += self._release()
        if len(self._held) > self.depth:
            skip_to = min(self._held)
            self.lost += skip_to - self.next
            self.next = skip_to
            out += self._release()
        return out

    def flush(self) -> list[T]:
        """Everything held, in order, gaps skipped (the stream ended)."""
        out = [self._held[s] for s in sorted(self._held)]
        if self._held:
            self.next = max(self._held) + 1
        self._held.clear()
        return out

    def _release(self) -> list[T]:
        out: list[T] = []
        while self.next in self._held:
            out.append(self._held.pop(self.next))
            self.next += 1
        return out

    def __len__(self) -> int:
        """Items held."""
        return len(self._held)
