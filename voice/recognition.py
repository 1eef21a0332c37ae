"""Streaming speech recognition: the one interface every recogniser
implements (DESIGN.md, "Providers": STT per session).

A :class:`Recogniser` serves the whole server (it may hold a loaded model
or an HTTP client); :meth:`Recogniser.open` gives one session its
:class:`RecognitionStream`. The session sends the stream its user's audio
(16 kHz mono s16, whatever the provider's own rate: a client resamples) and
reads typed events from it:

- :class:`SpeechStarted`: the provider's own voice activity detector heard speech;
- :class:`Interim`: text that may still change (Deepgram ``is_final=false``,
  an OpenAI ``...transcription.delta`` accumulated);
- :class:`Final`: text that will not change, with word timings and
  confidence where the provider gives them;
- :class:`EndOfUtterance`: the provider judged the utterance over
  (Deepgram ``speech_final``/``UtteranceEnd``, the end of a segment);
- :class:`RecognitionUsage`: what the provider reports it billed, or what
  the client counted.

**Time.** Every time in an event is *stream seconds*: seconds of audio
handed to :meth:`RecognitionStream.send` since the stream opened (at 16 kHz,
``bytes / 32000``). Providers count the same way (Deepgram's ``start`` and
``duration``, OpenAI's ``audio_start_ms``), since only speech is sent.

**Segments.** The session sends audio only while its own detector says the
user may be speaking (a candidate, an utterance being listened to: see
:mod:`voice.transcription`), and tells the stream where its own
endpointing put the end of each stretch: :meth:`RecognitionStream.finalize`
(the audio since the last finalize or discard is one utterance, complete:
give its final now; Deepgram ``Finalize``, an OpenAI ``commit``, a segmented
recogniser decodes it) or :meth:`RecognitionStream.discard` (it was no
speech: drop it if the provider can). A recogniser that cannot stream
(pocketsphinx, Whisper, ``/v1/audio/transcriptions``) is *segmented by our
own endpointing* this way; a streaming one also gets its silences as
KeepAlive rather than as billed audio.

**Failure.** :meth:`RecognitionStream.events` raises
:class:`RecognitionError` when the provider is gone (refused, dropped,
closed, answering garbage); the session's :mod:`voice.transcription`
reconnects once or falls back (:mod:`voice.stt_failover`). Nothing here
retries on its own.

The shapes follow LiveKit Agents' ``SpeechEvent`` and Pipecat's
``SegmentedSTTService`` (shared/reference/speech-providers.md, section 3).
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any, Literal, Protocol, runtime_checkable

from pydantic import BaseModel, ConfigDict, Field

#: the rate of the audio a stream is sent, Hz (16 kHz mono s16 LE)
STREAM_RATE = 16_000
#: bytes per second of stream audio
STREAM_BYTES_PER_S = STREAM_RATE * 2


def stream_seconds(nbytes: int) -> float:
    """Seconds of stream audio in ``nbytes`` bytes (16 kHz mono s16)."""
    return nbytes / STREAM_BYTES_PER_S



def language_code(language: str) -> str:
    """``stt.language`` (a BCP-47 tag) as the ISO-639-1 code recognisers
    take: ``en-US`` and ``en_GB`` -> ``en``; "" stays "" (the provider
    detects it)."""
    return language.replace("_", "-").split("-")[0].lower()

@dataclass(frozen=True)
class Word:
    """One recognised word.

    Attributes:
        text: the word as spoken (punctuated where the provider punctuates).
        start_s / end_s: stream seconds.
        confidence: 0..1, None if the provider gives none.
    """

    text: str
    start_s: float
    end_s: float
    confidence: float | None = None


@dataclass(frozen=True)
class SpeechStarted:
    """The provider's detector heard speech begin at ``at_s`` (stream s)."""

    at_s: float


@dataclass(frozen=True)
class Interim:
    """Text for the audio from ``start_s`` to ``end_s`` (stream s) that may
    still change; a later interim or a final for the same audio replaces it."""

    text: str
    start_s: float
    end_s: float


@dataclass(frozen=True)
class Final:
    """Text for the audio from ``start_s`` to ``end_s`` (stream s) that
    will not change; finals of one utterance are concatenated in order.

    Attributes:
        words: word timings, where the provider gives them (else empty).
        confidence: 0..1 for the whole text, None if not given.
        finalized: this final answers :meth:`RecognitionStream.finalize`
            (Deepgram ``from_finalize``; a segment's decode): the audio up
            to ``end_s`` is all recognised.
    """

    text: str
    start_s: float
    end_s: float
    words: tuple[Word, ...] = ()
    confidence: float | None = None
    finalized: bool = False


@dataclass(frozen=True)
class EndOfUtterance:
    """The provider judged the utterance over at ``at_s`` (stream s):
    Deepgram ``speech_final`` or ``UtteranceEnd``, an OpenAI item
    completed, a segment decoded."""

    at_s: float


