"""Rate limits and quotas per tenant and per client address (env
``TURNKEEPER_LIMITS__*``, TOML ``[limits]``; README "Rate limits and quotas").

What is limited, each per tenant and per client address (the TCP peer's
address, ``request.remote``):

- **session starts** a minute: WebRTC offers (``POST /v1/webrtc/offer``),
  phone streams (their WebSocket upgrade per address; their tenant once
  ``start`` names it) and device sockets;
- **concurrent voice sessions** (every transport's, in ``app[PEERS]``),
  beside the server's ``max_sessions`` (:mod:`web.admission`);
- **text turns** a minute (``POST /v1/turns``);
- **stop requests** a second (``POST /v1/turns/{id}/stop``): the first stop
  of the tenant's own open turn always passes (it spends a token if one is
  left); repeats, stops of other ids or of ended turns are refused beyond
  the rate;
- **socket messages** a second, summed over a tenant's or an address's
  connections (device sockets, WebRTC data channels; phone streams per
  tenant only, as every call of a provider comes from its few addresses),
  beside each connection's own limit (``telephony.max_messages_per_s``,
  ``devices.max_messages_per_s``, ``limits.datachannel_messages_per_s``).

Each rate is a token bucket (:class:`web.rate_limit.TokenBucket`) holding
its whole allowance at once (a minute's or a second's worth) and refilling
at the rate; a limit of 0 is unlimited. Over a limit, HTTP answers 429
``rate_limited`` with ``Retry-After``: the seconds until the bucket has a
token again, rounded up, at least 1. Sockets are closed 1008 (policy
violation; a device is told first), a data channel gets an ``error`` event
``rate_limited`` and the message is dropped. A refusal spends nothing and
creates nothing. Buckets live per key in a table of at most ``max_keys``
keys: idle full buckets are forgotten (a new one starts full, so nothing is
lost), and at the cap the least recently used is forgotten, so a flood of
distinct addresses cannot exhaust memory (it can at worst forget an idle
address's debt; the tenant's bucket still holds).
"""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterable
from typing import Literal

from pydantic import BaseModel, Field

from clock import Clock
from web.errors import ApiError
from web.rate_limit import TokenBucket
from web.state import ClientSession

#: what is rate-limited (see the module doc)
Kind = Literal["session_start", "turn", "stop", "message"]
#: idle full buckets looked at (and forgotten) per use of a table: amortised eviction, no scans
EVICT_PER_USE = 2
#: Retry-After of a refused session over a concurrency quota, s (a session lasts minutes)
SESSIONS_RETRY_AFTER_S = 5


class LimitSettings(BaseModel):
    """Rate limits and quotas (env ``TURNKEEPER_LIMITS__*``). A rate of 0
    is unlimited; each bucket holds its whole allowance (a minute's or a
    second's worth) at once.

    Attributes:
        session_starts_per_min_per_tenant: voice sessions a tenant may
            start a minute (WebRTC offers, phone streams, device sockets).
        session_starts_per_min_per_client: the same from one client address.
        sessions_per_tenant: concurrent voice sessions of one tenant (0:
            only ``max_sessions`` holds).
        sessions_per_client: concurrent voice sessions from one client
            address (0: only ``max_sessions`` holds).
        turns_per_min_per_tenant: text turns (``POST /v1/turns``) a tenant
            may start a minute.
        turns_per_min_per_client: the same from one client address.
        stops_per_s_per_tenant: stop requests a second of one tenant (the
            first stop of its own open turn always passes).
        stops_per_s_per_client: the same from one client address.
        datachannel_messages_per_s: messages a second one WebRTC data
            channel may send (a ping now and then, push-to-talk).
        messages_per_s_per_tenant: socket messages a second of all of a
            tenant's connections together (phone streams, devices, data
            channels; 20 ms phone audio is 50 a call).
        messages_per_s_per_client: the same from one client address
            (devices and data channels; not phone streams, whose calls all
            come from the provider's addresses).
        max_keys: tenants or addresses remembered per limit, entries; at
            the cap the least recently used is forgotten.
    """

    session_starts_per_min_per_tenant: float = Field(600, ge=0, le=1_000_000)
    session_starts_per_min_per_client: float = Field(120, ge=0, le=1_000_000)
    sessions_per_tenant: int = Field(0, ge=0, le=100_000)
    sessions_per_client: int = Field(0, ge=0, le=100_000)
    turns_per_min_per_tenant: float = Field(600, ge=0, le=1_000_000)
    turns_per_min_per_client: float = Field(300, ge=0, le=1_000_000)
    stops_per_s_per_tenant: float = Field(200, ge=0, le=1_000_000)
    stops_per_s_per_client: float = Field(100, ge=0, le=1_000_000)
    datachannel_messages_per_s: float = Field(50, ge=0, le=100_000)
    messages_per_s_per_tenant: float = Field(20_000, ge=0, le=10_000_000)
    messages_per_s_per_client: float = Field(5_000, ge=0, le=10_000_000)
    max_keys: int = Field(10_000, ge=1, le=10_000_000)


