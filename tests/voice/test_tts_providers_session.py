"""A voice session speaking through each speech provider's local fake
(testkit/: its wire protocol, its voice espeak-ng word by word): a barge-in
tells the provider to stop, nothing of the old generation leaves after the
fence, the history keeps the words the caller heard (from the provider's
own timings where it gives them); a provider that refuses the key or
drops hands the reply to espeak-ng, and with no fallback the reply ends
with an error and nothing unheard in the history."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import pytest
from aiohttp import web
from conftest import requires_espeak
from pydantic import SecretStr
from test_agent_session import Harness, pcm48

from testkit.tts_backend import TtsBackend
from turn.models import StopReasonKind, TurnStatus
from turn.sqlite_store import SqliteStore
from voice.synthesisers import TtsConfig, build_synthesiser, check_key
from voice.text import SentenceSplitter
from voice.tts import EspeakSynthesiser

pytestmark = requires_espeak

KEY = "test-key"


def make_fake(provider: str, backend: TtsBackend, **options: Any) -> tuple[Any, web.Application, str, str]:
    """(the fake, its app, base URL scheme, path suffix)."""
    if provider == "openai":
        from testkit.fake_openai_speech import FakeOpenAiSpeech, FakeSpeechOptions

        f: Any = FakeOpenAiSpeech(backend, FakeSpeechOptions(api_key=KEY, **options))
        return f, f.app(), "http", "/v1"
    if provider == "elevenlabs":
        from testkit.fake_elevenlabs import FakeElevenLabs, FakeElevenLabsOptions

        f = FakeElevenLabs(backend, FakeElevenLabsOptions(api_key=KEY, **options))
    elif provider == "cartesia":
        from testkit.fake_cartesia import FakeCartesia, FakeCartesiaOptions

        f = FakeCartesia(backend, FakeCartesiaOptions(api_key=KEY, **options))
    else:
        from testkit.fake_deepgram_speak import FakeDeepgramSpeak, FakeSpeakOptions

        f = FakeDeepgramSpeak(backend, FakeSpeakOptions(api_key=KEY, **options))
    return f, f.app(), "ws", ""


@asynccontextmanager
async def serving(provider: str, **options: Any) -> AsyncIterator[tuple[Any, TtsConfig]]:
    """The provider's fake on a loopback port and the settings that use it."""
    backend = TtsBackend()
    fake, app, scheme, suffix = make_fake(provider, backend, **options)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
    config = TtsConfig(
        provider=provider, base_url=f"{scheme}://127.0.0.1:{port}{suffix}", api_key=SecretStr(KEY),
        voice="alloy" if provider == "openai" else "test-voice",
    )
    try:
        yield fake, config
    finally:
        await runner.cleanup()


def use(h: Harness, config: TtsConfig, *, fallback: bool = True) -> None:
    """Speak the session's replies through ``config``'s provider."""
    h.session.tts.primary = build_synthesiser(config)
    h.session.tts.name = config.provider
    h.session.tts.fallback = EspeakSynthesiser() if fallback else None


async def words_within(reply: str, played_s: float) -> int:
    """How many words of ``reply`` end within ``played_s`` of its audio, each
    clause rendered as the fakes render it (the truth the caller heard)."""
    backend = TtsBackend()
    splitter = SentenceSplitter()
    clauses = [c for c in [*splitter.feed(reply), splitter.flush() or ""] if c.strip()]
    offset, n = 0.0, 0
    for clause in clauses:
        r = await backend.render(clause, 24_000)
        n += sum(1 for _, _, end in r.words if offset + end <= played_s)
        offset += r.seconds
    return n


