"""A simulated phone call: the provider (Twilio or Telnyx media streams) and
the caller on it, against a turnkeeper server's telephony WebSocket.

:class:`PhoneSimulator` opens the stream as the provider would and sends
``connected`` and ``start`` (with custom parameters). Its microphone sends
one ``media`` message of 20 ms (160 bytes of 8 kHz mu-law) every 20 ms at
real time, chunk numbers from 1 and timestamps in ms from the start of the
stream, silence between utterances, as a phone line does. What the server
sends back goes into the provider's playout buffer
(:class:`client.phone_playout.ProviderPlayout`), which plays at real time,
honours ``clear`` and echoes each ``mark`` only once its audio has played.
Everything the caller heard is recorded (silence where nothing played) and
can be written to a WAV; DTMF digits are sent on request, ``stop`` at the
end. With ``reorder`` (Telnyx) some media messages are delivered out of
order, carrying their original chunk, timestamp and sequence number.

Nothing here knows turns or generations: the wire does not carry them.
:mod:`client.phone_call` scripts a call with it and measures it.
"""

from __future__ import annotations

import asyncio
import json
import logging
import random
import wave
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp

from client.phone_dialects import Dialect, ProtocolViolation, ServerClear, ServerMark, ServerMedia
from client.phone_playout import Cleared, ProviderPlayout
from client.results import CallError
from clock import Clock, SystemClock
from media.frames import rms_dbfs
from media.g711 import MULAW_FRAME_BYTES, MULAW_RATE, mulaw_to_pcm, pcm_to_mulaw

log = logging.getLogger(__name__)

FRAME_S = 0.02
SILENCE_DBFS = -50.0  # a played 20 ms frame quieter than this is silence


@dataclass(frozen=True)
class HeardFrame:
    """20 ms the caller heard: when it began playing (clock seconds), its
    stream offset and received bytes (see :class:`client.phone_playout.Tick`),
    level (dBFS RMS) and where its sound ends (ms into the frame, 0 if silent)."""

    at: float
    start: int
    real: int
    dbfs: float
    sound_end_ms: float


@dataclass(frozen=True)
class SentFrame:
    """A microphone frame sent: when (clock seconds), its chunk number, and
    which utterance (index, -1 for line silence) at which 8 kHz sample."""

    at: float
    chunk: int
    utterance: int
    sample: int


@dataclass
class CallLog:
    """What one simulated call saw, in the simulator clock's seconds.

    ``media_in``: (arrival, stream offset, bytes) per server ``media``;
    ``marks_in``: (arrival, stream offset, name); ``echoes``: (sent, name,
    how: ``played`` or ``cleared``); ``clears``: (arrival, what it did);
    ``errors``: the server's protocol violations, as text.
    """

    heard: list[HeardFrame] = field(default_factory=list)
    sent: list[SentFrame] = field(default_factory=list)
    media_in: list[tuple[float, int, int]] = field(default_factory=list)
    marks_in: list[tuple[float, int, str]] = field(default_factory=list)
    echoes: list[tuple[float, str, str]] = field(default_factory=list)
    clears: list[tuple[float, Cleared]] = field(default_factory=list)
    dtmf: list[tuple[float, str]] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)