class BucketTable:
    """A token bucket per key (a tenant, an address), at most ``max_keys``.

    Args:
        rate_per_s: tokens a second of each key's bucket (> 0).
        burst: tokens each holds at most and at the start (>= 1).
        max_keys: keys kept at most (>= 1).

    Raises:
        ValueError: a rate that is not positive, a burst below 1, or no keys.
    """

    def __init__(self, rate_per_s: float, burst: float, max_keys: int) -> None:
        TokenBucket(rate_per_s, burst)  # raises on bad limits
        if max_keys < 1:
            raise ValueError(f"need max_keys >= 1, got {max_keys}")
        self.rate_per_s = rate_per_s
        self.burst = burst
        self.max_keys = max_keys
        self._buckets: OrderedDict[str, TokenBucket] = OrderedDict()  # least recently used first

    def __len__(self) -> int:
        return len(self._buckets)

    def wait_s(self, key: str, now: float) -> float:
        """Seconds from clock seconds ``now`` until ``key`` may go (0.0: now);
        nothing spent, nothing created."""
        bucket = self._buckets.get(key)
        return 0.0 if bucket is None else bucket.wait_s(now)

    def take(self, key: str, now: float) -> bool:
        """Spend one of ``key``'s tokens at ``now``; False (nothing spent)
        when none is left."""
        self._evict(now)
        bucket = self._buckets.get(key)
        if bucket is None:
            if len(self._buckets) >= self.max_keys:
                self._buckets.popitem(last=False)  # the least recently used
            bucket = self._buckets[key] = TokenBucket(self.rate_per_s, self.burst)
        else:
            self._buckets.move_to_end(key)
        return bucket.take(now)

    def _evict(self, now: float) -> None:
        """Forget up to :data:`EVICT_PER_USE` of the least recently used
        buckets if they are full again (idle long enough)."""
        for _ in range(EVICT_PER_USE):
            oldest = next(iter(self._buckets.items()), None)
            if oldest is None or not oldest[1].full(now):
                return
            del self._buckets[oldest[0]]


def _per_s(amount: float, per_min: bool) -> tuple[float, float]:
    """(rate a second, burst) of an allowance of ``amount`` a minute or a second."""
    return (amount / 60 if per_min else amount), max(1.0, amount)


