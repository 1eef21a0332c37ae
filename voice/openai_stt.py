"""Speech recognition by an OpenAI-compatible ``POST /v1/audio/transcriptions``
(OpenAI, speaches, vLLM, whisper.cpp with its path remapped), segmented by
our own endpointing (``stt.provider = "openai"``; issue 28, item 4).

The endpoint takes a whole file, so the stream keeps the audio sent since
the last ``finalize``/``discard`` (at most :data:`MAX_SEGMENT_S`; beyond,
the oldest is dropped) and, the moment our endpointing ends the utterance
(:meth:`OpenAiTranscriptionStream.finalize`), uploads it as a WAV in one
request made in the background: Pipecat's ``SegmentedSTTService`` pattern
(shared/reference/speech-providers.md, section 3.1).

**On the wire** (reference section 1.3; ``openai-python``
``src/openai/types/audio/transcription_create_params.py``): one
``POST {stt.base_url}/audio/transcriptions``, ``Authorization: Bearer <key>``
(omitted when ``stt.api_key`` is empty), ``multipart/form-data`` with

- ``file``: a WAV (RIFF, 16 kHz, mono, 16-bit PCM) of the segment's audio;
- ``model``: ``stt.model`` (default ``gpt-4o-transcribe``);
- ``language``: the primary subtag of ``stt.language`` (``en-US`` is sent as
  ``en``: the API takes ISO-639-1 codes);
- ``prompt``: ``stt.keyterms`` joined by ``", "`` (omitted when none);
- ``response_format``: ``verbose_json`` with ``timestamp_granularities[]=word``
  when ``stt.word_timestamps``, else ``json``;
- ``stream=true`` when ``stt.stream``.

**Reading the answer.** Its ``Content-Type`` decides, not what was asked,
since compatible servers ignore fields (reference section 1.4: OpenAI
ignores ``stream`` for ``whisper-1``; vLLM answers JSON to
``response_format=text``):

- ``application/json``: ``{"text", "usage"?, "words"?, "duration"?}``
  (``transcription.py``, ``transcription_verbose.py``): words are seconds
  from the file's start, moved into stream seconds;
- ``text/plain``: the text;
- ``text/event-stream``, three shapes (reference section 1.4): OpenAI's
  ``transcript.text.delta`` ... ``transcript.text.done`` (with token usage;
  a trailing ``data: [DONE]`` is tolerated but not needed); speaches' (one
  delta per segment, a ``done`` without usage: ``executors/whisper.py``);
  vLLM's ``transcription.chunk`` chat-chunk shape (``choices[].delta.content``,
  ``finish_reason`` on the last), an optional usage chunk and
  ``data: [DONE]`` (``vllm/entrypoints/openai/speech_to_text.py``).

Deltas become :class:`voice.recognition.Interim` (the text so far); the end
becomes a :class:`voice.recognition.Final` (``finalized``), an
:class:`voice.recognition.EndOfUtterance` at the segment's end and a
:class:`voice.recognition.RecognitionUsage`: the provider's (tokens, or
``{"type": "duration"}`` seconds) or, when it reports none, the request's
audio seconds (``source="counted"``). Every event spans the segment's own
stream seconds.

**Order.** Requests run side by side (a short utterance right after a long
one) and may finish out of order; each request's events come out as it
produces them, each with its own segment's span, so the session gives them
to the right segment whatever their order (:mod:`voice.transcription`,
"Attribution").

**Failure** (:class:`voice.recognition.RecognitionError`; nothing here
retries: :mod:`voice.transcription` reconnects once, then falls back):
401/403 ``unauthorized``; 429, 5xx, any other refusal or an error body
``provider``; connect refused, DNS, TLS or connect timeout ``unreachable``;
a connection that breaks before the answer is whole ``dropped``; an answer
that is not the protocol (not JSON, wrong shapes, an unknown content type,
an event stream that ends before its end, a body over its bound)
``protocol``. A refused key is logged once, naming ``stt.api_key``, and
remembered: later streams fail at once until :meth:`OpenAiTranscriptionRecogniser.start`
succeeds again. Closing a stream cancels its requests and closes their
responses (reference section 1.3: "Cancel by closing the HTTP response").
"""

