"""The REST + SSE turn API, on both stores: auth, text turns, idempotent
stop, resumable event streams, and every kind of bad input."""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import jsonschema
import pytest
from aiohttp import web
from conftest import start_app

from clock import VirtualClock
from turn.event_catalogue import MODEL_OF
from turn.models import TurnKind
from web.app import MANAGER, create_app
from web.auth import Auth
from web.errors import ApiError
from web.settings import Settings

TOKENS = "acme:tok-acme-0123456789,globex:tok-globex-0123456789"
ACME = {"Authorization": "Bearer tok-acme-0123456789"}
GLOBEX = {"Authorization": "Bearer tok-globex-0123456789"}
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "RECONCILE_REQUIRED"}


class Api:
    def __init__(self, app: web.Application, url: str, http: aiohttp.ClientSession) -> None:
        self.app, self.url, self.http = app, url, http

    async def call(self, method: str, path: str, *, headers: dict[str, str] | None = None, **kw: Any) -> tuple[int, Any]:
        async with self.http.request(method, self.url + path, headers=headers, **kw) as r:
            body = await r.json(content_type=None)
            return r.status, body

    async def start(self, text: str, headers: dict[str, str] = ACME, **extra: Any) -> dict[str, Any]:
        status, body = await self.call("POST", "/v1/turns", headers=headers, json={"text": text, **extra})
        assert status == 202, body
        return body

    async def wait_terminal(self, turn_id: str, headers: dict[str, str] = ACME, timeout: float = 20) -> dict[str, Any]:
        async with asyncio.timeout(timeout):
            while True:
                status, body = await self.call("GET", f"/v1/turns/{turn_id}", headers=headers)
                assert status == 200, body
                if body["status"] in TERMINAL:
                    return body
                await asyncio.sleep(0.05)

    async def stop(self, turn_id: str, key: str | None, headers: dict[str, str] = ACME, **kw: Any) -> tuple[int, Any]:
        h = dict(headers)
        if key is not None:
            h["Idempotency-Key"] = key
        return await self.call("POST", f"/v1/turns/{turn_id}/stop", headers=h, **kw)

    async def sse(
        self, path: str, *, headers: dict[str, str] | None = None, until: Any = None, timeout: float = 20
    ) -> list[dict[str, Any]]:
        """Read an event stream until ``until(message)`` is true."""
        out: list[dict[str, Any]] = []
        async with self.http.get(self.url + path, headers=headers) as r:
            assert r.status == 200, await r.text()
            assert r.headers["Content-Type"].startswith("text/event-stream")
            async with asyncio.timeout(timeout):
                current: dict[str, Any] = {}
                async for raw in r.content:
                    line = raw.decode().rstrip("\n")
                    if line.startswith("id: "):
                        current["_id"] = int(line[4:])
                    elif line.startswith("data: "):
                        current.update(json.loads(line[6:]))
                    elif line == "" and current:
                        out.append(current)
                        if until is not None and until(current):
                            return out
                        current = {}
        return out


@pytest.fixture(params=["sqlite", "redis"])
async def api(request: pytest.FixtureRequest, tmp_path: Path, redis_url: str) -> AsyncIterator[Api]:
    store = f"sqlite:///{tmp_path}/t.db" if request.param == "sqlite" else redis_url
    settings = Settings(
        store=store, api_tokens=TOKENS, redis_prefix=f"t{uuid.uuid4().hex[:12]}", llm={"tokens_per_second": 40},
        stt={"max_decoders": 1},  # text turns need no speech recogniser
    )
    app = create_app(settings)
    runner, url = await start_app(app)
    async with aiohttp.ClientSession() as http:
        yield Api(app, url, http)
    await runner.cleanup()


# -- auth ------------------------------------------------------------------------


@pytest.mark.parametrize(
    "headers",
    [None, {"Authorization": "Bearer nope"}, {"Authorization": "Basic dXNlcjpwYXNz"}, {"Authorization": "Bearer "}],
)
async def test_auth_is_required(api: Api, headers: dict[str, str] | None) -> None:
    for method, path in (("POST", "/v1/turns"), ("GET", "/v1/turns/x"), ("POST", "/v1/turns/x/stop"), ("GET", "/v1/sessions/x/events")):
        status, body = await api.call(method, path, headers=headers, json={"text": "hi"})
        assert status == 401 and body["error"]["code"] == "unauthorized", (method, path, body)
    async with api.http.post(api.url + "/v1/turns", json={"text": "hi"}) as r:
        assert r.headers["WWW-Authenticate"].startswith("Bearer")


