"""A local ElevenLabs multi-context stream-input server
(``/v1/text-to-speech/{voice_id}/multi-stream-input`` over a WebSocket) for
tests and benchmarks: a real aiohttp server on a real socket that speaks
ElevenLabs' messages and quirks, its voice espeak-ng word by word
(:class:`testkit.tts_backend.TtsBackend`), so every character's time in
the audio is known.

What it reproduces (shared/reference/speech-providers.md, section 2.2, and
section 4 item 4):

- **Upgrade**: ``xi-api-key`` is checked when ``api_key`` is set; a wrong or
  missing one is refused with HTTP 401 (``auth_failure="http"``) or accepted
  and answered ``{"message":"Invalid API key","error":"invalid_api_key"}``
  then closed with 1008 (``"close"``). ``output_format`` must be
  ``pcm_<rate>`` at a rate ElevenLabs has (HTTP 400 otherwise). The query is
  recorded (``model_id``, ``sync_alignment``, ``inactivity_timeout``,
  ``language_code``...).
- **Contexts**: a context opens with the first message naming its
  ``context_id`` (the init ``{"text":" ","voice_settings":...}``); text
  accumulates and is spoken at each ``flush`` (generation on ElevenLabs'
  chunk schedule without a flush is not reproduced); an empty text is a
  keep-alive (with or without a context id: never the end of input).
- **Replies**: ``{"audio":<base64 PCM>,"isFinal":null,"alignment":{"chars",
  "charStartTimesMs","charDurationsMs"},"normalizedAlignment":{...},<id>}``
  in chunks of ``chunk_ms`` every ``chunk_interval_s`` (faster than real
  time, so a stop mid-reply leaves audio still to send), the first
  ``first_audio_delay_s`` after the flush. The id key is ``contextId``
  (Pipecat's reading) or ``context_id`` (LiveKit's: current servers), by
  ``id_key``. **Alignment timebase** (VERIFY in the reference): ``"chunk"``
  (relative to each chunk, as the SDK docs say) or ``"cumulative"`` (the
  context's audio time, as LiveKit reads it). ``normalizedAlignment`` has
  the text rewritten (lower case, digits as words), so a client counting or
  timing words on it goes wrong; ``alignment_trim`` drops the leading and
  trailing whitespace of each flush's alignment and merges runs of spaces;
  ``alignment=False`` leaves alignment out. ``flush_done``: a
  ``{"type":"flush_done"}`` after each flush's audio (with the context id or
  not, ``flush_done_id``).
- **close_context**: of a finished context, ``isFinal`` at once; of an
  active one, its queued flushes are dropped, ``trailing_chunks`` more
  chunks of the audio being made are sent anyway (as real servers do), then
  ``isFinal`` (``final_after_close``). **close_socket**: closed with 1000.
- **Five contexts per socket** (``max_contexts``): a context opened past it
  gets ``{"message":...,"error":"max_active_conversations"}`` and the
  socket is closed with 1008. A context holds its slot until its
  ``isFinal`` after ``close_context`` is sent.
- **Inactivity**: no message for ``inactivity_timeout`` (the query's, 20 s
  by default; ``inactivity_timeout_s`` overrides) closes the socket with
  1008 ``input_timeout_exceeded``.
- **Format faults**: audio at ``answer_rate`` instead of the rate asked,
  as raw PCM or behind a WAV header (``audio_format="wav"``), or starting
  with an ID3 tag (``"mp3"``); chunks cut at odd byte counts
  (``odd_chunks``); one stray byte after each flush's audio (``odd_total``).

Faults (for the first ``faulty_connections`` connections): refuse the
upgrade with a status, delay it, drop the TCP connection after N audio
chunks, send garbage, send an error (on the context or the socket, then
close or not), hang (answer nothing more), inject any frames. Everything
received and sent is recorded per connection with ``time.monotonic()``
times (:class:`Connection`; audio as its byte count, and per context the
PCM itself), with the characters ElevenLabs would bill: every character of
text received, including text it went on generating after a close or after
the client went away (:attr:`ContextRecord.characters_after_close`).

Run it alone: ``python -m testkit.fake_elevenlabs --port 8097`` and point
``tts.base_url`` at ``ws://127.0.0.1:8097``.
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
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import WSMsgType, web

from testkit.tts_backend import Rendering, TtsBackend

log = logging.getLogger(__name__)

#: ElevenLabs' PCM output rates
PCM_RATES = (8000, 16000, 22050, 24000, 44100, 48000)
GARBAGE = "<html><body><h1>502 Bad Gateway</h1></body></html>"
_DIGITS = ["zero", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


@dataclass
class FakeElevenLabsOptions:
    """The fake's knobs (tests may change them between connections).

    Attributes:
        api_key: the key ``xi-api-key`` must carry (None: any, or none).
        auth_failure: a wrong key is refused at the upgrade (``"http"``:
            401) or after it (``"close"``: an error message, then 1008).
        first_audio_delay_s: a flush's first audio comes this long after
            the flush arrived, s.
        chunk_ms: audio per message, ms.
        chunk_interval_s: pause between messages, s (faster than real time).
        timebase: alignment times relative to each chunk or cumulative.
        id_key: ``"contextId"`` or ``"context_id"`` in replies.
        alignment / normalized_alignment: include them.
        alignment_trim: strip and merge whitespace in alignment.
        flush_done / flush_done_id: send ``flush_done`` after each flush's
            audio, with the context id or not.
        final_after_close: send ``isFinal`` after ``close_context``.
        trailing_chunks: chunks still sent after ``close_context`` of a
            context with audio being made.
        max_contexts: contexts open at once per socket.
        inactivity_timeout_s: idle close, s (None: the query's, 20 s by default).
        answer_rate: make the audio at this rate, whatever was asked (None: as asked).
        audio_format: ``"pcm"``, ``"wav"`` (a WAV header before each
            context's first audio, stating its rate) or ``"mp3"`` (an ID3
            tag before it).
        odd_chunks: cut chunks at odd byte counts (the total stays whole samples).
        odd_total: one stray byte after each flush's audio.
        refuse_status: answer the upgrade with this status instead.
        accept_delay_s: wait this long before answering the upgrade, s.
        faulty_connections: the faults below (and ``refuse_status`` and
            ``accept_delay_s``) apply to the first this many upgrade
            requests (None: all).
        drop_after_chunks: abort the TCP connection after this many audio
            messages on the connection.
        garbage_after_chunks: send a text frame that is not JSON after this many.
        hang_after_chunks: send nothing more after this many (the socket stays open).
        error_after_chunks: send an error after this many: ``error_message``,
            naming the context (``error_on_context``) or not, then close
            with ``error_close`` if set.
        inject: ``(after_chunks, frame)``: send ``frame`` (text, or bytes as
            a binary frame) after that many audio messages.
    """

    api_key: str | None = None
    auth_failure: Literal["http", "close"] = "http"
    first_audio_delay_s: float = 0.12
    chunk_ms: float = 60.0
    chunk_interval_s: float = 0.005
    timebase: Literal["chunk", "cumulative"] = "chunk"
    id_key: Literal["contextId", "context_id"] = "contextId"
    alignment: bool = True
    normalized_alignment: bool = True
    alignment_trim: bool = False
    flush_done: bool = False
    flush_done_id: bool = True
    final_after_close: bool = True
    trailing_chunks: int = 2
    max_contexts: int = 5
    inactivity_timeout_s: float | None = None
    answer_rate: int | None = None
    audio_format: Literal["pcm", "wav", "mp3"] = "pcm"
    odd_chunks: bool = False
    odd_total: bool = False
    refuse_status: int | None = None
    accept_delay_s: float = 0.0
    faulty_connections: int | None = 1
    drop_after_chunks: int | None = None
    garbage_after_chunks: int | None = None
    hang_after_chunks: int | None = None
    error_after_chunks: int | None = None
    error_message: str = "The fake was told to fail here"
    error_on_context: bool = True
    error_close: int | None = None
    inject: list[tuple[int, str | bytes]] = field(default_factory=list)


@dataclass
class Attempt:
    """One upgrade request, accepted or not.

    Attributes:
        path: the request path.
        voice_id: the path's voice id.
        headers: its headers.
        query: its query, in order.
        status: 101 (accepted) or the refusal's status.
        at: when it arrived (``time.monotonic()``).
    """

    path: str
    voice_id: str
    headers: dict[str, str]
    query: list[tuple[str, str]]
    status: int = 101
    at: float = 0.0

    def param(self, name: str) -> str | None:
        """The first value of query parameter ``name`` (None: absent)."""
        return next((v for k, v in self.query if k == name), None)


@dataclass
class ContextRecord:
    """What happened to one context.

    Attributes:
        context_id: its id.
        opened_at: its first message's arrival (``time.monotonic()``).
        voice_settings: the init's ``voice_settings``.
        texts: every ``text`` received for it, in order (the init's " " included).
        flushes: the text spoken at each flush, in order.
        closed_at: ``close_context``'s arrival, None if none came.
        audio: the PCM sent for it (at :attr:`rate`; headers and stray bytes not included).
        flush_bytes: bytes of :attr:`audio` sent for each flush.
        rate: the audio's rate, Hz.
        words: (word, start s, end s) of each word in its audio (the truth).
        chunks_sent: audio messages sent.
        chunks_after_close: of them, sent after ``close_context`` arrived.
        audio_ms_after_close: their audio, ms.
        characters_after_close: characters of the text it was generating
            when ``close_context`` came or the client went away (it went on
            generating it; it is billed anyway).
        final_sent: ``isFinal`` was sent.
    """

    context_id: str
    opened_at: float
    voice_settings: Any = None
    texts: list[str] = field(default_factory=list)
    flushes: list[str] = field(default_factory=list)
    closed_at: float | None = None
    audio: bytearray = field(default_factory=bytearray)
    flush_bytes: list[int] = field(default_factory=list)
    rate: int = 0
    words: list[tuple[str, float, float]] = field(default_factory=list)
    chunks_sent: int = 0
    chunks_after_close: int = 0
    audio_ms_after_close: float = 0.0
    characters_after_close: int = 0
    final_sent: bool = False

    @property
    def characters(self) -> int:
        """Characters of text received for it (what ElevenLabs bills)."""
        return sum(len(t) for t in self.texts)


@dataclass
class Connection:
    """What one accepted connection received and sent.

    Attributes:
        attempt: its upgrade request.
        rate: the rate asked (``output_format``), Hz.
        received: ``(time.monotonic(), message)`` per frame: the parsed JSON,
            or the raw text/bytes if it is not JSON.
        sent: ``(time.monotonic(), message)`` per frame sent: the JSON with
            ``audio`` replaced by its decoded byte count, or the raw frame.
        contexts: per context id.
        closed_with: ``(code, reason)`` of the close the server sent,
            ``(0, "aborted")`` for a dropped TCP connection; None: the client closed.
        client_gone_at: when the client closed or dropped it.
        ended: set when the connection is over.
    """

    attempt: Attempt
    rate: int
    received: list[tuple[float, Any]] = field(default_factory=list)
    sent: list[tuple[float, Any]] = field(default_factory=list)
    contexts: dict[str, ContextRecord] = field(default_factory=dict)
    closed_with: tuple[int, str] | None = None
    client_gone_at: float | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def characters(self) -> int:
        """Characters of text received on it (what ElevenLabs bills)."""
        return sum(c.characters for c in self.contexts.values())

    def messages(self, context_id: str | None = None) -> list[dict[str, Any]]:
        """The JSON messages received (of one context if given), in order."""
        return [m for _, m in self.received if isinstance(m, dict) and (context_id is None or m.get("context_id") == context_id)]

    def received_at(self, context_id: str, key: str) -> list[float]:
        """When each message of ``context_id`` carrying ``key`` truthy arrived."""
        return [t for t, m in self.received if isinstance(m, dict) and m.get("context_id") == context_id and m.get(key)]

    def sent_to(self, context_id: str) -> list[dict[str, Any]]:
        """The JSON messages sent for ``context_id`` (either id key)."""
        return [m for _, m in self.sent if isinstance(m, dict) and context_id in (m.get("contextId"), m.get("context_id"))]


class FakeElevenLabs:
    """The server (see the module doc); :meth:`app` is its aiohttp app.

    Args:
        backend: the voice (espeak-ng word by word).
        options: knobs (:class:`FakeElevenLabsOptions`).
    """

    def __init__(self, backend: TtsBackend | None = None, options: FakeElevenLabsOptions | None = None) -> None:
        self.backend = backend or TtsBackend()
        self.options = options or FakeElevenLabsOptions()
        self.attempts: list[Attempt] = []
        self.connections: list[Connection] = []

    @property
    def characters(self) -> int:
        """Characters billed on every connection."""
        return sum(c.characters for c in self.connections)

    def app(self) -> web.Application:
        """The aiohttp application (``GET /v1/text-to-speech/{voice_id}/multi-stream-input``)."""
        app = web.Application()
        app.router.add_get("/v1/text-to-speech/{voice_id}/multi-stream-input", self.stream_input)
        return app

    async def stream_input(self, request: web.Request) -> web.StreamResponse:
        """One upgrade: checked, then served until it closes."""
        o = self.options
        attempt = Attempt(
            request.path, request.match_info["voice_id"], dict(request.headers), list(request.query.items()), at=time.monotonic(),
        )
        self.attempts.append(attempt)
        index = len(self.attempts) - 1
        faulty = o.faulty_connections is None or index < o.faulty_connections
        if o.accept_delay_s and faulty:
            await asyncio.sleep(o.accept_delay_s)
        if o.refuse_status is not None and faulty:
            return _refuse(attempt, o.refuse_status, "refused", "The fake was told to refuse this connection.")
        key_ok = o.api_key is None or request.headers.get("xi-api-key") == o.api_key
        if not key_ok and o.auth_failure == "http":
            return _refuse(attempt, 401, "invalid_api_key", "Invalid API key")
        fmt = request.query.get("output_format", "mp3_44100_128")
        rate = int(fmt[4:]) if fmt.startswith("pcm_") and fmt[4:].isdigit() else 0
        if rate not in PCM_RATES:
            return _refuse(attempt, 400, "invalid_output_format", f"This fake speaks pcm_<rate> at {PCM_RATES} only, not {fmt}.")
        ws = web.WebSocketResponse(autoping=True, max_msg_size=16 * 1024 * 1024)
        await ws.prepare(request)
        conn = Connection(attempt, rate)
        self.connections.append(conn)
        session = _Session(self, request, ws, conn, faulty)
        try:
            if not key_ok:
                await session.send({"message": "Invalid API key", "error": "invalid_api_key"})
                await session.close(1008, "invalid_api_key")
            else:
                await session.serve()
        finally:
            conn.ended.set()
        return ws


def _refuse(attempt: Attempt, status: int, code: str, message: str) -> web.Response:
    attempt.status = status
    return web.json_response({"detail": {"status": code, "message": message}}, status=status)


class _Ctx:
    """One context being served."""

    def __init__(self, record: ContextRecord) -> None:
        self.record = record
        self.buffer = ""
        self.jobs: asyncio.Queue[tuple[str, float] | None] = asyncio.Queue()
        self.generating: str | None = None
        self.trailing_left = 0
        self.offset_bytes = 0  # audio of this context sent so far (whole samples)
        self.first_audio = True
        self.done = False  # its slot is free
        self.task: asyncio.Task[None] | None = None

    @property
    def closed(self) -> bool:
        return self.record.closed_at is not None


class _Session:
    """One connection's life."""

    def __init__(self, server: FakeElevenLabs, request: web.Request, ws: web.WebSocketResponse, conn: Connection, faulty: bool) -> None:
        self.server = server
        self.o = server.options
        self.request = request
        self.ws = ws
        self.conn = conn
        self.faulty = faulty
        self.loop = asyncio.get_running_loop()
        self.ctx: dict[str, _Ctx] = {}
        self.lock = asyncio.Lock()
        self.chunks = 0
        self.hung = False
        self.dropped = False
        self.last_rx = self.loop.time()
        self.fired: set[str] = set()
        self.out_rate = self.o.answer_rate or conn.rate
        idle = self.o.inactivity_timeout_s
        if idle is None:
            try:
                idle = float(request.query.get("inactivity_timeout", "20"))
            except ValueError:
                idle = 20.0
        self.idle_s = idle

    async def serve(self) -> None:
        watcher = self.loop.create_task(self.watch_idle())
        try:
            async for msg in self.ws:
                now = time.monotonic()
                if msg.type is WSMsgType.TEXT:
                    self.last_rx = self.loop.time()
                    try:
                        parsed = json.loads(msg.data)
                    except ValueError:
                        parsed = None
                    self.conn.received.append((now, parsed if isinstance(parsed, dict) else msg.data))
                    if isinstance(parsed, dict) and not self.hung:
                        await self.handle(parsed, now)
                elif msg.type is WSMsgType.BINARY:
                    self.conn.received.append((now, msg.data))
                else:
                    break
        finally:
            gone = time.monotonic()
            if self.conn.closed_with is None:
                self.conn.client_gone_at = gone
            workers = [c.task for c in self.ctx.values() if c.task is not None]
            for c in self.ctx.values():
                if not c.done and not c.closed:
                    # the client went away: what it was making and had queued is generated (and billed) anyway
                    left = (c.generating or "") + "".join(j[0] for j in list(c.jobs._queue) if j is not None)  # type: ignore[attr-defined]
                    c.record.characters_after_close += len(left)
            watcher.cancel()
            for t in workers:
                t.cancel()
            await asyncio.gather(watcher, *workers, return_exceptions=True)

    async def handle(self, m: dict[str, Any], now: float) -> None:
        if m.get("close_socket"):
            await self.close(1000, "")
            return
        cid = m.get("context_id")
        text = m.get("text")
        if not isinstance(cid, str):
            return  # a bare keep-alive ({"text": ""}), or nothing this fake does
        ctx = self.ctx.get(cid)
        if ctx is None:
            if m.get("close_context") or (text == "" and not m.get("flush")):
                return  # closing or keeping alive a context it does not have
            if sum(1 for c in self.ctx.values() if not c.done) >= self.o.max_contexts:
                await self.send({
                    "message": f"Maximum simultaneous contexts exceeded (limit {self.o.max_contexts})",
                    "error": "max_active_conversations",
                })
                await self.close(1008, "max_active_conversations")
                return
            record = ContextRecord(cid, now, voice_settings=m.get("voice_settings"), rate=self.out_rate)
            self.conn.contexts[cid] = record
            ctx = self.ctx[cid] = _Ctx(record)
            ctx.task = self.loop.create_task(self.work(ctx))
        if m.get("close_context"):
            if not ctx.closed:
                ctx.record.closed_at = now
                ctx.trailing_left = self.o.trailing_chunks
                if ctx.generating:
                    ctx.record.characters_after_close += len(ctx.generating)
                while not ctx.jobs.empty():
                    ctx.jobs.get_nowait()
                ctx.jobs.put_nowait(None)
            return
        if ctx.closed:
            return
        if isinstance(text, str):
            ctx.record.texts.append(text)
            ctx.buffer += text
        if m.get("flush"):
            job, ctx.buffer = ctx.buffer, ""
            ctx.jobs.put_nowait((job, now))

    # -- speaking -----------------------------------------------------------------

    async def work(self, ctx: _Ctx) -> None:
        try:
            while (job := await ctx.jobs.get()) is not None:
                text, arrived = job
                ctx.record.flushes.append(text)
                if text.strip():
                    ctx.generating = text
                    rendering = await self.server.backend.render(text, self.out_rate)
                    wait = arrived + self.o.first_audio_delay_s - time.monotonic()
                    if wait > 0:
                        await asyncio.sleep(wait)
                    await self.speak(ctx, text, rendering)
                    ctx.generating = None
                if self.o.flush_done and not ctx.closed:
                    msg: dict[str, Any] = {"type": "flush_done"}
                    if self.o.flush_done_id:
                        msg[self.o.id_key] = ctx.record.context_id
                    await self.send(msg)
            if self.o.final_after_close:
                await self.send({"audio": None, "isFinal": True, self.o.id_key: ctx.record.context_id})
                ctx.record.final_sent = True
        except (ConnectionError, RuntimeError):
            return
        finally:
            ctx.done = True

    async def speak(self, ctx: _Ctx, text: str, r: Rendering) -> None:
        o = self.o
        rate = self.out_rate
        pcm = r.pcm
        step = max(2, int(rate * o.chunk_ms / 1000) * 2)
        bounds = list(range(0, len(pcm), step)) + [len(pcm)]
        if o.odd_chunks:
            bounds = [0] + [b + 1 for b in bounds[1:-1]] + [len(pcm)]
        offset_ms = ctx.offset_bytes / 2 / rate * 1000
        chars = _trim(r.chars) if o.alignment_trim else list(r.chars)
        base_s = ctx.offset_bytes / 2 / rate
        ctx.record.words.extend((w, base_s + s, base_s + e) for w, s, e in r.words)
        pairs = [(a, b) for a, b in zip(bounds, bounds[1:], strict=False) if b > a]
        ctx.record.flush_bytes.append(0)
        for i, (a, b) in enumerate(pairs):
            after_close = ctx.closed
            if after_close:
                if ctx.trailing_left <= 0:
                    break
                ctx.trailing_left -= 1
            t0 = a / 2 / rate * 1000
            t1 = b / 2 / rate * 1000
            last = i == len(pairs) - 1
            mine = [(c, s, d) for c, s, d in chars if s >= t0 and (last or s < t1)]
            if i == 0:
                mine = [(c, s, d) for c, s, d in chars if s < t1 or last]
            shift = offset_ms if o.timebase == "cumulative" else -t0
            data = pcm[a:b]
            wire = data
            if last and o.odd_total:
                wire += b"\0"
            if ctx.first_audio:
                ctx.first_audio = False
                if o.audio_format == "wav":
                    wire = _wav_header(rate) + wire
                elif o.audio_format == "mp3":
                    wire = b"ID3\x04\x00\x00\x00\x00\x00\x00" + wire
            msg: dict[str, Any] = {"audio": base64.b64encode(wire).decode(), "isFinal": None}
            if o.alignment:
                msg["alignment"] = _align(mine, shift)
                msg["normalizedAlignment"] = _align(_normalise(mine), shift) if o.normalized_alignment else None
            msg[o.id_key] = ctx.record.context_id
            if not await self.send_audio(msg, len(wire)):
                return
            ctx.record.audio += data
            ctx.record.flush_bytes[-1] += len(data)
            ctx.record.chunks_sent += 1
            if after_close:
                ctx.record.chunks_after_close += 1
                ctx.record.audio_ms_after_close += len(data) / 2 / rate * 1000
            await asyncio.sleep(o.chunk_interval_s)
        ctx.offset_bytes += len(pcm) - len(pcm) % 2

    # -- sending ------------------------------------------------------------------

    async def send_audio(self, msg: dict[str, Any], size: int) -> bool:
        """Send one audio message after the faults due; False: the connection is gone."""
        if self.dropped:
            return False
        if self.faulty:
            o, n = self.o, self.chunks
            for i, (after, frame) in enumerate(o.inject):
                if n >= after and f"inject{i}" not in self.fired:
                    self.fired.add(f"inject{i}")
                    await self.send(frame)
            if o.garbage_after_chunks is not None and n >= o.garbage_after_chunks and "garbage" not in self.fired:
                self.fired.add("garbage")
                await self.send(GARBAGE)
            if o.error_after_chunks is not None and n >= o.error_after_chunks and "error" not in self.fired:
                self.fired.add("error")
                err: dict[str, Any] = {"message": o.error_message, "error": "fake_error"}
                if o.error_on_context:
                    err[o.id_key] = msg[o.id_key]
                await self.send(err)
                if o.error_close is not None:
                    await self.close(o.error_close, o.error_message[:100])
                    return False
            if o.hang_after_chunks is not None and n >= o.hang_after_chunks:
                self.hung = True
            if o.drop_after_chunks is not None and n >= o.drop_after_chunks:
                self.dropped = True
                self.conn.closed_with = (0, "aborted")
                transport = self.request.transport
                if transport is not None:
                    transport.abort()
                return False
        if self.hung:
            return True
        self.chunks += 1
        await self.send(msg, audio_size=size)
        return True

    async def send(self, msg: dict[str, Any] | str | bytes, audio_size: int | None = None) -> None:
        if self.hung or self.dropped or self.ws.closed:
            return
        try:
            async with self.lock:
                if isinstance(msg, bytes):
                    await self.ws.send_bytes(msg)
                else:
                    await self.ws.send_str(msg if isinstance(msg, str) else json.dumps(msg))
        except (ConnectionError, RuntimeError):
            self.dropped = True  # the client went away
            return
        record: Any = msg
        if isinstance(msg, dict) and audio_size is not None:
            record = dict(msg, audio=audio_size)
        self.conn.sent.append((time.monotonic(), record))

    async def close(self, code: int, reason: str) -> None:
        if self.conn.closed_with is None and not self.ws.closed:
            self.conn.closed_with = (code, reason)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.close(code=code, message=reason.encode())

    async def watch_idle(self) -> None:
        while True:
            left = self.last_rx + self.idle_s - self.loop.time()
            if left <= 0:
                if not self.hung:
                    await self.close(1008, "input_timeout_exceeded")
                return
            await asyncio.sleep(max(left, 0.02))


def _align(chars: list[tuple[str, float, float]], shift_ms: float) -> dict[str, Any]:
    return {
        "chars": [c for c, _, _ in chars],
        "charStartTimesMs": [round(max(0.0, s + shift_ms), 3) for _, s, _ in chars],
        "charDurationsMs": [round(d, 3) for _, _, d in chars],
    }


def _trim(chars: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """Whitespace stripped at both ends and merged inside (what a server may do to alignment)."""
    out: list[tuple[str, float, float]] = []
    for c in chars:
        if c[0].isspace() and (not out or out[-1][0].isspace()):
            continue
        out.append(c)
    while out and out[-1][0].isspace():
        out.pop()
    return out


def _normalise(chars: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """What ElevenLabs' normalised text looks like: lower case, digits said as words."""
    out: list[tuple[str, float, float]] = []
    for c, s, d in chars:
        if c.isdigit():
            word = _DIGITS[int(c)]
            out += [(w, s + k * d / len(word), d / len(word)) for k, w in enumerate(word)]
        else:
            out.append((c.lower(), s, d))
    return out


def _wav_header(rate: int) -> bytes:
    """A streaming WAV header (sizes unknown) for mono s16 at ``rate``."""
    fmt = struct.pack("<HHIIHH", 1, 1, rate, rate * 2, 2, 16)
    unknown = struct.pack("<I", 0xFFFFFFFF)
    return b"RIFF" + unknown + b"WAVE" + b"fmt " + struct.pack("<I", 16) + fmt + b"data" + unknown


def main() -> None:
    """``python -m testkit.fake_elevenlabs [--host H] [--port P] [--api-key K] [--timebase chunk|cumulative] ...``"""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8097)
    parser.add_argument("--api-key", default=None, help="require xi-api-key KEY")
    parser.add_argument("--first-audio-ms", type=float, default=120.0)
    parser.add_argument("--timebase", choices=["chunk", "cumulative"], default="chunk")
    parser.add_argument("--id-key", choices=["contextId", "context_id"], default="contextId")
    a = parser.parse_args()
    fake = FakeElevenLabs(TtsBackend(), FakeElevenLabsOptions(
        api_key=a.api_key, first_audio_delay_s=a.first_audio_ms / 1000, timebase=a.timebase, id_key=a.id_key,
    ))
    logging.basicConfig(level=logging.INFO)
    web.run_app(fake.app(), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
