"""The browser client on a server with API tokens, in headless Chromium:
without a client token it is refused and says why; with one (from the
embedding page's backend, or the URL fragment) it connects, once per token,
as the token's tenant."""

from __future__ import annotations

from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from conftest import start_app
from test_browser import CHROMIUM, collect_page_errors, launch, wait_peers

from turn.models import StopReasonKind
from web.app import PEERS, create_app
from web.settings import Settings

pytestmark = pytest.mark.browser
TOKEN = "tok-acme-0123456789"


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[web.Application, str]]:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens=f"acme:{TOKEN}"))
    runner, url = await start_app(app)
    yield app, url
    for peer in list(app[PEERS].values()):
        await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
    await runner.cleanup()


async def mint(url: str) -> dict[str, Any]:
    """What the app's backend does: ``POST /v1/sessions`` with its API token."""
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/sessions", json={"user_id": "browser-user"},
                             headers={"Authorization": f"Bearer {TOKEN}"}) as r:
            assert r.status == 201
            return dict(await r.json())


async def connected(page: Any) -> None:
    await page.wait_for_function("document.getElementById('status').dataset.state === 'connected'", timeout=15_000)


async def test_without_a_token_the_page_is_refused_and_says_why(server: tuple[web.Application, str], playwright: Any) -> None:
    app, url = server
    browser = await launch(playwright)
    try:
        page = await browser.new_page()
        await page.goto(f"{url}/?raw=1")
        await page.click("#connect")
        await page.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=15_000)
        status = await page.text_content("#status") or ""
        assert "Not allowed" in status and "client token" in status, status
        assert app[PEERS] == {}
    finally:
        await browser.close()


async def test_a_fragment_token_connects_once_as_its_tenant(server: tuple[web.Application, str], playwright: Any) -> None:
    app, url = server
    minted = await mint(url)
    browser = await launch(playwright)
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await page.goto(f"{url}/?raw=1#client_token={minted['client_token']}")
        await page.click("#connect")
        await connected(page)
        assert "client_token" not in await page.evaluate("location.href")  # used once, gone from the address
        [peer] = app[PEERS].values()
        assert (peer.id, peer.tenant, peer.user_id) == (minted["session_id"], "acme", "browser-user")
        assert not [e for e in errors if "pageerror" in e], errors
    finally:
        await browser.close()
    await wait_peers(app, 0, timeout_s=10)


async def test_the_embedding_page_gets_a_fresh_token_for_each_connection(
    server: tuple[web.Application, str], playwright: Any
) -> None:
    """``window.turnkeeperClientToken`` asks the app's backend (here a
    route the test serves, minting with the tenant's API token) before every
    offer: Disconnect, Connect again starts a second session."""
    app, url = server
    minted: list[dict[str, Any]] = []

    async def backend(route: Any) -> None:
        minted.append(await mint(url))
        await route.fulfill(json={"client_token": minted[-1]["client_token"]})

    browser = await launch(playwright)
    try:
        page = await browser.new_page()
        await page.route("**/my-backend/token", backend)
        await page.add_init_script("""
            window.turnkeeperClientToken = async () =>
              (await (await fetch("/my-backend/token", {method: "POST"})).json()).client_token;
        """)
        await page.goto(f"{url}/?raw=1")
        sessions = []
        for _ in range(2):
            await page.click("#connect")
            await connected(page)
            sessions.append(await page.text_content("#session-id"))
            await page.click("#disconnect")
            await wait_peers(app, 0, timeout_s=10)
        assert sessions == [m["session_id"] for m in minted] and len(set(sessions)) == 2
    finally:
        await browser.close()
