"""Cross-tenant isolation, swept over every route that takes an id.

Tenant B owns a running text turn (and its session), a device and a resume
token. Tenant A calls every route whose path has an ``{id}`` (enumerated
from ``app.router``: a new route with an id fails this test until the
sweep table covers it), plus ``POST /v1/turns`` with a ``session_id`` in
its body, with B's ids and with unknown ids of the same shape. Each
answer must be byte-identical (status, every header but ``Date``, body with
the id replaced): A cannot tell B's ids from ids that do not exist. Then
nothing of B's may have changed (turn still running, device still valid,
no session created), and resume tokens stay bound to their session and
tenant. The medians of other-tenant and unknown-id latencies are printed
(``-s``) and held only to a generous sanity bound: never a timed
assertion that could flake."""

from __future__ import annotations

import asyncio
import statistics
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import start_app

from turn.models import TurnStatus
from turn.store import UnknownSession
from web.app import STORE, create_app
from web.devices.routes import token_hash
from web.settings import Settings

A = {"Authorization": "Bearer tokA"}
B = {"Authorization": "Bearer tokB"}
#: how many requests of each kind the latency comparison sends
TIMED = 50
#: the sanity bound on a median, s (a loaded CI machine is slow, not this slow)
MEDIAN_BOUND_S = 1.0


@dataclass(frozen=True)
class Call:
    """One request of the sweep, with ``{id}`` standing for the id swept."""

    method: str
    path: str
    headers: dict[str, str] = field(default_factory=dict)
    json: dict[str, Any] | None = None


@dataclass
class Answer:
    status: int
    headers: list[tuple[str, str]]
    body: bytes


@dataclass
class Sweep:
    url: str
    http: aiohttp.ClientSession
    requests: int = 0
    leaks: list[str] = field(default_factory=list)

    async def send(self, call: Call, id_: str, *, extra: dict[str, str] | None = None) -> Answer:
        self.requests += 1
        path = call.path.replace("{id}", id_)
        body = None if call.json is None else {k: (id_ if v == "{id}" else v) for k, v in call.json.items()}
        headers = {**call.headers, **(extra or {})}
        async with self.http.request(call.method, self.url + path, headers=headers, json=body) as r:
            try:
                raw = await asyncio.wait_for(r.read(), 3)
            except TimeoutError:  # an event stream: a leak; its start is enough to see it
                raw = b"<still streaming>"
            kept = [(k, v) for k, v in r.headers.items() if k.lower() != "date"]
            return Answer(r.status, kept, raw.replace(id_.encode(), b"{id}"))

    async def compare(self, call: Call, theirs: str, unknown: str, key: str) -> tuple[Answer, Answer]:
        """B's id and an unknown one through ``call``: the same answer, or a leak."""
        extra = {"Idempotency-Key": f"k-{uuid.uuid4().hex}"} if "Idempotency-Key" in call.headers else None
        a = await self.send(call, theirs, extra=extra)
        b = await self.send(call, unknown, extra=extra)
        if (a.status, a.headers, a.body) != (b.status, b.headers, b.body):
            self.leaks.append(f"{key} {call}: other tenant's {a} vs unknown {b}")
        return a, b


def unknown_like(id_: str) -> str:
    """An id of the same shape (length, prefix) that nobody has."""
    prefix = id_[: id_.index("_") + 1] if "_" in id_ else ""
    fresh = (uuid.uuid4().hex * 3)[: len(id_) - len(prefix)]
    return prefix + fresh


def routes_with_ids(app: Any) -> set[tuple[str, str]]:
    """Every (method, path template) of ``app`` whose path has a ``{...}``."""
    out = set()
    for resource in app.router.resources():
        info = resource.get_info()
        template = info.get("formatter") or info.get("path") or ""
        if "{" in template:
            for route in resource:
                out.add((route.method, template))
    return out


