"""A stand-in for a telephony provider's side of a media stream, for tests:
a raw aiohttp WebSocket client that speaks Twilio's (or Telnyx's) messages.

It sends the caller's line as 20 ms mu-law ``media`` messages at real time
(speech queued with :meth:`FakeProvider.play`, silence otherwise, as a
provider does), and plays what the server sends the way the provider's
buffer does: one 20 ms message per 20 ms, in order; a ``mark`` is echoed
once the audio before it has played; a ``clear`` drops the buffer and
echoes the marks still in it at once (Twilio, "Media Streams - WebSocket
Messages", *Clear message*). Not the phone simulator (testkit's): just
enough provider to drive the endpoint.
"""

from __future__ import annotations

import asyncio
import base64
import json
import random
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from media.frames import load_pcm, rms_dbfs
from media.g711 import MULAW_FRAME_BYTES, MULAW_RATE, mulaw_to_pcm, pcm_to_mulaw

SILENCE = b"\xff" * MULAW_FRAME_BYTES


@dataclass
class Received:
    """One message from the server, with its arrival time (time.monotonic())."""

    at: float
    msg: dict[str, Any]


@dataclass
class Played:
    """One 20 ms message the far end played (time.monotonic())."""

    at: float
    payload: bytes
    before_clear: int  # how many clears had been received when it played


