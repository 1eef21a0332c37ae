"""The Redis store's downstream work queue (``TurnStore.queue_*``): one
Redis Stream per queue with the consumer group ``workers``; an item is
acknowledged and deleted when done.
"""

from __future__ import annotations

import json
from typing import Any

from redis.exceptions import ResponseError

from turn.redis_connection import RedisConnection


class RedisWorkQueue(RedisConnection):
    """The work-queue methods of :class:`turn.store.TurnStore` on Redis."""

    # -- downstream work queue (a Redis Stream with a consumer group) --------------

    def _queue(self, queue: str) -> str:
        return f"{self.prefix}:queue:{queue}"

    async def _ensure_group(self, queue: str) -> None:
        if queue in self._groups:
            return
        try:
            await self._call(self._c().xgroup_create(self._queue(queue), "workers", id="0", mkstream=True))
        except ResponseError as exc:
            if "BUSYGROUP" not in str(exc):
                raise
        self._groups.add(queue)

    async def queue_push(self, queue: str, item: dict[str, Any]) -> str:
        await self._ensure_group(queue)
        return str(await self._call(self._c().xadd(self._queue(queue), {"item": json.dumps(item)})))

    async def queue_claim(self, queue: str, consumer: str, count: int = 10) -> list[tuple[str, dict[str, Any]]]:
        await self._ensure_group(queue)
        res = await self._call(self._c().xreadgroup("workers", consumer, {self._queue(queue): ">"}, count=count))
        out: list[tuple[str, dict[str, Any]]] = []
        for _stream, entries in res or []:
            for entry_id, fields in entries:
                out.append((entry_id, json.loads(fields["item"])))
        return out

    async def queue_ack(self, queue: str, item_id: str) -> None:
        c = self._c()
        async with c.pipeline(transaction=False) as p:
            p.xack(self._queue(queue), "workers", item_id)
            p.xdel(self._queue(queue), item_id)
            await self._call(p.execute())

    async def queue_pending(self, queue: str) -> int:
        await self._ensure_group(queue)
        return int(await self._call(self._c().xlen(self._queue(queue))))
