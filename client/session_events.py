"""What the simulated calls share (:mod:`client.phone_call`,
:mod:`client.device_call`): the session's event log followed over the REST
API into the turns the caller saw, and the end of the agent's sound told
from a silent run when no protocol message marks it.

The event log is ``GET /v1/sessions/{id}/events`` (SSE) with a bearer token
of the session's tenant; each event's ``at`` (Unix seconds) is put on this
process's monotonic clock, so it lines up with what the simulator logged.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import Coroutine
from typing import Any

import aiohttp

from client.phone import SILENCE_DBFS, HeardFrame
from client.results import BargeInMeasure, CallError, TurnView, track_turn

log = logging.getLogger(__name__)

SILENT_RUN_MS = 500  # without a protocol marker: the agent counts as stopped once silent this long
NO_SPEECH_S = 5.0
TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "RECONCILE_REQUIRED"}


class SessionEvents:
    """Follows one session's event log (a mixin of the simulated call
    clients: ``base_url``, ``token`` and ``session_id`` are theirs)."""

    base_url: str
    token: str | None
    session_id: str

    def _init_events(self) -> None:
        self._turns: dict[str, TurnView] = {}
        self._events: list[dict[str, Any]] = []
        self._event_times: list[tuple[float, dict[str, Any]]] = []
        self._event_cond = asyncio.Condition()
        self._wall_offset = time.time() - time.monotonic()  # server "at" (Unix s) -> our clock
        #: the event stream has answered 404 since this clock time (None: it has not, or no longer)
        self._events_missing_since: float | None = None

    @property
    def following(self) -> bool:
        """The session's events can be read (a token and a session id)."""
        return bool(self.token and self.session_id)

    async def _follow(self, http: aiohttp.ClientSession) -> None:
        """Read the session's event log (SSE) into turns and timed events;
        retries while the session is not there yet."""
        url = f"{self.base_url}/v1/sessions/{self.session_id}/events"
        headers = {"Authorization": f"Bearer {self.token}"}
        after = 0
        while True:
            try:
                async with http.get(url, headers=headers, params={"after_seq": str(after)} if after else None,
                                    timeout=aiohttp.ClientTimeout(total=None, sock_read=None)) as resp:
                    if resp.status == 404:
                        # not there yet (a phone stream's session starts at its
                        # ``start``), or not this token's tenant's
                        if self._events_missing_since is None:
                            self._events_missing_since = time.monotonic()
                        await asyncio.sleep(0.05)
                        continue
                    self._events_missing_since = None
                    if resp.status != 200:
                        log.warning("events of %s: HTTP %s", self.session_id, resp.status)
                        return
                    async for raw in resp.content:
                        line = raw.decode().strip()
                        if line.startswith("data:"):
                            ev = json.loads(line[5:])
                            if isinstance(ev.get("seq"), int):
                                after = ev["seq"]
                                await self._on_event(ev)
            except (aiohttp.ClientError, OSError) as exc:
                log.info("events of %s: %s; following again", self.session_id, exc)
                await asyncio.sleep(0.1)

    async def _on_event(self, ev: dict[str, Any]) -> None:
        at = ev["at"] - self._wall_offset if isinstance(ev.get("at"), int | float) else time.monotonic()
        self._events.append(ev)
        self._event_times.append((at, ev))
        track_turn(self._turns, ev)
        async with self._event_cond:
            self._event_cond.notify_all()

    @staticmethod
    def _verdict_until(measures: list[BargeInMeasure], i: int, wait_s: float) -> float:
        """The end of the window in which events count as about
        ``measures[i]``: ``wait_s`` after it was sent, or when the next one was."""
        m = measures[i]
        assert m.sent_from is not None
        until = (m.sent_until or m.sent_from) + wait_s
        nxt = measures[i + 1].sent_from if i + 1 < len(measures) else None
        return until if nxt is None else min(until, nxt)

    def _judge_by_events(self, m: BargeInMeasure, until: float) -> float | None:
        """Fill ``m``'s server verdict from the events between its sending
        and ``until`` (clock s): committed barge-in (and its fence time,
        returned; None if none), onset to fence, the old turn, or the
        pause it made resuming (``false_interruption`` / ``backchannel``)."""
        assert m.sent_from is not None
        fence_at: float | None = None
        for at, ev in self._event_times:
            if not m.sent_from <= at <= until:
                continue
            if ev.get("type") == "barge_in" and not m.barged_in:
                m.barged_in, fence_at = True, at
                m.server_onset_to_fence_ms = ev.get("onset_to_fence_ms")
                m.old_turn_id = ev.get("old_turn_id")
            elif ev.get("type") in ("false_interruption", "backchannel") and m.resumed is None:
                m.resumed = ev["type"]
        return fence_at

    def _interrupted(self, m: BargeInMeasure) -> None:
        """What the server counted of ``m``'s interrupted reply (its
        ``agent.interrupted`` event: played_ms and the heard text)."""
        for ev in self._events:
            if ev.get("type") == "agent.interrupted" and ev.get("turn_id") == m.old_turn_id:
                m.server_played_ms, m.server_heard = ev.get("played_ms"), ev.get("heard")

    def _all_terminal(self) -> bool:
        return bool(self._turns) and all(t.status in TERMINAL for t in self._turns.values())

    async def _wait_all_terminal(self) -> None:
        async with self._event_cond:
            await self._event_cond.wait_for(self._all_terminal)

    async def _expect_a_turn(self) -> None:
        """Raises CallError when no turn starts within ``NO_SPEECH_S``
        (nothing to wait for without the events): the event stream still
        answering 404 then (a token of another tenant), else no speech."""
        if not self.following:
            return
        try:
            async with asyncio.timeout(NO_SPEECH_S):
                async with self._event_cond:
                    await self._event_cond.wait_for(lambda: bool(self._turns))
        except TimeoutError:
            if self._events_missing_since is not None:
                raise CallError(
                    f"cannot read the events of session {self.session_id}: HTTP 404 for "
                    f"{time.monotonic() - self._events_missing_since:.0f} s (is the token one of the call's tenant?)"
                ) from None
            raise CallError(f"the server heard no speech in the opening audio ({NO_SPEECH_S:.0f} s after it ended)") from None


