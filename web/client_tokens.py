"""Client tokens: short-lived, single-use credentials a browser presents to
start a voice session, minted by the app's backend.

The pattern is OpenAI Realtime's ephemeral client secrets and LiveKit's
access tokens: the backend holds the tenant's API token and never gives it
to a browser; for each user about to talk it asks

    POST /v1/sessions        (Authorization: Bearer <tenant API token>)
    {"user_id": "u-42", "instructions": "...", "voice": "en-gb",
     "transports": ["webrtc"], "plan": {"deadline_s": 60, "budget_cents": 5}}
    -> 201 {"client_token": "ck_...", "session_id": "...", "expires_at": "...",
            "expires_in_s": 60, "tenant_id": "...", "user_id": "u-42", "options": {...}}

and hands the token to its page, which sends it with the offer
(``Authorization: Bearer ck_...`` on ``POST /v1/webrtc/offer``). The token:

- is 32 random bytes (URL-safe base64 after ``ck_``); the store keeps only
  its SHA-256 with the grant, so a leaked store starts no session;
- is bound to the tenant, an optional user id, the session id the session
  will have (the backend can follow ``/v1/sessions/{id}/events`` with its
  own token from the start) and the options the backend chose;
- starts one session at most: the offer claims it atomically in the store
  (GETDEL on Redis, DELETE ... RETURNING on SQLite), so two offers with one
  token, on any instances, start one session. An offer refused before its
  session exists (full server, rate limit) puts it back;
- expires after ``auth.client_token_ttl_s`` (default 60 s).

The options can only narrow the tenant's plan (:meth:`ClientGrant.plan`):
a browser holding a token cannot spend more than its tenant may. The
instructions are never in the token (it is opaque), so the page cannot read
the backend's prompt.
"""

from __future__ import annotations

import base64
import json
import logging
import os
from datetime import datetime, timedelta
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from clock import Clock
from turn.models import Plan, TurnKind
from turn.store import TurnStore
from web.credentials import token_hash
from web.errors import ApiError

log = logging.getLogger(__name__)

#: what every client token starts with (tells it from a tenant API token)
PREFIX = "ck_"
#: the transports a client token may start
Transport = Literal["webrtc", "device"]


