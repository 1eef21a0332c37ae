"""The local agent's replies and pace, and sentence splitting."""

from __future__ import annotations

import asyncio
import contextlib

import pytest

from clock import VirtualClock
from turn.usage import UsageMeter
from voice.llm import (
    COUNT_REPLY,
    STORY_REPLY,
    WEATHER_REPLY,
    LocalAgent,
    LocalLlmConfig,
    choose_reply,
    prompt_tokens,
    tokenize,
)
from voice.providers import Message
from voice.text import SentenceSplitter
from voice.tools import ToolSpec


def test_replies_by_intent() -> None:
    assert choose_reply("what is the weather like today") == WEATHER_REPLY
    assert choose_reply("please tell me a story") == STORY_REPLY
    assert choose_reply("count to twenty") == COUNT_REPLY
    assert COUNT_REPLY.startswith("One, two, three,") and COUNT_REPLY.endswith("twenty.")
    assert choose_reply("front center") == "You said: front center."
    assert choose_reply("   ") == "Sorry, I did not catch that."
    assert len(tokenize(STORY_REPLY)) > 200  # long enough to interrupt at leisure


def test_tokenize_keeps_text() -> None:
    toks = tokenize("Hello, big  world.")
    assert toks == ["Hello, ", "big  ", "world."]
    assert "".join(toks) == "Hello, big  world."


async def test_stream_paced_on_clock(clock: VirtualClock) -> None:
    agent = LocalAgent(LocalLlmConfig(tokens_per_second=20), clock)
    got: list[str] = []

    async def consume() -> None:
        async for tok in agent.stream([Message(role="user", content="what is the weather")]):
            got.append(tok)

    task = asyncio.create_task(consume())
    await clock.advance(0.049)
    assert got == []
    await clock.advance(0.002)
    assert len(got) == 1  # one token each 50 ms
    await clock.advance(0.5)
    assert len(got) == 11
    await clock.advance(100)
    await task
    assert "".join(got) == WEATHER_REPLY


async def test_stream_cancel_mid_way(clock: VirtualClock) -> None:
    agent = LocalAgent(LocalLlmConfig(tokens_per_second=10), clock)
    got: list[str] = []

    async def consume() -> None:
        async with contextlib.aclosing(agent.stream([Message(role="user", content="tell me a story")])) as s:
            async for tok in s:
                got.append(tok)

    task = asyncio.create_task(consume())
    await clock.advance(0.35)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    n = len(got)
    await clock.advance(10)
    assert len(got) == n == 3 and agent.tokens_streamed == 3


async def test_stream_answers_last_user_message(clock: VirtualClock) -> None:
    agent = LocalAgent(LocalLlmConfig(tokens_per_second=1000), clock)
    history = [
        Message(role="user", content="tell me a story"),
        Message(role="assistant", content="Once upon", interrupted=True),
        Message(role="user", content="count to twenty"),
    ]
    task = asyncio.create_task(_collect(agent, history))
    await clock.advance(10)
    assert await task == COUNT_REPLY
    with pytest.raises(ValueError):
        await _collect(agent, [Message(role="system", content="hi")])


async def _collect(agent: LocalAgent, messages: list[Message]) -> str:
    return "".join([t async for t in agent.stream(messages)])


def test_splitter_sentences_and_clauses() -> None:
    sp = SentenceSplitter(min_clause_words=4)
    out: list[str] = []
    for tok in tokenize("Hi there. How are you? Fine, a long clause goes on here, and on. End"):
        out += sp.feed(tok)
    assert out[:2] == ["Hi there.", "How are you?"]
    assert "Fine, a long clause goes on here," in out
    assert sp.flush() == "End"
    assert sp.flush() is None


def test_splitter_short_clause_waits() -> None:
    sp = SentenceSplitter(min_clause_words=8)
    out: list[str] = []
    for tok in tokenize("Yes, sure. "):
        out += sp.feed(tok)
    assert out == ["Yes, sure."]


async def test_a_cut_off_local_request_bills_its_own_prompt_count_not_the_callers_estimate() -> None:
    """Found by review: a resumed turn's cut-off call was billed the
    caller's estimate (the tool specs' JSON: about 5 times the local
    agent's own count), which failed a tight budget."""
    clock = VirtualClock()
    agent = LocalAgent(LocalLlmConfig(tokens_per_second=10), clock)
    tools = [ToolSpec(name="create_order", description="Place an order for an item in the shop.",
                      parameters={"type": "object", "properties": {"item": {"type": "string"}}})]
    messages = [Message(role="user", content="tell me a story")]
    req = UsageMeter().start_request(10_000)  # a wild estimate
    stream = agent.stream(messages, tools=tools, meter=req)
    task = asyncio.ensure_future(anext(stream))
    await clock.advance(0.35)
    await task
    await stream.aclose()  # cut off after a few tokens
    rec = req.record()
    assert rec.partial and rec.prompt_tokens == prompt_tokens(messages, tools)
