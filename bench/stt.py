#!/usr/bin/env python3
"""Speech recognisers through the product's own path, side by side (issue 28).

For each recogniser: the light embedded one (pocketsphinx) and each provider's
fake (testkit/fake_deepgram.py, fake_openai_realtime.py in its GA shape,
fake_openai_transcriptions.py in OpenAI's dialect with ``stream`` on), each
fake in its own process at a realistic latency (interim 150 ms, final
300 ms after the audio) with pocketsphinx underneath (and as the fallback).
Every one uses the tests' JSGF grammar (tests/conftest.py GRAMMAR), so the word error
rate shows what the plumbing adds (nothing, if it works), not a provider's
quality. A server (bench/local_server.py, demo shop off: no tool time in
the replies) is started for each, and WebRTC calls (client/call.py) are
made as a caller would:

- the caller asks for a story in a voice (a labelled utterance): its
  voice-to-voice (last sample of speech sent to the reply's first sound at
  the client) and its transcript;
- while the story plays, a backchannel ("uh-huh", "mm-hmm", "yeah",
  "okay", "right", two voices): it should be kept talking (no barge-in);
- then a labelled request (six phrases, three voices, two speeds): it
  should barge in: its audible stop (first speech sample sent to the
  agent's audio silent at the client), its transcript, and its reply's
  voice-to-voice.

Figures per recogniser: audible stop p50/p95, backchannels kept talking,
voice-to-voice p50/p95 (openings and requests), word error rate and exact
transcripts over the labelled utterances, and failovers (a fake that failed
would hide behind the fallback: there must be none).

Usage: python bench/stt.py [--json] [--calls N] [--quick] [--only NAME ...]
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
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import corpus as C  # noqa: E402  (the tests' corpus)
import recognition_corpus as R  # noqa: E402  (its word error rate)
from bargein import stats, up  # noqa: E402
from conftest import GRAMMAR  # noqa: E402
from local_server import free_port, server, stop_process  # noqa: E402

from client.call import CallClient  # noqa: E402
from client.results import CallResult, Utterance  # noqa: E402

STORY = "tell me a story"
#: the requests said over the story (pocketsphinx hears "front left" and the
#: like wrong when they follow silence, grammar or not: left out)
REQUESTS = ["hello there", "count to twenty", "what is the weather like today", "make it a large one",
            "like in paris today", "what is the weather"]
VOICES = ["en-us", "en-gb", "en-us+f3"]
SPEEDS = [140, 175]
#: every request in every voice at every speed, in a fixed shuffled order
REQUEST_CLIPS = [(t, v, w) for w in SPEEDS for v in VOICES for t in REQUESTS]
random.Random(28).shuffle(REQUEST_CLIPS)
LATENCY = {"--interim-ms": "150", "--final-ms": "300"}
BENCH_KEY = "bench-key"


@dataclass
class Recogniser:
    """One recogniser under test: the fake's command (None: embedded) and
    the server's settings for it."""

    name: str
    fake: list[str] | None
    env: dict[str, str] = field(default_factory=dict)


def recognisers(port: int, grammar: Path) -> list[Recogniser]:
    """The embedded recogniser and the three providers' fakes (on ``port``)."""
    py = [sys.executable, "-m"]
    common = ["--port", str(port), "--grammar", str(grammar), "--api-key", BENCH_KEY, *[x for kv in LATENCY.items() for x in kv]]
    key = {"TURNKEEPER_STT__API_KEY": BENCH_KEY}
    return [
        Recogniser("pocketsphinx", None, {"TURNKEEPER_STT__PROVIDER": "pocketsphinx"}),
        Recogniser("deepgram", [*py, "testkit.fake_deepgram", *common],
                   {"TURNKEEPER_STT__PROVIDER": "deepgram", "TURNKEEPER_STT__BASE_URL": f"ws://127.0.0.1:{port}", **key}),
        Recogniser("openai_realtime", [*py, "testkit.fake_openai_realtime", *common, "--mode", "ga"],
                   {"TURNKEEPER_STT__PROVIDER": "openai_realtime", "TURNKEEPER_STT__BASE_URL": f"http://127.0.0.1:{port}/v1", **key}),
        Recogniser("openai", [*py, "testkit.fake_openai_transcriptions", *common, "--dialect", "openai"],
                   {"TURNKEEPER_STT__PROVIDER": "openai", "TURNKEEPER_STT__BASE_URL": f"http://127.0.0.1:{port}/v1",
                    "TURNKEEPER_STT__STREAM": "true", **key}),
    ]


