"""The demo_shop setting: on (the default) the server runs the demo shop's
tools, their external system and its message sender; off, it registers no
demo tool, starts no demo worker and never opens the shop's file."""

from __future__ import annotations

import asyncio
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import start_app

from voice.llm import WEATHER_REPLY
from web.app import PROVIDERS, create_app
from web.settings import Settings, load_settings
from web.state import WORKERS

TOKEN = {"Authorization": "Bearer tok-acme-0123456789"}


async def _turn(http: aiohttp.ClientSession, url: str, text: str) -> dict[str, Any]:
    async with http.post(f"{url}/v1/turns", headers=TOKEN, json={"text": text}) as r:
        assert r.status == 202, await r.text()
        turn_id = (await r.json())["turn"]["id"]
    async with asyncio.timeout(20):
        while True:
            async with http.get(f"{url}/v1/turns/{turn_id}", headers=TOKEN) as r:
                body = await r.json()
            if body["status"] in ("COMPLETED", "FAILED", "CANCELLED", "RECONCILE_REQUIRED"):
                return body
            await asyncio.sleep(0.05)


def test_it_is_on_by_default_and_the_environment_turns_it_off(monkeypatch: pytest.MonkeyPatch) -> None:
    assert load_settings().demo_shop is True
    monkeypatch.setenv("TURNKEEPER_DEMO_SHOP", "false")
    assert load_settings().demo_shop is False


@pytest.mark.parametrize("on", [True, False])
async def test_the_server_with_and_without_the_demo_shop(tmp_path: Path, on: bool) -> None:
    shop_db = tmp_path / "shop.db"
    settings = Settings(
        store=f"sqlite:///{tmp_path}/t.db", api_tokens="acme:tok-acme-0123456789", demo_shop=on,
        demo_service_db=str(shop_db), llm={"tokens_per_second": 200}, stt={"max_decoders": 1},
    )
    app = create_app(settings)
    runner, url = await start_app(app)
    try:
        workers = {t.get_name() for t in app[WORKERS]}
        tools = {s.name for s in app[PROVIDERS].tools().specs()}
        async with aiohttp.ClientSession() as http:
            order = await _turn(http, url, "please order a coffee")
            weather = await _turn(http, url, "what is the weather like today")
        if on:
            assert "message-sender" in workers
            assert tools == {"lookup_weather", "create_order", "charge_payment", "send_messages"}
            assert order["status"] == "COMPLETED" and [r["tool"] for r in order["ledger"]] == ["create_order"]
            assert [r["tool"] for r in weather["ledger"]] == ["lookup_weather"]
            assert shop_db.is_file()
        else:
            assert "message-sender" not in workers and {"reconciliation", "lease-sweeper"} <= workers
            assert tools == set() and app[PROVIDERS].shop is None
            assert order["status"] == "COMPLETED" and order["ledger"] == []  # no tool: the agent just answers
            assert order["reply"] == "You said: please order a coffee."
            assert weather["ledger"] == []
            assert not shop_db.exists()
        assert weather["status"] == "COMPLETED" and weather["reply"] == WEATHER_REPLY  # the same words either way
    finally:
        await runner.cleanup()
    assert all(t.done() for t in app[WORKERS])
