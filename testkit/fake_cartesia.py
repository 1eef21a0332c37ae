"""A local Cartesia TTS WebSocket server (``/tts/websocket``) for tests and
benchmarks: a real aiohttp server on a real socket that speaks Cartesia's
messages and quirks, its voice espeak-ng word by word
(:class:`testkit.tts_backend.TtsBackend`, so every word's place in the
audio is exact).

What it reproduces (shared/reference/speech-providers.md, section 2.3 and
section 4 item 4; Cartesia's docs pages "TTS WebSocket", "Contexts",
"Context flushing and flush IDs"):

- **Upgrade**: the key in ``X-API-Key`` or ``?api_key=`` is checked when
  ``api_key`` is set (401 otherwise); the version in ``?cartesia_version=``
  or the ``Cartesia-Version`` header is required (400 without).
- **Generation requests** on contexts: every input must carry ``model_id``,
  ``voice`` (``{"mode":"id","id"}``), ``output_format`` (``raw`` /
  ``pcm_s16le`` / 8-48 kHz: the only format the fake makes) and a
  ``context_id``; every field but ``transcript``, ``continue``,
  ``duration`` and ``flush`` must stay the same on one context, else an
  ``error`` for the context, as Cartesia. Transcripts are said in order,
  one after the other, faster than real time (``chunk_ms`` of audio every
  ``chunk_interval_s``), the first after ``first_audio_delay_s`` and each
  later one after ``request_delay_s``; ``continue: false`` (an empty
  transcript or not) ends the context with ``done`` once all is said.
  Input on a context after its end is an ``error``.
- **Answers**: ``chunk`` (base64 raw s16 LE at the rate asked, ``done``
  false, ``status_code`` 206, ``step_time``, ``context_id``),
  ``timestamps`` (``word_timestamps.words/start/end`` in seconds, sent
  after the chunk that completes the words, or all before the transcript's
  audio with ``timestamps="before"``; counted from the context's first
  audio, or from each transcript's with ``timebase="request"``: the
  reference does not say which, VERIFY), ``flush_done``, ``done``,
  ``error`` (``done`` true, ``error``, ``status_code``, ``context_id``).
- **Manual flush** (``transcript`` "", ``continue`` and ``flush`` true):
  ``flush_mode`` ``"full"``: chunks carry ``flush_id`` (1 for the audio of
  the first transcript, each flush adding one) and the flush is answered by
  ``flush_done`` with the ``flush_id`` it closed once the audio before it is
  sent; ``"flush_done"``: the same without ``flush_id`` on chunks;
  ``"flush_done_no_id"``: ``flush_done`` without any ``flush_id``;
  ``"none"``: flushes are ignored (an older server).
- **Cancel** ``{"context_id","cancel":true}``: no acknowledgement; queued
  transcripts not yet begun are dropped, but the one being generated goes
  on to its end (the docs: cancel "will only halt requests that have not
  begun generating"), so chunks keep coming after it (stragglers, counted
  in :attr:`FakeContext.audio_after_cancel_s`); ``done_after_cancel``
  sends ``done`` after them.
- **Context expiry**: an input on a context ``context_expiry_s`` (1 s)
  after its last audio, with nothing left to say, is an ``error``
  ("not supported" by Cartesia).
- **Idle close**: ``idle_close_s`` (about 5 min at Cartesia) with nothing
  received and nothing being said closes the socket (1000); there is no
  keepalive message.
- **Billing**: the characters of every transcript whose generation began
  (:attr:`FakeContext.billed_chars`), including what it kept generating
  after the client went away (``generate_after_disconnect``: transcripts
  already received are still said, unsent, and billed; counted apart in
  :attr:`FakeContext.chars_after_disconnect`).

Faults, for the first ``faulty_connections`` connection attempts: refuse the
upgrade with a status, accept it slowly, hang (read everything, answer
nothing), drop the TCP connection, send a text frame that is not JSON,
send an ``error`` for the context, close with a code (1008), after N chunks
on the connection; bad audio (``odd_total``: a context's first transcript's
audio one byte short; ``odd_split``: chunks cut at odd byte counts, whole samples across
them; ``base64``: data that is not base64); audio at another rate than
asked, not said (``render_rate``); any raw frame after N chunks. Everything
received and sent is recorded per connection with monotonic times
(:class:`Connection`).

Run it alone: ``python -m testkit.fake_cartesia --port 8099`` and point
``tts.base_url`` at ``ws://127.0.0.1:8099``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import contextlib
import json
import logging
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import WSMsgType, web

from testkit.tts_backend import TtsBackend

log = logging.getLogger(__name__)

#: the fields that may change between inputs on one context (docs, "Contexts")
FREE_FIELDS = frozenset({"transcript", "continue", "duration", "flush", "flush_id"})
GARBAGE = "<html><body>502 Bad Gateway</body></html>"


@dataclass
class FakeCartesiaOptions:
    """The fake's knobs (tests may change them between connections).

    Attributes:
        api_key: the key ``X-API-Key`` (or ``?api_key=``) must carry (None: any or none).
        first_audio_delay_s: a context's first transcript: its first chunk comes this late, s.
        request_delay_s: each later transcript of a context starts this late, s.
        chunk_ms: audio per chunk, ms.
        chunk_interval_s: time between chunks, s (60 ms every 5 ms: 12x real time).
        timestamps: ``"after"`` (each chunk's finished words after it) or ``"before"``
            (a transcript's words before its audio).
        timebase: word times from the context's first audio (``"context"``) or
            each transcript's (``"request"``).
        flush_mode: see the module doc.
        done_after_cancel: send ``done`` for a cancelled context once its stragglers are sent.
        context_expiry_s: a context expires this long after its last audio, s.
        idle_close_s: close the socket after this long with nothing received or said, s.
        generate_after_disconnect: transcripts received go on being generated
            (and billed) after the client went away.
        render_rate: make the audio at this rate whatever was asked (a fault; None: as asked).
        faulty_connections: the faults below apply to the first this many
            connection attempts, refused or not (None: to all).
        refuse_status: answer the upgrade with this status instead.
        accept_delay_s: wait this long before answering the upgrade, s.
        hang: accept, read, and answer nothing.
        drop_after_chunks: after this many chunks on the connection, drop the TCP connection.
        garbage_after_chunks: after this many chunks, send a text frame that is not JSON.
        error_after_chunks: after this many chunks, send ``error_message`` as an
            ``error`` for the context and stop it (once per connection).
        error_message / error_status: that error's text and ``status_code``.
        close_after_chunks: after this many chunks, close the socket with ``close_code``.
        close_code: that close's code.
        bad_audio: ``"odd_total"`` (each context's first transcript one byte
            short), ``"odd_split"`` or ``"base64"`` (module doc).
        inject: ``(after_chunks, frame)``: send the raw text ``frame`` once, after that many chunks.
    """

    api_key: str | None = None
    first_audio_delay_s: float = 0.12
    request_delay_s: float = 0.02
    chunk_ms: int = 60
    chunk_interval_s: float = 0.005
    timestamps: Literal["after", "before"] = "after"
    timebase: Literal["context", "request"] = "context"
    flush_mode: Literal["full", "flush_done", "flush_done_no_id", "none"] = "full"
    done_after_cancel: bool = False
    context_expiry_s: float = 1.0
    idle_close_s: float = 300.0
    generate_after_disconnect: bool = True
    render_rate: int | None = None
    faulty_connections: int | None = 1
    refuse_status: int | None = None
    accept_delay_s: float = 0.0
    hang: bool = False
    drop_after_chunks: int | None = None
    garbage_after_chunks: int | None = None
    error_after_chunks: int | None = None
    error_message: str = "Internal server error"
    error_status: int = 500
    close_after_chunks: int | None = None
    close_code: int = 1008
    bad_audio: Literal["odd_total", "odd_split", "base64"] | None = None
    inject: list[tuple[int, str]] = field(default_factory=list)


@dataclass
class Attempt:
    """One upgrade request, accepted (101) or not."""

    path: str
    headers: dict[str, str]
    query: dict[str, str]
    status: int = 101


@dataclass
class FakeContext:
    """One Cartesia context as the fake saw it.

    Attributes:
        context_id: its id.
        fields: the fields every input must repeat.
        rate: the rate asked, Hz.
        transcripts: every transcript received, in order ("" included).
        generated: the transcripts whose generation began (billed).
        billed_chars: their characters.
        chars_after_disconnect: characters of those begun after the client went away.
        audio: the PCM sent for it (what the client got), at the rate made.
        audio_s: seconds of audio made for it.
        cancelled_at: when its cancel arrived (monotonic s), None if never.
        audio_after_cancel_s: audio sent after the cancel arrived, s.
        done_sent: ``done`` was sent.
        errors: the ``error`` texts sent for it.
    """

    context_id: str
    fields: dict[str, Any]
    rate: int
    transcripts: list[str] = field(default_factory=list)
    generated: list[str] = field(default_factory=list)
    billed_chars: int = 0
    chars_after_disconnect: int = 0
    audio: bytearray = field(default_factory=bytearray)
    audio_s: float = 0.0
    cancelled_at: float | None = None
    audio_after_cancel_s: float = 0.0
    done_sent: bool = False
    errors: list[str] = field(default_factory=list)
    # the generator's state
    queue: asyncio.Queue[tuple[str, str]] = field(default_factory=asyncio.Queue)
    input_closed: bool = False
    generating: bool = False
    finished: bool = False
    last_audio_at: float | None = None
    flush_id: int = 1
    task: asyncio.Task[None] | None = None

    @property
    def busy(self) -> bool:
        return self.generating or not self.queue.empty()


@dataclass
class Connection:
    """What one accepted connection received and sent.

    Attributes:
        attempt: its upgrade.
        received: ``(monotonic s, raw text, parsed JSON or None)`` per frame.
        sent: ``(monotonic s, parsed JSON or raw text)`` per frame sent.
        contexts: its contexts by id.
        chunks_sent: chunks sent on it.
        closed_with: ``(code, reason)`` of the close the server sent,
            ``(0, "aborted")`` for a dropped TCP connection; None: the client closed.
        client_gone_at: when the client went away (monotonic s).
        ended: set when the connection (and its generation) is over.
    """

    attempt: Attempt
    received: list[tuple[float, str, Any]] = field(default_factory=list)
    sent: list[tuple[float, Any]] = field(default_factory=list)
    contexts: dict[str, FakeContext] = field(default_factory=dict)
    chunks_sent: int = 0
    closed_with: tuple[int, str] | None = None
    client_gone_at: float | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)

    @property
    def billed_chars(self) -> int:
        """Characters it would bill (generation begun), after the client left included."""
        return sum(c.billed_chars for c in self.contexts.values())

    def times(self, key: str, context_id: str | None = None) -> list[float]:
        """When each message with a true ``key`` (``"cancel"``, ``"flush"``) arrived."""
        return [
            t
            for t, _, m in self.received
            if isinstance(m, dict) and m.get(key) and (context_id is None or m.get("context_id") == context_id)
        ]

    def inputs(self, context_id: str) -> list[dict[str, Any]]:
        """The messages received for ``context_id``, in order."""
        return [m for _, _, m in self.received if isinstance(m, dict) and m.get("context_id") == context_id]

    def sent_of(self, kind: str, context_id: str | None = None) -> list[dict[str, Any]]:
        """The messages sent of ``type`` ``kind`` (for ``context_id``)."""
        return [
            m
            for _, m in self.sent
            if isinstance(m, dict) and m.get("type") == kind and (context_id is None or m.get("context_id") == context_id)
        ]


class FakeCartesia:
    """The server (see the module doc); :meth:`app` is its aiohttp app.

    Args:
        backend: the voice (espeak-ng word by word).
        options: knobs (:class:`FakeCartesiaOptions`).
    """

    def __init__(self, backend: TtsBackend, options: FakeCartesiaOptions | None = None) -> None:
        self.backend = backend
        self.options = options or FakeCartesiaOptions()
        self.attempts: list[Attempt] = []
        self.connections: list[Connection] = []
        self._sessions: set[_Session] = set()

    @property
    def billed_chars(self) -> int:
        """Characters billed on every connection."""
        return sum(c.billed_chars for c in self.connections)

    def app(self) -> web.Application:
        """The aiohttp application (``GET /tts/websocket``)."""
        app = web.Application()
        app.router.add_get("/tts/websocket", self.websocket)
        app.on_shutdown.append(self._shutdown)
        return app

    async def _shutdown(self, _app: web.Application) -> None:
        for session in list(self._sessions):
            await session.shutdown()

    async def websocket(self, request: web.Request) -> web.StreamResponse:
        """One upgrade: checked, then served until it closes."""
        o = self.options
        attempt = Attempt(request.path, dict(request.headers), dict(request.query))
        self.attempts.append(attempt)
        faulty = o.faulty_connections is None or len(self.attempts) <= o.faulty_connections
        if faulty and o.accept_delay_s:
            await asyncio.sleep(o.accept_delay_s)
        if faulty and o.refuse_status is not None:
            return _refuse(attempt, o.refuse_status, "The fake was told to refuse this connection.")
        key = request.headers.get("X-API-Key") or request.query.get("api_key")
        if o.api_key is not None and key != o.api_key:
            return _refuse(attempt, 401, "Invalid API key.")
        if not (request.query.get("cartesia_version") or request.headers.get("Cartesia-Version")):
            return _refuse(attempt, 400, "cartesia_version is required.")
        ws = web.WebSocketResponse(autoping=True, max_msg_size=16 * 1024 * 1024)
        await ws.prepare(request)
        conn = Connection(attempt)
        self.connections.append(conn)
        session = _Session(self, request, ws, conn, faulty)
        self._sessions.add(session)
        try:
            await session.serve()
        finally:
            self._sessions.discard(session)
            conn.ended.set()
        return ws


def _refuse(attempt: Attempt, status: int, message: str) -> web.Response:
    attempt.status = status
    return web.json_response({"error": message, "status_code": status}, status=status)


class _Session:
    """One connection's life: read inputs, say transcripts, answer."""

    def __init__(self, server: FakeCartesia, request: web.Request, ws: web.WebSocketResponse, conn: Connection, faulty: bool) -> None:
        self.server = server
        self.o = server.options
        self.request = request
        self.ws = ws
        self.conn = conn
        self.faulty = faulty
        self.loop = asyncio.get_running_loop()
        self.lock = asyncio.Lock()
        self.last_received = self.loop.time()
        self.fired: set[str] = set()
        self.gone = False  # the client went away (or the server closed)

    @property
    def hung(self) -> bool:
        return self.faulty and self.o.hang

    async def serve(self) -> None:
        idle = self.loop.create_task(self.watch_idle())
        try:
            await self.receive()
        finally:
            self.gone = True
            if self.conn.client_gone_at is None:
                self.conn.client_gone_at = time.monotonic()
            idle.cancel()
            tasks = [c.task for c in self.conn.contexts.values() if c.task is not None]
            for ctx in self.conn.contexts.values():
                if not self.o.generate_after_disconnect:
                    if ctx.task is not None:
                        ctx.task.cancel()
                ctx.queue.put_nowait(("gone", ""))
            await asyncio.gather(idle, *tasks, return_exceptions=True)

    async def shutdown(self) -> None:
        """The server stops: close the socket, stop saying."""
        await self.close(1001, "server shutdown")
        for ctx in self.conn.contexts.values():
            if ctx.task is not None:
                ctx.task.cancel()

    # -- receiving ----------------------------------------------------------------

    async def receive(self) -> None:
        async for msg in self.ws:
            if msg.type is not WSMsgType.TEXT:
                if msg.type is WSMsgType.BINARY:
                    self.conn.received.append((time.monotonic(), "<binary>", None))
                continue
            now = time.monotonic()
            self.last_received = self.loop.time()
            try:
                parsed = json.loads(msg.data)
            except ValueError:
                parsed = None
            self.conn.received.append((now, msg.data, parsed))
            if self.hung:
                continue
            await self.handle(parsed, now)

    async def handle(self, msg: Any, now: float) -> None:
        if not isinstance(msg, dict):
            await self.send({"type": "error", "done": True, "status_code": 400, "error": "Invalid JSON message."})
            return
        cid = msg.get("context_id")
        if msg.get("cancel") is True:
            ctx = self.conn.contexts.get(cid) if isinstance(cid, str) else None
            if ctx is not None and ctx.cancelled_at is None:
                ctx.cancelled_at = now
                ctx.queue.put_nowait(("cancel", ""))
            return
        if not isinstance(cid, str) or not cid:
            await self.send({"type": "error", "done": True, "status_code": 400, "error": "context_id is required."})
            return
        problem = _check_request(msg)
        if problem:
            await self.error(cid, 400, problem)
            return
        fixed = {k: v for k, v in msg.items() if k not in FREE_FIELDS}
        ctx = self.conn.contexts.get(cid)
        if ctx is None:
            ctx = FakeContext(cid, fixed, int(msg["output_format"]["sample_rate"]))
            self.conn.contexts[cid] = ctx
            ctx.task = self.loop.create_task(self.generate(ctx))
        elif ctx.finished or ctx.input_closed:
            await self.error(cid, 400, f"Context {cid} has finished; start a new context.")
            return
        elif ctx.cancelled_at is not None:
            return  # a cancelled context takes nothing more
        elif not ctx.busy and ctx.last_audio_at is not None and self.loop.time() - ctx.last_audio_at > self.o.context_expiry_s:
            ctx.finished = True
            await self.error(cid, 400, f"Context {cid} has expired (1 s after its last audio); start a new context.")
            return
        elif fixed != ctx.fields:
            changed = sorted(k for k in set(fixed) | set(ctx.fields) if fixed.get(k) != ctx.fields.get(k))
            await self.error(cid, 400, f"Inputs on one context must keep every field but transcript, continue and duration: {changed}")
            return
        transcript = msg.get("transcript", "")
        if not isinstance(transcript, str):
            await self.error(cid, 400, "transcript must be a string.")
            return
        ctx.transcripts.append(transcript)
        if transcript:
            ctx.queue.put_nowait(("text", transcript))
        if msg.get("flush") is True:
            ctx.queue.put_nowait(("flush", ""))
        if msg.get("continue", False) is not True:
            ctx.input_closed = True
            ctx.queue.put_nowait(("end", ""))

    # -- saying ---------------------------------------------------------------------

    async def generate(self, ctx: FakeContext) -> None:
        first = True
        try:
            while True:
                kind, text = await ctx.queue.get()
                if kind == "gone":
                    return
                if kind == "cancel":
                    if self.o.done_after_cancel:
                        await self.done(ctx)
                    continue
                if ctx.cancelled_at is not None or ctx.finished:
                    continue  # halted before it began
                if kind == "text":
                    ctx.generating = True
                    try:
                        ok = await self.say(ctx, text, self.o.first_audio_delay_s if first else self.o.request_delay_s)
                    finally:
                        ctx.generating = False
                    first = False
                    if not ok:
                        return
                elif kind == "flush":
                    if self.o.flush_mode != "none":
                        msg: dict[str, Any] = {
                            "type": "flush_done",
                            "done": False,
                            "flush_done": True,
                            "status_code": 206,
                            "context_id": ctx.context_id,
                        }
                        if self.o.flush_mode != "flush_done_no_id":
                            msg["flush_id"] = ctx.flush_id
                        ctx.flush_id += 1
                        await self.send(msg)
                elif kind == "end":
                    await self.done(ctx)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("fake Cartesia failed saying %s", ctx.context_id)

    async def done(self, ctx: FakeContext) -> None:
        if not ctx.done_sent:
            ctx.done_sent = ctx.finished = True
            await self.send({"type": "done", "done": True, "status_code": 206, "context_id": ctx.context_id})

    async def say(self, ctx: FakeContext, transcript: str, delay_s: float) -> bool:
        """Generate one transcript; False: a fault ended it (and the context)."""
        o = self.o
        ctx.generated.append(transcript)
        ctx.billed_chars += len(transcript)
        if self.gone:
            ctx.chars_after_disconnect += len(transcript)
        if not self.gone:
            await asyncio.sleep(delay_s)
        rate = (o.render_rate if self.faulty and o.render_rate else None) or ctx.rate
        rendering = await self.server.backend.render(transcript, rate)
        pcm = rendering.pcm
        bad = o.bad_audio if self.faulty else None
        if bad == "odd_total" and pcm and len(ctx.generated) == 1:
            pcm = pcm[:-1]
        step = max(2, int(rate * o.chunk_ms / 1000) * 2) + (1 if bad == "odd_split" else 0)
        base = ctx.audio_s if o.timebase == "context" else 0.0
        words = [(w, round(base + s, 4), round(base + e, 4)) for w, s, e in rendering.words]
        if o.timestamps == "before" and words:
            await self.timestamps(ctx, words)
            words = []
        pos = 0
        while pos < len(pcm):
            piece = pcm[pos : pos + step]
            pos += len(piece)
            if not await self.chunk(ctx, piece):
                return False
            ctx.audio_s += len(piece) / 2 / rate
            ctx.last_audio_at = self.loop.time()
            ready = [w for w in words if w[2] <= ctx.audio_s + 1e-6]
            if ready:
                words = words[len(ready) :]
                await self.timestamps(ctx, ready)
            if not self.gone:
                await asyncio.sleep(o.chunk_interval_s)
        if words:
            await self.timestamps(ctx, words)
        return True

    async def chunk(self, ctx: FakeContext, pcm: bytes) -> bool:
        """Send one chunk (and the faults due); False: the connection is ended by a fault."""
        o, conn = self.o, self.conn
        if self.gone:
            ctx.audio.extend(pcm)
            return True
        conn.chunks_sent += 1
        n = conn.chunks_sent
        if self.faulty:
            if o.drop_after_chunks is not None and n > o.drop_after_chunks:
                conn.closed_with = (0, "aborted")
                self.gone = True
                if self.request.transport is not None:
                    self.request.transport.abort()
                return False
            if o.close_after_chunks is not None and n > o.close_after_chunks:
                await self.close(o.close_code, f"closed by the fake after {o.close_after_chunks} chunks")
                return False
            if o.error_after_chunks is not None and n > o.error_after_chunks and "error" not in self.fired:
                self.fired.add("error")
                await self.error(ctx.context_id, o.error_status, o.error_message)
                ctx.finished = True
                return False
            if o.garbage_after_chunks is not None and n > o.garbage_after_chunks and "garbage" not in self.fired:
                self.fired.add("garbage")
                await self.send_raw(GARBAGE)
            for i, (after, frame) in enumerate(o.inject):
                if n > after and f"inject{i}" not in self.fired:
                    self.fired.add(f"inject{i}")
                    await self.send_raw(frame)
        data = "@@ not base64 @@" if self.faulty and o.bad_audio == "base64" else base64.b64encode(pcm).decode()
        msg: dict[str, Any] = {
            "type": "chunk",
            "data": data,
            "done": False,
            "status_code": 206,
            "step_time": round(o.chunk_interval_s * 1000, 3),
            "context_id": ctx.context_id,
        }
        if o.flush_mode == "full":
            msg["flush_id"] = ctx.flush_id
        ctx.audio.extend(pcm)
        if ctx.cancelled_at is not None:
            ctx.audio_after_cancel_s += len(pcm) / 2 / ctx.rate
        await self.send(msg)
        return True

    async def timestamps(self, ctx: FakeContext, words: list[tuple[str, float, float]]) -> None:
        msg: dict[str, Any] = {
            "type": "timestamps",
            "done": False,
            "status_code": 206,
            "context_id": ctx.context_id,
            "word_timestamps": {"words": [w for w, _, _ in words], "start": [s for _, s, _ in words], "end": [e for _, _, e in words]},
        }
        if self.o.flush_mode == "full":
            msg["flush_id"] = ctx.flush_id
        await self.send(msg)

    async def error(self, cid: str, status: int, message: str) -> None:
        ctx = self.conn.contexts.get(cid)
        if ctx is not None:
            ctx.errors.append(message)
        await self.send({"type": "error", "done": True, "status_code": status, "error": message, "context_id": cid})

    # -- sending ----------------------------------------------------------------------

    async def send(self, msg: dict[str, Any]) -> None:
        if await self.send_raw(json.dumps(msg), record=False):
            self.conn.sent.append((time.monotonic(), msg))

    async def send_raw(self, text: str, record: bool = True) -> bool:
        if self.gone or self.hung or self.ws.closed:
            return False
        try:
            async with self.lock:
                await self.ws.send_str(text)
        except (ConnectionError, RuntimeError):
            self.gone = True
            return False
        if record:
            self.conn.sent.append((time.monotonic(), text))
        return True

    async def close(self, code: int, reason: str) -> None:
        if self.conn.closed_with is None and not self.ws.closed:
            self.conn.closed_with = (code, reason)
            self.gone = True
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.close(code=code, message=reason.encode())

    async def watch_idle(self) -> None:
        while True:
            left = self.last_received + self.o.idle_close_s - self.loop.time()
            busy = any(c.busy for c in self.conn.contexts.values())
            if left <= 0 and not busy and not self.hung:
                await self.close(1000, "idle timeout")
                return
            await asyncio.sleep(min(max(left, 0.02), 1.0))


def _check_request(msg: dict[str, Any]) -> str:
    """What is wrong with a generation request ("" if nothing)."""
    if not isinstance(msg.get("model_id"), str) or not msg["model_id"]:
        return "model_id is required."
    voice = msg.get("voice")
    if not isinstance(voice, dict) or voice.get("mode") != "id" or not isinstance(voice.get("id"), str):
        return 'voice must be {"mode": "id", "id": "<voice id>"}.'
    fmt = msg.get("output_format")
    if not isinstance(fmt, dict):
        return "output_format is required."
    rate = fmt.get("sample_rate")
    if fmt.get("container") != "raw" or fmt.get("encoding") != "pcm_s16le":
        return "this fake makes raw pcm_s16le only."
    if not isinstance(rate, int) or isinstance(rate, bool) or not 8000 <= rate <= 48000:
        return "output_format.sample_rate must be 8000-48000."
    if "language" in msg and not isinstance(msg["language"], str):
        return "language must be a string."
    return ""


def main() -> None:
    """``python -m testkit.fake_cartesia [--host H] [--port P] [--api-key K]``"""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--api-key", default=None, help="require X-API-Key KEY")
    parser.add_argument("--first-audio-ms", type=float, default=120.0)
    a = parser.parse_args()
    fake = FakeCartesia(TtsBackend(), FakeCartesiaOptions(api_key=a.api_key, first_audio_delay_s=a.first_audio_ms / 1000))
    web.run_app(fake.app(), host=a.host, port=a.port, access_log=None)


if __name__ == "__main__":
    main()
