"""The phone transport: the transport seam (:class:`voice.transport.Transport`)
over one telephony media stream (a provider's WebSocket, in its dialect).

- inbound: each ``media`` message (160 bytes of mu-law 8 kHz, 20 ms) is put
  back in order if the dialect needs it (:class:`media.reorder.ReorderBuffer`),
  decoded and resampled to 16 kHz (:class:`media.g711.MulawDecoder`), cut
  into 20 ms frames and run through the same barge-in detector path as
  WebRTC's (:func:`media.inbound_frame.analyse_frame`); a stretch with no
  audio is filled with silence so the detector's timers run on;
- output: :class:`media.telephony_playout.TelephonyPlayout`: paced 20 ms
  ``media`` messages with send-ahead, marks, and ``clear`` in the same step
  as the fence; the heard position is the marks' account;
- controls: ``dtmf`` keys (:class:`voice.transport.Control` ``dtmf``);
- events: a phone has no event channel: the session's log is the record
  (read it through the REST API); :meth:`PhoneTransport.deliver` counts;
- the end: ``stop`` or the socket closing (``transport_disconnected``).

Every outbound message goes through one queue written by one task
(:meth:`PhoneTransport.write`), in order; a ``clear`` drops the media and
marks still queued before it, so nothing of an old generation leaves after
it. Protocol parsing is the dialect's (:mod:`web.telephony.dialect`).
"""

from __future__ import annotations

import asyncio
import logging
from collections import deque
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any

from clock import Clock
from media.bargein import BargeInDetector
from media.bargein_config import BargeInConfig
from media.frames import VAD_RATE, Reframer
from media.g711 import MulawDecoder
from media.inbound_frame import InboundFrame, analysed_frames
from media.outbound import Passes
from media.playout import PlayoutBuffer
from media.reorder import ReorderBuffer
from media.telephony_playout import SegmentHook, TelephonyPlayout
from media.vad import VadConfig
from turn.models import StopReasonKind
from voice.transport import CloseNotice, Control, ControlInbox, ControlKind
from web.telephony.dialect import Dialect, Dtmf, Mark, Media, dumps

log = logging.getLogger(__name__)

#: inbound frames waiting for the session, at most (5 s; newer ones are dropped while it is full)
MAX_INBOUND_FRAMES = 250
#: keys kept for a session that is starting, at most
MAX_EARLY_KEYS = 32
#: outbound messages waiting for the socket, at most (a stuck socket is closed)
MAX_OUTBOUND = 2000


@dataclass(frozen=True)
class WireRecord:
    """One message as it was written to the socket (for tests and audits).

    Attributes:
        kind: ``media``, ``mark`` or ``clear``.
        generation: the generation of a media message or mark (None for clear).
        at: clock seconds when it was written.
        name: a mark's name.
    """

    kind: str
    generation: int | None
    at: float
    name: str = ""


