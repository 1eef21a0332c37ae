"""The aiohttp application: signaling, health, and the browser client.

Routes:
    GET  /                  the browser client (static HTML + JS, no build step)
    GET  /static/...        its assets
    GET  /healthz           liveness: {"status": "ok", "sessions": N}
    POST /v1/webrtc/offer   {"type": "offer", "sdp": "..."} ->
                            {"type": "answer", "sdp": "...", "session_id": "..."}
    /v1/telephony/...       phone calls (web.telephony.routes)
    /v1/devices...          push-to-talk devices, xiaozhi-esp32 (web.devices.routes)

Every error under /v1 and /healthz is JSON: ``{"error": {"code", "message"}}``
with a 4xx/5xx status; a bad request never affects other sessions.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator, Awaitable, Callable, Coroutine
from pathlib import Path
from typing import TYPE_CHECKING, Any

import aiohttp
from aiohttp import web

from clock import Clock, SystemClock
from media.pacing import PacingMonitor
from turn.log_content import set_log_content
from turn.manager import TurnManager
from turn.models import StopReason, StopReasonKind
from turn.redis_store import RedisStore
from turn.reversal import EffectHandler
from turn.signals import RedisStopSignals, StopSignals
from turn.sqlite_connection import path_from_url
from turn.sqlite_store import SqliteStore
from turn.store import StoreUnavailable, TurnStore
from voice.end_of_turn import EndOfTurnModelError, shared_judge
from voice.llm import LocalAgent
from voice.openai_llm import OpenAiChatModel
from voice.providers import LanguageModel
from voice.recognisers import build_recognisers
from voice.session import Providers
from voice.synthesisers import build_synthesiser, check_key
from voice.text_turns import TextTurns
from voice.tools import Toolbox
from voice.tts import EspeakSynthesiser, EspeakTTS
from web import access_log, api, client_tokens, drain, instances, metrics, openapi, signaling, tracing
from web.auth import Auth
from web.capacity import Capacity
from web.devices import routes as device_routes
from web.drain import DRAIN, close_streams
from web.errors import ApiError
from web.limits import Limits
from web.settings import Settings
from web.state import (
    AUTH,
    CAPACITY,
    CLOCK,
    LEASES,
    LIMITS,
    MANAGER,
    PACING,
    PEERS,
    PROVIDERS,
    SETTINGS,
    STORE,
    STREAMS,
    TEXT_TURNS,
    WORKERS,
)
from web.telephony import routes as telephony_routes

if TYPE_CHECKING:
    from demo_shop.shop import DemoShop

log = logging.getLogger(__name__)

STATIC_DIR = Path(__file__).parent / "static"

__all__ = [
    "AUTH", "CLOCK", "LEASES", "MANAGER", "PEERS", "PROVIDERS", "SETTINGS", "STORE", "STREAMS", "TEXT_TURNS",
    "ApiError", "EmbeddedProviders", "create_app", "open_store",
]


class EmbeddedProviders:
    """The providers: the speech recogniser ``stt.provider`` names (and the
    embedded one as its fallback), shared by all sessions, and per session
    the model and espeak-ng; and the demo shop's tools when
    ``settings.demo_shop`` is on.

    Args:
        settings: provider settings.
        clock: the local agent's pace clock.
    """

    def __init__(self, settings: Settings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        self.stt, self.stt_fallback = build_recognisers(settings.stt)
        self._http: aiohttp.ClientSession | None = None
        #: the demo shop (tools and their in-process external system), or None
        self.shop = demo_shop_for(settings, clock)
        self._store: TurnStore | None = None
        #: the end-of-turn judge (``session.endpoint.mode = "model"``), shared by all sessions
        self.end_of_turn = shared_judge(settings.session.endpoint.judge) if settings.session.endpoint.mode == "model" else None

    def bind(self, store: TurnStore) -> None:
        """Give the tools the store (their downstream work queue lives there)."""
        self._store = store

    async def start(self) -> None:
        """Check the configuration before serving anyone.

        Raises:
            RuntimeError: espeak-ng is missing, or the speech model, the
                grammar or the end-of-turn model cannot be loaded.
        """
        tts = self.settings.tts
        if (tts.provider == "embedded" or tts.fallback == "embedded") and not EspeakTTS(tts.espeak).available():
            raise RuntimeError(f"TTS executable {tts.executable!r} not found; install espeak-ng")
        if tts.provider != "embedded" and (problem := await check_key(tts)) is not None:
            log.error("%s", problem)  # one line naming the setting; the server still serves (see tts.fallback)
        try:
            if self.stt_fallback is not None:
                await self.stt_fallback.start()
            await self.stt.start()
        except Exception as exc:
            raise RuntimeError(f"speech recogniser cannot start: {exc}") from exc
        if self.end_of_turn is not None:
            try:
                await asyncio.to_thread(self.end_of_turn.load)
            except EndOfTurnModelError as exc:
                raise RuntimeError(
                    f'end-of-turn model cannot load: {exc} (or set session.endpoint.mode = "silence")'
                ) from exc

    def for_session(self, voice: str | None = None) -> Providers:
        """Providers for one new voice session (``voice``: its TTS voice
        instead of ``tts.voice``)."""
        tts = self.settings.tts if voice is None else self.settings.tts.model_copy(update={"voice": voice})
        fallback = (
            EspeakSynthesiser(tts.espeak) if tts.provider != "embedded" and tts.fallback == "embedded" else None
        )
        return Providers(
            stt=self.stt, llm=self.llm_for_session(), tts=build_synthesiser(tts, self.http()), tts_fallback=fallback,
            tools=self.tools(), stt_fallback=self.stt_fallback,
            stt_final_timeout_s=self.settings.stt.final_timeout_ms / 1000, end_of_turn=self.end_of_turn,
        )

    async def voice_exists(self, voice: str) -> bool:
        """True if the TTS can speak with ``voice``: an espeak-ng voice it
        has, or, with a provider, any name (the provider judges it: a voice
        it refuses fails the reply over to the fallback)."""
        if self.settings.tts.provider != "embedded":
            return bool(voice.strip())
        return await EspeakTTS(self.settings.tts.espeak).voice_exists(voice)

    def http(self) -> aiohttp.ClientSession | None:
        """The server's HTTP client for the OpenAI-compatible providers (the
        model, speech): one keep-alive pool; None when neither is in use."""
        if self.settings.llm.provider != "openai" and self.settings.tts.provider != "openai":
            return None
        if self._http is None or self._http.closed:
            self._http = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(
                    total=self.settings.llm.request_timeout_s, sock_connect=self.settings.llm.connect_timeout_s
                )
            )
        return self._http

    def llm_for_session(self) -> LanguageModel:
        """The model for one session or text turn: the embedded agent, or
        an OpenAI-compatible API (``llm.provider``)."""
        if self.settings.llm.provider == "openai":
            http = self.http()
            assert http is not None
            return OpenAiChatModel(self.settings.llm, http)
        return LocalAgent(self.settings.llm, self.clock)

    def tools(self) -> Toolbox:
        """The tools the agent may call: the demo shop's (one toolbox for the
        whole process), or none when it is off."""
        if self.shop is None:
            return Toolbox()
        return self.shop.tools(self._store)

    def effect_handlers(self) -> Callable[[str], EffectHandler | None]:
        """What the ledger's ``handlers`` should be: the demo shop's (its
        tools and its queued messages), or the tools of the toolbox."""
        if self.shop is not None:
            return self.shop.handlers(self.tools)
        return lambda name: self.tools().get(name)

    def workers(self, store: TurnStore, consumer: str) -> dict[str, Coroutine[Any, Any, None]]:
        """Background work the providers need for the server's life, by
        task name: the demo shop's message sender (none when it is off)."""
        if self.shop is None:
            return {}
        return {"message-sender": self.shop.message_sender(store, consumer).run()}

    async def aclose(self) -> None:
        """Close the recognisers, the model's HTTP client and the demo shop."""
        await self.stt.aclose()
        if self.stt_fallback is not None:
            await self.stt_fallback.aclose()
        if self._http is not None:
            await self._http.close()
        if self.shop is not None:
            await self.shop.aclose()


