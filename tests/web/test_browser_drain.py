"""A deploy, as the browser sees it: two real servers behind a small load
balancer (it sends each request to the first backend whose ``/readyz``
answers 200, as a Kubernetes Service does with readiness). The page is
connected to A; A drains. The page, idle, opens a new session (its offer
lands on B), switches over once B's media is connected, and leaves A:
A's drain then ends with no voice session to cut.

Headless Debian Chromium, as ``tests/web/test_browser.py``.
"""

from __future__ import annotations

import asyncio
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from conftest import start_app
from test_browser import _require, collect_page_errors, launch, make_mic_wav, wait_peers

from web.app import PEERS, create_app
from web.drain import DRAIN, drain_app
from web.settings import Settings

pytestmark = pytest.mark.browser

HOP_HEADERS = {"host", "content-length", "transfer-encoding", "connection"}


def balancer(backends: list[str]) -> web.Application:
    """Forwards every request to the first of ``backends`` that is ready."""
    app = web.Application()

    async def forward(request: web.Request) -> web.StreamResponse:
        body = await request.read()
        async with aiohttp.ClientSession() as http:
            for base in backends:
                try:
                    async with http.get(base + "/readyz") as r:
                        if r.status != 200:
                            continue
                except aiohttp.ClientError:
                    continue
                headers = {k: v for k, v in request.headers.items() if k.lower() not in HOP_HEADERS}
                async with http.request(request.method, base + request.path_qs, headers=headers, data=body) as r:
                    out = {k: v for k, v in r.headers.items() if k.lower() not in HOP_HEADERS | {"content-encoding"}}
                    return web.Response(status=r.status, headers=out, body=await r.read())
        return web.json_response({"error": {"code": "no_backend", "message": "no ready backend"}}, status=503)

    app.router.add_route("*", "/{tail:.*}", forward)
    return app


def settings(tmp_path: Path, name: str) -> Settings:
    return Settings(
        store=f"sqlite:///{tmp_path}/{name}.db",
        shutdown={"lb_delay_s": 0, "drain_timeout_s": 30, "turn_wait_s": 1, "grace_s": 40},
    )


@pytest.fixture
async def fleet(tmp_path: Path) -> AsyncIterator[tuple[web.Application, web.Application, str]]:
    a, b = create_app(settings(tmp_path, "a")), create_app(settings(tmp_path, "b"))
    runners = []
    try:
        ra, url_a = await start_app(a)
        runners.append(ra)
        rb, url_b = await start_app(b)
        runners.append(rb)
        rl, url = await start_app(balancer([url_a, url_b]))
        runners.append(rl)
        yield a, b, url
    finally:
        for r in reversed(runners):
            await r.cleanup()


async def test_an_idle_page_moves_to_a_serving_instance_when_its_server_drains(  # type: ignore[no-untyped-def]
    fleet: tuple[web.Application, web.Application, str], playwright, tmp_path: Path
) -> None:
    _require("sox")
    a, b, url = fleet
    silence = tmp_path / "silence.wav"
    subprocess.run(["sox", "-n", "-r", "48000", "-c", "1", "-b", "16", str(silence), "trim", "0", "60"], check=True)
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={silence}"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await page.goto(url + "/?raw=1")
        await page.click("#connect")
        await page.wait_for_function("document.getElementById('status').dataset.state === 'connected'", timeout=15_000)
        await wait_peers(a, 1, timeout_s=5)
        (old_session,) = a[PEERS].keys()
        assert await page.text_content("#session-id") == old_session

        a[DRAIN].begin("test", lambda d: drain_app(d, a))
        # the page opens a session on B (A refuses offers now), switches, and leaves A
        await wait_peers(b, 1, timeout_s=20)
        await page.wait_for_function(
            "document.getElementById('status').textContent.startsWith('Moved to another server')", timeout=20_000
        )
        (new_session,) = b[PEERS].keys()
        assert await page.text_content("#session-id") == new_session
        # A's drain ends well before its 30 s drain_timeout: the page left, nothing was cut
        await asyncio.wait_for(a[DRAIN].done.wait(), 15)
        assert len(a[PEERS]) == 0
        assert await page.evaluate("document.getElementById('status').dataset.state") == "connected"
        assert await page.is_enabled("#disconnect")
        await page.click("#disconnect")
        await wait_peers(b, 0, timeout_s=5)
        assert errors == [], errors
    finally:
        await browser.close()


async def test_a_page_in_a_turn_moves_only_once_the_turn_has_ended(  # type: ignore[no-untyped-def]
    fleet: tuple[web.Application, web.Application, str], playwright, tmp_path: Path
) -> None:
    """The drain comes while the agent counts to twenty: the page stays on
    A until that turn has ended and the agent is idle (the reply is heard
    whole), then moves to B."""
    _require("espeak-ng", "sox")
    a, b, url = fleet
    mic = make_mic_wav(tmp_path, (1.0, "please count to twenty"), tail_s=60)
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}%noloop"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await page.goto(url + "/?raw=1")
        await page.click("#connect")
        await page.wait_for_function("document.getElementById('agent-phase').textContent === 'speaking'", timeout=30_000)
        a[DRAIN].begin("test", lambda d: drain_app(d, a))
        await asyncio.sleep(2.0)
        assert len(b[PEERS]) == 0  # mid-reply: it stays
        assert await page.text_content("#agent-phase") == "speaking"
        await page.wait_for_function(
            "document.getElementById('status').textContent.startsWith('Moved to another server')", timeout=40_000
        )
        assert len(b[PEERS]) == 1
        assert "completed" in (await page.text_content("#turn-log") or "")
        await asyncio.wait_for(a[DRAIN].done.wait(), 15)
        assert errors == [], errors
    finally:
        await browser.close()