def silent_run_end(heard: list[HeardFrame], t: float) -> float | None:
    """Where the sound ends before the first ``SILENT_RUN_MS`` of silence
    heard after ``t`` (clock s), or None if no such run was heard."""
    run = SILENT_RUN_MS // 20
    start = next((i for i, f in enumerate(heard) if f.at >= t), len(heard))
    for i in range(start, len(heard)):
        window = heard[i : i + run]
        if len(window) == run and all(f.dbfs <= SILENCE_DBFS for f in window):
            prev = heard[i - 1] if i > start else None
            return prev.at + prev.sound_end_ms / 1000 if prev is not None else heard[i].at
    return None


def sound_again_after(heard: list[HeardFrame], t: float) -> float | None:
    """When the caller heard the agent's sound come back after ``t`` (clock
    s): the first frame with sound after ``t`` that follows a silent one;
    None if it never did."""
    quiet_before = False
    for f in heard:
        loud = f.dbfs > SILENCE_DBFS
        if f.at > t and loud and quiet_before:
            return f.at
        quiet_before = not loud
    return None


def quiet(heard: list[HeardFrame]) -> bool:
    """The last four silent runs' worth of frames were all silent."""
    run = SILENT_RUN_MS // 20 * 4
    tail = heard[-run:]
    return len(tail) == run and all(f.dbfs <= SILENCE_DBFS for f in tail)


async def run_until_hangup(
    script: Coroutine[Any, Any, None], server_closed: asyncio.Event, timeout_s: float
) -> tuple[bool, bool]:
    """Run a simulated call's ``script`` until it ends, the server closes
    the connection (``server_closed`` set) or ``timeout_s`` seconds pass;
    whichever comes first, the others are cancelled and awaited.

    Returns:
        (timed_out, server_hung_up).

    Raises:
        Exception: what ``script`` raised, if it ended first.
    """
    task = asyncio.ensure_future(script)
    hangup = asyncio.ensure_future(server_closed.wait())
    try:
        done, _ = await asyncio.wait({task, hangup}, timeout=timeout_s, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for t in (task, hangup):
            t.cancel()
        await asyncio.gather(task, hangup, return_exceptions=True)
    if task in done:
        task.result()
        return False, False
    return hangup not in done, hangup in done
