"""A scripted fake model: it calls the tools of its script, one step per
request, then answers a fixed reply. The ledger fuzzer (:mod:`testkit.fuzz`)
drives turns with it.
"""

from __future__ import annotations

from collections.abc import AsyncIterator

from clock import VirtualClock
from turn.usage import Pricing, RequestMeter
from voice.llm import prompt_tokens, tokenize
from voice.providers import Message, ToolCall, ToolSpec


class ScriptedModel:
    """A model that calls the tools of its script, one step (a list of
    calls) per request, then answers ``reply``. Deterministic; honours the
    usual contract (cancellable stream, usage)."""

    name = "scripted"
    pricing = Pricing()

    def __init__(
        self,
        script: list[list[ToolCall]],
        clock: VirtualClock,
        *,
        reply: str = "All done: every step you asked for was carried out, one by one, in order.",
        tps: float = 200.0,
        requests: list[list[Message]] | None = None,
    ) -> None:
        self.script = script
        #: every request's messages, in order (what the model was sent)
        self.requests = requests if requests is not None else []
        self.clock = clock
        self.reply = reply
        self.interval = 1.0 / tps

    async def stream(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, meter: RequestMeter | None = None
    ) -> AsyncIterator[str | ToolCall]:
        """The next step's tool calls, or the reply once the script is done."""
        self.requests.append([m.model_copy() for m in messages])
        last_user = max(i for i, m in enumerate(messages) if m.role == "user")
        steps = sum(1 for m in messages[last_user + 1 :] if m.role == "assistant" and m.tool_calls)
        finished = False
        try:
            if steps < len(self.script):
                await self.clock.sleep(self.interval)
                if meter is not None:
                    meter.chunk(len(self.script[steps]) * 8)
                for call in self.script[steps]:
                    yield call
            else:
                for token in tokenize(self.reply):
                    await self.clock.sleep(self.interval)
                    if meter is not None:
                        meter.chunk()
                    yield token
            finished = True
            if meter is not None:
                meter.reported(prompt_tokens(messages, tools), meter.completion_tokens)
        finally:
            if meter is not None:
                meter.finish(partial=not finished, provider_stopped=True)
