"""Streaming speech synthesis: the one interface every text-to-speech
provider implements (DESIGN.md, "Providers": TTS per session).

A :class:`Synthesiser` serves one session (it may hold a pooled WebSocket
or a keep-alive HTTP client, warmed by :meth:`Synthesiser.warm` before the
first reply); :meth:`Synthesiser.open` gives one reply its
:class:`SynthesisStream`. The reply pushes its text as the model produces
it, a clause at a time (:meth:`SynthesisStream.push_text`), ends it
(:meth:`SynthesisStream.end_input`), and reads typed events:

- :class:`Audio`: mono s16 LE PCM at the rate *we asked for* (never assumed
  from the provider's documentation: speaches answers at its model's
  native rate unless told);
- :class:`Words`: word timings, where the provider gives them (ElevenLabs'
  alignment, Cartesia's timestamps), in *stream seconds*: seconds of this
  stream's audio from its first sample, whatever the provider's own
  timebase;
- :class:`SegmentDone`: every sample of one :meth:`push_text` call's text
  has been yielded (one per call, in order: the reply's sentence marks and
  the failover's "what is left to say" both read it).

The iteration ends once :meth:`SynthesisStream.end_input` was called and
every segment is done, or at once after :meth:`SynthesisStream.cancel`.

**Stop.** :meth:`SynthesisStream.cancel` is synchronous and returns at
once: nothing more is yielded, every later chunk of that context is dropped
by the stream (the generation fence before the playout buffer) and counted
in ``late_audio_ms``, and the provider is told to stop on its own protocol
(Cartesia ``cancel``, ElevenLabs ``close_context``, Deepgram ``Clear``, the
HTTP response's socket closed) as soon as its writer runs. The stream's
:class:`StopRecord` says when it was told and whether the provider
confirmed (Deepgram's ``Cleared``, the HTTP socket closed) and bounds the
characters it may still bill: those sent whose audio had not all arrived.

**Failure.** Iteration raises :class:`SynthesisError` when the provider is
gone (refused, 401, dropped, answering garbage); :mod:`voice.tts_failover`
reconnects once or falls back to espeak-ng. Nothing here retries on its own.

The shapes follow LiveKit Agents' ``SynthesizeStream`` (``push_text``,
``flush``, ``end_input``, ``aclose``) and Pipecat's audio contexts
(shared/reference/speech-providers.md, sections 2 and 3).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Literal, Protocol

from pydantic import BaseModel, ConfigDict, Field

from turn.models import SynthesisRecord

SynthesisErrorKind = Literal["unreachable", "unauthorized", "dropped", "closed", "protocol", "provider"]
#: failures after which nothing sent was billable: the provider was never reached, or refused the key
NOT_BILLED = frozenset({"unreachable", "unauthorized"})


@dataclass(frozen=True)
class TimedWord:
    """One word of the reply and when it is spoken.

    Attributes:
        text: the word as it is in the text pushed (punctuation kept).
        start_s / end_s: stream seconds (see the module doc).
    """

    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Audio:
    """Synthesised audio.

    Attributes:
        pcm: mono s16 LE PCM (an even number of bytes).
        sample_rate: its rate, Hz: the rate the stream asked the provider for.
    """

    pcm: bytes
    sample_rate: int


@dataclass(frozen=True)
class Words:
    """Word timings of audio already yielded or about to be (stream seconds)."""

    words: tuple[TimedWord, ...]


@dataclass(frozen=True)
class SegmentDone:
    """Every sample of one :meth:`SynthesisStream.push_text` call's ``text``
    has been yielded."""

    text: str


@dataclass(frozen=True)
class Restarted:
    """The provider failed mid-reply and another stream took over
    (:mod:`voice.tts_failover`): the clause that was arriving is said again
    from its start, so the audio of it that came before is no mark of it."""

    provider: str


SynthesisEvent = Audio | Words | SegmentDone | Restarted


class SynthesisError(RuntimeError):
    """A synthesis stream failed and yields nothing more.

    Attributes:
        kind: ``"unreachable"`` (connect refused, DNS, TLS, timeout),
            ``"unauthorized"`` (401/403: the key is wrong; retrying cannot
            help), ``"dropped"`` (the connection broke mid-reply),
            ``"closed"`` (the provider closed it, e.g. 1008 for too many
            contexts), ``"protocol"`` (an answer that is not the provider's
            protocol, or audio that is not what was asked for),
            ``"provider"`` (the provider reported an error).
        provider: the provider's name (``"cartesia"``, ...).
        retryable: reconnecting may help (every kind but ``unauthorized``).
    """

    def __init__(self, kind: SynthesisErrorKind, message: str, provider: str = "") -> None:
        super().__init__(message)
        self.kind = kind
        self.provider = provider
        self.retryable = kind != "unauthorized"


class SynthesisPricing(BaseModel):
    """What synthesis costs (``tts.*_cents_*``).

    Attributes:
        cents_per_1k_characters: US cents per 1,000 characters sent
            (OpenAI tts-1: 1.5; ElevenLabs, Cartesia and Deepgram Aura bill
            characters too).
    """

    model_config = ConfigDict(frozen=True)

    cents_per_1k_characters: float = Field(0.0, ge=0)

    def cents(self, characters: int) -> float:
        """The price of ``characters`` characters, US cents."""
        return characters * self.cents_per_1k_characters / 1000


@dataclass
class StopRecord:
    """How a stream's stop went.

    Attributes:
        requested_at: when :meth:`SynthesisStream.cancel` was called (the
            stream's clock, s).
        told_at: when the provider's stop left on the wire (a WebSocket
            message sent, the HTTP socket closed), s; None until then, or if
            there was nothing to tell (no request in flight).
        confirmed: the provider acknowledged the stop (Deepgram
            ``Cleared``; an HTTP response whose socket we closed counts as
            confirmed: nothing more is generated for us).
        characters_unspoken: characters sent whose audio had not all arrived
            at the stop: an upper bound of what it may still bill after it.
        late_audio_ms: audio of the stopped context that arrived after the
            stop and was dropped, ms.
        confirmed_at: when the provider's acknowledgement arrived, s (None:
            none, or confirmed by our own act: a socket closed, a process killed).
        confirmable: the provider's protocol acknowledges this stop and the
            acknowledgement is awaited (Deepgram's ``Cleared``): the turn's
            usage record waits for it, briefly, after the terminal write.
    """

    requested_at: float
    told_at: float | None = None
    confirmed: bool = False
    confirmed_at: float | None = None
    confirmable: bool = False
    characters_unspoken: int = 0
    late_audio_ms: float = 0.0

    @property
    def tell_ms(self) -> float | None:
        """Stop requested to provider told, ms (None: not told)."""
        return None if self.told_at is None else (self.told_at - self.requested_at) * 1000


class SynthesisStream(Protocol):
    """One reply being spoken by one provider (see the module doc)."""

    @property
    def provider(self) -> str:
        """The provider's name."""
        ...

    @property
    def sample_rate(self) -> int:
        """The rate of the audio it yields, Hz (what we asked for)."""
        ...

    @property
    def stop(self) -> StopRecord | None:
        """Set by :meth:`cancel`."""
        ...

    def push_text(self, text: str) -> None:
        """Speak ``text`` (a clause, with its trailing space or not) after
        what was pushed before.

        Raises:
            RuntimeError: after :meth:`end_input` or :meth:`cancel`.
        """
        ...

    def end_input(self) -> None:
        """No more text: the iteration ends once all of it is spoken."""
        ...

    def cancel(self) -> None:
        """Stop now (see the module doc); returns at once, idempotent."""
        ...

    @property
    def pending_texts(self) -> list[str]:
        """The texts pushed whose audio has not all been yielded, oldest first."""
        ...

    def usage(self) -> SynthesisRecord:
        """What this stream has cost so far."""
        ...

    def records(self) -> list[SynthesisRecord]:
        """What the reply cost, one record per provider stream it used."""
        ...

    def __aiter__(self) -> AsyncIterator[SynthesisEvent]: ...

    async def aclose(self) -> None:
        """Release the stream (cancels it first if it is not finished);
        never raises but ``CancelledError``."""
        ...


class Synthesiser(Protocol):
    """A text-to-speech provider as one session uses it."""

    #: the provider's name (``"espeak-ng"``, ``"openai"``, ...)
    name: str

    def open(self, context_id: str) -> SynthesisStream:
        """A stream for one reply; ``context_id`` names it on the wire
        (a WebSocket provider's context), unique within the session."""
        ...

    async def warm(self) -> None:
        """Open the connection the first reply will use (idempotent); a
        failure is not raised here: the first stream meets it."""
        ...

    async def aclose(self) -> None:
        """Close its connections (the session ends)."""
        ...


class BaseSynthesisStream:
    """The bookkeeping every provider's stream shares: the event queue, the
    segments in flight, the stop and the usage. A provider subclasses it and
    implements :meth:`_send_text`, :meth:`_send_end` and :meth:`_send_cancel`
    (each synchronous: hand the message to the connection's writer), and
    reports what arrives with :meth:`emit_audio`, :meth:`emit_words`,
    :meth:`emit_segment_done`, :meth:`emit_error`, :meth:`told` and
    :meth:`confirm_stop`. Its own tasks go in :meth:`_close`.

    Args:
        provider: the provider's name.
        sample_rate: the rate asked of the provider, Hz.
        pricing: what its characters cost.
        clock: monotonic seconds (injected in tests).
    """

    def __init__(
        self, provider: str, sample_rate: int, pricing: SynthesisPricing | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.provider = provider
        self.sample_rate = sample_rate
        self.pricing = pricing or SynthesisPricing()
        self.clock = clock
        self.stop: StopRecord | None = None
        self._events: asyncio.Queue[SynthesisEvent | BaseException | None] = asyncio.Queue()
        #: texts pushed whose audio has not all arrived, in order
        self.pending: list[str] = []
        self.ended = False
        self.finished = False
        self.characters = 0
        self.characters_after_stop = 0
        self.audio_bytes = 0

    # -- the reply's side -------------------------------------------------

    def push_text(self, text: str) -> None:
        """See :meth:`SynthesisStream.push_text`.

        Raises:
            RuntimeError: after :meth:`end_input` or :meth:`cancel`.
        """
        if self.stop is not None or self.ended:
            self.characters_after_stop += len(text) if self.stop is not None else 0
            raise RuntimeError(f"{self.provider}: text pushed after the stream was {'cancelled' if self.stop else 'ended'}")
        if not text.strip() or self.finished:
            return  # a failed stream takes no more (its owner says what is left elsewhere)
        self.pending.append(text)
        self.characters += len(text)
        self._send_text(text)

    def end_input(self) -> None:
        """See :meth:`SynthesisStream.end_input`."""
        if self.ended or self.stop is not None:
            return
        self.ended = True
        self._send_end()  # may fail the stream (an odd byte left): then that is how it ends
        if not self.pending and not self.finished:
            self._finish()

    def cancel(self) -> None:
        """See :meth:`SynthesisStream.cancel`."""
        if self.stop is not None or self.finished:
            return
        self.stop = StopRecord(requested_at=self.clock(), characters_unspoken=sum(len(t) for t in self.pending))
        while not self._events.empty():  # received, not yet taken: the fence drops it too
            self._events.get_nowait()
        self._events.put_nowait(None)
        if self.pending:
            self._send_cancel()
        else:
            self.stop.confirmed = True  # nothing in flight: nothing to stop

    def usage(self) -> SynthesisRecord:
        """See :meth:`SynthesisStream.usage`."""
        stop = self.stop
        in_flight = stop is not None and stop.characters_unspoken > 0
        return SynthesisRecord(
            provider=self.provider,
            characters=self.characters,
            characters_after_stop=self.characters_after_stop,
            characters_unspoken_at_stop=stop.characters_unspoken if stop is not None else 0,
            after_stop=("confirmed" if stop.confirmed else "unconfirmed") if in_flight and stop is not None else None,
            audio_s=round(self.audio_bytes / 2 / self.sample_rate, 3),
            cents=self.pricing.cents(self.characters),
        )

    def records(self) -> list[SynthesisRecord]:
        """See :meth:`SynthesisStream.records`: this stream's one record."""
        return [self.usage()]

    @property
    def pending_texts(self) -> list[str]:
        """See :meth:`SynthesisStream.pending_texts`."""
        return list(self.pending)

    def __aiter__(self) -> AsyncIterator[SynthesisEvent]:
        return self._iterate()

    async def _iterate(self) -> AsyncIterator[SynthesisEvent]:
        while True:
            event = await self._events.get()
            if event is None:
                return
            if isinstance(event, BaseException):
                raise event
            yield event

    async def aclose(self) -> None:
        """See :meth:`SynthesisStream.aclose`."""
        if not self.finished:
            self.cancel()
        await self._close()

    # -- the provider's side ----------------------------------------------

    def emit_audio(self, pcm: bytes) -> None:
        """Audio of this stream arrived (at :attr:`sample_rate`); after a
        stop it is dropped and counted as late audio."""
        if self.stop is not None:
            self.stop.late_audio_ms += len(pcm) / 2 / self.sample_rate * 1000
            return
        if self.finished or not pcm:
            return
        self.audio_bytes += len(pcm)
        self._events.put_nowait(Audio(pcm, self.sample_rate))

    def emit_words(self, words: list[TimedWord] | tuple[TimedWord, ...]) -> None:
        """Word timings arrived (stream seconds)."""
        if self.stop is None and not self.finished and words:
            self._events.put_nowait(Words(tuple(words)))

    def emit_segment_done(self) -> None:
        """All audio of the oldest pending text has arrived. Once input
        has ended and nothing is pending, the iteration ends."""
        if self.stop is not None or self.finished or not self.pending:
            return
        text = self.pending.pop(0)
        self._events.put_nowait(SegmentDone(text))
        if self.ended and not self.pending:
            self._finish()

    def emit_error(self, error: SynthesisError) -> None:
        """The provider failed: iteration raises ``error`` (after what was
        already yielded). Ignored once stopped or finished."""
        if self.stop is not None or self.finished:
            return
        self.finished = True
        if not error.provider:
            error.provider = self.provider
        if error.kind in NOT_BILLED:
            self.characters = 0  # nothing reached a provider that could bill it
        self._events.put_nowait(error)

    def told(self) -> None:
        """The stop went out on the wire now."""
        if self.stop is not None and self.stop.told_at is None:
            self.stop.told_at = self.clock()

    def confirm_stop(self) -> None:
        """The provider acknowledged the stop."""
        if self.stop is not None and not self.stop.confirmed:
            self.stop.confirmed = True
            self.stop.confirmed_at = self.clock()

    @property
    def seconds_yielded(self) -> float:
        """Stream seconds of audio yielded so far."""
        return self.audio_bytes / 2 / self.sample_rate

    def _finish(self) -> None:
        self.finished = True
        self._events.put_nowait(None)

    # -- to implement -----------------------------------------------------

    def _send_text(self, text: str) -> None:
        raise NotImplementedError

    def _send_end(self) -> None:
        raise NotImplementedError

    def _send_cancel(self) -> None:
        raise NotImplementedError

    async def _close(self) -> None:
        """Cancel and await the stream's own tasks, if any."""


def words_from_characters(
    chars: list[str], starts_ms: list[float], durations_ms: list[float], offset_s: float = 0.0,
) -> list[TimedWord]:
    """Word timings from character timings (ElevenLabs' ``alignment``):
    words are the runs of non-space characters; each starts at its first
    character's start and ends at its last character's end.

    Args:
        chars / starts_ms / durations_ms: one entry per character, ms.
        offset_s: added to every time (the chunk's place in the stream, s).

    Raises:
        ValueError: the three lists differ in length.
    """
    if not (len(chars) == len(starts_ms) == len(durations_ms)):
        raise ValueError(f"alignment lists differ in length: {len(chars)}, {len(starts_ms)}, {len(durations_ms)}")
    out: list[TimedWord] = []
    word: list[str] = []
    start = end = 0.0
    for c, s, d in zip(chars, starts_ms, durations_ms, strict=True):
        if c.isspace():
            if word:
                out.append(TimedWord("".join(word), offset_s + start / 1000, offset_s + end / 1000))
                word = []
            continue
        if not word:
            start = s
        word.append(c)
        end = s + d
    if word:
        out.append(TimedWord("".join(word), offset_s + start / 1000, offset_s + end / 1000))
    return out



async def cancel_and_wait(task: asyncio.Task[object] | None) -> None:
    """Cancel ``task`` and wait until it has ended, whatever it raised (its
    failure is read, not re-raised: it was told already, or is moot once
    cancelled). Only a cancellation of the caller during the wait is
    raised: ``asyncio.wait`` never passes on the task's own, so this works
    in a task that is already being cancelled (a session's cleanup).

    Raises:
        asyncio.CancelledError: the caller was cancelled while waiting.
    """
    if task is None:
        return
    task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # retrieved: no "never retrieved" warning
