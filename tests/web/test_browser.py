"""The browser client in headless Chromium against the real server.

Chromium's fake capture device plays a WAV made with espeak-ng as the
microphone, so the whole path runs for real: getUserMedia -> WebRTC (aiortc)
-> VAD -> pocketsphinx (with a JSGF grammar, so recognition is exact) -> the
local agent -> espeak-ng TTS -> back to the page, with the events rendered in
the transcript and the turn panel.

Never downloads a browser: it uses Debian's /usr/bin/chromium and skips when
that (or espeak-ng / sox) is missing.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import subprocess
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path

import pytest
from aiohttp import web

import web.app as web_app
from turn.models import StopReasonKind
from web.app import create_app
from web.settings import Settings

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
GRAMMAR = (
    "#JSGF V1.0;\n"
    "grammar turnkeeper_test;\n"
    "public <utt> = tell me a story | what is the weather like today | count to twenty;\n"
)
CHROMIUM_ARGS = [
    "--no-sandbox",
    "--disable-gpu",
    "--disable-quic",
    "--no-first-run",
    "--disable-background-networking",
    "--disable-component-update",
    "--disable-sync",
    "--use-fake-ui-for-media-stream",  # grants the mic (and so un-hides host ICE candidates)
    "--use-fake-device-for-media-stream",
]
CONVERSATION_TIMEOUT_MS = 45_000


def _require(*commands: str) -> None:
    if not CHROMIUM.exists():
        pytest.skip(f"{CHROMIUM} is not installed")
    for cmd in commands:
        if shutil.which(cmd) is None:
            pytest.skip(f"{cmd} is not installed")


def make_mic_wav(tmp_path: Path, *parts: tuple[float, str], tail_s: float = 6.0) -> Path:
    """The fake microphone, 48 kHz mono 16-bit: for each ``(silence_s, text)``
    that much silence and then ``text`` spoken by espeak-ng; ``tail_s`` of
    silence at the end."""
    pieces: list[str] = []
    for i, (silence_s, text) in enumerate(parts):
        spoken = tmp_path / f"spoken{i}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-s", "140", "-w", str(spoken), text], check=True)
        piece = tmp_path / f"piece{i}.wav"
        tail = tail_s if i == len(parts) - 1 else 0
        subprocess.run(
            ["sox", str(spoken), "-r", "48000", "-c", "1", "-b", "16", str(piece), "pad", str(silence_s), str(tail)],
            check=True,
        )
        pieces.append(str(piece))
    mic = tmp_path / "mic.wav"
    subprocess.run(["sox", *pieces, str(mic)], check=True)
    return mic


@dataclass
class Server:
    app: web.Application
    url: str


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[Server]:
    """The real application on a free loopback port."""
    grammar = tmp_path / "test.gram"
    grammar.write_text(GRAMMAR)
    settings = Settings(store=f"sqlite:///{tmp_path}/t.db", stt={"grammar": grammar})
    app = create_app(settings)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    try:
        yield Server(app, f"http://127.0.0.1:{port}")
    finally:
        await runner.cleanup()


@pytest.fixture
async def playwright():  # type: ignore[no-untyped-def]
    from playwright.async_api import async_playwright

    async with async_playwright() as p:
        yield p


async def launch(playwright, extra_args: list[str] | None = None):  # type: ignore[no-untyped-def]
    return await playwright.chromium.launch(
        executable_path=str(CHROMIUM), args=[*CHROMIUM_ARGS, *(extra_args or [])]
    )


def collect_page_errors(page) -> list[str]:  # type: ignore[no-untyped-def]
    """Uncaught exceptions and console errors of ``page``."""
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(f"pageerror: {exc}"))
    page.on("console", lambda msg: errors.append(f"console: {msg.text}") if msg.type == "error" else None)
    return errors


async def wait_peers(app: web.Application, count: int, timeout_s: float) -> None:
    async def _poll() -> None:
        while len(app[web_app.PEERS]) != count:
            await asyncio.sleep(0.05)

    try:
        await asyncio.wait_for(_poll(), timeout_s)
    except TimeoutError:
        pytest.fail(f"server still has {len(app[web_app.PEERS])} peers after {timeout_s} s (wanted {count})")


async def test_conversation_in_chromium(server: Server, playwright, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Connect, say "what is the weather like today", see the transcript, the
    streamed reply and the turn panel reach "completed"; Disconnect frees the
    server's session."""
    _require("espeak-ng", "sox")
    mic = make_mic_wav(tmp_path, (1.0, "what is the weather like today"))
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}%noloop"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        # Record every label the panel shows, in order.
        await page.add_init_script(
            """
            window.__states = [];
            document.addEventListener("DOMContentLoaded", () => {
              const el = document.getElementById("turn-state");
              new MutationObserver(() => window.__states.push(el.textContent))
                .observe(el, {childList: true, characterData: true, subtree: true});
            });
            """
        )
        await page.goto(f"{server.url}/?raw=1")
        await page.click("#connect")
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'connected'", timeout=15_000
        )

        user = page.locator("#transcript .user", has_text="weather")
        await user.first.wait_for(timeout=CONVERSATION_TIMEOUT_MS)
        turn_id = await user.first.get_attribute("data-turn-id")
        assert turn_id
        agent = page.locator(f'#transcript .agent[data-turn-id="{turn_id}"]')
        await page.wait_for_function(
            "id => { const a = document.querySelector(`#transcript .agent[data-turn-id=\"${id}\"] .text`);"
            " return a && a.textContent.includes('sunny'); }",
            arg=turn_id,
            timeout=CONVERSATION_TIMEOUT_MS,
        )
        await page.wait_for_function(
            "document.getElementById('turn-state').textContent === 'completed'", timeout=CONVERSATION_TIMEOUT_MS
        )

        assert (await page.text_content("#turn-id")) == turn_id
        generation = (await page.text_content("#turn-generation") or "").strip()
        assert generation and int(generation) >= 1
        assert "sunny and twenty two degrees" in (await agent.inner_text())
        entry = page.locator(f'#transcript li.turn[data-turn-id="{turn_id}"]')
        assert await entry.get_attribute("data-state") == "completed"
        assert not await entry.evaluate("el => el.classList.contains('interrupted')")
        states = await page.evaluate("window.__states")
        assert "running" in states and states[-1] == "completed", states
        assert "cancelled" not in states and "stopping" not in states, states
        # A data-channel ping got its pong.
        assert (await page.text_content("#rtt") or "").endswith("ms")

        await page.screenshot(path="/tmp/turnkeeper-page.png", full_page=True)

        assert len(server.app[web_app.PEERS]) == 1
        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert await page.get_attribute("#status", "data-state") == "idle"
        assert await page.is_enabled("#connect")
        assert await page.is_disabled("#disconnect")

        # Connecting again works (the fake file is used up: silence, no turn).
        await page.click("#connect")
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'connected'", timeout=15_000
        )
        await wait_peers(server.app, 1, timeout_s=5)
        assert (await page.text_content("#turn-id")) == ""
        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)

        assert errors == [], errors
    finally:
        await browser.close()


