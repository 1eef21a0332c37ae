"""A local OpenAI-compatible Chat Completions server that streams the
embedded agent's replies slowly, for tests and benchmarks of real model
streams (no mock objects: a real HTTP server on a real socket).

``POST /v1/chat/completions`` with ``stream: true`` answers with server-sent
``chat.completion.chunk`` events, one token per chunk at ``tokens_per_second``,
tool calls in the incremental ``delta.tool_calls`` form, a usage chunk when
``stream_options.include_usage`` is set (in every chunk with
``usage_every_chunk``), and ``data: [DONE]``. A completion stops at
``max_tokens`` (or ``max_completion_tokens``) with finish reason
``length``, as the API's does. The replies are the embedded
agent's (:func:`voice.llm.choose_reply`, :func:`voice.llm.choose_tool_call`).

It counts, per request, the tokens it generated and how many of them it
generated after the client had disconnected: a client that only stops
reading, without closing its connection, would show up as a server that
keeps generating. With ``ignore_disconnect`` it behaves like a provider that
bills the whole completion whatever the client does.

Run it alone: ``python -m testkit.openai_server --port 8099``.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import time
import uuid
from dataclasses import dataclass, field
from typing import Any

from aiohttp import web

from voice.llm import choose_reply, choose_tool_call, prompt_tokens, tokenize
from voice.providers import Message, ToolCall, ToolSpec


@dataclass
class RequestStats:
    """What the server did for one request.

    Attributes:
        generated: completion tokens generated.
        generated_after_disconnect: of those, generated after the client's
            connection was gone.
        disconnected_after_s: when the client went away, s after the request
            arrived (None: it stayed to the end).
        completed: the whole reply was sent.
    """

    generated: int = 0
    generated_after_disconnect: int = 0
    disconnected_after_s: float | None = None
    completed: bool = False
    done: asyncio.Event = field(default_factory=asyncio.Event)


@dataclass
class ServerOptions:
    """Behaviour of the server.

    Attributes:
        tokens_per_second: streaming pace.
        first_token_delay_s: time to the first token (prompt processing).
        usage_every_chunk: put usage in every chunk (vLLM's continuous usage).
        ignore_disconnect: keep generating after the client is gone.
        api_key: required bearer token (None: none).
    """

    tokens_per_second: float = 50.0
    first_token_delay_s: float = 0.0
    usage_every_chunk: bool = False
    ignore_disconnect: bool = False
    api_key: str | None = None


class ChatCompletionsServer:
    """The server's state and handler; :meth:`app` is the aiohttp app."""

    def __init__(self, options: ServerOptions | None = None) -> None:
        self.options = options or ServerOptions()
        self.requests: list[RequestStats] = []

    @property
    def tokens_after_disconnect(self) -> int:
        """Tokens generated after a client disconnected, over all requests."""
        return sum(r.generated_after_disconnect for r in self.requests)

    def app(self) -> web.Application:
        """The aiohttp application."""
        app = web.Application(client_max_size=4 * 1024 * 1024)
        app.router.add_post("/v1/chat/completions", self.completions)
        return app

    async def completions(self, request: web.Request) -> web.StreamResponse:
        opts = self.options
        if opts.api_key is not None and request.headers.get("Authorization") != f"Bearer {opts.api_key}":
            return _error(401, "invalid_api_key", "Incorrect API key provided.")
        try:
            body = await request.json()
        except (json.JSONDecodeError, UnicodeDecodeError):
            return _error(400, "invalid_request_error", "We could not parse the JSON body of your request.")
        if not isinstance(body, dict) or not isinstance(body.get("messages"), list) or not body["messages"]:
            return _error(400, "invalid_request_error", "'messages' must be a non-empty array.")
        try:
            messages = [_from_wire(m) for m in body["messages"]]
            tools = [ToolSpec(**t["function"]) for t in body.get("tools") or []]
        except (KeyError, TypeError, ValueError) as exc:
            return _error(400, "invalid_request_error", f"bad message or tool: {exc}")
        if not any(m.role == "user" for m in messages):
            return _error(400, "invalid_request_error", "no user message.")
        if not body.get("stream"):
            return _error(400, "invalid_request_error", "this server only streams: set stream to true.")
        include_usage = bool((body.get("stream_options") or {}).get("include_usage"))
        cap = body.get("max_completion_tokens", body.get("max_tokens"))
        if cap is not None and (not isinstance(cap, int) or isinstance(cap, bool) or cap < 1):
            return _error(400, "invalid_request_error", "max_tokens must be a positive integer.")
        stats = RequestStats()
        self.requests.append(stats)
        try:
            return await self._stream(request, messages, tools, include_usage, stats, cap)
        finally:
            stats.done.set()

    async def _stream(
        self,
        request: web.Request,
        messages: list[Message],
        tools: list[ToolSpec],
        include_usage: bool,
        stats: RequestStats,
        cap: int | None = None,
    ) -> web.StreamResponse:
        opts = self.options
        started = time.monotonic()
        resp = web.StreamResponse(headers={"Content-Type": "text/event-stream", "Cache-Control": "no-cache"})
        try:
            await resp.prepare(request)
        except (ConnectionResetError, ConnectionError):
            stats.disconnected_after_s = time.monotonic() - started  # gone before the first byte
            return resp
        cid = f"chatcmpl-{uuid.uuid4().hex[:12]}"
        prompt = prompt_tokens(messages, tools)
        call = choose_tool_call(messages, tools)
        if call is not None:
            pieces = _tool_call_pieces(call)
        else:
            reply = (
                " ".join(m.content for m in messages[_last_user(messages) + 1 :] if m.role == "tool")
                if messages[-1].role == "tool"
                else choose_reply(next(m.content for m in reversed(messages) if m.role == "user"))
            )
            pieces = [{"content": t} for t in tokenize(reply)]
        truncated = cap is not None and call is None and len(pieces) > cap
        if truncated:
            pieces = pieces[:cap]  # finish_reason "length", as the API does at max_tokens
        connected = True

        def gone() -> bool:
            transport = request.transport
            return transport is None or transport.is_closing()

        async def send(payload: dict[str, Any]) -> None:
            nonlocal connected
            if not connected:
                return
            try:
                await resp.write(f"data: {json.dumps(payload)}\n\n".encode())
            except (ConnectionResetError, ConnectionError, RuntimeError):
                connected = False

        def chunk(delta: dict[str, Any], finish: str | None = None) -> dict[str, Any]:
            out: dict[str, Any] = {
                "id": cid,
                "object": "chat.completion.chunk",
                "created": int(time.time()),
                "model": "turnkeeper-local",
                "choices": [{"index": 0, "delta": delta, "finish_reason": finish}],
            }
            if opts.usage_every_chunk and include_usage:
                out["usage"] = _usage(prompt, stats.generated)
            return out

        await send(chunk({"role": "assistant", "content": ""}))
        if opts.first_token_delay_s:
            await asyncio.sleep(opts.first_token_delay_s)
        for delta in pieces:
            await asyncio.sleep(1.0 / opts.tokens_per_second)
            if connected and gone():
                connected = False
            if not connected:
                if stats.disconnected_after_s is None:
                    stats.disconnected_after_s = time.monotonic() - started
                if not opts.ignore_disconnect:
                    return resp
                stats.generated_after_disconnect += 1
            stats.generated += 1
            await send(chunk(delta))
        await send(chunk({}, "tool_calls" if call is not None else "length" if truncated else "stop"))
        if include_usage:
            await send({"id": cid, "object": "chat.completion.chunk", "choices": [], "usage": _usage(prompt, stats.generated)})
        if connected:
            try:
                await resp.write(b"data: [DONE]\n\n")
                await resp.write_eof()
                stats.completed = True
            except (ConnectionResetError, ConnectionError, RuntimeError):
                pass
        return resp


def _usage(prompt: int, completion: int) -> dict[str, int]:
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion}


