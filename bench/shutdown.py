#!/usr/bin/env python3
"""Shutdown benchmark: time from SIGTERM to exit with N idle / N talking
voice sessions, and what each session saw of the drain (issue 15).

For each scenario a real ``turnkeeper serve`` process starts on the
embedded defaults (SQLite in a temporary folder, :mod:`local_server`), with
its shutdown settings set explicitly (``TURNKEEPER_SHUTDOWN__*``, printed
with the figures). N headless WebRTC clients (:class:`client.call.CallClient`)
connect; in an **idle** scenario they say nothing, in a **talking** one each
says "tell me a story" (espeak-ng) and the bench waits until every client
hears the agent speaking. Then it sends the server SIGTERM and measures,
all times in seconds from the SIGTERM on this host's monotonic clock:

1. ``exit_s``: SIGTERM to the server process's exit, and its exit code
   (a complete drain exits 0; 1 means it ran out of ``grace_s``);
   ``server_drain_s``, the drain's length as the server logged it ("drain
   done after"; the rest of ``exit_s`` is the app's cleanup and the exit).
2. per session: ``draining_s``, when its ``session.draining`` event
   arrived on the data channel (None: never), the ``left_s`` it announced,
   and ``ended_s``, when its connection ended (the data channel closed by
   the server).
3. talking sessions, from the audio the client received (not server
   counters): whether the agent was audible in the 0.5 s before SIGTERM;
   the reply's terminal ``turn`` event as the client saw it (status, stop
   reason, ``terminal_s``; the server closes a session still open at
   ``drain_timeout_s`` with ``worker_shutdown``, so a long story ends
   CANCELLED ``worker_shutdown`` there, a short reply COMPLETED);
   ``last_sound_s`` (the last audible 20 ms frame) and ``longest_quiet_s``
   (the longest stretch without sound, or without any frame arriving,
   between SIGTERM and the terminal event). ``audio_to_end`` is yes when
   the audio kept coming until the terminal event: no quiet stretch longer
   than ``QUIET_OK_S`` (the story's pauses between sentences are shorter).
   ``sound_after_terminal_s``: audio already sent that arrived after the
   terminal event (RTP and the data channel are separate paths).
4. ``workers_left``: the server's child processes (the recogniser's
   workers, seen just before SIGTERM) still alive 2 s after it exited:
   must be 0.

How to read it: an idle session never ends by itself, so with N > 0 the
exit comes at about ``drain_timeout_s`` plus the closing of the sessions;
with N = 0 at about ``lb_delay_s``. ``ended_s`` close to ``drain_timeout_s``
is the server hanging up; a talking session's ``terminal_s`` should come
just before its ``ended_s``.

Usage: python bench/shutdown.py [--sessions 0,1,4] [--quick] [--kinds idle,talking]
       [--lb-delay S] [--drain-timeout S] [--turn-wait S] [--grace S] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))
from local_server import ROOT, server  # noqa: E402

sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
from server_process import alive, child_pids  # noqa: E402

from client.call import SILENCE_DBFS, CallClient  # noqa: E402
from client.results import CallResult, Utterance  # noqa: E402
from media.frames import PLAYOUT_RATE, load_pcm  # noqa: E402
from media.playout import PlayoutBuffer  # noqa: E402

TERMINAL = {"COMPLETED", "FAILED", "CANCELLED", "RECONCILE_REQUIRED"}
#: a talking session's audio counts as cut when it was quiet longer than this, s
QUIET_OK_S = 1.5
#: the agent counts as speaking at SIGTERM when audible in this window before it, s
SPEAKING_WINDOW_S = 0.5
#: how long the sessions get to connect and (talking) for the agent to speak, s
READY_TIMEOUT_S = 40.0
#: after the exit, how long the workers get to notice it, s
WORKERS_WAIT_S = 2.0


@dataclass
class Shutdown:
    """The server's shutdown settings, s (``web.settings.ShutdownSettings``)."""

    lb_delay_s: float = 0.5
    drain_timeout_s: float = 8.0
    turn_wait_s: float = 5.0
    grace_s: float = 15.0

    def env(self) -> dict[str, str]:
        """As ``TURNKEEPER_SHUTDOWN__*`` environment variables."""
        return {f"TURNKEEPER_SHUTDOWN__{k.upper()}": f"{v:g}" for k, v in asdict(self).items()}