from __future__ import annotations

import asyncio
import io
import json
import logging
import math
import wave
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any, TypeGuard

import aiohttp

from voice.recognisers import SttConfig
from voice.recognition import (
    STREAM_BYTES_PER_S,
    STREAM_RATE,
    EndOfUtterance,
    Final,
    Interim,
    RecognitionError,
    RecognitionEvent,
    RecognitionUsage,
    SpeechPricing,
    StreamOptions,
    Word,
    language_code,
    stream_seconds,
)

log = logging.getLogger(__name__)

#: most audio one request carries, s (the oldest beyond it is dropped; OpenAI
#: takes files up to 25 MB, about 13 min of 16 kHz WAV)
MAX_SEGMENT_S = 60.0
#: largest JSON or text answer read, bytes (a 60 s transcript with word
#: timings is a few kB)
MAX_BODY_BYTES = 1 << 20
#: largest server-sent event line, bytes, and whole event stream, bytes
MAX_SSE_LINE_BYTES = 1 << 16
MAX_SSE_BYTES = 4 << 20
#: the most text one answer may grow to, characters (a minute of speech is
#: about 1,000); more is not a transcription
MAX_TEXT_CHARS = 20_000
#: interims of one answer at most this often, s (a server may send a delta
#: per character; each interim carries the whole text so far)
INTERIM_EVERY_S = 0.1
#: most of an error body kept for a message, characters
ERROR_TEXT_CHARS = 300

def wav_bytes(pcm: bytes, rate: int = STREAM_RATE) -> bytes:
    """A RIFF WAV file (mono, 16-bit PCM, ``rate`` Hz) of ``pcm`` (s16 LE)."""
    out = io.BytesIO()
    with wave.open(out, "wb") as w:
        w.setnchannels(1)
        w.setsampwidth(2)
        w.setframerate(rate)
        w.writeframes(pcm)
    return out.getvalue()