@pytest.mark.parametrize(
    "payload, code",
    [
        (b"{nope", "bad_json"),
        (b"[1]", "invalid_request"),
        (json.dumps({}).encode(), "invalid_request"),
        (json.dumps({"text": ""}).encode(), "invalid_request"),
        (json.dumps({"text": " \t\n "}).encode(), "invalid_request"),  # no words: refused, not answered
        (b'{"text": "hi", "budget_cents": NaN}', "invalid_request"),
        (b'{"text": "hi", "budget_cents": Infinity}', "invalid_request"),
        (json.dumps({"text": "x" * 4001}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "session_id": "../etc"}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "deadline_ms": 0}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "colour": "blue"}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "budget_tokens": -1}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "budget_cents": "lots"}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "budget_tokens": "100"}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "budget_tokens": True}).encode(), "invalid_request"),
        (json.dumps({"text": "hi", "deadline_ms": 1.5}).encode(), "invalid_request"),
    ],
)
async def test_bad_turn_requests(api: Api, payload: bytes, code: str) -> None:
    status, body = await api.call("POST", "/v1/turns", headers=ACME, data=payload)
    assert (status, body["error"]["code"]) == (400, code)


# -- text turns ------------------------------------------------------------------


async def test_text_turn_runs_to_completion(api: Api) -> None:
    started = await api.start("what is the weather")
    turn = started["turn"]
    assert turn["status"] == "RUNNING" and turn["kind"] == "text" and turn["tenant_id"] == "acme"
    assert started["events_url"] == f"/v1/sessions/{started['session_id']}/events" and started["resume_token"]
    done = await api.wait_terminal(turn["id"])
    assert done["status"] == "COMPLETED" and "sunny" in done["reply"] and done["transcript"] == "what is the weather"
    assert done["label"] == "completed" and done["terminal_at"] and done["owner_lost"] is False
    # the next turn in the session sees the conversation
    nxt = await api.start("count to twenty", session_id=started["session_id"])
    assert nxt["turn"]["generation"] == turn["generation"] + 1
    assert (await api.wait_terminal(nxt["turn"]["id"]))["reply"].startswith("One, two")


async def test_other_tenants_see_nothing(api: Api) -> None:
    started = await api.start("tell me a story")
    tid, sid = started["turn"]["id"], started["session_id"]
    for status, body in (
        await api.call("GET", f"/v1/turns/{tid}", headers=GLOBEX),
        await api.stop(tid, "k", headers=GLOBEX),
        await api.call("POST", "/v1/turns", headers=GLOBEX, json={"text": "hi", "session_id": sid}),
        await api.call("GET", f"/v1/sessions/{sid}/events", headers=GLOBEX),
        await api.call("GET", "/v1/turns/does-not-exist", headers=ACME),
    ):
        assert status == 404 and body["error"]["code"] == "not_found"
        assert "acme" not in json.dumps(body)
    await api.stop(tid, "cleanup")


async def test_a_text_turn_cannot_join_a_voice_session(api: Api) -> None:
    """A live call's session is the call's (its generation fence and
    delivery gate): a typed message into it is refused with 409, even by
    its own tenant, and nothing is written (from review: it ran beside
    the voice turn and fenced the call's output)."""
    manager = api.app[MANAGER]
    await manager.ensure_session("call-1", tenant_id="acme", kind=TurnKind.VOICE)
    status, body = await api.call("POST", "/v1/turns", headers=ACME, json={"text": "hi", "session_id": "call-1"})
    assert (status, body["error"]["code"]) == (409, "wrong_session_kind")
    assert "voice session" in body["error"]["message"]
    assert await manager.store.list_session("call-1") == []
    status, body = await api.call("POST", "/v1/turns", headers=GLOBEX, json={"text": "hi", "session_id": "call-1"})
    assert (status, body["error"]["code"]) == (404, "not_found")  # another tenant's: unknown, whatever its kind


