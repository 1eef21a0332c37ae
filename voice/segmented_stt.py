"""A recogniser of whole utterances, segmented by our own endpointing, as a
:class:`voice.recognition.RecognitionStream`.

The embedded recognisers (pocketsphinx, :mod:`voice.pocketsphinx_stt`)
recognise one utterance at a time (:class:`voice.providers.UtteranceRecogniser`).
:class:`SegmentedStream` gives each stretch of audio between two
``finalize``/``discard`` calls its own utterance stream: audio is fed as it
is sent (pocketsphinx decodes while the user still speaks), ``finalize``
ends the utterance and yields its :class:`voice.recognition.Final`
(``finalized``) and an :class:`voice.recognition.EndOfUtterance`,
``discard`` abandons it. This is Pipecat's ``SegmentedSTTService`` and
LiveKit's ``StreamAdapter`` pattern, with our endpointing as the VAD
(shared/reference/speech-providers.md, section 3).

Segments decode side by side when the pool has decoders free, so their
finals may come out of order; each carries its own stream seconds.

A recogniser that decodes whole utterances (Whisper) does its work only at
the end, after our endpointing waited out the user's silence
(``session.endpoint``, 500 ms by default). With a
:class:`voice.recognition.TentativeStream` the stream takes the session's
pause hints (:class:`voice.recognition.PauseHints`): at the user's pause
it decodes the audio so far, while the endpoint wait runs; if the user
does not go on, the finalize takes that decode (the audio after the pause
is the silence the endpoint waited out); if they do, it is dropped and the
whole segment is decoded at its end as usual. A pause the user goes on
from costs one decode that is thrown away.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator

from voice.narrowband import NarrowbandSpeech
from voice.recognition import (
    EndOfUtterance,
    Final,
    RecognitionError,
    RecognitionEvent,
    ShortDecode,
    StreamOptions,
    TentativeStream,
    UtteranceRecogniser,
    UtteranceStream,
    Word,
    stream_seconds,
)

log = logging.getLogger(__name__)


class SegmentedStream:
    """:class:`voice.recognition.RecognitionStream` over an utterance
    recogniser (see the module doc).

    Args:
        utterances: the recogniser (shared by every session; not closed here).
        options: the session's adaptation and band.
    """

    def __init__(self, utterances: UtteranceRecogniser, options: StreamOptions) -> None:
        self._recogniser: UtteranceRecogniser = NarrowbandSpeech(utterances) if options.narrowband else utterances
        self._adaptation = options.adaptation
        self._events: asyncio.Queue[RecognitionEvent | RecognitionError | None] = asyncio.Queue()
        self._current: UtteranceStream | None = None
        self._start_s = 0.0
        self._sent = 0
        self._decoding: set[asyncio.Task[None]] = set()
        self._closed = False
        #: the open segment's decode started at the user's pause, while no speech followed it
        self._tentative: asyncio.Task[str] | None = None
        #: tentative decodes started / taken as the final (for the bench and tests)
        self.tentative_started = 0
        self.tentative_kept = 0

    def send(self, pcm: bytes) -> None:
        """Feed 16 kHz mono s16 audio to the open segment (opening one)."""
        if self._closed or not pcm:
            return
        if self._current is None:
            self._current = self._recogniser.open_stream(self._adaptation)
            self._start_s = stream_seconds(self._sent)
        self._current.feed(pcm)
        self._sent += len(pcm)

    def speech_paused(self) -> None:
        """The user paused: decode the open segment so far, tentatively (a
        recogniser that cannot: nothing). A second pause with no speech
        between keeps the first decode."""
        stream = self._current
        if self._closed or stream is None or self._tentative is not None or not isinstance(stream, TentativeStream):
            return
        self._tentative = asyncio.get_running_loop().create_task(stream.decode_so_far())
        self._tentative.add_done_callback(lambda f: f.cancelled() or f.exception())  # read at finalize, if at all
        self.tentative_started += 1

    async def decode_short(self) -> str | None:
        """The open segment's words so far from a short decode
        (:class:`voice.recognition.ShortDecode`: a backchannel candidate's),
        the segment staying open; None if there is no open segment or its
        recogniser has no short decode.

        Raises:
            voice.recognition.SttError: the decode failed.
        """
        stream = self._current
        if self._closed or stream is None or not isinstance(stream, ShortDecode):
            return None
        return await stream.decode_short()

    def speech_resumed(self) -> None:
        """The user went on: the tentative decode no longer covers the segment."""
        self._drop_tentative()

    def _drop_tentative(self) -> None:
        tentative, self._tentative = self._tentative, None
        if tentative is not None:
            tentative.cancel()  # only the wait: the worker finishes its decode and is given back

    def finalize(self) -> None:
        """Decode the open segment (or take its tentative decode, if the
        user did not speak after it started); its final comes out of
        :meth:`events`."""
        stream, self._current = self._current, None
        tentative, self._tentative = self._tentative, None
        if stream is None or self._closed:
            if tentative is not None:
                tentative.cancel()
            return
        if tentative is not None:
            self.tentative_kept += 1
        task = asyncio.get_running_loop().create_task(
            self._decode(stream, self._start_s, stream_seconds(self._sent), tentative)
        )
        self._decoding.add(task)
        task.add_done_callback(self._decoding.discard)

    def discard(self) -> None:
        """Abandon the open segment (nothing is decoded)."""
        self._drop_tentative()
        stream, self._current = self._current, None
        if stream is not None:
            task = asyncio.get_running_loop().create_task(stream.aclose())
            self._decoding.add(task)
            task.add_done_callback(self._decoding.discard)

    async def _decode(self, stream: UtteranceStream, start_s: float, end_s: float,
                      tentative: asyncio.Task[str] | None = None) -> None:
        try:
            text = await tentative if tentative is not None else await stream.finish()
        except Exception as exc:
            log.warning("embedded recognition failed on a segment: %s", exc)
            self._events.put_nowait(RecognitionError("provider", f"embedded recogniser failed: {exc}"))
            return
        finally:
            await stream.aclose()
        words = tuple(
            Word(w.text, start_s + w.start_s, start_s + w.end_s, w.confidence) for w in stream.words
        )
        self._events.put_nowait(Final(text, start_s, end_s, words=words, confidence=stream.confidence, finalized=True))
        self._events.put_nowait(EndOfUtterance(end_s))

    async def events(self) -> AsyncIterator[RecognitionEvent]:
        """Each finalized segment's final and end, until :meth:`aclose`.

        Raises:
            voice.recognition.RecognitionError: a segment's decode failed
                (a worker died: the pool replaces it).
        """
        while (item := await self._events.get()) is not None:
            if isinstance(item, RecognitionError):
                raise item
            yield item

    async def aclose(self) -> None:
        """Abandon the open segment and any decode under way; end :meth:`events`."""
        if self._closed:
            return
        self._closed = True
        self._drop_tentative()
        stream, self._current = self._current, None
        for task in list(self._decoding):
            task.cancel()
        try:
            if stream is not None:
                await stream.aclose()
            if self._decoding:
                await asyncio.wait(set(self._decoding))
        finally:
            self._events.put_nowait(None)
