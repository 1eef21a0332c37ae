"""Redis store: the authority when many instances serve one deployment.

redis-py's asyncio client. Every state change of a turn is one Lua script on
the turn's own keys, so it is atomic; keys are hash-tagged per turn
(``{turn:ID}``) and per session (``{session:ID}``) so each script touches one
hash slot and the store works on Redis Cluster. Generations and event
sequence numbers come from HINCRBY on the session hash; the event log of a
session is a Redis Stream whose entry ids are ``0-<seq>``.

Key layout (``P`` is the configurable prefix, default ``tk``)::

    P:{turn:ID}              hash: the turn's fields (JSON for nested ones)
    P:{turn:ID}:stops        hash: request id -> "fingerprint|answer"
    P:{session:ID}           hash: tenant_id, kind, generation, event_seq, created_at
    P:{session:ID}:turns     sorted set: turn ids by creation time
    P:{session:ID}:events    stream: the event log, ids 0-1, 0-2, ...
    P:{session:ID}:fenced    set: seqs withheld by the delivery gate
    P:open                   sorted set: turns not yet terminal (an index)
    P:stopreq:REQUEST_ID     string: "turn_id|fingerprint", 7 days, to refuse
                             a request id reused on another turn
    P:secret:NAME            string: shared random secrets
    P:instance:ID            string: an instance's registration (JSON), expiring
    P:instances              sorted set: instance ids by registration expiry
    P:device:ID              hash: tenant_id, token_hash, created_at, revoked
    P:devtoken:HASH          string: the device id of a token's hash (deleted on revoke)
    P:clienttoken:HASH       string: a client token's grant (JSON), expiring with it;
                             claimed with GETDEL (single use)
    P:claim:KEY              string: a credential used once (SET NX), expiring with it
    P:{turn:ID}:ledger       sorted set: the turn's intent keys, by order written
    P:{turn:ID}:intent:KEY   hash: data (the intent as JSON), status, version
    P:{turn:ID}:audit:KEY    list: audit rows (JSON)
    P:ledger_open            sorted set: "TURN|KEY" of intents a worker must act
                             on, scored by next_attempt_at (an index)
    P:queue:NAME             stream, consumer group "workers": downstream work

Durability is Redis' own: run it with AOF (``appendonly yes``) so a restart
keeps what was acknowledged.

The store's parts: the connection and script registry
(:mod:`turn.redis_connection`), turn rows (:mod:`turn.redis_turns`), event
rows (:mod:`turn.redis_events`), ledger rows (:mod:`turn.redis_ledger`) and
the work queue (:mod:`turn.redis_queue`).
"""

from __future__ import annotations

import os
from datetime import datetime

from turn.models import InstanceInfo
from turn.redis_events import EVENT_LUA, RedisEventRows
from turn.redis_ledger import LEDGER_LUA, RedisLedgerRows
from turn.redis_queue import RedisWorkQueue
from turn.redis_turns import TURN_LUA, RedisTurnRows