class OpenAiTranscriptionRecogniser:
    """:class:`voice.recognition.Recogniser` over an OpenAI-compatible
    ``/v1/audio/transcriptions`` (see the module doc).

    Args:
        config: the ``stt.*`` settings (``base_url`` up to ``/v1``,
            ``api_key``, ``model``, ``language``, ``keyterms``, ``stream``,
            ``word_timestamps``, ``connect_timeout_s``, prices).

    Attributes:
        name: ``"openai"``.
        pricing: ``config.pricing``.
    """

    name = "openai"

    #: the session's bound applies (stt.final_timeout_ms)
    final_timeout_s: float | None = None

    def __init__(self, config: SttConfig) -> None:
        self.config = config
        self.pricing: SpeechPricing = config.pricing
        self._session: aiohttp.ClientSession | None = None
        #: why the key is refused (a 401/403 seen), None if it is not known to be
        self._refused: str | None = None
        #: what start() last logged: "ok", "refused", "unreachable", "unchecked"
        self._logged: str | None = None
        self._closed = False

    @property
    def url(self) -> str:
        """``stt.base_url`` (up to ``/v1``) without a trailing slash."""
        return self.config.url

    def auth_headers(self) -> dict[str, str]:
        """``Authorization: Bearer <key>``, or nothing when no key is set."""
        key = self.config.api_key.get_secret_value()
        return {"Authorization": f"Bearer {key}"} if key else {}

    def client(self) -> aiohttp.ClientSession:
        """The HTTP session (made on first use, inside the running loop).

        Raises:
            RuntimeError: after :meth:`aclose`.
        """
        if self._closed:
            raise RuntimeError("the recogniser is closed")
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=None, sock_connect=self.config.connect_timeout_s)
            )
        return self._session

    async def start(self) -> None:
        """Check the provider and the key: ``GET {base_url}/models`` with the key.

        Never raises (but for cancellation), and never blocks the server's
        start for long (bounded by twice ``connect_timeout_s``). A 401/403
        logs one warning naming ``stt.api_key`` and is remembered (streams
        then fail at once with ``unauthorized``); any other answer, or none,
        at most one info line (servers without ``/models``, such as
        whisper.cpp, answer 404). A later call that is not refused clears
        the refusal. Idempotent: a line is logged only when the outcome
        changes.
        """
        url = f"{self.url}/models"
        outcome, detail = "ok", ""
        if self._closed:
            return
        try:
            async with asyncio.timeout(2 * self.config.connect_timeout_s):
                async with self.client().get(url, headers=self.auth_headers(), allow_redirects=False) as resp:
                    if resp.status in (401, 403):
                        outcome, detail = "refused", f"{resp.status} {resp.reason}"
                    elif resp.status != 200:
                        outcome, detail = "unchecked", f"{resp.status} {resp.reason}"
        except (aiohttp.ClientError, TimeoutError, OSError) as exc:
            outcome, detail = "unreachable", _describe(exc)
        if outcome == "refused":
            self._refuse(detail)
            return
        self._refused = None
        if outcome == self._logged:
            return
        self._logged = outcome
        if outcome == "unreachable":
            log.info("stt.base_url %s is not reachable now (%s): each utterance tries it, then uses %s",
                     self.url, detail, self._fallback_words())
        elif outcome == "unchecked":
            log.info("stt.base_url %s answered GET /models with %s: the key and the server are not checked before use",
                     self.url, detail)
        else:
            log.info("speech recognition by %s (model %s)", self.url, self.config.model_name)

    def _fallback_words(self) -> str:
        return "the fallback recogniser" if self.config.fallback == "embedded" else "no recogniser (turns fail)"

    def _refuse(self, detail: str) -> None:
        """Remember that the key is refused; log it once (not per utterance)."""
        empty = not self.config.api_key.get_secret_value()
        what = "stt.api_key is empty and" if empty else "stt.api_key was refused by"
        self._refused = f"{what} {self.url} ({detail})"
        if self._logged != "refused":
            self._logged = "refused"
            if empty:
                log.warning("stt.api_key is empty and %s requires one (%s): sessions will use %s",
                            self.url, detail, self._fallback_words())
            else:
                log.warning("stt.api_key was refused by %s (%s): sessions will use %s", self.url, detail, self._fallback_words())

    @property
    def refused(self) -> str | None:
        """Why the key is known to be refused (None: it is not)."""
        return self._refused

    def open(self, options: StreamOptions) -> OpenAiTranscriptionStream:
        """One session's stream (never blocks; no connection until a
        segment is finalized). If the key is known to be refused, the
        stream's :meth:`OpenAiTranscriptionStream.events` raises
        ``unauthorized`` at once."""
        return OpenAiTranscriptionStream(self, options)

    async def aclose(self) -> None:
        """Close the HTTP session. Idempotent."""
        self._closed = True
        session, self._session = self._session, None
        if session is not None:
            await session.close()


@dataclass(frozen=True)
class _Request:
    """One segment's request: the stream seconds it spans and its audio, s."""

    start_s: float
    end_s: float
    audio_s: float


