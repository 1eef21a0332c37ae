"""A local OpenAI Realtime transcription server (``/v1/realtime?intent=transcription``)
for tests and benchmarks of :mod:`voice.openai_realtime_stt`: a real aiohttp
WebSocket server on loopback that speaks the protocol in three dialects and
transcribes the audio it gets with the embedded recogniser
(:class:`testkit.stt_backend.SttBackend`), so its transcripts are real.

Dialects (``mode``), from shared/reference/speech-providers.md sections 1.2
and 1.4, openai-python ``types/realtime`` and ``types/beta/realtime``, and
speaches-ai/speaches @870e1e1 ``src/speaches/realtime/*``:

- ``"ga"``: OpenAI's GA transcription session. ``Authorization: Bearer``
  (401 on the upgrade otherwise). ``session.created`` (``type:
  transcription``, the default ``server_vad`` on), ``session.update`` with
  ``session.type = "transcription"`` and ``audio.input`` answered by
  ``session.updated``; ``audio.input.format`` must be 24 kHz ``audio/pcm``.
  ``transcription_session.update`` (or any unknown event) is an ``error``
  (``invalid_value``, param ``type``). Deltas word by word, then
  ``completed`` with token usage.
- ``"beta"``: the legacy beta transcription session: ``transcription_session.created``,
  ``transcription_session.update`` answered by ``transcription_session.updated``;
  ``session.update`` is an ``error`` (``unknown_event``). Records the
  ``OpenAI-Beta`` header but does not require it.
- ``"speaches"``: speaches' ``/v1/realtime``. The key (when set) in
  ``Authorization: Bearer``, ``X-API-Key`` or ``?api_key=``; the ``model``
  query parameter is required: both refused with 403, as speaches closes
  the socket before accepting it (``verify_websocket_api_key``; FastAPI's
  missing-parameter check). ``session.created`` with the flat beta
  conversation session (``input_audio_transcription``, ``turn_detection``
  ``server_vad`` even for ``intent=transcription``); only ``session.update``
  with those flat fields is understood: unknown keys (the GA ``type`` and
  ``audio``) are silently dropped, ``input_audio_format`` gets an error
  ("not supported") but the rest is applied, and any other event type
  (``transcription_session.update``) is "Invalid client event" (no code).
  No deltas, only ``completed``, with ``{"type": "duration"}`` usage
  (``input_audio_buffer.py``; the reference's "no usage" is its SSE
  transcriptions, see ``usage``). A commit of under 100 ms is an error
  without a code ("buffer too small"); its speech events' ``audio_*_ms``
  count from the start of the current buffer, not the session.

In every dialect: audio arrives as base64 PCM16 24 kHz in
``input_audio_buffer.append`` and is resampled to 16 kHz for the
recogniser; ``input_audio_buffer.commit`` answers
``input_audio_buffer.committed {item_id, previous_item_id}`` (then
``conversation.item.added``/``created``), then after ``latency.interim_s``
the deltas, after ``latency.final_s`` the ``completed``; a commit of under
100 ms is an ``error`` (OpenAI: ``input_audio_buffer_commit_empty``, echoing
the commit's ``event_id``) and the audio stays in the buffer;
``input_audio_buffer.clear`` answers ``input_audio_buffer.cleared``. With
``turn_detection`` ``server_vad`` (the default until a client turns it off)
it runs its own detector (webrtcvad): ``speech_started``, ``speech_stopped``
after ``silence_duration_ms`` of silence, and commits on its own.

Faults (knobs, changeable between connections): ``refuse_status`` (refuse the
upgrade), ``auth_error_event`` (accept, send an ``invalid_api_key`` error,
close 1008), ``drop_after_s`` (abort the TCP connection once that much audio
came, on the first ``drop_connections`` connections), ``garbage`` (send
garbage instead of the next ``completed``, on the first
``garbage_connections`` connections), ``hang`` (take everything, answer
nothing after the session update), ``fail_item`` (the next item gets
``...transcription.failed``), ``out_of_order`` (of two pending items the later
completes first), ``max_session_s`` (the session's maximum duration: OpenAI
sends ``error`` ``session_expired`` and closes 1001; speaches closes 1011),
``send_created`` (off: no first event), ``late_committed`` (an item's
deltas and ``completed`` come before its ``committed``: completion is
asynchronous, the reference says not to assume an order), ``min_commit_s``
(a stricter server: commits of less audio are refused as empty).
``garbage = "stray_error"`` sends a recoverable ``error`` event
(``rate_limit_exceeded``) before the ``completed``, which still comes.

It records each connection (:class:`ConnectionRecord`): headers, query,
every client event but the appends, the audio received and every event it
sent, so tests assert on the wire.

Run it alone: ``python -m testkit.fake_openai_realtime --port 8098 [--grammar FILE] [--mode ga]``.
"""

