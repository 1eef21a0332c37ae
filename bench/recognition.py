#!/usr/bin/env python3
"""Free-form speech recognition over a labelled corpus, through the product's
own path (issue 29).

For each recogniser named (a value of the server setting ``stt.provider``:
``whisper``, ``pocketsphinx``), a server is started on loopback with that
recogniser and no grammar (free-form recognition; the demo shop off and
replies cut to 3 words, so each call is short), and every utterance of the
corpus (tests/recognition_corpus.py: 22 shop requests, 14 backchannels, 24
short answers and numbers in three espeak-ng voices at two speeds, the 8
alsa-utils human recordings, and ``Noise.wav``) is said by a caller over a
WebRTC call of its own (client/call.py), so it is a user turn (the agent is
silent when it is said). What the server heard is read from the events the
call receives (the user turns' transcripts, joined) and scored against the
label with the corpus's word error rate (its normaliser: lower case, no
punctuation, digits as words, "ok" = okay, "mhm" = mm hmm; see
``recognition_corpus.readings``).

Figures per recogniser:

- word error rate over the speech (errors / reference words, summed over
  the corpus) and the utterances heard exactly;
- the same per category: requests, backchannels, short answers and
  numbers, the human recordings;
- words heard in the noise (insertions: should be 0);
- recognition time, ms: from the server's ``end_of_turn`` event to its
  ``transcript`` event of that turn (both stamped by the server), p50/p95;
- voice-to-voice, ms: the last sample of the utterance sent to the first
  sound of the reply at the client (client/call.py), p50/p95;
- utterances in which nothing was heard (no turn within 5 s), calls that
  failed, failovers (``stt.failover`` events: there should be none);
- the server's CPU (its process and its recogniser workers, from /proc)
  per utterance, ms, and its tree's resident memory at the end, MB.

``--concurrent N`` says N utterances at once, each in its own call (the
recognition time under load: N callers ending their requests together).

Usage: python bench/recognition.py [--stt whisper pocketsphinx] [--quick] [--concurrent N] [--json] [--logs DIR]

A full run is 69 calls of about 4 s per recogniser (some 5 minutes each on
2 cores); ``--quick`` says 12 utterances (4 requests, 3 backchannels, 3
short answers, 2 recordings). The exit status is 1 when a recogniser could
not be measured (its server did not start: e.g. it refused the setting).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import sys
import tempfile
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import recognition_corpus as R  # noqa: E402  (the labelled corpus and its word error rate)
from bargein import stats  # noqa: E402  (min, p50, p95, max)
from local_server import server, tree_usage  # noqa: E402  (its own process, free-form recognition)

from client.call import CallClient  # noqa: E402
from client.results import CallError, CallResult, Utterance  # noqa: E402
from media.frames import PLAYOUT_RATE, load_pcm  # noqa: E402

RECOGNISERS = ("whisper", "pocketsphinx")
#: the server's settings besides the recogniser: no tool time, replies of 3 words (a call waits for its reply to end)
SERVER_ENV = {"TURNKEEPER_DEMO_SHOP": "false", "TURNKEEPER_LLM__MAX_TOKENS": "3", "TURNKEEPER_LOG_LEVEL": "WARNING",
              "TURNKEEPER_MAX_PENDING_PER_CLIENT": "16"}  # --concurrent: all of a group's calls connect at once
TRAIL_MS = 300  # silence after each utterance, ms (the microphone then sends silence anyway)
CALL_TIMEOUT_S = 60.0
CATEGORY_NAMES = {"request": "requests", "backchannel": "backchannels", "short": "short answers/numbers", "human": "human (alsa)"}


def utterance_pcm(path: Path) -> bytes:
    """A corpus WAV as the caller's microphone says it: 48 kHz mono s16,
    followed by ``TRAIL_MS`` of silence."""
    return load_pcm(path, PLAYOUT_RATE) + bytes(PLAYOUT_RATE * TRAIL_MS // 1000 * 2)


def recognition_ms(events: list[dict[str, Any]]) -> float | None:
    """ms from the server's ``end_of_turn`` (a ``vad`` event) to the next
    user ``transcript`` event, by the server's own ``at`` stamps (None:
    no such pair)."""
    end_at = None
    for ev in events:
        if ev.get("type") == "vad" and ev.get("event") == "end_of_turn":
            end_at = ev.get("at")
        elif ev.get("type") == "transcript" and ev.get("role", "user") == "user" and end_at is not None and ev.get("at") is not None:
            return round((ev["at"] - end_at) * 1000, 1)
    return None


def heard(result: CallResult) -> str:
    """What the server heard in a call: its turns' transcripts in order, joined."""
    return " ".join(t.transcript for t in result.turns if t.transcript)