def demo_shop_for(settings: Settings, clock: Clock) -> DemoShop | None:
    """The demo shop when ``settings.demo_shop`` is on, else None. This is
    the one place the product reaches the example: it is imported only when
    it is on (``tests/test_product_imports.py`` holds it to that)."""
    if not settings.demo_shop:
        return None
    from demo_shop.shop import DemoShop

    shop = DemoShop(clock, demo_service_path(settings))
    shop.service.inject_spec(settings.demo_faults)
    return shop


def demo_service_path(settings: Settings) -> Path:
    """Where the demo tools' external system keeps its table (it outlives
    restarts, so reconciliation after a crash asks a system that remembers)."""
    if settings.demo_service_db:
        return Path(settings.demo_service_db)
    if settings.store.startswith("sqlite:"):
        db = path_from_url(settings.store)
        return db.with_name(db.name + ".demo-service.db")
    return Path("var/demo-service.db")


def open_store(settings: Settings) -> tuple[SqliteStore | RedisStore, StopSignals]:
    """The store and stop signals ``settings.store`` names:
    ``sqlite:///path`` (embedded, one instance) or ``redis://host:port/db``
    (many instances; signals over pub/sub).

    Raises:
        ValueError: any other URL.
    """
    url = settings.store
    if url.startswith(("redis://", "rediss://", "unix://")):
        store = RedisStore(url, prefix=settings.redis_prefix)
        return store, _LazyRedisSignals(store, f"{settings.redis_prefix}:stops")
    if url.startswith("sqlite:"):
        return SqliteStore(path_from_url(url)), StopSignals()
    raise ValueError(f"unsupported store URL {url!r}: use sqlite:///path or redis://host:port/db")


