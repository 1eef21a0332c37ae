"""Speech synthesis by an OpenAI-compatible ``POST /v1/audio/speech``
(``tts.provider = "openai"``): OpenAI, speaches, Kokoro-FastAPI and other
servers that speak it (shared/reference/speech-providers.md, section 2.1).

**On the wire.** One request per pushed clause, in the order pushed and one
at a time: the next clause's request starts as soon as the previous
response has ended (its audio is already in the playout buffer, faster
than real time, so the next request's first-audio latency is hidden behind
it), and a clause not yet requested when the reply is stopped is never
sent. ``POST {tts.base_url}/audio/speech``, ``Authorization: Bearer <key>``
(omitted when ``tts.api_key`` is empty), JSON body (``openai-python``
``src/openai/types/audio/speech_create_params.py``)::

    {"model": tts.model, "input": <the clause>, "voice": tts.voice,
     "response_format": "pcm", "stream_format": "audio", "sample_rate": tts.sample_rate}

``speed`` is omitted (the provider's 1.0). ``sample_rate`` is speaches'
field (``routers/speech.py``: it resamples to it); it is **not sent to
OpenAI's own hosts** (``*.openai.com``), whose ``pcm`` is always 24 kHz and
whose handling of unknown fields is not documented; every other server gets
it (Kokoro-FastAPI ignores it). ``stream_format`` is ``"audio"``: speaches'
event stream ignores ``sample_rate`` (its deltas are at the model's native
rate, which the client cannot know), so raw bytes are asked for;
``stream_format="sse"`` can be chosen for tests and for servers that only
stream events.

**Reading the answer.** The response's ``Content-Type`` decides, not what
was asked (compatible servers ignore fields: reference section 2.1, LK
``ChunkedStream``), and the audio is emitted chunk by chunk as it arrives:

- ``audio/pcm``, ``audio/raw`` or ``application/octet-stream``: raw s16 LE
  mono. Its rate, in this order: the content type's ``rate=`` parameter
  (``audio/pcm;rate=16000``), an ``X-Sample-Rate`` header (sglang-omni's),
  the rate asked for when ``sample_rate`` was sent (speaches honours it),
  else OpenAI's 24000. A server that ignores ``sample_rate`` and does not
  say its rate cannot be told apart: Kokoro-FastAPI answers 24 kHz
  whatever is asked, so leave ``tts.sample_rate`` at its default 24000 for
  it. ``channels`` other than 1 or ``big-endian=true`` parameters are a
  ``protocol`` error.
- ``audio/wav``, ``audio/x-wav``, ``audio/wave``, ``audio/vnd.wave``: a
  RIFF header first; its ``fmt `` chunk decides (PCM or extensible PCM,
  16-bit, mono, its rate); the ``data`` size is ignored when it is 0 or
  0xFFFFFFFF (streamed), else bytes past it are not audio.
- ``text/event-stream``: ``speech.audio.delta`` events with base64 audio in
  ``audio`` (OpenAI) or ``delta`` (LK reads either), ``speech.audio.done``
  with ``usage`` (OpenAI) or ``token_usage`` (speaches: the key differs,
  ``src/speaches/api_types.py``), kept in :attr:`OpenAiSynthesisStream.tokens`;
  ``data: [DONE]`` and unknown types are ignored; ``error`` events are the
  provider's error. The rate: ``X-Sample-Rate``, else 24000 (OpenAI's).
- anything else (``audio/mpeg`` from a server that ignored ``pcm``, JSON, no
  type): ``protocol``.

Audio not at ``tts.sample_rate`` is resampled to it
(:class:`media.frames.PcmResampler`); an odd byte at a chunk's end waits for
the next chunk, and one left at the end of the response is a ``protocol``
error. There are no word timings on this protocol (no :class:`Words`).
A clause's segment is done when its response body ended normally.

**Stop.** :meth:`OpenAiSynthesisStream.cancel` closes the in-flight
response's connection at once (``ClientResponse.close()``: the socket is
closed, not returned to the pool, so the server sees the client gone),
which is the only stop this protocol has (reference section 2.1); the
stop is *told* then and *confirmed* (an HTTP stream we closed sends
nothing more). A request still waiting for its answer is cancelled and
told when its connection is torn down. ``characters`` counts only clauses
that were requested (those never sent are not billed), and
``characters_unspoken`` only the clause in flight at the stop.

**Failure** (:class:`voice.synthesis.SynthesisError`; nothing here
retries): connect refused, DNS, TLS, ``tts.connect_timeout_s`` exceeded
``unreachable``; 401/403 ``unauthorized``; 429, 5xx, any other non-200 and
an error event ``provider`` (with the provider's own message: OpenAI's
``{"error": {"message"}}``, FastAPI's ``{"detail"}``); no first audio
within ``tts.first_audio_timeout_s`` of the request (connecting included),
or a body silent that long mid-clause, ``provider``; the connection broken
mid-body ``dropped``; an answer that is not the protocol (not HTTP, an
unknown content type, bad JSON or base64 in an event, a bad WAV header,
an odd number of bytes left at the end) ``protocol``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import json
import logging
import struct
import time
from collections.abc import Callable
from typing import Any, Literal
from weakref import WeakSet

import aiohttp
from yarl import URL

from media.frames import PcmResampler
from voice.synthesis import BaseSynthesisStream, SynthesisError, cancel_and_wait
from voice.synthesisers import TtsConfig

log = logging.getLogger(__name__)

PROVIDER = "openai"
#: OpenAI's ``pcm`` rate, Hz (reference section 2.1; LK and PC hard-code it)
OPENAI_PCM_RATE = 24_000
#: content types read as raw s16 LE
RAW_TYPES = frozenset({"audio/pcm", "audio/raw", "application/octet-stream"})
#: content types read as a RIFF/WAVE stream
WAV_TYPES = frozenset({"audio/wav", "audio/x-wav", "audio/wave", "audio/vnd.wave"})
#: most of an error body read, bytes, and kept for a message, characters
ERROR_BODY_BYTES = 4096
ERROR_TEXT_CHARS = 300
#: largest WAV header (up to its ``data`` chunk) accepted, bytes
MAX_WAV_HEADER_BYTES = 1 << 16
#: largest server-sent event line, bytes (a base64 delta of a second of 48 kHz is 128 kB)
MAX_SSE_LINE_BYTES = 4 << 20
#: rates a server may declare, Hz
MIN_RATE, MAX_RATE = 4000, 192_000
#: the body of ``GET /models`` read by :meth:`OpenAiSynthesiser.warm` at most, bytes
MAX_WARM_BODY_BYTES = 1 << 16


def speech_url(config: TtsConfig) -> str:
    """``{tts.base_url}/audio/speech`` (base URL up to ``/v1``)."""
    return f"{config.url}/audio/speech"


def sends_sample_rate(config: TtsConfig) -> bool:
    """Whether requests carry speaches' ``sample_rate`` field: not to
    OpenAI's own hosts (``api.openai.com``, ``*.openai.com``), to every other
    server (see the module doc)."""
    host = (URL(config.url).host or "").lower().rstrip(".")
    return not (host == "openai.com" or host.endswith(".openai.com"))


def request_body(config: TtsConfig, text: str, stream_format: Literal["audio", "sse"] = "audio") -> dict[str, Any]:
    """The JSON body of one clause's request (see the module doc).

    Args:
        config: ``tts.*`` (model, voice, sample_rate, base_url).
        text: the clause, as pushed.
        stream_format: ``"audio"`` (raw bytes) or ``"sse"`` (events).
    """
    body: dict[str, Any] = {
        "model": config.model_name,
        "input": text,
        "voice": config.voice_name,
        "response_format": "pcm",
        "stream_format": stream_format,
    }
    if sends_sample_rate(config):
        body["sample_rate"] = config.sample_rate
    return body


class OpenAiSynthesiser:
    """:class:`voice.synthesis.Synthesiser` over an OpenAI-compatible
    ``/v1/audio/speech`` (see the module doc), one per session.

    Args:
        config: the ``tts.*`` settings (``base_url`` up to ``/v1``,
            ``api_key``, ``model``, ``voice``, ``sample_rate``,
            ``connect_timeout_s``, ``first_audio_timeout_s``, prices).
        http: a shared ``aiohttp.ClientSession`` (its keep-alive pool is
            used and never closed here); None: one of its own, made on first
            use and closed by :meth:`aclose`.
        clock: monotonic seconds (the streams' stop records).
        stream_format: asked of the server: ``"audio"`` (default) or
            ``"sse"`` (see the module doc).

    Attributes:
        name: ``"openai"``.
    """

    name = PROVIDER

    def __init__(
        self,
        config: TtsConfig,
        http: aiohttp.ClientSession | None = None,
        clock: Callable[[], float] = time.monotonic,
        *,
        stream_format: Literal["audio", "sse"] = "audio",
    ) -> None:
        self.config = config
        self.clock = clock
        self.stream_format: Literal["audio", "sse"] = stream_format
        self._shared = http
        self._own: aiohttp.ClientSession | None = None
        self._streams: WeakSet[OpenAiSynthesisStream] = WeakSet()
        self._warmed = False
        self._warming: asyncio.Lock | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """The speech endpoint, ``{base_url}/audio/speech``."""
        return speech_url(self.config)

    def auth_headers(self) -> dict[str, str]:
        """``Authorization: Bearer <key>``, or nothing when no key is set."""
        key = self.config.api_key.get_secret_value()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def timeout(self) -> aiohttp.ClientTimeout:
        """A request's aiohttp timeout: connecting at most
        ``connect_timeout_s``; the rest is bounded by the streams."""
        return aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)

    def client(self) -> aiohttp.ClientSession:
        """The HTTP session: the shared one, or its own (made on first use,
        inside the running loop).

        Raises:
            SynthesisError: ``closed`` after :meth:`aclose` (or the shared
                session was closed).
        """
        if self._closed:
            raise SynthesisError("closed", "openai: the synthesiser is closed", PROVIDER)
        if self._shared is not None:
            if self._shared.closed:
                raise SynthesisError("closed", "openai: the shared HTTP session is closed", PROVIDER)
            return self._shared
        if self._own is None or self._own.closed:
            self._own = aiohttp.ClientSession(timeout=self.timeout())
        return self._own

    def open(self, context_id: str) -> OpenAiSynthesisStream:
        """A stream for one reply (``context_id`` names it in logs; HTTP has
        no contexts). Never blocks: nothing is sent until text is pushed."""
        stream = OpenAiSynthesisStream(self, context_id)
        self._streams.add(stream)
        return stream

    async def warm(self) -> None:
        """Open a keep-alive connection for the first reply: ``GET
        {base_url}/models`` with the key, its answer read and ignored (the
        connection then waits in the pool, so the first ``POST`` pays no
        TCP/TLS setup). Idempotent once it succeeded; bounded by twice
        ``connect_timeout_s``; never raises but ``CancelledError`` (a
        failure is met by the first stream)."""
        if self._warmed or self._closed:
            return
        if self._warming is None:
            self._warming = asyncio.Lock()
        async with self._warming:
            if self._warmed or self._closed:
                return
            url = f"{self.config.url}/models"
            try:
                async with asyncio.timeout(2 * self.config.connect_timeout_s):
                    resp = await self.client().get(url, headers=self.auth_headers(), allow_redirects=False, timeout=self.timeout())
                    try:
                        size = 0
                        while size <= MAX_WARM_BODY_BYTES and (piece := await resp.content.readany()):
                            size += len(piece)
                        whole = size <= MAX_WARM_BODY_BYTES and resp.content.at_eof()
                    except BaseException:
                        resp.close()
                        raise
                    if whole:
                        resp.release()  # back to the pool, kept alive
                    else:
                        resp.close()
                self._warmed = True
                log.debug("openai tts: warmed %s (%s)", url, resp.status)
            except (aiohttp.ClientError, TimeoutError, OSError, SynthesisError) as exc:
                log.debug("openai tts: warming %s failed: %s", url, _describe(exc))

    async def aclose(self) -> None:
        """Close every stream it opened (their requests cancelled) and its
        own HTTP session (never a shared one). Idempotent."""
        self._closed = True
        for stream in list(self._streams):
            await stream.aclose()
        own, self._own = self._own, None
        if own is not None:
            await own.close()


class OpenAiSynthesisStream(BaseSynthesisStream):
    """One reply over ``/v1/audio/speech``: a request per clause, one at a
    time, in order (see the module doc).

    Args:
        owner: the synthesiser (settings, HTTP session).
        context_id: the reply's name (in logs).

    Attributes:
        context_id: as given.
        tokens: token usage the server reported in ``speech.audio.done``
            events, summed (``input_tokens``, ``output_tokens``,
            ``total_tokens``); empty without an event stream.
        requests: clauses requested so far.
    """

    def __init__(self, owner: OpenAiSynthesiser, context_id: str) -> None:
        super().__init__(PROVIDER, owner.config.sample_rate, owner.config.pricing, owner.clock)
        self._owner = owner
        self.context_id = context_id
        self.tokens: dict[str, int] = {}
        self.requests = 0
        self._clauses: asyncio.Queue[str | None] = asyncio.Queue()
        self._task: asyncio.Task[None] | None = None
        #: the clause whose request is in flight (from the POST to its body's end)
        self._in_flight: str | None = None
        self._response: aiohttp.ClientResponse | None = None

    # -- the base's hooks ---------------------------------------------------------

    def _send_text(self, text: str) -> None:
        self._clauses.put_nowait(text)
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run(), name=f"openai-tts-{self.context_id}")

    def _send_end(self) -> None:
        self._clauses.put_nowait(None)

    def _send_cancel(self) -> None:
        stop = self.stop
        assert stop is not None
        in_flight = self._in_flight
        self._unbill_unrequested()
        stop.characters_unspoken = len(in_flight) if in_flight is not None else 0
        resp, self._response = self._response, None
        task = self._task
        running = task is not None and not task.done()
        if running:
            task.cancel()  # type: ignore[union-attr]
        if resp is not None:
            resp.close()  # the socket is closed now: the server sees the client gone
            self.told()
            self.confirm_stop()
        elif in_flight is not None and running:
            # the request waits for its answer: told once aiohttp has torn its connection down
            def torn_down(_: asyncio.Task[None]) -> None:
                self.told()
                self.confirm_stop()

            task.add_done_callback(torn_down)  # type: ignore[union-attr]
        else:
            stop.confirmed = True  # nothing in flight: nothing to stop

    async def _close(self) -> None:
        task = self._task
        if task is not None and not task.done():
            await cancel_and_wait(task)
        resp, self._response = self._response, None
        if resp is not None:
            resp.close()
        self._owner._streams.discard(self)

    def _unbill_unrequested(self) -> None:
        """Clauses pushed but never requested are not billed: take them out
        of ``characters`` (the base counted them when pushed)."""
        waiting = self.pending[1:] if self._in_flight is not None else self.pending
        self.characters -= sum(len(t) for t in waiting)

    # -- the clauses ----------------------------------------------------------------

    async def _run(self) -> None:
        try:
            while (text := await self._clauses.get()) is not None:
                await self._speak(text)
                self.emit_segment_done()
        except SynthesisError as error:
            self._fail(error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # an answer nothing above foresaw: fail the stream, not the loop
            log.exception("openai tts %s: request failed unexpectedly", self.context_id)
            self._fail(SynthesisError("protocol", f"openai: {_describe(exc)}", PROVIDER))

    def _fail(self, error: SynthesisError) -> None:
        if self.stop is None and not self.finished:
            self._unbill_unrequested()
        log.debug("openai tts %s failed: %s: %s", self.context_id, error.kind, error)
        self.emit_error(error)

    async def _speak(self, text: str) -> None:
        """One clause: its request, its audio as it arrives, its end.

        Raises:
            SynthesisError: see the module doc.
        """
        owner = self._owner
        cfg = owner.config
        url = owner.url
        loop = asyncio.get_running_loop()
        session = owner.client()
        first_by = loop.time() + cfg.first_audio_timeout_s
        self._in_flight = text
        self.requests += 1
        body = request_body(cfg, text, owner.stream_format)
        try:
            async with asyncio.timeout_at(first_by):
                resp = await session.post(url, json=body, headers=owner.auth_headers(), allow_redirects=False, timeout=owner.timeout())
        except aiohttp.ClientError as exc:
            raise _request_error(exc, url) from None
        except TimeoutError:
            raise SynthesisError(
                "provider", f"{url} did not answer within {cfg.first_audio_timeout_s} s (tts.first_audio_timeout_s)", PROVIDER
            ) from None
        except OSError as exc:
            raise SynthesisError("unreachable", f"cannot reach {url} (tts.base_url): {_describe(exc)}", PROVIDER) from None
        self._response = resp
        complete = False
        try:
            if resp.status != 200:
                raise await _refusal(resp, url)
            decoder = self._decoder(resp, url, body)
            got_audio = False
            while True:
                try:
                    if got_audio:
                        async with asyncio.timeout(cfg.first_audio_timeout_s):
                            chunk = await resp.content.readany()
                    else:
                        async with asyncio.timeout_at(first_by):
                            chunk = await resp.content.readany()
                except TimeoutError:
                    what = "sent no audio" if not got_audio else "stalled mid-clause"
                    raise SynthesisError(
                        "provider", f"{url} {what} for {cfg.first_audio_timeout_s} s (tts.first_audio_timeout_s)", PROVIDER
                    ) from None
                except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
                    raise SynthesisError("dropped", f"{url} broke the connection mid-answer: {_describe(exc)}", PROVIDER) from None
                if not chunk:
                    break
                decoder.feed(chunk)
                got_audio = got_audio or decoder.audio_seen
            decoder.end()
            complete = True
        finally:
            if self._response is resp:
                self._response = None
                if complete:
                    resp.release()  # whole: the connection goes back to the pool
                else:
                    resp.close()
            if complete:
                self._in_flight = None

    def _decoder(self, resp: aiohttp.ClientResponse, url: str, body: dict[str, Any]) -> _Decoder:
        """How to read this answer, from its Content-Type (see the module doc).

        Raises:
            SynthesisError: ``protocol`` for a type that is not audio we read.
        """
        content_type = resp.headers.get("Content-Type", "")
        kind, params = parse_content_type(content_type)
        pcm = _Pcm(self.sample_rate, self.emit_audio, url)
        if kind in RAW_TYPES:
            if params.get("channels", "1") != "1" or params.get("big-endian", "false").lower() == "true":
                raise SynthesisError("protocol", f"{url} answered {content_type!r}: not mono s16 LE", PROVIDER)
            return _Raw(pcm, answer_rate(content_type, resp.headers.get("X-Sample-Rate"), body, url))
        if kind in WAV_TYPES:
            return _Wav(pcm, url)
        if kind == "text/event-stream":
            return _Events(pcm, answer_rate(content_type, resp.headers.get("X-Sample-Rate"), body, url), url, self.tokens)
        raise SynthesisError("protocol", f"{url} answered Content-Type {kind or 'none'!r}, not pcm audio", PROVIDER)


def answer_rate(content_type: str, x_sample_rate: str | None, body: dict[str, Any], url: str = "") -> int:
    """The rate of raw PCM (or event-stream audio) in an answer, Hz: the
    content type's ``rate=`` parameter, else the ``X-Sample-Rate`` header,
    else (raw PCM only) the ``sample_rate`` the request carried (speaches
    honours it), else OpenAI's 24000 (reference section 2.1; speaches'
    event stream ignores ``sample_rate``). A WAV answer's own header
    decides instead.

    Raises:
        SynthesisError: ``protocol`` for a declared rate that is not a number
            from 4000 to 192000.
    """
    kind, params = parse_content_type(content_type)
    rate = _rate_of(params.get("rate"), "rate", url) or _rate_of(x_sample_rate, "X-Sample-Rate", url)
    if rate is not None:
        return rate
    if kind != "text/event-stream" and "sample_rate" in body:
        return int(body["sample_rate"])
    return OPENAI_PCM_RATE


# -- reading audio ---------------------------------------------------------------


class _Pcm:
    """s16 LE mono at a declared rate, to whole samples at ``out_rate``:
    an odd byte waits for the next chunk; other rates are resampled."""

    def __init__(self, out_rate: int, emit: Callable[[bytes], None], url: str) -> None:
        self.out_rate = out_rate
        self.emit = emit
        self.url = url
        self.carry = b""
        self.seen = False
        self._resampler: PcmResampler | None = None

    def feed(self, data: bytes, rate: int) -> None:
        if not data:
            return
        self.seen = True
        data = self.carry + data
        cut = len(data) // 2 * 2
        self.carry = data[cut:]
        data = data[:cut]
        if not data:
            return
        if rate == self.out_rate and self._resampler is None:
            self.emit(data)
            return
        if self._resampler is None:
            self._resampler = PcmResampler(self.out_rate)
        try:
            self.emit(self._resampler.pcm(data, rate))
        except ValueError as exc:
            raise SynthesisError("protocol", f"{self.url}: {exc}", PROVIDER) from None

    def end(self) -> None:
        if self.carry:
            raise SynthesisError("protocol", f"{self.url} ended its audio with an odd number of bytes (not s16 samples)", PROVIDER)
        if self._resampler is not None:
            self.emit(self._resampler.flush())


class _Decoder:
    """One answer's body, chunk by chunk, to audio."""

    def __init__(self, pcm: _Pcm) -> None:
        self.pcm = pcm

    @property
    def audio_seen(self) -> bool:
        return self.pcm.seen

    def feed(self, chunk: bytes) -> None:
        raise NotImplementedError

    def end(self) -> None:
        self.pcm.end()


