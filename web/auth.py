"""Who is calling: bearer tokens per tenant, client tokens for voice
sessions, and event-stream resume tokens. Every transport's caller is
checked here: browsers by client tokens, devices by device tokens
(:meth:`Auth.device_caller`), phone streams by their provider's signature
and our signed tenant (:mod:`web.telephony.signature`, whose rules are
Twilio's and Telnyx's; single use through the store).

API tokens come from settings (``TURNKEEPER_API_TOKENS=tenant:token,...``,
or ``tenant:sha256:<hex>`` to keep only the token's SHA-256 in the
configuration) and are sent as ``Authorization: Bearer <token>`` (RFC
6750). Only their SHA-256 digests are held in memory, and a presented
token's digest is compared with every known one in constant time.

A voice session is started (:meth:`Auth.voice_caller`) with a client token
(:mod:`web.client_tokens`) or a tenant API token. With no API token
configured the server is in development mode: it listens on loopback only
(``web.serve`` refuses anything else without ``--insecure``) and a voice
session without credentials belongs to the ``default`` tenant.

A resume token lets a client (a browser's EventSource, which cannot send
headers) reconnect to one session's event stream. It is signed with
itsdangerous (HMAC-SHA256 over the payload and a timestamp, with a key
derived from a 32-byte secret kept in the store, so every instance accepts
it), bound to a tenant and a session, and expires after
``resume_token_ttl_s``. It is not guessable and carries nothing secret.
"""

from __future__ import annotations

import dataclasses
import hashlib
import hmac
import ipaddress
import logging
from dataclasses import dataclass

from aiohttp import web
from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer
from itsdangerous.timed import TimestampSigner

from clock import Clock
from turn.store import TurnStore
from web.client_tokens import PREFIX as CLIENT_TOKEN_PREFIX
from web.client_tokens import ClientGrant, ClientTokens, Transport
from web.credentials import credential_bytes, token_hash
from web.errors import ApiError

log = logging.getLogger(__name__)

RESUME_SALT = "turnkeeper.resume.v1"


@dataclass(frozen=True)
class ResumeGrant:
    """What a valid resume token grants: one tenant's one session."""

    tenant_id: str
    session_id: str


@dataclass(frozen=True)
class VoiceCaller:
    """Who starts a voice session, and with what.

    Attributes:
        tenant_id: whose session it is (whose plan and limits apply).
        grant: the client token's grant (session id, user id, options);
            None for a tenant API token or development mode.
        token: the client token presented (to put it back if the start is
            refused before the session exists); empty otherwise.
        device_id: a device socket's device (``client-<session id>`` for a
            client token); empty for other transports.
    """

    tenant_id: str
    grant: ClientGrant | None = None
    token: str = ""
    device_id: str = ""


#: the tenant of voice sessions in development mode (no API tokens)
DEV_TENANT = "default"