class _LazyRedisSignals(RedisStopSignals):
    """Redis signals on the store's client, which exists once the store is open."""

    def __init__(self, store: RedisStore, channel: str) -> None:
        super().__init__(None, channel)
        self._store = store

    async def start(self) -> None:
        self.client = self._store.client
        await super().start()


def create_app(
    settings: Settings | None = None,
    *,
    clock: Clock | None = None,
    providers: EmbeddedProviders | None = None,
) -> web.Application:
    """Build the application. Its startup opens the store, stops turns a
    previous process left open, and checks the providers; any failure there
    stops the server before it serves.

    Args:
        settings: defaults to ``Settings()`` (environment + defaults).
        clock: time source (system clock by default).
        providers: the STT/LLM/TTS source (embedded ones by default).

    Raises:
        ValueError: ``settings.store`` is not a supported URL.
    """
    settings = settings or Settings()
    set_log_content(settings.log_content)  # per process: the last app built decides
    access_log.redact_parse_errors()
    app = web.Application(client_max_size=settings.max_offer_bytes, middlewares=[_json_errors])
    app[SETTINGS] = settings
    app[CLOCK] = clock or SystemClock()
    store, signals = open_store(settings)
    app[STORE] = store
    app[MANAGER] = TurnManager(
        store,
        app[CLOCK],
        signals=signals,
        lease_ttl_s=settings.lease_ttl_s,
        flag_staleness_s=settings.stop_flag_staleness_ms / 1000,
    )
    app[PEERS] = {}
    app[PACING] = PacingMonitor(window_s=settings.capacity.window_s)
    app[CAPACITY] = Capacity(settings.capacity, app[PACING], app[CLOCK], lambda: len(app[PEERS]))
    app[LIMITS] = Limits(settings.limits, app[CLOCK])
    app[STREAMS] = set()
    app[PROVIDERS] = provs = providers or EmbeddedProviders(settings, app[CLOCK])
    provs.bind(store)
    app[MANAGER].ledger.handlers = provs.effect_handlers()
    app[TEXT_TURNS] = TextTurns(
        app[MANAGER],
        provs.llm_for_session,
        app[CLOCK],
        stop_grace_s=settings.session.stop_grace_ms / 1000,
        plans=settings.plan_for,
        tools=provs.tools,
        history_messages=settings.session.history_messages,
    )
    # a crashed worker's text turns run on here; a stalled one's end when it finds them taken over
    app[MANAGER].take_over_abandoned = app[TEXT_TURNS].take_over
    app[MANAGER].on_lease_lost = app[TEXT_TURNS].lease_lost
    app.router.add_get("/", _index)
    app.router.add_static("/static", STATIC_DIR)
    app.router.add_get("/healthz", _healthz)
    signaling.add_routes(app)
    client_tokens.add_routes(app)
    api.add_routes(app)
    openapi.add_routes(app)
    drain.add_routes(app, drain.Drain(app[CLOCK], settings.shutdown))
    metrics.add_routes(app, metrics.Metrics())
    tracing.add_tracing(app, tracing.Tracing(settings, app[CLOCK], app[MANAGER]))
    instances.add_routes(app)
    telephony_routes.add_routes(app)
    device_routes.add_routes(app)
    # Startup enters these in order, cleanup leaves them in reverse: a step
    # that fails stops the server before it serves, and cleanup then undoes
    # what the steps before it did (aiohttp runs only the exits of the
    # contexts it entered). The sessions end in on_shutdown, before aiohttp
    # waits for its handlers (an SSE stream never ends by itself) and before
    # any of this is undone.
    app.cleanup_ctx.extend([_closed_at_cleanup, _store_opened, _background_work, instances.registered, _providers_started])
    app.on_shutdown.append(_end_sessions)
    return app


