"""The Redis store's turn rows: sessions, turns, stop requests and
leases' heartbeats. Every state change of a turn is one Lua script on the
turn's own hash-tagged keys, so it is atomic and touches one hash slot;
generations come from HINCRBY on the session hash.
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

from pydantic import BaseModel

from turn.models import (
    TERMINAL_STATUSES,
    Budget,
    Session,
    Spent,
    StopReason,
    StopReport,
    Turn,
    TurnStatus,
    Usage,
)
from turn.redis_connection import RedisConnection
from turn.states import Outcome, TransitionResult, sources_of
from turn.store import (
    MUTABLE_FIELDS,
    DuplicateSession,
    DuplicateTurn,
    IdempotencyConflict,
    LeaseLost,
    StopAnswer,
    StopResult,
    UnknownSession,
    UnknownTurn,
)

_MODEL_FIELDS: dict[str, type[BaseModel]] = {
    "stop_reason": StopReason, "budget": Budget, "spent": Spent, "usage": Usage, "stop_report": StopReport,
}
#: how long a stop request id is remembered across turns, s (7 days)
STOP_REQUEST_TTL_S = 7 * 24 * 3600

_CREATE = """
if redis.call('EXISTS', KEYS[1]) == 1 then return 0 end
redis.call('HSET', KEYS[1], unpack(ARGV))
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
-- ARGV: triples of (op, field, value); op 's' sets, 'd' deletes; a first
-- 'f' triple fences: nothing is written unless the field holds the value
local i = 1
if ARGV[1] == 'f' then
  local holder = redis.call('HGET', KEYS[1], ARGV[2]) or ''
  if holder ~= ARGV[3] then return {'__lease_lost__', holder} end
  i = 4
end
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

_TAKE_OVER = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
if redis.call('HGET', KEYS[1], 'status') ~= ARGV[1] then return 0 end
if (redis.call('HGET', KEYS[1], 'lease_owner') or '') ~= ARGV[2] then return 0 end
if (redis.call('HGET', KEYS[1], 'heartbeat_at') or '') ~= ARGV[3] then return 0 end
redis.call('HSET', KEYS[1], 'lease_owner', ARGV[4], 'heartbeat_at', ARGV[5], 'updated_at', ARGV[5])
return 1
"""

_BUMP = """
if redis.call('EXISTS', KEYS[1]) == 0 then return -1 end
return redis.call('HINCRBY', KEYS[1], ARGV[1], 1)
"""

#: the scripts of turn and session rows
TURN_LUA = {
    "create": _CREATE,
    "transition": _TRANSITION,
    "request_stop": _REQUEST_STOP,
    "update": _UPDATE,
    "heartbeat": _HEARTBEAT,
    "take_over": _TAKE_OVER,
    "bump": _BUMP,
}


class RedisTurnRows(RedisConnection):
    """The session and turn methods of :class:`turn.store.TurnStore` on Redis."""

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

    async def update(self, turn_id: str, *, at: datetime, fence_owner: str | None = None, **fields: Any) -> Turn:
        bad = set(fields) - MUTABLE_FIELDS
        if bad:
            raise ValueError(f"not settable outside a transition: {sorted(bad)}")
        args: list[str] = ["f", "lease_owner", fence_owner] if fence_owner is not None else []
        args += ["s", "updated_at", at.isoformat()]
        for name, value in fields.items():
            args += ["d", name, ""] if value is None else ["s", name, _encode(value)]
        res = await self._script("update", [self._turn(turn_id)], args)
        if not res:
            raise UnknownTurn(turn_id)
        if res[0] == "__lease_lost__":
            raise LeaseLost(turn_id, res[1] or None)
        return _hash_to_turn(_pairs(res))

    async def heartbeat(self, owner: str, turn_ids: list[str], *, at: datetime) -> int:
        terminal = ",".join(s.value for s in TERMINAL_STATUSES)
        renewed = 0
        for turn_id in turn_ids:  # one slot per turn: one script each
            renewed += int(await self._script("heartbeat", [self._turn(turn_id)], [owner, at.isoformat(), terminal]))
        return renewed

    async def take_over(
        self, turn_id: str, owner: str, *, expect_owner: str | None, expect_heartbeat: datetime | None, at: datetime
    ) -> bool:
        got = int(await self._script("take_over", [self._turn(turn_id)], [
            TurnStatus.RUNNING.value, expect_owner or "", expect_heartbeat.isoformat() if expect_heartbeat else "",
            owner, at.isoformat(),
        ]))
        if got < 0:
            raise UnknownTurn(turn_id)
        return got == 1


def _flat(d: dict[str, str]) -> list[str]:
    return [x for kv in d.items() for x in kv]


def _pairs(flat: list[str]) -> dict[str, str]:
    return dict(zip(flat[::2], flat[1::2], strict=True))


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
