"""The aiohttp application: signaling, health, and the browser client.

Routes:
    GET  /                  the browser client (static HTML + JS, no build step)
    GET  /static/...        its assets
    GET  /healthz           liveness: {"status": "ok", "sessions": N}
    POST /v1/webrtc/offer   {"type": "offer", "sdp": "..."} ->
                            {"type": "answer", "sdp": "...", "session_id": "..."}

Every error under /v1 and /healthz is JSON: ``{"error": {"code", "message"}}``
with a 4xx/5xx status; a bad request never affects other sessions.
"""

from __future__ import annotations

import asyncio
import json
import logging
from pathlib import Path
from typing import Any, Awaitable, Callable, Literal

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from turn.clock import Clock, SystemClock
from turn.manager import TurnManager
from turn.models import StopReasonKind
from turn.sqlite_store import SqliteStore, path_from_url
from voice.llm import LocalAgent
from voice.session import Providers
from voice.stt import PocketsphinxSTT
from voice.tts import EspeakTTS
from web.peer import OfferRejected, PeerSession
from web.settings import Settings

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"

SETTINGS = web.AppKey("settings", Settings)
CLOCK = web.AppKey("clock", Clock)  # type: ignore[type-abstract]
STORE = web.AppKey("store", SqliteStore)
MANAGER = web.AppKey("manager", TurnManager)
PEERS = web.AppKey("peers", dict)  # session id -> PeerSession
PROVIDERS = web.AppKey("providers_factory", Callable)  # type: ignore[type-abstract]

ProvidersFactory = Callable[[Settings, Clock], Providers]


class ApiError(web.HTTPException):
    """A JSON error response ``{"error": {"code", "message"}}``."""

    def __init__(self, status: int, code: str, message: str) -> None:
        self.status_code = status
        super().__init__(
            text=json.dumps({"error": {"code": code, "message": message}}),
            content_type="application/json",
        )


class OfferRequest(BaseModel):
    """Body of ``POST /v1/webrtc/offer`` (the JSON form of an
    RTCSessionDescriptionInit, W3C WebRTC 1.0)."""

    type: Literal["offer"]
    sdp: str = Field(min_length=1)


def default_providers(settings: Settings, clock: Clock) -> Providers:
    """The embedded providers: pocketsphinx, the local agent, espeak-ng."""
    return Providers(
        stt=PocketsphinxSTT(settings.stt),
        llm=LocalAgent(settings.llm, clock),
        tts=EspeakTTS(settings.tts),
    )


def create_app(
    settings: Settings | None = None,
    *,
    clock: Clock | None = None,
    providers: ProvidersFactory = default_providers,
) -> web.Application:
    """Build the application.

    Args:
        settings: defaults to ``Settings()`` (environment + defaults).
        clock: time source (system clock by default).
        providers: builds each session's STT/LLM/TTS.

    Raises:
        ValueError: ``settings.store`` is not a supported URL.
    """
    settings = settings or Settings()
    app = web.Application(client_max_size=settings.max_offer_bytes, middlewares=[_json_errors])
    app[SETTINGS] = settings
    app[CLOCK] = clock or SystemClock()
    app[STORE] = SqliteStore(path_from_url(settings.store))
    app[MANAGER] = TurnManager(app[STORE], app[CLOCK])
    app[PEERS] = {}
    app[PROVIDERS] = providers
    app.router.add_get("/", _index)
    app.router.add_static("/static", STATIC_DIR)
    app.router.add_get("/healthz", _healthz)
    app.router.add_post("/v1/webrtc/offer", _offer)
    app.on_startup.append(_startup)
    app.on_shutdown.append(_shutdown)
    app.on_cleanup.append(_cleanup)
    return app


async def _startup(app: web.Application) -> None:
    await app[STORE].open()


async def _shutdown(app: web.Application) -> None:
    peers = list(app[PEERS].values())
    closing = [p.close(StopReasonKind.WORKER_SHUTDOWN) for p in peers]
    if closing:
        await asyncio.wait(closing, timeout=10)


async def _cleanup(app: web.Application) -> None:
    await app[STORE].close()


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn aiohttp's plain-text errors into JSON ones on the API paths."""
    try:
        return await handler(request)
    except ApiError:
        raise
    except web.HTTPException as exc:
        if not request.path.startswith(("/v1/", "/healthz")) or exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status, "http_error")
        raise ApiError(exc.status, code, exc.reason) from exc


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "sessions": len(request.app[PEERS])})


async def _read_json(request: web.Request) -> Any:
    limit = request.app[SETTINGS].max_offer_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "body_too_large", f"body is larger than {limit} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, "body_too_large", f"body is larger than {limit} bytes") from exc
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError) as exc:
        raise ApiError(400, "bad_json", f"body is not valid JSON: {exc}") from exc


async def _offer(request: web.Request) -> web.Response:
    app = request.app
    body = await _read_json(request)
    try:
        offer = OfferRequest.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ApiError(400, "invalid_offer", problems) from exc
    if not offer.sdp.lstrip().startswith("v=0"):
        raise ApiError(400, "invalid_sdp", "SDP must start with 'v=0' (RFC 8866)")
    settings = app[SETTINGS]
    peers: dict[str, PeerSession] = app[PEERS]
    if len(peers) >= settings.max_sessions:
        raise ApiError(503, "too_many_sessions", f"{settings.max_sessions} sessions are running; try later")
    clock = app[CLOCK]
    peer = PeerSession(
        settings=settings,
        manager=app[MANAGER],
        providers=app[PROVIDERS](settings, clock),
        clock=clock,
        on_closed=lambda p: peers.pop(p.id, None),
    )
    peers[peer.id] = peer
    try:
        sdp = await peer.answer(offer.sdp)
    except OfferRejected as exc:
        await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
        raise ApiError(400, exc.code, str(exc)) from exc
    except BaseException:
        await asyncio.shield(peer.close(StopReasonKind.TRANSPORT_DISCONNECTED))
        raise
    log.info("session %s: answered offer", peer.id)
    return web.json_response({"type": "answer", "sdp": sdp, "session_id": peer.id})
