"""The device transport: the transport seam (:class:`voice.transport.Transport`)
over one xiaozhi-esp32 device socket (78/xiaozhi-esp32, docs/websocket.md).

- inbound: each binary message's Opus packet (60 ms at 16 kHz from the
  firmware) is decoded to 16 kHz (:class:`media.opus.OpusDecoder`), cut into
  three 20 ms frames and run through the same barge-in detector path as
  WebRTC's (:func:`media.inbound_frame.analysed_frames`); in ``manual`` and
  ``auto`` modes the firmware's microphone is off while it speaks, and audio
  a device sends then anyway is dropped (barge-in there is the button's),
  in ``realtime`` it is kept and the detector with the echo guard decides;
- output: :class:`media.device_playout.DevicePlayout`: Opus at the
  announced downlink rate, paced with send-ahead; the heard position is
  what was sent minus the send-ahead in flight (no acknowledgements);
- ``tts``: ``start`` goes before the first packet of a generation,
  ``sentence_start`` with each sentence of the reply (from its
  ``agent.delta`` events), ``stop`` when the output is cleared (a barge-in,
  an abort, a stop from the API), when the reply completed (``agent.done``:
  after the device played it) or its turn ended; ``stt`` carries the user's
  transcript;
- controls: ``listen`` and ``abort`` become :class:`voice.transport.Control`
  (see :class:`web.devices.call.DeviceCall`);
- the end: the socket closing (``transport_disconnected``).

Every outbound message goes through one queue written by one task
(:meth:`DeviceTransport.write`), in order; a clear drops the audio still
queued before it, so nothing of an old generation leaves after ``tts stop``.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Literal

from clock import Clock
from media.bargein import BargeInDetector
from media.bargein_config import BargeInConfig
from media.device_playout import DevicePlayout
from media.echo_guard import EchoReference
from media.frames import VAD_RATE, Reframer
from media.inbound_frame import InboundFrame, analysed_frames
from media.opus import OpusDecoder
from media.outbound import Passes
from media.playout import PlayoutBuffer
from media.vad import VadConfig
from turn.models import StopReasonKind, TurnStatus
from voice.text import SentenceSplitter
from voice.transport import CloseNotice, Control, ControlInbox
from web.devices import framing
from web.devices.messages import AudioParams, alert, stt, tts

log = logging.getLogger(__name__)

#: inbound frames waiting for the session, at most (5 s; older are dropped)
MAX_INBOUND_FRAMES = 250
#: controls kept for a session that is starting, at most
MAX_EARLY_CONTROLS = 32
#: outbound messages waiting for the socket, at most (a stuck socket is closed)
MAX_OUTBOUND = 2000

Mode = Literal["manual", "auto", "realtime"]
#: a turn's terminal statuses, as its ``turn`` event names them
TERMINAL = frozenset(s.value for s in TurnStatus if s.is_terminal)


class DeviceTransport:
    """One device as the agent session sees it (see the module doc).

    Args:
        clock: time source.
        passes: the delivery gate's rule (``GenerationFence.passes``).
        send_str / send_bytes: write one text / binary message (awaited by the writer).
        session_id: the session's id (in every message to the device).
        version: the binary protocol version (1, 2 or 3).
        downlink: the audio the server ``hello`` announced.
        send_ahead_ms: see :class:`media.device_playout.DevicePlayout`.
        vad / bargein: the detector's settings (``bargein.echo_guard`` on:
            the echo guard hears what the device is sent).
        stall_ms: a stretch this long with no inbound audio is filled with silence.

    Attributes:
        output: the output sink.
        detector: this device's barge-in detector.
        mode: the ``listen`` mode last started (None: not listening yet).
        wire: every message written: ``(kind, generation, clock seconds)``,
            kind ``audio`` or the JSON type (``tts:stop``...) (latest 20,000).
        dropped_inbound: frames dropped (the session behind, or the mic of
            a speaking device in manual/auto mode).
    """

    kind = "device"

    def __init__(
        self, clock: Clock, passes: Passes, send_str: Callable[[str], Awaitable[None]],
        send_bytes: Callable[[bytes], Awaitable[None]], *, session_id: str, version: int, downlink: AudioParams,
        send_ahead_ms: int = 40, vad: VadConfig | None = None, bargein: BargeInConfig | None = None,
        stall_ms: int = 240,
    ) -> None:
        self.clock = clock
        self.session_id = session_id
        self.version = version
        self._send_str = send_str
        self._send_bytes = send_bytes
        cfg = bargein or BargeInConfig()
        self.echo = EchoReference(cfg.echo_max_delay_ms) if cfg.echo_guard else None
        self.output = DevicePlayout(
            clock, passes, self, sample_rate=downlink.sample_rate, frame_ms=downlink.frame_duration,
            send_ahead_ms=send_ahead_ms, on_played=self.echo.played if self.echo is not None else None,
        )
        self.detector = BargeInDetector(vad, bargein, self.echo)
        self.stall_ms = stall_ms
        self.mode: Mode | None = None
        self.wire: deque[tuple[str, int | None, float]] = deque(maxlen=20_000)
        self.dropped_inbound = 0
        self._decoder = OpusDecoder(VAD_RATE)
        self._reframer = Reframer(VAD_RATE)
        self._inbound: asyncio.Queue[tuple[bytes, float] | None] = asyncio.Queue()
        self._outbound: deque[tuple[str | bytes, str, int | None]] = deque()
        self._wake = asyncio.Event()
        self._controls = ControlInbox()
        self._early: deque[Control] = deque()
        self._closed = CloseNotice()
        #: the generation the device is in ``tts`` speaking state for (None: not speaking)
        self.speaking: int | None = None
        self._sentences: dict[int, tuple[SentenceSplitter, list[str]]] = {}

    # -- inbound, from the socket's reader ---------------------------------------------

    def on_audio(self, packet: bytes) -> None:
        """One Opus packet from the device (the framing's payload).

        Raises:
            media.opus.OpusError: not a decodable Opus packet (nothing of it
                is kept; the decoder goes on with the next).
        """
        pcm = self._decoder.decode(packet)
        if self.speaking is not None and self.mode != "realtime":
            self.dropped_inbound += len(pcm) // 640  # the firmware's mic is off while it speaks: not barge-in
            return
        now = self.clock.monotonic()
        for frame in self._reframer.push(pcm):
            if self._inbound.qsize() >= MAX_INBOUND_FRAMES:
                self.dropped_inbound += 1  # the session is not keeping up: drop, do not grow
                continue
            self._inbound.put_nowait((frame, now))

    def control(self, control: Control) -> None:
        """A control for the session; one given while the session is still
        starting waits for it (the first ``MAX_EARLY_CONTROLS``)."""
        if self._controls.put(control):
            return
        if not self.closed and len(self._early) < MAX_EARLY_CONTROLS:
            self._early.append(control)
        else:
            self.refuse(control, "session_not_ready")

    # -- outbound (media.device_playout.DeviceWire) --------------------------------------

    def send_audio(self, packet: bytes, generation: int) -> None:
        """Queue one Opus packet, after ``tts start`` (and the sentences so
        far) if the device is not speaking ``generation`` yet."""
        if self.speaking != generation:
            self.speaking = generation
            self.send_json(tts(self.session_id, "start"), "tts:start", generation)
            _, held = self._sentences.get(generation, (None, []))
            for text in held:
                self.send_json(tts(self.session_id, "sentence_start", text), "tts:sentence_start", generation)
            held.clear()
        self._queue(framing.frame(packet, self.version), "audio", generation)

    def send_cleared(self) -> None:
        """The output was cleared: audio not yet written is dropped and the
        device told ``tts stop`` (if it was speaking)."""
        if self._outbound:
            self._outbound = deque(m for m in self._outbound if m[1] != "audio")
        self.stop_speaking()

    def stop_speaking(self) -> None:
        """``tts stop`` if the device is in its speaking state."""
        if self.speaking is not None:
            gen, self.speaking = self.speaking, None
            self.send_json(tts(self.session_id, "stop"), "tts:stop", gen)

    def send_json(self, message: dict[str, Any], kind: str, generation: int | None = None) -> None:
        """Queue one JSON message."""
        self._queue(json.dumps(message, ensure_ascii=False), kind, generation)

    def _queue(self, data: str | bytes, kind: str, generation: int | None) -> None:
        if self._closed.reason is not None:
            return
        if len(self._outbound) >= MAX_OUTBOUND:
            log.warning("device %s: %d messages not written; the socket is stuck", self.session_id, len(self._outbound))
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
            return
        self._outbound.append((data, kind, generation))
        self._wake.set()

    async def write(self) -> None:
        """The writer task: the queued messages to the socket, in order,
        until the call ends or the socket fails (then the call ends)."""
        while self._closed.reason is None:
            while self._outbound:
                data, kind, generation = self._outbound.popleft()
                try:
                    if isinstance(data, bytes):
                        await self._send_bytes(data)
                    else:
                        await self._send_str(data)
                except (ConnectionError, RuntimeError) as exc:
                    log.info("device %s: socket closed while writing (%s)", self.session_id, exc)
                    self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
                    return
                self.wire.append((kind, generation, self.clock.monotonic()))
            self._wake.clear()
            await self._wake.wait()

    # -- the seam --------------------------------------------------------------------

    async def frames(self) -> AsyncIterator[InboundFrame]:
        """The device's analysed frames until the socket ends; silence is
        put in for a stall of ``stall_ms`` (the device sends nothing while
        it speaks or idles). The output is paced meanwhile."""
        pacer = asyncio.ensure_future(self.output.run())
        try:
            async for frame in analysed_frames(self.detector, self._inbound, self.clock, self.stall_ms):
                yield frame
        finally:
            pacer.cancel()
            await asyncio.wait({pacer})

    async def controls(self) -> AsyncIterator[Control]:
        """``listen`` and ``abort`` as controls, in order (those given
        before the session took them first)."""
        items = self._controls.items()
        while self._early:
            yield self._early.popleft()
        async for control in items:  # no await between the last early one and taking: none is lost
            yield control

    def refuse(self, control: Control, code: str) -> None:
        """Logged (the firmware has no message for a refused press)."""
        log.info("device %s: %s refused (%s)", self.session_id, control.kind, code)

    def deliver(self, event: dict[str, Any]) -> None:
        """One event of the session's log, in the device's messages:
        ``transcript`` -> ``stt``; ``agent.delta`` -> ``tts sentence_start``
        per sentence; ``agent.done`` and a turn's terminal ``turn`` event ->
        ``tts stop``; ``error`` -> ``alert``. Others are not the device's."""
        kind = event.get("type")
        gen = event.get("generation")
        if kind == "transcript" and event.get("text"):
            self.send_json(stt(self.session_id, str(event["text"])), "stt", gen)
        elif kind == "agent.delta" and isinstance(gen, int):
            self._sentence(gen, str(event.get("text", "")))
        elif kind == "agent.done" or (kind == "turn" and event.get("status") in TERMINAL):
            if gen is not None and gen == self.speaking:
                self.stop_speaking()
            if isinstance(gen, int):
                self._sentences.pop(gen, None)
        elif kind == "error":
            self.send_json(alert(self.session_id, str(event.get("message", ""))[:200]), "alert", gen)

    def _sentence(self, generation: int, token: str) -> None:
        if generation not in self._sentences:
            self._sentences[generation] = (SentenceSplitter(first_words=0), [])  # whole sentences on the screen
            while len(self._sentences) > 8:
                del self._sentences[min(self._sentences)]
        splitter, held = self._sentences[generation]
        for text in splitter.feed(token):
            if self.speaking == generation:
                self.send_json(tts(self.session_id, "sentence_start", text), "tts:sentence_start", generation)
            else:
                held.append(text)  # shown once its audio starts

    def reset_detector(self) -> None:
        """Forget the detector's current run."""
        self.detector.reset()

    def on_close(self, callback: Callable[[StopReasonKind], None]) -> None:
        """Call ``callback`` once with the reason the socket ends for."""
        self._closed.subscribe(callback)

    # -- the end -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """The connection has ended."""
        return self._closed.reason is not None

    def close(self, reason: StopReasonKind) -> bool:
        """The connection ends for ``reason`` (first call only; returns
        False after): subscribers are told, the frames and controls end,
        the writer stops."""
        if not self._closed.close(reason):
            return False
        self._inbound.put_nowait(None)
        self._controls.end()
        self._wake.set()
        return True

    def release(self) -> None:
        """Free the big buffers (queued audio, the detector's model). Idempotent."""
        PlayoutBuffer.clear(self.output)  # the queue only: nothing more goes to a closed socket
        self._outbound.clear()
        self.detector.close()