async def test_barge_in_in_chromium(server: Server, playwright, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """Ask for the weather, then talk over the reply: the panel shows the old
    turn "stopping" then "cancelled" (never "cancelled" first), then the new
    turn; the old reply is marked interrupted and the barge-in is logged."""
    _require("espeak-ng", "sox")
    # The weather reply is spoken for about ten seconds, starting one or two
    # seconds after the question ends: four seconds later we interrupt it.
    mic = make_mic_wav(tmp_path, (1.0, "what is the weather like today"), (4.0, "count to twenty"), tail_s=8.0)
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}%noloop"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        # Record every (turn id, label) the panel shows, in order.
        await page.add_init_script(
            """
            window.__panel = [];
            document.addEventListener("DOMContentLoaded", () => {
              const state = document.getElementById("turn-state");
              const id = document.getElementById("turn-id");
              new MutationObserver(() => {
                const last = window.__panel[window.__panel.length - 1];
                const now = [id.textContent, state.textContent];
                if (!last || last[0] !== now[0] || last[1] !== now[1]) window.__panel.push(now);
              }).observe(state, {childList: true, characterData: true, subtree: true});
            });
            """
        )
        await page.goto(f"{server.url}/?raw=1")
        await page.click("#connect")

        await page.locator("#transcript .user", has_text="weather").first.wait_for(timeout=CONVERSATION_TIMEOUT_MS)
        old_id = await page.locator("#transcript .user", has_text="weather").first.get_attribute("data-turn-id")
        new_user = page.locator("#transcript .user", has_text="count to twenty")
        await new_user.first.wait_for(timeout=CONVERSATION_TIMEOUT_MS)
        new_id = await new_user.first.get_attribute("data-turn-id")
        assert old_id and new_id and old_id != new_id
        await page.wait_for_function(
            "document.getElementById('turn-state').textContent === 'completed'", timeout=CONVERSATION_TIMEOUT_MS
        )
        await page.screenshot(path="/tmp/turnkeeper-barge-in.png", full_page=True)

        panel = [tuple(x) for x in await page.evaluate("window.__panel")]
        old_states = [label for tid, label in panel if tid == old_id]
        assert old_states[-2:] == ["stopping", "cancelled"], panel
        # The old turn was cancelled before the new one appeared in the panel.
        first_new = next(i for i, (tid, _) in enumerate(panel) if tid == new_id)
        assert panel.index((old_id, "cancelled")) < first_new, panel
        assert panel[-1] == (new_id, "completed"), panel

        old_entry = page.locator(f'#transcript li.turn[data-turn-id="{old_id}"]')
        assert await old_entry.get_attribute("data-state") == "cancelled"
        assert "interrupted" in (await old_entry.get_attribute("class") or "")
        old_agent = old_entry.locator(".agent")
        assert await old_agent.locator(".tag").is_visible()
        assert "(interrupted; " in await old_agent.inner_text()  # says how much speech was dropped
        assert "sunny" in await old_agent.inner_text()
        assert "nineteen, twenty." in await page.locator(f'#transcript .agent[data-turn-id="{new_id}"]').inner_text()

        gen_old = int(await old_entry.get_attribute("data-generation") or "0")
        assert int(await page.text_content("#turn-generation") or "0") > gen_old
        barge = await page.locator("#barge-ins li").all_inner_texts()
        assert len(barge) == 1 and "fenced" in barge[0] and "ms" in barge[0], barge
        assert await page.locator("#barge-ins li").first.get_attribute("data-old-turn-id") == old_id

        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert errors == [], errors
    finally:
        await browser.close()