class OpenAiTranscriptionStream:
    """:class:`voice.recognition.RecognitionStream` over one HTTP request per
    finalized segment (see the module doc).

    Args:
        owner: the recogniser (its settings, HTTP session and key state).
        options: the session's options (only ``session_id`` is used, in logs).
    """

    def __init__(self, owner: OpenAiTranscriptionRecogniser, options: StreamOptions) -> None:
        self._owner = owner
        self._options = options
        self._events: asyncio.Queue[RecognitionEvent | RecognitionError | None] = asyncio.Queue()
        self._buffer = bytearray()
        self._buffer_at = 0  # stream bytes where the buffer begins
        self._sent = 0  # stream bytes sent
        self._tasks: set[asyncio.Task[None]] = set()
        self._closed = False
        self._failed = False
        #: audio dropped because a segment outgrew MAX_SEGMENT_S, s
        self.dropped_s = 0.0
        if owner.refused is not None:
            self._fail(RecognitionError("unauthorized", owner.refused))

    # -- the session's side ------------------------------------------------------

    def send(self, pcm: bytes) -> None:
        """Keep 16 kHz mono s16 LE audio for the open segment (the oldest
        beyond :data:`MAX_SEGMENT_S` is dropped). Never blocks or raises."""
        if self._closed or self._failed or not pcm:
            self._sent += len(pcm)
            return
        self._buffer += pcm
        self._sent += len(pcm)
        limit = int(MAX_SEGMENT_S * STREAM_BYTES_PER_S)
        if len(self._buffer) > limit + STREAM_BYTES_PER_S:  # trimmed a second at a time, not per frame
            drop = (len(self._buffer) - limit) // 2 * 2
            del self._buffer[:drop]
            self._buffer_at += drop
            self.dropped_s += stream_seconds(drop)

    def finalize(self) -> None:
        """The open segment is one utterance: start its request now (in
        the background). Nothing happens if no audio came since the last
        finalize or discard."""
        limit = int(MAX_SEGMENT_S * STREAM_BYTES_PER_S)
        if len(self._buffer) > limit:
            drop = (len(self._buffer) - limit) // 2 * 2
            del self._buffer[:drop]
            self._buffer_at += drop
            self.dropped_s += stream_seconds(drop)
        audio, start = bytes(self._buffer), self._buffer_at
        self._buffer.clear()
        self._buffer_at = self._sent
        if not audio or self._closed or self._failed:
            return
        req = _Request(stream_seconds(start), stream_seconds(start + len(audio)), stream_seconds(len(audio)))
        task = asyncio.get_running_loop().create_task(self._run(req, audio))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    def discard(self) -> None:
        """The open segment is not speech: drop its audio (nothing was sent
        for it yet, so nothing is billed)."""
        self._buffer.clear()
        self._buffer_at = self._sent

    async def events(self) -> AsyncIterator[RecognitionEvent]:
        """Each segment's interims, final, end and usage, as its request
        produces them (segments may finish out of order), until :meth:`aclose`.

        Raises:
            voice.recognition.RecognitionError: a request failed (see the
                module doc for the kinds); nothing more comes.
        """
        while (item := await self._events.get()) is not None:
            if isinstance(item, RecognitionError):
                raise item
            yield item

    async def aclose(self) -> None:
        """Cancel the requests in flight (their responses closed, so the
        server sees the client gone), then end :meth:`events`. Idempotent;
        cancelling it closes at once."""
        if self._closed:
            return
        self._closed = True
        self._buffer.clear()
        tasks = set(self._tasks)
        for task in tasks:
            task.cancel()
        try:
            if tasks:
                await asyncio.wait(tasks)
        finally:
            self._events.put_nowait(None)

    # -- events --------------------------------------------------------------------

    def _fail(self, error: RecognitionError) -> None:
        """The stream failed: the error comes out of events() now, and the
        other requests are cancelled (nothing more comes; the session
        replays what was not answered)."""
        if self._failed or self._closed:
            return
        self._failed = True
        self._buffer.clear()
        current = asyncio.current_task() if self._tasks else None
        for task in self._tasks:
            if task is not current:
                task.cancel()
        log.debug("%s stream %s failed: %s: %s", self._owner.name, self._options.session_id, error.kind, error)
        self._events.put_nowait(error)

    def _emit(self, event: RecognitionEvent) -> None:
        if not (self._failed or self._closed):
            self._events.put_nowait(event)

    # -- one request -------------------------------------------------------------

    async def _run(self, req: _Request, audio: bytes) -> None:
        try:
            await self._transcribe(req, audio)
        except RecognitionError as error:
            self._fail(error)
        except asyncio.CancelledError:
            raise
        except Exception as exc:  # a bug or an answer nothing above foresaw: fail the stream, not the loop
            log.exception("%s: transcription request failed unexpectedly", self._owner.name)
            self._fail(RecognitionError("protocol", f"{self._owner.name}: {type(exc).__name__}: {exc}"))

    def form(self, audio: bytes) -> aiohttp.FormData:
        """The multipart form of one request for ``audio`` (16 kHz s16)."""
        cfg = self._owner.config
        form = aiohttp.FormData()
        form.add_field("file", wav_bytes(audio), filename="audio.wav", content_type="audio/wav")
        form.add_field("model", cfg.model_name)
        if language := language_code(cfg.language):
            form.add_field("language", language)
        if cfg.keyterms:
            form.add_field("prompt", ", ".join(t.strip() for t in cfg.keyterms))
        if cfg.word_timestamps:
            form.add_field("response_format", "verbose_json")
            form.add_field("timestamp_granularities[]", "word")
        else:
            form.add_field("response_format", "json")
        if cfg.stream:
            form.add_field("stream", "true")
        return form

    async def _transcribe(self, req: _Request, audio: bytes) -> None:
        owner = self._owner
        url = f"{owner.url}/audio/transcriptions"
        try:
            session = owner.client()
        except RuntimeError as exc:
            raise RecognitionError("closed", f"{owner.name}: {exc}") from None
        try:
            resp = await session.post(url, data=self.form(audio), headers=owner.auth_headers(), allow_redirects=False)
        except aiohttp.ClientError as exc:
            raise _request_error(exc, url) from None
        except (TimeoutError, OSError) as exc:
            raise RecognitionError("unreachable", f"cannot reach {url} (stt.base_url): {_describe(exc)}") from None
        complete = False
        try:
            if resp.status != 200:
                raise await self._refusal(resp, url)
            kind = resp.content_type
            try:
                if kind == "text/event-stream":
                    await self._read_events(req, resp, url)
                elif kind == "application/json" or kind.endswith("+json"):
                    self._answer(req, _parse_json(await _read_body(resp, url), url), url)
                elif kind == "text/plain":
                    text = _decode(await _read_body(resp, url), url)
                    self._answer(req, {"text": text}, url)
                else:
                    raise RecognitionError("protocol", f"{url} answered Content-Type {kind or 'none'!r}, not a transcription")
            except (aiohttp.ClientPayloadError, aiohttp.ClientConnectionError, OSError) as exc:
                raise RecognitionError("dropped", f"{url} broke the connection mid-answer: {_describe(exc)}") from None
            complete = True
        finally:
            if complete:
                resp.release()
            else:
                resp.close()  # tear the connection down: the server sees us gone

    async def _refusal(self, resp: aiohttp.ClientResponse, url: str) -> RecognitionError:
        """The error for a non-200 answer, with the provider's own message."""
        try:
            body = (await resp.content.read(4096)).decode("utf-8", "replace")
        except (aiohttp.ClientError, OSError):
            body = ""
        detail = f"{resp.status} {resp.reason}"
        message = _error_message(body)
        if resp.status in (401, 403):
            self._owner._refuse(detail)
            return RecognitionError("unauthorized", f"{self._owner.refused}: {message}" if message else str(self._owner.refused))
        what = "rate-limited the request" if resp.status == 429 else "refused the request" if resp.status < 500 else "failed"
        return RecognitionError("provider", f"{url} {what} ({detail}){': ' + message if message else ''}")

    def _answer(self, req: _Request, body: Any, url: str) -> None:
        """A whole answer (JSON object or text): its final, end and usage."""
        text, words, usage = _read_transcription(body, req, url)
        self._end(req, text, words, usage)

    def _end(self, req: _Request, text: str, words: tuple[Word, ...], usage: RecognitionUsage | None) -> None:
        self._emit(Final(text, req.start_s, req.end_s, words=words, finalized=True))
        self._emit(EndOfUtterance(req.end_s))
        if usage is None:
            usage = RecognitionUsage(audio_s=round(req.audio_s, 3), start_s=req.start_s, end_s=req.end_s, source="counted")
        self._emit(usage)

    async def _read_events(self, req: _Request, resp: aiohttp.ClientResponse, url: str) -> None:
        """An event stream in any of the three shapes (see the module doc)."""
        so_far = ""
        shape: str | None = None  # "openai" (type) or "vllm" (choices), from the first event
        finished = False  # vLLM: a choice had its finish_reason
        usage: RecognitionUsage | None = None
        loop = asyncio.get_running_loop()
        last_interim = -math.inf

        def interim(text: str) -> None:
            """The text so far, as an interim now and then (not per delta)."""
            nonlocal last_interim
            if len(text) > MAX_TEXT_CHARS:
                raise RecognitionError("protocol", f"{url} streamed more than {MAX_TEXT_CHARS} characters of text")
            if text.strip() and loop.time() - last_interim >= INTERIM_EVERY_S:
                last_interim = loop.time()
                self._emit(Interim(text.strip(), req.start_s, req.end_s))
        async for name, data in _sse(resp.content, url):
            if data.strip() == "[DONE]":
                if shape == "openai":
                    raise RecognitionError("protocol", f"{url} ended its event stream with [DONE] before transcript.text.done")
                self._end(req, so_far.strip(), (), usage)
                return
            event = _parse_json(data.encode(), url)
            if not isinstance(event, dict):
                raise RecognitionError("protocol", f"{url} sent an event that is not a JSON object: {data[:100]!r}")
            if name == "error" or event.get("type") == "error" or event.get("error") is not None:
                raise RecognitionError("provider", f"{url} reported an error mid-stream: {_error_message(json.dumps(event))}")
            kind = event.get("type")
            if kind is not None:
                if not isinstance(kind, str) or shape == "vllm":
                    raise RecognitionError("protocol", f"{url} sent an event of type {kind!r} in a {shape} stream")
                shape = "openai"
                if kind == "transcript.text.delta":
                    delta = event.get("delta")
                    if not isinstance(delta, str):
                        raise RecognitionError("protocol", f"{url} sent a delta that is not text: {data[:100]!r}")
                    so_far += delta
                    interim(so_far)
                elif kind == "transcript.text.done":
                    text, words, usage = _read_transcription(event, req, url)
                    self._end(req, text, words, usage)
                    return  # OpenAI's end; a trailing [DONE] is not waited for
                # other types (transcript.text.segment of the diarize model) carry nothing we use
                continue
            choices, chunk_usage = event.get("choices"), event.get("usage")
            if choices is None and chunk_usage is None:
                raise RecognitionError("protocol", f"{url} sent an event with neither type nor choices: {data[:100]!r}")
            if shape == "openai":
                raise RecognitionError("protocol", f"{url} sent a chat-style chunk in an OpenAI event stream")
            shape = "vllm"
            if chunk_usage is not None:
                usage = _chunk_usage(chunk_usage, req, url)
            if choices is None:
                choices = []
            if not isinstance(choices, list):
                raise RecognitionError("protocol", f"{url} sent choices that are not a list")
            for choice in choices:
                delta = choice.get("delta") if isinstance(choice, dict) else None
                content = delta.get("content") if isinstance(delta, dict) else None
                if not isinstance(delta, dict) or not isinstance(content, str | None):
                    raise RecognitionError("protocol", f"{url} sent a choice without a text delta: {data[:100]!r}")
                if content:
                    so_far += content
                    interim(so_far)
                if choice.get("finish_reason") is not None:
                    finished = True
        if shape == "vllm" and finished:  # tolerated: the text is whole, only [DONE] is missing
            self._end(req, so_far.strip(), (), usage)
            return
        raise RecognitionError("protocol", f"{url} ended its event stream before the transcript was done")


