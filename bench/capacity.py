#!/usr/bin/env python3
"""Capacity: how many speaking callers one server carries (issue 33).

One server on the embedded defaults, in its own process on loopback. Callers
are added one at a time; each asks for a story (a long reply) and listens,
and calls again when it is over; every ``--barge-every``-th caller instead
interrupts the story 2-6 s into it ("hey wait stop I have a question") and
calls again once the answer is over. A reference call, alone on the server,
records the story's reception first. After each caller joins, once its
agent is talking, the bench measures a window (``--window`` s) and reports
for that load:

- server CPU: user + system seconds of the server process and its
  recogniser workers (their process tree, from /proc) over the window, as a
  share of one core, in all and per session;
- clients CPU: the bench process's own (every caller runs in it), apart, so
  the server's figure is honest on a machine they share;
- send lateness p50 / p99 / max bucket: how late the server's paced 20 ms
  ticks went out (its ``turnkeeper_send_lateness_seconds`` histogram,
  scraped before and after the window; media/pacing.py), and the ticks 40 ms
  or more late;
- received gaps: in what the callers received during the window, RTP
  packets arriving 40 ms or more after the one before (the client's jitter
  buffer ran dry), and silences 40 ms or longer inserted into the story (its
  reception against the reference, tests/listening.py), for the callers
  that did not interrupt; and the stalls of the bench process's own event
  loop (30 ms or more), which time packets late at the client whoever is
  to blame;
- audible stop p95 of the interruptions whose first sample went out in the
  window (first speech sample sent to the last packet with agent sound,
  client/call.py);
- RSS of the server's process tree.

It stops after ``--max-sessions`` callers, or once the audio broke (a
received gap, or send lateness p99 over ``--break-p99-ms``) in two steps
in a row. ``--profile-at N`` also samples the server's process tree with
py-spy during the window at N callers and reports where its CPU goes, by
stage (bench/stage_profile.py).

WebRTC only for now; the phone and device transports are an option to come.
Progress goes to stderr; ``--json`` prints one JSON object on stdout.
Time: about ``--window`` + 8 s per step after a 60 s reference call.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import aiohttp
from prometheus_client.parser import text_string_to_metric_families

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import corpus as C  # noqa: E402  (the tests' espeak-ng helpers)
import listening as L  # noqa: E402  (the inserted-gap measure)
from bargein import make_client, stats, up  # noqa: E402
from local_server import server, tree_usage  # noqa: E402
from stage_profile import profile_window  # noqa: E402

from client.results import CallError, CallResult, Utterance  # noqa: E402
from media.pacing import LATENESS_BUCKETS_S, quantile_of_buckets  # noqa: E402

STORY = "tell me a story"
INTERRUPT = "hey wait stop I have a question"
#: a packet this long (ms) after the one before is a gap the caller hears
GAP_MS = 40.0
#: how long a caller's call may last, s (the story is about 60 s)
CALL_TIMEOUT_S = 120.0


@dataclass
class Caller:
    """One simulated caller: its calls, one after another."""

    n: int
    interrupts: bool
    results: list[CallResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    current: Any = None  # the client of the call in progress
    #: the reception of the call it was in when the run stopped
    cut_short: list[list[L.Frame]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


async def caller_loop(caller: Caller, url: str, transport: str, story: bytes, interrupt: bytes,
                      rng: random.Random, stop: asyncio.Event) -> None:
    """Call, listen, call again, until ``stop``."""
    while not stop.is_set():
        client = make_client(url, transport)
        caller.current = client
        script = [Utterance(interrupt, at_s=round(rng.uniform(2.0, 6.0), 2), label="interrupt", kind="speech")] \
            if caller.interrupts else []
        try:
            caller.results.append(await client.run(Utterance(story, label="story"), script, timeout_s=CALL_TIMEOUT_S,
                                                   settle_s=0.2))
        except CallError as exc:
            caller.errors.append(str(exc))
            await asyncio.sleep(1.0)
        finally:
            caller.current = None


async def lateness_counts(http: aiohttp.ClientSession, url: str) -> list[int]:
    """The server's send-lateness histogram as counts per bucket of
    ``LATENESS_BUCKETS_S`` (plus overflow), from /metrics."""
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    cumulative: dict[float, float] = {}
    for family in text_string_to_metric_families(text):
        if family.name == "turnkeeper_send_lateness_seconds":
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    cumulative[float(s.labels["le"])] = s.value
    bounds = [*LATENESS_BUCKETS_S, float("inf")]
    counts, before = [], 0.0
    for b in bounds:
        c = cumulative.get(b, before)
        counts.append(int(c - before))
        before = c
    return counts


class LoopLag:
    """The bench process's own event loop: when it stalls, the callers'
    packets are timed late however the server sent them. Records every
    wake-up of a 5 ms sleep that came ``STALL_MS`` or more late."""

    STALL_MS = 30.0

    def __init__(self) -> None:
        self.stalls: list[tuple[float, float]] = []  # (monotonic s, ms late)

    async def run(self) -> None:
        while True:
            t = time.monotonic()
            await asyncio.sleep(0.005)
            late_ms = (time.monotonic() - t - 0.005) * 1000
            if late_ms >= self.STALL_MS:
                self.stalls.append((time.monotonic(), round(late_ms, 1)))

    def within(self, t0: float, t1: float) -> list[float]:
        """The stalls (ms late) that ended within [t0, t1]."""
        return [ms for at, ms in self.stalls if t0 <= at <= t1]


def heard_sound(caller: Caller) -> bool:
    """The caller's call in progress has received agent sound."""
    client = caller.current
    return client is not None and any(lv > L.SILENCE_DBFS for _, lv, _ in getattr(client, "_received", []))


