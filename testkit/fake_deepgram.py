"""A local Deepgram live-transcription server (``/v1/listen`` over a
WebSocket) for tests and benchmarks: a real aiohttp server on a real socket
that speaks Deepgram's messages and quirks, with transcripts from the
embedded recogniser (:class:`testkit.stt_backend.SttBackend`; with a JSGF
grammar they are exact).

What it reproduces (shared/reference/speech-providers.md, section 1.1 and
section 4 item 4; Deepgram's docs pages cited there):

- **Upgrade**: ``Authorization: Token <key>`` is checked when ``api_key`` is
  set (a wrong or missing one: HTTP 401 with ``{"err_code":"INVALID_AUTH",
  "err_msg":...}`` and a ``dg-error`` header, as Deepgram refuses it);
  ``encoding`` and ``sample_rate`` are required for raw audio (400 without
  them); the 101 answer carries ``dg-request-id``.
- **Audio**: raw ``linear16`` in binary frames of any size, at the declared
  ``sample_rate`` (resampled to 16 kHz for recognition); every time in its
  messages is seconds of audio received on the connection.
- **Its own VAD** (webrtcvad, :class:`testkit.stt_backend.SpeechDetector`):
  ``SpeechStarted`` ``{"channel":[0,1],"timestamp"}`` when speech begins
  (``vad_events=true``; ``channel`` is a *list*); interim ``Results``
  (``is_final`` false) about every ``interim_every_s`` of audio while
  speech goes on (``interim_results=true``), text from
  :meth:`BackendUtterance.partial`; **endpointing**: after ``endpointing``
  ms of silence following speech, a final (``is_final`` and ``speech_final``
  true) for the audio since the last final; ``UtteranceEnd``
  ``{"channel":[0,1],"last_word_end"}`` once ``utterance_end_ms`` of audio
  passed with no new word (only with ``interim_results``, as Deepgram).
- **Finalize**: a final for the audio since the last final, marked
  ``from_finalize: true``; with no audio since the last final, an empty
  ``from_finalize`` final or nothing (``answer_empty_finalize``: the
  reference does not say which Deepgram does; VERIFY).
- **KeepAlive**: accepted silently. **Idle close**: ``idle_close_s``
  (10 s, as Deepgram) without audio or KeepAlive closes the socket with
  ``1011`` and a reason starting ``NET-0001``.
- **CloseStream**: the last final, then ``Metadata`` (``transaction_key``
  ``"deprecated"``, ``request_id``, ``sha256``, ``created``, ``duration`` =
  audio seconds received, ``channels``), then the close (1000): Metadata
  comes *before* the close.
- Words carry ``word``, ``start``, ``end``, ``confidence`` and
  ``punctuated_word`` (capitalised and with a full stop with
  ``punctuate=true``, as Deepgram's); ``from_finalize`` is only present
  when true (an optional field).

Answers are sent ``latency`` after the audio they are for arrived (interims
and SpeechStarted ``interim_s``, finals ``final_s``), in the order they were
made. Faults (for the first ``faulty_connections`` connections): refuse the
upgrade with a status, drop the TCP connection mid-utterance, send garbage,
send an error message and close, hang (answer nothing, close nothing),
inject any frames. Everything it received and sent is recorded per
connection (:class:`Connection`).

Run it alone: ``python -m testkit.fake_deepgram --port 8098 [--grammar FILE]``
and point ``stt.base_url`` at ``ws://127.0.0.1:8098``.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import hashlib
import json
import logging
import uuid
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

from aiohttp import WSMsgType, web

from media.frames import PcmResampler
from testkit.stt_backend import BackendUtterance, Latency, SpeechDetector, SttBackend
from voice.recognition import STREAM_RATE

log = logging.getLogger(__name__)

#: 20 ms of 16 kHz s16: the unit the fake's VAD and endpointing work in
FRAME_BYTES = STREAM_RATE * 2 // 50
FRAME_S = 0.02
#: Deepgram's idle close (https://developers.deepgram.com/docs/audio-keep-alive)
NET_0001 = "NET-0001: Deepgram did not receive audio data or a text message within the timeout window."
MODEL_UUID = "1ed36bac-f71c-4f3f-a31f-02fd6525c6c5"


@dataclass
class FakeDeepgramOptions:
    """The fake's knobs (tests may change them between connections).

    Attributes:
        api_key: the key ``Authorization: Token`` must carry (None: any, or none).
        latency: answer delays after the audio they are for.
        interim_every_s: audio seconds between interims while speech goes on.
        vad_aggressiveness: webrtcvad's mode (0-3).
        idle_close_s: close (1011 NET-0001) after this long, wall clock,
            with neither audio nor KeepAlive, s.
        answer_empty_finalize: a Finalize with no audio since the last
            final gets an empty ``from_finalize`` final (True) or nothing.
        refuse_status: answer every upgrade with this HTTP status (401,
            403, 503...) instead.
        accept_delay_s: wait this long before answering an upgrade, s.
        faulty_connections: the faults below apply to the first this many
            connections (None: to all).
        drop_after_s: after this many seconds of audio, close the TCP
            connection abruptly (no close frame).
        garbage_after_s: after this many seconds of audio, send a text
            frame that is not JSON.
        error_message: send ``{"type":"Error",...}`` with it, then close
            (1011), after ``error_after_s`` seconds of audio.
        hang_after_s: after this many seconds of audio, answer nothing more
            (no results, no Metadata, no close; KeepAlive or not).
        inject: ``(after_s, frame)``: send ``frame`` (text, or bytes as a
            binary frame) once ``after_s`` seconds of audio arrived (0: at
            once), in order with the answers.
    """

    api_key: str | None = None
    latency: Latency = field(default_factory=Latency)
    interim_every_s: float = 0.5
    vad_aggressiveness: int = 2
    idle_close_s: float = 10.0
    answer_empty_finalize: bool = True
    refuse_status: int | None = None
    accept_delay_s: float = 0.0
    faulty_connections: int | None = 1
    drop_after_s: float | None = None
    garbage_after_s: float | None = None
    error_message: str | None = None
    error_after_s: float = 0.0
    hang_after_s: float | None = None
    inject: list[tuple[float, str | bytes]] = field(default_factory=list)


@dataclass
class Attempt:
    """One upgrade request, accepted or not.

    Attributes:
        path: the request path.
        headers: its headers.
        query: its query, in order, repeated keys included.
        status: 101 (accepted) or the refusal's status.
    """

    path: str
    headers: dict[str, str]
    query: list[tuple[str, str]]
    status: int = 101

    def param(self, name: str) -> str | None:
        """The first value of query parameter ``name`` (None: absent)."""
        return next((v for k, v in self.query if k == name), None)


@dataclass
class Connection:
    """What one accepted connection received and sent.

    Attributes:
        attempt: its upgrade request.
        request_id: the ``dg-request-id`` it was given.
        rate: its declared ``sample_rate``, Hz.
        received: ``(wall monotonic s, kind, what)`` for each frame in order:
            ``("audio", bytes)`` or ``("text", raw text)``.
        sent: each text frame sent (parsed JSON, or the raw text if it is not).
        closed_with: ``(code, reason)`` of the close the server sent,
            ``(0, "aborted")`` for a dropped TCP connection, None: the client closed.
        ended: set when the connection is over.
    """

    attempt: Attempt
    request_id: str
    rate: int
    received: list[tuple[float, str, Any]] = field(default_factory=list)
    sent: list[Any] = field(default_factory=list)
    closed_with: tuple[int, str] | None = None
    ended: asyncio.Event = field(default_factory=asyncio.Event)
    audio_bytes: int = 0

    @property
    def audio_s(self) -> float:
        """Seconds of audio received (at the declared rate)."""
        return self.audio_bytes / (self.rate * 2)

    @property
    def controls(self) -> list[str]:
        """The ``type`` of each text frame received, in order (the raw text if it has none)."""
        out = []
        for _, kind, what in self.received:
            if kind == "text":
                try:
                    out.append(str(json.loads(what)["type"]))
                except (ValueError, KeyError, TypeError):
                    out.append(what)
        return out

    def times(self, control: str) -> list[float]:
        """Wall monotonic seconds at which each ``control`` message arrived."""
        return [t for t, kind, what in self.received if kind == "text" and control in what]

    def sent_of(self, kind: str) -> list[dict[str, Any]]:
        """The JSON messages sent of ``type`` ``kind``."""
        return [m for m in self.sent if isinstance(m, dict) and m.get("type") == kind]


class _Close:
    """A close frame queued behind the answers."""

    def __init__(self, code: int, reason: str) -> None:
        self.code = code
        self.reason = reason


@dataclass
class _Span:
    """The audio since the last final: one backend utterance."""

    start_s: float
    utt: BackendUtterance
    next_interim_s: float = 0.0


class FakeDeepgram:
    """The server (see the module doc); :meth:`app` is its aiohttp app.

    Args:
        backend: the embedded recogniser behind the transcripts (started by the caller).
        options: knobs (:class:`FakeDeepgramOptions`).
    """

    def __init__(self, backend: SttBackend, options: FakeDeepgramOptions | None = None) -> None:
        self.backend = backend
        self.options = options or FakeDeepgramOptions()
        self.attempts: list[Attempt] = []
        self.connections: list[Connection] = []

    def app(self) -> web.Application:
        """The aiohttp application (``GET /v1/listen``)."""
        app = web.Application()
        app.router.add_get("/v1/listen", self.listen)
        return app

    async def listen(self, request: web.Request) -> web.StreamResponse:
        """One ``/v1/listen`` upgrade: checked, then served until it closes."""
        o = self.options
        attempt = Attempt(request.path, dict(request.headers), list(request.query.items()))
        self.attempts.append(attempt)
        request_id = str(uuid.uuid4())
        if o.accept_delay_s:
            await asyncio.sleep(o.accept_delay_s)
        if o.refuse_status is not None:
            return _refuse(attempt, o.refuse_status, "REFUSED", "The fake was told to refuse this connection.", request_id)
        if o.api_key is not None and request.headers.get("Authorization") != f"Token {o.api_key}":
            return _refuse(attempt, 401, "INVALID_AUTH", "Invalid credentials.", request_id)
        q = request.query
        if "encoding" not in q or "sample_rate" not in q:
            return _refuse(attempt, 400, "Bad Request", "Raw audio needs encoding and sample_rate.", request_id)
        try:
            rate = int(q["sample_rate"])
            settings = _Settings.parse(q)
        except ValueError as exc:
            return _refuse(attempt, 400, "Bad Request", str(exc), request_id)
        if q["encoding"] != "linear16" or not 8000 <= rate <= 48000 or q.get("channels", "1") != "1":
            return _refuse(attempt, 400, "Bad Request", "This fake decodes mono linear16 at 8-48 kHz only.", request_id)
        ws = web.WebSocketResponse(autoping=True, timeout=2.0, max_msg_size=16 * 1024 * 1024)
        ws.headers["dg-request-id"] = request_id
        await ws.prepare(request)
        conn = Connection(attempt, request_id, rate)
        index = len(self.connections)
        self.connections.append(conn)
        faulty = o.faulty_connections is None or index < o.faulty_connections
        session = _Session(self, request, ws, conn, settings, faulty)
        try:
            await session.serve()
        finally:
            conn.ended.set()
        return ws


def _refuse(attempt: Attempt, status: int, code: str, message: str, request_id: str) -> web.Response:
    attempt.status = status
    return web.json_response(
        {"err_code": code, "err_msg": message, "request_id": request_id},
        status=status, headers={"dg-error": message, "dg-request-id": request_id},
    )


@dataclass
class _Settings:
    """The query's features."""

    interim_results: bool
    endpointing_s: float | None
    utterance_end_s: float | None
    vad_events: bool
    punctuate: bool

    @classmethod
    def parse(cls, q: Any) -> _Settings:
        """Raises ValueError on a value Deepgram would refuse."""

        def flag(name: str, default: bool) -> bool:
            value = q.get(name)
            if value is None:
                return default
            if value not in ("true", "false"):
                raise ValueError(f"{name} must be true or false")
            return bool(value == "true")

        interim = flag("interim_results", False)
        endpointing = q.get("endpointing", "10")  # Deepgram's default is 10 ms
        endpointing_s = None if endpointing == "false" else int(endpointing) / 1000
        ue = q.get("utterance_end_ms")
        return cls(
            interim_results=interim,
            endpointing_s=endpointing_s,
            utterance_end_s=int(ue) / 1000 if ue is not None and interim else None,
            vad_events=flag("vad_events", False),
            punctuate=flag("punctuate", False),
        )


