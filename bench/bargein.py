#!/usr/bin/env python3
"""Barge-in benchmark: how fast does the agent go silent when the user speaks?

Starts a turnkeeper server in its own process on loopback, then makes calls
with the headless aiortc client (web/call.py). Each call asks for a story and
interrupts the agent again and again at varied offsets after it starts
talking; every barge-in gives two figures:

- audible stop (client): from the first sample of barge-in speech handed to
  the client's RTP sender, to the arrival of the first decoded agent frame
  after which the agent stays silent (includes the client's 20 ms jitter
  buffer, the network, the server's inbound jitter buffer, VAD onset, the
  fence, the next 20 ms outbound tick, Opus encode and decode);
- onset to fence (server): from the arrival of the first voiced frame of the
  barge-in to the generation fence.

Barge-ins that land while the agent happens to be silent (between sentences)
are counted but left out of the audible-stop figures, which would flatter us.

Usage: python bench/bargein.py [--barge-ins N] [--per-call K] [--json]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import aiohttp
import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from media.frames import PLAYOUT_RATE, load_pcm  # noqa: E402
from web.call import CallClient, Utterance  # noqa: E402

GRAMMAR = (
    "#JSGF V1.0;\ngrammar bench;\n"
    "public <utt> = tell me a story | what is the weather like today | count to twenty;\n"
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def speak(text: str, path: Path) -> bytes:
    subprocess.run(["espeak-ng", "-v", "en-us", "-s", "140", "-w", str(path), text], check=True)
    return load_pcm(path, PLAYOUT_RATE)


async def wait_healthy(url: str, proc: subprocess.Popen[bytes], timeout: float = 30) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as http:
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(f"server exited with {proc.returncode}")
            try:
                async with http.get(f"{url}/healthz") as resp:
                    if resp.status == 200:
                        return
            except aiohttp.ClientError:
                pass
            await asyncio.sleep(0.1)
    raise RuntimeError("server did not become healthy")


def stats(values: list[float]) -> dict[str, float | int | None]:
    if not values:
        return {"n": 0, "min": None, "p50": None, "p95": None, "max": None}
    a = np.asarray(values, dtype=float)
    return {
        "n": len(values),
        "min": round(float(a.min()), 1),
        "p50": round(float(np.percentile(a, 50)), 1),
        "p95": round(float(np.percentile(a, 95)), 1),
        "max": round(float(a.max()), 1),
    }


async def run(args: argparse.Namespace) -> dict[str, object]:
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="tk-bench-") as tmp:
        d = Path(tmp)
        (d / "bench.gram").write_text(GRAMMAR)
        story = speak("tell me a story", d / "story.wav")
        weather = speak("what is the weather like today", d / "weather.wav")
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        env = {
            **os.environ,
            "PYTHONPATH": str(ROOT),
            "TURNKEEPER_STORE": f"sqlite:///{d}/bench.db",
            "TURNKEEPER_STT__GRAMMAR": str(d / "bench.gram"),
            "TURNKEEPER_LOG_LEVEL": "WARNING",
        }
        proc = subprocess.Popen(
            [sys.executable, "-m", "web.cli", "serve", "--port", str(port)], env=env, cwd=d
        )
        measures = []
        try:
            await wait_healthy(url, proc)
            remaining = args.barge_ins
            while remaining > 0:
                k = min(args.per_call, remaining)
                offsets = [round(rng.uniform(args.min_at, args.max_at), 2) for _ in range(k)]
                # Each barge-in asks for the story again, so there is always a
                # long answer to interrupt; the last asks for the short weather
                # report, so the call does not wait out a whole story.
                barge_ins = [Utterance(pcm=story, at_s=at, label=f"story@{at}") for at in offsets[:-1]]
                barge_ins.append(Utterance(pcm=weather, at_s=offsets[-1], label=f"weather@{offsets[-1]}"))
                result = await CallClient(url).run(
                    Utterance(pcm=story, label="story"), barge_ins, timeout_s=30 + 15 * k, settle_s=0.2
                )
                measures.extend(result.barge_ins)
                remaining -= k
                if not args.json:
                    print(f"  call {result.session_id[:8]}: {k} barge-ins", file=sys.stderr)
        finally:
            proc.terminate()
            try:
                proc.wait(10)
            except subprocess.TimeoutExpired:
                proc.kill()
    audible = [m.stop_ms for m in measures if m.speaking_at_onset and m.stop_ms is not None]
    fence = [m.server_onset_to_fence_ms for m in measures if m.server_onset_to_fence_ms is not None]
    return {
        "barge_ins": len(measures),
        "agent_silent_at_onset": sum(1 for m in measures if not m.speaking_at_onset),
        "unmeasured": sum(1 for m in measures if m.stop_ms is None),
        "audible_stop_ms": stats([v for v in audible if v is not None]),
        "onset_to_fence_ms": stats(fence),
        "offsets_s": [m.at_s for m in measures],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--barge-ins", type=int, default=24, help="how many barge-ins in all (default 24)")
    p.add_argument("--per-call", type=int, default=6, help="barge-ins per call (default 6)")
    p.add_argument("--min-at", type=float, default=0.2, help="earliest offset after the agent starts talking, s")
    p.add_argument("--max-at", type=float, default=2.5, help="latest offset, s")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"barge-ins: {out['barge_ins']}  (agent already silent at onset: {out['agent_silent_at_onset']}, "
          f"unmeasured: {out['unmeasured']})")
    print(f"{'figure':<34}{'n':>4}{'min':>9}{'p50':>9}{'p95':>9}{'max':>9}")
    for name, key in (("audible stop at client (ms)", "audible_stop_ms"), ("onset to fence on server (ms)", "onset_to_fence_ms")):
        s = out[key]
        assert isinstance(s, dict)
        cells = "".join(f"{'-' if s[c] is None else s[c]:>9}" for c in ("min", "p50", "p95", "max"))
        print(f"{name:<34}{s['n']:>4}{cells}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