def sound_end_ms(pcm: bytes, window: int = 40) -> float:
    """Where the sound of an 8 kHz s16 frame ends, ms from its start: the
    end of its last 5 ms window louder than ``SILENCE_DBFS`` (0 if none)."""
    n = len(pcm) // 2
    for start in range((n - 1) // window * window, -1, -window):
        if rms_dbfs(pcm[start * 2 : (start + window) * 2]) > SILENCE_DBFS:
            return min(n, start + window) * 1000 / MULAW_RATE
    return 0.0


class PhoneSimulator:
    """One call: the provider's side of the media stream and the caller.

    Args:
        stream_url: the server's ``ws://`` / ``wss://`` stream URL (or
            ``http(s)://``, turned into ``ws(s)://``).
        dialect: the provider (:class:`client.phone_dialects.TwilioDialect`
            or ``TelnyxDialect``).
        custom_parameters: sent in ``start`` (Twilio's ``<Parameter>``s).
        headers: sent with the upgrade (e.g. ``X-Twilio-Signature``).
        clock: pacing clock (system clock by default).
        reorder: share 0..1 of microphone frames delivered one frame late,
            after the next one (Telnyx does not guarantee order).
        seed: for ``reorder``.
    """

    def __init__(
        self,
        stream_url: str,
        dialect: Dialect,
        *,
        custom_parameters: dict[str, str] | None = None,
        headers: dict[str, str] | None = None,
        clock: Clock | None = None,
        reorder: float = 0.0,
        seed: int = 0,
    ) -> None:
        if stream_url.startswith("http"):
            stream_url = "ws" + stream_url[len("http") :]
        self.stream_url = stream_url
        self.dialect = dialect
        self.custom_parameters = dict(custom_parameters or {})
        self.headers = dict(headers or {})
        self.clock = clock or SystemClock()
        self.reorder = reorder
        self._rng = random.Random(seed)
        self.playout = ProviderPlayout()
        self.log = CallLog()
        self._pcm = bytearray()  # what the caller heard, 8 kHz s16
        self._mic: list[tuple[bytes, int, int]] = []  # (160 mu-law bytes, utterance, sample)
        self._mic_empty = asyncio.Event()
        self._mic_empty.set()
        self._http: aiohttp.ClientSession | None = None
        self._ws: aiohttp.ClientWebSocketResponse | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._receiver: asyncio.Task[None] | None = None
        self._held: dict[str, Any] | Callable[[], dict[str, Any]] | None = None
        self._send_lock = asyncio.Lock()
        #: set when the server closed the socket (or it broke)
        self.server_closed = asyncio.Event()
        #: headers of the upgrade's response (the server's session id)
        self.response_headers: dict[str, str] = {}
        #: seconds (clock) at which the stream started (``start`` sent)
        self.started_at: float | None = None
        self._heard_cond = asyncio.Condition()

    # -- lifecycle ---------------------------------------------------------------

    async def connect(self) -> None:
        """Open the WebSocket, send ``connected`` and ``start``, start the
        microphone, the receiver and the playout.

        Raises:
            CallError: the server refused the upgrade or cannot be reached.
        """
        self._http = aiohttp.ClientSession()
        try:
            self._ws = await self._http.ws_connect(self.stream_url, headers=self.headers, heartbeat=None, max_msg_size=0)
        except aiohttp.WSServerHandshakeError as exc:
            await self._http.close()
            raise CallError(f"{self.stream_url} refused the media stream (HTTP {exc.status})") from exc
        except (aiohttp.ClientError, OSError) as exc:
            await self._http.close()
            raise CallError(f"cannot reach {self.stream_url}: {exc or type(exc).__name__}") from exc
        # aiohttp keeps the upgrade's response on the socket object only
        response = getattr(self._ws, "_response", None)
        self.response_headers = dict(response.headers) if response is not None else {}
        await self._send(self.dialect.connected())
        await self._send(self.dialect.start(self.custom_parameters))
        self.started_at = self.clock.monotonic()
        loop = asyncio.get_running_loop()
        self._receiver = loop.create_task(self._receive())
        self._tasks = [
            loop.create_task(self._microphone(self.started_at)),
            self._receiver,
            loop.create_task(self._play(self.started_at)),
        ]

    async def hangup(self, *, send_stop: bool = True) -> None:
        """End the call: ``stop`` (unless ``send_stop`` is false: a dropped
        line), close the socket, stop the loops. Idempotent."""
        ws = self._ws
        receiver, others = self._receiver, [t for t in self._tasks if t is not self._receiver]
        for t in others:
            t.cancel()
        await asyncio.gather(*others, return_exceptions=True)
        self._tasks = []
        if ws is not None and not ws.closed:
            if send_stop:
                await self._send(self.dialect.stop)
            await ws.close()  # ends the receiver (cancelling a receive would abort the socket)
        if receiver is not None:
            try:
                await asyncio.wait_for(receiver, 5)
            except TimeoutError:
                pass
            self._receiver = None
        if self._http is not None:
            await self._http.close()
            self._http = None

    async def __aenter__(self) -> PhoneSimulator:
        await self.connect()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.hangup()

    # -- the caller ----------------------------------------------------------------

    def say(self, pcm8k: bytes, utterance: int) -> None:
        """Queue 8 kHz mono s16 PCM for the microphone (after what is queued),
        tagged ``utterance`` (>= 0) in :attr:`CallLog.sent`."""
        mulaw = pcm_to_mulaw(pcm8k[: len(pcm8k) // 2 * 2])
        for i in range(0, len(mulaw), MULAW_FRAME_BYTES):
            frame = mulaw[i : i + MULAW_FRAME_BYTES]
            frame += bytes([0xFF]) * (MULAW_FRAME_BYTES - len(frame))
            self._mic.append((frame, utterance, i))
        if self._mic:
            self._mic_empty.clear()

    async def said(self) -> None:
        """Wait until everything queued with :meth:`say` has been sent."""
        await self._mic_empty.wait()

    async def press(self, digit: str) -> None:
        """Send a ``dtmf`` message for ``digit`` (0-9, *, #, A-D)."""
        self.log.dtmf.append((self.clock.monotonic(), digit))
        await self._send(lambda: self.dialect.dtmf(digit))

    def heard_pcm(self) -> bytes:
        """What the caller heard so far: 8 kHz mono s16, from the stream's start."""
        return bytes(self._pcm)

    def write_heard(self, path: Path) -> None:
        """Write :meth:`heard_pcm` to a WAV file (8 kHz mono s16).

        Raises:
            OSError: it cannot be written.
        """
        path.parent.mkdir(parents=True, exist_ok=True)
        with wave.open(str(path), "wb") as w:
            w.setnchannels(1)
            w.setsampwidth(2)
            w.setframerate(MULAW_RATE)
            w.writeframes(bytes(self._pcm))

    async def wait_heard(self, predicate: Any, timeout: float | None = None) -> HeardFrame:
        """Wait for a played frame (after now) for which ``predicate(frame)``
        is true; return it.

        Raises:
            TimeoutError: none within ``timeout`` seconds.
        """
        seen = len(self.log.heard)
        async with asyncio.timeout(timeout):
            async with self._heard_cond:
                while True:
                    for f in self.log.heard[seen:]:
                        if predicate(f):
                            return f
                    seen = len(self.log.heard)
                    await self._heard_cond.wait()

    # -- loops -----------------------------------------------------------------------

    async def _send(self, message: dict[str, Any] | Callable[[], dict[str, Any]]) -> None:
        """Send one message; a callable is built under the send lock, so
        sequence numbers leave in order."""
        if self._ws is None or self._ws.closed:
            return
        async with self._send_lock:
            try:
                await self._ws.send_str(json.dumps(message() if callable(message) else message))
            except (ConnectionError, RuntimeError, aiohttp.ClientError) as exc:
                log.info("send failed (%s): the server is gone", exc)
                self.server_closed.set()

    async def _microphone(self, t0: float) -> None:
        k = 0
        while True:
            await self.clock.sleep(max(0.0, t0 + k * FRAME_S - self.clock.monotonic()))
            if self._mic:
                frame, utt, sample = self._mic.pop(0)
            else:
                frame, utt, sample = bytes([0xFF]) * MULAW_FRAME_BYTES, -1, 0
            if self.reorder:  # numbered as made; delivered perhaps late
                message: dict[str, Any] | Callable[[], dict[str, Any]] = self.dialect.media(k + 1, k * 20, frame)
            else:
                message = lambda k=k, frame=frame: self.dialect.media(k + 1, k * 20, frame)  # noqa: E731
            if self._held is not None:
                held, self._held = self._held, None
                await self._send(message)
                await self._send(held)
            elif self.reorder and self._rng.random() < self.reorder:
                self._held = message
            else:
                await self._send(message)
            self.log.sent.append(SentFrame(self.clock.monotonic(), k + 1, utt, sample))
            if not self._mic:
                self._mic_empty.set()
            k += 1

    async def _receive(self) -> None:
        assert self._ws is not None
        try:
            async for msg in self._ws:
                if msg.type == aiohttp.WSMsgType.TEXT:
                    self._on_text(msg.data)
                elif msg.type == aiohttp.WSMsgType.BINARY:
                    self._violation("a binary frame (the protocol sends JSON text)")
                elif msg.type == aiohttp.WSMsgType.ERROR:
                    break
        finally:
            self.server_closed.set()

    def _violation(self, text: str) -> None:
        log.warning("server broke the %s protocol: %s", self.dialect.name, text)
        self.log.errors.append(text)

    def _on_text(self, data: str) -> None:
        now = self.clock.monotonic()
        try:
            parsed = self.dialect.parse(json.loads(data))
        except ValueError as exc:  # ProtocolViolation, or not JSON
            self._violation(str(exc) if isinstance(exc, ProtocolViolation) else f"not JSON: {data[:80]!r}")
            return
        if isinstance(parsed, ServerMedia):
            at = self.playout.push_media(parsed.payload)
            self.log.media_in.append((now, at, len(parsed.payload)))
        elif isinstance(parsed, ServerMark):
            self.log.marks_in.append((now, self.playout.received, parsed.name))
            self._echo(self.playout.push_mark(parsed.name), "played")
        elif isinstance(parsed, ServerClear):
            cleared = self.playout.clear()
            self.log.clears.append((now, cleared))
            self._echo(cleared.echoes, "cleared")

    def _echo(self, names: list[str], how: str) -> None:
        for name in names:
            self.log.echoes.append((self.clock.monotonic(), name, how))
            task = asyncio.get_running_loop().create_task(self._send(lambda name=name: self.dialect.mark(name)))  # type: ignore[misc]
            self._tasks.append(task)

    async def _play(self, t0: float) -> None:
        k = 0
        while True:
            await self.clock.sleep(max(0.0, t0 + k * FRAME_S - self.clock.monotonic()))
            now = self.clock.monotonic()
            tick = self.playout.tick()
            self._echo(tick.echoes, "played")
            pcm = mulaw_to_pcm(tick.audio)
            self._pcm += pcm
            level = rms_dbfs(pcm)
            self.log.heard.append(HeardFrame(now, tick.start, tick.real, level, sound_end_ms(pcm)))
            async with self._heard_cond:
                self._heard_cond.notify_all()
            self._tasks = [t for t in self._tasks if not t.done()] if k % 50 == 0 else self._tasks
            k += 1
