"""Chaos: a real server process is signalled or killed at the awkward
moments of a text turn that places an order, and started again on the
same store. After each, exact checks: the turn's states and stop reason,
its event log, and the demo shop's own table (the external system): the
order applied exactly once, never repeated, nothing lost, no turn left
RUNNING.

The awkward moments come from the demo shop's faults (``demo_faults``):
``slow`` holds the order call 5 s before anything is written, ``slow_after``
writes it at once and holds the answer 5 s (accepted by the external
system, its completion not yet recorded by us).
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import uuid
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import free_port
from server_process import Server

from clock import SystemClock
from demo_shop.service import DemoService

pytestmark = pytest.mark.e2e
ROOT = Path(__file__).resolve().parents[2]
TOKEN = "tok-chaos-0123456789"
AUTH = {"Authorization": f"Bearer {TOKEN}"}
ORDER = "please order a coffee"


def env(store: str, **extra: str) -> dict[str, str]:
    e = {k: v for k, v in os.environ.items() if not k.startswith("TURNKEEPER_")}
    e.update(PYTHONPATH=str(ROOT), TURNKEEPER_API_TOKENS=f"default:{TOKEN}", TURNKEEPER_STORE=store,
             TURNKEEPER_LOG_LEVEL="INFO", TURNKEEPER_LEASE_TTL_S="2")
    e.update({f"TURNKEEPER_{k.upper()}": v for k, v in extra.items()})
    return e


async def api(http: aiohttp.ClientSession, method: str, url: str, **kw: Any) -> Any:
    async with http.request(method, url, headers=AUTH, **kw) as r:
        assert r.status < 300, (r.status, await r.text())
        return await r.json()


class Shop:
    """The demo shop's table, read from the test (the server's file)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    async def read(self, what: str, *args: Any) -> Any:
        service = DemoService(SystemClock(), self.path)
        try:
            return await getattr(service, what)(*args)
        finally:
            await service.aclose()

    async def wait_applied(self, prefix: str, timeout_s: float = 15) -> dict[str, Any]:
        async with asyncio.timeout(timeout_s):
            while not (applied := await self.read("applied", prefix)):
                await asyncio.sleep(0.05)
        return applied


async def ordered(http: aiohttp.ClientSession, url: str) -> tuple[str, str]:
    """Start the order turn; (turn id, session id)."""
    started = await api(http, "POST", f"{url}/v1/turns", json={"text": ORDER})
    return started["turn"]["id"], started["session_id"]


async def wait_call_started(http: aiohttp.ClientSession, url: str, turn_id: str) -> None:
    """Until the order call is on its way: its intent is in the ledger,
    pending (the call is sent right after it is written)."""
    async with asyncio.timeout(15):
        while not any(i["tool"] == "create_order" and i["status"] == "pending"
                      for i in (await api(http, "GET", f"{url}/v1/turns/{turn_id}"))["ledger"]):
            await asyncio.sleep(0.05)


async def ended(http: aiohttp.ClientSession, url: str, turn_id: str, timeout_s: float = 30) -> dict[str, Any]:
    async with asyncio.timeout(timeout_s):
        while not (turn := await api(http, "GET", f"{url}/v1/turns/{turn_id}"))["terminal_at"]:
            await asyncio.sleep(0.1)
    return turn  # type: ignore[no-any-return]


async def statuses(http: aiohttp.ClientSession, url: str, session_id: str, turn_id: str) -> list[str]:
    """The turn's status events in its session's log (SSE replay)."""
    out: list[str] = []
    async with http.get(f"{url}/v1/sessions/{session_id}/events?after_seq=0", headers=AUTH) as r:
        assert r.status == 200, await r.text()
        while True:
            try:
                raw = await asyncio.wait_for(r.content.readline(), 1.0)
            except TimeoutError:
                return out
            line = raw.decode()
            if line.startswith("data: "):
                msg = json.loads(line[6:])
                if msg.get("type") == "agent.restart" and msg.get("turn_id") == turn_id:
                    out.append(f"restart:{msg['reason']}")
                if msg.get("type") == "turn" and msg.get("turn_id") == turn_id:
                    out.append(msg["status"])
                    if msg["status"] in ("COMPLETED", "CANCELLED", "FAILED", "RECONCILE_REQUIRED"):
                        return out


