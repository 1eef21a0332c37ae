"""The small protocols every provider sits behind.

All calls are async and cancellable: cancelling the awaiting task stops the
work (a subprocess is killed, a stream closed) before ``CancelledError``
propagates.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Callable
from typing import Any, Literal, Protocol

from pydantic import BaseModel, Field

from turn.usage import Pricing, RequestMeter


class ToolCall(BaseModel):
    """A model's request to call a tool (OpenAI Chat Completions
    ``tool_calls`` entry, arguments decoded).

    Attributes:
        id: the call's id, echoed in the tool's result message.
        name: the tool.
        arguments: its arguments (a JSON object).
    """

    id: str
    name: str
    arguments: dict[str, Any] = Field(default_factory=dict)


class ToolSpec(BaseModel):
    """What a model is told of a tool: name, description and the JSON
    Schema of its arguments (OpenAI "function" tool)."""

    name: str
    description: str
    parameters: dict[str, Any]


class Message(BaseModel):
    """One entry of the conversation history a model sees.

    Attributes:
        role: "user", "assistant", "system" or "tool".
        content: the text.
        interrupted: for an assistant message, True if the user cut it off.
        tool_calls: for an assistant message, the tools it called.
        tool_call_id: for a tool message, the call it answers.
        status: for a tool message, how the call ended ("done",
            "cancelled", "error"); a cancelled call is recorded as such.
    """

    role: Literal["user", "assistant", "system", "tool"]
    content: str
    interrupted: bool = False
    tool_calls: list[ToolCall] | None = None
    tool_call_id: str | None = None
    status: str | None = None


class LanguageModel(Protocol):
    """A streaming model (one request per :meth:`stream` call).

    Attributes:
        pricing: what its tokens cost (cents per 1,000).
        name: for logs and usage records.
    """

    pricing: Pricing
    name: str

    def stream(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, meter: RequestMeter | None = None
    ) -> AsyncIterator[str | ToolCall]:
        """Yield the reply to ``messages``: text deltas (tokens) as they are
        produced, and :class:`ToolCall` items once complete. Feed ``meter``
        (one ``chunk()`` per streamed chunk, ``reported()`` with the
        provider's usage) and ``finish`` it, ``partial=True`` when aborted.
        Close the iterator (``aclose``) or cancel to abort: the request is
        torn down, not just left unread."""
        ...


#: receives synthesised mono s16 PCM as it is made (espeak-ng's clause synthesis)
PcmSink = Callable[[bytes], None]


def websocket_base(base_url: str) -> str:
    """``base_url`` as a WebSocket URL: ``http://`` becomes ``ws://`` and
    ``https://`` ``wss://`` (a provider's host is often given as its HTTP
    address; ``ws(s)://`` is kept), without a trailing slash."""
    for http, ws in (("http://", "ws://"), ("https://", "wss://")):
        if base_url.startswith(http):
            return ws + base_url[len(http):].rstrip("/")
    return base_url.rstrip("/")


def plain_base_url(value: str) -> str:
    """Check a provider's ``base_url`` setting: the clients build the path
    and the query from the other settings, so a query or fragment pasted
    into it would be dropped or doubled silently.

    Raises:
        ValueError: ``value`` has a query (``?``) or a fragment (``#``).
    """
    if "?" in value or "#" in value:
        raise ValueError("base_url takes no query or fragment (the model, voice, language and the rest are settings of their own)")
    return value