class DrainCall(CallClient):
    """A :class:`CallClient` that stays on the line until the server hangs
    up, and notes when the connection ended (client clock, s). ``idle``: it
    says nothing (its opening utterance is silence and no turn is expected)."""

    def __init__(self, base_url: str, *, idle: bool) -> None:
        super().__init__(base_url)
        self.idle = idle
        self.connected = asyncio.Event()
        self.ended_at: float | None = None

    async def _script(self, mic: PlayoutBuffer, *args: Any, **kwargs: Any) -> None:
        self._channel.on("close", self._on_channel_close)
        self.connected.set()
        await super()._script(mic, *args, **kwargs)

    def _on_channel_close(self) -> None:
        if self.ended_at is None:
            self.ended_at = self.clock.monotonic()

    async def _expect_a_turn(self) -> None:
        if not self.idle:
            await super()._expect_a_turn()

    def speaking(self, since: float) -> bool:
        """A turn runs and the agent was audible after ``since`` (client clock, s)."""
        running = any(t.status == "RUNNING" for t in self._turns.values())
        return running and any(at >= since and level > SILENCE_DBFS for at, level, _ in reversed(self._received[-50:]))


def session_figures(result: CallResult, ended_at: float | None, t0: float, talking: bool) -> dict[str, Any]:
    """What one session saw of the drain, times in s from SIGTERM (``t0``,
    client clock): ``draining_s``, ``left_s``, ``ended_s`` and, when
    ``talking``, the reply's terminal event and the audio up to it."""
    rel = _rel(t0)
    out: dict[str, Any] = {"session_id": result.session_id, "server_hung_up": result.server_hung_up,
                           "timed_out": result.timed_out}
    told = next(((at, ev) for at, ev in result.event_times if ev.get("type") == "session.draining"), None)
    out["draining_s"] = rel(told[0]) if told else None
    out["left_s"] = told[1].get("left_s") if told else None
    out["draining_reason"] = told[1].get("reason") if told else None
    out["ended_s"] = rel(ended_at)
    if not talking:
        return out
    rx = result.received
    out["speaking_at_sigterm"] = any(t0 - SPEAKING_WINDOW_S <= at <= t0 and lv > SILENCE_DBFS for at, lv, _ in rx)
    running = [t for t in result.turns if "RUNNING" in t.states]
    turn = running[-1] if running else None
    end = next(((at, ev) for at, ev in result.event_times if turn is not None and ev.get("type") == "turn"
                and ev.get("turn_id") == turn.id and ev.get("status") in TERMINAL), None)
    out["status"] = turn.status if turn else None
    out["stop_reason"] = turn.stop_reason if turn else None
    out["terminal_s"] = rel(end[0]) if end else None
    out["states"] = turn.states if turn else []
    sound = [at for at, lv, _ in rx if at >= t0 and lv > SILENCE_DBFS]
    out["last_sound_s"] = rel(sound[-1]) if sound else None
    until = end[0] if end else (ended_at or (rx[-1][0] if rx else t0))
    frames = [at for at, _, _ in rx if t0 <= at <= until]
    audible = [at for at in sound if at <= until]
    out["longest_quiet_s"] = round(max(_longest_gap(t0, audible, until), _longest_gap(t0, frames, until)), 3)
    out["audio_to_end"] = bool(end) and out["longest_quiet_s"] <= QUIET_OK_S
    # audio already on the wire may arrive after the event (RTP and the data channel are separate paths)
    out["sound_after_terminal_s"] = round(max(0.0, sound[-1] - end[0]), 3) if sound and end else None
    return out


def _rel(t0: float) -> Any:
    return lambda at: None if at is None else round(at - t0, 3)


def _longest_gap(start: float, times: list[float], end: float) -> float:
    """The longest interval, s, between ``start``, each of ``times`` and ``end``."""
    points = [start, *times, end]
    return max((b - a for a, b in zip(points, points[1:], strict=False)), default=0.0)


def descendants(pid: int) -> list[int]:
    """``pid``'s child processes and theirs (Linux /proc)."""
    out = []
    for child in child_pids(pid):
        out += [child, *descendants(child)]
    return out