class _Session:
    """One connection's life: receive, recognise, answer in order."""

    def __init__(self, server: FakeDeepgram, request: web.Request, ws: web.WebSocketResponse,
                 conn: Connection, settings: _Settings, faulty: bool) -> None:
        self.server = server
        self.o = server.options
        self.request = request
        self.ws = ws
        self.conn = conn
        self.settings = settings
        self.faulty = faulty
        self.loop = asyncio.get_running_loop()
        self.work: asyncio.Queue[tuple[str, bytes, float]] = asyncio.Queue()
        self.outbox: asyncio.Queue[tuple[float, str | bytes | _Close]] = asyncio.Queue()
        self.vad = SpeechDetector(self.o.vad_aggressiveness)
        self.resampler = PcmResampler(STREAM_RATE) if conn.rate != STREAM_RATE else None
        self.sha = hashlib.sha256()
        self.pending = bytearray()  # 16 kHz audio short of a whole frame
        self.done_bytes = 0  # 16 kHz bytes recognised
        self.span: _Span | None = None
        self.in_speech = False
        self.silence_s = 0.0
        self.word_heard = False
        self.last_word_end = 0.0
        self.last_alive = self.loop.time()
        self.hung = False
        self.fired: set[str] = set()

    @property
    def pos_s(self) -> float:
        return self.done_bytes / (STREAM_RATE * 2)

    async def serve(self) -> None:
        sender = self.loop.create_task(self.send_loop())
        idle = self.loop.create_task(self.watch_idle())
        tasks = [self.loop.create_task(self.process()), sender, idle]
        try:
            self.check_faults()
            await self.receive()
            if self.conn.closed_with is not None and self.conn.closed_with[0]:
                # the server is closing: let the close handshake finish
                await asyncio.wait([sender, idle], timeout=2.5, return_when=asyncio.FIRST_COMPLETED)
        finally:
            for t in tasks:
                t.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)
            if self.span is not None:
                await self.span.utt.aclose()

    # -- receiving ----------------------------------------------------------------

    async def receive(self) -> None:
        async for msg in self.ws:
            now = self.loop.time()
            if msg.type is WSMsgType.BINARY:
                data: bytes = msg.data
                self.conn.received.append((now, "audio", data))
                self.conn.audio_bytes += len(data)
                self.sha.update(data)
                self.last_alive = now
                if self.check_faults():
                    return
                if not self.hung:
                    self.work.put_nowait(("audio", data, now))
            elif msg.type is WSMsgType.TEXT:
                self.conn.received.append((now, "text", msg.data))
                try:
                    kind = json.loads(msg.data).get("type")
                except (ValueError, AttributeError):
                    kind = None
                if kind == "KeepAlive":
                    self.last_alive = now
                elif kind == "Finalize" and not self.hung:
                    self.work.put_nowait(("finalize", b"", now))
                elif kind == "CloseStream" and not self.hung:
                    self.work.put_nowait(("close", b"", now))
            else:
                break

    def check_faults(self) -> bool:
        """Fire the faults due at the audio received so far; True: the connection was dropped."""
        if not self.faulty:
            return False
        o, got = self.o, self.conn.audio_s
        now = self.loop.time()
        for i, (after_s, frame) in enumerate(o.inject):
            if got >= after_s and f"inject{i}" not in self.fired:
                self.fired.add(f"inject{i}")
                self.outbox.put_nowait((now, frame))
        if o.garbage_after_s is not None and got >= o.garbage_after_s and "garbage" not in self.fired:
            self.fired.add("garbage")
            self.outbox.put_nowait((now, "<html><body>502 Bad Gateway</body></html>"))
        if o.error_message is not None and got > 0 and got >= o.error_after_s and "error" not in self.fired:
            self.fired.add("error")
            err = {"type": "Error", "variant": "fake", "description": o.error_message, "message": o.error_message}
            self.outbox.put_nowait((now, json.dumps(err)))
            self.outbox.put_nowait((now, _Close(1011, o.error_message[:100])))
        if o.hang_after_s is not None and got >= o.hang_after_s:
            self.hung = True
        if o.drop_after_s is not None and got >= o.drop_after_s:
            self.conn.closed_with = (0, "aborted")
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            return True
        return False

    # -- recognising ----------------------------------------------------------------

    async def process(self) -> None:
        try:
            while True:
                kind, data, arrived = await self.work.get()
                if self.hung:
                    continue
                if kind == "audio":
                    await self.audio(data, arrived)
                elif kind == "finalize":
                    await self.flush()
                    await self.final(arrived, from_finalize=True)
                    self.in_speech, self.silence_s = False, 0.0
                else:  # CloseStream: the last final, Metadata, then the close
                    await self.flush()
                    if self.span is not None:
                        await self.final(arrived)
                    self.emit(arrived + self.o.latency.final_s, self.metadata())
                    self.outbox.put_nowait((arrived, _Close(1000, "")))
                    return
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("fake Deepgram failed recognising; closing the connection")
            self.outbox.put_nowait((self.loop.time(), _Close(1011, "fake internal error")))

    async def audio(self, data: bytes, arrived: float) -> None:
        if self.resampler is not None:
            data = self.resampler.pcm(data, self.conn.rate)
        self.pending += data
        while len(self.pending) >= FRAME_BYTES:
            frame = bytes(self.pending[:FRAME_BYTES])
            del self.pending[:FRAME_BYTES]
            await self.frame(frame, arrived)

    async def flush(self) -> None:
        """Audio short of a whole frame goes into the span (before a final)."""
        if self.pending:
            self.feed(bytes(self.pending))
            self.pending.clear()

    def feed(self, pcm: bytes) -> _Span:
        if self.span is None:
            self.span = _Span(self.pos_s, self.server.backend.utterance())
        self.span.utt.feed(pcm)
        self.done_bytes += len(pcm)
        return self.span

    async def frame(self, frame: bytes, arrived: float) -> None:
        span = self.feed(frame)
        ((voiced, _),) = self.vad.feed(frame)
        s, lat = self.settings, self.o.latency
        if voiced:
            self.silence_s = 0.0
            if not self.in_speech:
                self.in_speech = True
                span.next_interim_s = self.pos_s + self.o.interim_every_s
                if s.vad_events:
                    self.emit(arrived + lat.interim_s, {"type": "SpeechStarted", "channel": [0, 1], "timestamp": _r(self.pos_s - FRAME_S)})
        elif self.in_speech:
            self.silence_s += FRAME_S
            if s.endpointing_s is not None and self.silence_s >= s.endpointing_s - 1e-6:
                self.in_speech = False
                await self.final(arrived, speech_final=True)
                return
        if self.in_speech and s.interim_results and self.pos_s >= span.next_interim_s - 1e-6:
            span.next_interim_s = self.pos_s + self.o.interim_every_s
            text = await span.utt.partial()
            if text:
                self.word_heard, self.last_word_end = True, self.pos_s
            self.emit(arrived + lat.interim_s, self.results(span.start_s, text, [], is_final=False))
        if (s.utterance_end_s is not None and self.word_heard and not self.in_speech
                and self.pos_s - self.last_word_end >= s.utterance_end_s - 1e-6):
            self.word_heard = False
            self.emit(arrived + lat.interim_s, {"type": "UtteranceEnd", "channel": [0, 1], "last_word_end": _r(self.last_word_end)})

    async def final(self, arrived: float, *, speech_final: bool = False, from_finalize: bool = False) -> None:
        span, self.span = self.span, None
        due = arrived + self.o.latency.final_s
        if span is None:
            if from_finalize and self.o.answer_empty_finalize:
                self.emit(due, self.results(self.pos_s, "", [], is_final=True, from_finalize=True))
            return
        try:
            text, words = await span.utt.finish()
        finally:
            await span.utt.aclose()
        wire_words = [
            {"word": w.text, "start": _r(span.start_s + w.start_s), "end": _r(span.start_s + w.end_s),
             "confidence": _conf(w.confidence), "punctuated_word": w.text}
            for w in words
        ]
        if wire_words:
            self.word_heard, self.last_word_end = True, span.start_s + words[-1].end_s
        self.emit(due, self.results(span.start_s, text, wire_words, is_final=True, speech_final=speech_final, from_finalize=from_finalize))

    def results(self, start_s: float, text: str, words: list[dict[str, Any]], *, is_final: bool,
                speech_final: bool = False, from_finalize: bool = False) -> dict[str, Any]:
        """A ``Results`` message for the audio from ``start_s`` to now."""
        if self.settings.punctuate and text:
            text = text[0].upper() + text[1:] + ("." if is_final else "")
            if words:
                words[0]["punctuated_word"] = words[0]["word"].capitalize()
                words[-1]["punctuated_word"] = words[-1]["punctuated_word"] + "."
        confidence = round(sum(w["confidence"] for w in words) / len(words), 4) if words else (0.0 if not text else 0.9)
        msg: dict[str, Any] = {
            "type": "Results",
            "channel_index": [0, 1],
            "duration": _r(self.pos_s - start_s),
            "start": _r(start_s),
            "is_final": is_final,
            "speech_final": speech_final,
            "channel": {"alternatives": [{"transcript": text, "confidence": confidence, "words": words}]},
            "metadata": {
                "request_id": self.conn.request_id,
                "model_info": {"name": "general-nova-3", "version": "2025-01-01.0", "arch": "nova-3"},
                "model_uuid": MODEL_UUID,
            },
        }
        if from_finalize:  # an optional field: present when true
            msg["from_finalize"] = True
        return msg

    def metadata(self) -> dict[str, Any]:
        """The closing summary (https://developers.deepgram.com/docs/close-stream)."""
        return {
            "type": "Metadata",
            "transaction_key": "deprecated",
            "request_id": self.conn.request_id,
            "sha256": self.sha.hexdigest(),
            "created": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "duration": _r(self.conn.audio_s),
            "channels": 1,
            "models": [MODEL_UUID],
            "model_info": {MODEL_UUID: {"name": "general-nova-3", "version": "2025-01-01.0", "arch": "nova-3"}},
        }

    # -- answering ------------------------------------------------------------------

    def emit(self, due: float, message: dict[str, Any]) -> None:
        self.outbox.put_nowait((due, json.dumps(message)))

    async def send_loop(self) -> None:
        while True:
            due, frame = await self.outbox.get()
            wait = due - self.loop.time()
            if wait > 0:
                await asyncio.sleep(wait)
            if self.hung:
                continue
            try:
                if isinstance(frame, _Close):
                    await self.close(frame.code, frame.reason)
                    return
                if isinstance(frame, bytes):
                    await self.ws.send_bytes(frame)
                    self.conn.sent.append(frame)
                    continue
                await self.ws.send_str(frame)
            except (ConnectionError, RuntimeError):
                return
            try:
                self.conn.sent.append(json.loads(frame))
            except ValueError:
                self.conn.sent.append(frame)

    async def close(self, code: int, reason: str) -> None:
        if self.conn.closed_with is None and not self.ws.closed:
            self.conn.closed_with = (code, reason)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.close(code=code, message=reason.encode())

    async def watch_idle(self) -> None:
        while True:
            left = self.last_alive + self.o.idle_close_s - self.loop.time()
            if left <= 0 and not self.hung:
                await self.close(1011, NET_0001)
                return
            await asyncio.sleep(max(left, 0.05))


