"""One WebRTC session: an aiortc peer connection, its media and its agent.

:class:`PeerSession` owns the ``RTCPeerConnection``, the
:class:`web.webrtc_transport.WebRtcTransport` the agent runs on (the paced
outbound track, the events data channel, the inbound audio) and the
:class:`voice.session.AgentSession` task, and
frees all of them exactly once when the peer disconnects, fails, never
connects, goes quiet (no inbound audio for ``media_timeout_s``), or the server
shuts down. The agent (and its speech recogniser) starts only once the peer
is connected, so an offer that never connects costs almost nothing.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from aiortc import RTCDataChannel, RTCPeerConnection, RTCSessionDescription
from aiortc.mediastreams import MediaStreamTrack

from clock import Clock
from media.echo_guard import EchoReference
from media.inbound import InboundAudio, set_jitter_prefetch
from media.playout import PlayoutFrame
from turn.event_catalogue import AudioEnd, AudioStart
from turn.events import EventFollower, event_json
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import Plan, StopReasonKind, TurnKind
from voice.session import AgentSession, Providers
from web.limits import Limits
from web.offer_validation import OfferRejected
from web.rate_limit import TokenBucket
from web.settings import Settings
from web.webrtc_transport import WebRtcTransport

log = logging.getLogger(__name__)

#: how long a closing session waits for its last events to be sent, seconds
CLOSE_WAIT_S = 0.5
#: how often the watchdog looks at the connection, seconds
WATCH_INTERVAL_S = 0.25


class PeerSession:
    """Everything held for one connected browser or client.

    Args:
        settings: server settings.
        manager: the Turn Manager.
        providers: this session's STT/LLM/TTS.
        clock: time source.
        on_closed: called once with this session after it has been freed.
        client: the client's address, for per-client limits.
        tenant: whose session it is (its plan and per-tenant limits).
        limits: the server's per-tenant and per-address limits (None: only
            ``limits.datachannel_messages_per_s`` of this session holds).
        session_id: its id (a client token's); None: a new random one.
        plan: the limits of its turns (None: the tenant's plan).
        instructions: the system message of its model requests (None: none).
        user_id: the app's id of its user (from the client token), or None.
        echo_cancellation: what the client declared of its microphone's
            echo canceller (:meth:`media.bargein_config.BargeInConfig.for_client`).
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
        tenant: str = "default",
        limits: Limits | None = None,
        session_id: str | None = None,
        plan: Plan | None = None,
        instructions: str | None = None,
        user_id: str | None = None,
        echo_cancellation: bool | None = None,
    ) -> None:
        self.id = session_id or uuid.uuid4().hex
        self.user_id = user_id
        #: the client's address (for per-client limits)
        self.client = client
        #: its tenant (plan, per-tenant limits)
        self.tenant = tenant
        self._limits = limits
        rate = settings.limits.datachannel_messages_per_s
        self._messages = TokenBucket(rate, max(1.0, rate)) if rate > 0 else None  # a second's worth at once
        #: the peer connection reached "connected" at least once
        self.connected = False
        self.settings = settings
        #: the barge-in detector's configuration for this client
        self.bargein = settings.bargein.for_client(echo_cancellation)
        self.clock = clock
        self.pc = RTCPeerConnection()
        self.fence = GenerationFence(clock)
        #: the seam the agent runs on: audio in and out, controls, events
        self.transport = WebRtcTransport(clock, self.fence.passes, on_sent=self._on_sent, name=self.id,
                                         admit_message=self._admit_message)
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
            transport=self.transport,
            fence=self.fence,
            clock=clock,
            emit=self.log.emit_event,
            vad=settings.vad,
            config=settings.session,
            plan=plan or settings.plan_for(tenant),
            instructions=instructions,
        )
        self._track: MediaStreamTrack | None = None
        self._on_closed = on_closed
        self._task: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None
        self.closed = asyncio.Event()

        @self.pc.on("datachannel")
        def _datachannel(channel: RTCDataChannel) -> None:
            self.transport.events.attach(channel)

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

    def _admit_message(self) -> bool:
        """One data-channel message within this session's rate and its
        tenant's and address's (:mod:`web.limits`)?"""
        if self._messages is not None and not self._messages.take(self.clock.monotonic()):
            return False
        return self._limits is None or self._limits.allows("message", tenant=self.tenant, client=self.client)

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
            end = self.transport.outbound.audit.per_generation.get(current[0])
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
        self.pc.addTrack(self.transport.outbound)
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
        self.transport.receive(InboundAudio(
            self._track, self.clock, self.settings.vad, self.bargein, self.echo,
            stall_ms=self.settings.inbound_stall_ms,
        ))
        self._task = asyncio.get_running_loop().create_task(self._run(), name=f"session-{self.id}")

    async def _follow(self) -> None:
        """Deliver the session's log to the transport as it grows: the
        client sees only what was persisted, in order."""
        async for batch in self.follower.follow():
            for ev in batch:
                self.transport.deliver(event_json(ev))

    async def _run(self) -> None:
        try:
            await self.manager.ensure_session(self.id, tenant_id=self.tenant, kind=TurnKind.VOICE)
            self._follow_task = asyncio.get_running_loop().create_task(self._follow(), name=f"follow-{self.id}")
            await self.agent.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("session %s: agent failed", self.id)
            self.transport.tell("error", code="session_failed", message="the agent stopped working")
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
            inbound = self.transport.inbound
            last = inbound.last_frame_at if inbound and inbound.last_frame_at else since
            if self.clock.monotonic() - last > s.media_timeout_s:
                log.info("session %s: no audio for %.1f s, closing", self.id, s.media_timeout_s)
                self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
                return

    def close(self, reason: StopReasonKind) -> asyncio.Task[None]:
        """Free everything once; later calls return the same closing task."""
        if self._closing is None:
            self.transport.close(reason)  # the agent's close_reason is now ``reason``
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
                            self.transport.deliver(event_json(ev))
                    except Exception:
                        log.exception("session %s: could not read its last events", self.id)
                await self.transport.events.drain(CLOSE_WAIT_S)
            else:
                await self.manager.events.close(self.id)
            try:
                await self.pc.close()
            except Exception:  # aiortc can trip over offers it half-accepted
                log.exception("session %s: error while closing the peer connection", self.id)
            self.transport.outbound.stop()
        finally:
            # Free the session's big buffers now, not whenever the cyclic GC
            # reaches the session: the reply audio still queued (MBs for a
            # story cut by a hang-up) and the detector's Silero model (to
            # the pool, for the next session).
            self.transport.release()
            self.closed.set()
            self._on_closed(self)
