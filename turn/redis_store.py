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
    P:{turn:ID}:ledger       sorted set: the turn's intent keys, by order written
    P:{turn:ID}:intent:KEY   hash: data (the intent as JSON), status, version
    P:{turn:ID}:audit:KEY    list: audit rows (JSON)
    P:ledger_open            sorted set: "TURN|KEY" of intents a worker must act
                             on, scored by next_attempt_at (an index)
    P:queue:NAME             stream, consumer group "workers": downstream work

Durability is Redis' own: run it with AOF (``appendonly yes``) so a restart
keeps what was acknowledged.
"""

from __future__ import annotations

import json
import os
from datetime import datetime
from typing import Any

import redis.asyncio as aioredis
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from turn.intents import OPEN, AuditRow, Intent
from turn.models import (
    TERMINAL_STATUSES, Budget, EventRecord, Session, Spent, StopReason, StopReport, Turn, TurnStatus, Usage,
)
from turn.states import Outcome, TransitionResult, sources_of
from turn.store import (
    MUTABLE_FIELDS,
    DuplicateSession,
    DuplicateTurn,
    IdempotencyConflict,
    StopAnswer,
    StopResult,
    StoreUnavailable,
    UnknownIntent,
    UnknownSession,
    UnknownTurn,
)

_MODEL_FIELDS = {
    "stop_reason": StopReason, "budget": Budget, "spent": Spent, "usage": Usage, "stop_report": StopReport,
}
STOP_REQUEST_TTL_S = 7 * 24 * 3600

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
return 1
"""

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

_TRANSITION = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
local ok = false
for s in string.gmatch(ARGV[2], '[^,]+') do
  if s == status then ok = true end
end
if not ok then return {'rejected', status, redis.call('HGETALL', KEYS[1])} end
redis.call('HSET', KEYS[1], 'status', ARGV[1], 'updated_at', ARGV[3])
if ARGV[6] == '1' then redis.call('HSET', KEYS[1], 'terminal_at', ARGV[3]) end
if ARGV[4] ~= '' then redis.call('HSETNX', KEYS[1], 'stop_reason', ARGV[4]) end
if ARGV[5] ~= '' then redis.call('HSETNX', KEYS[1], 'error', ARGV[5]) end
return {'applied', status, redis.call('HGETALL', KEYS[1])}
"""

_REQUEST_STOP = """
local status = redis.call('HGET', KEYS[1], 'status')
if not status then return {'missing'} end
local seen = redis.call('HGET', KEYS[2], ARGV[1])
if seen then return {'repeat', seen, redis.call('HGETALL', KEYS[1])} end
local answer = 'already_terminal'
local first = '0'
if status == 'RUNNING' then
  redis.call('HSET', KEYS[1], 'status', 'CANCEL_REQUESTED', 'updated_at', ARGV[4])
  redis.call('HSETNX', KEYS[1], 'stop_reason', ARGV[3])
  answer = 'accepted'
  first = '1'
elseif status == 'QUEUED' then
  redis.call('HSET', KEYS[1], 'status', 'CANCELLED', 'updated_at', ARGV[4], 'terminal_at', ARGV[4])
  redis.call('HSETNX', KEYS[1], 'stop_reason', ARGV[3])
  answer = 'accepted'
  first = '1'
elseif status == 'CANCEL_REQUESTED' then
  answer = 'already_stopping'
elseif status == 'RECONCILE_REQUIRED' then
  answer = 'reconcile_required'
end
redis.call('HSET', KEYS[2], ARGV[1], ARGV[2] .. '|' .. answer)
return {answer, first, redis.call('HGETALL', KEYS[1])}
"""

_UPDATE = """
if redis.call('EXISTS', KEYS[1]) == 0 then return {} end
-- ARGV: triples of (op, field, value); op 's' sets, 'd' deletes
local i = 1
while i <= #ARGV do
  if ARGV[i] == 'd' then redis.call('HDEL', KEYS[1], ARGV[i + 1])
  else redis.call('HSET', KEYS[1], ARGV[i + 1], ARGV[i + 2]) end
  i = i + 3
end
return redis.call('HGETALL', KEYS[1])
"""

_HEARTBEAT = """
if redis.call('HGET', KEYS[1], 'lease_owner') ~= ARGV[1] then return 0 end
local status = redis.call('HGET', KEYS[1], 'status')
for s in string.gmatch(ARGV[3], '[^,]+') do
  if s == status then return 0 end
end
redis.call('HSET', KEYS[1], 'heartbeat_at', ARGV[2])
return 1
"""

_BUMP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
"""