class _Raw(_Decoder):
    def __init__(self, pcm: _Pcm, rate: int) -> None:
        super().__init__(pcm)
        self.rate = rate

    def feed(self, chunk: bytes) -> None:
        self.pcm.feed(chunk, self.rate)


class _Wav(_Decoder):
    """A RIFF/WAVE stream: the header (up to ``data``) parsed, then PCM."""

    def __init__(self, pcm: _Pcm, url: str) -> None:
        super().__init__(pcm)
        self.url = url
        self.head = bytearray()
        self.rate: int | None = None  # set once the header is read
        self.left: int | None = None  # data bytes still expected (None: to the end)

    def feed(self, chunk: bytes) -> None:
        if self.rate is None:
            self.head += chunk
            parsed = parse_wav_header(bytes(self.head), self.url)
            if parsed is None:
                if len(self.head) > MAX_WAV_HEADER_BYTES:
                    raise SynthesisError("protocol", f"{self.url} sent a WAV header over {MAX_WAV_HEADER_BYTES} bytes", PROVIDER)
                return
            self.rate, data_size, offset = parsed
            self.left = data_size if 0 < data_size < 0xFFFFFFFF else None
            chunk = bytes(self.head[offset:])
            self.head.clear()
        if self.left is not None:
            chunk = chunk[: self.left]
            self.left -= len(chunk)
        self.pcm.feed(chunk, self.rate)

    def end(self) -> None:
        if self.rate is None:
            raise SynthesisError("protocol", f"{self.url} ended before its WAV header was whole", PROVIDER)
        super().end()


