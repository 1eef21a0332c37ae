"""WebRTC signaling: ``POST /v1/webrtc/offer`` answers a browser's SDP offer
(JSON Session Establishment Protocol style, RFC 8829's offer/answer over
one HTTP exchange) and starts a :class:`web.peer.PeerSession`.

    POST /v1/webrtc/offer   {"type": "offer", "sdp": "..."} ->
                            {"type": "answer", "sdp": "...", "session_id": "..."}

An offer that can never connect is refused (400 ``invalid_sdp``) before
any limit is counted or any session is made (:mod:`web.offer_validation`).
Then the limits (:mod:`web.admission`, :mod:`web.limits`), before anything
is made.
"""

from __future__ import annotations

import asyncio
import json
import logging
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, Field, ValidationError

from turn.models import StopReasonKind, TurnKind
from web.admission import admit
from web.errors import ApiError, openapi_error
from web.offer_validation import OfferRejected, validate_offer
from web.peer import PeerSession
from web.state import AUTH, CLOCK, LIMITS, MANAGER, PACING, PEERS, PROVIDERS, SETTINGS

log = logging.getLogger(__name__)


class OfferRequest(BaseModel):
    """Body of ``POST /v1/webrtc/offer``: the JSON form of an
    RTCSessionDescriptionInit (W3C WebRTC 1.0), and optionally what the
    client knows of its microphone.

    Attributes:
        type: ``"offer"``.
        sdp: the offer (RFC 8866, JSEP RFC 8829).
        echo_cancellation: the microphone track's
            ``MediaTrackSettings.echoCancellation`` (W3C Media Capture and
            Streams): True, the client cancels the agent's echo itself, so
            the echo guard assumes ``bargein.echo_cancelled_loss_db`` until
            playout shows the loss; absent or False, nothing is assumed.
    """

    type: Literal["offer"]
    sdp: str = Field(min_length=1)
    echo_cancellation: bool | None = Field(None, strict=True)


async def read_json(request: web.Request) -> Any:
    """The request's body as JSON, at most ``max_offer_bytes``.

    Raises:
        ApiError: 413 ``body_too_large``; 400 ``bad_json``.
    """
    limit = request.app[SETTINGS].max_offer_bytes
    if request.content_length is not None and request.content_length > limit:
        raise ApiError(413, "body_too_large", f"body is larger than {limit} bytes")
    try:
        raw = await request.read()
    except web.HTTPRequestEntityTooLarge as exc:
        raise ApiError(413, "body_too_large", f"body is larger than {limit} bytes") from exc
    try:
        return json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, "bad_json", f"body is not valid JSON: {exc}") from exc


