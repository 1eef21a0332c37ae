"""Speech to text with pocketsphinx (CMU Sphinx), offline.

The bundled US English acoustic model and language model are used by default
(free-form recognition). A JSGF grammar file (W3C JSpeech Grammar Format)
restricts recognition to its phrases, which makes it exact for a known set of
test phrases.

One :class:`PocketsphinxSTT` serves the whole server. It keeps a small pool of
decoders (each about 80 MB, 0.4 s to load), each with its own worker thread,
because a pocketsphinx decoder must not be used by two utterances at once. An
utterance holds one decoder from its first frame to its final hypothesis;
audio is decoded on that thread while the user is still speaking, so
``finish()`` only waits for the tail. When every decoder is busy, a new
utterance's audio waits in memory until one is free.
"""

from __future__ import annotations

import asyncio
import logging
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field

from media.frames import VAD_RATE

log = logging.getLogger(__name__)

#: most audio an utterance keeps while it waits for a decoder (s at 16 kHz)
MAX_PENDING_S = 60


class PocketsphinxConfig(BaseModel):
    """STT settings (env ``TURNKEEPER_STT__*``).

    Attributes:
        grammar: optional JSGF file; None means free-form with the bundled LM.
        max_decoders: utterances decoded at the same time, across all
            sessions (each decoder costs about 80 MB and one thread).
    """

    grammar: Path | None = None
    max_decoders: int = Field(4, ge=1, le=64)


class SttError(RuntimeError):
    """Recognition failed (model not loadable, decoder error)."""


class _Decoder:
    """One pocketsphinx Decoder and the single thread that may touch it."""

    def __init__(self, config: PocketsphinxConfig) -> None:
        self.executor = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stt")
        self.config = config
        self.decoder: Any = None
        self.broken: BaseException | None = None
        #: an utterance is open on the decoder (touched only on its thread)
        self.in_utterance = False
        self.loaded = self.submit(self._load)

    def submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        return asyncio.get_running_loop().run_in_executor(self.executor, fn, *args)

    def _load(self) -> None:
        try:
            from pocketsphinx import Decoder

            kwargs: dict[str, Any] = {"samprate": VAD_RATE, "loglevel": "FATAL"}
            if self.config.grammar is not None:
                if not self.config.grammar.is_file():
                    raise FileNotFoundError(f"JSGF grammar not found: {self.config.grammar}")
                kwargs["jsgf"] = str(self.config.grammar)
            self.decoder = Decoder(**kwargs)
        except BaseException as exc:
            self.broken = exc
            raise

    def get(self) -> Any:
        """The decoder, on its own thread (calls queue behind the load)."""
        if self.decoder is None:
            raise SttError(f"speech model failed to load: {self.broken}")
        return self.decoder


class PocketsphinxSTT:
    """:class:`voice.providers.SpeechToText` over a pool of pocketsphinx decoders.

    Args:
        config: grammar and pool size.
    """

    def __init__(self, config: PocketsphinxConfig | None = None) -> None:
        self.config = config or PocketsphinxConfig()
        self._all: list[_Decoder] = []
        self._free: asyncio.Queue[_Decoder] | None = None
        self._closed = False
        self._started = False

    @property
    def decoders(self) -> int:
        """Decoders loaded (or loading) now."""
        return len(self._all)

    async def start(self) -> None:
        """Load one decoder now, so configuration errors show at startup.

        Raises:
            FileNotFoundError: the configured grammar file is missing.
            RuntimeError: pocketsphinx cannot load the model or grammar.
        """
        if self._started:
            return
        dec = self._acquire_nowait() or await self._acquire()
        try:
            await dec.loaded
        finally:
            self._release(dec)
        self._started = True

    def open_stream(self) -> "PocketsphinxStream":
        """Begin an utterance (never blocks; audio waits if no decoder is free).

        Raises:
            RuntimeError: after :meth:`aclose`.
        """
        if self._closed:
            raise RuntimeError("STT is closed")
        return PocketsphinxStream(self)

    async def aclose(self) -> None:
        """Stop every decoder thread, after the calls already queued. Idempotent."""
        if self._closed:
            return
        self._closed = True
        loop = asyncio.get_running_loop()
        for dec in self._all:
            await loop.run_in_executor(None, dec.executor.shutdown, True)
        self._all.clear()

    # -- the pool ------------------------------------------------------------------

    def _queue(self) -> asyncio.Queue[_Decoder]:
        if self._free is None:
            self._free = asyncio.Queue()
        return self._free

    def _acquire_nowait(self) -> _Decoder | None:
        free = self._queue()
        if not free.empty():
            return free.get_nowait()
        if len(self._all) < self.config.max_decoders:
            dec = _Decoder(self.config)
            self._all.append(dec)
            return dec
        return None

    async def _acquire(self) -> _Decoder:
        if self._closed:
            raise RuntimeError("STT is closed")
        dec = self._acquire_nowait()
        if dec is not None:
            return dec
        # No suspension between get() returning and the caller storing it,
        # so a cancelled waiter never loses a decoder.
        return await self._queue().get()

    def _release(self, dec: _Decoder) -> None:
        if self._closed:
            return
        if dec.broken is not None:
            self._all.remove(dec)  # a decoder that failed to load is not reused
            dec.executor.shutdown(wait=False)
            return
        self._queue().put_nowait(dec)


