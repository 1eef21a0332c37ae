"""Offers that can never connect get 400 before any session or pending slot
is taken (web/offer_validation.py; /work/shared/cases/sdp-offers-answered-200.md).

Every bad offer is a real aiortc offer (one sendrecv audio transceiver and
the events data channel) with one thing changed.
"""

from __future__ import annotations

import asyncio
import contextlib
import functools
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from aiortc import RTCPeerConnection
from conftest import start_app

from web import signaling
from web.app import PEERS, create_app
from web.offer_validation import (
    MAX_CANDIDATES_PER_MEDIA,
    MAX_FORMATS_PER_MEDIA,
    MAX_LINE_CHARS,
    MAX_MEDIA_SECTIONS,
    MAX_MESSAGE_CHARS,
    OfferRejected,
    validate_offer,
)
from web.settings import Settings

#: an offer made by Chromium 156 (one sendrecv audio transceiver, the events
#: data channel, mDNS host candidates, after ICE gathering)
CHROMIUM_OFFER = (Path(__file__).parent / "data" / "chromium_offer.sdp").read_text()
#: the same with its mDNS host names replaced by a TEST-NET-1 address, for
#: the tests that answer it: aioice keeps its mDNS resolver (and a lock) per
#: thread, and a session closed by one test's event loop mid-resolution
#: leaves it unusable for the next test's loop (a server has one loop)
CHROMIUM_OFFER_IP = re.sub(r"[0-9a-f-]{36}\.local", "192.0.2.1", CHROMIUM_OFFER)


async def make_aiortc_offer() -> str:
    pc = RTCPeerConnection()
    pc.addTransceiver("audio", direction="sendrecv")
    pc.createDataChannel("events")
    await pc.setLocalDescription(await pc.createOffer())
    sdp = pc.localDescription.sdp
    await pc.close()
    return sdp


@functools.cache
def aiortc_offer() -> str:
    """One real aiortc offer for the synchronous tests."""
    return asyncio.run(make_aiortc_offer())


# --- one change each ----------------------------------------------------------


def without(prefix: str) -> Callable[[str], str]:
    return lambda sdp: "".join(line for line in sdp.splitlines(True) if not line.startswith(prefix))


def audio_port(port: int) -> Callable[[str], str]:
    return lambda sdp: re.sub(r"^m=audio \d+", f"m=audio {port}", sdp, count=1, flags=re.M)


def audio_protocol(proto: str) -> Callable[[str], str]:
    return lambda sdp: re.sub(r"^(m=audio \d+) \S+", rf"\1 {proto}", sdp, count=1, flags=re.M)


def audio_formats(formats: list[str]) -> Callable[[str], str]:
    return lambda sdp: re.sub(r"^(m=audio \d+ \S+) .*$", rf"\1 {' '.join(formats)}", sdp, count=1, flags=re.M)


def replace(old: str, new: str) -> Callable[[str], str]:
    def change(sdp: str) -> str:
        assert old in sdp
        return sdp.replace(old, new)
    return change


def after_rtcp_mux(extra: str) -> Callable[[str], str]:
    return replace("a=rtcp-mux\r\n", f"a=rtcp-mux\r\n{extra}\r\n")


def audio_sections(count: int) -> Callable[[str], str]:
    def change(sdp: str) -> str:
        start = sdp.index("m=audio")
        end = sdp.index("m=application")
        return sdp[:end] + sdp[start:end] * (count - 1) + sdp[end:]
    return change


def direction(value: str) -> Callable[[str], str]:
    return replace("a=sendrecv\r\n", f"a={value}\r\n" if value else "")


def fingerprints(change: Callable[[str], str]) -> Callable[[str], str]:
    return lambda sdp: re.sub(r"^a=fingerprint:(.*)$", lambda m: "a=fingerprint:" + change(m.group(1)), sdp, flags=re.M)


def audio_codecs(names: str) -> Callable[[str], str]:
    """Keep the audio formats but name them all ``names`` in a=rtpmap."""
    return lambda sdp: re.sub(r"^a=rtpmap:(\d+) \S+", rf"a=rtpmap:\1 {names}", sdp, flags=re.M)


