"""A rolling deploy, as the process sees it: SIGTERM (or ``POST
/v1/admin/drain`` from a preStop hook) drains the server: ``/readyz``
fails at once while ``/healthz`` stays up, new work gets 503
``shutting_down`` with ``Retry-After`` (never a refused connection),
requests for what exists go on, an event stream gets its turn's terminal
event and ``stream.end`` and then a clean end, and the process exits 0. A
second signal exits at once. A text turn still running at
``turn_wait_s`` is released, and the next server on the store finishes it
for a client that resumes its stream there."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from server_process import Server, alive, child_pids

pytestmark = pytest.mark.e2e
TOKEN = "tok-drain-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}


def env(tmp_path: Path, **shutdown: float) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    e.update({
        "TURNKEEPER_STORE": f"sqlite:///{tmp_path}/var/t.db",
        "TURNKEEPER_API_TOKENS": f"default:{TOKEN}",
        "TURNKEEPER_LLM__TOKENS_PER_SECOND": "8",
        "PYTHONPATH": str(Path(__file__).resolve().parents[2]),
    })
    for k, v in shutdown.items():
        e[f"TURNKEEPER_SHUTDOWN__{k.upper()}"] = str(v)
    return e


async def read_stream(http: aiohttp.ClientSession, url: str, out: list[dict[str, Any]]) -> str:
    """Read an SSE stream into ``out`` until it ends; how it ended:
    ``clean`` or the error's name."""
    try:
        async with http.get(url, headers=AUTH, timeout=aiohttp.ClientTimeout(total=60)) as r:
            assert r.status == 200
            async for line in r.content:
                if line.startswith(b"data: "):
                    out.append(json.loads(line[6:]))
        return "clean"
    except aiohttp.ClientError as exc:
        return type(exc).__name__


async def wait_exit(server: Server, timeout: float) -> int:
    assert server.proc is not None
    for _ in range(int(timeout * 20)):
        if (rc := server.proc.poll()) is not None:
            return rc
        await asyncio.sleep(0.05)
    raise AssertionError(f"the server did not exit within {timeout} s:\n{server.log()[-3000:]}")