async def check_completed_once(http: aiohttp.ClientSession, url: str, shop: Shop, turn_id: str, session_id: str,
                               restart: str) -> dict[str, Any]:
    turn = await ended(http, url, turn_id)
    assert turn["status"] == "COMPLETED", json.dumps(turn, indent=1)
    assert turn["reply"], turn  # what the model made of the step (its result, or the lookup's "done")
    applied = await shop.read("applied", turn_id)
    assert len(applied) == 1, applied  # one order, under one key
    (key,) = applied
    assert await shop.read("times_applied", key) == 1
    assert not applied[key]["reversed"]
    # our ledger says what the shop says: that key done, nothing left open
    ledger = {i["key"]: i for i in turn["ledger"]}
    assert ledger[key]["status"] == "done" and ledger[key]["tool"] == "create_order", ledger
    assert not [i for i in ledger.values() if i["status"] in ("pending", "effect_unknown", "human_required")], ledger
    assert (await api(http, "GET", f"{url}/v1/turns/{turn_id}"))["generation"] == turn["generation"]
    seen = await statuses(http, url, session_id, turn_id)
    assert seen[0] == "QUEUED" and seen[-1] == "COMPLETED" and "RUNNING" in seen, seen
    assert seen.count(f"restart:{restart}") == 1, seen  # clients are told the reply comes again
    return applied


@pytest.mark.parametrize("fault, moment", [
    ("slow", "before the external system wrote anything"),
    ("slow_after", "after the external system applied it, before its answer came back"),
])
async def test_kill_9_mid_order_then_restart_completes_it_with_the_order_applied_once(
    tmp_path: Path, fault: str, moment: str
) -> None:
    store = f"sqlite:///{tmp_path}/var/t.db"
    shop = Shop(tmp_path / "var" / "t.db.demo-service.db")
    server = Server(env(store, demo_faults=f"order:{fault}"), tmp_path)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            turn_id, session_id = await ordered(http, server.url)
            if fault == "slow_after":
                await shop.wait_applied(turn_id)  # the shop has it; our ledger says pending
            else:
                await wait_call_started(http, server.url, turn_id)
                await asyncio.sleep(0.3)
                assert await shop.read("applied", turn_id) == {}
            server.kill()
            server.env = env(store)  # restarted without faults
            await server.start()
            applied = await check_completed_once(http, server.url, shop, turn_id, session_id, "taken_over")
            (key,) = applied
            # present: kept as it was (never sent again); absent: retried with the same key (its
            # first call never landed). The background reconciliation may retry it at the same
            # moment: the shop then answers the second call from the first, applying nothing.
            assert await shop.read("repeats", key) <= (0 if fault == "slow_after" else 1), moment
            assert "taken over" in server.log()
    finally:
        server.stop()


async def test_sigterm_while_the_order_is_unanswered_releases_the_turn_and_the_restart_finishes_it(tmp_path: Path) -> None:
    store = f"sqlite:///{tmp_path}/var/t.db"
    shop = Shop(tmp_path / "var" / "t.db.demo-service.db")
    quick = dict(shutdown__lb_delay_s="0", shutdown__turn_wait_s="0.5", shutdown__drain_timeout_s="1", shutdown__grace_s="10")
    server = Server(env(store, demo_faults="order:slow_after", **quick), tmp_path)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            turn_id, session_id = await ordered(http, server.url)
            await shop.wait_applied(turn_id)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(server.proc.wait, 15) == 0, server.log()[-3000:]
            assert "released for another worker" in server.log()
            server.env = env(store)
            await server.start()
            await check_completed_once(http, server.url, shop, turn_id, session_id, "adopted")
    finally:
        server.stop()


async def test_a_grace_that_runs_out_mid_payment_exits_at_once_and_the_restart_settles_it(tmp_path: Path) -> None:
    """A payment is a must-complete call: the drain waits for it, the grace
    (1 s) runs out first, the process exits 1 at once. The restart finds
    the turn RUNNING with its worker gone, looks the payment up (the shop
    has it) and completes the turn: charged once."""
    store = f"sqlite:///{tmp_path}/var/t.db"
    shop = Shop(tmp_path / "var" / "t.db.demo-service.db")
    tight = dict(shutdown__lb_delay_s="0", shutdown__turn_wait_s="0.2", shutdown__drain_timeout_s="0.5", shutdown__grace_s="1")
    server = Server(env(store, demo_faults="payment:slow_after", **tight), tmp_path)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            started = await api(http, "POST", f"{server.url}/v1/turns", json={"text": "please pay for it"})
            turn_id = started["turn"]["id"]
            await shop.wait_applied(turn_id)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(server.proc.wait, 15) == 1  # exited at once
            assert "exiting at once" in server.log()
            server.env = env(store)
            await server.start()
            turn = await ended(http, server.url, turn_id)
            assert turn["status"] == "COMPLETED", json.dumps(turn, indent=1)
            applied = await shop.read("applied", turn_id)
            assert len(applied) == 1 and await shop.read("repeats", next(iter(applied))) == 0, applied
            (row,) = [i for i in turn["ledger"] if i["tool"] == "charge_payment"]
            assert row["status"] == "done" and row["key"] in applied, row
    finally:
        server.stop()