class _Events(_Decoder):
    """Server-sent events (see the module doc): base64 audio deltas, then done."""

    def __init__(self, pcm: _Pcm, rate: int, url: str, tokens: dict[str, int]) -> None:
        super().__init__(pcm)
        self.rate = rate
        self.url = url
        self.tokens = tokens
        self.pending = bytearray()
        self.data: list[str] = []
        self.name = ""

    def feed(self, chunk: bytes) -> None:
        self.pending += chunk
        while (i := self.pending.find(b"\n")) >= 0:
            raw = bytes(self.pending[:i])
            del self.pending[: i + 1]
            self._line(raw[:-1] if raw.endswith(b"\r") else raw)
        if len(self.pending) > MAX_SSE_LINE_BYTES:
            raise SynthesisError("protocol", f"{self.url} sent an event line over {MAX_SSE_LINE_BYTES} bytes", PROVIDER)

    def end(self) -> None:
        if self.pending:
            self._line(bytes(self.pending))
            self.pending.clear()
        self._line(b"")
        super().end()

    def _line(self, raw: bytes) -> None:
        try:
            line = raw.decode("utf-8")
        except UnicodeDecodeError:
            raise SynthesisError("protocol", f"{self.url} sent an event line that is not UTF-8", PROVIDER) from None
        if not line:
            if self.data:
                self._event(self.name, "\n".join(self.data))
            self.data, self.name = [], ""
            return
        if line.startswith(":"):
            return
        field, _, value = line.partition(":")
        value = value[1:] if value.startswith(" ") else value
        if field == "data":
            self.data.append(value)
        elif field == "event":
            self.name = value

    def _event(self, name: str, data: str) -> None:
        if data.strip() == "[DONE]":
            return
        try:
            event = json.loads(data)
        except (ValueError, RecursionError):
            raise SynthesisError("protocol", f"{self.url} sent an event that is not JSON: {data[:80]!r}", PROVIDER) from None
        if not isinstance(event, dict):
            raise SynthesisError("protocol", f"{self.url} sent an event that is not a JSON object: {data[:80]!r}", PROVIDER)
        kind = event.get("type")
        if name == "error" or kind == "error" or event.get("error") is not None:
            raise SynthesisError("provider", f"{self.url} reported an error mid-stream: {error_message(data)}", PROVIDER)
        if kind == "speech.audio.delta":
            b64 = event.get("audio", event.get("delta"))
            if not isinstance(b64, str):
                raise SynthesisError("protocol", f"{self.url} sent a delta without base64 audio: {data[:80]!r}", PROVIDER)
            try:
                pcm = base64.b64decode(b64, validate=True)
            except (binascii.Error, ValueError):
                raise SynthesisError("protocol", f"{self.url} sent a delta whose audio is not base64", PROVIDER) from None
            self.pcm.feed(pcm, self.rate)
        elif kind == "speech.audio.done":
            usage = event.get("usage", event.get("token_usage"))
            if isinstance(usage, dict):
                for key in ("input_tokens", "output_tokens", "total_tokens"):
                    n = usage.get(key)
                    if isinstance(n, int) and not isinstance(n, bool) and n >= 0:
                        self.tokens[key] = self.tokens.get(key, 0) + n