async def test_new_message_supersedes_the_running_answer(api: Api) -> None:
    first = await api.start("tell me a story")
    await asyncio.sleep(0.3)
    second = await api.start("what is the weather", session_id=first["session_id"])
    old = await api.wait_terminal(first["turn"]["id"])
    assert old["status"] == "CANCELLED" and old["stop_reason"]["kind"] == "barge_in"
    new = await api.wait_terminal(second["turn"]["id"])
    assert new["status"] == "COMPLETED"
    # nothing of the old generation was delivered after the new one began
    store = api.app[MANAGER].store
    log = await store.read_events(first["session_id"])
    new_started = min(e.seq for e in log if e.turn_id == second["turn"]["id"])
    late_old = [e for e in log if e.seq > new_started and e.generation == old["generation"] and e.type == "agent.delta"]
    assert all(e.fenced for e in late_old)


# -- stop ------------------------------------------------------------------------


async def test_stop_is_idempotent_and_honest(api: Api) -> None:
    tid = (await api.start("tell me a story"))["turn"]["id"]
    await asyncio.sleep(0.2)
    status, body = await api.stop(tid, "stop-1")
    assert status == 202 and body["answer"] == "accepted"
    assert body["turn"]["label"] in ("stopping", "cancelled")  # never "cancelled" before the worker confirms
    if body["turn"]["status"] == "CANCEL_REQUESTED":
        assert body["turn"]["label"] == "stopping"
    again = await api.stop(tid, "stop-1")
    assert again[0] == 202 and again[1]["answer"] == "accepted"
    done = await api.wait_terminal(tid)
    assert done["status"] == "CANCELLED" and done["stop_reason"]["kind"] == "user_cancel"
    assert done["stop_reason"]["request_id"] == "acme:stop-1" and done["stop_reason"]["initiator"] == "api:acme"
    assert done["reply"] and len(done["reply"]) < 500  # the partial reply, not the whole story
    late = await api.stop(tid, "stop-2")
    assert late[0] == 200 and late[1]["answer"] == "already_terminal"
    assert (await api.stop(tid, "stop-1"))[0] == 202  # still its first answer


@pytest.mark.parametrize(
    "key, body, code",
    [
        (None, None, "idempotency_key_required"),
        ("", None, "invalid_idempotency_key"),
        ("has space", None, "invalid_idempotency_key"),
        ("k" * 129, None, "invalid_idempotency_key"),
        ("ok", b"{bad", "bad_json"),
        ("ok", json.dumps({"reason": "barge_in"}).encode(), "invalid_request"),
    ],
)
async def test_bad_stop_requests(api: Api, key: str | None, body: bytes | None, code: str) -> None:
    tid = (await api.start("tell me a story"))["turn"]["id"]
    status, got = await api.stop(tid, key, data=body)
    assert (status, got["error"]["code"]) == (400, code)
    assert (await api.call("GET", f"/v1/turns/{tid}", headers=ACME))[1]["status"] == "RUNNING"
    await api.stop(tid, "cleanup")


async def test_reused_key_with_other_parameters(api: Api) -> None:
    a = (await api.start("tell me a story"))["turn"]["id"]
    b = (await api.start("tell me a story"))["turn"]["id"]
    assert (await api.stop(a, "key-1"))[0] == 202
    status, body = await api.stop(a, "key-1", json={"reason": "safety_abort"})
    assert (status, body["error"]["code"]) == (422, "idempotency_key_reused")
    status, body = await api.stop(b, "key-1")
    assert (status, body["error"]["code"]) == (422, "idempotency_key_reused")
    assert (await api.call("GET", f"/v1/turns/{b}", headers=ACME))[1]["status"] == "RUNNING"
    # keys are per tenant: globex may use the same key on its own turn
    c = (await api.start("tell me a story", headers=GLOBEX))["turn"]["id"]
    assert (await api.stop(c, "key-1", headers=GLOBEX))[0] == 202
    await api.stop(b, "cleanup")