async def test_server_side_close_is_shown(server: Server, playwright) -> None:  # type: ignore[no-untyped-def]
    """When the server ends the session, the page says so, releases the mic
    and can connect again."""
    _require()
    browser = await launch(playwright)
    try:
        page = await browser.new_page(color_scheme="dark")
        errors = collect_page_errors(page)
        await page.goto(server.url + "/?raw=1")
        await page.click("#connect")
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'connected'", timeout=15_000
        )
        await wait_peers(server.app, 1, timeout_s=5)
        (peer,) = server.app[web_app.PEERS].values()
        await peer.close(StopReasonKind.WORKER_SHUTDOWN)
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'error'", timeout=10_000
        )
        assert "server" in (await page.text_content("#status") or "")
        assert await page.is_enabled("#connect")
        assert await page.is_disabled("#disconnect")
        await page.screenshot(path="/tmp/turnkeeper-closed.png")

        await page.click("#connect")
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'connected'", timeout=15_000
        )
        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert errors == [], errors
    finally:
        await browser.close()


async def test_index_serves_the_client(server: Server, playwright) -> None:  # type: ignore[no-untyped-def]
    """``GET /`` is the client page, with its script and stylesheet."""
    _require()
    browser = await launch(playwright)
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        response = await page.goto(server.url + "/")
        assert response is not None and response.ok
        assert await page.is_enabled("#connect")
        assert await page.is_disabled("#disconnect")
        assert await page.get_attribute("#transcript", "aria-live") == "polite"
        for path in ("/static/client.js", "/static/style.css"):
            r = await page.request.get(server.url + path)
            assert r.ok, path
        assert errors == [], errors
    finally:
        await browser.close()


async def test_rejected_offer_is_shown(server: Server, playwright) -> None:  # type: ignore[no-untyped-def]
    """A garbage offer gets the server's JSON error, which the page shows in
    #status; the mic is released and Connect is usable again."""
    _require()
    browser = await launch(playwright)  # default fake device: a beep, no file needed
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)

        async def garbage(route):  # type: ignore[no-untyped-def]
            await route.continue_(post_data=json.dumps({"type": "offer", "sdp": "not an sdp"}))

        await page.route("**/v1/webrtc/offer", garbage)
        await page.goto(server.url + "/")
        await page.click("#connect")
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'error'", timeout=15_000
        )
        status = await page.text_content("#status") or ""
        assert "invalid_sdp" in status, status
        assert await page.is_enabled("#connect")
        assert await page.is_disabled("#disconnect")
        assert len(server.app[web_app.PEERS]) == 0
        # Filter Chromium's own log line about the failed (400) request.
        assert [e for e in errors if "400" not in e] == [], errors
    finally:
        await browser.close()


async def test_microphone_denied_is_shown(server: Server, playwright) -> None:  # type: ignore[no-untyped-def]
    """getUserMedia failing is a visible message, not an uncaught exception."""
    _require()
    browser = await launch(playwright)
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await page.add_init_script(
            """
            navigator.mediaDevices.getUserMedia = () =>
              Promise.reject(new DOMException("Permission denied", "NotAllowedError"));
            """
        )
        await page.goto(server.url + "/")
        await page.click("#connect")
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'error'", timeout=5_000
        )
        status = await page.text_content("#status") or ""
        assert "NotAllowedError" in status, status
        assert await page.is_enabled("#connect")
        assert errors == [], errors
    finally:
        await browser.close()
