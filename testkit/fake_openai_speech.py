"""A local OpenAI-compatible ``POST /v1/audio/speech`` server, in the
dialects of OpenAI, speaches and Kokoro-FastAPI, for tests and benchmarks
of :mod:`voice.openai_tts`: a real aiohttp server on a real socket whose
voice is espeak-ng word by word (:class:`testkit.tts_backend.TtsBackend`),
so the audio a client gets can be compared byte for byte with
``backend.render(text, rate)``.

What each dialect reproduces (shared/reference/speech-providers.md,
section 2.1, and the sources it cites):

``openai`` (``openai-python`` ``types/audio/speech_create_params.py``)
    ``Authorization: Bearer`` checked when ``api_key`` is set: 401
    ``{"error": {"message", "type": "invalid_request_error", "param": null,
    "code": "invalid_api_key"}}``; 400 in the same shape for an unknown
    model, an empty input or one over 4096 characters, an unknown
    ``response_format``, and ``stream_format="sse"`` with ``tts-1`` /
    ``tts-1-hd``; ``pcm`` is s16 LE mono **24 kHz whatever ``sample_rate``
    says** (the field is ignored); ``stream_format="sse"`` (other models) is
    ``speech.audio.delta`` events with base64 audio in ``audio`` and a
    ``speech.audio.done`` with ``usage`` ``{input_tokens, output_tokens,
    total_tokens}``.
``speaches`` (``src/speaches/routers/speech.py``, ``api_types.py``)
    ``sample_rate`` (8000-48000, else 422 ``{"detail": [{"msg"}]}``)
    honoured for raw and WAV audio; without it the model's native rate
    (``native_rate``, 22050 as a Piper voice); the event stream **ignores
    ``sample_rate``** (deltas at the native rate) and ends with
    ``speech.audio.done`` carrying ``token_usage`` (zeros), **not
    ``usage``**; a wrong key is 403 ``{"detail": "Invalid API key..."}``.
``kokoro`` (remsky/Kokoro-FastAPI ``api/src/routers/openai_compatible.py``)
    ignores ``stream_format`` and ``sample_rate``: always raw bytes in the
    ``response_format`` at 24 kHz, with ``Content-Disposition`` and
    ``X-Accel-Buffering: no``; errors ``{"detail": {"error", "message",
    "type"}}``.

Everywhere: the ``Content-Type`` is ``audio/pcm`` for ``pcm`` (speaches'
and Kokoro's; OpenAI's own is not documented: its OpenAPI spec says
``application/octet-stream``, openai/openai-openapi#141, which
``answer_as="octet"`` gives) (knobs:
``declare_rate`` adds ``;rate=N``, ``rate_header`` an ``X-Sample-Rate``
header, ``answer_as`` answers another way whatever was asked: ``"octet"``
raw as ``application/octet-stream``, ``"wav"`` a streamed RIFF header
(data size 0xFFFFFFFF) then PCM, ``"mpeg"`` bytes labelled ``audio/mpeg``
as a server that ignored ``pcm``, ``"sse"`` events); ``mp3`` (the API's
default format) is answered as ``audio/mpeg``. The audio comes
``first_audio_delay_s`` after the request, then ``chunk_ms`` of audio every
``chunk_interval_s`` (faster than real time, so a client that stops
mid-clause leaves audio unsent). ``delta_key`` names the field of the
base64 audio (``audio``, or ``delta`` as some servers do). ``odd_chunks``
splits the audio at odd byte counts; ``odd_total`` adds a stray byte at the
end. ``strict_fields`` refuses fields the dialect does not know (400/422),
as a strict server would (``sample_rate`` to OpenAI: not documented
either way). ``GET /v1/models`` answers a model list (404 with
``models=False``).

Faults, for the first ``faulty_requests`` speech requests (None: all):
``status`` (answer with it and the dialect's error body: 401 in OpenAI's
shape, 500...), ``drop_after_bytes`` (close the TCP connection after that
much audio: a 500 mid-stream is not possible in HTTP once 200 went out),
``garbage`` (``"http"``: bytes that are not HTTP; ``"event"``: an event
that is not JSON; ``"base64"``: a delta that is not base64), ``hang``
(``"headers"``: never answer; ``"body"``: the headers, then nothing).

**After the client goes.** Servers stop at their next chunk (Kokoro checks
``is_disconnected``; Starlette stops a streaming body when a send fails);
with ``keep_generating`` the server goes on generating the clause to its
end at its pace (the reference assumes what is generated is billed). The
characters billed are those of the words whose audio was generated (the
whole input once it all was), so a client that stops at once is billed the
least. Every request is recorded (:class:`SpeechRecord`: receive time,
headers, body, client address, what was answered and when, when the client
disconnected, and what was generated after).

Run it alone: ``python -m testkit.fake_openai_speech --port 8880
[--dialect openai|speaches|kokoro] [--api-key KEY]`` and point
``tts.base_url`` at ``http://127.0.0.1:8880/v1``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from testkit.tts_backend import Rendering, TtsBackend

log = logging.getLogger(__name__)

Dialect = Literal["openai", "speaches", "kokoro"]
AnswerAs = Literal["pcm", "octet", "wav", "mpeg", "sse"]

OPENAI_MODELS = ("tts-1", "tts-1-hd", "gpt-4o-mini-tts")
RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
#: fields each dialect knows (``strict_fields``)
KNOWN_FIELDS: dict[str, frozenset[str]] = {
    "openai": frozenset({"model", "input", "voice", "response_format", "speed", "instructions", "stream_format"}),
    "speaches": frozenset({"model", "input", "voice", "response_format", "speed", "stream_format", "sample_rate"}),
    "kokoro": frozenset(
        {
            "model",
            "input",
            "voice",
            "response_format",
            "speed",
            "stream",
            "return_download_link",
            "lang_code",
            "volume_multiplier",
            "normalization_options",
            "download_format",
        }
    ),
}
#: what stands for MP3 audio (an ID3 tag and frame sync bytes: not PCM)
FAKE_MP3 = b"ID3\x04\x00\x00\x00\x00\x00\x00" + b"\xff\xfb\x90\x64" * 64
#: how often a streaming answer checks whether the client went, s
WATCH_S = 0.002


@dataclass
class FakeSpeechOptions:
    """The fake's knobs (see the module doc; tests may change them between requests).

    Attributes:
        dialect: ``"openai"``, ``"speaches"`` or ``"kokoro"``.
        api_key: the key ``Authorization: Bearer`` must carry (None: any or none).
        first_audio_delay_s: from the request to its first audio, s.
        chunk_ms: audio per chunk, ms.
        chunk_interval_s: between chunks, s.
        native_rate: speaches' model rate without ``sample_rate``, Hz.
        answer_as: answer this way whatever was asked (None: as asked).
        declare_rate: ``audio/pcm;rate=N``.
        rate_header: an ``X-Sample-Rate: N`` header.
        delta_key: the field of an event's base64 audio.
        odd_chunks: chunks of odd byte counts (the total stays even).
        odd_total: one stray byte after the audio.
        strict_fields: refuse fields the dialect does not know.
        keep_generating: go on generating after the client went.
        models: ``GET /v1/models`` exists.
        faulty_requests: the faults apply to the first this many speech
            requests (None: to all).
        status: fault: answer with this status and the dialect's error body.
        drop_after_bytes: fault: close the TCP connection after this much audio.
        garbage: fault: ``"http"``, ``"event"`` or ``"base64"``.
        hang: fault: ``"headers"`` (never answer) or ``"body"`` (headers only).
    """

    dialect: Dialect = "openai"
    api_key: str | None = None
    first_audio_delay_s: float = 0.12
    chunk_ms: int = 60
    chunk_interval_s: float = 0.005
    native_rate: int = 22050
    answer_as: AnswerAs | None = None
    declare_rate: bool = False
    rate_header: bool = False
    delta_key: Literal["audio", "delta"] = "audio"
    odd_chunks: bool = False
    odd_total: bool = False
    strict_fields: bool = False
    keep_generating: bool = False
    models: bool = True
    faulty_requests: int | None = 1
    status: int | None = None
    drop_after_bytes: int | None = None
    garbage: Literal["http", "event", "base64"] | None = None
    hang: Literal["headers", "body"] | None = None


@dataclass
class SpeechRecord:
    """One request (``POST /v1/audio/speech`` or ``GET /v1/models``) and its answer.

    Attributes:
        index: its place among the speech requests (models requests: -1).
        path: the request path.
        received_at: when it arrived (the fake's clock, monotonic s).
        headers: its headers.
        body: its JSON body (the raw text if it is not JSON; None for GET).
        peer: the client's (host, port): requests on one kept-alive
            connection share it.
        fault: the fault applied, if any.
        status: the status answered (0: none, e.g. a hang or garbage).
        content_type: the Content-Type answered.
        rate: the audio's rate, Hz (0: no audio).
        audio: the audio it would send (before any fault), s16 LE at ``rate``.
        chunks: ``(when, bytes)`` of each audio chunk written.
        audio_bytes_sent: audio bytes written.
        first_audio_at: when the first audio was written.
        disconnected_at: when the client was seen gone (None: it stayed).
        dropped: the server dropped the connection (a fault).
        characters_billed: characters of the words whose audio was generated
            (the whole input once all was).
        characters_after_disconnect: of those, generated after the client went.
        audio_bytes_after_disconnect: audio generated after the client went, bytes.
        finished_at: when the handler was done.
        ended: set then.
    """

    index: int
    path: str
    received_at: float
    headers: dict[str, str]
    body: Any
    peer: tuple[str, int] | None
    fault: str | None = None
    status: int = 0
    content_type: str = ""
    rate: int = 0
    audio: bytes = b""
    chunks: list[tuple[float, int]] = field(default_factory=list)
    audio_bytes_sent: int = 0
    first_audio_at: float | None = None
    disconnected_at: float | None = None
    dropped: bool = False
    characters_billed: int = 0
    characters_after_disconnect: int = 0
    audio_bytes_after_disconnect: int = 0
    finished_at: float | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def audio_sent(self) -> bytes:
        """The audio written to the client (s16 LE at ``rate``)."""
        return self.audio[: self.audio_bytes_sent]

    @property
    def input(self) -> str:
        """The body's ``input`` ("" if none)."""
        return str(self.body.get("input", "")) if isinstance(self.body, dict) else ""


class FakeOpenAiSpeech:
    """The server (see the module doc).

    Args:
        backend: the voice.
        options: the knobs.
        clock: monotonic seconds for the records.

    Attributes:
        requests: speech requests, in order of arrival.
        model_requests: ``GET /v1/models`` requests.
    """

    def __init__(self, backend: TtsBackend, options: FakeSpeechOptions | None = None, clock: Callable[[], float] = time.monotonic) -> None:
        self.backend = backend
        self.options = options or FakeSpeechOptions()
        self.clock = clock
        self.requests: list[SpeechRecord] = []
        self.model_requests: list[SpeechRecord] = []

    @property
    def characters_billed(self) -> int:
        """Characters billed over every speech request."""
        return sum(r.characters_billed for r in self.requests)

    def app(self) -> web.Application:
        """The aiohttp application (``/v1/audio/speech``, ``/v1/models``)."""
        app = web.Application()
        app.router.add_post("/v1/audio/speech", self.speech)
        app.router.add_get("/v1/models", self.list_models)
        return app

    async def wait_ended(self, timeout: float = 5.0) -> None:
        """Wait until every request so far has been answered to its end."""
        async with asyncio.timeout(timeout):
            for r in list(self.requests) + list(self.model_requests):
                await r.ended.wait()

    # -- handlers -----------------------------------------------------------------

    def _record(self, request: web.Request, index: int, body: Any) -> SpeechRecord:
        peer = request.transport.get_extra_info("peername") if request.transport is not None else None
        return SpeechRecord(index, request.path, self.clock(), dict(request.headers), body, tuple(peer[:2]) if peer else None)

    def _auth_refusal(self, request: web.Request) -> web.Response | None:
        key = self.options.api_key
        if key is None or request.headers.get("Authorization") == f"Bearer {key}":
            return None
        return self._key_refusal(request.headers.get("Authorization", ""))

    def _key_refusal(self, given: str, status: int | None = None) -> web.Response:
        """The dialect's answer to a wrong or missing key (``status``: its own by default)."""
        dialect = self.options.dialect
        if dialect == "speaches":
            detail = "Invalid API key. Make sure the Authorization header is 'Bearer <key>'."
            return web.json_response({"detail": detail}, status=status or 403)
        if dialect == "kokoro":
            return _kokoro_error(status or 401, "unauthorized", "Invalid API key")
        message = "You didn't provide an API key." if not given else f"Incorrect API key provided: {given[7:11]}****."
        return _openai_error(status or 401, message, code="invalid_api_key")

    async def list_models(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/models``: the model list (after the key check)."""
        rec = self._record(request, -1, None)
        self.model_requests.append(rec)
        try:
            if (refusal := self._auth_refusal(request)) is not None:
                rec.status = refusal.status
                return refusal
            if not self.options.models:
                rec.status = 404
                return web.json_response({"detail": "Not Found"}, status=404)
            rec.status = 200
            models = (
                OPENAI_MODELS
                if self.options.dialect == "openai"
                else ("kokoro", "tts-1")
                if self.options.dialect == "kokoro"
                else ("speaches-ai/Kokoro-82M-v1.0-ONNX",)
            )
            return web.json_response({"object": "list", "data": [{"id": m, "object": "model", "owned_by": "fake"} for m in models]})
        finally:
            rec.finished_at = self.clock()
            rec.ended.set()

    async def speech(self, request: web.Request) -> web.StreamResponse:
        """``POST /v1/audio/speech`` (see the module doc)."""
        o = self.options
        raw = await request.text()
        try:
            body: Any = json.loads(raw)
        except ValueError:
            body = raw
        rec = self._record(request, len(self.requests), body)
        self.requests.append(rec)
        faulty = o.faulty_requests is None or rec.index < o.faulty_requests
        try:
            return await self._speech(request, rec, faulty)
        finally:
            rec.finished_at = self.clock()
            rec.ended.set()

    async def _speech(self, request: web.Request, rec: SpeechRecord, faulty: bool) -> web.StreamResponse:
        o = self.options
        if (refusal := self._auth_refusal(request)) is not None:
            rec.status = refusal.status
            return refusal
        if faulty and o.status is not None:
            rec.fault, rec.status = f"status {o.status}", o.status
            if o.status in (401, 403):
                return self._key_refusal(request.headers.get("Authorization", ""), o.status)
            return self._error(o.status, "The server had an error while processing your request." if o.status >= 500 else "Refused.")
        if faulty and o.garbage == "http":
            rec.fault = "garbage http"
            assert request.transport is not None
            request.transport.write(b"THIS IS NOT HTTP\r\n\r\n\x00\x01garbage")
            request.transport.close()
            await asyncio.sleep(0.05)
            return web.Response()
        if faulty and o.hang == "headers":
            rec.fault = "hang headers"
            await self._until_gone(request, rec)
            return web.Response()
        refusal = self._validate(rec.body)
        if refusal is not None:
            rec.status = refusal.status
            return refusal
        body: dict[str, Any] = rec.body
        text: str = body["input"]
        fmt = body.get("response_format", "mp3")
        sse = body.get("stream_format") == "sse" and o.dialect != "kokoro"
        answer = o.answer_as or ("sse" if sse else "pcm" if fmt == "pcm" else "wav" if fmt == "wav" else "mpeg")
        if faulty and o.garbage in ("event", "base64"):
            answer = "sse"
        rate = self._rate(body, answer)
        rendering = await self.backend.render(text, rate)
        audio = rendering.pcm + (b"\x00" if o.odd_total else b"")
        rec.rate, rec.audio = rate, audio
        headers = {"Content-Type": self._content_type(answer, rate)}
        if o.rate_header:
            headers["X-Sample-Rate"] = str(rate)
        if o.dialect == "kokoro":
            headers.update(
                {"Content-Disposition": f"attachment; filename=speech.{fmt}", "X-Accel-Buffering": "no", "Cache-Control": "no-cache"}
            )
        rec.content_type = headers["Content-Type"]
        resp = web.StreamResponse(status=200, headers=headers)
        await resp.prepare(request)
        rec.status = 200
        watcher = asyncio.get_running_loop().create_task(self._until_gone(request, rec))
        try:
            await asyncio.sleep(max(0.0, rec.received_at + o.first_audio_delay_s - self.clock()))
            if faulty and o.hang == "body":
                rec.fault = "hang body"
                await watcher
                return resp
            await self._stream(request, resp, rec, rendering, audio, answer, faulty)
        finally:
            watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await watcher
        return resp

    async def _stream(
        self,
        request: web.Request,
        resp: web.StreamResponse,
        rec: SpeechRecord,
        rendering: Rendering,
        audio: bytes,
        answer: AnswerAs,
        faulty: bool,
    ) -> None:
        """The audio, chunk by chunk, at the fake's pace; generation goes on
        after the client went only with ``keep_generating``."""
        o = self.options
        text = rec.input
        step = max(2, rec.rate * 2 * o.chunk_ms // 1000 // 2 * 2)
        if o.odd_chunks:
            step |= 1
        cuts = list(range(0, len(audio), step)) + [len(audio)]
        ends = _word_ends(text, rendering)
        generated = 0  # audio bytes generated
        billed_when_gone: int | None = None
        first = True
        for start, end in zip(cuts, cuts[1:], strict=False):
            chunk = audio[start:end]
            gone = rec.disconnected_at is not None
            if gone and not o.keep_generating:
                break
            if gone and billed_when_gone is None:
                billed_when_gone = rec.characters_billed
            generated = end
            rec.characters_billed = _characters_until(ends, generated, rec.rate)
            if not gone:
                data = self._frame(chunk, answer, first, rec.rate, faulty)
                first = False
                if await self._write(resp, rec, data):
                    rec.audio_bytes_sent += len(chunk)
                    rec.chunks.append((self.clock(), len(chunk)))
                    if rec.first_audio_at is None:
                        rec.first_audio_at = self.clock()
                    if faulty and o.drop_after_bytes is not None and rec.audio_bytes_sent >= o.drop_after_bytes:
                        rec.fault, rec.dropped = f"drop after {rec.audio_bytes_sent} bytes", True
                        if request.transport is not None:
                            request.transport.abort()
                        return
                else:
                    gone = True
                    billed_when_gone = rec.characters_billed if billed_when_gone is None else billed_when_gone
            if gone:
                rec.audio_bytes_after_disconnect += len(chunk)
            await asyncio.sleep(o.chunk_interval_s)
        if generated >= len(audio):
            rec.characters_billed = len(text)
        if billed_when_gone is None and rec.disconnected_at is not None:
            billed_when_gone = rec.characters_billed
        if billed_when_gone is not None:
            rec.characters_after_disconnect = rec.characters_billed - billed_when_gone
        if rec.disconnected_at is not None:
            return
        if answer == "sse":
            usage = {"input_tokens": 0, "output_tokens": 0, "total_tokens": 0}
            key = "token_usage" if o.dialect == "speaches" else "usage"
            if o.dialect != "speaches":
                i, out = max(1, len(text) // 4), max(1, len(audio) // (rec.rate * 2) * 50)
                usage = {"input_tokens": i, "output_tokens": out, "total_tokens": i + out}
            await self._write(resp, rec, _sse({"type": "speech.audio.done", key: usage}))
        with contextlib.suppress(ConnectionError, RuntimeError):
            await resp.write_eof()

    def _frame(self, chunk: bytes, answer: AnswerAs, first: bool, rate: int, faulty: bool) -> bytes:
        """One chunk as it goes on the wire."""
        o = self.options
        if answer == "sse":
            if faulty and o.garbage == "event":
                return b"data: {this is not json\n\n"
            b64 = "!!not base64!!" if faulty and o.garbage == "base64" else base64.b64encode(chunk).decode()
            return _sse({"type": "speech.audio.delta", o.delta_key: b64})
        if answer == "wav" and first:
            return _wav_header(rate) + chunk
        if answer == "mpeg":
            return FAKE_MP3 if first else b""
        return chunk

    async def _write(self, resp: web.StreamResponse, rec: SpeechRecord, data: bytes) -> bool:
        """Write ``data``; False (and the disconnect recorded) if the client went."""
        if not data:
            return True
        try:
            await resp.write(data)
            return True
        except (ConnectionError, RuntimeError):
            if rec.disconnected_at is None:
                rec.disconnected_at = self.clock()
            return False

    async def _until_gone(self, request: web.Request, rec: SpeechRecord) -> None:
        """Return when the client has closed the connection (its time recorded)."""
        while True:
            transport = request.transport
            if transport is None or transport.is_closing():
                if rec.disconnected_at is None and not rec.dropped:
                    rec.disconnected_at = self.clock()
                return
            await asyncio.sleep(WATCH_S)

    # -- the dialects ---------------------------------------------------------------

    def _error(self, status: int, message: str, param: str | None = None) -> web.Response:
        if self.options.dialect == "openai":
            kind = "invalid_request_error" if status < 500 else "server_error"
            return _openai_error(status, message, kind=kind, param=param)
        if self.options.dialect == "kokoro":
            return _kokoro_error(status, "validation_error" if status < 500 else "processing_error", message)
        if status == 422:
            return web.json_response({"detail": [{"type": "value_error", "loc": ["body", param or ""], "msg": message}]}, status=422)
        return web.json_response({"detail": message}, status=status)

    def _validate(self, body: Any) -> web.Response | None:
        """The dialect's refusal of a body, or None."""
        o = self.options
        bad = 400 if o.dialect == "openai" else 422
        if not isinstance(body, dict):
            return self._error(bad, "We could not parse the JSON body of your request.")
        for name in ("model", "input", "voice"):
            if not isinstance(body.get(name), str):
                return self._error(bad, f"Missing required parameter: '{name}'.", name)
        if o.strict_fields:
            unknown = sorted(set(body) - KNOWN_FIELDS[o.dialect])
            if unknown:
                return self._error(bad, f"Unrecognized request argument supplied: {unknown[0]}", unknown[0])
        text = body["input"]
        if not text.strip() or len(text) > 4096:
            return self._error(bad, "input must be 1 to 4096 characters.", "input")
        fmt = body.get("response_format", "mp3")
        if fmt not in RESPONSE_FORMATS:
            return self._error(bad, f"Invalid value for 'response_format': {fmt!r}.", "response_format")
        if o.dialect == "openai":
            if body["model"] not in OPENAI_MODELS:
                return self._error(400, f"Invalid value for 'model': {body['model']!r}.", "model")
            if body.get("stream_format") == "sse" and body["model"] in ("tts-1", "tts-1-hd"):
                return self._error(400, f"stream_format 'sse' is not supported for {body['model']}.", "stream_format")
        if o.dialect == "speaches" and "sample_rate" in body:
            sr = body["sample_rate"]
            if not (isinstance(sr, int) and not isinstance(sr, bool) and 8000 <= sr <= 48000):
                return self._error(422, "sample_rate must be between 8000 and 48000", "sample_rate")
        return None

    def _rate(self, body: dict[str, Any], answer: AnswerAs) -> int:
        """The rate the dialect answers at, Hz."""
        o = self.options
        if o.dialect == "speaches":
            if answer == "sse":
                return o.native_rate  # speaches' event stream ignores sample_rate
            return int(body.get("sample_rate") or o.native_rate)
        return 24_000

    def _content_type(self, answer: AnswerAs, rate: int) -> str:
        if answer == "sse":
            return "text/event-stream"
        if answer == "wav":
            return "audio/wav"
        if answer == "mpeg":
            return "audio/mpeg"
        base = "application/octet-stream" if answer == "octet" else "audio/pcm"
        return f"{base};rate={rate}" if self.options.declare_rate else base


def _openai_error(
    status: int, message: str, kind: str = "invalid_request_error", param: str | None = None, code: str | None = None
) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "param": param, "code": code}}, status=status)