async def run_scenario(kind: str, n: int, shutdown: Shutdown, speech: Path | None = None,
                       log_dir: Path | None = None) -> dict[str, Any]:
    """One scenario: a server, ``n`` sessions (``kind`` ``idle`` or
    ``talking``; talking needs ``speech``, a WAV of "tell me a story"),
    SIGTERM, and the figures of the module doc (times in s from SIGTERM).
    ``log_dir``: keep the server's log there (else it is deleted).

    Raises:
        RuntimeError: the sessions did not connect, or the agent did not
            speak, within ``READY_TIMEOUT_S``.
    """
    talking = kind == "talking"
    opening = Utterance(pcm=load_pcm(speech, PLAYOUT_RATE) if talking and speech else bytes(1920 * 10))
    with tempfile.TemporaryDirectory(prefix="tk-bench-shutdown-log-") as tmp:
        log_path = (log_dir or Path(tmp)) / f"server-{kind}-{n}.log"
        async with server("tk-bench-shutdown-", shutdown.env(), log_path) as (url, proc):
            calls = [DrainCall(url, idle=not talking) for _ in range(n)]
            timeout = READY_TIMEOUT_S + shutdown.grace_s + 30
            tasks: list[asyncio.Future[CallResult]] = []
            try:
                for c in calls:  # one at a time: the server admits 3 connecting sessions per client address
                    tasks.append(asyncio.ensure_future(c.run(opening, hangup_after_s=3600, timeout_s=timeout, settle_s=0)))
                    await _until_ready([c], tasks[-1:], talking=False)
                await _until_ready(calls, tasks, talking)
                workers = descendants(proc.pid)
                t0 = time.monotonic()
                proc.send_signal(signal.SIGTERM)
                rc = await asyncio.to_thread(proc.wait, shutdown.grace_s + 15)
                exit_s = time.monotonic() - t0
                results = await asyncio.wait_for(asyncio.gather(*tasks), 15)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            for _ in range(int(WORKERS_WAIT_S * 20)):
                if not [p for p in workers if alive(p)]:
                    break
                await asyncio.sleep(0.05)
            left = [p for p in workers if alive(p)]
        log = log_path.read_text(errors="replace")
    done = re.search(r"drain done after ([0-9.]+) s", log)
    sessions = [session_figures(r, c.ended_at, t0, talking) for r, c in zip(results, calls, strict=True)]
    return {
        "kind": kind, "sessions": n, "exit_s": round(exit_s, 3), "exit_code": rc,
        "server_drain_s": float(done.group(1)) if done else None,
        "workers_before": len(workers), "workers_left": len(left), "workers_left_pids": left,
        "per_session": sessions,
        "log_tail": log[-2000:] if rc != 0 or left else "",
    }


async def _until_ready(calls: list[DrainCall], tasks: list[asyncio.Future[CallResult]], talking: bool) -> None:
    """Every call connected and (``talking``) hearing the agent speak."""
    deadline = time.monotonic() + READY_TIMEOUT_S
    while time.monotonic() < deadline:
        for t in tasks:
            if t.done():
                t.result()  # its error (e.g. CallError), or it ended early
                raise RuntimeError("a call ended before SIGTERM")
        now = time.monotonic()
        if all(c.connected.is_set() and (not talking or c.speaking(now - 0.3)) for c in calls):
            await asyncio.sleep(0.5)  # talking: a little into the story; idle: settled
            if not talking or all(c.speaking(time.monotonic() - 0.3) for c in calls):
                return
        await asyncio.sleep(0.05)
    what = "hear the agent speak" if talking else "connect"
    raise RuntimeError(f"not every session did {what} within {READY_TIMEOUT_S:.0f} s")


def summary(sc: dict[str, Any]) -> dict[str, Any]:
    """One scenario's figures over its sessions (counts, and max times, s)."""
    ss = sc["per_session"]

    def most(key: str) -> float | None:
        vals = [s[key] for s in ss if s.get(key) is not None]
        return max(vals) if vals else None

    out = {"draining_seen": sum(s["draining_s"] is not None for s in ss), "max_draining_s": most("draining_s"),
           "min_left_s": min((s["left_s"] for s in ss if s["left_s"] is not None), default=None),
           "max_ended_s": most("ended_s")}
    if sc["kind"] == "talking":
        out |= {"speaking_at_sigterm": sum(bool(s["speaking_at_sigterm"]) for s in ss),
                "terminal_seen": sum(s["terminal_s"] is not None for s in ss),
                "ends": sorted({f"{s['status']}/{s['stop_reason']}" for s in ss}),
                "max_terminal_s": most("terminal_s"), "audio_to_end": sum(bool(s["audio_to_end"]) for s in ss),
                "max_quiet_s": most("longest_quiet_s")}
    return out


def print_table(out: dict[str, Any]) -> None:
    """The figures as a readable table (times in s from SIGTERM)."""
    print("shutdown settings: " + ", ".join(f"{k} {v:g} s" for k, v in out["shutdown"].items()))
    print("times in s from SIGTERM; drain s: as the server logged it; ended: data channel closed by the server;")
    print("talking: speaking = agent audible at SIGTERM; terminal = the story's terminal turn event seen, at max s;")
    print(f"audio to end = audio kept arriving until it (no gap over {QUIET_OK_S:g} s); end = status/stop reason seen")
    head = (f"{'scenario':<12} {'exit s':>7} {'drain s':>7} {'rc':>3} {'workers left':>12} {'draining':>9} {'left_s':>6} "
            f"{'ended max':>9}  {'speaking':>8} {'terminal':>8} {'at max':>6} {'audio to end':>12}  end")
    print(head)
    for sc in out["scenarios"]:
        s, n = sc["summary"], sc["sessions"]
        row = (f"{sc['kind'] + ' ' + str(n):<12} {sc['exit_s']:>7.2f} {_num(sc['server_drain_s']):>7} {sc['exit_code']:>3} "
               f"{str(sc['workers_left']) + '/' + str(sc['workers_before']):>12} {str(s['draining_seen']) + '/' + str(n):>9} "
               f"{_num(s['min_left_s']):>6} {_num(s['max_ended_s']):>9}")
        if sc["kind"] == "talking":
            row += (f"  {str(s['speaking_at_sigterm']) + '/' + str(n):>8} {str(s['terminal_seen']) + '/' + str(n):>8} "
                    f"{_num(s['max_terminal_s']):>6} {str(s['audio_to_end']) + '/' + str(n):>12}  {' '.join(s['ends'])}")
        print(row)
    for p in out["problems"]:
        print("PROBLEM: " + p)


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.2f}"