# -- reading answers -----------------------------------------------------------


def _describe(exc: BaseException) -> str:
    text = str(exc).strip()
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def _request_error(exc: aiohttp.ClientError, url: str) -> RecognitionError:
    """The kind of a failure before the answer's status arrived."""
    if isinstance(exc, aiohttp.ClientConnectorError | aiohttp.ConnectionTimeoutError | aiohttp.InvalidURL):
        return RecognitionError("unreachable", f"cannot reach {url} (stt.base_url): {_describe(exc)}")
    if isinstance(exc, aiohttp.ClientResponseError):
        return RecognitionError("protocol", f"{url} answered something that is not HTTP: {_describe(exc)}")
    return RecognitionError("dropped", f"{url} broke the connection before answering: {_describe(exc)}")


async def _read_body(resp: aiohttp.ClientResponse, url: str) -> bytes:
    """The whole body, at most :data:`MAX_BODY_BYTES`.

    Raises:
        RecognitionError: ``protocol`` if it is longer.
    """
    if resp.content_length is not None and resp.content_length > MAX_BODY_BYTES:
        raise RecognitionError("protocol", f"{url} answered {resp.content_length} bytes (more than {MAX_BODY_BYTES})")
    body = bytearray()
    async for chunk in resp.content.iter_any():
        body += chunk
        if len(body) > MAX_BODY_BYTES:
            raise RecognitionError("protocol", f"{url} answered more than {MAX_BODY_BYTES} bytes")
    return bytes(body)


