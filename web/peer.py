"""One WebRTC session: an aiortc peer connection, its media and its agent.

:class:`PeerSession` owns the ``RTCPeerConnection``, the paced outbound track,
the events data channel and the :class:`voice.session.AgentSession` task, and
frees all of them exactly once when the peer disconnects, fails, never
connects, goes quiet (no inbound audio for ``media_timeout_s``), or the server
shuts down. The agent (and its speech recogniser) starts only once the peer
is connected, so an offer that never connects costs almost nothing.
"""

from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections import deque
from collections.abc import Callable
from typing import Any

from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack

from clock import Clock
from media.echo_guard import EchoReference
from media.inbound import InboundAudio, set_jitter_prefetch
from media.outbound import PacedAudioTrack
from media.playout import PlayoutBuffer, PlayoutFrame
from turn.conformance import CONFORMANCE
from turn.event_catalogue import AudioEnd, AudioStart
from turn.events import EventFollower, event_json
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import StopReasonKind, TurnKind
from voice.session import AgentSession, Providers
from web.offer_validation import OfferRejected
from web.settings import Settings

log = logging.getLogger(__name__)

#: events kept for a data channel that is not open yet; older ones are dropped
MAX_PENDING_EVENTS = 1000
#: how long a closing session waits for its last events to be sent, seconds
CLOSE_WAIT_S = 0.5
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
#: how often the watchdog looks at the connection, seconds
WATCH_INTERVAL_S = 0.25


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
            text = json.dumps(event, separators=(",", ":"))
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