class Limits:
    """Every per-tenant and per-address limit of one server (see the module doc).

    Args:
        settings: the limits.
        clock: the injected clock (buckets run on its ``monotonic`` seconds).
    """

    def __init__(self, settings: LimitSettings, clock: Clock) -> None:
        self.settings = settings
        self.clock = clock
        s = settings
        allowances: dict[Kind, tuple[float, float, bool]] = {
            "session_start": (s.session_starts_per_min_per_tenant, s.session_starts_per_min_per_client, True),
            "turn": (s.turns_per_min_per_tenant, s.turns_per_min_per_client, True),
            "stop": (s.stops_per_s_per_tenant, s.stops_per_s_per_client, False),
            "message": (s.messages_per_s_per_tenant, s.messages_per_s_per_client, False),
        }
        #: (kind, "tenant" or "client") -> its table; absent: unlimited
        self.tables: dict[tuple[Kind, str], BucketTable] = {}
        for kind, (tenant_amount, client_amount, per_min) in allowances.items():
            for scope, amount in (("tenant", tenant_amount), ("client", client_amount)):
                if amount > 0:
                    self.tables[(kind, scope)] = BucketTable(*_per_s(amount, per_min), s.max_keys)

    def _tables_for(self, kind: Kind, tenant: str | None, client: str | None) -> list[tuple[BucketTable, str]]:
        out = []
        for scope, key in (("tenant", tenant), ("client", client)):
            table = self.tables.get((kind, scope))
            if table is not None and key is not None:
                out.append((table, key))
        return out

    def wait_s(self, kind: Kind, *, tenant: str | None = None, client: str | None = None) -> float:
        """Seconds until one ``kind`` for ``tenant`` from ``client`` would
        pass (0.0: now); nothing spent."""
        now = self.clock.monotonic()
        return max((table.wait_s(key, now) for table, key in self._tables_for(kind, tenant, client)), default=0.0)

    def take(self, kind: Kind, *, tenant: str | None = None, client: str | None = None) -> float:
        """One ``kind`` for ``tenant`` and from ``client`` (None: that scope is
        not counted): 0.0 if every bucket had a token (each spent), else the
        seconds until all will have one (nothing spent)."""
        now = self.clock.monotonic()
        found = self._tables_for(kind, tenant, client)
        wait = max((table.wait_s(key, now) for table, key in found), default=0.0)
        if wait > 0:
            return wait
        for table, key in found:
            table.take(key, now)
        return 0.0

    def allows(self, kind: Kind, *, tenant: str | None = None, client: str | None = None) -> bool:
        """:meth:`take`, as a yes (spent) or no (nothing spent)."""
        return self.take(kind, tenant=tenant, client=client) == 0.0

    def spend(self, kind: Kind, *, tenant: str | None = None, client: str | None = None) -> None:
        """Spend a token of each bucket that has one, refusing nothing (a
        request that always passes still counts towards a flood)."""
        now = self.clock.monotonic()
        for table, key in self._tables_for(kind, tenant, client):
            table.take(key, now)

    def require(self, kind: Kind, *, tenant: str | None = None, client: str | None = None) -> None:
        """:meth:`take`, refusing over the limit.

        Raises:
            ApiError: 429 ``rate_limited`` with ``Retry-After`` (whole
                seconds until a token, at least 1).
        """
        wait = self.take(kind, tenant=tenant, client=client)
        if wait > 0:
            raise rate_limited(f"too many {_WHAT[kind]}; try again in {wait:.1f} s", wait)

    def check_sessions(self, sessions: Iterable[ClientSession], tenant: str | None, client: str | None) -> None:
        """Refuse one more voice session over ``sessions_per_tenant`` of
        ``tenant`` or ``sessions_per_client`` from ``client`` (0: no quota;
        None: that scope is not checked). ``sessions``: the others running.

        Raises:
            ApiError: 429 ``rate_limited``, ``Retry-After`` 5 s.
        """
        s = self.settings
        of_tenant = of_client = 0
        for session in sessions:
            of_tenant += tenant is not None and session.tenant == tenant
            of_client += client is not None and session.client == client
        if s.sessions_per_tenant and of_tenant >= s.sessions_per_tenant:
            raise rate_limited(f"your tenant has {s.sessions_per_tenant} voice sessions running; end one or wait",
                               SESSIONS_RETRY_AFTER_S)
        if s.sessions_per_client and of_client >= s.sessions_per_client:
            raise rate_limited(f"{s.sessions_per_client} voice sessions from your address are running; end one or wait",
                               SESSIONS_RETRY_AFTER_S)


_WHAT: dict[Kind, str] = {
    "session_start": "voice sessions started", "turn": "turns started", "stop": "stop requests",
    "message": "messages",
}


def retry_after(wait_s: float) -> str:
    """``Retry-After`` of a wait of ``wait_s`` seconds: whole seconds, rounded up, at least 1."""
    return str(max(1, math.ceil(wait_s - 1e-9)))  # 2.0000000001 s of float error is 2 s


def rate_limited(message: str, wait_s: float) -> ApiError:
    """The 429 ``rate_limited`` answer, ``Retry-After`` from ``wait_s`` seconds."""
    return ApiError(429, "rate_limited", message, headers={"Retry-After": retry_after(wait_s)})
