#!/usr/bin/env python3
"""Speech synthesis providers under barge-in (issue 30): the stop reaches
the provider, nothing of the old generation reaches the caller, and the
history keeps what the caller heard.

For espeak-ng (``tts.provider = "embedded"``) and each provider's local
fake server (testkit/: OpenAI-compatible speech, ElevenLabs, Cartesia,
Deepgram Aura; each speaks its wire protocol, its voice espeak-ng word by
word, first audio 120 ms after a clause, 24 kHz asked), a turnkeeper server
is started with that provider and ``--calls`` WebRTC calls are made with
the headless aiortc client (client/call.py). Each call asks for a story and,
0.8 to 4 s after the agent's audio starts, says "tell me a story" over it
(a barge-in).

Figures per provider (min, p50, p95, max where they apply):

- provider told to stop: the reply's stop to the provider's stop message on
  the wire, ms (the ``tts.usage`` event's ``stop_told_ms``; Cartesia
  ``cancel``, ElevenLabs ``close_context``, Deepgram ``Clear``, the HTTP
  socket closed; espeak-ng: the process killed);
- late audio dropped: audio of the stopped reply that arrived from the
  provider after the stop and was dropped before playout, ms
  (``late_audio_ms``);
- old audio at the client: sound that reached the client between 60 ms
  after the ``barge_in`` event arrived (the frames already on the wire at
  the fence) and 400 ms after it (before any new reply can start), ms;
- audible stop at the client: the first sample of speech sent to the
  arrival of the packet where the agent's sound ends (bench/bargein.py's
  measure);
- heard text within one word: the server's ``agent.interrupted`` heard
  text against the words the client received, told from the fake's own
  word timings (each clause of the reply rendered by the same espeak-ng
  backend; their ends against the reply audio the client received before
  the stop); not judged for espeak-ng, which gives no word timings;
- characters billable after stops: ``characters_unspoken_at_stop``
  summed, and whether the provider confirmed the stop;
- first clause to first audio: the server's
  ``turnkeeper_tts_time_to_first_audio_seconds`` histogram, p50/p95
  interpolated in its buckets, ms.

Usage: python bench/speech.py [--json] [--calls N] [--quick] [--provider P ...]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import re
import subprocess
import sys
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import aiohttp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import corpus as C  # noqa: E402  (the tests' labelled corpus)
from bargein import STORY, stats, up  # noqa: E402
from local_server import free_port, server, stop_process  # noqa: E402

from client.call import CallClient  # noqa: E402
from client.results import CallResult, Utterance  # noqa: E402
from testkit.tts_backend import TtsBackend  # noqa: E402
from voice.text import SentenceSplitter  # noqa: E402

PROVIDERS = ("embedded", "openai", "elevenlabs", "cartesia", "deepgram")
KEY = "bench-key"
#: sound louder than this at the client counts as audio, dBFS
SOUND_DBFS = -45.0


#: the fake's module and its base URL's scheme and path
FAKES = {
    "openai": ("testkit.fake_openai_speech", "http", "/v1"),
    "elevenlabs": ("testkit.fake_elevenlabs", "ws", ""),
    "cartesia": ("testkit.fake_cartesia", "ws", ""),
    "deepgram": ("testkit.fake_deepgram_speak", "ws", ""),
}


@asynccontextmanager
async def fake(provider: str) -> AsyncIterator[str]:
    """The provider's fake in its own process on a free loopback port (so
    its work is not the client's), first audio 120 ms after a clause; yields
    its base URL ("" for espeak-ng, which needs none)."""
    if provider == "embedded":
        yield ""
        return
    module, scheme, suffix = FAKES[provider]
    port = free_port()
    proc = subprocess.Popen([sys.executable, "-m", module, "--port", str(port), "--api-key", KEY],
                            cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            if proc.poll() is not None:
                raise RuntimeError(f"{module} exited with {proc.returncode}")
            try:
                _, writer = await asyncio.open_connection("127.0.0.1", port)
                writer.close()
                break
            except OSError:
                await asyncio.sleep(0.05)
        yield f"{scheme}://127.0.0.1:{port}{suffix}"
    finally:
        stop_process(proc)


def server_env(provider: str, base_url: str) -> dict[str, str]:
    """The settings that put ``provider`` behind the server's replies."""
    if provider == "embedded":
        return {}
    return {
        "TURNKEEPER_TTS__PROVIDER": provider, "TURNKEEPER_TTS__BASE_URL": base_url, "TURNKEEPER_TTS__API_KEY": KEY,
        "TURNKEEPER_TTS__SAMPLE_RATE": "24000", "TURNKEEPER_TTS__VOICE": "bench-voice" if provider != "openai" else "alloy",
    }


