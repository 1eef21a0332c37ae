"""Fault injection: providers that misbehave on purpose, so tests and
benchmarks can show what turnkeeper does when a third party does not play by
the rules. Never configure these in production.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator

from clock import Clock
from turn.usage import Pricing, RequestMeter
from voice.llm import LlmConfig, choose_reply, prompt_tokens, tokenize
from voice.providers import Message, ToolCall, ToolSpec


class CancellationIgnoringModel:
    """A streaming model that ignores cancellation and keeps streaming, like
    an SDK that drains a blocking HTTP response before it gives up: when the
    task reading it is cancelled, it swallows the ``CancelledError`` and goes
    on generating the rest of its reply at its pace (metering every token),
    then yields what it generated. Only closing it (``aclose``) ends it.

    What turnkeeper must do with it: write the turn's terminal state within
    the stop grace anyway (the model child reports ``ignored_cancel``),
    withhold every token it yields after the stop (the delivery gate), and
    record the wasted tokens (``completion_tokens_after_stop``).

    Args:
        config: pace (``tokens_per_second``) and prices.
        clock: time source.

    Attributes:
        ignored: how many cancellations it swallowed.
        tokens_after_cancel: tokens it generated after its first ignored
            cancellation.
    """

    name = "ignores-cancellation"

    def __init__(self, config: LlmConfig | None = None, clock: Clock | None = None) -> None:
        from clock import SystemClock

        self.config = config or LlmConfig()
        self.clock = clock or SystemClock()
        self.pricing: Pricing = self.config.pricing
        self.ignored = 0
        self.tokens_after_cancel = 0

    async def stream(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, meter: RequestMeter | None = None
    ) -> AsyncIterator[str | ToolCall]:
        """Yield the embedded agent's reply; cancellation is ignored (see
        the class doc). Tools are never called.

        Raises:
            ValueError: no user message.
        """
        last_user = next((m for m in reversed(messages) if m.role == "user"), None)
        if last_user is None:
            raise ValueError("no user message to answer")
        interval = 1.0 / self.config.tokens_per_second
        tokens = tokenize(choose_reply(last_user.content))[: self.config.max_tokens]
        finished = False
        if meter is not None:
            meter.max_tokens = self.config.max_tokens
        try:
            held: list[str] = []
            for token in tokens:
                try:
                    await self.clock.sleep(interval)
                except asyncio.CancelledError:
                    self.ignored += 1  # the misbehaviour: swallowed, and streaming goes on
                if self.ignored:
                    self.tokens_after_cancel += 1
                if meter is not None:
                    meter.chunk()
                if self.ignored:
                    held.append(token)  # draining: nothing is yielded until the reply is done
                    continue
                yield token
            for token in held:
                yield token
            finished = True
            if meter is not None:
                meter.reported(prompt_tokens(messages, tools), len(tokens))
        finally:
            if meter is not None:  # in this process: when it ends, it has stopped
                meter.finish(partial=not finished, provider_stopped=True)
