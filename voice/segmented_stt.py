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
    StreamOptions,
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

    def send(self, pcm: bytes) -> None:
        """Feed 16 kHz mono s16 audio to the open segment (opening one)."""
        if self._closed or not pcm:
            return
        if self._current is None:
            self._current = self._recogniser.open_stream(self._adaptation)
            self._start_s = stream_seconds(self._sent)
        self._current.feed(pcm)
        self._sent += len(pcm)

    def finalize(self) -> None:
        """Decode the open segment; its final comes out of :meth:`events`."""
        stream, self._current = self._current, None
        if stream is None or self._closed:
            return
        task = asyncio.get_running_loop().create_task(self._decode(stream, self._start_s, stream_seconds(self._sent)))
        self._decoding.add(task)
        task.add_done_callback(self._decoding.discard)

    def discard(self) -> None:
        """Abandon the open segment (nothing is decoded)."""
        stream, self._current = self._current, None
        if stream is not None:
            task = asyncio.get_running_loop().create_task(stream.aclose())
            self._decoding.add(task)
            task.add_done_callback(self._decoding.discard)

    async def _decode(self, stream: UtteranceStream, start_s: float, end_s: float) -> None:
        try:
            text = await stream.finish()
        except Exception as exc:
            log.warning("embedded recognition failed on a segment: %s", exc)
            self._events.put_nowait(RecognitionError("provider", f"embedded recogniser failed: {exc}"))
            return
        finally:
            await stream.aclose()
        words = tuple(
            Word(w.text, start_s + w.start_s, start_s + w.end_s, w.confidence) for w in stream.words
        )
        self._events.put_nowait(Final(text, start_s, end_s, words=words, finalized=True))
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
