"""Shared tooling of the fuzz tests (tests/web/test_fuzz_*.py): a real app
served from a thread of its own (schemathesis calls it synchronously), an
HTTP session that reads only the head of a live event stream, and the
count of cases each fuzz target tried.

Every fuzz target runs under hypothesis settings that make CI reproducible:
``derandomize=True`` (examples follow from the test's name, no random seed),
no example database, no deadline (a loaded 2-core machine is slow)."""

from __future__ import annotations

import asyncio
import json
import re
import threading
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from typing import Any, TypeVar

import requests
from aiohttp import web
from conftest import start_app
from hypothesis import HealthCheck, settings

T = TypeVar("T")

#: cases tried per fuzz target in this process (printed by each target and
#: at the end of the run by tests/web/test_fuzz_*.py with ``-s``)
CASES: Counter[str] = Counter()


def fuzz_settings(max_examples: int, **extra: Any) -> settings:
    """Hypothesis settings for a fuzz target: ``max_examples`` cases,
    derandomized, no example database, no deadline, no health check that a
    slow machine or a live server trips."""
    return settings(
        max_examples=max_examples,
        deadline=None,
        derandomize=True,
        database=None,
        suppress_health_check=list(HealthCheck),
        print_blob=False,
        **extra,
    )


def record(target: str) -> None:
    """Count one case tried against ``target``."""
    CASES[target] += 1


class LiveApp:
    """An aiohttp app served on a free loopback port by an event loop in a
    thread of its own, so synchronous clients (schemathesis, requests) can
    call it from the test's thread."""

    def __init__(self, make_app: Callable[[], web.Application]) -> None:
        self._make_app = make_app
        self.loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self.loop.run_forever, name="live-app", daemon=True)
        self.app: web.Application | None = None
        self.url = ""
        self._runner: web.AppRunner | None = None

    def run(self, coro: Awaitable[T], timeout: float = 30) -> T:
        """Run ``coro`` on the app's loop and wait for its result."""
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(timeout)  # type: ignore[arg-type]

    def start(self) -> None:
        """Make the app (on its loop: aiohttp binds to the running loop) and serve it."""
        self._thread.start()

        async def up() -> None:
            self.app = self._make_app()
            self._runner, self.url = await start_app(self.app)

        self.run(up())

    def stop(self) -> None:
        """Stop serving, close the app and end the thread."""
        if self._runner is not None:
            self.run(self._runner.cleanup(), timeout=60)
        self.loop.call_soon_threadsafe(self.loop.stop)
        self._thread.join(30)
        self.loop.close()


@contextmanager
def live_app(make_app: Callable[[], web.Application]) -> Iterator[LiveApp]:
    """A :class:`LiveApp` started for the block and stopped after it."""
    live = LiveApp(make_app)
    live.start()
    try:
        yield live
    finally:
        live.stop()


_EVENTS_PATH = re.compile(r"/v1/sessions/[^/?]*/events")
#: most bytes of a live event stream read before it is cut
SSE_HEAD_BYTES = 64 * 1024


class StreamHeadSession(requests.Session):
    """A requests session that, for a live event stream (200
    ``text/event-stream``), reads its head (up to the end of the first
    message, ``stream.start``; on a resume the ``snapshot`` after it) and
    hangs up, keeping what it read as the response's body. Everything else
    is read whole. A live stream never ends by itself: read whole, it would
    hang the fuzzer until its timeout."""

    def send(self, request: requests.PreparedRequest, **kwargs: Any) -> requests.Response:  # type: ignore[override]
        """Send ``request``; cut a live event stream after its first messages."""
        kwargs.setdefault("timeout", (5, 10))
        if not _EVENTS_PATH.search(request.url or ""):
            return super().send(request, **kwargs)
        kwargs["stream"] = True
        resp = super().send(request, **kwargs)
        if resp.status_code != 200 or not resp.headers.get("Content-Type", "").startswith("text/event-stream"):
            resp.content  # noqa: B018 -- read it whole, then release the connection
            resp.close()
            return resp
        resumed = "after_seq=" in (request.url or "") or "Last-Event-ID" in request.headers
        want = 2 if resumed else 1
        head = b""
        for chunk in resp.iter_content(chunk_size=None):
            head += chunk
            if head.count(b"\n\n") >= want or len(head) >= SSE_HEAD_BYTES:
                break
        resp.close()
        resp._content = head  # what was read stands for the body
        resp._content_consumed = True
        return resp


def sse_messages(body: bytes) -> list[dict[str, Any]]:
    """The JSON of each ``data:`` line of an event stream's text."""
    return [json.loads(line[6:]) for line in body.decode().splitlines() if line.startswith("data: ")]