class Auth:
    """Checks bearer tokens and makes/checks resume tokens.

    Args:
        tenants_by_token: token (or ``sha256:<hex>`` of it) -> tenant
            (from settings).
        secret: the resume-token signing secret (from the store).
        clock: for token timestamps and expiry.
        resume_ttl_s: resume-token lifetime, s.
        store: where client tokens are kept (None: none can be minted).
        client_token_ttl_s: a client token's lifetime, s.
    """

    def __init__(
        self, tenants_by_token: dict[str, str], secret: bytes, clock: Clock, resume_ttl_s: int,
        store: TurnStore | None = None, client_token_ttl_s: float = 60.0,
    ) -> None:
        self._tokens = [(_digest_of(t), tenant) for t, tenant in tenants_by_token.items()]
        self.resume_ttl_s = resume_ttl_s
        #: client tokens (None without a store)
        self.client_tokens = ClientTokens(store, clock, client_token_ttl_s) if store is not None else None
        self._store = store
        self._dev_logged = False

        class _ClockSigner(TimestampSigner):
            def get_timestamp(self) -> int:
                return int(clock.now().timestamp())

        self._clock = clock
        self._serializer = URLSafeTimedSerializer(
            secret, salt=RESUME_SALT, signer=_ClockSigner, signer_kwargs={"digest_method": hashlib.sha256}
        )

    @property
    def enabled(self) -> bool:
        """True if any API token is configured."""
        return bool(self._tokens)

    def tenant_of(self, request: web.Request) -> str | None:
        """The tenant of the request's bearer token, None if it sent none.

        Raises:
            ApiError: 401 for a malformed header or an unknown token, or when
                no tokens are configured at all.
        """
        header = request.headers.get("Authorization")
        if header is None:
            return None
        scheme, _, token = header.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise _unauthorized("expected 'Authorization: Bearer <token>'", "invalid_request")
        if not self.enabled:
            raise _unauthorized("the REST API is off: set TURNKEEPER_API_TOKENS", "invalid_token")
        given = hashlib.sha256(credential_bytes(token.strip())).digest()
        found = None
        for known, tenant in self._tokens:  # check every one: no early exit to time
            if hmac.compare_digest(given, known):
                found = tenant
        if found is None:
            raise _unauthorized("unknown token", "invalid_token")
        return found

    def require_tenant(self, request: web.Request) -> str:
        """The caller's tenant.

        Raises:
            ApiError: 401 when there is no valid bearer token.
        """
        tenant = self.tenant_of(request)
        if tenant is None:
            raise _unauthorized("this endpoint needs 'Authorization: Bearer <token>'", None)
        return tenant

    def voice_credentials(self, request: web.Request) -> str | None:
        """The bearer token a voice start presents, checked for form only
        (cheap, before its body is read): None in development mode without
        one.

        Raises:
            ApiError: 401 none while API tokens are configured, or a
                malformed ``Authorization`` header.
        """
        header = request.headers.get("Authorization")
        if header is None:
            if self.enabled:
                raise _unauthorized("send 'Authorization: Bearer <client token>' (your backend gets one from "
                                    "POST /v1/sessions)", None)
            return None
        scheme, _, token = header.partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise _unauthorized("expected 'Authorization: Bearer <token>'", "invalid_request")
        return token

    async def voice_caller(self, request: web.Request, transport: Transport) -> VoiceCaller:
        """Who starts a voice session on ``transport`` with ``request``: a
        client token (claimed: it starts nothing else afterwards), a tenant
        API token, or, in development mode, nobody (the ``default`` tenant;
        logged once).

        Raises:
            ApiError: 401 no credentials while API tokens are configured, a
                malformed header, an unknown, used or expired token; 403 a
                client token not valid for ``transport`` (it stays usable).
            turn.store.StoreUnavailable: the store cannot be reached.
        """
        token = self.voice_credentials(request)
        if token is None:
            if not self._dev_logged:
                self._dev_logged = True
                log.info("development mode: voice sessions start without credentials (no API tokens are set)")
            return VoiceCaller(DEV_TENANT)
        if not token.startswith(CLIENT_TOKEN_PREFIX):
            return VoiceCaller(self.require_tenant(request))
        if self.client_tokens is None:
            raise _unauthorized("client tokens are not available", "invalid_token")
        grant = await self.client_tokens.claim(token)
        if transport not in grant.options.transports:
            await self.client_tokens.put_back(token, grant)
            raise ApiError(403, "transport_not_allowed", f"this client token does not start {transport} sessions")
        return VoiceCaller(grant.tenant_id, grant, token)

    async def device_caller(self, request: web.Request) -> VoiceCaller:
        """Who opens a device socket (xiaozhi-esp32): a device token issued
        by ``POST /v1/devices`` (looked up by its SHA-256 in the store), or
        a client token minted for the ``device`` transport.

        Raises:
            ApiError: 401 no bearer token, an unknown or revoked device
                token, an unknown, used or expired client token; 403 a
                client token not for devices.
            turn.store.StoreUnavailable: the store cannot be reached.
        """
        scheme, _, token = request.headers.get("Authorization", "").partition(" ")
        token = token.strip()
        if scheme.lower() != "bearer" or not token:
            raise ApiError(401, "unauthorized", "a device needs 'Authorization: Bearer <device token>'",
                           headers={"WWW-Authenticate": 'Bearer realm="turnkeeper-devices"'})
        if token.startswith(CLIENT_TOKEN_PREFIX):
            caller = await self.voice_caller(request, "device")
            assert caller.grant is not None
            return dataclasses.replace(caller, device_id=f"client-{caller.grant.session_id}")
        found = await self._store.device_by_token(token_hash(token)) if self._store is not None else None
        if found is None:
            log.warning("refused a device from %s: unknown or revoked token", request.remote)
            raise ApiError(401, "unauthorized", "unknown or revoked device token",
                           headers={"WWW-Authenticate": 'Bearer realm="turnkeeper-devices", error="invalid_token"'})
        return VoiceCaller(found[1], device_id=found[0])

    async def refused(self, caller: VoiceCaller) -> None:
        """The start ``caller`` asked for was refused before its session
        existed (a limit, a full server): its client token is usable
        again (until its expiry)."""
        if caller.grant is not None and self.client_tokens is not None:
            await self.client_tokens.put_back(caller.token, caller.grant)

    def resume_token(self, tenant_id: str, session_id: str) -> str:
        """A token to resume ``session_id``'s event stream as ``tenant_id``."""
        return self._serializer.dumps({"t": tenant_id, "s": session_id})

    def check_resume_token(self, token: str) -> ResumeGrant:
        """What ``token`` grants.

        Raises:
            ApiError: 401 if it is malformed, forged (bad signature) or
                expired.
        """
        try:
            data = self._serializer.loads(token, max_age=self.resume_ttl_s)
        except SignatureExpired as exc:
            raise ApiError(401, "resume_token_expired", "the resume token has expired; reconnect with your API token") from exc
        except (BadSignature, ValueError, TypeError) as exc:
            raise ApiError(401, "invalid_resume_token", "the resume token is not valid") from exc
        if not isinstance(data, dict) or not isinstance(data.get("t"), str) or not isinstance(data.get("s"), str):
            raise ApiError(401, "invalid_resume_token", "the resume token is not valid")
        return ResumeGrant(tenant_id=data["t"], session_id=data["s"])