def _tool_call_pieces(call: ToolCall) -> list[dict[str, Any]]:
    """A tool call as streamed: its name first, then its arguments in two
    halves (clients must join them)."""
    args = json.dumps(call.arguments)
    half = len(args) // 2
    first = {"index": 0, "id": call.id, "type": "function", "function": {"name": call.name, "arguments": ""}}
    return [
        {"tool_calls": [first]},
        {"tool_calls": [{"index": 0, "function": {"arguments": args[:half]}}]},
        {"tool_calls": [{"index": 0, "function": {"arguments": args[half:]}}]},
    ]


def _last_user(messages: list[Message]) -> int:
    return max(i for i, m in enumerate(messages) if m.role == "user")


def _from_wire(m: Any) -> Message:
    if not isinstance(m, dict):
        raise TypeError("a message must be an object")
    calls = [
        ToolCall(id=c["id"], name=c["function"]["name"], arguments=json.loads(c["function"].get("arguments") or "{}"))
        for c in m.get("tool_calls") or []
    ]
    return Message(role=m["role"], content=m.get("content") or "", tool_calls=calls or None, tool_call_id=m.get("tool_call_id"))


def _error(status: int, kind: str, message: str) -> web.Response:
    return web.json_response({"error": {"message": message, "type": kind, "code": kind}}, status=status)


def main() -> None:
    """``python -m testkit.openai_server [--host H] [--port P] [--tps N]``"""
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--port", type=int, default=8099)
    parser.add_argument("--tps", type=float, default=50.0, help="tokens per second")
    parser.add_argument("--ignore-disconnect", action="store_true")
    a = parser.parse_args()
    server = ChatCompletionsServer(ServerOptions(tokens_per_second=a.tps, ignore_disconnect=a.ignore_disconnect))
    web.run_app(server.app(), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
