#!/usr/bin/env python3
"""Push-to-talk device benchmark: how fast the button silences the agent,
measured at the simulated device (issue 14, item 7).

Starts a turnkeeper server in its own process on loopback, issues a device
token (``POST /v1/devices``) and makes calls with the simulated xiaozhi-esp32
device (client/device_call.py, push-to-talk mode). Each call asks for a
story with the button held, then, while the agent talks, at random offsets
(``--min-at`` to ``--max-at`` s after the device's speaker starts playing):

- abort: the device sends ``abort`` (the firmware's button while
  speaking); then it asks for the story again;
- PTT press: the device presses push-to-talk while the agent speaks
  (``abort`` then ``listen start`` manual, as the firmware does), says
  "tell me a story" and releases.

Figures (min, p50, p95, max):

- stop at the device: from the press to the end of the last old-generation
  sound the device's speaker played (what arrived between the interrupted
  reply's ``tts start`` and the ``tts stop`` after the press; the device
  keeps playing what it received, so the server's send-ahead is included);
  the target is p95 <= 60 ms;
- ``tts stop`` after the press, and the last old packet's arrival after it;
- old audio sent after ``tts stop`` (should be 0);
- the heard position: what the device's speaker played of the interrupted
  reply against the ``played_ms`` the server counted (sent minus the
  send-ahead in flight), absolute difference;
- the interrupted turn's record: CANCEL_REQUESTED then a terminal state,
  with its stop reason and initiator (abort: user_cancel by ``device``;
  press: barge_in by ``ptt``).

Usage: python bench/device.py [--json] [--trials N] [--per-call K] [--quick] [--seed S] [--version 1|2|3]
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
from client.results import BargeInMeasure, CallResult, Utterance  # noqa: E402

TARGET_P95_MS = 60.0
TERMINAL = ("COMPLETED", "FAILED", "CANCELLED", "RECONCILE_REQUIRED")


def record_of(result: CallResult, turn_id: str | None) -> dict[str, Any]:
    """The interrupted turn's record as its events tell it: states, stop
    reason and initiator."""
    states: list[str] = []
    reason: dict[str, Any] = {}
    for ev in result.events:
        if ev.get("type") == "turn" and ev.get("turn_id") == turn_id:
            states.append(ev["status"])
            if isinstance(ev.get("stop_reason"), dict):
                reason = ev["stop_reason"]
    honest = "CANCEL_REQUESTED" in states and bool(states) and states[-1] in TERMINAL \
        and states.index("CANCEL_REQUESTED") < len(states) - 1
    return {"states": states, "stop_reason": reason.get("kind"), "initiator": reason.get("initiator"), "honest": honest}


def figures(measures: list[BargeInMeasure], records: list[dict[str, Any]]) -> dict[str, Any]:
    done = [m for m in measures if m.sent_from is not None and m.speaking_at_onset]
    stop = [m.stop_ms for m in done if m.stop_ms is not None and m.tts_stop_ms is not None]
    diffs = [abs(m.played_ms_at_ear - m.server_played_ms) for m in done
             if m.played_ms_at_ear is not None and m.server_played_ms is not None]
    p95 = stats(stop)["p95"]
    return {
        "presses": len(measures),
        "while_speaking": len(done),
        "no_tts_stop": sum(1 for m in done if m.tts_stop_ms is None),
        "stop_at_device_ms": stats(stop),
        "target_p95_ms": TARGET_P95_MS,
        "target_met": p95 is not None and p95 <= TARGET_P95_MS,
        "tts_stop_ms": stats([m.tts_stop_ms for m in done if m.tts_stop_ms is not None]),
        "last_old_packet_ms": stats([m.received_stop_ms for m in done if m.received_stop_ms is not None]),
        "old_audio_after_tts_stop_ms": sum(m.old_audio_after_tts_stop_ms or 0.0 for m in done),
        "heard_position_diff_ms": stats(diffs),
        "records_honest": sum(1 for r in records if r["honest"]),
        "records": len(records),
        "stop_reasons": sorted({f"{r['stop_reason']} by {r['initiator']}" for r in records}),
        "detail": [m.as_dict() for m in done],
    }


async def calls(ws: str, device_token: str, kind: str, n: int, args: argparse.Namespace,
                rng: random.Random) -> dict[str, Any]:
    story, _ = C.embed(C.espeak(STORY, "en-us", 140), 0, 300)
    measures: list[BargeInMeasure] = []
    records: list[dict[str, Any]] = []
    left = n
    while left > 0:
        k = min(args.per_call, left)
        left -= k
        script = [
            Utterance(b"", at_s=round(rng.uniform(args.min_at, args.max_at), 2), label="abort", abort=True)
            if kind == "abort" else
            Utterance(up(story), at_s=round(rng.uniform(args.min_at, args.max_at), 2), label="ptt story")
            for _ in range(k)
        ]
        client = DeviceCallClient(ws, mode="manual", device_token=device_token, token=BENCH_TOKEN, version=args.version)
        result = await client.run(Utterance(up(story), label="story"), script, timeout_s=60 + 20 * k, settle_s=0.3,
                                  revive=Utterance(up(story), label="story again"))
        measures.extend(result.barge_ins)
        records.extend(record_of(result, m.old_turn_id) for m in result.barge_ins if m.old_turn_id)
        if result.protocol_errors:
            print(f"  protocol errors: {result.protocol_errors[:5]}", file=sys.stderr)
        if not args.json:
            print(f"  {kind} call {result.session_id[:8]}: {k} presses{'' if result.ok else ' (ended early)'}", file=sys.stderr)
    return figures(measures, records)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    async with server("tk-bench-device-", {"TURNKEEPER_API_TOKENS": f"default:{BENCH_TOKEN}"}) as (url, _proc):
        device_token = await issue_device_token(url, BENCH_TOKEN)
        ws = device_url(url)
        abort = await calls(ws, device_token, "abort", args.trials, args, rng)
        ptt = await calls(ws, device_token, "ptt", args.trials, args, rng)
    return {"protocol_version": args.version, "abort": abort, "ptt_press": ptt}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--trials", type=int, default=20, help="aborts and presses each (default 20)")
    p.add_argument("--per-call", type=int, default=5, help="presses per call (default 5)")
    p.add_argument("--min-at", type=float, default=0.5, help="earliest press after the agent's audio starts, s")
    p.add_argument("--max-at", type=float, default=3.0, help="latest press, s")
    p.add_argument("--quick", action="store_true", help="6 of each")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--version", type=int, choices=[1, 2, 3], default=1, help="binary protocol version")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    if args.quick:
        args.trials = min(args.trials, 6)
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"device (protocol v{out['protocol_version']}, push-to-talk)")
    print(f"{'figure':<40}{'n':>4}{'min':>9}{'p50':>9}{'p95':>9}{'max':>9}")
    for kind, title in (("abort", "abort"), ("ptt_press", "PTT press while speaking")):
        f = out[kind]
        for name, key in ((f"{title}: stop at the device (ms)", "stop_at_device_ms"), ("  tts stop after the press (ms)", "tts_stop_ms"),
                          ("  last old packet after it (ms)", "last_old_packet_ms"),
                          ("  heard position vs server (|ms|)", "heard_position_diff_ms")):
            s = f[key]
            cells = "".join(f"{'-' if s[c] is None else s[c]:>9}" for c in ("min", "p50", "p95", "max"))
            print(f"{name:<40}{s['n']:>4}{cells}")
        print(f"  target p95 <= {f['target_p95_ms']:.0f} ms: {'met' if f['target_met'] else 'NOT met'}; "
              f"old audio after tts stop {f['old_audio_after_tts_stop_ms']:.0f} ms; no tts stop {f['no_tts_stop']}; "
              f"records CANCEL_REQUESTED -> terminal {f['records_honest']}/{f['records']} ({', '.join(f['stop_reasons'])})")
    return 0


if __name__ == "__main__":
    sys.exit(main())