class PlanLimits(BaseModel):
    """Limits tighter than the tenant's plan for this session's turns; each
    absent one is the plan's (:class:`turn.models.Plan` has the units)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    deadline_s: float | None = Field(default=None, gt=0, le=24 * 3600, allow_inf_nan=False,
                                     description="each turn's deadline, s")
    budget_cents: float | None = Field(default=None, ge=0, le=1_000_000, allow_inf_nan=False,
                                       description="money per turn, US cents")
    budget_tokens: int | None = Field(default=None, ge=0, le=10_000_000, description="model tokens per turn")
    max_steps: int | None = Field(default=None, ge=1, le=10_000, description="model and tool calls per turn")


class SessionOptions(BaseModel):
    """Body of ``POST /v1/sessions``: what the backend binds to the token."""

    model_config = ConfigDict(extra="forbid", strict=True)

    user_id: str | None = Field(default=None, pattern=r"^[\x21-\x7e]{1,128}$",
                                description="the app's id of the user (1-128 printable ASCII)")
    instructions: str | None = Field(default=None, min_length=1, max_length=8000,
                                     description="a system message put before the conversation in every model request")
    voice: str | None = Field(default=None, pattern=r"^[A-Za-z0-9_.+-]{1,40}$",
                              description="the TTS voice (espeak-ng voice name with the embedded TTS)")
    transports: list[Transport] = Field(default_factory=lambda: _webrtc_only(), min_length=1, max_length=2,
                                        description="which clients may present the token")
    plan: PlanLimits | None = Field(default=None, description="narrower limits than the tenant's plan")

    @field_validator("transports")
    @classmethod
    def _distinct(cls, value: list[str]) -> list[str]:
        if len(set(value)) != len(value):
            raise ValueError("a transport is named twice")
        return value


def _webrtc_only() -> list[Transport]:
    return ["webrtc"]


class ClientGrant(BaseModel):
    """What a valid client token grants: one session of one tenant, with
    the options its backend chose."""

    tenant_id: str
    session_id: str
    options: SessionOptions
    expires_at: datetime

    def plan(self, base: Plan) -> Plan:
        """``base`` (the tenant's plan) narrowed by the token's limits: each
        the smaller of the two (an absent budget is no limit)."""
        lim = self.options.plan
        if lim is None:
            return base

        def least(a: float | None, b: float | None) -> float | None:
            return b if a is None else a if b is None else min(a, b)

        deadline = base.deadline_s if lim.deadline_s is None else min(base.deadline_s, lim.deadline_s)
        tokens = least(base.budget_tokens, lim.budget_tokens)
        return base.model_copy(update={
            "deadline_s": deadline,
            "budget_cents": least(base.budget_cents, lim.budget_cents),
            "budget_tokens": None if tokens is None else int(tokens),
            "max_steps": base.max_steps if lim.max_steps is None else min(base.max_steps, lim.max_steps),
            # the wind-down reserve must stay shorter than the deadline
            "shutdown_reserve_ms": min(base.shutdown_reserve_ms, int(deadline * 1000) // 2),
        })


class ClientTokens:
    """Mints and claims client tokens in the store.

    Args:
        store: where the grants are kept (by token hash).
        clock: issue and expiry times.
        ttl_s: a token's lifetime, s (``auth.client_token_ttl_s``).
    """

    def __init__(self, store: TurnStore, clock: Clock, ttl_s: float) -> None:
        self.store = store
        self.clock = clock
        self.ttl_s = ttl_s

    async def mint(self, tenant_id: str, options: SessionOptions) -> tuple[str, ClientGrant]:
        """A new token for ``tenant_id`` and its grant (a fresh session id).

        Raises:
            turn.store.StoreUnavailable: the store cannot be written.
        """
        token = PREFIX + base64.urlsafe_b64encode(os.urandom(32)).rstrip(b"=").decode()
        grant = ClientGrant(
            tenant_id=tenant_id, session_id=base64.urlsafe_b64encode(os.urandom(16)).rstrip(b"=").decode(),
            options=options, expires_at=self.clock.now() + timedelta(seconds=self.ttl_s),
        )
        await self.store.client_token_put(token_hash(token), grant.model_dump_json(), grant.expires_at, self.clock.now())
        return token, grant

    async def claim(self, token: str) -> ClientGrant:
        """The grant of ``token``, which cannot start another session after
        this (single use).

        Raises:
            ApiError: 401 ``invalid_client_token``: unknown, used, expired
                or malformed (one answer for all: nothing to probe).
            turn.store.StoreUnavailable: the store cannot be read.
        """
        if not token.startswith(PREFIX) or len(token) > 100:
            raise invalid_client_token()
        raw = await self.store.client_token_claim(token_hash(token), self.clock.now())
        if raw is None:
            raise invalid_client_token()
        return ClientGrant.model_validate_json(raw)

    async def put_back(self, token: str, grant: ClientGrant) -> None:
        """Make a claimed token usable again until its own expiry (its offer
        was refused before any session existed). Best effort: a store error
        is logged, the token then stays used."""
        if grant.expires_at <= self.clock.now():
            return
        try:
            await self.store.client_token_put(token_hash(token), grant.model_dump_json(), grant.expires_at, self.clock.now())
        except Exception:
            log.warning("a refused offer's client token could not be put back; it stays used", exc_info=True)


def invalid_client_token() -> ApiError:
    """401 for a client token that starts nothing (RFC 6750 ``invalid_token``)."""
    return ApiError(401, "invalid_client_token",
                    "the client token is unknown, used or expired; ask your backend for a new one (POST /v1/sessions)",
                    headers={"WWW-Authenticate": 'Bearer realm="turnkeeper", error="invalid_token"'})


def grant_view(token: str, grant: ClientGrant, now: datetime, plan: Plan) -> dict[str, Any]:
    """The answer of ``POST /v1/sessions`` (the token is shown once; the
    instructions are not echoed back). ``plan`` is the tenant's: the
    answer's ``plan`` is what the session's turns will get (the token's
    limits narrow it, never widen it)."""
    options = grant.options.model_dump(mode="json", exclude={"instructions"})
    options["instructions"] = grant.options.instructions is not None
    effective = grant.plan(plan)
    return {
        "client_token": token,
        "session_id": grant.session_id,
        "tenant_id": grant.tenant_id,
        "user_id": grant.options.user_id,
        "expires_at": grant.expires_at.isoformat(),
        "expires_in_s": max(0, round((grant.expires_at - now).total_seconds())),
        "events_url": f"/v1/sessions/{grant.session_id}/events",
        "options": options,
        "plan": {"deadline_s": effective.deadline_s, "budget_cents": effective.budget_cents,
                 "budget_tokens": effective.budget_tokens, "max_steps": effective.max_steps},
    }


async def create_session(request: web.Request) -> web.Response:
    """``POST /v1/sessions`` (tenant bearer token): mint a client token for
    one voice session of the caller's tenant. The body (optional) is
    :class:`SessionOptions`.

    Raises:
        ApiError: 401 no or unknown API token (a client token cannot mint
            another); 400 bad JSON or options (``invalid_request``), a voice
            the TTS does not have (``unknown_voice``); 413 body too large.
    """
    from web.state import AUTH, CLOCK, MANAGER, PROVIDERS, SETTINGS  # web.state names this module's classes

    app = request.app
    if not app[AUTH].enabled:
        raise ApiError(401, "unauthorized", "no API tokens are configured (development mode): voice sessions "
                       "start without a client token; set TURNKEEPER_API_TOKENS to mint them",
                       headers={"WWW-Authenticate": 'Bearer realm="turnkeeper"'})
    tenant = app[AUTH].require_tenant(request)
    raw = await request.read()
    try:
        data = json.loads(raw) if raw.strip() else {}
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, "bad_json", f"body is not valid JSON: {exc}") from exc
    try:
        options = SessionOptions.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ApiError(400, "invalid_request", problems) from exc
    if options.voice is not None and not await app[PROVIDERS].voice_exists(options.voice):
        raise ApiError(400, "unknown_voice", f"the TTS has no voice {options.voice!r}")
    tokens = app[AUTH].client_tokens
    if tokens is None:
        raise ApiError(503, "client_tokens_unavailable", "this server keeps no client tokens")
    token, grant = await tokens.mint(tenant, options)
    # the session exists from now on: the backend can follow its events before the browser connects
    await app[MANAGER].ensure_session(grant.session_id, tenant_id=tenant, kind=TurnKind.VOICE)
    log.info("client token for session %s of tenant %s (expires in %.0f s)", grant.session_id, tenant, tokens.ttl_s)
    view = grant_view(token, grant, app[CLOCK].now(), app[SETTINGS].plan_for(tenant))
    return web.json_response(view, status=201)


def add_routes(app: web.Application) -> None:
    """Register ``POST /v1/sessions`` on ``app``."""
    app.router.add_post("/v1/sessions", create_session)


def _schema(model: type[BaseModel]) -> dict[str, Any]:
    schema = model.model_json_schema(ref_template="#/components/schemas/{model}")
    schema.pop("$defs", None)
    return schema


#: the OpenAPI paths of this module (merged into web.openapi's document)
OPENAPI_PATHS: dict[str, Any] = {
    "/v1/sessions": {"post": {
        "summary": "Mint a short-lived, single-use client token for one voice session",
        "requestBody": {"required": False, "content": {"application/json": {"schema": {
            "$ref": "#/components/schemas/SessionOptions"}}}},
        "responses": {
            "201": {"description": "the token (shown once) and its grant", "content": {"application/json": {"schema": {
                "type": "object",
                "required": ["client_token", "session_id", "tenant_id", "expires_at", "expires_in_s", "options"],
                "properties": {
                    "client_token": {"type": "string"}, "session_id": {"type": "string"},
                    "tenant_id": {"type": "string"}, "user_id": {"type": ["string", "null"]},
                    "expires_at": {"type": "string", "format": "date-time"},
                    "expires_in_s": {"type": "integer", "minimum": 0}, "events_url": {"type": "string"},
                    "options": {"type": "object", "description": "what was asked (instructions: only whether given)"},
                    "plan": {"type": "object", "description": "the limits the session's turns get: the tenant's "
                             "plan narrowed by the token's", "properties": {
                                 "deadline_s": {"type": "number"}, "budget_cents": {"type": ["number", "null"]},
                                 "budget_tokens": {"type": ["integer", "null"]}, "max_steps": {"type": "integer"}}}}}}}},
            "400": {"description": "bad JSON or options", "content": {"application/json": {"schema": {
                "$ref": "#/components/schemas/Error"}}}},
            "401": {"description": "no or unknown API token", "content": {"application/json": {"schema": {
                "$ref": "#/components/schemas/Error"}}}},
            "413": {"description": "body too large", "content": {"application/json": {"schema": {
                "$ref": "#/components/schemas/Error"}}}},
        }}},
}

#: the component schemas :data:`OPENAPI_PATHS` refers to
OPENAPI_SCHEMAS: dict[str, Any] = {"SessionOptions": _schema(SessionOptions), "PlanLimits": _schema(PlanLimits)}