from __future__ import annotations

import argparse
import asyncio
import base64
import binascii
import contextlib
import json
import math
import secrets
import time
from dataclasses import dataclass, field
from typing import Any, Literal

from aiohttp import web

from media.frames import PcmResampler
from testkit.stt_backend import BackendUtterance, Latency, SpeechDetector, SttBackend

Mode = Literal["ga", "beta", "speaches"]
Usage = Literal["tokens", "duration", "none"]
Garbage = Literal[
    "text", "binary", "array", "no_type", "bad_delta", "bad_completed", "bad_usage", "huge", "unknown_item",
    "bad_committed", "bad_speech", "stray_error",
]

#: the input rate of the protocol's PCM, Hz
INPUT_RATE = 24_000
#: a commit of less than this much audio is refused, s (both servers)
MIN_COMMIT_S = 0.1
#: speaches' client event types (``types/realtime.py`` CLIENT_EVENT_TYPES)
SPEACHES_CLIENT_EVENTS = frozenset({
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "conversation.item.create", "conversation.item.truncate", "conversation.item.delete", "response.create",
    "response.cancel",
})
GA_CLIENT_EVENTS = frozenset({
    "session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
    "conversation.item.create", "conversation.item.retrieve", "conversation.item.truncate", "conversation.item.delete",
    "response.create", "response.cancel", "output_audio_buffer.clear",
})
BETA_CLIENT_EVENTS = frozenset({
    "transcription_session.update", "input_audio_buffer.append", "input_audio_buffer.commit", "input_audio_buffer.clear",
})
_TRANSCRIPTION = "conversation.item.input_audio_transcription"


@dataclass
class ConnectionRecord:
    """What one connection brought and what the server sent on it.

    Attributes:
        headers: the upgrade request's headers.
        query: its query parameters.
        accepted: the upgrade was accepted (False: refused with ``status``).
        status: the HTTP status of a refused upgrade.
        control: every client event but ``input_audio_buffer.append``, parsed, in order.
        appends: ``input_audio_buffer.append`` events received.
        append_bytes: the size of each append's audio, bytes (24 kHz s16).
        audio_bytes: 24 kHz audio received, bytes.
        sent: every event the server sent, in order.
        items: item id -> the transcript it was given.
        session: the session configuration now (the dialect's shape).
        closed: how it ended: ``"client"``, ``"dropped"`` (the fault),
            ``"expired"`` (``max_session_s``), ``"auth"``.
    """

    headers: dict[str, str]
    query: dict[str, str]
    accepted: bool = False
    status: int = 101
    control: list[dict[str, Any]] = field(default_factory=list)
    appends: int = 0
    append_bytes: list[int] = field(default_factory=list)
    audio_bytes: int = 0
    sent: list[dict[str, Any]] = field(default_factory=list)
    items: dict[str, str] = field(default_factory=dict)
    session: dict[str, Any] = field(default_factory=dict)
    closed: str | None = None

    @property
    def audio_s(self) -> float:
        """Seconds of audio received (24 kHz)."""
        return self.audio_bytes / (INPUT_RATE * 2)

    def control_types(self) -> list[str]:
        """The types of the client's control events, in order."""
        return [str(e.get("type")) for e in self.control]

    def sent_types(self) -> list[str]:
        """The types of the events the server sent, in order."""
        return [str(e.get("type")) for e in self.sent]


@dataclass(eq=False)
class _Item:
    item_id: str
    utterance: BackendUtterance
    committed_at: float
    seq: int
    done: asyncio.Event = field(default_factory=asyncio.Event)