def is_loopback(host: str) -> bool:
    """True if listening on ``host`` reaches this machine only: a loopback
    address (127.0.0.0/8, ::1) or ``localhost``. ``0.0.0.0``, ``::`` and
    every other name or address are not."""
    if host.lower() in ("localhost", "localhost."):
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def check_exposure(host: str, has_api_tokens: bool, insecure: bool) -> None:
    """Refuse to serve everyone unauthenticated: without API tokens the
    server may listen on loopback only, unless ``insecure``.

    Raises:
        ValueError: one line naming the setting to set.
    """
    if has_api_tokens or insecure or is_loopback(host):
        return
    raise ValueError(
        f"refusing to listen on {host} without credentials: set TURNKEEPER_API_TOKENS (tenant:token,...), "
        "or listen on 127.0.0.1, or pass --insecure (TURNKEEPER_AUTH__INSECURE=true) to let anyone in"
    )


def _digest_of(configured: str) -> bytes:
    """The SHA-256 digest of a configured API token (``sha256:<hex>``
    already is one)."""
    if configured.startswith("sha256:"):
        return bytes.fromhex(configured[len("sha256:"):])
    return hashlib.sha256(configured.encode()).digest()


def _unauthorized(message: str, error: str | None) -> ApiError:
    challenge = 'Bearer realm="turnkeeper"' + (f', error="{error}"' if error else "")
    return ApiError(401, "unauthorized", message, headers={"WWW-Authenticate": challenge})


#: clients that may call the admin endpoints when no ``admin_token`` is set
LOOPBACK = frozenset({"127.0.0.1", "::1"})


def require_admin(request: web.Request) -> None:
    """Let an admin request (``/v1/admin/*``) through: with the
    ``admin_token`` setting, only ``Authorization: Bearer <admin_token>``
    (compared in constant time); without it, only loopback clients (a
    preStop hook runs in the pod; behind a proxy set the token).

    Raises:
        ApiError: 401 otherwise.
    """
    from web.state import SETTINGS  # web.state names this module's classes

    token = request.app[SETTINGS].admin_token
    if token:
        scheme, _, given = request.headers.get("Authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(credential_bytes(given.strip()), credential_bytes(token)):
            raise ApiError(401, "unauthorized", "send 'Authorization: Bearer <admin_token>'",
                           headers={"WWW-Authenticate": 'Bearer realm="turnkeeper-admin"'})
    elif request.remote not in LOOPBACK:
        raise ApiError(401, "unauthorized", "admin endpoints answer loopback only unless admin_token is set")
