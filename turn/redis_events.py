"""The Redis store's event rows: a session's log is a Redis Stream whose
entry ids are ``0-<seq>``, the sequence taken with HINCRBY on the session
hash in the same script that appends; the seqs withheld by the delivery
gate are a set beside it.
"""

from __future__ import annotations

import json

from turn.models import EventRecord
from turn.redis_connection import RedisConnection
from turn.store import UnknownSession

_APPEND_EVENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local seq = redis.call('HINCRBY', KEYS[1], 'event_seq', 1)
redis.call('XADD', KEYS[2], '0-' .. seq, 'd', ARGV[1])
return seq
"""

#: the scripts of event rows
EVENT_LUA = {"append_event": _APPEND_EVENT}


class RedisEventRows(RedisConnection):
    """The event-log methods of :class:`turn.store.TurnStore` on Redis."""

    # -- event log -------------------------------------------------------------

    async def append_event(self, event: EventRecord) -> EventRecord:
        sk = self._session(event.session_id)
        body = event.model_dump_json(include={"turn_id", "generation", "type", "at", "payload", "fenced"})
        seq = int(await self._script("append_event", [sk, f"{sk}:events"], [body]))
        if seq < 0:
            raise UnknownSession(event.session_id)
        if event.fenced:
            await self._call(self._c().sadd(f"{sk}:fenced", seq))
        return event.model_copy(update={"seq": seq})

    async def read_events(self, session_id: str, after_seq: int = 0, limit: int = 1000) -> list[EventRecord]:
        sk = self._session(session_id)
        c = self._c()
        entries = await self._call(c.xrange(f"{sk}:events", min=f"(0-{after_seq}", max="+", count=limit))
        if not entries:
            return []
        seqs = [int(entry_id.split("-")[1]) for entry_id, _ in entries]
        fenced = await self._call(c.smismember(f"{sk}:fenced", seqs))
        out = []
        for seq, (_, fields), is_fenced in zip(seqs, entries, fenced, strict=True):
            data = json.loads(fields["d"])
            data["fenced"] = bool(is_fenced) or data.get("fenced", False)
            out.append(EventRecord(session_id=session_id, seq=seq, **data))
        return out

    async def mark_fenced(self, session_id: str, seq: int) -> None:
        await self._call(self._c().sadd(f"{self._session(session_id)}:fenced", seq))

    async def wait_events(self, session_id: str, after_seq: int, timeout_s: float) -> bool:
        got = await self._call(
            self._c().xread({f"{self._session(session_id)}:events": f"0-{after_seq}"}, count=1, block=max(1, int(timeout_s * 1000)))
        )
        return bool(got)