def arrival_gaps(frames: list[L.Frame], t0: float, t1: float) -> list[float]:
    """Inter-arrival intervals (ms) of at least ``GAP_MS`` between received
    frames that both arrived within [t0, t1]."""
    times = [at for at, _, _ in frames if t0 <= at <= t1]
    return [round((b - a) * 1000, 1) for a, b in zip(times, times[1:], strict=False) if (b - a) * 1000 >= GAP_MS]


def judge_steps(steps: list[dict[str, Any]], callers: list[Caller], reference: list[L.Frame]) -> None:
    """Fill each step's received gaps and audible stops from the calls'
    receptions, cut to its window: the calls that ended and the one each
    caller was in when the run stopped (its reception so far; its
    interruptions unmeasured)."""
    for step in steps:
        t0, t1 = step["window"]
        arrival: list[float] = []
        inserted: list[float] = []
        stops: list[float] = []
        for caller in callers:
            receptions = [(list(r.received), r.barge_ins) for r in caller.results]
            receptions += [(frames, []) for frames in caller.cut_short]
            for frames, barge_ins in receptions:
                if not frames or frames[-1][0] < t0 or frames[0][0] > t1:
                    continue
                arrival += arrival_gaps(frames, t0, t1)
                if not caller.interrupts:
                    heard = L.listen(frames, reference, since=t0, until=t1)
                    inserted += [round(g.inserted_ms, 1) for g in heard.gaps
                                 if g.inserted_ms >= GAP_MS and g.run.start_at is not None and t0 <= g.run.start_at <= t1]
                for m in barge_ins:
                    if m.onset_sent_at is not None and t0 <= m.onset_sent_at <= t1 and m.speaking_at_onset and m.stop_ms is not None:
                        stops.append(m.stop_ms)
        step["received_gaps"] = {"arrival": len(arrival), "arrival_max_ms": max(arrival, default=None),
                                 "inserted": len(inserted), "inserted_max_ms": max(inserted, default=None)}
        step["audible_stop_ms"] = stats(stops)
        step["audio_broke"] = bool(arrival or inserted) or step["send_lateness"]["p99_ms"] is None \
            or step["send_lateness"]["p99_ms"] > step["break_p99_ms"]


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    story_pcm, _ = C.embed(C.espeak(STORY, "en-us", 175), 0, 300)
    interrupt_pcm, _ = C.embed(C.espeak(INTERRUPT, "en-us", 175), 0, 1000)
    story, interrupt = up(story_pcm), up(interrupt_pcm)
    steps: list[dict[str, Any]] = []
    callers: list[Caller] = []
    stop = asyncio.Event()
    profile: dict[str, Any] | None = None
    env = {"TURNKEEPER_MAX_SESSIONS": str(max(32, args.max_sessions + 4))}
    lag = LoopLag()
    lag_task = asyncio.create_task(lag.run())
    async with server("tk-capacity-", env) as (url, proc), aiohttp.ClientSession() as http:
        progress("reference call (the story alone on the server)...")
        # the whole story, or its first --reference-s (a silent cue then, and a hang-up)
        cue = [] if args.reference_s is None else [Utterance(bytes(1920), at_s=args.reference_s, label="end", kind="none")]
        ref = await make_client(url, "webrtc").run(Utterance(story, label="story"), cue, timeout_s=CALL_TIMEOUT_S, settle_s=0.2,
                                                   hangup_after_s=None if args.reference_s is None else 0.2)
        reference = list(ref.received)
        if not any(lv > L.SILENCE_DBFS for _, lv, _ in reference):
            raise RuntimeError("the reference call heard no reply")
        broke_in_a_row = 0
        try:
            for n in range(1, args.max_sessions + 1):
                caller = Caller(n, interrupts=args.barge_every > 0 and n % args.barge_every == 0)
                callers.append(caller)
                caller.task = asyncio.create_task(caller_loop(caller, url, "webrtc", story, interrupt, random.Random(rng.random()), stop))
                deadline = time.monotonic() + 20
                while not heard_sound(caller) and time.monotonic() < deadline:
                    await asyncio.sleep(0.1)
                await asyncio.sleep(args.settle)
                cpu0, _ = tree_usage(proc.pid)
                own0 = time.process_time()
                late0 = await lateness_counts(http, url)
                t0 = time.monotonic()
                prof_task = None
                if args.profile_at == n:
                    prof_task = asyncio.create_task(asyncio.to_thread(profile_window, proc.pid, args.window, keep=args.profile_raw))
                await asyncio.sleep(args.window)
                t1 = time.monotonic()
                cpu1, rss_mb = tree_usage(proc.pid)
                own1 = time.process_time()
                late1 = await lateness_counts(http, url)
                if prof_task is not None:
                    profile = await prof_task
                    profile["sessions"] = n
                    profile["server_cpu_core"] = round((cpu1 - cpu0) / (t1 - t0), 3)
                ticks = [b - a for a, b in zip(late0, late1, strict=True)]
                p99 = quantile_of_buckets(ticks, 0.99)
                p50 = quantile_of_buckets(ticks, 0.5)
                server_core = (cpu1 - cpu0) / (t1 - t0)
                step = {
                    "sessions": n,
                    "interrupting": sum(c.interrupts for c in callers),
                    "window": [t0, t1],
                    "server_cpu_core": round(server_core, 3),
                    "server_cpu_per_session_pct": round(100 * server_core / n, 1),
                    "clients_cpu_core": round((own1 - own0) / (t1 - t0), 3),
                    "send_lateness": {
                        "ticks": sum(ticks),
                        "p50_ms": None if p50 is None else round(p50 * 1000, 1),
                        "p99_ms": None if p99 is None or p99 == float("inf") else round(p99 * 1000, 1),
                        "late_20ms": sum(ticks[LATENESS_BUCKETS_S.index(0.020) + 1:]),
                        "late_40ms": sum(ticks[LATENESS_BUCKETS_S.index(0.040) + 1:]),
                        # the bound of the latest bucket any tick fell in (None: past the last bound)
                        "max_bucket_ms": next((None if b == float("inf") else round(1000 * b, 1) for b, c in
                                               zip(reversed([*LATENESS_BUCKETS_S, float("inf")]), reversed(ticks), strict=True) if c),
                                              0.0),
                    },
                    "break_p99_ms": args.break_p99_ms,
                    "rss_mb": round(rss_mb, 1),
                }
                steps.append(step)
                lat = step["send_lateness"]
                progress(f"  {n:>2} callers: server {100 * server_core:5.1f}% of a core ({step['server_cpu_per_session_pct']:4.1f}% each)"
                         f"  clients {100 * step['clients_cpu_core']:5.1f}%  send lateness p50 {lat['p50_ms']} p99 {lat['p99_ms']} ms"
                         f"  >=40 ms {lat['late_40ms']}  RSS {rss_mb:.0f} MiB")
                late = lat["p99_ms"] is None or lat["p99_ms"] > args.break_p99_ms
                broke_in_a_row = broke_in_a_row + 1 if late else 0
                if broke_in_a_row >= 2:
                    break
        finally:
            stop.set()
            for c in callers:
                if c.current is not None:
                    c.cut_short.append(list(getattr(c.current, "_received", [])))
                if c.task is not None:
                    c.task.cancel()
            await asyncio.gather(*(c.task for c in callers if c.task is not None), return_exceptions=True)
    lag_task.cancel()
    await asyncio.gather(lag_task, return_exceptions=True)
    for step in steps:
        step["clients_loop_stalls_ms"] = lag.within(*step["window"])
    judge_steps(steps, callers, reference)
    clean = [s for s in steps if not s["audio_broke"]]
    return {
        "transport": "webrtc",
        "seed": args.seed,
        "window_s": args.window,
        "barge_every": args.barge_every,
        "capacity": max((s["sessions"] for s in clean), default=0),
        "steps": steps,
        "profile": profile,
        "calls": sum(len(c.results) + len(c.cut_short) for c in callers),
        "clients_loop_stalls": len(lag.stalls),
        "errors": [e for c in callers for e in c.errors],
    }


