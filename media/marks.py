"""Marks: what a telephone caller has actually heard of the audio sent to
the provider.

A telephony media stream (Twilio Media Streams, Telnyx) plays what the
server sends in order, from its own buffer. A ``mark`` sent after some audio
is echoed back by the provider once that audio has played (Twilio, "Media
Streams - WebSocket Messages", *Mark message*: "sent ... when the audio
before the mark has finished playing"); it is the only evidence of what the
caller heard. After a ``clear`` the provider drops its buffer and echoes
every mark still pending (Twilio, *Clear message*): those echoes say the
audio was *thrown away*, not played, so they must not count.

:class:`MarkTracker` keeps the books, per generation, in samples of the
playout rate (48 kHz) and clock seconds, with no I/O, so the arithmetic is
tested on virtual time. The heard position of a generation is::

    last echoed mark's sample + (now - its echo time) * rate

capped at the next mark not yet echoed (and at the end of what was sent),
so a provider that is slow to echo never makes the server claim more than
the next mark. Before any echo the first sent sample and its send time
stand in for the last mark. A ``clear`` freezes each generation's position
at its value then.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass

#: marks awaiting their echo, at most (a provider that never echoes them)
MAX_PENDING = 1000
#: generations whose books are kept (the recent ones; older are forgotten)
KEEP_GENERATIONS = 64


@dataclass
class _Mark:
    name: str
    generation: int
    sample: int  # end of the audio before it, samples at ``rate`` into its generation
    sent_at: float


@dataclass
class _Generation:
    first_sample: int
    first_sent_at: float
    sent_end: int  # end of the audio sent, samples
    acked_sample: int | None = None
    acked_at: float = 0.0
    frozen: int | None = None  # set by a clear
    held: bool = False  # recalled by a pause: nothing plays until audio is sent again


class MarkTracker:
    """The marks of one call (see the module doc). Not thread-safe.

    Args:
        rate: samples per second of the positions (the playout rate, 48 kHz).
    """

    def __init__(self, rate: int) -> None:
        self.rate = rate
        self._pending: OrderedDict[str, _Mark] = OrderedDict()
        self._discarded: set[str] = set()
        self._gens: OrderedDict[int, _Generation] = OrderedDict()
        self._serial = 0
        #: echoes of marks never sent (logged by the caller), counted
        self.unknown_echoes = 0
        #: echoes of marks a ``clear`` discarded (not counted as played)
        self.discarded_echoes = 0

    # -- what was sent ------------------------------------------------------------

    def audio_sent(self, generation: int, start: int, end: int, at: float) -> None:
        """Audio of ``generation`` from sample ``start`` to ``end`` was sent
        at clock seconds ``at``."""
        g = self._gens.get(generation)
        if g is None:
            g = self._gens[generation] = _Generation(start, at, end)
            while len(self._gens) > KEEP_GENERATIONS:
                self._gens.popitem(last=False)
        if g.held:  # the recalled audio goes out again: it plays from now
            g.held, g.acked_at = False, at
        g.sent_end = max(g.sent_end, end)

    def mark_sent(self, generation: int, at: float) -> str:
        """A mark goes out now (clock seconds ``at``), after all audio of
        ``generation`` sent so far. Returns its name (unique in the call)."""
        g = self._gens.get(generation)
        sample = g.sent_end if g is not None else 0
        self._serial += 1
        name = f"g{generation}.{self._serial}"
        self._pending[name] = _Mark(name, generation, sample, at)
        if len(self._pending) > MAX_PENDING:  # a provider that never echoes: forget the oldest
            self._pending.popitem(last=False)
        return name

    # -- what the provider said ------------------------------------------------------

    def echoed(self, name: str, at: float) -> bool:
        """The provider echoed mark ``name`` at clock seconds ``at``. Returns
        True if it counts (its audio played); False for a mark a ``clear``
        discarded, or one never sent (``unknown_echoes``)."""
        mark = self._pending.get(name)
        if mark is None:
            if name in self._discarded:
                self._discarded.discard(name)
                self.discarded_echoes += 1
            else:
                self.unknown_echoes += 1
            return False
        # marks are played in the order sent: the ones sent before it are past too
        while self._pending:
            first_name, first = self._pending.popitem(last=False)
            self._ack(first, at)
            if first_name == name:
                break
        return True

    def _ack(self, mark: _Mark, at: float) -> None:
        g = self._gens.get(mark.generation)
        if g is None or g.frozen is not None:
            return
        if g.acked_sample is None or mark.sample >= g.acked_sample:
            g.acked_sample, g.acked_at = mark.sample, at

    def cleared(self, at: float) -> None:
        """A ``clear`` was sent at clock seconds ``at``: the provider drops
        what it holds. Each generation's heard position is frozen at its
        value now; every pending mark is discarded (its echo will not count)."""
        for gen, g in self._gens.items():
            if g.frozen is None:
                g.frozen = self.played_samples(gen, at)
        self._discard_pending()

    def _discard_pending(self) -> None:
        self._discarded.update(self._pending)
        if len(self._discarded) > 4096:  # echoes that never came: forget them
            self._discarded.clear()
        self._pending.clear()

    def recalled(self, at: float, rewind: dict[int, int]) -> None:
        """A ``clear`` at clock seconds ``at`` recalled audio that had not
        played, to be sent again: of each generation in ``rewind``, from
        that sample on. Pending marks are discarded (their echoes will not
        count); each such generation's heard position holds at its value
        now (at most the rewind sample) until its audio is sent again, and
        what was sent ends at the rewind sample."""
        heard = {gen: min(self.played_samples(gen, at), sample) for gen, sample in rewind.items()}
        self._discard_pending()
        for gen, sample in rewind.items():
            g = self._gens.get(gen)
            if g is None or g.frozen is not None:
                continue
            g.acked_sample, g.acked_at, g.held = heard[gen], at, True
            g.sent_end = sample

    # -- what was heard -----------------------------------------------------------------

    def played_samples(self, generation: int, now: float) -> int:
        """How far into ``generation``'s audio the caller has heard at clock
        seconds ``now``, in samples at ``rate`` (0 if nothing was sent).
        See the module doc for the rule."""
        g = self._gens.get(generation)
        if g is None:
            return 0
        if g.frozen is not None:
            return g.frozen
        if g.acked_sample is not None:
            base, since = g.acked_sample, g.acked_at
        else:
            base, since = g.first_sample, g.first_sent_at
        if g.held:
            return base
        cap = g.sent_end
        for m in self._pending.values():
            if m.generation == generation and m.sample > base:
                cap = min(cap, m.sample)
                break
        estimate = base + round(max(0.0, now - since) * self.rate)
        return max(base, min(estimate, cap))

    def pending(self, generation: int | None = None) -> int:
        """Marks sent and not echoed yet (of ``generation``, or all)."""
        return sum(1 for m in self._pending.values() if generation is None or m.generation == generation)

    def sent_end(self, generation: int) -> int:
        """End of ``generation``'s audio sent, samples (0 if none)."""
        g = self._gens.get(generation)
        return g.sent_end if g is not None else 0
