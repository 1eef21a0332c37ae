"""The Redis store's ledger rows: one hash per intent (its JSON, status
and version, compare-and-set by a Lua script), a sorted set of each turn's
keys in the order written, a list of audit rows per key, and a global
index of the rows a worker must act on (``ledger_open``).
"""

from __future__ import annotations

from datetime import datetime

from turn.intents import OPEN, AuditRow, Intent
from turn.redis_connection import RedisConnection
from turn.store import UnknownIntent

_LEDGER_ADD = """
local existing = redis.call('HGET', KEYS[1], 'data')
if existing then return {0, existing} end
redis.call('HSET', KEYS[1], 'data', ARGV[1], 'status', ARGV[2], 'version', ARGV[3])
redis.call('ZADD', KEYS[2], ARGV[4], ARGV[5])
return {1, ARGV[1]}
"""

_LEDGER_REPLACE = """
local version = redis.call('HGET', KEYS[1], 'version')
if not version then return -1 end
if tonumber(version) ~= tonumber(ARGV[3]) - 1 then return 0 end
redis.call('HSET', KEYS[1], 'data', ARGV[1], 'status', ARGV[2], 'version', ARGV[3])
return 1
"""

#: the scripts of ledger rows
LEDGER_LUA = {"ledger_add": _LEDGER_ADD, "ledger_replace": _LEDGER_REPLACE}


class RedisLedgerRows(RedisConnection):
    """The side-effect ledger methods of :class:`turn.store.TurnStore` on Redis."""

    # -- side-effect ledger ----------------------------------------------------

    def _intent(self, turn_id: str, key: str) -> str:
        return f"{self._turn(turn_id)}:intent:{key}"

    def _ledger_open(self) -> str:
        return f"{self.prefix}:ledger_open"

    async def _index_open(self, intent: Intent) -> None:
        """Keep the global index of open rows in step with ``intent``. It
        lives in another hash slot, so it cannot join the row's script: an
        open row is indexed *before* it is written and a resolved one
        unindexed *after*, so a crash in between leaves at worst an index
        entry too many (``ledger_due`` mends those), never an open row
        nobody will find."""
        member = f"{intent.turn_id}|{intent.key}"
        if intent.status in OPEN:
            score = intent.next_attempt_at.timestamp() if intent.next_attempt_at else 0.0
            await self._call(self._c().zadd(self._ledger_open(), {member: score}))
        else:
            await self._call(self._c().zrem(self._ledger_open(), member))

    async def ledger_add(self, intent: Intent) -> tuple[Intent, bool]:
        c = self._c()
        n = await self._call(c.incr(f"{self.prefix}:ledger_seq"))
        if intent.status in OPEN:
            await self._index_open(intent)  # before the row: see _index_open
        created, data = await self._script(
            "ledger_add",
            [self._intent(intent.turn_id, intent.key), f"{self._turn(intent.turn_id)}:ledger"],
            [intent.model_dump_json(), intent.status.value, intent.version, n, intent.key],
        )
        stored = Intent.model_validate_json(data)
        if not created and stored.status not in OPEN:
            await self._index_open(stored)  # our early index entry was for nothing
        return stored, bool(created)

    async def ledger_get(self, key: str) -> Intent:
        turn_id = key.split(":", 1)[0]
        data = await self._call(self._c().hget(self._intent(turn_id, key), "data"))
        if data is None:
            raise UnknownIntent(key)
        return Intent.model_validate_json(data)

    async def ledger_replace(self, intent: Intent) -> bool:
        if intent.status in OPEN:
            await self._index_open(intent)  # before the row: see _index_open
        res = await self._script(
            "ledger_replace",
            [self._intent(intent.turn_id, intent.key)],
            [intent.model_dump_json(), intent.status.value, intent.version],
        )
        if int(res) < 0:
            raise UnknownIntent(intent.key)
        if int(res) == 1 and intent.status not in OPEN:
            await self._index_open(intent)
        return int(res) == 1

    async def ledger_list(self, turn_id: str) -> list[Intent]:
        c = self._c()
        keys = await self._call(c.zrange(f"{self._turn(turn_id)}:ledger", 0, -1))
        if not keys:
            return []
        async with c.pipeline(transaction=False) as p:
            for k in keys:
                p.hget(self._intent(turn_id, k), "data")
            rows = await self._call(p.execute())
        return [Intent.model_validate_json(r) for r in rows if r is not None]

    async def ledger_due(self, now: datetime, limit: int = 100) -> list[Intent]:
        members = await self._call(self._c().zrangebyscore(self._ledger_open(), 0, now.timestamp(), start=0, num=limit))
        out = []
        for m in members:
            turn_id, _, key = m.partition("|")
            data = await self._call(self._c().hget(self._intent(turn_id, key), "data"))
            if data is None:
                continue
            intent = Intent.model_validate_json(data)
            if intent.status in OPEN:
                if intent.next_attempt_at is None or intent.next_attempt_at <= now:
                    out.append(intent)
                else:  # indexed early with another score: mend it
                    await self._index_open(intent)
            else:  # the index lagged behind a change: mend it
                await self._index_open(intent)
        return out

    async def ledger_open_count(self) -> int:
        return int(await self._call(self._c().zcard(self._ledger_open())))

    async def audit_add(self, row: AuditRow) -> None:
        turn_id = row.key.split(":", 1)[0]
        await self._call(self._c().rpush(f"{self._turn(turn_id)}:audit:{row.key}", row.model_dump_json()))

    async def audit_list(self, key: str) -> list[AuditRow]:
        turn_id = key.split(":", 1)[0]
        rows = await self._call(self._c().lrange(f"{self._turn(turn_id)}:audit:{key}", 0, -1))
        return [AuditRow.model_validate_json(r) for r in rows]
