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

That ramp runs with the server's admission by load off (web/capacity.py;
``max_sessions`` well above), so it finds where the audio breaks. It stops
after ``--max-sessions`` callers, or once the audio broke (a received gap,
or send lateness p99 over ``--break-p99-ms``) in two steps in a row; the
capacity is the most callers whose step was clean.

``--overload 1.5`` then starts a fresh server with its admission on (the
defaults) and adds 1.5 times that capacity (``--capacity N`` skips the
ramp), one caller at a time; a refused caller (503 ``at_capacity`` or
``too_many_sessions``) calls again after the refusal's Retry-After, 5 s,
and callers whose story ends call again too, so the server is pressed the
whole time. Once all are in, ``--overload-windows`` windows are measured
as above, with the refusals so far; and each caller admitted during them
is judged on what it received there: degraded if it had a received gap or
an inserted silence of 40 ms or more. ``--profile-at N`` also samples the server's process tree with
py-spy during the window at N callers and reports where its CPU goes, by
stage (bench/stage_profile.py).

``--transport`` picks how the callers reach the server: ``webrtc`` (the
default), ``twilio`` or ``telnyx`` (the phone simulator: a provider's media
stream, G.711 at 8 kHz) or ``device`` (the xiaozhi-esp32 simulator in
realtime mode, Opus at 16 kHz, a device token of its own per caller). What a
phone or device caller received is what its simulated phone or speaker
*played*, 20 ms at a time with silence where nothing did, so its gaps are
the inserted silences against the reference (an arrival gap is a WebRTC
measure: its packets' arrival times).
Progress goes to stderr; ``--json`` prints one JSON object on stdout.
Time: about ``--window`` + 8 s per step after a 60 s reference call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
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
from bargein import BENCH_TOKEN, make_client, stats, up  # noqa: E402
from local_server import server, tree_usage  # noqa: E402
from stage_profile import profile_window  # noqa: E402
from store import redis_server  # noqa: E402

from client.command import issue_device_token  # noqa: E402
from client.results import CallError, CallResult, Utterance  # noqa: E402
from media.pacing import LATENESS_BUCKETS_S, quantile_of_buckets  # noqa: E402

STORY = "tell me a story"
INTERRUPT = "hey wait stop I have a question"
#: a packet this long (ms) after the one before is a gap the caller hears
GAP_MS = 40.0
#: how long a caller's call may last, s (the story is about 60 s)
CALL_TIMEOUT_S = 120.0
#: the refusals of a full server (web/admission.py)
FULL_CODES = ("at_capacity", "too_many_sessions")
#: how long a refused caller waits before calling again, s (the refusal's Retry-After)
RETRY_AFTER_S = 5.0
#: settings that turn the server's admission by load off (the ramp finds where the audio breaks)
NO_ADMISSION = {"TURNKEEPER_CAPACITY__LATENESS_P99_MS": "0", "TURNKEEPER_CAPACITY__CPU_BUDGET": "0",
                "TURNKEEPER_CAPACITY__START_GAP_S": "0"}
TRANSPORTS = ("webrtc", "twilio", "telnyx", "device")


def tokens(transport: str) -> dict[str, str]:
    """The servers' API token for the default tenant, for phone and device
    callers (they read their events, and a device gets its token, with it);
    none for WebRTC, whose page connects without credentials then."""
    return {} if transport == "webrtc" else {"TURNKEEPER_API_TOKENS": f"default:{BENCH_TOKEN}"}


@dataclass
class Caller:
    """One simulated caller: its calls, one after another."""

    n: int
    interrupts: bool
    device_tokens: dict[str, str] = field(default_factory=dict)  # a device caller's token per instance URL
    results: list[CallResult] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    refused: int = 0  # calls a full server refused (at_capacity, too_many_sessions)
    instances: list[str] = field(default_factory=list)  # the instance of each of ``results``
    current_url: str = ""  # the instance of the call in progress
    current: Any = None  # the client of the call in progress
    #: the reception of the call it was in when the run stopped
    cut_short: list[list[L.Frame]] = field(default_factory=list)
    task: asyncio.Task[None] | None = None


async def pick_instance(urls: list[str], http: aiohttp.ClientSession | None) -> list[str]:
    """The instances in the order a load balancer that reads ``/readyz``
    would try them: the ready ones first (in order), then the rest."""
    if len(urls) == 1 or http is None:
        return urls
    ready = []
    for url in urls:
        try:
            async with http.get(f"{url}/readyz") as r:
                ready.append(r.status == 200)
        except aiohttp.ClientError:
            ready.append(False)
    return [u for u, ok in zip(urls, ready, strict=True) if ok] + [u for u, ok in zip(urls, ready, strict=True) if not ok]


async def caller_loop(caller: Caller, urls: str | list[str], transport: str, story: bytes, interrupt: bytes,
                      rng: random.Random, stop: asyncio.Event, http: aiohttp.ClientSession | None = None) -> None:
    """Call, listen, call again, until ``stop``. With several instances
    (``urls``), each call goes to the first ready one (:func:`pick_instance`),
    and a call one refuses goes to the next at once."""
    fleet = [urls] if isinstance(urls, str) else urls
    while not stop.is_set():
        order = await pick_instance(fleet, http)
        for url in order[:-1]:
            if await call_once(caller, url, transport, story, interrupt, rng, retry_later=False):
                break
        else:
            await call_once(caller, order[-1], transport, story, interrupt, rng, retry_later=True)


async def call_once(caller: Caller, url: str, transport: str, story: bytes, interrupt: bytes, rng: random.Random, *,
                    retry_later: bool) -> bool:
    """One call to ``url``; False if that instance refused it as full
    (then, with ``retry_later``, after the refusal's Retry-After)."""
    if transport == "device" and url not in caller.device_tokens:
        caller.device_tokens[url] = await issue_device_token(url, BENCH_TOKEN)
    client = make_client(url, transport, caller.device_tokens.get(url), device_id=device_mac(caller.n))
    caller.current, caller.current_url = client, url
    script = [Utterance(interrupt, at_s=round(rng.uniform(2.0, 6.0), 2), label="interrupt", kind="speech")] \
        if caller.interrupts else []
    try:
        caller.results.append(await client.run(Utterance(story, label="story"), script, timeout_s=CALL_TIMEOUT_S,
                                               settle_s=0.2))
        caller.instances.append(url)
    except CallError as exc:
        if any(code in str(exc) for code in FULL_CODES):
            caller.refused += 1  # a full server: try again after its Retry-After, as a caller's app would
            if retry_later:
                await asyncio.sleep(RETRY_AFTER_S)
            return False
        caller.errors.append(str(exc))
        await asyncio.sleep(1.0)
    finally:
        caller.current = None
    return True


def device_mac(n: int) -> str:
    """Caller ``n``'s device MAC (its ``Device-Id``): one per device."""
    return f"02:00:00:00:{n // 256 % 256:02x}:{n % 256:02x}"


def reception(caller: Caller) -> list[L.Frame]:
    """What the caller's call in progress has received so far (empty
    between calls)."""
    client = caller.current
    return [] if client is None else client.reception()


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


async def refusals_by_reason(http: aiohttp.ClientSession, url: str) -> dict[str, int]:
    """The server's ``turnkeeper_capacity_refusals_total`` by reason, from /metrics."""
    async with http.get(f"{url}/metrics") as r:
        text = await r.text()
    return {s.labels["reason"]: int(s.value) for family in text_string_to_metric_families(text)
            if family.name == "turnkeeper_capacity_refusals" for s in family.samples if s.name.endswith("_total")}


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
    return any(lv > L.SILENCE_DBFS for _, lv, _ in reception(caller))


def arrival_gaps(frames: list[L.Frame], t0: float, t1: float) -> list[float]:
    """Inter-arrival intervals (ms) of at least ``GAP_MS`` between received
    frames that both arrived within [t0, t1]."""
    times = [at for at, _, _ in frames if t0 <= at <= t1]
    return [round((b - a) * 1000, 1) for a, b in zip(times, times[1:], strict=False) if (b - a) * 1000 >= GAP_MS]


def judge_steps(steps: list[dict[str, Any]], callers: list[Caller], reference: list[L.Frame], transport: str) -> None:
    """Fill each step's received gaps and audible stops from the calls'
    receptions, cut to its window: the calls that ended and the one each
    caller was in when the run stopped (its reception so far; its
    interruptions unmeasured). Arrival gaps only for ``webrtc`` (a phone's
    or device's reception is what it played, one entry per 20 ms)."""
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
                if transport == "webrtc":
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


async def fleet_usage(pids: list[int]) -> tuple[float, float]:
    """CPU seconds and RSS (MiB) of the servers' process trees together."""
    usage = [tree_usage(pid) for pid in pids]
    return sum(u[0] for u in usage), sum(u[1] for u in usage)


async def fleet_lateness(http: aiohttp.ClientSession, urls: list[str]) -> list[int]:
    """The servers' send-lateness histograms summed, per bucket."""
    counts = await asyncio.gather(*(lateness_counts(http, u) for u in urls))
    return [sum(c) for c in zip(*counts, strict=True)]


async def measure_window(http: aiohttp.ClientSession, url: str | list[str], pid: int | list[int], n: int, window: float,
                         *, profile_raw: Path | None = None, profile: bool = False
                         ) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """One window of ``window`` s at ``n`` callers: the step's server and
    clients CPU, send lateness and RSS (its received gaps and stops are
    judged afterwards, :func:`judge_steps`), and with ``profile`` where the
    server's CPU went. Several servers (``url`` and ``pid`` lists, a fleet)
    count together: CPU and RSS summed, lateness over all their ticks."""
    urls = [url] if isinstance(url, str) else url
    pids = [pid] if isinstance(pid, int) else pid
    cpu0, _ = await fleet_usage(pids)
    own0 = time.process_time()
    late0 = await fleet_lateness(http, urls)
    t0 = time.monotonic()
    prof_task = None
    if profile:
        prof_task = asyncio.create_task(asyncio.to_thread(profile_window, pids[0], window, keep=profile_raw))
    await asyncio.sleep(window)
    t1 = time.monotonic()
    cpu1, rss_mb = await fleet_usage(pids)
    own1 = time.process_time()
    late1 = await fleet_lateness(http, urls)
    prof = None
    if prof_task is not None:
        prof = await prof_task
        prof["sessions"] = n
        prof["server_cpu_core"] = round((cpu1 - cpu0) / (t1 - t0), 3)
    ticks = [b - a for a, b in zip(late0, late1, strict=True)]
    p99 = quantile_of_buckets(ticks, 0.99)
    p50 = quantile_of_buckets(ticks, 0.5)
    server_core = (cpu1 - cpu0) / (t1 - t0)
    step = {
        "sessions": n,
        "window": [t0, t1],
        "server_cpu_core": round(server_core, 3),
        "server_cpu_per_session_pct": round(100 * server_core / max(n, 1), 1),
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
        "rss_mb": round(rss_mb, 1),
    }
    return step, prof


def step_line(step: dict[str, Any]) -> str:
    lat = step["send_lateness"]
    return (f"server {100 * step['server_cpu_core']:5.1f}% of a core ({step['server_cpu_per_session_pct']:4.1f}% each)"
            f"  clients {100 * step['clients_cpu_core']:5.1f}%  send lateness p50 {lat['p50_ms']} p99 {lat['p99_ms']} ms"
            f"  >=40 ms {lat['late_40ms']}  RSS {step['rss_mb']:.0f} MiB")


async def wait_heard_or_refused(caller: Caller, timeout_s: float = 20.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not heard_sound(caller) and not caller.refused and time.monotonic() < deadline:
        await asyncio.sleep(0.1)


async def end_callers(callers: list[Caller], stop: asyncio.Event) -> None:
    """Stop every caller, keeping the reception of the calls in progress."""
    stop.set()
    for c in callers:
        if c.current is not None:
            c.cut_short.append(reception(c))
        if c.task is not None:
            c.task.cancel()
    await asyncio.gather(*(c.task for c in callers if c.task is not None), return_exceptions=True)


async def reference_reception(url: str, transport: str, story: bytes, reference_s: float | None) -> list[L.Frame]:
    """The story alone on the server, as a caller receives it (the whole
    story, or its first ``reference_s``: a silent cue then, and a hang-up)."""
    cue = [] if reference_s is None else [Utterance(bytes(1920), at_s=reference_s, label="end", kind="none")]
    token = await issue_device_token(url, BENCH_TOKEN) if transport == "device" else None
    client = make_client(url, transport, token, device_id=device_mac(0))
    ref = await client.run(Utterance(story, label="story"), cue, timeout_s=CALL_TIMEOUT_S, settle_s=0.2,
                           hangup_after_s=None if reference_s is None else 0.2)
    reference = list(ref.received)
    if not any(lv > L.SILENCE_DBFS for _, lv, _ in reference):
        raise RuntimeError("the reference call heard no reply")
    return reference


async def ramp(args: argparse.Namespace, story: bytes, interrupt: bytes, rng: random.Random,
               lag: LoopLag) -> dict[str, Any]:
    """Add callers one at a time, admission by load off, until the audio
    breaks (or ``--max-sessions``); see the module doc."""
    steps: list[dict[str, Any]] = []
    callers: list[Caller] = []
    stop = asyncio.Event()
    profile: dict[str, Any] | None = None
    env = {"TURNKEEPER_MAX_SESSIONS": str(max(32, args.max_sessions + 4)), **NO_ADMISSION, **tokens(args.transport)}
    async with server("tk-capacity-", env) as (url, proc), aiohttp.ClientSession() as http:
        progress("reference call (the story alone on the server)...")
        reference = await reference_reception(url, args.transport, story, args.reference_s)
        broke_in_a_row = 0
        try:
            for n in range(1, args.max_sessions + 1):
                caller = Caller(n, interrupts=args.barge_every > 0 and n % args.barge_every == 0)
                callers.append(caller)
                caller.task = asyncio.create_task(caller_loop(caller, url, args.transport, story, interrupt,
                                                              random.Random(rng.random()), stop))
                await wait_heard_or_refused(caller)
                await asyncio.sleep(args.settle)
                step, prof = await measure_window(http, url, proc.pid, n, args.window, profile=args.profile_at == n,
                                                  profile_raw=args.profile_raw)
                profile = prof or profile
                step["interrupting"] = sum(c.interrupts for c in callers)
                step["break_p99_ms"] = args.break_p99_ms
                steps.append(step)
                progress(f"  {n:>2} callers: {step_line(step)}")
                lat = step["send_lateness"]
                late = lat["p99_ms"] is None or lat["p99_ms"] > args.break_p99_ms
                broke_in_a_row = broke_in_a_row + 1 if late else 0
                if broke_in_a_row >= 2:
                    break
        finally:
            await end_callers(callers, stop)
    judge_steps(steps, callers, reference, args.transport)
    for step in steps:
        step["clients_loop_stalls_ms"] = lag.within(*step["window"])
    clean = [s for s in steps if not s["audio_broke"]]
    return {
        "capacity": max((s["sessions"] for s in clean), default=0),
        "steps": steps,
        "profile": profile,
        "calls": sum(len(c.results) + len(c.cut_short) for c in callers),
        "errors": [e for c in callers for e in c.errors],
    }


async def overload(args: argparse.Namespace, capacity: int, story: bytes, interrupt: bytes, rng: random.Random,
                   lag: LoopLag) -> dict[str, Any]:
    """Fresh servers with their admission on (the defaults): ``--overload``
    times ``capacity`` callers, added one at a time; a refused caller
    calls again after the refusal's Retry-After, as a caller's app would.
    With ``--instances 2`` the servers are a fleet on one Redis (started
    here), and each call goes to the first instance whose ``/readyz`` is
    ready, the next one at once if it refuses. Once all are in,
    ``--overload-windows`` windows are measured, and each caller admitted
    during one is judged on what it received there: a degraded call had a
    received gap or an inserted silence of 40 ms or more."""
    target = max(capacity + 1, round(args.overload * capacity))
    callers: list[Caller] = []
    stop = asyncio.Event()
    steps: list[dict[str, Any]] = []
    env = {"TURNKEEPER_MAX_SESSIONS": str(max(32, target + 4)), **tokens(args.transport)}
    async with contextlib.AsyncExitStack() as stack:
        if args.instances > 1:
            redis_url = stack.enter_context(redis_server())
            env |= {"TURNKEEPER_STORE": redis_url, "TURNKEEPER_REDIS_PREFIX": f"cap{rng.randrange(10**6)}"}
        fleet = [await stack.enter_async_context(server(f"tk-overload-{i}-", env)) for i in range(args.instances)]
        urls, pids = [u for u, _ in fleet], [p.pid for _, p in fleet]
        http = await stack.enter_async_context(aiohttp.ClientSession())
        progress(f"overload: {target} callers on {len(urls)} server(s) with admission on (capacity {capacity} each)...")
        reference = await reference_reception(urls[0], args.transport, story, args.reference_s)
        reasons: dict[str, dict[str, int]] = {}
        try:
            for n in range(1, target + 1):
                caller = Caller(n, interrupts=args.barge_every > 0 and n % args.barge_every == 0)
                callers.append(caller)
                caller.task = asyncio.create_task(caller_loop(caller, urls, args.transport, story, interrupt,
                                                              random.Random(rng.random()), stop, http))
                await wait_heard_or_refused(caller)
                where = f" on instance {urls.index(caller.current_url) + 1}" if len(urls) > 1 and heard_sound(caller) else ""
                progress(f"  caller {n}: {'admitted' + where if heard_sound(caller) else 'refused'}")
            await asyncio.sleep(args.settle)
            for _ in range(args.overload_windows):
                live = sum(1 for c in callers if heard_sound(c))
                per_instance = [sum(1 for c in callers if heard_sound(c) and c.current_url == u) for u in urls]
                step, _ = await measure_window(http, urls, pids, live, args.window)
                step["interrupting"] = sum(c.interrupts for c in callers)
                step["break_p99_ms"] = args.break_p99_ms
                step["refused_so_far"] = sum(c.refused for c in callers)
                step["sessions_per_instance"] = per_instance
                steps.append(step)
                progress(f"  {live:>2} admitted callers talking {per_instance}: {step_line(step)}")
            for i, url in enumerate(urls):
                reasons[f"instance {i + 1}"] = await refusals_by_reason(http, url)
        finally:
            await end_callers(callers, stop)
    judge_steps(steps, callers, reference, args.transport)
    degraded = 0
    admitted = 0
    for caller in callers:
        receptions = [list(r.received) for r in caller.results] + caller.cut_short
        in_windows = [f for f in receptions if f and any(f[-1][0] >= s["window"][0] and f[0][0] <= s["window"][1]
                                                          for s in steps)]
        if not in_windows:
            continue
        admitted += 1
        bad = False
        for step in steps:
            t0, t1 = step["window"]
            for frames in in_windows:
                if args.transport == "webrtc" and arrival_gaps(frames, t0, t1):
                    bad = True
                elif not caller.interrupts:
                    heard = L.listen(frames, reference, since=t0, until=t1)
                    bad = bad or any(g.inserted_ms >= GAP_MS and g.run.start_at is not None and t0 <= g.run.start_at <= t1
                                     for g in heard.gaps)
        degraded += bad
    for step in steps:
        step["clients_loop_stalls_ms"] = lag.within(*step["window"])
    calls_per_instance = [sum(c.instances.count(u) for c in callers) for u in urls]
    return {
        "factor": args.overload,
        "capacity": capacity,
        "instances": len(urls),
        "callers": target,
        "admitted": admitted,
        "calls_per_instance": calls_per_instance,
        "refusals": sum(c.refused for c in callers),
        "refusals_by_reason": reasons if len(urls) > 1 else reasons.get("instance 1", {}),
        "callers_never_admitted": sum(1 for c in callers if not c.results and not c.cut_short),
        "degraded_calls": degraded,
        "steps": steps,
        "errors": [e for c in callers for e in c.errors],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    story_pcm, _ = C.embed(C.espeak(STORY, "en-us", 175), 0, 300)
    interrupt_pcm, _ = C.embed(C.espeak(INTERRUPT, "en-us", 175), 0, 1000)
    story, interrupt = up(story_pcm), up(interrupt_pcm)
    lag = LoopLag()
    lag_task = asyncio.create_task(lag.run())
    try:
        found = None
        if args.capacity is None:
            found = await ramp(args, story, interrupt, rng, lag)
        capacity = args.capacity if args.capacity is not None else found["capacity"]  # type: ignore[index]
        over = None
        if args.overload and capacity:
            over = await overload(args, capacity, story, interrupt, rng, lag)
    finally:
        lag_task.cancel()
        await asyncio.gather(lag_task, return_exceptions=True)
    return {
        "transport": args.transport,
        "seed": args.seed,
        "window_s": args.window,
        "barge_every": args.barge_every,
        "capacity": capacity,
        "steps": found["steps"] if found else [],
        "profile": found["profile"] if found else None,
        "calls": found["calls"] if found else 0,
        "clients_loop_stalls": len(lag.stalls),
        "errors": (found["errors"] if found else []) + (over["errors"] if over else []),
        "overload": over,
    }


def table_row(s: dict[str, Any]) -> str:
    """One step as a row of the table."""
    lat, gaps, stop = s["send_lateness"], s["received_gaps"], s["audible_stop_ms"]
    cell = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
    return (f"{s['sessions']:>3}{100 * s['server_cpu_core']:>10.1f}{s['server_cpu_per_session_pct']:>8.1f}"
            f"{100 * s['clients_cpu_core']:>11.1f}{cell(lat['p50_ms']):>10}{cell(lat['p99_ms']):>10}{lat['late_40ms']:>8}"
            f"{gaps['arrival']:>9}{gaps['inserted']:>10}{cell(stop['p95']):>10}{s['rss_mb']:>9.0f}"
            f"{len(s['clients_loop_stalls_ms']):>14}" + ("  audio broke" if s["audio_broke"] else ""))


def print_table(out: dict[str, Any]) -> None:
    print(f"{out['transport']}: capacity {out['capacity']} speaking sessions (window {out['window_s']} s, "
          f"every {out['barge_every']}th caller interrupts; {out['calls']} calls, {len(out['errors'])} errors)")
    head = (f"{'n':>3}{'server %':>10}{'each %':>8}{'clients %':>11}{'late p50':>10}{'late p99':>10}{'>=40ms':>8}"
            f"{'rx gaps':>9}{'inserted':>10}{'stop p95':>10}{'RSS MiB':>9}{'bench stalls':>14}")
    print(head)
    for s in out["steps"]:
        print(table_row(s))
    if out["profile"]:
        p = out["profile"]
        print(f"where the server's CPU goes at {p['sessions']} sessions ({p['samples']} samples, "
              f"{100 * p['server_cpu_core']:.1f}% of a core in all):")
        for stage, share in p["stages"].items():
            print(f"  {stage:<34}{100 * share:6.1f}%   {100 * share * p['server_cpu_core'] / p['sessions']:5.2f}% of a core per session")
        for frame, n in list(p["unclaimed"].items())[:5]:
            print(f"    unclaimed: {n:>5} {frame}")
    over = out.get("overload")
    if over:
        print(f"overload {over['factor']}x capacity {over['capacity']}: {over['callers']} callers, admission on: "
              f"{over['admitted']} admitted, {over['refusals']} refusals {over['refusals_by_reason']} "
              f"({over['callers_never_admitted']} callers never admitted), {over['degraded_calls']} admitted calls "
              "degraded")
        print(head)
        for s in over["steps"]:
            print(table_row(s))
    for e in out["errors"][:5]:
        print(f"  error: {e}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=TRANSPORTS, default="webrtc",
                   help="how the callers reach the server (default webrtc; twilio and telnyx: the phone simulator; "
                        "device: the xiaozhi-esp32 simulator)")
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
    p.add_argument("--overload", type=float,
                   help="then push this many times the capacity (e.g. 1.5) onto a server with its admission on, and "
                        "report how the admitted calls fared")
    p.add_argument("--capacity", type=int, help="with --overload: take this capacity instead of ramping to find it")
    p.add_argument("--overload-windows", type=int, default=3, help="windows measured under overload (default 3)")
    p.add_argument("--instances", type=int, default=1,
                   help="with --overload: this many servers on one Redis (started here), callers going to a ready one "
                        "(default 1)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures on stdout")
    args = p.parse_args()
    if args.max_sessions < 1 or args.window <= 0:
        p.error("need --max-sessions >= 1 and --window > 0")
    if args.capacity is not None and (args.capacity < 1 or not args.overload):
        p.error("--capacity N (N >= 1) goes with --overload")
    if args.instances < 1 or (args.instances > 1 and not args.overload):
        p.error("--instances N (N >= 1; more than 1 goes with --overload)")
    if args.overload is not None and args.overload <= 1:
        p.error("--overload must be more than 1 (e.g. 1.5)")
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