def _decode(raw: bytes, url: str) -> str:
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        raise RecognitionError("protocol", f"{url} answered text that is not UTF-8") from None


def _no_constant(name: str) -> Any:
    raise ValueError(f"{name} is not a number JSON allows")


def _parse_json(raw: bytes, url: str) -> Any:
    try:
        return json.loads(_decode(raw, url), parse_constant=_no_constant)
    except (ValueError, RecursionError):
        raise RecognitionError("protocol", f"{url} answered something that is not JSON: {raw[:100]!r}") from None


def _error_message(body: str) -> str:
    """The provider's own words from an error body: OpenAI's and vLLM's
    ``{"error": {"message"}}``, vLLM's ``{"error": "Unauthorized"}``,
    FastAPI's (speaches) ``{"detail"}``, or the text itself."""
    try:
        data = json.loads(body)
    except (ValueError, RecursionError):
        return " ".join(body.split())[:ERROR_TEXT_CHARS]
    if isinstance(data, dict):
        err = data.get("error", data)
        if isinstance(err, dict):
            msg = err.get("message", err.get("detail"))
            if msg is not None:
                return str(msg)[:ERROR_TEXT_CHARS]
        elif isinstance(err, str):
            return err[:ERROR_TEXT_CHARS]
    return " ".join(body.split())[:ERROR_TEXT_CHARS]


