"""The telephony routes.

Routes:
    POST /v1/telephony/twilio/voice   Twilio's voice webhook: TwiML that
                                      connects the call to our stream
    GET  /v1/telephony/twilio         WebSocket: Twilio Media Streams
    GET  /v1/telephony/telnyx         WebSocket: Telnyx media streaming

With ``telephony.twilio_auth_token`` set, the webhook and the Twilio
WebSocket upgrade need a valid ``X-Twilio-Signature``; without it they are
refused with 403 (``bad_signature``). A call counts against
``max_sessions`` like a WebRTC session and ends with the server. Its
upgrade counts as a session start of the provider's address (429
``rate_limited`` over :mod:`web.limits`); its tenant's quota and start rate
are checked at ``start`` (closed 1008 ``rate_limited`` over them).
"""

from __future__ import annotations

import hmac
import logging
from typing import Any

from aiohttp import web

from web.admission import FULL_CODES, admit, admit_tenant, refuse_socket
from web.credentials import credential_bytes
from web.errors import ApiError
from web.state import CLOCK, LIMITS, MANAGER, PACING, PEERS, PROVIDERS, SETTINGS, STORE
from web.telephony.call import PhoneCall
from web.telephony.dialect import Dialect
from web.telephony.signature import TenantSigner, request_url, twilio_signature_valid
from web.telephony.telnyx import TelnyxDialect
from web.telephony.twilio import TwilioDialect
from web.telephony.twiml import connect_stream

log = logging.getLogger(__name__)

TWILIO_STREAM_PATH = "/v1/telephony/twilio"
TWILIO_VOICE_PATH = "/v1/telephony/twilio/voice"
TELNYX_STREAM_PATH = "/v1/telephony/telnyx"


#: response header of the stream's upgrade naming the call's session
SESSION_HEADER = "X-Turnkeeper-Session"
_UPGRADED = {"description": "switching protocols", "headers": {SESSION_HEADER: {
    "description": "the call's session id (its events: GET /v1/sessions/{id}/events)", "schema": {"type": "string"}}}}


def _err(desc: str) -> dict[str, Any]:
    """A documented error response: the JSON ``Error`` of web.openapi's document."""
    return {"description": desc, "content": {"application/json": {"schema": {"$ref": "#/components/schemas/Error"}}}}


#: answered to a plain GET (RFC 6455 section 4.2.1: a request that is not a
#: valid WebSocket handshake gets an HTTP error such as 400)
_NOT_UPGRADE = _err("not a WebSocket handshake (no Upgrade: websocket, or a bad Sec-WebSocket-* header)")

#: the routes in the OpenAPI document (web.openapi.OPENAPI)
OPENAPI_PATHS: dict[str, Any] = {
    TWILIO_VOICE_PATH: {"post": {
        "summary": "Twilio's voice webhook: TwiML connecting the call to the media stream",
        "security": [],
        "parameters": [{"name": "X-Twilio-Signature", "in": "header", "schema": {"type": "string"},
                        "description": "required when telephony.twilio_auth_token is set"}],
        "requestBody": {"required": True, "content": {"application/x-www-form-urlencoded": {
            "schema": {"type": "object", "required": ["CallSid"], "properties": {
                "CallSid": {"type": "string"}, "To": {"type": "string"}, "From": {"type": "string"}}}}}},
        "responses": {
            "200": {"description": "TwiML: <Response><Connect><Stream url=...> with the signed tenant",
                    "content": {"text/xml": {"schema": {"type": "string"}}}},
            "400": _err("no CallSid"), "403": _err("bad or missing X-Twilio-Signature")}}},
    TWILIO_STREAM_PATH: {"get": {
        "summary": "WebSocket: Twilio Media Streams (bidirectional)", "security": [],
        "responses": {"101": _UPGRADED, "400": _NOT_UPGRADE, "403": _err("bad or missing X-Twilio-Signature"),
                      "429": _err("rate_limited: the address's session starts or sessions"),
                      "503": _err("shutting_down (draining); a full server (too_many_sessions, at_capacity) "
                                  "upgrades and closes 1013 with the reason")}}},
    TELNYX_STREAM_PATH: {"get": {
        "summary": "WebSocket: Telnyx media streaming (bidirectional RTP, PCMU)", "security": [],
        "parameters": [{"name": "token", "in": "query", "schema": {"type": "string"},
                        "description": "telephony.telnyx_stream_token, when set"}],
        "responses": {"101": _UPGRADED, "400": _NOT_UPGRADE, "403": _err("bad or missing ?token= (bad_token)"),
                      "429": _err("rate_limited: the address's session starts or sessions"),
                      "503": _err("shutting_down (draining); a full server (too_many_sessions, at_capacity) "
                                  "upgrades and closes 1013 with the reason")}}},
}