async def first_audio_ms(url: str) -> dict[str, float | None]:
    """p50/p95 of the server's time-to-first-audio histogram, ms (linear in its buckets)."""
    async with aiohttp.ClientSession() as http, http.get(f"{url}/metrics") as resp:
        text = await resp.text()
    buckets: list[tuple[float, float]] = []
    for m in re.finditer(r'^turnkeeper_tts_time_to_first_audio_seconds_bucket\{le="([^"]+)"\} (\S+)$', text, re.M):
        buckets.append((float("inf") if m[1] == "+Inf" else float(m[1]), float(m[2])))
    total = buckets[-1][1] if buckets else 0.0

    def quantile(q: float) -> float | None:
        if not total:
            return None
        want, lo, below = q * total, 0.0, 0.0
        for le, count in buckets:
            if count >= want:
                if le == float("inf"):
                    return round(lo * 1000, 1)
                return round((lo + (le - lo) * (want - below) / max(count - below, 1e-9)) * 1000, 1)
            lo, below = le, count
        return None

    return {"n": total, "p50": quantile(0.5), "p95": quantile(0.95)}


def old_audio_ms(result: CallResult, fence_arrival: float) -> float:
    """Sound received 60-400 ms after the ``barge_in`` event arrived, ms."""
    return sum(20.0 for at, level, _ in result.received
               if fence_arrival + 0.06 <= at <= fence_arrival + 0.4 and level > SOUND_DBFS)


async def client_heard_words(backend: TtsBackend, reply: str, played_s: float) -> int:
    """Words of ``reply`` whose end lies within ``played_s`` of its audio,
    each clause rendered as the fakes render it (24 kHz), one after another."""
    splitter = SentenceSplitter()
    clauses = [*splitter.feed(reply), splitter.flush() or ""]
    offset, heard = 0.0, 0
    for clause in (c for c in clauses if c.strip()):
        r = await backend.render(clause, 24_000)
        for _, _, end in r.words:
            if offset + end <= played_s:
                heard += 1
        offset += r.seconds
    return heard