@dataclass(frozen=True)
class RecognitionUsage:
    """What recognition cost, as the provider reported it (or, where it
    reports nothing, as the client counted it).

    Attributes:
        audio_s: audio billed, s (Deepgram's ``Metadata.duration``, OpenAI's
            ``{"type": "duration"}``); 0 if the provider bills otherwise.
        input_tokens / output_tokens: tokens billed (OpenAI's
            ``{"type": "tokens"}``), tokens.
        start_s / end_s: the stream seconds it is for (an OpenAI item, a
            segment's request), so the session can give it to a turn; None:
            the whole connection (Deepgram's closing Metadata).
        source: ``"provider"`` (reported on the wire) or ``"counted"``.
    """

    audio_s: float = 0.0
    input_tokens: int = 0
    output_tokens: int = 0
    start_s: float | None = None
    end_s: float | None = None
    source: Literal["provider", "counted"] = "provider"


RecognitionEvent = SpeechStarted | Interim | Final | EndOfUtterance | RecognitionUsage


class RecognitionError(RuntimeError):
    """A recognition stream failed and produces nothing more.

    Attributes:
        kind: ``"unreachable"`` (connect refused, DNS, TLS, timeout),
            ``"unauthorized"`` (401/403: the key is wrong; retrying cannot
            help), ``"dropped"`` (the connection broke mid-stream),
            ``"closed"`` (the provider closed it, e.g. an idle close),
            ``"protocol"`` (an answer that is not the provider's protocol),
            ``"provider"`` (the provider reported an error), ``"timeout"``
            (a final owed too long: raised by the session's transcription,
            never by a client).
        retryable: reconnecting may help (every kind but ``unauthorized``).
    """

    def __init__(self, kind: Literal["unreachable", "unauthorized", "dropped", "closed", "protocol", "provider", "timeout"],
                 message: str) -> None:
        super().__init__(message)
        self.kind = kind
        self.retryable = kind != "unauthorized"


class UtteranceStream(Protocol):
    """One utterance being recognised by a recogniser of whole utterances
    (:class:`UtteranceRecogniser`).

    """

    @property
    def words(self) -> list[Word]:
        """Once finished, its words with seconds from its start (empty if
        the recogniser gives none)."""
        ...

    @property
    def confidence(self) -> float | None:
        """Once finished, the transcript's confidence, 0..1 (None if the
        recogniser gives none)."""
        ...

    def feed(self, pcm: bytes) -> None:
        """Add audio: 16 kHz mono s16 PCM, any length. Never blocks."""
        ...

    async def finish(self) -> str:
        """End the utterance and return the final transcript ("" if none)."""
        ...

    async def aclose(self) -> None:
        """Abandon the utterance; idempotent, also after ``finish``."""
        ...


class SttAdaptation:
    """What a recogniser learnt of one session's voice and channel, carried
    from one of that session's utterances to the next and never to another
    session's (for pocketsphinx: the cepstral mean it settled at). Opaque
    to the session: only the recogniser reads and writes ``state``; a new
    one (``state`` None) starts from the recogniser's fixed starting point.
    """

    def __init__(self) -> None:
        self.state: Any = None


@runtime_checkable
class TentativeStream(UtteranceStream, Protocol):
    """An utterance stream that can decode what it has so far without
    ending (Whisper: a whole-utterance decoder, so the decode it would do at
    the end can start at the user's pause instead)."""

    async def decode_so_far(self) -> str:
        """The transcript of the audio fed so far ("" if none was heard);
        the stream stays open. Cancelling the wait leaves the decode to
        finish on its own.

        Raises:
            SttError: the decode failed.
        """
        ...


@runtime_checkable
class ShortDecode(Protocol):
    """A stream that can tell the words of its audio so far quickly when
    that audio is short (a backchannel candidate's, under a second): the
    embedded Whisper on a short encoder window. Used by the session to
    judge "uh-huh" against "wait" soon after it ends; a streaming
    provider's interims do that job instead."""

    async def decode_short(self) -> str:
        """The words of the audio so far ("" if none was heard); the stream
        stays open. Cancelling the wait leaves the decode to finish.

        Raises:
            SttError: the decode failed.
        """
        ...


@runtime_checkable
class PauseHints(Protocol):
    """A :class:`RecognitionStream` that takes hints of the user's pauses
    within an utterance (a recogniser of whole utterances starts a
    tentative decode at a pause; one that streams has no use for them)."""

    def speech_paused(self) -> None:
        """The user stopped speaking (our detector's speech_stopped): the
        audio sent after this is silence unless :meth:`speech_resumed`
        comes before the finalize."""
        ...

    def speech_resumed(self) -> None:
        """The user speaks again in the same utterance."""
        ...


class UtteranceRecogniser(Protocol):
    """A recogniser of one whole utterance at a time (the embedded ones;
    :mod:`voice.segmented_stt` makes it a :class:`RecognitionStream`).
    May hold a loaded model, shared by every session."""

    async def start(self) -> None:
        """Load what is needed. Idempotent."""
        ...

    def open_stream(self, adaptation: SttAdaptation | None = None) -> UtteranceStream:
        """Begin a new utterance, from ``adaptation`` (the session's) if
        given, else from the recogniser's fixed starting point; a
        recognised utterance updates ``adaptation``."""
        ...

    async def aclose(self) -> None:
        """Release the model."""
        ...


