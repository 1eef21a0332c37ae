#!/usr/bin/env python3
"""End-of-turn judges over the labelled turn corpus (issue 31): which one
tells a finished request from a pause in the middle of one?

Every request of tests/turn_corpus.py (24 complete requests, 26 with a
400-800 ms pause mid-sentence, 12 one- or two-word answers, 12 sentences
trailed off; espeak-ng, three voices, two speeds) is judged as the session
would judge it, at a short silence after the speech stops:

- the ends of turns, which should be judged complete: each complete
  request, each one-word answer, each mid-pause request whole (its end);
- the pauses, which should be judged incomplete: each mid-pause request
  cut at its pause (the audio up to the pause, as the session has it when
  the pause begins); a "complete" here is a false cut-off;
- the trailing-off sentences, genuinely ambiguous (the caller stops and
  waits; an agent should answer, after the longer bound): reported apart,
  as the share judged complete.

The judges (candidates):

- ``silence``: every short silence ends the turn (the judge always says
  complete): today's fixed silence with a bound shorter than the pause;
- ``smart_turn@0ms`` / ``smart_turn@200ms``: Smart Turn v3.2
  (voice/end_of_turn.py, threshold 0.5) on the audio with no silence after
  the speech, and with 200 ms of digital silence appended (about when the
  session calls it: ``session.endpoint.tentative_ms``);
- ``text``: a cheap rule on the words heard up to the silence (here the
  exact texts, so an upper bound for a recogniser's): a request ending on a
  function word (:data:`FUNCTION_WORDS`: articles, prepositions,
  conjunctions, auxiliaries, subject pronouns, possessives, fillers; no
  content word) is incomplete;
- ``smart_turn@200ms+text``: complete only when both say so.

Figures per judge: the false cut-off rate (pauses judged complete), missed
ends (ends judged incomplete: of the complete requests, of the one-word
answers, of the mid-pause requests whole), accuracy on each side, trailing
judged complete; for Smart Turn its ROC AUC (ends against pauses, free of
any threshold); for Smart Turn also its inference time (features and
model, one onnxruntime thread) p50/p95, the model's load time (hash check,
onnxruntime session, feature extractor import) and the resident memory
the load and first inference added. Then Smart Turn's thresholds swept
(at 200 ms): what a stricter threshold buys in cut-offs and costs in ends.
Last, the session's rule (three bounds: audio and words complete, the
turn ends at the tentative end; the words finished but the audio not,
``session.endpoint.unsure_silence_ms``; the words unfinished, the longer
``incomplete_silence_ms``) swept over ``unsure_silence_ms``: a pause is
cut off when it lasts at least as long as the wait its first half gets.

Usage: python bench/end_of_turn.py [--quick] [--json]

``--quick``: 12 requests (three of each kind). A full run takes about
20 s (espeak-ng renders are cached; see tests/turn_corpus.py).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

import numpy as np  # noqa: E402
import turn_corpus as T  # noqa: E402  (the labelled turn corpus)
from bargein import stats  # noqa: E402  (min, p50, p95, max)

from voice.end_of_turn import MODEL_PACKAGE, MODEL_SHA256, SmartTurn, words_complete  # noqa: E402
from voice.endpointing import EndpointConfig  # noqa: E402

TENTATIVE_MS = 200
THRESHOLD = 0.5
SWEEP = (0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
#: the session's longer bound (``session.endpoint.incomplete_silence_ms``), ms
LONGER_MS = EndpointConfig().incomplete_silence_ms
#: ``session.endpoint.unsure_silence_ms`` values weighed (the last: one bound for every "incomplete")
UNSURE_SWEEP = (500, 600, 700, 800, 900, 1000, LONGER_MS)
JUDGES = ("silence", "smart_turn@0ms", "smart_turn@200ms", "text", "smart_turn@200ms+text")


def text_complete(words: str) -> bool:
    """The text rule (the product's, :func:`voice.end_of_turn.words_complete`)."""
    return words_complete(words)


def rss_mb() -> float:
    """This process's resident memory, MB (Linux /proc)."""
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


def cases(quick: bool) -> list[dict[str, Any]]:
    """What is judged: one row per (request, cut), with the audio at 16 kHz,
    the words heard up to that point and what a judge should say."""
    out: list[dict[str, Any]] = []
    for req in T.corpus(quick):
        r = T.render(req)
        if req.kind == "mid_pause":
            out.append({"name": req.name, "set": "pause", "want": False, "pcm": r.until(r.pauses[0][0]), "words": req.parts[0],
                        "pause_ms": round((r.pauses[0][1] - r.pauses[0][0]) * 1000)})
            out.append({"name": req.name, "set": "mid_pause whole", "want": True, "pcm": r.pcm, "words": req.text})
        else:
            group = {"complete": "complete", "one_word": "one_word", "trailing": "trailing"}[req.kind]
            out.append({"name": req.name, "set": group, "want": None if req.kind == "trailing" else True, "pcm": r.pcm,
                        "words": req.text})
    return out


def run(quick: bool) -> dict[str, Any]:
    rows = cases(quick)
    rss0 = rss_mb()
    judge = SmartTurn(threshold=THRESHOLD)
    started = time.perf_counter()
    judge.load()
    load_ms = (time.perf_counter() - started) * 1000
    judge.judge(bytes(3200))  # the first run allocates onnxruntime's buffers: counted in the memory, not the times
    rss_added = rss_mb() - rss0
    silence = bytes(16 * TENTATIVE_MS * 2)
    inference: dict[str, list[float]] = {"smart_turn@0ms": [], "smart_turn@200ms": []}
    for row in rows:
        v0 = judge.judge(row["pcm"])
        v200 = judge.judge(row["pcm"] + silence)
        inference["smart_turn@0ms"].append(v0.inference_ms)
        inference["smart_turn@200ms"].append(v200.inference_ms)
        row["p@0ms"], row["p@200ms"] = v0.probability, v200.probability
        row["text"] = text_complete(row["words"])
    verdicts: dict[str, Callable[[dict[str, Any]], bool]] = {
        "silence": lambda r: True,
        "smart_turn@0ms": lambda r: r["p@0ms"] > THRESHOLD,
        "smart_turn@200ms": lambda r: r["p@200ms"] > THRESHOLD,
        "text": lambda r: r["text"],
        "smart_turn@200ms+text": lambda r: r["p@200ms"] > THRESHOLD and r["text"],
    }
    judges = {name: score(rows, f) for name, f in verdicts.items()}
    for name, times in inference.items():
        judges[name]["inference_ms"] = stats(times)
    ends = [r for r in rows if r["want"] is True]
    pauses = [r for r in rows if r["want"] is False]
    auc = {f"smart_turn@{ms}ms": roc_auc([r[f"p@{ms}ms"] for r in ends], [r[f"p@{ms}ms"] for r in pauses]) for ms in (0, TENTATIVE_MS)}
    sweep = [{"threshold": t, **score(rows, lambda r, t=t: r["p@200ms"] > t)} for t in SWEEP]  # type: ignore[misc]
    bounds = [bound_figures(rows, ms) for ms in UNSURE_SWEEP]
    return {
        "corpus": {"requests": len(T.corpus(quick)), "quick": quick, "seed": T.SEED, "voices": list(T.VOICES), "wpm": list(T.SPEEDS),
                   "sets": {s: sum(r["set"] == s for r in rows) for s in SETS}},
        "model": {"package": MODEL_PACKAGE, "sha256": MODEL_SHA256, "threshold": THRESHOLD, "load_ms": round(load_ms, 1),
                  "rss_added_mb": round(rss_added, 1), "threads": 1},
        "tentative_ms": TENTATIVE_MS,
        "judges": judges,
        "smart_turn_auc": auc,
        "smart_turn_threshold_sweep": sweep,
        "unsure_bound_sweep": bounds,
        "cases": [{k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items() if k != "pcm"} for r in rows],
    }


def roc_auc(positive: list[float], negative: list[float]) -> float | None:
    """The share of (end, pause) pairs in which the end scores higher (ties
    count half): 1.0 separates them at some threshold, 0.5 is chance."""
    if not positive or not negative:
        return None
    p, n = np.asarray(positive)[:, None], np.asarray(negative)[None, :]
    return round(float(np.mean((p > n) + 0.5 * (p == n))), 3)


SETS = ("complete", "one_word", "mid_pause whole", "pause", "trailing")


def score(rows: list[dict[str, Any]], complete: Callable[[dict[str, Any]], bool]) -> dict[str, Any]:
    """A judge's figures: per set, the share judged complete; then the false
    cut-off rate (pauses judged complete), the missed ends (ends judged
    incomplete) and the accuracy on ends and on pauses."""
    judged = {s: [complete(r) for r in rows if r["set"] == s] for s in SETS}
    share = {s: (float(np.mean(v)) if v else None) for s, v in judged.items()}
    ends = judged["complete"] + judged["one_word"] + judged["mid_pause whole"]
    return {
        "judged_complete": share,
        "false_cutoffs": {"n": int(sum(judged["pause"])), "of": len(judged["pause"]), "rate": share["pause"]},
        "missed_ends": {"n": int(len(ends) - sum(ends)), "of": len(ends), "rate": (1 - float(np.mean(ends))) if ends else None,
                        "complete_requests": int(len(judged["complete"]) - sum(judged["complete"]))},
        "accuracy_ends": float(np.mean(ends)) if ends else None,
        "accuracy_pauses": (1 - share["pause"]) if share["pause"] is not None else None,
        "trailing_judged_complete": share["trailing"],
    }


def wait_ms(row: dict[str, Any], unsure_ms: int) -> int:
    """The silence the session waits after this row's speech before it
    ends the turn (:meth:`voice.turn_taking.TurnTaking.judged`): the
    tentative end when the audio (at 200 ms, :data:`THRESHOLD`) and the
    words both say complete; ``unsure_ms`` when only the words do; the
    longer bound when the words end unfinished, ms."""
    audio = row["p@200ms"] > THRESHOLD
    if row["text"]:
        return TENTATIVE_MS if audio else unsure_ms
    return LONGER_MS


def bound_figures(rows: list[dict[str, Any]], unsure_ms: int) -> dict[str, Any]:
    """The three-bound rule with ``unsure_silence_ms = unsure_ms``: false
    cut-offs (pauses at most as long as the wait: the turn ends in them)
    and the silence finished turns wait (min/p50/p95/max, ms; and how many
    wait each bound)."""
    pauses = [r for r in rows if r["set"] == "pause"]
    ends = [r for r in rows if r["want"] is True]
    longer = LONGER_MS
    waits = [wait_ms(r, unsure_ms) for r in ends]
    cut = sum(wait_ms(r, unsure_ms) <= r["pause_ms"] for r in pauses)
    return {"unsure_silence_ms": unsure_ms, "false_cutoffs": {"n": cut, "of": len(pauses)}, "ends_wait_ms": stats(waits),
            "ends_waiting": {"unsure": sum(w == unsure_ms for w in waits) if unsure_ms != longer else 0,
                             "incomplete": sum(w == longer for w in waits), "of": len(ends)}}


def _pct(x: float | None) -> str:
    return "-" if x is None else f"{100 * x:.0f}%"


def table(result: dict[str, Any]) -> str:
    """The figures as text tables."""
    head = ["judge", "false cut-offs", "missed ends", "ends: complete/one-word/mid whole", "acc. ends", "acc. pauses",
            "trailing complete", "inference p50/p95 ms"]
    rows = [head]
    for name, j in result["judges"].items():
        s = j["judged_complete"]
        inf = j.get("inference_ms")
        rows.append([name, f"{j['false_cutoffs']['n']}/{j['false_cutoffs']['of']} ({_pct(j['false_cutoffs']['rate'])})",
                     f"{j['missed_ends']['n']}/{j['missed_ends']['of']} ({_pct(j['missed_ends']['rate'])})",
                     f"{_pct(s['complete'])} / {_pct(s['one_word'])} / {_pct(s['mid_pause whole'])}",
                     _pct(j["accuracy_ends"]), _pct(j["accuracy_pauses"]), _pct(j["trailing_judged_complete"]),
                     f"{inf['p50']} / {inf['p95']}" if inf else "-"])
    sweep = [["threshold", "false cut-offs", "missed ends", "acc. ends", "acc. pauses", "trailing complete"]]
    for s in result["smart_turn_threshold_sweep"]:
        sweep.append([str(s["threshold"]), f"{s['false_cutoffs']['n']}/{s['false_cutoffs']['of']} ({_pct(s['false_cutoffs']['rate'])})",
                      f"{s['missed_ends']['n']}/{s['missed_ends']['of']} ({_pct(s['missed_ends']['rate'])})",
                      _pct(s["accuracy_ends"]), _pct(s["accuracy_pauses"]), _pct(s["trailing_judged_complete"])])
    bounds = [["unsure_silence_ms", "false cut-offs", "ends waiting it / the longer bound", "ends' wait p50 / p95 ms"]]
    for b in result["unsure_bound_sweep"]:
        w = b["ends_wait_ms"]
        bounds.append([str(b["unsure_silence_ms"]), f"{b['false_cutoffs']['n']}/{b['false_cutoffs']['of']}",
                       f"{b['ends_waiting']['unsure']} / {b['ends_waiting']['incomplete']} of {b['ends_waiting']['of']}",
                       f"{w['p50']} / {w['p95']}"])
    m, c = result["model"], result["corpus"]

    def fmt(t: list[list[str]]) -> list[str]:
        widths = [max(len(row[i]) for row in t) for i in range(len(t[0]))]
        return ["  ".join(cell.ljust(w) for cell, w in zip(row, widths, strict=True)) for row in t]

    judged = ", ".join(f"{k} {v}" for k, v in c["sets"].items())
    return "\n".join([
        f"corpus: {c['requests']} requests{' (quick)' if c['quick'] else ''}; judged: {judged}",
        f"Smart Turn v3.2 ({m['package']}, sha256 {m['sha256'][:16]}...): threshold {m['threshold']}, load {m['load_ms']} ms, "
        f"RSS added {m['rss_added_mb']} MB, {m['threads']} thread",
        "Smart Turn ROC AUC, ends against pauses (1 separates, 0.5 is chance): "
        + ", ".join(f"{k} {v}" for k, v in result["smart_turn_auc"].items()),
        "", *fmt(rows), "", f"Smart Turn at {result['tentative_ms']} ms of silence, by threshold:", *fmt(sweep),
        "", "The session's three bounds (audio and words complete: now; words only: unsure_silence_ms; words unfinished: "
        f"{LONGER_MS} ms), by unsure_silence_ms:", *fmt(bounds)])


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="12 requests (three of each kind) instead of the whole corpus")
    p.add_argument("--json", action="store_true", help="print one JSON object of the figures (with each case's probabilities)")
    args = p.parse_args()
    result = run(args.quick)
    print(json.dumps(result) if args.json else table(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
