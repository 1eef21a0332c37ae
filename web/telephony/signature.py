"""Who may open a call: Twilio's request signature, and the tenant we sign
into the TwiML.

**X-Twilio-Signature** (Twilio, "Webhooks security": HMAC-SHA1, keyed with
the account's Auth Token, over the full URL Twilio requested followed by
each POST parameter's name and value, sorted by name, base64-encoded; a
WebSocket upgrade is signed over its URL alone). Checked with Twilio's own
``twilio.request_validator.RequestValidator``.

**The tenant** a call belongs to is never taken from the caller: the voice
webhook writes it into the TwiML's ``<Parameter>`` elements together with
an HMAC-SHA256 over the tenant, the call's ``CallSid`` and the time it was
issued (keyed with the ``telephony.tenant_secret`` setting, or a secret kept
in the store), and the stream's ``start`` must carry them back for the same
call, within ``TENANT_SIG_TTL_S`` of issue, and only once: a second stream
presenting the same call's signature is refused, on this instance by the
signer's memory and on every instance sharing the store by a claim there
(``TurnStore.claim_once``, made by :mod:`web.telephony.call` before the
session exists), so a stream URL and its parameters seen in a log cannot be
replayed to open another call on the tenant's budget. A stream with a tenant and no valid signature
is refused; so is one naming no tenant once Twilio requests are
authenticated (``telephony.twilio_auth_token``); without that setting
(development) such a stream is the ``default`` tenant's.
"""

from __future__ import annotations

import hashlib
import hmac
from collections import OrderedDict

from aiohttp import web
from twilio.request_validator import RequestValidator

from web.credentials import credential_bytes

#: the custom parameters carrying the signed tenant
TENANT_PARAM = "tenant"
TENANT_SIG_PARAM = "tenant_sig"
TENANT_TS_PARAM = "tenant_ts"
#: a signed tenant must reach the stream's ``start`` this soon after the webhook, s
TENANT_SIG_TTL_S = 300
#: how far ahead of our clock an issue time may be (another instance's clock), s
CLOCK_SKEW_S = 60
#: calls remembered as having started a stream, at most
MAX_CLAIMS = 100_000


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


def sign_tenant(secret: bytes, tenant: str, call_id: str, issued_at: int) -> str:
    """The signature binding ``tenant`` to the call ``call_id``, issued at
    ``issued_at`` (Unix seconds): hex HMAC-SHA256."""
    return hmac.new(secret, credential_bytes(f"{tenant}\n{call_id}\n{issued_at}"), hashlib.sha256).hexdigest()


class TenantSigner:
    """Signs the tenant into a call's TwiML and checks it when the stream
    starts (see the module doc). One per server; not thread-safe.

    Args:
        secret: the HMAC key.
    """

    def __init__(self, secret: bytes) -> None:
        self.secret = secret
        self._claimed: OrderedDict[str, float] = OrderedDict()  # call id -> when its signature expires

    def parameters(self, tenant: str, call_id: str, now: float) -> dict[str, str]:
        """The ``<Parameter>``s for call ``call_id`` of ``tenant``, issued
        at ``now`` (Unix seconds)."""
        issued = int(now)
        return {TENANT_PARAM: tenant, TENANT_TS_PARAM: str(issued),
                TENANT_SIG_PARAM: sign_tenant(self.secret, tenant, call_id, issued)}

    def tenant_of(self, parameters: dict[str, str], call_id: str, now: float, *, required: bool = False) -> str | None:
        """The tenant a stream's ``start`` names, if signed by us for
        ``call_id``, not expired at ``now`` (Unix seconds) and not used by
        another stream before; None when it is refused (the stream is
        closed). A ``start`` naming no tenant is ``"default"``, unless
        ``required`` (our webhook always names one: when Twilio requests
        are authenticated, a stream without it did not come from our TwiML,
        and its upgrade signature, over the URL alone, may be a replay)."""
        tenant = parameters.get(TENANT_PARAM)
        if tenant is None:
            return None if required else "default"
        given = parameters.get(TENANT_SIG_PARAM, "")
        issued_text = parameters.get(TENANT_TS_PARAM, "")
        if not call_id or not issued_text.isdigit() or len(issued_text) > 12:
            return None
        issued = int(issued_text)
        if not hmac.compare_digest(credential_bytes(given), credential_bytes(sign_tenant(self.secret, tenant, call_id, issued))):
            return None
        if not now - TENANT_SIG_TTL_S <= issued <= now + CLOCK_SKEW_S:
            return None
        return tenant if self._claim(call_id, issued + TENANT_SIG_TTL_S, now) else None

    def _claim(self, call_id: str, expires: float, now: float) -> bool:
        while self._claimed and next(iter(self._claimed.values())) < now:
            self._claimed.popitem(last=False)  # expired: its signature is refused anyway
        if call_id in self._claimed:
            return False
        self._claimed[call_id] = expires
        if len(self._claimed) > MAX_CLAIMS:
            self._claimed.popitem(last=False)
        return True