class SttError(RuntimeError):
    """Recognition of an utterance failed (an embedded model's worker died
    or could not decode; no recogniser could answer for it). A turn whose
    transcript raises it ends FAILED with the message."""


@dataclass
class StreamOptions:
    """How one session's stream is opened.

    Attributes:
        adaptation: what an embedded recogniser learnt of this session's
            voice (:class:`voice.providers.SttAdaptation`; a provider
            ignores it).
        narrowband: the audio is telephone audio (8 kHz G.711 upsampled):
            an embedded recogniser fills the empty band
            (:mod:`voice.narrowband`); a provider ignores it.
        session_id: for the provider's logs and request tags only.
    """

    adaptation: SttAdaptation = field(default_factory=SttAdaptation)
    narrowband: bool = False
    session_id: str = ""


class RecognitionStream(Protocol):
    """One session's recognition, for the session's whole life.

    ``send``, ``finalize`` and ``discard`` never block and never raise: a
    failed stream ignores them, and its failure comes out of
    :meth:`events`.
    """

    def send(self, pcm: bytes) -> None:
        """Add audio: 16 kHz mono s16 LE, any whole number of samples."""
        ...

    def finalize(self) -> None:
        """The audio sent since the last finalize or discard is one
        utterance and it is over: produce its :class:`Final` now. Every
        finalize with audio since the last one is owed exactly one
        :class:`Final` with ``finalized`` set whose ``end_s`` is the
        stream's position at the finalize (its text may be empty, e.g.
        when the provider had already given all of it as earlier finals;
        a provider that answers such a finalize with nothing is made to
        here, by the client). A finalize with no audio since the last one
        is owed nothing."""
        ...

    def discard(self) -> None:
        """The audio sent since the last finalize or discard is not
        speech: drop it where the provider can (it may still be billed)."""
        ...

    def events(self) -> AsyncIterator[RecognitionEvent]:
        """The stream's events, in the order the provider produced them,
        until :meth:`aclose` ends it. Iterated once.

        Raises:
            RecognitionError: the provider failed; nothing more comes.
        """
        ...

    async def aclose(self) -> None:
        """End the stream: the provider finishes what it has (Deepgram
        ``CloseStream``, bounded), its closing usage comes out of
        :meth:`events`, then the connection closes and :meth:`events`
        ends. Idempotent; cancelling it closes at once."""
        ...


class SpeechPricing(BaseModel):
    """What a recogniser costs (settings ``stt.*_cents_*``).

    Attributes:
        cents_per_minute: US cents per minute of audio sent (Deepgram,
            Whisper-style APIs bill by audio).
        input_cents_per_1k / output_cents_per_1k: US cents per 1,000
            input (audio) and output (text) tokens, for providers that
            report tokens (OpenAI's ``gpt-4o-transcribe`` family).
        billed_by: what a session's minutes are: ``"audio"`` (the audio
            sent) or ``"connection"`` (the socket's lifetime: LiveKit reads
            Deepgram's bill so; shared/reference/speech-providers.md marks it
            VERIFY). A turn's share is always its own audio.
    """

    model_config = ConfigDict(frozen=True)

    cents_per_minute: float = Field(0.0, ge=0, allow_inf_nan=False)
    input_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)
    output_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)
    billed_by: Literal["audio", "connection"] = "audio"

    def cents(self, audio_s: float, input_tokens: int = 0, output_tokens: int = 0) -> float:
        """The price of ``audio_s`` seconds and that many tokens, US cents."""
        return (
            audio_s / 60 * self.cents_per_minute
            + (input_tokens * self.input_cents_per_1k + output_tokens * self.output_cents_per_1k) / 1000
        )

    def session_cents(self, audio_s: float, connection_s: float, input_tokens: int = 0, output_tokens: int = 0) -> float:
        """A session's price: its audio or its connections' lifetime (by
        ``billed_by``), s, and its tokens; US cents."""
        return self.cents(connection_s if self.billed_by == "connection" else audio_s, input_tokens, output_tokens)


class Recogniser(Protocol):
    """A speech recogniser for the whole server.

    Attributes:
        name: the provider's name for logs, metrics and usage
            (``"pocketsphinx"``, ``"deepgram"``, ...).
        pricing: what its audio and tokens cost.
        final_timeout_s: how long it may owe a final after a finalize
            before it counts as failed, s; None: the session's setting
            (``stt.final_timeout_ms``, for providers: a connection that
            stops answering).
    """

    name: str
    pricing: SpeechPricing
    final_timeout_s: float | None

    async def start(self) -> None:
        """Load or check what it needs before the server serves anyone.
        Idempotent. A provider that cannot be reached is not an error
        here (the server still serves, with the fallback); one that refuses
        the key is logged once, naming the setting.

        Raises:
            RuntimeError: an embedded model cannot load.
        """
        ...

    def open(self, options: StreamOptions) -> RecognitionStream:
        """One session's stream (never blocks: a connection is made in the
        background, and audio sent meanwhile waits for it)."""
        ...

    async def aclose(self) -> None:
        """Release what it holds (models, connections). Idempotent."""
        ...
