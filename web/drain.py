"""Draining: how an instance stops taking work and ends what it holds
before it exits (a rolling deploy: SIGTERM, or a Kubernetes preStop hook
calling ``POST /v1/admin/drain`` / ``turnkeeper drain``).

The steps, in order, each logged (settings: :class:`web.settings.ShutdownSettings`;
every time counts from the drain's start):

1. **draining**: ``GET /readyz`` answers 503 at once; ``GET /healthz``
   (liveness) stays 200 until the process exits. Starting again is a no-op
   (a preStop hook may be delivered more than once).
2. **new work refused**: offers, phone and device connections, the phone
   webhook and new text turns get 503 ``shutting_down`` with
   ``Retry-After`` (:data:`NEW_WORK`); stops, reads and event streams go on.
   The listener stays open for at least ``lb_delay_s``, so requests a load
   balancer still routes here get that 503, never a refused connection.
3. **voice sessions** are told (``session.draining`` with the time left)
   and go on until they end or ``drain_timeout_s``; the rest are closed
   ``worker_shutdown``.
4. **text turns** run on until they end or ``turn_wait_s``; the rest halt
   at their next checkpoint (never inside a must-complete commit) and are
   *released* with it for another worker, or this one restarted, to go on
   (:mod:`turn.resume`): a deploy loses no turn.
5. **event streams** get every event logged so far, their turns' terminal
   ones included, then ``stream.end`` (``shutting_down``), then a clean
   end of the response.
6. the process exits 0 (leases released, store closed by the app's
   cleanup). A second SIGTERM, or ``grace_s`` after the start, exits at
   once; what was open then is found by the sweeper after restart.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from enum import StrEnum
from typing import Any

from aiohttp import web

from clock import Clock
from turn.event_catalogue import SessionDraining
from turn.models import StopReasonKind
from voice.text_turns import TextTurns
from web.admission import FULL_RETRY_AFTER_S, require_room
from web.auth import require_admin
from web.devices.routes import DEVICE_WS_PATH, XIAOZHI_WS_PATH
from web.errors import ApiError, openapi_error
from web.settings import ShutdownSettings
from web.state import MANAGER, PEERS, STREAMS, TEXT_TURNS, ClientSession
from web.telephony.routes import TELNYX_STREAM_PATH, TWILIO_STREAM_PATH, TWILIO_VOICE_PATH

log = logging.getLogger(__name__)

#: (method, route) of the requests that start new work, refused while draining
NEW_WORK = frozenset({
    ("POST", "/v1/webrtc/offer"),
    ("POST", "/v1/turns"),
    ("POST", TWILIO_VOICE_PATH),
    ("GET", TWILIO_STREAM_PATH),
    ("GET", TELNYX_STREAM_PATH),
    ("GET", DEVICE_WS_PATH),
    ("GET", XIAOZHI_WS_PATH),
})
#: the drain of this instance (set by :func:`add_routes`)
DRAIN: web.AppKey[Drain] = web.AppKey("drain")
#: how often the drain looks whether sessions and turns have ended, s
POLL_S = 0.05
#: event streams are given this long to send what is logged, s
STREAMS_FLUSH_S = 2.0


class DrainState(StrEnum):
    """Whether this instance takes new work."""

    SERVING = "serving"
    DRAINING = "draining"


class Drain:
    """This instance's serving state and its drain (see the module doc).

    Args:
        clock: time source (the drain's timers).
        settings: the shutdown settings.

    Attributes:
        state: serving or draining.
        reason: why it drains ("SIGTERM", "admin", ...), once it does.
        started_at: clock seconds when the drain began (None while serving).
        streams_closing: set when event streams must send what is logged
            and end (step 5).
        began: set when the drain begins (who must tell others at once).
        done: set when the drain has run its steps: the process may exit.
    """

    def __init__(self, clock: Clock, settings: ShutdownSettings) -> None:
        self.clock = clock
        self.settings = settings
        self.state = DrainState.SERVING
        self.reason = ""
        self.started_at: float | None = None
        self.streams_closing = asyncio.Event()
        self.began = asyncio.Event()
        self.done = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    @property
    def draining(self) -> bool:
        """New work is refused."""
        return self.state is DrainState.DRAINING

    def elapsed_s(self) -> float:
        """Seconds since the drain began (0 while serving)."""
        return 0.0 if self.started_at is None else self.clock.monotonic() - self.started_at

    def left_s(self, limit_s: float) -> float:
        """Of a step limited to ``limit_s`` from the start, what is left, s."""
        return max(0.0, limit_s - self.elapsed_s())

    def begin(self, reason: str, steps: Callable[[Drain], Awaitable[None]]) -> bool:
        """Start draining for ``reason``, running ``steps`` (steps 3 to 5)
        in a task that sets :attr:`done` when they finish. Idempotent:
        False (and nothing changes) if already draining."""
        if self.draining:
            log.info("drain requested again (%s): already draining for %.1f s", reason, self.elapsed_s())
            return False
        self.state, self.reason, self.started_at = DrainState.DRAINING, reason, self.clock.monotonic()
        self.began.set()
        log.warning("draining (%s): /readyz answers 503, new work is refused with 503 shutting_down", reason)
        self._task = asyncio.get_running_loop().create_task(self._run(steps), name="drain")
        return True

    async def _run(self, steps: Callable[[Drain], Awaitable[None]]) -> None:
        try:
            await steps(self)
            left = self.left_s(self.settings.lb_delay_s)
            if left:
                log.info("drain: waiting %.1f s more for load balancers to notice", left)
                await self.clock.sleep(left)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("drain: a step failed; exiting anyway")
        finally:
            log.warning("drain done after %.1f s: exiting", self.elapsed_s())
            self.done.set()

    def refusal(self) -> ApiError:
        """The answer to new work while draining: 503 ``shutting_down``
        with ``Retry-After`` (RFC 9110 section 10.2.3: a client retries,
        and a load balancer sends it to another instance)."""
        return ApiError(503, "shutting_down", "this instance is draining for a deploy: retry (another instance serves)",
                        headers={"Retry-After": "1"})

    async def aclose(self) -> None:
        """Cancel the drain's task, if it still runs (the process exits at once)."""
        if self._task is not None and not self._task.done():
            self._task.cancel()
            await asyncio.wait({self._task})


async def drain_app(drain: Drain, app: web.Application) -> None:
    """Steps 3 to 5 of the module doc for ``app``'s sessions, turns and
    event streams."""
    s = drain.settings
    peers = app[PEERS]
    for peer in list(peers.values()):
        if not peer.connected:
            # answered, media not connected: no turn, nothing heard; its client
            # sees the connection fail and connects again (elsewhere)
            log.info("drain: session %s never connected: closed", peer.id)
            await peer.close(StopReasonKind.WORKER_SHUTDOWN)
            continue
        tell_draining(peer, drain.left_s(s.drain_timeout_s), drain.reason)
    text_turns = app[TEXT_TURNS]
    log.info("drain: %d voice sessions may go on %.1f s, %d text turns %.1f s", len(peers),
             drain.left_s(s.drain_timeout_s), text_turns.running_count(), drain.left_s(s.turn_wait_s))
    async with asyncio.TaskGroup() as tg:
        tg.create_task(_voice_sessions_end(drain, peers))
        tg.create_task(_text_turns_end(drain, text_turns))
    await app[MANAGER].events.flush()  # the turns' terminal events are in the log ...
    await close_streams(drain, app)  # ... before the streams send what is logged and end


async def close_streams(drain: Drain, app: web.Application) -> None:
    """Step 5: every event stream sends what is logged, then ``stream.end``
    (at most ``STREAMS_FLUSH_S``; a stream still going then is cut)."""
    drain.streams_closing.set()
    streams = [t for t in app[STREAMS] if not t.done()]
    if streams:
        log.info("drain: %d event streams send what is logged and end", len(streams))
        _, late = await asyncio.wait(streams, timeout=STREAMS_FLUSH_S)
        for t in late:
            t.cancel()  # a client that reads nothing must not hold the exit


def tell_draining(peer: ClientSession, left_s: float, reason: str) -> None:
    """Log ``session.draining`` in ``peer``'s session (its client hears it
    on its event channel, if it has one)."""
    peer.log.emit_event(SessionDraining(generation=peer.fence.active, left_s=round(left_s, 1), reason=reason))


async def _voice_sessions_end(drain: Drain, peers: dict[str, ClientSession]) -> None:
    limit = drain.settings.drain_timeout_s
    while peers and drain.elapsed_s() < limit:
        await drain.clock.sleep(POLL_S)
    if not peers:
        log.info("drain: every voice session has ended")
        return
    log.warning("drain: %d voice sessions still open after %.1f s: ending them worker_shutdown", len(peers), limit)
    closing = [p.close(StopReasonKind.WORKER_SHUTDOWN) for p in list(peers.values())]
    await asyncio.wait(closing, timeout=10)


async def _text_turns_end(drain: Drain, text_turns: TextTurns) -> None:
    limit = drain.settings.turn_wait_s
    if await text_turns.wait_idle(drain.left_s(limit)):
        log.info("drain: every text turn has ended")
        return
    log.warning("drain: %d text turns still running after %.1f s: releasing them for another worker",
                text_turns.running_count(), limit)
    await text_turns.release_all()


# -- HTTP -------------------------------------------------------------------------------


def add_routes(app: web.Application, drain: Drain) -> None:
    """``GET /readyz``, ``POST /v1/admin/drain`` and the refusal of new
    work while draining (a middleware, so no route can forget it)."""
    app[DRAIN] = drain
    app.middlewares.append(refuse_new_work)
    app.router.add_get("/readyz", readyz)
    app.router.add_post("/v1/admin/drain", admin_drain)


async def readyz(request: web.Request) -> web.Response:
    """Readiness: 200 ``{"status": "ready"}`` while serving, 503
    ``{"status": "draining", "draining_s"}`` from the drain's start, and
    503 ``{"status": "full", "reason"}`` while a new call would be refused
    (``too_many_sessions`` or ``at_capacity``, :func:`web.admission.require_room`):
    a load balancer stops routing here, live calls go on (liveness,
    ``/healthz``, stays 200)."""
    drain = request.app[DRAIN]
    if drain.draining:
        return web.json_response({"status": "draining", "reason": drain.reason, "draining_s": round(drain.elapsed_s(), 1)},
                                 status=503, headers={"Retry-After": "1"})
    try:
        require_room(request.app, count=False)
    except ApiError as full:
        return web.json_response({"status": "full", "reason": full.code, "message": full.message}, status=503,
                                 headers={"Retry-After": str(FULL_RETRY_AFTER_S)})
    return web.json_response({"status": "ready"})


async def admin_drain(request: web.Request) -> web.Response:
    """Start draining (a preStop hook; idempotent): 202 ``{"state":
    "draining", "already": bool}``.

    Raises:
        ApiError: 401 without the admin token (``admin_token``), or, when
            none is set, for a client that is not on loopback.
    """
    require_admin(request)
    app = request.app
    drain = app[DRAIN]
    started = drain.begin("admin", lambda d: drain_app(d, app))
    return web.json_response({"state": drain.state.value, "already": not started, "draining_s": round(drain.elapsed_s(), 1)},
                             status=202)


#: security of the admin operations: the admin token, or (``admin_token``
#: unset) nothing from a loopback client
ADMIN_SECURITY: list[dict[str, list[str]]] = [{"admin": []}, {}]
#: the OpenAPI paths of this module (merged into web.openapi's document)
OPENAPI_PATHS: dict[str, Any] = {
    "/v1/admin/drain": {"post": {
        "summary": "Start draining this instance (a preStop hook); idempotent", "operationId": "adminDrain",
        "description": "Needs Authorization: Bearer <admin_token>; without admin_token set, loopback clients only "
                       "(no credentials).",
        "security": ADMIN_SECURITY,
        "responses": {
            "202": {"description": "draining (already: it was before this request)", "content": {"application/json": {
                "schema": {"type": "object", "required": ["state", "already", "draining_s"], "properties": {
                    "state": {"enum": [s.value for s in DrainState]}, "already": {"type": "boolean"},
                    "draining_s": {"type": "number", "minimum": 0}}}}}},
            "401": openapi_error("not the admin token (or, admin_token unset, not a loopback client)")}}},
}


@web.middleware
async def refuse_new_work(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """While draining, :data:`NEW_WORK` gets 503 ``shutting_down`` with
    ``Retry-After``; every other request is served."""
    drain = request.app[DRAIN]
    if drain.draining:
        route = request.match_info.route.resource
        if route is not None and (request.method, route.canonical) in NEW_WORK:
            log.info("refused %s %s: draining", request.method, request.path)
            raise drain.refusal()
    return await handler(request)