def _number(value: Any) -> TypeGuard[int | float]:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def _count(value: Any) -> TypeGuard[int]:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 0


def _read_transcription(body: Any, req: _Request, url: str) -> tuple[str, tuple[Word, ...], RecognitionUsage | None]:
    """Text, words (stream seconds) and usage of a JSON transcription, a
    verbose one or a ``transcript.text.done`` event.

    Raises:
        RecognitionError: ``provider`` for an error body, ``protocol`` for
            wrong shapes.
    """
    if not isinstance(body, dict):
        raise RecognitionError("protocol", f"{url} answered JSON that is not an object")
    if "text" not in body and "error" in body:
        raise RecognitionError("provider", f"{url} answered an error: {_error_message(json.dumps(body))}")
    text = body.get("text")
    if not isinstance(text, str):
        raise RecognitionError("protocol", f"{url} answered without a text: {json.dumps(body)[:100]}")
    words: list[Word] = []
    raw_words = body.get("words")
    if raw_words is not None:
        if not isinstance(raw_words, list):
            raise RecognitionError("protocol", f"{url} answered words that are not a list")
        for w in raw_words:
            if not (isinstance(w, dict) and isinstance(w.get("word"), str) and _number(w.get("start")) and _number(w.get("end"))):
                raise RecognitionError("protocol", f"{url} answered a word without word, start and end: {json.dumps(w)[:100]}")
            if not w["word"].strip():
                continue
            start = min(req.end_s, req.start_s + max(0.0, float(w["start"])))
            end = min(req.end_s, max(start, req.start_s + float(w["end"])))
            conf = w.get("probability", w.get("confidence"))
            words.append(Word(w["word"].strip(), round(start, 3), round(end, 3), float(conf) if _number(conf) and 0 <= conf <= 1 else None))
    usage = _usage(body.get("usage"), req, url)
    return text.strip(), tuple(words), usage