class FakeOpenAiRealtime:
    """The fake server (see the module doc); :meth:`app` is its aiohttp app,
    routed at ``/v1/realtime``.

    Args:
        backend: the recogniser behind it (started by the caller; shared).
        mode: ``"ga"``, ``"beta"`` or ``"speaches"``.
        api_key: the key it requires (None: none).
        latency: interim and final delays after a commit (default 150 / 300 ms).
        usage: what ``completed`` carries: ``"tokens"`` (input = audio
            tenths of a second, output = words), ``"duration"`` (the item's
            audio, s) or ``"none"``; default tokens, duration for speaches.
        The fault knobs are attributes of the same names (module doc).
    """

    def __init__(
        self,
        backend: SttBackend,
        *,
        mode: Mode = "ga",
        api_key: str | None = None,
        latency: Latency | None = None,
        usage: Usage | None = None,
        refuse_status: int | None = None,
        auth_error_event: bool = False,
        drop_after_s: float | None = None,
        drop_connections: int = 1,
        garbage: Garbage | None = None,
        garbage_connections: int = 1,
        hang: bool = False,
        fail_item: bool = False,
        out_of_order: bool = False,
        max_session_s: float | None = None,
        send_created: bool = True,
        late_committed: bool = False,
        min_commit_s: float = MIN_COMMIT_S,
        delta_gap_s: float = 0.01,
    ) -> None:
        self.backend = backend
        self.mode: Mode = mode
        self.api_key = api_key
        self.latency = latency or Latency()
        self.usage: Usage = usage or ("duration" if mode == "speaches" else "tokens")
        self.refuse_status = refuse_status
        self.auth_error_event = auth_error_event
        self.drop_after_s = drop_after_s
        self.drop_connections = drop_connections
        self.garbage = garbage
        self.garbage_connections = garbage_connections
        self.hang = hang
        self.fail_item = fail_item
        self.out_of_order = out_of_order
        self.max_session_s = max_session_s
        self.send_created = send_created
        self.late_committed = late_committed
        self.min_commit_s = min_commit_s
        self.delta_gap_s = delta_gap_s
        self.connections: list[ConnectionRecord] = []
        self._sockets: set[web.WebSocketResponse] = set()

    def app(self) -> web.Application:
        """The aiohttp application (``GET /v1/realtime``)."""
        app = web.Application()
        app.router.add_get("/v1/realtime", self.realtime)
        app.on_shutdown.append(self._shutdown)
        return app

    @property
    def accepted(self) -> list[ConnectionRecord]:
        """The connections whose upgrade was accepted."""
        return [c for c in self.connections if c.accepted]

    async def _shutdown(self, _app: web.Application) -> None:
        for ws in list(self._sockets):
            await ws.close(code=1001, message=b"server shutdown")

    async def realtime(self, request: web.Request) -> web.StreamResponse:
        """``GET /v1/realtime``: check the key (and speaches' ``model``), then
        run one transcription session."""
        record = ConnectionRecord(headers=dict(request.headers), query=dict(request.query))
        self.connections.append(record)
        index = len(self.connections) - 1
        refusal = self._refusal(request)
        if refusal is not None:
            record.status = refusal.status
            return refusal
        ws = web.WebSocketResponse(max_msg_size=16 * 1024 * 1024)
        await ws.prepare(request)
        record.accepted = True
        self._sockets.add(ws)
        try:
            session = _Session(self, record, ws, request, index)
            await session.run()
        finally:
            self._sockets.discard(ws)
        return ws

    def _refusal(self, request: web.Request) -> web.Response | None:
        if self.refuse_status is not None:
            return _http_error(self.refuse_status, "server_error" if self.refuse_status >= 500 else "invalid_request_error",
                               f"refused with {self.refuse_status} (fault)")
        if self.mode == "speaches":
            key_ok = self.api_key is None or self.api_key in (
                request.query.get("api_key"), _bearer(request.headers.get("Authorization")), request.headers.get("X-API-Key"),
            )
            if not key_ok or "model" not in request.query:
                # speaches closes the socket before accepting it: the upgrade gets 403
                return web.Response(status=403)
            return None
        if self.api_key is not None and _bearer(request.headers.get("Authorization")) != self.api_key:
            return _http_error(401, "invalid_request_error", "Incorrect API key provided.", code="invalid_api_key")
        return None