def add_routes(app: web.Application) -> None:
    """Add the telephony routes to ``app``."""
    app[SIGNER] = []
    app.router.add_post(TWILIO_VOICE_PATH, twilio_voice)
    app.router.add_get(TWILIO_STREAM_PATH, twilio_stream)
    app.router.add_get(TELNYX_STREAM_PATH, telnyx_stream)


#: the server's tenant signer, made on first use (its key may live in the store)
SIGNER: web.AppKey[list[TenantSigner]] = web.AppKey("telephony_signer")


async def tenant_signer(app: web.Application) -> TenantSigner:
    """The server's :class:`TenantSigner`, keyed with ``telephony.tenant_secret``,
    else a secret kept in the store (the same for every instance)."""
    held = app[SIGNER]
    if held:
        return held[0]
    configured = app[SETTINGS].telephony.tenant_secret
    if configured:
        secret = configured.encode()
    else:
        store = app[STORE]
        secret = await app[MANAGER].store_call(lambda: store.secret("telephony-tenant"))
    if not held:  # another request may have made it meanwhile: keep one (its claims)
        held.append(TenantSigner(secret))
    return held[0]


def _check_twilio(request: web.Request, params: dict[str, str], *, stream: bool = False) -> None:
    """Refuse (403) a request without a valid X-Twilio-Signature when an
    auth token is configured.

    Raises:
        ApiError: 403 ``bad_signature``.
    """
    t = request.app[SETTINGS].telephony
    if not t.twilio_auth_token:
        return
    # Twilio signs the URL it requested: for the stream, the <Stream> URL
    # we gave it (telephony.stream_url when that is set, with its own host
    # and path), else this server's URL
    url = t.stream_url if stream and t.stream_url else request_url(request, t.public_url)
    if not twilio_signature_valid(t.twilio_auth_token, url, params, request.headers.get("X-Twilio-Signature")):
        log.warning("refused %s %s: bad or missing X-Twilio-Signature", request.method, request.path)
        raise ApiError(403, "bad_signature", "X-Twilio-Signature is missing or does not sign this request")


def stream_url(request: web.Request, path: str) -> str:
    """The ``wss://`` URL of our stream endpoint ``path``: the
    ``telephony.stream_url`` setting, else built from ``telephony.public_url``
    or the request (``https`` becomes ``wss``, ``http`` ``ws``)."""
    t = request.app[SETTINGS].telephony
    if t.stream_url:
        return t.stream_url
    base = request_url(request, t.public_url)
    scheme, _, rest = base.partition("://")
    host = rest.split("/", 1)[0]
    return f"{'wss' if scheme in ('https', 'wss') else 'ws'}://{host}{path}"


async def twilio_voice(request: web.Request) -> web.Response:
    """Twilio's voice webhook (form-encoded POST): TwiML connecting the
    call to ``/v1/telephony/twilio``, with the tenant of the called number
    (``telephony.tenant_by_number``, else ``default``) signed for its
    ``CallSid``.

    Raises:
        ApiError: 403 bad signature; 400 ``bad_form`` (not a form Twilio
            sends: another content type, bytes that are not UTF-8, an
            unknown charset), ``bad_request`` (no ``CallSid``).
    """
    if request.content_type != "application/x-www-form-urlencoded":
        raise ApiError(400, "bad_form", f"Twilio's voice webhook is application/x-www-form-urlencoded, not {request.content_type}")
    try:
        form = await request.post()
    except (ValueError, LookupError) as exc:  # UnicodeDecodeError is a ValueError; LookupError: an unknown charset
        raise ApiError(400, "bad_form", f"the webhook's body is not a form: {exc}") from exc
    params = {k: v for k, v in form.items() if isinstance(v, str)}
    _check_twilio(request, params)
    call_sid = params.get("CallSid", "")
    if not call_sid:
        raise ApiError(400, "bad_request", "the webhook has no CallSid")
    t = request.app[SETTINGS].telephony
    tenant = t.tenant_by_number.get(params.get("To", ""), "default")
    signer = await tenant_signer(request.app)
    twiml = connect_stream(
        stream_url(request, TWILIO_STREAM_PATH), signer.parameters(tenant, call_sid, request.app[CLOCK].now().timestamp())
    )
    return web.Response(text=twiml, content_type="text/xml")


