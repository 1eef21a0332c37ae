"""The per-session generation counter and its fence.

Every token, TTS chunk, audio frame and event carries the generation that made
it. Advancing the generation fences everything older at once: the delivery
gate passes only the active generation, however late older output arrives.

The fence lives in the process that holds the session's media, so the check on
the per-frame hot path is an integer comparison; the store records each turn's
generation for audit.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from clock import Clock


@dataclass(frozen=True)
class FenceRecord:
    """One advance: the new generation and when it was set (clock seconds)."""

    generation: int
    at: float


@dataclass
class GenerationFence:
    """A session's generation counter.

    ``active`` starts at 0 (nothing has been said yet); each :meth:`advance`
    adds 1 and records the moment, so tests and audits can prove nothing of an
    older generation passed the gate after that moment.
    """

    clock: Clock
    active: int = 0
    history: list[FenceRecord] = field(default_factory=list)

    def advance(self) -> int:
        """Fence every older generation now; returns the new active generation."""
        self.active += 1
        self.history.append(FenceRecord(self.active, self.clock.monotonic()))
        return self.active

    def passes(self, generation: int) -> bool:
        """True iff output tagged ``generation`` may reach the client."""
        return generation == self.active

    def fenced_at(self, generation: int) -> float | None:
        """Clock seconds at which ``generation`` stopped being active, or None
        if it still is (or never was)."""
        for rec in self.history:
            if rec.generation == generation + 1:
                return rec.at
        return None
