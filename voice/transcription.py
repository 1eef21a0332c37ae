"""A session's transcription: its recognition stream, which audio goes to
it, which of its events belong to which utterance, and what happens when
the recogniser fails.

The agent session (:class:`voice.session.AgentSession`) sends audio only
while its detector says the user may be speaking: from a candidate's onset
(with the pre-roll) until it is rejected, judged a backchannel, or the
utterance it became ends (its endpointing). Each such stretch is an
:class:`Utterance`, and within it each stretch between two
``finalize``/``discard`` calls of the stream is a :class:`Segment`
(:mod:`voice.recognition`, "Segments"): a backchannel candidate is
finalized to be judged, and if the user goes on, what follows is a second
segment of the same utterance. In silence nothing is sent (a streaming
provider keeps its connection with KeepAlive): providers bill the audio
they get. The stream is opened with the first speech sent, and closed
after ``idle_close_s`` with nothing sent or waited for; a stream the
provider ends while nothing waits on it (Deepgram's idle close) is no
failure: the next utterance opens another.

**Attribution.** Events carry stream seconds; a segment knows the stream
seconds it spans, so each interim and final is given to the segment its
audio overlaps most. A segment's transcript is its finals in order, then
its latest interim. A segment being finalized is *complete* when the
provider has answered for all of it: a final marked ``finalized`` (the
answer every finalize is owed, :meth:`voice.recognition.RecognitionStream.finalize`)
or any final reaching its end. Answers may come out of order (OpenAI
completes items asynchronously; segmented requests race), so nothing is
inferred from the order of events. :meth:`Utterance.finish` waits for every
segment of the utterance to be complete; a segment the provider has not
answered ``final_timeout_s`` after its finalize counts as a failure of the
stream.

**Failure** (issue 28, item 6). When the stream fails
(:class:`voice.recognition.RecognitionError`, or that timeout), the next
recogniser is chosen by :class:`voice.stt_failover.Failover` (reconnect
once, then the fallback) and every segment not yet complete is sent to it
again: the audio after its last final (kept until then), finalized again if
it was. If none is left, those segments fail: :meth:`Utterance.finish`
raises :class:`voice.recognition.SttError` with the reason (the turn
ends FAILED), and the next utterance tries the configured recogniser anew.
No utterance ever waits without a bound.

**Usage** (item 7). Audio seconds sent (replays too: they are sent again),
per recogniser and per utterance, the tokens providers report per segment,
and each connection's lifetime (providers bill one or the other):
:meth:`Utterance.usage` for a turn, :meth:`Transcription.usage` for the
session.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Literal

from clock import Clock, timeout_after
from turn.models import RecognitionRecord
from voice.backchannel import normalise
from voice.recognition import (
    STREAM_BYTES_PER_S,
    EndOfUtterance,
    Final,
    Interim,
    PauseHints,
    Recogniser,
    RecognitionError,
    RecognitionEvent,
    RecognitionStream,
    RecognitionUsage,
    SpeechPricing,
    SpeechStarted,
    StreamOptions,
    SttError,
    Word,
    stream_seconds,
)
from voice.stt_failover import Failover, FailoverAction

log = logging.getLogger(__name__)

#: events this close to a segment's end (stream s) reach its end: providers
#: round their times, and report the last few ms of silence or not
END_TOLERANCE_S = 0.06
#: how long closing a stream may take (the provider's last usage comes then), s
CLOSE_TIMEOUT_S = 2.0
#: text longer than this (characters) is never acted on before it is final
#: (a minute of speech is about 1,000)
MAX_SETTLE_CHARS = 4000
#: a final's bound grows by this much per second of the segment's audio, s/s
FINAL_SLACK_PER_AUDIO_S = 0.25
#: a stream with nothing waiting and no audio sent this long is closed (the
#: next utterance opens another: a connection made while the user speaks is
#: ready long before the utterance ends), s. Deepgram closes one with no
#: audio in 10 s unless it gets KeepAlive; whether it bills a socket's
#: lifetime is not known (reference, VERIFY): so a silent session holds none.
IDLE_CLOSE_S = 20.0


@dataclass(eq=False)
class Segment:
    """One stretch of an utterance's audio between two ``finalize``/``discard``
    calls of the stream.

    Attributes:
        utterance: whose it is.
        start_s / end_s: the stream seconds it spans in the current stream
            (``end_s`` None while it is open; both moved when it is replayed).
        audio: its audio after its last final (kept for a replay), 16 kHz s16.
        kept_from_s: where ``audio`` begins, s from the segment's start.
        state: ``open`` (audio still comes), ``finalizing`` (finalized,
            waiting for the provider), ``complete``, ``discarded`` (not
            speech), ``failed`` (no recogniser could answer).
        finals: its finals, in order of their audio.
        interim: its latest interim after its last final.
        sent_s: audio seconds sent, per recogniser (replays count again).
        tokens: (input, output) tokens reported, per recogniser.
        finalized_at: clock seconds of its (last) finalize.
        error: why it failed.
    """

    utterance: Utterance
    start_s: float | None = None
    end_s: float | None = None
    audio: bytearray = field(default_factory=bytearray)
    kept_from_s: float = 0.0
    state: Literal["open", "finalizing", "complete", "discarded", "failed"] = "open"
    finals: list[Final] = field(default_factory=list)
    interim: Interim | None = None
    sent_s: dict[str, float] = field(default_factory=dict)
    tokens: dict[str, tuple[int, int]] = field(default_factory=dict)
    finalized_at: float | None = None
    error: str | None = None
    done: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def text(self) -> str:
        """Its finals, then its interim, as one text."""
        parts = [f.text for f in self.finals]
        if self.interim is not None:
            parts.append(self.interim.text)
        return " ".join(p.strip() for p in parts if p.strip())

    @property
    def final_text(self) -> str:
        """Its finals only."""
        return " ".join(f.text.strip() for f in self.finals if f.text.strip())


class Utterance:
    """What the user says from a candidate's onset until it is decided: the
    audio the session sends for it and what the recogniser made of it.

    It stands where a turn's recogniser stream stands
    (:class:`voice.providers.UtteranceStream`: ``feed``, ``finish``,
    ``aclose``), so a turn reads its transcript the same way whichever
    recogniser heard it.
    """

    def __init__(self, transcription: Transcription) -> None:
        self._transcription = transcription
        self.segments: list[Segment] = []
        #: no more audio is taken (ended, dropped or closed)
        self.ended = False
        #: the text (normalised) at the last update, to tell a settled one
        self._last: str | None = None
        #: :attr:`text` when the recogniser said the same twice in a row, or
        #: its finals once complete; None while it still changes
        self.settled_text: str | None = None
        #: the words (normalised) the last two updates agree on from the start,
        #: or all of them once complete: what stayed put as interims grew
        self.settled_words: str = ""

    # -- audio -----------------------------------------------------------------

    def feed(self, pcm: bytes) -> None:
        """Send 16 kHz mono s16 audio of this utterance to the recogniser
        (never blocks; ignored once it ended)."""
        if not self.ended:
            self._transcription._send(self, pcm)

    def end(self) -> None:
        """The audio so far is complete for now: finalize its open segment
        (more audio later opens another)."""
        self._transcription._finalize(self)

    def speech_paused(self) -> None:
        """The user paused in it (speech_stopped while it is listened to):
        a recogniser of whole utterances may decode it so far now
        (:class:`voice.recognition.PauseHints`)."""
        self._transcription._hint(self, paused=True)

    def speech_resumed(self) -> None:
        """The user speaks again in it."""
        self._transcription._hint(self, paused=False)

    def drop(self) -> None:
        """It was not speech (noise, echo) or not a request (a backchannel):
        no more audio is taken, and its open segment is discarded."""
        self.ended = True
        self._transcription._discard(self)

    # -- what was heard --------------------------------------------------------

    @property
    def text(self) -> str:
        """What the recogniser heard so far: finals, then the latest interim."""
        return " ".join(t for s in self.segments if s.state != "discarded" and (t := s.text))

    @property
    def words(self) -> list[Word]:
        """The word timings of its finals, where the provider gave them."""
        return [w for s in self.segments for f in s.finals for w in f.words]

    def covered(self) -> bool:
        """Every segment's text reaches the end of its audio so far: the
        interims or finals span all that was sent (within 0.3 s). A judge
        may read :attr:`text` without waiting for the finals."""
        for s in self.segments:
            if s.state in ("discarded", "complete"):
                continue
            if s.state == "failed" or s.start_s is None:
                return False
            reached = max([f.end_s for f in s.finals] + ([s.interim.end_s] if s.interim else []), default=s.start_s)
            end = s.end_s if s.end_s is not None else self._transcription.position_s
            if reached < end - 0.3:
                return False
        return True

    async def finish(self) -> str:
        """End it (finalize its open segment) and return its transcript once
        the recogniser answered for all of it.

        Raises:
            voice.recognition.SttError: no recogniser could answer
                (the configured one and its fallback failed); the message
                names the recogniser and why.
        """
        self.ended = True
        self.end()
        for seg in list(self.segments):
            await seg.done.wait()
        failed = [s.error for s in self.segments if s.state == "failed"]
        if failed:
            raise SttError(f"recognition failed: {failed[0]}")
        return " ".join(t for s in self.segments if s.state == "complete" and (t := s.final_text))

    def _updated(self) -> None:
        """The recogniser's text of it changed (an interim or a final came):
        it is *settled* when it says the same as at the update before (an
        interim repeated, or confirmed by its final), or when every segment
        is complete; its *settled words* are those the last two updates
        agree on from the start (interims grow as the user speaks: "what",
        "what is"). A first guess is not acted on: a recogniser's early
        interims of a short sound are often words it then takes back
        (pocketsphinx's partials of "uh-huh" were "charge" and "hello")."""
        text = self.text
        now = normalise(text) if len(text) <= MAX_SETTLE_CHARS else None  # a flood of text is no reply to act on
        complete = bool(self.segments) and all(s.state in ("complete", "discarded") for s in self.segments)
        self.settled_text = text if complete or (now and now == self._last) else None
        words, last = (now or "").split(), (self._last or "").split()
        agreed = len(words) if complete else next((i for i, (a, b) in enumerate(zip(words, last, strict=False)) if a != b),
                                                  min(len(words), len(last)))
        self.settled_words = " ".join(words[:agreed])
        self._last = now

    async def heard(self) -> str | None:
        """What a judge reads as soon as it can: the settled text if it
        already covers the audio (an interim heard it, twice), else the
        finals once complete; None if recognition failed."""
        self.end()
        if self.settled_text is not None and self.covered():
            return self.settled_text
        for seg in list(self.segments):
            await seg.done.wait()
        if any(s.state == "failed" for s in self.segments):
            return None
        return self.text

    async def short_words(self) -> str | None:
        """The words of its audio so far from the recogniser's short decode
        (:class:`voice.recognition.ShortDecode`: the embedded Whisper on a
        short window, for a backchannel candidate), without ending it; None
        if the recogniser has none (a provider: read :meth:`heard`), or it
        failed (logged; :meth:`heard` still can)."""
        try:
            return await self._transcription._short_words(self)
        except SttError as exc:
            log.warning("the short decode failed: %s", exc)
            return None

    async def aclose(self) -> None:
        """Abandon it if it was never finished (its open segment discarded). Idempotent."""
        if not self.ended:
            self.drop()

    def usage(self) -> list[RecognitionRecord]:
        """What recognising it cost, one record per recogniser that got its
        audio (priced by each recogniser's :class:`voice.recognition.SpeechPricing`)."""
        audio: dict[str, float] = {}
        tokens: dict[str, tuple[int, int]] = {}
        for s in self.segments:
            for name, sec in s.sent_s.items():
                audio[name] = audio.get(name, 0.0) + sec
            for name, (i, o) in s.tokens.items():
                ti, to = tokens.get(name, (0, 0))
                tokens[name] = (ti + i, to + o)
        records = []
        for name in sorted(set(audio) | set(tokens)):
            sec = audio.get(name, 0.0)
            i, o = tokens.get(name, (0, 0))
            pricing = self._transcription.pricing_of(name)
            records.append(RecognitionRecord(
                provider=name, audio_s=round(sec, 3), input_tokens=i, output_tokens=o,
                cents=round(pricing.cents(sec, i, o), 6) if pricing is not None else 0.0,
            ))
        return records


@dataclass
class SessionRecognitionUsage:
    """A session's recognition, for its whole life, per recogniser.

    Attributes:
        audio_s: audio sent, s (replays included).
        connection_s: how long its connections were open, s (providers that
            bill the socket's lifetime bill this).
        reported_audio_s: audio the provider reported billing, s (Deepgram's
            closing ``Metadata.duration``); 0 where it reports none.
        input_tokens / output_tokens: tokens reported.
    """

    audio_s: dict[str, float] = field(default_factory=dict)
    connection_s: dict[str, float] = field(default_factory=dict)
    reported_audio_s: dict[str, float] = field(default_factory=dict)
    input_tokens: dict[str, int] = field(default_factory=dict)
    output_tokens: dict[str, int] = field(default_factory=dict)


#: called when the recogniser failed: (the failed recogniser's name, the
#: error, what happens now, the next recogniser's name or None)
FailoverNotice = Callable[[str, RecognitionError, FailoverAction, str | None], None]


class Transcription:
    """One session's recognition (see the module doc).

    Args:
        failover: the configured recogniser and its fallback.
        options: how the session's streams are opened.
        clock: time source (final timeouts, connection lifetimes).
        final_timeout_s: a segment the provider has not answered this long
            after its finalize fails the stream, s.
        idle_close_s: a stream with nothing waiting on it and no audio sent
            this long is closed (the next utterance opens another), s; None:
            kept for the session's life.
        on_heard: called with an utterance each time an interim or final
            of it arrives (the session's barge-in and backchannel rules
            read :attr:`Utterance.text`); must not block.
        on_failover: told each failure and what followed (the session
            tells the client); must not block.
    """

    def __init__(
        self,
        failover: Failover,
        options: StreamOptions,
        *,
        clock: Clock,
        final_timeout_s: float = 4.0,
        idle_close_s: float | None = IDLE_CLOSE_S,
        on_heard: Callable[[Utterance], None] | None = None,
        on_failover: FailoverNotice | None = None,
    ) -> None:
        self.failover = failover
        self.options = options
        self.clock = clock
        self.final_timeout_s = final_timeout_s
        self.idle_close_s = idle_close_s
        #: clock seconds when audio was last sent
        self._last_audio_at = clock.monotonic()
        self._on_heard = on_heard or (lambda _u: None)
        self._on_failover = on_failover or (lambda *_a: None)
        self._stream: RecognitionStream | None = None
        #: the task reading the current stream's events
        self._reader: asyncio.Task[None] | None = None
        #: idle streams being closed in the background
        self._retiring: set[asyncio.Future[None]] = set()
        self._recogniser: Recogniser | None = None
        self._sent = 0  # bytes sent to the current stream
        #: each open stream's recogniser and when its connection time was
        #: last counted (clock s), until it is closed
        self._connections: dict[RecognitionStream, tuple[str, float]] = {}
        self._open: Segment | None = None
        #: audio seconds sent to the current stream, per segment (taken back
        #: if the stream never reached the provider)
        self._pushed: dict[Segment, float] = {}
        #: segments not complete, discarded or failed, in order
        self._live: list[Segment] = []
        self._wake = asyncio.Event()
        self._closing = False
        self._gave_up = False
        self._pricing = {r.name: r.pricing for r in (failover.primary, failover.fallback) if r is not None}
        self.totals = SessionRecognitionUsage()
        #: the latest segments completed (their usage may come after their final)
        self._recent: list[Segment] = []
        #: provider SpeechStarted / EndOfUtterance times seen, stream s (the latest)
        self.provider_speech_at: float | None = None
        self.provider_end_at: float | None = None

    # -- the session's side ------------------------------------------------------

    def begin(self) -> Utterance:
        """A new utterance (no audio is sent until it is fed)."""
        return Utterance(self)

    @property
    def recogniser(self) -> str:
        """The name of the recogniser in use."""
        return self.failover.current.name

    @property
    def position_s(self) -> float:
        """Stream seconds sent to the current stream."""
        return stream_seconds(self._sent)

    def pricing_of(self, name: str) -> SpeechPricing | None:
        """The pricing of the recogniser called ``name`` (None: unknown)."""
        return self._pricing.get(name)

    def usage(self) -> SessionRecognitionUsage:
        """The session's recognition so far (connection time up to now)."""
        for stream in list(self._connections):
            self._count_connection(stream, closed=False)
        return self.totals

    async def run(self) -> None:
        """Run for the session's life: open the stream, read its events,
        fail over when it fails. Ends after :meth:`aclose`. Never raises
        but for cancellation (a failure is told through ``on_failover`` and
        the utterances waiting)."""
        try:
            await self._pump()
        finally:
            # Also when cancelled (the session ended at once), and cancelled
            # again meanwhile (a task group aborting twice): the stream is
            # closed gracefully and read to its end, so the provider's
            # closing usage (Deepgram's Metadata) is counted; bounded.
            ending = asyncio.ensure_future(self._end(self._reader))
            interrupted = False
            while not ending.done():
                try:
                    await asyncio.shield(ending)
                except asyncio.CancelledError:
                    interrupted = True
            if interrupted:
                raise asyncio.CancelledError

    async def _pump(self) -> None:
        """Read the current stream and fail over, until closed."""
        try:
            while not self._closing:
                stream = self._stream
                if stream is None:
                    self._wake.clear()
                    await self._wake.wait()
                    continue
                reader = self._reader = asyncio.ensure_future(self._consume(stream))
                error = await self._read(reader)
                if self._closing or stream is not self._stream:
                    continue
                if error == "idle":
                    # speech from now on opens another stream at once; this one
                    # is closed gracefully meanwhile (its usage is read)
                    self._stream = None
                    retiring = asyncio.ensure_future(self._retire(stream, reader))
                    self._retiring.add(retiring)
                    retiring.add_done_callback(self._retiring.discard)
                    continue
                await _cancelled(reader)
                if error is None:
                    error = RecognitionError("closed", f"{self.recogniser} ended the stream")
                if not self._live and error.kind in ("closed", "dropped"):
                    # nothing was waiting on it (a provider's idle close, a
                    # connection lost in a silence): the next utterance opens another
                    log.debug("recognition stream of %s ended while idle (%s)", self.recogniser, error)
                    self._count_connection(stream)
                    self._stream = None
                    continue
                self._fail_over(error)
        finally:
            self._closing = True

    async def _end(self, reader: asyncio.Task[None] | None) -> None:
        """Close the current stream gracefully and let ``reader`` read its
        last events (both bounded by ``CLOSE_TIMEOUT_S``); the segments
        still waiting fail."""
        stream = self._stream
        if stream is not None:
            await self._retire(stream, reader)
        elif reader is not None:
            await _cancelled(reader)
        if self._retiring:  # idle streams still saying goodbye (each bounded)
            await asyncio.wait(set(self._retiring))
        for seg in list(self._live):
            self._fail(seg, "the session ended")

    async def _retire(self, stream: RecognitionStream, reader: asyncio.Task[None] | None) -> None:
        """Close ``stream`` gracefully and let ``reader`` read its last
        events (its usage), both bounded by ``CLOSE_TIMEOUT_S``; its
        connection time is counted, and the next audio opens another."""
        if reader is None:  # closed before anything read it (ended at once after its first audio)
            reader = asyncio.ensure_future(self._consume(stream))
        await self._close(stream)
        if reader is not None and not reader.done():
            with contextlib.suppress(TimeoutError):
                async with timeout_after(self.clock, CLOSE_TIMEOUT_S):
                    await asyncio.wait({reader})
        if reader is not None:
            await _cancelled(reader)
        if self._stream is stream:
            self._stream = None

    def close(self) -> None:
        """The session ends: no more audio is taken; :meth:`run` closes the
        stream gracefully (its last usage read, bounded by
        ``CLOSE_TIMEOUT_S``) and ends. Nothing here awaits, so a session
        cancelled while it closes cannot cut the provider's goodbye short:
        :meth:`run`'s own ending does it, cancelled or not."""
        self._closing = True
        self._wake.set()

    # -- audio ---------------------------------------------------------------

    def _send(self, utt: Utterance, pcm: bytes) -> None:
        if self._closing or not pcm:
            return
        seg = self._open
        if seg is not None and seg.utterance is not utt:
            self._finalize(seg.utterance)  # never two utterances in one segment
            seg = None
        if seg is None:
            if self._stream is None:  # opened for the first speech, after an idle close, or afresh after giving up
                recogniser = self.failover.restart() if self._gave_up else self.failover.current
                self._gave_up = False
                self._switch(recogniser)
            seg = Segment(utt)
            utt.segments.append(seg)
            self._live.append(seg)
            self._open = seg
            if self._stream is not None:
                seg.start_s = self.position_s
        seg.audio += pcm
        if self._stream is not None:
            self._push(seg, pcm)

    def _push(self, seg: Segment, pcm: bytes) -> None:
        assert self._stream is not None and self._recogniser is not None
        self._stream.send(pcm)
        self._sent += len(pcm)
        self._last_audio_at = self.clock.monotonic()
        name = self._recogniser.name
        sec = len(pcm) / STREAM_BYTES_PER_S
        seg.sent_s[name] = seg.sent_s.get(name, 0.0) + sec
        self.totals.audio_s[name] = self.totals.audio_s.get(name, 0.0) + sec
        self._pushed[seg] = self._pushed.get(seg, 0.0) + sec

    def _unsend(self, name: str) -> None:
        """The current stream never reached ``name`` (refused, unreachable):
        the audio given to it was not sent anywhere, and is not billed."""
        for seg, sec in self._pushed.items():
            seg.sent_s[name] = max(0.0, seg.sent_s.get(name, 0.0) - sec)
            if not seg.sent_s[name]:
                del seg.sent_s[name]
            self.totals.audio_s[name] = max(0.0, self.totals.audio_s.get(name, 0.0) - sec)
        self._pushed.clear()

    def _finalize(self, utt: Utterance) -> None:
        seg = self._open
        if seg is None or seg.utterance is not utt:
            return
        self._open = None
        seg.state = "finalizing"
        seg.finalized_at = self.clock.monotonic()
        if self._stream is not None:
            seg.end_s = self.position_s
            self._stream.finalize()
            if seg.finals and max(f.end_s for f in seg.finals) >= seg.end_s - END_TOLERANCE_S:
                self._complete(seg)  # its finals already reach its end: the finalize's answer adds nothing
        self._wake.set()

    def _hint(self, utt: Utterance, *, paused: bool) -> None:
        """Pass a pause hint on, if ``utt`` is being sent and the stream takes them."""
        seg = self._open
        if seg is None or seg.utterance is not utt or not isinstance(self._stream, PauseHints):
            return
        if paused:
            self._stream.speech_paused()
        else:
            self._stream.speech_resumed()

    async def _short_words(self, utt: Utterance) -> str | None:
        """A short decode of ``utt``'s open segment, if it is being sent
        and the stream has one (:meth:`voice.segmented_stt.SegmentedStream.decode_short`)."""
        seg = self._open
        decode_short = getattr(self._stream, "decode_short", None)
        if seg is None or seg.utterance is not utt or seg.finals or decode_short is None:
            return None
        text: str | None = await decode_short()
        return text

    def _discard(self, utt: Utterance) -> None:
        seg = self._open
        if seg is None or seg.utterance is not utt:
            return
        self._open = None
        seg.state = "discarded"
        seg.audio = bytearray()
        self._live.remove(seg)
        seg.done.set()
        if self._stream is not None:
            self._stream.discard()

    # -- the stream ------------------------------------------------------------

    def _switch(self, recogniser: Recogniser) -> None:
        """Open a stream on ``recogniser`` and send it every segment not yet
        complete: the audio after its last final, finalized again if it was."""
        self._recogniser = recogniser
        self._stream = recogniser.open(self.options)
        self._reader = None
        self._pushed.clear()
        self._sent = 0
        self._connections[self._stream] = (recogniser.name, self.clock.monotonic())
        self._wake.set()
        for seg in self._live:
            seg.start_s = self.position_s - seg.kept_from_s
            seg.interim = None
            if seg.audio:
                self._push(seg, bytes(seg.audio))
            if seg.state == "finalizing":
                seg.end_s = self.position_s
                seg.finalized_at = self.clock.monotonic()
                if seg.audio:
                    self._stream.finalize()
                else:
                    self._complete(seg)  # its finals had it all
        self._live = [s for s in self._live if s.state in ("open", "finalizing")]

    async def _read(self, reader: asyncio.Task[None]) -> RecognitionError | Literal["idle"] | None:
        """Wait while ``reader`` consumes the stream's events, until it ends
        (None), fails, the session closes (None; ``reader`` is left to
        read the stream's last events), a finalized segment is left
        unanswered past ``final_timeout_s`` (the error), or nothing was
        sent nor waited for ``idle_close_s`` (``"idle"``)."""
        while True:
            self._wake.clear()
            waits: set[asyncio.Future[object]] = {reader, asyncio.ensure_future(self._wake.wait())}  # type: ignore[arg-type]
            overdue_at = self._next_deadline()
            if overdue_at is not None:
                waits.add(asyncio.ensure_future(self.clock.sleep(max(0.0, overdue_at - self.clock.monotonic()))))
            idle_at = self._idle_at()
            if idle_at is not None:
                waits.add(asyncio.ensure_future(self.clock.sleep(max(0.0, idle_at - self.clock.monotonic()))))
            try:
                await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for w in waits - {reader}:
                    w.cancel()
            if reader.done():
                exc = reader.exception()
                if exc is None or isinstance(exc, RecognitionError):
                    return exc
                return RecognitionError("protocol", f"{self.recogniser}: {type(exc).__name__}: {exc}")
            if self._closing:
                return None
            idle_at = self._idle_at()
            if idle_at is not None and self.clock.monotonic() >= idle_at:
                return "idle"
            deadline = self._next_deadline()
            if deadline is not None and self.clock.monotonic() >= deadline:
                return RecognitionError(
                    "timeout", f"{self.recogniser} gave no final within {self._timeout_s():g} s of an utterance's end"
                )

    def _next_deadline(self) -> float | None:
        """When the earliest final owed is overdue: its finalize, plus the
        recogniser's bound, plus a quarter of the segment's length (a
        whole-file recogniser uploads and decodes a 60 s utterance for
        longer than a 1 s one)."""
        due = [
            s.finalized_at + self._timeout_s() + FINAL_SLACK_PER_AUDIO_S * stream_seconds(len(s.audio))
            for s in self._live if s.state == "finalizing" and s.finalized_at is not None
        ]
        return min(due) if due else None

    def _idle_at(self) -> float | None:
        """When the stream may be closed for idleness (None: not now)."""
        if self.idle_close_s is None or self._live:
            return None
        return self._last_audio_at + self.idle_close_s

    def _timeout_s(self) -> float:
        """How long the recogniser in use may owe a final: its own bound
        (an embedded pool that queues utterances when busy is slow, not
        broken: replaying to it would only add load), else the session's."""
        own = self._recogniser.final_timeout_s if self._recogniser is not None else None
        return own if own is not None else self.final_timeout_s

    async def _consume(self, stream: RecognitionStream) -> None:
        name = self.recogniser
        async for ev in stream.events():
            if stream is self._stream:
                self._on_event(ev)
            elif isinstance(ev, RecognitionUsage):
                self._add_usage(ev, name)  # a stream being closed tells what it billed; its words are for no one now

    def _fail_over(self, error: RecognitionError) -> None:
        failed = self.recogniser
        if error.kind in ("unauthorized", "unreachable"):
            self._unsend(failed)
        stream, self._stream = self._stream, None
        if stream is not None:
            closing = asyncio.ensure_future(self._close(stream))
            closing.add_done_callback(lambda f: f.cancelled() or f.exception())
        nxt, action = self.failover.after(error)
        # a refused key was logged once, naming the setting, when the recogniser started
        log.log(logging.INFO if error.kind == "unauthorized" else logging.WARNING,
                "recognition by %s failed (%s: %s); %s", failed, error.kind, error,
                {"reconnect": "reconnecting", "fallback": "falling back", "failed": "giving up"}[action])
        self._on_failover(failed, error, action, nxt.name if nxt is not None else None)
        if nxt is not None:
            self._switch(nxt)
            return
        self._gave_up = True
        self._recogniser = None
        self._open = None
        for seg in list(self._live):
            seg.utterance.ended = True
            self._fail(seg, f"{failed}: {error}")

    async def _close(self, stream: RecognitionStream) -> None:
        try:
            async with timeout_after(self.clock, CLOSE_TIMEOUT_S):
                await stream.aclose()
        except (TimeoutError, RecognitionError, OSError):
            pass
        finally:
            self._count_connection(stream)

    def _count_connection(self, stream: RecognitionStream, *, closed: bool = True) -> None:
        """Add ``stream``'s connection time since it was last counted;
        ``closed``: it is over (counted no more)."""
        entry = self._connections.pop(stream, None) if closed else self._connections.get(stream)
        if entry is None:
            return
        name, since = entry
        now = self.clock.monotonic()
        self.totals.connection_s[name] = self.totals.connection_s.get(name, 0.0) + max(0.0, now - since)
        if not closed:
            self._connections[stream] = (name, now)

    # -- events ----------------------------------------------------------------

    def _on_event(self, ev: RecognitionEvent) -> None:
        if isinstance(ev, (Interim, Final)):
            seg = self._segment_for(ev.start_s, ev.end_s)
            if seg is None:
                return
            if isinstance(ev, Interim):
                seg.interim = ev
            else:
                self._add_final(seg, ev)
            seg.utterance._updated()
            self._on_heard(seg.utterance)
        elif isinstance(ev, EndOfUtterance):
            self.provider_end_at = ev.at_s
        elif isinstance(ev, SpeechStarted):
            self.provider_speech_at = ev.at_s
        elif isinstance(ev, RecognitionUsage):
            self._add_usage(ev)

    def _segment_for(self, start_s: float, end_s: float) -> Segment | None:
        """The live segment whose audio ``start_s``..``end_s`` overlaps most
        (an instant: the segment it falls in, or at the end of). None if
        the audio is none of theirs (a discarded stretch, a segment
        already complete): such an event is dropped."""
        best: Segment | None = None
        best_overlap = 0.0
        for seg in self._live:
            if seg.start_s is None:
                continue
            seg_end = seg.end_s if seg.end_s is not None else float("inf")
            if end_s - start_s <= 0:
                # an instant at a segment's very start is the end of the one before
                inside = seg.start_s + END_TOLERANCE_S < start_s <= seg_end + END_TOLERANCE_S
                if inside and best is None:
                    best = seg
                continue
            overlap = min(end_s, seg_end) - max(start_s, seg.start_s)
            if overlap > best_overlap:
                best, best_overlap = seg, overlap
        return best

    def _add_final(self, seg: Segment, ev: Final) -> None:
        seg.finals.append(ev)
        seg.finals.sort(key=lambda f: f.start_s)
        seg.interim = None
        if seg.start_s is not None:
            # what a replay needs is only the audio after this final
            cut_s = min(max(0.0, ev.end_s - seg.start_s), stream_seconds(len(seg.audio)) + seg.kept_from_s)
            drop = int((cut_s - seg.kept_from_s) * STREAM_BYTES_PER_S) // 2 * 2
            if drop > 0:
                del seg.audio[:drop]
                seg.kept_from_s += drop / STREAM_BYTES_PER_S
        if seg.state == "finalizing" and seg.end_s is not None and (ev.finalized or ev.end_s >= seg.end_s - END_TOLERANCE_S):
            self._complete(seg)

    def _add_usage(self, ev: RecognitionUsage, name: str | None = None) -> None:
        name = name or (self.recogniser if self._recogniser is None else self._recogniser.name)
        t = self.totals
        if ev.source == "provider":  # what it reported billing; what a client counted is audio_s's business
            t.reported_audio_s[name] = t.reported_audio_s.get(name, 0.0) + ev.audio_s
        t.input_tokens[name] = t.input_tokens.get(name, 0) + ev.input_tokens
        t.output_tokens[name] = t.output_tokens.get(name, 0) + ev.output_tokens
        if ev.start_s is not None and ev.end_s is not None and (ev.input_tokens or ev.output_tokens):
            seg = self._segment_for(ev.start_s, ev.end_s) or self._recent_for(ev.start_s, ev.end_s)
            if seg is not None:
                i, o = seg.tokens.get(name, (0, 0))
                seg.tokens[name] = (i + ev.input_tokens, o + ev.output_tokens)

    def _recent_for(self, start_s: float, end_s: float) -> Segment | None:
        """A segment completed a moment ago whose audio this is (usage often
        comes with or after the final that completed it)."""
        for seg in reversed(self._recent):
            if seg.start_s is not None and seg.end_s is not None and min(end_s, seg.end_s) - max(start_s, seg.start_s) >= 0:
                return seg
        return None

    def _complete(self, seg: Segment) -> None:
        if seg.state not in ("open", "finalizing"):
            return
        seg.state = "complete"
        seg.audio = bytearray()
        if seg in self._live:
            self._live.remove(seg)
        self._recent = [*self._recent[-7:], seg]
        if self._open is seg:
            self._open = None
        seg.done.set()
        self.failover.recovered()

    def _fail(self, seg: Segment, why: str) -> None:
        if seg.state not in ("open", "finalizing"):
            return
        seg.state = "failed"
        seg.error = why
        seg.audio = bytearray()
        if seg in self._live:
            self._live.remove(seg)
        if self._open is seg:
            self._open = None
        seg.done.set()


async def _cancelled(task: asyncio.Task[None]) -> None:
    """Cancel ``task`` if it still runs and wait until it has ended (its
    own exception is the caller's business, read or not)."""
    if not task.done():
        task.cancel()
    await asyncio.wait({task})
    if not task.cancelled():
        task.exception()  # read: a failed reader was already told as the stream's failure