class PhoneTransport:
    """One phone call as the agent session sees it (see the module doc).

    Args:
        clock: time source.
        passes: the delivery gate's rule (``GenerationFence.passes``).
        dialect: the provider's JSON.
        send: writes one text message to the socket (awaited by the writer).
        vad / bargein: the detector's settings.
        send_ahead_ms / mark_every_ms: see :class:`media.telephony_playout.TelephonyPlayout`.
        stall_ms: a stretch this long with no inbound audio is filled with
            silence (0: never).
        name: the session's id, for logs.
        on_segment: see :class:`media.telephony_playout.TelephonyPlayout`.

    Attributes:
        output: the output sink.
        detector: this stream's barge-in detector.
        stream_id: the provider's stream id once ``start`` came.
        wire: every message written, in order (bounded to the latest 20,000).
        delivered: events handed to :meth:`deliver` (not sent: no channel).
    """

    kind = "telephony"

    def __init__(
        self, clock: Clock, passes: Passes, dialect: Dialect, send: Callable[[str], Awaitable[None]], *,
        vad: VadConfig | None = None, bargein: BargeInConfig | None = None, send_ahead_ms: int = 60,
        mark_every_ms: int = 200, stall_ms: int = 240, name: str = "?", on_segment: SegmentHook | None = None,
    ) -> None:
        self.clock = clock
        self.dialect = dialect
        self.name = name
        self._send = send
        self.output = TelephonyPlayout(
            clock, passes, self, send_ahead_ms=send_ahead_ms, mark_every_ms=mark_every_ms, on_segment=on_segment
        )
        self.detector = BargeInDetector(vad, bargein)
        self.stream_id: str | None = None
        self.wire: deque[WireRecord] = deque(maxlen=20_000)
        self.delivered = 0
        self.stall_ms = stall_ms
        self.dropped_inbound = 0
        self._decoder = MulawDecoder(VAD_RATE)
        self._reframer = Reframer(VAD_RATE)
        self._reorder: ReorderBuffer[bytes] | None = ReorderBuffer() if dialect.reorders else None
        self._inbound: asyncio.Queue[tuple[bytes, float] | None] = asyncio.Queue()
        self._outbound: deque[tuple[str, WireRecord]] = deque()
        self._wake = asyncio.Event()
        self._controls = ControlInbox()
        self._early: deque[Control] = deque()
        self._closed = CloseNotice()

    # -- inbound, from the socket's reader ------------------------------------------

    def started(self, stream_id: str) -> None:
        """``start`` came: messages are addressed to ``stream_id`` from now on."""
        self.stream_id = stream_id

    def on_media(self, media: Media) -> None:
        """One caller's 20 ms (reordered first if the dialect needs it)."""
        payloads = [media.payload] if self._reorder is None else self._reorder.push(media.chunk, media.payload)
        now = self.clock.monotonic()
        for payload in payloads:
            for pcm in self._reframer.push(self._decoder.decode(payload)):
                if self._inbound.qsize() >= MAX_INBOUND_FRAMES:
                    self.dropped_inbound += 1  # the session is not keeping up: drop, do not grow
                    continue
                self._inbound.put_nowait((pcm, now))

    def on_dtmf(self, dtmf: Dtmf) -> None:
        """A key: a ``dtmf`` control for the session. One pressed before the
        session takes controls (it is starting) waits for it (the first
        ``MAX_EARLY_KEYS``); after the call ended it is refused."""
        control = Control(ControlKind.DTMF, self.clock.monotonic(), dtmf.digit)
        if self._controls.put(control):
            return
        if self._closed.reason is None and len(self._early) < MAX_EARLY_KEYS:
            self._early.append(control)
        else:
            self.refuse(control, "session_not_ready")

    def on_mark(self, mark: Mark) -> None:
        """The provider echoed a mark."""
        if not self.output.on_mark(mark.name):
            log.debug("call %s: mark %r not counted (cleared or unknown)", self.name, mark.name[:40])

    # -- outbound (media.telephony_playout.Wire) ---------------------------------------

    def send_media(self, payload: bytes, generation: int) -> None:
        """Queue one ``media`` message."""
        self._queue(self.dialect.media(self._sid, payload), WireRecord("media", generation, 0.0))

    def send_mark(self, name: str, generation: int) -> None:
        """Queue one ``mark`` message."""
        self._queue(self.dialect.mark(self._sid, name), WireRecord("mark", generation, 0.0, name))

    def send_clear(self) -> None:
        """Queue ``clear``, dropping media and marks queued before it (the
        provider would discard them anyway; nothing old leaves after it)."""
        if self._outbound:
            self._outbound = deque(m for m in self._outbound if m[1].kind == "clear")
        self._queue(self.dialect.clear(self._sid), WireRecord("clear", None, 0.0))

    @property
    def _sid(self) -> str:
        return self.stream_id or ""

    def _queue(self, message: dict[str, Any], record: WireRecord) -> None:
        if self._closed.reason is not None:
            return
        if len(self._outbound) >= MAX_OUTBOUND:
            log.warning("call %s: %d messages not written; the socket is stuck", self.name, len(self._outbound))
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
            return
        self._outbound.append((dumps(message), record))
        self._wake.set()

    async def write(self) -> None:
        """The writer task: the queued messages to the socket, in order,
        until the call ends or the socket fails (then the call ends)."""
        while self._closed.reason is None:
            while self._outbound:
                text, record = self._outbound.popleft()
                try:
                    await self._send(text)
                except (ConnectionError, RuntimeError) as exc:
                    log.info("call %s: socket closed while writing (%s)", self.name, exc)
                    self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
                    return
                self.wire.append(WireRecord(record.kind, record.generation, self.clock.monotonic(), record.name))
            self._wake.clear()
            await self._wake.wait()

    # -- the seam --------------------------------------------------------------------

    async def frames(self) -> AsyncIterator[InboundFrame]:
        """The caller's analysed frames until the call ends; a stretch of
        ``stall_ms`` of the clock with no audio yields that much silence
        (``filled``), so the detector's and endpointer's timers run on. The
        output is paced meanwhile."""
        pacer = asyncio.ensure_future(self.output.run())
        try:
            async for frame in analysed_frames(self.detector, self._inbound, self.clock, self.stall_ms):
                yield frame
        finally:
            pacer.cancel()
            await asyncio.wait({pacer})

    async def controls(self) -> AsyncIterator[Control]:
        """The caller's DTMF keys, in order (those pressed before the
        session took them first)."""
        items = self._controls.items()
        while self._early:
            yield self._early.popleft()
        async for control in items:  # no await between the last early key and taking: none is lost
            yield control

    def refuse(self, control: Control, code: str) -> None:
        """Logged: a phone has no channel to say it on."""
        log.info("call %s: %s refused (%s)", self.name, control.kind, code)

    def deliver(self, event: dict[str, Any]) -> None:
        """Counted only: a phone call has no event channel (the log is the record)."""
        self.delivered += 1

    def reset_detector(self) -> None:
        """Forget the detector's current run."""
        self.detector.reset()

    def on_close(self, callback: Callable[[StopReasonKind], None]) -> None:
        """Call ``callback`` once with the reason the call ends for."""
        self._closed.subscribe(callback)

    # -- the end -----------------------------------------------------------------------

    @property
    def closed(self) -> bool:
        """The call has ended."""
        return self._closed.reason is not None

    def close(self, reason: StopReasonKind) -> bool:
        """The call ends for ``reason`` (first call only; returns False
        after): subscribers are told, the frames and controls end, the
        writer stops."""
        if not self._closed.close(reason):
            return False
        self._inbound.put_nowait(None)
        self._controls.end()
        self._wake.set()
        return True

    def release(self) -> None:
        """Free the big buffers (queued audio, the detector's model), and log
        what the caller's audio lost on the way (dropped, late, duplicate or
        lost frames), if anything. Idempotent."""
        r = self._reorder
        if self.dropped_inbound or (r is not None and (r.late or r.lost or r.duplicates or r.resyncs)):
            log.warning(
                "stream %s: inbound frames dropped %d (session behind), late %d, lost %d, duplicates %d, resyncs %d",
                self.stream_id, self.dropped_inbound, r.late if r else 0, r.lost if r else 0,
                r.duplicates if r else 0, r.resyncs if r else 0,
            )
            self.dropped_inbound = 0
            if r is not None:
                r.late = r.lost = r.duplicates = r.resyncs = 0
        PlayoutBuffer.clear(self.output)  # the queue only: no ``clear`` on a closed socket
        self._outbound.clear()
        self.detector.close()