@dataclass
class FakeProvider:
    """One provider-side stream (see the module doc)."""

    ws: aiohttp.ClientWebSocketResponse
    dialect: str = "twilio"
    stream_id: str = "MZ00000000000000000000000000000001"
    call_id: str = "CA00000000000000000000000000000001"
    echo_marks: bool = True
    #: send the line in blocks of this many messages, each block shuffled (0: in order)
    shuffle: int = 0
    received: list[Received] = field(default_factory=list)
    played: list[Played] = field(default_factory=list)
    echoed: list[str] = field(default_factory=list)
    speech_started_at: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        self._line: deque[tuple[bytes, bool]] = deque()
        self._buffer: deque[tuple[str, Any]] = deque()  # ("media", bytes) | ("mark", name)
        self._tasks: list[asyncio.Task[None]] = []
        self._chunk = 0
        self._seq = 0
        self.clears = 0
        self.idle = asyncio.Event()
        self.idle.set()

    # -- messages ------------------------------------------------------------------

    def _sid(self) -> dict[str, Any]:
        return {"streamSid": self.stream_id} if self.dialect == "twilio" else {"stream_id": self.stream_id}

    async def send(self, msg: dict[str, Any]) -> None:
        self._seq += 1
        key = "sequenceNumber" if self.dialect == "twilio" else "sequence_number"
        await self.ws.send_str(json.dumps({**msg, key: str(self._seq)}))

    async def start(self, parameters: dict[str, str] | None = None, *, lines: bool = True) -> None:
        """``connected`` and ``start``; then the line (and the far end's
        player) run until :meth:`stop`, unless ``lines`` is False."""
        if self.dialect == "twilio":
            await self.ws.send_str(json.dumps({"event": "connected", "protocol": "Call", "version": "1.0.0"}))
            await self.send({"event": "start", **self._sid(), "start": {
                "accountSid": "AC0", "streamSid": self.stream_id, "callSid": self.call_id,
                "tracks": ["inbound"], "customParameters": parameters or {},
                "mediaFormat": {"encoding": "audio/x-mulaw", "sampleRate": 8000, "channels": 1},
            }})
        else:
            from web.telephony.telnyx import encode_client_state

            await self.ws.send_str(json.dumps({"event": "connected", "version": "1.0.0"}))
            await self.send({"event": "start", **self._sid(), "start": {
                "call_control_id": self.call_id, "client_state": encode_client_state(parameters or {}),
                "media_format": {"encoding": "PCMU", "sample_rate": 8000, "channels": 1},
            }})
        self._reader = asyncio.ensure_future(self._read())
        self._tasks.append(self._reader)
        if lines:
            self._tasks.append(asyncio.ensure_future(self._line_out()))
            self._tasks.append(asyncio.ensure_future(self._far_end()))

    def media_message(self, payload: bytes, chunk: int | None = None) -> dict[str, Any]:
        """A ``media`` message of ``payload`` (chunk numbered in order unless given)."""
        if chunk is None:
            self._chunk += 1
            chunk = self._chunk
        return {"event": "media", **self._sid(), "media": {
            "track": "inbound", "chunk": str(chunk), "timestamp": str(chunk * 20),
            "payload": base64.b64encode(payload).decode(),
        }}

    async def dtmf(self, digit: str) -> None:
        await self.send({"event": "dtmf", **self._sid(), "dtmf": {"track": "inbound_track", "digit": digit}})

    async def stop(self) -> None:
        """``stop``, then the socket closes."""
        await self.send({"event": "stop", **self._sid(), "stop": {"accountSid": "AC0", "callSid": self.call_id}})
        await self.aclose()

    async def closed(self, timeout: float = 10) -> int | None:
        """Wait until the server closes the socket; its close code."""
        await asyncio.wait_for(asyncio.shield(self._reader), timeout)
        return self.ws.close_code

    async def aclose(self) -> None:
        for t in self._tasks:
            t.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self.ws.close()

    # -- the caller's line ----------------------------------------------------------

    def play(self, speech: str | Path | bytes) -> None:
        """Queue an utterance (a WAV, or 8 kHz s16 PCM) on the line."""
        pcm = speech if isinstance(speech, bytes) else load_pcm(speech, MULAW_RATE)
        mulaw = pcm_to_mulaw(pcm)
        mulaw += b"\xff" * (-len(mulaw) % MULAW_FRAME_BYTES)
        frames = [mulaw[i : i + MULAW_FRAME_BYTES] for i in range(0, len(mulaw), MULAW_FRAME_BYTES)]
        self._line.extend((f, i == 0) for i, f in enumerate(frames))
        self.idle.clear()

    async def _line_out(self) -> None:
        start = time.monotonic()
        n = 0
        block: list[dict[str, Any]] = []
        shuffler = random.Random(7)
        while True:
            if self._line:
                payload, first = self._line.popleft()
                if first:
                    self.speech_started_at.append(time.monotonic())
            else:
                payload = SILENCE
                self.idle.set()
            block.append(self.media_message(payload))
            if len(block) >= max(1, self.shuffle):
                if self.shuffle:
                    shuffler.shuffle(block)
                for msg in block:
                    await self.send(msg)
                block = []
            n += 1
            await asyncio.sleep(max(0.0, start + n * 0.02 - time.monotonic()))

    # -- the far end's buffer -----------------------------------------------------------

    async def _read(self) -> None:
        async for msg in self.ws:
            if msg.type is not aiohttp.WSMsgType.TEXT:
                break
            data = json.loads(msg.data)
            self.received.append(Received(time.monotonic(), data))
            event = data.get("event")
            if event == "media":
                self._buffer.append(("media", base64.b64decode(data["media"]["payload"])))
            elif event == "mark":
                self._buffer.append(("mark", data["mark"]["name"]))
                await self._echo_due()
            elif event == "clear":
                self.clears += 1
                pending = [v for k, v in self._buffer if k == "mark"]
                self._buffer.clear()
                for name in pending:  # Twilio returns the marks of a cleared buffer
                    await self._echo(name)

    async def _echo_due(self) -> None:
        while self._buffer and self._buffer[0][0] == "mark":
            await self._echo(self._buffer.popleft()[1])

    async def _echo(self, name: str) -> None:
        if not self.echo_marks:
            return
        self.echoed.append(name)
        await self.send({"event": "mark", **self._sid(), "mark": {"name": name}})

    async def _far_end(self) -> None:
        start = time.monotonic()
        n = 0
        while True:
            await self._echo_due()
            if self._buffer and self._buffer[0][0] == "media":
                self.played.append(Played(time.monotonic(), self._buffer.popleft()[1], self.clears))
            await self._echo_due()
            n += 1
            await asyncio.sleep(max(0.0, start + n * 0.02 - time.monotonic()))

    # -- what a test looks at ------------------------------------------------------------

    def of(self, event: str) -> list[Received]:
        return [r for r in self.received if r.msg.get("event") == event]

    def audible(self, since_clears: int | None = None) -> list[Played]:
        """Played messages with sound (not mu-law silence)."""
        return [p for p in self.played if rms_dbfs(mulaw_to_pcm(p.payload)) > -50
                and (since_clears is None or p.before_clear == since_clears)]


async def wait_until(pred: Callable[[], bool], timeout: float = 20, what: str = "") -> None:
    """Poll ``pred`` every 20 ms until true, else fail after ``timeout`` s."""
    try:
        async with asyncio.timeout(timeout):
            while not pred():
                await asyncio.sleep(0.02)
    except TimeoutError:
        raise AssertionError(f"not reached in {timeout} s: {what}") from None