def _r(seconds: float) -> float:
    return round(max(0.0, seconds), 3)


def _conf(posterior: float | None) -> float:
    """A 0..1 confidence from pocketsphinx's posterior (0.9 where it gives none usable)."""
    if posterior is None or not 0.0 < posterior <= 1.0:
        return 0.9
    return round(posterior, 4)


def main() -> None:
    """``python -m testkit.fake_deepgram [--host H] [--port P] [--grammar FILE] [--api-key K] ...``"""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8098)
    parser.add_argument("--grammar", default=None, help="JSGF grammar for the embedded recogniser")
    parser.add_argument("--api-key", default=None, help="require Authorization: Token KEY")
    parser.add_argument("--interim-ms", type=float, default=150.0)
    parser.add_argument("--final-ms", type=float, default=300.0)
    parser.add_argument("--idle-close-s", type=float, default=10.0)
    parser.add_argument("--max-decoders", type=int, default=2)
    a = parser.parse_args()
    backend = SttBackend(a.grammar, max_decoders=a.max_decoders)
    fake = FakeDeepgram(backend, FakeDeepgramOptions(
        api_key=a.api_key, latency=Latency(a.interim_ms / 1000, a.final_ms / 1000), idle_close_s=a.idle_close_s,
    ))
    app = fake.app()

    async def started(_app: web.Application) -> None:
        await backend.start()

    async def stopped(_app: web.Application) -> None:
        await backend.aclose()

    app.on_startup.append(started)
    app.on_cleanup.append(stopped)
    logging.basicConfig(level=logging.INFO)
    web.run_app(app, host=a.host, port=a.port)


if __name__ == "__main__":
    main()
