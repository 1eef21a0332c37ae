"""A stand-in for a xiaozhi-esp32 board, for tests: a raw aiohttp WebSocket
client that sends firmware-shaped messages (78/xiaozhi-esp32,
docs/websocket.md): the handshake headers, ``hello``, ``listen``,
``abort``, and the microphone as 60 ms Opus packets at 16 kHz in real time
(framed by protocol version 1, 2 or 3). It records every message the server
sends with its arrival time, and follows ``tts start``/``stop`` as the
firmware does: its microphone is off while it speaks in manual and auto
modes. Not the device simulator (``turnkeeper call --device``): just enough
device to drive the endpoint.
"""

from __future__ import annotations

import asyncio
import json
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from media.frames import VAD_RATE, load_pcm, rms_dbfs
from media.opus import OpusDecoder, OpusEncoder
from web.devices import framing

PACKET_MS = 60
PACKET_BYTES = VAD_RATE * PACKET_MS // 1000 * 2


def firmware_hello(version: int = 1) -> dict[str, Any]:
    """The hello of docs/websocket.md section 1.3."""
    return {"type": "hello", "version": version, "features": {"mcp": True}, "transport": "websocket",
            "audio_params": {"format": "opus", "sample_rate": 16000, "channels": 1, "frame_duration": 60}}


def headers(token: str, version: int = 1, mac: str = "aa:bb:cc:dd:ee:01") -> dict[str, str]:
    return {"Authorization": f"Bearer {token}", "Protocol-Version": str(version), "Device-Id": mac,
            "Client-Id": "3f6c2b1e-0000-4000-8000-000000000001"}


@dataclass
class Received:
    """One message from the server: its arrival time (time.monotonic()),
    its JSON (text) or its Opus payload (binary)."""

    at: float
    msg: dict[str, Any] | None = None
    packet: bytes | None = None
    tts_stops: int = 0  # ``tts stop`` messages received before it
    loud: bool = False  # a packet with sound (decoded: louder than -50 dBFS)
    samples: int = 0  # a packet's decoded length, samples at 16 kHz


@dataclass
class FakeDevice:
    """One board (see the module doc)."""

    ws: aiohttp.ClientWebSocketResponse
    version: int = 1
    mode: str = "manual"
    received: list[Received] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._mic: deque[bytes] = deque()
        self._tasks: list[asyncio.Task[None]] = []
        self._encoder = OpusEncoder(16000, PACKET_MS, in_rate=VAD_RATE)
        self._decoder = OpusDecoder(16000)
        self.speaking = False
        self.session_id: str | None = None
        self.hello = asyncio.Event()
        self.stops = 0

    async def send(self, msg: dict[str, Any]) -> None:
        if self.session_id is not None:
            msg = {"session_id": self.session_id, **msg}
        await self.ws.send_str(json.dumps(msg))

    async def start(self, *, mic: bool = True, hello: dict[str, Any] | None = None) -> None:
        """``hello``, wait for the server's; the mic runs until :meth:`aclose` if ``mic``."""
        self._tasks.append(asyncio.ensure_future(self._read()))
        await self.ws.send_str(json.dumps(hello or firmware_hello(self.version)))
        await asyncio.wait_for(self.hello.wait(), 30)
        if mic:
            self._tasks.append(asyncio.ensure_future(self._mic_out()))

    async def listen(self, state: str, mode: str | None = None, **extra: Any) -> None:
        if mode is not None:
            self.mode = mode
        await self.send({"type": "listen", "state": state, **({"mode": self.mode} if state == "start" else {}), **extra})

    async def abort(self, reason: str | None = None) -> None:
        await self.send({"type": "abort", **({"reason": reason} if reason else {})})

    def speak(self, speech: str | Path | bytes) -> None:
        """Queue an utterance (a WAV, or 16 kHz s16 PCM) on the microphone."""
        pcm = speech if isinstance(speech, bytes) else load_pcm(speech, VAD_RATE)
        pcm += bytes(-len(pcm) % PACKET_BYTES)
        self._mic.extend(pcm[i : i + PACKET_BYTES] for i in range(0, len(pcm), PACKET_BYTES))

    @property
    def mic_idle(self) -> bool:
        return not self._mic

    def packet(self, pcm: bytes) -> bytes:
        """One binary message of 60 ms of 16 kHz PCM, framed for ``version``."""
        [opus] = self._encoder.encode(pcm)
        return framing.frame(opus, self.version, timestamp_ms=int(time.monotonic() * 1000))

    async def _mic_out(self) -> None:
        start = time.monotonic()
        n = 0
        while True:
            muted = self.speaking and self.mode != "realtime"
            if self._mic and not muted:
                await self.ws.send_bytes(self.packet(self._mic.popleft()))
            elif not muted and self.mode != "manual":
                await self.ws.send_bytes(self.packet(bytes(PACKET_BYTES)))  # an open mic hears the room
            n += 1
            await asyncio.sleep(max(0.0, start + n * PACKET_MS / 1000 - time.monotonic()))

    async def _read(self) -> None:
        async for msg in self.ws:
            now = time.monotonic()
            if msg.type is aiohttp.WSMsgType.TEXT:
                data = json.loads(msg.data)
                self.received.append(Received(now, msg=data, tts_stops=self.stops))
                if data.get("type") == "hello":
                    self.session_id = data.get("session_id")
                    self.hello.set()
                elif data.get("type") == "tts" and data.get("state") == "start":
                    self.speaking = True
                elif data.get("type") == "tts" and data.get("state") == "stop":
                    self.speaking = False
                    self.stops += 1
            elif msg.type is aiohttp.WSMsgType.BINARY:
                payload = framing.parse(msg.data, self.version).payload
                pcm = self._decoder.decode(payload)
                self.received.append(Received(now, packet=payload, tts_stops=self.stops,
                                              loud=rms_dbfs(pcm) > -50, samples=len(pcm) // 2))
            else:
                break

    async def closed(self, timeout: float = 30) -> int | None:
        """Wait until the server closes the socket; its close code."""
        await asyncio.wait_for(asyncio.shield(self._tasks[0]), timeout)
        return self.ws.close_code

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()

    # -- what a test looks at ------------------------------------------------------------

    def of(self, kind: str, state: str | None = None) -> list[Received]:
        return [r for r in self.received if r.msg is not None and r.msg.get("type") == kind
                and (state is None or r.msg.get("state") == state)]

    def packets(self, before_stops: int | None = None) -> list[Received]:
        return [r for r in self.received if r.packet is not None and (before_stops is None or r.tts_stops == before_stops)]

    def audible(self, before_stops: int | None = None) -> list[Received]:
        """Packets with sound."""
        return [r for r in self.packets(before_stops) if r.loud]

    def audible_ms(self, before_stops: int | None = None) -> float:
        """Sound received, ms (whatever the downlink packet duration)."""
        return sum(r.samples for r in self.audible(before_stops)) / 16
