"""One device connection: a xiaozhi-esp32 board's WebSocket, its
:class:`web.devices.transport.DeviceTransport` and the voice session on it.

:class:`DeviceCall` reads the socket (:meth:`DeviceCall.run`): the device's
``hello`` is answered with the server ``hello`` at once (the firmware waits
10 s for it: 78/xiaozhi-esp32, docs/websocket.md section 1.4), and the
agent starts; then ``listen`` and ``abort`` become controls and binary
messages Opus audio. A device is a voice session like a WebRTC one: same
Turn Manager, ledger and log, with its tenant's plan.

Messages (docs/websocket.md section 4.1):

- ``listen start`` mode ``manual`` (push-to-talk pressed): ``ptt.start``,
  an immediate committed barge-in (initiator ``ptt``) if the agent speaks;
  ``listen stop`` in manual mode: ``ptt.end``, the user's turn ends at once;
  modes ``auto`` and ``realtime`` leave the turn to the detector and
  endpointing (realtime: barge-in by voice, echo guard on);
- ``listen detect`` with a wake word's text: a turn of that text;
- ``abort``: the output stops at once (nothing more of the reply is sent,
  ``tts stop``), and the turn is stopped ``user_cancel`` by ``device``.

Bad input (each a test in tests/web/test_device_bad_input.py): binary
before ``hello``, a ``hello`` without or with unsupported ``audio_params``
or another protocol version than the header's, malformed JSON, a message
of a known type with bad fields: an ``alert`` to the device, and the
socket closed for a ``hello`` we cannot serve (1003) or a broken one
(1002); an unknown type: logged, ignored (newer firmware); a corrupt Opus
packet or a version 2/3 header whose size lies: logged and dropped; more
than ``devices.max_messages_per_s`` messages in a second (or the tenant's or
address's connections together over ``limits.messages_per_s_per_*``: an
``alert``, then closed 1008), a binary message
over ``devices.max_frame_bytes``, too many bad messages, no ``hello`` in
``devices.hello_timeout_s``: the socket closed (1008 / 1009), the turns
settled ``transport_disconnected``.
"""

from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable

from aiohttp import WSCloseCode, WSMsgType, web

from clock import Clock
from media.opus import OpusError
from media.pacing import PacingMonitor
from turn.events import EventFollower, event_json
from turn.generation import GenerationFence
from turn.manager import TurnManager
from turn.models import StopReasonKind, TurnKind
from voice.session import AgentSession, Providers
from voice.transport import Control, ControlKind
from web.client_tokens import ClientGrant
from web.devices import framing
from web.devices.messages import Abort, AudioParams, DeviceMessageError, Hello, Ignored, Listen, alert, parse_device_message, server_hello
from web.devices.transport import DeviceTransport
from web.limits import Limits
from web.rate_limit import TokenBucket
from web.settings import Settings

log = logging.getLogger(__name__)

#: bad messages a device may send before its socket is closed
#: bad messages a socket may send at once before it is closed, and how many a
#: second it may go on sending (an occasional bad one never closes a long call)
MAX_BAD_MESSAGES = 100
BAD_MESSAGES_PER_S = 1.0
#: how long a closing connection waits for its agent to settle its turns, s
SETTLE_WAIT_S = 10.0


class DeviceError(Exception):
    """A bad message from a device.

    Attributes:
        code: short name (``before_hello``, ``bad_json``, ``bad_opus``...).
        fatal: the socket is closed for it.
        close_code: the WebSocket close code if fatal.
        tell: an ``alert`` goes to the device.
    """

    def __init__(self, code: str, message: str, *, fatal: bool = False, close_code: int = 1008, tell: bool = False) -> None:
        super().__init__(message)
        self.code, self.fatal, self.close_code, self.tell = code, fatal, close_code, tell


