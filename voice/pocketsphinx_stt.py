"""Speech to text with pocketsphinx (CMU Sphinx), offline.

The bundled US English acoustic model and language model are used by default
(free-form recognition). A JSGF grammar file (W3C JSpeech Grammar Format)
restricts recognition to its phrases, which makes it exact for a known set of
test phrases.

One :class:`PocketsphinxSTT` serves the whole server with a pool of
decoders, each in its own worker process (see :mod:`voice.pocketsphinx_worker`:
pocketsphinx holds the GIL while it works, which in-process would stall every
session's audio pacing and barge-in for up to half a second). All decoders
load at :meth:`PocketsphinxSTT.start`, before the server serves anyone. An
utterance holds one decoder from its first frame to its final hypothesis;
its audio is sent in ~100 ms batches and decoded while the user still
speaks, so ``finish()`` only waits for the tail. When every decoder is busy,
a new utterance's audio waits in memory until one is free. A worker that
dies is replaced.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures.process import BrokenProcessPool
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, field_validator

from media.frames import VAD_RATE
from voice import pocketsphinx_worker
from voice.recognition import SpeechPricing, StreamOptions, SttAdaptation, SttError, Word
from voice.segmented_stt import SegmentedStream
from voice.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)

#: most audio an utterance keeps while it waits for a decoder (s at 16 kHz)
MAX_PENDING_S = 60
#: audio sent to the worker per message, bytes (100 ms at 16 kHz s16)
BATCH_BYTES = VAD_RATE * 2 // 10


class PocketsphinxConfig(BaseModel):
    """STT settings (env ``TURNKEEPER_STT__*``).

    Attributes:
        grammar: optional JSGF file; None means free-form with the bundled LM.
        max_decoders: utterances decoded at the same time, across all
            sessions (each decoder is one worker process of about 80 MB).
        cmn_start: the cepstral mean a session's first utterance starts
            from (later ones start from what the session's last recognised
            utterance settled at), so no other session's audio changes how
            this one is heard (:mod:`voice.pocketsphinx_worker`): ``"model"`` (the
            acoustic model's own ``cmninit``, the default), ``"speech"``
            (a starting point measured on speech: fewer errors on free-form
            first words, see :data:`voice.pocketsphinx_worker.SPEECH_CMN`) or 13
            comma-separated numbers.
    """

    grammar: Path | None = None
    max_decoders: int = Field(2, ge=1, le=64)
    cmn_start: str = "model"

    @field_validator("cmn_start")
    @classmethod
    def _cmn_start_known(cls, value: str) -> str:
        pocketsphinx_worker.cmn_vector(value, "")
        return value


class PocketsphinxSTT:
    """:class:`voice.providers.UtteranceRecogniser` over a pool of pocketsphinx
    worker processes, and a :class:`voice.recognition.Recogniser` whose
    session streams it segments by our endpointing (:meth:`open`).

    Args:
        config: grammar and pool size.
    """

    name = "pocketsphinx"
    #: it runs here: its audio costs nothing but CPU
    pricing = SpeechPricing()
    #: a busy pool queues utterances until a decoder is free (a dead worker
    #: is found and replaced by the pool itself): a long bound, only so
    #: that nothing ever waits forever, s
    final_timeout_s: float | None = 30.0

    def __init__(self, config: PocketsphinxConfig | None = None) -> None:
        self.config = config or PocketsphinxConfig()
        grammar = str(self.config.grammar) if self.config.grammar is not None else None
        self.pool = WorkerPool(
            self.config.max_decoders,
            lambda: Worker(pocketsphinx_worker.init, (grammar, self.config.cmn_start), pocketsphinx_worker.ping),
        )

    @property
    def decoders(self) -> int:
        """Decoders loaded (or loading) now."""
        return len(self.pool)

    async def start(self) -> None:
        """Load every decoder now (in parallel worker processes), so
        configuration errors show at startup and no later utterance waits
        for a model to load. Idempotent.

        Raises:
            FileNotFoundError: the configured grammar file is missing.
            RuntimeError: pocketsphinx cannot load the model or grammar.
        """
        if self.pool.started:
            return
        if self.config.grammar is not None and not self.config.grammar.is_file():
            raise FileNotFoundError(f"JSGF grammar not found: {self.config.grammar}")
        await self.pool.start()

    def open_stream(self, adaptation: SttAdaptation | None = None) -> PocketsphinxStream:
        """Begin an utterance (never blocks; audio waits if no decoder is
        free), from the session's ``adaptation`` (the cepstral mean its
        last recognised utterance settled at) or from ``cmn_start``; a
        recognised utterance (non-empty text) updates ``adaptation``.

        Raises:
            RuntimeError: after :meth:`aclose`.
        """
        if self.pool.closed:
            raise RuntimeError("STT is closed")
        return PocketsphinxStream(self, adaptation)

    def open(self, options: StreamOptions) -> SegmentedStream:
        """One session's recognition stream: each stretch between two
        ``finalize``/``discard`` calls is one utterance on the pool
        (:class:`voice.segmented_stt.SegmentedStream`), from the session's
        adaptation."""
        return SegmentedStream(self, options)

    async def aclose(self) -> None:
        """Stop every worker process, after the calls already queued. Idempotent."""
        await self.pool.aclose()


class PocketsphinxStream:
    """One utterance. Its calls run in order on its decoder's worker.

    The decoder is held from the first frame until ``finish`` or ``aclose``
    has run in the worker, and is then handed back to the pool, whatever
    happens to the awaiting task.
    """

    def __init__(self, owner: PocketsphinxSTT, adaptation: SttAdaptation | None = None) -> None:
        self._owner = owner
        self._adaptation = adaptation
        self._decoder: Worker | None = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._batch = bytearray()
        self._ended = False
        self._error: BaseException | None = None
        #: the words of the finished utterance, seconds from its start (after :meth:`finish`)
        self.words: list[Word] = []
        #: pocketsphinx gives no confidence of a whole transcript here
        self.confidence: float | None = None
        self._attached = asyncio.get_running_loop().create_task(self._attach())
        # its failure (STT closed) is reported by finish(); don't also log it
        self._attached.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _attach(self) -> None:
        dec = await self._owner.pool.acquire()
        self._decoder = dec
        self._submit(pocketsphinx_worker.start, self._adaptation.state if self._adaptation is not None else None)
        if self._pending:
            self._submit(pocketsphinx_worker.process, b"".join(self._pending))
        self._pending.clear()

    def _submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        assert self._decoder is not None
        fut = self._decoder.submit(fn, *args)
        fut.add_done_callback(self._note_error)
        return fut

    def _note_error(self, fut: asyncio.Future[Any]) -> None:
        if fut.cancelled():
            return
        exc = fut.exception()
        if exc is not None:
            if self._error is None:
                self._error = exc
            if isinstance(exc, BrokenProcessPool) and self._decoder is not None:
                self._decoder.broken = exc

    def feed(self, pcm: bytes) -> None:
        """Queue 16 kHz mono s16 audio for decoding (never blocks; sent to the
        worker in ~100 ms batches). Audio fed after ``finish``/``aclose`` is
        ignored; while waiting for a decoder, at most ``MAX_PENDING_S``
        seconds are kept (the oldest is dropped)."""
        if self._ended or not pcm:
            return
        self._batch += pcm
        if len(self._batch) >= BATCH_BYTES:
            self._send_batch()

    def _send_batch(self) -> None:
        if not self._batch:
            return
        chunk, self._batch = bytes(self._batch), bytearray()
        if self._decoder is not None:
            self._submit(pocketsphinx_worker.process, chunk)
            return
        self._pending.append(chunk)
        self._pending_bytes += len(chunk)
        while self._pending_bytes > MAX_PENDING_S * VAD_RATE * 2 and len(self._pending) > 1:
            self._pending_bytes -= len(self._pending.pop(0))

    async def finish(self) -> str:
        """End the utterance; return the best hypothesis in lower case ("" if
        nothing was recognised).

        Raises:
            RuntimeError: finished or closed already.
            SttError: the decoder or its worker failed on this utterance.
        """
        if self._ended:
            raise RuntimeError("utterance already finished")
        self._send_batch()
        self._ended = True
        await asyncio.shield(self._attached)  # raises RuntimeError if STT closed meanwhile
        try:
            text, cmn, words = await self._end(pocketsphinx_worker.end)
        except BrokenProcessPool as exc:
            raise SttError(f"speech worker died: {exc}") from exc
        except RuntimeError as exc:
            raise SttError(f"recognition failed: {exc}") from exc
        if self._error is not None:
            raise SttError(f"recognition failed: {self._error}") from self._error
        if text and self._adaptation is not None:
            self._adaptation.state = cmn  # this session's next utterance starts here
        self.words = [Word(w, start, end, prob) for w, start, end, prob in words]
        return text

    async def partial(self) -> str:
        """The best hypothesis so far of the utterance being decoded ("" if
        none yet): after the audio fed so far has been decoded.

        Raises:
            RuntimeError: finished or closed already.
            SttError: the decoder or its worker failed.
        """
        if self._ended:
            raise RuntimeError("utterance already finished")
        self._send_batch()
        await asyncio.shield(self._attached)
        try:
            return str(await self._submit(pocketsphinx_worker.partial))
        except (BrokenProcessPool, RuntimeError) as exc:
            raise SttError(f"recognition failed: {exc}") from exc

    async def aclose(self) -> None:
        """Abandon the utterance. Idempotent, also after ``finish``."""
        if self._ended:
            return
        self._ended = True
        self._batch.clear()
        if not self._attached.done():
            self._attached.cancel()
        await asyncio.wait({self._attached})  # never raises; we only need it settled
        if self._decoder is not None:
            await asyncio.wait({self._end(pocketsphinx_worker.abandon)})

    def _end(self, fn: Any) -> asyncio.Future[Any]:
        """Run the last call of the utterance and give the decoder back once
        it has run, even if nobody awaits the result any more."""
        dec = self._decoder
        assert dec is not None
        fut = self._submit(fn)
        fut.add_done_callback(lambda _: self._owner.pool.release(dec))
        return fut