class _Session:
    """One connection's transcription session."""

    def __init__(self, server: FakeOpenAiRealtime, record: ConnectionRecord, ws: web.WebSocketResponse,
                 request: web.Request, index: int) -> None:
        self.server = server
        self.mode = server.mode
        self.record = record
        self.ws = ws
        self.request = request
        self.index = index
        self.session_id = "sess_" + secrets.token_hex(10)
        self.transcription: dict[str, Any] = {"model": request.query.get("model", "gpt-4o-transcribe"),
                                              "language": request.query.get("language"), "prompt": ""}
        if self.mode == "speaches":
            self.turn_detection: dict[str, Any] | None = {
                "type": "server_vad", "threshold": 0.9, "prefix_padding_ms": 0, "silence_duration_ms": 550,
                "create_response": False,
            }
        else:
            self.turn_detection = {"type": "server_vad", "threshold": 0.5, "prefix_padding_ms": 300, "silence_duration_ms": 500}
        self.resampler = PcmResampler(16_000)
        self.buffer: BackendUtterance | None = None
        self.buffer_start_s = 0.0  # session audio s where the buffer begins
        self.session_audio_s = 0.0  # 16 kHz audio received, s
        self.items: list[_Item] = []
        self.last_item_id: str | None = None
        self.seq = 0
        self.configured = False
        self.next_item_id = self._new_item_id()
        self.vad: SpeechDetector | None = None
        self.vad_origin = 0.0
        self.speech_from: float | None = None
        self.silence_s = 0.0
        self._lock = asyncio.Lock()
        self._tasks: set[asyncio.Task[None]] = set()

    def _new_item_id(self) -> str:
        return "item_" + secrets.token_hex(10)

    # -- the connection ------------------------------------------------------

    async def run(self) -> None:
        server = self.server
        timer = None
        try:
            if server.auth_error_event:
                await self.send({"type": "error", "error": {
                    "type": "invalid_request_error", "code": "invalid_api_key",
                    "message": "Incorrect API key provided.", "param": None, "event_id": None}})
                self.record.closed = "auth"
                await self.ws.close(code=1008, message=b"invalid_api_key")
                return
            if server.send_created:
                await self.send(self.created_event())
            if server.max_session_s is not None:
                timer = asyncio.get_running_loop().create_task(self.expire(server.max_session_s))
            async for msg in self.ws:
                if msg.type != web.WSMsgType.TEXT:
                    await self.error("invalid_request_error", "invalid_json", "Expected a text frame with a JSON event.")
                    continue
                await self.on_message(msg.data)
                if self.ws.closed:
                    break
            if self.record.closed is None:
                self.record.closed = "client"
        finally:
            if timer is not None:
                timer.cancel()
            for task in list(self._tasks):
                task.cancel()
            if self._tasks:
                await asyncio.wait(set(self._tasks))
            if self.buffer is not None:
                await self.buffer.aclose()
            for item in self.items:
                await item.utterance.aclose()

    def spawn(self, coro: Any) -> None:
        task = asyncio.get_running_loop().create_task(coro)
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def send(self, event: dict[str, Any]) -> None:
        event.setdefault("event_id", "event_" + secrets.token_hex(10))
        event = {"type": event.pop("type"), **event}
        async with self._lock:
            if self.ws.closed:
                return
            self.record.sent.append(event)
            with contextlib.suppress(ConnectionError, RuntimeError):
                await self.ws.send_str(json.dumps(event))

    async def send_raw(self, data: str | bytes) -> None:
        async with self._lock:
            if self.ws.closed:
                return
            with contextlib.suppress(ConnectionError, RuntimeError):
                if isinstance(data, bytes):
                    await self.ws.send_bytes(data)
                else:
                    await self.ws.send_str(data)

    async def error(self, etype: str, code: str | None, message: str, *, param: str | None = None,
                    event_id: str | None = None) -> None:
        if self.mode == "speaches":
            code, event_id = None, None  # speaches sets no codes and echoes no event ids
        await self.send({"type": "error", "error": {"type": etype, "code": code, "message": message, "param": param,
                                                    "event_id": event_id}})

    async def expire(self, after_s: float) -> None:
        await asyncio.sleep(after_s)
        self.record.closed = "expired"
        if self.mode == "speaches":
            await self.ws.close(code=1011, message=b"")
            return
        minutes = max(1, round(after_s / 60))
        message = f"Your session hit the maximum duration of {minutes} minutes."
        await self.error("invalid_request_error", "session_expired", message)
        await self.ws.close(code=1001, message=message.encode())

    # -- client events ---------------------------------------------------------

    async def on_message(self, data: str) -> None:
        try:
            event = json.loads(data)
        except ValueError:
            await self.error("invalid_request_error", "invalid_json", "The event is not valid JSON.")
            return
        if not isinstance(event, dict):
            await self.error("invalid_request_error", "invalid_json", "The event is not a JSON object.")
            return
        kind = event.get("type")
        eid = event.get("event_id") if isinstance(event.get("event_id"), str) else None
        if kind != "input_audio_buffer.append":
            self.record.control.append(event)
        known = {"ga": GA_CLIENT_EVENTS, "beta": BETA_CLIENT_EVENTS, "speaches": SPEACHES_CLIENT_EVENTS}[self.mode]
        if kind not in known:
            if self.mode == "speaches":
                await self.error("invalid_request_error", None, "Invalid client event: 1 validation error(s)")
            elif self.mode == "beta":
                await self.error("invalid_request_error", "unknown_event", f"Unknown event type: {kind!r}.",
                                 param="type", event_id=eid)
            else:
                await self.error("invalid_request_error", "invalid_value",
                                 f"Invalid value: {kind!r}. Supported values are: {', '.join(sorted(known))}.",
                                 param="type", event_id=eid)
            return
        if kind == "session.update" or kind == "transcription_session.update":
            await self.on_update(event, eid)
        elif kind == "input_audio_buffer.append":
            await self.on_append(event, eid)
        elif kind == "input_audio_buffer.commit":
            await self.commit(eid)
        elif kind == "input_audio_buffer.clear":
            await self.clear()
        else:
            await self.error("invalid_request_error", "unsupported", f"{kind} is not supported by this fake.", event_id=eid)

    async def on_update(self, event: dict[str, Any], eid: str | None) -> None:
        session = event.get("session")
        if not isinstance(session, dict):
            await self.error("invalid_request_error", "invalid_value", "session must be an object.", param="session", event_id=eid)
            return
        if self.mode == "ga":
            if session.get("type") != "transcription":
                await self.error("invalid_request_error", "invalid_value",
                                 "session.type must be 'transcription' in a transcription session.",
                                 param="session.type", event_id=eid)
                return
            audio_in = ((session.get("audio") or {}).get("input") or {}) if isinstance(session.get("audio"), dict) else {}
            fmt = audio_in.get("format")
            if fmt is not None and fmt != {"type": "audio/pcm", "rate": INPUT_RATE}:
                await self.error("invalid_request_error", "invalid_value", "Only 24 kHz audio/pcm is supported.",
                                 param="session.audio.input.format", event_id=eid)
                return
            if isinstance(audio_in.get("transcription"), dict):
                self.transcription.update(audio_in["transcription"])
            if "turn_detection" in audio_in:
                self.turn_detection = audio_in["turn_detection"]
            self.configured = True
            await self.send({"type": "session.updated", "session": self.session_object()})
            return
        if self.mode == "beta":
            if session.get("input_audio_format", "pcm16") not in ("pcm16", "g711_ulaw", "g711_alaw"):
                await self.error("invalid_request_error", "invalid_value", "Unsupported input_audio_format.",
                                 param="session.input_audio_format", event_id=eid)
                return
        elif "input_audio_format" in session:  # speaches reports it and applies the rest
            await self.error("invalid_request_error", None, "Specifying `session.input_audio_format` is not supported. "
                             "The server either does not support this field or it is not configurable.")
        if isinstance(session.get("input_audio_transcription"), dict):
            self.transcription.update(session["input_audio_transcription"])
        if "turn_detection" in session:
            self.turn_detection = session["turn_detection"]
        self.configured = True
        kind = "transcription_session.updated" if self.mode == "beta" else "session.updated"
        await self.send({"type": kind, "session": self.session_object()})

    async def on_append(self, event: dict[str, Any], eid: str | None) -> None:
        audio = event.get("audio")
        try:
            pcm = base64.b64decode(audio, validate=True) if isinstance(audio, str) else None
        except (binascii.Error, ValueError):
            pcm = None
        if pcm is None or len(pcm) % 2:
            await self.error("invalid_request_error", "invalid_value", "audio must be base64 PCM16.", param="audio", event_id=eid)
            return
        rec = self.record
        rec.appends += 1
        rec.append_bytes.append(len(pcm))
        rec.audio_bytes += len(pcm)
        pcm16 = self.resampler.pcm(pcm, INPUT_RATE)
        if self.buffer is None:
            self.buffer = self.server.backend.utterance()
            self.buffer_start_s = self.session_audio_s
        self.buffer.feed(pcm16)
        self.session_audio_s += len(pcm16) / 32_000
        server = self.server
        if server.drop_after_s is not None and self.index < server.drop_connections and rec.audio_s >= server.drop_after_s:
            rec.closed = "dropped"
            transport = self.request.transport
            if transport is not None:
                transport.abort()
            return
        td = self.turn_detection
        if isinstance(td, dict) and td.get("type") in ("server_vad", "semantic_vad"):
            await self.detect(pcm16, td)

    async def detect(self, pcm16: bytes, td: dict[str, Any]) -> None:
        """The server's own VAD: speech_started, speech_stopped after
        ``silence_duration_ms`` of silence, then its own commit."""
        if self.vad is None:
            self.vad = SpeechDetector()
            self.vad_origin = self.session_audio_s - len(pcm16) / 32_000
        silence_s = float(td.get("silence_duration_ms") or 500) / 1000
        base = self.buffer_start_s if self.mode == "speaches" else 0.0  # speaches counts from the buffer's start
        for voiced, end_s in self.vad.feed(pcm16):
            frame_end = self.vad_origin + end_s
            if voiced:
                self.silence_s = 0.0
                if self.speech_from is None:
                    self.speech_from = frame_end - 0.02
                    await self.send({"type": "input_audio_buffer.speech_started", "item_id": self.next_item_id,
                                     "audio_start_ms": round((self.speech_from - base) * 1000)})
            elif self.speech_from is not None:
                self.silence_s += 0.02
                if self.silence_s >= silence_s:
                    end = frame_end - self.silence_s
                    self.speech_from = None
                    self.silence_s = 0.0
                    await self.send({"type": "input_audio_buffer.speech_stopped", "item_id": self.next_item_id,
                                     "audio_end_ms": round((end - base) * 1000)})
                    await self.commit(None)

    async def commit(self, eid: str | None) -> None:
        buffered = self.buffer.fed_s if self.buffer is not None else 0.0
        if buffered < self.server.min_commit_s:
            if self.mode == "speaches":
                await self.error("invalid_request_error", None, "Error committing input audio buffer: buffer too small. "
                                 f"Expected at least 100ms of audio, but buffer only has {buffered * 1000:.2f}ms of audio.")
            else:
                await self.error("invalid_request_error", "input_audio_buffer_commit_empty",
                                 "Error committing input audio buffer: buffer too small. Expected at least 100ms of audio, "
                                 f"but buffer only has {buffered * 1000:.2f}ms of audio.", event_id=eid)
            return
        assert self.buffer is not None
        utterance, self.buffer = self.buffer, None
        item_id, self.next_item_id = self.next_item_id, self._new_item_id()
        previous, self.last_item_id = self.last_item_id, item_id
        self.seq += 1
        item = _Item(item_id, utterance, time.monotonic(), self.seq)
        self.items.append(item)
        if self.server.hang:
            return
        if not self.server.late_committed:
            await self.acknowledge(item_id, previous)
        self.spawn(self.transcribe(item, previous))

    async def acknowledge(self, item_id: str, previous: str | None) -> None:
        await self.send({"type": "input_audio_buffer.committed", "previous_item_id": previous, "item_id": item_id})
        content = [{"type": "input_audio", "transcript": None}]
        if self.mode == "ga":
            await self.send({"type": "conversation.item.added", "previous_item_id": previous, "item": {
                "id": item_id, "object": "realtime.item", "type": "message", "status": "completed", "role": "user",
                "content": content}})
        else:
            await self.send({"type": "conversation.item.created", "previous_item_id": previous, "item": {
                "id": item_id, "object": "realtime.item", "type": "message", "status": "completed", "role": "user",
                "content": content}})

    async def clear(self) -> None:
        if self.buffer is not None:
            buffer, self.buffer = self.buffer, None
            self.spawn(buffer.aclose())
        self.speech_from = None
        self.silence_s = 0.0
        await self.send({"type": "input_audio_buffer.cleared"})

    # -- answers ---------------------------------------------------------------

    async def transcribe(self, item: _Item, previous: str | None) -> None:
        server = self.server
        latency = server.latency
        audio_s = item.utterance.fed_s
        try:
            text, _words = await item.utterance.finish()
        except Exception as exc:  # the recogniser failed: what a provider says then
            await self.send({"type": f"{_TRANSCRIPTION}.failed", "item_id": item.item_id, "content_index": 0,
                             "error": {"type": "transcription_error", "code": "decode_failed", "message": str(exc)}})
            item.done.set()
            return
        await self.wait_until(item.committed_at + latency.interim_s)
        if server.fail_item:
            server.fail_item = False
            await self.wait_until(item.committed_at + latency.final_s)
            await self.send({"type": f"{_TRANSCRIPTION}.failed", "item_id": item.item_id, "content_index": 0,
                             "error": {"type": "transcription_error", "code": "audio_unintelligible",
                                       "message": "Audio could not be transcribed (fault)."}})
            item.done.set()
            return
        if self.mode != "speaches":
            for n, word in enumerate(text.split()):
                if n:
                    await asyncio.sleep(server.delta_gap_s)
                await self.send({"type": f"{_TRANSCRIPTION}.delta", "item_id": item.item_id, "content_index": 0,
                                 "delta": word if n == 0 else " " + word})
        await self.wait_until(item.committed_at + latency.final_s)
        if server.out_of_order:
            later = [i for i in self.items if i.seq > item.seq and not i.done.is_set()]
            if later:
                await asyncio.gather(*(i.done.wait() for i in later))
        if server.garbage is not None and self.index < server.garbage_connections:
            await self.send_garbage(server.garbage, item)
            if server.garbage != "stray_error":
                item.done.set()
                return
        event: dict[str, Any] = {"type": f"{_TRANSCRIPTION}.completed", "item_id": item.item_id, "content_index": 0,
                                 "transcript": text}
        usage = self.usage(audio_s, text)
        if usage is not None:
            event["usage"] = usage
        self.record.items[item.item_id] = text
        await self.send(event)
        if server.late_committed:
            await self.acknowledge(item.item_id, previous)
        item.done.set()

    def usage(self, audio_s: float, text: str) -> dict[str, Any] | None:
        if self.server.usage == "tokens":
            audio_tokens = math.ceil(audio_s * 10)
            words = len(text.split())
            return {"type": "tokens", "input_tokens": audio_tokens, "output_tokens": words,
                    "total_tokens": audio_tokens + words, "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": 0}}
        if self.server.usage == "duration":
            return {"type": "duration", "seconds": round(audio_s, 3)}
        return None

    async def send_garbage(self, kind: Garbage, item: _Item) -> None:
        completed = f"{_TRANSCRIPTION}.completed"
        if kind == "text":
            await self.send_raw("this is not JSON {")
        elif kind == "binary":
            await self.send_raw(b"\x00\x01garbage")
        elif kind == "array":
            await self.send_raw("[1, 2, 3]")
        elif kind == "no_type":
            await self.send_raw(json.dumps({"item_id": item.item_id, "transcript": "x"}))
        elif kind == "bad_delta":
            await self.send_raw(json.dumps({"type": f"{_TRANSCRIPTION}.delta", "item_id": 7, "delta": ["x"]}))
        elif kind == "bad_completed":
            await self.send_raw(json.dumps({"type": completed, "item_id": item.item_id, "transcript": None}))
        elif kind == "bad_usage":
            await self.send_raw(json.dumps({"type": completed, "item_id": item.item_id, "transcript": "x",
                                            "usage": {"type": "tokens", "input_tokens": "many", "output_tokens": 1}}))
        elif kind == "huge":
            await self.send_raw(json.dumps({"type": completed, "item_id": item.item_id, "transcript": "x" * (2 << 20)}))
        elif kind == "bad_committed":
            await self.send_raw(json.dumps({"type": "input_audio_buffer.committed", "item_id": None, "previous_item_id": None}))
        elif kind == "bad_speech":
            await self.send_raw(json.dumps({"type": "input_audio_buffer.speech_started", "item_id": item.item_id,
                                            "audio_start_ms": "soon"}))
        elif kind == "stray_error":
            await self.send({"type": "error", "error": {"type": "server_error", "code": "rate_limit_exceeded",
                                                        "message": "Slow down (fault).", "param": None, "event_id": None}})
        elif kind == "unknown_item":
            for n in range(100):  # answers for items never committed
                await self.send_raw(json.dumps({"type": f"{_TRANSCRIPTION}.delta", "item_id": f"item_ghost{n}", "delta": "x"}))

    async def wait_until(self, at: float) -> None:
        await asyncio.sleep(max(0.0, at - time.monotonic()))

    # -- shapes ----------------------------------------------------------------

    def created_event(self) -> dict[str, Any]:
        if self.mode == "beta":
            return {"type": "transcription_session.created", "session": self.session_object()}
        return {"type": "session.created", "session": self.session_object()}

    def session_object(self) -> dict[str, Any]:
        if self.mode == "ga":
            session: dict[str, Any] = {
                "type": "transcription", "object": "realtime.transcription_session", "id": self.session_id,
                "audio": {"input": {"format": {"type": "audio/pcm", "rate": INPUT_RATE}, "transcription": dict(self.transcription),
                                    "noise_reduction": None, "turn_detection": self.turn_detection}},
                "include": None,
            }
        elif self.mode == "beta":
            session = {
                "id": self.session_id, "object": "realtime.transcription_session", "modalities": ["text"],
                "input_audio_format": "pcm16", "input_audio_transcription": dict(self.transcription),
                "turn_detection": self.turn_detection, "input_audio_noise_reduction": None, "include": None,
            }
        else:
            session = {
                "id": self.session_id, "model": "gpt-4o-realtime-preview", "modalities": ["audio", "text"],
                "instructions": "", "voice": "af_heart", "input_audio_format": "pcm16", "output_audio_format": "pcm16",
                "input_audio_transcription": {"model": self.transcription.get("model"), "language": self.transcription.get("language")},
                "turn_detection": self.turn_detection, "temperature": 0.8, "tools": [], "tool_choice": "auto",
                "max_response_output_tokens": "inf",
            }
        self.record.session = session
        return session


