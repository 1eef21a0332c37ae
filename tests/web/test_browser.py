"""The browser client in headless Chromium against the real server.

Chromium's fake capture device plays a WAV made with espeak-ng as the
microphone, so the whole path runs for real: getUserMedia -> WebRTC (aiortc)
-> VAD -> Whisper (the embedded default) -> the
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
from turn.events import event_json
from turn.models import StopReasonKind
from web.app import create_app
from web.settings import Settings

pytestmark = pytest.mark.browser

CHROMIUM = Path("/usr/bin/chromium")
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
    settings = Settings(store=f"sqlite:///{tmp_path}/t.db")
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
        # nothing the user did stopped a turn; a reply started at a pause the
        # speech went on after (a loaded machine's audio can have one) is
        # shown as taken back, not as a stop
        assert "cancelled" not in states and "stopping" not in states, states
        assert await page.locator("#transcript li.turn").count() == 1  # a withdrawn one's entry is gone
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
    mic = make_mic_wav(tmp_path, (1.0, "what is the weather like today"), (4.0, "please count to twenty"), tail_s=8.0)
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
        new_user = page.locator("#transcript .user", has_text="count to")
        try:
            await new_user.first.wait_for(timeout=CONVERSATION_TIMEOUT_MS)
        except Exception as e:  # a load-dependent miss: say what the page did show
            seen = await page.locator("#transcript").inner_text()
            panel = await page.evaluate("window.__panel")
            logged = [
                {k: ev.get(k) for k in ("type", "event", "status", "text", "role", "stop_reason", "by", "outcome", "turn_id") if k in ev}
                for ev in await server_events(the_peer(server.app))
                if ev["type"] in ("vad", "turn", "transcript", "barge_in", "end_of_turn", "backchannel", "false_interruption")
            ]
            raise AssertionError(f"no 'count to' turn; transcript: {seen!r}; panel: {panel}; log: {logged}") from e
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


@pytest.mark.parametrize("query, declared", [("", True), ("?raw=1", False)])
async def test_the_page_declares_its_echo_canceller(server: Server, playwright, query: str, declared: bool) -> None:  # type: ignore[no-untyped-def]
    """The offer carries the microphone track's
    ``MediaTrackSettings.echoCancellation``: on by default (the server's
    echo guard then assumes the canceller's loss at a first reply), off in
    raw mode (a speakerphone with no canceller: nothing assumed)."""
    _require()
    browser = await launch(playwright)
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        offers: list[dict] = []
        page.on("request", lambda r: offers.append(json.loads(r.post_data or "{}")) if r.url.endswith("/v1/webrtc/offer") else None)
        await page.goto(server.url + "/" + query)
        await page.click("#connect")
        await page.wait_for_function(
            "document.getElementById('status').dataset.state === 'connected'", timeout=15_000
        )
        await wait_peers(server.app, 1, timeout_s=5)
        assert [o.get("echo_cancellation") for o in offers] == [declared], offers
        (peer,) = server.app[web_app.PEERS].values()
        settings = server.app[web_app.SETTINGS].bargein
        assert peer.bargein.echo_assumed_loss_db == (settings.echo_cancelled_loss_db if declared else settings.echo_assumed_loss_db)
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


# ---- push-to-talk and the new voice events ----------------------------------

#: records what the client sends on its data channel (pings left out) in
#: ``window.__sent`` and keeps the channel in ``window.__dc``, so a test can
#: send a message the client itself never would
RECORD_DATA_CHANNEL = """
window.__sent = [];
const _send = RTCDataChannel.prototype.send;
RTCDataChannel.prototype.send = function (data) {
  try { const m = JSON.parse(data); if (m.type !== "ping") window.__sent.push(m.type); } catch (_) {}
  return _send.call(this, data);
};
const _create = RTCPeerConnection.prototype.createDataChannel;
RTCPeerConnection.prototype.createDataChannel = function (...args) {
  const dc = _create.apply(this, args);
  window.__dc = dc;
  return dc;
};
"""
PTT_ENABLED = "!document.getElementById('ptt').disabled"


def make_silent_wav(tmp_path: Path, seconds: float = 60.0) -> Path:
    """A fake microphone that hears nothing (the default fake device beeps)."""
    wav = tmp_path / "silence.wav"
    subprocess.run(["sox", "-n", "-r", "48000", "-c", "1", "-b", "16", str(wav), "trim", "0", str(seconds)], check=True)
    return wav


def wav_seconds(path: Path) -> float:
    return float(subprocess.run(["sox", "--i", "-D", str(path)], check=True, capture_output=True, text=True).stdout)


def the_peer(app: web.Application):  # type: ignore[no-untyped-def]
    (peer,) = app[web_app.PEERS].values()
    return peer


async def server_events(peer) -> list[dict]:  # type: ignore[no-untyped-def]
    """The session's event log as the server stored it (fenced ones included)."""
    out = []
    for ev in await peer.manager.store.read_events(peer.id):
        d = event_json(ev)
        d["fenced"] = ev.fenced
        out.append(d)
    return out


async def wait_server_event(peer, pred, what: str, timeout_s: float = 10.0) -> dict:  # type: ignore[no-untyped-def]
    """The first logged event matching ``pred``, waiting for it."""
    deadline = asyncio.get_running_loop().time() + timeout_s
    while True:
        for ev in await server_events(peer):
            if pred(ev):
                return ev
        if asyncio.get_running_loop().time() > deadline:
            types = [(e["type"], e.get("event") or e.get("status") or e.get("text")) for e in await server_events(peer)]
            pytest.fail(f"no {what} in the server's event log after {timeout_s} s: {types}")
        await asyncio.sleep(0.05)


async def connect_for_ptt(page, url: str) -> None:  # type: ignore[no-untyped-def]
    await page.add_init_script(RECORD_DATA_CHANNEL)
    await page.goto(f"{url}/?raw=1")
    assert await page.is_disabled("#ptt")
    await page.click("#connect")
    await page.wait_for_function(PTT_ENABLED, timeout=15_000)


async def test_ptt_button_follows_the_connection(server: Server, playwright, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """(a) "Hold to talk" is disabled until the session is connected, enabled
    then, disabled again after Disconnect; losing the connection while it is
    held resets it (not pressed, no talking state)."""
    _require("sox")
    mic = make_silent_wav(tmp_path)
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await page.add_init_script(RECORD_DATA_CHANNEL)
        await page.goto(f"{server.url}/?raw=1")
        assert await page.is_disabled("#ptt")
        assert await page.get_attribute("#ptt", "aria-pressed") == "false"
        assert await page.text_content("#ptt") == "Hold to talk"
        # Not connected: pressing it or Space sends nothing.
        await page.keyboard.down("Space")
        await page.keyboard.up("Space")
        assert await page.evaluate("window.__sent") == []

        await page.click("#connect")
        await page.wait_for_function(PTT_ENABLED, timeout=15_000)
        assert await page.get_attribute("#status", "data-state") == "connected"
        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert await page.is_disabled("#ptt")

        # Held when the server ends the session: the press is forgotten.
        await page.click("#connect")
        await page.wait_for_function(PTT_ENABLED, timeout=15_000)
        await page.hover("#ptt")
        await page.mouse.down()
        assert await page.get_attribute("#ptt", "aria-pressed") == "true"
        assert await page.text_content("#ptt-state") == "talking (push-to-talk)"
        peer = the_peer(server.app)
        await wait_server_event(peer, lambda e: e["type"] == "turn" and e["status"] == "RUNNING", "running turn")
        await peer.close(StopReasonKind.WORKER_SHUTDOWN)
        await page.wait_for_function("document.getElementById('status').dataset.state === 'error'", timeout=10_000)
        assert await page.is_disabled("#ptt")
        assert await page.get_attribute("#ptt", "aria-pressed") == "false"
        assert (await page.text_content("#ptt-state") or "") == ""
        assert not await page.evaluate("document.body.classList.contains('ptt-held')")
        await page.mouse.up()
        assert await page.evaluate("window.__sent") == ["ptt.start"]
        assert errors == [], errors
    finally:
        await browser.close()


async def test_ptt_turn_and_ptt_barge_in(server: Server, playwright, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """(b) Holding the button while asking opens a turn on ptt.start (no VAD
    involved), releasing ends it at once (end_of_turn) and it is answered;
    holding it again while the agent speaks barges in with initiator "ptt",
    and the interrupted reply shows what was heard, the rest struck."""
    _require("espeak-ng", "sox")
    lead_s = 5.0  # silence before the question: time to connect and press
    mic = make_mic_wav(tmp_path, (lead_s, "what is the weather like today"), tail_s=40.0)
    speech_s = wav_seconds(tmp_path / "spoken0.wav")
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}%noloop"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await page.add_init_script(RECORD_DATA_CHANNEL)
        await page.goto(f"{server.url}/?raw=1")
        loop = asyncio.get_running_loop()
        t0 = loop.time()  # the fake file starts playing when the mic opens, just after this
        await page.click("#connect")
        await page.wait_for_function(PTT_ENABLED, timeout=15_000)
        if loop.time() - t0 > lead_s - 1.0:
            pytest.fail(f"connecting took {loop.time() - t0:.1f} s: too late to press before the question")
        peer = the_peer(server.app)

        await page.hover("#ptt")
        await page.mouse.down()
        assert await page.get_attribute("#ptt", "aria-pressed") == "true"
        assert await page.text_content("#ptt-state") == "talking (push-to-talk)"
        opened = await wait_server_event(
            peer, lambda e: e["type"] == "turn" and e["status"] == "RUNNING", "turn opened by ptt.start"
        )
        first = opened["turn_id"]
        assert peer.agent.ptt_active
        # Hold through the question, then release: the turn ends at once.
        await asyncio.sleep(max(0.0, t0 + lead_s + speech_s + 1.5 - loop.time()))
        await page.mouse.up()
        assert await page.get_attribute("#ptt", "aria-pressed") == "false"
        await wait_server_event(peer, lambda e: e["type"] == "vad" and e["event"] == "end_of_turn", "end_of_turn")
        assert not peer.agent.ptt_active

        user = page.locator(f'#transcript .user[data-turn-id="{first}"]')
        await page.wait_for_function(
            "id => (document.querySelector(`#transcript .user[data-turn-id=\"${id}\"] .text`) || {}).textContent"
            " === 'What is the weather like today?'",
            arg=first,
            timeout=CONVERSATION_TIMEOUT_MS,
        )
        assert "weather" in await user.inner_text()
        # Let the reply be heard for a while, then take the turn by push-to-talk.
        await page.wait_for_function(
            "document.getElementById('agent-phase').textContent === 'speaking'", timeout=CONVERSATION_TIMEOUT_MS
        )
        await wait_server_event(
            peer, lambda e: e["type"] == "audio.start" and e["turn_id"] == first, "reply audio", timeout_s=15
        )
        await asyncio.sleep(2.5)
        await page.hover("#ptt")
        await page.mouse.down()
        barge = await wait_server_event(peer, lambda e: e["type"] == "barge_in", "barge_in")
        assert barge["initiator"] == "ptt" and barge["old_turn_id"] == first, barge
        interrupted = await wait_server_event(
            peer, lambda e: e["type"] == "agent.interrupted" and e["turn_id"] == first, "agent.interrupted"
        )
        assert interrupted["heard"], interrupted  # 2.5 s of it were played
        await asyncio.sleep(0.5)
        await page.mouse.up()

        entry = page.locator(f'#transcript li.turn[data-turn-id="{first}"]')
        await page.wait_for_function(
            "id => document.querySelector(`#transcript li.turn[data-turn-id=\"${id}\"]`).dataset.state === 'cancelled'",
            arg=first,
            timeout=15_000,
        )
        assert "interrupted" in (await entry.get_attribute("class") or "")
        assert await entry.get_attribute("data-heard") == interrupted["heard"]
        tag = await entry.locator(".agent .tag").inner_text()
        assert tag.startswith("(interrupted; heard ") and "by push-to-talk" in tag, tag
        heard_text = await entry.locator(".agent > .text").inner_text()
        assert heard_text.split() == interrupted["heard"].split(), (heard_text, interrupted)
        unheard = await entry.locator(".agent .unheard").inner_text()
        assert "not heard" in unheard and len(unheard) > len("(not heard:)") + 3, unheard
        log_li = page.locator("#barge-ins li").first
        assert await log_li.get_attribute("data-initiator") == "ptt"
        assert "by push-to-talk" in await log_li.inner_text()

        # The second press opened a turn (silence: nothing recognized) that
        # release ended; the turn was never the VAD's doing.
        second = (await wait_server_event(
            peer, lambda e: e["type"] == "turn" and e["turn_id"] != first and e["status"] in ("FAILED", "COMPLETED"),
            "second turn",  # FAILED: nothing recognized (or a word Whisper made of the near-silence, answered)
        ))["turn_id"]
        stopped = await peer.manager.get(first)
        assert stopped.stop_reason.kind is StopReasonKind.BARGE_IN and stopped.stop_reason.initiator == "ptt"
        events = await server_events(peer)
        vad = [e["event"] for e in events if e["type"] == "vad"]
        assert vad == ["end_of_turn", "end_of_turn"], vad
        assert not [e for e in events if e["type"] == "error"], events
        assert second != first
        assert await page.evaluate("window.__sent") == ["ptt.start", "ptt.end", "ptt.start", "ptt.end"]
        await page.screenshot(path="/tmp/turnkeeper-ptt.png", full_page=True)

        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert errors == [], errors
    finally:
        await browser.close()


async def test_space_key_repeat_sends_one_start(server: Server, playwright, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """(c) Holding Space (auto-repeating) is one ptt.start, releasing it one
    ptt.end; the server opens one turn and ends it; Space in a text field
    types a space instead."""
    _require("sox")
    mic = make_silent_wav(tmp_path)
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await connect_for_ptt(page, server.url)
        peer = the_peer(server.app)

        for _ in range(6):  # the first is a press, the rest key repeats (event.repeat)
            await page.keyboard.down("Space")
        assert await page.evaluate("window.__sent") == ["ptt.start"]
        assert await page.get_attribute("#ptt", "aria-pressed") == "true"
        assert await page.text_content("#ptt-state") == "talking (push-to-talk)"
        opened = await wait_server_event(peer, lambda e: e["type"] == "turn" and e["status"] == "RUNNING", "turn")
        await page.keyboard.up("Space")
        assert await page.evaluate("window.__sent") == ["ptt.start", "ptt.end"]
        assert await page.get_attribute("#ptt", "aria-pressed") == "false"
        await wait_server_event(peer, lambda e: e["type"] == "vad" and e["event"] == "end_of_turn", "end_of_turn")
        # the hold heard nothing: the turn fails with no_speech_recognized, or, once in a loaded
        # CI run, Whisper made a word of the near-silence and it was answered; either way it ends
        await wait_server_event(
            peer, lambda e: e["type"] == "turn" and e["status"] in ("FAILED", "COMPLETED"), "the silent turn's end"
        )
        events = await server_events(peer)
        assert {e["turn_id"] for e in events if e["type"] == "turn"} == {opened["turn_id"]}
        assert not [e for e in events if e["type"] == "error"], events
        # Space did not press a focused button either (Disconnect, say).
        assert await page.get_attribute("#status", "data-state") == "connected"

        # In a text field Space types.
        await page.evaluate("document.body.append(Object.assign(document.createElement('input'), {id: 'box'}))")
        await page.focus("#box")
        await page.keyboard.press("Space")
        assert await page.input_value("#box") == " "
        assert await page.evaluate("window.__sent") == ["ptt.start", "ptt.end"]

        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert errors == [], errors
    finally:
        await browser.close()


async def test_ptt_refusal_is_shown(server: Server, playwright, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """(d) A ptt.end without a start (sent behind the client's back) is
    refused: the error event is shown with its code."""
    _require("sox")
    mic = make_silent_wav(tmp_path)
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await connect_for_ptt(page, server.url)
        await page.evaluate("window.__dc.send(JSON.stringify({type: 'ptt.end'}))")
        error = page.locator('#errors li[data-code="ptt_not_active"]')
        await error.wait_for(timeout=5_000)
        assert "ptt_not_active" in await error.inner_text()
        assert await page.get_attribute("#ptt-state", "data-state") == "error"
        assert "refused" in (await page.text_content("#ptt-state") or "")
        # The button still works afterwards, and a press clears the message.
        await page.hover("#ptt")
        await page.mouse.down()
        assert await page.text_content("#ptt-state") == "talking (push-to-talk)"
        await page.mouse.up()
        assert (await page.text_content("#ptt-state") or "") == ""
        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert errors == [], errors
    finally:
        await browser.close()


async def test_voice_events_are_rendered(server: Server, playwright, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """The new events, logged by the server on a live session, are shown:
    the heard part of an interrupted reply with the rest struck, the barge-in's
    initiator, a false interruption and a backchannel as notes, a deferred
    stop, and the VAD's states."""
    _require("sox")
    mic = make_silent_wav(tmp_path)
    browser = await launch(playwright, [f"--use-file-for-fake-audio-capture={mic}"])
    try:
        page = await browser.new_page()
        errors = collect_page_errors(page)
        await connect_for_ptt(page, server.url)
        peer = the_peer(server.app)
        emit = peer.log.emit
        gen = peer.fence.active
        tid = "f" * 32
        emit("agent.delta", generation=gen, turn_id=tid, text="It is sunny and warm. Tomorrow it will rain.")
        emit("false_interruption", generation=gen, paused_ms=420.0)
        emit("backchannel", generation=gen, text="uh huh", syllables=2, paused_ms=0)
        emit("vad", generation=gen, event="speech_rejected")
        emit("barge_in", generation=gen + 1, old_turn_id=tid, old_generation=gen, initiator="vad",
             onset_to_fence_ms=3.2, paused_ms=150.0, cleared_ms=2400)
        emit("stop_deferred", generation=gen, turn_id=tid, why="must_complete")
        emit("agent.interrupted", generation=gen, turn_id=tid, heard="It is sunny and warm.", played_ms=1800,
             reply_chars=44)
        # a reply started at the user's pause, taken back when they went on
        # (session._withdraw): no transcript entry, "withdrawn" in the panel
        wid = "e" * 32
        withdrawn = {"kind": "speculation_withdrawn", "initiator": "end_of_turn", "at": "2026-12-05T12:00:00Z",
                     "request_id": "r" * 32, "detail": None}
        turn = {"error": None, "transcript": "what is the", "reply": None}
        emit("turn", generation=gen + 2, turn_id=wid, status="QUEUED", label="queued", stop_reason=None, **turn)
        emit("turn", generation=gen + 2, turn_id=wid, status="RUNNING", label="running", stop_reason=None, **turn)
        emit("end_of_turn", generation=gen + 3, turn_id=wid, outcome="withdrawn", by="user_went_on", speculative=True,
             wait_ms=640.0)
        emit("turn", generation=gen + 2, turn_id=wid, status="CANCEL_REQUESTED", label="stopping",
             stop_reason=withdrawn, **turn)
        emit("turn", generation=gen + 2, turn_id=wid, status="CANCELLED", label="cancelled", stop_reason=withdrawn,
             **turn)

        entry = page.locator(f'#transcript li.turn[data-turn-id="{tid}"]')
        await page.wait_for_function(
            "id => { const e = document.querySelector(`#transcript li.turn[data-turn-id=\"${id}\"]`);"
            " return e && e.dataset.heard !== undefined; }",
            arg=tid,
            timeout=10_000,
        )
        assert await entry.locator(".agent > .text").inner_text() == "It is sunny and warm."
        unheard = entry.locator(".agent s.unheard")
        assert "Tomorrow it will rain." in await unheard.inner_text()
        assert await unheard.evaluate("el => getComputedStyle(el).textDecorationLine") == "line-through"
        tag = await entry.locator(".agent .tag").inner_text()
        assert tag == "(interrupted; heard 1.8 s, 2.4 s of speech not played, by voice)", tag
        notes = await entry.locator(".note").all_inner_texts()
        assert any("paused 420 ms for a noise, resumed" in n for n in notes), notes
        assert any("backchannel “uh huh”, kept talking" in n for n in notes), notes
        assert any("stop deferred" in n and "must-complete" in n for n in notes), notes
        assert await page.text_content("#vad") == "noise (ignored)"
        barge = await page.locator("#barge-ins li").all_inner_texts()
        assert any("by voice" in b and "paused 150 ms before" in b for b in barge), barge
        await page.wait_for_function(
            "id => document.querySelector(`#turn-log li[data-turn-id=\"${id}\"]`)?.dataset.state === 'withdrawn'"
            " && document.querySelectorAll(`#turn-log li[data-turn-id=\"${id}\"]`).length === 4",
            arg=wid,
            timeout=10_000,
        )
        assert await page.locator(f'#transcript li.turn[data-turn-id="{wid}"]').count() == 0
        assert await page.text_content("#turn-state") == "withdrawn"
        logged = await page.locator(f'#turn-log li[data-turn-id="{wid}"]').all_inner_texts()
        assert [t.split("→ ")[1] for t in reversed(logged)] == [
            "queued", "running", "withdrawn (speculation_withdrawn)", "withdrawn (speculation_withdrawn)"
        ], logged
        await page.screenshot(path="/tmp/turnkeeper-events.png", full_page=True)
        await page.click("#disconnect")
        await wait_peers(server.app, 0, timeout_s=5)
        assert errors == [], errors
    finally:
        await browser.close()
