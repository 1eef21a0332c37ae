"""A voice call started the production way, end to end over WebRTC: the
backend mints a client token (``POST /v1/sessions``) with instructions and
narrower limits, the client presents it with the offer, and the tenant's
plan, narrowed by the token, governs the voice turn exactly as a text turn;
the instructions are what the model is actually sent first."""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from conftest import plain, requires_espeak, start_app

from client.call import CallClient
from client.results import Utterance
from clock import Clock, SystemClock
from media.frames import PLAYOUT_RATE, load_pcm
from turn.models import TurnStatus
from voice.providers import LanguageModel, Message
from web.app import STORE, EmbeddedProviders, create_app
from web.settings import Settings

pytestmark = [pytest.mark.e2e, requires_espeak]
TOKEN_A, TOKEN_B = "tok-acme-0123456789", "tok-globex-0123456789"


class RecordingModel:
    """The embedded agent, with every request's messages kept."""

    def __init__(self, inner: LanguageModel, sent: list[list[Message]]) -> None:
        self.inner, self.sent = inner, sent

    def __getattr__(self, name: str) -> Any:
        return getattr(self.inner, name)

    def stream(self, messages: list[Message], **kw: Any) -> Any:
        self.sent.append(list(messages))
        return self.inner.stream(messages, **kw)


class RecordingProviders(EmbeddedProviders):
    def __init__(self, settings: Settings, clock: Clock) -> None:
        super().__init__(settings, clock)
        self.sent: list[list[Message]] = []

    def llm_for_session(self) -> LanguageModel:
        return RecordingModel(super().llm_for_session(), self.sent)  # type: ignore[return-value]


@pytest.fixture
async def server(tmp_path: Path) -> AsyncIterator[tuple[Any, str, RecordingProviders]]:
    settings = Settings(
        store=f"sqlite:///{tmp_path}/t.db",
        api_tokens=f"acme:{TOKEN_A},globex:{TOKEN_B}",
        plans={"acme": {"deadline_s": 120, "budget_tokens": 5000, "budget_cents": 50, "max_steps": 6}},
    )
    clock = SystemClock()
    providers = RecordingProviders(settings, clock)
    app = create_app(settings, clock=clock, providers=providers)
    runner, url = await start_app(app)
    yield app, url, providers
    await runner.cleanup()


async def test_a_client_token_call_runs_under_its_tenant_plan_and_instructions(
    server: tuple[Any, str, RecordingProviders], say: Callable[..., Path]
) -> None:
    app, url, providers = server
    async with aiohttp.ClientSession() as http:
        async with http.post(f"{url}/v1/sessions", headers={"Authorization": f"Bearer {TOKEN_A}"}, json={
            "user_id": "u-1", "instructions": "You are the Acme helpdesk. Answer briefly.",
            "plan": {"budget_tokens": 400, "max_steps": 3, "deadline_s": 600},
        }) as r:
            minted = await r.json()
            assert r.status == 201, minted
    opening = Utterance(pcm=load_pcm(say("what is the weather like today"), PLAYOUT_RATE), label="weather")
    result = await CallClient(url, token=minted["client_token"]).run(opening, timeout_s=60)
    assert not result.timed_out and result.session_id == minted["session_id"]
    [turn] = await app[STORE].list_session(minted["session_id"])
    assert turn.status is TurnStatus.COMPLETED and turn.tenant_id == "acme"
    # the tenant's plan, narrowed by the token: tokens and steps tighter, the deadline not widened
    assert turn.budget.tokens == 400 and turn.budget.cents == 50 and turn.max_steps == 3
    assert turn.deadline_at is not None
    assert 110 <= (turn.deadline_at - turn.created_at).total_seconds() <= 121
    # what the model was actually sent: the instructions first, then the user
    assert providers.sent, "no model request"
    first = providers.sent[0]
    assert first[0].role == "system" and first[0].content == "You are the Acme helpdesk. Answer briefly."
    assert first[-1].role == "user" and plain(first[-1].content) == "what is the weather like today"
    # the token is used: a second call with it is refused
    again = CallClient(url, token=minted["client_token"])
    with pytest.raises(Exception, match="invalid_client_token"):
        await again.run(opening, timeout_s=20)


async def test_a_backend_token_call_gets_its_own_tenant_plan_and_no_instructions(
    server: tuple[Any, str, RecordingProviders], say: Callable[..., Path]
) -> None:
    """``CallClient(token=<API token>)`` mints a token for each offer, as
    a backend would; globex has no plan of its own: the default one."""
    app, url, providers = server
    opening = Utterance(pcm=load_pcm(say("what is the weather like today"), PLAYOUT_RATE), label="weather")
    result = await CallClient(url, token=TOKEN_B).run(opening, timeout_s=60)
    assert not result.timed_out
    # one turn, or two where a loaded machine ended the utterance inside it
    # (the split is the end-of-turn's business; here: whose turns they are)
    turns = await app[STORE].list_session(result.session_id)
    default = Settings().plan_for("globex")
    assert 1 <= len(turns) <= 2
    for turn in turns:
        assert turn.tenant_id == "globex" and turn.max_steps == default.max_steps
        assert turn.budget.tokens == default.budget_tokens
    assert all(m.role != "system" for m in providers.sent[0])
