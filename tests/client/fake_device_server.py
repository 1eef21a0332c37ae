"""A minimal device server for the simulator's tests: the server side of
the xiaozhi-esp32 protocol (docs/websocket.md) reduced to what the tests
need, with knobs for misbehaving.

It answers the hello (downlink ``rate`` / ``frame_ms``), records what the
device sends (headers, JSON, binary frames parsed by the announced version
and decoded), and after the user's turn (``listen stop``; or, in realtime
mode, the end of at least ``turn_after_ms`` of loud uplink audio) sends ``stt``, ``tts start``, a
``sentence_start`` and a tone of ``reply_ms`` as Opus packets paced at real
time ``send_ahead_ms`` early, then ``tts stop``. An ``abort``, a ``listen
start`` while replying or (realtime) loud uplink audio stop the reply:
nothing more is sent (after ``late_ms`` more of audio, for a server that
does not stop at once) and ``tts stop`` follows.
"""

from __future__ import annotations

import asyncio
import json
import math
import struct
from dataclasses import dataclass, field
from typing import Any

from aiohttp import WSMsgType, web

from media.frames import rms_dbfs
from media.opus import OpusDecoder, OpusEncoder
from web.devices import framing


def tone(ms: int, rate: int, hz: float = 440.0, amplitude: float = 0.3) -> bytes:
    """A sine tone, mono s16."""
    n = rate * ms // 1000
    return b"".join(struct.pack("<h", int(amplitude * 32767 * math.sin(2 * math.pi * hz * i / rate))) for i in range(n))


@dataclass
class FakeDeviceServer:
    rate: int = 24_000
    frame_ms: int = 60
    reply_ms: int = 3000
    send_ahead_ms: int = 60
    late_ms: int = 0
    answer_hello: bool = True
    hello_transport: str = "websocket"
    turn_after_ms: int = 600
    barge_in_dbfs: float = -30.0
    bad_frames: list[bytes] = field(default_factory=list)  # sent raw after tts start
    #: what the device did
    headers: dict[str, str] = field(default_factory=dict)
    texts: list[tuple[float, dict[str, Any]]] = field(default_factory=list)
    frames: list[tuple[float, bytes]] = field(default_factory=list)  # (arrival, decoded 16 kHz PCM)
    raw: list[bytes] = field(default_factory=list)
    sent_audio: list[float] = field(default_factory=list)  # when each downlink packet left
    stopped_at: list[float] = field(default_factory=list)
    replies: int = 0

    def app(self) -> web.Application:
        app = web.Application()
        app.router.add_get("/v1/devices/ws", self.handle)
        return app

    async def handle(self, request: web.Request) -> web.WebSocketResponse:
        self.headers = dict(request.headers)
        version = int(request.headers.get("Protocol-Version", "1"))
        ws = web.WebSocketResponse()
        await ws.prepare(request)
        loop = asyncio.get_running_loop()
        decoder = OpusDecoder(16_000)
        reply: asyncio.Task[None] | None = None
        stop = asyncio.Event()
        mode = "manual"
        heard_ms = 0

        async def speak() -> None:
            await ws.send_str(json.dumps({"type": "stt", "session_id": "s-1", "text": f"turn {self.replies}"}))
            await ws.send_str(json.dumps({"type": "tts", "session_id": "s-1", "state": "start"}))
            await ws.send_str(json.dumps({"type": "tts", "session_id": "s-1", "state": "sentence_start", "text": "a tone"}))
            for raw in self.bad_frames:
                await ws.send_bytes(raw)
            enc = OpusEncoder(self.rate, self.frame_ms, in_rate=self.rate)
            packets = enc.encode(tone(self.reply_ms, self.rate)) + enc.flush()
            t0 = loop.time()
            stop_at: float | None = None
            for k, p in enumerate(packets):
                due = t0 + k * self.frame_ms / 1000 - self.send_ahead_ms / 1000
                await asyncio.sleep(max(0.0, due - loop.time()))
                if stop.is_set():
                    stop_at = stop_at or loop.time()
                    if loop.time() - stop_at >= self.late_ms / 1000:
                        break
                await ws.send_bytes(framing.frame(p, version))
                self.sent_audio.append(loop.time())
            await ws.send_str(json.dumps({"type": "tts", "session_id": "s-1", "state": "stop"}))

        def start_reply() -> None:
            nonlocal reply
            self.replies += 1
            stop.clear()
            reply = loop.create_task(speak())

        def interrupt() -> None:
            if reply is not None and not reply.done() and not stop.is_set():
                self.stopped_at.append(loop.time())
                stop.set()

        try:
            async for msg in ws:
                now = loop.time()
                if msg.type == WSMsgType.TEXT:
                    m = json.loads(msg.data)
                    self.texts.append((now, m))
                    if m.get("type") == "hello" and self.answer_hello:
                        await ws.send_str(json.dumps({
                            "type": "hello", "transport": self.hello_transport, "session_id": "s-1",
                            "audio_params": {"format": "opus", "sample_rate": self.rate, "channels": 1,
                                             "frame_duration": self.frame_ms}}))
                    elif m.get("type") == "abort":
                        interrupt()
                    elif m.get("type") == "listen" and m.get("state") == "start":
                        mode = m.get("mode", "manual")
                        heard_ms = 0
                        interrupt()
                    elif m.get("type") == "listen" and m.get("state") == "stop":
                        start_reply()
                elif msg.type == WSMsgType.BINARY:
                    self.raw.append(msg.data)
                    pcm = decoder.decode(framing.parse(msg.data, version).payload)
                    self.frames.append((now, pcm))
                    if mode == "realtime":  # a crude detector: loud packets are speech
                        loud = rms_dbfs(pcm) > self.barge_in_dbfs
                        speaking = reply is not None and not reply.done() and not stop.is_set()
                        if loud:
                            heard_ms += 60
                            if speaking:
                                interrupt()
                        elif heard_ms >= self.turn_after_ms and not speaking:
                            heard_ms = 0  # the end of an utterance: the turn
                            start_reply()
                        else:
                            heard_ms = 0
        finally:
            if reply is not None:
                reply.cancel()
        return ws
