"""The WebRTC data channel's client messages fuzzed at the real handler
(issue 16): a :class:`web.peer.PeerSession` made as ``POST /v1/webrtc/offer``
makes it, on a running app, its transport fed what a client could send on
the ``events`` channel (:meth:`web.webrtc_transport.WebRtcTransport._on_client_message`,
what aiortc calls for each message).

Bad messages: malformed JSON, non-UTF-8 and other binary, JSON that is not
an object or has no string ``type``, wrong field types, strings beyond
``MAX_CLIENT_MESSAGE``, unknown types, NaN and 1e999. Each is answered one
``error`` event with a catalogued code (``bad_message``,
``message_too_large``, ``unknown_type``), nothing escapes and the session
stays open; a ping after it is answered. A flood (more than
``limits.datachannel_messages_per_s`` at once) is answered: each message
within the rate as usual, then one ``error`` ``rate_limited`` for the run,
the rest dropped silently."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

from aiohttp import web
from conftest import start_app
from fuzz_support import fuzz_settings, record
from hypothesis import given
from hypothesis import strategies as st

from clock import Clock, VirtualClock
from turn.models import StopReasonKind
from web.app import PEERS, create_app
from web.peer import PeerSession
from web.settings import Settings
from web.state import CLOCK, LIMITS, MANAGER, PROVIDERS, SETTINGS
from web.webrtc_transport import MAX_CLIENT_MESSAGE

BAD_CODES = {"bad_message", "message_too_large", "unknown_type"}
RATE = 50  # limits.datachannel_messages_per_s (its default)

scalars = st.one_of(st.none(), st.booleans(), st.integers(), st.floats(), st.text(max_size=30))
values = st.recursive(scalars, lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=8), inner, max_size=3),
                      max_leaves=8)
#: messages of a known type with wrong fields, or of no known type
wrong_objects = st.one_of(
    st.fixed_dictionaries({"type": st.sampled_from(["ping", "ptt.start", "ptt.end"])},
                          optional={"id": values, "x": values, "generation": values}).filter(
        lambda o: set(o) - {"type", "id"} or not isinstance(o.get("id"), (str, int, type(None)))),
    st.fixed_dictionaries({"type": values.filter(lambda v: v not in ("ping", "ptt.start", "ptt.end"))},
                          optional={"id": values}),
    st.dictionaries(st.text(max_size=8).filter(lambda k: k != "type"), values, max_size=4),
    st.lists(values, max_size=4),
    scalars,
)
bad_messages = st.one_of(
    wrong_objects.map(json.dumps),
    wrong_objects.map(lambda o: json.dumps(o)[:-1] or "{"),  # cut short
    st.text(max_size=200).filter(lambda t: not t.strip().startswith("{")),  # not JSON, mostly
    st.binary(max_size=200),  # a binary message (and non-UTF-8)
    st.binary(min_size=1, max_size=50).map(lambda b: b"\xff" + b),  # never UTF-8
    st.integers(0, 3).map(lambda n: json.dumps({"type": "ping", "id": "x" * (MAX_CLIENT_MESSAGE + n)})),  # too large
    st.integers(1, 3).map(lambda n: "[" * (MAX_CLIENT_MESSAGE // 2 - n)),  # deep nesting within the size
    st.sampled_from(['{"type": "ping", "id": NaN}', '{"type": "ping", "id": 1e999}', '{"type": "ping", "id": Infinity}',
                     '{"type": 1}', '{"type": null}', '{"type": "x" }', '{"type": "ping"}garbage', "", " ", "null"]),
)


@asynccontextmanager
async def running_app(tmp_path: Path, datachannel_messages_per_s: float) -> AsyncIterator[web.Application]:
    """An app served on loopback with that data-channel rate (the other limits their defaults)."""
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db",
                              limits={"datachannel_messages_per_s": datachannel_messages_per_s}))
    runner, _ = await start_app(app)
    try:
        yield app
    finally:
        await runner.cleanup()


def make_peer(app: web.Application, client: str = "192.0.2.7", clock: Clock | None = None) -> PeerSession:
    """A session as ``POST /v1/webrtc/offer`` makes one (no offer answered),
    on the app's clock unless ``clock`` is given."""
    peers = app[PEERS]
    peer = PeerSession(settings=app[SETTINGS], manager=app[MANAGER], providers=app[PROVIDERS].for_session(),
                       clock=clock or app[CLOCK], on_closed=lambda p: peers.pop(p.id, None), client=client,
                       tenant="default", limits=app[LIMITS])
    peers[peer.id] = peer
    return peer


def told_of(peer: PeerSession) -> list[dict[str, Any]]:
    """Every event the session sends on its data channel, from now on."""
    told: list[dict[str, Any]] = []
    peer.transport.events.send = told.append  # type: ignore[method-assign]
    return told


async def test_each_bad_message_is_answered_an_error_and_the_session_stays(tmp_path: Path) -> None:
    async with running_app(tmp_path, 100_000) as app:  # the content is judged here, not the rate
        await bad_messages_answered(app)


async def bad_messages_answered(app: web.Application) -> None:
    peer = make_peer(app)
    told = told_of(peer)
    closed: list[StopReasonKind] = []
    peer.transport.on_close(closed.append)

    @fuzz_settings(150)
    @given(message=bad_messages)
    def fuzz(message: str | bytes) -> None:
        record("datachannel bad message")
        before = len(told)
        peer.transport._on_client_message(message)  # raises nothing: aiortc's loop would die
        answers = told[before:]
        assert len(answers) == 1 and answers[0]["type"] == "error", (message[:100], answers)
        assert answers[0]["code"] in BAD_CODES, answers[0]
        assert len(json.dumps(answers[0])) < 1024, "the answer does not echo a huge message"
        assert not closed and peer.id in app[PEERS]

    fuzz()
    peer.transport._on_client_message(json.dumps({"type": "ping", "id": 7}))
    assert told[-1] == {"type": "pong", "id": 7}
    await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
    assert not app[PEERS]


async def test_a_flood_is_answered_rate_limited_once_a_run(tmp_path: Path) -> None:
    async with running_app(tmp_path, RATE) as app:
        peers = await floods_answered(app)
        for peer in peers:
            await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
        assert not app[PEERS]


async def floods_answered(app: web.Application) -> list[PeerSession]:
    """Each flood on a session of its own (a fresh bucket) from an address
    of its own; the sessions, for the caller to close."""
    made: list[PeerSession] = []

    @fuzz_settings(20)
    @given(size=st.integers(RATE + 1, 6 * RATE),
           message=st.sampled_from([json.dumps({"type": "ping", "id": 1}), "not json", '{"type": "x"}', b"\x00"]))
    def fuzz(size: int, message: str | bytes) -> None:
        record("datachannel flood")
        # a clock that stands still while the flood runs: no token comes back
        # however slowly a loaded machine sends it (its bucket refills on time)
        peer = make_peer(app, client=f"192.0.2.{len(made) + 10}", clock=VirtualClock())
        made.append(peer)
        told = told_of(peer)
        before = len(told)
        for _ in range(size):
            peer.transport._on_client_message(message)
        answers = told[before:]
        limited = [i for i, e in enumerate(answers) if e.get("code") == "rate_limited"]
        assert len(limited) == 1, (size, [e.get("code") for e in answers][-5:])
        # the rate's worth answered as usual, then told once
        assert limited[0] == RATE and limited[0] == len(answers) - 1, (size, limited, len(answers))
        assert peer.id in app[PEERS]

    fuzz()
    return made
