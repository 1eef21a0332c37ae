#!/usr/bin/env python3
"""Soak bench: many calls in a row, one stimulus each, judged as the caller
hears it (issue 11.6).

    python bench/soak.py [--sessions 200] [--seed 1] [--min-at 1] [--max-at 6]
                         [--classes speech,backchannel,...] [--hangup-after 0.5]
                         [--transport webrtc|twilio|telnyx|device]
                         [--dump DIR] [--json]

Starts one turnkeeper server in its own process on loopback (embedded
defaults: SQLite store in a temporary directory, Whisper, espeak-ng,
the local agent) and makes N sequential calls with the headless aiortc
client (client/call.py). Recognition is free-form (Whisper hears "tell me
a story"; pocketsphinx without the tests' JSGF grammar did not, so the
agent never told the long reply a soak needs).

Each call asks for the story, then plays one stimulus at a random moment
(``--min-at`` to ``--max-at`` seconds after the agent's audio starts) while
the agent talks, and hangs up ``--hangup-after`` seconds after the stimulus
has been sent (the clips carry 1 s of trailing silence, so a verdict and a
resume have time to be heard), not waiting out the one-minute story.
Classes (round robin in a seeded random order): speech ("hey wait stop I
have a question" in espeak-ng's voices and speeds, and the alsa-utils human
recordings), backchannel, noise, cough, tone, click (the labelled corpus,
tests/corpus.py), and echo: a speakerphone call (the client plays the agent's
audio back into its microphone at -6 dB, 40 or 60 ms later) with nothing else
said; its whole reply is judged. The first call is the reference: the same
request with no stimulus (class ``none``).

Over the phone path (``--transport twilio`` or ``telnyx``: the phone
simulator, client/phone_call.py, 8 kHz mu-law both ways) and the device path
(``--transport device``: the simulated xiaozhi-esp32 in realtime mode,
client/device_call.py) the same calls are made and judged at the simulated
caller's ear or the device's speaker, as in bench/bargein.py. Neither
simulator has an echo path, so there the echo class is left out.

Each call is judged from the client's reception (tests/listening.py): the
silent runs of the received reply set against the reference's at the same
"sound time" (agent sound received so far), so the reply's own pauses are
not counted as gaps:

- kept talking: no inserted silence of 100 ms or more;
- paused and resumed: one or more (the gap lengths, p50 and max, are the
  longest inserted silence of each such call);
- stopped: the agent went silent and did not resume (or a newer turn
  superseded the reply); for speech, the audible stop is the client's
  measure (client/call.py): from the stimulus's first sample handed to the RTP
  sender to where the agent's sound ends at RTP arrival; also by the moment
  of the reply the speech began in, by half of the run (the server's age),
  and the five slowest calls;
- the silence after the stimulus's end, for a call where it paused the agent
  and the agent went on (a backchannel, a noise): from its last sample sent
  to the agent's sound arriving again.

Also reported: the request's transcript stability (share of calls whose
opening transcript equals the first call's, overall and per 50 calls), and
the server process's RSS (VmRSS) and open file descriptors at the start,
after 10 calls, every 50 and at the end (the recogniser's worker processes
are not included).

Time: about 9 s per call on the 2-core machine (most of it the random wait
before the stimulus), so the default 200 calls take about 30 minutes;
``--sessions 12`` about 2 minutes. Progress goes
to stderr; with ``--json``, stdout is one JSON object.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import corpus as C  # noqa: E402  (the tests' labelled corpus)
import listening as L  # noqa: E402  (the inserted-gap measure)
from bargein import BENCH_TOKEN, MOMENTS, make_client, stats, up  # noqa: E402
from local_server import server  # noqa: E402

from client.command import issue_device_token  # noqa: E402
from client.results import CallError, CallResult, Utterance  # noqa: E402
from media.frames import VAD_RATE  # noqa: E402

STORY = "tell me a story"
INTERRUPT = "hey wait stop I have a question"
CLASSES = ["speech", "backchannel", "noise", "cough", "tone", "click", "echo"]
CORPUS_LEAD_MS = 500  # the corpus embeds each non-speech clip after this much silence


@dataclass
class Stimulus:
    """One thing to play over the agent: ``pcm`` 48 kHz mono s16 (silence
    for the echo and reference calls), ``echo_delay_ms`` set for a
    speakerphone call."""

    cls: str
    label: str
    pcm: bytes
    echo_delay_ms: int | None = None


def stimuli() -> dict[str, list[Stimulus]]:
    """The clips per class (echo: one entry per echo delay)."""
    out: dict[str, list[Stimulus]] = {c: [] for c in CLASSES}
    for voice in C.VOICES:
        for wpm in C.SPEEDS:
            pcm, _ = C.embed(C.espeak(INTERRUPT, voice, wpm), 0, 1000)
            out["speech"].append(Stimulus("speech", f"hey-wait-{voice}-{wpm}", up(pcm)))
    lead = VAD_RATE * CORPUS_LEAD_MS // 1000 * 2
    for clip in C.speech_clips():
        if clip.name.startswith("alsa-"):
            out["speech"].append(Stimulus("speech", clip.name, up(clip.pcm[lead:])))
    for clip in C.backchannel_clips():
        out["backchannel"].append(Stimulus("backchannel", clip.name, up(clip.pcm[lead:])))
    for clip in C.nonspeech_clips():
        out[clip.label].append(Stimulus(clip.label, clip.name, up(clip.pcm[lead:])))
    silence = bytes(1920 * 50)  # 1 s: the echo goes on through it and the hang-up wait
    for delay in (40, 60):
        out["echo"].append(Stimulus("echo", f"speakerphone-{delay}ms", silence, echo_delay_ms=delay))
    return out


def proc_sample(pid: int, after: int) -> dict[str, Any]:
    """The server's memory and descriptors: VmRSS (kB) from /proc/PID/status
    and the count of /proc/PID/fd. Raises OSError if the process is gone."""
    rss = None
    with open(f"/proc/{pid}/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1])
    return {"after_sessions": after, "rss_kb": rss, "fds": len(os.listdir(f"/proc/{pid}/fd"))}


def progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


async def one_call(url: str, story: bytes, stim: Stimulus, at_s: float, hangup_after: float,
                   transport: str = "webrtc", device_token: str | None = None) -> CallResult:
    """Ask for the story over ``transport``, play ``stim`` ``at_s`` s after
    the agent starts talking, hang up ``hangup_after`` s after it was sent.

    Raises:
        CallError: the call failed (see :meth:`client.call.CallClient.run`).
    """
    echo = {} if stim.echo_delay_ms is None else {"echo_gain_db": -6.0, "echo_delay_ms": stim.echo_delay_ms}
    client = make_client(url, transport, device_token, **echo)
    kind = "speech" if stim.cls == "speech" else stim.cls
    return await client.run(
        Utterance(story, label="story"),
        [Utterance(stim.pcm, at_s=at_s, label=stim.label, kind=kind)],
        timeout_s=45,
        settle_s=0.2,
        hangup_after_s=hangup_after,
    )


async def run(args: argparse.Namespace) -> dict[str, Any]:
    rng = random.Random(args.seed)
    pool = stimuli()
    classes = [c for c in args.classes.split(",") if c and not (c == "echo" and args.transport != "webrtc")]
    unknown = set(classes) - set(pool) - {"none"}
    if unknown:
        raise SystemExit(f"unknown classes: {', '.join(sorted(unknown))} (known: {', '.join(CLASSES)}, none)")
    order: list[str] = []
    while len(order) < args.sessions - 1:
        block = classes[:]
        rng.shuffle(block)
        order.extend(block)
    order = order[: max(0, args.sessions - 1)]
    story_pcm, _ = C.embed(C.espeak(STORY, "en-us", 175), 0, 300)
    story = up(story_pcm)
    reference_stim = Stimulus("none", "reference", bytes(1920 * 5))
    sessions: list[dict[str, Any]] = []
    samples: list[dict[str, Any]] = []
    reference: list[L.Frame] | None = None
    first_transcript: str | None = None
    started = time.monotonic()
    env = {"TURNKEEPER_API_TOKENS": f"default:{BENCH_TOKEN}"} if args.transport != "webrtc" else None
    async with server("tk-soak-", env) as (url, proc):
        device_token = await issue_device_token(url, BENCH_TOKEN) if args.transport == "device" else None
        samples.append(proc_sample(proc.pid, 0))
        plan = [("none", reference_stim, args.max_at + 5.5), *[(c, None, None) for c in order]]
        for n, (cls, stim, at_s) in enumerate(plan, start=1):
            if stim is None:
                stim = rng.choice(pool[cls]) if cls != "none" else reference_stim
            if at_s is None:
                at_s = round(rng.uniform(args.min_at, args.max_at), 2)
            t0 = time.monotonic()
            row: dict[str, Any] = {"n": n, "class": cls, "label": stim.label, "at_s": at_s}
            try:
                result = await one_call(url, story, stim, at_s, args.hangup_after, args.transport, device_token)
            except CallError as exc:
                if n == 1:
                    raise RuntimeError(f"the reference call failed: {exc}") from exc
                row.update(outcome="error", error=str(exc))
                sessions.append(row)
                progress(f"  {n}/{len(plan)} {cls:<11} {stim.label:<26} error: {exc}")
                continue
            transcript = result.turns[0].transcript if result.turns else None
            if n == 1:
                if not (result.ok and any(lv > L.SILENCE_DBFS for _, lv, _ in result.received)):
                    raise RuntimeError(f"the reference call heard no reply (transcript {transcript!r})")
                first_transcript = transcript
                reference = list(result.received)
            row.update(session_id=result.session_id, transcript=transcript, ok=result.ok)
            m = result.barge_ins[0] if result.barge_ins else None
            heard = None
            if reference is not None and m is not None:
                [heard] = L.judge_call(result, reference, whole_reply=cls == "echo")
            if heard is None or m is None:
                row["outcome"] = "unjudged"  # no reference, or the stimulus was never played
            else:
                row.update(heard.as_dict())
                start = next((at for at, lv, _ in result.received if lv > L.SILENCE_DBFS), result.received[0][0])
                # where (s after the agent's first sound) and how long (ms) each inserted silence was, and the
                # server's pause verdicts as they arrived: to check the one against the other
                row["inserted_at"] = [
                    [round(g.run.start_at - start, 2), round(g.inserted_ms), g.reference_ms] for g in heard.gaps if g.inserted_ms >= 40
                ]
                row["pause_events"] = [
                    [round(at - start, 2), e["type"], e.get("paused_ms")]
                    for at, e in result.event_times
                    if e.get("type") in ("false_interruption", "backchannel", "barge_in")
                ]
                row.update(
                    outcome=m.outcome or "unjudged",
                    gap_ms=m.gap_ms,
                    stop_ms=None if m.stop_ms is None else round(m.stop_ms, 1),
                    speaking_at_onset=m.speaking_at_onset,
                    barged_in=m.barged_in,
                    server_resumed=m.resumed,
                    resumed_after_end_ms=m.resumed_after_end_ms,
                    onset_in_reply_s=None if m.into_reply_s is None else round(m.into_reply_s, 3),
                    server_paused_ms=[e.get("paused_ms") for e in result.events if e.get("type") in ("false_interruption", "backchannel")],
                )
            sessions.append(row)
            if args.dump is not None:
                args.dump.mkdir(parents=True, exist_ok=True)
                (args.dump / f"{n:04d}-{cls}.json").write_text(
                    json.dumps({**row, "received": result.received, "event_times": result.event_times})
                )
            progress(
                f"  {n}/{len(plan)} {cls:<11} {stim.label:<26} at {at_s:4.1f}s  {row['outcome']:<18}"
                f" gap {row.get('gap_ms', '-')!s:>6} ms  {time.monotonic() - t0:4.1f}s  {transcript!r}"
            )
            if n == 10 or n % 50 == 0:
                samples.append(proc_sample(proc.pid, n))
        if not samples or samples[-1]["after_sessions"] != len(plan):
            samples.append(proc_sample(proc.pid, len(plan)))
    return summarise(args, sessions, samples, first_transcript, time.monotonic() - started)


def summarise(
    args: argparse.Namespace, sessions: list[dict[str, Any]], samples: list[dict[str, Any]], first: str | None, seconds: float
) -> dict[str, Any]:
    """The figures: per class counts of each outcome, gap lengths (ms) of the
    paused-and-resumed calls, the audible stop (ms) of speech, transcript
    stability, server RSS/fds samples."""
    by_class: dict[str, dict[str, Any]] = {}
    for cls in dict.fromkeys(s["class"] for s in sessions):
        rows = [s for s in sessions if s["class"] == cls]
        judged = [s for s in rows if s["outcome"] in (L.KEPT, L.RESUMED, L.STOPPED)]
        resumed = [s for s in judged if s["outcome"] == L.RESUMED]
        gaps = [s["gap_ms"] for s in resumed]
        entry: dict[str, Any] = {
            "n": len(rows),
            "kept_talking": sum(s["outcome"] == L.KEPT for s in judged),
            "paused_and_resumed": len(resumed),
            "stopped": sum(s["outcome"] == L.STOPPED for s in judged),
            "unjudged": len(rows) - len(judged),
            "gap_ms": stats(gaps),
            # the longest inserted silence of every judged call, stopped or not
            "max_inserted_ms": max((s["gap_ms"] for s in judged if s["gap_ms"] is not None), default=None),
            "gaps_over_300ms": sum(g > 300 for g in gaps),
            "beyond_reference": sum(s.get("unjudged_runs", 0) > 0 for s in rows),
        }
        # the silence after the stimulus's own end, where it paused the agent and let it go on
        entry["resumed_after_end_ms"] = stats([s["resumed_after_end_ms"] for s in judged if s.get("resumed_after_end_ms") is not None])
        if cls == "speech":
            stops = [s for s in judged if s["outcome"] == L.STOPPED and s.get("speaking_at_onset") and s.get("stop_ms") is not None]
            entry["audible_stop_ms"] = stats([s["stop_ms"] for s in stops])
            entry["agent_silent_at_onset"] = sum(not s.get("speaking_at_onset") for s in judged)
            # where the tail comes from: the moment of the reply the speech began in, and the server's age
            entry["audible_stop_by_moment_ms"] = {
                name: stats([s["stop_ms"] for s in stops if s.get("onset_in_reply_s") is not None and lo <= s["onset_in_reply_s"] < hi])
                for name, lo, hi in MOMENTS
            }
            half = (len(sessions) + 1) // 2
            entry["audible_stop_by_sessions_ms"] = {
                f"sessions 1-{half}": stats([s["stop_ms"] for s in stops if s["n"] <= half]),
                f"sessions {half + 1}-{len(sessions)}": stats([s["stop_ms"] for s in stops if s["n"] > half]),
            }
            entry["slowest"] = sorted(
                ({"n": s["n"], "label": s["label"], "stop_ms": s["stop_ms"], "onset_in_reply_s": s.get("onset_in_reply_s")}
                 for s in stops), key=lambda r: -r["stop_ms"],
            )[:5]
        by_class[cls] = entry
    transcripts = [s.get("transcript") for s in sessions if s["outcome"] != "error"]
    blocks = []
    for i in range(0, len(transcripts), 50):
        chunk = transcripts[i : i + 50]
        blocks.append(round(sum(t == first for t in chunk) / len(chunk), 3))
    others: dict[str, int] = {}
    for t in transcripts:
        if t != first:
            others[str(t)] = others.get(str(t), 0) + 1
    return {
        "sessions": len(sessions),
        "transport": args.transport,
        "seconds": round(seconds, 1),
        "seed": args.seed,
        "at_s": [args.min_at, args.max_at],
        "hangup_after_s": args.hangup_after,
        "stt": "whisper (embedded default, free-form)",
        "classes": by_class,
        "transcript": {
            "first": first,
            "same_as_first": round(sum(t == first for t in transcripts) / len(transcripts), 3) if transcripts else None,
            "same_as_first_per_50": blocks,
            "others": others,
        },
        "server": samples,
        "errors": [s for s in sessions if s["outcome"] == "error"],
        "detail": sessions,
    }


def print_table(out: dict[str, Any]) -> None:
    print(f"{out['transport']}: {out['sessions']} sessions in {out['seconds']:.0f} s"
          f" (seed {out['seed']}, stimulus at {out['at_s'][0]}-{out['at_s'][1]} s)")
    head = f"{'class':<12}{'n':>4}{'kept':>6}{'paused':>8}{'stopped':>9}{'gap p50':>9}{'gap max':>9}{'>300ms':>8}{'max ins':>9}"
    print(head)
    for cls, e in out["classes"].items():
        g = e["gap_ms"]
        cell = lambda v: "-" if v is None else f"{v:.0f}"  # noqa: E731
        print(
            f"{cls:<12}{e['n']:>4}{e['kept_talking']:>6}{e['paused_and_resumed']:>8}{e['stopped']:>9}"
            f"{cell(g['p50']):>9}{cell(g['max']):>9}{e['gaps_over_300ms']:>8}{cell(e['max_inserted_ms']):>9}"
            + (f"   unjudged {e['unjudged']}" if e["unjudged"] else "")
            + (f"   beyond reference {e['beyond_reference']}" if e["beyond_reference"] else "")
        )
    for cls, e in out["classes"].items():
        a = e["resumed_after_end_ms"]
        if a["n"]:
            print(f"{cls}: silence after its end when the agent went on (ms): n {a['n']}  p50 {a['p50']}  p95 {a['p95']}  max {a['max']}")
    sp = out["classes"].get("speech")
    if sp:
        s = sp["audible_stop_ms"]
        print(f"speech audible stop (ms): n {s['n']}  min {s['min']}  p50 {s['p50']}  p95 {s['p95']}  max {s['max']}"
              f"   (agent already silent at onset: {sp['agent_silent_at_onset']})")
        for part in ("audible_stop_by_moment_ms", "audible_stop_by_sessions_ms"):
            for name, s in sp[part].items():
                print(f"  {name:<22} n {s['n']:>3}  p50 {s['p50']}  p95 {s['p95']}  max {s['max']}")
        print("  slowest: " + ", ".join(f"#{r['n']} {r['label']} {r['stop_ms']} ms at {r['onset_in_reply_s']} s" for r in sp["slowest"]))
    t = out["transcript"]
    print(f"request transcript: {t['first']!r}; same as the first session's: {t['same_as_first']} "
          f"(per 50: {t['same_as_first_per_50']})" + (f"; others: {t['others']}" if t["others"] else ""))
    print("server: " + "   ".join(f"after {s['after_sessions']}: RSS {s['rss_kb'] / 1024:.0f} MiB, {s['fds']} fds" for s in out["server"]))
    for e in out["errors"]:
        print(f"  error in session {e['n']} ({e['class']} {e['label']}): {e['error']}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--sessions", type=int, default=200, help="calls, the reference included (default 200)")
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--min-at", type=float, default=1.0, help="earliest stimulus, s after the agent's audio starts (default 1)")
    p.add_argument("--max-at", type=float, default=6.0, help="latest stimulus, s (default 6)")
    p.add_argument(
        "--hangup-after", type=float, default=0.5,
        help="hang up this long after the stimulus (with its 1 s of trailing silence) was sent, s (default 0.5)",
    )
    p.add_argument("--classes", default=",".join(CLASSES), help=f"comma-separated (default {','.join(CLASSES)}; also: none)")
    p.add_argument("--transport", choices=["webrtc", "twilio", "telnyx", "device"], default="webrtc",
                   help="WebRTC (aiortc), the phone simulator, or the device simulator (default webrtc)")
    p.add_argument("--dump", type=Path, help="write each call's reception (frames, events) to DIR/NNNN-class.json")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures on stdout")
    args = p.parse_args()
    if args.sessions < 1 or not 0 <= args.min_at <= args.max_at:
        p.error("need --sessions >= 1 and 0 <= --min-at <= --max-at")
    out = asyncio.run(run(args))
    if args.json:
        print(json.dumps(out))
    else:
        print_table(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
