#!/usr/bin/env python3
"""Backchannel bench: does "uh-huh" while the agent talks ever cost the
caller the reply? (issue 32, target 1)

    python bench/backchannels.py [--transport webrtc|twilio|telnyx|device]
                                 [--per-phrase 20] [--warm-sessions 100]
                                 [--per-call 10] [--stt whisper|deepgram]
                                 [--seed 1] [--json]

Starts one turnkeeper server in its own process on loopback (the embedded
defaults: Whisper, espeak-ng, the local agent) and first has it serve
``--warm-sessions`` short calls on the same transport (each asks for the
story, then, once the agent talks, says an interruption or a backchannel
and hangs up), so the figures are those of a server that has been up for a
while, not of a fresh one. Then the measured calls: each asks for the story
and, while the agent talks, says backchannels one after another, each at a
random moment 0.3-2 s after the agent's audio started again.

The phrases ("uh-huh", "mm-hmm", "okay", "yeah", "right", "I see", "sure")
are espeak-ng in three voices (American male, British female, a second male
variant), each phrase ``--per-phrase`` times over the voices in turn, in a
seeded random order.

Judged where the caller is (the same clients as bench/bargein.py: the aiortc
client, the simulated phone's ear, the simulated device's speaker):

- cancelled: the server committed a barge-in for it (the reply was lost);
  target: at most 1 in 20 per phrase;
- to the model: a user ``transcript`` (other than the request and the
  bench's own re-asks) after a backchannel said over the agent that did not
  barge in: a backchannel heard as a turn of its own. One said while the
  agent was already silent (its reply over, or cancelled by an earlier
  one) is not judged; it rightly makes a turn;
- resumed: it paused the agent, which went on (``backchannel`` or
  ``false_interruption``), or it never paused it;
- after its end: for one that paused the agent, from its last speech sample
  sent to the agent's sound again where the caller hears it, ms; target
  p95 <= 300 ms;
- played again: the ``backchannel`` events' ``replayed_ms`` (the reply went
  back to the start of the word it paused in).

``--stt deepgram`` recognises through Deepgram's live API instead of the
embedded Whisper, served by its local fake (testkit/fake_deepgram.py) at a
provider's latency (interims 150 ms, finals 300 ms after their audio;
pocketsphinx on a grammar of these phrases underneath): how soon a
streaming provider's interims let a backchannel go on.

Time: about 2.5 s per warm session and 3 s per backchannel, so the defaults
take about 12 minutes per transport. Progress goes to stderr; with
``--json``, stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import corpus as C  # noqa: E402  (espeak-ng, cached)
from bargein import BENCH_TOKEN, STORY, make_client, stats, up  # noqa: E402
from local_server import free_port, server, stop_process  # noqa: E402
from stt import BENCH_KEY, LATENCY, wait_port  # noqa: E402

from client.command import issue_device_token  # noqa: E402
from client.results import BargeInMeasure, CallResult, Utterance  # noqa: E402
from media.frames import VAD_RATE  # noqa: E402

PHRASES = ["uh-huh", "mm-hmm", "okay", "yeah", "right", "I see", "sure"]
VOICES = ["en-us", "en-gb+f3", "en+m3"]
INTERRUPT = "wait stop"
WPM = 160
LEAD_MS, TRAIL_MS = 100, 1000  # silence around each phrase (the trail lets a verdict and a resume be heard)
#: at most this many of every 20 of a phrase may cancel the reply (issue 32)
ALLOWED_PER_20 = 1


def phrase_item(text: str, voice: str) -> Utterance:
    """``text`` said by espeak-ng ``voice`` as a backchannel utterance (48 kHz),
    with where its speech ends."""
    raw = C.espeak(text, voice, WPM)
    pcm, off = C.embed(raw, LEAD_MS, TRAIL_MS)
    end = off + len(raw) / 2 / VAD_RATE
    return Utterance(up(pcm), label=f"{text}|{voice}", kind="backchannel", speech_end_s=end)


def script(per_phrase: int, rng: random.Random) -> list[Utterance]:
    """Each phrase ``per_phrase`` times, over the voices in turn, shuffled."""
    cache: dict[tuple[str, str], Utterance] = {}
    items = []
    for text in PHRASES:
        for i in range(per_phrase):
            voice = VOICES[i % len(VOICES)]
            proto = cache.setdefault((text, voice), phrase_item(text, voice))
            items.append(Utterance(proto.pcm, label=proto.label, kind=proto.kind, speech_end_s=proto.speech_end_s))
    rng.shuffle(items)
    return items


def words(text: str) -> str:
    return " ".join(re.findall(r"[a-z]+", text.lower()))


def turns_after(result: CallResult) -> list[tuple[BargeInMeasure | None, str]]:
    """The user turns the server opened in the call other than the request
    (and the bench's re-asks), each with the backchannel said last before it
    (None: none was)."""
    out: list[tuple[BargeInMeasure | None, str]] = []
    for at, e in result.event_times:
        if e.get("type") != "transcript" or e.get("role") != "user" or "story" in words(str(e.get("text", ""))):
            continue
        before = [m for m in result.barge_ins if m.sent_from is not None and m.sent_from <= at]
        out.append((max(before, key=lambda m: m.sent_from or 0.0) if before else None, str(e.get("text", ""))))
    return out


def replayed(result: CallResult) -> list[float]:
    """``replayed_ms`` of the call's ``backchannel`` events."""
    return [float(e.get("replayed_ms", 0)) for e in result.events if e.get("type") == "backchannel"]


async def warm_up(url: str, transport: str, device_token: str | None, n: int, concurrency: int,
                  story: Utterance, rng: random.Random, quiet: bool) -> dict[str, int]:
    """Serve ``n`` short calls, ``concurrency`` at a time: the request, then
    one interruption or backchannel 0.3-1 s into the reply, hang up."""
    stim = [Utterance(up(C.embed(C.espeak(INTERRUPT, v, WPM), LEAD_MS, 300)[0]), label="wait", kind="speech")
            for v in VOICES] + [phrase_item(t, v) for t in PHRASES[:3] for v in VOICES[:1]]
    done = {"calls": 0, "failed": 0}
    sem = asyncio.Semaphore(concurrency)

    async def one(i: int) -> None:
        async with sem:
            u = stim[i % len(stim)]
            clip = Utterance(u.pcm, at_s=round(rng.uniform(0.3, 1.0), 2), label=u.label, kind=u.kind,
                             speech_end_s=u.speech_end_s)
            try:
                await make_client(url, transport, device_token).run(story, [clip], timeout_s=40, settle_s=0.1,
                                                                    hangup_after_s=0.3)
                done["calls"] += 1
            except Exception as exc:  # noqa: BLE001  (a warm-up call that failed is counted, not fatal)
                done["failed"] += 1
                print(f"  warm-up call {i} failed: {exc!r}", file=sys.stderr)
            if not quiet and (done["calls"] + done["failed"]) % 20 == 0:
                print(f"  warm-up: {done['calls']} calls served", file=sys.stderr)

    async with asyncio.TaskGroup() as tg:
        for i in range(n):
            tg.create_task(one(i))
    return done


#: what the Deepgram fake's recogniser may hear (pocketsphinx, JSGF): the
#: request, the phrases, the warm-up's interruption
DEEPGRAM_GRAMMAR = ("#JSGF V1.0;\ngrammar backchannels;\npublic <utt> = "
                    + " | ".join([STORY, "uh huh", "mhm", "okay", "yeah", "right", "i see", "sure", INTERRUPT]) + ";\n")


@contextlib.contextmanager
def deepgram_fake(tmp: Path) -> Iterator[dict[str, str]]:
    """The Deepgram fake (testkit/fake_deepgram.py) in its own process at a
    provider's latency (interims 150 ms, finals 300 ms after their audio),
    pocketsphinx on :data:`DEEPGRAM_GRAMMAR` underneath; yields the
    server's settings for it.

    Raises:
        RuntimeError: it did not listen within 30 s.
    """
    grammar = tmp / "backchannels.gram"
    grammar.write_text(DEEPGRAM_GRAMMAR)
    port = free_port()
    log = (tmp / "fake-deepgram.log").open("wb")
    proc = subprocess.Popen([sys.executable, "-m", "testkit.fake_deepgram", "--port", str(port), "--grammar", str(grammar),
                             "--api-key", BENCH_KEY, *[x for kv in LATENCY.items() for x in kv]],
                            cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "PYTHONPATH": str(ROOT)})
    log.close()
    try:
        wait_port(port, proc)
        yield {"TURNKEEPER_STT__PROVIDER": "deepgram", "TURNKEEPER_STT__BASE_URL": f"ws://127.0.0.1:{port}",
               "TURNKEEPER_STT__API_KEY": BENCH_KEY, "TURNKEEPER_STT__EMBEDDED": "pocketsphinx",
               "TURNKEEPER_STT__GRAMMAR": str(grammar)}
    finally:
        stop_process(proc)


