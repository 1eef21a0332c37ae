"""Restart safety: SIGKILL the server mid-turn and start it again; turn
states, generations and event logs are intact (SQLite file; Redis with AOF,
itself killed and restarted too), and the killed text turn is taken over
by the restarted server and finished, never left running."""

from __future__ import annotations

import asyncio
import json
import os
import shutil
import signal
import subprocess
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import free_port
from server_process import Server

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
AUTH = {"Authorization": "Bearer tok-acme-0123456789"}


async def call(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> tuple[int, Any]:
    async with http.request(method, url, headers=AUTH, **kw) as r:
        return r.status, await r.json(content_type=None)


async def read_log(http: aiohttp.ClientSession, url: str, sid: str, token: str, after: int = 0,
                   until_seq: int | None = None, until: Any = None) -> list[dict[str, Any]]:
    """Events of a session via SSE with only the resume token: until seq
    ``until_seq`` or ``until(message)``, or until nothing new came for half a second."""
    out: list[dict[str, Any]] = []
    async with http.get(f"{url}/v1/sessions/{sid}/events?after_seq={after}&resume_token={token}") as r:
        assert r.status == 200, await r.text()
        msg: dict[str, Any] = {}
        while True:
            try:
                raw = await asyncio.wait_for(r.content.readline(), 0.5 if until_seq is None else 10)
            except TimeoutError:
                return out
            line = raw.decode().rstrip("\n")
            if line.startswith("data: "):
                msg = json.loads(line[6:])
            elif line == "" and msg:
                out.append(msg)
                if until_seq is not None and msg.get("seq") == until_seq or until is not None and until(msg):
                    return out
                msg = {}


async def kill_mid_turn_and_restart(server: Server, between: Any = None) -> None:
    async with aiohttp.ClientSession() as http:
        await server.start()
        status, first = await call(http, "POST", server.url + "/v1/turns", json={"text": "what is the weather"})
        assert status == 202
        sid, token = first["session_id"], first["resume_token"]
        done_id = first["turn"]["id"]
        async with asyncio.timeout(20):
            while (await call(http, "GET", f"{server.url}/v1/turns/{done_id}"))[1]["status"] != "COMPLETED":
                await asyncio.sleep(0.05)
        status, body = await call(http, "POST", server.url + "/v1/turns", json={"text": "tell me a story", "session_id": sid})
        tid = body["turn"]["id"]
        deltas = 0

        def some_story(m: dict[str, Any]) -> bool:
            nonlocal deltas
            deltas += m.get("type") == "agent.delta" and m.get("turn_id") == tid
            return deltas >= 10

        before = await read_log(http, server.url, sid, token, until=some_story)  # mid-story
        assert deltas >= 10
        server.kill()
        if between is not None:
            await between()
        await server.start()
        # a text turn is not lost to a crash: the restarted server takes it
        # over (its worker's lease is gone) and runs it on to its end
        async with asyncio.timeout(60):
            while True:
                status, turn = await call(http, "GET", f"{server.url}/v1/turns/{tid}")
                assert status == 200
                if turn["terminal_at"]:
                    break
                await asyncio.sleep(0.1)
        assert turn["status"] == "COMPLETED" and turn["stop_reason"] is None, turn
        assert turn["reply"]
        assert "taken over" in server.log()
        assert (await call(http, "GET", f"{server.url}/v1/turns/{done_id}"))[1]["status"] == "COMPLETED"
        # the log kept everything, in order, went on after the crash, and the same resume token still works
        last = max(e["seq"] for e in before if "seq" in e)

        def completed(m: dict[str, Any]) -> bool:
            return m.get("type") == "turn" and m.get("turn_id") == tid and m.get("status") == "COMPLETED"

        after = await read_log(http, server.url, sid, token, until_seq=10**9, until=completed)
        logged = [e for e in after if "seq" in e]
        assert [e["seq"] for e in logged] == list(range(1, len(logged) + 1))
        assert len(logged) > last and completed(logged[-1])
        # generations go on from where they were
        status, nxt = await call(http, "POST", server.url + "/v1/turns", json={"text": "count to twenty", "session_id": sid})
        assert nxt["turn"]["generation"] == turn["generation"] + 1
        server.stop()


@pytest.fixture
def env(tmp_path: Path) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    e.update(PYTHONPATH=str(ROOT), TURNKEEPER_API_TOKENS="acme:tok-acme-0123456789", TURNKEEPER_LOG_LEVEL="WARNING")
    return e


async def test_sqlite_restart(tmp_path: Path, env: dict[str, str]) -> None:
    server = Server({**env, "TURNKEEPER_STORE": f"sqlite:///{tmp_path}/var/t.db"}, tmp_path)
    try:
        await kill_mid_turn_and_restart(server)
    finally:
        server.stop()


@pytest.fixture
async def own_redis(tmp_path: Path) -> AsyncIterator[dict[str, Any]]:
    exe = shutil.which("redis-server")
    if exe is None:
        pytest.fail("redis-server is not installed (make test installs it)")
    port = free_port()
    data = tmp_path / "redis"
    data.mkdir()
    cmd = [exe, "--port", str(port), "--bind", "127.0.0.1", "--dir", str(data),
           "--appendonly", "yes", "--appendfsync", "always", "--save", ""]
    state: dict[str, Any] = {"url": f"redis://127.0.0.1:{port}/0"}

    async def start() -> None:
        state["proc"] = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for _ in range(100):
            try:
                _, w = await asyncio.open_connection("127.0.0.1", port)
                w.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
        raise RuntimeError("redis did not start")

    async def kill_and_restart() -> None:
        state["proc"].send_signal(signal.SIGKILL)
        state["proc"].wait(10)
        await start()

    await start()
    state["restart"] = kill_and_restart
    yield state
    state["proc"].terminate()
    state["proc"].wait(10)


async def test_redis_restart(tmp_path: Path, env: dict[str, str], own_redis: dict[str, Any]) -> None:
    """Kill the server and Redis itself mid-turn; with AOF nothing is lost.
    The killed turn's lease expires (1 s), so the next start takes it over."""

    async def between() -> None:
        await own_redis["restart"]()
        await asyncio.sleep(1.2)  # longer than the lease TTL

    server = Server({**env, "TURNKEEPER_STORE": own_redis["url"], "TURNKEEPER_LEASE_TTL_S": "1"}, tmp_path)
    try:
        await kill_mid_turn_and_restart(server, between)
    finally:
        server.stop()