class RedisStore(RedisTurnRows, RedisEventRows, RedisLedgerRows, RedisWorkQueue):
    """:class:`turn.store.TurnStore` on Redis (standalone or Cluster).

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS).
        prefix: key prefix, so several deployments (or tests) can share a server.
        client: an existing ``redis.asyncio`` client to use instead of ``url``.
    """

    #: many instances may serve this store
    single_instance = False

    LUA = {**TURN_LUA, **EVENT_LUA, **LEDGER_LUA}

    # -- the fleet ------------------------------------------------------------------

    async def instance_heartbeat(self, info: InstanceInfo, ttl_s: float) -> None:
        c = self._c()
        expires = info.heartbeat_at.timestamp() + ttl_s
        await self._call(c.set(f"{self.prefix}:instance:{info.id}", info.model_dump_json(), px=max(1, int(ttl_s * 1000))))
        await self._call(c.zadd(f"{self.prefix}:instances", {info.id: expires}))

    async def instance_list(self, now: datetime) -> list[InstanceInfo]:
        c = self._c()
        index = f"{self.prefix}:instances"
        await self._call(c.zremrangebyscore(index, "-inf", now.timestamp()))  # expired: forget
        ids = await self._call(c.zrangebyscore(index, now.timestamp(), "+inf"))
        out = []
        for instance_id in sorted(ids):
            raw = await self._call(c.get(f"{self.prefix}:instance:{instance_id}"))
            if raw is not None:
                out.append(InstanceInfo.model_validate_json(raw))
        return out

    async def instance_remove(self, instance_id: str) -> None:
        c = self._c()
        await self._call(c.delete(f"{self.prefix}:instance:{instance_id}"))
        await self._call(c.zrem(f"{self.prefix}:instances", instance_id))

    # -- shared secrets --------------------------------------------------------

    async def secret(self, name: str) -> bytes:
        key = f"{self.prefix}:secret:{name}"
        c = self._c()
        await self._call(c.set(key, os.urandom(32).hex(), nx=True))
        return bytes.fromhex(await self._call(c.get(key)))

    # -- device tokens ------------------------------------------------------------

    async def device_add(self, device_id: str, tenant_id: str, token_hash: str, created_at: datetime) -> None:
        c = self._c()
        if not await self._call(c.set(f"{self.prefix}:devtoken:{token_hash}", device_id, nx=True)):
            raise ValueError("that token exists already")
        created = await self._call(c.hsetnx(f"{self.prefix}:device:{device_id}", "tenant_id", tenant_id))
        if not created:
            await self._call(c.delete(f"{self.prefix}:devtoken:{token_hash}"))
            raise ValueError(f"device {device_id!r} exists already")
        await self._call(c.hset(f"{self.prefix}:device:{device_id}", mapping={
            "token_hash": token_hash, "created_at": created_at.isoformat(), "revoked": "0",
        }))

    async def device_by_token(self, token_hash: str) -> tuple[str, str] | None:
        c = self._c()
        device_id = await self._call(c.get(f"{self.prefix}:devtoken:{token_hash}"))
        if device_id is None:
            return None
        tenant, stored, revoked = await self._call(
            c.hmget(f"{self.prefix}:device:{device_id}", ["tenant_id", "token_hash", "revoked"])
        )
        if tenant is None or stored != token_hash or revoked != "0":
            return None
        return device_id, tenant

    async def device_revoke(self, device_id: str, tenant_id: str) -> bool:
        c = self._c()
        key = f"{self.prefix}:device:{device_id}"
        tenant, token_hash, revoked = await self._call(c.hmget(key, ["tenant_id", "token_hash", "revoked"]))
        if tenant != tenant_id or revoked != "0":
            return False
        # the flag first: a lookup between the two writes already refuses the token
        await self._call(c.hset(key, "revoked", "1"))
        await self._call(c.delete(f"{self.prefix}:devtoken:{token_hash}"))
        return True

    # -- client tokens ---------------------------------------------------------------

    async def client_token_put(self, token_hash: str, grant: str, expires_at: datetime, now: datetime) -> None:
        at_ms = int(expires_at.timestamp() * 1000)
        # Redis forgets it after the grant's lifetime on its own clock (+1 s)
        ttl_ms = max(1, int((expires_at - now).total_seconds() * 1000)) + 1000
        await self._call(self._c().set(f"{self.prefix}:clienttoken:{token_hash}", f"{at_ms}|{grant}", px=ttl_ms))

    async def client_token_claim(self, token_hash: str, now: datetime) -> str | None:
        raw = await self._call(self._c().getdel(f"{self.prefix}:clienttoken:{token_hash}"))
        if raw is None:
            return None
        at_ms, _, grant = str(raw).partition("|")
        # Redis expires keys on its own clock; ours decides (virtual time in tests)
        if not at_ms.isdigit() or int(at_ms) <= now.timestamp() * 1000:
            return None
        return grant

    async def claim_once(self, key: str, expires_at: datetime, now: datetime) -> bool:
        ttl_ms = max(1, int((expires_at - now).total_seconds() * 1000))
        return bool(await self._call(self._c().set(f"{self.prefix}:claim:{key}", "1", nx=True, px=ttl_ms)))

