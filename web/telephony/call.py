"""One phone call: a provider's media-stream WebSocket, its
:class:`web.telephony.transport.PhoneTransport` and the voice session on it.

:class:`PhoneCall` reads the socket (:meth:`PhoneCall.run`), hands each
message to its dialect and the transport, starts the agent once ``start``
names the stream (and, if it names a tenant, carries our signature for it),
and frees everything once when the stream stops, the socket closes, the
protocol is broken beyond recovery, or the server shuts down. A call is a
voice session like a WebRTC one: same Turn Manager, plan, ledger and log.

Bad input (each a test in tests/web/test_telephony_bad_input.py): a message
that is not JSON, an unknown event, bad base64, a payload that is not 160
bytes, a message for another stream, media before ``start``: logged and
dropped, the call goes on. A ``start`` we cannot serve (another format, a
forged tenant), more than ``max_messages_per_s`` messages in a second, a
frame over ``max_message_bytes``, too many bad messages, no ``start`` within
``connect_timeout_s``, a tenant over its limits (:mod:`web.limits`:
concurrent sessions, starts a minute at ``start``; its streams' messages a
second together): logged, the socket closed (1008 policy violation /
1009 too big), the call's turns settled; a stream silent for
``media_timeout_s`` is closed too (a provider sends silence as audio).
"""

from __future__ import annotations

import asyncio
import dataclasses
import hashlib
import logging
import uuid
from collections.abc import Callable
from datetime import UTC, datetime

from aiohttp import WSCloseCode, WSMsgType, web

from clock import Clock
from turn.event_catalogue import AudioEnd, AudioStart
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import StopReasonKind, TurnKind
from voice.session import AgentSession, Providers
from web.errors import ApiError
from web.limits import Limits
from web.rate_limit import TokenBucket
from web.settings import Settings
from web.telephony.dialect import Connected, Dialect, Dtmf, Mark, Media, ProtocolError, Start, Stop, loads
from web.telephony.signature import TENANT_PARAM, TENANT_SIG_TTL_S, TENANT_TS_PARAM, TenantSigner
from web.telephony.transport import PhoneTransport

log = logging.getLogger(__name__)

#: bad messages a call may send before its socket is closed
#: bad messages a socket may send at once before it is closed, and how many a
#: second it may go on sending (an occasional bad one never closes a long call)
MAX_BAD_MESSAGES = 100
BAD_MESSAGES_PER_S = 1.0
#: how often the watchdog looks at the stream, s
WATCH_INTERVAL_S = 0.25
#: how long a closing call waits for its agent to settle its turns, s
SETTLE_WAIT_S = 10.0