@pytest.mark.parametrize("provider", ["elevenlabs", "cartesia", "openai", "deepgram"])
async def test_a_barge_in_stops_the_provider_and_keeps_what_was_heard(
    provider: str, store: SqliteStore, say: Callable[..., Path]
) -> None:
    async with serving(provider) as (fake, config):
        h = Harness(store)
        use(h, config)
        await h.start()
        try:
            h.mic.say(pcm48(say("tell me a story")))
            await h.wait_for(lambda: 1 in h.track.audit.per_generation and h.track.audit.per_generation[1].frames > 60, 30)
            h.mic.say(pcm48(say("what is the weather like today")))
            await h.wait_for(lambda: any(e["type"] == "barge_in" for e in h.events))
            fenced_at = h.fence.fenced_at(1)
            await h.wait_for(lambda: sum(e.get("status") == "COMPLETED" for e in h.turn_events()) == 1, timeout=40)
        finally:
            await h.stop()
        old, new = await store.list_session("sess-1")
        assert old.status is TurnStatus.CANCELLED and old.stop_reason is not None
        assert old.stop_reason.kind is StopReasonKind.BARGE_IN
        assert new.status is TurnStatus.COMPLETED
        # nothing of generation 1 left the server after the fence
        last_old = h.track.audit.per_generation[1].last_sent_at
        assert fenced_at is not None and last_old is not None and last_old <= fenced_at
        # the provider spoke the replies, and was told to stop the old one at once
        [record] = old.usage.synthesis
        assert record.provider == provider and record.characters > 0 and record.characters_after_stop == 0
        [usage] = [e for e in h.events if e["type"] == "tts.usage" and e["turn_id"] == old.id]
        if usage["characters_unspoken_at_stop"]:
            assert usage["stop_told_ms"] is not None and usage["stop_told_ms"] < 1000, str(usage)  # a sanity bound
            # the turn's record says whether the provider acknowledged the stop
            # (Deepgram's Cleared, awaited after the terminal write; the HTTP
            # socket closed); the others have no acknowledgement in their protocol
            assert record.after_stop == ("confirmed" if provider in ("deepgram", "openai") else "unconfirmed")
        assert [r.provider for r in new.usage.synthesis] == [provider]
        assert not [e for e in h.events if e["type"] == "tts.failover"]
        # the history holds what the caller heard, to within a word of the truth
        [told] = [e for e in h.events if e["type"] == "agent.interrupted" and e["turn_id"] == old.id]
        reply = "".join(e["text"] for e in h.events if e["type"] == "agent.delta" and e["turn_id"] == old.id)
        truth = await words_within(reply, told["played_ms"] / 1000)
        assert abs(len(told["heard"].split()) - truth) <= 1, (told, truth)
        assistant = [m for m in await h.session.history() if m.role == "assistant"]
        assert assistant[0].interrupted and assistant[0].content == told["heard"]


async def test_a_refused_key_hands_the_reply_to_espeak(store: SqliteStore, say: Callable[..., Path]) -> None:
    async with serving("cartesia", faulty_connections=None) as (fake, config):
        config = config.model_copy(update={"api_key": SecretStr("wrong")})
        assert (await check_key(config) or "").startswith("tts.api_key: refused by cartesia")
        h = Harness(store)
        use(h, config)
        await h.start()
        try:
            h.mic.say(pcm48(say("what is the weather like today")))
            await h.wait_for(lambda: any(e.get("status") == "COMPLETED" for e in h.turn_events()), timeout=40)
        finally:
            await h.stop()
        [turn] = await store.list_session("sess-1")
        assert "sunny" in (turn.reply or "")
        [failover] = [e for e in h.events if e["type"] == "tts.failover"]
        assert (failover["provider"], failover["error"], failover["action"], failover["fallback"]) == (
            "cartesia", "unauthorized", "fallback", "espeak-ng")
        assert [(r.provider, r.characters) for r in turn.usage.synthesis][0] == ("cartesia", 0)  # refused: nothing billed
        assert [r.provider for r in turn.usage.synthesis] == ["cartesia", "espeak-ng"]
        assert h.track.audit.per_generation[1].frames > 50  # the caller heard the reply


async def test_with_no_fallback_a_dropped_provider_ends_the_reply_honestly(
    store: SqliteStore, say: Callable[..., Path]
) -> None:
    async with serving("elevenlabs", faulty_connections=None, drop_after_chunks=3) as (fake, config):
        h = Harness(store)
        use(h, config, fallback=False)
        await h.start()
        try:
            h.mic.say(pcm48(say("tell me a story")))
            await h.wait_for(lambda: any(e.get("status") == "FAILED" for e in h.turn_events()), timeout=40)
        finally:
            await h.stop()
        [turn] = await store.list_session("sess-1")
        assert turn.status is TurnStatus.FAILED and "SynthesisError" in (turn.error or "")
        assert [e["action"] for e in h.events if e["type"] == "tts.failover"] == ["reconnect", "failed"]
        assert any(e["type"] == "error" for e in h.events)
        # the reply's audio stopped with the failure; what was played is kept
        # as the reply (and told), the rest as unheard
        [told] = [e for e in h.events if e["type"] == "agent.interrupted" and e["turn_id"] == turn.id]
        assert (turn.reply or "") == told["heard"] and turn.reply_unheard
        played = h.track.audit.per_generation[1]
        assert abs(played.frames * 20 - told["played_ms"]) < 200


async def test_check_key_names_the_setting_when_the_provider_is_not_there() -> None:
    config = TtsConfig(provider="deepgram", base_url="ws://127.0.0.1:9", api_key=SecretStr(KEY), connect_timeout_s=1)
    line = await check_key(config)
    assert line is not None and line.startswith("tts.base_url: deepgram could not be reached") and "espeak-ng" in line
    async with serving("openai") as (_fake, good):
        assert await check_key(good) is None
    assert await check_key(TtsConfig()) is None
    await asyncio.sleep(0)