class PeerSession:
    """Everything held for one connected browser or client.

    Args:
        settings: server settings.
        manager: the Turn Manager.
        providers: this session's STT/LLM/TTS.
        clock: time source.
        on_closed: called once with this session after it has been freed.
        client: the client's address, for per-client limits.
    """

    def __init__(
        self,
        *,
        settings: Settings,
        manager: TurnManager,
        providers: Providers,
        clock: Clock,
        on_closed: Callable[[PeerSession], None],
        client: str = "?",
    ) -> None:
        self.id = uuid.uuid4().hex
        #: the client's address (for per-client limits)
        self.client = client
        #: the peer connection reached "connected" at least once
        self.connected = False
        self.settings = settings
        self.clock = clock
        self.pc = RTCPeerConnection()
        self.events = EventChannel()
        self.events.on_message = self._on_client_message
        self.fence = GenerationFence(clock)
        self.playout = PlayoutBuffer()
        self.outbound = PacedAudioTrack(self.playout, self.fence.passes, clock, on_sent=self._on_sent)
        #: what this session plays, for the echo guard (None: guard off)
        self.echo = EchoReference(settings.bargein.echo_max_delay_ms) if settings.bargein.echo_guard else None
        self._segment: tuple[int, int] | None = None  # (generation, first sample) of the audio going out
        self.providers = providers
        self.manager = manager
        self.log = manager.events.log(self.id, gate=self.fence)
        self.follower = EventFollower(manager.store, self.id, gate=self.fence)
        self._follow_task: asyncio.Task[None] | None = None
        self.agent = AgentSession(
            session_id=self.id,
            manager=manager,
            providers=providers,
            playout=self.playout,
            fence=self.fence,
            clock=clock,
            emit=self.log.emit_event,
            vad=settings.vad,
            config=settings.session,
            plan=settings.plan_for("default"),
        )
        self.inbound: InboundAudio | None = None
        self._track: MediaStreamTrack | None = None
        self._on_closed = on_closed
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

        @self.pc.on("datachannel")
        def _datachannel(channel: RTCDataChannel) -> None:
            self.events.attach(channel)

        @self.pc.on("track")
        def _track(track: MediaStreamTrack) -> None:
            if track.kind == "audio" and self._track is None:
                self._track = track
                self._start_agent()

        @self.pc.on("connectionstatechange")
        def _state() -> None:
            state = self.pc.connectionState
            log.info("session %s: connection %s", self.id, state)
            if state == "connected":
                self.connected = True
                self._start_agent()
            elif state in ("failed", "closed"):
                self.close(StopReasonKind.TRANSPORT_DISCONNECTED)

    def _on_sent(self, frame: PlayoutFrame | None, at: float) -> None:
        """Per 20 ms tick: feed the echo guard what is played, and log where
        agent audio segments start and end on the wire (``audio.start`` /
        ``audio.end``, positions in 48 kHz samples of the turn's audio).
        Cheap unless a segment changes."""
        if self.echo is not None:
            self.echo.played(frame.pcm if frame is not None else None, at)
        gen = frame.generation if frame is not None else None
        current = self._segment
        if current is not None and current[0] == gen:
            return
        emit = self.log.emit_event
        if current is not None:
            end = self.outbound.audit.per_generation.get(current[0])
            emit(AudioEnd(generation=current[0], turn_id=self.agent.turn_id_of(current[0]),
                          samples_sent=end.samples if end else 0))
            self._segment = None
        if frame is not None:
            self._segment = (frame.generation, frame.sample)
            emit(AudioStart(generation=frame.generation, turn_id=self.agent.turn_id_of(frame.generation),
                            sample=frame.sample))

    async def answer(self, sdp: str) -> str:
        """Apply the client's offer and return our answer SDP. The caller
        checks the offer first (:func:`web.offer_validation.validate_offer`);
        what aiortc still refuses is reported the same way.

        Raises:
            OfferRejected: the SDP cannot be parsed or negotiated, or offers
                no audio.
        """
        try:
            await self.pc.setRemoteDescription(RTCSessionDescription(sdp=sdp, type="offer"))
        except Exception as exc:  # aiortc raises ValueError and friends
            raise OfferRejected("invalid_sdp", f"cannot apply offer: {exc}") from exc
        audio = [t for t in self.pc.getTransceivers() if t.kind == "audio"]
        if not audio:
            raise OfferRejected("no_audio", "the offer has no audio m-line")
        set_jitter_prefetch(audio[0].receiver, self.settings.jitter_prefetch_packets)
        self.pc.addTrack(self.outbound)
        try:
            await self.pc.setLocalDescription(await self.pc.createAnswer())
        except Exception as exc:
            raise OfferRejected("invalid_sdp", f"cannot answer offer: {exc}") from exc
        self._watchdog = asyncio.get_running_loop().create_task(self._watch())
        return self.pc.localDescription.sdp

    def _start_agent(self) -> None:
        """Start the agent once there is both an audio track and a connection."""
        if self._task is not None or self._closing is not None or self._track is None:
            return
        if self.pc.connectionState != "connected":
            return
        self.inbound = InboundAudio(
            self._track, self.clock, self.settings.vad, self.settings.bargein, self.echo,
            stall_ms=self.settings.inbound_stall_ms,
        )
        self.agent.reset_detector = self.inbound.detector.reset
        self._task = asyncio.get_running_loop().create_task(self._run(self.inbound), name=f"session-{self.id}")

    async def _follow(self) -> None:
        """Deliver the session's log to the data channel as it grows: the
        client sees only what was persisted, in order."""
        async for batch in self.follower.follow():
            for ev in batch:
                self.events.send(event_json(ev))

    async def _run(self, inbound: InboundAudio) -> None:
        try:
            await self.manager.ensure_session(self.id, kind=TurnKind.VOICE)
            self._follow_task = asyncio.get_running_loop().create_task(self._follow(), name=f"follow-{self.id}")
            await self.agent.run(inbound.frames())
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("session %s: agent failed", self.id)
            self._send_direct("error", code="session_failed", message="the agent stopped working")
        finally:
            # The track ended or the agent failed: nothing more can happen here.
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)

    async def _watch(self) -> None:
        """Close a peer that does not connect within ``connect_timeout_s``, or
        whose audio stops arriving for ``media_timeout_s`` (a client that died
        without saying goodbye; ICE consent would take 30 s to notice)."""
        s = self.settings
        deadline = self.clock.monotonic() + s.connect_timeout_s
        while self.pc.connectionState != "connected":
            if self.clock.monotonic() >= deadline:
                log.info("session %s: not connected after %.1f s, closing", self.id, s.connect_timeout_s)
                self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
                return
            await self.clock.sleep(WATCH_INTERVAL_S)
        if s.media_timeout_s <= 0:
            return
        since = self.clock.monotonic()
        while True:
            await self.clock.sleep(WATCH_INTERVAL_S)
            last = self.inbound.last_frame_at if self.inbound and self.inbound.last_frame_at else since
            if self.clock.monotonic() - last > s.media_timeout_s:
                log.info("session %s: no audio for %.1f s, closing", self.id, s.media_timeout_s)
                self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
                return

    def _on_client_message(self, message: Any) -> None:
        """Client -> server messages on the data channel: JSON objects with a
        string ``type``. Anything else gets an error event; nothing a client
        sends may raise into aiortc's transport loop."""
        try:
            self._handle_client_message(message)
        except Exception:
            log.exception("session %s: client message handling failed", self.id)
            self._send_direct("error", code="bad_message", message="message could not be handled")

    def _send_direct(self, type: str, **fields: Any) -> None:
        """Send an event that is not logged (a reply to a client message,
        the agent's failure), checked against the catalogue as logged ones
        are (:mod:`turn.conformance`).

        Raises:
            turn.event_catalogue.EventMismatch: it does not match, and the
                check is strict (tests).
        """
        CONFORMANCE.check(type, fields)
        self.events.send({"type": type, **fields})

    def _handle_client_message(self, message: Any) -> None:
        if not isinstance(message, str):
            self._send_direct("error", code="bad_message", message="expected a text message (JSON)")
            return
        if len(message) > MAX_CLIENT_MESSAGE:
            self._send_direct("error", code="message_too_large", message=f"messages are at most {MAX_CLIENT_MESSAGE} characters")
            return
        try:
            msg = json.loads(message)
        except (ValueError, RecursionError):
            msg = None
        if not isinstance(msg, dict) or not isinstance(msg.get("type"), str):
            self._send_direct("error", code="bad_message", message="expected a JSON object with a string type")
            return
        kind = msg["type"]
        if kind in ("ptt.start", "ptt.end"):
            # Push-to-talk: start is a committed barge-in, end ends the
            # user's turn at once (voice.session.AgentSession.ptt_start/_end).
            error = self.agent.ptt_start() if kind == "ptt.start" else self.agent.ptt_end()
            if error is not None:
                self._send_direct("error", code=error, message=PTT_ERRORS.get(error, error))
        elif kind == "ping":
            ping_id = msg.get("id")
            self._send_direct("pong", id=ping_id if isinstance(ping_id, (int, float, str)) and len(str(ping_id)) <= 64 else None)
        else:
            shown = kind if len(kind) <= 64 else kind[:61] + "..."
            self._send_direct("error", code="unknown_type", message=f"unknown message type {shown!r}")

    def close(self, reason: StopReasonKind) -> asyncio.Task[None]:
        """Free everything once; later calls return the same closing task."""
        if self._closing is None:
            self.agent.close_reason = reason
            self._closing = asyncio.get_running_loop().create_task(self._close())
        return self._closing

    async def _close(self) -> None:
        try:
            if self._watchdog is not None:
                self._watchdog.cancel()
            if self._task is not None:  # None: the agent never started, no turn opened
                # Stop the agent first: it settles every open turn with
                # close_reason and its last events still reach a client that
                # is there (e.g. on server shutdown).
                self._task.cancel()
                await asyncio.wait({self._task})
                # Log the last events (the settled turns), send them, then close.
                await self.manager.events.close(self.id)
                if self._follow_task is not None:
                    self._follow_task.cancel()
                    await asyncio.wait({self._follow_task})
                    try:
                        for ev in await self.follower.read_available():
                            self.events.send(event_json(ev))
                    except Exception:
                        log.exception("session %s: could not read its last events", self.id)
                await self.events.drain(CLOSE_WAIT_S)
            else:
                await self.manager.events.close(self.id)
            try:
                await self.pc.close()
            except Exception:  # aiortc can trip over offers it half-accepted
                log.exception("session %s: error while closing the peer connection", self.id)
            self.outbound.stop()
        finally:
            # Free the session's big buffers now, not whenever the cyclic GC
            # reaches the session: the reply audio still queued (MBs for a
            # story cut by a hang-up) and the detector's Silero model (to
            # the pool, for the next session).
            self.playout.clear()
            if self.inbound is not None:
                self.inbound.close()
            self.closed.set()
            self._on_closed(self)
