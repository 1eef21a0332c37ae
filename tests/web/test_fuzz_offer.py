"""SDP offers from a grammar-aware mutator (issue 16): a real Chromium offer
(tests/web/data/chromium_offer.sdp) changed by the SDP grammar's units
(lines, m-sections, attributes) into offers that can never connect, each
kind of fault from /work/shared/cases/sdp-offers-answered-200.md and more:
truncated, duplicated and oversized m-lines, no ICE ufrag or pwd, no audio,
only unsupported codecs, huge attribute counts, port 0, RTP/AVP, no
fingerprint, a line that is no ``<type>=<value>``, non-UTF-8 bytes.

Each is refused by web/offer_validation.py (unit, many cases) and by
``POST /v1/webrtc/offer`` with a 4xx JSON error, taking no session and no
pending slot; the server answers a valid offer afterwards."""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path

import aiohttp
import pytest
from aiohttp import web
from fuzz_support import fuzz_settings, record
from hypothesis import given
from hypothesis import strategies as st
from test_offer_validation import counting_server

from web.app import PEERS
from web.offer_validation import OfferRejected, validate_offer

CHROMIUM = (Path(__file__).parent / "data" / "chromium_offer.sdp").read_text()
#: answerable in a test: mDNS host names replaced by a TEST-NET-1 address (see test_offer_validation.py)
VALID = re.sub(r"[0-9a-f-]{36}\.local", "192.0.2.1", CHROMIUM)
UNIT_CASES = 300
LIVE_CASES = 40

Lines = list[str]


def sections(lines: Lines) -> list[tuple[int, int]]:
    """(start, end) line indexes of each m-section."""
    starts = [i for i, line in enumerate(lines) if line.startswith("m=")]
    return list(zip(starts, [*starts[1:], len(lines)][: len(starts)], strict=True))


def audio(lines: Lines) -> tuple[int, int]:
    return next((a, b) for a, b in sections(lines) if lines[a].startswith("m=audio"))


# Each mutation breaks the offer for good (it can never connect); some take a drawn size.
def truncated(lines: Lines, n: int) -> Lines:
    """Cut before the audio section's a=setup (it then has none)."""
    a, _ = audio(lines)
    setup = next(i for i in range(a, len(lines)) if lines[i].startswith("a=setup"))
    return lines[: max(1, min(setup, a + n % (setup - a + 1)))]


def duplicated(lines: Lines, n: int) -> Lines:
    a, b = audio(lines)
    return lines[:b] + lines[a:b] * (8 + n % 30) + lines[b:]


def oversized_m_line(lines: Lines, n: int) -> Lines:
    a, _ = audio(lines)
    return [*lines[:a], lines[a] + " 0" * (129 + n * 50), *lines[a + 1:]]


def huge_attribute_counts(lines: Lines, n: int) -> Lines:
    a, _ = audio(lines)
    cand = next(line for line in lines[a:] if line.startswith("a=candidate"))
    return [*lines[: a + 1], *[cand] * (33 + n * 20), *lines[a + 1:]]


def long_line(lines: Lines, n: int) -> Lines:
    return [*lines, "a=x-junk:" + "y" * (1024 + n * 1000)]


def drop(prefix: str) -> Callable[[Lines, int], Lines]:
    def change(lines: Lines, n: int) -> Lines:
        return [line for line in lines if not line.startswith(prefix)]

    change.__name__ = f"no {prefix}"
    return change


def no_audio(lines: Lines, n: int) -> Lines:
    a, b = audio(lines)
    kept = lines[:a] + lines[b:]
    return [line.replace("BUNDLE 0 1", "BUNDLE 1") for line in kept]


def only_unsupported_codecs(lines: Lines, n: int) -> Lines:
    names = ["H264/90000", "iLBC/8000", "SILK/16000", "AMR/8000", "L16/44100"]
    return [re.sub(r"^a=rtpmap:(\d+) \S+", rf"a=rtpmap:\1 {names[n % len(names)]}", line) for line in lines]


def port_zero(lines: Lines, n: int) -> Lines:
    return [re.sub(r"^m=audio \d+", "m=audio 0", line) for line in lines]


def rtp_avp(lines: Lines, n: int) -> Lines:
    proto = ["RTP/AVP", "RTP/SAVP", "RTP/AVPF", "UDP/TLS/RTP/SAVP"][n % 4]
    return [re.sub(r"^(m=audio \d+) \S+", rf"\1 {proto}", line) for line in lines]


