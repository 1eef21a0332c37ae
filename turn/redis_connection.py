"""The Redis store's connection: the client, the key layout's shared
parts, the Lua scripts and the mapping of Redis errors to
:class:`turn.store.StoreUnavailable`.

:class:`RedisConnection` is the base of every part of
:class:`turn.redis_store.RedisStore` (turn rows, event rows, ledger rows,
the work queue); each part brings its Lua scripts, and the store
registers them all (``LUA``) when it opens.
"""

from __future__ import annotations

from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turn.store import StoreUnavailable


class RedisConnection:
    """The connection to Redis (standalone or Cluster).

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS).
        prefix: key prefix, so several deployments (or tests) can share a server.
        client: an existing ``redis.asyncio`` client to use instead of ``url``.
    """

    #: Lua scripts registered on :meth:`open`: name -> source
    LUA: dict[str, str] = {}

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, prefix: str = "tk", client: Any = None) -> None:
        self.url = url
        self.prefix = prefix
        #: work queues whose consumer group exists (:mod:`turn.redis_queue`)
        self._groups: set[str] = set()
        self.client: aioredis.Redis | None = client
        self._own_client = client is None
        self._scripts: dict[str, Any] = {}

    # -- keys ------------------------------------------------------------------

    def _turn(self, turn_id: str) -> str:
        return f"{self.prefix}:{{turn:{turn_id}}}"

    def _session(self, session_id: str) -> str:
        return f"{self.prefix}:{{session:{session_id}}}"

    @property
    def _open_index(self) -> str:
        return f"{self.prefix}:open"

    # -- lifecycle -------------------------------------------------------------

    async def open(self) -> None:
        """Connect (unless given a client), register the Lua scripts and
        ping the server. Idempotent.

        Raises:
            turn.store.StoreUnavailable: the server cannot be reached.
        """
        if self._scripts:
            return
        if self.client is None:
            self.client = aioredis.from_url(self.url, decode_responses=True)
        c = self.client
        self._scripts = {name: c.register_script(src) for name, src in self.LUA.items()}
        await self._call(c.ping())

    async def close(self) -> None:
        """Close the client this store made (a given one is left open). Idempotent."""
        if self.client is not None and self._own_client:
            await self.client.aclose()
            self.client = None
        self._scripts = {}

    def _c(self) -> aioredis.Redis:
        if self.client is None or not self._scripts:
            raise RuntimeError("store is not open")
        return self.client

    async def _call(self, awaitable: Any) -> Any:
        try:
            return await awaitable
        except (RedisConnectionError, RedisTimeoutError, OSError) as exc:
            raise StoreUnavailable(f"redis: {exc}") from exc
        except ResponseError as exc:
            if str(exc).split(" ", 1)[0] in ("BUSY", "LOADING", "TRYAGAIN", "CLUSTERDOWN"):  # not BUSYGROUP
                raise StoreUnavailable(f"redis: {exc}") from exc
            raise

    async def _script(self, name: str, keys: list[str], args: list[Any]) -> Any:
        self._c()
        return await self._call(self._scripts[name](keys=keys, args=args))