_APPEND_EVENT = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
local seq = redis.call('HINCRBY', KEYS[1], 'event_seq', 1)
redis.call('XADD', KEYS[2], '0-' .. seq, 'd', ARGV[1])
return seq
"""


class RedisStore:
    """:class:`turn.store.TurnStore` on Redis (standalone or Cluster).

    Args:
        url: ``redis://host:port/db`` (``rediss://`` for TLS).
        prefix: key prefix, so several deployments (or tests) can share a server.
        client: an existing ``redis.asyncio`` client to use instead of ``url``.
    """

    #: many instances may serve this store
    single_instance = False

    def __init__(self, url: str = "redis://127.0.0.1:6379/0", *, prefix: str = "tk", client: Any = None) -> None:
        self.url = url
        self.prefix = prefix
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
        if self._scripts:
            return
        if self.client is None:
            self.client = aioredis.from_url(self.url, decode_responses=True)
        c = self.client
        self._scripts = {
            name: c.register_script(src)
            for name, src in (
                ("create", _CREATE),
                ("transition", _TRANSITION),
                ("request_stop", _REQUEST_STOP),
                ("update", _UPDATE),
                ("heartbeat", _HEARTBEAT),
                ("bump", _BUMP),
                ("append_event", _APPEND_EVENT),
                ("ledger_add", _LEDGER_ADD),
                ("ledger_replace", _LEDGER_REPLACE),
            )
        }
        await self._call(c.ping())

    async def close(self) -> None:
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

    # -- sessions --------------------------------------------------------------

    async def create_session(self, session: Session) -> Session:
        fields = {
            "id": session.id,
            "tenant_id": session.tenant_id,
            "kind": session.kind.value,
            "generation": str(session.generation),
            "event_seq": "0",
            "created_at": session.created_at.isoformat(),
        }
        created = await self._script("create", [self._session(session.id)], _flat(fields))
        if not created:
            raise DuplicateSession(session.id)
        return session

    async def get_session(self, session_id: str) -> Session:
        h = await self._call(self._c().hgetall(self._session(session_id)))
        if not h:
            raise UnknownSession(session_id)
        return Session(
            id=h["id"], tenant_id=h["tenant_id"], kind=h["kind"], generation=int(h["generation"]),
            created_at=datetime.fromisoformat(h["created_at"]),
        )

    async def next_generation(self, session_id: str) -> int:
        n = int(await self._script("bump", [self._session(session_id)], ["generation"]))
        if n < 0:
            raise UnknownSession(session_id)
        return n

    # -- turns -----------------------------------------------------------------

    async def create(self, turn: Turn) -> Turn:
        created = await self._script("create", [self._turn(turn.id)], _flat(_turn_to_hash(turn)))
        if not created:
            raise DuplicateTurn(turn.id)
        score = turn.created_at.timestamp()
        c = self._c()
        async with c.pipeline(transaction=False) as p:
            p.zadd(f"{self._session(turn.session_id)}:turns", {turn.id: score})
            if not turn.status.is_terminal:
                p.zadd(self._open_index, {turn.id: score})
            await self._call(p.execute())
        return turn

    async def get(self, turn_id: str) -> Turn:
        h = await self._call(self._c().hgetall(self._turn(turn_id)))
        if not h:
            raise UnknownTurn(turn_id)
        return _hash_to_turn(h)

    async def _get_many(self, ids: list[str]) -> list[Turn]:
        if not ids:
            return []
        async with self._c().pipeline(transaction=False) as p:
            for i in ids:
                p.hgetall(self._turn(i))
            hashes = await self._call(p.execute())
        return [_hash_to_turn(h) for h in hashes if h]

    async def list_session(self, session_id: str) -> list[Turn]:
        ids = await self._call(self._c().zrange(f"{self._session(session_id)}:turns", 0, -1))
        return await self._get_many(list(ids))

    async def list_open(self) -> list[Turn]:
        ids = await self._call(self._c().zrange(self._open_index, 0, -1))
        turns = await self._get_many(list(ids))
        done = [t.id for t in turns if t.is_terminal]
        if done:  # the index lags behind a terminal write that crashed mid-way
            await self._call(self._c().zrem(self._open_index, *done))
        return [t for t in turns if not t.is_terminal]

    async def transition(
        self,
        turn_id: str,
        target: TurnStatus,
        *,
        at: datetime,
        stop_reason: StopReason | None = None,
        error: str | None = None,
    ) -> TransitionResult:
        res = await self._script(
            "transition",
            [self._turn(turn_id)],
            [
                target.value,
                ",".join(s.value for s in sources_of(target)),
                at.isoformat(),
                stop_reason.model_dump_json() if stop_reason else "",
                error or "",
                "1" if target.is_terminal else "0",
            ],
        )
        if res[0] == "missing":
            raise UnknownTurn(turn_id)
        turn = _hash_to_turn(_pairs(res[2]))
        previous = TurnStatus(res[1])
        if res[0] == "applied":
            if target.is_terminal:
                await self._call(self._c().zrem(self._open_index, turn_id))
            return TransitionResult(outcome=Outcome.APPLIED, turn=turn, previous=previous)
        outcome = Outcome.ALREADY_TERMINAL if previous.is_terminal else Outcome.CONFLICT
        return TransitionResult(outcome=outcome, turn=turn, previous=previous)

    async def request_stop(
        self, turn_id: str, request_id: str, reason: StopReason, *, at: datetime, fingerprint: str = ""
    ) -> StopResult:
        if "|" in fingerprint:
            raise ValueError("fingerprint must not contain '|'")
        c = self._c()
        index_key = f"{self.prefix}:stopreq:{request_id}"
        mine = f"{turn_id}|{fingerprint}"
        claimed = await self._call(c.set(index_key, mine, nx=True, ex=STOP_REQUEST_TTL_S))
        if not claimed:
            other = await self._call(c.get(index_key))
            if other is not None and other != mine:
                raise IdempotencyConflict(f"request id {request_id!r} was used with other parameters")
        tk = self._turn(turn_id)
        res = await self._script(
            "request_stop", [tk, f"{tk}:stops"], [request_id, fingerprint, reason.model_dump_json(), at.isoformat()]
        )
        if res[0] == "missing":
            raise UnknownTurn(turn_id)
        turn = _hash_to_turn(_pairs(res[2]))
        if res[0] == "repeat":
            seen_fp, _, seen_answer = res[1].rpartition("|")
            if seen_fp != fingerprint:
                raise IdempotencyConflict(f"request id {request_id!r} was used with other parameters")
            return StopResult(answer=StopAnswer(seen_answer), first=False, repeat=True, turn=turn)
        first = res[1] == "1"
        if first and turn.status.is_terminal:
            await self._call(c.zrem(self._open_index, turn_id))
        return StopResult(answer=StopAnswer(res[0]), first=first, repeat=False, turn=turn)

    async def update(self, turn_id: str, *, at: datetime, **fields: Any) -> Turn:
        bad = set(fields) - MUTABLE_FIELDS
        if bad:
            raise ValueError(f"not settable outside a transition: {sorted(bad)}")
        args: list[str] = ["s", "updated_at", at.isoformat()]
        for name, value in fields.items():
            args += ["d", name, ""] if value is None else ["s", name, _encode(value)]
        res = await self._script("update", [self._turn(turn_id)], args)
        if not res:
            raise UnknownTurn(turn_id)
        return _hash_to_turn(_pairs(res))

    async def heartbeat(self, owner: str, turn_ids: list[str], *, at: datetime) -> int:
        terminal = ",".join(s.value for s in TERMINAL_STATUSES)
        renewed = 0
        for turn_id in turn_ids:  # one slot per turn: one script each
            renewed += int(await self._script("heartbeat", [self._turn(turn_id)], [owner, at.isoformat(), terminal]))
        return renewed

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
        for seq, (_, fields), is_fenced in zip(seqs, entries, fenced):
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

    # -- secrets ---------------------------------------------------------------

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

    async def secret(self, name: str) -> bytes:
        key = f"{self.prefix}:secret:{name}"
        c = self._c()
        await self._call(c.set(key, os.urandom(32).hex(), nx=True))
        return bytes.fromhex(await self._call(c.get(key)))


def _flat(d: dict[str, str]) -> list[str]:
    return [x for kv in d.items() for x in kv]


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2]))


def _encode(value: Any) -> str:
    """A (not None) field value as the hash stores it."""
    if hasattr(value, "model_dump_json"):
        return value.model_dump_json()
    if isinstance(value, datetime):
        return value.isoformat()
    if hasattr(value, "value"):  # enums
        return str(value.value)
    return str(value)


def _turn_to_hash(t: Turn) -> dict[str, str]:
    return {name: _encode(getattr(t, name)) for name in Turn.model_fields if getattr(t, name) is not None}


def _hash_to_turn(h: dict[str, str]) -> Turn:
    data: dict[str, Any] = {}
    for name, value in h.items():
        if name in _MODEL_FIELDS:
            data[name] = _MODEL_FIELDS[name].model_validate_json(value)
        elif name in Turn.model_fields:
            data[name] = value
    return Turn.model_validate(data)


__all__ = ["RedisStore", "RedisError"]