def candidates(count: int) -> Callable[[str], str]:
    """Give the audio m-section ``count`` candidates (copies of its first)."""
    def change(sdp: str) -> str:
        audio = sdp[sdp.index("m=audio"):sdp.index("m=application")]
        lines = [line for line in audio.splitlines() if line.startswith("a=candidate:")]
        extra = (lines[0] + "\r\n") * (count - len(lines))
        return sdp.replace(lines[0] + "\r\n", lines[0] + "\r\n" + extra, 1)
    return change


#: (change, what the message must contain). The first six are the case's.
BAD_OFFERS: dict[str, tuple[Callable[[str], str], str]] = {
    "no fingerprint": (without("a=fingerprint:"), "no a=fingerprint"),
    "audio port 0": (audio_port(0), "port 0"),
    "RTP/AVP": (audio_protocol("RTP/AVP"), "protocol RTP/AVP"),
    "6000 payload types": (audio_formats(["96"] * 6000), "6000 formats"),
    "30 audio m-lines": (audio_sections(30), "31 m-lines"),
    "60 KB attribute": (after_rtcp_mux("a=x-big:" + "y" * 60_000), "is 60008 characters long"),
    # the same kind of fault
    "RTP/SAVPF (legacy name)": (audio_protocol("RTP/SAVPF"), "protocol RTP/SAVPF"),
    "recvonly": (direction("recvonly"), "a=recvonly"),
    "inactive": (direction("inactive"), "a=inactive"),
    "no direction": (direction(""), "no direction attribute"),
    "no ice-pwd": (without("a=ice-pwd:"), "a=ice-pwd"),
    "no ice-ufrag": (without("a=ice-ufrag:"), "a=ice-ufrag"),
    "short ice-pwd": (lambda sdp: re.sub(r"^a=ice-pwd:.*$", "a=ice-pwd:short", sdp, flags=re.M), "22 to 256"),
    "no setup": (without("a=setup:"), "no a=setup"),
    "setup holdconn": (replace("a=setup:actpass", "a=setup:holdconn"), "a=setup must be"),
    "only sha-1": (fingerprints(lambda v: "sha-1 " + v.split()[1]), "sha-1 offered"),
    "truncated fingerprint": (fingerprints(lambda v: v.split()[0] + " AB:CD"), "colon-separated hex bytes"),
    "no common codec": (audio_codecs("iLBC/8000"), "no codec the server can use"),
    "no rtpmap at all": (without("a=rtpmap:"), "no codec the server can use"),
    "no rtcp-mux": (without("a=rtcp-mux"), "a=rtcp-mux"),
    "payload type 300": (audio_formats(["300"]), "payload type '300'"),
    "payload type 73": (audio_formats(["73"]), "payload type '73'"),
    "payload type not a number": (audio_formats(["opus"]), "payload type 'opus'"),
    f"{MAX_FORMATS_PER_MEDIA + 1} payload types": (audio_formats(["0"] * (MAX_FORMATS_PER_MEDIA + 1)), "formats"),
    f"{MAX_MEDIA_SECTIONS + 1} m-lines": (audio_sections(MAX_MEDIA_SECTIONS), f"{MAX_MEDIA_SECTIONS + 1} m-lines"),
    "line just too long": (after_rtcp_mux("a=x:" + "y" * (MAX_LINE_CHARS - 3)), f"{MAX_LINE_CHARS + 1} characters"),
    "too many candidates": (candidates(MAX_CANDIDATES_PER_MEDIA + 1), "ICE candidates"),
    "malformed m-line": (replace("m=audio ", "m=audio x "), "is not 'm=<media>"),
    "not type=value": (after_rtcp_mux("hello"), "is not '<type>=<value>'"),
    "BUNDLE names a missing mid": (replace("a=group:BUNDLE 0 1", "a=group:BUNDLE 0 1 7"), "mid '7'"),
    "duplicate mid": (replace("a=mid:1", "a=mid:0"), "a=mid '0'"),
    # found by review: a digit that is not ASCII, no candidates at all (sent
    # before gathering finished), an rtpmap for a payload type the m-line
    # does not list, a candidate port over 65535
    "superscript payload type": (audio_formats(["111", "\u00b2"]), "payload type"),
    "Arabic-Indic payload type": (audio_formats(["\u0661\u0661\u0661"]), "payload type"),
    "no candidates": (without("a=candidate:"), "no a=candidate"),
    "rtpmap not on the m-line": (
        lambda sdp: audio_formats(["0"])(sdp).replace("a=rtpmap:0 PCMU/8000", "a=rtpmap:0 PCMU/8000\r\na=rtpmap:112 opus/48000/2", 1),
        "does not list",
    ),
    "candidate port 999999": (
        lambda sdp: re.sub(r"^(a=candidate:\S+ \d+ \S+ \d+ \S+ )\d+", r"\g<1>999999", sdp, count=1, flags=re.M),
        "port 999999",
    ),
    # aiortc's parser raises on these (ValueError, StopIteration): still 400
    "fingerprint without value": (fingerprints(lambda v: v.split()[0]), "cannot parse the SDP"),
    "fmtp for an unknown payload type": (after_rtcp_mux("a=fmtp:97 minptime=10"), "cannot parse the SDP"),
    "extmap id not a number": (after_rtcp_mux("a=extmap:x urn:x"), "cannot parse the SDP"),
}