def not_a_line(lines: Lines, n: int) -> Lines:
    junk = ["garbage", "A=sendrecv", "aa=b", "=x", "m", "\x00=1"][n % 6]
    at = n % len(lines)
    return [*lines[:at], junk, *lines[at:]]


BREAKING: list[Callable[[Lines, int], Lines]] = [
    truncated, duplicated, oversized_m_line, huge_attribute_counts, long_line, drop("a=ice-ufrag"), drop("a=ice-pwd"),
    drop("a=fingerprint"), drop("a=candidate"), drop("a=setup"), drop("a=rtcp-mux"), no_audio, only_unsupported_codecs,
    port_zero, rtp_avp, not_a_line,
]


@st.composite
def broken_offers(draw: st.DrawFn) -> tuple[str, str]:
    """(names of the mutations, offer): one to three breaking mutations of
    the Chromium offer, in any order, each with a drawn size."""
    lines = VALID.splitlines()
    names = []
    for change in draw(st.lists(st.sampled_from(BREAKING), min_size=1, max_size=3)):
        try:
            lines = change(lines, draw(st.integers(0, 40)))
        except StopIteration:  # what it changes is gone already (an earlier change removed it)
            continue
        names.append(change.__name__)
    sep = draw(st.sampled_from(["\r\n", "\n"]))
    assert names  # the first change always applies to the valid offer
    return "+".join(names), sep.join(lines) + sep


@fuzz_settings(UNIT_CASES)
@given(broken_offers())
def test_every_broken_offer_is_refused(named: tuple[str, str]) -> None:
    name, sdp = named
    record("sdp validate_offer")
    with pytest.raises(OfferRejected) as refused:
        validate_offer(sdp)
    assert refused.value.code in ("invalid_sdp", "no_audio"), name
    if "no_audio" in name and refused.value.code == "no_audio":
        assert "audio" in str(refused.value)


@pytest.fixture
async def server(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[tuple[web.Application, str, list]]:
    async with counting_server(tmp_path, monkeypatch, 1) as held:
        yield held


def drawn_offers() -> list[tuple[str, str]]:
    """LIVE_CASES broken offers, drawn as the unit test draws them."""
    out: list[tuple[str, str]] = []

    @fuzz_settings(LIVE_CASES)
    @given(broken_offers())
    def collect(named: tuple[str, str]) -> None:
        out.append(named)

    collect()
    return out


async def test_broken_offers_over_http_take_nothing(server: tuple[web.Application, str, list]) -> None:
    """Every broken offer (and non-UTF-8 bodies) gets a 4xx JSON error, no
    session is made, no pending slot is taken (one per client here: a
    single leak makes the valid offer at the end 429), /healthz shows no
    session; then a valid offer is answered."""
    app, url, made = server
    bodies = [(name, json.dumps({"type": "offer", "sdp": sdp}).encode()) for name, sdp in drawn_offers()]
    raw = json.dumps({"type": "offer", "sdp": "SDP"}).encode()
    bodies += [("non-utf-8 " + repr(b), raw.replace(b"SDP", VALID.encode()[:40] + b + VALID.encode()[40:]))
               for b in (b"\xff", b"\xc3\x28", b"\xed\xa0\x80", b"\x80\x80\x80")]
    async with aiohttp.ClientSession() as http:
        for name, body in bodies:
            async with http.post(f"{url}/v1/webrtc/offer", data=body, headers={"Content-Type": "application/json"}) as r:
                record("sdp POST /v1/webrtc/offer")
                assert 400 <= r.status < 500 and r.content_type == "application/json", (name, r.status)
                error = (await r.json())["error"]
                assert error["code"] in ("invalid_sdp", "no_audio", "bad_json", "body_too_large"), (name, error)
                if r.status == 400 and not name.startswith("non-utf-8"):
                    assert error["code"] in ("invalid_sdp", "no_audio"), (name, error)
            assert made == [] and app[PEERS] == {}, name
        async with http.get(f"{url}/healthz") as r:
            assert (await r.json())["sessions"] == 0
        async with http.post(f"{url}/v1/webrtc/offer", json={"type": "offer", "sdp": VALID}) as r:
            assert r.status == 200, await r.text()
            assert (await r.json())["type"] == "answer"
