"""The demo shop's tools, with real effects on the in-process
:class:`demo_shop.service.DemoService`, one per kind of effect:

- ``lookup_weather(city)``: effect "none" (a read; :func:`weather_tools`);
- ``create_order(item)``: effect "compensate", reversed by ``cancel_order``;
- ``charge_payment(amount_cents)``: effect "complete" (must finish once
  started);
- ``send_messages(n)``: effect "complete": records the batch, then queues
  ``n`` messages carrying the turn id on the store's work queue
  ``outbound_messages``; a :class:`turn.downstream.DownstreamWorker` sends
  them one by one and skips those of a stopped turn.

Every call passes its idempotency key on; each message has its own key
(``<batch key>:<i>``) and its own ledger row (tool ``outbound_messages``),
written before it is sent. :func:`demo_handlers` gives the ledger what it
needs to settle both: the tools, and :class:`QueuedMessages` for the
messages (lookup by key; never compensated).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Annotated, Any

from pydantic import Field

from clock import Clock
from demo_shop.service import DemoService
from turn.downstream import DownstreamWorker
from turn.intents import LookupAnswer
from turn.reversal import EffectHandler
from turn.store import TurnStore
from voice.llm import WEATHER_REPLY
from voice.tools import Toolbox, tool

#: the work queue of outbound messages
MESSAGES_QUEUE = "outbound_messages"


def weather_tools(clock: Clock, *, weather_latency_ms: float = 50.0, service: DemoService | None = None) -> Toolbox:
    """The demo's read-only tool, on ``clock``:

    - ``lookup_weather(city)``: effect "none"; answers after
      ``weather_latency_ms`` (a network read) with the embedded agent's
      weather report (:data:`voice.llm.WEATHER_REPLY`), so a weather turn
      says the same whether the agent calls the tool or answers alone.
      With ``service``, the read also goes there (:meth:`DemoService.read`,
      op "weather": counted, and its faults apply).
    """

    @tool(expected_duration_ms=weather_latency_ms, max_duration_ms=5000)
    async def lookup_weather(city: str = "here") -> str:
        """Look up the current weather and tomorrow's forecast for a city."""
        await clock.sleep(weather_latency_ms / 1000)
        if service is not None:
            await service.read("weather")
        return WEATHER_REPLY

    return Toolbox([lookup_weather])


def demo_tools(clock: Clock, service: DemoService, store: TurnStore) -> Toolbox:
    """The demo toolbox (see the module doc) on ``service`` and ``store``:
    :func:`weather_tools` and the three tools with effects."""

    async def lookup(idempotency_key: str) -> LookupAnswer:
        return await service.lookup(idempotency_key)

    async def cancel_order(idempotency_key: str) -> bool:
        return await service.reverse(idempotency_key)  # False: never placed, nothing reversed

    @tool(effect="compensate", compensate=cancel_order, lookup=lookup, expected_duration_ms=50, max_duration_ms=10_000)
    async def create_order(idempotency_key: str, item: str = "a coffee") -> str:
        """Place an order for an item in the shop."""
        await service.apply("order", idempotency_key, {"item": item})
        return f"Your order for {item} is placed."

    @tool(effect="complete", lookup=lookup, expected_duration_ms=50, max_duration_ms=10_000)
    async def charge_payment(idempotency_key: str, amount_cents: Annotated[int, Field(ge=1, le=1_000_000)] = 500) -> str:
        """Charge the card on file (amount in US cents)."""
        await service.apply("payment", idempotency_key, {"amount_cents": amount_cents})
        return f"Charged {amount_cents / 100:.2f} dollars."

    @tool(effect="complete", lookup=lookup, expected_duration_ms=50, max_duration_ms=10_000)
    async def send_messages(idempotency_key: str, turn_id: str, n: Annotated[int, Field(ge=1, le=100)] = 3) -> str:
        """Send a batch of n outbound messages to the customer."""
        await service.apply("batch", idempotency_key, {"n": n})
        for i in range(n):
            await store.queue_push(MESSAGES_QUEUE, {"turn_id": turn_id, "key": f"{idempotency_key}:{i}", "text": f"message {i + 1} of {n}"})
        return f"{n} messages are on their way."

    box = weather_tools(clock, service=service)
    for t in (create_order, charge_payment, send_messages):
        box.add(t)
    return box


def message_sender(service: DemoService, store: TurnStore, clock: Clock, **kw: Any) -> DownstreamWorker:
    """The downstream worker that sends queued messages through ``service``."""

    async def send(item: dict[str, Any]) -> None:
        await service.apply("message", item["key"], {"text": item.get("text", "")})

    return DownstreamWorker(store, MESSAGES_QUEUE, send, clock, **kw)


class QueuedMessages:
    """The ledger's handler for the rows of queued messages (tool
    :data:`MESSAGES_QUEUE`, effect "complete"): a lookup asks ``service``
    by the message's key; a retry sends it again under the same key (only
    when the turn's stop policy allows retries); there is no compensation
    (a sent message cannot be unsent).

    Args:
        service: the external system the messages go to.
    """

    name = MESSAGES_QUEUE
    effect = "complete"

    def __init__(self, service: DemoService) -> None:
        self.service = service

    async def compensate_effect(self, key: str, args: dict[str, Any]) -> bool:
        """Never called for a "complete" effect.

        Raises:
            RuntimeError: always (a sent message cannot be unsent).
        """
        raise RuntimeError("a sent message cannot be unsent")

    async def lookup_effect(self, key: str) -> LookupAnswer:
        """Whether the message ``key`` was sent (UNKNOWN if the service
        cannot say)."""
        return await self.service.lookup(key)

    async def retry_effect(self, key: str, args: dict[str, Any]) -> Any:
        """Send the message ``key`` again (the service applies a key once).

        Raises:
            turn.ledger.EffectNotApplied / demo_shop.service.ServiceError:
                as :meth:`DemoService.apply`.
        """
        return await self.service.apply("message", key, {"text": args.get("text", "")})


def demo_handlers(tools: Callable[[], Toolbox], service: DemoService) -> Callable[[str], EffectHandler | None]:
    """What ``Ledger.handlers`` should be for the demo: the tool of a name
    (``tools()`` is asked each time, so a toolbox built later is found),
    or :class:`QueuedMessages` for the message rows; None for any other
    name."""
    messages = QueuedMessages(service)

    def handler(name: str) -> EffectHandler | None:
        if name == MESSAGES_QUEUE:
            return messages
        return tools().get(name)

    return handler