def print_table(out: dict[str, Any]) -> None:
    print(f"{out['transport']}: capacity {out['capacity']} speaking sessions (window {out['window_s']} s, "
          f"every {out['barge_every']}th caller interrupts; {out['calls']} calls, {len(out['errors'])} errors)")
    head = (f"{'n':>3}{'server %':>10}{'each %':>8}{'clients %':>11}{'late p50':>10}{'late p99':>10}{'>=40ms':>8}"
            f"{'rx gaps':>9}{'inserted':>10}{'stop p95':>10}{'RSS MiB':>9}{'bench stalls':>14}")
    print(head)
    for s in out["steps"]:
        lat, gaps, stop = s["send_lateness"], s["received_gaps"], s["audible_stop_ms"]
        cell = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{s['sessions']:>3}{100 * s['server_cpu_core']:>10.1f}{s['server_cpu_per_session_pct']:>8.1f}"
              f"{100 * s['clients_cpu_core']:>11.1f}{cell(lat['p50_ms']):>10}{cell(lat['p99_ms']):>10}{lat['late_40ms']:>8}"
              f"{gaps['arrival']:>9}{gaps['inserted']:>10}{cell(stop['p95']):>10}{s['rss_mb']:>9.0f}"
              f"{len(s['clients_loop_stalls_ms']):>14}"
              + ("  audio broke" if s["audio_broke"] else ""))
    if out["profile"]:
        p = out["profile"]
        print(f"where the server's CPU goes at {p['sessions']} sessions ({p['samples']} samples, "
              f"{100 * p['server_cpu_core']:.1f}% of a core in all):")
        for stage, share in p["stages"].items():
            print(f"  {stage:<34}{100 * share:6.1f}%   {100 * share * p['server_cpu_core'] / p['sessions']:5.2f}% of a core per session")
        for frame, n in list(p["unclaimed"].items())[:5]:
            print(f"    unclaimed: {n:>5} {frame}")
    for e in out["errors"][:5]:
        print(f"  error: {e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--max-sessions", type=int, default=16, help="callers at most (default 16)")
    p.add_argument("--window", type=float, default=8.0, help="measured seconds per step (default 8)")
    p.add_argument("--settle", type=float, default=2.0, help="seconds after the new caller's agent talks before measuring (default 2)")
    p.add_argument("--barge-every", type=int, default=4, help="every Nth caller interrupts (0: none; default 4)")
    p.add_argument("--break-p99-ms", type=float, default=20.0, help="send lateness p99 taken as broken audio, ms (default 20)")
    p.add_argument("--profile-at", type=int, help="profile the server by stage at this many callers (py-spy)")
    p.add_argument("--profile-raw", type=Path, help="with --profile-at: keep py-spy's raw samples in this file")
    p.add_argument("--reference-s", type=float,
                   help="record only this much of the story (s) as the reference (default: all of it; silences later "
                        "in a call are then left unjudged)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures on stdout")
    args = p.parse_args()
    if args.max_sessions < 1 or args.window <= 0:
        p.error("need --max-sessions >= 1 and --window > 0")
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