async def _closed_at_cleanup(app: web.Application) -> AsyncIterator[None]:
    """Nothing at startup; at cleanup, after the background work has
    stopped, close what :func:`create_app` made: the providers (the work
    used them), the stop signals, the store. Also when startup failed
    before opening them (closing is idempotent, and a store whose open
    failed half-way may hold a connection)."""
    yield
    await app[PROVIDERS].aclose()
    await app[MANAGER].signals.aclose()
    await app[STORE].close()


async def _store_opened(app: web.Application) -> AsyncIterator[None]:
    """Open the store and the stop signals, stop the turns a previous
    process left open, and make the API's auth (it needs the store's
    secret). Undone by :func:`_closed_at_cleanup`.

    Raises:
        RuntimeError: the store cannot be opened.
    """
    store = app[STORE]
    try:
        await store.open()
    except Exception as exc:
        raise RuntimeError(f"cannot open the store {app[SETTINGS].store}: {exc}") from exc
    manager = app[MANAGER]
    await manager.signals.start()
    # Turns whose worker died (crash, SIGKILL) must not stay open forever:
    # with one process per store (SQLite) every open turn is such a turn;
    # with many (Redis), those whose lease expired.
    reason = StopReason(
        kind=StopReasonKind.WORKER_SHUTDOWN,
        initiator="server",
        at=app[CLOCK].now(),
        detail="recovered at startup: the process running it ended without recording its end",
    )
    await manager.recover_abandoned(reason, all_open=store.single_instance)
    settings = app[SETTINGS]
    app[AUTH] = Auth(
        settings.tenants_by_token, await manager.store_call(lambda: store.secret("resume-token")),
        app[CLOCK], settings.resume_token_ttl_s, store=store, client_token_ttl_s=settings.auth.client_token_ttl_s,
    )
    yield