class PocketsphinxStream:
    """One utterance. Its calls run in order on its decoder's thread.

    The decoder is held from the first frame until ``finish`` or ``aclose``
    has run on the thread, and is then handed back to the pool, whatever
    happens to the awaiting task.
    """

    def __init__(self, owner: PocketsphinxSTT) -> None:
        self._owner = owner
        self._decoder: _Decoder | None = None
        self._pending: list[bytes] = []
        self._pending_bytes = 0
        self._ended = False
        self._error: BaseException | None = None
        self._attached = asyncio.get_running_loop().create_task(self._attach())
        # its failure (STT closed) is reported by finish(); don't also log it
        self._attached.add_done_callback(lambda t: t.cancelled() or t.exception())

    async def _attach(self) -> None:
        dec = await self._owner._acquire()
        self._decoder = dec
        self._submit(self._start_utt)
        for pcm in self._pending:
            self._submit(self._process, pcm)
        self._pending.clear()

    def _submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        assert self._decoder is not None
        fut = self._decoder.submit(fn, self._decoder, *args)
        fut.add_done_callback(self._note_error)
        return fut

    def _note_error(self, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None and self._error is None:
            self._error = fut.exception()

    def feed(self, pcm: bytes) -> None:
        """Queue 16 kHz mono s16 audio for decoding (never blocks). Audio fed
        after ``finish``/``aclose`` is ignored; while waiting for a decoder,
        at most ``MAX_PENDING_S`` seconds are kept (the oldest is dropped)."""
        if self._ended or not pcm:
            return
        if self._decoder is not None:
            self._submit(self._process, pcm)
            return
        self._pending.append(pcm)
        self._pending_bytes += len(pcm)
        while self._pending_bytes > MAX_PENDING_S * VAD_RATE * 2 and len(self._pending) > 1:
            self._pending_bytes -= len(self._pending.pop(0))

    async def finish(self) -> str:
        """End the utterance; return the best hypothesis in lower case ("" if
        nothing was recognised).

        Raises:
            RuntimeError: finished or closed already.
            SttError: the decoder failed on this utterance.
        """
        if self._ended:
            raise RuntimeError("utterance already finished")
        self._ended = True
        await asyncio.shield(self._attached)  # raises RuntimeError if STT closed meanwhile
        fut = self._end(self._end_utt)
        text = await fut
        if self._error is not None:
            raise SttError(f"recognition failed: {self._error}") from self._error
        return text

    async def aclose(self) -> None:
        """Abandon the utterance. Idempotent, also after ``finish``."""
        if self._ended:
            return
        self._ended = True
        if not self._attached.done():
            self._attached.cancel()
        await asyncio.wait({self._attached})  # never raises; we only need it settled
        if self._decoder is not None:
            await asyncio.wait({self._end(self._abandon)})

    def _end(self, fn: Any) -> asyncio.Future[Any]:
        """Run the last call of the utterance and give the decoder back once
        it has run, even if nobody awaits the result any more."""
        dec = self._decoder
        assert dec is not None
        fut = self._submit(fn)
        fut.add_done_callback(lambda _: self._owner._release(dec))
        return fut

    # -- on the decoder's thread -------------------------------------------------

    # On the decoder's thread. pocketsphinx crashes the process if audio is
    # processed outside an utterance, so every call checks the state first.

    @staticmethod
    def _start_utt(dec: _Decoder) -> None:
        d = dec.get()
        if dec.in_utterance:  # a previous user never ended it: end it now
            d.end_utt()
        d.start_utt()
        dec.in_utterance = True

    @staticmethod
    def _process(dec: _Decoder, pcm: bytes) -> None:
        if dec.in_utterance:
            dec.get().process_raw(pcm, False, False)

    @staticmethod
    def _end_utt(dec: _Decoder) -> str:
        if not dec.in_utterance:
            raise SttError("no utterance is open on the decoder")
        d = dec.get()
        dec.in_utterance = False
        d.end_utt()
        hyp = d.hyp()
        return (hyp.hypstr if hyp is not None else "").strip()

    @staticmethod
    def _abandon(dec: _Decoder) -> None:
        if dec.in_utterance:
            dec.in_utterance = False
            dec.get().end_utt()