async def twilio_stream(request: web.Request) -> web.StreamResponse:
    """The Twilio Media Streams WebSocket (a full server accepts it and
    closes it 1013 with the reason: :func:`web.admission.refuse_socket`).

    Raises:
        ApiError: 403 bad signature; 429 the
            address's session starts a minute or sessions (``rate_limited``).
    """
    _check_twilio(request, {}, stream=True)
    return await _stream(request, TwilioDialect())


async def telnyx_stream(request: web.Request) -> web.StreamResponse:
    """The Telnyx media streaming WebSocket. Telnyx signs no stream upgrade,
    so the stream URL given to Telnyx (``stream_url`` of its call control
    command) carries a shared secret, ``?token=<telephony.telnyx_stream_token>``;
    with that setting empty the endpoint is open only while no provider
    credential is configured at all (development: no
    ``telephony.twilio_auth_token`` either), and refused otherwise.

    Raises:
        ApiError: 403 ``bad_token``; 429 the
            address's session starts a minute or sessions (``rate_limited``).
    """
    t = request.app[SETTINGS].telephony
    given = request.query.get("token", "")
    if t.telnyx_stream_token:
        if not hmac.compare_digest(credential_bytes(given), credential_bytes(t.telnyx_stream_token)):
            log.warning("refused %s: bad or missing Telnyx stream token", request.path)
            raise ApiError(403, "bad_token", "the stream URL's token is missing or wrong")
    elif t.twilio_auth_token:
        log.warning("refused %s: telephony.telnyx_stream_token is not set", request.path)
        raise ApiError(403, "bad_token", "Telnyx streams are off: set telephony.telnyx_stream_token")
    return await _stream(request, TelnyxDialect())


async def _stream(request: web.Request, dialect: Dialect) -> web.StreamResponse:
    app = request.app
    settings = app[SETTINGS]
    peers = app[PEERS]
    client = request.remote or "?"
    try:
        admit(app, client)  # early: a full server answers before the store is asked
    except ApiError as exc:
        if exc.code not in FULL_CODES:
            raise
        log.warning("refused a %s stream from %s: %s", dialect.name, client, exc.code)
        return await refuse_socket(request, exc)  # the provider logs the close and its reason
    signer = await tenant_signer(app)
    ws = web.WebSocketResponse(max_msg_size=settings.telephony.max_message_bytes, heartbeat=None)

    def forget(call: PhoneCall) -> None:
        peers.pop(call.id, None)

    # checked again and the call registered with no await between: concurrent
    # upgrades cannot all pass (web.admission); the address's start counted
    # here, the tenant's once ``start`` names it
    try:
        admit(app, client, start=True)
    except ApiError as exc:
        if exc.code not in FULL_CODES:
            raise
        log.warning("refused a %s stream from %s: %s", dialect.name, client, exc.code)
        return await refuse_socket(request, exc)
    call = PhoneCall(
        settings=settings, manager=app[MANAGER], providers=app[PROVIDERS].for_session(), clock=app[CLOCK], ws=ws,
        dialect=dialect, signer=signer, on_closed=forget, client=client, limits=app[LIMITS],
        admit_tenant=lambda tenant: admit_tenant(app, call, tenant),
    )
    call.transport.output.monitor = app[PACING]
    peers[call.id] = call
    # the call's session id, for operators' tooling (``turnkeeper call --phone``
    # follows its events with the tenant's token); providers ignore it
    ws.headers[SESSION_HEADER] = call.id
    try:
        await ws.prepare(request)
    except BaseException:
        peers.pop(call.id, None)  # the upgrade failed: no call to free
        raise
    await call.run()
    return ws
