"""Text to speech with espeak-ng, run as a subprocess per clause; as a
:class:`voice.synthesis.Synthesiser` it is :class:`EspeakSynthesiser`.

espeak-ng writes a streaming WAV (RIFF with placeholder sizes) to stdout; the
PCM is handed on as it arrives, resampled to 48 kHz mono with PyAV.
Cancelling :meth:`EspeakTTS.synthesize` kills the subprocess and reaps it
before ``CancelledError`` goes on.
"""

from __future__ import annotations

import asyncio
import shutil
import struct

from pydantic import BaseModel, Field

from media.frames import PLAYOUT_RATE, PcmResampler
from media.trim import SilenceTrimmer
from voice.providers import PcmSink
from voice.synthesis import BaseSynthesisStream, SynthesisError, cancel_and_wait

READ_CHUNK = 4096  # bytes per read from espeak-ng's stdout


class EspeakConfig(BaseModel):
    """TTS settings (env ``TURNKEEPER_TTS__*``).

    Attributes:
        executable: the espeak-ng binary.
        voice: espeak-ng voice name (``espeak-ng --voices``).
        words_per_minute: speaking rate, 80..450 words per minute.
        pitch: 0..99 (espeak-ng's ``-p``).
        pause_ms: silence kept after each sentence, ms; espeak-ng's own
            (about 330 ms) is trimmed to this, and leading silence dropped.
    """

    executable: str = "espeak-ng"
    voice: str = "en-us"
    words_per_minute: int = Field(165, ge=80, le=450)
    pitch: int = Field(50, ge=0, le=99)
    pause_ms: int = Field(120, ge=0, le=2000)


class TtsError(RuntimeError):
    """espeak-ng failed or produced something that is not mono s16 WAV."""


class EspeakTTS:
    """espeak-ng, one process per text (the engine behind :class:`EspeakStream`).

    Output is 48 kHz mono s16 (``sample_rate``).

    Args:
        config: voice, rate, pitch.
    """

    sample_rate = PLAYOUT_RATE

    def __init__(self, config: EspeakConfig | None = None) -> None:
        self.config = config or EspeakConfig()
        #: processes started and still running (for leak checks)
        self.running: set[asyncio.subprocess.Process] = set()

    def available(self) -> bool:
        """True if the espeak-ng executable is on PATH."""
        return shutil.which(self.config.executable) is not None

    async def voice_exists(self, voice: str) -> bool:
        """True if espeak-ng has ``voice`` (a name like ``en-gb`` or
        ``en-us+f3``): it is asked to say "a" silently (``-q``) with it, at
        most 5 s.
        Answers are remembered (per process, at most 256 names)."""
        known = _VOICES_SEEN.get((self.config.executable, voice))
        if known is not None:
            return known
        try:
            proc = await asyncio.create_subprocess_exec(
                self.config.executable, "-q", "-v", voice, "a",  # with no text at all it exits 0 for any voice
                stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.DEVNULL,
            )
        except FileNotFoundError:
            return False
        try:
            async with asyncio.timeout(5):
                ok = await proc.wait() == 0
        finally:
            if proc.returncode is None:
                proc.kill()
                await _reap(proc)
        if len(_VOICES_SEEN) >= 256:
            _VOICES_SEEN.clear()
        _VOICES_SEEN[(self.config.executable, voice)] = ok
        return ok

    async def synthesize(self, text: str, sink: PcmSink) -> None:
        """Speak ``text``; ``sink`` gets 48 kHz mono s16 PCM chunks.

        Raises:
            TtsError: espeak-ng is missing, exits non-zero, or emits a
                malformed WAV.
        """
        text = " ".join(text.split())
        if not text:
            return
        cfg = self.config
        try:
            proc = await asyncio.create_subprocess_exec(
                cfg.executable,
                "-v", cfg.voice,
                "-s", str(cfg.words_per_minute),
                "-p", str(cfg.pitch),
                "-b", "1",  # input is UTF-8
                "--stdin",
                "--stdout",
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE,
            )
        except FileNotFoundError as exc:
            raise TtsError(f"{cfg.executable} not found; install espeak-ng") from exc
        self.running.add(proc)
        try:
            assert proc.stdin and proc.stdout and proc.stderr
            proc.stdin.write(text.encode() + b"\n")
            proc.stdin.close()
            rate = await _read_wav_header(proc.stdout)
            resampler = PcmResampler(self.sample_rate)
            trimmer = SilenceTrimmer(self.sample_rate, keep_tail_ms=cfg.pause_ms)
            odd = b""
            while chunk := await proc.stdout.read(READ_CHUNK):
                chunk = odd + chunk
                cut = len(chunk) - (len(chunk) % 2)
                chunk, odd = chunk[:cut], chunk[cut:]
                if chunk:
                    out = trimmer.push(resampler.pcm(chunk, rate))
                    if out:
                        sink(out)
            tail = trimmer.push(resampler.flush()) + trimmer.flush()
            if tail:
                sink(tail)
            err = await proc.stderr.read()
            code = await proc.wait()
            if code != 0:
                raise TtsError(f"espeak-ng exited with {code}: {err.decode(errors='replace').strip()}")
        finally:
            if proc.returncode is None:
                proc.kill()
            try:
                await _reap(proc)
            finally:
                self.running.discard(proc)