async def test_sigterm_drains_refuses_new_work_and_ends_streams_cleanly(tmp_path: Path) -> None:
    server = Server(env(tmp_path, lb_delay_s=1.5, turn_wait_s=2, drain_timeout_s=3, grace_s=15), tmp_path)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/v1/turns", json={"text": "tell me a story"}, headers=AUTH) as r:
                assert r.status in (200, 201, 202), await r.text()
                started = await r.json()
            turn_id, session_id = started["turn"]["id"], started["session_id"]
            got: list[dict[str, Any]] = []
            reader = asyncio.ensure_future(read_stream(http, f"{server.url}/v1/sessions/{session_id}/events", got))
            for _ in range(100):
                if any(m.get("type") == "agent.delta" for m in got):
                    break
                await asyncio.sleep(0.05)
            assert server.proc is not None
            workers = child_pids(server.proc.pid)
            assert workers, "the recogniser runs in worker processes"
            t0 = time.monotonic()
            server.proc.send_signal(signal.SIGTERM)
            await asyncio.sleep(0.3)
            async with http.get(f"{server.url}/readyz") as r:
                assert r.status == 503 and (await r.json())["status"] == "draining"
            async with http.get(f"{server.url}/healthz") as r:
                assert r.status == 200  # alive: liveness is not readiness
            async with http.post(f"{server.url}/v1/turns", json={"text": "hello"}, headers=AUTH) as r:
                assert r.status == 503 and r.headers.get("Retry-After")
                assert (await r.json())["error"]["code"] == "shutting_down"
            async with http.post(f"{server.url}/v1/webrtc/offer", json={"type": "offer", "sdp": "v=0"}) as r:
                assert r.status == 503 and (await r.json())["error"]["code"] == "shutting_down"
            async with http.get(f"{server.url}/v1/turns/{turn_id}", headers=AUTH) as r:
                assert r.status == 200  # what exists is still served
            ended = await asyncio.wait_for(reader, 20)
            rc = await wait_exit(server, 20)
            took = time.monotonic() - t0
        log = server.log()
        assert rc == 0, log[-3000:]
        for _ in range(20):  # the server's worker processes end with it, within a second
            if not [pid for pid in workers if alive(pid)]:
                break
            await asyncio.sleep(0.05)
        assert not [pid for pid in workers if alive(pid)], "worker processes outlived the server"
        assert 1.5 <= took < 15, took
        assert ended == "clean", (ended, got[-3:])
        # the story outlived turn_wait_s: released (not stopped), and the stream was told before its end
        turn_events = [m for m in got if m.get("type") == "turn" and m.get("turn_id") == turn_id]
        assert turn_events and turn_events[-1]["status"] == "QUEUED", turn_events
        end = got[-1]
        assert end["type"] == "stream.end" and end["reason"] == "shutting_down"
        for step in ("draining (SIGTERM)", "releasing them for another worker", "event streams send what is logged",
                     "drain done"):
            assert step in log, (step, log[-3000:])
    finally:
        server.stop()
    # the next server on the store takes the turn over; the client resumes its stream there and sees it go on
    again = Server({**env(tmp_path, lb_delay_s=0, turn_wait_s=2, drain_timeout_s=3, grace_s=15),
                    "TURNKEEPER_LLM__TOKENS_PER_SECOND": "100"}, tmp_path)
    await again.start()
    try:
        async with aiohttp.ClientSession() as http:
            resumed: list[dict[str, Any]] = []
            url = f"{again.url}/v1/sessions/{session_id}/events?after_seq={end['last_seq']}"

            async def until_done() -> None:
                async with http.get(url, headers=AUTH) as r:
                    async for line in r.content:
                        if line.startswith(b"data: "):
                            resumed.append(json.loads(line[6:]))
                            m = resumed[-1]
                            if m.get("type") == "turn" and m.get("turn_id") == turn_id and m["status"] == "COMPLETED":
                                return

            await asyncio.wait_for(until_done(), 60)
        statuses = [m["status"] for m in resumed if m.get("type") == "turn" and m.get("turn_id") == turn_id]
        assert statuses[-2:] == ["RUNNING", "COMPLETED"], statuses
        async with aiohttp.ClientSession() as http:
            async with http.get(f"{again.url}/v1/turns/{turn_id}", headers=AUTH) as r:
                turn = await r.json()
        assert turn["status"] == "COMPLETED" and turn["reply"].startswith("Once upon a time")
        assert "resumed 1 released text turns" in again.log()
    finally:
        again.stop()


async def test_a_repeated_drain_is_one_drain_and_a_second_signal_exits_at_once(tmp_path: Path) -> None:
    server = Server(env(tmp_path, lb_delay_s=30, turn_wait_s=1, drain_timeout_s=1, grace_s=60), tmp_path)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            async with http.post(f"{server.url}/v1/admin/drain") as r:  # a preStop hook, from loopback
                assert r.status == 202 and (await r.json())["already"] is False
            async with http.post(f"{server.url}/v1/admin/drain") as r:  # delivered twice
                assert r.status == 202 and (await r.json())["already"] is True
            async with http.get(f"{server.url}/readyz") as r:
                assert r.status == 503
        assert server.proc is not None
        server.proc.send_signal(signal.SIGTERM)  # Kubernetes' SIGTERM after the hook: the drain goes on
        await asyncio.sleep(0.5)
        assert server.proc.poll() is None
        t0 = time.monotonic()
        server.proc.send_signal(signal.SIGTERM)  # again: at once
        workers = child_pids(server.proc.pid)
        rc = await wait_exit(server, 5)
        assert rc == 1 and time.monotonic() - t0 < 3
        for _ in range(30):  # exited at once, without cleanup: its workers notice within a second
            if not [pid for pid in workers if alive(pid)]:
                break
            await asyncio.sleep(0.05)
        assert not [pid for pid in workers if alive(pid)], "worker processes outlived the server"
        assert "again while draining: exiting at once" in server.log()
    finally:
        server.stop()