def problems(sc: dict[str, Any]) -> list[str]:
    """What went wrong in a scenario (the brief's musts), as sentences."""
    name, out = f"{sc['kind']} {sc['sessions']}", []
    if sc["exit_code"] != 0:
        out.append(f"{name}: exit code {sc['exit_code']}")
    if sc["workers_left"]:
        out.append(f"{name}: {sc['workers_left']} worker processes left alive: {sc['workers_left_pids']}")
    for i, s in enumerate(sc["per_session"]):
        if s["draining_s"] is None:
            out.append(f"{name}: session {i} got no session.draining")
        if not s["server_hung_up"]:
            out.append(f"{name}: session {i} was not hung up by the server (timed out: {s['timed_out']})")
        if sc["kind"] == "talking":
            if s["terminal_s"] is None:
                out.append(f"{name}: session {i}: the reply ended without a terminal event (states {s['states']})")
            elif not s["audio_to_end"]:
                out.append(f"{name}: session {i}: the audio stopped {s['longest_quiet_s']} s before the terminal event")
            if not s["speaking_at_sigterm"]:
                out.append(f"{name}: session {i}: the agent was not audible at SIGTERM")
    return out


async def run(kinds: list[str], counts: list[int], shutdown: Shutdown, progress: bool) -> dict[str, Any]:
    """Every scenario (``kinds`` x ``counts``; talking with 0 sessions is
    the idle one, so it is left out) and their figures."""
    scenarios = []
    with tempfile.TemporaryDirectory(prefix="tk-bench-shutdown-") as tmp:
        speech = Path(tmp) / "story.wav"
        if "talking" in kinds:
            subprocess.run(["espeak-ng", "-v", "en-us", "-s", "140", "-w", str(speech), "tell me a story"], check=True)
        for kind in kinds:
            for n in counts:
                if kind == "talking" and n == 0 and "idle" in kinds:
                    continue
                sc = await run_scenario(kind, n, shutdown, speech)
                sc["summary"] = summary(sc)
                scenarios.append(sc)
                if progress:
                    print(f"{kind} {n}: exit {sc['exit_s']:.2f} s, code {sc['exit_code']}", file=sys.stderr)
    return {"shutdown": asdict(shutdown), "scenarios": scenarios,
            "problems": [p for sc in scenarios for p in problems(sc)]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", default="0,1,4", help="comma-separated N (default 0,1,4)")
    p.add_argument("--quick", action="store_true", help="N=1 only")
    p.add_argument("--kinds", default="idle,talking", help="idle, talking or both (default)")
    p.add_argument("--lb-delay", type=float, default=0.5, help="shutdown.lb_delay_s (default 0.5)")
    p.add_argument("--drain-timeout", type=float, default=8.0, help="shutdown.drain_timeout_s (default 8)")
    p.add_argument("--turn-wait", type=float, default=5.0, help="shutdown.turn_wait_s (default 5)")
    p.add_argument("--grace", type=float, help="shutdown.grace_s (default: the longest of the above + 7)")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    kinds = [k.strip() for k in args.kinds.split(",") if k.strip()]
    if not set(kinds) <= {"idle", "talking"}:
        p.error("--kinds: idle and/or talking")
    counts = [1] if args.quick else [int(x) for x in args.sessions.split(",") if x.strip()]
    if "talking" in kinds and not shutil.which("espeak-ng"):
        p.error("talking sessions need espeak-ng (apt-get install espeak-ng)")
    longest = max(args.lb_delay, args.drain_timeout, args.turn_wait)
    shutdown = Shutdown(args.lb_delay, args.drain_timeout, args.turn_wait,
                        args.grace if args.grace is not None else longest + 7)
    out = asyncio.run(run(kinds, counts, shutdown, progress=not args.json))
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 1 if out["problems"] else 0


if __name__ == "__main__":
    sys.exit(main())