def parse_content_type(value: str) -> tuple[str, dict[str, str]]:
    """``("audio/pcm", {"rate": "16000"})`` from ``"audio/PCM; rate=16000"``:
    the media type in lower case and its parameters (names in lower case,
    quotes taken off)."""
    kind, *rest = value.split(";")
    params: dict[str, str] = {}
    for part in rest:
        name, eq, val = part.partition("=")
        if eq:
            params[name.strip().lower()] = val.strip().strip('"')
    return kind.strip().lower(), params


def parse_wav_header(head: bytes, url: str = "") -> tuple[int, int, int] | None:
    """``(rate Hz, data size, offset of the first data byte)`` of a RIFF/WAVE
    header, or None while it is incomplete (no ``data`` chunk yet).

    Raises:
        SynthesisError: ``protocol``: not RIFF/WAVE, not 16-bit mono PCM,
            a rate out of range, or ``data`` before ``fmt ``.
    """
    if len(head) < 12:
        if not b"RIFF".startswith(head[:4]):
            raise SynthesisError("protocol", f"{url} sent a WAV answer that is not RIFF/WAVE", PROVIDER)
        return None
    if head[:4] != b"RIFF" or head[8:12] != b"WAVE":
        raise SynthesisError("protocol", f"{url} sent a WAV answer that is not RIFF/WAVE", PROVIDER)
    pos, rate = 12, None
    while pos + 8 <= len(head):
        chunk_id, size = struct.unpack_from("<4sI", head, pos)
        if chunk_id == b"data":
            if rate is None:
                raise SynthesisError("protocol", f"{url} sent a WAV data chunk before its fmt chunk", PROVIDER)
            return rate, size, pos + 8
        end = pos + 8 + size + (size & 1)
        if end > len(head):
            if end - pos > MAX_WAV_HEADER_BYTES:
                raise SynthesisError("protocol", f"{url} sent a WAV header chunk of {size} bytes", PROVIDER)
            return None
        if chunk_id == b"fmt ":
            if size < 16:
                raise SynthesisError("protocol", f"{url} sent a WAV fmt chunk of {size} bytes", PROVIDER)
            fmt, channels, rate, _, _, bits = struct.unpack_from("<HHIIHH", head, pos + 8)
            if fmt == 0xFFFE and size >= 40:  # WAVE_FORMAT_EXTENSIBLE: the sub-format's first two bytes
                fmt = struct.unpack_from("<H", head, pos + 8 + 24)[0]
            if fmt != 1 or channels != 1 or bits != 16:
                raise SynthesisError(
                    "protocol", f"{url} sent WAV format {fmt}, {channels} channels, {bits} bits: not 16-bit mono PCM", PROVIDER
                )
            if not MIN_RATE <= rate <= MAX_RATE:
                raise SynthesisError("protocol", f"{url} sent a WAV rate of {rate} Hz", PROVIDER)
        pos = end
    return None