#: (executable, voice) -> whether espeak-ng has it
_VOICES_SEEN: dict[tuple[str, str], bool] = {}


async def _reap(proc: asyncio.subprocess.Process) -> None:
    """Wait for a finished or killed ``proc``, discarding its unread output,
    even while the caller is being cancelled (more than once, too); a
    cancellation received meanwhile is re-raised once the process is reaped,
    so no zombie and no unowned task is left behind.

    The pipes are drained rather than the process merely waited for: a
    reader paused on a full stdout buffer never reads its EOF, and asyncio's
    ``wait()`` returns only once every pipe is closed (CPython 3.11), so a
    bare ``wait()`` after a cancel could hang forever. The output left is
    bounded by the pipe and stream buffers, since the process has ended.

    Raises:
        asyncio.CancelledError: the caller was cancelled while reaping.
    """
    reaping = asyncio.ensure_future(proc.communicate())
    cancelled: asyncio.CancelledError | None = None
    while not reaping.done():
        try:
            await asyncio.shield(reaping)
        except asyncio.CancelledError as exc:
            if reaping.cancelled():
                raise
            cancelled = exc  # cleanup first, then re-raise
    if cancelled is not None:
        raise cancelled


async def _read_wav_header(stream: asyncio.StreamReader) -> int:
    """Read a RIFF/WAVE header up to the start of the ``data`` chunk and return
    the sample rate in Hz. Chunk sizes of the streaming header are ignored.

    Raises:
        TtsError: not RIFF/WAVE, not PCM mono 16-bit, or no data chunk.
    """
    try:
        riff = await stream.readexactly(12)
        if riff[:4] != b"RIFF" or riff[8:12] != b"WAVE":
            raise TtsError("espeak-ng output is not a RIFF/WAVE stream")
        rate = None
        while True:
            chunk_id, size = struct.unpack("<4sI", await stream.readexactly(8))
            if chunk_id == b"data":
                if rate is None:
                    raise TtsError("WAV data chunk before fmt chunk")
                return rate
            body = await stream.readexactly(size + (size & 1))
            if chunk_id == b"fmt ":
                fmt, channels, rate, _, _, bits = struct.unpack("<HHIIHH", body[:16])
                if fmt != 1 or channels != 1 or bits != 16:
                    raise TtsError(f"unexpected WAV format {fmt}, {channels} ch, {bits} bit")
    except asyncio.IncompleteReadError as exc:
        raise TtsError("espeak-ng produced no audio") from exc


class EspeakStream(BaseSynthesisStream):
    """A reply spoken by espeak-ng (:class:`voice.synthesis.SynthesisStream`):
    one subprocess per clause, in order, 48 kHz; no word timings (the
    reply's marks are per clause). Cancelling kills the clause's subprocess
    at once: the stop is told and confirmed when it is reaped."""

    def __init__(self, tts: EspeakTTS) -> None:
        super().__init__("espeak-ng", tts.sample_rate)
        self.tts = tts
        self._clauses: asyncio.Queue[str | None] = asyncio.Queue()
        self._task = asyncio.ensure_future(self._run())

    def _send_text(self, text: str) -> None:
        self._clauses.put_nowait(text)

    def _send_end(self) -> None:
        self._clauses.put_nowait(None)

    def _send_cancel(self) -> None:
        self._task.cancel()
        self.told()
        self.confirm_stop()  # the process is killed: nothing more is made

    async def _run(self) -> None:
        try:
            while (clause := await self._clauses.get()) is not None:
                await self.tts.synthesize(clause, self.emit_audio)
                self.emit_segment_done()
        except TtsError as exc:
            self.emit_error(SynthesisError("provider", str(exc), self.provider))

    async def _close(self) -> None:
        await cancel_and_wait(self._task)


class EspeakSynthesiser:
    """espeak-ng as a :class:`voice.synthesis.Synthesiser` (``tts.provider =
    "embedded"``, and every provider's fallback).

    Args:
        config: voice, rate, pitch.
    """

    name = "espeak-ng"

    def __init__(self, config: EspeakConfig | None = None) -> None:
        self.tts = EspeakTTS(config)

    def open(self, context_id: str) -> EspeakStream:
        """A stream for one reply (``context_id`` is not needed)."""
        return EspeakStream(self.tts)

    async def warm(self) -> None:
        """Nothing to open."""

    async def aclose(self) -> None:
        """Nothing to close (each stream reaps its own process)."""
