"""An OpenAI-compatible streaming model client: Chat Completions with
``stream=true`` over aiohttp, tool calls included.

It speaks the wire format of OpenAI's Chat Completions API (server-sent
events of ``chat.completion.chunk`` objects, ending with ``data: [DONE]``),
which Ollama, vLLM and the llama.cpp server also serve under ``/v1``.

Aborting (closing the stream, or cancelling the task that reads it) tears the
TCP connection down (``ClientResponse.close()``), so the server sees the
client gone at its next write and can stop generating; merely not reading
would leave it generating into socket buffers.

Usage: with ``stream_options.include_usage`` the server sends a final chunk
with the request's usage, which is taken as is (``source="usage_chunk"``);
servers that send usage in every chunk (vLLM's
``continuous_usage_stats``) are read the same way, so even an aborted
request has the server's own figures. Otherwise each streamed chunk counts
as one completion token and the prompt is estimated (``source="counted"``).
An aborted request is recorded partial: prompt tokens plus the completion
tokens streamed so far.

SSE parsing: only ``data:`` fields are used by this API; the lines are parsed
here (per the WHATWG event-stream rules: a blank line ends an event, lines
starting with ``:`` are comments) rather than with an SSE client library,
because those reconnect on their own, and a reconnect would start a second
model request.
"""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncIterator
from typing import Any

import aiohttp

from turn.usage import RequestMeter
from voice.llm import LlmConfig
from voice.providers import Message, ToolCall, ToolSpec

log = logging.getLogger(__name__)


class ModelApiError(RuntimeError):
    """The model API refused the request or sent something unreadable.

    Attributes:
        status: the HTTP status (0 if the error is in the stream itself).
    """

    def __init__(self, status: int, message: str) -> None:
        super().__init__(f"model API error {status}: {message}" if status else f"model API error: {message}")
        self.status = status


def to_wire(messages: list[Message]) -> list[dict[str, Any]]:
    """The messages in Chat Completions form. An interrupted assistant
    message says so in its text; a tool message keeps its call id."""
    out: list[dict[str, Any]] = []
    for m in messages:
        entry: dict[str, Any] = {"role": m.role, "content": m.content}
        if m.role == "assistant" and m.interrupted:
            entry["content"] = f"{m.content} [interrupted by the user]"
        if m.tool_calls:
            entry["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": json.dumps(c.arguments)}}
                for c in m.tool_calls
            ]
        if m.tool_call_id:
            entry["tool_call_id"] = m.tool_call_id
        out.append(entry)
    return out


async def sse_data(content: aiohttp.StreamReader) -> AsyncIterator[str]:
    """The ``data`` of each server-sent event in ``content`` (multi-line
    data joined with newlines).

    Raises:
        ModelApiError: a line is not UTF-8.
    """
    data: list[str] = []
    async for raw in content:
        try:
            line = raw.decode("utf-8").rstrip("\r\n")
        except UnicodeDecodeError as exc:
            raise ModelApiError(0, f"stream is not UTF-8: {exc}") from None
        if not line:
            if data:
                yield "\n".join(data)
                data = []
            continue
        if line.startswith(":"):
            continue
        name, _, value = line.partition(":")
        if name == "data":
            data.append(value[1:] if value.startswith(" ") else value)
    if data:
        yield "\n".join(data)