async def say(url: str, entry: R.Entry, pcm: bytes) -> dict[str, Any]:
    """Say ``pcm`` (48 kHz mono s16) in a call of its own; score what was heard.

    Returns:
        {name, category, label, heard (None: no turn), errors, words,
        recognition_ms, voice_to_voice_ms, failovers, error (a failed call), events}.
    """
    row: dict[str, Any] = {"name": entry.name, "category": entry.category, "label": entry.label, "heard": None,
                           "recognition_ms": None, "voice_to_voice_ms": None, "failovers": 0, "error": None, "events": []}
    try:
        result = await CallClient(url).run(Utterance(pcm, label=entry.name), timeout_s=CALL_TIMEOUT_S, settle_s=0.2)
    except CallError as exc:
        if "heard no speech" not in str(exc):  # client/call.py: no turn NO_SPEECH_S after the utterance
            row["error"] = str(exc)
    else:
        row.update(heard=heard(result), recognition_ms=recognition_ms(result.events), voice_to_voice_ms=result.voice_to_voice_ms,
                   failovers=sum(e.get("type") == "stt.failover" for e in result.events), events=result.events)
        if result.timed_out:
            row["error"] = f"the call did not end within {CALL_TIMEOUT_S:.0f} s"
    row["errors"], row["words"] = R.word_errors(entry.label, row["heard"])
    return row


def score(rows: list[dict[str, Any]]) -> dict[str, Any]:
    """Word error rate (None: no reference words), exact count and
    utterances of ``rows``."""
    words = sum(r["words"] for r in rows)
    return {"utterances": len(rows), "words": words, "word_error_rate": round(sum(r["errors"] for r in rows) / words, 4) if words else None,
            "exact": sum(r["errors"] == 0 for r in rows)}


def summarise(provider: str, rows: list[dict[str, Any]]) -> dict[str, Any]:
    """One recogniser's figures from its rows (see :func:`say`)."""
    speech = [r for r in rows if r["category"] != "non_speech"]
    noise = [r for r in rows if r["category"] == "non_speech"]
    return {
        "recogniser": provider,
        **score(speech),
        "categories": {c: score(of) for c in CATEGORY_NAMES if (of := [r for r in speech if r["category"] == c])},
        "non_speech": {"clips": len(noise), "words_heard": sum(r["errors"] for r in noise)},
        "recognition_ms": stats([r["recognition_ms"] for r in speech if r["recognition_ms"] is not None]),
        "voice_to_voice_ms": stats([r["voice_to_voice_ms"] for r in speech if r["voice_to_voice_ms"] is not None]),
        "nothing_heard": sum(r["heard"] is None and r["error"] is None for r in speech),
        "call_errors": sum(r["error"] is not None for r in rows),
        "failovers": sum(r["failovers"] for r in rows),
        "misheard": [{"name": r["name"], "said": r["label"], "heard": r["heard"]} for r in rows if r["errors"]],
    }


async def bench_one(provider: str, corpus: list[R.Entry], wavs: dict[str, Path], log_dir: Path, quiet: bool,
                    concurrent: int = 1) -> dict[str, Any]:
    """Start a server with ``provider`` and say each entry of ``corpus`` to
    it, ``concurrent`` calls at a time."""
    log_path = log_dir / f"server-{provider}.log"
    rows: list[dict[str, Any]] = []
    try:
        async with server(f"tk-bench-recognition-{provider}-", {**SERVER_ENV, "TURNKEEPER_STT__PROVIDER": provider},
                          log_path) as (url, proc):
            cpu0, _ = tree_usage(proc.pid)
            for start in range(0, len(corpus), concurrent):
                group = corpus[start : start + concurrent]
                for i, (entry, row) in enumerate(zip(group, await asyncio.gather(
                    *(say(url, e, utterance_pcm(wavs[e.name])) for e in group)
                ), strict=True), start + 1):
                    rows.append(row)
                    with (log_dir / f"calls-{provider}.jsonl").open("a") as f:
                        f.write(json.dumps(row) + "\n")
                    if not quiet:
                        print(f"  {provider} {i}/{len(corpus)} {entry.name}: said {entry.label!r} heard {row['heard']!r} "
                              f"({row['errors']} of {row['words']} wrong) recognition {row['recognition_ms']} ms"
                              + (f" ERROR {row['error']}" if row["error"] else ""), file=sys.stderr)
            cpu1, rss_mb = tree_usage(proc.pid)
    except RuntimeError as exc:  # the server did not start: e.g. it refused the setting
        tail = log_path.read_text(errors="replace").strip().splitlines()[-5:] if log_path.exists() else []
        return {"recogniser": provider, "error": f"{exc}: " + " | ".join(tail)}
    return {**summarise(provider, rows), "concurrent": concurrent,
            "server_cpu_ms_per_utterance": round(1000 * (cpu1 - cpu0) / max(1, len(rows)), 1), "server_rss_mb": round(rss_mb)}