async def bench_provider(provider: str, calls: int, rng: random.Random, story: bytes) -> dict[str, Any]:
    """``calls`` WebRTC calls to a server speaking through ``provider``
    (its fake started here), each barging in once at a random 0.8-4 s;
    returns the figures of the module doc (ms, characters, counts).

    Raises:
        RuntimeError: the fake or the server did not start.
    """
    told, late, old, audible, unspoken = [], [], [], [], 0
    confirmed = unconfirmed = within = judged = missed = 0
    backend = TtsBackend()
    async with fake(provider) as base_url, server("tk-speech-", server_env(provider, base_url)) as (url, _proc):
        for n in range(calls):
            at_s = round(rng.uniform(0.8, 4.0), 2)
            result = await CallClient(url).run(
                Utterance(up(story), label="story"), [Utterance(up(story), label="barge-in", kind="speech", at_s=at_s)],
                timeout_s=60, settle_s=0.5, hangup_after_s=0.5, revive=Utterance(up(story), label="story again"),
            )
            [m] = result.barge_ins or [None]
            if m is None or not m.barged_in:
                missed += 1
                continue
            if m.onset_sent_at is not None and m.silent_at is not None and m.speaking_at_onset:
                audible.append((m.silent_at - m.onset_sent_at) * 1000)
            fences = [(at, e) for at, e in result.event_times if e.get("type") == "barge_in"]
            if not fences:
                missed += 1
                continue
            old.append(old_audio_ms(result, fences[0][0]))
            old_turn = fences[0][1].get("old_turn_id")
            usages = [e for e in result.events if e.get("type") == "tts.usage" and e.get("turn_id") == old_turn]
            for u in usages:
                if u.get("stop_told_ms") is not None:
                    told.append(float(u["stop_told_ms"]))
                late.append(float(u.get("late_audio_ms") or 0.0))
                unspoken += int(u.get("characters_unspoken_at_stop") or 0)
                confirmed += u.get("after_stop") == "confirmed"
                unconfirmed += u.get("after_stop") == "unconfirmed"
            interrupted = [e for e in result.events if e.get("type") == "agent.interrupted" and e.get("turn_id") == old_turn]
            reply = "".join(e.get("text", "") for e in result.events
                            if e.get("type") == "agent.delta" and e.get("turn_id") == old_turn)
            if provider != "embedded" and interrupted and m.agent_started_at is not None and m.silent_at is not None:
                words = await client_heard_words(backend, reply, m.silent_at - m.agent_started_at)
                judged += 1
                within += abs(words - len(interrupted[0].get("heard", "").split())) <= 1
            print(f"  {provider} call {n + 1}/{calls}: barge-in at {at_s} s", file=sys.stderr)
        ttfa = await first_audio_ms(url)
    return {
        "provider": provider, "calls": calls, "missed": missed,
        "provider_told_ms": stats(told), "late_audio_dropped_ms": stats(late), "old_audio_at_client_ms": stats(old),
        "audible_stop_ms": stats(audible),
        "heard_within_one_word": {"judged": judged, "within": within},
        "characters_billable_after_stops": unspoken, "stops_confirmed": confirmed, "stops_unconfirmed": unconfirmed,
        "first_clause_to_first_audio_ms": ttfa,
    }


def table(rows: list[dict[str, Any]]) -> str:
    """The figures of :func:`bench_provider`, one row per provider, as text."""
    def q(s: dict[str, Any]) -> str:
        return "-" if not s.get("n") else f"{s['p50']}/{s['p95']}"

    lines = [f"{'provider':<11} {'told p50/p95':>13} {'late drop p95':>13} {'old@client max':>14} {'audible stop':>13} "
             f"{'heard ±1 word':>13} {'chars after stop':>16} {'first audio':>12}"]
    for r in rows:
        h = r["heard_within_one_word"]
        lines.append(
            f"{r['provider']:<11} {q(r['provider_told_ms']):>13} {str(r['late_audio_dropped_ms']['p95']):>13} "
            f"{str(r['old_audio_at_client_ms']['max']):>14} {q(r['audible_stop_ms']):>13} "
            f"{(str(h['within']) + '/' + str(h['judged'])) if h['judged'] else 'n/a':>13} "
            f"{r['characters_billable_after_stops']:>16} "
            f"{str(r['first_clause_to_first_audio_ms']['p50']) + '/' + str(r['first_clause_to_first_audio_ms']['p95']):>12}"
        )
    return "\n".join(lines)


async def main() -> None:
    """Parse the arguments, bench each provider, print the table or one JSON object."""
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--calls", type=int, default=10, help="calls per provider")
    ap.add_argument("--quick", action="store_true", help="3 calls per provider")
    ap.add_argument("--provider", nargs="+", choices=PROVIDERS, default=list(PROVIDERS))
    ap.add_argument("--seed", type=int, default=30)
    args = ap.parse_args()
    rng = random.Random(args.seed)
    story, _ = C.embed(C.espeak(STORY, "en-us", 140), 0, 300)
    rows = [await bench_provider(p, 3 if args.quick else args.calls, rng, story) for p in args.provider]
    if args.json:
        print(json.dumps({"providers": rows}))
    else:
        print(table(rows))


if __name__ == "__main__":
    asyncio.run(main())