async def offer(request: web.Request) -> web.Response:
    """Answer a WebRTC offer and start its session (connected within
    ``connect_timeout_s`` or closed).

    Credentials (:meth:`web.auth.Auth.voice_caller`): a client token
    (``Authorization: Bearer ck_...``) starts its own session id, tenant,
    plan, instructions and voice; a tenant API token starts a session of
    that tenant; in development mode none is needed.

    Raises:
        ApiError: 400 ``bad_json``, ``invalid_offer`` or ``invalid_sdp``
            (checked first: such an offer uses no token); 401 missing or
            invalid credentials; 403 a token not for WebRTC; 409 the
            token's session runs already; 413 ``body_too_large``; 429/503
            from :func:`web.admission.admit` (429 ``rate_limited``: the
            tenant's or the address's session starts a minute or concurrent
            sessions, :mod:`web.limits`); the token stays usable after any
            of these.
    """
    app = request.app
    auth = app[AUTH]
    auth.voice_credentials(request)  # none at all: 401 before the body is even read
    body = await read_json(request)
    try:
        req = OfferRequest.model_validate(body)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ApiError(400, "invalid_offer", problems) from exc
    try:
        # Before any limit is counted or session made: an offer that can never
        # connect must not hold a pending slot until connect_timeout_s.
        validate_offer(req.sdp)
    except OfferRejected as exc:
        raise ApiError(400, exc.code, str(exc)) from exc
    settings = app[SETTINGS]
    peers = app[PEERS]
    client = request.remote or "?"
    # after the SDP check (a bad offer uses no token), before anything is made
    caller = await auth.voice_caller(request, "webrtc")
    grant = caller.grant
    tenant = caller.tenant_id
    try:
        if grant is not None and grant.session_id in peers:
            raise ApiError(409, "session_exists", "this client token's session is running already")
        admit(app, client, tenant, start=True)
    except ApiError:
        await auth.refused(caller)  # nothing was started: the token may be used again
        raise
    peer = PeerSession(
        settings=settings,
        manager=app[MANAGER],
        providers=app[PROVIDERS].for_session(grant.options.voice if grant else None),
        clock=app[CLOCK],
        on_closed=lambda p: _forget(peers, p),
        client=client,
        tenant=tenant,
        limits=app[LIMITS],
        session_id=grant.session_id if grant else None,
        plan=grant.plan(settings.plan_for(tenant)) if grant else None,
        instructions=grant.options.instructions if grant else None,
        user_id=grant.options.user_id if grant else None,
        echo_cancellation=req.echo_cancellation,
    )
    peer.transport.outbound.monitor = app[PACING]
    peers[peer.id] = peer
    try:
        # the session exists from its answer on: its events can be followed, a drain can tell it
        await app[MANAGER].ensure_session(peer.id, tenant_id=tenant, kind=TurnKind.VOICE)
        sdp = await peer.answer(req.sdp)
    except OfferRejected as exc:
        await peer.close(StopReasonKind.TRANSPORT_DISCONNECTED)
        await auth.refused(caller)
        raise ApiError(400, exc.code, str(exc)) from exc
    except BaseException:
        await asyncio.shield(peer.close(StopReasonKind.TRANSPORT_DISCONNECTED))
        raise
    log.info("session %s: answered offer (tenant %s)", peer.id, caller.tenant_id)
    return web.json_response({"type": "answer", "sdp": sdp, "session_id": peer.id})


def _forget(peers: dict[str, Any], peer: PeerSession) -> None:
    """A closed peer leaves the table (if still there)."""
    peers.pop(peer.id, None)


#: the OpenAPI paths of this module (merged into web.openapi's document)
OPENAPI_PATHS: dict[str, Any] = {
    "/v1/webrtc/offer": {"post": {
        "summary": "Answer a WebRTC offer and start its voice session", "operationId": "webrtcOffer",
        "description": "Credentials: a client token (Bearer ck_..., from POST /v1/sessions, single use), a tenant API "
                       "token, or none in development mode (no API tokens configured). A session not connected "
                       "within connect_timeout_s is closed.",
        "security": [{"bearer": []}, {}],
        "requestBody": {"required": True, "content": {"application/json": {"schema": {
            "type": "object", "required": ["type", "sdp"],
            "properties": {"type": {"const": "offer"}, "sdp": {"type": "string", "minLength": 1},
                               "echo_cancellation": {"type": "boolean"}}}}}},
        "responses": {
            "200": {"description": "the SDP answer and the session's id", "content": {"application/json": {"schema": {
                "type": "object", "required": ["type", "sdp", "session_id"],
                "properties": {"type": {"const": "answer"}, "sdp": {"type": "string"},
                               "session_id": {"type": "string"}}}}}},
            "400": openapi_error("bad_json, invalid_offer, or an offer that can never connect (invalid_sdp, ...)"),
            "401": openapi_error("no credentials while API tokens are set; a malformed header; an unknown, used or "
                                 "expired token"),
            "403": openapi_error("a client token not for WebRTC (transport_not_allowed)"),
            "409": openapi_error("the client token's session runs already (session_exists)"),
            "413": openapi_error("body larger than max_offer_bytes (body_too_large)"),
            "429": openapi_error("rate_limited: the tenant's or the address's session starts a minute or concurrent "
                                 "sessions; too_many_pending: your sessions still connecting", retry_after=True),
            "503": openapi_error("too_many_sessions (max_sessions), at_capacity (the server is full: web/capacity.py), "
                                 "too_many_pending, shutting_down (draining) or store_unavailable",
                                 retry_after=True)}}},
}


def add_routes(app: web.Application) -> None:
    """Register ``POST /v1/webrtc/offer`` on ``app``."""
    app.router.add_post("/v1/webrtc/offer", offer)
