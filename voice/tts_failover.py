"""What a reply does when its speech synthesiser fails mid-reply: the
same provider once more, then espeak-ng (``tts.fallback = "embedded"``),
or the reply ends with the error (``"none"``).

:class:`FailoverSynthesiser` wraps a session's provider. Each reply's
:class:`FailoverStream` remembers the clauses pushed and how many were
spoken whole (:class:`voice.synthesis.SegmentDone`); when the provider's
stream raises :class:`voice.synthesis.SynthesisError`, the clauses not
spoken whole (the one cut by the failure from its start: a few words may be
said twice) go to a new stream: first a reconnect to the same provider
(unless the error is ``unauthorized``: a wrong key stays wrong), then the
fallback. Each switch is told (:class:`FailoverNotice`; the client gets ``tts.failover``)
and each stream's usage is kept (:meth:`FailoverStream.records`). Word
timings of a later stream are moved by the audio the earlier ones yielded,
so they stay in the reply's stream seconds.
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal

from voice.synthesis import (
    Audio,
    Restarted,
    SegmentDone,
    StopRecord,
    Synthesiser,
    SynthesisError,
    SynthesisEvent,
    SynthesisRecord,
    SynthesisStream,
    TimedWord,
    Words,
)

log = logging.getLogger(__name__)

FailoverAction = Literal["reconnect", "fallback", "failed"]


@dataclass(frozen=True)
class FailoverNotice:
    """A synthesiser failed mid-reply, and what follows.

    Attributes:
        provider: the one that failed.
        error: its error.
        action: ``"reconnect"`` (the same provider again), ``"fallback"``
            (espeak-ng says the rest) or ``"failed"`` (the reply ends with
            ``error``).
        fallback: the synthesiser saying the rest (None: none).
    """

    provider: str
    error: SynthesisError
    action: FailoverAction
    fallback: str | None


class FailoverStream:
    """One reply's :class:`voice.synthesis.SynthesisStream` over a provider
    and its fallback (see the module doc)."""

    def __init__(self, owner: FailoverSynthesiser, context_id: str) -> None:
        self.owner = owner
        self.context_id = context_id
        self.inner: SynthesisStream = owner.primary.open(context_id)
        self.provider = self.inner.provider
        self._texts: list[str] = []
        self._done = 0
        self._ended = False
        self._retried = False
        self._on_fallback = False
        self._offset_s = 0.0
        self._records: list[SynthesisRecord] = []

    @property
    def sample_rate(self) -> int:
        """The current stream's rate, Hz (each :class:`Audio` says its own)."""
        return self.inner.sample_rate

    @property
    def stop(self) -> StopRecord | None:
        """The stop of the stream in use (None: not stopped)."""
        return self.inner.stop

    def push_text(self, text: str) -> None:
        """See :meth:`voice.synthesis.SynthesisStream.push_text`."""
        if not text.strip():
            return
        self._texts.append(text)
        self.inner.push_text(text)

    def end_input(self) -> None:
        """See :meth:`voice.synthesis.SynthesisStream.end_input`."""
        self._ended = True
        self.inner.end_input()

    def cancel(self) -> None:
        """See :meth:`voice.synthesis.SynthesisStream.cancel`."""
        self.inner.cancel()

    @property
    def pending_texts(self) -> list[str]:
        """The clauses pushed and not yet spoken whole, oldest first."""
        return self._texts[self._done:]

    def records(self) -> list[SynthesisRecord]:
        """What the reply cost, one record per stream it used (a failed one
        too: its characters were sent)."""
        return [*self._records, self.inner.usage()]

    def usage(self) -> SynthesisRecord:
        """The stream in use's record (see :meth:`records` for all)."""
        return self.inner.usage()

    def __aiter__(self) -> AsyncIterator[SynthesisEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SynthesisEvent]:
        while True:
            seconds = 0.0
            try:
                async for event in self.inner:
                    if isinstance(event, Audio):
                        seconds += len(event.pcm) / 2 / event.sample_rate
                    elif isinstance(event, SegmentDone):
                        self._done += 1
                    elif isinstance(event, Words) and self._offset_s:
                        event = Words(tuple(
                            TimedWord(w.text, w.start_s + self._offset_s, w.end_s + self._offset_s) for w in event.words
                        ))
                    yield event
                return
            except SynthesisError as exc:
                self._offset_s += seconds
                await self._switch(exc)
                yield Restarted(self.inner.provider)

    async def _switch(self, error: SynthesisError) -> None:
        """Replace the failed stream (see the module doc).

        Raises:
            SynthesisError: ``error``, when nothing is left to try.
        """
        failed = self.inner
        owner = self.owner
        if not self._on_fallback and error.retryable and not self._retried:
            self._retried = True
            action: FailoverAction = "reconnect"
            nxt: Synthesiser | None = owner.primary
        elif not self._on_fallback and owner.fallback is not None:
            self._on_fallback = True
            action, nxt = "fallback", owner.fallback
        else:
            action, nxt = "failed", None
        owner.tell(FailoverNotice(failed.provider, error, action, nxt.name if nxt is not None else None))
        log.warning("tts %s failed (%s: %s): %s", failed.provider, error.kind, error, action)
        await failed.aclose()
        if nxt is None:
            raise error
        self._records.append(failed.usage())
        self.inner = nxt.open(f"{self.context_id}-{len(self._records)}")
        for text in self._texts[self._done:]:
            self.inner.push_text(text)
        if self._ended:
            self.inner.end_input()

    async def aclose(self) -> None:
        """See :meth:`voice.synthesis.SynthesisStream.aclose`."""
        await self.inner.aclose()


class FailoverSynthesiser:
    """A session's synthesiser: ``primary``, reconnected once, then
    ``fallback`` (None: none) per reply (see the module doc).

    Args:
        primary: the provider.
        fallback: espeak-ng, or None.
        tell: gets each :class:`FailoverNotice` (the session tells the
            client: ``tts.failover``).
    """

    def __init__(
        self, primary: Synthesiser, fallback: Synthesiser | None = None,
        tell: Callable[[FailoverNotice], None] | None = None,
    ) -> None:
        self.primary = primary
        self.fallback = fallback
        self.name = primary.name
        self._tell = tell

    def tell(self, notice: FailoverNotice) -> None:
        """Pass on a failover (to the session, if it listens)."""
        if self._tell is not None:
            self._tell(notice)

    def open(self, context_id: str) -> FailoverStream:
        """A stream for one reply."""
        return FailoverStream(self, context_id)

    async def warm(self) -> None:
        """Warm the provider (the fallback needs no warming)."""
        await self.primary.warm()

    async def aclose(self) -> None:
        """Close the provider's and the fallback's connections."""
        try:
            await self.primary.aclose()
        finally:
            if self.fallback is not None:
                await self.fallback.aclose()