class OpenAiChatModel:
    """:class:`voice.providers.LanguageModel` over an OpenAI-compatible API.

    Args:
        config: base URL, model, API key, timeouts and prices.
        session: an aiohttp session to use (one is made, and closed by
            :meth:`aclose`, if None).
    """

    name = "openai"

    def __init__(self, config: LlmConfig, session: aiohttp.ClientSession | None = None) -> None:
        self.config = config
        self.pricing = config.pricing
        self._session = session
        self._own_session = session is None

    def _client(self) -> aiohttp.ClientSession:
        if self._session is None or self._session.closed:
            self._session = aiohttp.ClientSession(
                timeout=aiohttp.ClientTimeout(total=self.config.request_timeout_s, sock_connect=self.config.connect_timeout_s)
            )
            self._own_session = True
        return self._session

    async def aclose(self) -> None:
        """Close the HTTP session if this client made it."""
        if self._own_session and self._session is not None:
            await self._session.close()

    def request_body(self, messages: list[Message], tools: list[ToolSpec] | None) -> dict[str, Any]:
        """The JSON body of one streaming request."""
        body: dict[str, Any] = {
            "model": self.config.model,
            "messages": to_wire(messages),
            "stream": True,
            "stream_options": {"include_usage": True},
            # a cap on every request: it bounds what the provider can spend
            # unseen if it goes on after a stop closed the connection
            self.config.max_tokens_field: self.config.max_tokens,
        }
        if tools:
            body["tools"] = [{"type": "function", "function": t.model_dump()} for t in tools]
        return body

    async def stream(
        self, messages: list[Message], *, tools: list[ToolSpec] | None = None, meter: RequestMeter | None = None
    ) -> AsyncIterator[str | ToolCall]:
        """Stream one completion: text deltas as they come, then each tool
        call once its arguments are complete.

        Raises:
            ModelApiError: a non-200 answer, an error event, or a chunk
                that is not JSON.
            aiohttp.ClientError / TimeoutError: the connection failed.
        """
        headers = {"Accept": "text/event-stream"}
        key = self.config.api_key.get_secret_value()
        if key:
            headers["Authorization"] = f"Bearer {key}"
        url = self.config.base_url.rstrip("/") + "/chat/completions"
        finished = False
        if meter is not None:
            meter.max_tokens = self.config.max_tokens
        try:
            resp = await self._client().post(url, json=self.request_body(messages, tools), headers=headers)
        except BaseException:
            if meter is not None:  # never reached the model: nothing billed
                meter.not_billed()
                meter.finish(partial=True)
            raise
        try:
            if resp.status != 200:
                if meter is not None:
                    meter.not_billed()
                text = (await resp.text())[:500]
                raise ModelApiError(resp.status, f"{url} (setting llm.base_url) answered {resp.reason}: {text}")
            calls: dict[int, dict[str, Any]] = {}
            async for data in sse_data(resp.content):
                if data.strip() == "[DONE]":
                    break
                try:
                    chunk = json.loads(data)
                except json.JSONDecodeError:
                    raise ModelApiError(0, f"chunk is not JSON: {data[:200]!r}") from None
                if not isinstance(chunk, dict):
                    raise ModelApiError(0, "chunk is not a JSON object")
                if "error" in chunk:
                    raise ModelApiError(0, json.dumps(chunk["error"])[:500])
                usage = chunk.get("usage")
                if usage and meter is not None:  # before the chunk's text: an abort right after it keeps the figures
                    meter.reported(int(usage.get("prompt_tokens") or 0), int(usage.get("completion_tokens") or 0))
                for choice in chunk.get("choices") or []:
                    delta = choice.get("delta") or {}
                    for tc in delta.get("tool_calls") or []:
                        slot = calls.setdefault(int(tc.get("index", 0)), {"id": "", "name": "", "arguments": ""})
                        slot["id"] = tc.get("id") or slot["id"]
                        fn = tc.get("function") or {}
                        slot["name"] += fn.get("name") or ""
                        slot["arguments"] += fn.get("arguments") or ""
                        if meter is not None and not usage:
                            meter.chunk()
                    content = delta.get("content")
                    if content:
                        if meter is not None and not usage:
                            meter.chunk()
                        yield content
            for index in sorted(calls):
                yield _tool_call(calls[index], index)
            finished = True
        finally:
            if meter is not None:  # aborted: closing the connection does not prove the provider stopped
                meter.finish(partial=not finished)
            if finished:
                resp.release()
            else:
                resp.close()  # tear the connection down: the server sees us gone


def _tool_call(slot: dict[str, Any], index: int) -> ToolCall:
    raw = slot["arguments"].strip() or "{}"
    try:
        arguments = json.loads(raw)
    except json.JSONDecodeError:
        raise ModelApiError(0, f"tool call {slot['name']!r} has arguments that are not JSON: {raw[:200]!r}") from None
    if not isinstance(arguments, dict):
        raise ModelApiError(0, f"tool call {slot['name']!r} arguments are not a JSON object")
    return ToolCall(id=slot["id"] or f"call_{index}", name=slot["name"], arguments=arguments)