def _bearer(header: str | None) -> str | None:
    if header and header.startswith("Bearer "):
        return header[len("Bearer "):]
    return None


def _http_error(status: int, etype: str, message: str, code: str | None = None) -> web.Response:
    return web.json_response({"error": {"message": message, "type": etype, "code": code, "param": None}}, status=status)


def main() -> None:
    """``python -m testkit.fake_openai_realtime [--host H] [--port P] [--grammar FILE] [--mode M] [--api-key K]``"""
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8098)
    parser.add_argument("--grammar", default=None, help="a JSGF grammar for the recogniser")
    parser.add_argument("--mode", choices=["ga", "beta", "speaches"], default="ga")
    parser.add_argument("--api-key", default=None)
    parser.add_argument("--interim-ms", type=float, default=150)
    parser.add_argument("--final-ms", type=float, default=300)
    parser.add_argument("--max-decoders", type=int, default=2)
    a = parser.parse_args()

    async def serve() -> None:
        backend = SttBackend(a.grammar, max_decoders=a.max_decoders)
        await backend.start()
        server = FakeOpenAiRealtime(backend, mode=a.mode, api_key=a.api_key,
                                    latency=Latency(a.interim_ms / 1000, a.final_ms / 1000))
        runner = web.AppRunner(server.app(), access_log=None)
        await runner.setup()
        await web.TCPSite(runner, a.host, a.port).start()
        print(f"fake OpenAI Realtime ({a.mode}) on ws://{a.host}:{a.port}/v1/realtime", flush=True)
        try:
            await asyncio.Event().wait()
        finally:
            await runner.cleanup()
            await backend.aclose()

    with contextlib.suppress(KeyboardInterrupt):
        asyncio.run(serve())


if __name__ == "__main__":
    main()