async def test_hundred_concurrent_stops_one_effect(api: Api) -> None:
    started = await api.start("tell me a story")
    tid, sid = started["turn"]["id"], started["session_id"]
    await asyncio.sleep(0.2)
    results = await asyncio.gather(*(api.stop(tid, f"k{i % 9}") for i in range(100)))
    assert {s for s, _ in results} <= {200, 202}
    answers = [b["answer"] for _, b in results]
    assert answers.count("accepted") >= 1
    await api.wait_terminal(tid)
    log = await api.app[MANAGER].store.read_events(sid)
    stopping = [e for e in log if e.type == "turn" and e.payload["status"] == "CANCEL_REQUESTED"]
    cancelled = [e for e in log if e.type == "turn" and e.payload["status"] == "CANCELLED"]
    assert len(stopping) == 1 and len(cancelled) == 1  # one stop, one effect


# -- events ----------------------------------------------------------------------


def is_terminal_turn(m: dict[str, Any]) -> bool:
    return m.get("type") == "turn" and m.get("status") in TERMINAL


async def test_sse_live_then_resume_exactly_the_missing(api: Api) -> None:
    started = await api.start("what is the weather")
    sid = started["session_id"]
    live = await api.sse(f"/v1/sessions/{sid}/events", headers=ACME, until=is_terminal_turn)
    assert live[0]["type"] == "stream.start" and live[0]["resume_token"]
    logged = [m for m in live if "_id" in m]
    seqs = [m["_id"] for m in logged]
    assert seqs == sorted(seqs) and seqs == [m["seq"] for m in logged]
    types = [m["type"] for m in logged]
    assert "transcript" in types and "agent.delta" in types and types[-1] == "turn"
    # resume from the middle with the resume token alone (no bearer: an EventSource)
    cut = seqs[len(seqs) // 2]
    token = live[0]["resume_token"]
    resumed = await api.sse(
        f"/v1/sessions/{sid}/events?after_seq={cut}&resume_token={token}", until=lambda m: m.get("_id") == seqs[-1]
    )
    assert resumed[0]["type"] == "stream.start"
    assert resumed[1]["type"] == "snapshot"  # the authoritative state first
    [snap] = [t for t in resumed[1]["turns"] if t["turn_id"] == started["turn"]["id"]]
    assert snap["status"] == "COMPLETED"
    assert [m["_id"] for m in resumed[2:]] == [s for s in seqs if s > cut]
    # Last-Event-ID works the same
    by_header = await api.sse(
        f"/v1/sessions/{sid}/events", headers={**ACME, "Last-Event-ID": str(cut)}, until=lambda m: m.get("_id") == seqs[-1]
    )
    assert [m["_id"] for m in by_header if "_id" in m] == [s for s in seqs if s > cut]


async def test_sse_bad_credentials(api: Api) -> None:
    a = await api.start("what is the weather")
    b = await api.start("what is the weather")
    g = await api.start("what is the weather", headers=GLOBEX)
    token_a = a["resume_token"]
    cases = [
        (f"/v1/sessions/{a['session_id']}/events?resume_token=garbage", None, 401, "invalid_resume_token"),
        (f"/v1/sessions/{a['session_id']}/events?resume_token={token_a[:-3]}abc", None, 401, "invalid_resume_token"),
        (f"/v1/sessions/{b['session_id']}/events?resume_token={token_a}", None, 403, "forbidden"),
        (f"/v1/sessions/{a['session_id']}/events?resume_token={token_a}", GLOBEX, 403, "forbidden"),
        (f"/v1/sessions/{a['session_id']}/events?resume_token={g['resume_token']}", None, 403, "forbidden"),
        (f"/v1/sessions/{a['session_id']}/events?after_seq=-1", ACME, 400, "invalid_cursor"),
        (f"/v1/sessions/{a['session_id']}/events?after_seq=abc", ACME, 400, "invalid_cursor"),
        ("/v1/sessions/no-such-session/events", ACME, 404, "not_found"),
    ]
    for path, headers, status, code in cases:
        got_status, body = await api.call("GET", path, headers=headers)
        assert (got_status, body["error"]["code"]) == (status, code), path
        assert "what is the weather" not in json.dumps(body)


def test_resume_token_expires() -> None:
    clock = VirtualClock()
    auth = Auth({"t": "acme"}, b"k" * 32, clock, resume_ttl_s=60)
    token = auth.resume_token("acme", "s1")
    grant = auth.check_resume_token(token)
    assert (grant.tenant_id, grant.session_id) == ("acme", "s1")
    other = Auth({}, b"x" * 32, clock, resume_ttl_s=60)
    with pytest.raises(ApiError) as forged:
        other.check_resume_token(token)  # signed with another secret
    assert forged.value.code == "invalid_resume_token"
    asyncio.run(clock.advance(61))
    with pytest.raises(ApiError) as expired:
        auth.check_resume_token(token)
    assert expired.value.code == "resume_token_expired" and expired.value.status == 401


async def test_openapi_describes_the_api(api: Api) -> None:
    status, doc = await api.call("GET", "/v1/openapi.json")
    assert status == 200 and doc["openapi"].startswith("3.1")
    assert {"/v1/turns", "/v1/turns/{turn_id}", "/v1/turns/{turn_id}/stop", "/v1/sessions/{session_id}/events",
            "/v1/events.schema.json", "/v1/telephony/twilio/voice", "/v1/telephony/twilio",
            "/v1/telephony/telnyx"} <= set(doc["paths"])
    assert "Turn" in doc["components"]["schemas"] and "StopReason" in doc["components"]["schemas"]
    stop = doc["paths"]["/v1/turns/{turn_id}/stop"]["post"]["responses"]
    assert {"202", "200", "409", "422", "413"} <= set(stop)
    assert "413" in doc["paths"]["/v1/turns"]["post"]["responses"]


async def test_an_oversized_body_is_413_as_documented(api: Api) -> None:
    """A body over the limit gets the JSON error the document lists, and the
    server goes on serving."""
    big = {"text": "x" * 2_000_000}
    for path in ("/v1/turns", "/v1/turns/nope/stop"):
        status, body = await api.call("POST", path, headers={**ACME, "Idempotency-Key": "k-413"}, json=big)
        assert status == 413 and body["error"]["code"] == "body_too_large", (path, status, body)
    assert (await api.call("GET", "/healthz"))[0] == 200


async def test_events_schema_is_served_and_the_stream_matches_it(api: Api) -> None:
    """GET /v1/events.schema.json (no credentials) is the catalogue's JSON
    Schema, and every message of a live and a resumed SSE stream of a turn
    with a tool call validates against it."""
    async with api.http.get(api.url + "/v1/events.schema.json") as r:
        assert r.status == 200 and r.content_type == "application/schema+json"
        schema = await r.json(content_type=None)
    jsonschema.Draft202012Validator.check_schema(schema)
    assert set(schema["discriminator"]["mapping"]) == set(MODEL_OF)
    started = await api.start("please order a coffee")
    sid = started["session_id"]
    live = await api.sse(f"/v1/sessions/{sid}/events", headers=ACME, until=is_terminal_turn)
    resumed = await api.sse(f"/v1/sessions/{sid}/events?after_seq=1", headers=ACME, until=is_terminal_turn)
    validator = jsonschema.Draft202012Validator(schema)
    messages = [{k: v for k, v in m.items() if k != "_id"} for m in live + resumed]
    for m in messages:
        errors = [e.message for e in validator.iter_errors(m)]
        assert not errors, (m, errors)
    types = {m["type"] for m in messages}
    assert {"stream.start", "snapshot", "turn", "transcript", "agent.delta", "usage", "tool.started", "tool.intent", "tool.done"} <= types
    assert list(validator.iter_errors({**live[0], "after_seq": "0"}))  # and it can say no


async def test_api_off_without_tokens(tmp_path: Path) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db"))
    runner, url = await start_app(app)
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(url + "/v1/turns", headers={"Authorization": "Bearer x"}, json={"text": "hi"}) as r:
                assert r.status == 401 and "TURNKEEPER_API_TOKENS" in (await r.json())["error"]["message"]
    finally:
        await runner.cleanup()


# -- limits and usage --------------------------------------------------------------


async def test_stopped_turn_shows_honest_usage_and_child_reports(api: Api) -> None:
    started = await api.start("tell me a story")
    turn_id = started["turn"]["id"]
    await asyncio.sleep(0.5)  # mid-stream at 40 tokens/s
    status, _ = await api.stop(turn_id, "stop-usage-1")
    assert status == 202
    done = await api.wait_terminal(turn_id)
    assert done["status"] == "CANCELLED"
    usage = done["usage"]
    for field in ("prompt_tokens", "completion_tokens", "completion_tokens_after_stop", "requests_after_stop"):
        assert field in usage
    assert usage["requests_after_stop"] == 0 and usage["model_requests"] == 1
    assert usage["prompt_tokens"] > 0 and usage["completion_tokens"] > 0
    assert usage["records"][0]["partial"] is True
    # the embedded agent runs in this process: its stop is known, and said so
    assert usage["after_stop"] == "confirmed" and usage["records"][0]["after_stop"] == "confirmed"
    assert usage["completion_tokens_after_stop_bound"] == usage["completion_tokens_after_stop"]
    assert usage["records"][0]["max_tokens"] == 1024
    # the usage event a client (and the model span) was told says the same as the record
    events = await api.app[MANAGER].store.read_events(started["session_id"])
    [told] = [e.payload for e in events if e.type == "usage"]
    assert told["after_stop"] == "confirmed", told
    assert told["completion_tokens_after_stop"] == usage["records"][0]["completion_tokens_after_stop"]
    assert done["spent"]["tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
    outcomes = {c["name"]: c["outcome"] for c in done["stop_report"]["children"]}
    assert outcomes["model"] == "stopped" and done["stop_report"]["grace_ms"] == 250


async def test_a_request_budget_tighter_than_the_plan_fails_the_turn(api: Api) -> None:
    # the prompt (about 50 tokens) fits; the story (about 250) does not
    started = await api.start("tell me a story", budget_tokens=200)
    assert started["turn"]["budget"]["tokens"] == 200
    done = await api.wait_terminal(started["turn"]["id"])
    assert done["status"] == "FAILED" and done["stop_reason"]["kind"] == "budget_exceeded"
    assert done["spent"]["tokens"] == 200 and done["usage"]["records"][0]["partial"]
    # a budget that cannot pay for the prompt starts no model request at all
    started = await api.start("tell me a story", budget_tokens=20)
    done = await api.wait_terminal(started["turn"]["id"])
    assert done["status"] == "FAILED" and done["stop_reason"]["kind"] == "budget_exceeded"
    assert done["usage"]["model_requests"] == 0 and done["spent"]["tokens"] == 0


async def test_the_plan_caps_what_a_request_asks(api: Api) -> None:
    started = await api.start("hello", budget_tokens=10_000_000, deadline_ms=3_600_000)
    turn = started["turn"]
    assert turn["budget"]["tokens"] == 100_000  # the default plan's
    assert turn["max_steps"] == 16


async def test_weather_goes_through_the_tool(api: Api) -> None:
    started = await api.start("what is the weather")
    done = await api.wait_terminal(started["turn"]["id"])
    assert done["status"] == "COMPLETED" and "sunny" in done["reply"]
    assert done["usage"]["model_requests"] == 2 and done["step_count"] == 3
    events = await api.sse(
        f"/v1/sessions/{started['session_id']}/events", headers=ACME, until=lambda m: m.get("type") == "agent.done"
    )
    types = [e.get("type") for e in events]
    assert "tool.started" in types and "tool.done" in types and types.count("usage") == 2


async def test_the_turn_shows_its_ledger_and_the_stream_its_tool_events(api: Api) -> None:
    started = await api.start("please order a coffee")
    turn_id = started["turn"]["id"]
    done = await api.wait_terminal(turn_id)
    assert done["status"] == "COMPLETED"
    [row] = done["ledger"]
    assert (row["tool"], row["status"], row["effect"], row["key"]) == ("create_order", "done", "compensate", f"{turn_id}:2")
    assert row["args"] == {"item": "a coffee"} and row["done_at"]
    events = await api.sse(
        f"/v1/sessions/{started['session_id']}/events", headers=ACME, until=lambda m: m.get("type") == "agent.done"
    )
    types = [e.get("type") for e in events]
    assert types.index("tool.intent") < types.index("tool.done") < types.index("agent.done")
