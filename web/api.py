"""The REST + SSE API for turns (bearer-token auth per tenant).

    POST /v1/turns                     start a text turn         -> 202
    GET  /v1/turns/{id}                the turn record            -> 200
    POST /v1/turns/{id}/stop           idempotent stop (Idempotency-Key header)
                                       -> 202 accepted, 200 already_terminal,
                                          409 reconcile_required
    GET  /v1/sessions/{id}/events      the session's event log as SSE, live;
                                       resumable with Last-Event-ID or
                                       ?after_seq=N&resume_token=T

(``GET /v1/openapi.json`` and ``GET /v1/events.schema.json``: :mod:`web.openapi`.)

A turn or session of another tenant answers 404, exactly like one that does
not exist: nothing about other tenants leaks. A resume token of another
session or tenant answers 403.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import re
from typing import Any, Literal

from aiohttp import web
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator

from turn.event_catalogue import Snapshot, SnapshotTurn, StreamEnd, StreamStart, wire_of
from turn.events import EventFollower, event_json
from turn.manager import TurnManager, turn_fields
from turn.models import Budget, Session, StopReason, StopReasonKind, Turn, TurnStatus
from turn.store import IdempotencyConflict, StopAnswer, UnknownSession, UnknownTurn, WrongSessionKind
from web.auth import Auth
from web.drain import DRAIN
from web.errors import ApiError
from web.limits import rate_limited
from web.state import AUTH, CLOCK, LIMITS, MANAGER, STREAMS, TEXT_TURNS

log = logging.getLogger(__name__)

SESSION_ID = re.compile(r"^[A-Za-z0-9_-]{1,64}$")
IDEMPOTENCY_KEY = re.compile(r"^[\x21-\x7e]{1,128}$")
#: how often an idle event stream sends a keep-alive comment, s
KEEPALIVE_S = 15.0
#: how often a live stream looks whether the instance drains, s (the longest
#: a store read of new events blocks: a cancelled blocking Redis read can
#: take until its end to return)
CLOSING_POLL_S = 0.5
#: turns of a session a resumed stream's snapshot shows at most
SNAPSHOT_TURNS = 50


class StartTurn(BaseModel):
    """Body of ``POST /v1/turns`` (strict: ``"100"`` or ``true`` is not a
    number)."""

    model_config = ConfigDict(extra="forbid", strict=True)

    text: str = Field(min_length=1, max_length=4000, description="what the user typed (not only whitespace)")
    session_id: str | None = Field(
        default=None, pattern=SESSION_ID.pattern, description="continue this conversation (the tenant's; 404 if unknown; new if absent)"
    )
    deadline_ms: int | None = Field(default=None, ge=1, le=3_600_000, description="deadline from now, ms")
    budget_tokens: int | None = Field(
        default=None, ge=0, le=10_000_000, description="token budget (prompt + completion); the plan's if tighter"
    )
    budget_cents: float | None = Field(
        default=None, ge=0, le=1_000_000, allow_inf_nan=False, description="money budget, US cents (a finite number)"
    )

    @field_validator("deadline_ms", "budget_tokens", mode="before")
    @classmethod
    def _whole(cls, value: Any) -> Any:
        # JSON has one number type: 2.0 is the integer 2 (JSON Schema's
        # "integer", RFC 8259 section 6), 2.5 and "2" stay refused
        if isinstance(value, float) and value.is_integer():
            return int(value)
        return value

    @field_validator("text")
    @classmethod
    def _has_words(cls, text: str) -> str:
        # a voice turn with no words fails (no_speech_recognized); a typed
        # one is refused before it starts
        if not text.strip():
            raise ValueError("text is only whitespace")
        return text


class StopTurn(BaseModel):
    """Body of ``POST /v1/turns/{id}/stop`` (optional)."""

    model_config = ConfigDict(extra="forbid")

    reason: Literal["user_cancel", "safety_abort"] = "user_cancel"
    detail: str | None = Field(default=None, max_length=500)


def turn_view(turn: Turn, manager: TurnManager) -> dict[str, Any]:
    """The turn as the API shows it: the record, its state's label
    ("stopping" for CANCEL_REQUESTED) and whether its worker is gone."""
    out = turn.model_dump(mode="json")
    out["label"] = turn.status.label
    out["owner_lost"] = manager.lease_expired(turn)
    return out


async def _body(request: web.Request, model: type[BaseModel], *, optional: bool = False) -> Any:
    raw = await request.read()
    if optional and not raw.strip():
        return model()
    try:
        data = json.loads(raw)
    except (ValueError, UnicodeDecodeError, RecursionError) as exc:
        raise ApiError(400, "bad_json", f"body is not valid JSON: {exc}") from exc
    try:
        return model.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'body'}: {e['msg']}" for e in exc.errors())
        raise ApiError(400, "invalid_request", problems) from exc


async def _own_turn(request: web.Request, tenant: str) -> Turn:
    manager = request.app[MANAGER]
    turn_id = request.match_info["turn_id"]
    try:
        turn = await manager.get(turn_id)
    except UnknownTurn:
        turn = None
    if turn is None or turn.tenant_id != tenant:
        raise ApiError(404, "not_found", f"no turn {turn_id!r}")
    return turn


async def start_turn(request: web.Request) -> web.Response:
    """``POST /v1/turns``: start a text turn (a new session, or ``session_id``'s)
    under the tenant's plan; ``deadline_ms`` in ms, ``budget_tokens`` in
    tokens, ``budget_cents`` in cents. Answers 202 with the turn, its
    session, the events URL and a resume token.

    Raises:
        ApiError: 401 no or unknown token; 400 bad JSON or fields; 413 body too
            large; 404 another tenant's or no such session; 409 the session is
            a voice session; 429 ``rate_limited`` (the tenant's or the
            address's turns a minute, :mod:`web.limits`); 503 shutting down.
    """
    app = request.app
    auth: Auth = app[AUTH]
    tenant = auth.require_tenant(request)
    body: StartTurn = await _body(request, StartTurn)
    app[LIMITS].require("turn", tenant=tenant, client=request.remote or "?")  # before anything is made
    if body.session_id is not None:
        # only one of the caller's sessions goes on: an unknown id is not
        # created, so another tenant's answers the same 404 (no existence
        # oracle, no squatting another tenant's next id)
        await _own_session(app[MANAGER], body.session_id, tenant)
    try:
        turn = await app[TEXT_TURNS].start(
            tenant_id=tenant,
            text=body.text,
            session_id=body.session_id,
            deadline_s=body.deadline_ms / 1000 if body.deadline_ms else None,
            budget=Budget(tokens=body.budget_tokens, cents=body.budget_cents)
            if body.budget_tokens is not None or body.budget_cents is not None
            else None,
        )
    except PermissionError as exc:
        raise ApiError(404, "not_found", "no such session") from exc
    except WrongSessionKind as exc:
        raise ApiError(409, "wrong_session_kind", f"{exc}: a text turn starts a text session or continues one") from exc
    except RuntimeError as exc:
        raise ApiError(503, "shutting_down", str(exc)) from exc
    return web.json_response(
        {
            "turn": turn_view(turn, app[MANAGER]),
            "session_id": turn.session_id,
            "events_url": f"/v1/sessions/{turn.session_id}/events",
            "resume_token": auth.resume_token(tenant, turn.session_id),
        },
        status=202,
    )


async def get_turn(request: web.Request) -> web.Response:
    """``GET /v1/turns/{id}``: the turn as stored now, with its ledger rows.

    Raises:
        ApiError: 401 no or unknown token; 404 another tenant's or no such turn.
    """
    tenant = request.app[AUTH].require_tenant(request)
    turn = await _own_turn(request, tenant)
    manager = request.app[MANAGER]
    view = turn_view(turn, manager)
    ledger = await manager.store_call(lambda: manager.store.ledger_list(turn.id))
    view["ledger"] = [i.model_dump(mode="json", exclude={"version"}) for i in ledger]
    return web.json_response(view)


async def stop_turn(request: web.Request) -> web.Response:
    """``POST /v1/turns/{id}/stop`` with an ``Idempotency-Key`` header: request
    a cooperative stop (DESIGN.md "Turn states"); a repeat with the same key
    gets the same answer and causes no second effect.

    Raises:
        ApiError: 401; 400 missing or bad Idempotency-Key or body; 404 another
            tenant's or no such turn; 422 the key was used with other parameters;
            429 ``rate_limited``: over the tenant's or the address's stops a
            second, unless it is the first stop of the tenant's own open turn
            (never refused: a stop must get through a flood).
    """
    app = request.app
    tenant = app[AUTH].require_tenant(request)
    key = request.headers.get("Idempotency-Key")
    if key is None:
        raise ApiError(400, "idempotency_key_required", "send an Idempotency-Key header (1-128 printable ASCII characters)")
    if not IDEMPOTENCY_KEY.match(key):
        raise ApiError(400, "invalid_idempotency_key", "Idempotency-Key must be 1-128 printable ASCII characters, no spaces")
    body: StopTurn = await _body(request, StopTurn, optional=True)
    limits, client = app[LIMITS], request.remote or "?"
    if limits.allows("stop", tenant=tenant, client=client):
        turn = await _own_turn(request, tenant)
    else:  # over the rate: only the first stop of the tenant's own open turn goes on
        wait = limits.wait_s("stop", tenant=tenant, client=client)
        try:
            turn = await _own_turn(request, tenant)
        except ApiError:
            raise rate_limited("too many stop requests", wait) from None
        if turn.status not in (TurnStatus.QUEUED, TurnStatus.RUNNING):
            raise rate_limited("too many stop requests", wait)
        limits.spend("stop", tenant=tenant, client=client)  # it still counts towards the flood
    manager: TurnManager = app[MANAGER]
    request_id = f"{tenant}:{key}"
    fingerprint = hashlib.sha256(f"{turn.id}\0{body.reason}\0{body.detail or ''}".encode()).hexdigest()
    reason = StopReason(
        kind=StopReasonKind(body.reason), initiator=f"api:{tenant}", at=app[CLOCK].now(), request_id=request_id, detail=body.detail
    )
    try:
        res = await manager.request_stop(turn.id, reason, request_id=request_id, fingerprint=fingerprint)
    except IdempotencyConflict as exc:
        raise ApiError(422, "idempotency_key_reused", "this Idempotency-Key was used with other parameters") from exc
    status = {
        StopAnswer.ACCEPTED: 202,
        StopAnswer.ALREADY_STOPPING: 202,
        StopAnswer.ALREADY_TERMINAL: 200,
        StopAnswer.RECONCILE_REQUIRED: 409,
    }[res.answer]
    return web.json_response({"answer": res.answer.value, "turn": turn_view(res.turn, manager)}, status=status)


async def session_events(request: web.Request) -> web.StreamResponse:
    """The session's event log as Server-Sent Events (WHATWG HTML, "Server-sent
    events"): first a ``stream.start`` message with a fresh resume token; on
    a resume, a ``snapshot`` of the session's turns as stored now (the
    authority) and then every event after the cursor; then events live. Each
    logged event's ``id`` is its seq. Fenced output is never sent."""
    app = request.app
    auth: Auth = app[AUTH]
    manager: TurnManager = app[MANAGER]
    session_id = request.match_info["session_id"]
    bearer_tenant = auth.tenant_of(request)
    token = request.query.get("resume_token")
    if token is not None:
        grant = auth.check_resume_token(token)
        if grant.session_id != session_id or (bearer_tenant is not None and bearer_tenant != grant.tenant_id):
            raise ApiError(403, "forbidden", "this resume token is for another session or tenant")
        tenant = grant.tenant_id
    elif bearer_tenant is not None:
        tenant = bearer_tenant
    else:
        raise ApiError(401, "unauthorized", "send 'Authorization: Bearer <token>' or a resume_token",
                       headers={"WWW-Authenticate": 'Bearer realm="turnkeeper"'})
    after_seq, resumed = _cursor(request)
    session = await _own_session(manager, session_id, tenant)

    resp = web.StreamResponse(
        headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
    )
    await resp.prepare(request)
    task = asyncio.current_task()
    streams: set[Any] = app[STREAMS]
    streams.add(task)
    try:
        await _send(resp, wire_of(StreamStart(session_id=session.id, after_seq=after_seq,
                                              resume_token=auth.resume_token(tenant, session.id), expires_in_s=auth.resume_ttl_s)))
        if resumed:
            turns = (await manager.store_call(lambda: manager.store.list_session(session.id)))[-SNAPSHOT_TURNS:]
            await _send(resp, wire_of(Snapshot(turns=[
                SnapshotTurn(turn_id=t.id, generation=t.generation, **turn_fields(t), owner_lost=manager.lease_expired(t))
                for t in turns
            ])))
        follower = EventFollower(manager.store, session.id, after_seq, poll_s=CLOSING_POLL_S)
        sent = [after_seq]  # the seq of the last event sent
        await _live(resp, follower, sent, app[DRAIN].streams_closing)
        # the instance drains: what is logged goes out, then the end
        follower.cursor = max(sent[0], after_seq)  # from the last event sent: none is lost, none sent twice
        for ev in await follower.read_available():
            await _send(resp, event_json(ev), event_id=ev.seq)
        await _send(resp, wire_of(StreamEnd(reason="shutting_down", last_seq=follower.cursor)))
        await resp.write_eof()
    except ConnectionResetError:
        pass  # the client went away
    finally:  # also when cut at shutdown (CancelledError goes on)
        streams.discard(task)
    return resp


async def _live(resp: web.StreamResponse, follower: EventFollower, sent: list[int], closing: asyncio.Event) -> None:
    """Send the session's events as they are logged (a keep-alive comment
    when nothing was sent for ``KEEPALIVE_S``) until ``closing`` is set
    (seen within ``CLOSING_POLL_S``); ``sent[0]`` is kept at the seq of the
    last one sent. No cancellation is needed to end it.

    Raises:
        ConnectionResetError: the client went away.
    """
    loop = asyncio.get_running_loop()
    last_write = loop.time()
    async for batch in follower.follow():
        if closing.is_set():
            return  # this batch is read again from ``sent[0]`` by the caller
        if not batch:
            if loop.time() - last_write >= KEEPALIVE_S:
                await resp.write(b": keep-alive\n\n")
                last_write = loop.time()
            continue
        for ev in batch:
            await _send(resp, event_json(ev), event_id=ev.seq)
            sent[0] = ev.seq
        last_write = loop.time()


def _cursor(request: web.Request) -> tuple[int, bool]:
    """(after_seq, resumed) from ``Last-Event-ID`` or ``?after_seq``."""
    raw = request.headers.get("Last-Event-ID")
    if raw is None:
        raw = request.query.get("after_seq")
    if raw is None:
        return 0, False
    if not raw.isdigit() or len(raw) > 18:
        raise ApiError(400, "invalid_cursor", "after_seq / Last-Event-ID must be a whole number >= 0")
    return int(raw), True


async def _own_session(manager: TurnManager, session_id: str, tenant: str) -> Session:
    if not SESSION_ID.match(session_id):
        raise ApiError(404, "not_found", "no such session")
    try:
        session = await manager.store_call(lambda: manager.store.get_session(session_id))
    except UnknownSession:
        session = None
    if session is None or session.tenant_id != tenant:
        raise ApiError(404, "not_found", "no such session")
    return session


async def _send(resp: web.StreamResponse, data: dict[str, Any], event_id: int | None = None) -> None:
    head = f"id: {event_id}\n" if event_id is not None else ""
    await resp.write(f"{head}data: {json.dumps(data, separators=(',', ':'))}\n\n".encode())


def add_routes(app: web.Application) -> None:
    """Register the API routes on ``app``."""
    app.router.add_post("/v1/turns", start_turn)
    app.router.add_get("/v1/turns/{turn_id}", get_turn)
    app.router.add_post("/v1/turns/{turn_id}/stop", stop_turn)
    app.router.add_get("/v1/sessions/{session_id}/events", session_events)