async def run(args: argparse.Namespace) -> dict[str, Any]:
    corpus = R.quick() if args.quick else R.entries()
    with tempfile.TemporaryDirectory(prefix="tk-bench-recognition-") as tmp:
        log_dir = Path(args.logs) if args.logs else Path(tmp)
        log_dir.mkdir(parents=True, exist_ok=True)
        wavs = R.materialise(log_dir / "corpus", corpus)
        corpus = [e for e in corpus if e.name in wavs]  # a recording missing from this machine is left out
        out = [await bench_one(p, corpus, wavs, log_dir, args.json, args.concurrent) for p in args.stt]
    return {"corpus": {"utterances": len(corpus), "quick": args.quick, "seed": R.SEED},
            "server": {"demo_shop": False, "llm_max_tokens": 3, "grammar": None}, "recognisers": out}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.1f}%"


def table(result: dict[str, Any]) -> str:
    """The figures as a text table, then each recogniser's misheard utterances."""
    head = ["recogniser", "WER", "exact", *CATEGORY_NAMES.values(), "words in noise", "recognition p50/p95 ms", "v2v p50/p95 ms",
            "nothing heard", "call errors", "at once", "server CPU ms/utt", "server RSS MB"]
    rows, notes = [head], []
    for r in result["recognisers"]:
        if "error" in r:
            notes.append(f"{r['recogniser']}: not measured: {r['error']}")
            continue
        cats = [_pct(r["categories"][c]["word_error_rate"]) if c in r["categories"] else "-" for c in CATEGORY_NAMES]
        rec, v2v = r["recognition_ms"], r["voice_to_voice_ms"]
        rows.append([r["recogniser"], _pct(r["word_error_rate"]), f"{r['exact']} of {r['utterances']}", *cats,
                     f"{r['non_speech']['words_heard']} ({r['non_speech']['clips']} clips)", f"{rec['p50']} / {rec['p95']}",
                     f"{v2v['p50']} / {v2v['p95']}", str(r["nothing_heard"]), str(r["call_errors"]), str(r["concurrent"]),
                     str(r["server_cpu_ms_per_utterance"]), str(r["server_rss_mb"])])
        notes.append(f"{r['recogniser']} misheard ({len(r['misheard'])}):")
        notes += [f"  {m['name']}: said {m['said']!r}, heard {m['heard']!r}" for m in r["misheard"]]
    widths = [max(len(row[i]) for row in rows) for i in range(len(head))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths, strict=True)) for row in rows]
    return "\n".join([*lines, "", *notes])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--stt", nargs="+", default=list(RECOGNISERS), metavar="PROVIDER",
                   help="recognisers (values of stt.provider) to measure, in turn (default: whisper pocketsphinx)")
    p.add_argument("--quick", action="store_true", help="12 utterances instead of the whole corpus")
    p.add_argument("--concurrent", type=int, default=1, metavar="N", help="say N utterances at once, each in its own call")
    p.add_argument("--logs", help="keep the servers' logs, each call's row and events (calls-<provider>.jsonl) and the corpus WAVs here")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures (no progress lines)")
    args = p.parse_args()
    result = asyncio.run(run(args))
    print(json.dumps(result) if args.json else table(result))
    return 0 if all("error" not in r for r in result["recognisers"]) else 1


if __name__ == "__main__":
    sys.exit(main())
