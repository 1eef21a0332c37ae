"""A local Deepgram Aura text-to-speech server (``/v1/speak`` over a
WebSocket) for tests and benchmarks: a real aiohttp server on a real socket
that speaks Deepgram's messages and quirks, with the audio of
:class:`testkit.tts_backend.TtsBackend` (espeak-ng word by word).

What it reproduces (shared/reference/speech-providers.md, section 2.4;
https://developers.deepgram.com/docs/tts-ws-flush, /docs/tts-ws-clear,
/reference/tts-ws-close):

- **Upgrade**: ``Authorization: Token <key>`` is checked when ``api_key`` is
  set (wrong or missing: HTTP 401 with ``{"err_code":"INVALID_AUTH",
  "err_msg"}`` and a ``dg-error`` header); ``encoding`` must be
  ``linear16`` and ``sample_rate`` 8000-48000 (400 otherwise: the fake
  renders nothing else); the 101 carries ``dg-request-id``. ``Metadata``
  (``request_id``, ``model_name``, ``model_version``, ``model_uuid``) is the
  first message.
- **Speak / Flush**: ``Speak`` text goes into a buffer; a ``Flush`` renders
  the buffer (after ``first_audio_delay_s``) and sends it as binary frames
  of ``chunk_ms`` of raw s16 LE mono, one every ``chunk_interval_s``
  (faster than real time, so a stop mid-reply leaves audio to send), then
  ``{"type":"Flushed","sequence_id":n}``. With ``speak_generates`` each
  ``Speak`` is rendered at once and a Flush only answers ``Flushed`` after
  it (whether Deepgram makes audio before a Flush is not documented: both).
- **Flush limit**: more than ``flush_limit`` Flushes within
  ``flush_window_s`` (20 per 60 s, as Deepgram) are not processed; each is
  answered with ``{"type":"Warning"}`` carrying the words under both
  ``description`` (Pipecat reads it) and ``warn_msg`` (LiveKit reads it),
  with ``warn_code`` (``warning_fields`` chooses which are sent), at once or
  in order behind the answers before it (``warn_in_order``). The text stays
  in the buffer for the next Flush.
- **Clear**: drops the text buffer and the audio not yet sent, then
  ``{"type":"Cleared","sequence_id":n}``; ``trailing_frames`` frames of
  the audio being sent still go out *before* Cleared (already in flight);
  ``cleared_delay_s`` delays it; ``answer_clear=False`` never sends it.
- **Close**: ``{"type":"Close"}`` sends what was flushed, then closes 1000;
  a close frame from the client ends it at once (1000).
- **Billing**: characters of every text rendered, counted when its
  rendering starts, including renderings that go on after the client went
  away (what was flushed is still rendered and billed: ``billed_after_gone``).

Faults (for the first ``faulty_connections`` connections, None: all):
refuse the upgrade with a status, delay it, drop the TCP connection after
N audio frames, send a text frame that is not JSON, send an ``Error``
message (then close 1011), close with a code (1008...), hang (send nothing
more, close nothing), inject frames; audio quirks: a RIFF header before
each flush's audio (``wav_header``, optionally claiming and rendered at
``wav_rate``, or a non-PCM ``wav_format``), frames cut at odd byte counts
(``odd_chunks``), one stray byte at the end of each flush's audio
(``odd_total``). Everything received and sent is recorded per connection
with monotonic times (:class:`SpeakConnection`).

Run it alone: ``python -m testkit.fake_deepgram_speak --port 8099`` and
point ``tts.base_url`` at ``ws://127.0.0.1:8099``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import struct
import time
import uuid
from collections import deque
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from testkit.tts_backend import TtsBackend

log = logging.getLogger(__name__)

MODEL_UUID = "c3c4d4a3-1b2e-4f5a-9a8b-7e6d5c4b3a21"


@dataclass
class FakeSpeakOptions:
    """The fake's knobs (tests may change them between connections).

    Attributes:
        api_key: the key ``Authorization: Token`` must carry (None: any, or none).
        first_audio_delay_s: from a Flush (or, with ``speak_generates``, a
            Speak) to its first audio frame, s.
        chunk_ms: audio per binary frame, ms.
        chunk_interval_s: pause between frames, s (much less than
            ``chunk_ms``: faster than real time).
        speak_generates: render each Speak at once, without waiting for a Flush.
        flush_limit / flush_window_s: the Flush limit (Deepgram: 20 per 60 s).
        warning_fields: which of ``description``, ``warn_msg``, ``warn_code``
            a Warning carries.
        warn_in_order: a refused Flush's Warning waits behind the audio and
            Flushed answers before it (False: it is sent at once; which
            Deepgram does is not documented).
        trailing_frames: after a Clear, this many more frames of the audio
            being sent still go out before ``Cleared``.
        cleared_delay_s: a Clear's ``Cleared`` comes this much later, s.
        answer_clear: send ``Cleared`` at all.
        wav_header: a RIFF/WAVE header before each rendering's audio.
        wav_rate: with ``wav_header``: the rate it says and the audio is
            rendered at (None: the rate asked).
        wav_format: with ``wav_header``: its format tag (1: PCM, 3: float).
        odd_chunks: cut frames at odd byte counts (the total stays whole samples).
        odd_total: one stray byte after each rendering's audio.
        refuse_status: answer the upgrade with this HTTP status instead.
        accept_delay_s: wait this long before answering an upgrade, s.
        faulty_connections: the faults apply to the first this many
            connections (None: all).
        drop_after_frames: after this many audio frames sent on the
            connection, abort the TCP connection (no close frame).
        garbage_after_frames: after this many frames, a text frame that is not JSON.
        error_after_frames / error_message: after this many frames, an
            ``Error`` message, then close 1011.
        close_after_frames / close_code: after this many frames, close with this code.
        hang_after_frames: after this many frames, send nothing more and
            close nothing (0: not even Metadata).
        inject: ``(after_frames, frame)``: send ``frame`` (text, or bytes as
            a binary frame) once that many frames went out (0: after Metadata).
    """

    api_key: str | None = None
    first_audio_delay_s: float = 0.12
    chunk_ms: int = 60
    chunk_interval_s: float = 0.004
    speak_generates: bool = False
    flush_limit: int = 20
    flush_window_s: float = 60.0
    warning_fields: tuple[str, ...] = ("warn_code", "warn_msg", "description")
    warn_in_order: bool = False
    trailing_frames: int = 0
    cleared_delay_s: float = 0.0
    answer_clear: bool = True
    wav_header: bool = False
    wav_rate: int | None = None
    wav_format: int = 1
    odd_chunks: bool = False
    odd_total: bool = False
    refuse_status: int | None = None
    accept_delay_s: float = 0.0
    faulty_connections: int | None = 1
    drop_after_frames: int | None = None
    garbage_after_frames: int | None = None
    error_after_frames: int | None = None
    error_message: str = "The fake failed to synthesise this text."
    close_after_frames: int | None = None
    close_code: int = 1008
    hang_after_frames: int | None = None
    inject: list[tuple[int, str | bytes]] = field(default_factory=list)


@dataclass
class SpeakAttempt:
    """One upgrade request, accepted or not.

    Attributes:
        headers: its headers.
        query: its query, in order.
        status: 101 (accepted) or the refusal's status.
        at: when it arrived (monotonic s).
    """

    headers: dict[str, str]
    query: list[tuple[str, str]]
    status: int = 101
    at: float = 0.0

    def param(self, name: str) -> str | None:
        """The first value of query parameter ``name`` (None: absent)."""
        return next((v for k, v in self.query if k == name), None)


@dataclass
class SpeakConnection:
    """What one accepted connection received and sent.

    Attributes:
        attempt: its upgrade.
        request_id: its ``dg-request-id``.
        rate: the ``sample_rate`` asked, Hz.
        received: ``(monotonic s, message)`` for each text frame received
            (parsed JSON, or the raw text if it is not).
        sent: ``(monotonic s, kind, what)`` for each frame sent: ``("audio",
            n bytes)`` or ``("text", parsed JSON or raw text)``.
        audio: every audio byte sent, in order.
        billed_characters: characters of the texts whose rendering started.
        billed_after_gone: of those, characters rendered after the client went away.
        characters_cleared: characters dropped by a Clear before rendering.
        closed_with: ``(code, reason)`` of a close the server sent,
            ``(0, "aborted")`` for a dropped TCP connection, None otherwise.
        gone_at: when the client's side ended (monotonic s).
        ended: set when the connection (and its renderings) is over.
    """

    attempt: SpeakAttempt
    request_id: str
    rate: int
    received: list[tuple[float, Any]] = field(default_factory=list)
    sent: list[tuple[float, str, Any]] = field(default_factory=list)
    audio: bytearray = field(default_factory=bytearray)
    billed_characters: int = 0
    billed_after_gone: int = 0
    characters_cleared: int = 0
    closed_with: tuple[int, str] | None = None
    gone_at: float | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    frames_sent: int = 0

    def types(self) -> list[str]:
        """The ``type`` of each text frame received, in order."""
        return [str(m.get("type")) if isinstance(m, dict) else str(m) for _, m in self.received]

    def times(self, kind: str) -> list[float]:
        """When each received message of ``type`` ``kind`` arrived (monotonic s)."""
        return [t for t, m in self.received if isinstance(m, dict) and m.get("type") == kind]

    def sent_of(self, kind: str) -> list[dict[str, Any]]:
        """The JSON messages sent of ``type`` ``kind``."""
        return [m for _, k, m in self.sent if k == "text" and isinstance(m, dict) and m.get("type") == kind]

    def sent_times(self, kind: str) -> list[float]:
        """When each JSON message of ``type`` ``kind`` was sent (monotonic s)."""
        return [t for t, k, m in self.sent if k == "text" and isinstance(m, dict) and m.get("type") == kind]


@dataclass
class _Job:
    kind: str  # "say", "flushed", "cleared", "close"
    text: str = ""


class FakeDeepgramSpeak:
    """The server (see the module doc); :meth:`app` is its aiohttp app.

    Args:
        backend: the voice (:class:`testkit.tts_backend.TtsBackend`).
        options: knobs (:class:`FakeSpeakOptions`).
    """

    def __init__(self, backend: TtsBackend, options: FakeSpeakOptions | None = None) -> None:
        self.backend = backend
        self.options = options or FakeSpeakOptions()
        self.attempts: list[SpeakAttempt] = []
        self.connections: list[SpeakConnection] = []

    def app(self) -> web.Application:
        """The aiohttp application (``GET /v1/speak``)."""
        app = web.Application()
        app.router.add_get("/v1/speak", self.speak)
        return app

    @property
    def billed_characters(self) -> int:
        """Characters billed over every connection."""
        return sum(c.billed_characters for c in self.connections)

    async def speak(self, request: web.Request) -> web.StreamResponse:
        """One ``/v1/speak`` upgrade: checked, then served until it closes."""
        o = self.options
        attempt = SpeakAttempt(dict(request.headers), list(request.query.items()), at=time.monotonic())
        self.attempts.append(attempt)
        faulty = o.faulty_connections is None or len(self.attempts) <= o.faulty_connections
        request_id = str(uuid.uuid4())
        if faulty and o.accept_delay_s:
            await asyncio.sleep(o.accept_delay_s)
        if faulty and o.refuse_status is not None:
            return _refuse(attempt, o.refuse_status, "REFUSED", "The fake was told to refuse this connection.", request_id)
        if o.api_key is not None and request.headers.get("Authorization") != f"Token {o.api_key}":
            return _refuse(attempt, 401, "INVALID_AUTH", "Invalid credentials.", request_id)
        q = request.query
        try:
            rate = int(q.get("sample_rate", "24000"))
        except ValueError:
            rate = 0
        if q.get("encoding", "linear16") != "linear16" or not 8000 <= rate <= 48000:
            return _refuse(attempt, 400, "Bad Request", "This fake renders linear16 at 8-48 kHz only.", request_id)
        ws = web.WebSocketResponse(autoping=True, timeout=2.0, max_msg_size=4 * 1024 * 1024)
        ws.headers["dg-request-id"] = request_id
        await ws.prepare(request)
        conn = SpeakConnection(attempt, request_id, rate)
        self.connections.append(conn)
        session = _Session(self, request, ws, conn, faulty, q.get("model", ""))
        try:
            await session.serve()
        finally:
            conn.ended.set()
        return ws


def _refuse(attempt: SpeakAttempt, status: int, code: str, message: str, request_id: str) -> web.Response:
    attempt.status = status
    return web.json_response(
        {"err_code": code, "err_msg": message, "request_id": request_id},
        status=status,
        headers={"dg-error": message, "dg-request-id": request_id},
    )


def wav_header(rate: int, fmt: int = 1, data_bytes: int = 0xFFFFFFFF) -> bytes:
    """A 44-byte RIFF/WAVE header for mono 16-bit audio at ``rate`` Hz
    (``data_bytes`` 0xFFFFFFFF: streamed, length unknown)."""
    riff_size = 0xFFFFFFFF if data_bytes == 0xFFFFFFFF else 36 + data_bytes
    return (
        b"RIFF"
        + struct.pack("<I", riff_size)
        + b"WAVE"
        + b"fmt "
        + struct.pack("<IHHIIHH", 16, fmt, 1, rate, rate * 2, 2, 16)
        + b"data"
        + struct.pack("<I", data_bytes)
    )


class _Session:
    """One connection: a receive loop and a renderer working through jobs in order."""

    def __init__(
        self, server: FakeDeepgramSpeak, request: web.Request, ws: web.WebSocketResponse, conn: SpeakConnection, faulty: bool, model: str
    ) -> None:
        self.server = server
        self.o = server.options
        self.request = request
        self.ws = ws
        self.conn = conn
        self.faulty = faulty
        self.model = model or "aura-2-thalia-en"
        self.buffer: list[str] = []
        self.jobs: deque[_Job] = deque()
        self.job_ready = asyncio.Event()
        self.flushes: deque[float] = deque()
        self.sequence = 0
        self.clearing = False  # a Clear arrived: the rendering being sent stops
        self.gone = False  # the client's side ended: render and bill, send nothing
        self.hung = False
        self.fired: set[str] = set()

    async def serve(self) -> None:
        renderer = asyncio.get_running_loop().create_task(self.render_loop())
        try:
            if not (self.faulty and self.o.hang_after_frames == 0):
                await self.send_json(
                    {
                        "type": "Metadata",
                        "request_id": self.conn.request_id,
                        "model_name": self.model,
                        "model_version": "2025-04-07.0",
                        "model_uuid": MODEL_UUID,
                    }
                )
            else:
                self.hung = True
            await self.check_faults()
            await self.receive()
        finally:
            self.gone = True
            if self.conn.gone_at is None:
                self.conn.gone_at = time.monotonic()
            # what was flushed is still rendered (and billed), sent nowhere
            self.jobs.append(_Job("close"))
            self.job_ready.set()
            try:
                await asyncio.wait({renderer}, timeout=10)
            finally:
                renderer.cancel()
                await asyncio.gather(renderer, return_exceptions=True)

    # -- receiving --------------------------------------------------------------

    async def receive(self) -> None:
        async for msg in self.ws:
            now = time.monotonic()
            if msg.type is WSMsgType.TEXT:
                try:
                    data: Any = json.loads(msg.data)
                except ValueError:
                    data = msg.data
                self.conn.received.append((now, data))
                kind = data.get("type") if isinstance(data, dict) else None
                if kind == "Speak":
                    text = str(data.get("text", ""))
                    if self.o.speak_generates:
                        self.push(_Job("say", text))
                    else:
                        self.buffer.append(text)
                elif kind == "Flush":
                    await self.flush(now)
                elif kind == "Clear":
                    self.clear()
                elif kind == "Close":
                    self.push(_Job("close"))
            elif msg.type is WSMsgType.BINARY:
                self.conn.received.append((now, bytes(msg.data)))
            else:
                break
        self.conn.gone_at = time.monotonic()

    def push(self, job: _Job) -> None:
        self.jobs.append(job)
        self.job_ready.set()

    async def flush(self, now: float) -> None:
        o = self.o
        while self.flushes and self.flushes[0] <= now - o.flush_window_s:
            self.flushes.popleft()
        if len(self.flushes) >= o.flush_limit:
            words = f"Flush limit reached: at most {o.flush_limit} Flush messages per {o.flush_window_s:g} s; this Flush was ignored."
            warning: dict[str, Any] = {"type": "Warning"}
            for name in o.warning_fields:
                warning[name] = "FLUSH_LIMIT_EXCEEDED" if name == "warn_code" else words
            if o.warn_in_order:
                self.push(_Job("warning", json.dumps(warning)))
            else:
                await self.send_json(warning)
            return
        self.flushes.append(now)
        if self.buffer:
            self.push(_Job("say", "".join(self.buffer)))
            self.buffer.clear()
        self.push(_Job("flushed"))

    def clear(self) -> None:
        dropped = sum(len(t) for t in self.buffer) + sum(len(j.text) for j in self.jobs if j.kind == "say")
        self.conn.characters_cleared += dropped
        self.buffer.clear()
        self.jobs = deque(j for j in self.jobs if j.kind == "close")
        self.clearing = True
        self.jobs.appendleft(_Job("cleared"))
        self.job_ready.set()

    # -- rendering and sending -------------------------------------------------------

    async def render_loop(self) -> None:
        while True:
            while not self.jobs:
                self.job_ready.clear()
                await self.job_ready.wait()
            job = self.jobs.popleft()
            if job.kind == "say":
                await self.say(job.text)
            elif job.kind == "flushed":
                await self.send_json({"type": "Flushed", "sequence_id": self.next_sequence()})
            elif job.kind == "warning":
                await self.send_text(job.text)
            elif job.kind == "cleared":
                self.clearing = False
                if self.o.cleared_delay_s:
                    await asyncio.sleep(self.o.cleared_delay_s)
                if self.o.answer_clear:
                    await self.send_json({"type": "Cleared", "sequence_id": self.next_sequence()})
            elif job.kind == "close":
                if self.gone:
                    return
                await self.close(1000, "")
                return

    def next_sequence(self) -> int:
        n = self.sequence
        self.sequence += 1
        return n

    async def say(self, text: str) -> None:
        o = self.o
        if not text.strip():
            return
        self.conn.billed_characters += len(text)
        if self.gone:
            self.conn.billed_after_gone += len(text)
        rate = o.wav_rate if o.wav_header and o.wav_rate else self.conn.rate
        rendering = await self.server.backend.render(text, rate)
        pcm = rendering.pcm
        if o.wav_header:
            pcm = wav_header(rate, o.wav_format) + pcm
        if o.odd_total:
            pcm += b"\x00"
        if self.gone:
            return
        await asyncio.sleep(o.first_audio_delay_s)
        size = max(2, self.conn.rate * 2 * o.chunk_ms // 1000)
        pos = 0
        trailing = 0
        odd = True
        while pos < len(pcm):
            if self.gone:
                return
            if self.clearing:
                if trailing >= o.trailing_frames:
                    return
                trailing += 1
            n = size + 1 if o.odd_chunks and odd else size
            odd = not odd
            await self.send_audio(pcm[pos : pos + n])
            pos += n
            if o.chunk_interval_s:
                await asyncio.sleep(o.chunk_interval_s)

    async def send_audio(self, frame: bytes) -> None:
        if self.hung or self.gone:
            return
        try:
            await self.ws.send_bytes(frame)
        except (ConnectionError, RuntimeError):
            self.gone = True
            return
        self.conn.sent.append((time.monotonic(), "audio", len(frame)))
        self.conn.audio += frame
        self.conn.frames_sent += 1
        await self.check_faults()

    async def send_json(self, message: dict[str, Any]) -> None:
        await self.send_text(json.dumps(message))

    async def send_text(self, text: str) -> None:
        if self.hung or self.gone:
            return
        try:
            await self.ws.send_str(text)
        except (ConnectionError, RuntimeError):
            self.gone = True
            return
        try:
            what: Any = json.loads(text)
        except ValueError:
            what = text
        self.conn.sent.append((time.monotonic(), "text", what))

    async def check_faults(self) -> None:
        """Fire the faults due at the frames sent so far."""
        if not self.faulty or self.hung:
            return
        o, n = self.o, self.conn.frames_sent

        def due(name: str, after: int | None) -> bool:
            if after is None or n < after or name in self.fired:
                return False
            self.fired.add(name)
            return True

        for i, (after, frame) in enumerate(o.inject):
            if due(f"inject{i}", after):
                if isinstance(frame, bytes):
                    await self.ws.send_bytes(frame)
                    self.conn.sent.append((time.monotonic(), "audio", len(frame)))
                else:
                    await self.send_text(frame)
        if due("garbage", o.garbage_after_frames):
            await self.send_text("<html><body>502 Bad Gateway</body></html>")
        if due("error", o.error_after_frames):
            await self.send_json(
                {"type": "Error", "err_code": "SYNTHESIS_FAILED", "err_msg": o.error_message, "description": o.error_message}
            )
            await self.close(1011, o.error_message[:100])
        if due("close", o.close_after_frames):
            await self.close(o.close_code, "fake close")
        if due("hang", o.hang_after_frames):
            self.hung = True
        if due("drop", o.drop_after_frames):
            self.conn.closed_with = (0, "aborted")
            self.gone = True
            transport = self.request.transport
            if transport is not None:
                transport.abort()

    async def close(self, code: int, reason: str) -> None:
        if self.conn.closed_with is None and not self.ws.closed:
            self.conn.closed_with = (code, reason)
            self.gone = True
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.close(code=code, message=reason.encode())


def main() -> None:  # pragma: no cover - a manual tool
    """Run the fake on a loopback port (``--port``, ``--api-key``) until interrupted."""
    parser = argparse.ArgumentParser(description="A local Deepgram Aura /v1/speak server (espeak-ng voice).")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--api-key", default=None)
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    fake = FakeDeepgramSpeak(TtsBackend(), FakeSpeakOptions(api_key=args.api_key, faulty_connections=0))
    web.run_app(fake.app(), host="127.0.0.1", port=args.port)


if __name__ == "__main__":  # pragma: no cover
    main()
