"""The embedded local agent: a deterministic streaming model.

It needs no network and no keys, and it replies token by token at a set pace,
so every cancellation path (before the first token, mid-stream, mid-sentence,
mid-playout) can be hit on purpose:

- a question about the weather gets a short weather report;
- "tell me a story" gets a long story (about a minute of speech);
- "count to twenty" gets "One, two, three, ... twenty.";
- anything else is echoed back ("You said: ...").

Given tools, it calls them the same deterministic way (a weather question
calls ``lookup_weather``; "call X" calls tool ``X``; "keep checking the
weather" calls ``lookup_weather`` forever, which loop detection stops), then
speaks what the tool returned.

A token here is one word with its trailing space. Usage is reported like a
provider's usage chunk: prompt tokens are the words of the messages.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr

from clock import Clock, SystemClock
from turn.usage import Pricing, RequestMeter
from voice.providers import Message, ToolCall, ToolSpec

WEATHER_REPLY = (
    "Right now it is sunny and twenty two degrees, with a light breeze from the west. "
    "Tonight stays clear and cool, and tomorrow brings a few clouds in the afternoon."
)

STORY_REPLY = (
    "Once upon a time, in a village at the edge of a great forest, there lived a clockmaker named Ada. "
    "Every morning she opened her small shop and wound every clock on the wall, one by one. "
    "The villagers said her clocks were never wrong, not by a single second. "
    "One winter night, a traveller knocked on her door with a clock that had stopped at midnight. "
    "He told her it had belonged to his grandmother, and that nobody had been able to make it run again. "
    "Ada opened the case and found, instead of gears, a tiny folded map. "
    "The map showed a path through the forest to a lake that did not appear on any other map. "
    "At dawn the two of them set out together, following the path between the snowy pines. "
    "They walked all day, and as the sun went down they reached the shore of a silver lake. "
    "In the middle of the lake stood a tower with a clock face as large as a house. "
    "Its hands were frozen at midnight, exactly like the little clock in the traveller's hands. "
    "Ada rowed across the water, climbed the tower, and found the great gears coated in ice. "
    "She warmed them one by one with her lantern, and slowly the giant hands began to move. "
    "At that very moment the little clock in the traveller's hands began to tick again. "
    "And from that day on, the village clocks and the tower clock kept time together. "
    "The end."
)

NUMBERS = (
    "one two three four five six seven eight nine ten eleven twelve thirteen fourteen "
    "fifteen sixteen seventeen eighteen nineteen twenty"
).split()
COUNT_REPLY = ", ".join(n.capitalize() if i == 0 else n for i, n in enumerate(NUMBERS)) + "."


class LlmConfig(BaseModel):
    """Model settings (env ``TURNKEEPER_LLM__*``).

    Attributes:
        provider: ``"local"`` (the embedded agent, no network) or
            ``"openai"`` (any OpenAI-compatible Chat Completions server:
            OpenAI, Ollama, vLLM, the llama.cpp server).
        tokens_per_second: the local agent's pace, tokens (words) per second.
        base_url: the OpenAI-compatible API's base URL, up to ``/v1``
            (Ollama: ``http://127.0.0.1:11434/v1``; vLLM:
            ``http://127.0.0.1:8000/v1``; llama.cpp server:
            ``http://127.0.0.1:8080/v1``).
        model: the model name sent with each request.
        api_key: bearer token (empty: none; local servers need none).
        connect_timeout_s: to connect to the API, s.
        request_timeout_s: a whole model request at most, s.
        prompt_cents_per_1k / completion_cents_per_1k: token prices, US
            cents per 1,000 tokens (the budget's cents come from these).
        max_tokens: the completion cap of every model request, tokens
            (sent as ``max_tokens``; the local agent stops there too). It
            bounds what a provider can spend unseen after a stop.
        max_tokens_field: the request field the cap is sent in:
            ``"max_tokens"`` (understood by Ollama, vLLM, the llama.cpp
            server and OpenAI's non-reasoning models) or
            ``"max_completion_tokens"`` (OpenAI's current name, required by
            its reasoning models).
    """

    model_config = ConfigDict(extra="forbid")

    provider: Literal["local", "openai"] = "local"
    tokens_per_second: float = Field(20.0, gt=0, le=10_000)
    base_url: str = "http://127.0.0.1:11434/v1"
    model: str = "llama3.2"
    api_key: SecretStr = SecretStr("")
    connect_timeout_s: float = Field(10.0, gt=0, le=600)
    request_timeout_s: float = Field(120.0, gt=0, le=3600)
    prompt_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)
    completion_cents_per_1k: float = Field(0.0, ge=0, allow_inf_nan=False)
    max_tokens: int = Field(1024, ge=1, le=131_072)
    max_tokens_field: Literal["max_tokens", "max_completion_tokens"] = "max_tokens"

    @property
    def pricing(self) -> Pricing:
        """The token prices."""
        return Pricing(prompt_cents_per_1k=self.prompt_cents_per_1k, completion_cents_per_1k=self.completion_cents_per_1k)


#: the former name, kept for settings files and callers of the first release
LocalLlmConfig = LlmConfig

_CALL_TOOL = re.compile(r"\b(?:call|use|run) (?:the )?([a-z_][a-z0-9_]*)")


def choose_reply(text: str) -> str:
    """The deterministic reply to a user utterance (see module doc)."""
    t = text.lower()
    if "weather" in t:
        return WEATHER_REPLY
    if "story" in t:
        return STORY_REPLY
    if re.search(r"\bcount", t):
        return COUNT_REPLY
    t = text.strip()
    if not t:
        return "Sorry, I did not catch that."
    return f"You said: {t}."


def choose_tool_call(messages: list[Message], tools: list[ToolSpec]) -> ToolCall | None:
    """The tool the local agent calls next, if any:

    - a weather question calls ``lookup_weather`` once (and again and again
      if the user said "keep checking": a loop, on purpose);
    - "call X" / "use X" / "run X" calls the tool ``X`` with no arguments,
      once;
    - "send five messages" calls ``send_messages(n=5)``, "order a coffee"
      ``create_order(item="a coffee")``, "pay" or "charge" ``charge_payment``;
    - nothing else calls a tool.
    """
    names = {t.name for t in tools}
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    if last_user is None:
        return None
    text = messages[last_user].content.lower()
    calls_since = [m for m in messages[last_user + 1 :] if m.role == "tool"]
    number = sum(1 for m in messages if m.role == "tool") + 1
    if "weather" in text and "lookup_weather" in names and (not calls_since or "keep checking" in text):
        return ToolCall(id=f"call_{number}", name="lookup_weather", arguments={"city": "here"})
    m = _CALL_TOOL.search(text)
    if m and m.group(1) in names and not calls_since:
        return ToolCall(id=f"call_{number}", name=m.group(1), arguments={})
    if calls_since:
        return None
    if (m := _SEND.search(text)) and "send_messages" in names:
        return ToolCall(id=f"call_{number}", name="send_messages", arguments={"n": _number(m.group(1))})
    if (m := _ORDER.search(text)) and "create_order" in names:
        return ToolCall(id=f"call_{number}", name="create_order", arguments={"item": m.group(1).strip() or "a coffee"})
    if re.search(r"\b(pay|charge)\b", text) and "charge_payment" in names:
        return ToolCall(id=f"call_{number}", name="charge_payment", arguments={})
    return None


_SEND = re.compile(r"\bsend (\w+) messages?\b")
_ORDER = re.compile(r"\border (?:me )?((?:a|an|some|two|three)? ?\w*)")
_NUMBER_WORDS = {w: i + 1 for i, w in enumerate(NUMBERS)}


def _number(word: str) -> int:
    """A count said as digits or as a word up to twenty (3 if neither)."""
    if word.isdigit():
        return max(1, min(100, int(word)))
    return _NUMBER_WORDS.get(word, 3)


def tokenize(text: str) -> list[str]:
    """Split a reply into tokens: words with their trailing whitespace."""
    return re.findall(r"\S+\s*", text)


def prompt_tokens(messages: list[Message], tools: list[ToolSpec] | None = None) -> int:
    """The local agent's prompt size in tokens: the words of every message
    (and of the tool specs), one token each."""
    words = sum(len(tokenize(m.content)) for m in messages)
    if tools:
        words += sum(len(tokenize(t.description)) + 1 for t in tools)
    return words


class LocalAgent:
    """:class:`voice.providers.LanguageModel` that answers from
    :func:`choose_reply` (or calls a tool, :func:`choose_tool_call`), one
    token every ``1 / tokens_per_second`` seconds. After a tool call it
    speaks the tool's result. It reports usage at the end of each request,
    like a provider's usage chunk, and leaves a partial record on abort.

    Args:
        config: pace and prices.
        clock: time source for the pace (a virtual clock in tests).
    """

    name = "local"

    def __init__(self, config: LlmConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or LlmConfig()
        self.clock = clock or SystemClock()
        self.pricing = self.config.pricing
        #: how many tokens it produced in all (for tests and usage)
        self.tokens_streamed = 0

    def count_prompt_tokens(self, messages: list[Message], tools: list[ToolSpec] | None = None) -> int:
        """Its prompt's exact size, tokens (:func:`prompt_tokens`): what a
        request will bill, known before it is sent (the turn's budget
        check uses it instead of a generic estimate)."""
        return prompt_tokens(messages, tools)

    async def stream(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, meter: RequestMeter | None = None
    ) -> AsyncIterator[str | ToolCall]:
        """Yield the reply to the last user message, token by token, or one
        tool call.

        Raises:
            ValueError: no user message in ``messages``.
        """
        last_user = next((m for m in reversed(messages) if m.role == "user"), None)
        if last_user is None:
            raise ValueError("no user message to answer")
        interval = 1.0 / self.config.tokens_per_second
        prompt = prompt_tokens(messages, tools)
        completion = 0
        finished = False
        if meter is not None:
            meter.max_tokens = self.config.max_tokens
            # it knows its prompt's size before it generates: a request cut off
            # is billed that, not the caller's estimate (which counts the tool
            # specs' JSON as a hosted model's prompt would)
            meter.prompt_tokens = prompt
        try:
            call = choose_tool_call(messages, tools or [])
            if call is not None:
                await self.clock.sleep(interval)
                completion = len(tokenize(f"{call.name} {call.arguments}"))
                self.tokens_streamed += completion
                if meter is not None:
                    meter.chunk(completion)
                yield call
            else:
                if messages[-1].role == "tool":
                    reply = " ".join(m.content for m in messages if m.role == "tool" and _after_last_user(messages, m))
                else:
                    reply = choose_reply(last_user.content)
                for token in tokenize(reply)[: self.config.max_tokens]:
                    await self.clock.sleep(interval)
                    self.tokens_streamed += 1
                    completion += 1
                    if meter is not None:
                        meter.chunk()
                    yield token
            finished = True
            if meter is not None:
                meter.reported(prompt, completion)
        finally:
            if meter is not None:  # it runs here: once closed, it generates nothing more
                meter.finish(partial=not finished, provider_stopped=True)


def _after_last_user(messages: list[Message], msg: Message) -> bool:
    last_user = max(i for i, m in enumerate(messages) if m.role == "user")
    return any(m is msg for m in messages[last_user + 1 :])