async def test_kill_9_of_one_of_two_instances_the_other_takes_its_turn_over_within_the_lease(
    redis_url: str, tmp_path: Path
) -> None:
    prefix = f"chaos{uuid.uuid4().hex[:8]}"
    shop_db = tmp_path / "shop.db"
    common = dict(redis_prefix=prefix, demo_service_db=str(shop_db))
    a = Server(env(redis_url, demo_faults="order:slow_after", **common), tmp_path)
    b = Server(env(redis_url, **common), tmp_path)
    await a.start()
    await b.start()
    shop = Shop(shop_db)
    try:
        async with aiohttp.ClientSession() as http:
            turn_id, session_id = await ordered(http, a.url)
            await shop.wait_applied(turn_id)
            a.kill()
            killed = asyncio.get_running_loop().time()
            turn = await ended(http, b.url, turn_id, timeout_s=20)
            took_s = asyncio.get_running_loop().time() - killed
            assert turn["status"] == "COMPLETED", json.dumps(turn, indent=1)
            assert "taken over" in b.log()
            # the lease (2 s) expires, and B's sweep (every 2 s) notices: at most
            # two TTLs, plus the answer's own time (a sanity bound)
            assert took_s < 2 * 2 + 5, took_s
            applied = await shop.read("applied", turn_id)
            assert len(applied) == 1 and await shop.read("repeats", next(iter(applied))) == 0, applied
            (row,) = [i for i in turn["ledger"] if i["tool"] == "create_order"]
            assert row["status"] == "done" and row["key"] in applied, row
    finally:
        a.stop()
        b.stop()


async def wait_reversal_started(http: aiohttp.ClientSession, url: str, turn_id: str) -> dict[str, Any]:
    """Until the stop's reversal of the order is on its way: its
    compensation row is in the ledger, open. Returns the turn."""
    async with asyncio.timeout(15):
        while True:
            turn = await api(http, "GET", f"{url}/v1/turns/{turn_id}")
            if any(i["kind"] == "compensation" and i["status"] == "pending" for i in turn["ledger"]):
                return turn  # type: ignore[no-any-return]
            await asyncio.sleep(0.05)