class DeviceCall:
    """One device connection (see the module doc).

    Args:
        settings: server settings.
        manager: the Turn Manager.
        providers: this connection's STT/LLM/TTS.
        clock: time source.
        ws: the device's WebSocket (prepared).
        device_id: the registered device (its token's).
        tenant: its tenant (whose plan applies).
        grant: the client token it connected with (its session id, plan
            narrowed, instructions), or None for a device token.
        header_version: the ``Protocol-Version`` header (None: not sent).
        on_closed: called once with this call after it has been freed.
        client: the device's address.
        mac: the ``Device-Id`` header (the board's MAC), for logs.
        limits: the per-tenant and per-address limits its messages count
            towards (None: only its own rate holds).

    Attributes:
        errors: the code of every bad message, in order (the latest 1000).
        close_code: the WebSocket close code we closed with (None: not us).
        transport: the transport once ``hello`` came (None before).
    """

    def __init__(
        self, *, settings: Settings, manager: TurnManager, providers: Providers, clock: Clock,
        ws: web.WebSocketResponse, device_id: str, tenant: str, header_version: int | None,
        on_closed: Callable[[DeviceCall], None], client: str = "?", mac: str = "", limits: Limits | None = None,
        grant: ClientGrant | None = None,
    ) -> None:
        self.id = grant.session_id if grant is not None else uuid.uuid4().hex
        #: the client token's grant it connected with (plan, instructions), or None
        self.grant = grant
        self.client = client
        self.connected = True
        self.settings = settings
        self.manager = manager
        self.providers = providers
        self.clock = clock
        self.ws = ws
        self.device_id = device_id
        self.mac = mac
        self.tenant = tenant
        self._limits = limits
        self.header_version = header_version
        self._on_closed = on_closed
        self.fence = GenerationFence(clock)
        self.log = manager.events.log(self.id, gate=self.fence)
        self.follower = EventFollower(manager.store, self.id, gate=self.fence)
        d = settings.devices
        self.downlink = AudioParams(sample_rate=d.downlink_sample_rate, frame_duration=d.downlink_frame_ms)
        self.transport: DeviceTransport | None = None
        #: where its pacer's lateness goes (the app's PacingMonitor), or None
        self.pacing: PacingMonitor | None = None
        self.agent: AgentSession | None = None
        self.errors: list[str] = []
        self.close_code: int | None = None
        self._tasks: list[asyncio.Task[None]] = []
        self._agent_task: asyncio.Task[None] | None = None
        self._closing: asyncio.Task[None] | None = None
        self._farewell: str | None = None  # the alert of a fatal error, sent just before the close
        limit = settings.devices.max_messages_per_s
        self._messages = TokenBucket(limit, limit)  # a second's worth at once, the rate on average
        self._bad_budget = TokenBucket(BAD_MESSAGES_PER_S, MAX_BAD_MESSAGES)
        self.closed = asyncio.Event()

    # -- the socket ---------------------------------------------------------------------

    async def run(self) -> None:
        """Read the socket until it closes or the connection ends, then free
        it (its turns settled). The WebSocket handler awaits this."""
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._hello_timeout(), name=f"device-hello-{self.id}"))
        try:
            async for msg in self.ws:
                if msg.type is WSMsgType.TEXT:
                    self._guard(self._on_text, msg.data)
                elif msg.type is WSMsgType.BINARY:
                    self._guard(self._on_binary, msg.data)
                elif msg.type is WSMsgType.ERROR:
                    log.warning("device %s: socket error: %s", self.id, self.ws.exception())
                    if self.close_code is None and "size" in str(self.ws.exception()):
                        self.close_code = int(WSCloseCode.MESSAGE_TOO_BIG)
                    break
                if self._closing is not None:
                    break
        finally:
            await asyncio.shield(self.close(StopReasonKind.TRANSPORT_DISCONNECTED))

    def _guard(self, handle: Callable[[object], None], data: object) -> None:
        """Rate-check one message and hand it on; nothing raises into the reader."""
        limit = self.settings.devices.max_messages_per_s
        try:
            if not self._messages.take(self.clock.monotonic()):
                raise DeviceError("flood", f"more than {limit} messages a second (60 ms audio is 17)", fatal=True)
            if self._limits is not None and not self._limits.allows("message", tenant=self.tenant, client=self.client):
                raise DeviceError("rate_limited", "your tenant's or address's connections send too many messages "
                                  "together", fatal=True, tell=True)
            handle(data)
        except DeviceError as exc:
            self._bad(exc)
        except Exception:
            log.exception("device %s: message handling failed", self.id)
            self._bad(DeviceError("internal", "message could not be handled"))

    def _on_text(self, data: object) -> None:
        assert isinstance(data, str)
        try:
            msg = parse_device_message(data)
        except DeviceMessageError as exc:
            if self.transport is None and str(exc).startswith("bad 'hello'"):  # a hello we cannot serve
                raise DeviceError("bad_hello", str(exc), fatal=True, close_code=int(WSCloseCode.UNSUPPORTED_DATA),
                                  tell=True) from None
            raise DeviceError("bad_message", str(exc), tell=True) from None
        if isinstance(msg, Hello):
            self._hello(msg)
        elif self.transport is None:
            raise DeviceError("before_hello", f"{msg.type!r} before hello: dropped", tell=True)
        elif isinstance(msg, Listen):
            self._listen(msg)
        elif isinstance(msg, Abort):
            self._abort(msg)
        elif isinstance(msg, Ignored) and msg.type != "mcp":
            raise DeviceError("unknown_type", f"message type {msg.type!r} is not handled: ignored")

    def _on_binary(self, data: object) -> None:
        assert isinstance(data, bytes)
        limit = self.settings.devices.max_frame_bytes
        if len(data) > limit:
            raise DeviceError("too_big", f"a binary message of {len(data)} bytes (at most {limit})", fatal=True,
                              close_code=int(WSCloseCode.MESSAGE_TOO_BIG))
        if self.transport is None:
            raise DeviceError("before_hello", "audio before hello: dropped", tell=True)
        try:
            frame = framing.parse(data, self.transport.version)
        except framing.FramingError as exc:
            raise DeviceError("bad_frame", str(exc)) from None
        if frame.type != framing.TYPE_OPUS:
            raise DeviceError("bad_frame", f"binary payload of type {frame.type}: only Opus (0) is taken")
        try:
            self.transport.on_audio(frame.payload)
        except OpusError as exc:
            raise DeviceError("bad_opus", str(exc)) from None

    # -- messages ----------------------------------------------------------------------

    def _hello(self, hello: Hello) -> None:
        if self.transport is not None:
            raise DeviceError("duplicate_hello", "a second hello on one connection: ignored")
        if "audio_params" not in hello.model_fields_set:
            raise DeviceError("no_audio_params", "hello has no audio_params (opus, 16000 Hz, 1 channel, 60 ms)",
                              fatal=True, close_code=int(WSCloseCode.UNSUPPORTED_DATA), tell=True)
        if self.header_version is not None and hello.version != self.header_version:
            raise DeviceError("version_mismatch", f"hello says version {hello.version}, the header "
                              f"{self.header_version}", fatal=True, close_code=int(WSCloseCode.PROTOCOL_ERROR), tell=True)
        d = self.settings.devices
        self.transport = t = DeviceTransport(
            self.clock, self.fence.passes, self.ws.send_str, self.ws.send_bytes, session_id=self.id,
            version=hello.version, downlink=self.downlink, send_ahead_ms=d.send_ahead_ms, vad=self.settings.vad,
            bargein=self.settings.bargein, stall_ms=self.settings.inbound_stall_ms,
        )
        t.output.monitor = self.pacing
        t.send_json(server_hello(self.id, self.downlink), "hello")
        self._tasks.append(asyncio.get_running_loop().create_task(t.write(), name=f"device-writer-{self.id}"))
        self.agent = AgentSession(
            session_id=self.id, manager=self.manager, providers=self.providers, transport=t, fence=self.fence,
            clock=self.clock, emit=self.log.emit_event, vad=self.settings.vad, config=self.settings.session,
            plan=self.grant.plan(self.settings.plan_for(self.tenant)) if self.grant else self.settings.plan_for(self.tenant),
            instructions=self.grant.options.instructions if self.grant else None,
        )
        log.info("device %s: %s (%s) v%d, uplink %s Hz, tenant %s", self.id, self.device_id, self.mac[:40],
                 hello.version, hello.audio_params.sample_rate, self.tenant)
        self._agent_task = asyncio.get_running_loop().create_task(self._run_agent(), name=f"device-{self.id}")

    def _listen(self, msg: Listen) -> None:
        t = self.transport
        assert t is not None
        now = self.clock.monotonic()
        if msg.state == "detect":
            t.control(Control(ControlKind.DETECT, now, text=msg.text or ""))
        elif msg.state == "start":
            t.mode = msg.mode or "auto"
            if t.mode == "manual":
                t.control(Control(ControlKind.PTT_START, now))
        elif t.mode == "manual":  # stop
            t.control(Control(ControlKind.PTT_END, now))

    def _abort(self, msg: Abort) -> None:
        """Stop at once: nothing more of the reply is sent, ``tts stop``;
        then the session stops the turn (user_cancel, ``device``)."""
        t = self.transport
        assert t is not None
        t.output.mute(self.fence.active)
        t.stop_speaking()  # answered even if the output had nothing in flight
        t.control(Control(ControlKind.ABORT, self.clock.monotonic(), initiator="device"))
        log.info("device %s: abort (%s)", self.id, (msg.reason or "")[:40])

    def _bad(self, exc: DeviceError) -> None:
        """A bad message: logged with its code, told to the device if it
        says so; the socket is closed if fatal or the device sent too many."""
        self.errors = [*self.errors[-999:], exc.code]
        fatal = exc.fatal or not self._bad_budget.take(self.clock.monotonic())
        log.warning("device %s: %s: %s%s", self.id, exc.code, exc, " (closing)" if fatal else "")
        if exc.tell:
            if fatal and self.transport is not None:  # its writer ends with the call: said last, before the close
                self._farewell = str(exc)
            else:
                self._alert(str(exc))
        if fatal:
            self.close_code = exc.close_code if exc.fatal else int(WSCloseCode.POLICY_VIOLATION)
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)

    def _alert(self, message: str) -> None:
        if self.transport is not None:
            self.transport.send_json(alert(self.id, message[:200]), "alert")
        elif not self.ws.closed:  # no writer yet: straight out, in order with nothing
            self._tasks.append(asyncio.get_running_loop().create_task(self._send_alert(message)))

    async def _send_alert(self, message: str) -> None:
        try:
            await self.ws.send_json(alert(self.id, message[:200]))
        except (ConnectionError, RuntimeError):
            pass

    async def _hello_timeout(self) -> None:
        await self.clock.sleep(self.settings.devices.hello_timeout_s)
        if self.transport is None:
            self._bad(DeviceError("no_hello", f"no hello in {self.settings.devices.hello_timeout_s:g} s", fatal=True))

    # -- the agent ------------------------------------------------------------------------

    async def _run_agent(self) -> None:
        assert self.agent is not None
        follow: asyncio.Task[None] | None = None
        try:
            await self.manager.ensure_session(self.id, tenant_id=self.tenant, kind=TurnKind.VOICE)
            follow = asyncio.get_running_loop().create_task(self._follow(), name=f"device-follow-{self.id}")
            await self.agent.run()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("device %s: agent failed", self.id)
        finally:
            if follow is not None:
                follow.cancel()
                await asyncio.wait({follow})
            self.close(StopReasonKind.TRANSPORT_DISCONNECTED)

    async def _follow(self) -> None:
        """The session's log to the device as it grows (``stt``, ``tts``...)."""
        assert self.transport is not None
        async for batch in self.follower.follow():
            for ev in batch:
                self.transport.deliver(event_json(ev))

    # -- the end --------------------------------------------------------------------------

    def close(self, reason: StopReasonKind, code: int | None = None) -> asyncio.Task[None]:
        """End the connection for ``reason`` (with WebSocket close ``code``
        if given) and free it, once; later calls return the same task."""
        if self._closing is None:
            if code is not None and self.close_code is None:
                self.close_code = code
            if self.transport is not None:
                self.transport.close(reason)  # the agent's close_reason is now ``reason``; its frames end
            self._closing = asyncio.get_running_loop().create_task(self._close())
        return self._closing

    async def _close(self) -> None:
        try:
            task = self._agent_task
            if task is not None and task is not asyncio.current_task():
                done, _ = await asyncio.wait({task}, timeout=SETTLE_WAIT_S)
                if not done:
                    task.cancel()
                    await asyncio.wait({task})
            await self.manager.events.close(self.id)
            for t in self._tasks:
                t.cancel()
            if self._tasks:
                await asyncio.wait(self._tasks)
            if not self.ws.closed:
                code = self.close_code if self.close_code is not None else int(WSCloseCode.OK)
                try:
                    if self._farewell is not None:
                        await self.ws.send_json(alert(self.id, self._farewell[:200]))
                    await self.ws.close(code=code, message=b"session ended")
                except Exception:  # the peer is gone already
                    log.debug("device %s: close handshake failed", self.id, exc_info=True)
        finally:
            if self.transport is not None:
                self.transport.release()
            self.closed.set()
            self._on_closed(self)
