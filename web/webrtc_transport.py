"""The WebRTC transport: the transport seam (:class:`voice.transport.Transport`)
over one aiortc peer's audio track, its paced outbound track and its
"events" data channel.

- inbound: the remote track read by :class:`media.inbound.InboundAudio`
  (16 kHz mono 20 ms frames through the barge-in detector);
- output: a :class:`media.playout.PlayoutBuffer` drained by a
  :class:`media.outbound.OpusPacedTrack` (it codes its own Opus) through the delivery gate; the
  played position is what left that gate;
- controls: the client's ``ptt.start`` / ``ptt.end`` data-channel messages
  (``ping`` is answered here, anything else refused with an ``error``; a
  message over the rate limits is dropped, the first of a run told an
  ``error`` ``rate_limited``);
- events: compact JSON on the data channel (:class:`EventChannel`).

:class:`web.peer.PeerSession` owns the peer connection and wires this to the
agent session.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
from collections import deque
from collections.abc import AsyncIterator, Callable
from typing import Any

from aiortc import RTCDataChannel

from clock import Clock
from media.inbound import InboundAudio
from media.inbound_frame import InboundFrame
from media.outbound import OpusPacedTrack, Passes, SentHook
from media.playout import PlayoutBuffer
from turn.client_messages import CLIENT_MODEL_OF, Ping, validate_client_message
from turn.conformance import CONFORMANCE
from turn.event_catalogue import EventMismatch
from turn.models import StopReasonKind
from voice.transport import CloseNotice, Control, ControlInbox, ControlKind

log = logging.getLogger(__name__)

#: events kept for a data channel that is not open yet; older ones are dropped
MAX_PENDING_EVENTS = 1000
#: largest client message accepted on the data channel, characters/bytes
MAX_CLIENT_MESSAGE = 16 * 1024
#: largest event sent (SCTP peers must accept 64 KiB; RFC 8831 section 6.6)
MAX_EVENT_BYTES = 64 * 1024
#: what a refused push-to-talk message is told
PTT_ERRORS = {
    "ptt_already_active": "push-to-talk is already held (ptt.start twice)",
    "ptt_not_active": "ptt.end without ptt.start",
    "session_not_ready": "the session is not connected yet",
}


class EventChannel:
    """Sends JSON events on the client's data channel, keeping them (bounded)
    until the channel opens. Never raises into its caller: an event that
    cannot be sent is logged and dropped."""

    def __init__(self) -> None:
        self.channel: RTCDataChannel | None = None
        self._pending: deque[str] = deque(maxlen=MAX_PENDING_EVENTS)
        self.sent = 0
        self.dropped = 0
        self.on_message: Callable[[Any], None] | None = None

    def attach(self, channel: RTCDataChannel) -> None:
        """Use ``channel`` (the client's "events" channel) from now on."""
        self.channel = channel

        @channel.on("open")
        def _open() -> None:
            self._flush()

        @channel.on("message")
        def _message(message: Any) -> None:
            if self.on_message is not None:
                self.on_message(message)

        if channel.readyState == "open":
            self._flush()

    def send(self, event: dict[str, Any]) -> None:
        """Queue ``event`` as compact JSON and send what the channel can take.
        Events larger than ``MAX_EVENT_BYTES`` or not JSON-serialisable are
        dropped (and counted in ``dropped``)."""
        try:
            text = json.dumps(event, separators=(",", ":"), allow_nan=False)  # NaN is not JSON (RFC 8259)
        except (TypeError, ValueError):
            log.exception("event is not JSON: %r", event.get("type"))
            self.dropped += 1
            return
        if len(text.encode()) > MAX_EVENT_BYTES:
            log.warning("dropping %s event of %d bytes", event.get("type"), len(text))
            self.dropped += 1
            return
        self._pending.append(text)
        self._flush()

    async def drain(self, timeout: float) -> None:
        """Wait (at most ``timeout`` seconds) until queued events have been
        handed to SCTP, so closing the connection does not drop them."""
        ch = self.channel
        if ch is None or ch.readyState != "open":
            return
        try:
            async with asyncio.timeout(timeout):
                while ch.bufferedAmount > 0:
                    await asyncio.sleep(0.01)
        except TimeoutError:
            log.info("closing with %d bytes of events unsent", ch.bufferedAmount)

    def _flush(self) -> None:
        ch = self.channel
        if ch is None or ch.readyState != "open":
            return
        while self._pending:
            text = self._pending.popleft()
            try:
                ch.send(text)
                self.sent += 1
            except Exception:  # closing channel, SCTP refused: drop, keep going
                log.exception("could not send an event")
                self.dropped += 1


class WebRtcTransport:
    """One WebRTC client as the agent session sees it (see the module doc).

    Args:
        clock: time source (control arrival, outbound pacing).
        passes: the delivery gate's rule (``GenerationFence.passes``).
        on_sent: the outbound track's per-tick hook (echo reference, audio
            segment events), called with (frame or None, clock seconds).
        name: the session's id, for logs.
        admit_message: asked for each client message; False drops it (over
            a rate limit: :mod:`web.limits`). None: every message is taken.

    Attributes:
        output: the playout buffer (the seam's output sink).
        outbound: the paced track to add to the peer connection.
        events: the data channel's event sender.
        inbound: the inbound audio once :meth:`receive` was called.
    """

    kind = "webrtc"

    def __init__(
        self, clock: Clock, passes: Passes, on_sent: SentHook | None = None, name: str = "?",
        admit_message: Callable[[], bool] | None = None,
    ) -> None:
        self.clock = clock
        #: asked for each client message: False drops it (over a rate limit)
        self.admit_message = admit_message
        self._limited = False  # the last message was dropped over a limit
        self.name = name
        self.output = PlayoutBuffer()
        self.outbound = OpusPacedTrack(self.output, passes, clock, on_sent=on_sent)
        self.events = EventChannel()
        self.events.on_message = self._on_client_message
        self.inbound: InboundAudio | None = None
        self._controls = ControlInbox()
        self._closed = CloseNotice()

    def receive(self, inbound: InboundAudio) -> None:
        """Read the client's audio from ``inbound`` (the remote track's)."""
        self.inbound = inbound

    # -- the seam ----------------------------------------------------------------

    def frames(self) -> AsyncIterator[InboundFrame]:
        """The remote track's analysed frames until it ends.

        Raises:
            RuntimeError: no track was given yet (:meth:`receive`).
        """
        if self.inbound is None:
            raise RuntimeError("no inbound audio: receive() a track first")
        return self.inbound.frames()

    def controls(self) -> AsyncIterator[Control]:
        """``ptt.start`` / ``ptt.end`` from the data channel, in order."""
        return self._controls.items()

    def refuse(self, control: Control, code: str) -> None:
        """An ``error`` event on the data channel (not logged)."""
        try:
            self.tell("error", code=code, message=PTT_ERRORS.get(code, code))
        except Exception:  # an uncatalogued code: never into the session
            log.exception("session %s: could not refuse %s", self.name, control.kind)

    def deliver(self, event: dict[str, Any]) -> None:
        """One logged event on the data channel (:meth:`EventChannel.send`)."""
        self.events.send(event)

    def reset_detector(self) -> None:
        """Forget the inbound detector's current run."""
        if self.inbound is not None:
            self.inbound.detector.reset()

    def on_close(self, callback: Callable[[StopReasonKind], None]) -> None:
        """Call ``callback`` once with the reason :meth:`close` is given."""
        self._closed.subscribe(callback)

    # -- the peer's side ---------------------------------------------------------

    def close(self, reason: StopReasonKind) -> bool:
        """The call ends for ``reason`` (first call only; returns False
        after): subscribers are told, controls end."""
        if not self._closed.close(reason):
            return False
        self._controls.end()
        return True

    def release(self) -> None:
        """Free the big buffers now (the reply audio still queued, the
        detector's Silero model back to its pool). Idempotent."""
        self.output.clear()
        if self.inbound is not None:
            self.inbound.close()

    def tell(self, type: str, **fields: Any) -> None:
        """Send an event that is not logged (a reply to a client message,
        the agent's failure), checked against the catalogue as logged ones
        are (:mod:`turn.conformance`).

        Raises:
            turn.event_catalogue.EventMismatch: it does not match, and the
                check is strict (tests).
        """
        CONFORMANCE.check(type, fields)
        self.events.send({"type": type, **fields})

    def _on_client_message(self, message: Any) -> None:
        """Client -> server messages on the data channel: JSON objects with a
        string ``type``. Anything else gets an error event; nothing a client
        sends may raise into aiortc's transport loop."""
        try:
            self._handle_client_message(message)
        except Exception:
            log.exception("session %s: client message handling failed", self.name)
            self.tell("error", code="bad_message", message="message could not be handled")

    def _handle_client_message(self, message: Any) -> None:
        if self.admit_message is not None and not self.admit_message():
            if not self._limited:  # told once a run: a flood is not answered with a flood
                self._limited = True
                self.tell("error", code="rate_limited", message="too many messages: dropped; slow down")
            return
        self._limited = False
        if not isinstance(message, str):
            self.tell("error", code="bad_message", message="expected a text message (JSON)")
            return
        if len(message) > MAX_CLIENT_MESSAGE:
            self.tell("error", code="message_too_large", message=f"messages are at most {MAX_CLIENT_MESSAGE} characters")
            return
        try:
            msg = json.loads(message, parse_constant=_no_constant, parse_float=_finite_float)
        except (ValueError, RecursionError):
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            self.tell("error", code="bad_message", message="expected a JSON object with a string type")
            return
        kind = msg["type"]
        if kind not in CLIENT_MODEL_OF:
            shown = kind if len(kind) <= 64 else kind[:61] + "..."
            self.tell("error", code="unknown_type", message=f"unknown message type {shown!r}")
            return
        try:
            parsed = validate_client_message(msg)  # the catalogue: turn/client_messages.py
        except EventMismatch as exc:
            self.tell("error", code="bad_message", message="; ".join(exc.problems)[:200])
            return
        if isinstance(parsed, Ping):
            ping_id = parsed.id
            self.tell("pong", id=ping_id if not isinstance(ping_id, str) or len(ping_id) <= 64 else None)
        else:
            # Push-to-talk: start is a committed barge-in, end ends the
            # user's turn at once (voice.session.AgentSession.ptt_start/_end).
            control = Control(ControlKind(kind), self.clock.monotonic())
            if not self._controls.put(control):
                self.refuse(control, "session_not_ready")


def _no_constant(name: str) -> float:
    """``json.loads`` hook: NaN and Infinity are not JSON (RFC 8259 section 6).

    Raises:
        ValueError: always.
    """
    raise ValueError(f"{name} is not a JSON number")


def _finite_float(text: str) -> float:
    """``json.loads`` hook: a number too large for a double (``1e999``) is refused,
    not read as infinity.

    Raises:
        ValueError: the number is not finite as a double.
    """
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:20]} does not fit a double")
    return value