async def test_another_tenants_ids_answer_exactly_like_unknown_ones(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    app = create_app(Settings(store=f"sqlite:///{tmp_path}/t.db", api_tokens="tenant_a:tokA,tenant_b:tokB",
                              llm={"tokens_per_second": 1}, demo_shop=False))
    runner, url = await start_app(app)
    store = app[STORE]
    try:
        async with aiohttp.ClientSession() as http:
            sweep = Sweep(url, http)

            async def post(path: str, headers: dict[str, str], **kw: Any) -> dict[str, Any]:
                async with http.post(url + path, headers=headers, **kw) as r:
                    assert r.status in (201, 202), await r.text()
                    return dict(await r.json())

            # tenant B's things; A's own session gives A a resume token of its own
            b_turn = await post("/v1/turns", B, json={"text": "tell me a long story please"})
            b_turn_id, b_session = b_turn["turn"]["id"], b_turn["session_id"]
            b_resume = b_turn["resume_token"]
            b_device = await post("/v1/devices", B)
            a_turn = await post("/v1/turns", A, json={"text": "hello"})
            a_session, a_resume = a_turn["session_id"], a_turn["resume_token"]

            theirs = {"turn_id": b_turn_id, "session_id": b_session, "device_id": b_device["device_id"]}
            key = {"Idempotency-Key": "set per request"}
            # every route with an id in its path, and how it is called (variants)
            table: dict[tuple[str, str], tuple[str, list[Call]]] = {
                ("GET", "/v1/turns/{turn_id}"): ("turn_id", [Call("GET", "/v1/turns/{id}", A)]),
                ("HEAD", "/v1/turns/{turn_id}"): ("turn_id", [Call("HEAD", "/v1/turns/{id}", A)]),
                ("POST", "/v1/turns/{turn_id}/stop"): ("turn_id", [
                    Call("POST", "/v1/turns/{id}/stop", {**A, **key}),
                    Call("POST", "/v1/turns/{id}/stop", {**A, **key}, {"reason": "safety_abort", "detail": "x"}),
                    Call("POST", "/v1/turns/{id}/stop", A),  # no key: refused before the turn is looked up
                ]),
                ("GET", "/v1/sessions/{session_id}/events"): ("session_id", [
                    Call("GET", "/v1/sessions/{id}/events", A),
                    Call("GET", "/v1/sessions/{id}/events?after_seq=0", A),
                    Call("GET", "/v1/sessions/{id}/events", {**A, "Last-Event-ID": "3"}),
                    Call("GET", f"/v1/sessions/{{id}}/events?after_seq=0&resume_token={a_resume}"),
                    Call("GET", f"/v1/sessions/{{id}}/events?after_seq=0&resume_token={a_resume}", A),
                    Call("GET", "/v1/sessions/{id}/events"),  # no credentials at all
                ]),
                ("HEAD", "/v1/sessions/{session_id}/events"): ("session_id", [
                    Call("HEAD", "/v1/sessions/{id}/events", A),
                ]),
                ("DELETE", "/v1/devices/{device_id}"): ("device_id", [Call("DELETE", "/v1/devices/{id}", A)]),
            }
            # ids in a body
            body_ids = {("POST", "/v1/turns", "session_id"): ("session_id", [
                Call("POST", "/v1/turns", A, {"text": "hi", "session_id": "{id}"}),
            ])}

            routes = routes_with_ids(app)
            assert routes - set(table) == set(), "routes with an id the sweep does not cover: add them to the table"
            assert set(table) - routes == set(), "the sweep names routes the app no longer has"

            swept = {**table, **{k[:2]: v for k, v in body_ids.items()}}
            answers: dict[str, Answer] = {}
            for route, (kind, calls) in swept.items():
                for call in calls:
                    a, _ = await sweep.compare(call, theirs[kind], unknown_like(theirs[kind]), str(route))
                    answers[f"{call.method} {call.path} {sorted(call.headers)}"] = a
            assert all(a.status >= 400 for a in answers.values()), answers

            # latency: B's id vs an unknown one, interleaved, on each kind of lookup
            medians: dict[str, tuple[float, float]] = {}
            for name, call, kind in (
                ("GET turn", table[("GET", "/v1/turns/{turn_id}")][1][0], "turn_id"),
                ("POST stop", table[("POST", "/v1/turns/{turn_id}/stop")][1][0], "turn_id"),
                ("GET events", table[("GET", "/v1/sessions/{session_id}/events")][1][0], "session_id"),
                ("DELETE device", table[("DELETE", "/v1/devices/{device_id}")][1][0], "device_id"),
                ("POST turn (body)", body_ids[("POST", "/v1/turns", "session_id")][1][0], "session_id"),
            ):
                times: dict[str, list[float]] = {"theirs": [], "unknown": []}
                for _ in range(TIMED):
                    for who, id_ in (("theirs", theirs[kind]), ("unknown", unknown_like(theirs[kind]))):
                        extra = {"Idempotency-Key": f"t-{uuid.uuid4().hex}"} if "Idempotency-Key" in call.headers else None
                        t0 = time.perf_counter()
                        answer = await sweep.send(call, id_, extra=extra)
                        times[who].append(time.perf_counter() - t0)
                        assert answer.status == 404, (name, who, answer)
                medians[name] = (statistics.median(times["theirs"]), statistics.median(times["unknown"]))

            # resume tokens stay bound to their session and tenant
            async def events(path: str, headers: dict[str, str] | None = None) -> tuple[int, bytes]:
                sweep.requests += 1
                async with http.get(url + path, headers=headers) as r:
                    if r.status == 200:
                        return 200, b""  # a live stream: its status is the answer
                    return r.status, (await r.read())

            refused = []
            b_second = (await post("/v1/turns", B, json={"text": "hello"}))["session_id"]
            for path, headers in (
                (f"/v1/sessions/{b_second}/events?resume_token={b_resume}", None),  # B's token, B's other session
                (f"/v1/sessions/{a_session}/events?resume_token={b_resume}", None),  # B's token, A's session
                (f"/v1/sessions/{unknown_like(b_session)}/events?resume_token={b_resume}", None),
                (f"/v1/sessions/{b_session}/events?resume_token={b_resume}", A),  # A's bearer, B's token
                (f"/v1/sessions/{b_session}/events?resume_token={a_resume}", A),  # A's own token on B's session
                (f"/v1/sessions/{b_session}/events?resume_token={a_resume}", None),
            ):
                status, body = await events(path, headers)
                refused.append((status, body))
            assert {s for s, _ in refused} == {403}, refused
            assert len({b for _, b in refused}) == 1, refused  # one answer, whatever the mismatch
            assert (await events(f"/v1/sessions/{b_session}/events?resume_token={b_resume}"))[0] == 200  # the control

            # nothing of B's was written
            turn = await store.get(b_turn_id)
            assert turn.status is TurnStatus.RUNNING and turn.stop_reason is None, turn
            assert await store.device_by_token(token_hash(b_device["token"])) is not None
            assert [t.id for t in await store.list_session(b_session)] == [b_turn_id]
            for _ in range(3):
                with pytest.raises(UnknownSession):
                    await store.get_session(unknown_like(b_session))
            async with http.delete(f"{url}/v1/devices/{b_device['device_id']}", headers=B) as r:
                assert r.status == 204  # it was B's to revoke, still
            async with http.post(f"{url}/v1/turns/{b_turn_id}/stop", headers={**B, "Idempotency-Key": "end"}) as r:
                assert r.status == 202
    finally:
        await runner.cleanup()

    endpoints = len(swept)
    with capsys.disabled():
        print(f"\ntenant isolation: {endpoints} endpoints, {sweep.requests} requests, {len(sweep.leaks)} leaks")
        for name, (other, unknown) in medians.items():
            print(f"  median {name}: other tenant {other * 1000:.2f} ms, unknown id {unknown * 1000:.2f} ms")
    assert sweep.leaks == [], "\n".join(sweep.leaks)
    for name, (other, unknown) in medians.items():
        assert other < MEDIAN_BOUND_S and unknown < MEDIAN_BOUND_S, (name, other, unknown)

