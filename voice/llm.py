"""The embedded local agent: a deterministic streaming model.

It needs no network and no keys, and it replies token by token at a set pace,
so every cancellation path (before the first token, mid-stream, mid-sentence,
mid-playout) can be hit on purpose:

- a question about the weather gets a short weather report;
- "tell me a story" gets a long story (about a minute of speech);
- "count to twenty" gets "One, two, three, ... twenty.";
- anything else is echoed back ("You said: ...").

A token here is one word with its trailing space.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator

from pydantic import BaseModel, Field

from turn.clock import Clock, SystemClock
from voice.providers import Message

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


class LocalLlmConfig(BaseModel):
    """Local agent settings (env ``TURNKEEPER_LLM__*``).

    Attributes:
        tokens_per_second: streaming pace in tokens (words) per second.
    """

    tokens_per_second: float = Field(20.0, gt=0, le=10_000)


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


def tokenize(text: str) -> list[str]:
    """Split a reply into tokens: words with their trailing whitespace."""
    return re.findall(r"\S+\s*", text)


class LocalAgent:
    """:class:`voice.providers.LanguageModel` that answers from
    :func:`choose_reply`, one token every ``1 / tokens_per_second`` seconds.

    Args:
        config: pace.
        clock: time source for the pace (a virtual clock in tests).
    """

    def __init__(self, config: LocalLlmConfig | None = None, clock: Clock | None = None) -> None:
        self.config = config or LocalLlmConfig()
        self.clock = clock or SystemClock()
        #: how many tokens it produced in all (for tests and usage)
        self.tokens_streamed = 0

    async def stream(self, messages: list[Message]) -> AsyncIterator[str]:
        """Yield the reply to the last user message, token by token.

        Raises:
            ValueError: no user message in ``messages``.
        """
        last_user = next((m for m in reversed(messages) if m.role == "user"), None)
        if last_user is None:
            raise ValueError("no user message to answer")
        interval = 1.0 / self.config.tokens_per_second
        for token in tokenize(choose_reply(last_user.content)):
            await self.clock.sleep(interval)
            self.tokens_streamed += 1
            yield token