def _rate_of(value: str | None, what: str, url: str) -> int | None:
    if value is None:
        return None
    try:
        rate = int(value.strip())
    except ValueError:
        rate = 0
    if not MIN_RATE <= rate <= MAX_RATE:
        raise SynthesisError("protocol", f"{url} declared a {what} of {value!r} Hz", PROVIDER)
    return rate


# -- errors --------------------------------------------------------------------------


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _request_error(exc: aiohttp.ClientError, url: str) -> SynthesisError:
    """The kind of a failure before the answer's status arrived."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError | aiohttp.InvalidURL):
        return SynthesisError("unreachable", f"cannot reach {url} (tts.base_url): {_describe(exc)}", PROVIDER)
    if isinstance(exc, aiohttp.ClientResponseError):
        return SynthesisError("protocol", f"{url} answered something that is not HTTP: {_describe(exc)}", PROVIDER)
    return SynthesisError("dropped", f"{url} broke the connection before answering: {_describe(exc)}", PROVIDER)


async def _refusal(resp: aiohttp.ClientResponse, url: str) -> SynthesisError:
    """The error for a non-200 answer, with the provider's own message."""
    try:
        async with asyncio.timeout(1.0):
            body = (await resp.content.read(ERROR_BODY_BYTES)).decode("utf-8", "replace")
    except (aiohttp.ClientError, OSError, TimeoutError):
        body = ""
    detail = f"{resp.status} {resp.reason}"
    message = error_message(body)
    said = f": {message}" if message else ""
    if resp.status in (401, 403):
        return SynthesisError("unauthorized", f"{url} refused tts.api_key ({detail}){said}", PROVIDER)
    what = "rate-limited the request" if resp.status == 429 else "refused the request" if resp.status < 500 else "failed"
    return SynthesisError("provider", f"{url} {what} ({detail}){said}", PROVIDER)


def error_message(body: str) -> str:
    """The provider's own words from an error body: OpenAI's
    ``{"error": {"message"}}``, FastAPI's ``{"detail": ...}`` (speaches; a
    dict with ``message`` from Kokoro-FastAPI; a list of ``msg`` for 422),
    an ``error`` string, or the text itself (at most 300 characters)."""
    with contextlib.suppress(ValueError, RecursionError):
        data = json.loads(body)
        if isinstance(data, dict):
            err = data.get("error", data.get("detail"))
            if isinstance(err, dict):
                msg = err.get("message", err.get("detail"))
                if msg is not None:
                    return str(msg)[:ERROR_TEXT_CHARS]
            elif isinstance(err, list):
                msgs = [str(e.get("msg", e)) if isinstance(e, dict) else str(e) for e in err]
                return "; ".join(msgs)[:ERROR_TEXT_CHARS]
            elif isinstance(err, str):
                return err[:ERROR_TEXT_CHARS]
    return " ".join(body.split())[:ERROR_TEXT_CHARS]
