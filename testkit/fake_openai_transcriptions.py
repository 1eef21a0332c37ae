"""A local OpenAI-compatible ``/v1/audio/transcriptions`` server, in the
dialects of OpenAI, speaches and vLLM, for tests and benchmarks of
:mod:`voice.openai_stt` (a real HTTP server on a real socket, no mocks).

Its transcripts are real recognition of the audio it receives: the file is
decoded (:func:`testkit.stt_backend.wav_pcm16k`) and recognised by the
embedded recogniser (:class:`testkit.stt_backend.SttBackend`; with a JSGF
grammar, exact for the phrases it lists), and answered after the
provider's latency (:class:`testkit.stt_backend.Latency`: the final
``final_s`` after the request's audio arrived, streamed deltas
``interim_s`` apart from ``interim_s`` on).

What each dialect does, from shared/reference/speech-providers.md
(sections 1.3, 1.4 and the sources they cite):

``openai`` (``openai-python`` ``types/audio/*``)
    401 ``{"error": {"message", "type": "invalid_request_error", "code":
    "invalid_api_key"}}`` without the right ``Authorization: Bearer``;
    ``verbose_json`` (and ``timestamp_granularities[]``) only for
    ``whisper-1``, ``timestamp_granularities[]`` only with ``verbose_json``,
    ``language`` only as ISO-639-1, each else 400; ``json`` is ``{"text",
    "usage"}`` (``{"type": "tokens", ...}``, ``{"type": "duration",
    "seconds"}`` for ``whisper-1``); ``text`` is ``text/plain`` with a
    trailing newline; ``stream=true`` is server-sent
    ``transcript.text.delta`` events word by word and a
    ``transcript.text.done`` with token usage, except for ``whisper-1``,
    whose streaming is ignored (it answers as if not asked).
``speaches`` (``src/speaches/routers/stt.py``, ``executors/whisper.py``,
    ``dependencies.py``)
    403 ``{"detail": "Invalid API key. ..."}`` (FastAPI's shape); a missing
    field 422 ``{"detail": [...]}``; no usage anywhere; words and streamed
    text keep faster-whisper's leading spaces (the JSON ``text`` is
    stripped, the streamed ``done`` text is not); ``stream=true`` is one
    ``transcript.text.delta`` per segment (the whole text is one segment
    here) and a ``done`` without usage, whatever ``response_format`` says.
``vllm`` (``vllm/entrypoints/openai/speech_to_text/*``)
    401 ``{"error": "Unauthorized"}``; errors ``{"error": {"message",
    "type", "param", "code": <status>}}``; ``json`` *and* ``text`` are
    answered as JSON ``{"text", "usage": {"type": "duration", "seconds":
    <whole seconds, rounded up>}}`` with Whisper's leading space;
    ``verbose_json`` has segments but no words and a ``duration`` that is a
    string, and refuses ``stream=true``; ``stream=true`` is chat-style
    ``transcription.chunk`` chunks (``choices[].delta.content``,
    ``finish_reason`` on the last), a usage chunk when asked
    (``stream_include_usage=true``, or the ``usage_chunk`` knob standing for
    ``--enable-force-include-usage``) and ``data: [DONE]``.

``GET /v1/models`` answers the model list (with the dialect's refusal
without the key; 404 with ``models=False``, as servers without it).

Knobs (attributes, changeable while it runs): ``api_key``, ``dialect``,
``latency``, ``status`` (answer with this status and the dialect's error
body), ``garbage`` (see :data:`Garbage`), ``hang`` (never answer, until the
client goes), ``drop`` (close the connection mid-body), ``faults`` (how
many transcription requests the faults above apply to; None: all),
``usage_chunk``, ``done_marker`` (end an OpenAI/speaches event stream with
``data: [DONE]`` too: tolerated by clients, not sent by default),
``answer_as`` (answer in this format whatever was asked, as servers that
ignore ``response_format`` do), ``extra_delay_s`` (per request, in order of
arrival: to make answers finish out of order), ``models``.

Every request is recorded (:class:`RecordedRequest`: headers, form fields,
audio and its seconds, what was answered, when, and whether the client went
away first).

Run it alone: ``python -m testkit.fake_openai_transcriptions --port 8098
[--grammar FILE] [--dialect openai|speaches|vllm] [--api-key KEY]``.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import math
import re
import signal
import time
import wave
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import BodyPartReader, web

from testkit.stt_backend import Latency, SttBackend, wav_pcm16k
from voice.recognition import Word

Dialect = Literal["openai", "speaches", "vllm"]
#: bad answers: ``json`` (200 ``application/json`` that is not JSON),
#: ``shape`` (JSON, or an event, of the wrong shape), ``sse`` (an event
#: stream that ends before its end), ``sse_json`` (an event that is not
#: JSON), ``huge`` (a 2 MiB JSON body, chunked), ``huge_sse`` (one 256 KiB
#: event line), ``content_type`` (200 ``text/html``), ``error_event`` (an
#: error reported mid-stream, in the dialect's shape)
Garbage = Literal["json", "shape", "sse", "sse_json", "huge", "huge_sse", "content_type", "error_event"]

#: the most a request may upload, bytes (OpenAI: 25 MB)
MAX_UPLOAD_BYTES = 25 * 1024 * 1024
RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
#: models whose streaming OpenAI ignores (TranscriptionCreateParamsStreaming)
NO_STREAMING_MODELS = ("whisper-1",)


@dataclass
class RecordedRequest:
    """One request the fake received, and what it did with it.

    Attributes:
        method / path: the request line.
        headers: its headers (the last of each name).
        fields: its form fields but the file, name -> values in order.
        file_name / file_type: the ``file`` part's filename and Content-Type.
        pcm: the file's audio as 16 kHz mono s16 (None: no WAV).
        audio_s: its seconds (None: no WAV).
        wav_format: (rate Hz, channels, sample bytes) of the WAV as sent.
        status: the status answered (0: none yet, or never).
        content_type: the answer's Content-Type.
        text: the transcript recognised.
        sent: the answer as sent (the body, or each event's data).
        received_at / answered_at: ``time.monotonic()`` when its body had
            arrived and when its handler finished (None: not yet).
        disconnected: the client went away before the answer ended.
    """

    method: str
    path: str
    headers: dict[str, str]
    fields: dict[str, list[str]] = field(default_factory=dict)
    file_name: str | None = None
    file_type: str | None = None
    pcm: bytes | None = None
    audio_s: float | None = None
    wav_format: tuple[int, int, int] | None = None
    status: int = 0
    content_type: str = ""
    text: str = ""
    sent: list[str] = field(default_factory=list)
    received_at: float = 0.0
    answered_at: float | None = None
    disconnected: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)

    def field(self, name: str) -> str | None:
        """The (first) value of a form field, None if absent."""
        values = self.fields.get(name)
        return values[0] if values else None


class _Refused(Exception):
    def __init__(self, response: web.StreamResponse) -> None:
        self.response = response


class FakeTranscriptions:
    """The fake server (see the module doc); :meth:`app` is its aiohttp app,
    :meth:`start` runs it on 127.0.0.1.

    Args:
        backend: the recogniser behind it (started by the caller).
        dialect: ``"openai"``, ``"speaches"`` or ``"vllm"``.
        api_key: the key required as ``Authorization: Bearer`` (None: none).
        latency: answer times (default 150 ms interim, 300 ms final).
        Other knobs: see the module doc; all are attributes.
    """

    def __init__(
        self,
        backend: SttBackend,
        *,
        dialect: Dialect = "openai",
        api_key: str | None = None,
        latency: Latency | None = None,
        status: int | None = None,
        garbage: Garbage | None = None,
        hang: bool = False,
        drop: bool = False,
        faults: int | None = None,
        usage_chunk: bool = False,
        done_marker: bool = False,
        answer_as: str | None = None,
        extra_delay_s: list[float] | None = None,
        models: bool = True,
    ) -> None:
        self.backend = backend
        self.dialect: Dialect = dialect
        self.api_key = api_key
        self.latency = latency or Latency()
        self.status = status
        self.garbage: Garbage | None = garbage
        self.hang = hang
        self.drop = drop
        self.faults = faults
        self.usage_chunk = usage_chunk
        self.done_marker = done_marker
        self.answer_as = answer_as
        self.extra_delay_s = list(extra_delay_s or [])
        self.models = models
        #: transcription requests, in order of arrival
        self.requests: list[RecordedRequest] = []
        #: GET /v1/models requests
        self.model_requests: list[RecordedRequest] = []
        self._runner: web.AppRunner | None = None
        self._closing = asyncio.Event()
        self.url = ""

    # -- running -------------------------------------------------------------------

    def app(self) -> web.Application:
        """The aiohttp application (routes under ``/v1``)."""
        app = web.Application(client_max_size=MAX_UPLOAD_BYTES + 1024 * 1024)
        app.router.add_post("/v1/audio/transcriptions", self.transcriptions)
        app.router.add_get("/v1/models", self.list_models)
        return app

    async def start(self, host: str = "127.0.0.1", port: int = 0) -> str:
        """Serve on ``host:port`` (0: a free port); returns the base URL up to ``/v1``."""
        self._runner = web.AppRunner(self.app(), access_log=None, shutdown_timeout=1.0)
        await self._runner.setup()
        site = web.TCPSite(self._runner, host, port)
        await site.start()
        bound = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        self.url = f"http://{host}:{bound}/v1"
        return self.url

    async def aclose(self) -> None:
        """Stop serving (hanging answers end). Idempotent."""
        self._closing.set()
        runner, self._runner = self._runner, None
        if runner is not None:
            await runner.cleanup()

    # -- what it answers -------------------------------------------------------------

    @staticmethod
    def token_usage(audio_s: float, prompt: str, text: str) -> tuple[int, int]:
        """The (input, output) tokens the fake bills: 10 audio tokens a
        second (rounded up) plus a token a prompt word; a token a transcript
        word plus one. Its own estimate, not OpenAI's tokenizer."""
        return math.ceil(audio_s * 10) + len(prompt.split()), len(text.split()) + 1

    def _faulty(self) -> bool:
        """Do the faults apply to this request (and count it)?"""
        if self.faults is None:
            return True
        if self.faults > 0:
            self.faults -= 1
            return True
        return False

    def _error(self, status: int, message: str, *, code: str | None = None, param: str | None = None) -> web.Response:
        """The dialect's error body."""
        if self.dialect == "speaches":
            return web.json_response({"detail": message}, status=status)
        if self.dialect == "vllm":
            kind = {400: "BadRequestError", 404: "NotFoundError", 429: "TooManyRequests"}.get(
                status, "InternalServerError" if status >= 500 else "BadRequestError"
            )
            return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": status}}, status=status)
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status == 429:
            kind, code = "requests", code or "rate_limit_exceeded"
        return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)

    def _fault_status(self, status: int) -> web.Response:
        message = {
            429: "Rate limit reached for requests. Please try again in 1s.",
            500: "The server had an error while processing your request. Sorry about that!",
            502: "Bad gateway.",
            503: "The engine is currently overloaded, please try again later.",
        }.get(status, f"fake status {status}")
        return self._error(status, message)

    def _check_auth(self, request: web.Request) -> None:
        """Raise the dialect's refusal unless the key is right."""
        if self.api_key is None:
            return
        header = request.headers.get("Authorization", "")
        if header == f"Bearer {self.api_key}":
            return
        given = header[7:] if header.startswith("Bearer ") else ""
        if self.dialect == "speaches":
            detail = ("Invalid API key. The provided API key is incorrect." if given else
                      "API key required. Please provide an API key using the Authorization header with Bearer scheme.")
            raise _Refused(web.json_response({"detail": detail}, status=403, headers={"WWW-Authenticate": "Bearer"}))
        if self.dialect == "vllm":
            raise _Refused(web.json_response({"error": "Unauthorized"}, status=401))
        message = (f"Incorrect API key provided: {given[:3]}***{given[-4:]}. You can find your API key at "
                   "https://platform.openai.com/account/api-keys." if given else
                   "You didn't provide an API key. You need to provide your API key in an Authorization header "
                   "using Bearer auth (i.e. Authorization: Bearer YOUR_KEY).")
        raise _Refused(web.json_response(
            {"error": {"message": message, "type": "invalid_request_error", "param": None, "code": "invalid_api_key"}}, status=401
        ))

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``: the model list (the dialect's refusal without the key)."""
        record = RecordedRequest(request.method, request.path, dict(request.headers), received_at=time.monotonic())
        self.model_requests.append(record)
        try:
            self._check_auth(request)
            if not self.models:
                raise _Refused(web.Response(status=404, text="Not Found"))
            if self.status is not None and (self.faults is None or self.faults > 0):
                raise _Refused(self._fault_status(self.status))
        except _Refused as refused:
            record.status = refused.response.status
            record.answered_at = time.monotonic()
            record.done.set()
            return refused.response
        ids = {"openai": ["whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"],
               "speaches": ["Systran/faster-whisper-small"], "vllm": ["openai/whisper-large-v3"]}[self.dialect]
        data = [{"id": i, "object": "model", "created": 1_700_000_000, "owned_by": self.dialect} for i in ids]
        record.status = 200
        record.answered_at = time.monotonic()
        record.done.set()
        return web.json_response({"object": "list", "data": data})

    async def transcriptions(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/audio/transcriptions`` (see the module doc)."""
        record = RecordedRequest(request.method, request.path, dict(request.headers))
        index = len(self.requests)
        self.requests.append(record)
        try:
            try:
                response = await self._transcribe(request, record, index)
            except _Refused as refused:
                response = refused.response
            record.status = record.status or response.status
            record.content_type = record.content_type or response.content_type
            return response
        finally:
            record.answered_at = time.monotonic()
            record.done.set()

    async def _read_form(self, request: web.Request, record: RecordedRequest) -> bytes | None:
        """Parse the multipart form strictly; returns the file's bytes (None: no file)."""
        if request.content_type != "multipart/form-data":
            raise _Refused(self._error(400, f"Expected multipart/form-data, got {request.content_type or 'nothing'}."))
        file: bytes | None = None
        try:
            reader = await request.multipart()
            total = 0
            while (part := await reader.next()) is not None:
                if not isinstance(part, BodyPartReader) or not part.name:
                    raise _Refused(self._error(400, "Malformed multipart body: a part without a name."))
                data = bytearray()
                while chunk := await part.read_chunk(1 << 16):
                    data += chunk
                    total += len(chunk)
                    if total > MAX_UPLOAD_BYTES:
                        raise _Refused(self._error(413, f"Maximum content size limit ({MAX_UPLOAD_BYTES}) exceeded."))
                if part.name == "file":
                    if part.filename is None:
                        raise _Refused(self._error(400, "'file' must be a file upload.", param="file"))
                    file = bytes(data)
                    record.file_name = part.filename
                    record.file_type = part.headers.get("Content-Type")
                else:
                    record.fields.setdefault(part.name, []).append(data.decode("utf-8"))
        except (ValueError, UnicodeDecodeError, AssertionError) as exc:
            raise _Refused(self._error(400, f"Malformed multipart body: {exc}")) from None
        return file

    def _missing(self, name: str) -> web.Response:
        if self.dialect == "speaches":  # FastAPI's validation error
            return web.json_response({"detail": [{"type": "missing", "loc": ["body", name], "msg": "Field required", "input": None}]},
                                     status=422)
        return self._error(400, f"you must provide a {name} parameter" if name == "model" else
                           "Could not parse multipart form: 'file' is required", param=name)

    async def _transcribe(self, request: web.Request, record: RecordedRequest, index: int) -> web.StreamResponse:
        self._check_auth(request)
        file = await self._read_form(request, record)
        record.received_at = time.monotonic()
        if file is None:
            raise _Refused(self._missing("file"))
        model = record.field("model")
        if not model:
            raise _Refused(self._missing("model"))
        fmt = record.field("response_format") or "json"
        if fmt not in RESPONSE_FORMATS:
            raise _Refused(self._error(400, f"Invalid response_format {fmt!r}.", param="response_format"))
        granularities = record.fields.get("timestamp_granularities[]", [])
        if granularities and fmt != "verbose_json":
            raise _Refused(self._error(400, "timestamp_granularities[] is only supported with response_format verbose_json.",
                                       param="timestamp_granularities"))
        if any(g not in ("word", "segment") for g in granularities):
            raise _Refused(self._error(400, f"Invalid timestamp_granularities[]: {granularities}.", param="timestamp_granularities"))
        stream = (record.field("stream") or "false").lower() == "true"
        language = record.field("language")
        if self.dialect == "openai":
            if fmt == "verbose_json" and model not in NO_STREAMING_MODELS:
                raise _Refused(self._error(400, f"response_format 'verbose_json' is not compatible with model '{model}'. "
                                           "Use 'json' or 'text' instead.", param="response_format"))
            if language is not None and not re.fullmatch(r"[a-z]{2}", language):
                raise _Refused(self._error(400, f"Invalid language '{language}'. Language parameter must be specified in "
                                           "ISO-639-1 format.", param="language"))
            if model in NO_STREAMING_MODELS:
                stream = False  # ignored for whisper-1
        if self.dialect == "vllm" and fmt not in ("json", "text", "verbose_json"):
            raise _Refused(self._error(400, "Currently only support response_format: `text`, `json` or `verbose_json`"))
        if self.dialect == "vllm" and fmt == "verbose_json" and stream:
            raise _Refused(self._error(400, "verbose_json format doesn't support streaming case"))
        try:
            pcm = wav_pcm16k(file)
        except ValueError as exc:
            raise _Refused(self._error(400, "Invalid file format. Supported formats: ['flac', 'm4a', 'mp3', 'mp4', "
                                       f"'mpeg', 'mpga', 'oga', 'ogg', 'wav', 'webm'] ({exc})", param="file")) from None
        record.wav_format = _wav_format(file)
        record.pcm = pcm
        record.audio_s = len(pcm) / 32000
        faulty = (self.status is not None or self.garbage is not None or self.hang or self.drop) and self._faulty()
        if faulty and self.status is not None:
            raise _Refused(self._fault_status(self.status))
        if faulty and self.hang:
            await self._until_gone(request, record)
            raise _Refused(web.Response(status=504, text="hung"))
        if self.answer_as is not None:
            fmt = self.answer_as
        if stream:  # speaches streams whatever response_format says
            fmt = "sse"
        start_at = record.received_at + (self.extra_delay_s[index] if index < len(self.extra_delay_s) else 0.0)
        recognised = asyncio.ensure_future(self._recognise(pcm))
        try:
            if faulty and self.garbage is not None:
                return await self._garbage(request, record, stream, start_at)
            if fmt == "sse":
                return await self._stream(request, record, recognised, start_at, model, faulty and self.drop)
            text, words = await recognised
            record.text = text
            await _sleep_until(start_at + self.latency.final_s)
            body, content_type = self._body(fmt, text, words, record, model)
            return await self._send(request, record, body, content_type, faulty and self.drop)
        finally:
            if not recognised.done():
                recognised.cancel()

    async def _recognise(self, pcm: bytes) -> tuple[str, list[Word]]:
        utt = self.backend.utterance()
        try:
            utt.feed(pcm)
            return await utt.finish()
        finally:
            await utt.aclose()

    def _body(self, fmt: str, text: str, words: list[Word], record: RecordedRequest, model: str) -> tuple[str, str]:
        """The non-streamed answer: (body, Content-Type)."""
        audio_s = record.audio_s or 0.0
        prompt = record.field("prompt") or ""
        lead = " " if text and self.dialect in ("speaches", "vllm") else ""
        if self.dialect == "vllm":
            duration_usage = {"type": "duration", "seconds": math.ceil(audio_s)}
            if fmt == "verbose_json":
                segment = {"id": 0, "seek": 0, "start": 0.0, "end": round(audio_s, 2), "text": lead + text, "tokens": [],
                           "temperature": 0.0, "avg_logprob": -0.2, "compression_ratio": 1.0, "no_speech_prob": None}
                return json.dumps({"text": lead + text, "language": record.field("language"), "duration": str(audio_s),
                                   "segments": [segment] if text else []}), "application/json"
            return json.dumps({"text": lead + text, "usage": duration_usage}), "application/json"  # text too: JSON
        if fmt == "text":
            return (text + "\n" if self.dialect == "openai" else text), "text/plain"
        if fmt in ("srt", "vtt"):
            end = _timestamp(audio_s, "," if fmt == "srt" else ".")
            start = _timestamp(0.0, "," if fmt == "srt" else ".")
            cue = f"1\n{start} --> {end}\n{text}\n"
            return (cue if fmt == "srt" else f"WEBVTT\n\n{cue}"), ("text/plain" if fmt == "srt" else "text/vtt")
        usage: dict[str, Any] | None
        if self.dialect == "speaches":
            usage = None
        elif model in NO_STREAMING_MODELS or fmt == "verbose_json":
            usage = {"type": "duration", "seconds": math.ceil(audio_s)}
        else:
            i, o = self.token_usage(audio_s, prompt, text)
            usage = {"type": "tokens", "input_tokens": i, "input_token_details": {"audio_tokens": i - len(prompt.split()),
                     "text_tokens": len(prompt.split())}, "output_tokens": o, "total_tokens": i + o}
        if fmt == "verbose_json":
            with_words = "word" in record.fields.get("timestamp_granularities[]", [])
            body: dict[str, Any] = {
                "task": "transcribe", "language": "english" if self.dialect == "openai" else (record.field("language") or "en"),
                "duration": round(audio_s, 3), "text": text,
                "segments": [{"id": 0, "seek": 0, "start": 0.0, "end": round(audio_s, 2), "text": lead + text, "tokens": [],
                              "temperature": 0.0, "avg_logprob": -0.2, "compression_ratio": 1.0, "no_speech_prob": 0.01}],
            }
            if with_words:
                body["words"] = [{"word": lead + w.text, "start": round(w.start_s, 2), "end": round(w.end_s, 2)} for w in words]
            elif self.dialect == "speaches":
                body["words"] = None
            body["usage"] = usage
            return json.dumps(body), "application/json"
        body = {"text": text}
        if usage is not None or self.dialect == "speaches":
            body["usage"] = usage
        return json.dumps(body), "application/json"

    async def _send(self, request: web.Request, record: RecordedRequest, body: str, content_type: str,
                    drop: bool) -> web.StreamResponse:
        """Answer ``body`` whole, or (``drop``) half of it, then close the connection."""
        raw = body.encode()
        record.sent.append(body)
        if not drop:
            resp = web.Response(body=raw, content_type=content_type, charset="utf-8")
            record.status, record.content_type = 200, content_type
            record.answered_at = time.monotonic()
            return resp
        stream = web.StreamResponse(headers={"Content-Type": f"{content_type}; charset=utf-8"})
        stream.content_length = len(raw)
        await stream.prepare(request)
        await stream.write(raw[: len(raw) // 2])
        record.status, record.content_type = 200, content_type
        _close(request)
        return stream

    async def _stream(self, request: web.Request, record: RecordedRequest, recognised: asyncio.Future[tuple[str, list[Word]]],
                      start_at: float, model: str, drop: bool) -> web.StreamResponse:
        """The dialect's event stream (see the module doc); ``drop``: the
        connection is closed after the first event."""
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        await resp.prepare(request)
        record.status, record.content_type = 200, "text/event-stream"
        text, _words = await recognised
        record.text = text
        audio_s = record.audio_s or 0.0
        prompt = record.field("prompt") or ""
        pieces: list[str]
        if self.dialect == "speaches":
            pieces = [" " + text] if text else []  # one delta per segment, faster-whisper's leading space
        elif self.dialect == "vllm":
            pieces = [" " + w for w in text.split()]
        else:
            pieces = [w if k == 0 else " " + w for k, w in enumerate(text.split())]
        at = start_at
        for k, piece in enumerate(pieces):
            at = start_at + self.latency.interim_s * (k + 1)
            await _sleep_until(at)
            if drop and k == 1:
                _close(request)
                return resp
            if not await self._event(request, resp, record, self._delta(piece, model, record)):
                return resp
        if drop and len(pieces) < 2:
            _close(request)
            return resp
        await _sleep_until(max(at, start_at + self.latency.final_s))
        events: list[dict[str, Any] | str] = []
        if self.dialect == "vllm":
            events.append(self._chunk(model, record, "", finish=True))
            if self.usage_chunk or (record.field("stream_include_usage") or "").lower() == "true":
                i, o = self.token_usage(audio_s, prompt, text)
                events.append({"id": self._chunk_id(record), "object": "transcription.chunk", "created": int(time.time()),
                               "model": model, "choices": [], "usage": {"prompt_tokens": i, "completion_tokens": o,
                                                                        "total_tokens": i + o}})
            events.append("[DONE]")
        else:
            done: dict[str, Any] = {"type": "transcript.text.done", "text": "".join(pieces) if self.dialect == "speaches" else text}
            if self.dialect == "speaches":
                done["logprobs"] = None
                done["usage"] = None
            else:
                i, o = self.token_usage(audio_s, prompt, text)
                done["usage"] = {"type": "tokens", "input_tokens": i, "input_token_details": {
                    "audio_tokens": i - len(prompt.split()), "text_tokens": len(prompt.split())},
                    "output_tokens": o, "total_tokens": i + o}
            events.append(done)
            if self.done_marker:
                events.append("[DONE]")
        for event in events:
            if not await self._event(request, resp, record, event):
                return resp
        await resp.write_eof()
        record.answered_at = time.monotonic()
        return resp

    def _chunk_id(self, record: RecordedRequest) -> str:
        return f"transcribe-{id(record):x}"

    def _chunk(self, model: str, record: RecordedRequest, content: str, *, finish: bool = False) -> dict[str, Any]:
        choice: dict[str, Any] = {"delta": {"content": content}}
        if finish:
            choice.update(finish_reason="stop", stop_reason=None)
        return {"id": self._chunk_id(record), "object": "transcription.chunk", "created": int(time.time()),
                "model": model, "choices": [choice]}

    def _delta(self, piece: str, model: str, record: RecordedRequest) -> dict[str, Any]:
        if self.dialect == "vllm":
            return self._chunk(model, record, piece)
        event: dict[str, Any] = {"type": "transcript.text.delta", "delta": piece}
        if self.dialect == "speaches":
            event.update(logprobs=None, segment_id=None)
        return event

    async def _event(self, request: web.Request, resp: web.StreamResponse, record: RecordedRequest,
                     event: dict[str, Any] | str) -> bool:
        """Send one ``data:`` event; False if the client is gone."""
        data = event if isinstance(event, str) else json.dumps(event)
        if _gone(request):
            record.disconnected = True
            return False
        try:
            await resp.write(f"data: {data}\n\n".encode())
        except (ConnectionError, RuntimeError):
            record.disconnected = True
            return False
        record.sent.append(data)
        return True

    async def _garbage(self, request: web.Request, record: RecordedRequest, stream: bool, start_at: float) -> web.StreamResponse:
        """A bad answer of the kind ``self.garbage`` (see :data:`Garbage`)."""
        kind = self.garbage
        await _sleep_until(start_at + self.latency.final_s)
        record.status = 200
        if kind == "content_type":
            record.content_type = "text/html"
            return web.Response(text="<html><body><h1>Welcome to nginx!</h1></body></html>", content_type="text/html")
        if kind == "json":
            record.content_type = "application/json"
            return web.Response(text="<html><body><h1>502 Bad Gateway</h1></body></html>", content_type="application/json")
        if kind == "shape" and not stream:
            record.content_type = "application/json"
            return web.json_response({"text": ["tell", "me"], "words": "none"})
        if kind == "huge":
            resp = web.StreamResponse(headers={"Content-Type": "application/json"})  # chunked: no length to refuse early
            await resp.prepare(request)
            record.content_type = "application/json"
            await resp.write(b'{"text": "')
            for _ in range(32):
                if _gone(request):
                    record.disconnected = True
                    return resp
                try:
                    await resp.write(b"a" * 65536)
                except (ConnectionError, RuntimeError):
                    record.disconnected = True
                    return resp
            await resp.write(b'"}')
            await resp.write_eof()
            return resp
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await resp.prepare(request)
        record.content_type = "text/event-stream"
        first = ({"type": "transcript.text.delta", "delta": "tell"} if self.dialect != "vllm" else
                 {"object": "transcription.chunk", "choices": [{"delta": {"content": " tell"}}]})
        lines: list[str]
        if kind == "shape":
            lines = ['{"type": "transcript.text.delta", "delta": 42}' if self.dialect != "vllm" else
                     '{"object": "transcription.chunk", "choices": [{"delta": "tell"}]}']
        elif kind == "sse":
            lines = [json.dumps(first)]  # and then the stream just ends
        elif kind == "sse_json":
            lines = [json.dumps(first), '{"type": "transcript.text.delta", "delta": "me']
        elif kind == "huge_sse":
            lines = [json.dumps({"type": "transcript.text.delta", "delta": "a" * (256 * 1024)})]
        else:  # error_event
            error = {"message": "The server had an error while processing your request.", "type": "server_error", "code": 500}
            lines = [json.dumps(first), json.dumps({"error": error}) if self.dialect == "vllm" else
                     json.dumps({"type": "error", "error": error})]
            if self.dialect == "vllm":
                lines.append("[DONE]")
        for line in lines:
            try:
                await resp.write(f"data: {line}\n\n".encode())
            except (ConnectionError, RuntimeError):
                record.disconnected = True
                return resp
            record.sent.append(line)
        await resp.write_eof()
        record.answered_at = time.monotonic()
        return resp

    async def _until_gone(self, request: web.Request, record: RecordedRequest) -> None:
        """Never answer: wait until the client goes away (or the fake closes)."""
        while not _gone(request) and not self._closing.is_set():
            try:
                async with asyncio.timeout(0.02):
                    await self._closing.wait()
            except TimeoutError:
                pass
        record.disconnected = _gone(request)


def _gone(request: web.Request) -> bool:
    transport = request.transport
    return transport is None or transport.is_closing()


def _close(request: web.Request) -> None:
    """Close the connection (what was written is still flushed)."""
    if request.transport is not None:
        request.transport.close()


async def _sleep_until(at: float) -> None:
    await asyncio.sleep(max(0.0, at - time.monotonic()))


def _timestamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    return f"{ms // 3_600_000:02d}:{ms // 60_000 % 60:02d}:{ms // 1000 % 60:02d}{sep}{ms % 1000:03d}"


def _wav_format(data: bytes) -> tuple[int, int, int] | None:
    """(rate Hz, channels, sample bytes) of a WAV file, None if it is not one."""
    try:
        with wave.open(io.BytesIO(data)) as w:
            return w.getframerate(), w.getnchannels(), w.getsampwidth()
    except (wave.Error, EOFError):
        return None


async def serve(host: str, port: int, grammar: str | None, dialect: Dialect, api_key: str | None, latency: Latency,
                usage_chunk: bool) -> None:
    """Run the fake until SIGINT or SIGTERM."""
    backend = SttBackend(grammar, max_decoders=2)
    await backend.start()
    fake = FakeTranscriptions(backend, dialect=dialect, api_key=api_key, latency=latency, usage_chunk=usage_chunk)
    try:
        url = await fake.start(host, port)
        print(f"fake {dialect} transcriptions on {url}", flush=True)
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        await stop.wait()
    finally:
        await fake.aclose()
        await backend.aclose()


def main() -> None:
    """``python -m testkit.fake_openai_transcriptions --port N [--grammar FILE] [--dialect D] [--api-key K]``"""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8098)
    parser.add_argument("--grammar", default=None, help="a JSGF grammar file (default: free-form)")
    parser.add_argument("--dialect", choices=["openai", "speaches", "vllm"], default="openai")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--interim-ms", type=float, default=150.0)
    parser.add_argument("--final-ms", type=float, default=300.0)
    parser.add_argument("--usage-chunk", action="store_true", help="vllm: always send the usage chunk")
    args = parser.parse_args()
    latency = Latency(interim_s=args.interim_ms / 1000, final_s=args.final_ms / 1000)
    asyncio.run(serve(args.host, args.port, args.grammar, args.dialect, args.api_key, latency, args.usage_chunk))


if __name__ == "__main__":
    main()
