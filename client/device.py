"""A simulated push-to-talk device: the xiaozhi-esp32 firmware's side of the
device WebSocket (78/xiaozhi-esp32: docs/websocket.md, and
main/protocols/websocket_protocol.cc, protocol.cc and application.cc for
what the document leaves out), against a turnkeeper server.

:class:`DeviceSimulator` connects with the firmware's headers
(``Authorization: Bearer <token>``, ``Protocol-Version``, ``Device-Id``,
``Client-Id``), sends its ``hello`` (16 kHz mono Opus, 60 ms frames) and
waits for the server's (10 s, and it must say transport "websocket", as
the firmware checks); the server's ``audio_params`` give the downlink rate
and frame duration. Then it behaves as the firmware does:

- states ``idle``, ``listening``, ``speaking``; ``tts start`` enters
  speaking (from idle or listening), ``tts stop`` leaves it (to idle in
  manual mode, else back to listening, which in auto mode sends ``listen
  start`` again);
- the button: :meth:`press` while idle sends ``listen start`` (mode
  manual); while speaking it sends ``abort`` and then ``listen start``
  (``Application::StartListening``); :meth:`release` sends ``listen stop``;
  :meth:`abort` sends ``abort`` (optional reason) and stays speaking until
  ``tts stop``; :meth:`detect` sends ``listen state detect`` with a wake word;
- the microphone sends one Opus packet of 60 ms every 60 ms at real time
  while listening (and while speaking in realtime mode, where it stays
  open): what :meth:`say` queued, else silence; speech said while the
  microphone is off is lost, as in a room;
- downlink audio is played only while speaking (the firmware drops it
  otherwise), decoded at the announced rate and played at real time by
  :class:`client.device_speaker.DeviceSpeaker`; after an ``abort`` the
  device keeps playing whatever it still receives.

A Wi-Fi link can be simulated (``wifi_jitter_ms``): each message from the
server then reaches the firmware later by a random extra delay, and never
before the one sent ahead of it (one TCP stream: a late packet holds back
the ones behind it). The speaker records where its queue ran dry while
speaking (:attr:`client.device_speaker.DeviceSpeaker.underruns`).

Binary messages are framed by the announced protocol version (1, 2 or 3,
:mod:`web.devices.framing`). Everything sent and received is logged with
its time (:class:`DeviceLog`); what the speaker played can be written to a
WAV. Nothing here knows turns or generations: the wire does not carry them.
:mod:`client.device_call` scripts a call with it and measures it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import uuid
import wave
from pathlib import Path
from typing import Any

import aiohttp

from client.device_log import DeviceLog, ReceivedPacket
from client.device_mic import UPLINK_FRAME_MS, UPLINK_RATE, DeviceMicrophone
from client.device_speaker import DeviceSpeaker, Segment, sound_end_s
from client.phone import HeardFrame
from client.results import CallError
from clock import Clock, SystemClock
from media.opus import OpusDecoder, OpusError
from web.devices import framing

log = logging.getLogger(__name__)

#: the firmware waits this long for the server's hello, s (websocket_protocol.cc)
HELLO_TIMEOUT_S = 10.0
MODES = ("manual", "auto", "realtime")


class DeviceSimulator:
    """One device's connection: the firmware's protocol side and its room.

    Args:
        url: the server's ``ws://`` / ``wss://`` device URL (``http(s)://``
            is turned into ``ws(s)://``).
        token: the device's token (sent as ``Authorization: Bearer``);
            None sends no Authorization header.
        version: binary protocol version, 1, 2 or 3 (header and hello).
        device_id: the ``Device-Id`` header (a MAC address).
        client_id: the ``Client-Id`` header (a UUID; a new one by default).
        clock: pacing clock (system clock by default).
        hello_timeout_s: how long to wait for the server's hello, s.
        hello: extra fields for the device's hello (newer firmware's).
        wifi_jitter_ms: the 95th percentile (ms) of the extra delay a
            Wi-Fi link adds to each message from the server (exponential,
            mean a third of it; 0: none, loopback as it is).
        seed: the jitter's random seed.

    Raises:
        ValueError: an unknown protocol version, or a negative jitter.
    """

    def __init__(
        self,
        url: str,
        token: str | None = None,
        *,
        version: int = 1,
        device_id: str = "02:00:00:00:00:01",
        client_id: str | None = None,
        clock: Clock | None = None,
        hello_timeout_s: float = HELLO_TIMEOUT_S,
        hello: dict[str, Any] | None = None,
        wifi_jitter_ms: float = 0.0,
        seed: int | None = None,
    ) -> None:
        if version not in framing.VERSIONS:
            raise ValueError(f"protocol version {version} (one of {framing.VERSIONS})")
        if wifi_jitter_ms < 0:
            raise ValueError("wifi_jitter_ms must not be negative")
        self._jitter_mean_s = wifi_jitter_ms / 3 / 1000  # exponential: p95 = mean * ln 20, about 3 means
        self._rng = random.Random(seed)
        self._arrived = 0.0  # when the newest message from the server reached the firmware
        if url.startswith("http"):
            url = "ws" + url[len("http") :]
        self.url, self.token, self.version = url, token, version
        self.device_id = device_id
        self.client_id = client_id or str(uuid.uuid4())
        self.clock = clock or SystemClock()
        self.hello_timeout_s = hello_timeout_s
        self._extra_hello = dict(hello or {})
        self.log = DeviceLog()
        self.state = "connecting"
        self.mode = "manual"
        #: the server's hello (None until it came)
        self.server_hello: dict[str, Any] | None = None
        self.session_id = ""
        self.downlink_rate = 16_000
        self.downlink_frame_ms = 60
        self.speaker = DeviceSpeaker(self.downlink_rate)
        self._decoder: OpusDecoder | None = None
        self.mic = DeviceMicrophone(self.clock, self._mic_open, self._send, version, self.log,
                                    lambda: self.started_at or 0.0)
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._hello_event = asyncio.Event()
        self._cond = asyncio.Condition()
        self._send_lock = asyncio.Lock()
        #: set when the server closed the socket (or it broke)
        self.server_closed = asyncio.Event()
        #: headers of the upgrade's response
        self.response_headers: dict[str, str] = {}
        #: the close code the server sent, if it closed
        self.close_code: int | None = None
        self.started_at: float | None = None

    # -- lifecycle -------------------------------------------------------------------

    def headers(self) -> dict[str, str]:
        """The handshake headers the firmware sets (docs/websocket.md section 2)."""
        out = {"Protocol-Version": str(self.version), "Device-Id": self.device_id, "Client-Id": self.client_id}
        if self.token:
            # websocket_protocol.cc: a token without a space gets the "Bearer " prefix
            out["Authorization"] = self.token if " " in self.token else f"Bearer {self.token}"
        return out

    def hello(self) -> dict[str, Any]:
        """The device's hello (docs/websocket.md section 1.3)."""
        return {
            "type": "hello", "version": self.version, "features": {"mcp": True}, "transport": "websocket",
            "audio_params": {"format": "opus", "sample_rate": UPLINK_RATE, "channels": 1, "frame_duration": UPLINK_FRAME_MS},
        } | self._extra_hello

    async def connect(self) -> None:
        """Open the WebSocket, send hello, wait for the server's, start the
        microphone and the receiver; the device is then idle.

        Raises:
            CallError: the upgrade was refused, the server cannot be reached,
                closed the socket, or sent no valid hello in time.
        """
        self._http = aiohttp.ClientSession()
        try:
            self._ws = await self._http.ws_connect(self.url, headers=self.headers(), heartbeat=None, max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            await self._http.close()
            raise CallError(f"{self.url} refused the device (HTTP {exc.status})") from exc
        except (aiohttp.ClientError, OSError) as exc:
            await self._http.close()
            raise CallError(f"cannot reach {self.url}: {exc or type(exc).__name__}") from exc
        response = getattr(self._ws, "_response", None)
        self.response_headers = dict(response.headers) if response is not None else {}
        loop = asyncio.get_running_loop()
        receiver = loop.create_task(self._receive())
        self._tasks = [receiver]
        await self.send_json(self.hello())
        closed = loop.create_task(self.server_closed.wait())
        hello = loop.create_task(self._hello_event.wait())
        try:
            await asyncio.wait({closed, hello}, timeout=self.hello_timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            closed.cancel()
            hello.cancel()
        if not self._hello_event.is_set():
            why = f"closed the socket (code {self.close_code})" if self.server_closed.is_set() else \
                f"sent no hello with transport 'websocket' within {self.hello_timeout_s:g} s"
            errors = f"; {'; '.join(self.log.errors)}" if self.log.errors else ""
            await self.close()
            raise CallError(f"the server {why}{errors}")
        self.started_at = self.clock.monotonic()
        self._set_state("idle")
        self._tasks.append(loop.create_task(self.mic.run()))

    async def close(self) -> None:
        """Close the socket (``CloseAudioChannel``) and stop the loops. Idempotent."""
        receiver, others = (self._tasks[0], self._tasks[1:]) if self._tasks else (None, [])
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        self._tasks = []
        if self._ws is not None and not self._ws.closed:
            await self._ws.close()
        if receiver is not None:
            try:
                await asyncio.wait_for(receiver, 5)
            except TimeoutError:
                receiver.cancel()
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> DeviceSimulator:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # -- the user -------------------------------------------------------------------------

    async def listen(self, mode: str) -> None:
        """Open the microphone in ``mode`` (``auto`` or ``realtime``: the
        firmware's wake word or chat button; ``manual``: :meth:`press`).
        While speaking it first aborts, as the firmware does.

        Raises:
            ValueError: an unknown mode.
        """
        if mode not in MODES:
            raise ValueError(f"listening mode {mode!r} (one of {MODES})")
        if self.state == "speaking":
            await self.send_json({"session_id": self.session_id, "type": "abort"})
        self.mode = mode
        await self.send_json({"session_id": self.session_id, "type": "listen", "state": "start", "mode": mode})
        self._set_state("listening")

    async def press(self) -> float:
        """Press the push-to-talk button: ``abort`` first if speaking, then
        ``listen start`` (manual). Returns when it was pressed (clock s)."""
        at = self.clock.monotonic()
        await self.listen("manual")
        return at

    async def release(self) -> float:
        """Release the button: ``listen stop`` if listening. Returns when (clock s)."""
        at = self.clock.monotonic()
        if self.state == "listening":
            self.mic.drain()
            await self.send_json({"session_id": self.session_id, "type": "listen", "state": "stop"})
            self._set_state("idle")
        return at

    async def abort(self, reason: str | None = None) -> float:
        """Send ``abort`` (with ``reason``, e.g. ``wake_word_detected``);
        the device stays speaking until ``tts stop``. Returns when (clock s)."""
        at = self.clock.monotonic()
        message: dict[str, Any] = {"session_id": self.session_id, "type": "abort"}
        if reason is not None:
            message["reason"] = reason
        await self.send_json(message)
        return at

    async def detect(self, text: str, mode: str = "auto") -> None:
        """A wake word: ``listen state detect`` with its ``text``, then listen in ``mode``."""
        await self.send_json({"session_id": self.session_id, "type": "listen", "state": "detect", "text": text})
        self.mode = mode
        self._set_state("listening")

    def say(self, pcm16k: bytes, utterance: int) -> None:
        """Queue 16 kHz mono s16 PCM for the microphone (after what is
        queued), tagged ``utterance`` (>= 0) in :attr:`DeviceLog.sent`."""
        self.mic.say(pcm16k, utterance)

    async def said(self) -> None:
        """Wait until everything queued with :meth:`say` has been captured."""
        await self.mic.said()

    async def send_json(self, message: dict[str, Any]) -> None:
        """Send one text message (logged)."""
        self.log.messages_out.append((self.clock.monotonic(), message))
        await self._send(json.dumps(message))

    async def send_raw(self, data: str | bytes) -> None:
        """Send a text or binary message as is (for bad-input tests)."""
        await self._send(data)

    # -- what it heard --------------------------------------------------------------------------

    def heard_frames(self, until: float | None = None) -> list[HeardFrame]:
        """What the speaker played, 20 ms at a time from the connection to
        ``until`` (default: the end of the last audio played)."""
        if self.started_at is None:
            return []
        end = max([self.started_at] + [s.end for s in self.speaker.segments]) if until is None else until
        return self.speaker.frames(self.started_at, end)

    def write_heard(self, path: Path) -> None:
        """Write what the speaker played (mono s16 at the downlink rate) to a WAV.

        Raises:
            OSError: it cannot be written.
        """
        start = self.started_at or 0.0
        end = max([start] + [s.end for s in self.speaker.segments])
        path.parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(self.speaker.rate)
            w.writeframes(self.speaker.render(start, end))

    async def wait_audible(self, after: float, timeout: float | None = None) -> float:
        """Wait until the speaker plays sound that began after ``after``
        (clock s); returns when that sound began playing.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
        """
        async with asyncio.timeout(timeout):
            async with self._cond:
                seg = await self._cond.wait_for(lambda: self._first_loud(after))
        assert seg is not None
        await self.clock.sleep(seg.start - self.clock.monotonic())
        return seg.start

    def _first_loud(self, after: float) -> Segment | None:
        return next((p.segment for p in self.log.received
                     if p.segment is not None and p.segment.start > after and p.segment.loud), None)

    async def wait_message(
        self, predicate: Any, timeout: float | None = None, *, since: float | None = None
    ) -> tuple[float, dict[str, Any]]:
        """Wait for a received JSON message for which ``predicate(message)``
        is true, received after now (or at or after ``since``, clock s);
        returns (arrival, message).

        Raises:
            TimeoutError: none within ``timeout`` seconds.
        """
        seen = len(self.log.messages_in) if since is None else \
            next((i for i, (at, _) in enumerate(self.log.messages_in) if at >= since), len(self.log.messages_in))
        async with asyncio.timeout(timeout):
            async with self._cond:
                while True:
                    for at, m in self.log.messages_in[seen:]:
                        if predicate(m):
                            return at, m
                    seen = len(self.log.messages_in)
                    await self._cond.wait()

    # -- loops ------------------------------------------------------------------------------------

    def _set_state(self, state: str) -> None:
        if state != self.state:
            self.state = state
            self.log.states.append((self.clock.monotonic(), state))
            self.mic.changed()

    def _mic_open(self) -> bool:
        return self.state == "listening" or (self.state == "speaking" and self.mode == "realtime")

    async def _send(self, data: str | bytes) -> None:
        if self._ws is None or self._ws.closed:
            return
        async with self._send_lock:
            try:
                if isinstance(data, str):
                    await self._ws.send_str(data)
                else:
                    await self._ws.send_bytes(data)
            except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
                log.info("send failed (%s): the server is gone", exc)
                self.server_closed.set()

    async def _receive(self) -> None:
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    self._on_text(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    self._on_binary(msg.data)
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    break
                async with self._cond:
                    self._cond.notify_all()
        finally:
            self.close_code = self._ws.close_code
            self.server_closed.set()
            async with self._cond:
                self._cond.notify_all()

    def _violation(self, text: str) -> None:
        log.warning("server broke the device protocol: %s", text)
        self.log.errors.append(text)

    def _arrival(self) -> float:
        """When the message received now reaches the firmware: now, plus
        the Wi-Fi link's random delay if one is simulated, never before
        the message ahead of it."""
        now = self.clock.monotonic()
        if self._jitter_mean_s > 0:
            now = max(self._arrived, now + self._rng.expovariate(1 / self._jitter_mean_s))
            self._arrived = now
        return now

    def _on_text(self, data: str) -> None:
        now = self._arrival()
        try:
            message = json.loads(data)
        except ValueError:
            self._violation(f"not JSON: {data[:80]!r}")
            return
        if not isinstance(message, dict) or not isinstance(message.get("type"), str):
            self._violation(f"a message without a string type: {data[:80]!r}")  # the firmware logs and ignores it
            return
        self.log.messages_in.append((now, message))
        kind = message["type"]
        if kind == "hello":
            self._on_hello(message)
        elif kind == "tts":
            if message.get("state") == "start" and self.state in ("idle", "listening"):
                self.speaker.reset(now)  # ResetDecoder
                self._set_state("speaking")
            elif message.get("state") == "stop" and self.state == "speaking":
                if self.mode == "manual":
                    self._set_state("idle")
                else:
                    self._set_state("listening")
                    if self.mode == "auto":  # the audio processor was off: listening starts again
                        start = {"session_id": self.session_id, "type": "listen", "state": "start", "mode": "auto"}
                        self.log.messages_out.append((now, start))
                        self._tasks.append(asyncio.get_running_loop().create_task(self._send(json.dumps(start))))

    def _on_hello(self, message: dict[str, Any]) -> None:
        if message.get("transport") != "websocket":
            self._violation(f"a server hello with transport {message.get('transport')!r} (the firmware wants 'websocket')")
            return
        if isinstance(message.get("session_id"), str):
            self.session_id = message["session_id"]
        params = message.get("audio_params")
        if isinstance(params, dict):
            if isinstance(params.get("sample_rate"), int):
                self.downlink_rate = params["sample_rate"]
            if isinstance(params.get("frame_duration"), int):
                self.downlink_frame_ms = params["frame_duration"]
        if self.server_hello is None:
            self.speaker = DeviceSpeaker(self.downlink_rate)
            self._decoder = OpusDecoder(self.downlink_rate)
        self.server_hello = message
        self._hello_event.set()

    def _on_binary(self, data: bytes) -> None:
        now = self._arrival()
        if self.server_hello is None:
            self._violation(f"a binary message of {len(data)} bytes before the server's hello")
            return
        try:
            frame = framing.parse(data, self.version)
        except framing.FramingError as exc:
            self._violation(f"a bad version {self.version} frame: {exc}")
            return
        if frame.type != framing.TYPE_OPUS:
            self._violation(f"a binary message of type {frame.type} (Opus is {framing.TYPE_OPUS})")
            return
        assert self._decoder is not None
        try:
            pcm = self._decoder.decode(frame.payload)
        except OpusError as exc:
            self.log.received.append(ReceivedPacket(now, len(frame.payload), self.state, None))
            self._violation(f"undecodable downlink audio: {exc}")
            return
        samples = len(pcm) // 2
        expect = self.downlink_rate * self.downlink_frame_ms // 1000
        if abs(samples - expect) > self.downlink_rate // 200 and samples > 0:  # 5 ms of resampler slack
            self._violation(f"a {samples * 1000 // self.downlink_rate} ms packet where the hello announced "
                            f"{self.downlink_frame_ms} ms")
        segment = self.speaker.push(pcm, now) if self.state == "speaking" else None
        end = segment.sound_end if segment is not None else sound_end_s(pcm, self.downlink_rate)
        self.log.received.append(ReceivedPacket(now, len(frame.payload), self.state, segment, samples, end))
