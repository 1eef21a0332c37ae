"""One model call of a turn, the same for voice and text turns.

:func:`stream_reply` checkpoints before and after the call (a stop already
requested means the model is never called), streams the tokens to a
callback, and checkpoints again every ``check_every_s`` during the stream,
so a worker that missed a stop signal still stops within that bound.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable

from turn.clock import Clock
from turn.manager import TurnManager
from voice.providers import LanguageModel, Message

#: how often (s) a running stream re-checks the stop flag in the store
CHECK_EVERY_S = 0.1


async def stream_reply(
    llm: LanguageModel,
    messages: list[Message],
    *,
    manager: TurnManager,
    turn_id: str,
    on_token: Callable[[str], None],
    clock: Clock,
    check_every_s: float = CHECK_EVERY_S,
) -> str:
    """Stream the model's reply to ``messages``; returns the whole text.

    Raises:
        turn.manager.TurnStopped: a stop was requested (before, during or
            after the call); the stream is closed first.
        Exception: whatever the provider raises.
    """
    await manager.checkpoint(turn_id, "before_model")
    parts: list[str] = []
    last_check = clock.monotonic()
    async with contextlib.aclosing(llm.stream(messages)) as tokens:  # type: ignore[type-var]
        async for token in tokens:
            parts.append(token)
            on_token(token)
            now = clock.monotonic()
            if now - last_check >= check_every_s:
                last_check = now
                await manager.checkpoint(turn_id, "model_stream")
    await manager.checkpoint(turn_id, "after_model")
    return "".join(parts)
