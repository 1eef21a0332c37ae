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
    """After the first piece, a short clause stays with its sentence."""
    sp = SentenceSplitter(min_clause_words=8)
    out: list[str] = []
    for tok in tokenize("Right. Yes, sure. "):
        out += sp.feed(tok)
    assert out == ["Right.", "Yes, sure."]


def _cut(text: str, **kw: int) -> list[str]:
    sp = SentenceSplitter(**kw)
    out: list[str] = []
    for tok in tokenize(text):
        out += sp.feed(tok)
    rest = sp.flush()
    return out + ([rest] if rest else [])


def test_the_first_clause_goes_first() -> None:
    """Issue 31 item 3: the first piece is cut at the first clause boundary
    the model produces (comma, semicolon, colon, dash), the moment the
    boundary's token arrives; the pieces after it follow the sentence rules."""
    assert _cut("You said: order a large coffee.") == ["You said:", "order a large coffee."]
    assert _cut("Yes, sure. Anything else, or is that all for today?") == ["Yes,", "sure.", "Anything else, or is that all for today?"]
    assert _cut("Sure - here it is.") == ["Sure -", "here it is."]
    assert _cut("Sure\u2014here it is.") == ["Sure\u2014here it is."]  # a dash inside a word pair is no boundary
    assert _cut("Okay; done.") == ["Okay;", "done."]
    assert _cut("Fine. Then, later, more.") == ["Fine.", "Then, later, more."]
    # a thousands separator is no clause boundary (no space after it)
    assert _cut("It costs 1,000 dollars.") == ["It costs 1,000 dollars."]


def test_a_first_clause_without_a_boundary_is_cut_at_the_word_budget() -> None:
    text = "Right now it is sunny and twenty two degrees, with a light breeze."
    assert _cut(text) == ["Right now it is sunny and", "twenty two degrees, with a light breeze."]
    assert _cut(text, first_words=3) == ["Right now it", "is sunny and twenty two degrees, with a light breeze."]
    # first_words=0: the first piece by the later pieces' rules (the device's screen shows whole sentences)
    assert _cut(text, first_words=0) == ["Right now it is sunny and twenty two degrees,", "with a light breeze."]


def test_each_reply_gets_its_first_clause_early() -> None:
    sp = SentenceSplitter()
    first = [p for t in tokenize("Hello, there. ") for p in sp.feed(t)]
    assert first == ["Hello,", "there."] and sp.flush() is None
    again = [p for t in tokenize("Hi, again. ") for p in sp.feed(t)]
    assert again == ["Hi,", "again."]


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
