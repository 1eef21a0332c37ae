"""Who is calling: bearer tokens per tenant, and event-stream resume tokens.

API tokens come from settings (``TURNKEEPER_API_TOKENS=tenant:token,...``)
and are sent as ``Authorization: Bearer <token>`` (RFC 6750). They are
compared in constant time.

A resume token lets a client (a browser's EventSource, which cannot send
headers) reconnect to one session's event stream. It is signed with
itsdangerous (HMAC-SHA256 over the payload and a timestamp, with a key
derived from a 32-byte secret kept in the store, so every instance accepts
it), bound to a tenant and a session, and expires after
``resume_token_ttl_s``. It is not guessable and carries nothing secret.
"""

from __future__ import annotations

import hashlib
import hmac
from dataclasses import dataclass

from aiohttp import web
from itsdangerous import BadSignature, SignatureExpired, URLSafeTimedSerializer
from itsdangerous.timed import TimestampSigner

from clock import Clock
from web.errors import ApiError

RESUME_SALT = "turnkeeper.resume.v1"


@dataclass(frozen=True)
class ResumeGrant:
    """What a valid resume token grants: one tenant's one session."""

    tenant_id: str
    session_id: str


class Auth:
    """Checks bearer tokens and makes/checks resume tokens.

    Args:
        tenants_by_token: token -> tenant (from settings).
        secret: the resume-token signing secret (from the store).
        clock: for token timestamps and expiry.
        resume_ttl_s: resume-token lifetime, s.
    """

    def __init__(self, tenants_by_token: dict[str, str], secret: bytes, clock: Clock, resume_ttl_s: int) -> None:
        self._tokens = [(t.encode(), tenant) for t, tenant in tenants_by_token.items()]
        self.resume_ttl_s = resume_ttl_s

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
        given = token.strip().encode()
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
        if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), token.encode()):
            raise ApiError(401, "unauthorized", "send 'Authorization: Bearer <admin_token>'",
                           headers={"WWW-Authenticate": 'Bearer realm="turnkeeper-admin"'})
    elif request.remote not in LOOPBACK:
        raise ApiError(401, "unauthorized", "admin endpoints answer loopback only unless admin_token is set")