class PhoneCall:
    """One call (see the module doc).

    Args:
        settings: server settings.
        manager: the Turn Manager.
        providers: this call's STT/LLM/TTS.
        clock: time source.
        ws: the provider's WebSocket (prepared).
        dialect: its JSON.
        signer: checks the tenant our webhook signed into the stream's parameters.
        on_closed: called once with this call after it has been freed.
        client: the provider's address.
        limits: the per-tenant limits; once ``start`` names the tenant its
            messages count towards ``limits.messages_per_s_per_tenant``
            (None: only this call's own rate holds).
        admit_tenant: called with the tenant ``start`` names, before the
            agent is made; its :class:`web.errors.ApiError` (the tenant's
            quota or start rate) closes the stream 1008 ``rate_limited``.

    Attributes:
        errors: the code of every bad message, in order (the latest 1000).
        close_code: the WebSocket close code we closed with (None: not us).
    """

    def __init__(
        self, *, settings: Settings, manager: TurnManager, providers: Providers, clock: Clock,
        ws: web.WebSocketResponse, dialect: Dialect, signer: TenantSigner, on_closed: Callable[[PhoneCall], None],
        client: str = "?", limits: Limits | None = None, admit_tenant: Callable[[str], None] | None = None,
    ) -> None:
        self.id = uuid.uuid4().hex
        self.client = client
        self._limits = limits
        self._admit_tenant = admit_tenant
        #: False until ``start`` names the stream: until then the call counts
        #: as connecting (``max_pending_sessions``, ``max_pending_per_client``)
        self.connected = False
        self.settings = settings
        self.manager = manager
        # telephone audio has nothing above 4 kHz: an embedded recogniser gets the band filled
        self.providers = dataclasses.replace(providers, narrowband=True)
        self.clock = clock
        self.ws = ws
        self.dialect = dialect
        self._signer = signer
        self._on_closed = on_closed
        self.fence = GenerationFence(clock)
        t = settings.telephony
        self.transport = PhoneTransport(
            clock, self.fence.passes, dialect, ws.send_str, vad=settings.vad, bargein=settings.bargein,
            send_ahead_ms=t.send_ahead_ms, mark_every_ms=t.mark_every_ms, stall_ms=settings.inbound_stall_ms,
            name=self.id, on_segment=self._on_segment,
        )
        self.log = manager.events.log(self.id, gate=self.fence)
        self.agent: AgentSession | None = None
        self.tenant: str | None = None
        #: (call id, Unix s) of the signed tenant it started with: claimed in the store until then
        self._signed_until: tuple[str, int] | None = None
        self.errors: list[str] = []
        self.close_code: int | None = None
        #: the close frame's reason: the error's code when a bad message closed it
        self.close_message = b"call ended"
        self._task: asyncio.Task[None] | None = None
        self._writer: asyncio.Task[None] | None = None
        self._watchdog: asyncio.Task[None] | None = None
        self._last_media_at = clock.monotonic()
        self._closing: asyncio.Task[None] | None = None
        limit = settings.telephony.max_messages_per_s
        self._messages = TokenBucket(limit, limit)  # a second's worth at once, the rate on average
        self._bad_budget = TokenBucket(BAD_MESSAGES_PER_S, MAX_BAD_MESSAGES)
        self.closed = asyncio.Event()

    # -- the socket ---------------------------------------------------------------------

    async def run(self) -> None:
        """Read the socket until it closes or the call ends, then free the
        call (its turns settled). The WebSocket handler awaits this."""
        loop = asyncio.get_running_loop()
        self._writer = loop.create_task(self.transport.write(), name=f"call-writer-{self.id}")
        self._watchdog = loop.create_task(self._watch(), name=f"call-watch-{self.id}")
        try:
            async for msg in self.ws:
                if msg.type is WSMsgType.TEXT:
                    self._on_text(msg.data)
                elif msg.type is WSMsgType.BINARY:
                    self._bad(ProtocolError("binary", "binary frames are not part of the protocol: JSON text only"))
                elif msg.type is WSMsgType.ERROR:
                    log.warning("call %s: socket error: %s", self.id, self.ws.exception())
                    break
                if self._closing is not None:
                    break
            else:  # the socket closed under us: no ``stop``, not our close
                if self._closing is None:
                    log.warning("call %s: the socket closed without a stop (close code %s)", self.id, self.ws.close_code)
        finally:
            await asyncio.shield(self.close(StopReasonKind.TRANSPORT_DISCONNECTED))

    async def _watch(self) -> None:
        """Close a stream that sends no ``start`` within ``connect_timeout_s``,
        or no media for ``media_timeout_s`` once started (a provider
        sends the caller's line every 20 ms, silence included)."""
        s = self.settings
        opened = self.clock.monotonic()
        while True:
            await self.clock.sleep(WATCH_INTERVAL_S)
            now = self.clock.monotonic()
            if self.transport.stream_id is None:
                if now - opened > s.connect_timeout_s:
                    self._bad(ProtocolError("no_start", f"no start within {s.connect_timeout_s:g} s", fatal=True))
                    return
            elif s.media_timeout_s > 0 and now - self._last_media_at > s.media_timeout_s:
                log.info("call %s: nothing received for %.1f s, closing", self.id, s.media_timeout_s)
                self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
                return

    def _on_text(self, data: str) -> None:
        """One text message: rate-checked, parsed, handed on. Nothing here
        raises into the reader."""
        if not self._messages.take(self.clock.monotonic()):
            self._bad(ProtocolError(
                "flood", f"more than {self.settings.telephony.max_messages_per_s} messages a second "
                "(20 ms media is 50 a second)", fatal=True,
            ))
            return
        if self.tenant is not None and self._limits is not None and not self._limits.allows("message", tenant=self.tenant):
            self._bad(ProtocolError(
                "rate_limited", f"the tenant's streams send more than {self._limits.settings.messages_per_s_per_tenant:g} "
                "messages a second together", fatal=True,
            ))
            return
        try:
            self._handle(self.dialect.parse(loads(data)))
        except ProtocolError as exc:
            self._bad(exc)
        except Exception:
            log.exception("call %s: message handling failed", self.id)
            self._bad(ProtocolError("internal", "message could not be handled"))

    def _handle(self, event: Connected | Start | Media | Dtmf | Mark | Stop) -> None:
        t = self.transport
        if isinstance(event, Connected):
            return
        if isinstance(event, Start):
            self._start(event)
            return
        if t.stream_id is None:
            if isinstance(event, Stop):
                self.close(StopReasonKind.TRANSPORT_DISCONNECTED)
                return
            raise ProtocolError("before_start", f"{type(event).__name__.lower()} before start: dropped")
        if event.stream_id is not None and event.stream_id != t.stream_id:
            raise ProtocolError(
                "stream_mismatch", f"message for stream {event.stream_id[:40]!r} on stream {t.stream_id!r}: dropped"
            )
        if isinstance(event, Media):
            # only the caller's audio keeps a call alive (a provider sends it
            # every 20 ms, silence included): mark echoes and bad messages do not
            self._last_media_at = self.clock.monotonic()
            t.on_media(event)
        elif isinstance(event, Dtmf):
            t.on_dtmf(event)
        elif isinstance(event, Mark):
            t.on_mark(event)
        else:
            log.info("call %s: stream stopped by the provider", self.id)
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)

    def _start(self, start: Start) -> None:
        if self.transport.stream_id is not None:
            raise ProtocolError("duplicate_start", "a second start on one stream: ignored")
        # our TwiML always names the tenant: once Twilio is authenticated, a start without it is refused
        required = self.dialect.name == "twilio" and bool(self.settings.telephony.twilio_auth_token)
        tenant = self._signer.tenant_of(start.parameters, start.call_id, self.clock.now().timestamp(), required=required)
        if tenant is None:
            raise ProtocolError(
                "bad_tenant", "the stream names a tenant without our valid signature for this call "
                "(missing, wrong, expired, or used by another stream)", fatal=True,
            )
        if self._admit_tenant is not None:
            try:
                self._admit_tenant(tenant)  # before anything of the session is made
            except ApiError as exc:
                raise ProtocolError("rate_limited", f"tenant {tenant!r} is over a limit ({exc.message})", fatal=True) from None
        self.tenant = tenant
        issued = start.parameters.get(TENANT_TS_PARAM, "")
        if TENANT_PARAM in start.parameters and issued.isdigit():
            self._signed_until = (start.call_id, int(issued) + TENANT_SIG_TTL_S + 1)
        self.connected = True
        self.transport.started(start.stream_id)
        self.agent = AgentSession(
            session_id=self.id, manager=self.manager, providers=self.providers, transport=self.transport,
            fence=self.fence, clock=self.clock, emit=self.log.emit_event, vad=self.settings.vad,
            config=self.settings.session, plan=self.settings.plan_for(tenant),
        )
        log.info("call %s: %s stream %s of call %s (tenant %s)", self.id, self.dialect.name, start.stream_id,
                 start.call_id, tenant)
        self._task = asyncio.get_running_loop().create_task(self._run_agent(), name=f"call-{self.id}")

    def _bad(self, exc: ProtocolError) -> None:
        """A bad message: logged with its code; the socket is closed if it
        is fatal or the call has sent too many."""
        self.errors = [*self.errors[-999:], exc.code]
        fatal = exc.fatal or not self._bad_budget.take(self.clock.monotonic())
        log.warning("call %s: %s: %s%s", self.id, exc.code, exc, " (closing)" if fatal else "")
        if fatal:
            self.close_code = int(WSCloseCode.POLICY_VIOLATION)
            self.close_message = exc.code.encode()[:120]
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)

    def _on_segment(self, generation: int, sample: int, started: bool) -> None:
        """A stretch of a turn's audio started or stopped leaving on the
        socket: ``audio.start`` / ``audio.end``, as a WebRTC session logs them."""
        turn_id = self.agent.turn_id_of(generation) if self.agent is not None else None
        if started:
            self.log.emit_event(AudioStart(generation=generation, turn_id=turn_id, sample=sample))
        else:
            self.log.emit_event(AudioEnd(generation=generation, turn_id=turn_id, samples_sent=sample))

    # -- the agent ------------------------------------------------------------------------

    async def _run_agent(self) -> None:
        assert self.agent is not None and self.tenant is not None
        try:
            if not await self._claimed():
                self._bad(ProtocolError("bad_tenant", "this call's signed tenant opened a stream already "
                                        "(on this or another instance)", fatal=True))
                return
            await self.manager.ensure_session(self.id, tenant_id=self.tenant, kind=TurnKind.VOICE)
            await self.agent.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("call %s: agent failed", self.id)
        finally:
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)

    async def _claimed(self) -> bool:
        """Claim the call's signed tenant in the store, once for every
        instance sharing it (the signer's own memory holds per instance):
        True for a stream naming no signed tenant."""
        if self._signed_until is None:
            return True
        key = "twilio-tenant:" + hashlib.sha256(self._signed_until[0].encode()).hexdigest()
        now = self.clock.now()
        until = datetime.fromtimestamp(self._signed_until[1], UTC)
        return await self.manager.store_call(lambda: self.manager.store.claim_once(key, max(until, now), now))

    # -- the end --------------------------------------------------------------------------

    def close(self, reason: StopReasonKind) -> asyncio.Task[None]:
        """End the call for ``reason`` and free it, once; later calls return
        the same closing task."""
        if self._closing is None:
            self.transport.close(reason)  # the agent's close_reason is now ``reason``; its frames end
            self._closing = asyncio.get_running_loop().create_task(self._close())
        return self._closing

    async def _close(self) -> None:
        try:
            if self._task is not None and self._task is not asyncio.current_task():
                # its frames have ended: it settles every open turn and returns
                done, _ = await asyncio.wait({self._task}, timeout=SETTLE_WAIT_S)
                if not done:
                    self._task.cancel()
                    await asyncio.wait({self._task})
            await self.manager.events.close(self.id)
            if self._watchdog is not None and self._watchdog is not asyncio.current_task():
                self._watchdog.cancel()
            if self._writer is not None:
                self._writer.cancel()
                await asyncio.wait({self._writer})
            if not self.ws.closed:
                code = self.close_code if self.close_code is not None else int(WSCloseCode.OK)
                try:
                    await self.ws.close(code=code, message=self.close_message)
                except Exception:  # the peer is gone already
                    log.debug("call %s: close handshake failed", self.id, exc_info=True)
        finally:
            self.transport.release()
            self.closed.set()
            self._on_closed(self)