# --- the validator on its own -----------------------------------------------------


@pytest.mark.parametrize("name", BAD_OFFERS)
def test_bad_offer_is_invalid_sdp(name: str) -> None:
    change, message = BAD_OFFERS[name]
    with pytest.raises(OfferRejected) as err:
        validate_offer(change(aiortc_offer()))
    assert err.value.code == "invalid_sdp"
    assert message in str(err.value)
    assert len(str(err.value)) <= MAX_MESSAGE_CHARS


@pytest.mark.parametrize(
    "name, change",
    [
        ("aiortc as made", lambda sdp: sdp),
        ("sendonly (the client only speaks)", direction("sendonly")),
        ("TCP/DTLS/RTP/SAVPF", audio_protocol("TCP/DTLS/RTP/SAVPF")),
        ("PCMU only", lambda sdp: re.sub(r"^a=rtpmap:(?!0 ).*\r\n", "", audio_formats(["0"])(sdp), flags=re.M)),
        ("lower-case fingerprint", fingerprints(str.lower)),
        ("fingerprint at session level only", lambda sdp: re.sub(
            "^t=0 0\r\n", "t=0 0\r\n" + re.search(r"^a=fingerprint:.*\r\n", sdp, re.M).group(0),
            without("a=fingerprint:")(sdp), count=1, flags=re.M)),
        ("bundle-only audio with port 0", lambda sdp: after_rtcp_mux("a=bundle-only")(audio_port(0)(sdp))),
        (f"{MAX_CANDIDATES_PER_MEDIA} candidates", candidates(MAX_CANDIDATES_PER_MEDIA)),
        ("a line of the longest accepted length", after_rtcp_mux("a=x:" + "y" * (MAX_LINE_CHARS - 4))),
    ],
)
def test_good_offer_passes(name: str, change: Callable[[str], str]) -> None:
    validate_offer(change(aiortc_offer()))


def test_chromium_offer_passes() -> None:
    assert ".local " in CHROMIUM_OFFER and ".local " not in CHROMIUM_OFFER_IP
    validate_offer(CHROMIUM_OFFER)
    validate_offer(CHROMIUM_OFFER_IP)
    validate_offer(CHROMIUM_OFFER.replace("\r\n", "\n"))  # LF-only lines are read too


@pytest.mark.parametrize(
    "sdp, code",
    [
        ("v=0\r\no=- 1 1 IN IP4 0.0.0.0\r\ns=-\r\nt=0 0\r\n", "no_audio"),
        ("garbage", "invalid_sdp"),
        ("v=1\r\n", "invalid_sdp"),
    ],
)
def test_no_audio_and_not_sdp(sdp: str, code: str) -> None:
    with pytest.raises(OfferRejected) as err:
        validate_offer(sdp)
    assert err.value.code == code


# --- through the API: 400, and nothing created ----------------------------------------------


