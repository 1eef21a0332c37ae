"""Running the server as a process: ``turnkeeper serve``.

aiohttp's ``run_app`` stops at the first SIGTERM: the listener closes at
once (clients get refused connections), event streams are cut mid-way and
turns end ``worker_shutdown`` within a second. Here the signals start a
drain instead (:mod:`web.drain`): the listener stays open and answers new
work with 503, sessions and turns get their time, every event stream gets
its terminal events and a clean end, and the process exits 0. A SIGTERM
after a drain that ``POST /v1/admin/drain`` began (Kubernetes sends it
once the preStop hook returns) lets that drain go on. A second signal, or
``shutdown.grace_s`` after the drain began, exits at once with status 1:
whatever was open then is found by the lease sweeper after restart.

Before it listens, the process freezes what its startup left alive, so
CPython's full collections no longer walk the libraries' objects (tens of
ms each, a gap in every caller's audio), and settles again whenever it has
gone idle after serving (:mod:`web.garbage_collector`).
"""

from __future__ import annotations

import asyncio
import logging
import os
import signal
from typing import Any

from aiohttp import web

from web import garbage_collector
from web.access_log import runner as app_runner
from web.app import create_app
from web.auth import check_exposure
from web.drain import DRAIN, drain_app
from web.settings import Settings
from web.state import CLOCK, PEERS

log = logging.getLogger(__name__)

#: how often the main loop looks at the drain and the grace, s
WATCH_S = 0.1
#: exit status when the process had to stop before its drain finished
EXIT_AT_ONCE = 1


async def serve(settings: Settings) -> int:
    """Serve until a drain has run (SIGTERM, SIGINT, ``POST
    /v1/admin/drain``), then clean up and return 0; see the module doc.

    Raises:
        OSError: the address cannot be listened on.
        ValueError: not loopback, no API tokens and not ``auth.insecure``
            (:func:`web.auth.check_exposure`).
    """
    check_exposure(settings.host, bool(settings.tenants_by_token), settings.auth.insecure)
    app = create_app(settings)
    runner = app_runner(app, handle_signals=False)  # its access log leaves secrets out, at DEBUG
    await runner.setup()
    # set up, before the first caller can connect: what lives now is walked
    # by no collection from here on
    settled = garbage_collector.settle()
    log.debug("froze %d objects after startup (%.0f ms): full collections stay short", settled.frozen, settled.ms)
    site = web.TCPSite(runner, settings.host, settings.port)
    try:
        await site.start()
    except OSError as exc:
        await runner.cleanup()
        raise OSError(exc.errno, f"cannot listen on {settings.host}:{settings.port}: {exc.strerror or exc}") from exc
    host = f"[{settings.host}]" if ":" in settings.host else settings.host  # an IPv6 address in a URL (RFC 3986)
    print(f"turnkeeper serving on http://{host}:{settings.port}", flush=True)
    weak = sorted({tenant for token, tenant in settings.tenants_by_token.items()
                   if not token.startswith("sha256:") and len(token) < 16})
    if weak:
        log.warning("API tokens of %s are shorter than 16 characters: guessable; use e.g. `openssl rand -hex 24`",
                    ", ".join(weak))
    if not settings.tenants_by_token:
        log.warning("no API tokens: serving unauthenticated on %s (development mode: voice sessions are tenant "
                    "'default', the REST API is off)", settings.host)
    drain = app[DRAIN]
    at_once = asyncio.Event()
    loop = asyncio.get_running_loop()
    idle_collector = loop.create_task(garbage_collector.settle_when_idle(lambda: len(app[PEERS]), app[CLOCK]),
                                      name="settle-when-idle")

    signals = [0]

    def on_signal(name: str) -> None:
        signals[0] += 1
        if signals[0] > 1:
            log.warning("%s again while draining: exiting at once", name)
            at_once.set()
        else:  # the first: a drain (or the one a preStop hook began goes on)
            drain.begin(name, lambda d: drain_app(d, app))

    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, on_signal, sig.name)
    grace_s = settings.shutdown.grace_s
    while not drain.done.is_set() and not at_once.is_set():
        if drain.draining and drain.elapsed_s() >= grace_s:
            log.warning("drain still running after shutdown.grace_s (%.0f s): exiting at once", grace_s)
            at_once.set()
            break
        waiters = [asyncio.ensure_future(drain.done.wait()), asyncio.ensure_future(at_once.wait())]
        await asyncio.wait(waiters, timeout=WATCH_S, return_when=asyncio.FIRST_COMPLETED)
        for w in waiters:
            w.cancel()
    idle_collector.cancel()
    if not at_once.is_set():
        # the cleanup (handlers' end, background work, the store) counts
        # against the grace too, and a second signal cuts it short
        cleanup = asyncio.ensure_future(runner.cleanup())
        stop = asyncio.ensure_future(at_once.wait())
        left = max(0.0, grace_s - drain.elapsed_s())
        await asyncio.wait({cleanup, stop}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
        stop.cancel()
        if cleanup.done():
            cleanup.result()  # its error, if any, is the process's
            return 0
        log.warning("cleanup still running after shutdown.grace_s (%.0f s): exiting at once; waiting were:\n%s",
                    grace_s, _pending_tasks())
    logging.shutdown()
    os._exit(EXIT_AT_ONCE)  # nothing more may run: the sweeper settles what was open


def _pending_tasks() -> str:
    """Each unfinished task with the line it waits on, for the log of a
    shutdown that ran out of time (what held it is the bug to fix)."""
    lines = []
    for task in asyncio.all_tasks():
        if task is asyncio.current_task():
            continue
        chain: list[str] = []
        coro: Any = task.get_coro()
        while coro is not None and len(chain) < 40:  # the awaits, outermost first
            frame = getattr(coro, "cr_frame", None) or getattr(coro, "ag_frame", None)
            if frame is not None:
                chain.append(f"{frame.f_code.co_name} ({frame.f_code.co_filename}:{frame.f_lineno})")
            coro = getattr(coro, "cr_await", None) or getattr(coro, "ag_await", None)
        lines.append(f"  {task.get_name()}: " + " -> ".join(chain or ["?"]))
    return "\n".join(sorted(lines))