async def _background_work(app: web.Application) -> AsyncIterator[None]:
    """Start the lease keeper and the background workers (reconciliation,
    the lease sweeper, the providers' own); at cleanup (or if starting
    them failed) cancel them, the keeper first, and wait for the workers
    (at most 5 s)."""
    manager = app[MANAGER]
    loop = asyncio.get_running_loop()
    app[LEASES] = loop.create_task(manager.keep_leases(), name="lease-keeper")
    try:
        app[WORKERS] = [
            loop.create_task(manager.reconciliation_worker().run(), name="reconciliation"),
            loop.create_task(manager.sweep_abandoned(), name="lease-sweeper"),
            loop.create_task(_resume_released(app), name="resume-released"),
            loop.create_task(app[CAPACITY].run(), name="capacity"),
        ]
        app[WORKERS] += [
            loop.create_task(work, name=name)
            for name, work in app[PROVIDERS].workers(app[STORE], manager.owner).items()
        ]
        yield
    finally:
        app[LEASES].cancel()
        workers = app.get(WORKERS, [])
        for task in workers:
            task.cancel()
        if workers:
            await asyncio.wait(workers, timeout=5)


async def _resume_released(app: web.Application) -> None:
    """Run forever: at startup and every ``lease_ttl_s``, adopt the text
    turns another worker (or this one, before a restart) released in a
    drain, and run them on here (:mod:`turn.resume`). A failed round is
    logged and the next one runs on time."""
    manager = app[MANAGER]
    while True:
        try:
            # a draining instance takes nothing over: it is handing its own work on
            taken = 0 if app[DRAIN].draining else await app[TEXT_TURNS].resume_released()
            if taken:
                log.info("resumed %d released text turns", taken)
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("resuming released turns failed")
        await app[CLOCK].sleep(manager.lease_ttl_s)


async def _providers_started(app: web.Application) -> AsyncIterator[None]:
    """Check the providers (espeak-ng present, the speech recogniser
    loaded); they are closed by :func:`_closed_at_cleanup`.

    Raises:
        RuntimeError: from :meth:`EmbeddedProviders.start`.
    """
    await app[PROVIDERS].start()
    yield


async def _end_sessions(app: web.Application) -> None:
    """Shutdown (after a drain, or at once on a second signal): close every
    peer still open with ``worker_shutdown`` (at most 10 s), stop the text
    turns, write the event logs' queues to the store, and let each event
    stream send what is logged and end (see :mod:`web.drain`)."""
    peers = list(app[PEERS].values())
    closing = [p.close(StopReasonKind.WORKER_SHUTDOWN) for p in peers]
    if closing:
        await asyncio.wait(closing, timeout=10)
    await app[TEXT_TURNS].aclose()
    await app[MANAGER].events.flush()
    await close_streams(app[DRAIN], app)  # the terminal events reach every stream, then it ends
    await app[MANAGER].events.aclose()


@web.middleware
async def _json_errors(
    request: web.Request, handler: Callable[[web.Request], Awaitable[web.StreamResponse]]
) -> web.StreamResponse:
    """Turn aiohttp's plain-text errors into JSON ones on the API paths."""
    api = request.path.startswith(("/v1/", "/healthz"))
    try:
        return await handler(request)
    except ApiError:
        raise
    except web.HTTPException as exc:
        if not api or exc.status < 400:
            raise
        code = {404: "not_found", 405: "method_not_allowed", 413: "body_too_large"}.get(exc.status, "http_error")
        raise ApiError(exc.status, code, exc.reason) from exc
    except StoreUnavailable as exc:
        if not api:
            raise
        log.warning("store unavailable: %s", exc)
        raise ApiError(503, "store_unavailable", "the turn store is unavailable; try again", headers={"Retry-After": "1"}) from exc
    except Exception as exc:
        if not api:
            raise
        log.exception("error in %s %s", request.method, request.path)
        raise ApiError(500, "internal_error", "unexpected error; it was logged") from exc


async def _index(request: web.Request) -> web.StreamResponse:
    return web.FileResponse(STATIC_DIR / "index.html")


async def _healthz(request: web.Request) -> web.Response:
    return web.json_response({"status": "ok", "sessions": len(request.app[PEERS])})