@contextlib.asynccontextmanager
async def counting_server(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, pending_per_client: int
) -> AsyncIterator[tuple[web.Application, str, list]]:
    """The app (default body cap: 64 KiB) with ``pending_per_client``
    pending offers per client, counting every PeerSession it makes."""
    made: list = []
    real = signaling.PeerSession

    def counting(*args, **kwargs):  # type: ignore[no-untyped-def]
        peer = real(*args, **kwargs)
        made.append(peer)
        return peer

    monkeypatch.setattr(signaling, "PeerSession", counting)
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", max_pending_per_client=pending_per_client))
    runner, url = await start_app(app)
    try:
        yield app, url, made
    finally:
        await runner.cleanup()


@pytest.fixture
async def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[web.Application, str, list]]:
    """The default body cap (64 KiB, so the 60 KB line reaches the SDP
    check), two pending offers per client; counts every PeerSession made."""
    async with counting_server(tmp_path, monkeypatch, 2) as held:
        yield held


async def post_offer(http: aiohttp.ClientSession, url: str, sdp: str) -> tuple[int, dict]:
    async with http.post(f"{url}/v1/webrtc/offer", json={"type": "offer", "sdp": sdp}) as resp:
        assert resp.content_type == "application/json"
        return resp.status, await resp.json()


async def test_case_offers_get_400_and_take_nothing(server: tuple[web.Application, str, list]) -> None:
    """The case's six offers (one server, to keep the run short)."""
    app, url, made = server
    async with aiohttp.ClientSession() as http:
        for name in list(BAD_OFFERS)[:6]:
            change, message = BAD_OFFERS[name]
            status, body = await post_offer(http, url, change(await make_aiortc_offer()))
            assert (status, body["error"]["code"]) == (400, "invalid_sdp"), (name, body)
            assert message in body["error"]["message"], (name, body)
            assert made == [] and app[PEERS] == {}, name  # no session, so no pending slot


async def test_many_bad_offers_leave_the_client_its_slots(server: tuple[web.Application, str, list]) -> None:
    """Every bad shape, three times, from one client: each is refused at
    once and nothing is registered; then the same client's real aiortc offer
    and a Chromium offer both get answers (with max_pending_per_client=2 a
    single leaked slot would make the second one 429)."""
    app, url, made = server
    base = await make_aiortc_offer()
    async with aiohttp.ClientSession() as http:
        for _ in range(3):
            for name, (change, message) in BAD_OFFERS.items():
                status, body = await post_offer(http, url, change(base))
                assert (status, body["error"]["code"]) == (400, "invalid_sdp"), (name, body)
                assert message in body["error"]["message"], name
                assert made == [] and app[PEERS] == {}, name
        answered = []
        for sdp in (await make_aiortc_offer(), CHROMIUM_OFFER_IP):
            status, body = await post_offer(http, url, sdp)
            assert status == 200 and body["type"] == "answer", body
            assert body["session_id"] in app[PEERS]
            answered.append(body["session_id"])
    assert [p.id for p in made] == answered and set(app[PEERS]) == set(answered)


async def test_chromium_offer_is_answered_in_kind(server: tuple[web.Application, str, list]) -> None:
    app, url, _ = server
    async with aiohttp.ClientSession() as http:
        status, body = await post_offer(http, url, CHROMIUM_OFFER_IP)
    assert status == 200, body
    answer = body["sdp"]
    assert re.search(r"^m=audio \d+ UDP/TLS/RTP/SAVPF ", answer, re.M)
    assert re.search(r"^a=rtpmap:111 opus/48000/2", answer, re.M)
    assert "a=recvonly" not in answer and "a=inactive" not in answer
    assert body["session_id"] in app[PEERS]


async def test_bad_offer_is_400_even_when_the_server_is_full(tmp_path: Path) -> None:
    """The offer is judged before the limits are counted: a client whose
    offer can never work is told so, not told to retry later."""
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", max_sessions=1))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            status, _ = await post_offer(http, url, await make_aiortc_offer())
            assert status == 200
            status, body = await post_offer(http, url, without("a=fingerprint:")(await make_aiortc_offer()))
            assert (status, body["error"]["code"]) == (400, "invalid_sdp")
            status, body = await post_offer(http, url, await make_aiortc_offer())
            assert (status, body["error"]["code"]) == (503, "too_many_sessions")
    finally:
        await runner.cleanup()
