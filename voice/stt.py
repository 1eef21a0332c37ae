"""Speech to text with pocketsphinx (CMU Sphinx), offline.

The bundled US English acoustic model and language model are used by default
(free-form recognition). A JSGF grammar file (W3C JSpeech Grammar Format)
restricts recognition to its phrases, which makes it exact for a known set of
test phrases.

Decoding is CPU work, so each session gets one decoder on one worker thread:
audio fed during the utterance is decoded while the user is still speaking,
and ``finish()`` only waits for the tail.
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from media.frames import VAD_RATE


class PocketsphinxConfig(BaseModel):
    """STT settings (env ``TURNKEEPER_STT__*``).

    Attributes:
        grammar: optional JSGF file; None means free-form with the bundled LM.
    """

    grammar: Path | None = None


class PocketsphinxSTT:
    """:class:`voice.providers.SpeechToText` backed by one pocketsphinx Decoder.

    Args:
        config: grammar choice.
    """

    def __init__(self, config: PocketsphinxConfig | None = None) -> None:
        self.config = config or PocketsphinxConfig()
        self._executor: ThreadPoolExecutor | None = ThreadPoolExecutor(max_workers=1, thread_name_prefix="stt")
        self._dec: Any = None  # set on the worker thread by _load
        self._loading: asyncio.Future[None] | None = None

    async def start(self) -> None:
        """Load the model on the worker thread (about 0.4 s). Idempotent.

        Raises:
            FileNotFoundError: the configured grammar file is missing.
        """
        await asyncio.shield(self._ensure_loading())

    def _ensure_loading(self) -> asyncio.Future[None]:
        if self._loading is None:
            self._loading = self._submit(self._load)
        return self._loading

    def _load(self) -> None:
        from pocketsphinx import Decoder

        kwargs: dict[str, Any] = {"samprate": VAD_RATE, "loglevel": "FATAL"}
        if self.config.grammar is not None:
            if not self.config.grammar.is_file():
                raise FileNotFoundError(f"JSGF grammar not found: {self.config.grammar}")
            kwargs["jsgf"] = str(self.config.grammar)
        self._dec = Decoder(**kwargs)

    def open_stream(self) -> "PocketsphinxStream":
        """Begin an utterance. Audio fed before :meth:`start` completes is
        queued on the worker thread behind the model load.

        Raises:
            RuntimeError: after :meth:`aclose`.
        """
        self._ensure_loading()
        return PocketsphinxStream(self)

    async def aclose(self) -> None:
        if self._executor is None:
            return
        executor, self._executor = self._executor, None
        await asyncio.get_running_loop().run_in_executor(None, executor.shutdown, True)
        self._dec = None

    def _submit(self, fn: Any, *args: Any) -> asyncio.Future[Any]:
        if self._executor is None:
            raise RuntimeError("STT is closed")
        return asyncio.get_running_loop().run_in_executor(self._executor, fn, *args)

    def _decoder_sync(self) -> Any:
        """The decoder, on the worker thread (calls queue behind _load)."""
        if self._dec is None:
            raise RuntimeError("STT model is not loaded")
        return self._dec


class PocketsphinxStream:
    """One utterance on a session's decoder. Calls run in order on the worker
    thread; the event loop never waits for decoding except in ``finish``."""

    def __init__(self, owner: PocketsphinxSTT) -> None:
        self._owner = owner
        self._done = False
        _quiet(owner._submit(self._start_utt))

    def _start_utt(self) -> None:
        self._owner._decoder_sync().start_utt()

    def feed(self, pcm: bytes) -> None:
        if self._done or not pcm:
            return
        _quiet(self._owner._submit(self._process, pcm))

    def _process(self, pcm: bytes) -> None:
        self._owner._decoder_sync().process_raw(pcm, False, False)

    async def finish(self) -> str:
        """Return the best hypothesis (lower case words), "" if nothing.

        Raises:
            RuntimeError: finished or closed already.
        """
        if self._done:
            raise RuntimeError("utterance already finished")
        self._done = True
        return await self._owner._submit(self._end_utt)

    def _end_utt(self) -> str:
        dec = self._owner._decoder_sync()
        dec.end_utt()
        hyp = dec.hyp()
        return (hyp.hypstr if hyp is not None else "").strip()

    async def aclose(self) -> None:
        if self._done:
            return
        self._done = True
        try:
            await self._owner._submit(self._abandon)
        except RuntimeError:  # STT already closed: nothing to end
            pass

    def _abandon(self) -> None:
        dec = self._owner._decoder_sync()
        try:
            dec.end_utt()
        except RuntimeError:
            pass


def _quiet(fut: asyncio.Future[Any]) -> None:
    """Fire-and-forget on the worker: a failure there (model not loaded)
    surfaces in ``finish``; don't also log it as never retrieved."""
    fut.add_done_callback(lambda f: f.cancelled() or f.exception())
