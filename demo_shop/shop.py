"""The demo shop wired for one server: what ``web/app.py`` starts when the
``demo_shop`` setting is on (its default), and nothing else of the product
knows of it.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path

from clock import Clock
from demo_shop.service import DemoService
from demo_shop.tools import demo_handlers, demo_tools, message_sender, weather_tools
from turn.downstream import DownstreamWorker
from turn.reversal import EffectHandler
from turn.store import TurnStore
from voice.tools import Toolbox


class DemoShop:
    """The demo's external system, one toolbox on it for the whole process,
    the ledger's handlers for its effects and the worker that sends its
    queued messages.

    Args:
        clock: time source of the tools and the service.
        path: the service's SQLite file (it outlives restarts, so
            reconciliation after a crash asks a system that remembers).
    """

    def __init__(self, clock: Clock, path: str | Path) -> None:
        self.clock = clock
        self.service = DemoService(clock, path)
        self._toolbox: Toolbox | None = None

    def tools(self, store: TurnStore | None) -> Toolbox:
        """The demo tools on the service and ``store`` (their downstream work
        queue lives there), built once; with no store yet, the weather tool
        alone (not kept)."""
        if self._toolbox is None:
            if store is None:
                return weather_tools(self.clock)
            self._toolbox = demo_tools(self.clock, self.service, store)
        return self._toolbox

    def handlers(self, tools: Callable[[], Toolbox]) -> Callable[[str], EffectHandler | None]:
        """What ``Ledger.handlers`` should be: the tool of a name (``tools()``
        is asked each time) or the queued messages' handler."""
        return demo_handlers(tools, self.service)

    def message_sender(self, store: TurnStore, consumer: str) -> DownstreamWorker:
        """The worker that sends the queued messages, as ``consumer``."""
        return message_sender(self.service, store, self.clock, consumer=consumer)

    async def aclose(self) -> None:
        """Close the service's database (its worker threads finish first)."""
        await self.service.aclose()
