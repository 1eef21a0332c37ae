#!/usr/bin/env python3
"""The device send-ahead trade-off: what a xiaozhi-esp32 device still plays
after a barge-in against how much Wi-Fi jitter its speaker rides out.

    python bench/device_send_ahead.py [--send-ahead 20,40,60] [--jitter 0,20,40]
                                      [--listens 2] [--listen-s 12] [--barge-ins 6]
                                      [--seed 1] [--json]

The firmware plays every packet it receives, at real time from receipt, with
no prebuffer, and keeps playing what it holds after an ``abort``; the
server therefore sends at most ``devices.send_ahead_ms`` beyond real time
(media/device_playout.py). A smaller send-ahead leaves less to play after a
barge-in, and less to cover a packet the Wi-Fi link delays: the speaker then
runs dry until it arrives.

For each send-ahead (one server on the embedded defaults with
``TURNKEEPER_DEVICES__SEND_AHEAD_MS`` set) and each Wi-Fi jitter (the
simulated device's ``wifi_jitter_ms``: the 95th percentile of a random
extra delay per message from the server, exponential, in order, as one TCP
stream delivers them; 0 is loopback as it is), device calls in realtime mode
(client/device_call.py) that:

- ask for a story and listen ``--listen-s`` s: where the speaker's queue
  ran dry between two packets of the reply (an underrun: a gap the listener
  hears), per minute of reply, and the silence they add;
- ask for the story and say "hey wait stop I have a question" 1 to 3 s into
  the reply: the audible stop at the device's speaker (from the packet
  carrying the speech's first sample leaving the device to the end of the
  last old sound the speaker played; p50, p95, max).

Time: about (listens x listen-s + barge-ins x 8 s) per cell, about 12
minutes for the defaults. Progress goes to stderr; with ``--json`` stdout is
one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import sys
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import corpus as C  # noqa: E402
from bargein import BENCH_TOKEN, STORY, device_url, stats, up  # noqa: E402
from local_server import server  # noqa: E402

from client.command import issue_device_token  # noqa: E402
from client.device_call import DeviceCallClient  # noqa: E402
from client.results import CallError, Utterance  # noqa: E402

INTERRUPT = "hey wait stop I have a question"


def progress(msg: str) -> None:
    """One line of progress on stderr (stdout is the table or the JSON)."""
    print(msg, file=sys.stderr, flush=True)


def client(url: str, device_token: str, jitter_ms: float, seed: int) -> DeviceCallClient:
    """A realtime-mode device call to the server at ``url`` (http://h:p)
    behind a Wi-Fi link of ``jitter_ms`` (p95 of the extra delay per
    message, ms; :class:`client.device.DeviceSimulator`), seeded ``seed``."""
    return DeviceCallClient(device_url(url), mode="realtime", device_token=device_token, token=BENCH_TOKEN,
                            wifi_jitter_ms=jitter_ms, seed=seed)


async def listen(url: str, device_token: str, jitter_ms: float, seed: int, story: bytes, listen_s: float) -> dict[str, float]:
    """One call that asks for the story and listens ``listen_s`` s: the
    reply's length heard (s) and its underruns (count, ms).

    Raises:
        CallError: the call failed.
    """
    c = client(url, device_token, jitter_ms, seed)
    result = await c.run(Utterance(story, label="story"), [Utterance(bytes(9600), at_s=listen_s, label="listen", kind="none")],
                         timeout_s=listen_s + 30, settle_s=0.2, hangup_after_s=0.3)
    assert c.sim is not None
    speaker = c.sim.speaker
    start = next((s.start for s in speaker.segments if s.loud), None)
    if not result.ok or start is None:
        raise CallError("the story was not heard")
    end = max(s.end for s in speaker.segments)
    runs = [ms for at, ms in speaker.underruns if start < at < end]
    return {"reply_s": end - start, "underruns": len(runs), "underrun_ms": sum(runs), "longest_ms": max(runs, default=0.0)}


async def barge_in(url: str, device_token: str, jitter_ms: float, seed: int, story: bytes, speech: bytes,
                   at_s: float) -> float | None:
    """One call that says ``speech`` ``at_s`` s into the story: its audible
    stop at the device's speaker (ms), None if it did not barge in over
    the audible agent.

    Raises:
        CallError: the call failed.
    """
    c = client(url, device_token, jitter_ms, seed)
    result = await c.run(Utterance(story, label="story"), [Utterance(speech, at_s=at_s, label="hey-wait", kind="speech")],
                         timeout_s=40, settle_s=0.3, hangup_after_s=1.0)
    m = result.barge_ins[0] if result.barge_ins else None
    if m is None or not m.barged_in or not m.speaking_at_onset or m.stop_ms is None:
        return None
    return float(m.stop_ms)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    story_pcm, _ = C.embed(C.espeak(STORY, "en-us", 175), 0, 300)
    story = up(story_pcm)
    speeches = [up(C.embed(C.espeak(INTERRUPT, v, 175), 0, 1000)[0]) for v in C.VOICES]
    cells: list[dict[str, Any]] = []
    for ahead in args.send_ahead:
        env = {"TURNKEEPER_API_TOKENS": f"default:{BENCH_TOKEN}", "TURNKEEPER_DEVICES__SEND_AHEAD_MS": str(ahead)}
        async with server("tk-send-ahead-", env) as (url, _proc):
            device_token = await issue_device_token(url, BENCH_TOKEN)
            for jitter in args.jitter:
                listens: list[dict[str, float]] = []
                stops: list[float] = []
                errors = missed = 0
                for _ in range(args.listens):
                    try:
                        listens.append(await listen(url, device_token, jitter, rng.randrange(1 << 30), story, args.listen_s))
                    except CallError as exc:
                        errors += 1
                        progress(f"  send-ahead {ahead} jitter {jitter}: listen call failed: {exc}")
                for k in range(args.barge_ins):
                    try:
                        stop = await barge_in(url, device_token, jitter, rng.randrange(1 << 30), story,
                                              speeches[k % len(speeches)], round(rng.uniform(1.0, 3.0), 2))
                    except CallError as exc:
                        errors += 1
                        progress(f"  send-ahead {ahead} jitter {jitter}: barge-in call failed: {exc}")
                        continue
                    if stop is None:
                        missed += 1
                    else:
                        stops.append(stop)
                minutes = sum(x["reply_s"] for x in listens) / 60
                cell = {
                    "send_ahead_ms": ahead, "wifi_jitter_p95_ms": jitter,
                    "reply_s": round(minutes * 60, 1),
                    "underruns_per_min": round(sum(x["underruns"] for x in listens) / minutes, 2) if minutes else None,
                    "underrun_ms_per_min": round(sum(x["underrun_ms"] for x in listens) / minutes, 1) if minutes else None,
                    "longest_underrun_ms": round(max((x["longest_ms"] for x in listens), default=0.0), 1),
                    "audible_stop_ms": stats(stops), "not_barged_in": missed, "errors": errors,
                }
                cells.append(cell)
                s = cell["audible_stop_ms"]
                progress(f"  send-ahead {ahead:>3} ms, jitter p95 {jitter:>3} ms: {cell['underruns_per_min']} underruns/min "
                         f"({cell['underrun_ms_per_min']} ms/min), audible stop p50 {s['p50']} p95 {s['p95']} ms")
    return {"seed": args.seed, "listen_s": args.listen_s, "cells": cells}


def print_table(out: dict[str, Any]) -> None:
    """One row per (send-ahead, jitter) cell of :func:`run`'s result: reply
    heard (s), underruns per minute and the silence they add (ms/min), the
    longest (ms), and the audible stop's n, p50, p95, max (ms)."""
    print(f"{'send-ahead':>10} {'jitter p95':>10} {'reply s':>8} {'underruns/min':>14} {'dry ms/min':>11} {'longest':>8}"
          f" {'stop n':>7} {'p50':>7} {'p95':>7} {'max':>7}")
    for c in out["cells"]:
        s = c["audible_stop_ms"]
        cell = lambda v: "-" if v is None else f"{v:.1f}"  # noqa: E731
        print(f"{c['send_ahead_ms']:>10} {c['wifi_jitter_p95_ms']:>10} {c['reply_s']:>8} {cell(c['underruns_per_min']):>14}"
              f" {cell(c['underrun_ms_per_min']):>11} {c['longest_underrun_ms']:>8} {s['n']:>7} {cell(s['p50']):>7}"
              f" {cell(s['p95']):>7} {cell(s['max']):>7}" + (f"   errors {c['errors']}" if c["errors"] else ""))


def ints(text: str) -> list[int]:
    """A comma-separated list of integers ("20,40"); ValueError on anything else."""
    return [int(x) for x in text.split(",") if x]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--send-ahead", type=ints, default=[20, 40, 60], help="devices.send_ahead_ms values (default 20,40,60)")
    p.add_argument("--jitter", type=ints, default=[0, 20, 40], help="Wi-Fi jitter p95 values, ms (default 0,20,40)")
    p.add_argument("--listens", type=int, default=2, help="listening calls per cell (default 2)")
    p.add_argument("--listen-s", type=float, default=12.0, help="how long each listens, s (default 12)")
    p.add_argument("--barge-ins", type=int, default=6, help="barge-in calls per cell (default 6)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    if any(a % 20 or a < 20 for a in args.send_ahead) or any(j < 0 for j in args.jitter):
        p.error("send-ahead values are multiples of 20 ms from 20; jitter values are not negative")
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