def _usage(raw: Any, req: _Request, url: str) -> RecognitionUsage | None:
    """OpenAI's ``{"type": "tokens", "input_tokens", "output_tokens"}`` or
    ``{"type": "duration", "seconds"}``; None when absent or of another type
    (the request's audio is then counted)."""
    if raw is None:
        return None
    if not isinstance(raw, dict):
        raise RecognitionError("protocol", f"{url} answered a usage that is not an object")
    kind = raw.get("type")
    if kind == "tokens":
        i, o = raw.get("input_tokens", 0), raw.get("output_tokens", 0)
        if not (_count(i) and _count(o)):
            raise RecognitionError("protocol", f"{url} answered token usage without token counts: {json.dumps(raw)[:100]}")
        return RecognitionUsage(input_tokens=i, output_tokens=o, start_s=req.start_s, end_s=req.end_s)
    if kind == "duration":
        sec = raw.get("seconds")
        if not (_number(sec) and sec >= 0):
            raise RecognitionError("protocol", f"{url} answered duration usage without seconds: {json.dumps(raw)[:100]}")
        return RecognitionUsage(audio_s=float(sec), start_s=req.start_s, end_s=req.end_s)
    if kind is None and ("prompt_tokens" in raw or "completion_tokens" in raw):
        return _chunk_usage(raw, req, url)
    return None


def _chunk_usage(raw: Any, req: _Request, url: str) -> RecognitionUsage:
    """vLLM's usage chunk ``{"prompt_tokens", "completion_tokens", "total_tokens"}``."""
    if not isinstance(raw, dict):
        raise RecognitionError("protocol", f"{url} sent a usage that is not an object")
    i, o = raw.get("prompt_tokens", 0), raw.get("completion_tokens", 0)
    if not (_count(i) and _count(o)):
        raise RecognitionError("protocol", f"{url} sent a usage without token counts: {json.dumps(raw)[:100]}")
    return RecognitionUsage(input_tokens=i, output_tokens=o, start_s=req.start_s, end_s=req.end_s)


async def _sse(content: aiohttp.StreamReader, url: str) -> AsyncIterator[tuple[str, str]]:
    """``(event name, data)`` of each server-sent event (WHATWG rules: a
    blank line ends an event, ``:`` lines are comments, multi-line data is
    joined with newlines), bounded by :data:`MAX_SSE_LINE_BYTES` a line and
    :data:`MAX_SSE_BYTES` in all.

    Raises:
        RecognitionError: ``protocol`` for a line or stream over its bound,
            or text that is not UTF-8.
    """
    pending = bytearray()
    total = 0
    data: list[str] = []
    name = ""

    def line_of(raw: bytes) -> str:
        return _decode(raw[:-1] if raw.endswith(b"\r") else raw, url)

    lines: list[str] = []
    async for chunk in content.iter_any():
        total += len(chunk)
        if total > MAX_SSE_BYTES:
            raise RecognitionError("protocol", f"{url} sent an event stream over {MAX_SSE_BYTES} bytes")
        pending += chunk
        while (i := pending.find(b"\n")) >= 0:
            lines.append(line_of(bytes(pending[:i])))
            del pending[: i + 1]
        if len(pending) > MAX_SSE_LINE_BYTES:
            raise RecognitionError("protocol", f"{url} sent an event line over {MAX_SSE_LINE_BYTES} bytes")
        for line in lines:
            if not line:
                if data:
                    yield name, "\n".join(data)
                data, name = [], ""
            elif line.startswith(":"):
                continue
            else:
                field_name, _, value = line.partition(":")
                value = value[1:] if value.startswith(" ") else value
                if field_name == "data":
                    data.append(value)
                elif field_name == "event":
                    name = value
        lines.clear()
    if pending:  # a last line without its newline
        field_name, _, value = line_of(bytes(pending)).partition(":")
        if field_name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield name, "\n".join(data)
