"""Who may open a call: Twilio's request signature, and the tenant we sign
into the TwiML.

**X-Twilio-Signature** (Twilio, "Webhooks security": HMAC-SHA1, keyed with
the account's Auth Token, over the full URL Twilio requested followed by
each POST parameter's name and value, sorted by name, base64-encoded; a
WebSocket upgrade is signed over its URL alone). Checked with Twilio's own
``twilio.request_validator.RequestValidator``.

**The tenant** a call belongs to is never taken from the caller: the voice
webhook writes it into the TwiML's ``<Parameter>`` elements together with
an HMAC-SHA256 over the tenant and the call's ``CallSid`` (keyed with the
``telephony.tenant_secret`` setting, or a secret kept in the store), and the
stream's ``start`` must carry both back for the same call. A stream with a
tenant and no valid signature is refused.
"""

from __future__ import annotations

import hashlib
import hmac

from aiohttp import web
from twilio.request_validator import RequestValidator

#: the custom parameters carrying the signed tenant
TENANT_PARAM = "tenant"
TENANT_SIG_PARAM = "tenant_sig"


def twilio_signature_valid(auth_token: str, url: str, params: dict[str, str], signature: str | None) -> bool:
    """Whether ``signature`` (the X-Twilio-Signature header) signs ``url``
    and ``params`` (the form's POST parameters; empty for a GET) with
    ``auth_token``."""
    if not signature:
        return False
    return bool(RequestValidator(auth_token).validate(url, params, signature))


def request_url(request: web.Request, public_url: str) -> str:
    """The URL Twilio requested, as it signed it: ``public_url`` (the
    ``telephony.public_url`` setting: scheme and host as the world sees the
    server, behind a proxy) joined with the path and query, else the
    request's own URL (``X-Forwarded-Proto`` honoured for the scheme); for a
    WebSocket upgrade the scheme is ``ws``/``wss``, as in the ``<Stream>``
    URL Twilio opened and signed."""
    if public_url:
        scheme, _, host = public_url.rstrip("/").partition("://")
    else:
        scheme = request.headers.get("X-Forwarded-Proto", request.scheme).split(",")[0].strip()
        host = request.host
    if request.headers.get("Upgrade", "").lower() == "websocket":
        scheme = {"http": "ws", "https": "wss"}.get(scheme, scheme)  # Twilio signs the wss:// URL it opened
    return f"{scheme}://{host}{request.rel_url.path_qs}"


def sign_tenant(secret: bytes, tenant: str, call_id: str) -> str:
    """The signature binding ``tenant`` to the call ``call_id`` (hex HMAC-SHA256)."""
    return hmac.new(secret, f"{tenant}\n{call_id}".encode(), hashlib.sha256).hexdigest()


def tenant_of(secret: bytes, parameters: dict[str, str], call_id: str) -> str | None:
    """The tenant a stream's ``start`` names, if signed by us for ``call_id``:
    ``"default"`` when it names none, None when the signature is missing or
    wrong (the stream is refused)."""
    tenant = parameters.get(TENANT_PARAM)
    if tenant is None:
        return "default"
    given = parameters.get(TENANT_SIG_PARAM, "")
    if not call_id or not hmac.compare_digest(given, sign_tenant(secret, tenant, call_id)):
        return None
    return tenant