def wait_port(port: int, proc: subprocess.Popen[bytes], timeout_s: float = 30) -> None:
    """Wait until something listens on 127.0.0.1:``port``.

    Raises:
        RuntimeError: ``proc`` exited, or nothing listened within ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"the fake exited with {proc.returncode}")
        with socket.socket() as s:
            if s.connect_ex(("127.0.0.1", port)) == 0:
                return
        time.sleep(0.1)
    raise RuntimeError(f"nothing listens on port {port}")


def script(n: int) -> tuple[Utterance, str, list[Utterance], str]:
    """Call ``n``'s opening (and its label) and clips: a backchannel, then a
    labelled request (and its label)."""
    voice = VOICES[n % len(VOICES)]
    opening, _ = C.embed(C.espeak(STORY, voice, 140), 0, 300)
    bcs = C.backchannel_clips()
    bc = bcs[n % len(bcs)]
    text, req_voice, wpm = REQUEST_CLIPS[n % len(REQUEST_CLIPS)]
    request, _ = C.embed(C.espeak(text, req_voice, wpm), 0, 300)
    clips = [Utterance(up(bc.pcm), at_s=1.0, label=bc.name, kind="backchannel"),
             Utterance(up(request), at_s=1.2, label=f"{text} ({req_voice} {wpm})", kind="speech")]
    return Utterance(up(opening), label=f"{STORY} ({voice})"), STORY, clips, text


def judge(result: CallResult, opening_text: str, request_text: str) -> dict[str, Any]:
    """One call's figures: what was heard against what was said, the stop,
    the backchannel, voice-to-voice."""
    turns = result.turns
    heard = [t.transcript for t in turns]
    bc, req = result.barge_ins
    said = [(opening_text, heard[0] if heard else None)]
    # the request is the turn after the opening (a backchannel that barged in would add one: counted apart)
    said.append((request_text, heard[-1] if len(heard) >= 2 else None))
    failovers = [e for e in result.events if e.get("type") == "stt.failover"]
    usage = [e for e in result.events if e.get("type") == "stt.usage"]
    return {
        "session_id": result.session_id,
        "said": said,
        "stop_ms": req.stop_ms if req.barged_in and req.speaking_at_onset else None,
        "request_barged_in": req.barged_in,
        "backchannel_kept": not bc.barged_in,
        "backchannel_resumed": bc.resumed,
        "v2v_ms": [v for v in (result.voice_to_voice_ms, req.reply_after_ms) if v is not None],
        "failovers": failovers,
        "usage": usage,
        "timed_out": result.timed_out,
    }


async def bench_one(rec: Recogniser, calls: int, grammar: Path, port: int, log_dir: Path, quiet: bool) -> dict[str, Any]:
    """Start ``rec``'s fake (if any) and a server on it; make ``calls`` calls."""
    fake: subprocess.Popen[bytes] | None = None
    if rec.fake is not None:
        out = (log_dir / f"fake-{rec.name}.log").open("wb")
        fake = subprocess.Popen(rec.fake, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT,
                                env={**os.environ, "PYTHONPATH": str(ROOT)})
        out.close()
        wait_port(port, fake)
    # pocketsphinx with the grammar under every one (the fakes' and the fallback's)
    env = {"TURNKEEPER_DEMO_SHOP": "false", "TURNKEEPER_STT__EMBEDDED": "pocketsphinx", "TURNKEEPER_STT__GRAMMAR": str(grammar),
           **rec.env}
    results = []
    try:
        async with server(f"tk-bench-stt-{rec.name}-", env, log_path=log_dir / f"server-{rec.name}.log") as (url, _proc):
            for n in range(calls):
                opening, opening_text, clips, request_text = script(n)
                result = await CallClient(url).run(opening, clips, timeout_s=60, settle_s=0.3)
                results.append(judge(result, opening_text, request_text))
                with (log_dir / f"calls-{rec.name}.jsonl").open("a") as f:
                    f.write(json.dumps({**result.as_dict(), "events": result.events}) + "\n")
                if not quiet:
                    r = results[-1]
                    print(f"  {rec.name} call {n + 1}/{calls}: heard {[h for _, h in r['said']]} stop {r['stop_ms']} "
                          f"v2v {r['v2v_ms']} bc kept {r['backchannel_kept']}", file=sys.stderr)
    finally:
        if fake is not None:
            stop_process(fake)
    said = [pair for r in results for pair in r["said"]]
    counts = [R.word_errors(s, h) for s, h in said]
    ref_words = sum(w for _, w in counts)
    errors = sum(e for e, _ in counts)
    return {
        "recogniser": rec.name,
        "calls": len(results),
        "audible_stop_ms": stats([r["stop_ms"] for r in results if r["stop_ms"] is not None]),
        "requests_barged_in": sum(r["request_barged_in"] for r in results),
        "backchannels_kept_talking": sum(r["backchannel_kept"] for r in results),
        "voice_to_voice_ms": stats([v for r in results for v in r["v2v_ms"]]),
        "labelled_utterances": len(said),
        "word_error_rate": round(errors / ref_words, 4) if ref_words else None,
        "exact": sum(e == 0 for e, _ in counts),
        "failovers": sum(len(r["failovers"]) for r in results),
        "timed_out": sum(r["timed_out"] for r in results),
        "misheard": [(s, h) for (s, h), (e, _) in zip(said, counts, strict=True) if e],
    }


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tk-bench-stt-") as tmp:
        d = Path(tmp)
        grammar = d / "bench.gram"
        grammar.write_text(GRAMMAR)
        log_dir = Path(args.logs) if args.logs else d
        log_dir.mkdir(parents=True, exist_ok=True)
        port = free_port()
        out = []
        for rec in recognisers(port, grammar):
            if args.only and rec.name not in args.only:
                continue
            out.append(await bench_one(rec, args.calls, grammar, port, log_dir, args.json))
    return {"latency": {"interim_ms": 150, "final_ms": 300}, "recognisers": out}


def table(result: dict[str, Any]) -> str:
    rows = [("recogniser", "stop p50/p95 ms", "backchannels kept", "v2v p50/p95 ms", "WER", "exact", "failovers")]
    for r in result["recognisers"]:
        s, v = r["audible_stop_ms"], r["voice_to_voice_ms"]
        rows.append((r["recogniser"], f"{s['p50']} / {s['p95']}", f"{r['backchannels_kept_talking']} of {r['calls']}",
                     f"{v['p50']} / {v['p95']}", f"{100 * (r['word_error_rate'] or 0):.1f}%",
                     f"{r['exact']} of {r['labelled_utterances']}", str(r["failovers"])))
    widths = [max(len(row[i]) for row in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--calls", type=int, default=18, help="calls per recogniser (2 labelled utterances each; default 18)")
    p.add_argument("--quick", action="store_true", help="3 calls per recogniser")
    p.add_argument("--only", nargs="*", help="these recognisers only (pocketsphinx, deepgram, openai_realtime, openai)")
    p.add_argument("--logs", help="keep the servers' and fakes' logs in this folder")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    if args.quick:
        args.calls = 3
    result = asyncio.run(run(args))
    if args.json:
        print(json.dumps(result))
    else:
        print(table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