def _kokoro_error(status: int, error: str, message: str) -> web.Response:
    kind = "invalid_request_error" if status < 500 else "server_error"
    return web.json_response({"detail": {"error": error, "message": message, "type": kind}}, status=status)


def _sse(event: dict[str, Any]) -> bytes:
    return f"data: {json.dumps(event)}\n\n".encode()


def _wav_header(rate: int) -> bytes:
    """A streamed RIFF/WAVE header: 16-bit mono PCM at ``rate``, sizes 0xFFFFFFFF."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    return (
        b"RIFF"
        + struct.pack("<I", 0xFFFFFFFF)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<I", len(fmt))
        + fmt
        + b"data"
        + struct.pack("<I", 0xFFFFFFFF)
    )


def _word_ends(text: str, rendering: Rendering) -> list[tuple[float, int]]:
    """``(start s, characters of text up to this word's end)`` per word."""
    out: list[tuple[float, int]] = []
    pos = 0
    for word, start, _ in rendering.words:
        pos = text.index(word, pos) + len(word)
        out.append((start, pos))
    return out


def _characters_until(ends: list[tuple[float, int]], generated: int, rate: int) -> int:
    """Characters of the words whose audio has begun within the first
    ``generated`` bytes."""
    at = generated / 2 / rate
    chars = 0
    for start, end in ends:
        if start < at:
            chars = end
    return chars


def main() -> None:
    """``python -m testkit.fake_openai_speech [--host H] [--port P] [--dialect D] [--api-key K]``"""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8880)
    parser.add_argument("--dialect", choices=["openai", "speaches", "kokoro"], default="openai")
    parser.add_argument("--api-key", default=None, help="require Authorization: Bearer KEY")
    parser.add_argument("--first-audio-ms", type=float, default=120.0)
    a = parser.parse_args()
    fake = FakeOpenAiSpeech(
        TtsBackend(), FakeSpeechOptions(dialect=a.dialect, api_key=a.api_key, first_audio_delay_s=a.first_audio_ms / 1000)
    )
    logging.basicConfig(level=logging.INFO)
    web.run_app(fake.app(), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