async def run(args: argparse.Namespace) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="tk-bench-bc-") as tmp, contextlib.ExitStack() as stack:
        stt_env = stack.enter_context(deepgram_fake(Path(tmp))) if args.stt == "deepgram" else {}
        return await measure(args, stt_env)


async def measure(args: argparse.Namespace, stt_env: dict[str, str]) -> dict[str, Any]:
    rng = random.Random(args.seed)
    items = script(args.per_phrase, rng)
    story = Utterance(up(C.embed(C.espeak(STORY, "en-us", 140), 0, 300)[0]), label="story")
    phone = args.transport != "webrtc"
    env = {**stt_env, **({"TURNKEEPER_API_TOKENS": f"default:{BENCH_TOKEN}"} if phone else {})}
    measures: list[BargeInMeasure] = []
    extra_turns: list[str] = []
    over_silence: list[str] = []
    replays: list[float] = []
    t0 = time.monotonic()
    async with server("tk-bench-", env) as (url, _proc):
        device_token = await issue_device_token(url, BENCH_TOKEN) if args.transport == "device" else None
        warm = await warm_up(url, args.transport, device_token, args.warm_sessions, args.warm_concurrency,
                             story, rng, args.json)
        warm_s = time.monotonic() - t0
        chunks = [items[i : i + args.per_call] for i in range(0, len(items), args.per_call)]
        for n, chunk in enumerate(chunks):
            for u in chunk:
                u.at_s = round(rng.uniform(0.3, 2.0), 2)
            result = await make_client(url, args.transport, device_token).run(
                story, chunk, timeout_s=90 + 5 * len(chunk), settle_s=0.3, hangup_after_s=1.0,
                revive=Utterance(story.pcm, label="story again"),  # the reply ended, or a request was misheard
            )
            measures.extend(result.barge_ins)
            for m, text in turns_after(result):
                if m is None or not m.speaking_at_onset:
                    over_silence.append(text)  # said while the agent was silent: a turn, rightly (issue 32.4)
                elif not m.barged_in:
                    extra_turns.append(text)  # a backchannel over the agent that became a turn
            replays.extend(replayed(result))
            if not args.json:
                cancels = sum(m.barged_in for m in result.barge_ins)
                print(f"  call {n + 1}/{len(chunks)} {result.session_id[:8]}: {len(chunk)} backchannels, "
                      f"{cancels} cancelled", file=sys.stderr)
    sent = [m for m in measures if m.sent_from is not None]  # the rest: the call ended before it was said
    said = [m for m in sent if m.speaking_at_onset]  # over the agent's voice: the ones judged
    per_phrase: dict[str, dict[str, Any]] = {}
    per_voice: dict[str, dict[str, int]] = {}
    for m in said:
        text, voice = m.label.split("|")
        p = per_phrase.setdefault(text, {"n": 0, "cancelled": 0, "paused_resumed": 0, "kept_talking": 0,
                                         "after_end": []})
        p["n"] += 1
        p["cancelled"] += m.barged_in
        p["paused_resumed"] += m.resumed is not None and not m.barged_in
        p["kept_talking"] += m.resumed is None and not m.barged_in
        if m.resumed_after_end_ms is not None and not m.barged_in:
            p["after_end"].append(m.resumed_after_end_ms)
        v = per_voice.setdefault(voice, {"n": 0, "cancelled": 0})
        v["n"] += 1
        v["cancelled"] += m.barged_in
    for p in per_phrase.values():
        p["after_end_ms"] = stats(p.pop("after_end"))
        p["meets_target"] = p["cancelled"] * 20 <= ALLOWED_PER_20 * p["n"]
    after = [m.resumed_after_end_ms for m in said if m.resumed_after_end_ms is not None and not m.barged_in]
    return {
        "transport": args.transport,
        "stt": args.stt,
        "warm_sessions": warm["calls"],
        "warm_failed": warm["failed"],
        "warm_s": round(warm_s, 1),
        "backchannels": len(said),
        "unsent": len(measures) - len(sent),
        # said while the agent was silent (its reply had ended, or a cancel): not judged; turns they made
        "over_silence": len(sent) - len(said),
        "over_silence_turns": over_silence,
        "cancelled": sum(m.barged_in for m in said),
        "to_the_model": len(extra_turns),
        "to_the_model_texts": extra_turns,
        "after_end_ms": stats([a for a in after if a is not None]),
        "replayed_ms": stats(replays),
        "replayed_nonzero": sum(r > 0 for r in replays),
        "per_phrase": per_phrase,
        "per_voice": per_voice,
        "all_phrases_meet_target": all(p["meets_target"] for p in per_phrase.values()) and len(per_phrase) == len(PHRASES),
        "cancelled_detail": [m.as_dict() for m in said if m.barged_in],
    }


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--transport", choices=["webrtc", "twilio", "telnyx", "device"], default="webrtc")
    p.add_argument("--per-phrase", type=int, default=20, help="times each phrase is said (default 20)")
    p.add_argument("--warm-sessions", type=int, default=100, help="calls the server serves first (default 100)")
    p.add_argument("--warm-concurrency", type=int, default=2, help="warm-up calls at once (default 2)")
    p.add_argument("--per-call", type=int, default=10, help="backchannels per measured call (default 10)")
    p.add_argument("--stt", choices=["whisper", "deepgram"], default="whisper",
                   help="the embedded Whisper (default), or Deepgram's streaming interims from its local fake")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures")
    args = p.parse_args()
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
        return 0
    print(f"transport: {out['transport']}  stt: {out['stt']}  after {out['warm_sessions']} warm-up calls "
          f"({out['warm_failed']} failed, {out['warm_s']} s)")
    print(f"backchannels over the agent: {out['backchannels']} (over silence {out['over_silence']}, unsent "
          f"{out['unsent']})  cancelled: {out['cancelled']}  "
          f"reached the model as a turn: {out['to_the_model']} {out['to_the_model_texts']}")
    print(f"{'phrase':<10}{'n':>4}{'cancel':>8}{'resumed':>9}{'kept':>6}   after its end (ms) p50 / p95 / max")
    for text in PHRASES:
        ph = out["per_phrase"].get(text)
        if ph is None:
            continue
        a = ph["after_end_ms"]
        mark = "" if ph["meets_target"] else "   <- over 1 in 20"
        print(f"{text:<10}{ph['n']:>4}{ph['cancelled']:>8}{ph['paused_resumed']:>9}{ph['kept_talking']:>6}   "
              f"{a['p50']} / {a['p95']} / {a['max']}{mark}")
    a = out["after_end_ms"]
    print(f"{'all':<10}{out['backchannels']:>4}{out['cancelled']:>8}{'':>15}   {a['p50']} / {a['p95']} / {a['max']}")
    print("per voice: " + ", ".join(f"{v} {d['cancelled']}/{d['n']} cancelled" for v, d in out["per_voice"].items()))
    r = out["replayed_ms"]
    print(f"played again from the word's start: {out['replayed_nonzero']} of {r['n']} resumes "
          f"(p50 {r['p50']}, max {r['max']} ms)")
    for d in out["cancelled_detail"]:
        print(f"  cancelled: {d}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