async def test_sigterm_during_a_compensation_reverses_the_order_once(tmp_path: Path) -> None:
    """A user stops the turn while its order is unanswered (the shop has
    it): the stop reverses it, and the reversal takes 5 s (``reverse:slow``),
    longer than a stop may wait for it. SIGTERM comes during the reversal.
    The drain does not cut the stop: it waits while the stop settles, which
    writes RECONCILE_REQUIRED (the reversal not yet confirmed) and leaves
    the reversal to reconciliation as a job; then exit 0. The exit cuts the
    slow attempt; the job's next attempt (before the exit, or after the
    restart) reverses the order, once, and nothing is left open."""
    store = f"sqlite:///{tmp_path}/var/t.db"
    shop = Shop(tmp_path / "var" / "t.db.demo-service.db")
    timing = dict(shutdown__lb_delay_s="0", shutdown__turn_wait_s="0.2", shutdown__drain_timeout_s="0.5",
                  shutdown__grace_s="10")
    server = Server(env(store, demo_faults="order:slow_after,reverse:slow", **timing), tmp_path)
    await server.start()
    try:
        async with aiohttp.ClientSession() as http:
            turn_id, session_id = await ordered(http, server.url)
            (key,) = await shop.wait_applied(turn_id)
            async with http.post(f"{server.url}/v1/turns/{turn_id}/stop", headers={**AUTH, "Idempotency-Key": "stop-1"},
                                 json={"reason": "user_cancel"}) as r:
                assert r.status == 202, await r.text()
            await wait_reversal_started(http, server.url, turn_id)
            assert server.proc is not None
            server.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(server.proc.wait, 20) == 0, server.log()[-3000:]
            assert "their stops are being settled; waiting for them" in server.log()
            server.env = env(store)
            await server.start()
            turn = await ended(http, server.url, turn_id)
            assert turn["status"] == "RECONCILE_REQUIRED", json.dumps(turn, indent=1)  # written before the exit
            assert turn["stop_reason"]["kind"] == "user_cancel"
            async with asyncio.timeout(30):  # the job's next attempt, on the restarted server
                while await shop.read("times_reversed", key) == 0:
                    await asyncio.sleep(0.1)
            async with asyncio.timeout(15):
                while True:
                    turn = await api(http, "GET", f"{server.url}/v1/turns/{turn_id}")
                    if not [i for i in turn["ledger"] if i["status"] in ("pending", "retrying", "effect_unknown", "human_required")]:
                        break
                    await asyncio.sleep(0.1)
            assert await shop.read("times_applied", key) == 1 and await shop.read("times_reversed", key) == 1
            ledger = {i["key"]: i for i in turn["ledger"]}
            assert ledger[key]["status"] == "compensated", ledger
            assert turn["status"] == "RECONCILE_REQUIRED"  # one terminal state, never rewritten
            seen = await statuses(http, server.url, session_id, turn_id)
            assert seen == ["QUEUED", "RUNNING", "CANCEL_REQUESTED", "RECONCILE_REQUIRED"], seen
    finally:
        server.stop()


async def test_the_store_unreachable_during_the_drain_exits_within_the_grace_and_no_turn_is_lost(tmp_path: Path) -> None:
    """The server's Redis stops answering (SIGSTOP: its connections hang,
    the nastiest way to be unreachable) just as a drain begins, with a text
    turn mid-order. The drain cannot release the turn nor close the store:
    the process exits 1 when ``shutdown.grace_s`` runs out, never hangs.
    Redis comes back; the next instance takes the turn over (its lease
    expired) and completes it, the order applied once."""
    port = free_port()
    redis = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                              "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    url = f"redis://127.0.0.1:{port}/0"
    shop_db = tmp_path / "shop.db"
    common = dict(redis_prefix="unreachable", demo_service_db=str(shop_db))
    timing = dict(shutdown__lb_delay_s="0", shutdown__turn_wait_s="0.2", shutdown__drain_timeout_s="0.5", shutdown__grace_s="3")
    shop = Shop(shop_db)
    server: Server | None = None
    try:
        await wait_redis(port)
        server = Server(env(url, demo_faults="order:slow_after", **common, **timing), tmp_path)
        await server.start()
        async with aiohttp.ClientSession() as http:
            turn_id, session_id = await ordered(http, server.url)
            await shop.wait_applied(turn_id)
            redis.send_signal(signal.SIGSTOP)
            assert server.proc is not None
            stopped_at = asyncio.get_running_loop().time()
            server.proc.send_signal(signal.SIGTERM)
            assert await asyncio.to_thread(server.proc.wait, 20) == 1, server.log()[-3000:]
            took_s = asyncio.get_running_loop().time() - stopped_at
            assert took_s < 3 + 3, took_s  # the grace, and a sanity margin
            assert "exiting at once" in server.log()
            redis.send_signal(signal.SIGCONT)
            server.env = env(url, **common)
            await server.start()
            turn = await ended(http, server.url, turn_id, timeout_s=30)
            assert turn["status"] == "COMPLETED", json.dumps(turn, indent=1)
            applied = await shop.read("applied", turn_id)
            assert len(applied) == 1 and await shop.read("repeats", next(iter(applied))) == 0, applied
            (row,) = [i for i in turn["ledger"] if i["tool"] == "create_order"]
            assert row["status"] == "done" and row["key"] in applied, row
            seen = await statuses(http, server.url, session_id, turn_id)
            assert seen[0] == "QUEUED" and seen[-1] == "COMPLETED", seen
    finally:
        if server is not None:
            server.stop()
        redis.send_signal(signal.SIGCONT)
        redis.kill()
        redis.wait(10)


async def wait_redis(port: int) -> None:
    async with asyncio.timeout(10):
        while True:
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                return
            except OSError:
                await asyncio.sleep(0.05)
