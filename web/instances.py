"""The fleet: each instance registers itself in the store (id, URL, state
serving or draining, open voice sessions, running text turns) with a
heartbeat, and ``GET /v1/admin/instances`` (on any instance) lists the
registrations that are current, so an operator, a load balancer or a client
can see the fleet and send new sessions to serving instances.

The counts are as of the last heartbeat. It is written every
``lease_ttl_s / 3`` and expires after
``lease_ttl_s`` (the turns' lease rule: an instance that stops heartbeating
is gone for the fleet as its turns are for the sweeper); a drain writes one
at once, so the fleet sees ``draining`` within a round trip; a clean exit
removes the registration.
"""

from __future__ import annotations

import asyncio
import logging
import socket
from collections.abc import AsyncIterator
from datetime import datetime
from typing import Any

from aiohttp import web

from clock import timeout_after
from turn.models import InstanceInfo
from web.auth import require_admin
from web.drain import ADMIN_SECURITY, DRAIN
from web.errors import openapi_error
from web.state import CLOCK, MANAGER, PEERS, SETTINGS, STORE, TEXT_TURNS

log = logging.getLogger(__name__)


def advertised_url(host: str, port: int, configured: str) -> str:
    """Where this instance is reached: ``configured`` (``advertise_url``),
    else ``http://<host>:<port>`` (the host name when it listens on every
    address)."""
    if configured:
        return configured.rstrip("/")
    shown = socket.gethostname() if host in ("0.0.0.0", "::", "") else host
    return f"http://{shown}:{port}"


class Registration:
    """This instance's registration in the store (see the module doc).

    Args:
        app: the application (its store, manager, sessions, turns, drain).
        started_at: when the instance started, UTC.
    """

    def __init__(self, app: web.Application, started_at: datetime) -> None:
        self.app = app
        self.started_at = started_at

    def info(self) -> InstanceInfo:
        """The registration as of now."""
        app = self.app
        s = app[SETTINGS]
        return InstanceInfo(
            id=app[MANAGER].owner, url=advertised_url(s.host, s.port, s.advertise_url),
            state="draining" if app[DRAIN].draining else "serving", voice_sessions=len(app[PEERS]),
            text_turns=app[TEXT_TURNS].running_count(), started_at=self.started_at, heartbeat_at=app[CLOCK].now(),
        )

    async def beat(self) -> None:
        """Write the registration now (a failure is logged: the next beat retries)."""
        manager = self.app[MANAGER]
        try:
            await manager.store_call(lambda: self.app[STORE].instance_heartbeat(self.info(), manager.lease_ttl_s))
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("instance registration not written: %s", exc)

    async def run(self) -> None:
        """Beat every ``lease_ttl_s / 3`` of the clock, and at once when the
        drain starts, until cancelled."""
        clock, every = self.app[CLOCK], self.app[MANAGER].lease_ttl_s / 3
        began = self.app[DRAIN].began
        while True:
            await self.beat()
            if began.is_set():
                await clock.sleep(every)
                continue
            try:  # the next beat on time, or at once when the drain begins
                async with timeout_after(clock, every):
                    await began.wait()
            except TimeoutError:
                pass


async def registered(app: web.Application) -> AsyncIterator[None]:
    """Cleanup context: register while serving; unregister on the way out."""
    reg = Registration(app, app[CLOCK].now())
    task = asyncio.get_running_loop().create_task(reg.run(), name="instance-heartbeat")
    try:
        yield
    finally:
        task.cancel()
        await asyncio.wait({task})
        try:
            await app[STORE].instance_remove(app[MANAGER].owner)
        except Exception as exc:  # the store may be gone: the registration expires on its own
            log.warning("instance registration not removed: %s", exc)


async def list_instances(request: web.Request) -> web.Response:
    """``GET /v1/admin/instances``: ``{"instances": [...]}`` current in the
    store, each an :class:`turn.models.InstanceInfo` (with SQLite, one
    process serves the file: this one).

    Raises:
        ApiError: 401 without the admin token (or, unset, off loopback).
    """
    require_admin(request)
    app = request.app
    found = await app[MANAGER].store_call(lambda: app[STORE].instance_list(app[CLOCK].now()))
    return web.json_response({"instances": [i.model_dump(mode="json") for i in found]})


#: the OpenAPI paths of this module (merged into web.openapi's document)
OPENAPI_PATHS: dict[str, Any] = {
    "/v1/admin/instances": {"get": {
        "summary": "The fleet: the instances registered in the store with a current heartbeat",
        "operationId": "adminInstances",
        "description": "Needs Authorization: Bearer <admin_token>; without admin_token set, loopback clients only.",
        "security": ADMIN_SECURITY,
        "responses": {
            "200": {"description": "the current registrations", "content": {"application/json": {"schema": {
                "type": "object", "required": ["instances"], "properties": {"instances": {
                    "type": "array", "items": {"$ref": "#/components/schemas/InstanceInfo"}}}}}}},
            "401": openapi_error("not the admin token (or, admin_token unset, not a loopback client)"),
            "503": openapi_error("the store is unavailable (store_unavailable)", retry_after=True)}}},
}
#: the component schemas :data:`OPENAPI_PATHS` refers to
OPENAPI_SCHEMAS: dict[str, Any] = {"InstanceInfo": InstanceInfo.model_json_schema(mode="serialization")}


def add_routes(app: web.Application) -> None:
    """The listing (the registration is :func:`registered`, a cleanup
    context the app enters once its store is open)."""
    app.router.add_get("/v1/admin/instances", list_instances)
